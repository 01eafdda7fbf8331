"""BatchTimeCurve: the time(batch) hinge fit and its knee, exploration, identical GPUs pooled and changes of speed
learnt, memory caps that hold under peak-held and changing readings, curves that survive long runs at one size, and a
decision path that leaves the knee search for after the write."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp import JobConfig, LBBSPPolicy, Report
from lbbsp.allocation import HingeTime
from lbbsp.errors import ConfigError
from lbbsp.models import BatchTimeCurve, fit_hinge, fit_memory_cap, gpu_curve
from lbbsp.models.gpu_curve import perturb_pairs
from lbbsp.sim.engine import run_policy
from lbbsp.sim.scenarios import GPUMix, Truth

GB = 1e9


def _report(iteration: int, size: int, seconds: float, used: float | None = None, total: float = 16 * GB,
            worker: int = 0) -> Report:
    memory = {} if used is None else {"gpu_mem_used": used, "gpu_mem_free": total - used}
    return Report("g", worker, iteration, size, seconds, device="cuda:0", features=memory)


def test_memory_cap_takes_the_line_through_the_origin_where_readings_barely_rise() -> None:
    """NVML's 'used' stays at the caching allocator's peak: one page more at twice the size is no slope of 41
    bytes per sample, which would have put the cap at 117 million samples."""
    sizes, valid, budget = np.array([[100.0, 200.0]]), np.ones((1, 2), bool), np.array([15.8 * GB])
    flat = fit_memory_cap(sizes, np.array([[11 * GB, 11 * GB]]), valid, budget)
    page_more = fit_memory_cap(sizes, np.array([[11 * GB, 11 * GB + 4096]]), valid, budget)
    assert flat[0] == page_more[0] == 287  # 15.8 GB at 11 GB / 200 samples


def test_memory_cap_holds_with_readings_held_at_the_peak() -> None:
    """Readings that never drop below the largest use so far flatten the least-squares line (1 GB + 40 MB per
    sample truly, 16 GB card: 375 samples); the cap stays within the card."""
    model = BatchTimeCurve()
    peak = 0.0
    for k, size in enumerate([100, 200, 150, 120, 180]):
        peak = max(peak, GB + 0.04 * GB * size)
        model.partial_fit([_report(k, size, 0.01 * size, peak)])
    assert model.max_batch([0])[0] <= 375


def test_memory_cap_errs_low_where_the_fitted_line_starts_below_zero() -> None:
    """1 GB at 100 samples, 3 GB at 200 on a 10 GB card: the line -1 GB + 20 MB per sample predicts more above
    200 than the line through the origin, which allowed 643 samples (11.9 GB by the fitted line)."""
    sizes, used, valid = np.array([[100.0, 200.0]]), np.array([[GB, 3 * GB]]), np.ones((1, 2), bool)
    budget = 3 * GB + 0.95 * 7 * GB
    cap = fit_memory_cap(sizes, used, valid, np.array([budget]))[0]
    assert -GB + 0.02 * GB * cap <= budget
    assert cap == 532


def test_memory_cap_follows_another_process_on_the_same_card() -> None:
    """Another process takes 6 GB of a worker's card while it stays at one size: the cap comes down to what
    is left (225 samples at 40 MB each) with the first report that shows it, not at the next new size."""
    model = BatchTimeCurve()
    for k, (size, other) in enumerate([(100, 0.0), (200, 0.0), (200, 6 * GB)]):
        model.partial_fit([_report(k, size, 0.01 * size, GB + 0.04 * GB * size + other)])
    assert model.max_batch([0])[0] <= 225


class _PeakHeldThrottled(GPUMix):
    """gpu-mix whose memory readings hold their peak (a caching allocator) and where every third GPU runs at
    0.4 of its speed in alternate spells of 40 iterations, so sizes go down and up again."""

    def features(self, iteration: int, sizes: np.ndarray) -> list[dict[str, float]]:
        out = super().features(iteration, sizes)
        used = np.array([f["gpu_mem_used"] for f in out])
        self.peak = np.maximum(getattr(self, "peak", used), used)
        return [{**f, "gpu_mem_used": p, "gpu_mem_free": t - p}
                for f, p, t in zip(out, self.peak.tolist(), self.total_bytes.tolist())]

    def truth(self, iteration: int) -> Truth:
        truth = super().truth(iteration)
        slow = (iteration // 40) % 2 == 1 and np.arange(self.speed.size) % 3 == 0
        factor = np.where(slow, 0.4, 1.0)
        curve = truth.time_model
        return Truth(HingeTime(curve.base / factor, curve.knee, curve.slope / factor, curve.observed_max),
                     max_batch=truth.max_batch)


@pytest.mark.parametrize("seed", [0, 2])
def test_gpu_mix_never_exceeds_memory_with_peak_held_readings(seed: int) -> None:
    scenario = _PeakHeldThrottled(16, 120, seed)
    run = run_policy(scenario, "lbbsp", LBBSPPolicy(scenario.capacity_model()), 120)
    assert run.over_memory == 0


def test_a_new_gpu_is_capped_by_the_memory_it_announces() -> None:
    """Two A100s measured on 32-core hosts (1.5 GB + 85 MB per sample of 40 GB) at 112 and 120 samples: sizes
    too close to follow their line far (it allowed 436), so the line through the origin caps them. A third on a
    64-core host announces its memory: it is capped at what its free memory holds at 97.5 MB per sample
    (measured at 120), not left uncapped for lack of peers with its exact hardware; one that announces nothing
    stays uncapped."""
    model = BatchTimeCurve()

    def features(size: int, cores: float) -> dict[str, float]:
        used = 1.5 * GB + 0.085 * GB * size
        return {"gpu_mem_used": used, "gpu_mem_free": 40 * GB - used, "cores": cores}

    for k, size in enumerate([112, 120]):
        model.partial_fit([Report("g", w, k, size, 0.1, features=features(size, 32.0), device="cuda:A100")
                           for w in range(2)])
    model.partial_fit([Report("g", 2, 1, 0, 0.0, device="cuda:A100",
                              features={"gpu_mem_used": 0.5 * GB, "gpu_mem_free": 39.5 * GB, "cores": 64.0}),
                       Report("g", 3, 1, 0, 0.0, device="cuda:A100", features={"cores": 16.0})])
    caps = model.max_batch([0, 1, 2, 3])
    assert caps[0] == caps[1] == 395  # (11.7 + 0.95 * 28.3) GB / (11.7 GB / 120)
    assert caps[2] == 384  # 0.95 * 39.5 GB / (11.7 GB / 120): the 0.5 GB in use is not planned on (it was 390)
    assert caps[3] > 1e9


def test_an_unknown_curve_is_the_proportional_line() -> None:
    """Two sizes 1% apart whose noise says the time falls with the size: not known yet, so the line through
    the origin (the docs' rule), not a flat curve that makes 50 samples cost as much as 100."""
    model = BatchTimeCurve()
    model.partial_fit([_report(0, 100, 1.00)])
    model.partial_fit([_report(1, 101, 0.99)])
    assert not model.known_[0]
    time = model.time_model([0]).time(np.array([50.0, 100.0]))
    assert time[0] == pytest.approx(time[1] / 2)


def test_no_exploration_at_explore_fraction_zero() -> None:
    model = BatchTimeCurve(explore_fraction=0.0).partial_fit([_report(0, 100, 0.1, worker=w) for w in range(4)])
    sizes = np.array([100, 100, 100, 100])
    np.testing.assert_array_equal(model.explore(range(4), sizes, np.zeros(4), np.full(4, 1000)), sizes)


def test_a_long_run_at_one_size_leaves_a_curve_that_still_slopes_and_is_explored_again() -> None:
    """Four sizes, then 1,200 iterations at 150: the other sizes' weight decays away, but the curve never turns
    flat (it was, from about 600 iterations on: then 75 samples took as long as 150 and the split never
    moved again); once its spread has decayed the curve is unknown and exploration moves samples again."""
    model = BatchTimeCurve()
    sizes = [100, 200, 120, 180] + [150] * 1200
    for k, size in enumerate(sizes):
        model.partial_fit([_report(k, size, 0.02 + 0.001 * size, worker=w) for w in range(2)])
        time = model.time_model([0]).time(np.array([75.0, 150.0]))
        assert time[0] < 0.8 * time[1], f"iteration {k}: flat curve {time}"
    assert not model.known_.any()
    explored = model.explore([0, 1], np.array([150, 150]), np.zeros(2), np.full(2, 300))
    assert explored.sum() == 300 and (explored != 150).all()


def test_a_fit_whose_other_sizes_have_decayed_away_is_the_line_through_the_origin() -> None:
    """Sums in which one size holds all but 1e-12 of the weight do not determine a slope: the line through the
    origin and that size, not a flat line at its time (which no later report at that size would undo)."""
    sizes = np.array([[100.0, 150.0]])
    sums = gpu_curve.hinge_sums(sizes, 0.02 + 0.001 * sizes, np.array([[1e-12, 30.0]]), np.zeros((1, 1)))
    base, slope, _ = gpu_curve.line_from_sums(sums)
    assert base[0] == 0 and slope[0] == pytest.approx(0.17 / 150)


def test_a_slowdown_after_a_long_steady_run_is_rebalanced_within_a_few_iterations() -> None:
    """Two equal GPUs held 800 iterations at 150 / 150, then one runs at half speed: two misses in a row against
    its slot say it changed, its curve is learnt afresh and the split reaches the best one, 93 / 207, within 6
    iterations (it stayed at 150 / 150 for good; then, with old and new times mixed in its slots read as a
    flat curve, at 143 / 157 for 175 iterations)."""
    config = JobConfig("g", 2, 300)
    policy = LBBSPPolicy(BatchTimeCurve(), hedge=None)
    rng = np.random.default_rng(0)
    sizes, plan, history = np.array([150, 150]), {}, []
    for k in range(830):
        slow = np.array([2.0 if k >= 800 else 1.0, 1.0])
        seconds = (0.02 + 0.001 * sizes) * slow * rng.lognormal(0, 0.002, 2)
        policy.observe([_report(k, int(sizes[w]), float(seconds[w]), worker=w) for w in range(2)])
        plan[k + 2] = np.array(policy.decide(k + 2, tuple(sizes.tolist()), config).sizes)
        policy.learn()
        sizes = plan.get(k + 1, sizes)
        history.append(int(sizes[0]))
    assert all(abs(size - 93) <= 2 for size in history[806:]), history[800:]


def test_one_slow_iteration_is_not_taken_for_a_change_of_speed() -> None:
    """A single measurement 3x its slot's time (a stall) is held out: the curve and the noise estimate stay as
    they were (averaged in, it bent the slope and multiplied the noise estimate by thousands)."""
    model, rng = BatchTimeCurve(), np.random.default_rng(0)
    for k in range(60):
        size = 100 + 10 * (k % 3)
        stall = np.array([3.0 if k == 50 else 1.0, 1.0])
        seconds = (0.02 + 0.001 * size) * stall * rng.lognormal(0, 0.002, 2)
        model.partial_fit([_report(k, size, float(seconds[w]), worker=w) for w in range(2)])
        if k == 49:
            slope, noise = model.slope_[0], model.noise_
    assert model.known_[0] and model.slope_[0] == pytest.approx(slope, rel=0.05)
    assert model.noise_ < 2 * noise


def test_deferred_learning_leaves_the_knee_search_for_after_the_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """partial_fit(defer=True) does no knee search (4 ms a call at 1,024 workers, on the decision's path);
    finish_learning does it, to the same curve as learning at once."""
    searches = []

    def counted(*args: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        searches.append(1)
        return fit_hinge(*args)

    fit_hinge = gpu_curve.fit_hinge
    monkeypatch.setattr(gpu_curve, "fit_hinge", counted)
    deferred, direct = BatchTimeCurve(), BatchTimeCurve()
    times = 0.05 + 0.004 * np.maximum(np.array([8, 24, 48, 96.0]) - 24, 0)
    for k, (size, seconds) in enumerate(zip([8, 24, 48, 96], times)):
        deferred.partial_fit([_report(k, size, seconds)], defer=True)
        assert not searches, "a knee search on the decision's path"
        direct.partial_fit([_report(k, size, seconds)])
        searches.clear()
        deferred.finish_learning()
        assert searches
        searches.clear()
    assert deferred.knee_[0] == direct.knee_[0] == 24
    np.testing.assert_allclose([deferred.base_, deferred.slope_], [direct.base_, direct.slope_])


def test_merged_slots_keep_whole_sizes_so_reports_find_them() -> None:
    """Sizes that wander by a few samples fill the window and merge: a merged slot sits at a whole size, so the
    next report of that size adds to it instead of counting as a new size (and a new knee search)."""
    rng = np.random.default_rng(0)
    model = BatchTimeCurve()
    for k in range(60):
        model.partial_fit([_report(k, int(112 + rng.integers(-6, 7)), 0.1)])
    present = model.slot_size_[model.slot_weight_ > 0]
    np.testing.assert_array_equal(present, np.round(present))


def test_identical_gpus_with_no_noise_at_all_keep_finite_curves() -> None:
    """Four identical cards timed exactly (a synthetic test, a replay): no spread beyond a noise of 0 made the
    pooling's share 0 / 0, the curves NaN, and decisions fail ('the time model predicted a non-finite time')."""
    config = JobConfig("g", 4, 1600)
    policy = LBBSPPolicy(BatchTimeCurve(), hedge=None)
    sizes = {0: config.initial_sizes(), 1: config.initial_sizes()}
    for k in range(8):
        policy.observe([Report("g", w, k, s, 0.002 * s, device="cuda:0",
                               features={"gpu_mem_used": 1e9 + 2e7 * s, "gpu_mem_free": 15e9 - 2e7 * s})
                        for w, s in enumerate(sizes[k])])
        sizes[k + 2] = policy.decide(k + 2, sizes[k + 1], config).sizes
        policy.learn()
        assert np.isfinite(policy.model.time_model(range(4)).time(np.full(4, 400.0))).all()
    assert all(abs(s - 400) <= 20 for s in sizes[9])


def test_readings_held_at_a_peak_never_cap_a_card_past_what_it_holds() -> None:
    """NVML's 'used' under a caching allocator holds the peak. Sizes that wander merge slots whose readings
    still rise with size, so the readings passed for a line: its slope came out 0.7x the true one, and the cap,
    333, needed 18.5 GB of a 16 GB card. A reading that does not fall when the size does now marks the card
    held, and its cap follows the line through the origin."""
    a, b, total = 3.2e9, 46e6, 16e9  # 278 samples fit
    sizes = [98, 104, 110, 112, 120, 118, 118, 118, 114, 110, 117, 112, 108, 102, 94, 103, 111, 121, 120, 129,
             135, 121, 122, 124, 120, 110, 120, 127, 118, 128, 137, 135, 132, 128, 139, 144, 139, 145]
    model, peak = BatchTimeCurve(), 0.0
    for k, size in enumerate(sizes):
        peak = max(peak, a + b * size)
        model.partial_fit(_report(k, size, 0.01 + size / 1e4, used=peak, total=total))
        assert a + b * int(model.max_batch([0])[0]) <= total, k
    assert model.mem_held_[0]
    honest = BatchTimeCurve()  # the same sizes read honestly: a line, as far as the origin's (its reach, over the
    for k, size in enumerate(sizes):  # sizes above the first: the first reading may be held, fit_memory_cap)
        honest.partial_fit(_report(k, size, 0.01 + size / 1e4, used=a + b * size, total=total))
    assert not honest.mem_held_[0] and model.max_batch([0])[0] <= honest.max_batch([0])[0] <= 278


def test_a_gpu_that_reports_no_memory_keeps_its_cold_start_cap() -> None:
    """A card that announced 8 GB, then reports without GPU features, lost its cap at its first measurement
    and was given 525 samples (11.5 GB at its peer's 20 MB per sample); it keeps its peer's and its announced
    cap until readings of its own replace them."""
    config = JobConfig("j", 2, 700)
    policy = LBBSPPolicy(BatchTimeCurve(), hedge=None)
    policy.observe([Report("j", 1, 0, 0, 0.0, device="cuda:0", features={"gpu_mem_used": 1e9, "gpu_mem_free": 7e9})])
    sizes = (350, 350)
    for k in range(6):
        policy.observe([Report("j", 0, k, sizes[0], sizes[0] / 1000, device="cuda:0",
                               features={"gpu_mem_used": 1e9 + 2e7 * sizes[0], "gpu_mem_free": 7e9 - 2e7 * sizes[0]}),
                        Report("j", 1, k, sizes[1], sizes[1] / 3000, device="cuda:0")])
        sizes = policy.decide(k + 1, sizes, config).sizes
        policy.learn()
    caps = policy.model.max_batch([0, 1])
    assert caps[1] <= 346 and sizes[1] <= 350


def _grow(model: BatchTimeCurve, fixed: float, per_sample: float, total: float, steps: int,
          granule: float = 1.0) -> list[int]:
    """Grow one worker as the allocator grows the fastest, to min(2 x its size, its cap), with readings rounded up
    to ``granule`` bytes."""
    size, path = 32, []
    for k in range(steps):
        assert fixed + per_sample * size <= total, f"step {k}: size {size} does not fit"
        used = np.ceil((fixed + per_sample * size) / granule) * granule
        model.partial_fit(_report(k, size, 0.01 + size / 1e4, used=used, total=total))
        path.append(size)
        size = max(1, min(2 * size, int(model.max_batch([0])[0])))
    return path


@pytest.mark.parametrize("granule", [1.0, 20 * 2**20])
def test_a_nearly_full_card_grows_to_its_limit_in_a_few_steps(granule: float) -> None:
    """As measured on an H100 with 3.8 GiB of 80 free and 3 MB a sample: the line through the origin charges the
    76 GiB in use to 32 samples, so the cap rose by one sample a step, where 1,281 fit. The readings' line (once
    it rises 32 MiB) now sets it: within 20 steps the worker holds what fits in the 99% of the card it may use
    (memory_floor), and never more; also with readings in the 20 MiB steps of PyTorch's expandable segments,
    which read the same at sizes a sample apart and had failed the line's test that each reading rises."""
    fixed, per_sample, total = 76.2 * 2**30, 3 * 2**20, 80 * 2**30
    fits = (0.99 * total - fixed) // per_sample
    path = _grow(BatchTimeCurve(), fixed, per_sample, total, 20, granule)
    assert path[-1] >= 0.95 * fits, path


def test_readings_that_do_not_rise_keep_the_cap_at_the_sizes_measured() -> None:
    """A framework that reserved the card up front reads the same at every size: no line, and no growth."""
    model = BatchTimeCurve()
    for k, size in enumerate([32, 36, 40, 36]):
        model.partial_fit(_report(k, size, 0.01 + size / 1e4, used=79 * GB, total=80 * GB))
    assert model.max_batch([0])[0] <= 41


@pytest.mark.parametrize(("total", "fixed_share", "fits", "warm", "start"),
                         [(11e9, 0.3, 1000, 600, 50), (11e9, 0.3, 300, 180, 6), (40e9, 0.5, 3000, 1200, 60)])
def test_readings_held_at_a_peak_set_before_the_first_report_never_cap_past_the_card(
        total: float, fixed_share: float, fits: int, warm: int, start: int) -> None:
    """A warm-up or evaluation pass at a larger batch leaves PyTorch's readings flat at its peak, and the sizes
    only grow, so no reading is seen not to fall: the line through flat, then rising, readings was too shallow,
    and the cap followed it past the card (1,853 where 1,014 fit, and the next step ran out of memory)."""
    fixed = fixed_share * total
    per_sample = (0.99 * total - fixed) / fits
    peak, model, size = fixed + per_sample * warm, BatchTimeCurve(), start
    for k in range(25):
        used = max(peak, fixed + per_sample * size)
        model.partial_fit(_report(k, size, 0.01 + size / 1e4, used=used, total=total))
        size = max(1, min(2 * size, int(model.max_batch([0])[0])))
        assert fixed + per_sample * size <= 0.99 * total, f"step {k}: {size} samples, past the card"
    assert size >= 0.8 * fits  # and it still grows to near what fits


def test_a_reading_merged_from_a_smaller_size_does_not_stand_for_the_merged_size() -> None:
    """NVML failed once, at a new largest size; when the slots merged it into its neighbour, the reading of the
    smaller size stood for their larger mean, and the cap passed the card (725 where 700 fit)."""
    fixed, per_sample, total = 2 * GB, 20e6, 16 * GB
    model = BatchTimeCurve()
    for k, size in enumerate([100, 125, 156, 195, 244, 305, 381, 440, 90]):
        used = None if size == 440 else fixed + per_sample * size
        model.partial_fit(_report(k, size, 0.01 + size / 1e4, used=used, total=total))
        assert model.max_batch([0])[0] <= (0.99 * total - fixed) // per_sample


def test_a_gpu_that_changes_speed_on_a_report_without_memory_keeps_its_cap() -> None:
    """A change of speed forgets the slots, readings included; the report that showed it lacked a reading, and the
    worker, alone on its hardware, was left uncapped."""
    model = BatchTimeCurve()
    for k, size in enumerate([100, 200, 150, 300, 250]):
        model.partial_fit(_report(k, size, 0.01 + size / 1e4, used=2 * GB + 40e6 * size))
    cap = model.max_batch([0])[0]
    assert cap <= 346  # what fits 99% of the 16 GB card
    model.partial_fit(_report(5, 250, 2 * (0.01 + 250 / 1e4), used=2 * GB + 40e6 * 250))  # slower: one miss
    model.partial_fit(_report(6, 250, 2 * (0.01 + 250 / 1e4)))  # the second, with no reading
    assert model.max_batch([0])[0] == cap


def test_a_worker_held_by_its_memory_cap_grows_to_what_its_nearly_full_card_holds() -> None:
    """PyTorch's readings stay at their peak when a batch shrinks, so after one exploration move down a card is
    read through the origin, which on a card nearly full of model grows the cap ~2% a measured step: under the
    3% dead band, so the split was kept and the 4x faster worker stayed at 409 samples for good, where its card
    holds 1,024 (1.7x slower than the best split). A proposal that raises a worker held at its cap is taken."""
    gib, mib = 2**30, 2**20
    fixed, per_sample, total = 76.2 * gib, 3 * mib, 80 * gib
    speed = np.array([4000.0, 1000.0, 1000.0, 1000.0])
    config = JobConfig("g", 4, 1600)
    policy, sizes, planned, peak = LBBSPPolicy(BatchTimeCurve(), hedge=None), np.full(4, 400), {}, np.zeros(4)
    for k in range(120):
        seconds = 0.01 + sizes / speed
        need = np.array([fixed, 10 * gib, 10 * gib, 10 * gib]) + per_sample * sizes
        assert need[0] <= 0.99 * total, f"iteration {k}: worker 0 past its card"
        peak = np.maximum(peak, np.ceil(need / (2 * mib)) * 2 * mib)  # held at the peak, in 2 MiB granules
        policy.observe([_report(k, int(sizes[w]), float(seconds[w]), used=float(peak[w]), total=total, worker=w)
                        for w in range(4)])
        planned[k + 2] = np.asarray(policy.decide(k + 2, tuple(sizes.tolist()), config).sizes)
        policy.learn()
        sizes = planned.get(k + 1, sizes)
    assert sizes[0] >= 880  # the best split, ~914 / 229 / 229 / 228, within the card's 1,024


@pytest.mark.parametrize(("warm", "excess"), [(110, 0.0), (120, 0.0), (140, 0.0), (165, 0.0), (None, 0.5 * GB),
                                             (None, 1 * GB), (None, 2 * GB)])
def test_a_peak_held_from_before_the_first_reading_never_lets_the_split_past_the_card(warm: int | None,
                                                                                    excess: float) -> None:
    """Four 16 GB cards, 1.5 GB + 85 MB a sample (170 fit), readings held at the peak from before the first report:
    a warm-up at a larger batch, or a first step's extra workspace (cuDNN's benchmark). With one reading above that
    peak the line through both passed every test, too shallow: caps of 178-202, and the fast workers were given
    them, where 170 fit (every first-step excess of a sweep, and warm-ups from 110 to 165). The line now leaves out
    readings at the first size and below."""
    fixed, per_sample, total = 1.5 * GB, 85e6, 16 * GB
    speeds, config = np.array([2000.0, 2000.0, 400.0, 130.0]), JobConfig("g", 4, 400)
    policy, splits = LBBSPPolicy(BatchTimeCurve()), {0: (100,) * 4, 1: (100,) * 4}
    peak = np.full(4, fixed + per_sample * (warm if warm is not None else 100) + excess)
    for k in range(60):
        need = fixed + per_sample * np.array(splits[k])
        assert (need <= total).all(), f"iteration {k}: {splits[k]} past the card"
        peak = np.maximum(peak, need)
        policy.observe([_report(k, splits[k][w], 0.015 + splits[k][w] / speeds[w], used=float(peak[w]), worker=w)
                        for w in range(4)])
        splits[k + 2] = policy.decide(k + 2, splits[k], config).sizes
        policy.learn()
    assert min(splits[59][:2]) >= 160  # and the fast ones still grow to near what fits (slowly on a card held full)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: gpu_curve.fit_hinge(np.zeros((1, 0)), np.zeros((1, 0)), np.zeros((1, 0))), "at least one of each"),
    (lambda: fit_memory_cap([[1.0, 2.0]], [[GB, 2 * GB]], [[True, True]], [8 * GB]), None),  # lists are arrays
    (lambda: fit_memory_cap(np.ones(2), np.ones(2), np.ones(2, bool), np.ones(1)), r"\(workers, points\)"),
    (lambda: fit_memory_cap(np.ones((1, 2)), np.ones((1, 3)), np.ones((1, 2), bool), np.ones(1)), "one shape"),
    (lambda: fit_memory_cap(np.ones((1, 2)), np.ones((1, 2)), np.ones((1, 2), bool), np.ones(2)), r"budget"),
    (lambda: fit_memory_cap(np.ones((1, 2)), np.array([[GB, np.nan]]), np.ones((1, 2), bool), np.ones(1)),
     "finite sizes and readings where valid"),
])
def test_the_pure_fits_check_their_arrays(call, match: str | None) -> None:  # type: ignore[no-untyped-def]
    """fit_memory_cap had checked nothing (a list: AttributeError; 1-D: AxisError; a valid NaN: ignored), and
    fit_hinge on no points had raised numpy's 'zero-size array to reduction operation'."""
    if match is None:
        assert call().shape == (1,)
    else:
        with pytest.raises(ConfigError, match=match):
            call()


def test_a_window_too_large_to_hold_is_a_config_error_not_an_out_of_memory_kill() -> None:
    """BatchTimeCurve(window=10**9) had been accepted, and its first partial_fit made tables of a billion slots per
    worker: the process was killed for lack of memory."""
    with pytest.raises(ConfigError, match=r"window must be an integer in \[2, 256\], got 1000000000"):
        BatchTimeCurve(window=10**9).partial_fit([Report("j", 0, 0, 32, 0.1, device="cuda:0")])
    BatchTimeCurve(window=256).partial_fit([Report("j", 0, 0, 32, 0.1, device="cuda:0")])


def test_a_split_that_explore_moved_says_so_in_its_reason() -> None:
    """Four equal GPUs, curves unknown: the split came back (95, 105, 95, 105) with the reason 'kept: predicted gain
    under the dead band'."""
    policy, config = LBBSPPolicy(BatchTimeCurve()), JobConfig("job", 4, 400)
    policy.observe([Report("job", w, 0, 100, 0.265, device="cuda:0") for w in range(4)])
    decision = policy.decide(2, (100, 100, 100, 100), config)
    assert decision.sizes != (100, 100, 100, 100) and sum(decision.sizes) == 400
    moved = sum(abs(s - 100) for s in decision.sizes) // 2
    assert f"then {moved} sample(s) moved to learn the workers' batch-time curves (explore)" in decision.reason


def test_a_knee_between_measured_sizes_is_found() -> None:
    sizes = np.array([[16.0, 48, 80, 112, 144]])  # flat 0.1 s up to 64 samples, then 2 ms per sample
    base, knee, slope = fit_hinge(sizes, 0.1 + 0.002 * np.maximum(sizes - 64, 0), np.ones(sizes.shape, bool))
    assert (base[0], knee[0], slope[0]) == pytest.approx((0.1, 64, 0.002))  # knee 48, slope 0.00165 before


@pytest.mark.parametrize(("arrays", "words"), [
    ((np.array([16.0, 48]), np.array([0.1, 0.2]), np.ones(2)), r"\(workers, points\) arrays of one shape"),
    ((np.ones((2, 3)), np.ones((2, 2)), np.ones((2, 3))), "of one shape"),
    ((np.array([[16.0, 48]]), np.array([[0.1, np.nan]]), np.ones((1, 2))), "finite"),
])
def test_fit_hinge_refuses_arrays_it_cannot_fit(arrays: tuple[np.ndarray, ...], words: str) -> None:
    """A 1-D row had raised numpy's AxisError, and a NaN time had given a NaN base and slope."""
    with pytest.raises(ConfigError, match=words):
        fit_hinge(*arrays)


def test_fit_hinge_ignores_what_an_absent_point_holds() -> None:
    sizes, weight = np.array([[16.0, 48, 64]]), np.array([[1.0, 0.0, 1.0]])
    fits = [fit_hinge(sizes, np.array([[0.1, absent, 0.3]]), weight) for absent in (0.2, np.nan, np.inf)]
    for fit in fits[1:]:
        np.testing.assert_array_equal(np.concatenate(fit), np.concatenate(fits[0]))


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


def test_a_knee_lies_above_the_smallest_size() -> None:
    """1, 3 and 5 s at 10, 20 and 30 samples: no flat part, so the proportional line (knee 0), not a knee at the
    smallest size, which has no point on its flat part."""
    knee, base, slope = fit_hinge(np.array([[10.0, 20.0, 30.0]]), np.array([[1.0, 3.0, 5.0]]), np.ones((1, 3)))
    assert knee[0] == pytest.approx(0, abs=1e-6) and base[0] == pytest.approx(0, abs=1e-6)
    assert slope[0] == pytest.approx(22 / 140)


def test_two_misses_in_a_row_in_one_direction_are_a_change_of_speed() -> None:
    """A GPU that became twice as slow is learnt afresh at its second slow measurement (the first is held out)."""
    model = BatchTimeCurve()
    for it in range(6):
        model.partial_fit([Report("j", 0, it, 100, 1.0, device="cuda:0")])
    model.partial_fit([Report("j", 0, 6, 100, 2.0, device="cuda:0")])
    assert model.predict([0])[0] == pytest.approx(100.0)  # one slow step: held out
    model.partial_fit([Report("j", 0, 7, 100, 2.0, device="cuda:0")])
    assert model.predict([0])[0] == pytest.approx(50.0)


def test_a_knee_that_fits_hardly_better_than_the_line_is_not_taken() -> None:
    """fit_hinge takes a knee only where it fits clearly better (1% less squared error) than the straight line: noisy
    linear times with a knee that would gain under 1% stay the line (knee 0)."""
    x = np.arange(10.0, 90.0, 10.0)[None]
    t = np.array([[1.1035, 1.2082, 1.3033, 1.387, 1.5091, 1.6045, 1.6946, 1.8058]])
    base, knee, slope = fit_hinge(x, t, np.ones_like(x))
    assert knee[0] == 0.0
    assert slope[0] == pytest.approx(0.00997, rel=1e-3) and base[0] == pytest.approx(1.0034, rel=1e-3)


def test_times_that_fall_as_the_batch_grows_fit_a_flat_curve() -> None:
    """The hinge's slope is never negative (the curve is monotone): falling times fit their weighted mean, flat."""
    base, knee, slope = fit_hinge(np.array([[10.0, 20.0, 30.0, 40.0]]), np.array([[4.0, 3.0, 2.0, 1.0]]),
                                  np.ones((1, 4)))
    assert (base[0], knee[0], slope[0]) == (pytest.approx(2.5), 0.0, 0.0)


def _pooling_reports(workers: list[int]) -> list[list[Report]]:
    rng = np.random.default_rng(0)
    slopes, devices, cores = [0.010, 0.0102, 0.02], ["cuda:0", "cuda:1", "cuda:2"], [8.0, 8.0, 16.0]
    history = []
    for it in range(12):
        size, noise = 100 + 20 * (it % 2), rng.normal(0, 0.02, 3)
        history.append([Report("j", w, it, size, (0.2 + slopes[w] * size) * (1 + noise[w]), device=devices[w],
                               features={"cores": cores[w]}) for w in workers])
    return history


def test_two_gpus_of_one_hardware_keep_their_own_curves() -> None:
    """Pooling starts at groups of three: two GPUs sharing a hardware key each keep their own curve, so worker 0 is
    predicted as it is without its twin (they had been pulled to one speed)."""
    both, alone = BatchTimeCurve(), BatchTimeCurve()
    for reports in _pooling_reports([0, 1, 2]):
        both.partial_fit(reports)
    for reports in _pooling_reports([0, 2]):
        alone.partial_fit(reports)
    assert both.known_[:3].all()
    assert both.predict([0])[0] == pytest.approx(alone.predict([0])[0], rel=1e-9)
    assert both.predict([0])[0] != pytest.approx(both.predict([1])[0], rel=1e-3)


def test_explore_moves_at_least_one_sample_at_small_batches() -> None:
    """5% of a batch of 8 rounds to 0: explore still moves one sample, so small batches learn their slope too."""
    model = BatchTimeCurve()
    model.partial_fit([Report("j", w, 0, 8, 1.0, device="cuda:0") for w in range(2)])
    out = model.explore([0, 1], np.array([8, 8]), np.array([1, 1]), np.array([100, 100]))
    assert sorted(out.tolist()) == [7, 9]
