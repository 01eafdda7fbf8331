"""Split each global batch of a seeded epoch permutation by the agreed batch-size vector.

Framework-free and deterministic: every worker computes the same permutation from (seed, epoch) and
takes positions [offset_i, offset_i + x_i) of global batch k, where offset_i is the sum of the sizes
before it. Two workers, B = 8, sizes (3, 5): worker 0 takes positions 0-2 of the batch, worker 1 takes
positions 3-7; with sizes (6, 2) next iteration, worker 0 takes 0-5 and worker 1 takes 6-7. Every sample
is used exactly once per epoch, whatever the splits were.

A dataset of n samples gives ``n // B`` full batches. The rest (``n % B`` samples) is either dropped
(``drop_last=True``, as ``DataLoader`` does) or served as a short final batch, split in proportion to
the agreed vector by :func:`scale_split` (each worker with samples keeping one where there are enough), so that
it too is covered exactly once.
"""
from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable, Mapping, Sequence, Set

import numpy as np

from .config import _integer, _is_integer
from .errors import ConfigError
from .protocol import _flag


def _checked_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """``sizes`` as a tuple of plain ints (a generator would be used up by the check; numpy integers would sum
    with wrap-around, so that sizes far beyond B could pass for B), if all are integers >= 0."""
    if isinstance(sizes, (str, bytes, Mapping, Set)) or not isinstance(sizes, Iterable):  # a dict's keys, a set's
        hint = ": pass the assignment's .sizes" if hasattr(sizes, "sizes") else ""
        raise ConfigError(f"sizes must be a sequence of integers, one per worker, got {type(sizes).__name__}{hint}")
    sizes = tuple(sizes)
    if not all(_is_integer(s) and s >= 0 for s in sizes):
        raise ConfigError(f"sizes must be integers >= 0, got {sizes[:8]}")
    return tuple(int(s) for s in sizes)


def scale_split(sizes: Sequence[int], total: int) -> tuple[int, ...]:
    """Scale a split to a new total, proportionally, by largest remainders (ties to the lower index). A worker with
    samples keeps at least one where the total holds one for each such worker, taken from the largest share (an
    epoch's short final batch of 3 had split 9 / 1 as 3 / 0: an empty slice, whose mean loss is NaN)."""
    return _scaled(_checked_sizes(sizes), _integer(total, "total", 0, None))


def _scaled(sizes: tuple[int, ...], total: int) -> tuple[int, ...]:
    """:func:`scale_split` of plain-int sizes and a total already checked, in exact integer arithmetic: int64
    products overflow, and float remainders that should tie do not."""
    whole = sum(sizes)
    if whole == total:
        return sizes
    if whole <= 0:
        raise ConfigError("cannot scale an empty split")
    parts = [divmod(s * total, whole) for s in sizes]  # (floor, remainder) of each exact share
    scaled = [floor for floor, _ in parts]
    short = total - sum(scaled)
    for i in sorted(range(len(sizes)), key=lambda i: -parts[i][1])[:short]:  # a stable sort: ties to the lower index
        scaled[i] += 1
    emptied = [i for i, size in enumerate(sizes) if size and not scaled[i]]
    if emptied and total >= len(sizes) - sizes.count(0):  # then another share holds 2 or more
        # the largest share first, ties to the lower index: a heap, as a pass over all workers for each one emptied
        # had taken 3 s at 4,096 workers
        largest = [(-share, j) for j, share in enumerate(scaled) if share > 1]
        heapq.heapify(largest)
        for i in emptied:
            negated, donor = largest[0]
            scaled[donor] = -negated - 1
            if scaled[donor] > 1:
                heapq.heapreplace(largest, (negated + 1, donor))
            else:
                heapq.heappop(largest)
            scaled[i] = 1
    return tuple(scaled)


class GlobalBatchSampler:
    """Indices of global batch k, and each worker's slice of it, for a dataset of ``dataset_size`` samples."""

    def __init__(self, dataset_size: int, global_batch: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False) -> None:
        # plain ints: numpy's had kept their type (a uint8 batch overflowed at 1000 samples, naming nothing)
        dataset_size, global_batch, seed = (_integer(value, name, least, None) for name, value, least in (
            ("dataset_size", dataset_size, 1), ("global_batch", global_batch, 1), ("seed", seed, 0)))
        shuffle, drop_last = _flag(shuffle, "shuffle"), _flag(drop_last, "drop_last")
        if drop_last and dataset_size < global_batch:
            raise ConfigError(f"drop_last with {dataset_size} samples and global batch {global_batch} leaves "
                              "no batch at all")
        self.dataset_size, self.global_batch, self.seed = dataset_size, global_batch, seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.dataset_size)
        return np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch's permutation, as ``DistributedSampler.set_epoch`` does."""
        _integer(epoch, "epoch", 0, None)
        if epoch != self.epoch:
            self.epoch = epoch
            self._order = self._permutation(epoch)

    def fingerprint(self) -> int:
        """63 bits of a hash of the seed and the current epoch's order: equal on two workers only if they split the
        same permutation (a seed that differs by any amount, or a numpy that draws another permutation from the
        same seed, gives another)."""
        digest = hashlib.blake2b(str(self.seed).encode(), digest_size=8)
        digest.update(np.ascontiguousarray(self._order, dtype=np.int64).tobytes())
        return int.from_bytes(digest.digest(), "little") >> 1

    def __len__(self) -> int:
        """Global batches per epoch."""
        full, rest = divmod(self.dataset_size, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def batch_size(self, step: int) -> int:
        """Samples in global batch ``step`` of the epoch: B, or fewer for a short final batch."""
        self._check_step(step)
        return min(self.global_batch, self.dataset_size - step * self.global_batch)

    def global_indices(self, step: int) -> np.ndarray:
        """Dataset indices of global batch ``step`` within the current epoch."""
        start = step * self.global_batch
        return self._order[start:start + self.batch_size(step)]

    def split_for(self, step: int, sizes: Sequence[int]) -> tuple[int, ...]:
        """The split actually used at ``step``: ``sizes``, scaled down for a short final batch."""
        sizes = _checked_sizes(sizes)
        if sum(sizes) != self.global_batch:
            raise ConfigError(f"sizes {tuple(sizes)} sum to {sum(sizes)}, not the global batch {self.global_batch}")
        return _scaled(sizes, self.batch_size(step))  # checked above

    def worker_indices(self, step: int, sizes: Sequence[int], worker: int) -> np.ndarray:
        """Dataset indices that ``worker`` computes at ``step`` of the epoch under the agreed ``sizes``."""
        split = self.split_for(step, sizes)
        if not _is_integer(worker):
            raise ConfigError(f"worker must be an integer, got {worker!r}")
        if not 0 <= worker < len(split):
            raise ConfigError(f"worker {worker} is not in a split of {len(split)} workers")
        offset = sum(split[:worker])
        return self.global_indices(step)[offset:offset + split[worker]]

    def _check_step(self, step: int) -> None:
        if not _is_integer(step):
            raise ConfigError(f"step must be an integer, got {step!r}")
        if not 0 <= step < len(self):
            raise ConfigError(f"step {step} is outside the epoch's {len(self)} global batches")
