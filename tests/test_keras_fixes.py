"""tf_keras in one process: a fit that ends before its last epoch records only the batches it trained.

tf_keras prefetches from the source as soon as the callback publishes the next vector. A fit that stops
early (``EarlyStopping``) or raises has published the vector of the next epoch's first iteration, so the
source served batches of it that were never trained. They must not reach ``served`` or a report.

A fit that raises must not leave anything behind that hangs the process later (tf.data's own prefetch thread).
"""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lbbsp import Assignment, ConfigError, JobConfig

tf_keras = pytest.importorskip("tf_keras")
from lbbsp.integrations.keras import BalancedSource, WorkerSession, callback_class  # noqa: E402

SAMPLES, GLOBAL_BATCH = 120, 32  # 4 steps per epoch, the last one of 24 samples


class _StopAfterFirstEpoch(tf_keras.callbacks.Callback):
    """Raises at the end of the first epoch, after the lbbsp callback published the next vector."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        raise RuntimeError("stopped")


def _model():  # type: ignore[no-untyped-def]
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Input((6,)), tf_keras.layers.Dense(1)])
    model.compile(optimizer=tf_keras.optimizers.SGD(0.01), loss="mse")
    return model


def _fit_stopped_then_again(redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch, stop: str,
                            pipeline: str) -> tuple[BalancedSource, list[tuple[int, int]], list[int]]:
    """A fit of up to 5 epochs that ``stop`` ends early, then a fit of one epoch: the source, the reports sent
    as (iteration, samples), and the iterations recorded in ``served`` between the two fits."""
    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype("float32")
    reports: list[tuple[int, int]] = []
    with WorkerSession(config, 0, url=redis_url) as session:
        send = session.client.report

        def record(iteration: int, samples: int, compute_s: float, **kwargs: object) -> None:
            reports.append((iteration, samples))
            send(iteration, samples, compute_s, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(session.client, "report", record)
        source = BalancedSource(x, x[:, :1], config, 0)
        callback = callback_class(tf_keras)(session.client, source)
        model = _model()

        def fit(epochs: int, *others: object) -> None:
            data = source.tf_dataset() if pipeline == "tf_dataset" else source.py_dataset(tf_keras)
            model.fit(data, epochs=epochs, steps_per_epoch=len(source), callbacks=[callback, *others], verbose=0,
                      shuffle=False, workers=2)

        if stop == "early_stopping":  # stops after the second epoch
            fit(5, tf_keras.callbacks.EarlyStopping("loss", patience=0, min_delta=1e9))
        else:  # after the first; Keras skips on_train_end, so the source learns of it at the next fit
            with pytest.raises(RuntimeError, match="stopped"):
                fit(5, _StopAfterFirstEpoch())
        between = [b.iteration for b in source.served]
        fit(1)
    return source, reports, between


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipeline", ["tf_dataset", "py_dataset"])
def test_an_early_stop_records_only_the_batches_trained(redis_url: str, job: str, pipeline: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    source, reports, between = _fit_stopped_then_again(redis_url, job, monkeypatch, "early_stopping", pipeline)
    assert between == list(range(8))
    assert [b.iteration for b in source.served] == list(range(12))
    assert sum(b.size for b in source.served) == 3 * SAMPLES
    assert reports == [(k, 24 if k % 4 == 3 else 32) for k in range(12)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_fit_after_one_that_raised_reports_only_its_own_batches(redis_url: str, job: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    source, reports, _ = _fit_stopped_then_again(redis_url, job, monkeypatch, "error", "tf_dataset")
    assert [b.iteration for b in source.served] == list(range(8))
    assert reports == [(k, 24 if k % 4 == 3 else 32) for k in range(8)]


def test_detach_forgets_batches_cut_for_an_iteration_never_run(job: str) -> None:
    """Keras may cut batches of the next iteration as soon as its vector is published, before the fit stops."""
    config = JobConfig(job, num_workers=2, global_batch=8)
    source = BalancedSource(np.zeros((16, 2)), np.zeros(16), config, 0)
    data = source.py_dataset(tf_keras)
    source.attach(0, 0)
    for iteration, sizes in enumerate([(3, 5), (6, 2)]):
        source.publish(Assignment(job, iteration, sizes, "scripted"))
        data[iteration]  # a prefetch, as Keras makes it
    source.detach(1)
    assert [(b.iteration, b.size) for b in source.served] == [(0, 3)]
    assert (source.samples_in(0), source.samples_in(1)) == (3, 0)


@pytest.mark.parametrize(("x_dtype", "weight_dtype"), [("float16", "float32"), ("float32", "float32"),
                                                     ("float64", "float64"), ("int64", "float32")])
def test_weights_are_never_narrower_than_float32(job: str, x_dtype: str, weight_dtype: str) -> None:
    """Inputs kept in float16 to save memory had their weights W * b_i / B rounded to float16 (0.66 served as
    0.66015625): updates were 2e-4 off plain SGD, with one worker and sample weights too."""
    config = JobConfig(job, num_workers=2, global_batch=100)
    source = BalancedSource(np.zeros((200, 2), dtype=x_dtype), np.zeros(200), config, 1,
                            sample_weight=np.full(200, 1 / 3))
    data = source.py_dataset(tf_keras)
    source.attach(0, 0)
    source.publish(Assignment(job, 0, (33, 67), "scripted"))
    _, _, weights = data[0]
    assert weights.dtype == np.dtype(weight_dtype)
    assert weights[0] == pytest.approx(2 * 0.67 / 3, rel=1e-6)


def test_a_batch_still_being_cut_when_the_fit_ends_is_not_recorded(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefetch thread that got its vector just before ``detach`` finishes cutting after it."""
    config = JobConfig(job, num_workers=2, global_batch=8)
    source = BalancedSource(np.zeros((16, 2)), np.zeros(16), config, 0)
    data = source.py_dataset(tf_keras)
    source.attach(0, 0)
    source.publish(Assignment(job, 0, (3, 5), "scripted"))
    cut = source._cut

    def cut_as_the_fit_ends(*args: object) -> tuple[np.ndarray, ...]:
        source.detach(0)
        return cut(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(source, "_cut", cut_as_the_fit_ends)
    assert len(data[0][0]) == 3
    assert not source.served and source.samples_in(0) == 0


_RAISE_IN_FIT = textwrap.dedent("""
    import gc
    import sys
    import time
    import numpy as np
    from lbbsp import JobConfig
    from lbbsp.integrations.keras import BalancedSource, WorkerSession, callback_class, keras_module

    keras = keras_module()  # Keras 3, or tf_keras under TF_USE_LEGACY_KERAS=1

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("a bug in a callback of the user's")

    config = JobConfig(sys.argv[2], num_workers=1, global_batch=100)
    x = np.zeros((1000, 8), "float32")
    with WorkerSession(config, 0, url=sys.argv[1]) as session:
        source = BalancedSource(x, x[:, :1], config, 0, wait_timeout_s=60)
        model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        started = time.monotonic()
        try:
            pipeline = source.py_dataset() if sys.argv[3:] == ["py_dataset"] else source.tf_dataset()
            model.fit(pipeline, epochs=2, steps_per_epoch=len(source), shuffle=False, verbose=0,
                      callbacks=[callback_class(keras)(session.client, source), Boom()])
        except RuntimeError:  # the stall came after the error: the clock leaves out fit's compiling before it
            started = time.monotonic()
            print("raised")
        gc.collect()
        print(f"released after {time.monotonic() - started:.1f}s")
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_fit_that_raised_leaves_no_prefetch_thread_to_hang_the_exit(redis_url: str, job: str) -> None:
    """Keras 3 from a tf_dataset: tf.data's injected prefetch thread waited in the generator for the next vector,
    and the GC at exit destroyed the iterator and waited for that thread forever (often, not always: 3 tries)."""
    pytest.importorskip("keras", minversion="3")
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"} | {"TF_CPP_MIN_LOG_LEVEL": "2"}
    for attempt in range(3):
        try:
            done = subprocess.run([sys.executable, "-c", _RAISE_IN_FIT, redis_url, f"{job}-{attempt}"], env=env,
                                  capture_output=True, text=True, timeout=40, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the process hung at exit after a fit that raised (try {attempt + 1})")
        assert done.returncode == 0 and "raised" in done.stdout, done.stderr[-2000:]


@contextlib.contextmanager
def _one_worker(redis_url: str, job: str) -> Iterator[tuple[BalancedSource, Any]]:
    """A one-worker job's source (random x, its first column as y) and tf_keras callback, in a live session."""
    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    x = np.random.default_rng(0).normal(size=(SAMPLES, 6)).astype("float32")
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, x[:, :1], config, 0)
        yield source, callback_class(tf_keras)(session.client, source)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tf_keras_trains_with_jit_compile(redis_url: str, job: str) -> None:
    """The compute probe's tf.py_function time marks made XLA fail: "Detected unsupported operations ... EagerPyFunc".
    A fit without XLA first installs the probe on the optimizer; the fit with XLA must then leave it out."""
    with _one_worker(redis_url, job) as (source, callback):
        model = _model()
        for jit_compile in (False, True):
            model.jit_compile = jit_compile
            model.fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), callbacks=[callback], verbose=0)
    assert [b.size for b in source.served] == [32, 32, 32, 24] * 2


class _RaiseAtSecondBatch(tf_keras.callbacks.Callback):
    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if batch == 1:
            raise RuntimeError("stopped")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_fit_again_after_one_that_raised_reads_a_new_py_dataset(redis_url: str, job: str) -> None:
    """The source stayed attached to the fit that raised, so the next fit's first read of its new pipeline (before
    ``on_train_begin``) was refused as "a second pipeline ... validation_data"."""
    with _one_worker(redis_url, job) as (source, callback):
        model = _model()
        with pytest.raises(RuntimeError, match="stopped"):
            model.fit(source.py_dataset(tf_keras), epochs=1, steps_per_epoch=len(source), shuffle=False, workers=2,
                      callbacks=[callback, _RaiseAtSecondBatch()], verbose=0)
        model.fit(source.py_dataset(tf_keras), epochs=1, steps_per_epoch=len(source), shuffle=False, workers=2,
                  callbacks=[callback], verbose=0)
    assert [(b.iteration, b.step) for b in source.served] == [(0, 0), (1, 1), (2, 0), (3, 1), (4, 2), (5, 3)]


def test_swapped_or_mistyped_arguments_are_named(redis_url: str, job: str) -> None:
    """LBBSPCallback(source, client) failed with "AttributeError: ... 'expect_callback'"; steps_per_execution=2.0
    was taken and gave float iteration numbers; worker=True was taken as worker 1."""
    config = JobConfig(job, num_workers=2, global_batch=GLOBAL_BATCH)
    x = np.zeros((SAMPLES, 2), dtype="float32")
    for bad in ({"steps_per_execution": 2.0}, {"worker": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            BalancedSource(x, x, config, **{"worker": 0, **bad})  # type: ignore[arg-type]
    with WorkerSession(config, 1, url=redis_url) as session:
        source = BalancedSource(x, x, config, 1)
        with pytest.raises(ConfigError, match=r"\(client, source\).*got \(BalancedSource, WorkerClient\)"):
            callback_class(tf_keras)(source, session.client)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_compute_probe_times_a_mixed_float16_step(redis_url: str, job: str) -> None:
    """Under mixed_float16 compile wraps the optimizer in a LossScaleOptimizer, whose own aggregate_gradients the
    step never calls: the probe had marked nothing, and the reports fell back to wall time, barrier wait included."""
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with _one_worker(redis_url, job) as (source, callback):
            model = _model()
            assert type(model.optimizer).__name__.startswith("LossScaleOptimizer")
            model.fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), callbacks=[callback], verbose=0)
            assert callback.probe is not None and callback.probe.computed and callback.probe.reduced
    finally:
        tf_keras.mixed_precision.set_global_policy(None)  # the default again (a "float32" policy would pin float32)


def test_a_train_step_of_the_users_own_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    """Under MWMS a train_step that drops the served sample weights trained on the unweighted gradient, silently."""
    from lbbsp.integrations.keras import _warn_of_an_own_train_step  # noqa: PLC0415

    class OwnStep(tf_keras.Model):
        def train_step(self, data: Any) -> Any:
            return super().train_step(data)

    with caplog.at_level(logging.WARNING, logger="lbbsp.keras"):
        for model_class in (tf_keras.Sequential, OwnStep, OwnStep):
            _warn_of_an_own_train_step(model_class)
    warned = [r.getMessage() for r in caplog.records if "train_step of its own" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("OwnStep") and "unpack_x_y_sample_weight" in warned[0]
