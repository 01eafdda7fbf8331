"""LB-BSP for Keras ``model.fit``: a callback that reports and agrees, and a data source that resizes.

Works with tf_keras (``TF_USE_LEGACY_KERAS=1``) single- and multi-worker under
``MultiWorkerMirroredStrategy``, and with Keras 3 single-worker. See docs/keras.md.

>>> session = WorkerSession(config, worker=task_index())          # Redis + coordinator on worker 0
>>> source = BalancedSource(x, y, config, worker=session.worker)
>>> model.fit(source.tf_dataset(), epochs=3, steps_per_epoch=len(source), shuffle=False,
...           callbacks=[LBBSPCallback(session.client, source)])
"""
from __future__ import annotations

import functools
import json
import logging
import math
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

import numpy as np

from lbbsp.errors import ConfigError
from lbbsp.telemetry import ResourceMonitor
from lbbsp.worker import WorkerClient

from .keras_data import BalancedSource, ServedBatch
from .keras_session import (
    WorkerSession,
    all_gathered,
    close_sessions,
    keras_module,
    task_index,
    training_tasks,
)

log = logging.getLogger("lbbsp.keras")

__all__ = ["BalancedSource", "BatchStatisticsWarning",
           "LBBSPCallback",  # noqa: F822  (served by the module __getattr__ below)
           "ServedBatch", "WorkerSession", "callback_class", "close_sessions", "keras_module", "task_index",
           "training_tasks"]


class StepProbe:
    """Marks, inside the train step, when local gradients are ready and when their all-reduce returned.

    Installed on a tf_keras optimizer by wrapping its ``aggregate_gradients`` (``_aggregate_gradients`` for a legacy
    one); the callback reads it to time compute without the wait for other workers inside the all-reduce.
    """

    def __init__(self) -> None:
        self.computed: list[float] = []
        self.reduced: list[float] = []
        self.enabled = True  # read when the step is traced: XLA (jit_compile=True) cannot compile a tf.py_function

    def clear(self) -> None:
        self.computed.clear()
        self.reduced.clear()

    def times(self, started: float) -> tuple[float, float] | None:
        """Seconds of local work since ``started``, the all-reduce waits left out, and seconds spent in the
        all-reduces (waiting for the slower workers, and the transfer); None without marks."""
        if not self.computed or len(self.reduced) != len(self.computed):
            return None
        starts = [started] + self.reduced[:-1]
        return (sum(max(end - start, 0.0) for start, end in zip(starts, self.computed)),
                sum(max(done - ready, 0.0) for ready, done in zip(self.computed, self.reduced)))

    def _mark(self, marks: list[float]) -> Any:

        marks.append(time.perf_counter())
        return np.float64(0.0)


def install_probe(optimizer: Any) -> StepProbe | None:
    """Wrap a tf_keras optimizer's ``aggregate_gradients`` with time marks (once); None if it has none. A
    LossScaleOptimizer (``mixed_float16``) aggregates in the optimizer it wraps: the probe goes there. A legacy
    optimizer (``tf_keras.optimizers.legacy``) aggregates in ``_aggregate_gradients``: without the probe there, every
    report counted the all-reduce's wait as compute."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    probe = getattr(optimizer, "_lbbsp_probe", None)
    if probe is not None:
        return probe
    name = "aggregate_gradients" if hasattr(optimizer, "aggregate_gradients") else "_aggregate_gradients"
    original = getattr(optimizer, name, None)
    if original is None:
        return None
    import tensorflow as tf  # noqa: PLC0415

    probe = StepProbe()

    def mark_after(marks: list[float], grads: list[Any]) -> list[Any]:
        with tf.control_dependencies([g for g in grads if g is not None]):
            stamp = tf.py_function(functools.partial(probe._mark, marks), [], tf.float64)
        with tf.control_dependencies([stamp]):
            return [None if g is None else tf.identity(g) for g in grads]

    def aggregate_gradients(grads_and_vars: Any) -> Any:
        if not probe.enabled:
            return original(grads_and_vars)
        grads, variables = zip(*grads_and_vars)
        reduced = original(list(zip(mark_after(probe.computed, list(grads)), variables)))
        reduced_grads, reduced_vars = zip(*reduced)
        return list(zip(mark_after(probe.reduced, list(reduced_grads)), reduced_vars))

    setattr(optimizer, name, aggregate_gradients)
    optimizer._lbbsp_probe = probe
    return probe


def _refuse_summed_losses(loss: Any, job: str) -> None:
    """A ConfigError for a compiled loss that sums its samples: each worker's samples are weighted W * b_i / B,
    which makes the workers' means the global batch's mean, but a sum times those weights is neither the global
    sum nor its mean (8.3 off single-process SGD in an audit, silently)."""
    import tensorflow as tf  # noqa: PLC0415

    summed = [item for item in tf.nest.flatten(loss) if str(getattr(item, "reduction", "")).lower() == "sum"]
    if summed:
        raise ConfigError(f"{type(summed[0]).__name__}(reduction='sum') is not exact with several workers: lbbsp "
                          "weights each worker's samples by its share of the global batch, which turns the workers' "
                          "means into the global batch's mean. Compile with the default reduction (the mean over the "
                          "batch); a sum over the global batch is the mean times its size", job=job)


def _warn_of_an_own_train_step(model_class: Any) -> None:
    """Say once per class that a ``train_step`` of the user's must pass the served sample weights on: the weighting
    rides on them, and a step that drops them trains on the unweighted gradient without an error."""
    import tf_keras  # noqa: PLC0415

    if model_class.train_step is not tf_keras.Model.train_step and model_class not in _WARNED_TRAIN_STEPS:
        _WARNED_TRAIN_STEPS.add(model_class)
        log.warning("%s has a train_step of its own: it must unpack the sample weights the source serves (keras.utils"
                    ".unpack_x_y_sample_weight) and pass them to compiled_loss, or its gradients are not the global "
                    "batch's; lbbsp corrects the logged loss only for the built-in train_step (docs/keras.md)",
                    model_class.__name__)


class BatchStatisticsWarning(UserWarning):
    """A layer computes over each worker's own batch (BatchNormalization not synchronized, an activity regularizer):
    with the workers' batches of different sizes, the update is no longer exactly the global batch's."""


def _warn_of_batch_statistics(model: Any) -> None:
    """Warn once per model of the layers that make uneven batches inexact (an audit: plain BatchNormalization 0.14
    away from one process, an activity regularizer 7e-3, with no word), and of the way out."""
    if model in _WARNED_BATCH_STATISTICS:
        return
    _WARNED_BATCH_STATISTICS.add(model)
    import tf_keras  # noqa: PLC0415

    layers = list(model._flatten_layers(include_self=False, recursive=True))
    norms = [layer.name for layer in layers if isinstance(layer, tf_keras.layers.BatchNormalization)
             and not getattr(layer, "synchronized", False)]
    regularized = [layer.name for layer in layers if getattr(layer, "activity_regularizer", None) is not None]
    if norms or regularized:
        said = [f"BatchNormalization layers normalise each worker's own batch ({', '.join(norms[:3])}): build them "
                "with BatchNormalization(synchronized=True)"] if norms else []
        said += [f"activity regularizers average over each worker's own batch ({', '.join(regularized[:3])}): move "
                 "the penalty into the loss, or accept the difference"] if regularized else []
        warnings.warn(f"{'; '.join(said)}. Computed over each worker's own batch (of a size lbbsp varies), these "
                      "updates are not exactly those of one process on the global batch (docs/keras.md, Layers that "
                      "see each worker's own batch)", BatchStatisticsWarning, stacklevel=2)


_WARNED_BATCH_STATISTICS: weakref.WeakSet[Any] = weakref.WeakSet()
_WARNED_TRAIN_STEPS: weakref.WeakSet[Any] = weakref.WeakSet()
_KERAS_NAMES = {"tf_keras": "tf_keras", "keras": "Keras 3"}


def _keras_of(cls: type) -> str | None:
    """"tf_keras" or "keras" (Keras 3): the package of the nearest Keras class in ``cls``'s bases."""
    for klass in cls.__mro__:
        package = klass.__module__.partition(".")[0]
        if package in ("tf_keras", "keras"):
            return package
    return None


class ExactLogs:
    """Makes tf_keras log the global mean loss of each step when the workers' batches differ in size.

    The source weights worker i's samples by f_i = W * b_i / B, which makes the summed gradient exact. tf_keras
    then averages the workers' losses weighted by b_i, so it would log sum_i b_i * f_i * mean_i / B instead
    of sum_i b_i * mean_i / B; weighted metrics would see f_i times the sample weights. Installed on a
    tf_keras model's ``train_step``, this weights each worker's loss by B / W instead (the weights still sum
    to B, so the epoch mean weights each step by its size, as in one process) and divides f_i out of the
    weights of weighted metrics. B comes from one scalar all-reduce per step, placed after the gradients'
    own: placed before the forward pass, a fast worker would wait in it for a slow one before computing, and
    that wait would count as its compute time. So the loss metrics' updates wait for it too.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._local: Any = None  # this worker's batch size, while the train step is traced
        self._deferred: list[tuple[Any, Any]] = []  # (loss metric's update_state, values) awaiting B
        self._scales: tuple[Any, Any] | None = None  # (B / W, 1 / f_i) once B is known
        self._train_step, self._compute_loss = model.train_step, model.compute_loss
        self._compute_metrics = model.compute_metrics

    @classmethod
    def install(cls, model: Any) -> None:
        """Install on ``model`` (once) and rebuild its train function, which may have been traced without."""
        if getattr(model, "_lbbsp_exact_logs", None) is not None:
            return
        logs = cls(model)
        model.train_step, model.compute_loss, model.compute_metrics = logs.train_step, logs.loss, logs.metrics
        model._lbbsp_exact_logs = logs
        model.train_function = model.make_train_function(force=True)

    def train_step(self, data: Any) -> Any:
        import tensorflow as tf  # noqa: PLC0415
        import tf_keras  # noqa: PLC0415

        _, y, _ = tf_keras.utils.unpack_x_y_sample_weight(data)
        self._local = tf.cast(tf.shape(tf.nest.flatten(y)[0])[0], tf.float64)
        try:
            result = self._train_step(data)
            self._apply_deferred()  # a train step of the user's own that computed no metrics
            return result
        except ValueError as exc:
            if "values to unpack (expected 2)" not in str(exc):
                raise
            # the guide's `x, y = data` on the (x, y, weights) batches: a bare unpacking error from the traced step
            error = ConfigError(f"{type(self.model).__name__}.train_step unpacks its batch as `x, y = data`, but with "
                                "several workers every batch is (x, y, sample_weight): the weights W * b_i / B make the "
                                "uneven batches' gradients the global batch's. Unpack with x, y, sample_weight = "
                                "keras.utils.unpack_x_y_sample_weight(data) and pass sample_weight to compiled_loss "
                                "(docs/keras.md, `model.fit` arguments)")
            error.ag_pass_through = True  # type: ignore[attr-defined]  # AutoGraph would make it a StagingError
            raise error from exc
        finally:
            self._local, self._scales = None, None
            self._deferred.clear()

    def loss(self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None) -> Any:
        container = self.model.compiled_loss  # the latest compile's
        if self._local is None or container is None:
            return self._compute_loss(x, y, y_pred, sample_weight)
        if not container._built:
            container.build(y_pred)  # creates the loss metrics, so that their updates can be held back below
        originals = [(metric, metric.update_state) for metric in container.metrics]
        for metric, update in originals:
            metric.update_state = functools.partial(self._defer, update)
        try:
            return self._compute_loss(x, y, y_pred, sample_weight)
        finally:
            for metric, update in originals:
                metric.update_state = update

    def metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
        if self._local is not None:
            self._apply_deferred()
            if sample_weight is not None:
                import tensorflow as tf  # noqa: PLC0415

                sample_weight = sample_weight * tf.cast(self._known_scales()[1], sample_weight.dtype)
        return self._compute_metrics(x, y, y_pred, sample_weight)

    def _defer(self, update: Any, values: Any, sample_weight: Any = None) -> None:
        self._deferred.append((update, values))

    def _apply_deferred(self) -> None:
        """The held-back loss metric updates, each weighted B / W."""
        if self._deferred:
            share = self._known_scales()[0]
            for update, values in self._deferred:
                update(values, sample_weight=share)
            self._deferred.clear()

    def _known_scales(self) -> tuple[Any, Any]:
        """(B / W, 1 / f_i), from the all-reduce of the batch sizes (traced once per step, where first asked:
        after the optimizer step, so that the collectives' order puts it after the gradients' all-reduce)."""
        if self._scales is None:
            import tensorflow as tf  # noqa: PLC0415

            total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, self._local)
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            self._scales = (total / replicas, tf.math.divide_no_nan(total, replicas * self._local))
        return self._scales


#: Per WorkerClient, the iteration its next step runs: a new callback on the same client (a second ``fit`` that
#: builds its callback inline) carries on from there, where starting at 0 replayed decided vectors and every
#: report of the second fit was refused as a duplicate.
_NEXT_ITERATION: weakref.WeakKeyDictionary[WorkerClient, int] = weakref.WeakKeyDictionary()


class _CallbackLogic:
    """The LB-BSP callback, independent of which Keras provides the ``Callback`` base class."""

    # set by the Keras Callback base class this logic is mixed into
    model: Any
    params: dict[str, Any]

    def __init__(self, client: WorkerClient, source: BalancedSource, *, monitor: ResourceMonitor | None = None) -> None:
        super().__init__()
        if client is None:
            raise ConfigError("LBBSPCallback got no client: the session is closed (session.client is None after "
                              "close() or the end of its `with` block); build the callback while it is open")
        if not isinstance(client, WorkerClient) or not isinstance(source, BalancedSource):
            raise ConfigError(f"LBBSPCallback takes (client, source): a WorkerClient and a BalancedSource, got "
                              f"({type(client).__name__}, {type(source).__name__})")
        if client.worker != source.worker or client.config.job != source.config.job:
            raise ConfigError("the client and the source belong to different workers or jobs", job=client.config.job)
        if monitor is not None and not callable(getattr(monitor, "sample", None)):
            raise ConfigError(f"monitor must be None or a ResourceMonitor, got {monitor!r:.60}", job=client.config.job)
        self.client = client
        self.source = source
        source.expect_callback(_keras_of(type(self)))
        self.monitor = monitor if monitor is not None else ResourceMonitor()
        self.iteration = _NEXT_ITERATION.get(client, 0)  # the job's count goes on across callbacks
        self.epochs_done = source.epochs_trained  # and the source's shuffle order
        self.probe: StepProbe | None = None
        self._started = 0.0
        self._warned_unread = False
        self._epoch = 0
        self._in_step = False  # between on_train_batch_begin and its end: a second begin means listed twice
        self._first_epoch_begun = False  # this fit's: a Keras 3 fit that BackupAndRestore resumed starts later
        self._restore_offset = 0  # a resumed fit's order of Keras epoch e is e + this (on_train_begin)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A new callback of the same worker, as ``LBBSPCallback(session.client, source)`` builds it: the client and
        the source are shared, not copied (a copy of either would be a second worker of the job, and neither copies).
        KerasTuner deep-copies the callbacks of each trial; the copy's fit carries on where the latest fit left the job.
        """
        return type(self)(self.client, self.source, monitor=self.monitor)

    def __copy__(self) -> Any:
        return self.__deepcopy__({})

    def __reduce_ex__(self, protocol: object) -> Any:
        raise ConfigError("LBBSPCallback cannot be pickled: it holds this worker's live client of the job (its Redis "
                          "connection); build one in each process with LBBSPCallback(session.client, source)",
                          job=self.client.config.job)

    def set_model(self, model: Any) -> None:
        """Refuse a model of the other Keras (tf_keras vs Keras 3), or Keras 3 on a backend other than TensorFlow's,
        which fail later with obscure errors."""
        mine, theirs = _keras_of(type(self)), _keras_of(type(model))
        job = self.client.config.job
        if theirs is not None and theirs != mine:
            fix = ("set TF_USE_LEGACY_KERAS=1 before importing TensorFlow, or use callback_class(tf_keras)"
                   if theirs == "tf_keras" else
                   "`import keras` is Keras 3 even under TF_USE_LEGACY_KERAS=1. To go multi-worker, build the model "
                   "with tf.keras (or import tf_keras as keras); to train Keras 3 on one worker, unset "
                   "TF_USE_LEGACY_KERAS (or use callback_class(keras))")
            raise ConfigError(f"the model is a {_KERAS_NAMES[theirs]} model but LBBSPCallback was built on "
                              f"{_KERAS_NAMES[str(mine)]}'s Callback: {fix}", job=job)
        if mine == "keras":
            import keras  # noqa: PLC0415

            backend = keras.backend.backend()
            if backend != "tensorflow":  # the source's pipelines and the strategy are TensorFlow's
                raise ConfigError(f"the model is Keras 3 on the {backend} backend, but lbbsp's Keras integration "
                                  "runs on TensorFlow's: set KERAS_BACKEND=tensorflow (or unset it) before importing "
                                  "Keras", job=job)
        super().set_model(model)  # type: ignore[misc]

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Check the fit against the job (workers, steps per epoch and per execution), carry on from where the
        latest fit left the job, and publish the first iteration's vector to the source."""
        self._in_step = False  # a fit that failed inside a step left it set
        self._check_schedule()
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        job = self.client.config.job
        if replicas != self.client.config.num_workers:
            raise ConfigError(f"JobConfig.num_workers is {self.client.config.num_workers} but the model's strategy "
                              f"trains on {replicas} worker(s): set num_workers to the number of workers in "
                              "TF_CONFIG, and build the model under MultiWorkerMirroredStrategy().scope()", job=job)
        # where the latest fit left the job and the source, also one that ran after this callback was made (callback
        # lists built up front had replayed iteration 0 and epoch 0's order, and every report was refused)
        self.iteration = _NEXT_ITERATION.get(self.client, self.iteration)
        self.epochs_done = self.source.epochs_trained
        if replicas > 1:  # on every worker, before anything of the fit that one worker alone may refuse
            _check_sources_agree(self.model.distribute_strategy, self.source, self.epochs_done)
        self.source.attach(self.iteration, self.epochs_done, replicas, running=_fit_running())
        if _keras_of(type(self)) == "tf_keras":
            jit = bool(self.model.jit_compile)
            if jit and replicas > 1:
                raise ConfigError("compile(jit_compile=True) cannot time compute without the all-reduce wait (XLA "
                                  "cannot compile the time marks) under a multi-worker strategy: compile with "
                                  "jit_compile=False", job=job)
            self.probe = install_probe(self.model.optimizer)
            if self.probe is not None:
                self.probe.enabled = not jit  # with one worker, the wall time has no barrier in it
            if replicas > 1:
                _refuse_summed_losses(self.model.loss, job)
                _warn_of_an_own_train_step(type(self.model))
                _warn_of_batch_statistics(self.model)
                ExactLogs.install(self.model)
            _time_from_the_train_function(self.model, self._train_function_called)  # the one ExactLogs rebuilt
            _hear_of_a_restore(self.model, self._restored)
        self._first_epoch_begun = False
        # the source's order of Keras epoch e is e + offset: this fit's from the epochs trained and its initial_epoch,
        # unless Keras resumes a stopped fit, whose offset the source keeps where it trained that fit (a retry in the
        # same process; a new process's source starts as the stopped one did)
        fresh = self.epochs_done - _fit_argument("initial_epoch", 0)
        self._restore_offset = self.source.keras_epoch_offset if self.source.keras_epoch_offset is not None else fresh
        self.source.keras_epoch_offset = fresh
        self.source.publish(self.client.assignment(self.iteration))

    def _restored(self, steps: int, initial_epoch: int, epoch: int, step: int) -> tuple[int, int]:
        """The epoch and step tf_keras's fit resumes at, from those its ``BackupAndRestore`` restored: with
        ``steps_per_execution`` N > 1 it saves the first step of the execution it backs up and resumes one after it,
        so N - 1 steps already trained would run again; they are skipped. The source starts there."""
        per_execution = self.source.steps_per_execution
        if step and per_execution > 1:
            step += per_execution - 1
            if step >= steps:
                epoch, step = epoch + 1, 0
        if (epoch, step) != (initial_epoch, 0):
            self._resume(epoch, step)
        return epoch, step

    def _resume(self, epoch: int, step: int) -> None:
        """Keras resumes a run that ``BackupAndRestore`` saved at ``step`` of ``epoch``: the source starts there, in
        the order the stopped fit used for that epoch (a new process's source had replayed epoch 0's order, and a fit
        resumed mid-epoch had trained that epoch's first steps again and never its last)."""
        order = epoch + self._restore_offset
        if order < 0:
            raise ConfigError(f"Keras resumes this fit at epoch {epoch} (BackupAndRestore), which the source's count "
                              f"puts before its first epoch ({self._restore_offset:+d}): give fit the stopped fit's "
                              "initial_epoch, or set source.epochs_trained to the epochs the stopped run's source had "
                              "trained before its fit, plus this fit's initial_epoch less the stopped one's",
                              job=self.client.config.job)
        log.info("LBBSPCallback: Keras resumes this fit at epoch %d, step %d (BackupAndRestore): the source at its "
                 "order %d", epoch, step, order)
        self.epochs_done = order
        self.source.keras_epoch_offset = self._restore_offset
        self.source.resume_at(order, step)

    def _check_schedule(self) -> None:
        job = self.source.config.job
        # tf_keras marks "auto" (its steps_per_execution is then a tf.Variable it retunes); Keras 3 keeps the string
        if getattr(self.model, "autotune_steps_per_execution", False) or isinstance(self.model.steps_per_execution, str):
            raise ConfigError("model.compile(steps_per_execution='auto') changes how many steps one execution runs "
                              "while it trains (tf_keras retunes it every 50 s or so), but each LB-BSP iteration is "
                              "one execution of the steps the source was built for: compile with a whole number, "
                              "and build BalancedSource with the same steps_per_execution (tf_keras goes on retuning "
                              "a model compiled once with 'auto', even compiled again: set "
                              "model.autotune_steps_per_execution = False)", job=job)
        self._undo_a_cut_execution()
        per_execution = getattr(self.model, "_steps_per_execution", None)  # tf_keras: a tf.Variable
        per_execution = int(per_execution.numpy()) if per_execution is not None else int(self.model.steps_per_execution)
        if per_execution != self.source.steps_per_execution:
            raise ConfigError(f"model.compile(steps_per_execution={per_execution}) but the source was built with "
                              f"steps_per_execution={self.source.steps_per_execution}: build it with BalancedSource("
                              f"..., steps_per_execution={per_execution}), or compile with "
                              f"steps_per_execution={self.source.steps_per_execution}", job=job)
        steps = self.params.get("steps")
        if steps is None:
            raise ConfigError("model.fit does not know how many steps an epoch has (the source repeats forever): "
                              "pass steps_per_epoch=len(source)", job=job)
        if steps != len(self.source):
            raise ConfigError(f"model.fit runs {steps} steps per epoch but the source has {len(self.source)}: "
                              "pass the source's pipeline, source.tf_dataset(strategy) or source.py_dataset(), to "
                              "fit, with steps_per_epoch=len(source)", job=job)
        if steps % per_execution and _keras_of(type(self)) == "keras" and self.source.latest_pipeline == "tf_dataset":
            raise ConfigError(f"Keras 3 runs all {per_execution} steps of an execution from a tf.data dataset, so the "
                              f"last execution of an epoch of {steps} steps would read into the next epoch: use a "
                              f"steps_per_execution that divides {steps} (in compile and BalancedSource), or "
                              "source.py_dataset()", job=job)

    def _undo_a_cut_execution(self) -> None:
        """tf_keras cuts an epoch's last execution to the steps left (5 steps in executions of 3: the last runs 2) by
        setting the model's steps_per_execution variable, and sets it back once that execution ends: a fit stopped
        within it (an error, Ctrl-C, a preemption that BackupAndRestore resumes in the same process) leaves the model
        at the cut, every later fit's executions that short, and the source's 3-step iterations had refused the fit
        again for good, with "model.compile(steps_per_execution=2)". Such a value is set back to the source's."""
        variable = getattr(self.model, "_steps_per_execution", None)  # tf_keras only
        steps, wanted = self.params.get("steps"), self.source.steps_per_execution
        if variable is None or not steps or not steps % wanted or int(variable.numpy()) != steps % wanted:
            return
        variable.assign(wanted)
        log.warning("the model's steps_per_execution was %d, the length of an epoch's last execution of %d steps in "
                    "executions of %d, as a fit stopped within that execution leaves it: set back to %d, the source's",
                    steps % wanted, steps, wanted, wanted)

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        """Start timing this execution's compute (tf_keras: again as its train function is called, after every
        callback's on_train_batch_begin)."""
        if self._in_step:  # Keras calls each listed callback in turn: this one twice before either end
            raise ConfigError("this LBBSPCallback is listed more than once in model.fit(callbacks=...): list it once "
                              "(each listing would count and report every step again)", job=self.client.config.job)
        self._in_step = True
        if self.probe is not None:
            self.probe.clear()
        self._started = time.perf_counter()

    def _train_function_called(self) -> None:
        if self._in_step:
            self._started = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Report this execution's compute time, then fetch and publish the vector of the next one. If that fails
        (Redis unusable past ``outage_s``), the source stops serving this fit before the error leaves ``fit``."""
        try:
            self._end_step(batch)
        except BaseException:
            # a prefetch waiting for the next vector returns now, while the interpreter is whole: under MWMS it had
            # waited past fit's StoreUnavailable, and destroying the iterator at exit hung the process
            self.source.abandon(self.iteration)
            raise

    def _end_step(self, batch: int) -> None:
        self._in_step = False
        wall_s = time.perf_counter() - self._started
        probed = self.probe.times(self._started) if self.probe is not None else None
        compute_s = max(probed[0] if probed is not None else wall_s, 1e-9)
        wait_s = probed[1] if probed is not None else max(wall_s - compute_s, 0.0)
        served = self.source.batches_in(self.iteration)
        if not served and not self._warned_unread:  # fit reads arrays or a pipeline of its own: nothing is balanced
            self._warned_unread = True
            log.warning("LBBSPCallback is attached, but model.fit did not read the source's batches of iteration %d: "
                        "pass source.tf_dataset(strategy) or source.py_dataset() to fit, or nothing is balanced and "
                        "the reports count no samples (said once)", self.iteration)
        samples, batches = self.source.samples_in(self.iteration), max(served, 1)
        # One batch's worth: its mean size and a 1/batches share of the time. The throughput is the execution's,
        # a batch-time curve sees the batch size it is asked about, and the samples stay within the size the
        # coordinator assigned (the whole execution's were refused as more than assigned, every report).
        per_batch = math.ceil(samples / batches)
        scale = per_batch / samples if samples else 1.0 / batches
        self.client.report(self.iteration, per_batch, max(compute_s * scale, 1e-9),
                           wait_s=wait_s * scale, features=self.monitor.sample())
        self.iteration += 1
        _NEXT_ITERATION[self.client] = self.iteration
        if not (self._epoch == self.params.get("epochs", 0) - 1 and batch >= len(self.source) - 1):
            self.source.publish(self.client.assignment(self.iteration))  # the next fit fetches it otherwise

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Note the epoch: the last step of the fit's last epoch fetches no next vector (the next fit does). Keras 3
        resumes a ``BackupAndRestore`` run at the first step of the epoch it sets as ``model._initial_epoch``, and
        reads no batch of this fit before its first epoch begins."""
        if not self._first_epoch_begun and _keras_of(type(self)) == "keras" and epoch and \
                getattr(self.model, "_initial_epoch", None) == epoch:
            self._resume(epoch, 0)
        self._first_epoch_begun = True
        self._epoch = epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Count the epoch trained, for the source's permutation of the next one."""
        self.epochs_done += 1
        self.source.epochs_trained = self.epochs_done

    def on_train_end(self, logs: dict | None = None) -> None:
        """Put the source back on the equal split and send the reports still queued."""
        _time_from_the_train_function(self.model, None)
        _hear_of_a_restore(self.model, None)
        if getattr(self.model, "_initial_epoch", None) is not None:  # Keras 3 keeps the epoch BackupAndRestore
            self.model._initial_epoch = None  # restored, and starts every later fit there, serving those epochs again
        self.source.detach(self.iteration)
        self.client.flush()


def _check_sources_agree(strategy: Any, source: BalancedSource, epoch: int) -> None:
    """A ConfigError on every worker unless all workers' sources split the same ``epoch``: one dataset size, shuffle,
    drop_last and seed (the epoch order's fingerprint). A seed per worker had trained on some samples twice and on
    others never, without an error; another dataset size had failed fit in TensorFlow's all-reduce (a shape
    mismatch of a collective instance) once one worker ran out of batches."""
    ours = source.sampler
    order = source._sampler_for(epoch)  # the epoch's sampler the source cuts with, its permutation drawn once
    mine = {"dataset size": ours.dataset_size, "shuffle": ours.shuffle, "drop_last": ours.drop_last,
            "epoch": epoch, "seed (the epoch order's fingerprint)": order.fingerprint()}
    gathered = all_gathered(strategy, 1, source.config.num_workers, source.worker, json.dumps(mine))
    every = [json.loads(str(theirs)) for theirs in gathered]
    for name in mine:
        values = [theirs[name] for theirs in every]
        if any(value != values[0] for value in values):
            raise ConfigError(f"the workers' sources differ in {name} ({values}, by worker): every worker must build "
                              "BalancedSource from the whole dataset (not a shard: the source splits it) with the same "
                              "seed, shuffle and drop_last, and train as many epochs before this fit",
                              job=source.config.job, worker=source.worker)


def _time_from_the_train_function(model: Any, called: Callable[[], None] | None) -> None:
    """Have tf_keras's ``fit`` tell ``called`` as it calls the model's train function for a step, after every
    callback's ``on_train_batch_begin``; None undoes it. Started in this callback's own hook instead, the compute
    counted the hooks of the callbacks listed after it and not those before: a worker slowed by a callback of its
    own was balanced or not by where the callback was listed."""
    function = getattr(model, "train_function", None)
    inner = function.inner if isinstance(function, _TimedTrainFunction) else function  # a fit that raised skips
    if called is None or inner is None:  # on_train_end: the next wraps the same function
        if inner is not function:
            model.train_function = inner
        return
    model.train_function = _TimedTrainFunction(inner, called)


class _TimedTrainFunction:
    """A model's train function that tells ``called`` (a callback's method) as it is called; anything else read of it
    is the function's (a script's ``model.train_function.experimental_get_tracing_count()``). The callback is held
    weakly: left on the model by a fit that raised, the wrapper would have kept it, and its client, alive."""

    def __init__(self, inner: Callable[..., Any], called: Callable[[], None]) -> None:
        self.inner, self._called = inner, weakref.WeakMethod(called)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (called := self._called()) is not None:
            called()
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being made): no endless recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def _hear_of_a_restore(model: Any, restored: Callable[[int, int, int, int], tuple[int, int]] | None) -> None:
    """Have tf_keras's ``fit`` ask ``restored`` where to resume, given the epoch and step its ``BackupAndRestore``
    restored: fit reads them right after every callback's ``on_train_begin`` (that callback may be listed after this
    one) and before its first batch. None undoes it."""
    model.__dict__.pop(_COUNTERS, None)
    if restored is not None:
        object.__setattr__(model, _COUNTERS, _RestoredCounters(getattr(model, _COUNTERS), restored, _fit_running()))


_COUNTERS = "_maybe_load_initial_counters_from_ckpt"


class _RestoredCounters:
    """tf_keras's ``Model._maybe_load_initial_counters_from_ckpt``, with the counters a checkpoint gave passed through
    ``restored`` (held weakly, as in :class:`_TimedTrainFunction`), in the fit that installed it only: left on the
    model by a fit that raised, it leaves a later fit without the callback alone."""

    def __init__(self, inner: Callable[[int, int], tuple[int, int]],
                 restored: Callable[[int, int, int, int], tuple[int, int]], running: Callable[[], bool] | None) -> None:
        self.inner, self._restored, self._running = inner, weakref.WeakMethod(restored), running

    def __call__(self, steps_per_epoch: int, initial_epoch: int) -> tuple[int, int]:
        epoch, step = self.inner(steps_per_epoch, initial_epoch)
        restored = self._restored()
        if restored is None or (self._running is not None and not self._running()):
            return epoch, step
        return restored(int(steps_per_epoch), int(initial_epoch), int(epoch), int(step))


def _fit_frame() -> FrameType | None:
    """The frame of the innermost ``model.fit`` that calls the caller; None outside a ``fit``."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "fit":
        frame = frame.f_back
    return frame


def _fit_argument(name: str, default: int) -> int:
    """The whole-number argument ``name`` of the ``model.fit`` that calls this (read from its frame, as Keras 3 gives
    callbacks no ``initial_epoch``), or ``default`` outside a ``fit`` or where it is no whole number."""
    frame = _fit_frame()
    value = frame.f_locals.get(name) if frame is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _fit_running() -> Callable[[], bool] | None:
    """A test, for other threads, of whether the ``model.fit`` that calls this is still running (its frame is still on
    its thread's stack); None outside a ``fit``. When fit raises, Keras skips ``on_train_end``: this is how the source
    learns of it. The frame is known by its id and code, not held, so that it is freed as usual."""
    frame = _fit_frame()
    if frame is None:
        return None
    thread, fit_id, fit_code = threading.get_ident(), id(frame), frame.f_code

    def running() -> bool:
        frame = sys._current_frames().get(thread)
        while frame is not None and (id(frame) != fit_id or frame.f_code is not fit_code):
            frame = frame.f_back
        return frame is not None

    return running


@functools.cache
def callback_class(keras: ModuleType) -> type:
    """``LBBSPCallback`` built on ``keras.callbacks.Callback`` of the given Keras (tf_keras or Keras 3)."""
    return type("LBBSPCallback", (_CallbackLogic, keras.callbacks.Callback), {
        "__doc__": """Times each step's compute, reports it, and publishes the agreed size of the next step.

        One report per Keras execution: with ``steps_per_execution = N`` the batch hooks fire every N steps,
        so an LB-BSP iteration is N steps that share one vector. Build the source with the same N.
        """,
        "__module__": __name__,
    })


def __getattr__(name: str) -> Any:
    if name == "LBBSPCallback":  # resolved on use, for the Keras that tf.keras means in this process
        return callback_class(keras_module())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
