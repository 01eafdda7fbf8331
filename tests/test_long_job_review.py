"""A long job seen from Redis: what a worker's wait for a late decision leaves behind as the job goes on, and what the
coordinator says of keys that expired in a pause longer than ttl_s."""
from __future__ import annotations

import threading
import time

import pytest

from emulated import worker_clients
from lbbsp import Assignment, Coordinator, JobConfig, Store, WorkerClient


def _decided_later(store: Store, config: JobConfig, iteration: int, delay_s: float = 0.3) -> threading.Timer:
    """A coordinator that writes the split of ``iteration`` ``delay_s`` from now, so that a worker waits for it."""
    split = Assignment(config.job, iteration, (40, 24), "test", "late")
    timer = threading.Timer(delay_s, store.publish, [split])
    timer.start()
    return timer


def _announce(store: Store, config: JobConfig, iterations: range) -> None:
    """Write the splits of ``iterations`` as a coordinator does (each write announces its iteration)."""
    store.publish_all([Assignment(config.job, k, (32, 32), "test") for k in iterations])


def _reads(client: WorkerClient) -> list[int]:
    """Count the worker's reads of assignment keys (each a round trip to Redis)."""
    calls: list[int] = []
    read = client.store.get_assignment

    def counted(iteration: int) -> bytes | None:
        calls.append(iteration)
        return read(iteration)

    client.store.get_assignment = counted  # type: ignore[method-assign]
    return calls


def test_a_worker_that_waited_once_leaves_redis_no_announcements_to_hold(redis_url: str, job: str) -> None:
    """A worker that once waited for a late decision stayed subscribed to the job's announcements for good, and read
    none of them while its splits were written in time: Redis queued one for it at every write, about 60 bytes, up to
    its pubsub buffer limit (8 MB a worker, 8 GB at 1,024, before it dropped the connections)."""
    config = JobConfig(job, 2, 64, assignment_timeout_s=5.0)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as (worker, _):
        _decided_later(store, config, 2)
        assert worker.assignment(2).sizes == (40, 24)  # waited, and got the decision
        _announce(store, config, range(3, 4))
        assert worker.assignment(3).sizes == (32, 32)  # there at once, as from here on
        _announce(store, config, range(4, 20_004))  # the rest of a long job, decided in time
        held = sum(int(c["omem"]) for c in store.client.client_list())
        assert held < 16_384, f"Redis holds {held} bytes of announcements no worker reads"
        assert store.client.pubsub_numsub(store.key("assigned")) == [(store.key("assigned").encode(), 0)]


def test_a_worker_waiting_again_reads_only_when_its_own_split_is_announced(redis_url: str, job: str) -> None:
    """At its next wait, that worker went through every announcement queued since, reading Redis at each: 2,000
    round trips for 2,000 iterations decided in between. Announcements of other iterations (running ahead, a decision
    writes several) and the subscription's own confirmations are no cause to read either."""
    config = JobConfig(job, 2, 64, assignment_timeout_s=5.0)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as (worker, _):
        _decided_later(store, config, 2)
        assert worker.assignment(2).sizes == (40, 24)
        _announce(store, config, range(3, 2_003))
        assert worker.assignment(3).sizes == (32, 32)
        reads = _reads(worker)
        timer = _decided_later(store, config, 2_003)
        assert worker.assignment(2_003).sizes == (40, 24)
        timer.join()
        # before the write, after subscribing, each 0.25 s poll, and at its announcement
        assert len(reads) <= 5, f"{len(reads)} reads of Redis for one wait of 0.3 s"


class _Later:
    """The ``time`` module as the coordinator sees it, its monotonic clock ``ahead_s`` later: a pause without waiting."""

    def __init__(self, ahead_s: float) -> None:
        self.ahead_s = ahead_s

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead_s


def test_keys_that_expired_in_a_pause_longer_than_ttl_s_are_not_blamed_on_redis(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Workers that paused for longer than ttl_s (an evaluation, a checkpoint) found the coordinator warning that Redis
    had been restarted without persistence or flushed: the job's keys had expired, as ttl_s says they do."""
    config = JobConfig(job, 2, 64, ttl_s=10)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as clients:
        coordinator = Coordinator(store, config)
        for k in range(3):
            for i, client in enumerate(clients):
                client.report(k, client.assignment(k).sizes[i], 0.01 * (i + 1))
                client.flush()
            assert store.next_ready(1.0) == k
            coordinator.decide(k)
        monkeypatch.setattr("lbbsp.coordinator.time", _Later(config.ttl_s + 1))  # 11 s on, no decision since
        store.forget()  # what Redis's expiry did meanwhile
        with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
            coordinator.start()
            deadline = time.monotonic() + 3.0
            while "keys are gone" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            coordinator.stop()
        assert "keys are gone" in caplog.text and "flushed" not in caplog.text
        assert "expired: no decision for 11s, past the job's ttl_s (10s)" in caplog.text
        assert clients[0].assignment(4).fallback is False  # republished, as after a flush
