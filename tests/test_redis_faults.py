"""What a worker and the coordinator do when Redis misbehaves: answers with errors, loses its data, stalls,
or holds entries that no lbbsp process wrote. Each against a real redis-server."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from lbbsp import Coordinator, EmbeddedRedis, JobConfig, Report, Store, WorkerClient
from lbbsp.cli import main
from lbbsp.client_history import ClientHistory
from lbbsp.policies import Decision, Policy
from lbbsp.store import worker_socket_timeout


class Fixed(Policy):
    """Writes (7, 3) at its first decision, then keeps whatever split is in force (as per-epoch resizing
    does between epochs): what it keeps shows which split the coordinator believes is in force."""

    name = "fixed"

    def __init__(self) -> None:
        self.decided = 0

    def decide(self, iteration: int, current: tuple[int, ...], config: JobConfig) -> Decision:
        self.decided += 1
        return Decision((7, 3), "first") if self.decided == 1 else Decision(current, "kept")


def test_the_report_sender_survives_an_error_reply_and_sends_the_next_report(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8, assignment_timeout_s=0.3)
    with Store.from_url(redis_url, job) as other, WorkerClient(Store.from_url(redis_url, job), config, 0) as worker:
        other.client.set(other.key("reports", 0), "not a hash")  # every post of iteration 0 answers WRONGTYPE
        worker.report(0, 4, 0.1)
        worker.flush(2.0)
        worker.report(1, 4, 0.1)
        worker.flush(2.0)
        assert worker._sender.is_alive()
        assert set(other.reports(1)) == {b"0"}
        worker.store.close()


def test_a_flushed_redis_gets_the_decided_split_back_before_a_worker_falls_back(job: str) -> None:
    config = JobConfig(job, 2, 10, assignment_timeout_s=3.0, lag=1)
    with EmbeddedRedis() as server:
        coordinator = Coordinator(Store.from_url(server.url, job), config, Fixed()).start()
        workers = [WorkerClient(Store.from_url(server.url, job), config, w) for w in range(2)]
        try:
            for worker in workers:
                worker.report(0, worker.assignment(0).sizes[worker.worker], 0.1)
            first = workers[0].assignment(1)
            assert first.sizes == (7, 3)
            workers[0].store.client.flushall()  # worker 1 has not read iteration 1's split yet
            time.sleep(1.5)  # the coordinator's heartbeat notices within a second
            second = workers[1].assignment(1)
            assert (second.sizes, second.fallback) == ((7, 3), False)
        finally:
            coordinator.stop()
            for worker in workers:
                worker.close()
                worker.store.close()
            coordinator.store.close()


def test_a_lost_report_does_not_reset_the_split_in_force(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.5, lag=2)
    policy = Fixed()
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, policy)
        workers = [WorkerClient(Store.from_url(redis_url, job), config, w) for w in range(2)]
        try:
            for k in range(7):
                sizes = workers[0].assignment(k).sizes
                assert workers[1].assignment(k).sizes == sizes
                assert sizes == ((5, 5) if k < 2 else (7, 3)), k
                for worker in workers:
                    if (k, worker.worker) != (2, 1):  # worker 1's report of iteration 2 is lost
                        worker.report(k, sizes[worker.worker], 0.1)
                    worker.flush()
                while coordinator.step(0.05) is not None:
                    pass
        finally:
            for worker in workers:
                worker.close()
                worker.store.close()
    assert policy.decided == 6  # every iteration but 2 was complete


def test_a_stalled_redis_holds_a_worker_about_its_assignment_timeout(job: str) -> None:
    config = JobConfig(job, 2, 10, assignment_timeout_s=1.0, lag=1)
    with EmbeddedRedis() as server:
        store = Store.from_url(server.url, job, socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
        with store, WorkerClient(store, config, 0) as worker:
            worker.assignment(0)
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                fallback = worker.assignment(1)
                waited = time.monotonic() - started
            finally:
                os.kill(server.pid, signal.SIGCONT)
    assert fallback.fallback and fallback.sizes == (5, 5)
    assert waited < 2.5  # with the default 5 s socket timeout and its retries: 15 s


def test_the_coordinators_wait_for_reports_ends_before_its_socket_timeout(redis_url: str, job: str) -> None:
    with Store.from_url(redis_url, job, socket_timeout_s=1.0) as store:
        coordinator = Coordinator(store, JobConfig(job, 2, 10))
        assert coordinator.step(3.0) is None  # no TimeoutError from the socket


@pytest.mark.parametrize("spelling", ["01", "0x1", "1.0", " 1", "1e0", "-1", "", "+1"])
def test_only_the_plain_decimal_worker_id_counts_towards_a_complete_iteration(redis_url: str, job: str,
                                                                             spelling: str) -> None:
    with Store.from_url(redis_url, job) as store:
        assert store.post_raw_report(0, spelling, b"{}", 2) == -2
        assert store.report_count(0) == 0


def test_a_deeply_nested_report_is_rejected_and_the_others_are_decided_on(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config)
        store.post_report(Report(job, 0, 0, 5, 0.1), 2)
        store.post_raw_report(0, "1", b"[" * 1900 + b"]" * 1900, 2)
        outcome = coordinator.step(1.0)
    assert outcome is not None and outcome.written
    assert [r.worker for r in outcome.rejected] == ["1"] and "nested too deeply" in outcome.rejected[0].error


def test_a_client_index_is_never_given_twice_while_the_job_records(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job, ttl_s=2) as history:
        first, second = history.worker_index("node-a"), history.worker_index("node-b")
        for rnd in range(4):  # longer than the TTL, with a record every second
            history.record([Report(job, first, rnd, 10, 1.0), Report(job, second, rnd, 10, 2.0)], {})
            time.sleep(0.8)
        assert history.worker_index("node-c") == 2


def test_an_embedded_server_outlives_the_thread_that_started_it() -> None:
    started: list[EmbeddedRedis] = []
    thread = threading.Thread(target=lambda: started.append(EmbeddedRedis()))
    thread.start()
    thread.join()
    with started[0] as server, Store.from_url(server.url, "x") as store:
        time.sleep(0.3)
        store.ping()


def test_a_step_that_fails_the_same_way_is_logged_once_not_at_every_retry(redis_url: str, job: str,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config).start()
        store.client.set(store.key("ready"), "not a list")  # every step's pop answers WRONGTYPE
        with caplog.at_level(logging.ERROR, logger="lbbsp.coordinator"):
            time.sleep(1.0)
        coordinator.stop()
    failures = [r for r in caplog.records if "step failed" in r.getMessage()]
    assert len(failures) == 1


def test_status_skips_entries_no_coordinator_wrote(redis_url: str, job: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 10))
        store.client.lpush(store.key("decisions"), "not json", "[" * 3000)
        store.client.hset(store.key("workers"), mapping={"x": "{}", "1": '{"size": "big"}'})
        assert main(["status", "--redis", redis_url, "--job", job, "--decisions", "3"]) == 0
    assert f"job {job}" in capsys.readouterr().out
