"""Policy and allocator edges an earlier review noticed and left: a time model's ``capacity`` of the wrong length or
NaN, a model's ``max_batch`` of the wrong length, backup workers that drop every gradient, and one policy object reused
for a job whose iterations start again at 0."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from lbbsp import JobConfig, Report, Store
from lbbsp.allocation import LinearTime, allocate
from lbbsp.coordinator import checked_process_policy
from lbbsp.errors import ConfigError
from lbbsp.models import EWMAThroughput
from lbbsp.models.base import WorkerIds
from lbbsp.policies import BackupWorkersPolicy, LBBSPPolicy, LeaderStragglerPolicy, PerEpochPolicy, Policy
from test_policies_review import SPEEDS
from test_policies_review import _run as run_job


class OwnTime:
    """A time model of one's own whose ``capacity`` answers ``drop`` fewer workers, or NaN for worker 1."""

    def __init__(self, speed: np.ndarray, drop: int = 0, nan: bool = False) -> None:
        self.linear, self.drop, self.nan = LinearTime(speed), drop, nan

    def time(self, sizes: np.ndarray) -> np.ndarray:
        return self.linear.time(sizes)

    def capacity(self, deadline: float) -> np.ndarray:
        samples = self.linear.capacity(deadline)[:self.linear.speed.size - self.drop]
        if self.nan:
            samples[1] = np.nan
        return samples


class OwnTimeModel(EWMAThroughput):
    """EWMA whose time model is :class:`OwnTime` with the given slip."""

    def __init__(self, alpha: float = 0.3, drop: int = 0, nan: bool = False) -> None:
        super().__init__(alpha=alpha)
        self.drop, self.nan = drop, nan

    def time_model(self, workers: WorkerIds) -> OwnTime:
        return OwnTime(self.predict(workers), self.drop, self.nan)


class ShortCaps(EWMAThroughput):
    """EWMA with a memory cap for every worker but the last (a user's slip)."""

    def max_batch(self, workers: WorkerIds) -> np.ndarray:
        return np.full(len(workers) - 1, 300.0)


def _reports(job: str, k: int, sizes: np.ndarray) -> list[Report]:
    return [Report(job, w, k, int(s), float(s) / SPEEDS[w]) for w, s in enumerate(sizes)]


def test_a_capacity_of_the_wrong_length_is_named() -> None:
    """It failed deep in the search with numpy's 'operands could not be broadcast together with shapes (3,) (4,)'."""
    with pytest.raises(ConfigError, match=r"OwnTime.capacity returned 3 values for 4 workers: it must return one"):
        allocate(OwnTime(SPEEDS, drop=1), 800, [0] * 4, [800] * 4)  # type: ignore[arg-type]


def test_a_capacity_of_nan_is_named() -> None:
    """It was read as 'nothing more': worker 1 got its lower bound, (133, 0, 534, 133) for the balanced (100, 200, 400,
    100)."""
    with pytest.raises(ConfigError, match=r"OwnTime.capacity\(.*\) returned NaN for worker\(s\) \[1\]"):
        allocate(OwnTime(SPEEDS, nan=True), 800, [0] * 4, [800] * 4)  # type: ignore[arg-type]


def test_the_builtin_capacities_answer_no_nan() -> None:
    """0 x inf (a speed of 0 with an infinite overhead; an infinite speed at a deadline equal to its overhead) is
    LinearTime's 'nothing more', not the NaN the allocator now refuses."""
    model = LinearTime(np.array([0.0, np.inf, 1.0]), overhead=np.array([np.inf, 2.0, 0.0]))
    assert model.capacity(2.0).tolist() == [-1.0, -1.0, 2.0]
    assert allocate(model, 9, [0] * 3, [9] * 3).sum() == 9


@pytest.mark.parametrize(("make", "why"), [
    (lambda: LBBSPPolicy(OwnTimeModel(drop=1), hedge=None), "OwnTime.capacity returned 3 values for 4 workers"),
    (lambda: LBBSPPolicy(OwnTimeModel(nan=True), hedge=None), r"OwnTime.capacity\(.*\) returned NaN"),
    (lambda: LBBSPPolicy(ShortCaps()), "ShortCaps.max_batch returned 3 values for 4 workers"),
    (lambda: LeaderStragglerPolicy(model=ShortCaps()), "ShortCaps.max_batch returned 3 values for 4 workers"),
], ids=["capacity-length", "capacity-nan", "max-batch-length", "search-max-batch-length"])
def test_a_policy_names_the_model_that_answered_badly(make, why: str) -> None:  # type: ignore[no-untyped-def]
    """A policy's decision failed with numpy's broadcast error (or, for NaN, gave a poor split in silence)."""
    policy = make()
    policy.observe(_reports("p", 0, np.full(4, 200)))
    with pytest.raises(ConfigError, match=why):
        policy.decide(2, (200, 200, 200, 200), JobConfig("p", 4, 800))


def test_a_max_batch_of_one_cap_for_all_still_holds_every_worker() -> None:
    class OneCap(EWMAThroughput):
        def max_batch(self, workers: WorkerIds) -> np.ndarray:
            return np.array(250.0)

    policy = LBBSPPolicy(OneCap(), hedge=None)
    policy.observe(_reports("p", 0, np.full(4, 200)))
    assert max(policy.decide(2, (200, 200, 200, 200), JobConfig("p", 4, 800)).sizes) == 250


@pytest.fixture
def stores(redis_url: str, job: str) -> Iterator[list[Store]]:
    """Stores of three jobs."""
    with Store.from_url(redis_url, job) as one, Store.from_url(redis_url, f"{job}-b") as two, \
            Store.from_url(redis_url, f"{job}-c") as three:
        yield [one, two, three]
        for store in (one, two, three):
            store.forget()


def _run(store: Store, policy: Policy, iterations: int) -> tuple[list[tuple[int, ...]], list[str]]:
    """``iterations`` of a job of 4 workers at SPEEDS, as tests/test_policies_review.py runs one."""
    return run_job(store, JobConfig(store.job, 4, 800), policy, iterations)


def test_backup_workers_that_drop_every_gradient_are_refused_by_the_coordinator(stores: list[Store]) -> None:
    """Outside the simulator nothing asked: BackupWorkersPolicy(backups=4) on 4 workers wrote 'equal split (BSP)'.
    A coordinator now refuses it where it is made, and the policy where it is asked to decide."""
    with pytest.raises(ConfigError, match=r"backups must be in \[0, 4\), got 4"):
        BackupWorkersPolicy(backups=4).decide(2, (200, 200, 200, 200), JobConfig("p", 4, 800))
    with pytest.raises(ConfigError, match=r"backups must be in \[0, 4\), got 4"):
        _run(stores[0], BackupWorkersPolicy(backups=4), 1)
    with pytest.raises(ConfigError, match=r"backups must be in \[0, 4\), got 4"):
        checked_process_policy(BackupWorkersPolicy(backups=4), JobConfig("p", 4, 800))
    ran, _ = _run(stores[1], BackupWorkersPolicy(backups=3), 2)
    assert ran[1] == (200, 200, 200, 200)


@pytest.mark.parametrize("make", [lambda: LeaderStragglerPolicy(window=1), lambda: PerEpochPolicy(2)],
                         ids=["leader-straggler", "per-epoch"])
def test_a_policy_reused_for_a_job_that_starts_again_at_0_starts_afresh(stores: list[Store], make) -> None:  # type: ignore[no-untyped-def]
    """A second job (real coordinators, one policy object) runs as with a fresh policy. The search had kept only
    reports from the iteration of its last move (31) on, so the second job ran the initial split to its end; the
    per-epoch policy took the second job's first decision (iteration 2, an epoch's start) as within the epoch."""
    reused = make()
    _run(stores[0], reused, 30)
    again, _ = _run(stores[1], reused, 12)
    fresh, _ = _run(stores[2], make(), 12)
    assert again == fresh and fresh[2] != fresh[0], (again, fresh)
