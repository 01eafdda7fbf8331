"""BatchTimeCurve's memory cap with another process on the worker's card (a co-tenant): the readings at the larger
sizes predate it, and had been trusted as they were, so the cap stayed where the card no longer held it; and it
comes back once the co-tenant leaves."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp.config import JobConfig
from lbbsp.models import BatchTimeCurve
from lbbsp.policies import LBBSPPolicy
from lbbsp.protocol import Report

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
