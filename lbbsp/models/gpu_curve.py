"""GPU workers: a batch-time curve per worker (flat while under-used, then linear) and a memory cap.

Speed on a dedicated GPU is stable, but time(batch) is not proportional to the batch: small batches leave
the device under-used, so the time stays flat up to a knee and grows linearly after it. Each worker keeps
``window`` slots of distinct batch sizes, each holding the decayed-weight mean time and the latest GPU memory
reading at that size. Repeats of a size average the noise out instead of pushing old sizes out, and when a
new size needs a slot the two closest sizes merge (at a whole size), so the widest spread of sizes (what pins
the slope) stays in the slots through a long run at one size, though with decaying weight: once that spread
has decayed far, the curve counts as unknown again and is explored again. The slots are fitted with the best
hinge whose knee is 0, one of the slot sizes or between two of them (non-negative slope, so the fit is
monotone). Workers with the same hardware key share what they learn: each curve is shrunk toward its group's
mean as far as the group's spread allows. Memory: bytes = a + b * batch from the slots' ``gpu_mem_used``
where the readings identify the line, else the line through the origin and the largest measurement
(:func:`fit_memory_cap`), refitted whenever a reading changes; where readings at an unchanged size differ (a
noisy telemetry path), the line must rise out of that noise and the cap follows its upper band. The cap extrapolates
into at most (1 - memory_margin) of the memory not yet seen in use at the largest size measured, and never past
(1 - memory_floor) of used + free: a worker nears its card's limit in steps that its measurements confirm. Memory
that other processes take or give back on the card later (a reading off what the slots predict at its size) is
counted apart, so that readings taken before it still give the worker's own bytes and the cap what the card holds now.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..allocation import HingeTime
from ..config import _integer, _real
from ..errors import ConfigError
from ..protocol import Report
from .base import (
    NO_CAP,
    CapacityModel,
    Hardware,
    WorkerIds,
    as_reports,
    by_iteration,
    feature,
    field,
    whole_caps,
    worker_ids,
)

#: The memory line counts only where it rises at least this many bytes across the sizes it was fitted on
#: (fit_memory_cap): less is within a reading's noise and an allocator's rounding (PyTorch rounds to 2 MB blocks).
_MIN_RISE = 32 * 2**20
#: The memory line is trusted this many times the span of the sizes it was fitted on past the largest of them:
#: a slope fitted on close sizes (an exploration's 5%) is off by what the readings' noise is over that span.
#: Further on, the line through the origin (which errs low) sets the cap, and the cap grows as sizes spread.
_LINE_REACH = 2.0
#: Noisy memory readings (fit_memory_cap's ``noise``): the line counts only where its rise exceeds _MIN_RISE plus this
#: many standard errors of that rise, and the cap follows the line with its level and slope each this many standard
#: errors up. A slope fitted on readings held flat at a peak is noise alone, and it had passed the line's tests: with
#: 20 MB of noise on the readings, 41 runs of 260 (50 MB: 65) of a sweep of 4-GPU jobs (warm-ups, first steps above
#: their need, plain runs) were given a batch past the card; at 3 sigmas, 3 (50 MB: 3); at 4, none. Exact readings are
#: not affected: their noise is 0.
_NOISE_SIGMAS = 4.0
#: How many of the latest changes between a worker's consecutive readings at one size (job-wide) estimate the
#: readings' noise (BatchTimeCurve._track_memory_noise), and how many of each worker's own estimate its own.
_NOISE_PAIRS, _OWN_NOISE_PAIRS = 256, 16
#: A known curve becomes unknown (and is explored again) when its weighted spread of sizes has decayed to this
#: share of the spread that made it known.
_STILL_KNOWN = 1e-3
#: A measurement off its size's slot by more than this share (or _SHIFT_SIGMAS times the measured noise, if more)
#: is a miss; _SHIFT_MISSES of them in a row, in the same direction, mean the GPU changed speed (throttling, another
#: process): its slots are forgotten and the curve is learnt afresh, where decaying them would take tens of
#: half-lives (old and new times mixed in one slot read as a flat curve, which kept the split for 175 iterations).
_SHIFT, _SHIFT_SIGMAS, _SHIFT_MISSES = 0.10, 6.0, 2


def fit_hinge(sizes: np.ndarray, times: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Weighted least-squares hinge  t = base + slope * max(x - knee, 0)  per row, slope >= 0.

    Arrays are (workers, points); ``weight`` 0 (or False) marks an absent point. The knee is 0, one of the
    row's sizes or the best knee between two neighbouring sizes (:func:`_knees_between`), above its smallest
    size (so some points lie on the flat part), taken only when it fits clearly better than the straight line.
    A row with a single distinct size says nothing about the shape: it gets the proportional line through the
    origin (the CPU assumption). Pure function; a ConfigError for arrays that are not (workers, points) of one
    shape, or a present point that is not finite.
    """
    sizes, times, w = (np.asarray(a, dtype=float) for a in (sizes, times, weight))
    if sizes.ndim != 2 or times.shape != sizes.shape or w.shape != sizes.shape or 0 in sizes.shape:
        raise ConfigError(f"fit_hinge takes sizes, times and weight as (workers, points) arrays of one shape, at "
                          f"least one of each, got {sizes.shape}, {times.shape} and {w.shape}")
    present = w > 0
    if not (np.isfinite(w).all() and np.isfinite(np.where(present, sizes + times, 0.0)).all()):
        raise ConfigError("fit_hinge takes finite sizes, times and weights (an absent point, of weight 0, may hold "
                          "anything)")
    sizes, t = np.where(present, sizes, 0.0), np.where(present, times, 0.0)  # an absent NaN adds nothing
    n = sizes.shape[0]
    knees = np.concatenate([np.zeros((n, 1)), sizes, _knees_between(sizes, t, w)], axis=1)  # (n, J)
    base, slope, proportional = line_from_sums(hinge_sums(sizes[:, None, :], t[:, None, :], w[:, None, :],
                                                          knees[:, :, None]))
    z = np.maximum(sizes[:, None, :] - knees[:, :, None], 0.0)
    sse = (w[:, None, :] * (t[:, None, :] - base[:, :, None] - slope[:, :, None] * z) ** 2).sum(2)
    smallest = np.where(present, sizes, np.inf).min(1)
    # A knee must sit above the smallest size (flat observations exist) and fit clearly better than the line.
    tolerance = 0.99 * sse[:, :1] - 1e-12 * (w * t * t).sum(1)[:, None]
    sse[:, 1:] = np.where((knees[:, 1:] > smallest[:, None]) & (sse[:, 1:] < tolerance), sse[:, 1:], np.inf)
    pick = np.arange(n), np.argmin(sse, axis=1)
    single = ~(np.where(present, sizes, -np.inf).max(1) > smallest)
    return (np.where(single, 1e-9, np.maximum(base[pick], 1e-9)), np.where(single, 0.0, knees[pick]),
            np.where(single, proportional[:, 0], slope[pick]))


def _knees_between(sizes: np.ndarray, times: np.ndarray, w: np.ndarray) -> np.ndarray:
    """For each pair of neighbouring sizes of each row, the knee between them that fits best: where the mean of
    the points up to the lower size (the flat part) meets the least-squares line of the points from the upper
    size on, clipped to the pair. (n, points - 1); 0 where the points above do not determine a rising line.
    A knee that falls between measured sizes is found exactly, where the sizes alone missed it by a gap."""
    order = np.argsort(np.where(w > 0, sizes, np.inf), axis=1)  # absent points last, weight 0
    x, t, v = (np.take_along_axis(np.asarray(a, dtype=float), order, axis=1) for a in (sizes, times, w))
    x = np.where(v > 0, x, 0.0)
    left_w, left_t = np.cumsum(v, 1)[:, :-1], np.cumsum(v * t, 1)[:, :-1]

    def above(a: np.ndarray) -> np.ndarray:  # sums over the points from the upper size of each pair on
        return np.cumsum(a[:, ::-1], 1)[:, ::-1][:, 1:]

    r_w, r_x, r_t, r_xx, r_xt = (above(a) for a in (v, v * x, v * t, v * x * x, v * x * t))
    with np.errstate(divide="ignore", invalid="ignore"):
        det = r_w * r_xx - r_x ** 2
        slope = (r_w * r_xt - r_x * r_t) / det
        knee = (left_t / left_w - (r_t - slope * r_x) / r_w) / slope
    fits = (left_w > 0) & (det > 1e-9 * np.maximum(r_w * r_xx, 1e-300)) & (slope > 0) & np.isfinite(knee)
    return np.where(fits, np.clip(np.nan_to_num(knee), x[:, :-1], x[:, 1:]), 0.0)


def hinge_sums(sizes: np.ndarray, times: np.ndarray, w: np.ndarray, knees: np.ndarray) -> np.ndarray:
    """The weighted sums a hinge fit at ``knees`` needs, stacked on a new last axis: w, w t, w z, w z^2,
    w z t and w t / x, with z = max(x - knee, 0). The points lie on the last axis of the inputs, the other
    axes broadcast (one set of sums per knee). Sums of decayed measurements decay and grow one by one."""
    z = np.maximum(sizes - knees, 0.0)
    wz = w * z
    return np.stack(np.broadcast_arrays(w.sum(-1), (w * times).sum(-1), wz.sum(-1), (wz * z).sum(-1),
                                        (wz * times).sum(-1), (w * times / np.maximum(sizes, 1.0)).sum(-1)), axis=-1)


def line_from_sums(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(base, slope, proportional slope) of the least-squares hinge at a fixed knee from :func:`hinge_sums`,
    with base >= 0 and slope >= 0: where the free fit's base is negative, or the points above the knee have
    (almost) a single z, so that the free fit is not determined, the best line with base 0 (slope sum w z t /
    sum w z^2), which still passes through the well-measured sizes; where its slope is negative, or no point
    lies above the knee, the flat fit."""
    s_w, s_t, s_z, s_zz, s_zt, s_p = np.moveaxis(sums, -1, 0)
    base, slope, positive = _free_line(s_w, s_t, s_z, s_zz, s_zt)
    return base, slope, s_p / positive


def _free_line(s_w: np.ndarray, s_t: np.ndarray, s_z: np.ndarray, s_zz: np.ndarray,
               s_zt: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`line_from_sums`' base and slope, and the sum of weights it divides by (1 where there is none)."""
    spread = s_w * s_zz
    det = spread - s_z ** 2
    determined = det > 1e-9 * np.maximum(spread, 1e-300)
    rising = s_zz > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = np.maximum(np.where(determined, (s_w * s_zt - s_z * s_t) / det, 0.0), 0.0)
        positive = np.where(s_w > 0, s_w, 1.0)
        base = (s_t - slope * s_z) / positive
        through_zero = ((base < 0) | ~determined) & rising
        if through_zero.any():
            slope = np.where(through_zero, s_zt / np.where(rising, s_zz, 1.0), slope)
            base = np.where(through_zero, 0.0, base)
        return base, slope, positive


def fit_memory_cap(sizes: np.ndarray, used: np.ndarray, valid: np.ndarray, budget: np.ndarray,
                   held: np.ndarray | None = None, first: np.ndarray | None = None,
                   noise: np.ndarray | None = None) -> np.ndarray:
    """Largest batch whose predicted bytes stay within ``budget``, per row. Pure function.

    Bytes are predicted by the least-squares line a + b * batch where the readings identify it: two or more
    distinct sizes, each reading above the one at the next smaller size, and above the smallest size's, by at
    least half what the line (or the two largest sizes' readings, where steeper) predicts there (less
    ``_MIN_RISE``, an allocator's rounding), and a rise of at least ``_MIN_RISE`` bytes across them. Readings
    held at a caching allocator's peak (flat below the largest size run so far, or below a peak set before the
    first report) fail the first test where the sizes are far enough apart to tell; readings that do not rise (a
    framework that reserved the card up front) or rise by noise alone, the second. (A slope of at least a tenth
    of the bytes per sample in use at the largest size had been asked instead: where the fixed part, the model
    and other processes, dwarfs a sample's, as on a nearly full card, no true line passed, and an H100
    with 3.8 GiB free grew from 32 samples by one sample a step, where 1,281 fit.) Elsewhere bytes follow the
    line through the origin and the largest measurement, which over-predicts them above it (a >= 0), so the
    cap errs low; and where the fitted a < 0, whichever of the two lines predicts more. The fitted line is
    followed at most ``_LINE_REACH`` times the span of measured sizes past the largest (its slope is only as
    good as the readings are over that span); beyond, the origin line's cap, where that reaches further.
    ``held``: rows whose readings were seen not to fall when the size did (a caching allocator's peak, which
    slots merged from several sizes can hide from the first test); they get the line through the origin.
    ``first``: each row's size at its first reading (NaN for none); readings at that size and below are left out of
    the line, not out of the line through the origin: the first may be held at a peak set before it (cuDNN's
    benchmark trying workspaces, a warm-up), and with one reading above it the line passed every test above (202
    where 170 fit; a first step 0.5-2 GB above its need went past the card in every run of a sweep). So are the
    readings above it up to the largest size that reads no higher than it (within a byte, and sqrt 2 times the noise
    bands: the first is a noisy reading too), where they span more sizes than ``_MIN_RISE`` does at the least slope
    the rise past them shows: held at the same peak (a granule's rounding keeps sizes a few apart flat).
    ``noise``: each row's standard deviation of one reading in bytes (None: exact readings, as 0): the line counts only
    where its rise across its sizes also exceeds ``_NOISE_SIGMAS`` standard errors of that rise (readings held flat
    at a peak rise by noise alone), and its cap is where the line with its level and slope each ``_NOISE_SIGMAS``
    standard errors up meets the budget (the slope's error grows with the distance from the sizes fitted).
    A ConfigError for arrays not of those shapes ((workers, points), budget, held, first and noise (workers,)), a valid
    reading that is not finite, or a noise that is negative or not finite.
    """
    sizes, used, budget = (np.asarray(a, dtype=float) for a in (sizes, used, budget))
    valid = np.asarray(valid, dtype=bool)
    held = None if held is None else np.asarray(held, dtype=bool)
    first = None if first is None else np.asarray(first, dtype=float)
    given_noise = None if noise is None else np.asarray(noise, dtype=float)
    noise = np.zeros(sizes.shape[:1]) if given_noise is None else given_noise
    if (sizes.ndim != 2 or used.shape != sizes.shape or valid.shape != sizes.shape or 0 in sizes.shape
            or budget.shape != sizes.shape[:1] or (held is not None and held.shape != sizes.shape[:1])
            or (first is not None and first.shape != sizes.shape[:1]) or noise.shape != sizes.shape[:1]):
        # only the arrays given: the shape of a noise left out (made to match sizes) had been named as one given
        raise ConfigError(f"fit_memory_cap takes sizes, used and valid as (workers, points) arrays of one shape, at "
                          f"least one of each, and budget (held, first, noise) as (workers,), got {sizes.shape}, "
                          f"{used.shape}, {valid.shape}, {budget.shape}"
                          + ("" if held is None else f", held {held.shape}")
                          + ("" if first is None else f", first {first.shape}")
                          + ("" if given_noise is None else f", noise {given_noise.shape}"))
    if not np.isfinite(np.where(valid, sizes + used, 0.0)).all():
        raise ConfigError("fit_memory_cap takes finite sizes and readings where valid (an invalid one may hold "
                          "anything)")
    if not (np.isfinite(noise) & (noise >= 0)).all():
        raise ConfigError(f"fit_memory_cap takes a finite noise >= 0 per row, got {noise}")
    if first is not None:  # the line's readings: those above the first size (NaN: no first reading, all of them)
        at_or_below = valid & (sizes <= np.where(np.isnan(first), -np.inf, first)[:, None])
        # nor those read no higher than it, where they span more sizes above it than a granule (_MIN_RISE) does at
        # the least slope the rise past them shows: held at the same peak, with which the line was too shallow (28 MB
        # a sample where 95 were: 154 where 146 fit, in 5 runs of 150 with warm-ups and exact readings); a granule's
        # rounding, which reads sizes a few samples apart the same, keeps them
        rows, margin = np.arange(sizes.shape[0]), _NOISE_SIGMAS * noise
        peak = np.where(at_or_below, used, -np.inf).max(1)
        # within a byte (a merged slot's mean of two equal readings may exceed them by a rounding) and sqrt 2 bands of
        # noise (the peak is a noisy reading too): a held reading just above had formed a line alone with the first
        # that rose (140 where 130 fit; with 20 MB of noise, 1,580 where 1,152 fit)
        flat = valid & ~at_or_below & (used <= (peak + np.sqrt(2) * margin + 1.0)[:, None])
        plateau = np.where(flat | at_or_below, sizes, -np.inf).max(1)
        top = np.argmax(np.where(valid, sizes, -np.inf), axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):  # no reading at the first size, or none above its
            least = (used[rows, top] - peak - _MIN_RISE - margin) / (sizes[rows, top] - plateau)  # plateau: NaN
            # all readings up to the plateau's largest size: one above a flat reading at a larger size is noise or
            # another process, not the worker's own line
            held_flat = (valid & ~at_or_below & (sizes <= plateau[:, None])
                         & (least * (plateau - first) > _MIN_RISE)[:, None])
        above = valid & ~at_or_below & ~held_flat
        caps = _memory_cap(sizes, used, valid, above, budget, held, noise)
        # fewer than two above it: the lower of that cap (the line through the origin) and the cap of all readings
        # (all at or below the first size, a worker that shrank: the origin's line predicts too little below the size
        # it passes); fitted for those rows alone, as the rest (once a worker has grown) need no second fit
        few = np.flatnonzero(above.sum(1) < 2)
        if few.size:
            caps[few] = np.minimum(caps[few], _memory_cap(sizes[few], used[few], valid[few], valid[few], budget[few],
                                                          None if held is None else held[few], noise[few]))
        return caps
    return _memory_cap(sizes, used, valid, valid, budget, held, noise)


def _memory_cap(sizes: np.ndarray, used: np.ndarray, valid: np.ndarray, line: np.ndarray, budget: np.ndarray,
                held: np.ndarray | None, noise: np.ndarray) -> np.ndarray:
    """:func:`fit_memory_cap` on checked arrays: its line fitted on the readings ``line``, its line through the origin
    on the largest size ``valid``."""
    weight = line.astype(float)
    count = weight.sum(1)
    x, y = np.where(line, sizes, 0.0), np.where(line, used, 0.0)
    order = np.argsort(np.where(line, sizes, np.inf), axis=1)
    by_size, read_by_size = np.take_along_axis(x, order, axis=1), np.take_along_axis(y, order, axis=1)
    rising, step = np.diff(read_by_size, axis=1), np.diff(by_size, axis=1)  # by size, the invalid ones last
    pair = np.take_along_axis(line, order, axis=1)[:, 1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_x, mean_y = x.sum(1) / count, y.sum(1) / count
        dx = (x - mean_x[:, None]) * weight
        var = (dx * dx).sum(1)
        b = np.where(var > 0, (dx * (y - mean_y[:, None])).sum(1) / var, np.nan)
        a = mean_y - b * mean_x
        largest = np.argmax(np.where(valid, sizes, -1.0), axis=1)
        rows = np.arange(sizes.shape[0])
        through_origin = used[rows, largest] / np.maximum(sizes[rows, largest], 1.0)
        # each reading must rise over the one at the next smaller size, and over the smallest size's, by half what
        # the line, or the two largest sizes' readings if steeper, predict: readings held flat at a peak set before
        # the first report (a warm-up at a larger batch), then rising, had fitted a line too shallow that the cap
        # followed past the card (1,853 where 1,014 fit); a reading may fall short by an allocator's granule (20 MB
        # under expandable segments), so that sizes one sample apart, read the same, still fit a line
        last = np.maximum(count.astype(np.int64) - 2, 0)[:, None]
        top_slope = np.take_along_axis(rising, last, axis=1)[:, 0] / np.take_along_axis(step, last, axis=1)[:, 0]
        expected = np.fmax(b, np.where(count >= 2, top_slope, np.nan))[:, None]
        from_smallest = read_by_size - read_by_size[:, :1] >= 0.5 * expected * (by_size - by_size[:, :1]) - _MIN_RISE
        consistent = (~pair | ((rising >= 0.5 * expected * step - _MIN_RISE) & from_smallest[:, 1:])).all(1)
        top, bottom = sizes[rows, largest], np.where(line, sizes, np.inf).min(1)
        slope_error = _NOISE_SIGMAS * noise / np.sqrt(var)  # 0 for exact readings
        linear = np.isfinite(b) & ((b - slope_error) * (top - bottom) >= _MIN_RISE) & consistent
        if held is not None:
            linear &= ~held
        origin_cap = budget / through_origin
        # the line's upper band: its level at the mean size and its slope, each _NOISE_SIGMAS standard errors up
        upper = b + slope_error
        level = mean_y + _NOISE_SIGMAS * noise / np.sqrt(count) - upper * mean_x
        line_cap = (budget - np.where(linear, level, 0.0)) / np.where(linear, upper, 1.0)
        reach = top + _LINE_REACH * (top - bottom)
        reached = np.where(line_cap <= reach, line_cap, np.maximum(reach, origin_cap))
        cap = np.where(linear, np.where(a < 0, np.minimum(line_cap, origin_cap), reached), origin_cap)
    cap = np.where(valid.any(1), cap, np.inf)
    return whole_caps(cap)


class BatchTimeCurve(CapacityModel):
    """Per-worker hinge curve time(batch) and memory cap, from ``window`` slots of distinct batch sizes.

    ``half_life``: measurements of a worker (one per iteration it reports) after which an earlier one counts half,
    so a curve follows a GPU that slows down. A worker's curve is *known* while its slots hold as much information
    on the slope (the weighted spread of their sizes) as two measurements ``explore_fraction`` / 2 of its largest
    size apart (at least one sample; the older one's weight decays, so two sizes one sample apart take a third
    measurement). Until then, and again once a long run at one size has decayed the other sizes that far, the
    curve is the proportional line through the origin and ``explore`` moves ``explore_fraction`` of a batch
    between such workers. ``partial_fit(..., defer=True)`` leaves the knee search of the workers whose set of
    sizes changed to :meth:`finish_learning`; the decision in between reads their line at the knee found before.
    """

    # Learned per-worker arrays (index: worker id), created and grown by _grow.
    mem_total_: np.ndarray
    mem_announced_: np.ndarray
    mem_rate_: np.ndarray
    count_: np.ndarray
    latest_: np.ndarray
    latest_weight_: np.ndarray
    base_: np.ndarray
    knee_: np.ndarray
    slope_: np.ndarray
    observed_max_: np.ndarray
    known_: np.ndarray
    cap_: np.ndarray
    group_: np.ndarray
    misses_: np.ndarray  # large misses in a row against the slot of the size measured, signed by direction
    read_size_: np.ndarray  # the size of the worker's latest memory reading (NaN before one)
    read_mem_: np.ndarray  # that reading
    mem_first_size_: np.ndarray  # the size of the first measured step with a reading, NaN until one
    mem_held_: np.ndarray  # a reading did not fall when the size did: held at a caching allocator's peak
    mem_other_: np.ndarray  # bytes other processes took on the card since the slots' readings (kept net of it)
    mem_doubt_: np.ndarray  # the part of mem_other_ that may be a caching allocator's peak instead (_watch_others)
    mem_noise_: float  # standard deviation of one memory reading, job-wide (_track_memory_noise); 0 for exact ones
    mem_changes_: np.ndarray  # the latest |changes| between consecutive readings at one size, a ring
    mem_changes_seen_: int  # how many changes the ring has taken, all told
    mem_own_noise_: np.ndarray  # each worker's own standard deviation of one reading, from its own changes
    mem_own_changes_: np.ndarray  # (workers, _OWN_NOISE_PAIRS): each worker's latest |changes|, a ring
    mem_own_seen_: np.ndarray  # per worker: how many changes its ring has taken, all told
    pending_: np.ndarray

    _STRUCTURAL = frozenset({"window"})

    def __init__(self, window: int = 8, *, memory_margin: float = 0.05, memory_floor: float = 0.01,
                 explore_fraction: float = 0.05, half_life: float = 20.0) -> None:
        self.window = window
        self.memory_margin = memory_margin
        self.memory_floor = memory_floor
        self.explore_fraction = explore_fraction
        self.half_life = half_life

    @by_iteration
    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> BatchTimeCurve:
        reports = as_reports(reports)
        if not reports:  # an iteration nobody reported in: nothing to learn, and an unfitted model stays so
            self._check_params()
            return self
        if not hasattr(self, "slot_size_"):
            self._check_params()
            self.slot_size_ = np.zeros((0, self.window))
            self.slot_time_ = np.zeros((0, self.window))
            self.slot_mem_ = np.full((0, self.window), np.nan)
            self.slot_weight_ = np.zeros((0, self.window))
            self.noise_ = np.nan
            self.mem_noise_, self.mem_changes_, self.mem_changes_seen_ = 0.0, np.zeros(_NOISE_PAIRS), 0
            self.group_ids_: dict[Hardware, int] = {}
            self.pending_ = np.zeros(0, dtype=np.int64)
            # every table from the start, so a model that has seen only announcements answers from priors; one row
            # (worker 0, unmeasured until it reports) at least, which ids beyond the tables read in its place
            self._grow(1)
        self.finish_learning()
        self._remember_hardware(reports)
        size, seconds, rows = field(reports, "samples"), field(reports, "compute_s"), field(reports, "worker")
        used, free = feature(reports, "gpu_mem_used"), feature(reports, "gpu_mem_free")
        measured = (size > 0) & (seconds > 0)
        if not measured.all():
            self._announce(rows[~measured], used[~measured], free[~measured])
            rows, size, seconds, used, free = rows[measured], size[measured], seconds[measured], used[measured], free[measured]
        if not rows.size:
            return self
        self._grow(int(rows.max()) + 1)
        self._assign_groups(rows)
        every = _all_or(rows, self.count_.size)
        total = used + free
        finite, known_total = np.isfinite(total), self.mem_total_[every]
        new_total = finite & (total != known_total)
        if new_total.any():  # elsewhere the card's size is the one known, or not reported
            self.mem_total_[every] = np.where(finite, total, known_total)
        # a reading other than the one before, or at another size: the only ones that memory watching reads
        moved = np.isfinite(used) & ((size != self.read_size_[every]) | (used != self.read_mem_[every]))
        any_moved = bool(moved.any())
        new_other = self._watch_others(every, size, used, moved) if any_moved else moved  # (all False)
        again = np.isfinite(used) & (size == self.read_size_[every])  # read at the size of the worker's reading before
        new_noise = np.zeros(rows.size, dtype=bool)  # whose own noise estimate moved: its cap with it
        if again.any():
            new_noise[again] = self._track_memory_noise((used - self.read_mem_[every])[again], rows[again])
        new_size, new_mem, held = self._record(every, size, seconds, used)
        first = np.isnan(self.mem_first_size_[every]) & np.isfinite(used)
        if first.any():  # the line leaves out readings at this size and below (fit_memory_cap)
            self.mem_first_size_[every] = np.where(first, size, self.mem_first_size_[every])
        new_held = self._watch_readings(every, size, used) if any_moved else moved
        self.latest_[every] = size
        self.count_[every] += 1
        # A new size changes the slots: take the sums at the knee found so far from them (the knee is searched again
        # in finish_learning). Elsewhere the sizes are unchanged: decay the sums and add the measurement, O(1) each.
        fresh = rows[new_size] if new_size.any() else None
        if fresh is not None:
            self._sums_from_slots(fresh)
            self._largest_size(fresh)
            rest, x, t, held = rows[~new_size], size[~new_size], seconds[~new_size], held[~new_size]
            rest = _all_or(rest, self.count_.size)
        else:
            rest, x, t = every, size, seconds
        self._add_to_sums(rest, x, t, held)
        self._know(every)
        self._line(every)
        # the cap follows every change of the memory readings, also another process's on the same card
        refit = new_size | new_mem | new_total | new_noise
        if any_moved:
            refit |= new_held | new_other
        if refit.any():
            self._fit_memory(rows[refit])
        if fresh is not None:
            self.pending_ = np.union1d(self.pending_, fresh)
        self._pool()
        return self if defer else self.finish_learning()

    def finish_learning(self) -> BatchTimeCurve:
        """Search the knee again for the workers whose set of sizes changed since the last search (4 ms a call at
        1,024 workers, so a coordinator runs it after writing the split)."""
        pending = getattr(self, "pending_", None)
        if pending is not None and pending.size:
            self.pending_ = pending[:0]
            weight, sizes, times = self.slot_weight_[pending], self.slot_size_[pending], self.slot_time_[pending]
            _, self.knee_[pending], _ = fit_hinge(sizes, times, weight)
            self._sums_from_slots(pending)
            self._line(pending)
            self._pool()
        return self

    def predict(self, workers: WorkerIds) -> np.ndarray:
        """Throughput at each worker's latest batch size, as the curve predicts it."""
        self._check_is_fitted("slot_size_")
        known = _all_or(np.flatnonzero(self.count_ > 0), self.count_.size)
        throughput = np.full(self.count_.size, np.nan)  # per worker id; the prior fills workers never measured
        latest = self.latest_[known]
        curve = HingeTime(self.pooled_base_[known], self.pooled_knee_[known], self.pooled_slope_[known],
                          self.observed_max_[known])
        throughput[known] = latest / curve.time(latest)
        return self._with_prior(throughput, workers)

    def time_model(self, workers: WorkerIds) -> HingeTime:
        self._check_is_fitted("slot_size_")
        workers_arr = worker_ids(workers)
        curve = self._curve(workers_arr)
        unseen = curve.observed_max <= 0
        if unseen.any():  # cold start: a straight line at the similar-hardware prior throughput
            speed = np.nan_to_num(self.predict(workers_arr[unseen]), nan=1.0)
            curve.base[unseen], curve.knee[unseen], curve.slope[unseen] = 1e-9, 0.0, 1.0 / speed
        return curve

    def max_batch(self, workers: WorkerIds) -> np.ndarray:
        """Largest batch each worker's GPU memory holds (with the margin). For a worker with no memory reading of
        its own yet (not measured, or measured without GPU features), the smallest cap on its hardware (else it
        would take what its capped peers cannot hold, and run out of memory) and, where it announced its GPU
        memory, what the memory it announced free holds at the most bytes per sample any worker measured (both
        where both apply); a huge number where nothing is known."""
        self._check_is_fitted("slot_size_")
        workers_arr = worker_ids(workers)
        inside = workers_arr < self.count_.size
        if inside.all():
            caps, cold = self.cap_[workers_arr], np.flatnonzero(~np.isfinite(self.mem_rate_[workers_arr]))
        else:
            safe = np.where(inside, workers_arr, 0)
            caps = np.where(inside, self.cap_[safe], NO_CAP)
            cold = np.flatnonzero(~inside | ~np.isfinite(self.mem_rate_[safe]))
        if cold.size and self.group_ids_:
            measured = np.isfinite(self.mem_rate_)
            smallest = np.full(len(self.group_ids_), NO_CAP)
            np.minimum.at(smallest, self.group_[measured], self.cap_[measured])
            keys = [self.hardware_.get(worker) for worker in workers_arr[cold].tolist()]
            group = np.array([-1 if key is None else self.group_ids_.get(key, -1) for key in keys], dtype=np.int64)
            caps[cold] = np.where(group >= 0, smallest[np.maximum(group, 0)], NO_CAP)
            rates = self.mem_rate_[measured & (self.mem_rate_ > 0)]
            if rates.size:
                cold_safe = np.where(inside[cold], workers_arr[cold], 0)
                in_use = self.mem_announced_[cold_safe]  # another process's, or this worker's loaded model
                budget = self._budget(self.mem_total_[cold_safe], in_use) - in_use
                announced = whole_caps(budget / rates.max(), nan=NO_CAP)
                caps[cold] = np.where(inside[cold], np.minimum(caps[cold], announced), caps[cold])
        return caps

    def explore(self, workers: WorkerIds, sizes: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        """Move ``explore_fraction`` of a batch between pairs of workers of similar size whose curve is unknown
        and whose coming size is too close to their latest to reveal it, so the next reports pin each slope; sum
        unchanged. Stops for a worker once its curve is known; nothing moves at ``explore_fraction`` 0."""
        self._check_is_fitted("slot_size_")
        sizes = np.asarray(sizes, dtype=np.int64)
        if self.explore_fraction == 0:
            return sizes
        workers_arr = worker_ids(workers)
        inside = workers_arr < self.count_.size
        if inside.all():
            ids = workers_arr
            unknown = np.flatnonzero((self.count_[ids] > 0) & ~self.known_[ids])
        else:
            ids = np.where(inside, workers_arr, 0)
            unknown = np.flatnonzero(inside & (self.count_[ids] > 0) & ~self.known_[ids])
        if unknown.size == 0:
            return sizes
        latest, coming = self.latest_[ids[unknown]], sizes[unknown]
        unknown = unknown[np.abs(coming - latest) < self._needed_spread(np.maximum(latest, coming))]  # not revealing
        unknown = unknown[np.argsort(sizes[unknown], kind="stable")]
        return perturb_pairs(sizes, unknown, self.explore_fraction, lower, upper)

    def _check_params(self) -> None:
        _integer(self.window, "window", 2, 256)  # slots per worker: a billion had been an out-of-memory kill
        for name in ("memory_margin", "memory_floor", "explore_fraction"):
            _real(getattr(self, name), name, 0.0, 1.0, "in [0, 1)", hi_open=True)
        _real(self.half_life, "half_life", 0.0, np.inf, "a positive number of measurements", lo_open=True)

    @property
    def _decay(self) -> float:
        """The factor every weight takes per measurement of its worker."""
        return 0.5 ** (1.0 / self.half_life)

    def _needed_spread(self, largest: np.ndarray) -> np.ndarray:
        """The span of sizes that makes a curve known: explore_fraction / 2 of the largest, at least 1."""
        return np.maximum(1.0, 0.5 * self.explore_fraction * largest)

    def _parameters_changed(self, names: set[str]) -> None:
        """New memory margins apply to the cached caps at once (they are refitted only when a reading changes)."""
        if names & {"memory_margin", "memory_floor"} and hasattr(self, "cap_"):
            self._fit_memory(np.arange(self.cap_.size))

    def _budget(self, total: np.ndarray, seen: np.ndarray) -> np.ndarray:
        """Bytes a worker may plan to use: ``seen`` in use and (1 - memory_margin) of the rest of its card
        ``total``, at most (1 - memory_floor) of the card."""
        return np.minimum((1 - self.memory_floor) * total, seen + (1 - self.memory_margin) * (total - seen))

    def _announce(self, rows: np.ndarray, used: np.ndarray, free: np.ndarray) -> None:
        """Note the GPU memory that workers not measured yet announce, for their cold-start cap."""
        total = used + free
        announced = np.isfinite(total)
        if announced.any():
            rows, used, total = rows[announced], used[announced], total[announced]
            self._grow(int(rows.max()) + 1)
            cold = self.count_[rows] == 0
            self.mem_total_[rows[cold]], self.mem_announced_[rows[cold]] = total[cold], used[cold]

    def _record(self, rows: np.ndarray | slice, size: np.ndarray, seconds: np.ndarray,
                used: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decay the rows' weights and add one measurement each to the slot of its size: a new slot, merging the
        two closest sizes when all are taken. A slot keeps the decayed mean of its times and its latest memory
        reading (memory in use is a state, not a noisy sample), net of what other processes took since
        (``mem_other_``, which a GPU that changed speed, :meth:`_shifted`, sets to none as it starts from empty
        slots); a single measurement beyond the band is held out. Returns which rows changed their set of sizes,
        which read memory other than their slot held, and which measurements were held out."""
        # where rows is a slice, these are views: the slots change in place
        sizes, times, mem = self.slot_size_[rows], self.slot_time_[rows], self.slot_mem_[rows]
        weight = self.slot_weight_[rows]
        weight *= self._decay
        match = (sizes == size[:, None]) & (weight > 0)
        at = np.arange(size.size), np.argmax(match, axis=1)  # a row's sizes are distinct: its one slot of that size
        has, time_at = match[at], times[at]
        timed = has & (time_at > 0)
        every_timed = bool(timed.all())
        if every_timed:
            miss = seconds / time_at - 1.0
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                miss = np.where(timed, seconds / time_at - 1.0, 0.0)
        shifted, missed = self._shifted(rows, miss)
        any_missed = bool(missed.any())
        any_shifted = any_missed and bool(shifted.any())
        if any_shifted:
            weight[shifted], match[shifted] = 0.0, False
            has = has & ~shifted
        new = ~has
        any_new = (any_shifted or not every_timed) and bool(new.any())  # every row timed had its slot
        if any_new:
            fresh = np.flatnonzero(new)
            full = fresh[(weight[fresh] > 0).all(1)]
            if full.size:
                _merge_closest(sizes, times, mem, weight, full)
                match[full] = (sizes[full] == size[full, None]) & (weight[full] > 0)  # merged into the new size
            empty = fresh[~match[fresh].any(1)]
            slot = np.argmin(weight[empty] > 0, axis=1)  # first empty slot
            sizes[empty, slot], times[empty, slot], mem[empty, slot] = size[empty], 0.0, np.nan
            match[empty, slot] = True
            at[1][fresh] = np.argmax(match[fresh], axis=1)
            time_at = times[at]
        before = weight[at]
        # a miss beyond the band is a change (confirmed by the next) or an outlier: neither noise nor time to keep
        held, noisy = (missed & ~shifted, ~new & ~missed) if any_missed else (missed, has)
        if every_timed and not any_missed:  # the usual case: each measurement had its slot, and missed it by noise
            self._track_noise(miss, before)
        else:
            self._track_noise(seconds[noisy] / time_at[noisy] - 1.0, before[noisy])
        mean = (before * time_at + seconds) / (before + 1.0)
        times[at] = np.where(held, time_at, mean) if any_missed and held.any() else mean
        if any_shifted:  # forgotten slots: readings start afresh
            other = np.where(shifted, 0.0, self.mem_other_[rows])
            self.mem_other_[rows] = other
            self.mem_doubt_[rows] = np.where(shifted, 0.0, self.mem_doubt_[rows])
        else:
            other = self.mem_other_[rows]
        reads, net, mem_at = np.isfinite(used), used - other, mem[at]
        if reads.all():
            new_mem = mem_at != net
            mem[at] = net
        else:
            new_mem = reads & (mem_at != net)
            mem[at] = np.where(reads, net, mem_at)
        # memory in use does not fall as the batch grows: a smaller size's reading above this one is stale (read with
        # another process that has left since, unseen: it came as the worker first ran that size); bring it down
        if any_new or new_mem.any():
            read = np.flatnonzero(new_mem | new)
            stale = (weight[read] > 0) & (sizes[read] < size[read, None]) & (mem[read] > net[read, None] + _MIN_RISE)
            if stale.any():
                mem[read] = np.where(stale, net[read, None], mem[read])
                new_mem[read] |= stale.any(1)
        weight[at] = after = (before + ~held) if any_missed else (before + 1.0)
        self.latest_weight_[rows] = after
        if not isinstance(rows, slice):
            self.slot_size_[rows], self.slot_time_[rows], self.slot_mem_[rows] = sizes, times, mem
            self.slot_weight_[rows] = weight
        return new, new_mem, held

    def _shifted(self, rows: np.ndarray | slice, miss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(Which rows' GPUs changed speed, which rows missed): count each row's misses in a row against its size's
        slot, ``miss`` (relative; 0 at a size without a slot), signed by direction, reset by a measurement within the
        band or at a size without a slot."""
        band = max(_SHIFT, _SHIFT_SIGMAS * math.sqrt(self.noise_)) if math.isfinite(self.noise_) else _SHIFT
        within = np.abs(miss) <= band
        if within.all():  # the usual case: every streak ends
            self.misses_[rows] = 0
            return ~within, ~within
        direction = np.sign(miss) * (np.abs(miss) > band)
        streak = self.misses_[rows]
        streak = np.where((direction != 0) & (np.sign(streak) == direction), streak + direction, direction)
        shifted = np.abs(streak) >= _SHIFT_MISSES
        self.misses_[rows] = np.where(shifted, 0, streak)
        return shifted, direction != 0

    def _add_to_sums(self, rows: np.ndarray | slice, x: np.ndarray, t: np.ndarray, held: np.ndarray) -> None:
        """Decay the hinge sums of ``rows`` (sizes unchanged) and add one measurement each, ``t`` seconds at ``x``
        samples, at the row's knee; a measurement ``held`` out adds nothing. In place, column by column."""
        z = np.maximum(x - self.knee_[rows], 0.0)
        if held.any():
            added = np.column_stack([np.ones_like(z), t, z, z * z, z * t, t / x]) * ~held[:, None]
            self.sums_[rows] = self._decay * self.sums_[rows] + added
            return
        sums = self.sums_[rows]  # a view where rows is a slice
        sums *= self._decay
        for column, value in enumerate((1.0, t, z, z * z, z * t, t / x)):
            sums[:, column] += value
        if not isinstance(rows, slice):
            self.sums_[rows] = sums

    def _sums_from_slots(self, rows: np.ndarray) -> None:
        """The hinge sums of ``rows`` at their knee, taken afresh from their slots."""
        weight = self.slot_weight_[rows]
        self.sums_[rows] = hinge_sums(self.slot_size_[rows], np.where(weight > 0, self.slot_time_[rows], 0.0), weight,
                                      self.knee_[rows][:, None])

    def _largest_size(self, rows: np.ndarray) -> None:
        """observed_max_ of ``rows``: the largest size in their slots (changed by a new size only)."""
        self.observed_max_[rows] = np.where(self.slot_weight_[rows] > 0, self.slot_size_[rows], 0.0).max(1)

    def _know(self, rows: np.ndarray | slice) -> None:
        """known_: whether the slots' weighted spread of sizes, sum w (x - mean)^2, is at least that of two
        measurements the needed span apart. Weights decay: a known curve stays known until a long run at one
        size has decayed that spread to _STILL_KNOWN of it (about ten half-lives), then it is explored again
        (each exploration costs a little iteration time)."""
        weight, sizes = self.slot_weight_[rows], self.slot_size_[rows]
        moment = weight * sizes
        total, first, second = weight.sum(1), moment.sum(1), (moment * sizes).sum(1)
        spread = second - first * first / np.maximum(total, 1e-300)
        needed = 0.5 * self._needed_spread(self.observed_max_[rows]) ** 2
        self.known_[rows] = spread >= np.where(self.known_[rows], _STILL_KNOWN * needed, needed)

    def _line(self, rows: np.ndarray | slice) -> None:
        """base_ and slope_ of ``rows`` from their sums; the proportional line where the curve is not known."""
        sums = self.sums_[rows]
        base, slope, positive = _free_line(*(sums[:, column] for column in range(5)))
        known = self.known_[rows]
        if known.all():
            self.base_[rows], self.slope_[rows] = np.maximum(base, 1e-9), slope
        else:
            self.base_[rows] = np.where(known, np.maximum(base, 1e-9), 1e-9)
            self.slope_[rows] = np.where(known, slope, sums[:, 5] / positive)

    def _assign_groups(self, rows: np.ndarray) -> None:
        """Number each new worker's hardware key (device, cores): workers that share one pool their curves."""
        for row in rows[self.group_[rows] < 0].tolist():
            self.group_[row] = self.group_ids_.setdefault(self.hardware_[row], len(self.group_ids_))

    def _track_noise(self, miss: np.ndarray, weight: np.ndarray) -> None:
        """Update noise_, the variance of one measurement's time relative to the truth, from the relative
        misses of repeated sizes against their slot's mean (itself off by 1 / weight of that variance);
        exponentially weighted over iterations."""
        if miss.size >= 2:
            variance = float(np.add.reduce(miss ** 2 / (1.0 + 1.0 / weight)) / miss.size)  # np.mean, less its checks
            self.noise_ = variance if np.isnan(self.noise_) else 0.9 * self.noise_ + 0.1 * variance

    def _track_memory_noise(self, change: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Update mem_noise_, the standard deviation of one memory reading, from ``change``, the differences between
        workers' consecutive readings at an unchanged size, kept with the latest ``_NOISE_PAIRS`` before them: their
        root mean square over sqrt 2. A change beyond _MIN_RISE and _SHIFT_SIGMAS times the median's estimate of their
        spread is a state that changed (another process arriving or leaving, a cache released), not noise: kept, a
        co-tenant of 3 GB arriving had held a worker's cap at 451 where 600 fit. Readings that repeat exactly keep
        it 0. Each worker of ``rows`` (one per change) has its own estimate too, the median's over its latest
        ``_OWN_NOISE_PAIRS`` changes, and its cap follows the larger: one noisy worker among exact ones had the
        job's estimate near 0, its changes past 32 MiB taken for changed states, and in 6 of 65 jobs of 4 GPUs (20
        MB of noise; 50 MB: 10) it had been given a batch past its card. Whether each worker's own estimate moved
        (its cap then moves too: a state that changed and then left the median had left it lower)."""
        change = np.abs(change)
        recent = change[-_NOISE_PAIRS:]
        self.mem_changes_[(self.mem_changes_seen_ + np.arange(recent.size)) % _NOISE_PAIRS] = recent
        self.mem_changes_seen_ += recent.size
        seen = self.mem_changes_[: min(self.mem_changes_seen_, _NOISE_PAIRS)]
        spread = float(np.median(seen)) / 0.6745  # a normal change's standard deviation, from the median of |change|
        noise = seen[seen <= max(_MIN_RISE, _SHIFT_SIGMAS * spread)]
        self.mem_noise_ = math.sqrt(float(np.mean(noise * noise)) / 2) if noise.size else 0.0
        self.mem_own_changes_[rows, self.mem_own_seen_[rows] % _OWN_NOISE_PAIRS] = change
        self.mem_own_seen_[rows] += 1
        count = np.minimum(self.mem_own_seen_[rows], _OWN_NOISE_PAIRS)
        # the median's estimate: a few changed states among them (a co-tenant arriving, then leaving) are not noise. It
        # counts from the first change (from the fifth, 4 and 7 of those 65 jobs still went past the card); a state
        # that changed in the first two errs safe, a lower cap for as many iterations
        mine = np.sort(np.where(np.arange(_OWN_NOISE_PAIRS) < count[:, None], self.mem_own_changes_[rows], np.inf))
        middle = np.take_along_axis(mine, np.stack([(count - 1) // 2, count // 2], axis=1), axis=1)
        median = middle.mean(axis=1)  # np.nanmedian's, at a fifth of its time
        before = self.mem_own_noise_[rows]
        self.mem_own_noise_[rows] = median / 0.6745 / math.sqrt(2)
        return self.mem_own_noise_[rows] != before

    def _pool(self) -> None:
        """Shrink each known curve toward its hardware group's mean curve (empirical Bayes): a worker keeps
        the share tau^2 / (tau^2 + noise_ / n) of its own curve, where n counts its measurements at its latest
        size and tau^2 is how much the group's workers really differ (their spread beyond what the noise
        explains). Identical GPUs then share one precise curve from their first measurements; GPUs that
        differ, groups of under three and curves still unknown keep their own (the proportional line, knee 0)."""
        own = self.known_ & (self.count_ > 0)
        count = int(np.count_nonzero(own))
        if not math.isfinite(self.noise_) or count < 3:
            self._own_curves()
            return
        whole = count == own.size
        at = slice(None) if whole else _all_or(np.flatnonzero(own), own.size)  # views where a slice does
        group, groups = self.group_[at], len(self.group_ids_)
        members = np.bincount(group, minlength=groups)
        params = self.base_[at], self.knee_[at], self.slope_[at]
        per_member = np.maximum(members, 1)
        means = [(np.bincount(group, p, minlength=groups) / per_member)[group] for p in params]
        x = self.latest_[at]
        mine = params[0] + params[2] * np.maximum(x - params[1], 0.0)
        theirs = means[0] + means[2] * np.maximum(x - means[1], 0.0)
        noise = self.noise_ / self.latest_weight_[at]
        beyond_noise = np.bincount(group, (mine / theirs - 1.0) ** 2 - noise, minlength=groups) / np.maximum(members - 1, 1)
        tau2 = np.where(members >= 3, np.maximum(beyond_noise, 0.0), np.inf)[group]
        total = tau2 + noise
        shrunk = np.isfinite(tau2) & (total > 0)  # with no noise and no spread, nothing to shrink
        with np.errstate(divide="ignore", invalid="ignore"):
            keep = np.where(shrunk, tau2 / total, 1.0)
        rest = 1 - keep
        pooled = [keep * p + rest * m for p, m in zip(params, means)]
        if whole:
            self.pooled_base_, self.pooled_knee_, self.pooled_slope_ = pooled
        else:
            self._own_curves()
            self.pooled_base_[at], self.pooled_knee_[at], self.pooled_slope_[at] = pooled

    def _own_curves(self) -> None:
        """Every worker's pooled curve set to its own (the proportional line, knee 0, where its curve is unknown)."""
        self.pooled_base_, self.pooled_slope_ = self.base_.copy(), self.slope_.copy()
        self.pooled_knee_ = np.where(self.known_, self.knee_, 0.0)

    def _watch_readings(self, rows: np.ndarray | slice, size: np.ndarray, used: np.ndarray) -> np.ndarray:
        """Mark the rows whose memory reading did not fall while their size did (held at a peak, as NVML's 'used'
        is under PyTorch's caching allocator, or another process grew meanwhile); returns the rows newly marked."""
        reads = np.isfinite(used)
        held = reads & (size < self.read_size_[rows]) & (used >= self.read_mem_[rows]) & ~self.mem_held_[rows]
        self.mem_held_[rows] |= held
        self.read_size_[rows] = np.where(reads, size, self.read_size_[rows])
        self.read_mem_[rows] = np.where(reads, used, self.read_mem_[rows])
        return held

    def _watch_others(self, rows: np.ndarray | slice, size: np.ndarray, used: np.ndarray,
                      check: np.ndarray) -> np.ndarray:
        """Follow ``mem_other_``, the bytes other processes have taken on each row's card since its slots' readings
        (which are kept net of it): a reading above what the slots predict at its size (:func:`_expected_reading`:
        as readings fall, or on a card seen holding its peak, ``mem_held_``, as they are held) by more than an
        allocator's granule (``_MIN_RISE``) and a sample's bytes is another process arriving, one below it one
        leaving (down to none); past the largest size only a departure shows (the worker's own bytes there are
        unmeasured). The slots' readings at the larger sizes had predated a co-tenant that came while the worker ran
        smaller, and the cap stayed where the card no longer held it (648 where 500 fit). A reading that first shows
        a peak held, as the size fell, is ambiguous: a co-tenant that came just then reads the same (739 where 350
        fit). It is taken for a co-tenant, in doubt (``mem_doubt_``: read as falling), until a later size below the
        largest, far enough from it for the worker's own bytes to show: a reading that stayed put there is the
        caching allocator's peak, and read as held, the card shows the doubt's bytes leave (kept, they had held a
        nearly full card's cap at each smaller size it ran, down to 1 sample). A held card whose reading moves with
        its size, by its own bytes, holds no peak (the first such reading came with a co-tenant): it is read as
        falling again. ``check``: the readings to follow, those other than the one before or at another size (the
        same reading at the same size is what its slot predicts). Returns the rows whose ``mem_other_`` or
        ``mem_held_`` changed."""
        changed = np.zeros(size.size, dtype=bool)
        ids = np.arange(self.mem_other_.size)[rows][check]
        size, used, before_size, before = size[check], used[check], self.read_size_[ids], self.read_mem_[ids]
        other, doubt, held = self.mem_other_[ids], self.mem_doubt_[ids], self.mem_held_[ids]
        sizes, mem = self.slot_size_[ids], self.slot_mem_[ids]
        valid = (self.slot_weight_[ids] > 0) & np.isfinite(mem)
        falling, holding, per_sample, beyond = _expected_reading(sizes, mem, valid, size)
        slack = _MIN_RISE + np.nan_to_num(per_sample)  # a granule, and a merged slot's rounding to a whole sample
        step, rise = size - before_size, used - before
        with np.errstate(invalid="ignore"):
            moved = ~beyond & (per_sample * np.abs(step) > 2 * slack)  # far enough for its own bytes to show
            flat = moved & (np.abs(rise) <= slack)
            own = moved & (rise * step > 0) & (np.abs(rise) >= 0.5 * per_sample * np.abs(step))
        unheld = held & own
        doubt = np.where(flat | own, 0.0, doubt)
        held &= ~own
        expected = np.where(held & (doubt == 0), holding, falling) + other  # in doubt: as the co-tenant it is taken for
        arrived = ~beyond & (used > expected + slack)
        left = used < expected - slack
        updated = np.maximum(other + np.where(arrived | left, used - expected, 0.0), 0.0)
        ambiguous = arrived & ~held & (step < 0) & (rise >= 0)  # what newly marks a card held
        doubt = np.minimum(np.where(ambiguous, used - expected, doubt), updated)
        self.mem_other_[ids], self.mem_doubt_[ids], self.mem_held_[ids] = updated, doubt, held
        changed[check] = (updated != other) | unheld
        return changed

    def _fit_memory(self, rows: np.ndarray) -> None:
        """Cache each row's memory cap and its bytes per sample through the origin at its largest size (both from
        its own readings, net of ``mem_other_``, which the budget counts as in use); a row whose slots hold no
        reading keeps those it had (a GPU that changed speed forgets its slots, and the report that showed it may
        lack a reading: the worker, alone on its hardware, had been left uncapped). Where another process's memory
        brings a cap below the largest size, on a card whose readings fall with its size (a held peak covers the
        sizes below it), the cap is also held to what the latest reading leaves free at those bytes per sample: the
        line through the origin predicts too little below the size it passes through."""
        sizes, mem = self.slot_size_[rows], self.slot_mem_[rows]
        valid = (self.slot_weight_[rows] > 0) & np.isfinite(mem)
        measured = valid.any(1)
        at = np.arange(rows.size), np.argmax(np.where(valid, sizes, -1.0), axis=1)
        seen, other = np.where(measured, mem[at], 0.0), self.mem_other_[rows]  # own, in use at the largest size
        self.mem_rate_[rows] = np.where(measured, seen / np.maximum(sizes[at], 1.0), self.mem_rate_[rows])
        budget = self._budget(self.mem_total_[rows], seen + other)
        caps = fit_memory_cap(sizes, mem, valid, np.nan_to_num(budget - other), self.mem_held_[rows],
                              self.mem_first_size_[rows], np.maximum(self.mem_noise_, self.mem_own_noise_[rows]))
        with np.errstate(divide="ignore", invalid="ignore"):
            latest = self.read_size_[rows] + (budget - self.read_mem_[rows]) / self.mem_rate_[rows]
        falling = ~self.mem_held_[rows] | (self.mem_doubt_[rows] > 0)  # a held peak covers the sizes below it
        below = (caps < sizes[at]) & (other > 0) & falling & np.isfinite(latest)
        caps[below] = np.minimum(caps[below], whole_caps(latest[below]))
        self.cap_[rows] = np.where(np.isfinite(budget) & measured, caps, self.cap_[rows])

    def _grow(self, size: int) -> None:
        extra = size - self.slot_size_.shape[0]
        if extra > 0:
            for name, fill in (("slot_size_", 0.0), ("slot_time_", 0.0), ("slot_mem_", np.nan), ("slot_weight_", 0.0)):
                setattr(self, name, np.vstack([getattr(self, name), np.full((extra, self.window), fill)]))
            self.sums_ = np.vstack([getattr(self, "sums_", np.zeros((0, 6))), np.zeros((extra, 6))])
            for name, fill, dtype in (("mem_total_", np.nan, float), ("mem_announced_", np.nan, float),
                                      ("mem_rate_", np.nan, float), ("count_", 0, np.int64), ("latest_", 0.0, float),
                                      ("base_", 0.0, float), ("knee_", 0.0, float), ("slope_", 0.0, float),
                                      ("observed_max_", 0.0, float), ("known_", False, bool), ("cap_", NO_CAP, np.int64),
                                      ("latest_weight_", 0.0, float), ("group_", -1, np.int64), ("misses_", 0, np.int64),
                                      ("pooled_base_", 0.0, float), ("pooled_knee_", 0.0, float),
                                      ("pooled_slope_", 0.0, float), ("read_size_", np.nan, float),
                                      ("read_mem_", np.nan, float), ("mem_first_size_", np.nan, float),
                                      ("mem_held_", False, bool),
                                      ("mem_other_", 0.0, float), ("mem_doubt_", 0.0, float),
                                      ("mem_own_noise_", 0.0, float), ("mem_own_seen_", 0, np.int64)):
                setattr(self, name, np.concatenate([getattr(self, name, np.zeros(0, dtype=dtype)),
                                                    np.full(extra, fill, dtype=dtype)]))
            self.mem_own_changes_ = np.vstack([getattr(self, "mem_own_changes_", np.zeros((0, _OWN_NOISE_PAIRS))),
                                               np.zeros((extra, _OWN_NOISE_PAIRS))])

    def _curve(self, workers: np.ndarray) -> HingeTime:
        inside = workers < self.count_.size
        if inside.all():
            return HingeTime(self.pooled_base_[workers], self.pooled_knee_[workers], self.pooled_slope_[workers],
                             self.observed_max_[workers])
        safe = np.where(inside, workers, 0)
        return HingeTime(np.where(inside, self.pooled_base_[safe], 0.0), np.where(inside, self.pooled_knee_[safe], 0.0),
                         np.where(inside, self.pooled_slope_[safe], 0.0), np.where(inside, self.observed_max_[safe], 0.0))


def _all_or(rows: np.ndarray, total: int) -> np.ndarray | slice:
    """``rows`` as a slice where they are evenly spaced in increasing order (plain views instead of copies): every row
    of ``total``, or every other one, as a mixed job's GPU workers may be; else ``rows`` itself."""
    if rows.size == total:
        return slice(None) if bool((rows == np.arange(total)).all()) else rows
    if not rows.size:
        return rows
    first = int(rows[0])
    step = int(rows[1]) - first if rows.size > 1 else 1
    if step < 1:
        return rows
    last = first + step * (rows.size - 1)
    return slice(first, last + 1, step) if bool((rows == np.arange(first, last + 1, step)).all()) else rows


def _expected_reading(sizes: np.ndarray, mem: np.ndarray, valid: np.ndarray,
                      size: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What each row's slots (``valid`` readings ``mem`` at ``sizes``) predict its reading at ``size`` to be, read
    as they fall and as a caching allocator holds them. Falling: the slot's own at that size, else the straight line
    between the slots on either side; past the largest size, the chord from the smallest size's reading to the
    largest's, carried on (the line through the origin and the largest reading with one size); below the smallest,
    that chord carried back. Held: the highest reading, up to the largest size; past it, the line through the origin
    and its reading (which errs high there). Returns both (NaN where no slot reads, or below a single size), the
    chord's bytes per sample (NaN with one size) and which sizes lie past the largest."""
    s, rows = size[:, None], np.arange(sizes.shape[0])
    below, above = valid & (sizes <= s), valid & (sizes >= s)
    # slot sizes are at least 1 sample, so a product or a huge sum masks the others out (faster than np.where)
    lo, hi = np.argmax(sizes * below, 1), np.argmin(sizes + ~above * 1e300, 1)
    top, bottom = np.argmax(sizes * valid, 1), np.argmin(sizes + ~valid * 1e300, 1)
    x_lo, m_lo, x_hi, m_hi = sizes[rows, lo], mem[rows, lo], sizes[rows, hi], mem[rows, hi]
    x_top, m_top, x_bottom, m_bottom = sizes[rows, top], mem[rows, top], sizes[rows, bottom], mem[rows, bottom]
    with np.errstate(divide="ignore", invalid="ignore"):
        chord = np.where(x_top > x_bottom, np.maximum((m_top - m_bottom) / (x_top - x_bottom), 0.0), np.nan)
        between = np.where(x_hi > x_lo, m_lo + (m_hi - m_lo) * (size - x_lo) / (x_hi - x_lo), m_lo)
        through_origin = m_top / np.maximum(x_top, 1.0) * size
        onward = np.where(np.isnan(chord), through_origin, m_top + chord * (size - x_top))
        back = m_bottom - chord * (x_bottom - size)
    has_lo, has_hi = below[rows, lo], above[rows, hi]  # the slot picked is one of them, if any is
    beyond = has_lo & ~has_hi
    falling = np.where(has_lo & has_hi, between, np.where(has_hi, back, np.where(has_lo, onward, np.nan)))
    peak = np.where(valid, mem, -np.inf).max(1)
    held = np.where(beyond, through_origin, np.where(has_hi, peak, np.nan))
    return falling, held, chord, beyond


def _merge_closest(sizes: np.ndarray, times: np.ndarray, mem: np.ndarray, weight: np.ndarray,
                   rows: np.ndarray) -> None:
    """In each of ``rows`` (all slots taken), merge the two sizes closest in ratio into one weighted slot at
    their weighted mean size, rounded to a whole sample so that later reports of that size find it, and empty
    the other, in place."""
    order = np.argsort(sizes[rows], axis=1)
    ordered = np.take_along_axis(sizes[rows], order, axis=1)
    k = np.argmin(np.diff(ordered, axis=1) / ordered[:, 1:], axis=1)
    r = np.arange(rows.size)
    keep, drop = (rows, order[r, k]), (rows, order[r, k + 1])
    w_keep, w_drop = weight[keep], weight[drop]
    total = w_keep + w_drop
    merged = np.round((w_keep * sizes[keep] + w_drop * sizes[drop]) / total)  # whole samples, as reported
    times[keep] = (w_keep * times[keep] + w_drop * times[drop]) / total
    m_keep, m_drop = mem[keep], mem[drop]
    # one reading alone stands for the merged size only where it was read at that size or above (a reading at
    # the smaller size, put at the mean of the two, had read as a line too shallow: a cap of 725 where 700 fit)
    alone = np.where(np.isfinite(m_keep), m_keep, m_drop)
    read_at = np.where(np.isfinite(m_keep), sizes[keep], sizes[drop])
    mem[keep] = np.where(np.isfinite(m_keep) & np.isfinite(m_drop), (w_keep * m_keep + w_drop * m_drop) / total,
                         np.where(read_at >= merged, alone, np.nan))
    sizes[keep], weight[keep], weight[drop], sizes[drop] = merged, total, 0.0, 0.0


def perturb_pairs(sizes: np.ndarray, who: np.ndarray, fraction: float, lower: np.ndarray,
                  upper: np.ndarray) -> np.ndarray:
    """Shift round(fraction * size) samples within consecutive pairs of ``who`` (first gives, second takes),
    within the bounds; the total is unchanged. Pure function."""
    out = sizes.copy()
    lower, upper = np.asarray(lower, dtype=np.int64), np.asarray(upper, dtype=np.int64)
    giver, taker = who[0:len(who) - 1:2], who[1::2]
    step = np.maximum(1, np.round(fraction * np.minimum(out[giver], out[taker]))).astype(np.int64)
    step = np.minimum(step, np.minimum(out[giver] - lower[giver], upper[taker] - out[taker]))
    step = np.maximum(step, 0)
    out[giver] -= step
    out[taker] += step
    return out
