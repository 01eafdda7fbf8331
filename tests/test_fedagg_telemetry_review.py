"""Review fixes: sample counts that are strings, a FedNova scale that is not a stretch, and two resource monitors in
one thread that shortened each other's CPU window."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import psutil
import pytest

from lbbsp import ResourceMonitor
from lbbsp.errors import LBBSPError
from lbbsp.fedagg import rescale_update, sample_weights


@pytest.mark.parametrize(("counts", "words"), [
    (["10", 5], r"sample count 0 .*'10' \(str\)"),  # np.asarray(..., dtype=float) read "10" as 10.0
    ([5, np.str_("10")], r"sample count 1 .*'10'.* \(str_\)"),
    ([5, b"10"], r"sample count 1 .*b'10' \(bytes\)"),
    ([3, None], r"sample count 1 .*None"),
])
def test_sample_counts_that_are_not_numbers_are_refused_by_index(counts: list[Any], words: str) -> None:
    with pytest.raises(LBBSPError, match=words):
        sample_weights(counts)


def test_numpy_counts_and_plain_numbers_still_weigh() -> None:
    np.testing.assert_allclose(sample_weights([np.int64(10), np.int32(30)]), [0.25, 0.75])
    np.testing.assert_allclose(sample_weights(np.array([1, 3], dtype=np.uint16)), [0.25, 0.75])
    np.testing.assert_allclose(sample_weights([2.5, np.float32(7.5)]), [0.25, 0.75])


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), -0.5, 0.0, "2", None, True,
                                   np.float64("nan")])
def test_a_scale_that_is_not_a_positive_finite_stretch_is_refused(scale: Any) -> None:
    """NaN spoilt the model silently, -0.5 reversed the update, 0 dropped it, True stretched by 1."""
    with pytest.raises(LBBSPError, match=r"scale must be a finite number > 0"):
        rescale_update([np.zeros(2)], [np.ones(2)], scale)


def test_a_numpy_scale_still_stretches() -> None:
    np.testing.assert_allclose(rescale_update([np.zeros(2)], [np.ones(2)], np.float32(1.5))[0], [1.5, 1.5])


def _busy_share(before: Any, after: Any) -> float:
    """The machine's busy share of CPU time between two psutil.cpu_times() readings, as psutil.cpu_percent counts
    it (idle and iowait are idle; guest time is already in user time)."""
    delta = {name: max(getattr(after, name) - getattr(before, name), 0.0) for name in before._fields}
    total = sum(delta.values()) - delta.get("guest", 0.0) - delta.get("guest_nice", 0.0)
    return 1.0 - (delta["idle"] + delta.get("iowait", 0.0)) / total


def _burn(cpu_s: float) -> None:
    """Busy-loop until this process has used ``cpu_s`` seconds of CPU (ticks, not a loop count: see test_telemetry)."""
    until = time.process_time() + cpu_s
    while time.process_time() < until:
        pass


def test_two_monitors_in_one_thread_each_measure_their_own_window() -> None:
    """B's window is idle then busy, A's busy then idle; each sample's cpu_util must match the machine's busy share
    over that monitor's own window. With one baseline per thread, A's second sample covered only the idle part after
    B's sample (about 0 on a quiet machine instead of about 0.3), and B's only the busy part after A's first."""
    a, b = ResourceMonitor(min_interval_s=0.0), ResourceMonitor(min_interval_s=0.0)
    b_start = psutil.cpu_times()
    time.sleep(0.3)
    a_start = psutil.cpu_times()
    a.sample()
    _burn(0.3)
    b_cpu = b.sample()["cpu_util"]
    b_end = psutil.cpu_times()
    time.sleep(0.3)
    a_cpu = a.sample()["cpu_util"]
    a_end = psutil.cpu_times()
    assert a_cpu == pytest.approx(_busy_share(a_start, a_end), abs=0.08)
    assert b_cpu == pytest.approx(_busy_share(b_start, b_end), abs=0.08)
