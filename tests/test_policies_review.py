"""Peer policies at the edges a job meets, driven as a job drives them: reports posted to a real Redis, a real
Coordinator deciding and writing each split."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest

from lbbsp import Assignment, Coordinator, JobConfig, Report, Store
from lbbsp.models import EWMAThroughput
from lbbsp.policies import LeaderStragglerPolicy, Policy, StaticProportionalPolicy

SPEEDS = np.array([100.0, 200.0, 400.0, 100.0])  # samples/s; the balanced split of 800 is 100, 200, 400, 100

#: How a worker reports iteration k at its size: (samples, compute_s), by default what it ran at SPEEDS.
Measure = Callable[[int, int, int], tuple[int, float]]


def _measured(k: int, worker: int, size: int) -> tuple[int, float]:
    return size, size / SPEEDS[worker]


@pytest.fixture
def store(redis_url: str, job: str) -> Iterator[Store]:
    with Store.from_url(redis_url, job) as store:
        yield store
        store.forget()


def _run(store: Store, config: JobConfig, policy: Policy, iterations: int,
         measure: Measure = _measured) -> tuple[list[tuple[int, ...]], list[str]]:
    """Run ``iterations`` iterations of a job: each worker reports its iteration as ``measure`` says, and the
    coordinator decides from them; the sizes each iteration ran with (read back from Redis), and the reasons."""
    coordinator = Coordinator(store, config, policy, max_ahead=1)
    for k in range(config.lag):
        store.publish(config.initial_assignment(k))
    ran: list[tuple[int, ...]] = []
    reasons: list[str] = []
    for k in range(iterations):
        raw = store.get_assignment(k)
        assert raw is not None
        sizes = Assignment.from_json(raw, job=config.job).sizes
        ran.append(sizes)
        reports: Sequence[Report] = [Report(config.job, w, k, *measure(k, w, size)) for w, size in enumerate(sizes)]
        store.post_reports(reports, config.num_workers)
        reasons.append(coordinator.decide(k).assignment.reason)
    assert coordinator.failed_decisions == 0
    return ran, reasons


def test_leader_straggler_takes_a_report_that_measured_nothing_for_no_time(store: Store, job: str) -> None:
    """compute_s = 0 is the protocol's "nothing measured", as every model reads it; the search read it as a step
    of 0 s, so worker 3, which never timed its steps, was the leader at every window: it took 797 of 800 samples
    and ran 2.7x the balanced iteration. A worker that measured nothing keeps its size, as one that sent nothing."""
    def untimed(k: int, worker: int, size: int) -> tuple[int, float]:
        return (size, 0.0) if worker == 3 else _measured(k, worker, size)

    ran, _ = _run(store, JobConfig(job, 4, 800), LeaderStragglerPolicy(window=1), 60, untimed)
    assert ran[-1][3] == 200, ran[-1]
    times = np.array(ran[-1][:3]) / SPEEDS[:3]
    assert times.max() < 1.1 * times.min(), ran[-1]  # the others are balanced among themselves


def test_leader_straggler_does_not_move_samples_on_announcements(store: Store, job: str) -> None:
    """Workers that announce themselves (samples = 0, nothing measured) for the first iterations: the search had
    moved 50 samples from worker 0 to worker 1 on those announcements alone, every time read as 0 s."""
    def announcing(k: int, worker: int, size: int) -> tuple[int, float]:
        return (0, 0.0) if k < 3 else _measured(k, worker, size)

    ran, reasons = _run(store, JobConfig(job, 4, 800), LeaderStragglerPolicy(window=1), 6, announcing)
    assert ran[:5] == [(200, 200, 200, 200)] * 5, ran  # the reports of 0, 1 and 2 decide iterations 2, 3 and 4
    assert reasons[:3] == ["observing"] * 3, reasons
    assert ran[5] == (150, 200, 250, 200), ran  # the first measurement moves from the straggler to the leader


def test_leader_straggler_searches_where_the_memory_caps_cannot_hold_the_global_batch(store: Store, job: str) -> None:
    """Memory caps that hold 790 of a global batch of 800: the search had found workers 0 and 3 over their caps,
    no room for both excesses, and kept the equal split for good (2.0 s an iteration; LB-BSP 1.5 s). As LB-BSP's
    bounds do, caps that cannot hold the batch never shrink a worker below its size in force: the search goes on."""
    class Capped(EWMAThroughput):
        def max_batch(self, workers: Sequence[int] | np.ndarray) -> np.ndarray:
            return np.array([150.0, 200.0, 300.0, 140.0])[np.asarray(workers)]

    ran, reasons = _run(store, JobConfig(job, 4, 800), LeaderStragglerPolicy(window=1, model=Capped()), 60)
    times = np.array(ran[-1]) / SPEEDS
    assert times.max() <= 1.5, (ran[-1], reasons[-1])
    assert ran[-1][1] <= 200 and ran[-1][2] <= 300  # the workers with room are kept within their caps


def test_static_proportional_profiles_measurements_not_announcements(store: Store, job: str) -> None:
    """Workers that announce themselves (samples = 0, nothing measured) for the first three iterations: those had
    counted as the three profiled, and the equal split, from no measurement at all, was fixed for good as
    "proportional to the speeds profiled" (2x the balanced iteration here)."""
    def announcing(k: int, worker: int, size: int) -> tuple[int, float]:
        return (0, 0.0) if k < 3 else _measured(k, worker, size)

    ran, reasons = _run(store, JobConfig(job, 4, 800), StaticProportionalPolicy(), 12, announcing)
    assert ran[-1] == (100, 200, 400, 100), (ran, reasons)
