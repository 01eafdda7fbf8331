"""The worker side of the core under input a new integration might give it: huge numbers, numpy integers,
an assignment stored under another iteration's key, a closed client, a step that is not an integer."""
from __future__ import annotations

import time

import numpy as np
import pytest

from lbbsp import (
    Assignment,
    ConfigError,
    Coordinator,
    GlobalBatchSampler,
    JobConfig,
    LBBSPError,
    ProtocolError,
    Report,
    Store,
    StoreUnavailable,
    WorkerClient,
)
from lbbsp.client_history import ClientHistory

HUGE = "1" + "0" * 400  # a JSON integer no float can hold


def report_json(compute_s: str = "0.1", features: str = "{}", job: str = "j", worker: int = 0) -> str:
    return (f'{{"v":1,"job":"{job}","worker":{worker},"iteration":0,"samples":4,"compute_s":{compute_s},'
            f'"features":{features}}}')


@pytest.mark.parametrize("payload", [report_json(compute_s=HUGE), report_json(features=f'{{"cpu_util":{HUGE}}}')])
def test_an_integer_too_large_for_a_float_is_a_protocol_error(payload: str) -> None:
    with pytest.raises(ProtocolError, match="bits"):
        Report.from_json(payload)
    with pytest.raises(ProtocolError, match="created"):
        Assignment("j", 0, (4, 4), "p", created=10**400)


def test_a_report_with_a_huge_integer_is_rejected_and_the_others_are_decided_on(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8, lag=1)
    with Store.from_url(redis_url, job) as store, Store.from_url(redis_url, job) as own:
        store.register(config)
        store.post_report(Report(job, 0, 0, 4, 0.1), 2)
        store.post_raw_report(0, "1", report_json(compute_s=HUGE, job=job, worker=1).encode(), 2)
        outcome = Coordinator(own, config).step(2.0)
        assert outcome is not None and [r.worker for r in outcome.rejected] == ["1"]
        assert store.get_assignment(1) is not None


def test_an_assignment_with_a_number_too_long_to_read_is_a_protocol_error() -> None:
    payload = '{"v":1,"job":"j","iteration":0,"sizes":[4,' + "4" * 5000 + '],"policy":"p","created":1.0}'
    with pytest.raises(ProtocolError, match="too long"):
        Assignment.from_json(payload)


def test_a_stored_assignment_of_another_iteration_is_refused(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8)
    with WorkerClient(Store.from_url(redis_url, job), config, 0) as worker:
        worker.store.publish(Assignment(job, 4, (6, 2), "p"))
        worker.store.client.set(worker.store.key("assign", 5), worker.store.get_assignment(4) or b"")
        with pytest.raises(LBBSPError, match="for iteration 4, not 5"):
            worker.assignment(5)
        worker.store.close()


def test_the_coordinator_refuses_a_stored_assignment_of_another_iteration(redis_url: str, job: str) -> None:
    """The split in force at iteration 5, where key 5 holds iteration 3's: the latest one truly of an iteration
    before it (4's, as the workers, who refuse key 5, fall back to), not the misplaced one."""
    config = JobConfig(job, 2, 8)
    store = Store.from_url(redis_url, job)
    store.publish(Assignment(job, 3, (7, 1), "p"))
    store.publish(Assignment(job, 4, (6, 2), "p"))
    store.client.set(store.key("assign", 5), store.get_assignment(3) or b"")
    assert Coordinator(store, config)._in_force(5).sizes == (6, 2)
    store.close()


def test_a_worker_started_with_redis_down_gets_store_unavailable() -> None:
    """Redis not answering when a WorkerClient registers: the library's StoreUnavailable, naming the address
    (it was redis-py's own ConnectionError)."""
    store = Store.from_url("redis://127.0.0.1:1/0", "j", socket_timeout_s=1.0)  # nothing listens there
    with pytest.raises(StoreUnavailable, match="127.0.0.1:1"):
        WorkerClient(store, JobConfig("j", 2, 8), 0)
    store.close()


def test_a_numpy_iteration_falls_back_like_a_plain_one_and_a_string_fails_at_once(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8, assignment_timeout_s=0.2)
    with WorkerClient(Store.from_url(redis_url, job), config, 0) as worker:
        assert worker.assignment(np.int64(0)).iteration == 0
        late = worker.assignment(np.int64(3))  # no coordinator: the fallback, written once, after the wait
        assert (late.iteration, late.fallback, late.sizes) == (3, True, (4, 4))
        worker.report(np.int64(3), 4, 0.1)
        started = time.monotonic()
        for bad in ("5", 5.0, True, -1):
            with pytest.raises(ProtocolError, match="iteration"):
                worker.assignment(bad)  # type: ignore[arg-type]
        assert time.monotonic() - started < 0.1  # refused before any wait for the coordinator
        worker.store.close()


def test_worker_true_is_not_taken_for_worker_one(redis_url: str, job: str) -> None:
    with Store.from_url(redis_url, job) as store, pytest.raises(ConfigError, match="worker must be an integer"):
        WorkerClient(store, JobConfig(job, 2, 8), True)


def test_a_report_after_close_raises_instead_of_vanishing(redis_url: str, job: str) -> None:
    with Store.from_url(redis_url, job) as store:
        worker = WorkerClient(store, JobConfig(job, 2, 8), 0)
        worker.close()
        with pytest.raises(LBBSPError, match="after close"):
            worker.report(0, 4, 0.1)
        assert store.reports(0) == {}


@pytest.mark.parametrize(("step", "worker"), [(1.0, 0), ("1", 0), (0, 1.0), (0, "1"), (0, True)])
def test_a_step_or_worker_that_is_not_an_integer_is_a_config_error(step: object, worker: object) -> None:
    sampler = GlobalBatchSampler(23, 10)
    with pytest.raises(ConfigError, match="must be an integer"):
        sampler.worker_indices(step, (5, 5), worker)  # type: ignore[arg-type]


def test_sizes_given_as_a_generator_are_split_like_a_tuple() -> None:
    sampler = GlobalBatchSampler(23, 10)
    assert sampler.split_for(2, (s for s in (5, 5))) == sampler.split_for(2, (5, 5))
    np.testing.assert_array_equal(sampler.worker_indices(0, (s for s in (5, 5)), 1),
                                  sampler.worker_indices(0, (5, 5), 1))


def test_a_report_of_an_iteration_already_reported_is_warned_about(redis_url: str, job: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 2, 8)
    with WorkerClient(Store.from_url(redis_url, job), config, 0) as worker:
        worker.report(0, 4, 0.1)
        worker.report(1, 4, 0.1)
        worker.flush()
        assert "reported already" not in caplog.text
        worker.report(0, 4, 0.2)  # a counter restarted by a new epoch: Redis keeps the first report of iteration 0
        worker.report(1, 4, 0.2)
        worker.flush()
        assert caplog.text.count("iteration 0 was reported already") == 1  # once a minute, not per report
        assert "or this worker reported the iteration twice" in caplog.text  # the cause here, which it had not named
        worker.store.close()


@pytest.mark.parametrize("cls", [Store, ClientHistory])
def test_a_url_where_a_redis_client_belongs_says_to_use_from_url(cls: type) -> None:
    with pytest.raises(ConfigError, match=rf"{cls.__name__} takes a Redis client; for a URL, use "
                                          rf"{cls.__name__}\.from_url\(url, job\)") as caught:
        cls("redis://user:secret@localhost:6379/0", "job")
    assert "secret" not in str(caught.value)
