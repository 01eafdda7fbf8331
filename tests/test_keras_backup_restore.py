"""A run that Keras's ``BackupAndRestore`` resumes: the source starts at the epoch, and with tf_keras the step, that
Keras resumes at, so that every sample of every epoch is trained once and the weights are those of a run that was
never interrupted. One worker in one process, real Redis and TensorFlow; the interruption is the callback that raises,
as in ``BackupAndRestore``'s own docstring, and the resumed fit has a new source, as a new process would."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lbbsp import ConfigError, GlobalBatchSampler, JobConfig

pytest.importorskip("tensorflow")
from lbbsp.integrations.keras import BalancedSource, WorkerSession, callback_class

SAMPLES, GLOBAL_BATCH, EPOCHS = 80, 16, 4  # 5 steps per epoch
SEED = 3


def _data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(SAMPLES, 6)).astype("float32")
    return x, (x[:, :1] > 0).astype("float32")


def _model(keras: Any, per_execution: int = 1) -> Any:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((6,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="binary_crossentropy", steps_per_execution=per_execution)
    return model


def _uninterrupted(keras: Any, x: np.ndarray, y: np.ndarray, epochs: int = EPOCHS) -> list[np.ndarray]:
    """The weights of single-process SGD on every global batch of ``epochs`` epochs' orders, in order."""
    model, sampler = _model(keras), GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step in range(len(sampler)):
            model.train_on_batch(x[sampler.global_indices(step)], y[sampler.global_indices(step)])
    return model.get_weights()


def _interrupted_then_resumed(keras: Any, session: WorkerSession, backup: Path, save_freq: Any, stop_at: int = 13,
                              per_execution: int = 1, pipeline: str = "tf_dataset") -> tuple[Any, BalancedSource]:
    """A fit stopped by an error after ``stop_at`` executions, then the same fit again on a new source and callback."""
    x, y = _data()

    class Interrupt(keras.callbacks.Callback):
        executions = 0

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            Interrupt.executions += 1
            if Interrupt.executions == stop_at:
                raise RuntimeError("interrupted")

    def fit(model: Any, source: BalancedSource, *extra: Any) -> None:
        data = source.tf_dataset() if pipeline == "tf_dataset" else source.py_dataset(keras)
        model.fit(data, epochs=EPOCHS, steps_per_epoch=len(source), shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(str(backup), save_freq=save_freq),
                             callback_class(keras)(session.client, source), *extra])

    def source() -> BalancedSource:
        return BalancedSource(x, y, session.config, 0, seed=SEED, steps_per_execution=per_execution)

    model = _model(keras, per_execution)
    with pytest.raises(RuntimeError, match="interrupted"):
        fit(model, source(), Interrupt())
    resumed = source()
    fit(model, resumed)
    return model, resumed


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("save_freq", "per_execution", "stop_at", "first_step"),
                         [(4, 1, 13, 2), ("epoch", 1, 13, 0), (2, 2, 8, 4)])
def test_tf_keras_resumed_run_trains_each_remaining_step_once(redis_url: str, job: str, tmp_path: Path,
                                                               save_freq: Any, per_execution: int, stop_at: int,
                                                               first_step: int) -> None:
    """Saved every 4 steps and stopped after 13, Keras resumes at step 2 of epoch 2: the source had served steps 0
    and 1 again and never 3 and 4, and every later epoch was cut across two permutations. Saved per epoch, it resumes
    at epoch 2, which the new source had served in epoch 0's order. With 2 steps per execution, saved every 2
    executions and stopped after 8, tf_keras saved the execution of steps 2-3 as step 2 and resumed at step 3,
    which it had trained: it resumes at step 4. All now end where an uninterrupted run does."""
    tf_keras = pytest.importorskip("tf_keras")
    with WorkerSession(JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH), 0, url=redis_url) as session:
        model, resumed = _interrupted_then_resumed(tf_keras, session, tmp_path / "backup", save_freq, stop_at,
                                                   per_execution)
    assert [(b.epoch, b.step) for b in resumed.served] == (
        [(2, step) for step in range(first_step, 5)] + [(3, step) for step in range(5)])
    assert resumed.epochs_trained == EPOCHS
    for got, want in zip(model.get_weights(), _uninterrupted(tf_keras, *_data()), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_keras3_resumed_run_takes_the_epoch_keras_resumes_at(redis_url: str, job: str, tmp_path: Path) -> None:
    """Keras 3 resumes at the first step of the epoch it saved last: the new source serves that epoch's order; a
    later fit goes on from the epochs trained."""
    keras = pytest.importorskip("keras")
    with WorkerSession(JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH), 0, url=redis_url) as session:
        model, resumed = _interrupted_then_resumed(keras, session, tmp_path / "backup", "epoch")
        assert [(b.epoch, b.step) for b in resumed.served] == [(e, step) for e in (2, 3) for step in range(5)]
        for got, want in zip(model.get_weights(), _uninterrupted(keras, *_data()), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        # Keras 3 keeps the restored epoch on the model and had started the next fit there too, which took it for a
        # restore again and served epochs 2 and 3 once more: the callback clears it as the fit ends
        model.fit(resumed.tf_dataset(), epochs=2, steps_per_epoch=len(resumed), shuffle=False, verbose=0,
                  callbacks=[callback_class(keras)(session.client, resumed)])
    assert [b.epoch for b in list(resumed.served)[-10:]] == [4] * 5 + [5] * 5


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_py_dataset_resumed_mid_epoch_is_refused(redis_url: str, job: str, tmp_path: Path) -> None:
    """tf_keras reads a Sequence from its first batch whatever step it resumes at: refused, with the way out."""
    tf_keras = pytest.importorskip("tf_keras")
    with WorkerSession(JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH), 0, url=redis_url) as session, \
            pytest.raises(ConfigError, match="resumes this fit at step 2 of epoch 2.*save_freq='epoch'"):
        _interrupted_then_resumed(tf_keras, session, tmp_path / "backup", 4, pipeline="py_dataset")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_fit_without_the_callback_after_one_that_raised_is_left_alone(redis_url: str, job: str,
                                                                        tmp_path: Path) -> None:
    """The hook a fit that raised left on the model (Keras skips on_train_end) had sent a later fit's restore, one
    without LBBSPCallback, to the dead fit's source: "resume_at is for the callback"."""
    tf_keras = pytest.importorskip("tf_keras")
    x, y = _data()
    with WorkerSession(JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH), 0, url=redis_url) as session:
        source, model = BalancedSource(x, y, session.config, 0, seed=SEED), _model(tf_keras)
        callback = callback_class(tf_keras)(session.client, source)

        class Interrupt(tf_keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
                if batch == 2:
                    raise RuntimeError("interrupted")

        backup = tf_keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
        with pytest.raises(RuntimeError, match="interrupted"):
            model.fit(source.tf_dataset(), epochs=2, steps_per_epoch=len(source), verbose=0,
                      callbacks=[backup, callback, Interrupt()])
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, callbacks=[backup])
    assert len(history.history["loss"]) == 2
    assert callback is not None  # alive through the second fit, as a script's variable keeps it


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_retry_in_the_same_process_takes_up_the_stopped_fits_orders(redis_url: str, job: str, tmp_path: Path) -> None:
    """fit(initial_epoch=1) trains Keras epoch 1 on the source's order 0 (docs: initial_epoch). Stopped after 4 steps
    and retried on the same source, it had resumed on order 1, Keras's epoch number: that epoch trained 69 of its 80
    samples, some twice (found by a review). The retry takes up the stopped fit's orders."""
    tf_keras = pytest.importorskip("tf_keras")
    x, y = _data()

    class Interrupt(tf_keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if batch == 3:
                raise RuntimeError("interrupted")

    with WorkerSession(JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH), 0, url=redis_url) as session:
        source, model = BalancedSource(x, y, session.config, 0, seed=SEED), _model(tf_keras)
        backup = tf_keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=2)
        for extra in ([Interrupt()], []):
            with pytest.raises(RuntimeError, match="interrupted") if extra else contextlib.nullcontext():
                model.fit(source.tf_dataset(), initial_epoch=1, epochs=3, steps_per_epoch=len(source), verbose=0,
                          callbacks=[backup, callback_class(tf_keras)(session.client, source), *extra])
    assert [(b.epoch, b.step) for b in source.served] == [(0, step) for step in range(5)] + [(1, s) for s in range(5)]
    assert source.epochs_trained == 2
    for got, want in zip(model.get_weights(), _uninterrupted(tf_keras, x, y, epochs=2), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
