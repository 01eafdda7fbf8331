"""The integer min-max allocator: exact sum, bounds, and optimality against single-unit moves."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbbsp import AllocationError, LinearTime, allocate
from lbbsp.allocation import RoundsOut, allocate_sitting_out, damp, predicted_makespan
from lbbsp.errors import ConfigError


class StepCurve:
    """A GPU-like curve without an inverse: flat up to a knee, then linear (exercises the generic search)."""

    def __init__(self, knee: np.ndarray, slope: np.ndarray, floor: np.ndarray) -> None:
        self.knee, self.slope, self.floor = knee, slope, floor

    def time(self, sizes: np.ndarray) -> np.ndarray:
        return self.floor + self.slope * np.maximum(np.asarray(sizes, dtype=float) - self.knee, 0.0)


def no_single_move_helps(model, x: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> bool:
    times = model.time(x)
    worst = times.max()
    for j in np.flatnonzero(times >= worst * (1 - 1e-12)):  # only moving off a slowest worker can help
        if x[j] <= lower[j]:
            continue
        for k in np.flatnonzero(x < upper):
            if k == j:
                continue
            y = x.copy()
            y[j] -= 1
            y[k] += 1
            if model.time(y).max() < worst * (1 - 1e-9):
                return False
    return True


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_linear_allocation_properties(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 12))
    speeds = np.array(data.draw(st.lists(st.floats(0.1, 1000), min_size=n, max_size=n)))
    overhead = np.array(data.draw(st.lists(st.floats(0, 2), min_size=n, max_size=n)))
    lower = np.array(data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)))
    upper = lower + np.array(data.draw(st.lists(st.integers(0, 60), min_size=n, max_size=n)))
    batch = data.draw(st.integers(int(lower.sum()), int(upper.sum())))
    model = LinearTime(speeds, overhead)
    x = allocate(model, batch, lower, upper)
    assert x.sum() == batch
    assert (x >= lower).all() and (x <= upper).all()
    assert no_single_move_helps(model, x, lower, upper)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_curve_allocation_properties(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 8))
    knee = np.array(data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)), dtype=float)
    slope = np.array(data.draw(st.lists(st.floats(0.01, 5), min_size=n, max_size=n)))
    floor = np.array(data.draw(st.lists(st.floats(0.0, 3), min_size=n, max_size=n)))
    upper = np.array(data.draw(st.lists(st.integers(1, 80), min_size=n, max_size=n)))
    lower = np.zeros(n, dtype=int)
    batch = data.draw(st.integers(0, int(upper.sum())))
    model = StepCurve(knee, slope, floor)
    x = allocate(model, batch, lower, upper)
    assert x.sum() == batch
    assert (x >= lower).all() and (x <= upper).all()
    assert no_single_move_helps(model, x, lower, upper)


def test_proportional_to_speed() -> None:
    x = allocate(LinearTime(np.array([1.0, 2.0, 3.0, 4.0])), 100, [1] * 4, [100] * 4)
    assert x.tolist() == [10, 20, 30, 40]


def test_infeasible_bounds_raise_a_clear_error() -> None:
    with pytest.raises(AllocationError, match="cannot be placed within the bounds: they allow 4 to 40"):
        allocate(LinearTime(np.ones(4)), 41, [1] * 4, [10] * 4)


def test_dead_band_keeps_the_current_split_for_small_gains() -> None:
    model = LinearTime(np.array([1.0, 1.02]))
    kept, changed = damp([50, 50], np.array([49, 51]), model, deadband=0.05)
    assert not changed and kept.tolist() == [50, 50]
    model = LinearTime(np.array([1.0, 3.0]))
    moved, changed = damp([50, 50], np.array([25, 75]), model, deadband=0.05)
    assert changed and moved.tolist() == [25, 75]


def test_a_client_whose_transfer_alone_is_too_slow_sits_out() -> None:
    # four clients of one compute speed; client 3's model transfer takes 50 s, the others' 1 s; a quarter
    # of them (client 3, the slowest) may sit out
    rounds = LinearTime(np.full(4, 10.0), overhead=np.array([1.0, 1.0, 1.0, 50.0]), idle_is_free=True)
    assert rounds.time(np.array([0, 0, 5, 0])).tolist() == [0.0, 0.0, 1.5, 0.0]  # not asked: no transfer
    everyone = allocate(rounds, 100, [1] * 4, [100] * 4)
    sizes = allocate_sitting_out(rounds, 100, [1] * 4, [100] * 4, share=0.25)
    assert sizes.tolist() == [34, 33, 33, 0]
    assert predicted_makespan(rounds, sizes) < 5 < 50 < predicted_makespan(rounds, everyone)
    # a gain under min_gain keeps everyone in: without client 3 the round is 4.33 s, with it 4.5 s (4% more)
    close = LinearTime(np.full(4, 10.0), overhead=np.array([1.0, 1.0, 1.0, 4.4]), idle_is_free=True)
    kept = allocate_sitting_out(close, 100, [1] * 4, [100] * 4, share=0.25, min_gain=0.05)
    assert kept.tolist() == allocate(close, 100, [1] * 4, [100] * 4).tolist()
    assert allocate_sitting_out(close, 100, [1] * 4, [100] * 4, share=0.25).tolist() != kept.tolist()
    # a worker that pays its overhead even when idle (not a federated client) still holds everyone up
    busy = LinearTime(np.full(4, 10.0), overhead=np.array([1.0, 1.0, 1.0, 50.0]))
    assert predicted_makespan(busy, allocate_sitting_out(busy, 100, [1] * 4, [100] * 4, share=0.25)) == 50.0
    # nobody out, or the others cannot hold the global batch: the plain split
    assert allocate_sitting_out(rounds, 100, [1] * 4, [100] * 4, share=0.0).tolist() == everyone.tolist()
    assert allocate_sitting_out(rounds, 100, [1] * 4, [30] * 4, share=0.25).tolist() == allocate(
        rounds, 100, [1] * 4, [30] * 4).tolist()


def test_a_worker_out_rejoin_after_times_in_a_row_stays_in() -> None:
    # client 3's transfer is slowest, client 2's next; client 3 is due back, so client 2 is the one ranked out
    rounds = LinearTime(np.full(4, 10.0), overhead=np.array([1.0, 1.0, 30.0, 50.0]), idle_is_free=True)
    assert allocate_sitting_out(rounds, 100, [1] * 4, [100] * 4, share=0.25).tolist()[3] == 0
    back = allocate_sitting_out(rounds, 100, [1] * 4, [100] * 4, share=0.25, stay=[False, False, False, True])
    assert back[3] > 0 and back.sum() == 100
    # client 3 holds the round up anyway, so leaving client 2 out as well gains nothing: everyone is in
    assert back.tolist() == allocate(rounds, 100, [1] * 4, [100] * 4).tolist()
    # with a lower bound of 0, staying in still means at least one sample
    assert allocate_sitting_out(rounds, 100, [0] * 4, [100] * 4, share=0.25, stay=[False] * 3 + [True])[3] >= 1

    out = RoundsOut(rejoin_after=2)
    due = []
    for sizes in ([5, 0, 0], [5, 0, 3], [0, 3, 3]):
        due.append(out.due([7, 8, 9]).tolist())
        out.record([7, 8, 9], sizes)
    due.append(out.due([7, 8, 9]).tolist())
    assert due == [[False] * 3, [False] * 3, [False, True, False], [False] * 3]  # a streak ends when asked
    assert not RoundsOut(None).due([1]).any()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="rejoin_after"):
            RoundsOut(bad)  # type: ignore[arg-type]


def test_workers_that_never_finish_get_their_lower_bound_while_the_others_hold_the_rest() -> None:
    assert allocate(LinearTime(np.array([0.0, 2.0, 3.0])), 90, [1, 1, 1], [90, 90, 90]).tolist() == [1, 36, 53]
    assert allocate(LinearTime(np.array([1e-300, 2.0, 3.0])), 90, [1, 1, 1], [90, 50, 30]).tolist() == [10, 50, 30]
    with pytest.raises(AllocationError, match="never finish"):
        allocate(LinearTime(np.array([0.0, 0.0, 0.0])), 90, [1, 1, 1], [90, 90, 90])
    # a lower bound of 0: nothing to compute takes no time, even at a speed of 0 (0 / 0 was NaN, an error)
    assert allocate(LinearTime(np.array([0.0, 2.0, 3.0])), 90, [0, 0, 0], [90, 90, 90]).tolist() == [0, 36, 54]



class MemoryWall:
    """x / speed up to a wall, then never (out of memory): finite below the upper bound, infinite at it."""

    def __init__(self, speed: list[float], wall: list[int]) -> None:
        self.speed, self.wall = np.asarray(speed, dtype=float), np.asarray(wall)

    def time(self, sizes: np.ndarray) -> np.ndarray:
        x = np.asarray(sizes, dtype=float)
        return np.where(x <= self.wall, x / self.speed, np.inf)


def test_a_worker_that_never_finishes_above_a_size_is_capped_there_not_held_at_its_lower_bound() -> None:
    """It was held at its lower bound: (10, 0) took 10 s where (5, 5) takes 5; with both walled it raised
    'never finish' although (4, 6) finishes in 4 s. The only split there is (one worker) is no error either."""
    assert allocate(MemoryWall([1.0, 2.0], [100, 5]), 10, [0, 0], [10, 10]).tolist() == [5, 5]
    assert allocate(MemoryWall([1.0, 2.0], [6, 6]), 10, [0, 0], [10, 10]).tolist() == [4, 6]
    assert allocate(LinearTime(np.array([0.0])), 10, [0], [10]).tolist() == [10]


def test_a_capacity_of_nan_finishes_nothing_more() -> None:
    """0 x inf (a speed of 0 and an infinite overhead, or an infinite speed at a deadline equal to the overhead)
    went through astype(int64) as -2**63: the sizes summed to -9.2e18."""
    never = LinearTime(np.array([0.0, 1.0, 2.0]), overhead=np.array([np.inf, 0.0, 0.0]))
    assert allocate(never, 30, [0, 0, 0], [30, 30, 30]).tolist() == [0, 10, 20]
    assert allocate(never, 30, [1, 0, 0], [1, 30, 30]).tolist() == [1, 10, 19]
    for batch in (3, 6, 9):
        x = allocate(LinearTime(np.array([np.inf, 1.0, 1.0]), overhead=batch / 3), batch, [0] * 3, [batch] * 3)
        assert x.sum() == batch and (x >= 0).all()


def test_a_large_overhead_does_not_blur_the_part_the_sizes_change() -> None:
    """The search stopped once the deadlines agreed to 1e-7 of the whole time: with overheads of 1e5 s that
    is 0.01 s, many samples, and the compute part came out 3.3x the best."""
    rng = np.random.default_rng(1)
    speed = rng.lognormal(10, 2, 100)
    model = LinearTime(speed, overhead=np.full(100, 1e5))
    x = allocate(model, 400_000, np.zeros(100, dtype=np.int64), np.full(100, 400_000))
    best = allocate(LinearTime(speed), 400_000, np.zeros(100, dtype=np.int64), np.full(100, 400_000))
    compute = predicted_makespan(model, x) - 1e5
    assert compute <= (predicted_makespan(LinearTime(speed), best)) * (1 + 1e-4), compute

@pytest.mark.parametrize(("global_batch", "lower", "upper", "message"), [
    (60.5, [0] * 3, [60] * 3, "global_batch must be a whole number"),
    (True, [0] * 3, [60] * 3, "global_batch must be a whole number"),
    (float("nan"), [0] * 3, [60] * 3, "global_batch must be a whole number"),
    (2**62, [0] * 3, [2**62] * 3, "global_batch must be a whole number"),
    (60, [0, 0.5, 0], [60] * 3, "lower bounds must be whole numbers"),
    (60, [0] * 3, [60, float("nan"), 60], "upper bounds must be whole numbers"),
])
def test_bad_arguments_are_a_clear_allocation_error(global_batch: object, lower: list, upper: list,
                                                    message: str) -> None:
    """Not numpy's UFuncTypeError, a bound of 0.5 truncated to 0, True taken as 1, or a sum that wraps."""
    with pytest.raises(AllocationError, match=message):
        allocate(LinearTime(np.ones(3)), global_batch, lower, upper)  # type: ignore[arg-type]


def test_caps_near_the_integer_limit_do_not_overflow() -> None:
    no_cap = np.iinfo(np.int64).max // 4
    assert allocate(LinearTime(np.arange(1.0, 6.0)), 100, [0] * 5, [no_cap] * 5).sum() == 100
