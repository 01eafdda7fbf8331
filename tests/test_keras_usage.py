"""What a Keras user meets on the way: mistakes in the session, the source's inputs and the Keras in use, refused up
front with a ConfigError that says what to do; after a fit that stopped early or raised, the source records only the
batches trained and the next fit reads a new pipeline; jit_compile, mixed_float16 and a train_step of one's own."""
from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lbbsp import Assignment, ConfigError, EmbeddedRedis, JobConfig
from lbbsp.errors import StoreUnavailable
from lbbsp.integrations.keras import BalancedSource
from refused_policies import REFUSALS, refused_policy

pytest.importorskip("tensorflow")
from lbbsp.integrations.keras import WorkerSession, callback_class, close_sessions, task_index
from lbbsp.integrations.keras_session import _embedded_directory

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")
tf_keras = pytest.importorskip("tf_keras")
pytest.importorskip("torch")  # the demo's workers and the ranks of the policy checks train with it


def _tf_config(monkeypatch: pytest.MonkeyPatch, cluster: dict[str, list[str]], task: str, index: int) -> None:
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": task, "index": index}}))


def test_task_index_counts_the_chief_first(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = {"chief": ["a:1"], "worker": ["b:1", "c:1"]}
    indices = []
    for task, index in [("chief", 0), ("worker", 0), ("worker", 1)]:
        _tf_config(monkeypatch, cluster, task, index)
        indices.append(task_index())
    assert indices == [0, 1, 2]
    _tf_config(monkeypatch, {"worker": ["b:1", "c:1"]}, "worker", 1)
    assert task_index() == 1
    monkeypatch.delenv("TF_CONFIG")
    assert task_index() == 0


def test_session_refuses_num_workers_unlike_tf_config(monkeypatch: pytest.MonkeyPatch, job: str) -> None:
    _tf_config(monkeypatch, {"chief": ["a:1"], "worker": ["b:1", "c:1"]}, "worker", 0)
    with pytest.raises(ConfigError, match="TF_CONFIG lists 3 training workers but JobConfig.num_workers is 2"):
        WorkerSession(JobConfig(job, num_workers=2, global_batch=32), 1, url="redis://unused")


def test_session_refuses_a_strategy_that_does_not_span_the_workers(job: str) -> None:
    """The strategy carries worker 0's Redis address to the others: one of a single machine cannot."""
    import tensorflow as tf  # noqa: PLC0415

    config = JobConfig(job, num_workers=2, global_batch=32)
    for strategy in (tf.distribute.get_strategy(), "mwms"):  # the default strategy: one process
        with pytest.raises(ConfigError, match="the strategy given does not span the job's 2 workers") as refused:
            WorkerSession(config, 0, strategy=strategy)
        assert "for one process, JobConfig(num_workers=1)" in str(refused.value)  # the README's 2, run alone


def test_session_refuses_a_one_process_strategy_with_devices_for_a_job_of_two_workers(job: str) -> None:
    """A MirroredStrategy of this process's devices reduces, but over one worker: the job's other worker is not in it
    (its index never turns up in the all-reduce), so it is refused as not spanning the job, not waited on."""
    import tensorflow as tf  # noqa: PLC0415

    config = JobConfig(job, num_workers=2, global_batch=32)
    with pytest.raises(ConfigError, match="the strategy given does not span the job's 2 workers"):
        WorkerSession(config, 0, strategy=tf.distribute.MirroredStrategy(["/cpu:0"]), url="redis://unused")


@pytest.mark.parametrize("worker", [-1, 2, True, 1.0])
def test_session_refuses_a_worker_index_outside_the_job(worker: object, job: str) -> None:
    with pytest.raises(ConfigError, match=r"worker must be this worker's index, an integer in \[0, 2\).*pass task_index\(\)"):
        WorkerSession(JobConfig(job, num_workers=2, global_batch=32), worker, url="redis://unused")  # type: ignore[arg-type]


@pytest.mark.parametrize(("max_ahead", "coordinator", "words"), [
    (0, True, r"max_ahead must be an integer in \[1, 1024\], got 0"),
    (2.0, True, "max_ahead must be an integer, got"),
    (1, False, "max_ahead= is the coordinator's.*set its --max-ahead"),
])
def test_session_refuses_a_max_ahead_out_of_range_or_beside_an_external_coordinator(
        max_ahead: object, coordinator: bool, words: str, job: str) -> None:
    with pytest.raises(ConfigError, match=words):  # before any connection: nothing listens there
        WorkerSession(JobConfig(job, num_workers=1, global_batch=32), 0, url="redis://127.0.0.1:1/0",
                      coordinator=coordinator, max_ahead=max_ahead)  # type: ignore[arg-type]


def test_session_refuses_a_policy_that_is_not_a_policy_instance_on_any_worker(job: str) -> None:
    """Worker 0 alone had refused it, in its coordinator: the other workers went on to wait for it."""
    with pytest.raises(ConfigError, match="policy must be a Policy instance"):  # worker 1: before any connection
        WorkerSession(JobConfig(job, num_workers=2, global_batch=32), 1, url="redis://127.0.0.1:1/0",
                      policy="bsp")  # type: ignore[arg-type]


def test_a_failed_start_of_worker_0s_server_leaves_no_folder(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder would keep the server's config (with its password, on TCP) until a later start removed it."""
    monkeypatch.setattr("lbbsp.embedded.redis_server_binary", lambda: "/bin/false")
    with pytest.raises(StoreUnavailable):
        WorkerSession(JobConfig(job, num_workers=1, global_batch=32), 0)
    assert not _embedded_directory(job).exists()


def test_a_second_session_of_a_job_name_in_use_on_the_machine_is_refused_and_the_first_runs_on(job: str) -> None:
    """Its worker 0 had deleted the first session's folder, server running, and started its own on the same socket:
    the first session's worker then talked to the second's Redis, and found none once that closed."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    with WorkerSession(config, 0) as first:
        with pytest.raises(ConfigError, match="another WorkerSession of this job name runs on this machine"):
            WorkerSession(config, 0)
        assert first.client is not None and first.client.assignment(0).sizes == (32,)
    with WorkerSession(config, 0):  # once the first closed
        pass


def test_a_session_left_open_in_this_process_is_named_and_closed_by_close_sessions(job: str) -> None:
    """In a notebook, a session made outside `with` whose fit raised stays open, held by its threads: a cell run again
    was refused for good ("Close it"), with no handle left to close it by."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    WorkerSession(config, 0)  # left open, no reference kept
    with pytest.raises(ConfigError, match=rf"runs on this machine, in this process .*close_sessions\('{job}'\)"):
        WorkerSession(config, 0)
    assert close_sessions("another-job") == 0 and close_sessions(job) == 1 and close_sessions(job) == 0
    with WorkerSession(config, 0) as again:
        assert again.client is not None and again.client.assignment(0).sizes == (32,)
    assert close_sessions() == 0  # a session closed by its `with` is not left to close


def test_a_folder_another_user_made_for_the_jobs_server_is_refused_by_every_local_worker(job: str) -> None:
    """In a shared /dev/shm another user who made it first could serve the workers their own Redis."""
    folder, config = _embedded_directory(job), JobConfig(job, num_workers=2, global_batch=32)
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    try:  # a server answers there, in a folder others can write to: checked once connected, as it may come later
        with EmbeddedRedis(folder), pytest.raises(ConfigError, match="writable by others .* not a private folder"):
            WorkerSession(config, 1, connect_timeout_s=5.0)
    finally:
        shutil.rmtree(folder)
    folder.symlink_to("/tmp")  # one worker 0 cannot remove (another user's, where it does not run as root)
    try:
        with pytest.raises(ConfigError, match="is a link, not a private folder of this user"):
            WorkerSession(config, 0)
    finally:
        folder.unlink()


def test_a_worker_that_finds_no_socket_is_told_to_pass_the_strategy(job: str) -> None:
    with pytest.raises(StoreUnavailable, match=r"on another machine than worker 0, pass strategy= \(the Multi"):
        WorkerSession(JobConfig(job, num_workers=2, global_batch=32), 1, connect_timeout_s=0.2)


@pytest.mark.parametrize("sample_weight", [np.ones(7), np.ones((8, 1)), np.ones((8, 3))])
def test_source_needs_one_sample_weight_per_sample(sample_weight: np.ndarray, job: str) -> None:
    """A weight per time step or output would be misread: the source multiplies one weight per sample."""
    with pytest.raises(ConfigError, match=re.escape(f"shape (8,), got shape {sample_weight.shape}")):
        BalancedSource(np.zeros((8, 2)), np.zeros(8), JobConfig(job, num_workers=1, global_batch=4), 0,
                       sample_weight=sample_weight)


def test_source_needs_min_batch_of_one(job: str) -> None:
    with pytest.raises(ConfigError, match="min_batch >= 1"):
        BalancedSource(np.zeros((8, 2)), np.zeros(8), JobConfig(job, num_workers=2, global_batch=4, min_batch=0), 0)


def test_a_multi_worker_fit_of_a_py_dataset_says_to_use_tf_dataset(job: str) -> None:
    """It was told to "pass the strategy, source.tf_dataset(strategy)", and py_dataset takes no strategy: users
    looked for one."""
    source = BalancedSource(np.zeros((8, 2)), np.zeros(8), JobConfig(job, num_workers=2, global_batch=4), 0)
    source.py_dataset()
    with pytest.raises(ConfigError, match=r"2 replicas \(a multi-worker strategy\), and py_dataset\(\) serves one "
                                          r"worker alone: use source.tf_dataset\(strategy\)"):
        source.attach(0, 0, replicas=2)
    source.tf_dataset()  # built without the strategy: the hint that names it stays
    with pytest.raises(ConfigError, match=r"pipeline was built for 1: pass the strategy"):
        source.attach(0, 0, replicas=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_keras", ["tf_keras", "keras"])
def test_callback_refuses_a_model_of_the_other_keras(model_keras: str, redis_url: str, job: str) -> None:
    """tf_keras without TF_USE_LEGACY_KERAS=1 got a Keras 3 callback: "no attribute _implements_train_batch_hooks"."""
    model_module = pytest.importorskip(model_keras)
    callback_module = pytest.importorskip("keras" if model_keras == "tf_keras" else "tf_keras")
    config = JobConfig(job, num_workers=1, global_batch=4)
    source = BalancedSource(np.zeros((8, 2), "float32"), np.zeros(8, "float32"), config, 0)
    model = model_module.Sequential([model_module.layers.Input((2,)), model_module.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = callback_class(callback_module)(session.client, source)
        fix = "TF_USE_LEGACY_KERAS=1" if model_keras == "tf_keras" else "unset TF_USE_LEGACY_KERAS"
        with pytest.raises(ConfigError, match=f"the model is a {'tf_keras' if model_keras == 'tf_keras' else 'Keras 3'}"
                                              f" model .*{fix}"):
            model.fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), callbacks=[callback], verbose=0,
                      shuffle=False)


@pytest.mark.parametrize("what", list(REFUSALS))
def test_a_policy_worker_0_refuses_is_refused_on_every_keras_worker(what: str, redis_url: str, job: str) -> None:
    """Worker 1's session started with it; worker 0's alone raised, and worker 1's fit then waited on a coordinator
    that never ran."""
    from lbbsp.integrations.keras import WorkerSession  # noqa: PLC0415

    with pytest.raises(ConfigError, match=re.escape(REFUSALS[what])):
        WorkerSession(JobConfig(job, num_workers=2, global_batch=10), 1, url=redis_url, policy=refused_policy(what))


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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tf_keras_use_multiprocessing_is_refused_through_fit_as_docs_keras_md_says(redis_url: str, job: str) -> None:
    """docs/keras.md had named the error fit raises a tf.errors.UnknownError; TensorFlow 2.21 raises an
    InvalidArgumentError, whose message holds the ConfigError."""
    with _one_worker(redis_url, job) as (source, callback):
        with pytest.raises(tf.errors.InvalidArgumentError, match="ConfigError: BalancedSource cannot run in a separate "
                                                                 "process"):
            _model().fit(source.py_dataset(tf_keras), epochs=1, steps_per_epoch=len(source), shuffle=False,
                         workers=2, use_multiprocessing=True, callbacks=[callback], verbose=0)


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


X, Y = np.random.default_rng(0).random((100, 4)).astype("float32"), np.arange(100) % 2


CONFIG = JobConfig("inputs", num_workers=1, global_batch=32)


def test_a_dataset_or_an_iterator_is_named_as_such() -> None:
    import tensorflow as tf  # noqa: PLC0415

    with pytest.raises(ConfigError, match=r"x must be in-memory arrays \(numpy or tensors\), got a \w*Dataset"):
        BalancedSource(tf.data.Dataset.from_tensor_slices((X, Y)), None, CONFIG, 0)
    with pytest.raises(ConfigError, match="got a generator"):
        BalancedSource((row for row in X), Y, CONFIG, 0)
    assert len(BalancedSource(tf.constant(X), tf.constant(Y), CONFIG, 0)) == 4  # tensors are arrays


def test_a_list_of_labels_is_told_to_be_one_array() -> None:
    with pytest.raises(ConfigError, match=r"y is a list of 100 single values.*np.asarray\(y\)"):
        BalancedSource(X, list(Y), CONFIG, 0)
    assert len(BalancedSource(X, [Y], CONFIG, 0)) == 4  # a list of arrays: one per output, as before


def test_a_tuple_of_generators_is_named_as_generators() -> None:
    """Each part a generator had read as a single value ("a tuple of 2 single values ... pass np.asarray(x)")."""
    with pytest.raises(ConfigError, match=r"x\[0\] must be in-memory arrays .* got a generator"):
        BalancedSource(((row for row in X), (row for row in X)), Y, CONFIG, 0)


def _sign_data(samples: int = 96) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 4)).astype("float32")
    return x, (x[:, :1] > 0).astype("float32")


def _dense_model(module: Any, steps_per_execution: int = 1) -> Any:
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
    source = BalancedSource(*_sign_data(), config, 0)
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = callback_class(tf_keras)(session.client, source)
        with pytest.raises(ConfigError) as refused:
            callback.set_model(_dense_model(keras))
    message = str(refused.value)
    assert "the model is a Keras 3 model but LBBSPCallback was built on tf_keras's Callback" in message
    assert "build the model with tf.keras (or import tf_keras as keras)" in message
    assert "unset TF_USE_LEGACY_KERAS" in message and "one worker" in message


def test_a_keras3_model_on_another_backend_is_refused_by_name(redis_url: str, job: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """KERAS_BACKEND=torch failed in on_train_begin: "'Sequential' object has no attribute 'distribute_strategy'"."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_sign_data(), config, 0)
    model = _dense_model(keras)
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")  # as `import keras` under KERAS_BACKEND=torch
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = callback_class(keras)(session.client, source)
        with pytest.raises(ConfigError, match=r"Keras 3 on the torch backend.*KERAS_BACKEND=tensorflow \(or unset "
                                              r"it\)"):
            callback.set_model(model)


@pytest.mark.timeout(120)
def test_a_steps_per_execution_unlike_the_sources_says_what_to_build(redis_url: str, job: str) -> None:
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_sign_data(), config, 0)
    with WorkerSession(config, 0, url=redis_url) as session:
        with pytest.raises(ConfigError, match=r"compile\(steps_per_execution=3\) but the source was built with "
                                              r"steps_per_execution=1: build it with BalancedSource\(\.\.\., "
                                              r"steps_per_execution=3\)"):
            _dense_model(keras, 3).fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), verbose=0,
                                 shuffle=False, callbacks=[callback_class(keras)(session.client, source)])


def test_a_worker_that_finds_no_socket_gets_one_sentence_end(job: str) -> None:
    """The message had read "No such file or directory.. Worker 0 serves ..."."""
    with pytest.raises(StoreUnavailable) as refused:
        WorkerSession(JobConfig(job, num_workers=2, global_batch=32), 1, connect_timeout_s=0.2)
    assert "No such file or directory. Worker 0 serves" in str(refused.value)
    assert ".." not in str(refused.value)
