"""Single-process checks of the torch adapter's small parts (no process group needed)."""
from __future__ import annotations

from collections import namedtuple

import pytest

torch = pytest.importorskip("torch")

from lbbsp import ConfigError  # noqa: E402
from lbbsp.integrations.demo import DemoConfig, load_on, parse_schedule  # noqa: E402
from lbbsp.integrations.torch_data import PlannedBatch, _empty_like  # noqa: E402
from lbbsp.integrations.torch_grad import ComputeClock, check_weighting, scaled_loss  # noqa: E402


def test_planned_batch_yields_the_plan_once() -> None:
    plan = PlannedBatch()
    assert list(plan) == []
    plan.indices = [4, 2]
    assert list(plan) == [[4, 2]] and list(plan) == []


def test_empty_like_keeps_structure() -> None:
    Pair = namedtuple("Pair", "x y")
    batch = {"a": torch.ones(3, 2), "b": [torch.zeros(3), Pair(torch.ones(3), 7)]}
    empty = _empty_like(batch)
    assert empty["a"].shape == (0, 2) and empty["b"][0].shape == (0,)
    assert isinstance(empty["b"][1], Pair) and empty["b"][1].x.shape == (0,) and empty["b"][1].y == 7


def test_scaled_loss_weights_and_survives_an_empty_slice() -> None:
    w = torch.ones(2, requires_grad=True)
    assert scaled_loss((w * 2).mean(), 30, 120, 4).item() == pytest.approx(2.0)
    empty = torch.empty(0, 2) @ w
    loss = scaled_loss(empty.mean(), 0, 120, 4)  # the mean of nothing is NaN; its share must be zero
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(w.grad, torch.zeros(2))


def test_weighting_and_clock_validation() -> None:
    assert check_weighting("loss") == "loss"
    with pytest.raises(ConfigError):
        check_weighting("mean")
    clock = ComputeClock(torch.device("cpu"))
    clock.start()
    with pytest.raises(ConfigError):
        clock.seconds()
    clock.stop()
    assert clock.ready and clock.seconds() >= 0


def test_demo_flags_are_validated() -> None:
    assert parse_schedule("0-0.5, 0.75-1") == ((0.0, 0.5), (0.75, 1.0))
    assert load_on(((0.0, 0.5),), 10, 40) and not load_on(((0.0, 0.5),), 20, 40)
    for bad in ("0.5-0.2", "x", "0-2"):
        with pytest.raises(ConfigError):
            parse_schedule(bad)
    with pytest.raises(ConfigError):
        DemoConfig(workers=1)
    with pytest.raises(ConfigError):
        DemoConfig(slow_worker=2)
