"""The data side: serve, at each step, this rank's slice of the global batch at the size agreed for that step.

The size of step k is decided from every rank's compute time of step k - lag, so it exists only once that
step is computed everywhere. A ``DataLoader`` that prefetches would ask for indices of steps whose size nobody
knows yet. :class:`BalancedLoader` therefore drives its ``DataLoader`` one step at a time: it fetches the
agreed vector, plans exactly one batch, and pulls it through the loader (with worker processes, persistent,
and pinned memory if asked). Sizes are never guessed and never stale. With ``JobConfig.lag`` = 2 (the default)
the vector of step k is decided from the reports of step k-2, so it is often stored while step k-1 computes:
with loader worker processes, a thread then loads step k's slice ahead (:class:`Prefetch`), and the step uses
it only if the vector agreed at step k is the one it was cut by; otherwise it loads the slice again.

Two ranks, global batch 8, epoch permutation p: with sizes (3, 5) rank 0 gets p[0:3] and rank 1 gets
p[3:8]; if the next step agrees (6, 2), rank 0 gets p[8:14] and rank 1 gets p[14:16].
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import ConcatDataset, DataLoader, Dataset, IterableDataset, Subset

from lbbsp.config import _integer, _is_integer
from lbbsp.errors import ConfigError
from lbbsp.sampling import GlobalBatchSampler

from .torch_grad import _collective_device

if TYPE_CHECKING:
    from .torch import Balancer

log = logging.getLogger("lbbsp.torch")

#: DataLoader options that BalancedLoader sets itself, and why.
_RESERVED = {
    "batch_size": "each step's size is this rank's share of the Balancer's global batch",
    "sampler": "it samples the global batches itself (GlobalBatchSampler; pass shuffle= and seed=)",
    "batch_sampler": "it samples the global batches itself (GlobalBatchSampler; pass shuffle= and seed=)",
    "persistent_workers": "it keeps its loader workers alive between steps whenever num_workers > 0; leave it out "
                          "(True is accepted with num_workers > 0)",
}


def _from_ddps_batch_size(batch_size: object, balancer: Balancer) -> str:
    """How a DDP script's ``batch_size`` (per rank) becomes the global batch, with this job's figures where known."""
    if not _is_integer(batch_size):
        return ("; for DDP's updates, pass global_batch = batch_size x world size to Balancer.from_env "
                "(DDP's batch_size is per rank)")
    world = balancer.world_size
    return (f"; for DDP's updates, pass global_batch = batch_size x world size (here {batch_size} x {world} = "
            f"{int(batch_size) * world}) to Balancer.from_env (DDP's batch_size is per rank; this Balancer's "
            f"global batch is {balancer.config.global_batch})")


class PlannedBatch:
    """A batch sampler that yields the one batch planned for the current step, then stops."""

    def __init__(self) -> None:
        self.indices: list[int] | None = None

    def __iter__(self) -> Iterator[list[int]]:
        if self.indices is not None:
            batch, self.indices = self.indices, None
            yield batch

    def __len__(self) -> int:
        return 1


class Prefetch:
    """Loads one step's slice in a thread, by the vector stored for its iteration, while the step before computes.

    The thread polls ``peek`` (a read of the stored vector, no waiting in Redis) until it finds the vector or is
    cancelled; once it has begun loading, it owns the loader until the batch is in. :meth:`take` cancels a
    thread still polling at once (it never touches the loader after) and waits for one that is loading.
    ``key`` names what is loaded (epoch, global batch, iteration): a step takes only its own.
    """

    def __init__(self, key: tuple[int, int, int], load: Callable[[tuple[int, ...]], Any],
                 peek: Callable[[], Sequence[int] | None]) -> None:
        self.key = key
        self._load, self._peek = load, peek
        self._lock = threading.Lock()
        self._cancelled = self._loading = False
        self._done = threading.Event()
        self._sizes: tuple[int, ...] | None = None
        self._batch: Any = None
        self._thread = threading.Thread(target=self._run, name="lbbsp-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = 0.001
        while (sizes := self._peek()) is None:
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
            if self._cancelled:
                return
        with self._lock:
            if self._cancelled:
                return
            self._loading = True
        try:
            self._batch, self._sizes = self._load(tuple(sizes)), tuple(sizes)
        except Exception:  # noqa: BLE001  (the step loads the slice itself, and meets the error there)
            self._sizes = None
        finally:
            self._done.set()

    def take(self, sizes: Sequence[int] | None) -> Any:
        """The batch, if it was loaded by ``sizes``; else None, and the loader is free again. Returns at once in
        the thread itself (a generator closed there by the garbage collector) and at interpreter exit, where a
        daemon thread is frozen mid-load and would never finish."""
        with self._lock:
            self._cancelled = True
            loading = self._loading
        if not loading or threading.current_thread() is self._thread:
            return None
        while not self._done.wait(0.05):
            if sys.is_finalizing() or not self._thread.is_alive():
                return None
        return self._batch if sizes is not None and self._sizes == tuple(sizes) else None


class BalancedLoader:
    """Iterate over this rank's slices of an epoch's global batches, one agreed size per step.

    Replaces ``DataLoader(dataset, batch_size, sampler=DistributedSampler(...))``: call
    :meth:`set_epoch` at the start of each epoch as with ``DistributedSampler``. Every rank yields the same
    number of batches per epoch; a rank whose slice is empty (``min_batch=0``, or a short final batch of fewer
    samples than ranks) yields a zero-length batch so that it still takes part in the step's collectives.
    """

    def __init__(self, dataset: Dataset, balancer: Balancer, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, prefetch: bool | None = None, **dataloader_kwargs: Any) -> None:
        workers = int(dataloader_kwargs.get("num_workers", 0))
        # what it does anyway (persistent_workers=num_workers > 0, a common line): a DDP script's options pass
        if "persistent_workers" in dataloader_kwargs and dataloader_kwargs["persistent_workers"] is (workers > 0):
            del dataloader_kwargs["persistent_workers"]
        reserved = sorted(set(dataloader_kwargs) & set(_RESERVED))
        if reserved:
            message = "; ".join(f"{key} itself: {_RESERVED[key]}" for key in reserved)
            if "batch_size" in reserved:
                message += _from_ddps_batch_size(dataloader_kwargs["batch_size"], balancer)
            raise ConfigError("BalancedLoader sets " + message)
        if isinstance(dataset, DataLoader):
            raise ConfigError("BalancedLoader takes the dataset, not a DataLoader: pass loader.dataset (and its "
                              "num_workers, collate_fn or pin_memory as keyword arguments); batch_size and the "
                              "sampler are set from the Balancer's global batch")
        if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ConfigError(f"BalancedLoader needs a map-style dataset (__getitem__ and __len__), got "
                              f"{type(dataset).__name__}: each step reads the positions of its rank's slice of a "
                              "seeded permutation of the epoch")
        self.dataset = dataset
        self.balancer = balancer
        size = len(dataset)
        self.sampler = GlobalBatchSampler(size, balancer.config.global_batch, seed=seed, shuffle=shuffle,
                                          drop_last=drop_last)
        if balancer.config.global_batch > size:  # with drop_last, the sampler has refused it
            log.warning("the global batch %d is larger than the dataset (%d samples): each epoch is one short step "
                        "of %d samples; pass Balancer.from_env a global batch of at most %d",
                        balancer.config.global_batch, size, size, size)
        self._plan = PlannedBatch()
        self._loader = DataLoader(dataset, batch_sampler=self._plan, persistent_workers=workers > 0,
                                  **dataloader_kwargs)
        self._loop: object | None = None  # the loop in progress, if any: only its clean-up ends a step or the iteration
        self._next_epoch: int | None = None
        self._served = (0, 0)  # (epoch, its next global batch): where the latest iteration stands
        self._resume: tuple[int, int] | None = None  # (epoch, first global batch) of a loaded state, until used
        if prefetch is not None and not isinstance(prefetch, bool):
            raise ConfigError(f"prefetch must be True, False or None (with loader workers), got {prefetch!r}")
        if prefetch and workers == 0:  # a thread of the training process would read the dataset beside training,
            # and each load would draw its seed from torch's global RNG at a moment that varies from run to run
            raise ConfigError("prefetch=True needs DataLoader worker processes: pass num_workers >= 1 (the slice is "
                              "then loaded in a worker process, as the training thread goes on)")
        # No use before lag 2: the vector of step k is decided from step k-1's reports, sent as step k begins.
        self.prefetch = (workers > 0 if prefetch is None else prefetch) and balancer.config.lag >= 2
        self.prefetched = 0  # steps served from a prefetch (the others loaded their slice as they began)
        self._ahead: Prefetch | None = None
        self._warned_leak = False
        balancer._loaders.add(self)

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch``, as ``DistributedSampler.set_epoch`` does: called while an epoch
        is being iterated, from the next iteration on (switching mid-epoch would repeat and skip samples)."""
        epoch = _integer(epoch, "epoch", 0, None)
        if self._loop is not None:
            self._next_epoch = epoch
        else:  # and one asked for during an earlier iteration is superseded
            self._next_epoch = None
            self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, int | bool]:
        """Where the loader stands, for a checkpoint: the epoch and its next global batch (a batch counts as
        served once yielded, so save after the step's update), and what a resume must match. The position is
        global, not this rank's, so a run may resume on another number of ranks."""
        epoch = self._next_epoch if self._next_epoch is not None and self._loop is None else self.sampler.epoch
        if self._resume is not None and self._loop is None:
            step = self._resume[1] if self._resume[0] == epoch else 0
        else:
            step = self._served[1] if self._served[0] == epoch else 0
        sampler = self.sampler
        return {"epoch": epoch, "step": step, "dataset_size": sampler.dataset_size,
                "global_batch": sampler.global_batch, "seed": sampler.seed, "shuffle": sampler.shuffle,
                "drop_last": sampler.drop_last}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the state's epoch is selected, and its next iteration starts at the
        state's global batch, so every sample of the epoch is still used once across the restart. A
        ``ConfigError`` if the state is not a loader's or was saved with another dataset size, global batch,
        seed, shuffle or drop_last (its positions would then name other samples)."""
        if self._loop is not None:
            raise ConfigError("load_state_dict while the loader is being iterated: load it before the loop")
        now = self.state_dict()
        if not isinstance(state, Mapping) or set(state) != set(now):
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(f"not a BalancedLoader state (keys {keys}): pass what loader.state_dict() returned")
        for name in ("dataset_size", "global_batch", "seed", "shuffle", "drop_last"):
            if state[name] != now[name] or isinstance(state[name], bool) != isinstance(now[name], bool):
                raise ConfigError(f"the loader state was saved with {name}={state[name]!r}, this loader has "
                                  f"{name}={now[name]!r}: its positions would name other samples; resume with the "
                                  "same dataset, global batch, seed, shuffle and drop_last")
        epoch = _integer(state["epoch"], "the state's epoch", 0, None)
        step = _integer(state["step"], "the state's step", 0, len(self.sampler))
        self.set_epoch(epoch)
        self._resume = (epoch, step)

    def __reduce_ex__(self, protocol: object) -> Any:
        from .torch import _NOT_COPIED  # noqa: PLC0415  (torch imports this module)

        raise ConfigError(_NOT_COPIED.format(what="a BalancedLoader"), job=self.balancer.config.job,
                          worker=self.balancer.rank)

    def close(self) -> None:
        """Stop the loader's worker processes (they persist between steps); :meth:`Balancer.close` calls it."""
        self._cancel_ahead()
        iterator = getattr(self._loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._loader._iterator = None

    def __len__(self) -> int:
        """Steps per epoch, the same on every rank."""
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        self.balancer._refuse_closed()  # before the ranks' check, a collective
        if self._next_epoch is not None:
            self.sampler.set_epoch(self._next_epoch)
            self._next_epoch = None
        self._cancel_ahead()  # another loop's, still suspended: never this loop's steps
        first = self._first_step()
        _check_ranks_agree(self.sampler, self.balancer, first, self.dataset)
        self._resume = None  # used once the ranks agree on it (a refusal leaves it for the next loop)
        self._loop = loop = object()
        self._served = (self.sampler.epoch, first)
        if first == len(self.sampler):  # a state saved at the epoch's end: nothing of it is left to serve
            self._loop = None
            return
        try:
            for step in range(first, len(self.sampler)):
                indices = self.balancer.begin_step(self.sampler, step)
                current = self.balancer._current()
                key = (self.sampler.epoch, step, current.iteration)
                ahead, self._ahead = self._ahead, None
                batch = ahead.take(current.assignment.sizes if ahead.key == key else None) if ahead else None
                if batch is None:
                    batch = self._slice(step, indices)
                else:
                    self.prefetched += 1
                if self.prefetch and step + 1 < len(self.sampler):
                    self._ahead = self._prefetch(step + 1, self.balancer._iteration)
                self._served = (self.sampler.epoch, step + 1)  # yielded: a checkpoint from here on counts it
                yield batch
        except GeneratorExit:  # the loop was left early (break, zip, an error): its open step is abandoned
            if self._loop is loop:  # an earlier loop closed late (collected) must not end a later loop's step
                if not self.balancer._synced:  # left before its backward: a checkpoint from here must not count it
                    self._served = (self.sampler.epoch, step)
                self.balancer.end_step(abandoned=True)
            raise
        finally:
            if self._loop is loop:  # nor cancel its prefetch, or count the loader as no longer iterated
                self._cancel_ahead()
                self._loop = None
        self.balancer.end_step()
        self.balancer.end_epoch()

    def _prefetch(self, step: int, iteration: int) -> Prefetch:
        """Start loading ``step``'s slice by the vector Redis will hold for ``iteration``."""
        peek = self.balancer.client.peek
        rank = self.balancer.rank
        return Prefetch((self.sampler.epoch, step, iteration),
                        lambda sizes: self._slice(step, self.sampler.worker_indices(step, sizes, rank)),
                        lambda: None if (found := peek(iteration)) is None else found.sizes)

    def _cancel_ahead(self) -> None:
        """Drop a prefetch in flight, once it no longer uses the loader."""
        if self._ahead is not None:
            self._ahead.take(None)
            self._ahead = None

    def _slice(self, step: int, indices: Sequence[int] | np.ndarray) -> Any:
        """This rank's slice ``indices`` of global batch ``step``. An empty one keeps the batch's structure, so
        that the rank still runs the step's forward and collectives: it is cut from batches of one sample of the
        step and of that sample twice, which tell what holds one entry per sample whatever the ``collate_fn``."""
        if len(indices):
            return self._load(indices)
        first = int(self.sampler.global_indices(step)[0])
        leaks: list[str] = []
        batch = _emptied(self._load([first]), self._load([first, first]), leaks)
        if leaks and not self._warned_leak:
            self._warned_leak = True
            log.warning("an empty slice's batch keeps a value of another rank's sample in a part it cannot cut to "
                        "no sample (%s): its gradient weight is 0, so training stays exact, but count samples by "
                        "the tensors' rows, not by that part (said once)", ", ".join(sorted(set(leaks))))
        return batch

    def _first_step(self) -> int:
        """The global batch this iteration starts at: a loaded state's, once, if it is of this epoch."""
        if self._resume is None:
            return 0
        epoch, step = self._resume
        if epoch == self.sampler.epoch:
            return step
        if 0 < step < len(self.sampler):
            log.warning("the loaded loader state resumes epoch %d at global batch %d, but epoch %d is iterated: it "
                        "starts at its first batch, and the rest of epoch %d is not served", epoch, step,
                        self.sampler.epoch, epoch)
        return 0

    def _load(self, indices: Sequence[int] | np.ndarray) -> Any:
        self._plan.indices = [int(i) for i in indices]
        return next(iter(self._loader))


#: What every rank's sampler must agree on, or the ranks' slices overlap and miss samples (or their step counts
#: differ, and one rank waits for the others in a collective until the process group times out).
_AGREED = ("dataset size", "shuffle", "drop_last", "epoch", "first global batch (a loaded state's)",
           "dataset's subset indices (a Subset per rank is a shard)", "seed (the epoch order's fingerprint)")


def _subset_fingerprint(dataset: Any) -> int:
    """A hash of the indices of every ``Subset`` in ``dataset`` (through ``ConcatDataset`` and nested subsets), 0
    where there is none: equal shards per rank (``Subset(data, range(rank, N, world))``) have one size, and only
    their indices tell them apart."""
    if isinstance(dataset, Subset):
        own = zlib.crc32(np.asarray(dataset.indices, dtype=np.int64).tobytes())
        return zlib.crc32(np.array([own, _subset_fingerprint(dataset.dataset)], dtype=np.int64).tobytes())
    if isinstance(dataset, ConcatDataset):
        parts = [_subset_fingerprint(part) for part in dataset.datasets]
        return zlib.crc32(np.array(parts, dtype=np.int64).tobytes()) if any(parts) else 0
    return 0


def _check_ranks_agree(sampler: GlobalBatchSampler, balancer: Balancer, first: int, dataset: Any) -> None:
    """Raise a ConfigError on every rank unless all ranks' samplers and datasets agree on ``_AGREED`` (one
    all-gather of seven integers as each epoch starts; the first that differs is named, the order's fingerprint
    last as it differs whenever another does)."""
    if balancer.world_size < 2:
        return
    rows = _gathered_rows(balancer, [sampler.dataset_size, int(sampler.shuffle), int(sampler.drop_last), sampler.epoch,
                                     first, _subset_fingerprint(dataset), sampler.fingerprint()])
    closed = [r for r, row in enumerate(rows) if row == _CLOSING]
    if closed:
        raise ConfigError(f"rank(s) {closed[:8]} closed the Balancer as this rank began epoch {sampler.epoch} of "
                          f"lb.loader: {_SAME_EPOCHS}", job=balancer.config.job, worker=balancer.rank)
    for j, name in enumerate(_AGREED):
        values = [row[j] for row in rows]
        if len(set(values)) > 1:
            raise ConfigError(f"the ranks' loaders differ in {name} ({values}, by rank): every rank must load the "
                              "whole dataset (not a shard: the loader splits it) with the same seed, shuffle and "
                              "drop_last, call set_epoch with the same epoch, and load the same loader state",
                              job=balancer.config.job, worker=balancer.rank)


#: What a closing rank gathers where the others gather their loader's ``_AGREED`` (no dataset has -1 samples).
_CLOSING = [-1] + [0] * (len(_AGREED) - 1)
_SAME_EPOCHS = ("every rank must run the same number of epochs (loops over lb.loader) before Balancer.close; each "
                "rank waits for the others in both, and one closing while another began an epoch had both waiting "
                "until the process group's timeout")


def _gathered_rows(balancer: Balancer, row: list[int]) -> list[list[int]]:
    """Every rank's ``row`` of ``len(_AGREED)`` integers, in rank order (one all-gather over the balancer's group)."""
    mine = torch.tensor(row, dtype=torch.int64, device=_collective_device(balancer.group))
    everyone = [torch.empty_like(mine) for _ in range(balancer.world_size)]
    dist.all_gather(everyone, mine, group=balancer.group)
    return torch.stack(everyone).cpu().tolist()


def meet_at_close(balancer: Balancer) -> None:
    """Wait for every rank to close ``balancer`` (a barrier that the epoch check of a rank still training meets: both
    raise a ConfigError, where a barrier had left both waiting until the process group's timeout)."""
    if balancer.world_size < 2:
        dist.barrier(group=balancer.group)
        return
    training = [r for r, row in enumerate(_gathered_rows(balancer, _CLOSING)) if row != _CLOSING]
    if training:
        raise ConfigError(f"rank(s) {training[:8]} began another epoch of lb.loader as this rank closed the Balancer: "
                          f"{_SAME_EPOCHS}", job=balancer.config.job, worker=balancer.rank)


def _emptied(one: Any, two: Any, leaks: list[str]) -> Any:
    """The batch ``one`` (of one sample) cut to no sample, by its difference from ``two`` (of that sample twice):
    what has 1 entry where ``two`` has 2 holds one per sample and is emptied (a tensor's or array's batch axis; a
    list or tuple of per-sample values, as a custom ``collate_fn`` leaves them), and containers keep their
    structure (mappings, named tuples, dataclasses, tuples of fields). A value that differs otherwise cannot be
    cut and keeps the sample's; its type's name is added to ``leaks``."""
    if isinstance(one, (torch.Tensor, np.ndarray)) and type(two) is type(one) and one.ndim == two.ndim:
        axes = [a for a in range(one.ndim) if one.shape[a] == 1 and two.shape[a] == 2]
        if axes:
            return one[(slice(None),) * axes[0] + (slice(0, 0),)]
        if _equal(one, two):
            return one
    elif isinstance(one, Mapping) and isinstance(two, Mapping) and one.keys() == two.keys():
        entries = {k: _emptied(v, two[k], leaks) for k, v in one.items()}
        if isinstance(one, MutableMapping):  # as default_collate builds it: a defaultdict's type takes no dict
            emptied = copy.copy(one)
            emptied.update(entries)
            return emptied
        return type(one)(entries)  # type: ignore[call-arg]
    elif isinstance(one, (list, tuple)) and type(two) is type(one):
        if len(one) == 1 and len(two) == 2:  # one entry per sample
            return [] if isinstance(one, list) else ()
        if len(one) == len(two):
            parts = [_emptied(a, b, leaks) for a, b in zip(one, two)]
            return type(one)(*parts) if hasattr(one, "_fields") else type(one)(parts)
    elif dataclasses.is_dataclass(one) and not isinstance(one, type) and type(two) is type(one):
        fields = [f.name for f in dataclasses.fields(one) if f.init]
        return dataclasses.replace(one, **{f: _emptied(getattr(one, f), getattr(two, f), leaks) for f in fields})
    else:
        try:
            if bool(one == two):
                return one
        except (TypeError, ValueError, RuntimeError):  # a value that does not compare to one bool
            pass
    leaks.append(type(one).__name__)
    return one


def _equal(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    """Whether two tensors, or two arrays, of one shape hold the same values."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return bool(np.array_equal(a, b))
