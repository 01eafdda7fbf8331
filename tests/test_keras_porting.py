"""Porting a one-worker ``model.fit`` script to lbbsp: validation, the usual callbacks and a second phase of training
(tf_keras's enqueuer, validation time, a run resumed from ``epochs_trained``, boolean labels under class weights).
One worker in one process, real Redis and TensorFlow, with the Keras each case needs."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from lbbsp import Assignment, GlobalBatchSampler, JobConfig

pytest.importorskip("tensorflow")
from lbbsp.integrations.keras import BalancedSource, WorkerSession, callback_class

SAMPLES, GLOBAL_BATCH = 96, 32  # 3 steps per epoch


def _data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(SAMPLES, 6)).astype("float32")
    return x, (x[:, :1] > 0).astype("float32")


def _model(keras: Any) -> Any:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((6,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
    return model


def _recording(session: WorkerSession, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, float, float]]:
    """The reports the session's client sends, as (iteration, samples, compute_s, wait_s), as they are sent."""
    reports: list[tuple[int, int, float, float]] = []
    send = session.client.report

    def record(iteration: int, samples: int, compute_s: float, **kwargs: Any) -> Any:
        reports.append((iteration, samples, compute_s, kwargs.get("wait_s") or 0.0))
        return send(iteration, samples, compute_s, **kwargs)

    monkeypatch.setattr(session.client, "report", record)
    return reports


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tf_keras_worker_threads_with_validation_train_every_batch_once(redis_url: str, job: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """tf_keras's enqueuer (``fit(workers=2)``) starts a second pass over the Sequence on its own while the epoch
    ends (validation, a checkpoint): the source counted those reads as the next epoch's, so the next epoch's real
    reads were taken for the epoch after, whose vector never came: fit hung for ``wait_timeout_s`` (120 s by
    default), then failed with "no agreed vector"."""
    tf_keras = pytest.importorskip("tf_keras")

    class SlowEpochEnd(tf_keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            time.sleep(0.3)  # a checkpoint being written: the enqueuer's next pass starts meanwhile

    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        reports = _recording(session, monkeypatch)
        source = BalancedSource(x, y, config, 0, wait_timeout_s=8)
        history = _model(tf_keras).fit(
            source.py_dataset(tf_keras), epochs=3, steps_per_epoch=len(source), shuffle=False, verbose=0,
            workers=2, validation_data=(x, y),
            callbacks=[callback_class(tf_keras)(session.client, source), SlowEpochEnd()])
    assert len(history.history["val_loss"]) == 3
    assert [(b.iteration, b.epoch, b.step) for b in source.served] == [(3 * e + s, e, s) for e in range(3)
                                                                        for s in range(3)]
    assert [(k, n) for k, n, _, _ in reports] == [(k, 32) for k in range(9)]  # no batch counted twice


def test_a_sequence_read_on_from_an_earlier_fit_does_not_take_the_next_fits_turn(job: str) -> None:
    """A callback that stops fit mid-epoch (``model.stop_training``, as TerminateOnNaN does) leaves tf_keras's
    enqueuer of that epoch (``fit(workers=2)``) running: tf_keras stops one only at an epoch's end. Its next pass read
    the first fit's Sequence while the next fit ran (3 of 4 runs of two such fits), and the next fit's own Sequence was
    refused: "a second pipeline of this source is being read during model.fit (validation_data=...?)"."""
    tf_keras = pytest.importorskip("tf_keras")
    config = JobConfig(job, num_workers=1, global_batch=8)
    source = BalancedSource(np.arange(32.0).reshape(16, 2), np.zeros(16), config, 0, wait_timeout_s=2)
    first = source.py_dataset(tf_keras)
    source.attach(0, 0)
    source.publish(Assignment(job, 0, (8,), "scripted"))
    first[0]
    source.detach(1)  # the first fit stopped after its first step
    second = source.py_dataset(tf_keras)
    source.attach(1, 1)
    source.publish(Assignment(job, 1, (8,), "scripted"))
    first[0]  # the first fit's enqueuer, reading on
    x, _ = second[0]
    first[1]  # at once, though iteration 2 has no vector yet
    sampler = GlobalBatchSampler(16, 8, seed=0)
    sampler.set_epoch(1)
    np.testing.assert_array_equal(x, source.x[sampler.worker_indices(0, (8,), 0)])  # the second epoch's first batch
    assert [(b.iteration, b.epoch, b.step) for b in source.served] == [(0, 0, 0), (1, 1, 0)]
    assert (source.samples_in(0), source.samples_in(1)) == (8, 8)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("keras_name", ["keras", "tf_keras"])
def test_validation_time_is_neither_compute_nor_wait(redis_url: str, job: str, keras_name: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation runs between an epoch's last step and the next epoch's first: its time must not lower the worker's
    measured throughput (compute) nor pass for a wait at the barrier."""
    keras = pytest.importorskip(keras_name)
    validation_s = 1.0

    class SlowValidation(keras.callbacks.Callback):
        def on_test_begin(self, logs: dict | None = None) -> None:
            time.sleep(validation_s)  # a large validation set

    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        reports = _recording(session, monkeypatch)
        source = BalancedSource(x, y, config, 0)
        history = _model(keras).fit(source.tf_dataset(), epochs=2, steps_per_epoch=len(source), shuffle=False,
                                    verbose=0, validation_data=(x, y),
                                    callbacks=[SlowValidation(), callback_class(keras)(session.client, source)])
    assert len(history.history["val_loss"]) == 2 and len(reports) == 2 * len(source)
    for _, _, compute_s, wait_s in reports[1:]:  # the first step traces the train function
        assert compute_s < validation_s / 2 and wait_s < validation_s / 2, reports


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_resumed_run_continues_the_sample_order_from_epochs_trained(redis_url: str, job: str) -> None:
    """A run resumed in a new process with ``fit(initial_epoch=1)`` trains epoch 1 on the order of epoch 0 of its new
    source, unless the script sets ``source.epochs_trained = 1`` (docs/keras.md, initial_epoch)."""
    keras = pytest.importorskip("keras")
    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        resumed = BalancedSource(x, y, config, 0, seed=3)
        resumed.epochs_trained = 1
        _model(keras).fit(resumed.tf_dataset(), initial_epoch=1, epochs=2, steps_per_epoch=len(resumed),
                          shuffle=False, verbose=0, callbacks=[callback_class(keras)(session.client, resumed)])
    assert [(b.epoch, b.step) for b in resumed.served] == [(1, step) for step in range(len(resumed))]


def test_class_weight_reads_boolean_labels_as_classes_0_and_1(job: str) -> None:
    """Keras 3's ``fit(y=labels == 1, class_weight=...)`` trains on boolean labels, and so does the source without
    class weights; with them it refused "y of shape (n,), (n, 1) or one-hot (n, k), got shape (4,) and dtype bool"."""
    config = JobConfig(job, num_workers=1, global_batch=2)
    for y in (np.array([True, False, True, False]), np.array([[True], [False], [True], [False]]),
              np.array([[False, True], [True, False], [False, True], [True, False]])):
        source = BalancedSource(np.zeros((4, 2)), y, config, 0, class_weight={0: 0.5, 1: 3.0})
        assert source.sample_weights is not None
        np.testing.assert_array_equal(source.sample_weights, [3.0, 0.5, 3.0, 0.5])
