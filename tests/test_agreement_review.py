"""Fixes from a review of agreement and restarts: a policy that raises an OSError keeps the split in force like any
other failing policy; an embedded Redis whose restart fails once is tried again; a coordinator that finds Redis
refusing writes after an outage keeps serving; a URL or a config of the wrong kind gets a ConfigError, without the
URL's password."""
from __future__ import annotations

import logging
import os
import signal
import socket
import time

import pytest
import redis

from lbbsp import ConfigError, Coordinator, CoordinatorProcess, EmbeddedRedis, JobConfig, Report, Store, WorkerClient
from lbbsp.embedded import local_addresses, serve_embedded
from lbbsp.policies import BSPPolicy, Policy


class _GivesUp(Policy):
    """A custom policy whose solver runs under a time limit: ``concurrent.futures`` raises the builtin TimeoutError,
    an OSError, as a socket's timeout is."""

    def decide(self, iteration: int, current, config):  # type: ignore[no-untyped-def]
        raise TimeoutError("the solver ran past its time limit")


def test_a_policy_that_raises_an_os_error_keeps_the_split_and_is_not_taken_for_a_redis_outage(
        redis_url: str, job: str) -> None:
    """The guard re-raised every OSError as a Redis outage: nothing was written, the iteration was lost, and every
    worker waited assignment_timeout_s for a fallback at every step while the log said Redis was unavailable."""
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, _GivesUp())
        for worker, size in enumerate(config.initial_sizes()):
            store.post_report(Report(job, worker, 0, size, 0.01), config.num_workers)
        outcome = coordinator.step(1.0)
        assert outcome is not None and outcome.written
        assert outcome.assignment.sizes == config.initial_sizes() and "policy failed (TimeoutError" in \
            outcome.assignment.reason
        assert coordinator.failed_decisions == 1
        assert store.get_assignment(1) is not None
        store.forget()


def _answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=0.5) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def test_an_embedded_redis_whose_restart_failed_once_is_tried_again(caplog: pytest.LogCaptureFixture) -> None:
    """A restart that failed (its port taken meanwhile; or, after the OOM killer, killed again while it loads its
    append-only file) left the server stopped for good, as stop() does, with 4 of its 5 restarts unused."""
    with EmbeddedRedis(listen="127.0.0.1") as server, socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with caplog.at_level(logging.WARNING, logger="lbbsp.embedded"):
            with server._lock:  # the watch waits: the port is taken before it restarts the server
                os.kill(server.pid or 0, signal.SIGKILL)
                time.sleep(0.2)
                holder.bind(("127.0.0.1", server.port))
                holder.listen()
            deadline = time.monotonic() + 10
            while "could not start the embedded redis-server again" not in caplog.text:
                assert time.monotonic() < deadline, "the restart did not fail"
                time.sleep(0.05)
            holder.close()
            deadline = time.monotonic() + 10
            while not _answers(server.url):
                assert time.monotonic() < deadline, "the server was not started again once its port was free"
                time.sleep(0.1)


def test_a_coordinator_given_a_url_or_no_job_config_says_what_it_takes(redis_url: str, job: str) -> None:
    """Coordinator takes a Store where CoordinatorProcess takes a URL: a URL given had failed with AttributeError
    ('str' object has no attribute 'register'), as had a config that is not a JobConfig (WorkerClient says so)."""
    config = JobConfig(job, 2, 10)
    with pytest.raises(ConfigError, match=r"store must be a Store \(for a URL: Store\.from_url\(url, job\), or "
                                          r"CoordinatorProcess\(url, config\)\)"):
        Coordinator(redis_url, config)  # type: ignore[arg-type]
    with Store.from_url(redis_url, job) as store:
        with pytest.raises(ConfigError, match="config must be a JobConfig, got dict"):
            Coordinator(store, {"job": job, "num_workers": 2, "global_batch": 10})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="config must be a JobConfig, got str"):
        CoordinatorProcess(redis_url, job)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as caught:
        Coordinator("redis://:hunter2@10.0.0.5:6379/0", config)  # type: ignore[arg-type]
    assert "hunter2" not in str(caught.value) and "redis://:***@10.0.0.5" in str(caught.value)


def test_a_worker_client_given_a_url_keeps_its_password_out_of_the_error(job: str) -> None:
    """The URL was shown as given, password and all, in an error that ends up in logs and tracebacks."""
    with pytest.raises(ConfigError, match=r"store must be a Store") as caught:
        WorkerClient("redis://:hunter2@10.0.0.5:6379/0", JobConfig(job, 2, 10), 0)  # type: ignore[arg-type]
    assert "hunter2" not in str(caught.value) and "redis://:***@10.0.0.5" in str(caught.value)


def test_a_coordinator_that_finds_redis_refusing_writes_after_an_outage_keeps_serving(
        caplog: pytest.LogCaptureFixture) -> None:
    """After an outage (here a stall past the socket timeout), the coordinator rewrites its latest splits; a Redis
    that answered that with an error (out of memory, a read-only replica in a failover) ended the coordinator's
    thread, and every later step waited assignment_timeout_s for a fallback."""
    job = "refusing"
    config = JobConfig(job, 2, 10)
    with EmbeddedRedis() as server, Store.from_url(server.url, job, socket_timeout_s=0.1) as store, \
            Store.from_url(server.url, job) as workers:
        coordinator = Coordinator(store, config, BSPPolicy()).start()
        for k in range(2):
            for worker, size in enumerate(config.initial_sizes()):
                workers.post_report(Report(job, worker, k, size, 0.01), config.num_workers)
            deadline = time.monotonic() + 10
            while coordinator.decisions_made <= k:
                assert time.monotonic() < deadline, "no decision"
                time.sleep(0.01)
            if k == 0:
                workers.client.config_set("maxmemory", 1)  # every write refused: OOM
                with caplog.at_level(logging.ERROR, logger="lbbsp.coordinator"):
                    for _ in range(10):  # each stall ends in the rewrite about every other time
                        workers.client.execute_command("DEBUG", "SLEEP", "0.6")
                        time.sleep(0.2)
                        assert coordinator._thread is not None and coordinator._thread.is_alive()
                workers.client.config_set("maxmemory", 0)
        coordinator.stop()
        assert workers.get_assignment(3) is not None  # decided from iteration 1, after the refusals


def test_entries_of_the_ready_list_that_are_not_iterations_are_skipped_not_fatal(redis_url: str, job: str) -> None:
    """A number of over 4,300 digits on the ready list (only a foreign writer puts one there) made int() raise after
    the list had been emptied: the coordinator's step failed, and the iterations queued beside it were lost."""
    with Store.from_url(redis_url, job) as store:
        store.client.rpush(store.key("ready"), b"3", b"9" * 5000, b"junk", b"-1", b"5")
        assert store.drain_ready() == [3, -1, 5]  # a negative one is the coordinator's to refuse, with a warning
        store.client.rpush(store.key("ready"), b"9" * 5000, b"7")
        assert store.next_ready(1.0) is None and store.next_ready(1.0) == 7
        store.forget()


def test_a_host_that_cannot_be_looked_up_leaves_the_other_addresses_and_a_failed_offer_stops_the_server() -> None:
    """A peer host with a label over 63 characters (a bad MASTER_ADDR) raised a bare UnicodeError from the lookup,
    after worker 0's server had started: every worker raised, and the server ran on until this process exited."""
    assert local_addresses("a" * 64 + ".example")[-1] == "127.0.0.1"

    class Offers(EmbeddedRedis):  # a real server whose addresses fail, as any error there would
        def peer_urls(self, toward: str | None = None) -> list[str]:
            raise ConfigError("no address to offer")

    started: list[EmbeddedRedis] = []

    def start(listen: str | None) -> EmbeddedRedis:
        started.append(Offers(listen=listen))
        return started[-1]

    with pytest.raises(ConfigError, match="no address to offer"):
        serve_embedded(0, lambda value: [value], start, across=True)
    assert started and started[0].pid is None and not _answers(started[0].url)


def test_a_foreign_key_that_names_no_job_is_left_out_of_the_jobs_listed(redis_url: str, job: str) -> None:
    """A key of the config pattern whose middle is no job name (a space, a colon, bytes that are not UTF-8) made
    Store.jobs() yield it, and `lbbsp status` then failed for every job with "job name must match ..."."""
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 10))
        foreign = [b"lbbsp:a b:config", b"lbbsp:a:b:config", b"lbbsp:\xff:config"]
        for key in foreign:
            store.client.set(key, b"{}")
        try:
            assert job in set(store.jobs()) and not {"a b", "a:b"} & set(store.jobs())
        finally:
            store.client.delete(*foreign)
            store.forget()
