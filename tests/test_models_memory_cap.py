"""The memory model (bytes = a + b * batch) and the largest batch that fits a worker's free memory: readings held at a
peak or noisy, another process on the card, a new GPU's cold-start cap, and GPU workers routed to a model or policy
that cannot cap them, named once."""
from __future__ import annotations

import logging
import random
import warnings

import numpy as np
import pytest

from lbbsp import (
    BSPPolicy,
    ConfigError,
    Coordinator,
    JobConfig,
    LBBSPPolicy,
    LeaderStragglerPolicy,
    PerEpochPolicy,
    Report,
    StaticProportionalPolicy,
    Store,
)
from lbbsp.guarded_policy import warn_uncapped
from lbbsp.models import NO_CAP, AutoCapacityModel, BatchTimeCurve, EWMAThroughput, fit_memory_cap
from lbbsp.models.base import WorkerIds, whole_caps
from lbbsp.policies import Policy

GIB = 2**30


def _gpu_report(job: str, worker: int, iteration: int, samples: int) -> Report:
    return Report(job, worker, iteration, samples, 0.1 * (1 + worker), device="cuda:A100",
                  features={"gpu_mem_used": 4 * GIB, "gpu_mem_free": 12 * GIB})


def _warnings(redis_url: str, job: str, policy: Policy, caplog: pytest.LogCaptureFixture) -> list[str]:
    """The coordinator's warnings that GPU workers go uncapped, over three decisions of a two-GPU job."""
    with Store.from_url(redis_url, job) as store, caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        try:
            coordinator = Coordinator(store, JobConfig(job, 2, 64), policy)
            for iteration in range(3):
                for worker in (0, 1):
                    store.post_report(_gpu_report(job, worker, iteration, 32), 2)
                coordinator.decide(iteration)
        finally:
            store.forget()
    return [r.getMessage() for r in caplog.records if "report GPU memory" in r.getMessage()]


@pytest.mark.parametrize("make, why", [
    (PerEpochPolicy, "per-epoch policy has a model, EWMAThroughput, that sets no memory caps"),
    (lambda: LBBSPPolicy(EWMAThroughput()), "lbbsp policy has a model, EWMAThroughput,"),
    (lambda: LeaderStragglerPolicy(model=None), "leader-straggler policy has no model to set memory caps"),
])
def test_gpu_workers_a_policy_cannot_cap_are_named_once(redis_url: str, job: str, caplog: pytest.LogCaptureFixture,
                                                        make: object, why: str) -> None:
    # per-epoch's own slow EWMA had given GPUs that held 716 samples 787-932, and nothing said so
    said = _warnings(redis_url, job, make(), caplog)  # type: ignore[operator]
    assert len(said) == 1 and why in said[0] and "worker(s) [0, 1]" in said[0] and "--model auto" in said[0]


@pytest.mark.parametrize("make", [LBBSPPolicy, BSPPolicy, lambda: PerEpochPolicy(model=AutoCapacityModel()),
                                  lambda: LeaderStragglerPolicy(model=BatchTimeCurve())])
def test_a_policy_that_caps_or_needs_no_caps_says_nothing(redis_url: str, job: str, caplog: pytest.LogCaptureFixture,
                                                          make: object) -> None:
    assert _warnings(redis_url, job, make(), caplog) == []  # type: ignore[operator]


def test_static_proportional_is_told_of_a_policy_that_takes_a_model(redis_url: str, job: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    # it takes no model (the command line refuses --model with it), yet it had been told to take AutoCapacityModel()
    (said,) = _warnings(redis_url, job, StaticProportionalPolicy(), caplog)
    assert "use a policy that takes a model" in said and "--policy lbbsp" in said


GB, MB = 1e9, 1e6


TOTAL, FIXED, PER_SAMPLE = 16 * GB, 1 * GB, 20 * MB  # the worker's own memory: 1 GB + 20 MB a sample


def _report(iteration: int, size: int, seconds: float, other: float = 0.0, worker: int = 0) -> Report:
    """A report whose NVML readings hold the worker's own memory at ``size`` and ``other`` bytes of other
    processes (used + free is the card)."""
    used = FIXED + PER_SAMPLE * size + other
    return Report("cotenant", worker, iteration, size, seconds, device="cuda:0",
                  features={"gpu_mem_used": used, "gpu_mem_free": max(TOTAL - used, 0.0)})


def _fits(other: float) -> int:
    """Samples that fit the card beside ``other`` bytes of other processes."""
    return int((TOTAL - FIXED - other) // PER_SAMPLE)


def _grown_then_run_at(at: int, grow: list[int]) -> tuple[BatchTimeCurve, int]:
    """A worker grown through ``grow``, then run three times at ``at``: the model and the next iteration."""
    model, k = BatchTimeCurve(), 0
    for size in [*grow, at, at, at]:
        model.partial_fit(_report(k, size, 0.01 + 1e-4 * max(size - 64, 0)))
        k += 1
    return model, k


@pytest.mark.parametrize(("other", "at"), [(5 * GB, 200), (3 * GB, 500), (8 * GB, 300), (1 * GB, 700)])
def test_a_cotenant_arriving_below_the_largest_size_measured_brings_the_cap_within_the_card(
        other: float, at: int) -> None:
    """Grown to 256 (or 700), run at a smaller size, then another process takes ``other`` of the card: the readings
    at the larger sizes predate it. With 5 GB at 200 the cap had gone from 704 to 648 where 500 fit."""
    model, k = _grown_then_run_at(at, [32, 64, 128, 256] if at <= 256 else [32, 64, 128, 256, 512, 700])
    before = int(model.max_batch([0])[0])
    for step in range(5):
        model.partial_fit(_report(k + step, at, 0.01 + 1e-4 * max(at - 64, 0), other))
        cap = int(model.max_batch([0])[0])
        assert cap <= _fits(other), f"step {step}: cap {cap} where {_fits(other)} fit (cap before: {before})"
    assert cap >= 0.8 * _fits(other)  # and the cap is what the card holds now, not a collapse


def test_a_cotenant_whose_reading_equals_the_largest_sizes_reading_still_lowers_the_cap() -> None:
    """Grown to 700 (15 GB), then at 300 another process takes 8 GB: the reading, 15 GB, is the one at 700, as a
    caching allocator's held peak would read; the worker's memory has never been seen held, so the reading is not
    taken for one (the cap had stayed at 739 where 350 fit)."""
    model = BatchTimeCurve()
    for k, size in enumerate([32, 64, 128, 256, 512, 700]):
        model.partial_fit(_report(k, size, 0.01 + 1e-4 * max(size - 64, 0)))
    for k in (6, 7):
        model.partial_fit(_report(k, 300, 0.01 + 1e-4 * 236, 8 * GB))
        assert model.max_batch([0])[0] <= _fits(8 * GB)


def test_a_cotenant_never_gets_its_worker_assigned_past_the_card() -> None:
    """Through LBBSPPolicy: worker 0, 3x faster, grows to 600, comes back to ~400 when worker 1 speeds up, then a
    co-tenant takes 6 GB of its card while worker 1 slows again. It had been assigned 600 where 450 fit, 27 of 30
    iterations (its reports ran what fit). Every split decided after the first report that shows the co-tenant
    now keeps worker 0 within the card."""
    config = JobConfig("cotenant", 2, 800)
    policy = LBBSPPolicy(BatchTimeCurve())
    pending = [config.initial_sizes()] * 2  # config.lag iterations ahead
    fits, decided_after = _fits(6 * GB), []
    for k in range(90):
        run = pending.pop(0)
        other, slow = (0.0, 3e-4) if k < 30 else (0.0, 1e-4) if k < 60 else (6 * GB, 3e-4)
        mine = min(run[0], fits) if k >= 60 else run[0]  # what a real worker could run
        policy.observe([_report(k, mine, 0.005 + 1e-4 * mine, other, 0),
                        _report(k, run[1], 0.005 + slow * run[1], 0.0, 1)])
        decision = policy.decide(k + 2, pending[-1], config)
        policy.learn()
        pending.append(decision.sizes)
        if k >= 60:
            decided_after.append(decision.sizes[0])
    assert max(decided_after) <= fits, decided_after
    assert decided_after[-1] >= 0.9 * fits  # it still takes what its card holds


@pytest.mark.parametrize("held", [False, True], ids=["honest", "peak-held"])
def test_the_cap_comes_back_when_the_cotenant_leaves(held: bool) -> None:
    """A co-tenant takes 5 GB while the worker runs at 200 (grown to 256 before), then leaves: the readings fall,
    and the cap returns to what it was, not kept low for good; also where the readings hold the caching
    allocator's peak (the worker went 256 -> 200 once before the co-tenant came)."""
    model, k = BatchTimeCurve(), 0
    peak = 0.0
    sizes = [32, 64, 128, 256, 200, 200, 200]

    def report(size: int, other: float) -> Report:
        nonlocal peak, k
        peak = max(peak, FIXED + PER_SAMPLE * size) if held else FIXED + PER_SAMPLE * size
        used = peak + other
        k += 1
        return Report("cotenant", 0, k, size, 0.01 + 1e-4 * size, device="cuda:0",
                      features={"gpu_mem_used": used, "gpu_mem_free": TOTAL - used})

    for size in sizes:
        model.partial_fit(report(size, 0.0))
    before = int(model.max_batch([0])[0])
    for _ in range(3):
        model.partial_fit(report(200, 5 * GB))
        assert model.max_batch([0])[0] <= _fits(5 * GB)
    for _ in range(3):
        model.partial_fit(report(200, 0.0))
    assert int(model.max_batch([0])[0]) >= before


def test_a_cotenant_that_leaves_while_its_worker_grows_past_its_largest_size_is_forgotten() -> None:
    """The co-tenant leaves as the worker grows to a size it never ran: the cap is what the card holds, neither
    the co-tenant's share kept off it for good nor a line through readings that lack it (which would cap past the
    card)."""
    model, k = _grown_then_run_at(200, [32, 64, 128, 256])
    for step in range(3):
        model.partial_fit(_report(k + step, 200, 0.01 + 1e-4 * 136, 5 * GB))
        assert model.max_batch([0])[0] <= _fits(5 * GB)
    model.partial_fit(_report(k + 3, 400, 0.01 + 1e-4 * 336))
    cap = int(model.max_batch([0])[0])
    assert 0.9 * _fits(0.0) <= cap <= _fits(0.0)


def test_readings_without_a_cotenant_give_the_caps_they_gave() -> None:
    """Honest readings that only follow the worker's own sizes, up and down, are never read as a co-tenant: the
    cap is the line's, at every step."""
    rng = np.random.default_rng(0)
    model = BatchTimeCurve()
    for k, size in enumerate([32, 64, 128, 256, *rng.integers(100, 400, 40).tolist()]):
        model.partial_fit(_report(k, int(size), 0.01 + 1e-4 * size))
        assert model.mem_other_[0] == 0.0
    assert _fits(0.0) * 0.95 <= model.max_batch([0])[0] <= _fits(0.0)


def test_a_caching_allocators_first_held_peak_does_not_keep_the_cap_down() -> None:
    """On a card nearly full of model, under a caching allocator: the first reading held at the peak as the size
    fell is taken for a co-tenant (it reads as one would), which brings the cap down to that size; the next size,
    reading the same, shows the peak held, and the cap is what it was. Kept, the doubt had held the cap at each
    smaller size the worker ran, down to 1 sample."""
    gib, mib = 2**30, 2**20
    fixed, per_sample, total = 76.2 * gib, 3 * mib, 80 * gib
    model, peak = BatchTimeCurve(), 0.0
    for k, size in enumerate([400, 600, 800, 1000, 1100]):
        peak = max(peak, fixed + per_sample * size)
        model.partial_fit(Report("cotenant", 0, k, size, 0.01 + size / 1e4, device="cuda:0",
                                 features={"gpu_mem_used": peak, "gpu_mem_free": total - peak}))
    grown = int(model.max_batch([0])[0])
    caps = []
    for k, size in enumerate([1000, 900, 800, 700], start=5):
        model.partial_fit(Report("cotenant", 0, k, size, 0.01 + size / 1e4, device="cuda:0",
                                 features={"gpu_mem_used": peak, "gpu_mem_free": total - peak}))
        caps.append(int(model.max_batch([0])[0]))
        assert fixed + per_sample * caps[-1] <= total
    assert caps[-1] >= grown, caps


def test_a_reading_with_an_unseen_cotenant_is_brought_down_by_a_later_larger_size() -> None:
    """A co-tenant came just as the worker first ran 400 samples (a size past those measured: its reading is taken
    for the worker's own) and left before it ran 500. Memory in use does not fall as the batch grows, so the 400's
    reading, above the 500's, is stale and is brought down to it: left as it was, it stood for the card's held peak,
    and a second co-tenant, arriving at 350, went unseen (a cap of 716 where 600 fit)."""
    model, peak = BatchTimeCurve(), 0.0
    for k, (size, other) in enumerate([(100, 0.0), (200, 0.0), (300, 0.0), (250, 0.0), (280, 0.0), (400, 5 * GB),
                                       (500, 0.0), (350, 3 * GB), (350, 3 * GB)]):
        peak = max(peak, FIXED + PER_SAMPLE * size)  # a caching allocator's readings hold the peak
        used = peak + other
        model.partial_fit(Report("cotenant", 0, k, size, 0.01 + 1e-4 * size, device="cuda:0",
                                 features={"gpu_mem_used": used, "gpu_mem_free": TOTAL - used}))
        assert FIXED + PER_SAMPLE * model.max_batch([0])[0] + other <= TOTAL, k


def test_a_card_taken_for_holding_its_peak_reads_as_falling_once_its_readings_follow_its_size() -> None:
    """The co-tenant that came as the size fell from 700 to 300 read exactly as a held peak would, which marks the
    card held. Its next reading falls with its size, by the worker's own bytes: the card holds no peak, and its
    readings are again compared with what they would be falling. Read as held, a later 0.5 GB co-tenant went unseen
    (the reading it gave was below the one before) and the cap stayed at 739 where 725 fit."""
    model = BatchTimeCurve()
    steps = [(32, 0.0), (64, 0.0), (128, 0.0), (256, 0.0), (512, 0.0), (700, 0.0), (300, 8 * GB), (250, 8 * GB),
             (250, 0.0), (400, 0.0), (350, 0.5 * GB), (350, 0.5 * GB)]
    for k, (size, other) in enumerate(steps):
        model.partial_fit(_report(k, size, 0.01 + 1e-4 * max(size - 64, 0), other))
        assert model.max_batch([0])[0] <= _fits(other), k
    assert not model.mem_held_[0]


MiB, GiB = 2.0**20, 2.0**30


GRANULE = 20 * MiB  # PyTorch's expandable segments (the granule that keeps flat readings in: test_models_gpu_curve)


def test_a_reading_held_flat_with_the_first_is_left_out_of_the_line() -> None:
    fixed, per_sample, total = 2.5 * GiB, 95 * MiB, 16 * GiB
    fits = int((total - fixed) // per_sample)
    need = lambda size: fixed + per_sample * size  # noqa: E731
    sizes = np.array([[115.0, 124.0, 134.0]])
    held = np.array([[need(131), need(131), need(134)]])  # warmed up at 131: flat up to it
    valid, budget, first = np.ones(sizes.shape, dtype=bool), np.array([total]), np.array([115.0])
    assert fit_memory_cap(sizes, held, valid, budget, None, first)[0] <= fits
    # read honestly, the same sizes give the line, which reaches the card
    honest = np.array([[need(115), need(124), need(134)]])
    assert fit_memory_cap(sizes, honest, valid, budget, None, first)[0] == fits


def _job_after_warm_up(seed: int, iterations: int = 60) -> tuple[list[int], int, list[int]]:
    """A 4-GPU job with LB-BSP and the default models, each card warmed up at 50-95% of what fits, its readings held
    at the peak so far in 20 MiB granules. The sizes that passed the card, what fits, and the final caps."""
    r = random.Random(seed)
    per_sample, fixed, total = r.uniform(40, 100) * MiB, r.uniform(1, 4) * GiB, 16 * GiB
    fits = int((total - fixed) / per_sample)
    speed = [r.choice([1, 1, 2, 4]) for _ in range(4)]
    peak = [fixed + per_sample * int(fits * r.uniform(0.5, 0.95)) for _ in range(4)]
    config = JobConfig("warm", 4, int(fits * 4 * r.uniform(0.6, 0.9)))
    policy, noise = LBBSPPolicy(AutoCapacityModel()), random.Random(seed)
    splits, past = {0: config.initial_sizes(), 1: config.initial_sizes()}, []
    for k in range(iterations):
        reports = []
        for w, size in enumerate(splits[k]):
            if size > fits:
                past.append(size)
            peak[w] = max(peak[w], float(np.ceil((fixed + per_sample * size) / GRANULE) * GRANULE))
            used = min(peak[w], total)
            seconds = (0.01 + 0.1 / speed[w] * max(size - 8, 0) / 1000) * noise.uniform(0.98, 1.02)
            reports.append(Report("warm", w, k, size, seconds, device="cuda:V100",
                                  features={"cores": 16.0, "gpu_mem_used": used, "gpu_mem_free": total - used}))
        policy.observe(reports)
        splits[k + 2] = policy.decide(k + 2, splits[k + 1], config).sizes
        policy.learn()
    return past, fits, [int(c) for c in policy.model.max_batch(np.arange(4))]


@pytest.mark.parametrize("seed", [3, 11, 89, 96, 100, 113, 118])  # the runs of 150 that had passed the card
def test_a_job_warmed_up_at_a_larger_batch_never_passes_the_card(seed: int) -> None:
    past, fits, caps = _job_after_warm_up(seed)
    assert not past, f"sizes {past} where {fits} fit"
    assert max(caps) <= fits


def test_a_held_reading_a_rounding_above_the_others_is_still_flat() -> None:
    """A merged slot's mean of two equal readings can exceed them by 2e-6 bytes: that one reading had stayed in the
    line while the flat ones beside it were left out, and with the first that rose it fitted one far too shallow
    (140 where 130 fit)."""
    peak, top = 16148070400.0, 16756244480.0
    sizes = np.array([[78.0, 84, 92, 99, 104, 112, 120, 126]])
    used = np.array([[peak] * 7 + [top]])
    used[0, 2] = (1.0 * peak + 1.9330329915368074 * peak) / 2.9330329915368074  # merged, weights 1 and 1.93
    valid, budget, first = np.ones(sizes.shape, dtype=bool), np.array([17008070492.16]), np.array([78.0])
    assert fit_memory_cap(sizes, used, valid, budget, None, first)[0] <= 130


@pytest.mark.parametrize(("total", "fixed", "per_sample", "warm", "sizes", "offsets", "noise", "fits"), [
    # 24 GiB, warmed up at 683: the reading at 125 is 61 MiB over the peak, just past the 4-sigma band (2,120)
    (24 * GiB, 1.5 * GiB, 20 * MiB, 683, [32, 50, 79, 125, 198, 314, 498, 790], [0, 0, 36, 61, 36, 41, 31, 0],
     15.9e6, 1139),
    # 16 GiB, warmed up at 85: the last held reading 68 MiB over it (161)
    (16 * GiB, 2.5 * GiB, 95 * MiB, 85, [32, 48, 72, 108], [0, 0, 68, 0], 17.7e6, 143),
])
def test_one_noisy_held_reading_past_the_band_does_not_make_a_line(total: float, fixed: float, per_sample: float,
                                                                    warm: int, sizes: list[int], offsets: list[int],
                                                                    noise: float, fits: int) -> None:
    need = fixed + per_sample * np.array([sizes], dtype=float)
    used = np.maximum(need, fixed + per_sample * warm) + np.array([offsets]) * MiB
    cap = fit_memory_cap(np.array([sizes], dtype=float), used, np.ones(need.shape, dtype=bool),
                         np.array([0.99 * total]), np.array([False]), np.array([float(sizes[0])]), np.array([noise]))
    assert cap[0] <= fits


CARD, CARD_FIXED, CARD_PER_SAMPLE = 16 * GB, 1.5 * GB, 85 * MB  # 170 samples fit the card


FITS = int((CARD - CARD_FIXED) // CARD_PER_SAMPLE)


def _need(size: np.ndarray | float) -> np.ndarray | float:
    """The bytes a step at ``size`` truly needs."""
    return CARD_FIXED + CARD_PER_SAMPLE * size


def _card_report(iteration: int, worker: int, size: int, used: float) -> Report:
    """A report reading ``used`` bytes on the card (used + free is the card)."""
    return Report("noise", worker, iteration, size, 0.01 + size / 1000, device="cuda:0",
                  features={"gpu_mem_used": used, "gpu_mem_free": CARD - used})


def _grow_after_warm_up(seed: int, noise: float, steps: int = 40, workers: int = 4) -> tuple[BatchTimeCurve, int]:
    """Workers warmed up at 150 samples (NVML holds that peak), started at 100, each size read twice, then grown by
    12 samples within their cap; readings with ``noise`` bytes of Gaussian noise. The model and the largest cap."""
    rng = np.random.default_rng(seed)
    model, size = BatchTimeCurve(), np.full(workers, 100)
    peak, largest = np.full(workers, _need(150)), 0
    for it in range(steps):
        peak = np.maximum(peak, _need(size))
        reads = np.minimum(peak + rng.normal(0.0, noise, workers) if noise else peak, CARD)
        model.partial_fit([_card_report(it, w, int(size[w]), float(reads[w])) for w in range(workers)])
        cap = model.max_batch(np.arange(workers))
        largest = max(largest, int(cap.max()))
        if it % 2:
            size = np.minimum(cap, size + 12).astype(int)
    return model, largest


@pytest.mark.parametrize("noise", [20 * MB, 50 * MB])
@pytest.mark.parametrize("seed", range(5))
def test_noisy_readings_held_at_a_warm_up_peak_never_cap_a_worker_past_its_card(seed: int, noise: float) -> None:
    model, largest = _grow_after_warm_up(seed, noise)
    assert largest <= FITS, f"a cap of {largest} where {FITS} fit"
    assert model.max_batch(np.arange(4)).min() >= 0.9 * FITS  # and still near the card: not a collapse


def test_exact_readings_measure_no_noise_and_keep_their_cap() -> None:
    model, largest = _grow_after_warm_up(0, 0.0)
    assert model.mem_noise_ == 0.0
    assert largest == 168  # what the cap reached before noise was measured


def test_the_noise_is_measured_from_repeated_readings() -> None:
    model, _ = _grow_after_warm_up(0, 20 * MB)
    assert 15 * MB < model.mem_noise_ < 25 * MB


def test_a_cotenant_arriving_is_not_counted_as_noise() -> None:
    model = BatchTimeCurve()
    for it, (size, other) in enumerate([(64, 0.0), (64, 0.0), (128, 0.0), (128, 0.0), (128, 3 * GB), (128, 3 * GB)]):
        model.partial_fit(_card_report(it, 0, size, float(_need(size)) + other))
    assert model.mem_noise_ == 0.0


def test_fit_memory_cap_leaves_a_slope_within_the_noise_to_the_line_through_the_origin() -> None:
    sizes = np.array([[100.0, 110, 111, 122, 123, 135, 136]])
    held = _need(150) + np.array([[0.0, -10, 5, 15, 10, 30, 35]]) * MB  # held at a peak, rising by noise alone
    budget = np.array([0.99 * CARD])
    valid, first = np.ones(sizes.shape, dtype=bool), np.array([100.0])
    assert fit_memory_cap(sizes, held, valid, budget, None, first)[0] > FITS  # read as exact: the line, past the card
    origin = int(budget[0] / (held[0, -1] / sizes[0, -1]))
    assert fit_memory_cap(sizes, held, valid, budget, None, first, np.array([20 * MB]))[0] == origin
    line = _need(sizes) + np.array([[0.0, -5, 2, 8, 5, 15, 18]]) * MB  # a true line, a little noise on it
    exact = fit_memory_cap(sizes, line, valid, budget, None, first)[0]
    assert exact - 3 <= fit_memory_cap(sizes, line, valid, budget, None, first, np.array([20 * MB]))[0] < exact


@pytest.mark.parametrize("noise", [np.array([-1.0]), np.array([np.nan]), np.array([1.0, 2.0])])
def test_fit_memory_cap_refuses_a_noise_not_finite_and_non_negative_per_row(noise: np.ndarray) -> None:
    with pytest.raises(ConfigError, match="noise"):
        fit_memory_cap(np.array([[10.0, 20.0]]), np.array([[1e9, 2e9]]), np.ones((1, 2), dtype=bool),
                       np.array([8e9]), noise=noise)


def _job(warm: int, noise: float, seed: int, iterations: int = 40) -> int:
    """Four 16 GB GPUs (fast, fast, medium, slow) warmed up at ``warm`` samples, NVML holding that peak; only worker 0
    reads with ``noise`` bytes of Gaussian noise. The steps run past the card (170 samples fit)."""
    rng = np.random.default_rng(seed)
    total, fixed, per, batch = 16 * GB, 1.5 * GB, 85 * MB, 400
    speeds = np.array([2000, 2000, 400, 130.0]) * np.exp(rng.normal(0, 0.1, 4))
    model = BatchTimeCurve()
    policy, config = LBBSPPolicy(model), JobConfig("one-noisy", 4, batch)
    splits = {0: (batch // 4,) * 4, 1: (batch // 4,) * 4}
    peak, over = np.full(4, fixed + per * warm), 0
    for it in range(iterations):
        sizes = splits[it]
        need = fixed + per * np.array(sizes, dtype=float)
        over += int((need > total).sum())
        peak = np.maximum(peak, need)
        reads = np.minimum(peak + np.where(np.arange(4) == 0, rng.normal(0, noise, 4), 0.0), total)
        policy.observe([Report("one-noisy", w, it, sizes[w], (0.015 + max(sizes[w], 32) / speeds[w])
                               * np.exp(rng.normal(0, 0.01)), device="cuda:V100",
                               features={"gpu_mem_used": reads[w], "gpu_mem_free": total - reads[w]})
                        for w in range(4)])
        splits[it + 2] = policy.decide(it + 2, sizes, config).sizes
        policy.learn()
    return over


@pytest.mark.parametrize(("warm", "noise", "seed"), [(140, 50 * MB, 2), (150, 20 * MB, 2), (160, 20 * MB, 0),
                                                      (165, 50 * MB, 2)])
def test_one_noisy_worker_among_exact_ones_stays_within_its_card(warm: int, noise: float, seed: int) -> None:
    logging.disable(logging.WARNING)
    try:
        assert _job(warm, noise, seed) == 0  # steps past the card: 31, 30, 22 and 18 before
    finally:
        logging.disable(logging.NOTSET)


def _cotenant_job(other_from: int | None, other_until: int | None, iterations: int = 20) -> int:
    """Four 16 GB GPUs, exact readings, samples of 20 MB (about 717 fit); another process holds 0.3 GB on worker 0's
    card from ``other_from`` to ``other_until``. Worker 0's cap at the end."""
    total, fixed, per, batch = 16 * GB, 1.5 * GB, 20 * MB, 1600
    model = BatchTimeCurve()
    policy, config = LBBSPPolicy(model), JobConfig("cotenant", 4, batch)
    splits, speeds = {0: (batch // 4,) * 4, 1: (batch // 4,) * 4}, np.array([2000, 2000, 400, 130.0])
    for it in range(iterations):
        sizes = splits[it]
        there = other_from is not None and other_from <= it < (other_until or iterations)
        reads = fixed + per * np.array(sizes, dtype=float) + np.where((np.arange(4) == 0) & there, 0.3 * GB, 0.0)
        policy.observe([Report("cotenant", w, it, sizes[w], 0.015 + max(sizes[w], 32) / speeds[w], device="cuda:V100",
                               features={"gpu_mem_used": reads[w], "gpu_mem_free": total - reads[w]})
                        for w in range(4)])
        splits[it + 2] = policy.decide(it + 2, sizes, config).sizes
        policy.learn()
    return int(model.max_batch([0])[0])


def test_a_state_that_came_and_went_leaves_the_own_noise_and_the_cap_returns() -> None:
    """Another process's memory arriving at an unchanged size, and leaving, are two changes of the worker's own
    readings: its own noise estimate is high while they are the median of its changes (a lower cap, the safe side),
    and the cap returns to the plain run's once they are not; it is refitted when the estimate moves (the readings do
    not), where it had stayed at 695 for good."""
    assert _cotenant_job(3, 6) == _cotenant_job(None, None)


def test_a_memory_line_from_close_sizes_is_not_followed_past_the_card() -> None:
    """4 GB + 20 MB per sample on a 16 GB card (592 samples fit 99%), measured at sizes 5% apart with 40 MB of
    noise: the slope is off by what the noise is over 24 samples, and 611 caps in 2,000 lay past the card."""
    rng = np.random.default_rng(0)
    sizes = np.tile([240.0, 252.0, 264.0], (2000, 1))
    used = 4 * GB + 20 * MB * sizes + rng.normal(0, 40 * MB, sizes.shape)
    budget = np.minimum(0.99 * 16 * GB, used[:, 2] + 0.95 * (16 * GB - used[:, 2]))
    caps = fit_memory_cap(sizes, used, np.ones(sizes.shape, bool), budget)
    assert (4 * GB + 20 * MB * caps <= 16 * GB).all()
    assert (caps > 264).all()  # it still grows, along the line through the origin


def test_a_new_gpu_is_not_planned_on_memory_already_in_use() -> None:
    model = BatchTimeCurve()
    for k, size in enumerate([100, 300]):  # 2 GB + 20 MB per sample on 16 GB cards
        model.partial_fit([Report("j", w, k, size, 0.1, device="cuda:T4", features={
            "gpu_mem_used": 2 * GB + 20 * MB * size, "gpu_mem_free": 14 * GB - 20 * MB * size}) for w in (0, 1)])
    other = 6 * GB  # another process holds 6 GB of the new worker's card
    model.partial_fit([Report("j", 2, 2, 0, 0.0, device="cuda:T4",
                              features={"gpu_mem_used": other, "gpu_mem_free": 16 * GB - other})])
    cap = int(model.max_batch([2])[0])
    assert other + 2 * GB + 20 * MB * cap <= 16 * GB  # it was 581 samples: 19.6 GB
    assert cap > 300


def test_new_memory_margins_apply_to_the_caps_at_once() -> None:
    model = BatchTimeCurve()
    for k, size in enumerate([100, 400]):
        model.partial_fit([Report("j", 0, k, size, 0.1, device="cuda:0", features={
            "gpu_mem_used": 2 * GB + 10 * MB * size, "gpu_mem_free": 14 * GB - 10 * MB * size})])
    model.set_params(memory_margin=0.9, memory_floor=0.5)  # at most 8 GB of the card
    fresh = BatchTimeCurve(memory_margin=0.9, memory_floor=0.5)
    for k, size in enumerate([100, 400]):
        fresh.partial_fit([Report("j", 0, k, size, 0.1, device="cuda:0", features={
            "gpu_mem_used": 2 * GB + 10 * MB * size, "gpu_mem_free": 14 * GB - 10 * MB * size})])
    assert model.max_batch([0])[0] == fresh.max_batch([0])[0] <= 600  # it kept the old cap, 1,155


class _CapUnknownForWorker0(EWMAThroughput):
    """A model of one's own that knows worker 1's memory cap and not worker 0's (NaN: no cap known)."""

    def max_batch(self, workers: WorkerIds) -> np.ndarray:
        return np.array([np.nan if w == 0 else 500.0 for w in np.atleast_1d(workers)])


def test_a_nan_memory_cap_under_the_auto_model_is_no_cap() -> None:
    # LBBSPPolicy reads a NaN cap as the job's upper bound; AutoCapacityModel had cast it to -2**63, a cap below
    # every lower bound, so two equally fast GPUs were split 1 / 63 where the model alone gave 32 / 32
    reports = [Report("j", w, 0, 32, 0.1, device="cuda:0") for w in range(2)]
    config = JobConfig("j", 2, 64)
    splits = []
    for model in (_CapUnknownForWorker0(), AutoCapacityModel(models={"gpu": _CapUnknownForWorker0()})):
        policy = LBBSPPolicy(model, hedge=None)
        policy.observe(reports)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy's "invalid value encountered in cast" too
            splits.append(policy.decide(2, (16, 48), config).sizes)
    assert splits == [(32, 32), (32, 32)]


GPU = {"gpu_mem_used": 1e9, "gpu_mem_free": 1e10}


def test_every_model_answers_one_no_cap_value() -> None:
    """The auto model's CPU workers and the curve's unseen GPUs are both uncapped: both answer NO_CAP (the auto
    model's had been one more, read through a float)."""
    reports = [Report("j", 0, 0, 8, 0.1), Report("j", 1, 0, 8, 0.1, device="cuda:0", features=GPU)]
    caps = AutoCapacityModel().fit(reports).max_batch([0, 1, 5])
    assert caps is not None and caps[0] == caps[2] == NO_CAP and caps[1] < NO_CAP
    curve = BatchTimeCurve().fit([Report("j", 1, 0, 8, 0.1, device="cuda:0")])
    assert curve.max_batch([7]).tolist() == [NO_CAP]
    nothing_read = fit_memory_cap(np.array([[8.0, 16.0]]), np.array([[1e9, 2e9]]), np.zeros((1, 2), bool),
                                  np.array([1e10]))
    assert nothing_read.tolist() == [NO_CAP]  # through a float it had read 2**61


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


def test_one_reading_past_the_first_size_is_capped_no_higher_than_all_readings_allow() -> None:
    """With a single reading above the first size, the cap is the lower of the line through the origin (400) and the
    cap from every reading, where bytes grow faster than in proportion (a < 0: 383)."""
    sizes, used = np.array([[50.0, 100.0, 200.0]]), np.array([[1.0 * GB, 2.5 * GB, 5.5 * GB]])
    cap = fit_memory_cap(sizes, used, np.ones((1, 3), dtype=bool), np.array([11 * GB]), first=np.array([100.0]))
    assert cap.tolist() == [383]


def test_a_budget_below_the_fixed_bytes_caps_at_zero_not_below() -> None:
    """Caps are whole samples, none below 0: a budget under the line's fixed part is a cap of 0 (a negative cap had
    passed as a bound)."""
    sizes, used = np.array([[100.0, 200.0]]), np.array([[5 * GB, 6 * GB]])
    cap = fit_memory_cap(sizes, used, np.ones((1, 2), dtype=bool), np.array([1 * GB]))
    assert cap.tolist() == [0]


def test_a_new_gpu_is_capped_by_its_peers_cap_and_its_announced_memory_whichever_is_lower() -> None:
    """A GPU with no reading of its own takes the smaller of its hardware peers' smallest cap (480) and what its
    announced free memory holds (about 3,775): both apply."""
    model = BatchTimeCurve()
    model.partial_fit([Report("j", 0, 0, 100, 1.0, device="cuda:0",
                              features={"gpu_mem_used": 2 * GB, "gpu_mem_free": 8 * GB}),
                       Report("j", 1, 0, 0, 0.0, device="cuda:1",
                              features={"gpu_mem_used": 0.5 * GB, "gpu_mem_free": 79.5 * GB})])
    caps = model.max_batch([0, 1])
    assert caps[0] == 480 and caps[1] == 480


def test_caps_at_no_cap_are_no_cap_exactly() -> None:
    """whole_caps: NO_CAP at or past it, exactly (a float at NO_CAP reads 2**61, one past it), and none below 0."""
    caps = whole_caps(np.array([float(NO_CAP), np.inf, 1e30, 7.9, -3.0, np.nan]), nan=NO_CAP)
    assert caps.tolist() == [NO_CAP, NO_CAP, NO_CAP, 7, 0, NO_CAP]


def test_fit_memory_cap_names_only_the_arrays_it_was_given() -> None:
    with pytest.raises(ConfigError) as refused:
        fit_memory_cap(np.array([8.0, 16.0]), np.array([1e9, 2e9]), np.array([True, True]), np.array([1e10]))
    assert "noise" not in str(refused.value).partition(", got ")[2], refused.value  # none given: none named
    with pytest.raises(ConfigError, match=r"noise \(3,\)"):
        fit_memory_cap(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2), bool), np.ones(2), noise=np.zeros(3))


def test_a_gpu_kind_given_a_model_without_caps_is_named(redis_url: str, job: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (said,) = _warnings(redis_url, job, LBBSPPolicy(AutoCapacityModel(models={"gpu": EWMAThroughput()})), caplog)
    assert "worker(s) [0, 1]" in said and "to kind 'gpu', whose model, EWMAThroughput, sets no memory caps" in said
    assert "BatchTimeCurve()" in said
    assert "(lbbsp coordinator: --kind-model gpu=gpu-curve)" in said  # the fix for a user of the command, too


def test_a_gpu_worker_pinned_to_cpu_is_named_alone(redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    (said,) = _warnings(redis_url, job, LBBSPPolicy(AutoCapacityModel(kinds={1: "cpu"})), caplog)
    assert "worker(s) [1]" in said and "to kind 'cpu' (pinned there), whose default model sets no memory caps" in said
    assert "pin them to 'gpu'" in said


@pytest.mark.parametrize("model", [AutoCapacityModel(), AutoCapacityModel(models={"gpu": BatchTimeCurve(window=4)}),
                                   AutoCapacityModel(models={"cpu": EWMAThroughput()}, kinds={0: "gpu"})])
def test_gpu_workers_routed_to_a_model_with_caps_say_nothing(redis_url: str, job: str,
                                                             caplog: pytest.LogCaptureFixture,
                                                             model: AutoCapacityModel) -> None:
    assert _warnings(redis_url, job, LBBSPPolicy(model), caplog) == []


def test_workers_pinned_to_gpu_are_told_to_give_the_gpu_kind_a_curve(redis_url: str, job: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # pinned to 'gpu' already, they had been told to pin themselves to 'gpu'
    model = AutoCapacityModel(models={"gpu": EWMAThroughput()}, kinds={0: "gpu", 1: "gpu"})
    (said,) = _warnings(redis_url, job, LBBSPPolicy(model), caplog)
    assert "BatchTimeCurve()" in said and "pin them" not in said and "(pinned there)" not in said


def test_a_cpu_only_job_is_not_scanned_at_every_decision() -> None:
    """With the default models no worker can go uncapped: settled at the first decision, whatever the reports."""
    assert warn_uncapped("j", LBBSPPolicy(), [])
    assert warn_uncapped("j", LBBSPPolicy(AutoCapacityModel(kinds={3: "fl"})), [])
    assert not warn_uncapped("j", LBBSPPolicy(AutoCapacityModel(kinds={3: "cpu"})), [])  # a GPU may come, pinned


def test_federated_clients_reading_gpu_memory_are_not_told_to_take_a_gpu_curve(
        caplog: pytest.LogCaptureFixture) -> None:
    """Their model plans transfers: a BatchTimeCurve in its place would drop them."""
    report = Report("j", 0, 0, 10, 1.0, device="cuda:0",
                    features={"download_s": 1.0, "upload_s": 1.0, "gpu_mem_used": 1e9, "gpu_mem_free": 1e9})
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        warn_uncapped("j", LBBSPPolicy(AutoCapacityModel(models={"gpu": EWMAThroughput()})), [report])
    assert "report GPU memory" not in caplog.text
