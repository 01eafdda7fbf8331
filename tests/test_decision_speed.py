"""What keeps a decision fast, and decides as the plain paths do: the allocator's search (few calls to the time model,
the splits of the search it replaced), the models' in-place updates and numbering, and what a policy keeps between
decisions."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from numbers import Integral

import numpy as np
import pytest

from lbbsp import JobConfig, LBBSPPolicy, allocation
from lbbsp.allocation import HingeTime, LinearTime, TimeModel, _checked_capacity, _sizes, allocate
from lbbsp.errors import AllocationError, ConfigError
from lbbsp.hedging import ForecastRisk, hedged
from lbbsp.models import AutoCapacityModel, BatchTimeCurve, EWMAThroughput, FLClientModel, base, gpu_curve
from lbbsp.models.auto import grouped
from lbbsp.models.base import _number_hardware
from lbbsp.protocol import MAX_BATCH, Report
from test_models_auto import _reports


@pytest.mark.parametrize("kind", ["linear", "hinge", "hedged"])
def test_a_decision_at_1024_workers_takes_milliseconds(kind: str) -> None:
    """About 0.1-1 ms here; a loop in Python over the workers at each of the search's steps would take 100x that."""
    rng = np.random.default_rng(0)
    n = 1024
    model: object = {"linear": lambda: LinearTime(10 ** rng.uniform(-3, 3, n)),
                     "hinge": lambda: HingeTime(rng.uniform(0.01, 0.1, n), rng.integers(0, 64, n).astype(float),
                                                rng.uniform(1e-4, 1e-3, n), np.full(n, 128.0)),
                     "hedged": lambda: hedged(LinearTime(rng.lognormal(0, 0.5, n)), rng.uniform(1, 1.5, n))}[kind]()
    lower, upper = np.ones(n, dtype=np.int64), np.full(n, 64 * n, dtype=np.int64)
    seconds = []
    for _ in range(7):
        start = time.perf_counter()
        allocate(model, 64 * n, lower, upper)  # type: ignore[arg-type]
        seconds.append(time.perf_counter() - start)
    assert np.median(seconds) < 0.05, seconds


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
    if stalled.all():  # no split finishes: allocation._around_stalled's rule, not the search's, copied
        raise AllocationError(f"the time model predicts that all {stalled.size} workers never finish a batch "
                              f"that holds the global batch {global_batch}")
    sizes = upper.copy()
    sizes[stalled] = frozen_allocate(LinearTime(np.ones(int(stalled.sum()))),
                                     global_batch - int(upper[~stalled].sum()), finite[stalled], upper[stalled])
    return sizes


def _frozen_only_flat_jumps(model: TimeModel, x_lo: np.ndarray, x_hi: np.ndarray, room: np.ndarray) -> bool:
    """Whether the few workers with room for more than one sample take as long for all of it as for the first."""
    wide = room > 1
    if int(wide.sum()) > 16:  # checked only near the end of the search, where one or two curves jump
        return False
    first = model.time(np.where(wide, x_lo + 1, x_lo))[wide]
    return bool((model.time(x_hi)[wide] <= first * (1 + 1e-12)).all())


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


GB, MB = 1e9, 1e6


def _run(workers: int) -> tuple[BatchTimeCurve, list[np.ndarray]]:
    """A job of ``workers`` GPUs: all report, then only the even ids; sizes that repeat and change, a GPU that slows
    down, an outlier, a co-tenant on one card, and a report that measured nothing."""
    rng = np.random.default_rng(7)
    model, answers = BatchTimeCurve(), []
    size = rng.integers(100, 400, workers)
    for k in range(60):
        ids = np.arange(workers) if k < 30 else np.arange(0, workers, 2)
        if k % 7 == 3:
            size = np.where(rng.random(workers) < 0.5, size + rng.integers(-40, 40, workers), size)
        reports = []
        for i in ids.tolist():
            samples = 0 if (k, i) == (40, 4) else int(size[i])
            seconds = (0.02 + 1e-4 * max(samples - 150, 0)) * (1.6 if i == 2 and k >= 45 else 1.0)
            seconds *= 3.0 if (k, i) == (20, 1) else float(rng.lognormal(0.0, 0.02))
            used = 1 * GB + 20 * MB * samples + (5 * GB if i == 6 and 35 <= k < 50 else 0.0)
            reports.append(Report("views", i, k, samples, seconds, device="cuda:0",
                                  features={"gpu_mem_used": used, "gpu_mem_free": 16 * GB - used}))
        model.partial_fit(reports, defer=k % 2 == 0)
        answers += [model.predict(np.arange(workers)), model.max_batch(np.arange(workers)),
                    model.time_model(np.arange(workers)).slope]
        model.finish_learning()
    return model, answers


def test_rows_updated_in_place_learn_what_copied_rows_learn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run with every row set taken as an index array (copies written back) instead of a slice."""
    seen = {"shifted": 0, "other": 0}
    shifted, watch_others = BatchTimeCurve._shifted, BatchTimeCurve._watch_others

    def count_shifts(self: BatchTimeCurve, rows: np.ndarray | slice, miss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        answer = shifted(self, rows, miss)
        seen["shifted"] += int(answer[0].sum())
        return answer

    def count_others(self: BatchTimeCurve, rows: np.ndarray | slice, size: np.ndarray, used: np.ndarray,
                     check: np.ndarray) -> np.ndarray:
        answer = watch_others(self, rows, size, used, check)
        seen["other"] += int(answer.sum())
        return answer

    monkeypatch.setattr(BatchTimeCurve, "_shifted", count_shifts)
    monkeypatch.setattr(BatchTimeCurve, "_watch_others", count_others)
    sliced, sliced_answers = _run(12)
    assert seen["shifted"] and seen["other"]  # the run went through the slowdown and the co-tenant
    monkeypatch.setattr(gpu_curve, "_all_or", lambda rows, total: rows)
    copied, copied_answers = _run(12)
    assert vars(sliced).keys() == vars(copied).keys()
    for name, value in vars(sliced).items():
        if isinstance(value, np.ndarray):
            assert value.tobytes() == vars(copied)[name].tobytes(), name
        elif isinstance(value, float):
            assert np.float64(value).tobytes() == np.float64(vars(copied)[name]).tobytes(), name
    for mine, theirs in zip(sliced_answers, copied_answers):
        assert mine.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("model", [EWMAThroughput(), FLClientModel()])
def test_a_worker_without_history_is_predicted_from_a_numbering_made_once(model: EWMAThroughput,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker with no history (one that joined, a federated client never asked) is predicted from the prior at
    every predict. A loop in Python over every worker with one had run at each (1.4 ms a predict at 1,024 workers,
    18-40 ms at 20,000); the workers' hardware is now numbered once, until a new worker's arrives, and the prior
    taken in array operations."""
    numbered = []

    def counted(keys: list[tuple[str, int] | None]) -> tuple[np.ndarray, np.ndarray]:
        numbered.append(len(keys))
        return _number_hardware(keys)

    monkeypatch.setattr(base, "_number_hardware", counted)
    n = 2_000
    model.partial_fit(_reports(range(n)))
    model.partial_fit([Report("j", n, 0, 0, 0.0, features={"cores": 8})])  # announced, nothing measured yet
    for _ in range(3):
        speeds = model.predict(np.arange(n + 2))
        # its hardware's median: the 8-core workers (odd ids) run at 64 / 0.05, 64 / 0.1 and 64 / 0.15 samples/s
        assert speeds[n] == pytest.approx(64 / 0.1)
        assert speeds[n + 1] == pytest.approx(float(np.median(speeds[:n])))  # no hardware known: everyone's median
    assert numbered == [n + 1]


WORKERS = np.arange(12)


FORECAST = np.linspace(100.0, 1200.0, 12)


def _cpu(worker: int, k: int, cores: int = 8, **features: float) -> Report:
    return Report("c", worker, k, 64, 64 / 500.0, features={"cores": cores, **features})


def _gpu(worker: int, k: int) -> Report:
    return Report("c", worker, k, 64, 0.05, device="cuda:0",
                  features={"cores": 8, "gpu_mem_used": 1e9 + 1e7 * worker, "gpu_mem_free": 7e10})


# each: the reports of iterations 0, 1, 2; the groups or kinds of workers 6-10 change at iteration 2 (worker 11, on
# other hardware from the start, sets how many workers there are)
CHANGES = {
    # workers 6-10 join on worker 11's hardware: ranked among its group, not left in the middle bucket as unknown
    "workers join": lambda k: [_cpu(w, k) for w in range(6)] + [
        _cpu(w, k, cores=16) for w in range(6, 12) if k == 2 or w == 11],
    # workers 6-11 announced themselves bare (a kind not known yet), then measure as federated clients
    "a group's kind is known": lambda k: [_cpu(w, k) for w in range(6)] + [
        Report("c", w, k, 0, 0.0, features={"cores": 4}) if k < 2 else
        Report("c", w, k, 64, 0.1, features={"cores": 4, "download_s": 1.0, "upload_s": 1.0}) for w in range(6, 12)],
    # GPU ranks 6-11 first timed on the CPU (their model's device not known yet), then on their GPUs: their model
    # moved, and they join the group of their hardware now, GPUs 0-5's
    "a worker's model moved": lambda k: [_gpu(w, k) for w in range(6)] + [
        _gpu(w, k) if k == 2 else _cpu(w, k) for w in range(6, 12)],
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_margins_rank_each_forecast_among_its_hardware_group_as_it_is_now(change: str) -> None:
    """A forecast recorded at every iteration (its workers' groups kept between them) is put in the bucket that
    one recorded once, at the end, puts it in: the groups kept are read again once a group or kind changes."""
    every, once = ForecastRisk(), ForecastRisk()
    for k in range(3):
        every.record(k, WORKERS, FORECAST)
        for risk in (every, once):
            risk.observe(CHANGES[change](k), defer=True)
            risk.finish_learning()
    every.record(3, WORKERS, FORECAST)
    once.record(3, WORKERS, FORECAST)
    assert every.forecasts_[3][2].tolist() == once.forecasts_[3][2].tolist()
    assert np.unique(every.forecasts_[3][2][6:]).size > 1  # workers 6-11 are ranked in their group


def test_the_margins_rank_the_workers_asked_for_when_they_change() -> None:
    """The groups kept are those of the workers recorded: another list of workers (or another order) is read
    afresh, each forecast ranked with its own worker."""
    risk = ForecastRisk()
    risk.observe([_cpu(w, 0, cores=8 + 8 * (w % 2)) for w in WORKERS.tolist()])
    risk.record(1, WORKERS, FORECAST)
    reverse = WORKERS[::-1]
    risk.record(2, reverse, FORECAST[::-1])
    risk.record(3, WORKERS[:6], FORECAST[:6])
    assert risk.forecasts_[2][2].tolist() == risk.forecasts_[1][2][::-1].tolist()
    fresh = ForecastRisk()
    fresh.observe([_cpu(w, 0, cores=8 + 8 * (w % 2)) for w in WORKERS.tolist()])
    fresh.record(3, WORKERS[:6], FORECAST[:6])
    assert risk.forecasts_[3][2].tolist() == fresh.forecasts_[3][2].tolist()


def _policy(speeds: tuple[float, ...] = (100.0, 200.0, 300.0, 400.0), **kwargs: object) -> LBBSPPolicy:
    policy = LBBSPPolicy(EWMAThroughput(), hedge=None, **kwargs)
    policy.observe([Report("c", w, 0, 25, 25 / speed) for w, speed in enumerate(speeds)])
    return policy


def test_new_job_bounds_bound_the_next_split() -> None:
    """The job's bounds are kept between decisions while the job is the same: a config with another max_batch,
    min_batch, global batch or number of workers bounds the very next split."""
    policy = _policy()
    assert max(policy.decide(2, (25, 25, 25, 25), JobConfig("c", 4, 100)).sizes) > 30
    assert policy.decide(3, (25, 25, 25, 25), JobConfig("c", 4, 100, min_batch=20)).sizes == (20, 20, 26, 34)
    assert max(policy.decide(4, (25, 25, 25, 25), JobConfig("c", 4, 100, max_batch=30)).sizes) == 30
    caps = (40, 20, 20, 30)
    assert policy.decide(5, (25, 25, 25, 25), JobConfig("c", 4, 100, max_batch=caps)).sizes[1:] == (20, 20, 30)
    assert sum(policy.decide(6, (30, 30, 30, 30), JobConfig("c", 4, 120, max_batch=(40, 20, 20, 40))).sizes) == 120
    pair = _policy((100.0, 400.0))  # without max_batch, the global batch is every worker's upper bound
    assert pair.decide(2, (50, 50), JobConfig("c", 2, 100)).sizes == (20, 80)
    assert pair.decide(3, (200, 200), JobConfig("c", 2, 400)).sizes == (80, 320)
    assert sum(pair.decide(4, (100, 100, 200), JobConfig("c", 3, 400)).sizes) == 400  # a worker joined


class _BoundsOnce(LBBSPPolicy):
    """A variant that, in its first decision only, holds worker 0 to 1 sample and worker 1 to at least 40, changing
    the bounds LB-BSP's own bounds return in place."""

    def bounds(self, workers, current, config):
        lower, upper = super().bounds(workers, current, config)
        if not getattr(self, "once", False):
            self.once = True
            upper[0], lower[1] = 1, 40
        return lower, upper


def test_bounds_a_variant_changes_in_place_are_the_job_s_again_in_the_next_decision() -> None:
    """The job's bounds kept between decisions are not those handed out: a variant may change these in place."""
    policy = _BoundsOnce(EWMAThroughput(), hedge=None)
    policy.observe([Report("c", w, 0, 25, 25 / speed) for w, speed in enumerate((400.0, 100.0, 300.0, 200.0))])
    config = JobConfig("c", 4, 100)
    first = policy.decide(2, (1, 40, 30, 29), config)
    assert first.sizes[0] == 1 and first.sizes[1] >= 40
    assert policy.decide(3, first.sizes, config).sizes == (40, 10, 30, 20)


def test_the_split_kept_is_the_one_given_not_the_last_decided() -> None:
    """The last split decided is kept as an array for the next decision, whose ``current`` it usually is; another
    split in force (a fallback, another coordinator's) is the one the next decision keeps."""
    policy = _policy((100.0, 110.0, 120.0, 130.0), deadband=0.99)  # every split within bounds is kept
    first = policy.decide(2, (25, 25, 25, 25), JobConfig("c", 4, 100))
    assert first.sizes == (25, 25, 25, 25)
    assert policy.decide(3, first.sizes, JobConfig("c", 4, 100)).sizes == first.sizes
    assert policy.decide(4, (10, 20, 30, 40), JobConfig("c", 4, 100)).sizes == (10, 20, 30, 40)
    assert policy.decide(5, [40, 30, 20, 10], JobConfig("c", 4, 100)).sizes == (40, 30, 20, 10)


class _Caps(EWMAThroughput):
    """EWMA speeds with memory caps that the test sets."""

    def __init__(self, caps: tuple[float, ...] = ()) -> None:
        super().__init__()
        self.caps = caps

    def max_batch(self, workers):
        return np.asarray(self.caps, dtype=float)


class _JobBoundsOnly(LBBSPPolicy):
    """A variant whose bounds are the job's alone: it reads no memory caps itself."""

    def bounds(self, workers, current, config):
        return tuple(np.asarray(b, dtype=np.int64) for b in config.bounds())


class _RaisedInPlace(LBBSPPolicy):
    """A variant that raises the bounds LB-BSP's own bounds return, in place, to the job's global batch (over the
    job's ``max_batch``)."""

    def bounds(self, workers, current, config):
        lower, upper = super().bounds(workers, current, config)
        upper[:] = config.global_batch
        return lower, upper


def _over(decision, caps: tuple[float, ...]) -> None:
    """The reason names the workers given more than ``caps`` (none over a NaN cap: unknown), or no cap at all."""
    over = [w for w, (size, cap) in enumerate(zip(decision.sizes, caps)) if size > cap]
    assert f"over the memory cap of worker(s) {over}" in decision.reason if over else "cap" not in decision.reason


@pytest.mark.parametrize("policy_class", [LBBSPPolicy, _JobBoundsOnly, _RaisedInPlace])
def test_the_reason_names_the_workers_over_the_memory_caps_of_this_decision(policy_class: type) -> None:
    """The caps a decision's bounds read are those its reason checks the split against (the model is not asked
    again); caps that changed since the last decision, and caps a variant's bounds did not read, are asked of the
    model: the reason names the workers over the caps of this decision."""
    model = _Caps((20.0, 20.0, 20.0, 20.0))  # they hold 80 of 100 samples: set aside
    policy = policy_class(model, hedge=None)
    policy.observe([Report("c", w, 0, 25, 25 / speed) for w, speed in enumerate((100.0, 200.0, 300.0, 400.0))])
    config = JobConfig("c", 4, 100)
    decision = policy.decide(2, (25, 25, 25, 25), config)
    assert "over the memory cap of worker(s)" in decision.reason
    _over(decision, model.caps)
    for k, caps in enumerate([(30.0, 10.0, np.nan, 40.0), (100.0, 100.0, 100.0, 100.0), (20.0, 20.0, 20.0, 20.0)]):
        model.caps = caps
        decision = policy.decide(3 + k, decision.sizes, config)
        _over(decision, caps)
    # caps unknown (NaN), under max_batch 30: the job's bounds; a variant's over them are not the memory's
    model.caps = (np.nan,) * 4
    decision = policy.decide(6, (25, 25, 25, 25), JobConfig("c", 4, 100, max_batch=30))
    assert max(decision.sizes) > 30 if policy_class is _RaisedInPlace else max(decision.sizes) == 30
    assert "cap" not in decision.reason
