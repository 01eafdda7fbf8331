"""Keras 3 single-worker model.fit with the lbbsp callback: trains, reports, serves the agreed sizes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from emulated import DelayedPolicy
from lbbsp import BSPPolicy, JobConfig, Report, Store
from lbbsp.embedded import FOLDER_PREFIX
from lbbsp.errors import ConfigError

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

if keras.__version__.startswith("2") or os.environ.get("TF_USE_LEGACY_KERAS"):
    pytest.skip("these tests are for Keras 3", allow_module_level=True)
try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
except RuntimeError:  # TF already initialised by another test module
    pass

from lbbsp.integrations.keras import BalancedSource, LBBSPCallback, WorkerSession  # noqa: E402


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 6)).astype("float32")
    return x, (x[:, :1] > 0).astype("float32")


def _model(steps_per_execution: int = 1):  # type: ignore[no-untyped-def]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
                  steps_per_execution=steps_per_execution)
    return model


def _newest_reports_decided_from(store: Store) -> int:
    """The newest iteration whose reports a decision was made from (-1 before the first): a coordinator slower than
    the steps decides from the newest complete iteration, so not every iteration has a decision of its own."""
    return max((json.loads(d)["from_reports_of"] for d in store.decisions(100)), default=-1)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipeline", ["py_dataset", "tf_dataset"])
def test_single_worker_fit_trains_and_reports(redis_url: str, job: str, pipeline: str) -> None:
    config = JobConfig(job, num_workers=1, global_batch=32)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        assert session.client.device == "cpu"  # "gpu:<model>" where TensorFlow sees a GPU
        source = BalancedSource(x, y, config, 0, seed=1)
        data = source.py_dataset(workers=2, max_queue_size=8) if pipeline == "py_dataset" else source.tf_dataset()
        model = _model()
        callback = LBBSPCallback(session.client, source)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(data, epochs=3, steps_per_epoch=len(source), callbacks=[callback], verbose=0,
                                shuffle=False)
        assert not [w for w in caught if "LBBSPCallback" in str(w.message)]  # prefetch leftovers are not an epoch
        session.client.flush()
        assert session.coordinator is not None and session.coordinator.alive
        with Store.from_url(redis_url, job) as store:  # the coordinator process decides from the last reports
            deadline = time.monotonic() + 30
            while _newest_reports_decided_from(store) < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            decided_from = _newest_reports_decided_from(store)

    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert callback.iteration == 3 * len(source) == 12
    served = list(source.served)
    assert [b.iteration for b in served] == list(range(12))  # every step, once, in order
    assert [b.size for b in served] == [32, 32, 32, 24] * 3  # the short final batch of 120 = 3 * 32 + 24
    assert decided_from >= 10  # the coordinator got every report but the last few in flight
    with Store.from_url(redis_url, job) as store:
        assert store.get_assignment(11) is not None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_external_coordinator_serves_the_job(redis_url: str, job: str) -> None:
    """`lbbsp coordinator` started first serves the job: the session takes its lag and TTL, starts no coordinator of
    its own, refuses settings that differ, and fit trains on the external coordinator's decisions."""
    with pytest.raises(ConfigError, match="coordinator=False.*pass url="):
        WorkerSession(JobConfig(job, num_workers=1, global_batch=32), 0, coordinator=False)
    with pytest.raises(ConfigError, match="policy= is the coordinator's"):
        WorkerSession(JobConfig(job, num_workers=1, global_batch=32), 0, url=redis_url, coordinator=False,
                      policy=BSPPolicy())
    served = subprocess.Popen([sys.executable, "-m", "lbbsp.cli", "coordinator", "--redis", redis_url, "--job", job,
                               "--workers", "1", "--global-batch", "32", "--lag", "1", "--ttl", "600", "--policy",
                               "bsp"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with Store.from_url(redis_url, job) as store:
            deadline = time.monotonic() + 30
            while store.load_config() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        with pytest.raises(ConfigError, match="with global_batch=32, but this run asks for global_batch=64"):
            WorkerSession(JobConfig(job, num_workers=1, global_batch=64), 0, url=redis_url, coordinator=False)
        config = JobConfig(job, num_workers=1, global_batch=32)
        x, y = _data()
        with WorkerSession(config, 0, url=redis_url, coordinator=False) as session:
            assert session.coordinator is None
            assert (session.config.lag, session.config.ttl_s) == (1, 600.0)
            source = BalancedSource(x, y, config, 0, seed=1)
            callback = LBBSPCallback(session.client, source)
            _model().fit(source.tf_dataset(), epochs=2, steps_per_epoch=len(source), callbacks=[callback], verbose=0,
                         shuffle=False)
            session.client.flush()
            with Store.from_url(redis_url, job) as store:
                deadline = time.monotonic() + 30
                while len(store.decisions(100)) < 7 and time.monotonic() < deadline:
                    time.sleep(0.05)
                policies = {json.loads(d)["policy"] for d in store.decisions(100)}
    finally:
        served.terminate()
        out = served.communicate(timeout=30)[0]
    assert f"coordinating job '{job}'" in out, out
    assert callback.iteration == 8 and [b.size for b in source.served] == [32, 32, 32, 24] * 2
    assert policies == {"bsp"}  # decided by the external coordinator (the embedded one runs lbbsp)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_ahead", [None, 1])
def test_max_ahead_reaches_worker_0s_coordinator(redis_url: str, job: str, max_ahead: int | None) -> None:
    """Worker 0's coordinator, slower than the steps (decisions of 60 ms), runs ahead by default, one decision
    covering several steps, and decides every step with max_ahead=1."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url, policy=DelayedPolicy(0.06, 1.0, seed=0),
                       max_ahead=max_ahead) as session:
        source = BalancedSource(x, y, config, 0, seed=1)
        callback = LBBSPCallback(session.client, source)
        _model().fit(source.tf_dataset(), epochs=10, steps_per_epoch=len(source), callbacks=[callback], verbose=0,
                     shuffle=False)
        session.client.flush()
    with Store.from_url(redis_url, job) as store:  # the session's close stopped the coordinator: the log is whole
        decisions = [json.loads(d) for d in store.decisions(1000)]
    spans = {d["through"] - d["iteration"] + 1 for d in decisions}
    assert callback.iteration == 40
    if max_ahead == 1:
        assert spans == {1} and len(decisions) >= 40 - config.lag, (spans, len(decisions))
    else:
        assert max(spans) > 1, spans


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_steps_per_execution_reports_once_per_execution(redis_url: str, job: str) -> None:
    config = JobConfig(job, num_workers=1, global_batch=32)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0, steps_per_execution=2)
        callback = LBBSPCallback(session.client, source)
        _model(2).fit(source.tf_dataset(), epochs=2, steps_per_epoch=len(source), callbacks=[callback], verbose=0,
                      shuffle=False)
    assert callback.iteration == 2 * source.iterations_per_epoch == 4
    assert [b.iteration for b in source.served] == [0, 0, 1, 1, 2, 2, 3, 3]
    # each report is one batch's worth (its size, half the execution's time): the whole execution's 64 samples
    # were refused by the coordinator as more than the 32 assigned, every time, so nothing was ever balanced
    with Store.from_url(redis_url, job) as store:
        reports = [Report.from_json(payload, job=job) for k in range(4) for payload in store.reports(k).values()]
        decisions = [json.loads(d) for d in store.decisions()]
    assert [r.samples for r in reports] == [32, 28, 32, 28] and all(r.compute_s > 0 for r in reports)  # 32 + 24
    assert len(decisions) >= 2 and all(d["rejected"] == [] for d in decisions), decisions


@pytest.mark.timeout(120)
def test_mismatched_schedule_is_refused(redis_url: str, job: str) -> None:
    config = JobConfig(job, num_workers=1, global_batch=32)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0, steps_per_execution=2)
        with pytest.raises(ConfigError, match="steps_per_execution"):
            _model(1).fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source),
                          callbacks=[LBBSPCallback(session.client, source)], verbose=0, shuffle=False)
        with pytest.raises(ConfigError, match="use_multiprocessing"):
            source.py_dataset(workers=2, use_multiprocessing=True)
        source = BalancedSource(x, y, config, 0)
        with pytest.raises(ConfigError, match=r"pass steps_per_epoch=len\(source\)"):  # else epoch 1 never ends
            _model().fit(source.tf_dataset(), epochs=1, callbacks=[LBBSPCallback(session.client, source)],
                         verbose=0, shuffle=False)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tf_dataset_needs_steps_per_execution_that_divides_the_epoch(redis_url: str, job: str) -> None:
    """Keras 3 runs all steps of an execution from a tf.data dataset: with 4 steps per epoch and 3 per execution
    it would read 2 batches of the next epoch, whose vector is not agreed yet (a long wait, then a misleading
    error). A PyDataset ends each epoch, so its last execution is short and the same schedule works."""
    config = JobConfig(job, num_workers=1, global_batch=32)  # 120 samples: 4 steps per epoch
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0, steps_per_execution=3, wait_timeout_s=5.0)
        callback = LBBSPCallback(session.client, source)
        with pytest.raises(ConfigError, match=r"divides 4 .*or source.py_dataset\(\)"):
            _model(3).fit(source.tf_dataset(), epochs=2, steps_per_epoch=len(source), callbacks=[callback],
                          verbose=0, shuffle=False)
        _model(3).fit(source.py_dataset(), epochs=2, steps_per_epoch=len(source), callbacks=[callback], verbose=0,
                      shuffle=False)
    assert [b.iteration for b in source.served] == [0, 0, 0, 1, 2, 2, 2, 3]


@pytest.mark.timeout(120)
def test_num_workers_must_match_the_strategy(redis_url: str, job: str) -> None:
    config = JobConfig(job, num_workers=2, global_batch=32)  # but one process, no MultiWorkerMirroredStrategy
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0)
        with pytest.raises(ConfigError, match="num_workers is 2 but the model's strategy trains on 1"):
            _model().fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), verbose=0, shuffle=False,
                         callbacks=[LBBSPCallback(session.client, source)])


@pytest.mark.timeout(120)
def test_misused_pipelines_fail_fast(redis_url: str, job: str) -> None:
    config = JobConfig(job, num_workers=1, global_batch=8)  # 15 batches: a shuffled order is never 0, 1, 2, ...
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0)
        callback = LBBSPCallback(session.client, source)
        started = time.perf_counter()
        with pytest.raises(Exception, match=r"shuffle=False"):  # Keras 3 shuffles a PyDataset by default
            _model().fit(source.py_dataset(), epochs=1, callbacks=[callback], verbose=0)
        with pytest.raises(Exception, match="validate with arrays"):
            _model().fit(source.tf_dataset(), epochs=2, steps_per_epoch=len(source), callbacks=[callback],
                         verbose=0, shuffle=False, validation_data=source.tf_dataset(), validation_steps=2)
        assert time.perf_counter() - started < 30  # not the wait for a vector that never comes


@pytest.mark.timeout(120)
def test_an_epoch_without_the_callback_warns_once(redis_url: str, job: str) -> None:
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_data(), config, 0)
    with pytest.warns(UserWarning, match="no LBBSPCallback attached") as caught:
        _model().fit(source.tf_dataset(), epochs=3, steps_per_epoch=len(source), verbose=0, shuffle=False)
    assert len([w for w in caught if "LBBSPCallback" in str(w.message)]) == 1
    source = BalancedSource(*_data(), config, 0)
    model = _model()
    with WorkerSession(config, 0, url=redis_url) as session:
        model.fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), verbose=0, shuffle=False,
                  callbacks=[LBBSPCallback(session.client, source)])
    with pytest.warns(UserWarning, match="validate and evaluate with arrays"):  # without steps, it would never end
        model.evaluate(source.tf_dataset(), steps=len(source), verbose=0)


@pytest.mark.timeout(120)
def test_a_callback_made_but_left_out_of_fit_still_gets_the_warning(redis_url: str, job: str) -> None:
    """Making the callback had silenced the warning for good: a fit it was left out of trained unbalanced, with
    nothing said. The warning now waits for two epochs and a few batches (what Keras may probe before attaching)."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_data(), config, 0)
    with WorkerSession(config, 0, url=redis_url) as session:
        LBBSPCallback(session.client, source)  # made, then forgotten
        with pytest.warns(UserWarning, match="no LBBSPCallback attached") as caught:
            _model().fit(source.tf_dataset(), epochs=8, steps_per_epoch=len(source), verbose=0, shuffle=False)
    assert len([w for w in caught if "LBBSPCallback" in str(w.message)]) == 1


@pytest.mark.timeout(120)
def test_a_callback_listed_twice_is_refused(redis_url: str, job: str) -> None:
    """callbacks=[cb, cb] had counted every step twice: each second report said 0 samples, and the log blamed the
    pipeline ("fit did not read the source's batches"), which was the right one."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    source = BalancedSource(*_data(), config, 0)
    with WorkerSession(config, 0, url=redis_url) as session:
        callback = LBBSPCallback(session.client, source)
        with pytest.raises(ConfigError, match="listed more than once in model.fit"):
            _model().fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), verbose=0, shuffle=False,
                         callbacks=[callback, callback])
        _model().fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), verbose=0, shuffle=False,
                     callbacks=[callback])  # listed once, the same callback trains on
    assert callback.iteration == len(source)


@pytest.mark.timeout(120)
def test_batches_keras_probes_before_the_callback_attaches_raise_no_warning(redis_url: str, job: str) -> None:
    """Under a strategy, Keras 3 reads a few batches through a throwaway iterator before ``on_train_begin``:
    with an epoch of 2 steps, that once looked like a whole epoch trained without the callback."""
    config = JobConfig(job, num_workers=1, global_batch=64)
    x, y = _data()
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0)
        callback = LBBSPCallback(session.client, source)
        with strategy.scope():
            model = _model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(source.tf_dataset(strategy), epochs=2, steps_per_epoch=len(source), callbacks=[callback],
                      verbose=0, shuffle=False)
    assert not [w for w in caught if "LBBSPCallback" in str(w.message)]
    assert [b.iteration for b in source.served] == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_example_reports_the_samples_it_trained(tmp_path: Path) -> None:
    """Digits has 1,797 samples: 15 global batches of up to 128, not 15 * 128 = 1,920 samples per epoch."""
    example = Path(__file__).resolve().parents[1] / "examples" / "keras_digits.py"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    subprocess.run([sys.executable, str(example), "--epochs", "2", "--result", str(tmp_path / "result.json")],
                   env=env, check=True, capture_output=True, timeout=150)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["samples"] == 2 * 1797
    assert result["global_samples_per_s"] * result["seconds"] == pytest.approx(2 * 1797)


@pytest.mark.timeout(120)
def test_without_a_url_worker_0_serves_an_embedded_redis_that_a_later_start_can_clean_up(job: str) -> None:
    config = JobConfig(job, num_workers=1, global_batch=32)
    with WorkerSession(config, 0) as session:
        assert session.server is not None
        folder = session.server.directory
        # named and labelled as the stale-folder cleanup expects: if this process were killed, the next
        # worker 0 start would remove the folder (tests/test_keras_failure.py shows that part)
        assert folder.name.startswith(FOLDER_PREFIX)
        assert (folder / "owner").read_text().split()[0] == str(os.getpid())
        session.client.store.ping()  # raises if unreachable
    assert not folder.exists()


@pytest.mark.timeout(120)
def test_a_callback_whose_fit_reads_arrays_says_so_once(redis_url: str, job: str, caplog) -> None:
    """fit(x, y, callbacks=[LBBSPCallback(...)]) trained normally, and nothing was balanced or said: the reports
    counted 0 samples and the coordinator predicted a finish of 64 s."""
    config = JobConfig(job, num_workers=1, global_batch=32)
    x, y = _data()
    source = BalancedSource(x, y, config, 0)
    with WorkerSession(config, 0, url=redis_url) as session, caplog.at_level("WARNING", logger="lbbsp.keras"):
        _model().fit(x, y, batch_size=32, epochs=2, steps_per_epoch=len(source), verbose=0,
                     callbacks=[LBBSPCallback(session.client, source)])
    assert caplog.text.count("did not read the source's batches") == 1, caplog.text


@pytest.mark.timeout(120)
def test_a_deep_copied_callback_trains_on_as_the_same_worker_and_live_objects_refuse_pickling(
        redis_url: str, job: str) -> None:
    """A callbacks list deep-copied for each fit, as KerasTuner copies it for each trial, trains on as the same worker,
    carrying on the job's iterations (it had raised "cannot pickle '_thread.lock' object"); the source, and a callback
    pickled, refuse with lbbsp's ConfigError."""
    import copy  # noqa: PLC0415
    import pickle  # noqa: PLC0415

    config = JobConfig(job, num_workers=1, global_batch=32)
    x, y = _data()
    with WorkerSession(config, 0, url=redis_url) as session:
        source = BalancedSource(x, y, config, 0, seed=1)
        callbacks = [LBBSPCallback(session.client, source), keras.callbacks.History()]
        for _ in range(2):  # KerasTuner: a new model and a deep copy of the callbacks for each trial
            copied = copy.deepcopy(callbacks)
            assert copied[0].client is session.client and copied[0].source is source
            _model().fit(source.tf_dataset(), epochs=1, steps_per_epoch=len(source), callbacks=copied, verbose=0,
                         shuffle=False)
        assert copied[0].iteration == 2 * len(source)  # the second trial carried on the job's iterations
        assert [b.iteration for b in source.served] == list(range(2 * len(source)))  # each once, in order
        for what in (callbacks[0], source):
            with pytest.raises(ConfigError, match="cannot be (copied or )?pickled"):
                pickle.dumps(what)
        with pytest.raises(ConfigError, match="BalancedSource cannot be copied or pickled"):
            copy.deepcopy(source)
