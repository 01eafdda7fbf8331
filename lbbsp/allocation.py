"""Integer min-max allocation: split a global batch so that the slowest predicted finish is as early as can be.

Pure functions on numpy arrays. A *time model* predicts, for each worker at once, the seconds that worker
needs for a batch of a given size; it must be non-decreasing in the size. The allocator searches the finish
time T, asks every worker how much it can do by T, and fills the last few samples greedily, so one decision
costs O(n log(1/eps)) vectorised work: milliseconds at 10,000 workers. The search starts where straight lines
through each worker's times at its bounds add up to the global batch, which is exact for linear times: a
decision usually calls the time model five times (linear times) to a dozen (curves, mixed jobs).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from numbers import Integral, Real
from typing import Protocol

import numpy as np

from .errors import AllocationError, ConfigError
from .protocol import MAX_BATCH, _flag

_SEARCH_STEPS = 100
_GUESS_STEPS = 8  # Newton steps on the lines through the bounds' times, for the first deadline
_FEW_WIDE = 16  # workers that may still add several samples, under which the search looks at their times


class TimeModel(Protocol):
    """Predicted seconds per worker: ``time(sizes)[i]`` is worker i's time for ``sizes[i]`` samples."""

    def time(self, sizes: np.ndarray) -> np.ndarray:
        """Each worker's predicted seconds for its size in ``sizes`` (one per worker, in worker order)."""
        ...


class InvertibleTimeModel(TimeModel, Protocol):
    """A time model that can also say how many samples each worker finishes by a deadline."""

    def capacity(self, deadline: float) -> np.ndarray:
        """How many samples each worker finishes by ``deadline`` seconds: -1 for none, inf for any (the allocator
        clips to the bounds); lets the allocator solve for a deadline instead of searching each worker's time."""
        ...


@dataclass(frozen=True)
class LinearTime:
    """time_i(x) = overhead_i + x / speed_i, the CPU model: throughput ``speed`` in samples per second.

    ``idle_is_free``: a worker given no samples takes no time at all, overhead included (a federated client
    that is not asked this round downloads nothing).
    """

    speed: np.ndarray
    overhead: np.ndarray | float = 0.0
    idle_is_free: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "idle_is_free", _flag(self.idle_is_free, "LinearTime idle_is_free"))  # "no": True
        given = {name: np.asarray(getattr(self, name)) for name in ("speed", "overhead")}  # a list is fine too
        for name, values in given.items():  # numbers only: strings had been parsed, bools read as speeds 1 and 0
            if values.dtype.kind not in "iuf":
                raise ConfigError(f"LinearTime {name} must be numbers, got {getattr(self, name)!r:.80}")
        speed = np.asarray(given["speed"], dtype=float)  # numbers are checked once, here
        overhead = np.asarray(given["overhead"], dtype=float)
        if speed.ndim != 1 or not (speed >= 0).all():
            raise ConfigError(f"LinearTime speed must be one number >= 0 (samples per second) per worker, got "
                              f"{np.array2string(speed, threshold=8)}")
        if overhead.ndim > 1 or overhead.size not in (1, speed.size) or not (overhead >= 0).all():
            raise ConfigError(f"LinearTime overhead must be one number >= 0 (seconds), or one per worker "
                              f"({speed.size}), got {np.array2string(overhead, threshold=8)}")
        object.__setattr__(self, "speed", speed)
        object.__setattr__(self, "overhead", overhead if overhead.ndim else float(overhead))

    def time(self, sizes: np.ndarray) -> np.ndarray:
        """Each worker's predicted seconds for its size in ``sizes``."""
        x = np.asarray(sizes, dtype=float)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # a speed of (nearly) 0: forever,
            seconds = self.overhead + np.where(x > 0, x / self.speed, 0.0)  # but no samples take no compute
        return np.where(x > 0, seconds, 0.0) if self.idle_is_free else seconds

    def capacity(self, deadline: float | np.ndarray) -> np.ndarray:
        """How many samples each worker finishes by ``deadline`` seconds, one for all or one per worker (not bounded
        above: the allocator clips); -1 where none."""
        # The small slack keeps x whose time equals the deadline up to rounding; 0 x inf (a speed of 0 and an
        # infinite overhead, an infinite speed at a deadline equal to the overhead) is NaN, which fmax reads as none
        # (the allocator refuses NaN: a time model of one's own that answers it has a bug).
        with np.errstate(invalid="ignore"):
            return np.fmax(np.floor((deadline - self.overhead) * self.speed * (1 + 1e-12) + 1e-9), -1.0)


def _capacity_by_search(model: TimeModel, deadline: float, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """Largest x in [lower, upper] with time(x) <= deadline, per worker (lower where even that is late)."""
    lo, hi = lower.copy(), upper.copy()
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = np.where(open_, (lo + hi + 1) // 2, lo)
        fits = model.time(mid) <= deadline
        lo = np.where(open_ & fits, mid, lo)
        hi = np.where(open_ & ~fits, mid - 1, hi)


def allocate(model: TimeModel, global_batch: int, lower: Sequence[int] | np.ndarray,
             upper: Sequence[int] | np.ndarray) -> np.ndarray:
    """Integers x with sum(x) == global_batch and lower <= x <= upper that minimise max_i time_i(x_i).

    A worker predicted to take forever (an infinite time: a stalled worker, a speed of 0) gets its lower
    bound while the others can hold the rest, and no more than they cannot. Raises :class:`AllocationError`
    if the global batch does not fit within the bounds, or if every worker is predicted never to finish.
    """
    # numpy's integers are Integral and its bool is not; config._is_integer is the same test, but config imports this
    if isinstance(global_batch, bool) or not isinstance(global_batch, Integral) or not 0 <= global_batch <= MAX_BATCH:
        raise AllocationError(f"global_batch must be a whole number of samples in [0, {MAX_BATCH}], got {global_batch!r}")
    global_batch = int(global_batch)
    lower, upper = _sizes(lower, "lower"), _sizes(upper, "upper")
    if lower.shape != upper.shape or lower.ndim != 1 or lower.size == 0:
        raise AllocationError(f"bounds must be two 1-D arrays of one length, got {lower.shape} and {upper.shape}")
    if (lower < 0).any() or (lower > upper).any():
        raise AllocationError("bounds must satisfy 0 <= lower <= upper for every worker")
    upper = np.minimum(upper, global_batch)  # no worker takes more than B
    if not lower.sum() <= global_batch <= upper.sum():
        raise AllocationError(f"global batch {global_batch} cannot be placed within the bounds: they allow "
                              f"{int(lower.sum())} to {int(upper.sum())} samples")
    if lower.sum() == global_batch:
        return lower.copy()
    if upper.sum() == global_batch:  # the only split there is, whatever the times (one worker, all at their caps)
        return upper.copy()
    if not callable(getattr(model, "time", None)):
        raise AllocationError(f"the time model must have a method time(sizes) (LinearTime, a model's "
                              f"time_model(...)), got {type(model).__name__}")
    try:
        t_lower, t_upper = model.time(lower), model.time(upper)
    except ValueError as exc:  # numpy's broadcast error: a model of another number of workers than the bounds
        raise AllocationError(f"the time model failed on the sizes of {lower.size} workers ({exc}): is it "
                              "the model of these workers?") from exc
    if not isinstance(t_lower, np.ndarray) or t_lower.dtype.kind not in "iuf":  # a list had failed deep in the search
        got = type(t_lower).__name__ if not isinstance(t_lower, np.ndarray) else f"an array of {t_lower.dtype}"
        raise AllocationError(f"the time model's time(sizes) must return a numpy array of seconds, one per worker, "
                              f"got {got}")
    t_lower, t_upper = t_lower.astype(float, copy=False), np.asarray(t_upper, dtype=float)
    if t_lower.shape != lower.shape or t_upper.shape != lower.shape:
        raise AllocationError(f"the time model gave {t_lower.shape[0] if t_lower.ndim == 1 else t_lower.shape} "
                              f"times for {lower.size} workers: it must give one per worker of the bounds")
    if np.isnan(t_lower).any() or np.isnan(t_upper).any() or np.isneginf(t_lower).any():
        raise AllocationError("the time model predicted a non-finite time")
    # a negative time, or one that falls as the batch grows, would be planned on as a faster worker (a model of
    # one's own answering -size had kept the equal split at a "predicted finish -16s", unsaid)
    if (t_lower < 0).any() or (t_upper < t_lower).any():
        wrong = np.flatnonzero((t_lower < 0) | (t_upper < t_lower))
        raise AllocationError(f"the time model predicted a time below 0, or one that falls as the batch grows, for "
                              f"worker(s) {wrong[:8].tolist()}: seconds must be at least 0 and grow with the batch")
    free = upper > lower
    stalled = free & np.isposinf(t_upper)
    if stalled.any():
        return _around_stalled(model, global_batch, lower, upper, stalled)

    invert = getattr(model, "capacity", None)

    def capacity(deadline: float, least: np.ndarray, most: np.ndarray) -> np.ndarray:
        """Each worker's samples by ``deadline``, which lies between the deadlines that gave ``least`` and ``most``
        (so a search need not look outside them)."""
        if invert is None:
            return _capacity_by_search(model, deadline, least, most)
        samples = _checked_capacity(model, invert(deadline), deadline, lower.size)
        return np.minimum(np.maximum(samples, lower), upper).astype(np.int64)  # np.clip, at half its cost

    # Over the workers whose size is free (a fixed one's time, even an infinite one, moves nothing):
    t_lo = float(np.nextafter(t_lower[free].min(), -np.inf))  # capacity(t_lo) == lower, whose sum is < B
    t_hi = float(t_upper[free].max())  # capacity(t_hi) == upper, whose sum is >= B
    t_floor = t_lo  # the tolerance below is of the time above it: an overhead of a day would make 1e-7 of the
    # whole time span many samples of the part that the sizes change
    x_lo, x_hi = lower.copy(), upper.copy()
    # Each worker's samples per second between its bounds: its speed if its time is linear, a chord of a curve.
    # The first deadline is where these lines add up to B; any number will do (the search takes it only inside
    # the bracket), so floats that overflow on a curve steeper than they hold are no error.
    with np.errstate(all="ignore"):
        rate = np.divide(upper - lower, t_upper - t_lower, out=np.zeros(lower.size), where=free & (t_upper > t_lower))
        guess = _first_deadline(global_batch, lower, upper, t_lower, rate)
    # Narrow [t_lo, t_hi] until each worker can add at most one sample between the two deadlines (then the
    # greedy fill below is exact), or until the floats run out (flat curves). The first deadline is the guess,
    # the second a Newton step from it along the lines, aimed past B by a margin (about twice the spread of the
    # rounding of n workers' sizes) so that the two close in on B from both sides. After them, the next deadline
    # interpolates the total linearly between the ends, Illinois style (the weight of an end kept twice is
    # halved), so a few steps usually land on B exactly; a bisection stands in when interpolation would not move.
    margin = 0.5 * (1 + math.sqrt(lower.size))  # samples
    f_lo, f_hi = float(x_lo.sum() - global_batch), float(x_hi.sum() - global_batch)
    kept = 0  # +1 after the upper end moved, -1 after the lower end moved
    next_lo: np.ndarray | None = None  # time(x_lo + 1) and time(x_hi), asked for near the end, kept while their
    time_hi: np.ndarray | None = None  # end stays
    probed = np.zeros(lower.size, dtype=bool)
    for step in range(_SEARCH_STEPS):
        # Also done once the deadlines agree to 1e-7 of the time the sizes add (the fill is then exact enough), and
        # when the only workers that can add several samples take the same time for each of them (a GPU under its
        # knee jumps by many samples at one deadline), since the fill is then exact too.
        room = x_hi - x_lo
        if int(room.max()) <= 1 or t_hi - t_lo <= 1e-7 * abs(t_hi - t_floor):
            break
        wide = room > 1
        if np.count_nonzero(wide) <= _FEW_WIDE:
            next_lo = model.time(np.minimum(x_lo + 1, upper)) if next_lo is None else next_lo
            time_hi = model.time(x_hi) if time_hi is None else time_hi
            steep = np.flatnonzero(wide & (time_hi > next_lo * (1 + 1e-12)))
            if steep.size == 0:
                break
            # A worker whose samples between the ends come faster than twice its rate (a flat block, a GPU under
            # its knee, with a sample or two beyond) is tried once at the deadline of its next sample: the total
            # jumps there, which interpolation between the totals creeps up on.
            fresh = steep[~probed[steep]]
            burst = fresh[room[fresh] - 1 > 2 * rate[fresh] * (time_hi[fresh] - next_lo[fresh])]
            if burst.size:
                probe = burst[np.argmin(next_lo[burst])]
                probed[probe] = True
                guess = float(next_lo[probe])
        mid = guess if t_lo < guess < t_hi else (t_lo * f_hi - t_hi * f_lo) / (f_hi - f_lo)
        if not t_lo < mid < t_hi:
            mid = 0.5 * (t_lo + t_hi)
            if not t_lo < mid < t_hi:
                break
        x_mid = capacity(mid, x_lo, x_hi)
        excess = int(x_mid.sum()) - global_batch
        if excess == 0:
            return x_mid
        if excess > 0:
            t_hi, x_hi, f_hi, time_hi = mid, x_mid, float(excess), None
            f_lo = f_lo / 2 if kept > 0 else f_lo
            kept = 1
        else:
            t_lo, x_lo, f_lo, next_lo = mid, x_mid, float(excess), None
            f_hi = f_hi / 2 if kept < 0 else f_hi
            kept = -1
        guess = math.nan
        if step == 0:  # the Newton step along the lines of the workers within their bounds
            on_lines = float(rate[(x_mid > lower) & (x_mid < upper)].sum())
            if on_lines > 0:
                guess = mid - (excess + math.copysign(margin, excess)) / on_lines
    # x_lo always sums to less than B and x_hi to B or more, so the fill below lands on B exactly.
    x_hi = np.maximum(x_hi, x_lo)
    deficit = global_batch - int(x_lo.sum())
    room = x_hi - x_lo
    candidates = np.flatnonzero(room > 0)
    next_lo = model.time(np.minimum(x_lo + 1, upper)) if next_lo is None else next_lo
    order = candidates[np.argsort(next_lo[candidates], kind="stable")]
    filled_before = np.concatenate(([0], np.cumsum(room[order])[:-1]))
    take = np.clip(deficit - filled_before, 0, room[order])
    x = x_lo.copy()
    x[order] += take
    return x


def _first_deadline(global_batch: int, lower: np.ndarray, upper: np.ndarray, t_lower: np.ndarray,
                    rate: np.ndarray) -> float:
    """The deadline by which lines through each worker's lower bound at its time ``t_lower``, rising at ``rate``
    samples per second and held within its bounds, add up to ``global_batch`` and half a sample for each worker on
    its line (a capacity counts whole samples: half a sample under the line, on average). Newton's method on the
    sum, which is piecewise linear; NaN where no worker has a line."""
    total = rate.sum()
    if total == 0:
        return math.nan
    lower, upper = lower.astype(float), upper.astype(float)  # floats against floats: half the cost of mixed types
    origin = np.where(rate > 0, lower - rate * t_lower, lower)  # each line's size at deadline 0
    deadline = (global_batch + 0.5 * np.count_nonzero(rate) - origin.sum()) / total  # every worker on its line
    for _ in range(_GUESS_STEPS):
        line = origin + rate * deadline
        on_line = (line > lower) & (line < upper)
        gap = global_batch + 0.5 * np.count_nonzero(on_line) - np.minimum(np.maximum(line, lower), upper).sum()
        slope = rate @ on_line
        if abs(gap) < 1 or slope == 0:
            break
        deadline += gap / slope
    return float(deadline)


def numbers_per_worker(answer: object, count: int, source: str, meaning: str) -> np.ndarray:
    """``answer`` (from ``source``, a method of a model of one's own) as an array of one number per worker of
    ``count``, or a ConfigError that names ``source`` and says it must return ``meaning``: a list is taken as its
    array; one of the wrong length, or not numbers, had failed deep inside each decision (numpy's broadcast error)."""
    try:
        values = np.asarray(answer)
    except ValueError:  # ragged
        values = np.asarray(None)
    if values.dtype.kind not in "iuf":
        raise ConfigError(f"{source} returned {str(answer)[:80]}, not numbers: it must return {meaning}")
    if values.shape != (count,):
        what = f"{values.size} values" if values.ndim == 1 else f"an array of shape {values.shape}"
        raise ConfigError(f"{source} returned {what} for {count} workers: it must return {meaning}")
    return values


def _checked_capacity(model: TimeModel, answer: object, deadline: float, count: int) -> np.ndarray:
    """``model.capacity(deadline)``'s ``answer`` as one number per worker of ``count``, or a ConfigError naming the
    model: a NaN had been read as nothing more, giving that worker its lower bound in silence. Below the lower bound
    (none) and inf (any number) are answers: the bounds clip them."""
    name = type(model).__name__
    samples = numbers_per_worker(answer, count, f"{name}.capacity",
                                 "one number of samples per worker, how many it finishes by the deadline")
    if np.isnan(samples).any():
        raise ConfigError(f"{name}.capacity({deadline:.6g}) returned NaN for worker(s) "
                          f"{np.flatnonzero(np.isnan(samples))[:8].tolist()}: it must return how many samples each "
                          "finishes by the deadline (-1 for none, inf for any number)")
    return samples


def _sizes(values: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    """Bounds as int64 sizes; an :class:`AllocationError` for anything but whole numbers (numpy would truncate
    0.5 to 0). Sizes beyond ``MAX_BATCH`` are held just above it, so that no sum can wrap."""
    arr = np.asarray(values)
    whole = arr.dtype.kind in "iu" or (arr.dtype.kind == "f" and bool(np.isfinite(arr).all())
                                        and bool((arr == np.floor(arr)).all()))
    if not whole:
        raise AllocationError(f"{name} bounds must be whole numbers of samples, got {str(values)[:80]}")
    return np.clip(arr, -1, MAX_BATCH + 1).astype(np.int64)


def sit_out_share(value: float) -> float:
    """``value`` as a share of workers that may sit out, in [0, 1); a :class:`ConfigError` otherwise."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0 <= float(value) < 1:
        raise ConfigError(f"sit_out must be a share in [0, 1), got {value!r}")
    return float(value)


class RoundsOut:
    """How many iterations in a row each worker has sat out, so that none sits out more than ``rejoin_after``
    in a row: a worker that sits out trains on none of its data and sends no report to renew its estimate.

    ``rejoin_after=None`` sets no limit. Workers are keyed by index; one that was never recorded has 0.
    """

    def __init__(self, rejoin_after: int | None = 10) -> None:
        if rejoin_after is not None and (isinstance(rejoin_after, bool) or not isinstance(rejoin_after, Integral)
                                         or rejoin_after < 1):
            raise ConfigError(f"rejoin_after must be a positive number of iterations (a federated job's rounds) or "
                              f"None, got {rejoin_after!r}")
        self.rejoin_after = None if rejoin_after is None else int(rejoin_after)
        self._streak = np.zeros(0, dtype=np.int64)  # by worker index

    def due(self, workers: Sequence[int] | np.ndarray) -> np.ndarray:
        """Per worker, whether it has sat out ``rejoin_after`` iterations in a row and must be asked next."""
        ids = np.asarray(workers, dtype=np.int64)
        if self.rejoin_after is None:
            return np.zeros(ids.size, dtype=bool)
        streak = np.zeros(ids.size, dtype=np.int64)
        known = ids < self._streak.size
        streak[known] = self._streak[ids[known]]
        return streak >= self.rejoin_after

    def record(self, workers: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray) -> None:
        """Note the sizes the workers were given: a streak grows at 0 and ends at any other size."""
        ids = np.asarray(workers, dtype=np.int64)
        if ids.size and ids.max() >= self._streak.size:
            self._streak = np.concatenate([self._streak, np.zeros(ids.max() + 1 - self._streak.size, dtype=np.int64)])
        self._streak[ids] = np.where(np.asarray(sizes) == 0, self._streak[ids] + 1, 0)


def allocate_sitting_out(model: TimeModel, global_batch: int, lower: Sequence[int] | np.ndarray,
                         upper: Sequence[int] | np.ndarray, share: float, min_gain: float = 0.0,
                         ranked_by: TimeModel | None = None,
                         stay: Sequence[bool] | np.ndarray | None = None) -> np.ndarray:
    """:func:`allocate`, or, if its predicted finish is earlier by more than ``min_gain`` (a fraction), the split
    in which the ``share`` of workers slowest at their smallest size under ``ranked_by`` (default ``model``)
    sit the iteration out (size 0) and the others share the global batch within their bounds. A small
    ``min_gain`` keeps workers in where sitting out would save little, since a worker that sits out does not
    train on its data. Workers marked in ``stay`` (e.g. :meth:`RoundsOut.due`) are not among those that sit out.

    Sitting out pays where a worker given nothing takes no time (``LinearTime(idle_is_free=True)``: a
    federated client not asked this round); elsewhere such a worker still takes its fixed time, so little is won.
    """
    lower = np.asarray(lower, dtype=np.int64)
    upper = np.asarray(upper, dtype=np.int64)
    may_leave = np.ones(lower.size, dtype=bool) if stay is None else ~np.asarray(stay, dtype=bool)
    if not may_leave.all():  # with a lower bound of 0, staying means at least one sample
        lifted = np.where(may_leave, lower, np.minimum(np.maximum(lower, 1), upper))
        lower = lifted if lifted.sum() <= global_batch else lower
    everyone = allocate(model, global_batch, lower, upper)
    count = min(int(sit_out_share(share) * lower.size + 1e-9), int(may_leave.sum()))
    if count == 0:
        return everyone
    ranked = ranked_by if ranked_by is not None else model
    slowness = np.where(may_leave, np.asarray(ranked.time(np.maximum(lower, 1)), dtype=float), -np.inf)
    out = np.argsort(-slowness, kind="stable")[:count]
    low, high = lower.copy(), upper.copy()
    low[out] = high[out] = 0
    if int(high.sum()) < global_batch:  # the others cannot hold the global batch
        return everyone
    try:
        without = allocate(model, global_batch, low, high)
    except AllocationError:  # a model of one's own whose time at 0 samples it refuses (below 0, NaN)
        return everyone
    faster = predicted_makespan(model, without) * (1 + min_gain) < predicted_makespan(model, everyone)
    return without if faster else everyone


def _around_stalled(model: TimeModel, global_batch: int, lower: np.ndarray, upper: np.ndarray,
                    stalled: np.ndarray) -> np.ndarray:
    """Allocate with each ``stalled`` worker (infinite time at its upper bound) capped at the largest size it
    finishes: its lower bound if even one sample more never ends (a speed of 0), a memory wall's size if it has
    one. Holding such a worker at its lower bound instead gave (10, 0) where (5, 5) finished in half the time."""
    finite = np.where(stalled, _capacity_by_search(model, np.finfo(float).max, lower, upper), upper)
    if int(finite.sum()) >= global_batch:
        return allocate(model, global_batch, lower, finite)
    if stalled.all():
        raise AllocationError(f"the time model predicts that all {stalled.size} workers never finish a batch "
                              f"that holds the global batch {global_batch}")
    # no split finishes: the others take all they may and the stalled workers as few as they can, evenly
    # (raising here had kept whatever split was in force, (100, 100, 100) where (60, 120, 120) was open)
    sizes = upper.copy()
    sizes[stalled] = allocate(LinearTime(np.ones(int(stalled.sum()))), global_batch - int(upper[~stalled].sum()),
                              finite[stalled], upper[stalled])
    return sizes


def predicted_makespan(model: TimeModel, sizes: Sequence[int] | np.ndarray) -> float:
    """The predicted finish of the slowest worker for this split."""
    return float(np.max(model.time(np.asarray(sizes, dtype=np.int64))))


def damp(current: Sequence[int] | np.ndarray, proposed: np.ndarray, model: TimeModel,
         deadband: float) -> tuple[np.ndarray, bool]:
    """Keep ``current`` unless ``proposed`` is predicted faster by more than ``deadband`` (a fraction).

    A dead band stops the sizes oscillating when noisy measurements predict tiny gains. Returns the
    chosen split and whether it is the proposed one. Workers predicted to never finish make both finishes
    infinite: then the split that gives them fewer samples wins, and at a tie the others' finish decides.
    """
    current_arr = np.asarray(current, dtype=np.int64)
    if current_arr.shape != proposed.shape or current_arr.sum() != proposed.sum():
        return proposed, True
    t_new, t_old = model.time(proposed), model.time(current_arr)
    never = np.isposinf(t_new) | np.isposinf(t_old)
    if never.any():
        on_never, had = int(proposed[never].sum()), int(current_arr[never].sum())
        if on_never != had:
            return (proposed, True) if on_never < had else (current_arr, False)
        t_new, t_old = t_new[~never], t_old[~never]
    if t_new.size and t_new.max() * (1 + deadband) < t_old.max():
        return proposed, True
    return current_arr, False


@dataclass(frozen=True)
class HingeTime:
    """The GPU model: time_i(x) = base_i + slope_i * max(x - knee_i, 0), flat while the device is under-used.

    Beyond ``observed_max_i`` (the largest batch ever measured) the time is also at least the straight line
    through the origin and the last measured point, so an unexplored flat region is never taken as free.
    """

    base: np.ndarray
    knee: np.ndarray
    slope: np.ndarray
    observed_max: np.ndarray

    def time(self, sizes: np.ndarray) -> np.ndarray:
        """Each worker's predicted seconds for its size in ``sizes``: the hinge, and past ``observed_max`` at least
        the line through the origin and the last measured point."""
        x = np.asarray(sizes, dtype=float)
        hinge = self.base + self.slope * np.maximum(x - self.knee, 0.0)
        beyond = x > self.observed_max
        if not beyond.any():  # the usual case: every size within what was measured
            return hinge
        return np.where(beyond, np.maximum(hinge, self._ratio * x), hinge)

    def capacity(self, deadline: float | np.ndarray) -> np.ndarray:
        """How many samples each worker finishes by ``deadline`` seconds, one for all or one per worker (at most
        1e15: a flat curve finishes any); -1 where even none is done by then (the deadline is under its base time)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            along_hinge = np.where(self.slope > 0, self.knee + (deadline - self.base) / self.slope, np.inf)
            beyond = np.minimum(along_hinge, deadline / self._ratio)
        x = np.where(deadline * (1 + 1e-12) >= self._observed_time, np.maximum(beyond, self.observed_max),
                     np.minimum(along_hinge, self.observed_max))
        x = np.where(deadline < self.base, -1.0, x)
        return np.floor(np.minimum(x, 1e15) * (1 + 1e-12) + 1e-9)

    # Computed on first use (the allocator asks for them at every step); the arrays must not change after.
    @cached_property
    def _observed_time(self) -> np.ndarray:
        return self.base + self.slope * np.maximum(self.observed_max - self.knee, 0.0)

    @cached_property
    def _ratio(self) -> np.ndarray:
        return self._observed_time / np.maximum(self.observed_max, 1.0)
