"""Capacity models learn known synthetic relations; memory caps hold; cold start gives sane sizes. The contract
every model shares: fit, predict and partial_fit (reports of several iterations learned in order, worker ids
checked), get_params and set_params (a bad value refused, a new one taking effect), clone, and the report columns
the models read."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import sklearn.base
import sklearn.exceptions

from lbbsp import ConfigError, EWMAThroughput, JobConfig, LBBSPPolicy, Report, allocate
from lbbsp.allocation import HingeTime
from lbbsp.models import (
    AutoCapacityModel,
    BatchTimeCurve,
    CapacityModel,
    FLClientModel,
    LastValue,
    NARXThroughput,
    NotFittedError,
    TimeWeightedThroughput,
    fit_hinge,
    similar_hardware_prior,
    worker_kind,
)
from lbbsp.models.base import CheckedReports, as_reports, feature, field
from lbbsp.models.gpu_curve import hinge_sums, line_from_sums
from test_models_auto import _history, _mixed_reports, _reports


def test_fit_hinge_recovers_a_piecewise_linear_curve_within_1_percent() -> None:
    sizes = np.array([[8, 16, 24, 48, 64, 96, 128, 160.0]])
    times = 0.05 + 0.004 * np.maximum(sizes - 24, 0)
    base, knee, slope = fit_hinge(sizes, times * np.random.default_rng(0).normal(1, 0.002, sizes.shape),
                                  np.ones_like(sizes, dtype=bool))
    assert base[0] == pytest.approx(0.05, rel=0.01)
    assert knee[0] == pytest.approx(24, rel=0.01)
    assert slope[0] == pytest.approx(0.004, rel=0.01)


def _gpu_reports(iteration: int, sizes: np.ndarray, base: np.ndarray, knee: np.ndarray, speed: np.ndarray,
                 total: np.ndarray) -> list[Report]:
    times = base + np.maximum(sizes - knee, 0) / speed
    used = 1e9 + 1e8 * sizes
    return [Report("gpu", i, iteration, int(sizes[i]), float(times[i]), device="cuda:0",
                   features={"gpu_mem_used": float(used[i]), "gpu_mem_free": float(total[i] - used[i])})
            for i in range(sizes.size)]


def test_gpu_curve_balances_hinge_workers_and_never_exceeds_memory() -> None:
    base, knee, speed = np.array([0.05, 0.05, 0.2]), np.array([32.0, 64.0, 8.0]), np.array([1000.0, 2500.0, 100.0])
    total = np.array([10e9, 16e9, 16e9])
    true_cap = np.floor((total - 1e9) / 1e8)  # 90, 150, 150 samples
    config = JobConfig("gpu", 3, 240)
    policy = LBBSPPolicy(BatchTimeCurve())
    sizes = np.asarray(config.initial_sizes())
    for k in range(30):
        assert (sizes <= true_cap).all(), f"iteration {k}: {sizes} exceeds the memory caps {true_cap}"
        policy.observe(_gpu_reports(k, sizes, base, knee, speed, total))
        sizes = np.asarray(policy.decide(k + 1, tuple(sizes.tolist()), config).sizes)
    truth = HingeTime(base, knee, 1 / speed, np.full(3, 1e12))
    safe_cap = np.floor((0.99 * total - 1e9) / 1e8).astype(int)  # the model leaves 1% of the memory free
    best = allocate(truth, 240, [1] * 3, safe_cap)
    assert truth.time(sizes).max() <= 1.02 * truth.time(best).max()


def test_gpu_memory_cap_nears_the_card_in_measured_steps_and_keeps_the_floor_free() -> None:
    """Each cap extrapolates into at most 95% of the memory not yet seen in use, so it nears the card in steps
    that measurements confirm, and it always leaves 1% of the card free."""
    model = BatchTimeCurve()
    total = np.array([16e9])  # used = 1 GB + 100 MB per sample: the card holds 150 samples
    caps = []
    for k, size in enumerate([50, 51, 145, 148, 148]):
        model.partial_fit(_gpu_reports(k, np.array([size]), np.array([0.05]), np.array([8.0]), np.array([1000.0]),
                                       total))
        caps.append(int(model.max_batch([0])[0]))
    # one size: the line through the origin (15.5 GB / 120 MB per sample); two sizes 1 apart identify the line
    # 1 GB + 100 MB per sample, but too close to follow it 94 samples further (a budget of 6.1 GB + 0.95 x 9.9 GB
    # = 15.5 GB would allow 145), so the origin line again; from sizes 95 apart, 0.99 x 16 GB = 15.84 GB
    assert caps == [129, 129, 148, 148, 148]
    with pytest.raises(ConfigError, match="memory_floor"):
        BatchTimeCurve(memory_floor=1.0).partial_fit(_gpu_reports(0, np.array([8]), np.array([0.05]), np.array([8.0]),
                                                                  np.array([1000.0]), total))


def _hinge_reports(iteration: int, sizes: np.ndarray, rng: np.random.Generator, noise: float = 0.005,
                   speed: float | np.ndarray = 800.0, device: str = "cuda:v100") -> list[Report]:
    """GPUs with time = (15 ms + max(b, 32) / speed) * lognormal jitter, memory 1.5 GB + 85 MB per sample of 16 GB."""
    times = (0.015 + np.maximum(sizes, 32) / speed) * rng.lognormal(0, noise, sizes.size)
    used = 1.5e9 + 8.5e7 * sizes
    return [Report("h", i, iteration, int(sizes[i]), float(times[i]), device=device,
                   features={"gpu_mem_used": float(used[i]), "gpu_mem_free": float(16e9 - used[i])})
            for i in range(sizes.size)]


def test_gpu_curve_learns_a_hinge_within_half_a_percent_and_keeps_the_slope_through_long_runs_at_one_size() -> None:
    """Two sizes, then 60 iterations at one size (far longer than the window): the curve stays right at
    both ends and beyond the knee; flat below it."""
    rng = np.random.default_rng(0)
    model = BatchTimeCurve()
    for k, size in enumerate([64] * 3 + [160] * 3 + [150] * 60):
        model.partial_fit(_hinge_reports(k, np.array([size]), rng))
    predicted = model.time_model([0]).time(np.array([16.0, 32, 64, 100, 150, 160]))
    truth = 0.015 + np.maximum([16.0, 32, 64, 100, 150, 160], 32) / 800
    np.testing.assert_allclose(predicted[2:], truth[2:], rtol=0.005)
    assert predicted[0] <= predicted[1] <= truth[2]  # below the sizes seen: never slower than the smallest


def test_gpu_curve_passes_through_the_size_it_runs_at_when_a_free_line_would_start_below_zero() -> None:
    """One measurement each at 112 and 127 whose jitter tilts the line through them below the origin, then
    30 at 120 (a split that has settled): the curve answers the settled size from its measurements, not from
    the early pair (a base clipped to 0 without refitting the slope missed it by 0.7% and froze the split)."""
    truth = 0.0927 + 0.0024272 * (np.array([112.0, 127, 120]) - 32)  # a V100 past its knee, as in gpu-mix
    model = BatchTimeCurve()
    for k, (size, seconds) in enumerate([(112, truth[0] * 0.995), (127, truth[1] * 1.006)] + [(120, truth[2])] * 30):
        model.partial_fit([Report("h", 0, k, size, seconds, device="cuda:v100")])
    assert model.time_model([0]).time(np.array([120.0]))[0] == pytest.approx(truth[2], rel=0.001)
    assert model.base_[0] >= 0 and model.slope_[0] > 0


def test_gpu_curve_pools_identical_gpus_and_keeps_different_ones_apart() -> None:
    """40 workers of one GPU model share one precise curve after their first measurements; workers that
    report the same device but differ by up to 2x keep their own curves."""
    rng = np.random.default_rng(1)
    sizes = np.array([100, 140] * 20)
    same, mixed = BatchTimeCurve(), BatchTimeCurve()
    speed = np.linspace(500.0, 1000.0, 40)
    for k in range(4):
        same.partial_fit(_hinge_reports(k, np.roll(sizes, k), rng, noise=0.01))
        mixed.partial_fit(_hinge_reports(k, np.roll(sizes, k), rng, noise=0.01, speed=speed))
    predicted = same.time_model(range(40)).time(np.full(40, 120))
    assert np.abs(predicted / (0.015 + 120 / 800) - 1).max() < 0.004  # one measurement alone misses by ~1%
    predicted = mixed.time_model(range(40)).time(np.full(40, 120))
    assert np.abs(predicted / (0.015 + 120 / speed) - 1).max() < 0.03


def test_gpu_curve_updates_in_o1_to_the_same_fit_as_a_refit_from_its_slots() -> None:
    """The knee is searched when a worker's set of sizes changes; in between, base and slope at that knee follow
    from decayed sums in O(1), and equal a least-squares refit of the slots at the knee."""
    rng = np.random.default_rng(3)
    model = BatchTimeCurve()
    seen: set[int] = set()
    for k, size in enumerate([40, 40, 90, 90, 60] + [60, 61] * 10):
        model.partial_fit(_hinge_reports(k, np.array([size, size + 5]), rng))
        if size not in seen:
            seen.add(size)
            np.testing.assert_allclose(model.knee_, fit_hinge(model.slot_size_, model.slot_time_,
                                                              model.slot_weight_)[1])
    sums = hinge_sums(model.slot_size_, model.slot_time_, model.slot_weight_, model.knee_[:, None])
    base, slope, _ = line_from_sums(sums)
    np.testing.assert_allclose(model.base_, base, rtol=1e-9)
    np.testing.assert_allclose(model.slope_, slope, rtol=1e-9)


def test_gpu_curve_explores_only_until_each_curve_is_known() -> None:
    """Identical GPUs already balanced by the equal split: exploration moves samples between pairs at first
    (the sum unchanged), then stops for good once every worker has measured two sizes."""
    rng = np.random.default_rng(2)
    config = JobConfig("h", 6, 6 * 120)
    policy = LBBSPPolicy(BatchTimeCurve())
    sizes = np.asarray(config.initial_sizes())
    history = [sizes]
    for k in range(12):
        policy.observe(_hinge_reports(k, sizes, rng))
        sizes = np.asarray(policy.decide(k + 1, tuple(sizes.tolist()), config).sizes)
        history.append(sizes)
        assert sizes.sum() == config.global_batch
    assert (history[1] != history[0]).any()
    assert policy.model.known_.all()
    lower, upper = (np.asarray(b) for b in config.bounds())
    np.testing.assert_array_equal(policy.model.explore(range(6), sizes, lower, upper), sizes)


def test_narx_learns_an_ar_process_with_an_exogenous_driver() -> None:
    """log x(t+1) = 0.5 log x(t) + 0.5 log x(t-1) - 0.8 u(t) + noise, u a sticky on/off load: NARX must beat
    LastValue and EWMA by at least 20% MAPE after warm-up."""
    rng = np.random.default_rng(1)
    n, workers = 300, 8
    u = np.zeros((n, workers))
    for t in range(1, n):
        u[t] = np.where(rng.random(workers) < 0.1, 1 - u[t - 1], u[t - 1])
    log_x = np.zeros((n, workers)) + np.log(100)
    for t in range(2, n):
        log_x[t] = np.log(100) + 0.5 * (log_x[t - 1] - np.log(100)) + 0.3 * (log_x[t - 2] - np.log(100)) \
            - 0.8 * u[t - 1] + rng.normal(0, 0.02, workers)
    models = {"narx": NARXThroughput(warmup=20), "ewma": EWMAThroughput(), "last": LastValue()}
    errors: dict[str, list[float]] = {m: [] for m in models}
    for t in range(n):
        reports = [Report("ar", w, t, 100, 100 / float(np.exp(log_x[t, w])),
                          features={"colocated_load": float(u[t, w])}) for w in range(workers)]
        for name, model in models.items():
            if t > 150:
                errors[name].extend(np.abs(model.predict(range(workers)) / np.exp(log_x[t]) - 1))
            model.partial_fit(reports)
    mape = {name: float(np.mean(e)) for name, e in errors.items()}
    assert mape["narx"] <= 0.8 * min(mape["ewma"], mape["last"]), mape


def test_narx_reads_process_cpu_per_core_so_a_bigger_host_forecasts_alike() -> None:
    """The same run reported from a 2-core and a 64-core host (proc_cpu and cores both x32) gets the same
    forecasts: proc_cpu in cores, fed raw, swamped the network on big hosts (MAPE above EWMA's at x64)."""
    rng = np.random.default_rng(3)
    n, workers = 200, 4
    share = np.clip(0.9 - 0.4 * (rng.random((n, workers)) < 0.3) + rng.normal(0, 0.03, (n, workers)), 0.2, 1.0)
    forecasts = []
    for cores in (2.0, 64.0):
        model = NARXThroughput(warmup=10)
        for t in range(n):
            model.partial_fit([Report("host", w, t, 100, 1.0 / share[t, w],
                                      features={"proc_cpu": share[t, w] * cores, "cores": cores})
                               for w in range(workers)])
        forecasts.append(model.predict(range(workers)))
    np.testing.assert_allclose(forecasts[0], forecasts[1], rtol=1e-9)


def test_cold_start_gives_a_new_worker_the_speed_of_similar_hardware() -> None:
    policy = LBBSPPolicy(EWMAThroughput(), deadband=0)
    policy.observe([Report("c", 0, 0, 100, 1.0, device="cuda:0", features={"cores": 8.0}),
                    Report("c", 1, 0, 100, 0.1, device="cpu", features={"cores": 32.0}),
                    Report("c", 2, 0, 0, 0.0, device="cuda:1", features={"cores": 8.0})])  # announces itself
    assert policy.model.predict([2])[0] == pytest.approx(100.0)
    sizes = policy.decide(1, (300, 300, 300), JobConfig("c", 3, 900))
    assert sizes.sizes[1] > sizes.sizes[0] > 0 and sizes.sizes[2] == sizes.sizes[0]


def test_auto_model_picks_per_kind_and_can_be_overridden() -> None:
    gpu = Report("m", 0, 0, 64, 0.1, device="cuda:0", features={"gpu_mem_used": 2e9, "gpu_mem_free": 1e10})
    cpu = Report("m", 1, 0, 64, 0.4, features={"cpu_util": 0.5})
    fl = Report("m", 2, 0, 64, 0.4, features={"download_s": 1.0})
    assert [worker_kind(r) for r in (gpu, cpu, fl)] == ["gpu", "cpu", "fl"]
    assert worker_kind(Report("m", 3, 0, 64, 0.1, device=" CUDA:1")) == "gpu"  # as hardware_of reads the device
    model = AutoCapacityModel(models={"cpu": LastValue()}, kinds={2: "cpu"}).partial_fit([gpu, cpu, fl])
    assert isinstance(model.models_["gpu"], BatchTimeCurve) and model.kind_ == {0: "gpu", 1: "cpu", 2: "cpu"}
    np.testing.assert_allclose(model.predict([0, 1, 2]), [640, 160, 160])
    sizes = allocate(model.time_model([0, 1, 2]), 300, [1] * 3, [300] * 3)
    assert sizes.sum() == 300 and sizes[0] > sizes[1]
    # before its first report, a worker pinned by kinds= is answered by its kind's model (the GPU's prior,
    # 640 samples/s), not by the most common kind's (the CPUs', 160)
    two_cpus = [gpu, cpu, Report("m", 4, 0, 64, 0.4)]
    pinned = AutoCapacityModel(kinds={3: "gpu"}).partial_fit(two_cpus)
    np.testing.assert_allclose([pinned.predict([3])[0], pinned.predict([5])[0]], [640, 160])
    np.testing.assert_allclose(AutoCapacityModel().partial_fit(two_cpus).predict([3]), [160])


def test_auto_model_leaves_the_kind_of_a_bare_announcement_open() -> None:
    """A federated client that first announces itself (nothing measured, hardware only) is not fixed as a CPU
    worker: its later reports reach the client model, which answers with its transfer (60 s a round here); the
    client model knew its hardware from the announcement, so before that it had the phones' prior."""
    model = AutoCapacityModel(models={"fl": FLClientModel(local_steps=5)})
    phone = {"cores": 8.0, "download_s": 30.0, "upload_s": 30.0}
    model.partial_fit([Report("j", 0, 0, 0, 0.0, device="android", features={"cores": 8.0}),
                       Report("j", 1, 0, 100, 1.0, device="android", features=phone)])
    assert model.models_["fl"].hardware_[0] == ("android", 8)
    np.testing.assert_allclose(model.time_model([0]).time(np.array([20])), [61.0])  # the phones' prior
    model.partial_fit([Report("j", w, 1, 100, 1.0, device="android", features=phone) for w in (0, 1)])
    assert model.kind_ == {0: "fl", 1: "fl"}
    np.testing.assert_allclose(model.time_model([0, 1]).time(np.array([20, 20])), [61.0, 61.0])


def test_auto_model_routes_a_worker_that_only_announced_itself_by_its_hardware() -> None:
    """A CPU worker that announces itself (nothing measured, no GPU features) in a job of mostly GPUs had been
    routed to the GPUs' model and given an A100's share, 251 samples where its CPU peers got 9, and the next
    iteration lasted 26x as long. Its hardware's peers decide, then its device family's, then the job's most
    common kind."""
    a100 = [Report("j", w, 0, 170, 0.016, device="cuda:A100", features={"cores": 8.0}) for w in range(3)]
    cpus = [Report("j", w, 0, 170, 0.425, features={"cores": 8.0}) for w in (3, 4)]
    newcomers = [Report("j", 5, 0, 0, 0.0, features={"cores": 8.0}),  # the CPUs' hardware
                 Report("j", 6, 0, 0, 0.0, features={"cores": 64.0}),  # the CPUs' device family
                 Report("j", 7, 0, 0, 0.0, device="tpu", features={"cores": 8.0})]  # nobody's: the most common kind
    policy = LBBSPPolicy(deadband=0)
    policy.observe(a100 + cpus + newcomers)
    model = policy.model
    assert isinstance(model, AutoCapacityModel) and 5 not in model.kind_
    np.testing.assert_allclose(model.predict([5, 6, 7]), [400.0, 400.0, 10625.0], rtol=0.01)
    sizes = policy.decide(2, JobConfig("j", 8, 1024).initial_sizes(), JobConfig("j", 8, 1024)).sizes
    assert sizes[3] == sizes[5] == sizes[6] < 20 and sizes[7] == sizes[0] > 200 and sum(sizes) == 1024


def test_auto_model_moves_a_cpu_worker_that_starts_reporting_gpu_memory_to_the_gpu_model() -> None:
    """Its model moved to a GPU mid-run: it had stayed with NARX for good, 18 iterations to reach its share and never
    a memory cap. A worker pinned to the CPUs stays there."""
    gpu = {"gpu_mem_used": 2e9 + 1e7 * 64, "gpu_mem_free": 14e9 - 1e7 * 64}
    model = AutoCapacityModel(kinds={2: "cpu"})
    for k in range(4):
        model.partial_fit([Report("j", w, k, 64, 0.64) for w in range(3)])
    assert model.kind_ == {0: "cpu", 1: "cpu", 2: "cpu"} and model.max_batch([0, 1, 2]) is None
    model.partial_fit([Report("j", 0, 4, 64, 0.064, device="cuda:A100", features=gpu),
                       Report("j", 1, 4, 64, 0.64), Report("j", 2, 4, 64, 0.064, device="cuda:A100", features=gpu)])
    assert model.kind_ == {0: "gpu", 1: "cpu", 2: "cpu"}
    assert model.predict([0])[0] == pytest.approx(1000.0) and model.max_batch([0])[0] < 2000
    assert model.hardware_[0][0] == "cuda:a100"  # peers by hardware now count it among the A100s


def test_auto_model_moves_a_gpu_worker_that_reports_from_the_cpu_to_the_cpu_model() -> None:
    """A GPU worker whose model fell back to the CPU had stayed on the GPU curve for good, planned at its GPU speed
    under a GPU's memory cap; an announcement from the CPU, measuring nothing, does not move it."""
    gpu = {"gpu_mem_used": 2e9 + 1e7 * 64, "gpu_mem_free": 14e9 - 1e7 * 64}
    model = AutoCapacityModel(kinds={2: "gpu"})
    for k in range(4):
        model.partial_fit([Report("j", w, k, 64, 0.064, device="cuda:A100", features=gpu) for w in range(3)])
    assert model.kind_ == {0: "gpu", 1: "gpu", 2: "gpu"}
    model.partial_fit([Report("j", 0, 4, 0, 0.0), Report("j", 1, 4, 64, 0.064, device="cuda:A100", features=gpu),
                       Report("j", 2, 4, 64, 0.64)])
    assert model.kind_ == {0: "gpu", 1: "gpu", 2: "gpu"}  # 0 only announced itself; 2 is pinned
    model.partial_fit([Report("j", 0, 5, 64, 0.64, features={"cores": 8.0}),
                       Report("j", 1, 5, 64, 0.064, device="cuda:A100", features=gpu)])
    assert model.kind_[0] == "cpu" and model.hardware_[0] == ("cpu", 8.0)
    assert model.predict([0])[0] == pytest.approx(100.0)
    assert model.max_batch([0, 1])[0] > 10**9 > model.max_batch([0, 1])[1]  # no GPU cap on it any more


def test_auto_model_plans_the_first_gpu_of_a_cpu_job_at_the_jobs_median_speed() -> None:
    """A GPU that announced itself in a CPU job, its kind's model having measured nothing, had been planned at
    1 sample/s (the curve's fallback) and given 1 sample, with a predicted finish of 128 s where the iteration
    took 0.43 s; it now runs at the job's median speed until it reports."""
    config = JobConfig("j", 4, 512)
    policy = LBBSPPolicy(deadband=0)
    policy.observe([Report("j", w, 0, 170, 0.425, features={"cores": 8.0}) for w in range(3)]
                   + [Report("j", 3, 0, 0, 0.0, device="cuda:A100", features={"cores": 8.0})])
    assert policy.model.predict([3])[0] == pytest.approx(400.0)
    decision = policy.decide(2, config.initial_sizes(), config)
    assert decision.sizes == (128, 128, 128, 128) and "predicted finish 0.32s" in decision.reason


@pytest.mark.parametrize("factory", [LastValue, EWMAThroughput, TimeWeightedThroughput, NARXThroughput, BatchTimeCurve,
                                     FLClientModel, AutoCapacityModel])
def test_contract(factory: type) -> None:
    model = factory()
    with pytest.raises(sklearn.exceptions.NotFittedError):  # ours, also scikit-learn's
        model.predict([0])
    model.fit([[Report("c", 0, 0, 10, 0.1)], [Report("c", 0, 1, 10, 0.1)]])
    assert model.predict([0])[0] == pytest.approx(100.0, rel=0.05)
    fresh = sklearn.base.clone(model)  # the parameters, none of the learned state
    assert type(fresh) is type(model) and fresh.get_params().keys() == model.get_params().keys()
    learned = [name for name in vars(model) if name.endswith("_") and not name.startswith("_")]
    assert learned and not any(name in vars(fresh) for name in learned)
    assert fresh.set_params(**fresh.get_params(deep=False)) is fresh
    for ask in (model.predict, model.time_model, model.max_batch):  # numpy would answer -1 with the last worker
        with pytest.raises(ConfigError, match="worker ids must be >= 0, got -1"):
            ask([0, -1])
    # fit also takes one flat list of reports (scikit-learn's fit takes all the data at once), by iteration
    history = [[Report("c", w, k, 10, 0.1 * (w + 1) * (1 + k % 3)) for w in range(3)] for k in range(6)]
    flat = [report for reports in reversed(history) for report in reports]
    nested = sklearn.base.clone(model).fit(history).predict([0, 1, 2])
    assert sklearn.base.clone(model).fit(flat).predict([0, 1, 2]) == pytest.approx(nested)
    with pytest.raises(TypeError, match="mixes reports with lists"):
        model.fit([history[0][0], history[1]])
    # partial_fit takes one report alone as a list of one, and names what is not a report
    alone, listed = sklearn.base.clone(model), sklearn.base.clone(model)
    for reports in history:
        for report in reports:
            alone.partial_fit(report)
            listed.partial_fit([report])
    assert alone.predict([0, 1, 2]) == pytest.approx(listed.predict([0, 1, 2]))
    with pytest.raises(TypeError, match="got a dict in it"):
        sklearn.base.clone(model).partial_fit([history[0][0], {"worker": 1}])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="got str"):
        sklearn.base.clone(model).partial_fit(history[0][0].to_json().decode())  # type: ignore[arg-type]


@pytest.mark.parametrize(("factory", "bad", "shaping", "tuning"), [
    (EWMAThroughput, {"alpha": 0.0}, None, {"alpha": 0.9}),
    (TimeWeightedThroughput, {"alpha": 1.5}, None, {"alpha": 0.9}),
    (FLClientModel, {"local_steps": 0}, None, {"alpha": 0.9}),
    (BatchTimeCurve, {"window": 1}, {"window": 4}, {"half_life": 5.0}),
    (NARXThroughput, {"hidden": "16"}, {"lags": 6}, {"learning_rate": 1e-2}),
    (AutoCapacityModel, {"kinds": {0: "tpu"}}, {"horizon": 1}, None),
])
def test_set_params_is_checked_and_takes_effect(factory: type, bad: dict, shaping: dict | None,
                                               tuning: dict | None) -> None:
    """set_params on a fitted model: a bad value is refused at once and changes nothing; a parameter that shapes
    what was learned is not silently ignored (the model forgets, and relearns with it); any other keeps state."""
    history = [[Report("c", w, k, 10, 0.1 * (w + 1)) for w in range(3)] for k in range(12)]
    model = factory().fit(history)
    (name, value), = bad.items()
    with pytest.raises(ConfigError, match=name):
        model.set_params(**bad)
    assert model.get_params()[name] == factory().get_params()[name]
    assert model.predict([0, 1, 2]) == pytest.approx([100.0, 50.0, 33.33], rel=0.05)  # still fitted, as before
    if tuning is not None:
        assert model.set_params(**tuning).predict([0]) == pytest.approx([100.0], rel=0.05)
    if shaping is not None:
        with pytest.raises(sklearn.exceptions.NotFittedError):
            model.set_params(**shaping).predict([0])
        model.fit(history)
        assert model.predict([0, 1, 2]) == pytest.approx([100.0, 50.0, 33.33], rel=0.05)
        assert model.get_params()[next(iter(shaping))] == next(iter(shaping.values()))


def test_set_params_reshapes_what_is_learned() -> None:
    """A new ``lags`` or ``window`` is what the model then uses (it used to keep its old shapes, unlike get_params)."""
    history = [[Report("c", 0, k, 10, 0.1)] for k in range(5)]
    narx = NARXThroughput().fit(history).set_params(lags=7)
    curve = BatchTimeCurve().fit(history).set_params(window=3)
    for reports in history:
        narx.partial_fit(reports)
        curve.partial_fit(reports)
    assert narx.log_thr_.shape == (1, 7) and curve.slot_size_.shape == (1, 3)


@pytest.mark.parametrize("reports", [[Report("a", 0, 0, 0, 0.0, device="cuda:0")], [Report("a", 0, 0, 10, 0.0)]],
                         ids=["announcement", "no-time"])
def test_gpu_curve_answers_after_reports_that_measured_nothing(reports: list[Report]) -> None:
    """A GPU job's first iteration may bring only announcements: the curve then knows nothing, like any model,
    instead of failing on tables it has not made yet; before any report it says it is not fitted."""
    with pytest.raises(NotFittedError):
        BatchTimeCurve().time_model([0])
    model = BatchTimeCurve().partial_fit(reports)
    assert np.isnan(model.predict([0, 3])).all()
    assert (model.time_model([0, 3]).time(np.array([4.0, 4.0])) > 0).all()
    assert (model.max_batch([0, 3]) > 1e9).all()
    np.testing.assert_array_equal(model.explore([0, 3], np.array([5, 5]), np.array([1, 1]), np.array([9, 9])), [5, 5])


def test_gpu_cold_start_caps_a_new_worker_at_what_its_hardware_holds() -> None:
    """Two fast cards that hold 98 samples and a slow big card; a third fast card announces itself: before it
    measures anything it is capped like its peers, not given the samples they cannot hold (an out-of-memory
    first iteration); a card of hardware never seen stays uncapped."""
    speed, total, cores = {"a": 4000.0, "b": 500.0}, {"a": 11.5e9, "b": 40e9}, {"a": 8.0, "b": 16.0}

    def report(worker: int, iteration: int, size: int, card: str) -> Report:
        used = 1.5e9 + 1e8 * size
        return Report("g", worker, iteration, size, 0.01 + size / speed[card], device="cuda:0",
                      features={"gpu_mem_used": used, "gpu_mem_free": total[card] - used, "cores": cores[card]})

    config = JobConfig("g", 5, 400)
    policy = LBBSPPolicy(BatchTimeCurve())
    sizes = [100, 100, 200]
    for k in range(10):
        policy.observe([report(w, k, sizes[w], card) for w, card in enumerate("aab")])
        sizes = list(policy.decide(k + 1, (*sizes, 0, 0), config).sizes[:3])
        sizes[2] += 400 - sum(sizes)
    policy.observe([Report("g", 3, 10, 0, 0.0, device="cuda:1", features={"cores": 8.0}),
                    Report("g", 4, 10, 0, 0.0, device="cuda:1", features={"cores": 4.0})])
    caps = policy.model.max_batch(range(5))
    assert caps[0] == caps[1] == caps[3] == 98 and caps[4] > 1e9
    assert policy.decide(11, (*sizes, 0, 0), config).sizes[3] <= 98


def test_auto_model_clones_the_models_it_is_given() -> None:
    """``models`` is a parameter, stored unchanged: two models built from the same parameters learn apart,
    and fit forgets what an earlier fit taught them."""
    given = LastValue()
    first = AutoCapacityModel(models={"cpu": given})
    second = AutoCapacityModel(**first.get_params())
    first.partial_fit([Report("a", 0, 0, 10, 0.1)])
    second.partial_fit([Report("a", 1, 0, 10, 1.0)])
    assert not hasattr(given, "throughput_")
    np.testing.assert_allclose(first.predict([0, 1]), [100.0, 100.0])  # worker 1: the prior, not second's 10
    first.fit([[Report("a", 2, 0, 10, 0.5)]])
    np.testing.assert_allclose(first.predict([0, 2]), [20.0, 20.0])
    with pytest.raises(ConfigError, match="cpu"):
        AutoCapacityModel(models={"cpu": None}).partial_fit([Report("a", 0, 0, 10, 0.1)])  # type: ignore[dict-item]


def test_auto_model_routes_a_worker_never_seen_the_same_way_in_every_process() -> None:
    """A worker never seen joins the most common kind, ties broken in the order cpu, gpu, fl (it was the order
    of a set of strings, which changes with PYTHONHASHSEED); alone, it joins the job's most common kind."""
    code = ("from lbbsp.models import AutoCapacityModel\nfrom lbbsp.protocol import Report\n"
            "m = AutoCapacityModel().partial_fit([Report('m', 0, 0, 10, 0.1), Report('m', 1, 0, 64, 0.2, device='cuda'),"
            " Report('m', 2, 0, 10, 0.3, features={'download_s': 0.5})])\nprint(m.predict([0, 1, 2, 3])[3])")
    answers = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                              capture_output=True, text=True, check=True).stdout for seed in (0, 1, 5)}
    assert len(answers) == 1 and float(answers.pop()) == pytest.approx(100.0)
    gpus = AutoCapacityModel().partial_fit([Report("m", w, 0, 64, 0.2, device="cuda") for w in range(2)]
                                           + [Report("m", 2, 0, 10, 0.1)])
    assert gpus.predict([7])[0] == pytest.approx(320.0)  # the GPUs' prior, not a CPU model that knows no worker
    assert gpus.max_batch([7]) is not None


@pytest.mark.parametrize("params", [{"window": 1}, {"memory_margin": -0.1}, {"memory_floor": 1.0},
                                    {"explore_fraction": -0.1}, {"explore_fraction": 1.0},
                                    {"explore_fraction": float("nan")}, {"half_life": 0.0}])
def test_gpu_curve_rejects_bad_parameters_at_first_fit(params: dict) -> None:
    with pytest.raises(ConfigError):
        BatchTimeCurve(**params).partial_fit([Report("b", 0, 0, 10, 0.1, device="cuda")])


def test_auto_model_decides_before_a_pinned_kind_has_reported() -> None:
    """A worker pinned to a kind whose model has no report yet is taken with the others, not a NotFittedError
    (which kept every split as it was until that worker reported)."""
    gpu = {"gpu_mem_used": 2e9, "gpu_mem_free": 14e9}
    model = AutoCapacityModel(kinds={1: "cpu", 2: "cpu"})
    model.partial_fit([Report("j", 0, 0, 100, 0.5, features=gpu, device="cuda:0"),
                       Report("j", 3, 0, 100, 0.25, features=gpu, device="cuda:1")])
    np.testing.assert_allclose(model.predict([0, 1, 2, 3]), [200.0, 300.0, 300.0, 400.0])  # the GPUs' median
    assert model.time_model([0, 1, 2, 3]).time(np.array([100, 100, 100, 100])).shape == (4,)
    model.partial_fit([Report("j", 1, 1, 100, 1.0), Report("j", 2, 1, 100, 1.0)])
    np.testing.assert_allclose(model.predict([1, 2]), [100.0, 100.0], rtol=0.05)


def test_auto_model_refit_forgets_how_it_grouped_workers() -> None:
    model = AutoCapacityModel()
    gpu = {"gpu_mem_used": 2e9, "gpu_mem_free": 14e9}
    model.fit([[Report("j", w, 0, 100, 0.5, features=gpu, device="cuda:0") for w in (0, 1)]])
    assert model.max_batch([0, 1]) is not None
    model.fit([[Report("j", w, 0, 0, 0.0) for w in (0, 1)]])  # bare CPU announcements: nothing claims them
    assert model.max_batch([0, 1]) is None  # the GPU grouping of the first fit would cap them


@pytest.mark.parametrize("model", [
    EWMAThroughput(alpha="0.5"), TimeWeightedThroughput(alpha=0), BatchTimeCurve(memory_floor=None),
    FLClientModel(model_bytes="1e6"),
    NARXThroughput(learning_rate="1"), NARXThroughput(warmup=None), NARXThroughput(random_state=-1),
    NARXThroughput(learning_rate=float("inf")), AutoCapacityModel(kinds=[0]), AutoCapacityModel(horizon=0),
    AutoCapacityModel(kinds={"1": "gpu"}), FLClientModel(local_steps=True),
], ids=repr)
def test_a_bad_model_parameter_is_a_config_error_that_names_it(model: CapacityModel) -> None:
    """They raised a bare TypeError or numpy's ValueError, failed later in predict, or were taken silently (a
    string worker id in kinds was never applied; an infinite learning rate; horizon 0 in a GPU-only job)."""
    default = type(model)().get_params(deep=False)
    bad = next(name for name, value in model.get_params(deep=False).items()
               if type(value) is not type(default[name]) or value != default[name])
    with pytest.raises(ConfigError, match=bad):
        model.partial_fit([Report("c", 0, 0, 10, 0.1)])


def test_numpy_integers_are_integer_parameters() -> None:
    """As JobConfig and the policies take them: 'window must be an integer >= 2, got np.int64(8)'."""
    for model in (BatchTimeCurve(window=np.int64(8)), FLClientModel(local_steps=np.int64(3)),
                  NARXThroughput(lags=np.int64(4), horizon=np.int64(2), hidden=(np.int64(8),), buffer_size=np.int64(64))):
        assert np.isfinite(model.partial_fit([Report("c", 0, 0, 10, 0.1)]).predict([0])).all()


def test_auto_model_after_reports_that_measured_nothing_answers_like_the_other_models() -> None:
    """Predicting after such reports had raised 'NARXThroughput has seen no report yet', naming a model the user
    never chose; the others answer NaN (no worker known), and the split is the equal one."""
    model = AutoCapacityModel().partial_fit([Report("a", 0, 0, 0, 0.0)])
    assert np.isnan(model.predict([0, 1])).all() and model.max_batch([0, 1]) is None
    assert allocate(model.time_model([0, 1]), 10, [1, 1], [10, 10]).tolist() == [5, 5]
    np.testing.assert_array_equal(model.explore([0, 1], np.array([5, 5]), np.ones(2), np.full(2, 9)), [5, 5])


def test_similar_hardware_prior_falls_back_from_hardware_to_device_family_to_everyone() -> None:
    values = {0: 100.0, 1: 300.0, 2: 1000.0, 3: float("nan")}
    hardware = {0: ("cpu", 8), 1: ("cpu", 8), 2: ("cuda", 16), 3: ("cuda", 16), 4: ("cpu", 64), 5: ("tpu", 4)}
    prior = similar_hardware_prior(values, hardware, [3, 4, 5, 6])
    # worker 3: its hardware's median (its own NaN is no value); 4: the cpu family's; 5 and 6: everyone's
    np.testing.assert_allclose(prior, [1000.0, 200.0, 300.0, 300.0])
    assert np.isnan(similar_hardware_prior({}, hardware, [0])).all()
    assert similar_hardware_prior({}, hardware, [0], default=1.0).tolist() == [1.0]


def test_perturb_pairs_moves_a_share_within_each_pair_and_keeps_the_sum_and_the_bounds() -> None:
    from lbbsp.models.gpu_curve import perturb_pairs  # noqa: PLC0415  (the model's helper)

    sizes = np.array([100, 100, 40, 60, 50])
    out = perturb_pairs(sizes, np.array([0, 1, 2, 3, 4]), 0.1, np.full(5, 1), np.array([200, 200, 200, 62, 200]))
    # pairs (0, 1) and (2, 3) shift round(0.1 x the smaller size): 10, and 4 cut to the 2 that 3's bound allows;
    # the odd worker out, 4, is left as it was
    assert out.tolist() == [90, 110, 38, 62, 50] and out.sum() == sizes.sum()


def test_a_model_with_a_bad_parameter_fails_where_the_policy_is_made() -> None:
    """EWMAThroughput(alpha=5) had been accepted: every decision of the running job then failed, was logged, and
    kept the equal split, so the job ran as plain BSP."""
    with pytest.raises(ConfigError, match="alpha"):
        LBBSPPolicy(EWMAThroughput(alpha=5))


def _cpu_history(iterations: int, start: int = 0) -> list[list[Report]]:
    rng = np.random.default_rng(start)
    return [[Report("j", w, k, 100, float(rng.uniform(0.5, 1.5)) * (1 + w), features={"cpu_util": 0.5})
             for w in range(3)] for k in range(start, start + iterations)]


@pytest.mark.parametrize("model, change", [(BatchTimeCurve(), {"window": 4, "windw": 3}),
                                           (NARXThroughput(), {"lags": 6, "lag": 1})], ids=["gpu", "narx"])
def test_a_misspelt_parameter_changes_nothing(model: BatchTimeCurve | NARXThroughput,
                                              change: dict[str, int]) -> None:
    model.fit([[Report("j", w, k, 10 + k, 0.1, device="cuda:0") for w in range(2)] for k in range(4)])
    before = model.get_params()
    misspelt = next(name for name in change if name not in before)
    with pytest.raises(ValueError, match=f"Invalid parameter '{misspelt}' for {type(model).__name__}; valid") as raised:
        model.set_params(**change)
    assert "=" not in str(raised.value)  # scikit-learn's message showed the model with the valid value set
    assert model.get_params() == before  # the valid name had been set, without the forgetting it needs
    model.partial_fit([Report("j", 5, 9, 20, 0.1, device="cuda:0")])  # the GPU curve had crashed here


def test_set_params_still_refuses_a_bad_value() -> None:
    model = BatchTimeCurve().fit([[Report("j", 0, 0, 10, 0.1, device="cuda:0")]])
    with pytest.raises(ConfigError, match="memory_margin"):
        model.set_params(memory_margin=1.5)
    assert model.memory_margin == 0.05


@pytest.mark.parametrize("ids", [[0.9, 1.9], ["1"], [True, False]], ids=["floats", "strings", "bools"])
def test_worker_ids_that_are_not_integers_are_refused(ids: list[object]) -> None:
    model = LastValue().fit([[Report("j", w, 0, 10, 0.1) for w in range(2)]])
    with pytest.raises(ConfigError, match="worker ids must be integers"):
        model.predict(ids)  # type: ignore[arg-type]  (0.9 had been read as worker 0)
    assert model.predict([]).size == 0 and model.predict(np.arange(2)).size == 2


@pytest.mark.parametrize(("ids", "said"), [
    ([1, 2**70], "worker ids must be integers in [0, 2**63 - 1], got 1180591620717411303424"),
    ([None, 3], "worker ids must be integers, got object values such as None"),
], ids=["past-uint64", "none-beside-an-int"])
def test_a_worker_id_too_large_for_numpy_is_named_as_too_large(ids: list[object], said: str) -> None:
    """2**70 had been called no integer ("got object values such as 1", the first id, an integer)."""
    model = LastValue().fit([[Report("j", w, 0, 10, 0.1) for w in range(2)]])
    with pytest.raises(ConfigError) as raised:
        model.predict(ids)  # type: ignore[arg-type]
    assert str(raised.value) == said


def test_an_equal_list_for_a_tuple_parameter_forgets_nothing() -> None:
    """hidden=[16, 16] equals the default (16, 16): a fitted NARX had taken it as new and forgotten everything."""
    model = NARXThroughput().fit(_cpu_history(20))
    before = model.predict([0, 1])
    model.set_params(hidden=[16, 16], features=list(model.features))
    np.testing.assert_array_equal(model.predict([0, 1]), before)
    with pytest.raises(NotFittedError):  # a new value still makes it relearn
        model.set_params(hidden=[8]).predict([0])


@pytest.mark.parametrize("model", [LastValue(), EWMAThroughput(), TimeWeightedThroughput(), NARXThroughput(),
                                   BatchTimeCurve(), FLClientModel(), AutoCapacityModel()],
                         ids=lambda m: type(m).__name__)
def test_an_iteration_nobody_reported_in_leaves_a_model_unfitted_and_a_table_of_ids_is_refused(model) -> None:  # type: ignore[no-untyped-def]
    """predict had answered NaN after partial_fit([]) (docs: NotFittedError before any report), and flattened a
    2-D array of ids into four predictions."""
    model.partial_fit([])
    with pytest.raises(NotFittedError):
        model.predict([0])
    model.partial_fit([Report("j", w, 0, 100, 0.5, device="cpu") for w in range(2)]).partial_fit([])
    assert model.predict([0, 1]).shape == (2,) and model.predict(1).shape == (1,)
    with pytest.raises(ConfigError, match=r"1-D sequence .* shape \(2, 2\)"):
        model.predict([[0, 1], [1, 0]])


@pytest.mark.parametrize("model", [LastValue, EWMAThroughput, TimeWeightedThroughput, NARXThroughput, BatchTimeCurve,
                                   FLClientModel, AutoCapacityModel])
def test_reports_of_several_iterations_are_learned_in_iteration_order(model: type) -> None:
    # a worker's last report is its latest: given out of order, iteration 4 had overwritten iteration 5
    history = _cpu_history(12)
    flat = [report for reports in history for report in reports]
    rng = np.random.default_rng(0)
    in_order, shuffled = model().partial_fit(flat), model().partial_fit([flat[i] for i in rng.permutation(len(flat))])
    np.testing.assert_allclose(shuffled.predict([0, 1, 2]), in_order.predict([0, 1, 2]))
    latest = LastValue().partial_fit(list(reversed(flat)))
    np.testing.assert_allclose(latest.predict([0, 1, 2]), [r.samples / r.compute_s for r in history[-1]])


@pytest.mark.parametrize("model", [EWMAThroughput(), TimeWeightedThroughput(), NARXThroughput(), FLClientModel()])
def test_an_unsigned_id_above_the_int64_range_is_named_as_given(model: EWMAThroughput) -> None:
    """np.uint64(2**64 - 1) had been cast to -1 and refused as 'worker ids must be >= 0, got -1'."""
    model.partial_fit(_reports(range(2)))
    np.testing.assert_allclose(model.predict(np.array([0, 1], dtype=np.uint64)), model.predict([0, 1]))
    for ids in (np.array([1, 2**64 - 1], dtype=np.uint64), [2**63]):
        with pytest.raises(ConfigError, match=f"got {max(ids)}"):
            model.predict(ids)


@pytest.mark.parametrize("build", [EWMAThroughput, TimeWeightedThroughput, LastValue,
                                   lambda: NARXThroughput(random_state=0),
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


def test_fit_refuses_scikit_learns_x_and_y_in_its_own_name() -> None:
    with pytest.raises(TypeError, match=r"not fit\(X, y\)"):
        EWMAThroughput().fit(np.ones((3, 2)), np.ones(3))
    with pytest.raises(TypeError, match="^fit takes a list of lbbsp.Report"):  # it had named partial_fit
        EWMAThroughput().fit(np.ones((3, 2)))


def test_a_model_that_forgot_for_a_new_parameter_says_so() -> None:
    history = [Report("j", 0, k, 8 + k, 0.1, device="cuda:0") for k in range(3)]
    model = BatchTimeCurve().fit(history).set_params(window=4)
    with pytest.raises(NotFittedError, match="forgot what it had learned when set_params changed window"):
        model.predict([0])
    assert np.isfinite(model.fit(history).predict([0])).all()
    with pytest.raises(NotFittedError, match="has seen no report yet"):
        BatchTimeCurve().predict([0])


def test_ewma_blends_at_its_alpha() -> None:
    model = EWMAThroughput(alpha=0.2).partial_fit([Report("g", 0, 0, 100, 1.0)]).partial_fit([Report("g", 0, 1, 200, 1.0)])
    assert model.predict([0])[0] == pytest.approx(120.0)


def test_time_weighted_throughput_is_smoothed_samples_over_smoothed_seconds() -> None:
    """A worker that did 100 samples in 1 s, then 100 in 0.25 s: 400/s counts by its 0.25 s, not as a whole step
    (EWMAThroughput: 0.5 x 100 + 0.5 x 400 = 250/s); an empty step says nothing; workers are apart."""
    model = TimeWeightedThroughput()
    model.partial_fit([Report("g", 0, 0, 100, 1.0), Report("g", 1, 0, 50, 1.0)])
    model.partial_fit([Report("g", 0, 1, 100, 0.25), Report("g", 1, 1, 0, 0.0)])
    np.testing.assert_allclose(model.predict([0, 1]), [100 / 0.625, 50.0])


def test_a_worker_with_no_forecast_is_planned_at_the_median_speed() -> None:
    class Partial(CapacityModel):
        def partial_fit(self, reports, *, defer=False):  # type: ignore[no-untyped-def]
            return self

        def predict(self, workers):  # type: ignore[no-untyped-def]
            return np.array([10.0, np.nan, 30.0])

    assert Partial().time_model([0, 1, 2]).speed.tolist() == [10.0, 20.0, 30.0]


def test_a_report_of_samples_in_no_time_measured_nothing() -> None:
    """A report with samples but compute_s 0 is not a measurement (its throughput would be infinite): the speed stays
    the last one measured."""
    model = LastValue()
    model.partial_fit([Report("j", 0, 0, 100, 1.0)])
    model.partial_fit([Report("j", 0, 1, 100, 0.0)])
    assert model.predict([0])[0] == pytest.approx(100.0)


def test_fields_match_the_reports_and_are_shared_read_only() -> None:
    reports = as_reports(_mixed_reports())
    assert field(reports, "worker").tolist() == list(range(6))
    assert field(reports, "samples").tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert field(reports, "device") == ["cpu", "cuda:0"] * 3
    assert field(reports, "worker") is field(reports, "worker")  # read once
    memory = feature(reports, "gpu_mem_used")
    assert np.isnan(memory[::2]).all() and (memory[1::2] == 1e9).all()
    assert feature(reports, "cores", 1.0).tolist() == [4.0, 1.0, 4.0, 1.0, 4.0, 1.0]
    with pytest.raises(ValueError):  # shared by every reader: nobody may change it in place
        field(reports, "samples")[0] = 5.0


def test_a_subset_keeps_order_and_the_arrays_read() -> None:
    reports = as_reports(_mixed_reports())
    field(reports, "compute_s")
    part = reports.subset(np.array([1, 4, 5]))
    assert type(part) is CheckedReports and [r.worker for r in part] == [1, 4, 5]
    assert field(part, "compute_s").tolist() == pytest.approx([0.2, 0.5, 0.6])
    assert field(part, "iteration").tolist() == [7, 7, 7]


def test_reports_out_of_iteration_order_are_sorted_and_read_afresh() -> None:
    given = [Report("cols", 0, 8, 1, 0.1), Report("cols", 1, 7, 1, 0.1), Report("cols", 0, 7, 1, 0.1)]
    reports = as_reports(given)
    assert field(reports, "iteration").tolist() == [7, 7, 8]
    assert [(r.worker, r.iteration) for r in reports] == [(1, 7), (0, 7), (0, 8)]  # a stable sort


def test_a_ragged_forecast_is_a_config_error_naming_the_model() -> None:
    """numpy refuses a ragged list outright (a ValueError): it is no numbers, said as the model's answer."""
    class Ragged(CapacityModel):
        def partial_fit(self, reports: Any, *, defer: bool = False) -> Ragged:
            return self

        def predict(self, workers: Any) -> Any:
            return [[10.0, 20.0], [30.0]]

    with pytest.raises(ConfigError, match=r"Ragged.predict returned \[\[10.0, 20.0\], \[30.0\]\], not numbers"):
        Ragged().time_model([0, 1])


class _Speeds(CapacityModel):
    """A model of one's own with an array parameter (its speeds), which ``==`` cannot read as one bool."""

    def __init__(self, speeds: np.ndarray | None = None) -> None:
        self.speeds = speeds

    def partial_fit(self, reports: Any, *, defer: bool = False) -> _Speeds:
        return self

    def predict(self, workers: Any) -> np.ndarray:
        return np.asarray(self.speeds, dtype=float)[np.asarray(workers)]

    def _parameters_changed(self, names: set[str]) -> None:
        self.changed_ = names


def test_a_new_array_parameter_is_taken_as_changed() -> None:
    """set_params compares old and new values with ==; for arrays that is no bool (numpy's "truth value of an array
    is ambiguous"), which had failed set_params after the value was set. Such a value is taken as changed."""
    model = _Speeds(np.array([10.0, 20.0]))
    assert model.set_params(speeds=np.array([30.0, 40.0])) is model
    assert model.changed_ == {"speeds"} and model.predict([0, 1]).tolist() == [30.0, 40.0]
