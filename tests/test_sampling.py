"""The global-batch sampler covers every sample exactly once per epoch, whatever the splits were; a short final batch
is split in proportion (scale_split: exact for huge sizes, ties to the lower index), and sizes, steps or workers
that are not what they must be are ConfigErrors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lbbsp import Assignment, ConfigError, GlobalBatchSampler, ProtocolError, Report, scale_split


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_sample_exactly_once_per_epoch(data: st.DataObject) -> None:
    n_workers = data.draw(st.integers(1, 6))
    batch = data.draw(st.integers(n_workers, 40))
    size = data.draw(st.integers(1, 300))
    drop_last = data.draw(st.booleans()) and size >= batch
    sampler = GlobalBatchSampler(size, batch, seed=data.draw(st.integers(0, 99)), drop_last=drop_last)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen: list[int] = []
        for step in range(len(sampler)):
            cuts = sorted(data.draw(st.lists(st.integers(0, batch), min_size=n_workers - 1,
                                             max_size=n_workers - 1)))
            sizes = np.diff([0, *cuts, batch]).tolist()
            parts = [sampler.worker_indices(step, sizes, w) for w in range(n_workers)]
            assert sum(len(p) for p in parts) == sampler.batch_size(step)
            seen.extend(int(i) for p in parts for i in p)
        expected = size - (size % batch if drop_last else 0)
        assert len(seen) == expected
        assert len(set(seen)) == expected  # no sample twice


def test_two_rank_example_from_the_docstring() -> None:
    sampler = GlobalBatchSampler(16, 8, shuffle=False)
    assert sampler.worker_indices(0, (3, 5), 0).tolist() == [0, 1, 2]
    assert sampler.worker_indices(0, (3, 5), 1).tolist() == [3, 4, 5, 6, 7]
    assert sampler.worker_indices(1, (6, 2), 1).tolist() == [14, 15]


def test_epochs_differ_and_repeat_under_a_seed() -> None:
    a, b = GlobalBatchSampler(50, 10, seed=3), GlobalBatchSampler(50, 10, seed=3)
    first = a.global_indices(0).tolist()
    assert first == b.global_indices(0).tolist()
    a.set_epoch(1)
    assert a.global_indices(0).tolist() != first


def test_short_final_batch_is_split_in_proportion() -> None:
    sampler = GlobalBatchSampler(25, 10, shuffle=False)
    assert len(sampler) == 3 and sampler.batch_size(2) == 5
    assert sampler.split_for(2, (2, 8)) == (1, 4)
    assert scale_split((3, 3, 4), 5) == (2, 1, 2)


def test_bad_sizes_and_steps_are_rejected() -> None:
    sampler = GlobalBatchSampler(25, 10)
    with pytest.raises(ConfigError, match="sum to 9"):
        sampler.worker_indices(0, (4, 5), 0)
    with pytest.raises(ConfigError, match="outside the epoch"):
        sampler.global_indices(3)


@pytest.mark.parametrize("call", [
    lambda s: s.worker_indices(0, [-2, 10], 0), lambda s: s.worker_indices(0, [2.5, 5.5], 0),
    lambda s: s.set_epoch(-1), lambda s: GlobalBatchSampler(10.5, 4), lambda s: GlobalBatchSampler(10, 4.5),
    lambda s: GlobalBatchSampler(10, 4, seed=-1),
])
def test_bad_sizes_and_arguments_are_config_errors(call) -> None:
    with pytest.raises(ConfigError):
        call(GlobalBatchSampler(20, 8))


@pytest.mark.parametrize(("sizes", "total"), [((5, -2), 2), ((2.7, 1.3), 4), ((1, 2), -3), ((True, 3), 2),
                                             ((1, 2), True)])
def test_scale_split_refuses_what_is_not_a_split(sizes: tuple, total: int) -> None:
    """Exported on its own, it gave (3, -1), truncated floats, and scaled to a negative total."""
    with pytest.raises(ConfigError):
        scale_split(sizes, total)


def test_the_fingerprint_tells_seeds_and_epochs_apart() -> None:
    """The torch ranks compare it: their check had compared seed % 2**63, so seeds 2**63 apart passed."""
    a, b = GlobalBatchSampler(50, 8, seed=5), GlobalBatchSampler(50, 8, seed=5 + 2**63)
    assert a.fingerprint() != b.fingerprint() and a.fingerprint() == GlobalBatchSampler(50, 8, seed=5).fingerprint()
    first = a.fingerprint()
    a.set_epoch(1)
    assert a.fingerprint() != first and 0 <= a.fingerprint() < 2**63


def test_a_short_final_batch_leaves_no_worker_with_samples_empty_where_it_holds_one_each() -> None:
    """A split of 9 / 1 scaled an epoch's short final batch of 3 to 3 / 0: the second rank's slice was empty under the
    default min_batch of 1, its mean loss NaN (a script's `if loss.isnan(): continue` then hung the other rank in
    the all-reduce). A worker given nothing stays at nothing; a batch too short for one each still empties some."""
    assert scale_split((9, 1), 3) == (2, 1)
    assert scale_split((0, 9, 1), 3) == (0, 2, 1)
    assert scale_split((1, 8, 1), 3) == (1, 1, 1)
    assert scale_split((1, 1, 98), 5) == (1, 1, 3)
    assert scale_split((9, 1), 1) == (1, 0)
    assert scale_split((3, 3, 4), 5) == (2, 1, 2)  # the proportional split where it has no empty slice
    sampler = GlobalBatchSampler(23, 10, seed=1)
    for sizes in [(9, 1), (1, 9), (5, 5), (10, 0)]:
        parts = [sampler.worker_indices(2, sizes, w) for w in range(2)]
        assert sorted(np.concatenate(parts).tolist()) == sorted(sampler.global_indices(2).tolist())
        assert all(part.size for part, size in zip(parts, sizes) if size)


def test_sizes_must_be_a_sequence_and_an_assignment_is_named() -> None:
    sampler = GlobalBatchSampler(100, 8)
    with pytest.raises(ConfigError, match=r"got Assignment: pass the assignment's \.sizes"):
        sampler.worker_indices(0, Assignment("j", 0, (4, 4), "p"), 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="got NoneType"):
        sampler.split_for(0, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="got NoneType"):
        scale_split(None, 2)  # type: ignore[arg-type]
    for unordered in ({0: 3, 1: 5}, {3, 5}):  # a dict's keys had been scaled ((0, 4)), a set's in no set order
        with pytest.raises(ConfigError, match=f"sizes must be a sequence .* got {type(unordered).__name__}"):
            scale_split(unordered, 4)  # type: ignore[arg-type]
    for payload in (None, 5):
        with pytest.raises(ProtocolError, match="payload: report must be JSON as bytes or str"):
            Report.from_json(payload)  # type: ignore[arg-type]


def test_numpy_sizes_are_kept_as_plain_ints() -> None:
    """A uint8 global batch of 200 had been kept as uint8: a dataset of 1,000 overflowed, naming nothing."""
    sampler = GlobalBatchSampler(1000, np.uint8(200), seed=np.int16(3))
    assert type(sampler.global_batch) is int and type(sampler.batch_size(4)) is int and sampler.batch_size(4) == 200
    assert sampler.global_indices(4).size == 200


@pytest.mark.parametrize(("step", "worker"), [(1.0, 0), ("1", 0), (0, 1.0), (0, "1"), (0, True)])
def test_a_step_or_worker_that_is_not_an_integer_is_a_config_error(step: object, worker: object) -> None:
    sampler = GlobalBatchSampler(23, 10)
    with pytest.raises(ConfigError, match="must be an integer"):
        sampler.worker_indices(step, (5, 5), worker)  # type: ignore[arg-type]


def test_sizes_given_as_a_generator_are_split_like_a_tuple() -> None:
    sampler = GlobalBatchSampler(23, 10)
    assert sampler.split_for(2, (s for s in (5, 5))) == sampler.split_for(2, (5, 5))
    np.testing.assert_array_equal(sampler.worker_indices(0, (s for s in (5, 5)), 1),
                                  sampler.worker_indices(0, (5, 5), 1))


def test_numpy_sizes_that_wrap_past_the_sum_check_are_refused() -> None:
    """int64 sizes summed in numpy wrapped round to B: worker 0 took the whole batch, worker 2 none of its 10."""
    sampler = GlobalBatchSampler(8, 8, shuffle=False)
    sizes = (np.int64(2**63 - 1), np.int64(2**63 - 1), np.int64(10))
    with pytest.raises(ConfigError, match="not the global batch 8"):
        sampler.worker_indices(0, sizes, 0)


def test_scale_split_is_exact_for_huge_sizes() -> None:
    """int64 products overflowed: (2**40, 2**40) scaled to 2**30 gave (1, 1); beyond int64, a raw OverflowError."""
    assert scale_split((2**40, 2**40), 2**30) == (2**29, 2**29)
    assert scale_split((2**70,), 5) == (5,)
    assert scale_split((3, 5), 2**70) == (3 * 2**67, 5 * 2**67)


def test_scale_split_breaks_ties_to_the_lower_index() -> None:
    """Workers 0 and 2 have equal remainders (2356/4123); float rounding gave the spare sample to worker 2."""
    sizes = (1957, 1539, 627)
    assert scale_split(sizes, 1240) == (589, 463, 188)
    sampler = GlobalBatchSampler(sum(sizes) + 1240, sum(sizes), shuffle=False)  # a short final batch of 1240
    assert sampler.split_for(1, sizes) == (589, 463, 188)
    parts = [sampler.worker_indices(1, sizes, w) for w in range(3)]
    assert np.concatenate(parts).tolist() == list(range(sum(sizes), sum(sizes) + 1240))


@pytest.mark.parametrize("sizes", [(0, 0), ()], ids=["zeros", "none"])
def test_a_split_of_no_samples_cannot_be_scaled(sizes: tuple[int, ...]) -> None:
    """There is no proportion to keep: an error, not a division by zero or a split of nothing called the total."""
    with pytest.raises(ConfigError, match="cannot scale an empty split"):
        scale_split(sizes, 3)
    assert scale_split(sizes, 0) == sizes  # scaled to what it already sums to: nothing to do


@pytest.mark.parametrize("worker", [-1, 2])
def test_a_worker_outside_the_split_is_a_config_error(worker: int) -> None:
    """-1 would index from the end (the last worker's samples, computed twice), 2 of 2 an empty slice."""
    sampler = GlobalBatchSampler(20, 10)
    with pytest.raises(ConfigError, match=f"worker {worker} is not in a split of 2 workers"):
        sampler.worker_indices(0, (5, 5), worker)
