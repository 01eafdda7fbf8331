"""Risk-aware allocation: margins learned from forecast misses, per hardware kind, load and rank, applied to any time
model; the quantile and the typical miss as defined, a worker's kind followed when it is pinned or moves, and a
state that stays bounded over a long run."""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pytest

from lbbsp import JobConfig, LBBSPPolicy, Report
from lbbsp.allocation import HingeTime, LinearTime, allocate
from lbbsp.errors import ConfigError
from lbbsp.hedging import _REACH, ForecastRisk, HedgedTime, hedged, sized_throughput
from lbbsp.models import KINDS, AutoCapacityModel, EWMAThroughput
from lbbsp.models.auto import MixedTime
from test_models_auto import _cpu

SPEEDS = np.linspace(100.0, 1200.0, 12)  # one hardware group; the fastest third is the "fast" bucket


def _reports(k: int, sizes: np.ndarray, speeds: np.ndarray, job: str = "h") -> list[Report]:
    return [Report(job, i, k, int(s), float(s / v)) for i, (s, v) in enumerate(zip(sizes, speeds))]


def _learn(risk: ForecastRisk, iterations: int, actual) -> None:
    """Forecast SPEEDS every iteration; the reports then measure ``actual(k)``."""
    workers = np.arange(SPEEDS.size)
    for k in range(iterations):
        risk.record(k, workers, SPEEDS)
        risk.observe(_reports(k, np.full(SPEEDS.size, 64), actual(k)))


def test_fast_forecasts_that_sometimes_slow_down_get_the_larger_margin() -> None:
    rng = np.random.default_rng(0)

    def actual(k: int) -> np.ndarray:
        speed = SPEEDS * rng.lognormal(0.0, 0.05, SPEEDS.size)
        slowed = rng.random(SPEEDS.size) < 0.2
        speed[8:] = np.where(slowed[8:], speed[8:] / 3, speed[8:])  # the fast third turns 3x slower at times
        return speed

    risk = ForecastRisk(hedge=1.0)
    _learn(risk, 60, actual)
    risk.record(60, np.arange(12), SPEEDS)
    factor = risk.factors(60)
    assert factor[8:].min() > 2.0 and factor[:4].max() < 1.2
    assert np.unique(factor[:4]).size == 1 and np.unique(factor[8:]).size == 1  # one factor per bucket


def test_free_machines_that_sometimes_get_co_located_load_get_the_larger_margin() -> None:
    rng = np.random.default_rng(4)
    load = np.tile([0.0, 0.5], 6)  # even workers run alone, odd ones share their machine (ranks interleave)
    risk = ForecastRisk(hedge=1.0)
    workers = np.arange(12)
    for k in range(60):
        risk.record(k, workers, SPEEDS)
        speed = SPEEDS * rng.lognormal(0.0, 0.05, 12)
        speed[::2] /= np.where(rng.random(6) < 0.2, 3.0, 1.0)  # a job arrives on a free machine at times
        speed[1::2] *= np.where(rng.random(6) < 0.2, 2.0, 1.0)  # and leaves a shared one
        risk.observe([Report("h", i, k, 64, 64 / v, features={"colocated_load": float(c)})
                      for i, (v, c) in enumerate(zip(speed, load))])
    risk.record(60, workers, SPEEDS)
    factor = risk.factors(60)
    assert factor[::2].min() > 2.0 and factor[1::2].max() < 1.2


def test_cold_start_is_plain_lbbsp() -> None:
    config = JobConfig("h", 12, 1200)
    plain, hedging = LBBSPPolicy(EWMAThroughput(), hedge=None), LBBSPPolicy(EWMAThroughput(), hedge=3.0)
    rng = np.random.default_rng(1)
    sizes = np.asarray(config.initial_sizes())
    for k in range(3):  # 36 slowdowns: under min_samples in every bucket
        reports = _reports(k, sizes, SPEEDS * rng.lognormal(0.0, 0.3, 12))
        plain.observe(reports)
        hedging.observe(reports)
        a, b = (p.decide(k + 1, tuple(sizes.tolist()), config) for p in (plain, hedging))
        assert a.sizes == b.sizes and a.predicted_s == b.predicted_s
        assert (hedging.risk.factors(k + 1) == 1.0).all()
        sizes = np.asarray(a.sizes)


class _CappedEWMA(EWMAThroughput):
    """EWMA speeds with a fixed per-worker memory cap, as a GPU model would report."""

    def max_batch(self, workers):
        return np.full(len(workers), 150, dtype=np.int64)


def test_hedged_split_sums_to_b_within_bounds_and_memory_caps() -> None:
    config = JobConfig("h", 12, 1200, min_batch=20)
    policy = LBBSPPolicy(_CappedEWMA(), hedge=2.0)
    rng = np.random.default_rng(2)
    sizes = np.asarray(config.initial_sizes())
    reasons = []
    for k in range(40):
        speed = SPEEDS * rng.lognormal(0.0, 0.05, 12)
        speed[8:] /= np.where(rng.random(4) < 0.3, 3.0, 1.0)
        policy.observe(_reports(k, sizes, speed))
        decision = policy.decide(k + 1, tuple(sizes.tolist()), config)
        sizes = np.asarray(decision.sizes)
        assert sizes.sum() == 1200 and (sizes >= 20).all() and (sizes <= 150).all()
        assert np.allclose(decision.predicted_s, sizes / policy.model.predict(range(12)))  # without margins
        reasons.append(decision.reason)
    assert any("slowdown margins" in r for r in reasons)


def test_symmetric_errors_leave_the_split_about_proportional() -> None:
    config = JobConfig("h", 12, 12 * 400)
    policy = LBBSPPolicy(EWMAThroughput(alpha=0.2), hedge=3.0)
    rng = np.random.default_rng(3)
    sizes = np.asarray(config.initial_sizes())
    for k in range(80):
        policy.observe(_reports(k, sizes, SPEEDS * rng.lognormal(0.0, 0.1, 12)))
        sizes = np.asarray(policy.decide(k + 1, tuple(sizes.tolist()), config).sizes)
    assert (policy.risk.pooled_[:policy.risk.buckets] >= policy.risk.min_samples).all()  # no co-located load
    proportional = config.global_batch * SPEEDS / SPEEDS.sum()
    assert np.abs(sizes / proportional - 1).max() < 0.15


def test_bad_and_missing_reports_do_not_crash() -> None:
    risk = ForecastRisk(hedge=1.0, min_samples=1)
    risk.observe([])
    forecast = SPEEDS.copy()
    forecast[3] = np.nan  # a worker with no forecast sits in the middle bucket and is not learned from
    risk.record(0, np.arange(12), forecast)
    reports = _reports(0, np.full(12, 64), SPEEDS)[:6]  # half the workers missing
    reports.append(Report("h", 7, 0, 0, 0.0))  # measured nothing
    reports.append(Report("h", 40, 0, 64, 0.1))  # a worker that had no forecast
    reports.append(Report("h", 2, 99, 64, 0.1))  # an iteration never forecast
    risk.observe(reports)
    assert risk.pooled_.sum() == 5  # workers 0-5 without worker 3
    assert np.isfinite(risk.factors(0)).all() and (risk.factors(0) > 0).all()
    with pytest.raises(ConfigError):
        ForecastRisk(hedge=0)


@pytest.mark.parametrize("params", [{"hedge": "2"}, {"hedge": float("inf")}, {"hedge": float("nan")},
                                    {"buckets": True}, {"buckets": 2.0}, {"loaded_at": float("nan")},
                                    {"pool_size": 1}])
def test_bad_margin_parameters_are_config_errors(params: dict) -> None:
    """A string hedge raised a TypeError; an infinite one and buckets=True were taken."""
    with pytest.raises(ConfigError, match=next(iter(params))):
        ForecastRisk(**params)
    assert ForecastRisk(np.float32(2.0), buckets=np.int64(3)).buckets == 3


def test_forecasts_are_kept_for_the_last_few_iterations_only() -> None:
    risk = ForecastRisk(keep=3)
    for k in range(10):
        risk.record(k, np.arange(4), SPEEDS[:4])
    assert sorted(risk.forecasts_) == [7, 8, 9]
    risk.record(2, np.arange(4), SPEEDS[:4])  # a decision re-made late keeps its own forecast (a KeyError before)
    assert sorted(risk.forecasts_) == [2, 8, 9] and risk.factors(2).shape == (4,)


def test_reports_of_an_iteration_without_a_forecast_of_its_own_score_the_split_in_force() -> None:
    """A coordinator running ahead writes one decision's split for several iterations and decides from the newest
    complete one, which then seldom has a forecast of its own: its reports are scored against the newest forecast
    before it (here the fast half's speeds were forecast 2x too high by the forecast of 12, not by that of 10)."""
    risk = ForecastRisk(min_samples=1)
    workers = np.arange(SPEEDS.size)
    risk.record(10, workers, SPEEDS)
    risk.record(12, workers, SPEEDS * np.where(workers >= 6, 2.0, 1.0))
    for k in (9, 12 + _REACH + 1):  # before every forecast, and past the reach of the newest
        risk.observe(_reports(k, np.full(SPEEDS.size, 64), SPEEDS))
    assert risk.pooled_.sum() == 0
    risk.observe(_reports(15, np.full(SPEEDS.size, 64), SPEEDS))  # ran on the split planned for 12
    assert risk.pooled_.sum() == SPEEDS.size
    slowdowns = np.exp(np.concatenate([risk.pool_[b, :n] for b, n in enumerate(risk.pooled_)]))
    np.testing.assert_allclose(np.sort(slowdowns), [1.0] * 6 + [2.0] * 6)


def test_deferred_pooling_sees_the_load_at_once_and_pools_the_same_slowdowns_later() -> None:
    now, deferred = ForecastRisk(), ForecastRisk()
    workers = np.arange(12)
    for k in range(80):
        speeds = SPEEDS * np.where(np.arange(12) % 3 == k % 3, 0.5, 1.0)
        reports = [Report("h", i, k, 64, 64 / v, features={"colocated_load": float(k % 2)})
                   for i, v in enumerate(speeds)]
        for risk in (now, deferred):
            risk.record(k, workers, SPEEDS)
        now.observe(reports)
        pooled = deferred.pooled_.copy()
        deferred.observe(reports, defer=True)
        assert np.array_equal(deferred.pooled_, pooled) and deferred.loaded_.all() == bool(k % 2)
        deferred.finish_learning()
    np.testing.assert_array_equal(deferred.pool_, now.pool_)
    assert now.pooled_.sum() == 80 * 12


def test_lbbsp_learns_off_the_decision_path_and_catches_up_when_nobody_calls_learn() -> None:
    config = JobConfig("h", 12, 12 * 64)
    told, untold = LBBSPPolicy(EWMAThroughput()), LBBSPPolicy(EWMAThroughput())
    rng = np.random.default_rng(6)
    sizes = {id(told): config.initial_sizes(), id(untold): config.initial_sizes()}
    for k in range(40):
        speeds = SPEEDS * rng.lognormal(0.0, 0.1, 12)
        for policy in (told, untold):
            policy.observe(_reports(k, np.asarray(sizes[id(policy)]), speeds))
            sizes[id(policy)] = policy.decide(k + 2, sizes[id(policy)], config).sizes
        assert told.risk.pooled_.sum() == untold.risk.pooled_.sum()  # both pooled up to the previous iteration
        told.learn()
        assert told.risk.pooled_.sum() == untold.risk.pooled_.sum() + (12 if k >= 2 else 0)
    assert sizes[id(told)] == sizes[id(untold)]


def test_hedged_models_invert_exactly_like_the_search() -> None:
    factor = np.array([1.0, 1.5, 2.0, 1.2])
    linear = LinearTime(np.array([100.0, 200.0, 400.0, 100.0]), overhead=np.array([0.0, 0.1, 0.0, 0.2]))
    hinge = HingeTime(np.full(4, 0.05), np.array([8.0, 16.0, 16.0, 32.0]), np.array([0.01, 0.004, 0.002, 0.001]),
                      np.full(4, 1e12))
    lower, upper = np.ones(4, dtype=np.int64), np.full(4, 1000, dtype=np.int64)
    for model in (linear, hinge):
        fast = hedged(model, factor)
        assert hasattr(fast, "capacity")
        assert np.allclose(fast.time(np.full(4, 50)), model.time(np.full(4, 50)) * factor)
        assert (allocate(fast, 1000, lower, upper) == allocate(HedgedTime(model, factor), 1000, lower, upper)).all()
    mixed = MixedTime(((np.array([0, 2]), LinearTime(np.array([100.0, 400.0]))),
                       (np.array([1, 3]), HingeTime(np.full(2, 0.05), np.full(2, 16.0), np.array([0.004, 0.001]),
                                                    np.full(2, 1e12)))), 4)
    sizes = np.array([10, 20, 30, 40])
    assert np.allclose(hedged(mixed, factor).time(sizes), mixed.time(sizes) * factor)
    assert (allocate(hedged(mixed, factor), 1000, lower, upper)
            == allocate(HedgedTime(mixed, factor), 1000, lower, upper)).all()


@dataclass(frozen=True)
class SquareRootTime:
    """A time model of a user's own, invertible for one deadline only: time = sqrt(x) / speed."""

    speed: np.ndarray

    def time(self, sizes: np.ndarray) -> np.ndarray:
        return np.sqrt(np.asarray(sizes, dtype=float)) / self.speed

    def capacity(self, deadline: float) -> np.ndarray:
        return np.floor((deadline * self.speed) ** 2)


def test_a_mixed_job_with_a_model_of_the_users_own_is_hedged_by_search() -> None:
    factor = np.array([1.0, 1.5, 2.0, 1.2])
    mixed = MixedTime(((np.array([0, 2]), LinearTime(np.array([100.0, 400.0]))),
                       (np.array([1, 3]), SquareRootTime(np.array([2.0, 4.0])))), 4)
    lower, upper = np.ones(4, dtype=np.int64), np.full(4, 1000, dtype=np.int64)
    sizes = allocate(hedged(mixed, factor), 1000, lower, upper)
    assert sizes.sum() == 1000 and (sizes >= lower).all() and (sizes <= upper).all()
    assert (sizes == allocate(HedgedTime(mixed, factor), 1000, lower, upper)).all()


def test_the_quantile_is_the_order_statistic_it_names_despite_float_rounding() -> None:
    """(1 - 3/9) * 396 is 264.00000000000006 in floats: its ceiling took the 265th smallest of 397 slowdowns."""
    risk = ForecastRisk(hedge=3, buckets=1, min_samples=1, pool_size=397)
    risk.pool_[0] = np.log(np.arange(1.0, 398.0))[::-1]  # slowdowns 1 .. 397, in no particular order
    risk.pooled_[0] = 397
    risk.record(5, np.arange(9), np.ones(9))
    assert np.allclose(risk.factors(5), 265.0)  # index 264 of the sorted slowdowns (np.quantile's "higher" says 266)


def test_a_forecast_is_scored_at_the_size_run_where_the_curve_makes_throughput_depend_on_it() -> None:
    """A GPU forecast at 500 samples/s at its latest size, then given 8 samples under its 64-sample knee, takes as
    long as for 64: scored at the latest size, that read as a slowdown of 6x, whose margin took its samples away
    (in a mixed job of 256 workers, GPUs at 1 sample and the job at 2.9x the oracle's time)."""
    curve = HingeTime(np.full(3, 0.128), np.full(3, 64.0), np.full(3, 0.002), np.full(3, 1e12))
    linear = LinearTime(np.array([50.0, 60.0]))
    job = MixedTime(((np.arange(3), curve), (np.arange(3, 5), linear)), 5)
    sizes = np.array([8, 100, 0, 4, 6])
    np.testing.assert_allclose(sized_throughput(job, sizes), [62.5, 100 / 0.2, np.nan, np.nan, np.nan])
    risk = ForecastRisk(min_samples=1)
    risk.record(5, np.arange(5), np.array([500.0, 500.0, 500.0, 50.0, 60.0]))
    risk.expect(5, np.arange(5), sized_throughput(job, sizes))
    risk.observe([Report("h", w, 5, int(sizes[w]), float(job.time(sizes)[w])) for w in (0, 1, 3, 4)])
    pooled = np.concatenate([risk.pool_[b, :n] for b, n in enumerate(risk.pooled_)])
    np.testing.assert_allclose(pooled, 0.0, atol=1e-12)  # every forecast came true at the size it was run at
    assert risk.factors(5).max() == pytest.approx(1.0)


def test_gpus_and_cpus_learn_their_margins_apart() -> None:
    """A GPU's forecasts miss by about 0.5%, a shared CPU's by tens of percent: pooled together, the GPUs had been
    planned with the CPUs' margins (a mixed job of 1,024 workers at 1.59x the oracle's time, 1.16x apart)."""
    rng = np.random.default_rng(0)
    risk = ForecastRisk()
    workers, forecast = np.arange(40), np.full(40, 100.0)
    for k in range(20):
        risk.record(k, workers, forecast)
        slowdown = np.where(workers < 20, rng.lognormal(0.0, 0.005, 40), rng.uniform(1.0, 1.6, 40))
        risk.observe([Report("h", w, k, 64, 0.64 * float(slowdown[w]), device="cuda:A100" if w < 20 else "cpu")
                      for w in workers.tolist()])
    risk.record(20, workers, forecast)
    factor = risk.factors(20)
    assert factor[:20].max() < 1.03 and factor[20:].min() > 1.4


def test_gpus_that_join_a_running_cpu_job_are_not_planned_with_the_cpus_margins_before_they_measure() -> None:
    """A GPU's announcement (nothing measured yet, GPU memory read) names its kind, as AutoCapacityModel reads it:
    its group had counted as CPUs until its first measurement, so its first forecasts took the CPUs' margin."""
    rng = np.random.default_rng(1)
    risk = ForecastRisk()
    cpus = np.arange(20)
    for k in range(10):
        risk.record(k, cpus, np.full(20, 100.0))
        risk.observe([Report("h", w, k, 64, 0.64 * rng.uniform(1.0, 1.6)) for w in cpus.tolist()])
    gpus = [Report("h", w, 10, 0, 0.0, device="cuda:A100", features={"gpu_mem_used": 1e9, "gpu_mem_free": 7e10})
            for w in range(20, 24)]
    risk.observe([Report("h", w, 10, 64, 0.64 * rng.uniform(1.0, 1.6)) for w in cpus.tolist()] + gpus)
    workers = np.arange(24)
    risk.record(11, workers, np.full(24, 100.0))
    factor = risk.factors(11)
    assert factor[:20].min() > 1.4 and np.all(factor[20:] == 1.0)  # no GPU slowdowns pooled yet: plain LB-BSP


@pytest.mark.parametrize("groups", [3, 40])  # a sort per group; one sort for many groups (clients naming devices)
def test_each_forecast_is_ranked_among_its_hardware_peers_alone(groups: int) -> None:
    """The rank bucket is a forecast's place among its own hardware group's forecasts (slow, middle, fast third),
    whatever the other groups forecast: the same rule for a few groups and for many."""
    rng = np.random.default_rng(groups)
    n = 6 * groups
    workers, cores = np.arange(n), rng.permutation(np.arange(n) % groups) + 1
    risk = ForecastRisk(buckets=3)
    risk.observe([Report("h", w, 0, 64, 0.5, features={"cores": int(c)}) for w, c in zip(workers.tolist(), cores)])
    forecast = rng.permutation(n).astype(float) + 1.0  # no ties
    bucket = risk._bucket(workers, forecast)
    for c in np.unique(cores).tolist():  # six workers a group: two a third, by forecast within the group
        members = np.flatnonzero(cores == c)
        by_forecast = members[np.argsort(forecast[members])]
        assert bucket[by_forecast].tolist() == [0, 0, 1, 1, 2, 2], c


@pytest.mark.parametrize("call", ["record", "expect"])
def test_forecasts_of_another_length_than_their_workers_are_a_clear_error(call: str) -> None:
    """A forecast of 2 throughputs for 3 workers had failed with numpy's "operands could not be broadcast" from
    inside the bucketing (record), or with an IndexError (expect)."""
    risk = ForecastRisk()
    risk.record(1, [0, 1, 2], [1.0, 2.0, 3.0])
    with pytest.raises(ConfigError, match=r"3 workers.*2 throughputs"):
        getattr(risk, call)(1, [0, 1, 2], [1.0, 2.0])


def _mixed_reports(k: int, rng: np.random.Generator, gpus_on_cpu: bool) -> list[Report]:
    """20 GPUs (precise) on 32-core hosts, 20 shared CPUs (1-1.6x slowdowns) on 8-core ones; ``gpus_on_cpu``: the
    GPUs report as their first step did under gloo without DDP, timed on the CPU before the model's device was known."""
    gpu = {"cores": 32.0, "gpu_mem_used": 2e9, "gpu_mem_free": 7e10}
    out = []
    for w in range(40):
        if w < 20 and not gpus_on_cpu:
            out.append(Report("m", w, k, 64, 0.064 * float(rng.lognormal(0.0, 0.005)), device="cuda:A100",
                              features=gpu))
        else:
            seconds = 0.064 * float(rng.lognormal(0.0, 0.005)) if w < 20 else 0.64 * float(rng.uniform(1.0, 1.6))
            out.append(Report("m", w, k, 64, seconds, features={"cores": 32.0 if w < 20 else 8.0}))
    return out


def test_a_gpu_whose_first_report_came_from_the_cpu_gets_the_gpus_margins_once_it_reads_its_gpu() -> None:
    """Its hardware group, and so its kind, came from its first report for good, while AutoCapacityModel moved it to
    the GPU curve: the GPUs were planned with the CPUs' margins (x1.52-1.54 here, where GPUs apart get under
    x1.03), and a mixed job of 16 + 16 ran 12-14% slower than with the GPUs' first report from cuda."""
    rng = np.random.default_rng(0)
    risk = ForecastRisk()
    workers, forecast = np.arange(40), np.where(np.arange(40) < 20, 1000.0, 100.0)
    for k in range(20):
        risk.record(k, workers, forecast)
        risk.observe(_mixed_reports(k, rng, gpus_on_cpu=k == 0), defer=True)
        risk.finish_learning()
    risk.record(20, workers, forecast)
    factor = risk.factors(20)
    assert factor[:20].max() < 1.03 and factor[20:].min() > 1.4
    # and back: a GPU worker measuring on the CPU with no GPU features joins the CPUs' group
    risk.observe([Report("m", 0, 20, 64, 0.64, features={"cores": 8.0})])
    risk.record(21, workers, forecast)
    assert risk.factors(21)[0] > 1.4 and risk.factors(21)[1:20].max() < 1.03


def test_the_margins_state_stays_bounded_over_a_long_run_and_follows_the_worker_set() -> None:
    rng = np.random.default_rng(1)
    risk = ForecastRisk(pool_size=64, min_samples=8, keep=4)
    shape = risk.pool_.shape
    counts = [12] * 200 + [5] * 100 + [30] * 100  # workers leave, then more join
    for k, n in enumerate(counts):
        workers = np.arange(n)
        risk.record(k, workers, np.full(n, 100.0))
        assert risk.factors(k).shape == (n,)
        risk.observe([Report("b", w, k, 64, 0.64 * float(rng.uniform(1.0, 1.5))) for w in range(n)], defer=True)
        risk.finish_learning()
        assert len(risk.forecasts_) <= 4
    assert risk.pool_.shape == shape and risk.pooled_.sum() == sum(counts)
    assert risk.peer_group_.size == 30 and len(risk.groups_) == 1
    assert 1.3 < risk.factors(len(counts) - 1).min() <= risk.factors(len(counts) - 1).max() < 1.5


def test_margins_follow_a_pinned_kind_not_the_kind_the_reports_show() -> None:
    """A worker pinned "gpu" whose reports look like a CPU's had been planned with the CPUs' margins."""
    config = JobConfig("job", 3, 300, lag=1)
    policy = LBBSPPolicy(AutoCapacityModel(kinds={2: "gpu"}, models={"gpu": EWMAThroughput()}, horizon=1))
    current = list(config.initial_sizes())
    for k in range(3):
        policy.observe([_cpu(w, k, current[w], 100) for w in range(3)])
        current = list(policy.decide(k + 1, current, config).sizes)
        policy.learn()
    risk = policy.risk
    assert risk is not None and policy.model.kind_ == {0: "cpu", 1: "cpu", 2: "gpu"}
    assert [KINDS[risk.group_kind_[risk.peer_group_[w]]] for w in range(3)] == ["cpu", "cpu", "gpu"]
    assert risk.peer_group_[2] != risk.peer_group_[0] == risk.peer_group_[1]


def _risk(hedge: float, pool: np.ndarray, min_samples: int = 1) -> ForecastRisk:
    risk = ForecastRisk(hedge=hedge, buckets=1, min_samples=min_samples, pool_size=max(pool.size, 8))
    risk.pool_[0, :pool.size] = np.log(pool)
    risk.pooled_[0] = pool.size
    return risk


@pytest.mark.parametrize(("hedge", "pool", "workers", "factor"), [
    (1, np.arange(1.0, 11.0), 4, 8.0),  # the ceil of the quantile's rank, not its floor (7)
    (2, np.arange(1.0, 102.0), 3, 51.0),  # eps held at 0.5 (35 without)
])
def test_margins_are_the_quantile_the_hedge_asks(hedge: float, pool: np.ndarray, workers: int, factor: float) -> None:
    risk = _risk(hedge, pool)
    risk.record(5, np.arange(workers), np.ones(workers))
    assert risk.factors(5) == pytest.approx(np.full(workers, factor))


def test_margins_start_at_exactly_min_samples_misses() -> None:
    risk = _risk(1, np.full(5, 2.0), min_samples=5)
    risk.record(5, np.arange(4), np.ones(4))
    assert risk.factors(5) == pytest.approx(np.full(4, 2.0))


def test_the_typical_miss_is_the_median() -> None:
    risk = ForecastRisk(buckets=1, min_samples=1, pool_size=8)
    risk.pool_[0, :3] = [0.1, 0.2, 3.0]
    risk.pooled_[0] = 3
    assert risk.typical_miss() == pytest.approx(0.2)


def test_forecast_risk_buckets_workers_by_kind_load_and_rank() -> None:
    loaded = ForecastRisk(buckets=3, loaded_at=0.1)
    loaded.observe([Report("h", w, 0, 64, 0.5, features={"colocated_load": 0.1}) for w in range(3)])
    assert loaded._bucket(np.arange(3), np.arange(1.0, 4.0)).tolist() == [3, 4, 5]  # at loaded_at: loaded
    unknown = ForecastRisk(buckets=3)
    unknown.observe([Report("h", w, 0, 64, 0.5) for w in range(3)])
    assert unknown._bucket(np.arange(3), np.array([1.0, np.nan, 3.0])).tolist() == [0, 1, 2]  # NaN: the middle
    gpus = ForecastRisk(buckets=3)
    gpus.observe([Report("h", w, 0, 64, 0.5, device="cuda:0", features={"gpu_mem_used": 1e9, "gpu_mem_free": 7e10})
                  for w in range(3)])
    assert gpus._bucket(np.arange(4), np.arange(1.0, 5.0)).tolist() == [6, 7, 8, 7]  # unseen: the common kind
    pinned = ForecastRisk(buckets=3)
    pinned.observe([Report("h", w, 0, 64, 0.5) for w in range(3)], pinned={0: "gpu", 1: "gpu", 2: "gpu"})
    assert pinned._bucket(np.arange(3), np.arange(1.0, 4.0)).tolist() == [6, 7, 8]
    for groups in (1, 20):  # ranks within a group of five: the lowest two, the middle, the highest two
        ranked = ForecastRisk(buckets=3)
        n = 5 * groups
        ranked.observe([Report("h", w, 0, 64, 0.5, features={"cores": w % groups + 1}) for w in range(n)])
        buckets = ranked._bucket(np.arange(n), np.arange(1.0, n + 1))
        assert buckets[np.arange(n) % groups == 0].tolist() == [0, 0, 1, 2, 2]


class _TenfoldForWorker2(EWMAThroughput):
    """A model of the user's own with a bug: worker 2's throughput forecast 10x too high."""

    def predict(self, workers):  # type: ignore[no-untyped-def]
        out = np.array(super().predict(workers), dtype=float)
        out[np.asarray(workers) == 2] *= 10.0
        return out


def test_forecasts_that_keep_missing_several_times_over_are_warned_about_once_a_worker(
        caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig("misled", 12, 12 * 64)
    rng = np.random.default_rng(7)
    runs = {}
    for name, model in (("buggy", _TenfoldForWorker2()), ("sound", EWMAThroughput())):
        policy, sizes = LBBSPPolicy(model), config.initial_sizes()
        caplog.clear()
        with caplog.at_level("WARNING", logger="lbbsp.policies"):
            for k in range(60):
                policy.observe(_reports(k, np.asarray(sizes), SPEEDS * rng.lognormal(0.0, 0.1, 12), "misled"))
                policy.learn()
                sizes = policy.decide(k + 2, sizes, config).sizes
        runs[name] = [r.getMessage() for r in caplog.records if "keep missing" in r.getMessage()]
        ids, factors = policy.risk.misled()
        runs[name + " ids"] = ids.tolist()
        if name == "buggy":
            assert factors[0] == pytest.approx(10.0, rel=0.15)
    assert runs["sound"] == [] and runs["sound ids"] == []
    assert runs["buggy ids"] == [2] and len(runs["buggy"]) == 1  # once, however many decisions follow
    assert "job misled: _TenfoldForWorker2's forecasts" in runs["buggy"][0]
    assert re.search(r"\(worker 2 at (9\.\d+|1[01](\.\d+)?)x, forecast / measured", runs["buggy"][0])


def test_expect_matches_workers_by_id_and_skips_an_iteration_never_recorded() -> None:
    """expect takes the workers in any order, or some of them (a policy of one's own with its own with_margins): each
    throughput rescores the forecast of its own worker, the others keep theirs; for an iteration with no forecast
    recorded there is nothing to rescore, and nothing is added."""
    risk = ForecastRisk()
    risk.record(5, [0, 1, 2], np.array([100.0, 100.0, 100.0]))
    risk.expect(5, [2, 0], np.array([50.0, 200.0]))
    ids, throughput, _ = risk.forecasts_[5]
    assert ids.tolist() == [0, 1, 2] and throughput.tolist() == [200.0, 100.0, 50.0]
    risk.expect(6, [0, 1, 2], np.ones(3))
    assert sorted(risk.forecasts_) == [5] and risk.forecasts_[5][1].tolist() == [200.0, 100.0, 50.0]


def test_reports_against_a_forecast_of_no_workers_pool_nothing() -> None:
    risk = ForecastRisk(min_samples=1)
    risk.record(3, [], np.zeros(0))
    risk.observe([Report("h", w, 3, 64, 0.64) for w in range(2)])
    assert risk.pooled_.sum() == 0
