"""Capacity models as a data scientist or a long-running job uses them (the scikit-learn contract, large and
sparse worker ids, many workers): each test fails on the code before its fix."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from lbbsp.errors import ConfigError
from lbbsp.models import (
    AutoCapacityModel,
    BatchTimeCurve,
    EWMAThroughput,
    FLClientModel,
    LastValue,
    NARXThroughput,
    base,
    similar_hardware_prior,
)
from lbbsp.models.base import _number_hardware
from lbbsp.protocol import MAX_WORKERS, Report


def _reports(workers: range, iteration: int = 0) -> list[Report]:
    """One iteration of CPU workers on two kinds of host, each at its own speed."""
    return [Report("j", w, iteration, 64, 0.05 * (1 + w % 3), features={"cores": 4 + 4 * (w % 2)}) for w in workers]


def _reference_prior(values: dict[int, float], hardware: dict[int, tuple[str, int]], workers: list[int]) -> list[float]:
    """The prior as docs/models.md states it, one worker at a time: the median of the finite values of workers
    with the same hardware, else of the same device family, else of all workers."""
    known = {w: v for w, v in values.items() if np.isfinite(v)}
    out = []
    for worker in workers:
        key = hardware.get(worker)
        same = [v for w, v in known.items() if key is not None and hardware.get(w) == key]
        family = [v for w, v in known.items() if key is not None and (hardware.get(w) or ("",))[0] == key[0]]
        out.append(float(np.median(same or family or list(known.values()))))
    return out


def test_the_similar_hardware_prior_matches_its_definition_on_random_clusters() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        devices, cores = ["cpu", "cuda:a100", "cuda:v100"], [4, 8, 16]
        hardware = {int(w): (devices[int(rng.integers(3))], cores[int(rng.integers(3))])
                    for w in rng.choice(2 * n, size=int(rng.integers(0, 2 * n)), replace=False)}
        values = {int(w): float(rng.choice([np.nan, rng.uniform(1, 1000)], p=[0.2, 0.8])) for w in range(n)}
        if not any(np.isfinite(list(values.values()))):
            continue
        asked = [int(w) for w in rng.integers(0, 2 * n, size=int(rng.integers(0, 10)))]
        np.testing.assert_allclose(similar_hardware_prior(values, hardware, asked),
                                   _reference_prior(values, hardware, asked), rtol=1e-12)


@pytest.mark.parametrize("model", [EWMAThroughput(), FLClientModel()])
def test_a_worker_without_history_is_predicted_from_a_numbering_made_once(model: EWMAThroughput,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker with no history (one that joined, a federated client never asked) is predicted from the prior at
    every predict. A loop in Python over every worker with one had run at each (1.4 ms a predict at 1,024 workers,
    18-40 ms at 20,000); the workers' hardware is now numbered once, until a new worker's arrives, and the prior
    taken in array operations."""
    numbered = []

    def counted(keys: list[tuple[str, int] | None]) -> tuple[np.ndarray, np.ndarray]:
        numbered.append(len(keys))
        return _number_hardware(keys)

    monkeypatch.setattr(base, "_number_hardware", counted)
    n = 2_000
    model.partial_fit(_reports(range(n)))
    model.partial_fit([Report("j", n, 0, 0, 0.0, features={"cores": 8})])  # announced, nothing measured yet
    for _ in range(3):
        speeds = model.predict(np.arange(n + 2))
        # its hardware's median: the 8-core workers (odd ids) run at 64 / 0.05, 64 / 0.1 and 64 / 0.15 samples/s
        assert speeds[n] == pytest.approx(64 / 0.1)
        assert speeds[n + 1] == pytest.approx(float(np.median(speeds[:n])))  # no hardware known: everyone's median
    assert numbered == [n + 1]


@pytest.mark.parametrize("model", [LastValue(), NARXThroughput(), FLClientModel()])
def test_the_prior_follows_hardware_announced_after_a_prediction(model: LastValue) -> None:
    model.partial_fit(_reports(range(5)))
    assert model.predict([9]) == pytest.approx(64 / 0.1)  # nothing known of worker 9's hardware: everyone's median
    model.partial_fit([Report("j", 9, 1, 0, 0.0, features={"cores": 8})])
    assert model.predict([9]) == pytest.approx((64 / 0.1 + 64 / 0.05) / 2)  # the 8-core workers': 1 and 3
    model.fit([_reports(range(5))])  # forgets worker 9's hardware with the rest
    assert model.predict([9]) == pytest.approx(64 / 0.1)


@pytest.mark.parametrize("client", [MAX_WORKERS, 2**40])
def test_an_outcome_for_a_client_id_no_report_can_carry_is_refused_and_changes_nothing(client: int) -> None:
    """A Flower node id (a 64-bit number) passed as the client had made a table of that many rows: 8 GB and 22 s
    for 10**9, numpy's MemoryError naming no id for 2**40. Reports carry ids below MAX_WORKERS."""
    model = FLClientModel().partial_fit(_reports(range(3))).record_outcomes({0: True, 1: False})
    before = model.availability([0, 1, 2])
    with pytest.raises(ConfigError, match=rf"client ids in \[0, {MAX_WORKERS - 1}\] .* got {client}: number"):
        model.record_outcomes({2: True, client: False})
    np.testing.assert_array_equal(model.availability([0, 1, 2]), before)
    assert model.availability_.size == 2


@pytest.mark.parametrize("model", [EWMAThroughput(), NARXThroughput(), FLClientModel()])
def test_an_unsigned_id_above_the_int64_range_is_named_as_given(model: EWMAThroughput) -> None:
    """np.uint64(2**64 - 1) had been cast to -1 and refused as 'worker ids must be >= 0, got -1'."""
    model.partial_fit(_reports(range(2)))
    np.testing.assert_allclose(model.predict(np.array([0, 1], dtype=np.uint64)), model.predict([0, 1]))
    for ids in (np.array([1, 2**64 - 1], dtype=np.uint64), [2**63]):
        with pytest.raises(ConfigError, match=f"got {max(ids)}"):
            model.predict(ids)


def _history(iterations: int = 16, workers: int = 4) -> list[list[Report]]:
    """A small mixed history: CPU workers with a load feature, a GPU worker whose time is flat then linear in its
    size, speeds that drift, so that what a model keeps depends on every iteration it learnt."""
    rng = np.random.default_rng(3)
    out = []
    for k in range(iterations):
        reports = []
        for w in range(workers):
            samples = 24 + 8 * ((k + w) % 3)
            speed = (100.0 + 30 * w) * (1.0 + 0.3 * np.sin(k / 3 + w)) * rng.uniform(0.95, 1.05)
            gpu = w == workers - 1
            seconds = (0.02 + max(samples - 16, 0) / 400.0) if gpu else samples / speed
            features = {"gpu_mem_used": 1e9 + 5e6 * samples, "gpu_mem_free": 8e9} if gpu else {
                "cpu_util": 0.5 + 0.1 * np.sin(k + w), "colocated_load": 0.2 * (k % 4)}
            reports.append(Report("j", w, k, samples, seconds, features=features,
                                  device="cuda:0" if gpu else "cpu"))
        out.append(reports)
    return out


@pytest.mark.parametrize("build", [EWMAThroughput, LastValue, lambda: NARXThroughput(random_state=0),
                                   BatchTimeCurve, FLClientModel, AutoCapacityModel])
def test_reports_of_several_iterations_in_one_call_are_learnt_iteration_by_iteration(build: Callable[[], Any]) -> None:
    """partial_fit given three iterations at once had kept only each worker's last report (an EWMA predicted
    111.11 where feeding the iterations one by one gives 127.58): now it learns them in order, as fit replays a
    history, whichever order they come in."""
    history = _history()
    one_by_one, at_once, shuffled = build(), build(), build()
    for reports in history:
        one_by_one.partial_fit(reports)
    for start in range(0, len(history), 3):
        chunk = [r for reports in history[start:start + 3] for r in reports]
        at_once.partial_fit(chunk)
        shuffled.partial_fit(chunk[::-1])
    workers = [0, 1, 2, 3]
    expected = one_by_one.predict(workers)
    np.testing.assert_allclose(at_once.predict(workers), expected, rtol=1e-12)
    np.testing.assert_allclose(shuffled.predict(workers), expected, rtol=1e-12)


@pytest.mark.parametrize("features", [None, 5, True, (f for f in ["cpu_util"]), [["cpu_util"]]])
def test_narx_features_of_the_wrong_type_are_a_config_error_and_set_params_keeps_the_old(features: object) -> None:
    """features=None (or an int, a generator) was a bare TypeError from deep inside, and set_params left the bad
    value in a fitted model, which then failed at every partial_fit."""
    history = _history(6)
    with pytest.raises(ConfigError, match="features must be a list or tuple of report features"):
        NARXThroughput(features=features).partial_fit(history[0])
    model = NARXThroughput().fit(history[:5])
    with pytest.raises(ConfigError, match="features must be"):
        model.set_params(features=features)
    assert model.features == NARXThroughput().features
    model.partial_fit(history[5])  # still learns


@pytest.mark.parametrize(("params", "message"), [
    ({"hidden": (10**5, 10**5)}, r"hidden must be a tuple of 1 to 8 layer widths, each in \[1, 1024\]"),
    ({"hidden": (8,) * 9}, "hidden must be a tuple of 1 to 8"),
    ({"lags": 10**400}, r"lags must be an integer in \[1, 256\]"),
    ({"buffer_size": 10**400}, r"buffer_size x the input width \(lags \+ exog_lags x features: 12\)"),
    ({"buffer_size": 10**7}, "must be at most 67,108,864 values"),
])
def test_narx_sizes_past_what_memory_holds_are_refused_by_name(params: dict[str, Any], message: str) -> None:
    """hidden=(10**5, 10**5) was a MemoryError asking for 75 GiB, lags=10**400 numpy's 'maximum allowed dimension
    exceeded': neither named the parameter."""
    with pytest.raises(ConfigError, match=message):
        NARXThroughput(**params).partial_fit(_history(1)[0])


def test_an_auto_kind_that_is_not_a_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown worker kind: kinds\[0\] = \['gpu'\]; a worker kind is one of"):
        AutoCapacityModel(kinds={0: ["gpu"]}).partial_fit(_history(1)[0])  # was TypeError: unhashable type: 'list'


def test_fl_local_steps_past_a_million_are_refused_where_every_time_would_overflow() -> None:
    with pytest.raises(ConfigError, match=r"local_steps must be an integer in \[1, 1000000\]"):
        FLClientModel(local_steps=10**400).partial_fit(_history(1)[0])  # was an OverflowError at time_model
    assert FLClientModel(local_steps=10**6).partial_fit(_history(1)[0]).time_model([0]).time(np.array([4]))[0] > 0
