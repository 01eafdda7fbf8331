"""What a new Keras user's audit found (Keras 3, one worker, real Redis and TensorFlow): a second fit with a new
callback carries the job's count on, and arguments that had failed deep inside Keras, TensorFlow or numpy (or
not at all) are refused where they are given, by name."""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from lbbsp import JobConfig
from lbbsp.errors import ConfigError

pytest.importorskip("tensorflow")
from lbbsp.integrations.keras import (
    BalancedSource,
    LBBSPCallback,
    WorkerSession,
    task_index,
    training_tasks,
)
from test_keras3 import _data, _model

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
    still served (or waiting for a vector) had hung the process at exit (4 of 4 runs of a Redis stall in an audit;
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
    with pytest.raises(tf.errors.OpError, match="expected to contain 4 elements but contained only 1"):
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
