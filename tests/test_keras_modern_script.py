"""A modern Keras training script ported to lbbsp: mixed precision, named inputs and outputs, a train_step of one's
own, steps_per_execution, gradient clipping, a learning-rate schedule and a best-only checkpoint.

Keras 3 runs one worker in this process (its ``fit`` does not run under MultiWorkerMirroredStrategy). tf_keras runs
two real MWMS workers, started once for the module as ``python tests/test_keras_modern_script.py worker ...``, with
the uneven, changing splits of tests/test_keras_mwms.py. Each worker trains the models of ``FITS`` in turn, and the
tests compare each with a single-process run on the same global batches, and with an unweighted one (each worker's
mean gradient counted alike, whatever its batch size), which the tolerance must tell apart.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lbbsp import EmbeddedRedis, GlobalBatchSampler, JobConfig, Report, Store
from test_keras_mwms import (
    EPOCHS,
    GLOBAL_BATCH,
    SAMPLES,
    SEED,
    ScriptedPolicy,
    _free_ports,
    _one_thread,
    join_cluster,
    make_data,
)

#: What each tf_keras worker trains, in order, each from a source of its own: "unpacks_two" fails, so it comes last.
FITS = ("clip", "named", "own_step", "bf16", "unpacks_two")
CLIPNORM = 0.05  # small enough that every step is clipped


def schedule(epoch: int, lr: float) -> float:
    """The learning rate of each epoch (``LearningRateScheduler``)."""
    return 0.2 / (1 + epoch)


def train_step_of_ones_own(keras: Any, unpack: bool) -> type:
    """A tf_keras model class with a train_step of the user's: GradientTape, compiled_loss and apply_gradients, as in
    tf_keras's guide. With ``unpack`` it passes the served sample weights on; without, it unpacks ``x, y = data``."""
    import tensorflow as tf  # noqa: PLC0415

    class OwnStep(keras.Model):
        def train_step(self, data: Any) -> dict[str, Any]:
            if unpack:
                x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            else:
                (x, y), sample_weight = data, None
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compiled_loss(y, y_pred, sample_weight=sample_weight, regularization_losses=self.losses)
            self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
            self.compiled_metrics.update_state(y, y_pred, sample_weight)
            return {m.name: m.result() for m in self.metrics}

    return OwnStep


def build(keras: Any, name: str) -> Any:
    """The compiled tf_keras model of fit ``name``, as both the workers and the single-process reference build it."""
    keras.utils.set_random_seed(0)
    if name == "named":  # named inputs, named outputs, a loss and a loss weight per output
        a, b = keras.layers.Input((3,), name="a"), keras.layers.Input((2,), name="b")
        hidden = keras.layers.Dense(6, activation="tanh")(keras.layers.Concatenate()([a, b]))
        model = keras.Model({"a": a, "b": b}, {"reg": keras.layers.Dense(2, name="reg")(hidden),
                                               "cls": keras.layers.Dense(1, activation="sigmoid", name="cls")(hidden)})
        model.compile(optimizer=keras.optimizers.SGD(0.2, global_clipnorm=CLIPNORM),
                      loss={"reg": "mse", "cls": "binary_crossentropy"}, loss_weights={"reg": 1.0, "cls": 0.3})
        return model
    model_class = train_step_of_ones_own(keras, name == "own_step") if name in ("own_step", "unpacks_two") else keras.Model
    inputs = keras.layers.Input((5,))
    model = model_class(inputs, keras.layers.Dense(2)(keras.layers.Dense(8, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.2, clipnorm=CLIPNORM if name == "clip" else None), loss="mse")
    return model


def arrays(name: str) -> tuple[Any, Any]:
    """The x and y of fit ``name``: dicts of named inputs and outputs for "named"."""
    x, y = make_data()
    if name == "named":
        return {"a": x[:, :3], "b": x[:, 3:]}, {"reg": y, "cls": (y[:, :1] > 0).astype(np.float64)}
    return x, y


def policy_of(name: str) -> str | None:
    return "mixed_bfloat16" if name == "bf16" else None


def run_worker(index: int, ports: list[int], url: str, job: str, out: Path) -> None:
    """One MWMS worker: trains each model of FITS with the lbbsp callback and source, and writes what it trained."""
    join_cluster(index, ports)
    import tensorflow as tf  # noqa: PLC0415

    tf.config.threading.set_intra_op_parallelism_threads(1)
    import tf_keras as keras  # noqa: PLC0415

    from lbbsp.integrations.keras import BalancedSource, LBBSPCallback, WorkerSession  # noqa: PLC0415

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    config = JobConfig(job, num_workers=2, global_batch=GLOBAL_BATCH, assignment_timeout_s=30.0)
    record: dict[str, Any] = {}
    with WorkerSession(config, index, url=url, policy=ScriptedPolicy()) as session:
        for name in FITS:
            keras.backend.set_floatx("float32" if policy_of(name) else "float64")
            keras.mixed_precision.set_global_policy(policy_of(name))  # None: floatx's
            source = BalancedSource(*arrays(name), config, index, seed=SEED)
            with strategy.scope():
                model = build(keras, name)
            np.savez(out / f"{name}-initial{index}.npz", *model.get_weights())
            callback = LBBSPCallback(session.client, source)
            extra = [keras.callbacks.LearningRateScheduler(schedule),
                     keras.callbacks.ModelCheckpoint(str(out / "best.keras"), monitor="loss", save_best_only=True)]
            try:
                history = model.fit(source.tf_dataset(strategy), epochs=EPOCHS, steps_per_epoch=len(source),
                                    verbose=0, callbacks=[callback, *(extra if name == "clip" else [])])
            except ValueError as exc:  # ConfigError is one
                record[name] = {"error": type(exc).__name__, "message": str(exc)}
                continue
            np.savez(out / f"{name}-weights{index}.npz", *model.get_weights())
            record[name] = {"sizes": [list(b.sizes) for b in source.served], "history": history.history,
                            "marks": len(callback.probe.computed) if callback.probe is not None else 0}
    (out / f"record{index}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def two_workers(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Run the two tf_keras workers once for the module: the folder of what they wrote."""
    out = tmp_path_factory.mktemp("modern")
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", "TF_USE_LEGACY_KERAS": "1"}
    ports, job = _free_ports(2), f"test-{uuid.uuid4().hex[:10]}"
    procs = [subprocess.Popen([sys.executable, __file__, "worker", str(i), ",".join(map(str, ports)), url, job,
                               str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    try:
        outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    yield out


def _records(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((out / f"record{i}.json").read_text())[name] for i in range(2)]


def _weights(out: Path, name: str, kind: str) -> list[list[np.ndarray]]:
    return [list(np.load(out / f"{name}-{kind}{i}.npz").values()) for i in range(2)]


def _single_process(out: Path, name: str, unweighted: bool = False) -> tuple[list[np.ndarray], list[float]]:
    """Fit ``name`` in one process on the workers' global batches, from their initial weights: its weights and the epoch
    losses ``fit`` logs. ``unweighted``: each sample weighs B / (W * b_i), which makes the step's loss the plain mean of
    the workers' mean losses, the aggregation that ignores the uneven split."""
    import tensorflow as tf  # noqa: PLC0415
    import tf_keras as keras  # noqa: PLC0415

    _one_thread(tf)
    keras.backend.set_floatx("float32" if policy_of(name) else "float64")
    keras.mixed_precision.set_global_policy(policy_of(name))
    try:
        model = build(keras, name)
        model.set_weights(_weights(out, name, "initial")[0])
        x, y = arrays(name)
        vectors = iter(_records(out, name)[0]["sizes"])
        sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)
        losses = []
        for epoch in range(EPOCHS):
            if name == "clip":
                keras.backend.set_value(model.optimizer.lr, schedule(epoch, 0.0))
            sampler.set_epoch(epoch)
            steps = []
            for step in range(len(sampler)):
                idx, vector = sampler.global_indices(step), tuple(next(vectors))
                weight = np.zeros(SAMPLES)
                for worker in range(2):
                    mine = sampler.worker_indices(step, vector, worker)
                    weight[mine] = len(idx) / (2 * len(mine)) if len(mine) else 0.0
                loss = model.train_on_batch(_take(x, idx), _take(y, idx), sample_weight=weight[idx] if unweighted
                                            else None, return_dict=True)["loss"]
                steps.append((len(idx), loss))
            sizes, step_losses = np.array(steps).T
            losses.append(float(np.average(step_losses, weights=sizes)))
        return model.get_weights(), losses
    finally:  # the defaults again: a "float32" policy would pin float32 for later tests that set floatx
        keras.mixed_precision.set_global_policy(None)
        keras.backend.set_floatx("float32")


def _take(value: Any, idx: np.ndarray) -> Any:
    return {key: array[idx] for key, array in value.items()} if isinstance(value, dict) else value[idx]


def _off(weights: list[np.ndarray], reference: list[np.ndarray], initial: list[np.ndarray]) -> float:
    """How far ``weights`` are from ``reference``, as a share of how far training moved the reference."""
    return max(float(np.linalg.norm(w - r) / np.linalg.norm(r - i)) for w, r, i in zip(weights, reference, initial))


def _check_exact(out: Path, name: str, tolerance: float) -> None:
    """Both workers end with the single-process weights to ``tolerance`` (of the distance trained), which the unweighted
    aggregation misses by far more; the splits were uneven."""
    records = _records(out, name)
    assert all(len(set(map(tuple, r["sizes"]))) >= 4 for r in records), records  # uneven, changing splits
    ours = _weights(out, name, "weights")
    initial = _weights(out, name, "initial")[0]
    reference, _ = _single_process(out, name)
    unweighted, _ = _single_process(out, name, unweighted=True)
    for weights in ours:
        assert _off(weights, reference, initial) < tolerance, (name, _off(weights, reference, initial))
    assert _off(unweighted, reference, initial) > 10 * tolerance, (name, _off(unweighted, reference, initial))
    for a, b in zip(*ours):
        np.testing.assert_array_equal(a, b)  # MWMS keeps the replicas identical


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_clipping_sees_the_global_gradient_beside_a_schedule_and_a_best_only_checkpoint(two_workers: Path) -> None:
    """tf_keras clips after the all-reduce, so clipnorm sees the global batch's gradient: exact, as in one process.
    LearningRateScheduler and ModelCheckpoint(save_best_only=True) read the global loss on both workers."""
    import tf_keras as keras  # noqa: PLC0415

    _check_exact(two_workers, "clip", 1e-9)
    reference, losses = _single_process(two_workers, "clip")
    for record in _records(two_workers, "clip"):
        np.testing.assert_allclose(record["history"]["loss"], losses, rtol=1e-10)
        assert record["history"]["lr"] == pytest.approx([schedule(e, 0.0) for e in range(EPOCHS)])
    assert losses[-1] < losses[0]  # so the best epoch is the last, and the chief saved its weights
    keras.backend.set_floatx("float64")
    try:
        best = keras.models.load_model(two_workers / "best.keras", compile=False)
    finally:
        keras.backend.set_floatx("float32")
    for saved, final in zip(best.get_weights(), _weights(two_workers, "clip", "weights")[0]):
        np.testing.assert_array_equal(saved, final)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_named_inputs_and_outputs_with_a_loss_per_output_train_as_one_process(two_workers: Path) -> None:
    """Dicts of inputs and of targets, loss={...}, loss_weights={...} and global_clipnorm."""
    _check_exact(two_workers, "named", 1e-9)
    assert {"loss", "reg_loss", "cls_loss"} <= set(_records(two_workers, "named")[0]["history"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_train_step_of_ones_own_that_passes_the_weights_on_is_exact_and_timed(two_workers: Path) -> None:
    """GradientTape, compiled_loss(sample_weight=...) and apply_gradients: exact, and the probe in the optimizer's
    aggregation still times the compute apart from the all-reduce's wait."""
    _check_exact(two_workers, "own_step", 1e-9)
    assert all(r["marks"] > 0 for r in _records(two_workers, "own_step"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixed_bfloat16_trains_as_one_process_under_the_same_policy(two_workers: Path) -> None:
    """bfloat16 keeps 8 bits of mantissa: the per-worker partial sums round differently from one process's, so the
    tolerance is loose: 1.5e-2 of the distance trained in a run of 2026-12-03, where the unweighted aggregation missed
    by 1.08."""
    _check_exact(two_workers, "bf16", 0.05)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_train_step_that_unpacks_x_y_is_told_how_to_take_the_weights(two_workers: Path) -> None:
    """Under several workers every batch carries the weights W * b_i / B; tf_keras's guide's ``x, y = data`` failed
    with a bare "too many values to unpack (expected 2)" from inside the traced step."""
    for record in _records(two_workers, "unpacks_two"):
        assert record["error"] == "ConfigError", record
        assert "keras.utils.unpack_x_y_sample_weight(data)" in record["message"], record


@pytest.mark.timeout(120)
def test_a_modern_keras3_script_trains_as_plain_keras(redis_url: str, job: str, tmp_path: Path) -> None:
    """Keras 3, one worker, all at once: mixed_bfloat16, named inputs and outputs with a loss and a weight per output,
    a subclass whose train_step calls compute_loss and optimizer.apply, steps_per_execution=4, clipnorm, sample weights
    of the user's, LearningRateScheduler and ModelCheckpoint(save_best_only=True). Equal to train_on_batch of the same
    model on the same global batches, under the same policy."""
    keras = pytest.importorskip("keras")
    if keras.__version__.startswith("2"):
        pytest.skip("Keras 3 only")
    from lbbsp.integrations.keras import BalancedSource, WorkerSession, callback_class  # noqa: PLC0415

    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(100, 3)).astype("float32"), "b": rng.normal(size=(100, 2)).astype("float32")}
    y = {"reg": (x["a"] @ rng.normal(size=(3, 2))).astype("float32"), "cls": (x["b"][:, :1] > 0).astype("float32")}
    sample_weight = rng.uniform(0.2, 2.0, 100)
    config = JobConfig(job, num_workers=1, global_batch=32)  # 4 steps: one execution of 4 per epoch
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        source = BalancedSource(x, y, config, 0, seed=SEED, sample_weight=sample_weight, steps_per_execution=4)
        model = _keras3_model(keras)
        by_epoch: list[list[np.ndarray]] = []
        with WorkerSession(config, 0, url=redis_url) as session:
            history = model.fit(source.tf_dataset(), epochs=EPOCHS, steps_per_epoch=len(source), shuffle=False,
                                verbose=0, callbacks=[
                                    callback_class(keras)(session.client, source),
                                    keras.callbacks.LearningRateScheduler(schedule),
                                    keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="loss",
                                                                    save_best_only=True),
                                    keras.callbacks.LambdaCallback(
                                        on_epoch_end=lambda *_: by_epoch.append(model.get_weights()))])
        reference = _keras3_model(keras)
        sampler = GlobalBatchSampler(100, 32, seed=SEED)
        for epoch in range(EPOCHS):
            reference.optimizer.learning_rate = schedule(epoch, 0.0)
            sampler.set_epoch(epoch)
            for step in range(len(sampler)):
                idx = sampler.global_indices(step)
                reference.train_on_batch(_take(x, idx), _take(y, idx), sample_weight=sample_weight[idx])
    finally:
        keras.mixed_precision.set_global_policy(previous)
    assert [b.size for b in source.served] == [32, 32, 32, 4] * EPOCHS
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert history.history["learning_rate"] == pytest.approx([schedule(e, 0.0) for e in range(EPOCHS)])
    losses = history.history["loss"]
    assert min(losses) > 0  # the total loss, which the checkpoint monitors, tracked by the train_step
    best = keras.models.load_model(tmp_path / "best.keras", custom_objects={"OwnStep": type(model)}, compile=False)
    for saved, kept in zip(best.get_weights(), by_epoch[int(np.argmin(losses))]):
        np.testing.assert_array_equal(saved, kept)
    store = Store.from_url(redis_url, job)
    reports = [Report.from_json(p, job=job) for k in range(EPOCHS) for p in store.reports(k).values()]
    store.close()
    assert [r.samples for r in reports] == [25, 25] and all(r.compute_s > 0 for r in reports)  # one per execution


def _keras3_model(keras: Any) -> Any:
    """A Keras 3 functional subclass of named inputs and outputs whose train_step follows Keras 3's guide."""
    import tensorflow as tf  # noqa: PLC0415

    class OwnStep(keras.Model):
        def train_step(self, data: Any) -> dict[str, Any]:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            for metric in self.metrics:  # compute_loss tracks each output's loss, not the total
                if metric.name == "loss":
                    metric.update_state(loss)
            return self.compute_metrics(x, y, y_pred, sample_weight)

    keras.utils.set_random_seed(0)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    hidden = keras.layers.Dense(6, activation="tanh")(keras.layers.Concatenate()([a, b]))
    model = OwnStep({"a": a, "b": b}, {"reg": keras.layers.Dense(2, name="reg")(hidden),
                                       "cls": keras.layers.Dense(1, activation="sigmoid", name="cls")(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=CLIPNORM), loss={"reg": "mse", "cls": "binary_crossentropy"},
                  loss_weights={"reg": 1.0, "cls": 0.3}, steps_per_execution=4)
    return model


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _, _, index, ports, url, job, out = sys.argv
    run_worker(int(index), [int(p) for p in ports.split(",")], url, job, Path(out))
