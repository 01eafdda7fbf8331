"""The allocator's search asks the time model few times and gives the same split as the search it replaced.

The search of 2026-12 started from the widest bracket (just below the fastest first sample, the slowest worker's
whole batch) and needed 7 time-model calls for a linear model of 1,024 workers, 17 for a mixed GPU + CPU job. The
search now starts where lines through each worker's times at its bounds add up to the global batch. The
split must not move: every case of a random corpus (linear times with overheads, hinge curves with knees and
observed maxima, mixed and hedged jobs, models without an inverse, tight and loose bounds, fixed and stalled workers,
1 to 2,000 workers) is checked against a frozen copy of that search, kept below. Evaluation counts are behaviour,
not timing: they are the same on every machine.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from numbers import Integral

import numpy as np
import pytest

from lbbsp import JobConfig, LBBSPPolicy, allocation
from lbbsp.allocation import HingeTime, LinearTime, TimeModel, _checked_capacity, _sizes, allocate
from lbbsp.errors import AllocationError, ConfigError
from lbbsp.hedging import hedged
from lbbsp.models import AutoCapacityModel
from lbbsp.models.auto import grouped
from lbbsp.protocol import MAX_BATCH, Report

# ---- the search as it was before 2026-12-03, frozen: the reference every split is compared with ----


def frozen_allocate(model: TimeModel, global_batch: int, lower: Sequence[int] | np.ndarray,
                    upper: Sequence[int] | np.ndarray) -> np.ndarray:
    """lbbsp.allocation.allocate as of 2026-12-03, verbatim but for names: integers x with sum(x) == global_batch
    and lower <= x <= upper that minimise max_i time_i(x_i).

    A worker predicted to take forever (an infinite time: a stalled worker, a speed of 0) gets its lower
    bound while the others can hold the rest. Raises :class:`AllocationError` if the global batch does not
    fit within the bounds.
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
    free = upper > lower
    stalled = free & np.isposinf(t_upper)
    if stalled.any():
        return _frozen_around_stalled(model, global_batch, lower, upper, stalled)

    invert = getattr(model, "capacity", None)

    def capacity(deadline: float) -> np.ndarray:
        if invert is None:
            return _frozen_capacity_by_search(model, deadline, lower, upper)
        return np.clip(_checked_capacity(model, invert(deadline), deadline, lower.size), lower, upper).astype(np.int64)

    # Over the workers whose size is free (a fixed one's time, even an infinite one, moves nothing):
    t_lo = float(np.nextafter(t_lower[free].min(), -np.inf))  # capacity(t_lo) == lower, whose sum is < B
    t_hi = float(t_upper[free].max())  # capacity(t_hi) == upper, whose sum is >= B
    t_floor = t_lo  # the tolerance below is of the time above it: an overhead of a day would make 1e-7 of the
    # whole time span many samples of the part that the sizes change
    x_lo, x_hi = lower.copy(), upper.copy()
    # Narrow [t_lo, t_hi] until each worker can add at most one sample between the two deadlines (then the
    # greedy fill below is exact), or until the floats run out (flat curves). The next deadline interpolates
    # the total linearly between the ends, Illinois style (the weight of an end kept twice is halved), so
    # a few steps usually land on B exactly; a bisection stands in when interpolation would not move.
    f_lo, f_hi = float(x_lo.sum() - global_batch), float(x_hi.sum() - global_batch)
    kept = 0  # +1 after the upper end moved, -1 after the lower end moved
    for _ in range(100):
        # Also done when the only workers that can add several samples take the same time for each of them
        # (a GPU under its knee jumps by many samples at one deadline), since the fill is then exact too, and
        # once the deadlines agree to 1e-7 of the time the sizes add (the fill is then exact enough).
        room = x_hi - x_lo
        if (int(room.max()) <= 1 or _frozen_only_flat_jumps(model, x_lo, x_hi, room)
                or t_hi - t_lo <= 1e-7 * abs(t_hi - t_floor)):
            break
        mid = (t_lo * f_hi - t_hi * f_lo) / (f_hi - f_lo)
        if not t_lo < mid < t_hi:
            mid = 0.5 * (t_lo + t_hi)
            if not t_lo < mid < t_hi:
                break
        x_mid = capacity(mid)
        excess = int(x_mid.sum()) - global_batch
        if excess == 0:
            return x_mid
        if excess > 0:
            t_hi, x_hi, f_hi = mid, x_mid, float(excess)
            f_lo = f_lo / 2 if kept > 0 else f_lo
            kept = 1
        else:
            t_lo, x_lo, f_lo = mid, x_mid, float(excess)
            f_hi = f_hi / 2 if kept < 0 else f_hi
            kept = -1
    # x_lo always sums to less than B and x_hi to B or more, so the fill below lands on B exactly.
    x_hi = np.maximum(x_hi, x_lo)
    deficit = global_batch - int(x_lo.sum())
    room = x_hi - x_lo
    candidates = np.flatnonzero(room > 0)
    order = candidates[np.argsort(model.time(np.minimum(x_lo + 1, upper))[candidates], kind="stable")]
    filled_before = np.concatenate(([0], np.cumsum(room[order])[:-1]))
    take = np.clip(deficit - filled_before, 0, room[order])
    x = x_lo.copy()
    x[order] += take
    return x


def _frozen_capacity_by_search(model: TimeModel, deadline: float, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
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


def _frozen_around_stalled(model: TimeModel, global_batch: int, lower: np.ndarray, upper: np.ndarray,
                           stalled: np.ndarray) -> np.ndarray:
    """Allocate with each ``stalled`` worker (infinite time at its upper bound) capped at the largest size it
    finishes: its lower bound if even one sample more never ends (a speed of 0), a memory wall's size if it has
    one. Holding such a worker at its lower bound instead gave (10, 0) where (5, 5) finished in half the time."""
    finite = np.where(stalled, _frozen_capacity_by_search(model, np.finfo(float).max, lower, upper), upper)
    if int(finite.sum()) >= global_batch:
        return frozen_allocate(model, global_batch, lower, finite)
    raise AllocationError(f"the time model predicts that {int(stalled.sum())} of {stalled.size} workers never "
                          f"finish, and the others cannot hold the global batch {global_batch}")


def _frozen_only_flat_jumps(model: TimeModel, x_lo: np.ndarray, x_hi: np.ndarray, room: np.ndarray) -> bool:
    """Whether the few workers with room for more than one sample take as long for all of it as for the first."""
    wide = room > 1
    if int(wide.sum()) > 16:  # checked only near the end of the search, where one or two curves jump
        return False
    first = model.time(np.where(wide, x_lo + 1, x_lo))[wide]
    return bool((model.time(x_hi)[wide] <= first * (1 + 1e-12)).all())


# ---- the corpus ----


class Walled:
    """No inverse (the allocator searches each worker's size): base + x / speed up to a memory wall, then never."""

    def __init__(self, speed: np.ndarray, wall: np.ndarray, base: np.ndarray) -> None:
        self.speed, self.wall, self.base = speed, wall, base

    def time(self, sizes: np.ndarray) -> np.ndarray:
        x = np.asarray(sizes, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(x <= self.wall, self.base + np.where(x > 0, x / self.speed, 0.0), np.inf)


class Counted:
    """``model`` with a count of its calls to time and capacity (the latter only where ``model`` has one)."""

    def __init__(self, model: TimeModel) -> None:
        self.model, self.calls = model, 0
        if hasattr(model, "capacity"):
            self.capacity = self._capacity

    def time(self, sizes: np.ndarray) -> np.ndarray:
        self.calls += 1
        return self.model.time(sizes)

    def _capacity(self, deadline: float) -> np.ndarray:
        self.calls += 1
        return self.model.capacity(deadline)  # type: ignore[attr-defined]


def _speeds(rng: np.random.Generator, n: int) -> np.ndarray:
    """Samples per second: one spread or another (none, 10%, 1.5 in log), sometimes three values shared by all."""
    speed = rng.lognormal(rng.uniform(0, 8), rng.choice([0.0, 0.1, 0.5, 1.5]), n)
    return rng.choice(speed[:3], n) if rng.random() < 0.2 else speed


def _linear(rng: np.random.Generator, n: int) -> LinearTime:
    speed = _speeds(rng, n)
    if rng.random() < 0.1:
        speed[rng.random(n) < 0.1] = 0.0  # stalled workers
    if rng.random() < 0.5:
        overhead: float | np.ndarray = float(rng.choice([0.0, rng.uniform(0, 3)]))
    else:
        overhead = rng.uniform(0, 1, n) * rng.choice([1e-3, 1.0, 10.0])
    return LinearTime(speed, overhead, bool(rng.random() < 0.2))


def _hinge(rng: np.random.Generator, n: int) -> HingeTime:
    slope = 1 / _speeds(rng, n)
    knee = rng.choice([0.0, 0.01, float(rng.integers(1, 64))]) + rng.uniform(0, 40, n) * (rng.random() < 0.5)
    base = rng.uniform(0.001, 0.05, n) + knee * slope * rng.uniform(0.2, 1.0, n)
    observed = knee + rng.choice([1e9, 0.0, float(rng.integers(1, 128))]) * rng.uniform(0.5, 1.5, n)
    return HingeTime(base, knee, slope, np.maximum(observed, 1.0))


def _model(rng: np.random.Generator, n: int, nested: bool = False) -> TimeModel:
    kind = rng.choice(["linear", "hinge", "walled"] + ([] if nested else ["hedged", "grouped"]))
    if kind == "linear":
        return _linear(rng, n)
    if kind == "hinge":
        return _hinge(rng, n)
    if kind == "walled":
        wall = rng.integers(1, 200, n) * rng.choice([1, 10_000], n, p=[0.2, 0.8])
        return Walled(_speeds(rng, n), wall, rng.uniform(0, 0.1, n))
    if kind == "hedged":
        return hedged(_model(rng, n, nested=True), rng.uniform(1.0, rng.choice([1.01, 1.5, 3.0]), n))
    order = rng.permutation(n)  # two groups, as a mixed job's kinds, each hedged or not
    cut = int(rng.integers(0, n + 1))
    parts = [p for p in (order[:cut], order[cut:]) if p.size]
    groups = tuple((p, _model(rng, p.size, nested=True)) for p in parts)
    if rng.random() < 0.5:
        groups = tuple((p, hedged(m, rng.uniform(1, 2, p.size))) for p, m in groups)
    return grouped(groups, n)


def random_case(rng: np.random.Generator) -> tuple[TimeModel, int, np.ndarray, np.ndarray]:
    """A time model, a global batch and bounds: loose or tight, some workers fixed (lower == upper)."""
    n = int(rng.choice([1, 2, 3, 5, 16, 64, 300, 1000, 2000, int(rng.integers(1, 200))]))
    model = _model(rng, n)
    scale = int(rng.choice([4, 64, 1000, 100_000]))
    lower = rng.integers(0, 3, n) * rng.choice([0, 1, 8], n)
    upper = lower + rng.integers(0, 2 * scale, n) * (rng.random(n) < rng.choice([1.0, 0.9]))
    if rng.random() < 0.3:
        upper = np.maximum(upper, lower + scale * n)  # loose: any worker could take the whole batch
    least, most = int(lower.sum()), min(int(upper.sum()), MAX_BATCH)
    if least > most:
        lower, upper, least, most = np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64), 0, n
    pick = str(rng.choice(["any", "tight", "near lower"]))
    batch = {"any": int(rng.integers(least, most + 1)), "tight": max(least, most - int(rng.integers(0, n + 1))),
             "near lower": min(most, least + int(rng.integers(0, n + 1)))}[pick]
    return model, batch, lower, upper


def _outcome(allocator: Callable[..., np.ndarray], model: TimeModel, batch: int, lower: np.ndarray,
             upper: np.ndarray) -> tuple[object, int]:
    """(the split or the error's class and message, the model's calls)."""
    counted = Counted(model)
    try:
        split: object = allocator(counted, batch, lower, upper).tolist()
    except (AllocationError, ConfigError) as exc:
        split = (type(exc).__name__, str(exc))
    return split, counted.calls


@pytest.mark.parametrize("seed", range(6))
def test_the_split_is_the_frozen_searchs_on_a_random_corpus(seed: int) -> None:
    """The same split, or the same error, for every case; and, over the corpus, well under the frozen search's
    calls to the time model."""
    rng = np.random.default_rng(seed)
    calls = [0, 0]
    for case in range(400):
        model, batch, lower, upper = random_case(rng)
        before, calls_before = _outcome(frozen_allocate, model, batch, lower, upper)
        after, calls_after = _outcome(allocate, model, batch, lower, upper)
        assert after == before, f"seed {seed}, case {case}: {type(model).__name__} of {lower.size} workers, B {batch}"
        calls[0] += calls_before
        calls[1] += calls_after
    assert calls[1] < 0.7 * calls[0], calls  # the corpus as a whole: about half the calls


def _mixed_plans(monkeypatch: pytest.MonkeyPatch, workers: int, iterations: int
                 ) -> list[tuple[TimeModel, int, np.ndarray, np.ndarray]]:
    """Every allocation LB-BSP (its default models and margins) asks for in the last 10 of ``iterations`` decisions
    of a mixed job as the coordinator benchmark (experiments/bench_coordinator.py) runs one: even workers GPUs, odd
    ones CPUs, speeds drifting by 5% an iteration."""
    config = JobConfig(f"alloc-speed-{workers}", workers, 64 * workers)
    policy = LBBSPPolicy(AutoCapacityModel(), hedge=2.0)
    rng = np.random.default_rng(0)
    speed = rng.uniform(500, 5000, workers)
    plans: list[tuple[TimeModel, int, np.ndarray, np.ndarray]] = []

    def recorded(model: TimeModel, batch: int, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        plans.append((model, batch, np.array(lower), np.array(upper)))
        return allocate(model, batch, lower, upper)

    monkeypatch.setattr(allocation, "allocate", recorded)  # as allocate_sitting_out calls it
    sizes = {k: config.initial_sizes() for k in range(config.lag)}
    for k in range(iterations):
        if k == iterations - 10:
            del plans[:]  # the models' history filled, as in a long run
        now = (speed * rng.lognormal(0.0, 0.05, workers)).tolist()
        reports = [Report(config.job, i, k, size, 0.01 + max(size, 32) / s, device="cuda:0",
                          features={"gpu_mem_used": 2e9 + 5e7 * size, "gpu_mem_free": 3e10 - 5e7 * size})
                   if i % 2 == 0 else Report(config.job, i, k, size, size / s, features={
                       "cpu_util": 0.5, "proc_cpu": 0.9, "colocated_load": float(i % 3), "mem_util": 0.4, "cores": 8})
                   for i, (size, s) in enumerate(zip(sizes[k], now))]
        policy.observe(reports)
        sizes[k + config.lag] = policy.decide(k + config.lag, sizes[k + config.lag - 1], config).sizes
        policy.learn()
    return plans


def test_a_linear_model_of_1000_workers_needs_five_calls() -> None:
    """Two times (at the bounds), two capacities (the first guess, one step past it), one time for the fill: the
    frozen search made 7 to 8 for these."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        model = LinearTime(rng.uniform(500, 5000, 1000))
        lower, upper = np.ones(1000, dtype=np.int64), np.full(1000, 64_000)
        split, calls = _outcome(allocate, model, 64_000, lower, upper)
        assert split == frozen_allocate(model, 64_000, lower, upper).tolist()
        assert calls <= 5


def test_a_mixed_gpu_and_cpu_job_of_1024_workers_needs_about_ten_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPUs' hinge curves (flat under the knee, steeper past the largest batch measured) make the lines
    through the bounds a rougher first guess than for CPUs; the frozen search made about 17 calls a decision."""
    calls_before, calls_after = [], []
    for model, batch, lower, upper in _mixed_plans(monkeypatch, 1024, 60):
        before, count_before = _outcome(frozen_allocate, model, batch, lower, upper)
        after, count_after = _outcome(allocate, model, batch, lower, upper)
        assert after == before
        calls_before.append(count_before)
        calls_after.append(count_after)
    assert len(calls_after) == 10
    assert np.mean(calls_after) <= 12 and np.mean(calls_after) <= 0.75 * np.mean(calls_before), (calls_after,
                                                                                              calls_before)


def test_a_model_without_an_inverse_is_searched_within_the_bracket() -> None:
    """Each step's per-worker search runs between the sizes at the bracket's ends, not between the bounds."""
    rng = np.random.default_rng(5)
    for _ in range(10):
        speed = rng.uniform(100, 1000, 64)
        model = Walled(speed, np.full(64, 10**6), np.zeros(64))
        lower, upper = np.zeros(64, dtype=np.int64), np.full(64, 100_000)
        before, calls_before = _outcome(frozen_allocate, model, 100_000, lower, upper)
        after, calls_after = _outcome(allocate, model, 100_000, lower, upper)
        assert after == before
        assert calls_after < 0.6 * calls_before, (calls_after, calls_before)


def test_a_gpu_whose_flat_block_holds_the_last_samples_is_probed_at_its_deadline() -> None:
    """The finish is the deadline of one GPU's flat block (its knee just short of a whole sample), where the total
    jumps by 52 samples: interpolation between the totals crept towards it (16 to 28 calls without the probe, 29
    to 35 in the frozen search)."""
    n = 64
    speed = np.linspace(1000, 2000, n)
    knee = np.full(n, 0.01)
    knee[7] = 53.995  # worker 7 does 1 to 53 samples in one time, the 54th a little later
    base = 0.01 + knee / speed
    model = HingeTime(base, knee, 1 / speed, np.full(n, 1e9))
    lower, upper = np.ones(n, dtype=np.int64), np.full(n, 400)
    filled = int(np.clip(model.capacity(base[7]), lower, upper).sum())  # the total at worker 7's deadline
    for batch in (filled - 40, filled - 20, filled - 5, filled - 1):  # each within the jump there
        before, _ = _outcome(frozen_allocate, model, batch, lower, upper)
        after, calls = _outcome(allocate, model, batch, lower, upper)
        assert after == before
        assert calls <= 10, (batch, calls)
