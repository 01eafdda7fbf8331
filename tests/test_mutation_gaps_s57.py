"""Behaviour that a mutation review found no test held: each of these failed with one small change to the code it
names (the oracle's memory caps, the memory cap's negative-intercept and held-peak rules, the cold-start cap's
most bytes per sample, the leader's room, the cap-held worker's override, NARX's scale-free inputs and its level,
the knee above the smallest size, the FL spike factor, GPU memory features as a GPU, the median fill, the idle
share with backup workers and the over-memory count)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from lbbsp import JobConfig, Report
from lbbsp.allocation import LinearTime
from lbbsp.models import (
    BatchTimeCurve,
    CapacityModel,
    EWMAThroughput,
    FLClientModel,
    NARXThroughput,
    fit_hinge,
    fit_memory_cap,
    worker_kind,
)
from lbbsp.policies import BackupWorkersPolicy, Decision, LBBSPPolicy, LeaderStragglerPolicy, OraclePolicy, Policy
from lbbsp.sim.engine import run_policy
from lbbsp.sim.scenarios import Scenario, Truth

GB = 1e9


class _Capped(EWMAThroughput):
    """EWMA speeds with memory caps set by the test."""

    caps: np.ndarray | None = None

    def max_batch(self, workers):  # type: ignore[no-untyped-def]
        return None if self.caps is None else self.caps[np.asarray(workers)]


def _reports(job: str, k: int, sizes, speeds) -> list[Report]:  # type: ignore[no-untyped-def]
    return [Report(job, w, k, int(s), float(s / v)) for w, (s, v) in enumerate(zip(sizes, speeds))]


def test_the_oracle_keeps_within_the_memory_caps_it_is_shown() -> None:
    config = JobConfig("o", 3, 300)
    oracle = OraclePolicy()
    oracle.reveal(LinearTime(np.array([1000.0, 100.0, 100.0])), max_batch=np.array([120, 300, 300]))
    sizes = oracle.decide(2, (100, 100, 100), config).sizes
    assert sum(sizes) == 300 and sizes[0] == 120  # uncapped, the fastest would take 250


def test_a_memory_line_with_a_negative_intercept_is_capped_by_the_lower_of_its_two_lines() -> None:
    """0.5, 2.5 and 4.5 GB at 100, 200 and 300 samples (a < 0) under a 3 GB budget: 200 by the line through the
    origin, where the fitted line alone allows 225, past what the card holds."""
    caps = fit_memory_cap(np.array([[100.0, 200.0, 300.0]]), np.array([[0.5, 2.5, 4.5]]) * GB,
                          np.ones((1, 3), bool), np.array([3 * GB]))
    assert caps.tolist() == [200]


def test_readings_seen_held_at_a_peak_take_the_line_through_the_origin() -> None:
    sizes, used = np.array([[100.0, 200.0, 300.0]]), np.array([[1.5, 2.5, 3.5]]) * GB
    valid, budget = np.ones((1, 3), bool), np.array([5 * GB])
    assert fit_memory_cap(sizes, used, valid, budget).tolist() == [450]  # the line 0.5 GB + 10 MB a sample
    assert fit_memory_cap(sizes, used, valid, budget, held=np.array([True])).tolist() == [428]  # 3.5 GB / 300


def test_a_new_gpu_is_capped_at_the_most_bytes_per_sample_any_worker_measured() -> None:
    """Two A100s measured at 97.5 MB and 212.5 MB a sample; a third announces 39.5 GB free: capped at what that
    holds at 212.5 MB a sample (176), not at the lighter worker's rate (384), which would run it out of memory."""
    model = BatchTimeCurve()
    for k, size in enumerate([112, 120]):
        model.partial_fit([Report("g", w, k, size, 0.1, device="cuda:A100",
                                  features={"gpu_mem_used": (used := 1.5 * GB + rate * GB * size),
                                            "gpu_mem_free": 40 * GB - used, "cores": 32.0})
                           for w, rate in enumerate([0.085, 0.2])])
    model.partial_fit([Report("g", 2, 1, 0, 0.0, device="cuda:A100",
                              features={"gpu_mem_used": 0.5 * GB, "gpu_mem_free": 39.5 * GB, "cores": 64.0})])
    assert model.max_batch([2]).tolist() == [176]  # 0.95 x 39.5 GB / (25.5 GB / 120)


def test_the_leader_is_the_fastest_worker_with_room() -> None:
    """The fastest worker sits at its memory cap: the search moves the straggler's samples to the next fastest
    (it had picked the capped worker and moved 0 samples at every window)."""
    config, speeds = JobConfig("l", 3, 300), [400.0, 200.0, 100.0]
    model = _Capped()
    model.caps = np.array([100, 300, 300])
    policy = LeaderStragglerPolicy(window=1, model=model)
    policy.observe(_reports("l", 0, (100, 100, 100), speeds))
    decision = policy.decide(1, (100, 100, 100), config)
    assert decision.sizes == (100, 125, 75), decision.reason  # step 0.25 x 100


def test_a_worker_held_at_its_cap_follows_a_cap_that_grew_by_less_than_the_dead_band() -> None:
    config, speeds = JobConfig("c", 4, 400), [400.0, 100.0, 100.0, 100.0]
    model = _Capped()
    model.caps = np.array([100, 400, 400, 400])
    policy = LBBSPPolicy(model, hedge=None)
    policy.observe(_reports("c", 0, (100, 100, 100, 100), speeds))
    assert policy.decide(2, (100, 100, 100, 100), config).sizes == (100, 100, 100, 100)
    model.caps = np.array([102, 400, 400, 400])  # a 2% gain, under the 3% dead band
    assert policy.decide(3, (100, 100, 100, 100), config).sizes[0] == 102


def test_narx_forecasts_are_scale_free() -> None:
    """The same relative series at 1x and 100x: forecasts 100x apart, the network's and the level's alike."""
    rng = np.random.default_rng(0)
    series = 100 * np.exp(np.cumsum(rng.normal(0, 0.05, (80, 3)), axis=0))
    small, large = NARXThroughput(warmup=5), NARXThroughput(warmup=5)
    for k in range(80):
        small.partial_fit(_reports("n", k, [100] * 3, series[k]))
        large.partial_fit(_reports("n", k, [100] * 3, 100 * series[k]))
    np.testing.assert_allclose(large.predict([0, 1, 2]), 100 * small.predict([0, 1, 2]), rtol=1e-6)


def test_narx_answers_with_its_ewma_level_before_warm_up() -> None:
    model = NARXThroughput(alpha_ewma=0.3)
    for k, speed in enumerate([100.0, 200.0]):
        model.partial_fit(Report("n", 0, k, 100, 100 / speed))
    assert model.predict([0])[0] == pytest.approx(np.exp(0.3 * np.log(200) + 0.7 * np.log(100)))  # 123.1


def test_a_knee_lies_above_the_smallest_size() -> None:
    """1, 3 and 5 s at 10, 20 and 30 samples: no flat part, so the proportional line (knee 0), not a knee at the
    smallest size, which has no point on its flat part."""
    knee, base, slope = fit_hinge(np.array([[10.0, 20.0, 30.0]]), np.array([[1.0, 3.0, 5.0]]), np.ones((1, 3)))
    assert knee[0] == pytest.approx(0, abs=1e-6) and base[0] == pytest.approx(0, abs=1e-6)
    assert slope[0] == pytest.approx(22 / 140)


def test_an_fl_client_speeding_up_within_the_spike_factor_is_followed_at_once() -> None:
    model = FLClientModel(alpha=0.5, spike=4.0)
    for k, speed in enumerate([10.0, 20.0]):
        model.partial_fit(Report("f", 0, k, 10, 10 / speed))
    assert model.predict([0])[0] == pytest.approx(15.0)


def test_gpu_memory_features_make_a_gpu_worker_whatever_its_device() -> None:
    assert worker_kind(Report("k", 0, 0, 8, 0.1, device="cpu",
                              features={"gpu_mem_used": 1e9, "gpu_mem_free": 7e9})) == "gpu"


def test_a_worker_with_no_forecast_is_planned_at_the_median_speed() -> None:
    class Partial(CapacityModel):
        def partial_fit(self, reports, *, defer=False):  # type: ignore[no-untyped-def]
            return self

        def predict(self, workers):  # type: ignore[no-untyped-def]
            return np.array([10.0, np.nan, 30.0])

    assert Partial().time_model([0, 1, 2]).speed.tolist() == [10.0, 20.0, 30.0]


@dataclass
class _Fixed(Scenario):
    """Three workers at 100, 100 and 10 samples/s, each able to hold at most 100 samples."""

    def truth(self, iteration: int) -> Truth:
        return Truth(LinearTime(np.array([100.0, 100.0, 10.0])), max_batch=np.array([100, 100, 100]))

    def features(self, iteration: int, sizes: np.ndarray) -> list[dict[str, float]]:
        return [{} for _ in sizes]


class _Given(Policy):
    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    def decide(self, iteration: int, current, config: JobConfig) -> Decision:  # type: ignore[no-untyped-def]
        return Decision(self.sizes, "given")


def test_idle_shares_stay_in_zero_to_one_with_backup_workers() -> None:
    """The straggler backup workers do without finishes after the iteration's end: it idles for none of it (its
    idle share had been negative)."""
    run = run_policy(_Fixed("fixed", JobConfig("fixed", 3, 150), ["cpu"] * 3), "backup", BackupWorkersPolicy(), 6)
    assert all(0.0 <= share <= 1.0 for share in run.idle_fraction)


def test_a_worker_given_exactly_its_memory_cap_is_not_over_it() -> None:
    scenario = _Fixed("fixed", JobConfig("fixed", 3, 200), ["cpu"] * 3)
    assert run_policy(scenario, "at", _Given((100, 99, 1)), 6).over_memory == 0
    assert run_policy(scenario, "past", _Given((101, 98, 1)), 6).over_memory == 4  # after the lag's 2 iterations
