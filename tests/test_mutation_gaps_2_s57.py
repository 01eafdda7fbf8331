"""Behaviour a second mutation review found no test held, each with the numbers it must give: the coordinator's
guard on a policy's split, ForecastRisk's margins and buckets, damping and sitting out, the auto model's explore
and its median for a kind not measured yet, the simulator's scenarios, the GPU curve's explore and cold slopes,
EWMA's alpha and the trace loader's warnings."""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest

from lbbsp import JobConfig, Report
from lbbsp.allocation import LinearTime, allocate_sitting_out, damp
from lbbsp.coordinator import GuardedPolicy
from lbbsp.hedging import ForecastRisk
from lbbsp.models import AutoCapacityModel, BatchTimeCurve, EWMAThroughput
from lbbsp.models.gpu_curve import perturb_pairs
from lbbsp.policies import Decision, Policy
from lbbsp.sim.scenarios import CPUContention, FLClients, GPUMix, MixedCluster
from lbbsp.sim.traces import load_traces


class _Fixed(Policy):
    def __init__(self, sizes: tuple[float, ...], sit_out: float = 0.0) -> None:
        self.sizes, self.sit_out = sizes, sit_out

    def decide(self, iteration: int, current, config: JobConfig) -> Decision:  # type: ignore[no-untyped-def]
        return Decision(self.sizes, "fixed")  # type: ignore[arg-type]


@pytest.mark.parametrize(("config", "sizes", "sit_out", "refusal"), [
    (JobConfig("j", 4, 400, max_batch=150), (200, 100, 50, 50), 0.0, "worker 0 got 200 samples, outside its bounds"),
    (JobConfig("j", 4, 400, max_batch=120), (150, 50, 100, 100), 0.25, "outside its bounds"),
    (JobConfig("j", 4, 400, min_batch=0), (-0.5, 100.0, 100.0, 200.5), 0.0, "must be integers"),
])
def test_the_guard_refuses_a_split_past_the_bounds_or_of_fractions(config: JobConfig, sizes: tuple[float, ...],
                                                                   sit_out: float, refusal: str) -> None:
    guard = GuardedPolicy(_Fixed(sizes, sit_out), config)
    decision, assignment = guard.decide(5, config.initial_sizes(), [])
    assert assignment.sizes == tuple(config.initial_sizes()) and guard.failures == 1
    assert refusal in decision.reason


def test_the_guard_lets_the_share_allowed_to_sit_out_do_so() -> None:
    config = JobConfig("j", 100, 1000)
    sizes = (0,) * 29 + (10,) * 70 + (300,)  # 29 of 100 at 0, under sit_out 0.29 (a float's 28.999...)
    guard = GuardedPolicy(_Fixed(sizes, 0.29), config)
    assert guard.decide(5, config.initial_sizes(), [])[1].sizes == sizes and guard.failures == 0


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


def test_damping_takes_a_proposal_of_another_sum_and_ignores_workers_that_never_finish() -> None:
    sizes, changed = damp([5, 5], np.array([6, 6]), LinearTime([1.0, 1.0]), 0.1)
    assert sizes.tolist() == [6, 6] and changed
    sizes, changed = damp([6, 3, 1], np.array([5, 4, 1]), LinearTime([1.0, 1.0, 0.0]), 0.0)
    assert sizes.tolist() == [5, 4, 1] and changed


def test_sitting_out_ranks_by_the_forecast_and_lifts_only_bounds_that_fit() -> None:
    lifted = allocate_sitting_out(LinearTime([1.0] * 4, idle_is_free=True), 2, [0] * 4, [2] * 4, 0.5,
                                  stay=[True, True, True, False])
    assert lifted.tolist() == [1, 1, 0, 0]
    model = LinearTime([10.0] * 4, overhead=np.array([0, 0, 0, 5.0]), idle_is_free=True)
    ranked = allocate_sitting_out(model, 40, [1] * 4, [40] * 4, 0.25, ranked_by=LinearTime([1.0, 10, 10, 10]))
    assert ranked.tolist() == [13, 13, 13, 1]


def _cpu(w: int, n: int, speed: float) -> Report:
    return Report("job", w, 0, n, n / speed, features={"cores": 16, "cpu_util": 0.5})


def _gpu(w: int, n: int, speed: float) -> Report:
    used = 2e9 + n * 2e7
    return Report("job", w, 0, n, 0.02 + n / speed, device="cuda:A100",
                  features={"cores": 8, "gpu_mem_used": used, "gpu_mem_free": 16e9 - used})


def test_the_auto_models_explore_keeps_each_kind_within_its_own_bounds() -> None:
    model = AutoCapacityModel().partial_fit([_cpu(0, 50, 100.0), _gpu(1, 100, 3000.0), _gpu(2, 100, 3000.0)])
    assert model.explore([0, 1, 2], np.array([50, 100, 100]), np.ones(3, int), np.array([1000, 1000, 100])).tolist() \
        == [50, 100, 100]


def test_a_kind_not_measured_yet_gets_the_median_of_the_measured_kinds() -> None:
    gpu_announced = Report("job", 3, 0, 0, 0.0, device="cuda:A100", features={"gpu_mem_used": 1e9, "gpu_mem_free": 7e10})
    model = AutoCapacityModel().partial_fit([_cpu(0, 64, 10.0), _cpu(1, 64, 20.0), _cpu(2, 64, 1000.0), gpu_announced])
    assert model.predict([3])[0] == pytest.approx(20.0)  # the median, not the mean (343)
    client = Report("job", 4, 0, 0, 0.0, device="phone", features={"download_s": 1.0, "upload_s": 1.0})
    mixed = AutoCapacityModel().partial_fit([_cpu(0, 64, 10.0), _cpu(1, 64, 20.0), _cpu(2, 64, 30.0),
                                             _gpu(3, 100, 3000.0), client])
    assert mixed.predict([4])[0] == pytest.approx(25.0)  # each kind's median: 20 and ~1875, then theirs


def test_the_scenarios_truths_hold_what_they_are_built_from() -> None:
    gpu = GPUMix(4, 5, 0, jitter=0.3)
    np.testing.assert_allclose(gpu.truth(2).time_model.time(gpu.knee), gpu.jitter[2] * (gpu.overhead + gpu.knee / gpu.speed))
    assert np.unique(CPUContention(4, 50, 0, mean_dwell=math.inf).speed[:, 0]).size > 20  # replays, not repeats
    clients = FLClients(4, 3, 0)
    np.testing.assert_allclose([f["upload_s"] for f in clients.features(0, np.ones(4))], clients.upload_s)
    mixed = MixedCluster(4, 3, 0)
    caps = mixed.truth(0).max_batch
    assert caps is not None and caps[mixed.gpus_at].tolist() == mixed.gpus.cap.tolist()


def test_a_level_is_replayed_at_its_median(tmp_path: Path) -> None:
    """Level 0 runs at 1, 1 and 10 samples/s (median 1, mean 4), level 1 at 0.5: without noise a worker runs at
    1,000 or 500 samples/s (the levels' medians, the first scaled to 1,000), not at 1,000 or 125."""
    columns = ["throughput", "hog_level", "cpu_util", "proc_cpu", "colocated_load", "mem_util", "cores"]
    rows = [[t, 0, 0.5, 0.5, 0.0, 0.3, 8] for t in [1.0, 1.0, 10.0] * 20] + [[0.5, 1, 0.9, 0.5, 1.0, 0.3, 8]] * 60
    (tmp_path / "a.json").write_text(json.dumps({"columns": columns, "rows": rows}))
    scenario = CPUContention(8, 40, 0, traces=load_traces(tmp_path), noise=False, machine_spread=0.0, mean_dwell=5)
    assert sorted(np.unique(np.round(scenario.speed, 6)).tolist()) == [500.0, 1000.0]


def test_explore_moves_a_share_of_the_smaller_size_and_only_where_the_sizes_say_nothing() -> None:
    assert perturb_pairs(np.array([100, 10]), np.array([0, 1]), 0.1, np.zeros(2), np.full(2, 1000)).tolist() == [99, 11]
    model = BatchTimeCurve(explore_fraction=0.2).partial_fit([Report("g", w, 0, 100, 0.1, device="cuda:0")
                                                              for w in range(2)])
    assert model.explore([0, 1], np.array([85, 115]), np.zeros(2), np.full(2, 1000)).tolist() == [85, 115]


def test_a_known_curve_stays_known_through_a_long_run_at_one_size() -> None:
    model = BatchTimeCurve()
    for k, size in enumerate([100, 200] + [150] * 300):
        model.partial_fit([Report("g", 0, k, size, 0.02 + 0.001 * size, device="cuda:0")])
    assert model.known_[0]


def test_cold_slopes_follow_each_hardware_group() -> None:
    model = BatchTimeCurve().partial_fit([Report("g", 0, 0, 100, 0.1, device="cuda:A100"),
                                          Report("g", 1, 0, 100, 1.0, device="cuda:T4"),
                                          Report("g", 2, 0, 0, 0.0, device="cuda:A100"),
                                          Report("g", 3, 0, 0, 0.0, device="cuda:T4")])
    assert model.time_model([2, 3]).slope == pytest.approx([0.001, 0.01])


def test_ewma_blends_at_its_alpha() -> None:
    model = EWMAThroughput(alpha=0.2).partial_fit([Report("g", 0, 0, 100, 1.0)]).partial_fit([Report("g", 0, 1, 200, 1.0)])
    assert model.predict([0])[0] == pytest.approx(120.0)


def test_a_trace_warns_of_the_levels_short_of_rows_and_only_those(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    columns = ["throughput", "hog_level", "cpu_util", "proc_cpu", "colocated_load", "mem_util", "cores"]
    # level 1: 30 rows a replay uses, the first of 31 ran partly at level 0
    rows = [[1000.0, 0, 0.5, 0.5, 0.0, 0.3, 8]] * 30 + [[500.0, 1, 0.9, 0.5, 1.0, 0.3, 8]] * 31
    (tmp_path / "a.json").write_text(json.dumps({"columns": columns, "rows": rows, "meta": {"max_level": 2}}))
    with caplog.at_level(logging.WARNING, logger="lbbsp.sim.traces"):
        load_traces(tmp_path)
    assert len(caplog.messages) == 1 and "level 2 has 0 rows" in caplog.messages[0]
