"""What a decision keeps from the one before (the margins' hardware groups, the job's bounds, the last split, the
memory caps its bounds read) is renewed whenever what it was read from changes."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp.config import JobConfig
from lbbsp.hedging import ForecastRisk
from lbbsp.models import EWMAThroughput
from lbbsp.policies import LBBSPPolicy
from lbbsp.protocol import Report

WORKERS = np.arange(12)
FORECAST = np.linspace(100.0, 1200.0, 12)


def _cpu(worker: int, k: int, cores: int = 8, **features: float) -> Report:
    return Report("c", worker, k, 64, 64 / 500.0, features={"cores": cores, **features})


def _gpu(worker: int, k: int) -> Report:
    return Report("c", worker, k, 64, 0.05, device="cuda:0",
                  features={"cores": 8, "gpu_mem_used": 1e9 + 1e7 * worker, "gpu_mem_free": 7e10})


# each: the reports of iterations 0, 1, 2; the groups or kinds of workers 6-10 change at iteration 2 (worker 11, on
# other hardware from the start, sets how many workers there are)
CHANGES = {
    # workers 6-10 join on worker 11's hardware: ranked among its group, not left in the middle bucket as unknown
    "workers join": lambda k: [_cpu(w, k) for w in range(6)] + [
        _cpu(w, k, cores=16) for w in range(6, 12) if k == 2 or w == 11],
    # workers 6-11 announced themselves bare (a kind not known yet), then measure as federated clients
    "a group's kind is known": lambda k: [_cpu(w, k) for w in range(6)] + [
        Report("c", w, k, 0, 0.0, features={"cores": 4}) if k < 2 else
        Report("c", w, k, 64, 0.1, features={"cores": 4, "download_s": 1.0, "upload_s": 1.0}) for w in range(6, 12)],
    # GPU ranks 6-11 first timed on the CPU (their model's device not known yet), then on their GPUs: their model
    # moved, and they join the group of their hardware now, GPUs 0-5's
    "a worker's model moved": lambda k: [_gpu(w, k) for w in range(6)] + [
        _gpu(w, k) if k == 2 else _cpu(w, k) for w in range(6, 12)],
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_margins_rank_each_forecast_among_its_hardware_group_as_it_is_now(change: str) -> None:
    """A forecast recorded at every iteration (its workers' groups kept between them) is put in the bucket that
    one recorded once, at the end, puts it in: the groups kept are read again once a group or kind changes."""
    every, once = ForecastRisk(), ForecastRisk()
    for k in range(3):
        every.record(k, WORKERS, FORECAST)
        for risk in (every, once):
            risk.observe(CHANGES[change](k), defer=True)
            risk.finish_learning()
    every.record(3, WORKERS, FORECAST)
    once.record(3, WORKERS, FORECAST)
    assert every.forecasts_[3][2].tolist() == once.forecasts_[3][2].tolist()
    assert np.unique(every.forecasts_[3][2][6:]).size > 1  # workers 6-11 are ranked in their group


def test_the_margins_rank_the_workers_asked_for_when_they_change() -> None:
    """The groups kept are those of the workers recorded: another list of workers (or another order) is read
    afresh, each forecast ranked with its own worker."""
    risk = ForecastRisk()
    risk.observe([_cpu(w, 0, cores=8 + 8 * (w % 2)) for w in WORKERS.tolist()])
    risk.record(1, WORKERS, FORECAST)
    reverse = WORKERS[::-1]
    risk.record(2, reverse, FORECAST[::-1])
    risk.record(3, WORKERS[:6], FORECAST[:6])
    assert risk.forecasts_[2][2].tolist() == risk.forecasts_[1][2][::-1].tolist()
    fresh = ForecastRisk()
    fresh.observe([_cpu(w, 0, cores=8 + 8 * (w % 2)) for w in WORKERS.tolist()])
    fresh.record(3, WORKERS[:6], FORECAST[:6])
    assert risk.forecasts_[3][2].tolist() == fresh.forecasts_[3][2].tolist()


def _policy(speeds: tuple[float, ...] = (100.0, 200.0, 300.0, 400.0), **kwargs: object) -> LBBSPPolicy:
    policy = LBBSPPolicy(EWMAThroughput(), hedge=None, **kwargs)
    policy.observe([Report("c", w, 0, 25, 25 / speed) for w, speed in enumerate(speeds)])
    return policy


def test_new_job_bounds_bound_the_next_split() -> None:
    """The job's bounds are kept between decisions while the job is the same: a config with another max_batch,
    min_batch, global batch or number of workers bounds the very next split."""
    policy = _policy()
    assert max(policy.decide(2, (25, 25, 25, 25), JobConfig("c", 4, 100)).sizes) > 30
    assert policy.decide(3, (25, 25, 25, 25), JobConfig("c", 4, 100, min_batch=20)).sizes == (20, 20, 26, 34)
    assert max(policy.decide(4, (25, 25, 25, 25), JobConfig("c", 4, 100, max_batch=30)).sizes) == 30
    caps = (40, 20, 20, 30)
    assert policy.decide(5, (25, 25, 25, 25), JobConfig("c", 4, 100, max_batch=caps)).sizes[1:] == (20, 20, 30)
    assert sum(policy.decide(6, (30, 30, 30, 30), JobConfig("c", 4, 120, max_batch=(40, 20, 20, 40))).sizes) == 120
    pair = _policy((100.0, 400.0))  # without max_batch, the global batch is every worker's upper bound
    assert pair.decide(2, (50, 50), JobConfig("c", 2, 100)).sizes == (20, 80)
    assert pair.decide(3, (200, 200), JobConfig("c", 2, 400)).sizes == (80, 320)
    assert sum(pair.decide(4, (100, 100, 200), JobConfig("c", 3, 400)).sizes) == 400  # a worker joined


class _BoundsOnce(LBBSPPolicy):
    """A variant that, in its first decision only, holds worker 0 to 1 sample and worker 1 to at least 40, changing
    the bounds LB-BSP's own bounds return in place."""

    def bounds(self, workers, current, config):
        lower, upper = super().bounds(workers, current, config)
        if not getattr(self, "once", False):
            self.once = True
            upper[0], lower[1] = 1, 40
        return lower, upper


def test_bounds_a_variant_changes_in_place_are_the_job_s_again_in_the_next_decision() -> None:
    """The job's bounds kept between decisions are not those handed out: a variant may change these in place."""
    policy = _BoundsOnce(EWMAThroughput(), hedge=None)
    policy.observe([Report("c", w, 0, 25, 25 / speed) for w, speed in enumerate((400.0, 100.0, 300.0, 200.0))])
    config = JobConfig("c", 4, 100)
    first = policy.decide(2, (1, 40, 30, 29), config)
    assert first.sizes[0] == 1 and first.sizes[1] >= 40
    assert policy.decide(3, first.sizes, config).sizes == (40, 10, 30, 20)


def test_the_split_kept_is_the_one_given_not_the_last_decided() -> None:
    """The last split decided is kept as an array for the next decision, whose ``current`` it usually is; another
    split in force (a fallback, another coordinator's) is the one the next decision keeps."""
    policy = _policy((100.0, 110.0, 120.0, 130.0), deadband=0.99)  # every split within bounds is kept
    first = policy.decide(2, (25, 25, 25, 25), JobConfig("c", 4, 100))
    assert first.sizes == (25, 25, 25, 25)
    assert policy.decide(3, first.sizes, JobConfig("c", 4, 100)).sizes == first.sizes
    assert policy.decide(4, (10, 20, 30, 40), JobConfig("c", 4, 100)).sizes == (10, 20, 30, 40)
    assert policy.decide(5, [40, 30, 20, 10], JobConfig("c", 4, 100)).sizes == (40, 30, 20, 10)


class _Caps(EWMAThroughput):
    """EWMA speeds with memory caps that the test sets."""

    def __init__(self, caps: tuple[float, ...] = ()) -> None:
        super().__init__()
        self.caps = caps

    def max_batch(self, workers):
        return np.asarray(self.caps, dtype=float)


class _JobBoundsOnly(LBBSPPolicy):
    """A variant whose bounds are the job's alone: it reads no memory caps itself."""

    def bounds(self, workers, current, config):
        return tuple(np.asarray(b, dtype=np.int64) for b in config.bounds())


class _RaisedInPlace(LBBSPPolicy):
    """A variant that raises the bounds LB-BSP's own bounds return, in place, to the job's global batch (over the
    job's ``max_batch``)."""

    def bounds(self, workers, current, config):
        lower, upper = super().bounds(workers, current, config)
        upper[:] = config.global_batch
        return lower, upper


def _over(decision, caps: tuple[float, ...]) -> None:
    """The reason names the workers given more than ``caps`` (none over a NaN cap: unknown), or no cap at all."""
    over = [w for w, (size, cap) in enumerate(zip(decision.sizes, caps)) if size > cap]
    assert f"over the memory cap of worker(s) {over}" in decision.reason if over else "cap" not in decision.reason


@pytest.mark.parametrize("policy_class", [LBBSPPolicy, _JobBoundsOnly, _RaisedInPlace])
def test_the_reason_names_the_workers_over_the_memory_caps_of_this_decision(policy_class: type) -> None:
    """The caps a decision's bounds read are those its reason checks the split against (the model is not asked
    again); caps that changed since the last decision, and caps a variant's bounds did not read, are asked of the
    model: the reason names the workers over the caps of this decision."""
    model = _Caps((20.0, 20.0, 20.0, 20.0))  # they hold 80 of 100 samples: set aside
    policy = policy_class(model, hedge=None)
    policy.observe([Report("c", w, 0, 25, 25 / speed) for w, speed in enumerate((100.0, 200.0, 300.0, 400.0))])
    config = JobConfig("c", 4, 100)
    decision = policy.decide(2, (25, 25, 25, 25), config)
    assert "over the memory cap of worker(s)" in decision.reason
    _over(decision, model.caps)
    for k, caps in enumerate([(30.0, 10.0, np.nan, 40.0), (100.0, 100.0, 100.0, 100.0), (20.0, 20.0, 20.0, 20.0)]):
        model.caps = caps
        decision = policy.decide(3 + k, decision.sizes, config)
        _over(decision, caps)
    # caps unknown (NaN), under max_batch 30: the job's bounds; a variant's over them are not the memory's
    model.caps = (np.nan,) * 4
    decision = policy.decide(6, (25, 25, 25, 25), JobConfig("c", 4, 100, max_batch=30))
    assert max(decision.sizes) > 30 if policy_class is _RaisedInPlace else max(decision.sizes) == 30
    assert "cap" not in decision.reason
