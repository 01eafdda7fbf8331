"""``model.fit`` arguments a user passes next to the source: weights, class weights, epochs to resume from.

One worker in one process, with both Keras (Keras 3 and tf_keras, each with its own callback class). Each
weighted run is compared with plain Keras ``train_on_batch`` on the same global batches, in the same order, with
the same weights: LB-BSP must not change what a weighted step computes, and its weights are never narrower than
float32. The two-worker case (tf_keras under MultiWorkerMirroredStrategy) is in tests/test_keras_mwms.py.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lbbsp import Assignment, ConfigError, GlobalBatchSampler, JobConfig

pytest.importorskip("tensorflow")
from lbbsp.integrations.keras import BalancedSource, WorkerSession, callback_class

tf_keras = pytest.importorskip("tf_keras")

SAMPLES, GLOBAL_BATCH, SEED, EPOCHS = 100, 32, 5, 2  # 4 steps per epoch, the last one of 4 samples
CLASS_WEIGHT = {0: 0.5, 1: 3.0, 2: 1.5}  # tf_keras's fit needs a weight for every class


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    return x, np.digitize(x[:, 0], [-0.5, 0.5]).astype("float32")  # classes 0, 1, 2


def _model(keras: Any) -> Any:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    return model


def _keras(name: str) -> Any:
    return pytest.importorskip(name)


def _reference(keras: Any, weights: np.ndarray | None, class_weight: dict[int, float] | None) -> list[np.ndarray]:
    """Plain Keras, one process: ``train_on_batch`` on the source's global batches, with the given weights."""
    x, y = _data()
    model = _model(keras)
    for idx in _global_batches():
        model.train_on_batch(x[idx], y[idx], sample_weight=None if weights is None else weights[idx],
                             class_weight=class_weight)
    return model.get_weights()


def _global_batches() -> Iterator[np.ndarray]:
    """The indices of the source's global batches, epoch after epoch, as a single process trains them."""
    sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for step in range(len(sampler)):
            yield sampler.global_indices(step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keras_name", ["keras", "tf_keras"])
@pytest.mark.parametrize("route, pipeline", [("source class_weight", "tf_dataset"),
                                             ("source class_weight", "py_dataset"),
                                             ("source sample_weight", "tf_dataset"),
                                             ("fit class_weight", "py_dataset")])
def test_weighted_fit_equals_plain_keras_on_the_same_batches(redis_url: str, job: str, keras_name: str, route: str,
                                                             pipeline: str) -> None:
    """``BalancedSource(class_weight=...)`` did not exist, and ``fit(class_weight=...)`` failed with either Keras
    ("You cannot specify `class_weight` and `sample_weight` at the same time", or tf_keras's "Cannot convert a
    partially known TensorShape"): the source always sent weights. A py_dataset of a source without weights of the
    user's now sends none, so Keras applies ``fit(class_weight=...)`` itself."""
    keras = _keras(keras_name)
    x, y = _data()
    sample_weight = np.random.default_rng(1).uniform(0.2, 2.0, SAMPLES)
    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    weights = {"source class_weight": {"class_weight": CLASS_WEIGHT},
               "source sample_weight": {"sample_weight": sample_weight}}.get(route, {})
    source = BalancedSource(x, y, config, 0, seed=SEED, **weights)  # type: ignore[arg-type]
    model = _model(keras)
    with WorkerSession(config, 0, url=redis_url) as session:
        data = source.tf_dataset() if pipeline == "tf_dataset" else source.py_dataset(keras)
        model.fit(data, epochs=EPOCHS, steps_per_epoch=len(source), shuffle=False, verbose=0,
                  class_weight=CLASS_WEIGHT if route == "fit class_weight" else None,
                  callbacks=[callback_class(keras)(session.client, source)])
    assert [b.size for b in source.served] == [32, 32, 32, 4] * EPOCHS
    reference = _reference(keras, sample_weight if "sample_weight" in route else None,
                           CLASS_WEIGHT if "class_weight" in route else None)
    assert not np.allclose(reference[0], _reference(keras, None, None)[0])  # the weights changed the training
    for ours, theirs in zip(model.get_weights(), reference):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keras_name", ["keras", "tf_keras"])
@pytest.mark.parametrize("weighted", [False, True])
def test_fit_class_weight_on_a_tf_dataset_is_refused_before_training(redis_url: str, job: str, keras_name: str,
                                                                     weighted: bool) -> None:
    """Keras 3 said "You cannot `class_weight` and `sample_weight` at the same time" (the user passed no sample
    weights) and tf_keras "Cannot convert a partially known TensorShape (None,) to a Tensor"."""
    keras = _keras(keras_name)
    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    source = BalancedSource(*_data(), config, 0, sample_weight=np.ones(SAMPLES) if weighted else None)
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = callback_class(keras)(session.client, source)
        with pytest.raises(ConfigError, match=re.escape("Pass the class weights to the source instead: "
                                                        "BalancedSource(x, y, ..., class_weight={...})")):
            _model(keras).fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), verbose=0,
                              shuffle=False, class_weight=CLASS_WEIGHT, callbacks=[callback])
    assert callback.iteration == 0 and not source.served  # refused as fit starts, before any step
    source.tf_dataset().map(lambda *batch: batch)  # other maps go through


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keras_name", ["keras", "tf_keras"])
def test_steps_per_execution_auto_is_refused_before_training(redis_url: str, job: str, keras_name: str) -> None:
    """tf_keras retunes an "auto" steps_per_execution while it trains (every 50 s or so), where each LB-BSP iteration
    is one execution of the steps the source was built for; Keras 3 had stopped in the callback with "invalid
    literal for int() with base 10: 'auto'"."""
    keras = _keras(keras_name)
    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    source = BalancedSource(*_data(), config, 0)
    model = _model(keras)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy",
                  steps_per_execution="auto")
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = callback_class(keras)(session.client, source)
        with pytest.raises(ConfigError, match=re.escape("model.compile(steps_per_execution='auto') changes how many "
                                                        "steps one execution runs while it trains")):
            model.fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), verbose=0, shuffle=False,
                      callbacks=[callback])
    assert callback.iteration == 0 and not source.served  # refused as fit starts, before any step


@pytest.mark.parametrize("kwargs, message", [
    ({"sample_weight": np.r_[np.nan, np.ones(SAMPLES - 1)]}, r"finite and >= 0: 1 are not, the first at index 0"),
    ({"sample_weight": -np.ones(SAMPLES)}, r"finite and >= 0: 100 are not"),
    ({"sample_weight": np.array(["1"] * SAMPLES)}, "sample_weight must be numeric"),
    ({"class_weight": [0.5, 3.0]}, "class_weight must be a dict"),
    ({"class_weight": {"0": 1.0}}, "keys must be class ids"),
    ({"class_weight": {-1: 1.0}}, "keys must be class ids"),
    ({"class_weight": {0: float("inf")}}, r"class_weight\[0\] must be a finite number >= 0"),
    ({"class_weight": {0: -2.0}}, r"class_weight\[0\] must be a finite number >= 0"),
])
def test_bad_weights_are_refused(kwargs: dict[str, Any], message: str, job: str) -> None:
    """A NaN weight trained to a NaN loss and a negative one to a negative loss, silently."""
    with pytest.raises(ConfigError, match=message):
        BalancedSource(*_data(), JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH), 0, **kwargs)


def test_class_weight_reads_labels_as_keras_does(job: str) -> None:
    """Class ids from rounded labels of shape (n,) or (n, 1), or from one-hot rows; a class without a weight weighs
    1 (as in Keras 3); the weights multiply with sample weights."""
    config = JobConfig(job, num_workers=1, global_batch=2)
    x = np.zeros((4, 2), "float32")
    labels = np.array([0, 2, 1, 2])
    class_weight = {0: 0.5, 1: 3.0}
    for y in (labels, labels[:, None].astype("float32") + 0.1, np.eye(3, dtype="float32")[labels]):
        source = BalancedSource(x, y, config, 0, class_weight=class_weight)
        np.testing.assert_array_equal(source.sample_weights, [0.5, 1.0, 3.0, 1.0])
    both = BalancedSource(x, labels, config, 0, class_weight=class_weight, sample_weight=np.array([2, 2, 1, 0]))
    np.testing.assert_array_equal(both.sample_weights, [1.0, 2.0, 3.0, 0.0])
    with pytest.raises(ConfigError, match=r"y of shape \(n,\), \(n, 1\) or one-hot"):
        BalancedSource(x, np.zeros((4, 2, 2)), config, 0, class_weight=CLASS_WEIGHT)
    with pytest.raises(ConfigError, match="class ids >= 0 in y, found -1"):
        BalancedSource(x, np.array([0, -1, 1, 1]), config, 0, class_weight=CLASS_WEIGHT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keras_name", ["keras", "tf_keras"])
def test_initial_epoch_trains_the_remaining_epochs_in_order(redis_url: str, job: str, keras_name: str) -> None:
    """fit(initial_epoch=1, epochs=3) runs epochs 1 and 2: two epochs of iterations, each step once, in order."""
    keras = _keras(keras_name)
    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    source = BalancedSource(*_data(), config, 0, seed=SEED)
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = callback_class(keras)(session.client, source)
        history = _model(keras).fit(source.tf_dataset(), initial_epoch=1, epochs=3, steps_per_epoch=len(source),
                                    verbose=0, shuffle=False, callbacks=[callback])
    assert len(history.history["loss"]) == 2 and callback.iteration == 2 * len(source)
    assert [(b.iteration, b.epoch, b.step) for b in source.served] == [
        (k, k // 4, k % 4) for k in range(2 * len(source))]


def _two_in_two_out(keras: Any) -> Any:
    """Named inputs "a" and "b", outputs "cls" and "reg", with loss weights."""
    keras.utils.set_random_seed(0)
    a, b = keras.layers.Input((4,), name="a"), keras.layers.Input((2,), name="b")
    hidden = keras.layers.Dense(5, activation="tanh")(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, [keras.layers.Dense(3, activation="softmax", name="cls")(hidden),
                                           keras.layers.Dense(1, name="reg")(hidden)])
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=["sparse_categorical_crossentropy", "mse"],
                  loss_weights=[1.0, 0.5])
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keras_name", ["keras", "tf_keras"])
@pytest.mark.parametrize("pipeline", ["tf_dataset", "py_dataset"])
def test_a_model_of_named_inputs_and_two_outputs_trains_as_plain_keras(redis_url: str, job: str, keras_name: str,
                                                                       pipeline: str) -> None:
    """x and y had to be single arrays: a dict of inputs or a tuple of targets was refused."""
    keras = _keras(keras_name)
    x, classes = _data()
    rng = np.random.default_rng(2)
    inputs = {"a": x, "b": rng.normal(size=(SAMPLES, 2)).astype("float32")}
    targets = [classes, x[:, 1:2] * 2.0]
    sample_weight = rng.uniform(0.2, 2.0, SAMPLES)
    config = JobConfig(job, num_workers=1, global_batch=GLOBAL_BATCH)
    source = BalancedSource(inputs, targets, config, 0, seed=SEED, sample_weight=sample_weight)
    model = _two_in_two_out(keras)
    with WorkerSession(config, 0, url=redis_url) as session:
        data = source.tf_dataset() if pipeline == "tf_dataset" else source.py_dataset(keras)
        model.fit(data, epochs=EPOCHS, steps_per_epoch=len(source), shuffle=False, verbose=0,
                  callbacks=[callback_class(keras)(session.client, source)])
    assert [b.size for b in source.served] == [32, 32, 32, 4] * EPOCHS
    reference = _two_in_two_out(keras)
    for idx in _global_batches():
        reference.train_on_batch({k: v[idx] for k, v in inputs.items()}, [t[idx] for t in targets],
                                 sample_weight=sample_weight[idx])
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("x, y, words", [
    ({"a": np.zeros((8, 2))}, None, "y must be an array, or a dict, tuple or list of arrays, got None"),
    ({"a": [np.zeros((8, 2))]}, np.zeros(8), "x['a'] must be an array (np.asarray it), got a list"),
    ({1: np.zeros((8, 2))}, np.zeros(8), "names (strings)"),
    ((), np.zeros(8), "x is an empty tuple"),
    ({"a": np.zeros((8, 2)), "b": np.zeros((7, 2))}, np.zeros(8), "x['a']: 8, x['b']: 7, y: 8"),
    ((np.zeros((8, 2)), np.array(["s"] * 8)), np.zeros(8), "x[1] must be a numeric array"),
])
def test_a_source_names_the_part_of_its_arrays_it_cannot_take(x: Any, y: Any, words: str, job: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        BalancedSource(x, y, JobConfig(job, num_workers=1, global_batch=4), 0)


def test_class_weight_needs_one_target_array(job: str) -> None:
    with pytest.raises(ConfigError, match="class_weight needs one target array"):
        BalancedSource(np.zeros((8, 2)), (np.zeros(8), np.zeros(8)), JobConfig(job, num_workers=1, global_batch=4), 0,
                       class_weight={0: 1.0})


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


@pytest.mark.timeout(180)
def test_tf_keras_resumed_from_a_backup_of_an_epochs_last_execution_starts_the_next_epoch(
        redis_url: str, job: str, tmp_path: Path) -> None:
    """5 steps an epoch in executions of 3: tf_keras backs up the epoch's last execution (steps 3-4) as step 3 and
    would resume at step 4, which it trained; the source starts at the next epoch's step 0, and the run ends with the
    weights of one that was never interrupted (backed up after 2 executions, stopped after 3)."""
    from test_keras_backup_restore import GLOBAL_BATCH as BACKUP_BATCH  # noqa: PLC0415
    from test_keras_backup_restore import _data as backup_data  # noqa: PLC0415
    from test_keras_backup_restore import _interrupted_then_resumed, _uninterrupted  # noqa: PLC0415

    with WorkerSession(JobConfig(job, num_workers=1, global_batch=BACKUP_BATCH), 0, url=redis_url) as session:
        model, resumed = _interrupted_then_resumed(tf_keras, session, tmp_path / "backup", save_freq=2, stop_at=3,
                                                   per_execution=3)
    assert [(b.epoch, b.step) for b in resumed.served] == [(e, s) for e in (1, 2, 3) for s in range(5)]
    for got, want in zip(model.get_weights(), _uninterrupted(tf_keras, *backup_data()), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(180)
def test_a_fit_resumed_before_the_sources_first_epoch_is_refused(redis_url: str, job: str, tmp_path: Path) -> None:
    """A retry with initial_epoch=4 on a backup saved at epoch 2 (the stopped fit had initial_epoch=0): the source's
    order of Keras epoch 2 would be 2 + 0 - 4 < 0, an order no fit of it trained. Refused before a batch, by name."""
    keras = pytest.importorskip("keras")
    from test_keras_backup_restore import GLOBAL_BATCH as BACKUP_BATCH  # noqa: PLC0415
    from test_keras_backup_restore import _data as backup_data  # noqa: PLC0415
    from test_keras_backup_restore import _model as backup_model  # noqa: PLC0415

    class StopAtEpoch2(keras.callbacks.Callback):  # type: ignore[name-defined]
        def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
            if epoch == 2:
                raise RuntimeError("interrupted")

    callback = callback_class(keras)
    with WorkerSession(JobConfig(job, num_workers=1, global_batch=BACKUP_BATCH), 0, url=redis_url) as session:
        model = backup_model(keras)
        for initial_epoch, epochs, extra in ((0, 4, [StopAtEpoch2()]), (4, 6, [])):
            source = BalancedSource(*backup_data(), session.config, 0, seed=SEED)
            with pytest.raises(RuntimeError if extra else ConfigError) as raised:
                model.fit(source.tf_dataset(), epochs=epochs, initial_epoch=initial_epoch,
                          steps_per_epoch=len(source), shuffle=False, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
                                     callback(session.client, source), *extra])
    assert re.search(r"Keras resumes this fit at epoch 2 \(BackupAndRestore\), which the source's count puts before "
                     r"its first epoch \(-4\): give fit the stopped fit.s initial_epoch, or set source.epochs_trained",
                     str(raised.value)), raised.value
    assert not source.served


@pytest.mark.timeout(180)
def test_tf_keras_stopped_within_an_epochs_cut_execution_resumes_in_whole_executions(
        redis_url: str, job: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """5 steps an epoch in executions of 3: tf_keras runs the epoch's last execution as 2 steps by setting the model's
    steps_per_execution variable to 2, and sets it back once that execution ends. A fit stopped within it leaves the
    model at 2, and the fit again (BackupAndRestore resuming it, in the same process) had been refused for good:
    "model.compile(steps_per_execution=2) but the source was built with steps_per_execution=3". Set back to 3, with a
    warning, the run resumes at the next epoch and ends with the weights of one never interrupted."""
    from test_keras_backup_restore import EPOCHS as BACKUP_EPOCHS  # noqa: PLC0415
    from test_keras_backup_restore import GLOBAL_BATCH as BACKUP_BATCH  # noqa: PLC0415
    from test_keras_backup_restore import _data as backup_data  # noqa: PLC0415
    from test_keras_backup_restore import _interrupted_then_resumed, _uninterrupted  # noqa: PLC0415

    with WorkerSession(JobConfig(job, num_workers=1, global_batch=BACKUP_BATCH), 0, url=redis_url) as session:
        model, resumed = _interrupted_then_resumed(tf_keras, session, tmp_path / "backup", save_freq=1, stop_at=2,
                                                   per_execution=3)  # stopped in the execution of steps 3-4
    assert "steps_per_execution was 2, the length of an epoch's last execution of 5 steps" in caplog.text
    assert [(b.epoch, b.step) for b in resumed.served] == [(e, s) for e in range(1, BACKUP_EPOCHS) for s in range(5)]
    assert int(model._steps_per_execution.numpy()) == 3
    for got, want in zip(model.get_weights(), _uninterrupted(tf_keras, *backup_data()), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
