"""What a Keras user can get wrong, caught where it happens (one process, real Redis and TensorFlow, Keras 3 unless
a test says tf_keras): a second fit with a new callback, or a callback made before an earlier fit, carries the job's
count on; a tf_keras callback left out of fit is warned about in the first epoch; and arguments that had failed deep
inside Keras, TensorFlow or numpy (or not at all), swapped or mistyped ones too, are refused where given, by name."""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import warnings
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lbbsp import Assignment, ConfigError, JobConfig, LBBSPError

pytest.importorskip("tensorflow")
from lbbsp.integrations.keras import BalancedSource, LBBSPCallback, WorkerSession, task_index, training_tasks
from test_keras3 import _data, _model

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
tf_keras = pytest.importorskip("tf_keras")
from lbbsp.integrations.keras import callback_class  # noqa: E402
from test_keras_usage import _dense_model, _sign_data  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "keras_digits.py"


@pytest.mark.timeout(120)
def test_a_second_fit_with_a_new_callback_carries_on_the_iterations_and_epochs(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """The docs' snippets build the callback inline, so a repeated fit line makes a new one. It had started at
    iteration 0 again: replayed the first fit's vectors and epoch 0's order, and Redis refused every report."""
    caplog.set_level(logging.WARNING)
    config = JobConfig(job, num_workers=1, global_batch=32)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0, seed=1)
        model = _model()
        callbacks = []
        for _ in range(2):
            callbacks.append(LBBSPCallback(session.client, source))
            model.fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), callbacks=callbacks[-1:],
                      verbose=0, shuffle=False)
        session.client.flush()
    steps = len(source)
    assert [b.iteration for b in source.served] == list(range(2 * steps))
    assert [b.epoch for b in source.served] == [0] * steps + [1] * steps
    assert callbacks[1].iteration == 2 * steps and callbacks[1].epochs_done == 2
    assert not [r for r in caplog.records if "reported already" in r.getMessage()]


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"wait_timeout_s": "x"}, "wait_timeout_s must be None or seconds"),
    ({"wait_timeout_s": 0}, r"wait_timeout_s must be None or seconds in \(0, 86400\], got 0"),
    ({"wait_timeout_s": math.nan}, "wait_timeout_s must be"),
    ({"record_limit": -1}, r"record_limit must be an integer in \[0, inf\], got -1"),
    ({"record_limit": 1.5}, "record_limit must be an integer"),
])
def test_source_options_are_checked_by_name(kwargs: dict[str, object], words: str, job: str) -> None:
    x, y = _data()
    with pytest.raises(ConfigError, match=words):
        BalancedSource(x, y, JobConfig(job, num_workers=1, global_batch=32), 0, **kwargs)  # type: ignore[arg-type]


def test_source_refuses_what_it_cannot_serve_by_name(job: str) -> None:
    x, y = _data()
    config = JobConfig(job, num_workers=1, global_batch=32)
    with pytest.raises(ConfigError, match="config must be the session's JobConfig"):
        BalancedSource(x, y, {"job": job}, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="x and y hold no sample"):  # had named dataset_size
        BalancedSource(x[:0], y[:0], config, 0)
    with pytest.raises(ConfigError, match="x must be a numeric array"):  # had failed in fit, in a Cast
        BalancedSource(np.array([["a"]] * 8), y[:8], config, 0)
    source = BalancedSource(x, y, config, 0)
    with pytest.raises(ConfigError, match="strategy must be None or the tf.distribute strategy"):
        source.tf_dataset("mirrored")
    with pytest.raises(ConfigError, match="keras must be None or a Keras module"):
        source.py_dataset(keras="keras")  # type: ignore[arg-type]


def test_class_weight_is_looked_up_by_the_classes_present_not_a_table_up_to_the_largest_id(job: str) -> None:
    """{10**9: 1.0} had allocated 8 GB (a dense table up to the largest class id); {10**13: ...} raised MemoryError."""
    x, y = _data()
    labels = np.where(y[:, 0] > 0, 10**13, 3).astype(np.int64)
    source = BalancedSource(x, labels, JobConfig(job, num_workers=1, global_batch=32), 0,
                            class_weight={10**13: 2.0, 10**9: 5.0})
    assert source.sample_weights is not None
    np.testing.assert_array_equal(source.sample_weights, np.where(labels == 10**13, 2.0, 1.0))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"connect_timeout_s": "5"}, r"connect_timeout_s must be seconds in \(0, 86400\]"),
    ({"connect_timeout_s": 0}, "connect_timeout_s must be seconds"),
    ({"connect_timeout_s": math.nan}, "connect_timeout_s must be seconds"),
    ({"outage_s": 5}, r"outage_s must be seconds in \[assignment_timeout_s \(10\), 86400\], got 5"),
    ({"url": 123}, "url must be None .* or a Redis URL string, got 123"),
    ({"coordinator": "false"}, r"coordinator must be True or False, got 'false' \(str\)"),  # had started one
])
def test_session_options_are_refused_before_anything_starts(kwargs: dict[str, object], words: str, job: str) -> None:
    """Each had failed only after Redis and the coordinator started, or deep inside (a str timeout: TypeError)."""
    options: dict[str, object] = {"url": "redis://unused", **kwargs}
    with pytest.raises(ConfigError, match=words):
        WorkerSession(JobConfig(job, num_workers=1, global_batch=32, assignment_timeout_s=10), 0,
                      **options)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="config must be a JobConfig"):
        WorkerSession({"job": job}, 0)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_the_default_outage_follows_a_long_assignment_timeout_and_numpy_worker_indices_pass(redis_url: str,
                                                                                          job: str) -> None:
    """outage_s's default of 60 had refused a job with assignment_timeout_s=61, though the user set no outage_s."""
    with WorkerSession(JobConfig(job, num_workers=1, global_batch=32, assignment_timeout_s=61), np.int64(0),
                       url=redis_url) as session:
        assert session.client is not None and session.client.outage_s == 61
        assert type(session.worker) is int
        x, y = _data()
        source = BalancedSource(x, y, session.config, 0)
        with pytest.raises(ConfigError, match="monitor must be None or a ResourceMonitor, got 'yes'"):
            LBBSPCallback(session.client, source, monitor="yes")  # type: ignore[arg-type]
        client = session.client
    assert client.outage_s == 61
    with pytest.raises(ConfigError, match=r"the session is closed .* build the callback while it is open"):
        LBBSPCallback(session.client, source)  # type: ignore[arg-type]


def test_a_tf_config_whose_cluster_is_not_a_map_of_lists_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": ["a:1", "b:1"], "task": {"type": "worker", "index": 0}}))
    for call in (task_index, training_tasks):
        with pytest.raises(ConfigError, match='TF_CONFIG\'s "cluster" must map each task type to a list'):
            call()


@pytest.mark.parametrize(("argv", "words"), [
    (["--epochs", "0"], "--workers and --epochs must be at least 1"),  # had crashed on served[-1]
    (["--workers", "0"], "--workers and --epochs must be at least 1"),  # had run one worker
    (["--workers", "2", "--global-batch", "8"], "--global-batch must be at least 8 per worker"),
])
def test_the_example_refuses_what_it_cannot_run(argv: list[str], words: str) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLE), *argv], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 2 and words in result.stderr, result.stderr


def test_the_examples_workers_write_their_results_to_files_of_their_own(tmp_path: Path) -> None:
    # both had written to the one --result, which kept the last worker's figures; its folder is made up front
    wanted = tmp_path / "new folder" / "result.json"
    subprocess.run([sys.executable, str(EXAMPLE), "--workers", "2", "--epochs", "1", "--result", str(wanted)],
                   check=True, timeout=300, capture_output=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    results = [json.loads((wanted.parent / f"result.{i}.json").read_text()) for i in range(2)]
    assert [r["worker"] for r in results] == [0, 1]
    assert results[0]["sizes"] == results[1]["sizes"]  # one agreed vector per step
    assert sum(r["samples"] for r in results) == 1797  # digits, one epoch: each sample once


def test_a_fit_whose_callback_failed_ends_its_pipeline_instead_of_serving_more(job: str) -> None:
    """When the callback stops fit (Redis unusable past outage_s), the source abandons that fit's tf_dataset: its
    passes end at once, so no prefetch calls back into Python while the process exits. Under MWMS, a prefetch
    still served (or waiting for a vector) had hung the process at exit (4 of 4 runs of a Redis stall;
    0 of 3 now)."""
    import tensorflow as tf  # noqa: PLC0415

    config = JobConfig(job, num_workers=1, global_batch=32)
    x, y = _data()
    source = BalancedSource(x, y, config, 0)
    batches = iter(source.tf_dataset())
    source.attach(0, 0)
    source.publish(config.initial_assignment(0))
    assert len(next(batches)[0]) == 32
    source.abandon(1)
    with pytest.raises(tf.errors.OpError, match="expected to contain an infinite number of elements but contained only 1"):
        next(batches)
    assert source.served == deque() or all(b.iteration < 1 for b in source.served)


@pytest.mark.parametrize("value", ["yes", "True"])
def test_the_keras_lbbsp_takes_is_the_one_tf_keras_means(value: str) -> None:
    # 'yes' (and 'TRUE') had made lbbsp take tf_keras while TensorFlow, which takes only 1/true/True, kept Keras 3
    probe = ("import tensorflow as tf; from lbbsp.integrations.keras import keras_module; "
             "print(tf.keras.Model.__module__.split('.')[0], keras_module().__name__)")
    env = {**os.environ, "TF_USE_LEGACY_KERAS": value, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    tf_means, lbbsp_takes = out.stdout.split()
    assert lbbsp_takes == tf_means, out.stdout
    assert tf_means == ("tf_keras" if value == "True" else "keras")


SAMPLES, GLOBAL_BATCH = 120, 32  # 4 steps per epoch, the last one of 24 samples


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


FIT_SAMPLES, FIT_GLOBAL_BATCH = 96, 32  # 3 steps per epoch


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_callbacks_made_before_an_earlier_fit_carry_on_its_iterations_and_epochs(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """Callback lists built up front, one per fit: the second callback took the iteration and epoch reached when it
    was made (0), so its fit replayed the first fit's vectors and epoch 0's order, and Redis refused every report."""
    caplog.set_level(logging.WARNING)
    config = JobConfig(job, num_workers=1, global_batch=FIT_GLOBAL_BATCH)
    x = np.random.default_rng(0).normal(size=(FIT_SAMPLES, 6)).astype("float32")
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, x[:, :1], config, 0)
        tf_keras.utils.set_random_seed(0)
        model = tf_keras.Sequential([tf_keras.layers.Input((6,)), tf_keras.layers.Dense(1)])
        model.compile(optimizer=tf_keras.optimizers.SGD(0.01), loss="mse")
        callbacks = [callback_class(tf_keras)(session.client, source) for _ in range(2)]
        for callback in callbacks:
            model.fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), callbacks=[callback], verbose=0)
        session.client.flush()
    steps = len(source)
    assert [b.iteration for b in source.served] == list(range(2 * steps))
    assert [b.epoch for b in source.served] == [0] * steps + [1] * steps
    assert not [r for r in caplog.records if "reported already" in r.getMessage()]


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
    source = BalancedSource(*_sign_data(), config, 0)  # 3 steps per epoch
    with WorkerSession(config, 0, url=redis_url) as session:
        callback_class(tf_keras)(session.client, source)  # made, then left out of fit
        seen = _warnings_at_epoch_ends(lambda callbacks: _dense_model(tf_keras).fit(
            source.tf_dataset(), epochs=3, steps_per_epoch=len(source), verbose=0, callbacks=callbacks), tf_keras)
    assert seen == [1, 1, 1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipeline", ["tf_dataset", "py_dataset"])
def test_what_tf_keras_reads_before_on_train_begin_raises_no_warning(redis_url: str, job: str, pipeline: str) -> None:
    """tf_keras reads one batch of a Sequence (its shape peek) before on_train_begin, and none of a dataset (under a
    strategy too): with a one-step epoch, that peek must not look like an epoch trained without the callback."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_sign_data(32), config, 0)  # one step per epoch
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = callback_class(tf_keras)(session.client, source)
        with strategy.scope():
            model = _dense_model(tf_keras)
        data = source.tf_dataset(strategy) if pipeline == "tf_dataset" else source.py_dataset(tf_keras)
        seen = _warnings_at_epoch_ends(lambda callbacks: model.fit(
            data, epochs=1, steps_per_epoch=len(source), verbose=0, shuffle=False, callbacks=[callback, *callbacks]),
            tf_keras)
    assert seen == [0]
    assert [b.iteration for b in source.served] == [0]


def test_layers_that_see_each_workers_own_batch_are_warned_of_once() -> None:
    """Plain BatchNormalization and an activity regularizer made a 2-worker run 0.14 and 7e-3 away from one process
    with no word (a Keras audit); a synchronized BatchNormalization is exact and goes unsaid."""
    tf_keras = pytest.importorskip("tf_keras")
    from lbbsp.integrations.keras import BatchStatisticsWarning, _warn_of_batch_statistics  # noqa: PLC0415

    layers = tf_keras.layers
    model = tf_keras.Sequential([layers.Input((3,)), layers.Dense(4, activity_regularizer="l2", name="penalised"),
                                 layers.BatchNormalization(name="plain"),
                                 layers.BatchNormalization(synchronized=True, name="synced")])
    with pytest.warns(BatchStatisticsWarning) as said:
        _warn_of_batch_statistics(model)
    message = str(said[0].message)
    assert "(plain): build them with BatchNormalization(synchronized=True)" in message and "synced" not in message
    assert "activity regularizers average over each worker's own batch (penalised)" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchStatisticsWarning)  # tf_keras<2.19 warns of random.randint(1, 1e9)
        _warn_of_batch_statistics(model)  # once per model
        _warn_of_batch_statistics(tf_keras.Sequential([layers.Input((3,)), layers.Dense(2, kernel_regularizer="l2"),
                                                       layers.BatchNormalization(synchronized=True)]))


@pytest.mark.parametrize(("raw", "words"), [
    ('{"cluster": {"worker": ["a:1"], "ps": ["b:1"]}, "task": {"type": "ps", "index": 0}}',
     "TF_CONFIG task type 'ps' is not a training worker"),
    ('{"task": {"type": "evaluator"}}', "TF_CONFIG task type 'evaluator' is not a training worker"),
    ("{'task': {}}", "TF_CONFIG is not valid JSON: "),  # Python's quotes, not JSON's
    ('[{"task": {}}]', "TF_CONFIG must be a JSON object, got list"),
])
def test_a_tf_config_that_names_no_training_worker_is_refused_by_name(raw: str, words: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter server or evaluator given the training script gets no worker index (it would have counted as one
    of the workers, and waited for a vector), and a TF_CONFIG that is no JSON object says so, not json's error."""
    monkeypatch.setenv("TF_CONFIG", raw)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        task_index()


def test_a_callback_whose_client_and_source_are_of_different_jobs_is_refused(redis_url: str, job: str) -> None:
    x, y = _data()
    config = JobConfig(job, num_workers=1, global_batch=32)
    with WorkerSession(config, 0, url=redis_url) as session:
        other_job = BalancedSource(x, y, JobConfig(job + "-b", num_workers=1, global_batch=32), 0)
        with pytest.raises(ConfigError, match="the client and the source belong to different workers or jobs"):
            LBBSPCallback(session.client, other_job)


@pytest.mark.timeout(120)
def test_a_fit_whose_epoch_is_not_the_sources_is_refused_before_a_step(redis_url: str, job: str) -> None:
    """steps_per_epoch shorter than the source's epoch had left each epoch's last batches for the next, out of step
    with the iterations the callback counts; it is refused at on_train_begin, naming both counts."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0)
        steps = len(source)
        with pytest.raises(ConfigError, match=rf"model.fit runs {steps - 1} steps per epoch but the source has "
                                              rf"{steps}: .*steps_per_epoch=len\(source\)"):
            _model().fit(source.tf_dataset(), epochs=1, steps_per_epoch=steps - 1, verbose=0, shuffle=False,
                         callbacks=[LBBSPCallback(session.client, source)])
        assert not source.served  # refused before a batch was cut


@pytest.mark.timeout(120)
def test_a_pipeline_built_during_fit_stops_the_fit_by_name(redis_url: str, job: str) -> None:
    """A pipeline built mid-fit (a callback of the user's evaluating on a new source.tf_dataset()) detaches the source
    from the running fit: the next step's vector is refused with what to do, not waited for."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0)

        class BuildsAPipeline(keras.callbacks.Callback):  # type: ignore[name-defined]
            def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
                if batch == 1:
                    source.tf_dataset()

        with warnings.catch_warnings(), pytest.raises(ConfigError, match="the source was detached during model.fit: "
                                                                          "build its pipelines before fit"):
            warnings.simplefilter("ignore")
            _model().fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), verbose=0, shuffle=False,
                         callbacks=[LBBSPCallback(session.client, source), BuildsAPipeline()])


def test_tf_keras_takes_no_loader_arguments_in_py_dataset(job: str) -> None:
    """Keras 3's PyDataset takes workers=; tf_keras's Sequence does not (fit does): they were dropped unsaid."""
    source = BalancedSource(*_data(), JobConfig(job, num_workers=1, global_batch=32), 0)
    with pytest.raises(ConfigError, match=r"tf_keras takes \['workers'\] as model.fit arguments, not here"):
        source.py_dataset(keras=tf_keras, workers=2)


@pytest.mark.timeout(120)
def test_a_strategy_of_several_replicas_in_one_worker_is_refused_by_the_dataset() -> None:
    """Each worker's batch is split across its replicas by the strategy, not by the source: one replica per worker.
    (A subprocess: the two logical CPUs and tf_keras must be set before TensorFlow starts.)"""
    probe = """if True:
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        from lbbsp import ConfigError, JobConfig
        from lbbsp.integrations.keras import BalancedSource
        source = BalancedSource(np.zeros((64, 2), "float32"), np.zeros((64, 1), "float32"),
                                JobConfig("j", num_workers=2, global_batch=32), 0)
        try:
            source.tf_dataset(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
        except ConfigError as exc:
            print("refused:", exc)
    """
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=110,
                         check=True)
    assert "refused: one replica per worker is supported (one device per worker process)" in out.stdout, out.stderr


def test_a_batch_whose_vector_never_comes_fails_after_wait_timeout_s_saying_why(job: str) -> None:
    """An attached source whose callback publishes no vector (left out of fit's callbacks after an earlier fit, or
    stuck on Redis) had waited for good: it fails after wait_timeout_s, naming the likely causes."""
    config = JobConfig(job, num_workers=1, global_batch=8)
    source = BalancedSource(np.arange(32.0).reshape(16, 2), np.zeros(16), config, 0, wait_timeout_s=0.5)
    sequence = source.py_dataset(tf_keras)
    source.attach(0, 0)
    source.publish(Assignment(job, 0, (8,), "scripted"))
    sequence[0]
    with pytest.raises(LBBSPError, match=r"no agreed vector after 0.5s: is LBBSPCallback in model.fit's callbacks") \
            as raised:
        sequence[1]  # iteration 1: never published
    assert raised.value.iteration == 1
    assert [b.iteration for b in source.served] == [0]


def test_resume_at_is_refused_outside_a_fit_and_once_the_fit_read_a_batch(job: str) -> None:
    """resume_at moves where the attached fit starts; called before attach, or after the fit read a batch, it would
    have moved a fit that is not there, or skipped (or replayed) batches under a running one."""
    config = JobConfig(job, num_workers=1, global_batch=8)
    source = BalancedSource(np.arange(32.0).reshape(16, 2), np.zeros(16), config, 0)
    sequence = source.py_dataset(tf_keras)
    with pytest.raises(ConfigError, match="resume_at is for the callback, before the fit it attached to reads a batch"):
        source.resume_at(0, 1)
    source.attach(0, 0)
    source.publish(Assignment(job, 0, (8,), "scripted"))
    sequence[0]
    with pytest.raises(ConfigError, match="resume_at is for the callback, before the fit it attached to reads a batch"):
        source.resume_at(0, 1)
    assert [(b.epoch, b.step) for b in source.served] == [(0, 0)]
