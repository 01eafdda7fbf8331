"""What a Keras user's walkthrough of docs/keras.md found (TF 2.21, Keras 3.15, tf_keras; one process, real Redis):
the errors a ported script meets say what to do, and a callback left out of tf_keras's fit is warned about at once."""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from lbbsp import JobConfig
from lbbsp.errors import ConfigError, StoreUnavailable

keras = pytest.importorskip("keras")
tf_keras = pytest.importorskip("tf_keras")
tf = pytest.importorskip("tensorflow")
from lbbsp.integrations.keras import BalancedSource, WorkerSession, callback_class  # noqa: E402
from test_keras_usage import _tf_config  # noqa: E402


def _data(samples: int = 96) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 4)).astype("float32")
    return x, (x[:, :1] > 0).astype("float32")


def _model(module: Any, steps_per_execution: int = 1) -> Any:
    model = module.Sequential([module.layers.Input((4,)), module.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    return model


def test_the_multi_worker_refusal_says_to_build_the_model_with_tf_keras(monkeypatch: pytest.MonkeyPatch,
                                                                       job: str) -> None:
    """Following "set TF_USE_LEGACY_KERAS=1" but keeping `import keras` built a Keras 3 model, and fit failed under
    MWMS with TensorFlow's "Attempt to convert a value (PerReplica...)" before any callback ran."""
    _tf_config(monkeypatch, {"worker": ["a:1", "b:1"]}, "worker", 0)
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    with pytest.raises(ConfigError, match=r"set TF_USE_LEGACY_KERAS=1 before importing TensorFlow and build the model "
                                          r"with tf\.keras \(or import tf_keras as keras\), not `import keras`, which "
                                          r"stays Keras 3"):
        WorkerSession(JobConfig(job, num_workers=2, global_batch=32), 0)


def test_a_keras3_model_beside_a_tf_keras_callback_is_told_both_ways_out(redis_url: str, job: str) -> None:
    """Under TF_USE_LEGACY_KERAS=1 with `import keras`, one worker was told only to unset the variable: wrong for
    someone on the way to multi-worker, who needs the model built with tf.keras."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_data(), config, 0)
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = callback_class(tf_keras)(session.client, source)
        with pytest.raises(ConfigError) as refused:
            callback.set_model(_model(keras))
    message = str(refused.value)
    assert "the model is a Keras 3 model but LBBSPCallback was built on tf_keras's Callback" in message
    assert "build the model with tf.keras (or import tf_keras as keras)" in message
    assert "unset TF_USE_LEGACY_KERAS" in message and "one worker" in message


def test_a_keras3_model_on_another_backend_is_refused_by_name(redis_url: str, job: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """KERAS_BACKEND=torch failed in on_train_begin: "'Sequential' object has no attribute 'distribute_strategy'"."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_data(), config, 0)
    model = _model(keras)
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")  # as `import keras` under KERAS_BACKEND=torch
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = callback_class(keras)(session.client, source)
        with pytest.raises(ConfigError, match=r"Keras 3 on the torch backend.*KERAS_BACKEND=tensorflow \(or unset "
                                              r"it\)"):
            callback.set_model(model)


def _warnings_at_epoch_ends(fit: Any, module: Any) -> list[int]:
    """How many source warnings ``fit(callbacks)`` had raised at the end of each of its epochs."""
    seen: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = lambda *_: seen.append(len([w for w in caught if "no LBBSPCallback" in str(w.message)]))  # noqa: E731
        fit([module.callbacks.LambdaCallback(on_epoch_end=count)])
    return seen


@pytest.mark.timeout(120)
def test_a_tf_keras_callback_left_out_of_fit_is_warned_about_in_the_first_epoch(redis_url: str, job: str) -> None:
    """The wait for Keras 3's probe had applied to tf_keras too: 2 MWMS workers, 3 epochs of 12 steps, no warning."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_data(), config, 0)  # 3 steps per epoch
    with WorkerSession(config, 0, url=redis_url) as session:
        callback_class(tf_keras)(session.client, source)  # made, then left out of fit
        seen = _warnings_at_epoch_ends(lambda callbacks: _model(tf_keras).fit(
            source.tf_dataset(), epochs=3, steps_per_epoch=len(source), verbose=0, callbacks=callbacks), tf_keras)
    assert seen == [1, 1, 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipeline", ["tf_dataset", "py_dataset"])
def test_what_tf_keras_reads_before_on_train_begin_raises_no_warning(redis_url: str, job: str, pipeline: str) -> None:
    """tf_keras reads one batch of a Sequence (its shape peek) before on_train_begin, and none of a dataset (under a
    strategy too): with a one-step epoch, that peek must not look like an epoch trained without the callback."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_data(32), config, 0)  # one step per epoch
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = callback_class(tf_keras)(session.client, source)
        with strategy.scope():
            model = _model(tf_keras)
        data = source.tf_dataset(strategy) if pipeline == "tf_dataset" else source.py_dataset(tf_keras)
        seen = _warnings_at_epoch_ends(lambda callbacks: model.fit(
            data, epochs=1, steps_per_epoch=len(source), verbose=0, shuffle=False, callbacks=[callback, *callbacks]),
            tf_keras)
    assert seen == [0]
    assert [b.iteration for b in source.served] == [0]


@pytest.mark.timeout(120)
def test_a_steps_per_execution_unlike_the_sources_says_what_to_build(redis_url: str, job: str) -> None:
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_data(), config, 0)
    with WorkerSession(config, 0, url=redis_url) as session:
        with pytest.raises(ConfigError, match=r"compile\(steps_per_execution=3\) but the source was built with "
                                              r"steps_per_execution=1: build it with BalancedSource\(\.\.\., "
                                              r"steps_per_execution=3\)"):
            _model(keras, 3).fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), verbose=0,
                                 shuffle=False, callbacks=[callback_class(keras)(session.client, source)])


def test_a_worker_that_finds_no_socket_gets_one_sentence_end(job: str) -> None:
    """The message had read "No such file or directory.. Worker 0 serves ..."."""
    with pytest.raises(StoreUnavailable) as refused:
        WorkerSession(JobConfig(job, num_workers=2, global_batch=32), 1, connect_timeout_s=0.2)
    assert "No such file or directory. Worker 0 serves" in str(refused.value)
    assert ".." not in str(refused.value)
