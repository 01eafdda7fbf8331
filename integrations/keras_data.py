"""The data side of the Keras integration: serve this worker's slice of every global batch at the agreed size.

A callback alone cannot resize a batch in ``model.fit`` (keras-team/keras #10143, #12314, #13058): the
pipeline has already cut the next batches when the callback runs. :class:`BalancedSource` cooperates with
:class:`~lbbsp.integrations.keras.LBBSPCallback` instead. The callback publishes the agreed vector of each
iteration here; the source cuts batch k only once the vector of k's iteration is known, so prefetching
threads block rather than serve a stale size. Vectors are write-once, so a vector once known never changes.

Two workers, B = 8, vectors (4, 4) then (3, 5): worker 1 serves positions 4-7 of global batch 0, then
positions 3-7 of global batch 1, each sample weighted W * b_i / B = 2 * 5 / 8 (see :meth:`sample_weight`).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import math
import os
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import numpy as np

from lbbsp.config import JobConfig, _integer, _real
from lbbsp.errors import ConfigError, LBBSPError
from lbbsp.protocol import Assignment
from lbbsp.sampling import GlobalBatchSampler

from .keras_session import keras_module, require_tf_keras

#: What a source takes as x or y: an array, or one level of a dict, tuple or list of arrays (kept as a tuple).
Arrays = np.ndarray | dict[str, np.ndarray] | tuple[np.ndarray, ...] | list[np.ndarray]

_KEEP_ITERATIONS = 64
_SOURCES: weakref.WeakSet[BalancedSource] = weakref.WeakSet()  # released at exit: see _release_all
#: Set at exit: a tf_dataset's generator then ends its pass, and the pass after it is empty, which ends the repeat.
_EXITING = threading.Event()
#: The generator steps under way, over every source, and when the last one ended: _release_all waits for them.
_generating = {"inside": 0, "ended": 0.0}
_generating_lock = threading.Lock()
#: How long _release_all waits at most for the generators to stop, and how long none must have stepped.
_EXIT_DRAIN_S, _EXIT_QUIET_S = 2.0, 0.1
#: How long a ``PyDataset`` batch waits for the batches before it in its epoch to be asked for: in order, they
#: were asked for a moment earlier (worker threads take indices first come, first served).
_ORDER_GRACE_S = 5.0
#: How often a batch waiting for its vector checks that the fit it waits for is still running (see attach).
_RUNNING_CHECK_S = 0.5
#: Batches beyond two epochs that a pipeline may serve, before a Keras 3 callback made for its source attaches, and
#: still be Keras 3 probing it (see BalancedSource.expect_callback).
_PROBE_BATCHES = 16
#: The names of the functions that ``fit(class_weight=...)`` maps over a ``tf.data`` dataset (Keras 3, tf_keras).
_CLASS_WEIGHT_MAPS = frozenset({"class_weights_map_fn", "_class_weights_map_fn"})


@dataclass(frozen=True)
class ServedBatch:
    """One batch this worker served: where it sits in training and how many samples it held."""

    iteration: int
    epoch: int
    step: int
    size: int
    sizes: tuple[int, ...]


class BalancedSource:
    """This worker's slices of the global batches of in-memory arrays ``x``, ``y``, at the agreed sizes.

    One LB-BSP iteration is one Keras execution: ``steps_per_execution`` consecutive global batches share
    the vector agreed for that iteration. Before a callback attaches (for example while Keras probes the
    first batches for their shapes), the source serves the equal split and records nothing. ``served``
    keeps the latest ``record_limit`` batches served: what this worker actually trained on.

    ``x`` and ``y`` are arrays, or a dict, tuple or list of arrays (a model's named or ordered inputs and
    outputs), each with the same number of samples. The source serves ``model.fit``'s training batches only:
    validate and evaluate with arrays.

    ``sample_weight`` (one weight per sample) and ``class_weight`` (class id -> weight, read as ``model.fit``
    reads it; a class without one weighs 1) multiply into the weight of every sample the source serves. Pass class
    weights here, not to ``fit``: the batches carry weights of their own (see :meth:`sample_weight`), which Keras's
    ``class_weight`` would replace or refuse, so ``fit(class_weight=...)`` on a ``tf_dataset()`` raises ConfigError.
    """

    def __init__(self, x: Arrays, y: Arrays, config: JobConfig, worker: int, *,
                 sample_weight: np.ndarray | None = None, class_weight: Mapping[int, float] | None = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, steps_per_execution: int = 1,
                 wait_timeout_s: float | None = None, record_limit: int = 100_000) -> None:
        if not isinstance(config, JobConfig):
            raise ConfigError(f"config must be the session's JobConfig (session.config), got {type(config).__name__}")
        x, y = _arrays(x, "x", config.job), _arrays(y, "y", config.job)
        lengths = {f"{name}{part}": len(array) for name, value in (("x", x), ("y", y))
                   for part, array in _named_leaves(value)}
        if len(set(lengths.values())) > 1:
            raise ConfigError(f"x and y differ in length ({', '.join(f'{k}: {n}' for k, n in lengths.items())})",
                              job=config.job)
        size = next(iter(lengths.values()))
        if size == 0:
            raise ConfigError("x and y hold no sample: a source needs at least one", job=config.job)
        weights = _sample_weights(sample_weight, size, config.job)
        if class_weight is not None:
            if not isinstance(y, np.ndarray):
                raise ConfigError("class_weight needs one target array to read classes from; with several outputs, "
                                  "pass sample_weight (one weight per sample) instead", job=config.job)
            by_class = _class_weights(class_weight, y, config.job)
            weights = by_class if weights is None else weights * by_class
        worker = _integer(worker, "worker", 0, config.num_workers - 1, config.job)  # True is not worker 1
        if config.min_batch < 1:
            raise ConfigError("the Keras integration needs min_batch >= 1, so that every worker trains on every full "
                              "global batch (only a short final batch can leave a worker empty: see drop_last)",
                              job=config.job)
        steps_per_execution = _integer(steps_per_execution, "steps_per_execution", 1, None, config.job)  # 2.0: float steps
        record_limit = _integer(record_limit, "record_limit", 0, None, config.job)
        if wait_timeout_s is not None:
            wait_timeout_s = _real(wait_timeout_s, "wait_timeout_s", 0.0, 86_400.0, "None or seconds in (0, 86400]",
                                   lo_open=True)
        self.x, self.y = x, y
        self.sample_weights = weights  # sample_weight times class_weight, None without either
        #: Whether batches are (x, y, weights), not (x, y): with one worker and no weights of the user's, every
        #: weight would be 1, and leaving them out lets Keras apply ``fit(class_weight=...)`` to a py_dataset().
        self.weighted = config.num_workers > 1 or weights is not None
        self.config = config
        self.worker = worker
        self.sampler = GlobalBatchSampler(size, config.global_batch, seed=seed, shuffle=shuffle,
                                          drop_last=drop_last)
        self.steps_per_execution = steps_per_execution
        # by default longer than WorkerSession's default outage_s (60 s, or the timeout if longer), so that a Redis
        # outage ends fit with the client's StoreUnavailable, not with this wait's error
        self.wait_timeout_s = wait_timeout_s if wait_timeout_s is not None else 3 * config.assignment_timeout_s + 90
        # float64 inputs get float64 weights (exact to 1e-10 under MWMS), and nothing narrower than float32: a
        # float16 x had rounded W * b_i / B (0.66 served as 0.66015625), and updates were 2e-4 off plain SGD
        floats = [array.dtype for _, array in _named_leaves(x) if np.issubdtype(array.dtype, np.floating)]
        self.weight_dtype = np.result_type(np.float32, *floats)
        self.served: deque[ServedBatch] = deque(maxlen=record_limit)
        self._samples: dict[int, int] = {}
        self._batches: dict[int, int] = {}  # per iteration: batches served (an execution's N, fewer at an epoch's end)
        self._vectors: dict[int, tuple[int, ...]] = {}
        self._changed = threading.Condition()
        self._attached = False
        self._first_iteration = 0
        self._first_epoch = 0
        self._start_step = 0  # the step the attached fit starts at: a fit resumed mid-epoch (resume_at)
        #: The latest fit's order of Keras epoch e is e + this; kept for a fit that BackupAndRestore resumes in this
        #: process (set by the callback; None before any fit).
        self.keras_epoch_offset: int | None = None
        #: Epochs trained from this source, over every fit: a new callback for it starts the sampler there.
        self.epochs_trained = 0
        self._generator_epochs = 0
        self._index_calls: dict[int, int] = {}  # per PyDataset index: the epochs of this fit that asked for it
        self._sequence_epochs = 0  # epochs of this fit that tf_keras ended on its Sequence (_end_sequence_epoch)
        self._fit_thread: int | None = None  # the thread that runs the attached fit
        self._samplers: dict[int, GlobalBatchSampler] = {}
        self._owner_pid = os.getpid()
        self._pipelines = itertools.count()
        self._newest: int | None = None  # the pipeline built last
        self._pipeline_replicas: int | None = None  # replicas the latest tf_dataset or py_dataset was built for
        self.latest_pipeline: str | None = None  # "tf_dataset" or "py_dataset": which the latest call built
        self._reader: int | None = None  # the pipeline that model.fit reads while a callback is attached
        self._reading = 0  # passes of that pipeline being read at once (tf_dataset): one, unless misused
        self._fit = 0  # counts attach calls, so that passes left over from an earlier fit are not counted
        self._abandoned: int | None = None  # the fit whose callback failed: its passes end (abandon)
        self._prefix: dict[int, int] = {}  # per epoch: how many leading PyDataset indices were asked for
        self._trained: set[int] = set()  # pipelines read while a callback was attached
        self._unattached: dict[int, int] = {}  # per other pipeline: batches served
        self._warned_unattached = False
        self._probe_batches = 0  # while a callback made for this source has not attached: what its Keras may probe
        self._running: Callable[[], bool] | None = None  # whether the attached fit still runs (see attach)
        _SOURCES.add(self)

    def __reduce_ex__(self, protocol: object) -> Any:
        raise ConfigError("BalancedSource cannot be copied or pickled: it cuts each batch at the size its callback "
                          "publishes in this process, and a copy would wait for sizes nobody publishes; build its "
                          "pipelines with source.tf_dataset() or source.py_dataset() (worker threads), in this process",
                          job=self.config.job, worker=self.worker)

    # -- shape of an epoch ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Steps (global batches) per epoch: pass it to ``model.fit(steps_per_epoch=...)``."""
        return len(self.sampler)

    @property
    def iterations_per_epoch(self) -> int:
        """LB-BSP iterations (Keras executions) per epoch."""
        return math.ceil(len(self) / self.steps_per_execution)

    def iteration_of(self, epoch: int, step: int) -> int:
        """The LB-BSP iteration of ``step`` in the ``epoch``-th epoch of the current ``fit`` (its first epoch starts
        at the step that a resumed ``fit`` starts at, see :meth:`resume_at`)."""
        per_execution, start = self.steps_per_execution, self._start_step
        if epoch == 0:
            return self._first_iteration + (step - start) // per_execution
        first = math.ceil((len(self) - start) / per_execution)  # the executions of the partial first epoch
        return self._first_iteration + first + (epoch - 1) * self.iterations_per_epoch + step // per_execution

    # -- the callback's side ----------------------------------------------------------------------------
    def attach(self, first_iteration: int, first_epoch: int, replicas: int = 1,
               running: Callable[[], bool] | None = None) -> None:
        """Start serving agreed sizes: the next ``fit`` starts at this iteration and sampler epoch.

        ``replicas`` is the number of replicas of the model's strategy; the latest pipeline built must be
        for it, since Keras would split each batch of a plain pipeline across the workers again. ``running``
        says whether that ``fit`` still runs: a batch waiting for its vector after the fit raised (Keras then
        skips ``on_train_end``) returns, instead of holding up the destruction of fit's iterator.
        """
        if replicas > 1 and self.latest_pipeline == "py_dataset":  # the hint below had sent users to look for a
            # strategy argument py_dataset does not take
            raise ConfigError(f"the model trains on {replicas} replicas (a multi-worker strategy), and py_dataset() "
                              "serves one worker alone: use source.tf_dataset(strategy)", job=self.config.job)
        if replicas > 1 and self._pipeline_replicas != replicas:
            raise ConfigError(f"the model trains on {replicas} replicas, but the source's pipeline was built for "
                              f"{self._pipeline_replicas or 1}: pass the strategy, source.tf_dataset(strategy) "
                              "(Keras would otherwise cut every batch again across the workers)", job=self.config.job)
        with self._changed:
            self._forget_from(first_iteration)
            self._attached = True
            self._probe_batches = 0
            self._running = running
            self._fit_thread = threading.get_ident()  # attach runs in the callback's on_train_begin, in fit's thread
            self._first_iteration = first_iteration
            self._first_epoch = first_epoch
            self._start_step = 0
            self._generator_epochs = 0
            self._index_calls.clear()
            self._sequence_epochs = 0
            self._prefix.clear()
            self._reader = None
            self._reading = 0
            self._fit += 1

    def resume_at(self, epoch: int, step: int) -> None:
        """Start the attached ``fit`` at ``step`` of the sampler's ``epoch`` (the order the stopped fit used), where
        Keras resumes a run that ``BackupAndRestore`` saved; the steps it skips are not served."""
        with self._changed:
            if not self._attached or self._generator_epochs or self._index_calls:
                raise ConfigError("resume_at is for the callback, before the fit it attached to reads a batch",
                                  job=self.config.job, worker=self.worker)
            if step and self.latest_pipeline == "py_dataset":
                raise ConfigError(f"Keras resumes this fit at step {step} of epoch {epoch} (BackupAndRestore with "
                                  "save_freq=<steps>), but a py_dataset() is read from its first batch whatever the "
                                  "step: use source.tf_dataset(), or BackupAndRestore(save_freq='epoch')",
                                  job=self.config.job, worker=self.worker)
            self._first_epoch, self._start_step = epoch, step

    def detach(self, next_iteration: int) -> None:
        """Back to the equal split (after ``fit``); a prefetch still waiting gets an unrecorded batch.

        Batches of ``next_iteration`` and later were only prefetched (a fit stopped early still publishes the
        vector of the next epoch's first iteration), so they leave ``served`` and the samples to report.
        """
        with self._changed:
            self._attached = False
            self._forget_from(next_iteration)
            self._changed.notify_all()

    def abandon(self, next_iteration: int) -> None:
        """End the current fit's pipeline, after the callback failed (Redis unusable past ``outage_s``): as
        :meth:`detach`, and the tf_dataset passes of this fit end instead of serving more batches, so that no
        prefetch calls into Python while the interpreter exits (under MWMS that had hung the process)."""
        with self._changed:
            self._abandoned = self._fit
        self.detach(next_iteration)

    def _forget_from(self, iteration: int) -> None:
        """Drop what was recorded for ``iteration`` and later: Keras prefetched those batches but never trained them."""
        kept = [batch for batch in self.served if batch.iteration < iteration]
        if len(kept) < len(self.served):
            self.served.clear()
            self.served.extend(kept)
        self._samples = {k: n for k, n in self._samples.items() if k < iteration}
        self._batches = {k: n for k, n in self._batches.items() if k < iteration}

    def expect_callback(self, keras: str | None) -> None:
        """Note that a callback of ``keras`` ("keras" for Keras 3, or "tf_keras") exists for this source. Until it first
        attaches, unattached batches may be that Keras probing the pipeline before ``on_train_begin``, so the warning
        waits for more of them than its probe reads: Keras 3 under a strategy reads a few through a throwaway
        iterator; tf_keras reads batch 0 of a ``Sequence`` (its shape peek) and nothing of a dataset, so a tf_keras
        callback left out of ``fit`` is warned about in the first epoch (Keras 3's wait had held that back two)."""
        with self._changed:
            probe = 2 * len(self) + _PROBE_BATCHES if keras == "keras" else 1
            self._probe_batches = probe if self._fit == 0 else 0

    def publish(self, assignment: Assignment) -> None:
        """Make the agreed vector of ``assignment.iteration`` available to the batches of that iteration."""
        with self._changed:
            if not self._attached:  # a pipeline built during the fit ended it (see _end_failed_fit)
                raise ConfigError("the source was detached during model.fit: build its pipelines before fit",
                                  job=self.config.job, worker=self.worker)
            self._vectors[assignment.iteration] = assignment.sizes
            for old in [k for k in self._vectors if k < assignment.iteration - _KEEP_ITERATIONS]:
                del self._vectors[old]
                self._samples.pop(old, None)
                self._batches.pop(old, None)
            self._changed.notify_all()

    def samples_in(self, iteration: int) -> int:
        """Samples this worker served for ``iteration``, over all the batches of its execution."""
        with self._changed:
            return self._samples.get(iteration, 0)

    def batches_in(self, iteration: int) -> int:
        """Batches this worker served for ``iteration``: ``steps_per_execution``, or fewer at an epoch's end."""
        with self._changed:
            return self._batches.get(iteration, 0)

    # -- cutting batches --------------------------------------------------------------------------------
    def _agreed(self, iteration: int) -> tuple[int, ...] | None:
        """The vector of ``iteration`` once the callback publishes it; None when no callback is attached."""
        if os.getpid() != self._owner_pid:
            raise ConfigError("BalancedSource cannot run in a separate process (use_multiprocessing=True): the "
                              "size of each batch is agreed after the previous step, in the training process; "
                              "use worker threads instead", job=self.config.job, worker=self.worker,
                              iteration=iteration)
        deadline = time.monotonic() + self.wait_timeout_s
        with self._changed:
            while iteration not in self._vectors and self._attached:
                if self._running is not None and not self._running():
                    # fit raised, so Keras skipped on_train_end: a prefetch (tf.data's, in a py_dataset() of one
                    # worker thread) kept waiting here, and destroying fit's iterator waited for it (wait_timeout_s)
                    self._end_failed_fit()
                    break
                left = deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(min(left, _RUNNING_CHECK_S))
                    continue
                raise LBBSPError(f"no agreed vector after {self.wait_timeout_s:g}s: is LBBSPCallback in "
                                 "model.fit's callbacks, and fit(shuffle=False) for a PyDataset (batch k must be "
                                 "step k; the source shuffles by itself)? Or the callback is still waiting for "
                                 "Redis (its warnings say so): then WorkerSession(outage_s=...) ends the wait",
                                 job=self.config.job, worker=self.worker, iteration=iteration)
            return self._vectors.get(iteration) if self._attached else None

    def _batch(self, epoch: int, step: int, pipeline: int, record: bool = True) -> tuple[Arrays, ...]:
        """This worker's ``(x, y)``, or ``(x, y, weights)`` if weighted, at ``step`` of this fit's ``epoch``; recorded
        in ``served`` and the samples to report unless ``record`` is False (a batch served before)."""
        iteration = self.iteration_of(epoch, step)
        sizes = self._agreed(iteration)
        if sizes is None:  # a shape probe, training without the callback, or a prefetch past the end of fit
            self._count_unattached(pipeline)
            return self._cut(self._first_epoch + epoch, step, self.config.initial_sizes())
        batch = self._cut(self._first_epoch + epoch, step, sizes)
        samples = len(_named_leaves(batch[0])[0][1])
        with self._changed:
            if self._attached and record:  # not attached: fit ended while this prefetch was cut, it is never trained
                self.served.append(ServedBatch(iteration, self._first_epoch + epoch, step, samples, sizes))
                self._samples[iteration] = self._samples.get(iteration, 0) + samples
                self._batches[iteration] = self._batches.get(iteration, 0) + 1
        return batch

    def _count_unattached(self, pipeline: int) -> None:
        """Warn once when a pipeline that no fit with the callback read serves a whole epoch: it trains without
        the callback, or evaluates on the source (the batches a fit's pipeline serves after it are prefetches)."""
        with self._changed:
            if pipeline in self._trained or self._warned_unattached:
                return
            self._unattached[pipeline] = self._unattached.get(pipeline, 0) + 1
            # a whole epoch, and more than the batches that the Keras of a callback made for the source (and not
            # attached yet) may read to probe the pipeline: a fit that callback was left out of
            if self._unattached[pipeline] <= max(len(self) - 1, self._probe_batches):
                return
            self._warned_unattached = True
        warnings.warn("BalancedSource served a whole epoch with no LBBSPCallback attached: every batch had the equal "
                      "split and nothing was reported. Pass LBBSPCallback(client, source) to model.fit; the source "
                      "serves training batches only (it repeats forever), so validate and evaluate with arrays",
                      stacklevel=3)

    def _misuse(self, message: str) -> ConfigError:
        """The error for a misused pipeline; detaches first, so that prefetches blocked in this fit return."""
        self._attached = False
        self._changed.notify_all()
        return ConfigError(message, job=self.config.job, worker=self.worker)

    def _claim(self, pipeline: int) -> None:
        """Refuse a second pipeline read during a ``fit``: its batches would take the training batches' turns."""
        if self._attached and self._reader not in (None, pipeline):
            raise self._misuse("a second pipeline of this source is being read during model.fit (validation_data="
                               "source.tf_dataset() or source.py_dataset()?): the source serves the training "
                               "batches only; validate with arrays, validation_data=(x_val, y_val)")
        if self._attached:
            self._reader = pipeline
            self._trained.add(pipeline)

    def _end_failed_fit(self) -> None:
        """A pipeline built while a fit is attached means that fit raised (Keras then skips ``on_train_end``): stop
        serving it, so that its waiting prefetches return and the next fit's shape probe gets the equal split."""
        with self._changed:
            if self._attached:
                self._attached = False
                self._changed.notify_all()

    def _sampler_for(self, epoch: int) -> GlobalBatchSampler:
        """A sampler per epoch, so that threads cutting two epochs at once never share a permutation."""
        with self._changed:
            sampler = self._samplers.get(epoch)
            if sampler is None:
                sampler = GlobalBatchSampler(self.sampler.dataset_size, self.config.global_batch, seed=self.sampler.seed,
                                             shuffle=self.sampler.shuffle, drop_last=self.sampler.drop_last)
                sampler.set_epoch(epoch)
                self._samplers = {e: s for e, s in self._samplers.items() if e >= epoch - 1} | {epoch: sampler}
            return sampler

    def _cut(self, epoch: int, step: int, sizes: tuple[int, ...]) -> tuple[Arrays, ...]:
        sampler = self._sampler_for(epoch)
        split = sampler.split_for(step, sizes)
        indices = sampler.worker_indices(step, sizes, self.worker)
        x, y = _take(self.x, indices), _take(self.y, indices)
        if not self.weighted:
            return x, y
        weight = self.sample_weight(split)
        weights = np.full(len(indices), weight, dtype=self.weight_dtype)
        if self.sample_weights is not None:
            weights = (weights * self.sample_weights[indices]).astype(self.weight_dtype)
        return x, y, weights

    def sample_weight(self, split: tuple[int, ...]) -> float:
        """The weight W * b_i / B that makes the summed per-worker mean losses the global mean.

        Keras averages each worker's loss over its own b_i samples and divides by the W replicas; the
        strategy then sums the gradients. Weighting every local sample by W * b_i / B turns that sum
        into (1 / B) * sum of all B per-sample gradients, exactly the single-process gradient.
        """
        return self.config.num_workers * split[self.worker] / sum(split)

    def _epoch_batches(self, pipeline: int) -> Iterator[tuple[Arrays, ...]]:
        """One epoch of ``pipeline``'s batches; ``repeat`` starts the next pass once this one has ended."""
        with self._changed:
            self._claim(pipeline)
            if self._attached and self._reading:
                raise self._misuse("two passes over this source's tf_dataset are being read at once (the training "
                                   "dataset also passed as validation_data?): the source serves the training "
                                   "batches only; validate with arrays")
            fit, counted = self._fit, self._attached
            self._reading += counted
            epoch = self._generator_epochs
            self._generator_epochs += 1
        try:
            for step in range(self._start_step if counted and epoch == 0 else 0, len(self)):
                if self._abandoned == fit or _EXITING.is_set():
                    return
                with _generator_step():
                    batch = self._batch(epoch, step, pipeline)
                yield batch
        finally:
            with self._changed:
                if counted and fit == self._fit:
                    self._reading -= 1

    def _indexed_batch(self, pipeline: int, index: int, sequence: bool) -> tuple[Arrays, ...]:
        """Batch ``index`` of its epoch: for Keras 3's PyDataset, the epoch after those that asked for it before; for
        tf_keras's ``sequence``, the epoch fit is in (see :meth:`_end_sequence_epoch`), recorded once."""
        if sequence and self._left_over(pipeline):  # what it reads is thrown away with it
            return self._cut(self._first_epoch + self._sequence_epochs, index, self.config.initial_sizes())
        with self._changed:
            self._claim(pipeline)
            asked = self._index_calls.get(index, 0)
            epoch = self._sequence_epochs if sequence else asked
            if self._attached:
                self._index_calls[index] = max(asked, epoch + 1)
                prefix = self._prefix.get(epoch, 0)
                while self._index_calls.get(prefix, 0) > epoch:
                    prefix += 1
                self._prefix = {e: p for e, p in self._prefix.items() if e >= epoch - 1} | {epoch: prefix}
                self._changed.notify_all()
                if not self._changed.wait_for(lambda: self._prefix.get(epoch, 0) >= index or not self._attached,
                                              _ORDER_GRACE_S):
                    raise self._misuse(f"Keras asked for batch {index} of an epoch before batch "
                                       f"{self._prefix.get(epoch, 0)}: call model.fit(..., shuffle=False) (fit "
                                       "shuffles a PyDataset or Sequence by default; the source shuffles samples "
                                       "itself)")
        return self._batch(epoch, index, pipeline, record=asked <= epoch)

    def _left_over(self, pipeline: int) -> bool:
        """Whether ``pipeline``, a tf_keras Sequence that an earlier fit read, is read by that fit's enqueuer
        (``fit(workers=2)``) during this one: tf_keras stops an epoch's enqueuer at the epoch's end, so one whose fit a
        callback stopped mid-epoch reads on. It had taken the reader's turn, and the fit's own pipeline was refused."""
        with self._changed:
            return (self._attached and pipeline != self._reader and pipeline != self._newest
                    and pipeline in self._trained)

    def _end_sequence_epoch(self) -> None:
        """tf_keras ends each epoch of a Sequence here, from fit's thread, after it stopped that epoch's reader; a new
        reader reads the next epoch. Its enqueuer (``fit(workers=2)``) also calls this, from its own thread, once it has
        read a pass, and then reads a second pass while the epoch ends, which fit throws away. Counted per index, those
        reads had taken the next epoch's turn, and the next epoch's reads waited for a vector that never came (fit
        failed after ``wait_timeout_s``, 120 s by default)."""
        with self._changed:
            if self._attached and threading.get_ident() == self._fit_thread:
                self._sequence_epochs += 1

    # -- the two Keras pipelines ------------------------------------------------------------------------
    def tf_dataset(self, strategy: Any = None) -> Any:
        """A ``tf.data.Dataset`` of this worker's batches (batch dimension None: no retracing per size).

        It repeats, one epoch per pass, so pass ``steps_per_epoch=len(source)`` to ``fit``. Under a multi-worker
        ``strategy`` (tf_keras only), pass it: the dataset then comes from
        ``strategy.distribute_datasets_from_function``, since ``experimental_distribute_dataset`` would treat
        each batch as a global one and rebatch it across the replicas.
        """
        import tensorflow as tf  # noqa: PLC0415  (the framework stays at the edge)

        def spec(array: np.ndarray) -> Any:
            return tf.TensorSpec((None,) + array.shape[1:], tf.as_dtype(array.dtype))

        if strategy is not None and not isinstance(getattr(strategy, "num_replicas_in_sync", None), int):
            raise ConfigError(f"strategy must be None or the tf.distribute strategy the model is built under, got "
                              f"{strategy!r:.60}", job=self.config.job)
        replicas = 1 if strategy is None else strategy.num_replicas_in_sync
        if replicas > 1:
            self._check_distributed(strategy)
        _release_at_exit()
        self._end_failed_fit()
        signature = (_map(spec, self.x), _map(spec, self.y)) + ((tf.TensorSpec((None,), tf.as_dtype(self.weight_dtype)),)
                                                    if self.weighted else ())
        self._newest = next(self._pipelines)
        dataset = tf.data.Dataset.from_generator(functools.partial(self._epoch_batches, self._newest),
                                                 output_signature=signature)
        # a pass is an epoch, and the first of a fit resumed mid-epoch is shorter (resume_at)
        dataset = dataset.repeat().apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        # No prefetch thread of tf.data's own: after a fit that raised, it would sit in the generator waiting for a
        # vector, and the iterator's destructor (run by the GC, holding the GIL) would wait for it forever. Batch k
        # cannot be cut before step k - 1 ends anyway.
        options.experimental_optimization.inject_prefetch = False
        dataset = dataset.with_options(options)
        self._pipeline_replicas = replicas
        self.latest_pipeline = "tf_dataset"
        if replicas > 1:
            dataset = strategy.distribute_datasets_from_function(lambda context: dataset)
        return self._refuse_class_weight(dataset)

    def _refuse_class_weight(self, dataset: Any) -> Any:
        """``dataset``, made to refuse ``fit(class_weight=...)`` as ``fit`` starts, with a ConfigError that says what
        to do. Keras applies class weights by mapping a function of its own over the dataset: Keras 3's refuses the
        weights the batches carry, tf_keras's fails on their unknown batch size, a multi-worker dataset has no
        ``map`` at all, and Keras 3 adds a prefetch after it, whose thread, waiting in the source after a ``fit``
        that raised, hung the process (2 exits of 4). Every other ``map`` call goes through."""
        original = getattr(dataset, "map", None)
        job = self.config.job

        def refusing_map(function: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(function, "__name__", None) in _CLASS_WEIGHT_MAPS:
                raise ConfigError("model.fit(class_weight=...) does not work with source.tf_dataset(): Keras would "
                                  "replace or refuse the weights that the source gives every sample (W * b_i / B, "
                                  "which keeps uneven batches exact). Pass the class weights to the source instead: "
                                  "BalancedSource(x, y, ..., class_weight={...}) weights each sample as "
                                  "fit(class_weight=...) would", job=job)
            if original is None:
                raise AttributeError(f"{type(dataset).__name__!r} object has no attribute 'map'")
            return original(function, *args, **kwargs)

        dataset.map = refusing_map
        return dataset

    def _check_distributed(self, strategy: Any) -> None:
        """A multi-replica strategy must be tf_keras's MultiWorkerMirroredStrategy, one replica per worker."""
        require_tf_keras(self.config.job)
        if getattr(strategy.extended, "_num_workers", 1) != strategy.num_replicas_in_sync:
            raise ConfigError("one replica per worker is supported (one device per worker process)",
                              job=self.config.job)

    def py_dataset(self, keras: ModuleType | None = None, **kwargs: Any) -> Any:
        """A ``keras.utils.PyDataset`` (Keras 3) or ``Sequence`` (tf_keras) of this worker's batches.

        ``kwargs`` go to ``PyDataset`` (``workers``, ``max_queue_size``); worker threads are fine, worker
        processes are refused, since sizes are agreed in the training process. Call ``fit`` with
        ``shuffle=False``: Keras would otherwise reorder the batches, and batch k must be trained at step k
        (the source already shuffles samples with its seeded permutation). It is built for ``keras``, by
        default the Keras that ``tf.keras`` means here (:func:`~lbbsp.integrations.keras.keras_module`).
        """
        if kwargs.get("use_multiprocessing"):
            raise ConfigError("use_multiprocessing=True is not supported: the agreed size of each batch is only "
                              "known in the training process; use workers=N threads", job=self.config.job)

        keras = keras or keras_module()
        if not hasattr(getattr(keras, "utils", None), "Sequence"):
            raise ConfigError(f"keras must be None or a Keras module (keras or tf_keras), got {keras!r:.60}",
                              job=self.config.job)
        _release_at_exit()
        self._end_failed_fit()
        has_py_dataset = hasattr(keras.utils, "PyDataset")  # Keras 3; tf_keras has only Sequence
        base = keras.utils.PyDataset if has_py_dataset else keras.utils.Sequence
        source = self
        pipeline = self._newest = next(self._pipelines)
        self._pipeline_replicas = 1
        self.latest_pipeline = "py_dataset"

        class BalancedPyDataset(base):  # type: ignore[misc, valid-type]
            """Index k of an epoch is global batch k, cut at the size agreed for its iteration."""

            def __init__(self) -> None:
                if has_py_dataset:
                    super().__init__(**kwargs)
                elif kwargs:  # tf_keras: workers are model.fit arguments
                    raise ConfigError(f"tf_keras takes {sorted(kwargs)} as model.fit arguments, not here",
                                      job=source.config.job)

            def __len__(self) -> int:
                return len(source)

            def __getitem__(self, index: int) -> tuple[Arrays, ...]:
                return source._indexed_batch(pipeline, index, sequence=not has_py_dataset)

            if not has_py_dataset:
                def on_epoch_end(self) -> None:
                    source._end_sequence_epoch()

        return BalancedPyDataset()


def _sample_weights(sample_weight: Any, samples: int, job: str) -> np.ndarray | None:
    """``sample_weight`` as one finite, non-negative float per sample, or None; a ConfigError otherwise."""
    if sample_weight is None:
        return None
    weights = np.asarray(sample_weight)
    if weights.shape != (samples,):  # Keras would read (n, t) as per-timestep weights
        raise ConfigError(f"sample_weight must hold one weight per sample, shape ({samples},), got shape "
                          f"{weights.shape}", job=job)
    if not (np.issubdtype(weights.dtype, np.number) or weights.dtype == bool):
        raise ConfigError(f"sample_weight must be numeric, got dtype {weights.dtype}", job=job)
    weights = weights.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(weights) | (weights < 0))
    if len(bad):  # NaN trains to a NaN loss, silently; a negative weight turns a sample's loss into a gain
        raise ConfigError(f"sample_weight must be finite and >= 0: {len(bad)} are not, the first at index {bad[0]} "
                          f"({weights[bad[0]]})", job=job)
    return weights


def _arrays(value: Any, name: str, job: str) -> Arrays:
    """``value`` as numeric arrays with a sample axis, in its structure (a list becomes a tuple), or a ConfigError
    naming the part that is not one."""
    if value is None:
        raise ConfigError(f"{name} must be an array, or a dict, tuple or list of arrays, got None", job=job)
    if isinstance(value, Mapping):
        if not value or not all(isinstance(key, str) for key in value):
            raise ConfigError(f"{name} as a dict must map input or output names (strings) to arrays, got keys "
                              f"{list(value)!r:.80}", job=job)
        return {key: _array(part, f"{name}[{key!r}]", job) for key, part in value.items()}
    if isinstance(value, (tuple, list)):
        if not value:
            raise ConfigError(f"{name} is an empty {type(value).__name__}: it needs at least one array", job=job)
        if not any(map(_streams, value)) and all(np.ndim(part) == 0 for part in value[:1000]):  # meant as one array
            raise ConfigError(f"{name} is a {type(value).__name__} of {len(value):,} single values; a "
                              f"{type(value).__name__} is read as one array per model input or output: pass "
                              f"np.asarray({name}) for one array of {len(value):,} samples", job=job)
        return tuple(_array(part, f"{name}[{i}]", job) for i, part in enumerate(value))
    return _array(value, name, job)


def _array(value: Any, name: str, job: str) -> np.ndarray:
    if isinstance(value, (Mapping, tuple, list)):
        raise ConfigError(f"{name} must be an array (np.asarray it), got a {type(value).__name__}: a source takes "
                          "one level of dict, tuple or list of arrays", job=job)
    if _streams(value):
        raise ConfigError(f"{name} must be in-memory arrays (numpy or tensors), got a {type(value).__name__}: a "
                          "source splits each global batch by sample index, so it needs the samples themselves; "
                          "load them into arrays (a small tf.data.Dataset: x, y = map(np.stack, zip(*ds.as_numpy_"
                          "iterator()))), or give the pipeline to fit directly, unbalanced", job=job)
    array = np.asarray(value)
    if array.ndim == 0 or array.dtype.kind not in "biuf":
        raise ConfigError(f"{name} must be a numeric array with a sample axis, got shape {array.shape} and dtype "
                          f"{array.dtype}", job=job)
    return array


def _streams(value: Any) -> bool:
    """Whether ``value`` yields its samples rather than holding them: a tf.data.Dataset, an iterator, a generator."""
    return hasattr(value, "element_spec") or hasattr(value, "__next__")


def _named_leaves(value: Arrays) -> list[tuple[str, np.ndarray]]:
    """Each array of ``value`` with its place ('' for a single array, "['a']" or '[0]' for a part)."""
    if isinstance(value, dict):
        return [(f"[{key!r}]", array) for key, array in value.items()]
    if isinstance(value, tuple):
        return [(f"[{i}]", array) for i, array in enumerate(value)]
    return [("", cast(np.ndarray, value))]


def _map(function: Callable[[np.ndarray], Any], value: Arrays) -> Any:
    """``function`` of every array of ``value``, in its structure."""
    if isinstance(value, dict):
        return {key: function(array) for key, array in value.items()}
    if isinstance(value, tuple):
        return tuple(function(array) for array in value)
    return function(cast(np.ndarray, value))


def _take(value: Arrays, indices: np.ndarray) -> Arrays:
    return cast(Arrays, _map(lambda array: array[indices], value))


def _class_weights(class_weight: Mapping[int, float], y: np.ndarray, job: str) -> np.ndarray:
    """One weight per sample from ``class_weight`` and the classes in ``y``, read as Keras reads them: rounded
    labels (booleans too) of shape (n,) or (n, 1), or the argmax of one-hot rows (n, k); a class without a weight
    weighs 1."""
    if not isinstance(class_weight, Mapping):
        raise ConfigError(f"class_weight must be a dict of class id -> weight, got {type(class_weight).__name__}",
                          job=job)
    table: dict[int, float] = {}
    for key, value in class_weight.items():
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or key < 0:
            raise ConfigError(f"class_weight keys must be class ids, integers >= 0, got {key!r}", job=job)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not 0 <= value < math.inf:
            raise ConfigError(f"class_weight[{key}] must be a finite number >= 0, got {value!r}", job=job)
        table[int(key)] = float(value)
    if y.ndim > 2 or not (y.dtype == bool or np.issubdtype(y.dtype, np.number)):
        raise ConfigError(f"class_weight needs one class per sample: y of shape (n,), (n, 1) or one-hot (n, k), "
                          f"got shape {y.shape} and dtype {y.dtype}", job=job)
    if y.dtype == bool:  # False and True are classes 0 and 1, as Keras 3's fit(class_weight=...) reads them
        y = y.astype(np.int64)
    classes = y.argmax(axis=1) if y.ndim == 2 and y.shape[1] > 1 else np.round(y.reshape(len(y))).astype(np.int64)
    if len(classes) and classes.min() < 0:
        raise ConfigError(f"class_weight needs class ids >= 0 in y, found {classes.min()}", job=job)
    present, where = np.unique(classes, return_inverse=True)  # by the classes in y: class ids may be huge
    return np.array([table.get(int(c), 1.0) for c in present])[where.reshape(len(classes))]


@contextlib.contextmanager
def _generator_step() -> Iterator[None]:
    """A step of a tf_dataset's generator under way (for _release_all)."""
    with _generating_lock:
        _generating["inside"] += 1
    try:
        yield
    finally:
        with _generating_lock:
            _generating["inside"] -= 1
            _generating["ended"] = time.monotonic()


def _release_all() -> None:
    """End every source's fit at exit, so that prefetches waiting for a vector return, and end their generators:
    each pass ends, the next is empty, and the repeat ends, so tf.data calls them no more. Then wait (the GIL
    released) until no generator step is under way and none ended in the last 0.1 s (up to 2 s). Under MWMS, a fit that raised (Keras skips
    on_train_end) left the distributed iterator's prefetch waiting in the generator, and destroying the iterator at
    exit waited for it: the process hung after its traceback, and SIGTERM did not end it. With the fits released
    but the generators still served, the prefetch thread could be in a generator call when the interpreter's
    finalisation began, where its Python cannot run again: 3 of 6 exits of the survivor of worker 0 killed hung so."""
    _EXITING.set()
    for source in list(_SOURCES):
        source._end_failed_fit()
    if not any(source.latest_pipeline == "tf_dataset" for source in list(_SOURCES)):
        return
    deadline = time.monotonic() + _EXIT_DRAIN_S
    while time.monotonic() < deadline and (_generating["inside"] or
                                           time.monotonic() - _generating["ended"] < _EXIT_QUIET_S):
        time.sleep(0.02)


@functools.cache
def _release_at_exit() -> None:
    """Register :func:`_release_all` once, when the first pipeline is built: TensorFlow is imported by then, so
    the handler comes after TensorFlow's own and runs before them (exit handlers run last first)."""
    atexit.register(_release_all)
