"""FLClientModel: learns compute speed and transfer time per client; sizes batches with local steps fixed."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp.allocation import allocate
from lbbsp.errors import ConfigError
from lbbsp.models import FLClientModel, NotFittedError
from lbbsp.protocol import Report


def _round(speeds: list[float], transfers: list[float], batch: int, local_steps: int,
           rng: np.random.Generator | None = None) -> list[Report]:
    reports = []
    for worker, (speed, transfer) in enumerate(zip(speeds, transfers)):
        samples = local_steps * batch
        noise = 1.0 if rng is None else float(rng.normal(1.0, 0.02))
        reports.append(Report("fl", worker, 0, samples, samples / speed * noise,
                              features={"download_s": transfer / 2, "upload_s": transfer / 2}))
    return reports


def test_learns_speed_and_transfer_and_balances_rounds() -> None:
    speeds, transfers, local_steps = [100.0, 400.0, 50.0], [2.0, 0.5, 1.0], 5
    model = FLClientModel(local_steps=local_steps)
    rng = np.random.default_rng(0)
    for _ in range(20):
        model.partial_fit(_round(speeds, transfers, 32, local_steps, rng))
    np.testing.assert_allclose(model.predict([0, 1, 2]), speeds, rtol=0.05)
    np.testing.assert_allclose(model.transfer_s([0, 1, 2]), transfers, rtol=1e-9)
    sizes = allocate(model.time_model([0, 1, 2]), 300, [1] * 3, [300] * 3)
    round_s = np.array(transfers) + local_steps * sizes / np.array(speeds)
    assert sizes.sum() == 300
    assert round_s.max() / round_s.min() < 1.05  # every client finishes its round at about the same time


def test_transfer_from_bandwidth_and_model_bytes() -> None:
    model = FLClientModel(model_bytes=1e6)
    model.partial_fit([Report("fl", 0, 0, 10, 1.0, features={"bandwidth_down": 1e6, "bandwidth_up": 5e5})])
    assert model.transfer_s([0])[0] == pytest.approx(3.0)


def test_cold_start_uses_similar_hardware() -> None:
    model = FLClientModel()
    model.partial_fit([
        Report("fl", 0, 0, 10, 1.0, device="android", features={"cores": 8.0, "download_s": 1.0}),
        Report("fl", 1, 0, 10, 0.1, device="android", features={"cores": 8.0, "download_s": 1.0}),
        Report("fl", 2, 0, 10, 0.01, device="gpu-server", features={"cores": 64.0, "download_s": 0.1}),
        Report("fl", 3, 0, 0, 0.0, device="gpu-server", features={"cores": 64.0}),  # announces itself only
    ])
    speed = model.predict([3, 4])
    assert speed[0] == pytest.approx(1000.0)  # like the other gpu-server
    assert speed[1] == pytest.approx(np.median([10.0, 100.0, 1000.0]))  # nothing known: median of all
    sizes = allocate(model.time_model(range(5)), 100, [1] * 5, [100] * 5)
    assert sizes.sum() == 100 and (sizes >= 1).all()


def test_learns_availability_from_round_outcomes_with_a_hardware_prior() -> None:
    """A phone that completes 70% of its rounds is learned to about 0.7, a server that always completes to 1;
    a new phone starts from what phones do (and its first outcome is blended into that), and a client nobody
    knows anything about from 1."""
    model = FLClientModel(availability_alpha=0.05)
    model.partial_fit([Report("fl", 0, 0, 10, 1.0, device="android"), Report("fl", 1, 0, 10, 0.1, device="server"),
                       Report("fl", 2, 0, 0, 0.0, device="android")])  # 2 announces itself only
    assert model.availability([0, 1, 2, 9]).tolist() == [1.0, 1.0, 1.0, 1.0]  # nothing missed yet
    rng = np.random.default_rng(0)
    for _ in range(400):
        model.record_outcomes({0: bool(rng.random() < 0.7), 1: True})
    phone, server, new_phone, stranger = model.availability([0, 1, 2, 9])
    assert phone == pytest.approx(0.7, abs=0.1) and server == 1.0
    assert new_phone == phone  # the prior of similar hardware
    assert stranger == pytest.approx(np.median([phone, server]))  # unknown hardware: the median of all
    model.record_outcomes({2: False})  # the new phone's first miss lowers it from the phones' figure, not from 1
    assert model.availability([2])[0] == pytest.approx(0.95 * phone)
    unknown = model.availability([3])[0]  # no hardware known: the median of all clients
    model.record_outcomes({3: True})
    assert model.availability([3])[0] == pytest.approx(0.05 + 0.95 * unknown)
    model.fit([])  # forgets availability with everything else
    assert model.availability([0]).tolist() == [1.0]


def test_contract() -> None:
    with pytest.raises(NotFittedError):
        FLClientModel().predict([0])
    with pytest.raises(ConfigError):
        FLClientModel(local_steps=0).partial_fit([])
    with pytest.raises(ConfigError):
        FLClientModel(availability_alpha=0).record_outcomes({0: True})
    for model_bytes in (0.0, -1e6):  # would turn every bandwidth into no transfer at all, silently
        with pytest.raises(ConfigError, match="model_bytes"):
            FLClientModel(model_bytes=model_bytes).partial_fit([])
    model = FLClientModel(local_steps=3, alpha=0.2)
    assert type(model)(**model.get_params()).get_params() == model.get_params()
