"""Mistakes a new Keras user makes, refused up front with a ConfigError that says what to do."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from lbbsp import JobConfig
from lbbsp.errors import ConfigError, StoreUnavailable

pytest.importorskip("tensorflow")
from lbbsp.integrations.keras import BalancedSource, WorkerSession, _embedded_directory, callback_class, task_index


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
