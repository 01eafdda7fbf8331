"""The worker's side of a job (WorkerClient): what it is given checked, waiting for its split and the subscription
that wakes it, fallbacks when the coordinator is late or a stored assignment is invalid, riding out a Redis outage,
and the fallbacks and reports it writes."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest

from emulated import rank0_agree, worker_clients
from lbbsp import (
    Assignment,
    ConfigError,
    Coordinator,
    EmbeddedRedis,
    JobConfig,
    LBBSPError,
    ProtocolError,
    Report,
    Store,
    StoreUnavailable,
    WorkerClient,
)
from lbbsp.policies import Decision, Policy
from lbbsp.store import REDIS_ERRORS, worker_socket_timeout


def test_a_worker_client_given_a_url_keeps_its_password_out_of_the_error(job: str) -> None:
    """The URL was shown as given, password and all, in an error that ends up in logs and tracebacks."""
    with pytest.raises(ConfigError, match=r"store must be a Store") as caught:
        WorkerClient("redis://:hunter2@10.0.0.5:6379/0", JobConfig(job, 2, 10), 0)  # type: ignore[arg-type]
    assert "hunter2" not in str(caught.value) and "redis://:***@10.0.0.5" in str(caught.value)


def test_a_worker_client_checks_what_it_is_given(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8)
    with Store.from_url(redis_url, job) as store:
        with pytest.raises(ConfigError, match=r"store must be a Store \(for a URL: Store.from_url"):
            WorkerClient(redis_url, config, 0)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="config must be a JobConfig"):
            WorkerClient(store, {"job": job}, 0)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="agree must be None or a function"):
            WorkerClient(store, config, 0, agree="x")  # type: ignore[arg-type]
        for device in (123, "x" * 100):
            with pytest.raises(ConfigError, match="device must be a string of at most 64"):
                WorkerClient(store, config, 0, device=device)  # type: ignore[arg-type]


def test_a_stored_assignment_of_another_iteration_is_refused(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8)
    with WorkerClient(Store.from_url(redis_url, job), config, 0) as worker:
        worker.store.publish(Assignment(job, 4, (6, 2), "p"))
        worker.store.client.set(worker.store.key("assign", 5), worker.store.get_assignment(4) or b"")
        with pytest.raises(LBBSPError, match="for iteration 4, not 5"):
            worker.assignment(5)
        worker.store.close()


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


def test_a_report_that_close_overtakes_is_refused_not_dropped_in_silence(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report() on another thread (torch's GPU report thread) that passed the closed check before close() ran had been
    queued behind the sender's stop marker: accepted, and never sent, without a word (13 of 300 such races)."""
    with Store.from_url(redis_url, job) as store:
        worker = WorkerClient(store, JobConfig(job, 2, 8), 0)
        to_json = Report.to_json

        def closed_meanwhile(report: Report) -> str:  # close() runs whole between report()'s check and its queueing
            closing = threading.Thread(target=worker.close)
            closing.start()
            closing.join(10)
            return to_json(report)

        monkeypatch.setattr(Report, "to_json", closed_meanwhile)
        with pytest.raises(LBBSPError, match="after close"):
            worker.report(0, 4, 0.1)
        assert store.reports(0) == {}


def test_close_stops_the_sender_with_several_reports_queued_in_an_outage(
        job: str, caplog: pytest.LogCaptureFixture) -> None:
    """Each queued report has assignment_timeout_s of its own: close had returned after assignment_timeout_s + 1 with
    the sender still retrying the rest, which it then posted, through the store its owner had closed, once Redis was
    back. Now what is still queued then is dropped, and said so."""
    config = JobConfig(job, 2, 64, assignment_timeout_s=1.0)
    with EmbeddedRedis() as server:
        store = Store.from_url(server.url, job, socket_timeout_s=0.3)
        worker = WorkerClient(store, config, 0)
        server.stop()
        for k in range(4):
            worker.report(k, 32, 0.01)
        with caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
            worker.close()
        alive = worker._sender.is_alive()
        store.close()
        server.start()
        time.sleep(1.5)
        with Store.from_url(server.url, job) as fresh:
            posted = [k for k in range(4) if fresh.reports(k)]
    assert not alive and posted == [], (alive, posted)
    assert any("those still queued are dropped" in r.getMessage() for r in caplog.records), caplog.text


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


def test_a_report_redis_py_sent_again_is_not_warned_about_as_reported_twice(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis stall past the socket timeout has redis-py send the report script again within one call, after
    Redis ran the first send: the call answers "already stored", and that had been warned about as a job name run
    twice. The resend is made here: each post is sent twice, and answers as the second send does."""
    config = JobConfig(job, 2, 8)
    with WorkerClient(Store.from_url(redis_url, job), config, 0) as worker:
        store = worker.store
        post, answers = store.post_report, []

        def sent_twice(report: Report, num_workers: int) -> bool:
            post(report, num_workers)
            answers.append(post(report, num_workers))
            return answers[-1]

        monkeypatch.setattr(store, "post_report", sent_twice)
        worker.report(0, 4, 0.1)
        worker.flush()
        assert answers == [False] and "reported already" not in caplog.text
        sent = Report.from_json(store.reports(0)[b"0"])
        assert store.holds(sent) and not store.holds(dataclasses.replace(sent, compute_s=0.2))
        monkeypatch.setattr(store, "post_report", post)
        worker.report(0, 4, 0.2)  # another report of iteration 0 is still warned about
        worker.flush()
        assert "iteration 0 was reported already" in caplog.text
        store.close()


def _run(clients: list, iterations: range) -> None:
    """Every worker fetches and reports each of ``iterations``, worker 1 three times slower."""
    for k in iterations:
        for i, client in enumerate(clients):
            size = client.assignment(k).sizes[i]
            client.report(k, size, size / (100.0 * (1 + 2 * i)))


@pytest.mark.timeout(30)
def test_a_worker_whose_iteration_jumps_ahead_is_told_so(redis_url: str, job: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Iterations 0-5, then 1000: the warning said "the previous split is used; is a coordinator running?" while the
    coordinator ran and the split used was the equal one, not iteration 5's. It now names the jump and its cause."""
    config = JobConfig(job, 2, 128, assignment_timeout_s=0.3)
    coordinator = Coordinator(Store.from_url(redis_url, job), config).start()
    try:
        with worker_clients(redis_url, config) as clients:
            _run(clients, range(6))
            assert clients[0].assignment(5).sizes != config.initial_sizes()  # rebalanced: "previous" is not equal
            with caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
                jumped = clients[0].assignment(1000)
    finally:
        coordinator.stop()
        coordinator.store.close()
    assert jumped.fallback and jumped.sizes == config.initial_sizes()  # which vector: unchanged
    warning = [r.getMessage() for r in caplog.records if "iteration 1000" in r.getMessage()]
    assert warning and "iteration 1000 is 995 past this worker's last (5): k must count up by one, across epochs " \
        "too; the equal split is used" in warning[0], caplog.text
    assert "coordinator running" not in warning[0]


@pytest.mark.timeout(30)
def test_a_late_decision_says_which_split_is_used(redis_url: str, job: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """With no coordinator: a worker that knows iteration k-1's split says it uses that one; one that knows none says
    the equal split (it had said "the previous split" either way)."""
    config = JobConfig(job, 2, 128, assignment_timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
        with worker_clients(redis_url, config) as clients:
            _run(clients, range(2))  # iterations below lag take the initial split, with no wait
            clients[0].assignment(2)
        with worker_clients(redis_url, config) as fresh:  # a worker started (or restarted) at iteration 9
            fresh[1].assignment(9)
    messages = [r.getMessage() for r in caplog.records]
    assert any("no decision for iteration 2 within 0.2s, so the split of iteration 1 is used" in m
               for m in messages), messages
    assert any("no decision for iteration 9 within 0.2s, so the equal split is used (this worker knows no split "
               "before it)" in m for m in messages), messages


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


@pytest.mark.timeout(30)
@pytest.mark.parametrize("iteration", [0, 5])  # 0: the initial split's write-once path (publish_or_read)
def test_a_wrong_typed_assign_key_is_an_invalid_assignment_for_a_worker_not_redis_down(
        redis_url: str, job: str, iteration: int) -> None:
    """Without agree, the worker had waited outage_s and raised StoreUnavailable ("bring Redis back"); it is the key's
    value that is wrong, which lbbsp's invalid-assignment path names. With agree, the worker falls back."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.5, ttl_s=60)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        store.client.hset(store.key("assign", iteration), "x", "y")
        lone = WorkerClient(Store.from_url(redis_url, job), config, 0, outage_s=3.0)
        agreed = WorkerClient(Store.from_url(redis_url, job), config, 1, agree=lambda a: a)
        try:
            started = time.monotonic()
            with pytest.raises(LBBSPError) as raised:
                lone.assignment(iteration)
            waited = time.monotonic() - started
            fallback = agreed.assignment(iteration)
        finally:
            for worker in (lone, agreed):
                worker.close()
                worker.store.close()
    assert not isinstance(raised.value, StoreUnavailable) and waited < 2.0, (waited, raised.value)
    assert store.key("assign", iteration) in str(raised.value) and "another type" in str(raised.value)
    assert fallback.fallback and fallback.sizes == config.initial_sizes()


@pytest.mark.timeout(30)
def test_a_report_to_a_wrong_typed_key_is_dropped_at_once_naming_it_and_the_next_goes_through(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """The report thread had retried WRONGTYPE, which no retry clears, for assignment_timeout_s, holding up the
    reports behind it, then dropped it as "(a stall)"."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=5.0, ttl_s=60)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        store.client.set(store.key("reports", 0), "not a hash")
        worker = WorkerClient(Store.from_url(redis_url, job), config, 0)
        try:
            with caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
                started = time.monotonic()
                worker.report(0, 5, 0.1)
                worker.report(1, 5, 0.1)
                while store.raw_report(1, 0) is None:
                    assert time.monotonic() - started < 2.0, "the next report waited behind the dropped one"
                    time.sleep(0.01)
        finally:
            worker.close()
            worker.store.close()
    said = [r.getMessage() for r in caplog.records if "dropped the report of iteration 0" in r.getMessage()]
    assert len(said) == 1 and store.key("reports", 0) in said[0] and "another type" in said[0], said


def _written_later(store: Store, assignment: Assignment, delay_s: float) -> tuple[threading.Thread, list[float]]:
    """Write ``assignment`` ``delay_s`` from now, as a coordinator does (once Redis answers); the list gets the time of
    the write."""
    written: list[float] = []

    def write() -> None:
        time.sleep(delay_s)
        deadline = time.monotonic() + 5.0
        while True:
            try:
                store.publish(assignment)
                break
            except REDIS_ERRORS:  # a Redis still restarting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        written.append(time.monotonic())

    thread = threading.Thread(target=write)
    thread.start()
    return thread, written


def test_a_worker_wakes_at_its_split_whatever_it_did_at_the_iterations_before(redis_url: str, job: str) -> None:
    """Waits and iterations decided in time, in random order, splits written within a few milliseconds of the
    worker's first read (between it and the subscription taking effect), and announcements of iterations ahead left
    unread between waits: each wait ends within milliseconds of its split's write, never at a 0.25 s poll."""
    config = JobConfig(job, 2, 64, assignment_timeout_s=5.0)
    rng = random.Random(1)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as (worker, _):
        slowest = 0.0
        k = 2
        while k < 150:
            if rng.random() < 0.4:  # decided in time
                store.publish(Assignment(job, k, (32, 32), "test"))
                assert worker.assignment(k).sizes == (32, 32)
                k += 1
                continue
            ahead = rng.randint(0, 3)  # announcements of the iterations after it, written just after its own
            thread, written = _written_later(store, Assignment(job, k, (40, 24), "test"), rng.uniform(0, 0.004))
            assert worker.assignment(k).sizes == (40, 24)
            returned = time.monotonic()
            thread.join()
            slowest = max(slowest, returned - written[0])
            store.publish_all([Assignment(job, j, (32, 32), "test") for j in range(k + 1, k + 1 + ahead)])
            k += 1 + ahead
        assert slowest < 0.15, f"a wait ended {slowest:.3f} s after its split was written"


def test_a_worker_whose_subscription_connection_was_cut_between_waits_still_wakes_at_once(redis_url: str,
                                                                                         job: str) -> None:
    """The subscription's connection cut by Redis (CLIENT KILL, a proxy's idle timeout) while the worker computed:
    the unsubscribe at the next split found at once goes to a dead connection, and the wait after it still ends at
    its split's write, and leaves no subscriber behind once splits come in time again."""
    config = JobConfig(job, 2, 64, assignment_timeout_s=5.0)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as (worker, _):
        key = store.key("assigned").encode()
        thread, written = _written_later(store, Assignment(job, 2, (40, 24), "test"), 0.05)
        assert worker.assignment(2).sizes == (40, 24)
        thread.join()
        assert store.client.client_kill_filter(_type="pubsub") >= 1
        store.publish(Assignment(job, 3, (32, 32), "test"))
        assert worker.assignment(3).sizes == (32, 32)  # found at once: the unsubscribe goes to the cut connection
        thread, written = _written_later(store, Assignment(job, 4, (40, 24), "test"), 0.05)
        assert worker.assignment(4).sizes == (40, 24)
        returned = time.monotonic()
        thread.join()
        assert returned - written[0] < 0.15
        store.publish(Assignment(job, 5, (32, 32), "test"))
        assert worker.assignment(5).sizes == (32, 32)
        deadline = time.monotonic() + 2.0
        while store.client.pubsub_numsub(key) != [(key, 0)] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.client.pubsub_numsub(key) == [(key, 0)]


def test_a_split_written_between_the_first_read_and_the_subscription_wakes_the_worker_at_once(
        redis_url: str, job: str) -> None:
    """The lost wake-up a subscription after a read invites: the split written after the worker found none and
    before Redis took its SUBSCRIBE is announced to no one. Read again at the confirmation, it ends the wait at once,
    at a first wait and at one after iterations decided in time (a subscription stopped and taken up again)."""
    config = JobConfig(job, 2, 64, assignment_timeout_s=5.0)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as (worker, _):
        subscribe = worker.store.subscribe

        def written_first(*args: object) -> object:
            store.publish(Assignment(job, pending[0], (40, 24), "test"))
            return subscribe(*args)

        worker.store.subscribe = written_first  # type: ignore[method-assign]
        for k in (2, 4):
            pending = [k]
            started = time.monotonic()
            assert worker.assignment(k).sizes == (40, 24)
            assert time.monotonic() - started < 0.15
            store.publish(Assignment(job, k + 1, (32, 32), "test"))
            assert worker.assignment(k + 1).sizes == (32, 32)  # in time: the subscription stops


@pytest.mark.parametrize("returns", ["none", "sizes", "other iteration", "other batch"])
def test_an_agree_that_returns_no_assignment_of_the_iteration_is_a_config_error(redis_url: str, job: str,
                                                                                returns: str) -> None:
    """A None or a tuple ended in "AttributeError: 'NoneType' object has no attribute 'iteration'"; an assignment of
    another iteration or global batch was every worker's split, unchecked."""
    config = JobConfig(job, 2, 10, lag=1)
    wrong = {"none": lambda a: None, "sizes": lambda a: a.sizes,
             "other iteration": lambda a: Assignment(job, a.iteration + 1, a.sizes, "fallback"),
             "other batch": lambda a: Assignment(job, a.iteration, (6, 6), "fallback")}[returns]
    with Store.from_url(redis_url, job) as store, WorkerClient(store, config, 0, agree=wrong) as worker:
        with pytest.raises(ConfigError, match="agree returned") as raised:
            worker.assignment(0)
        assert raised.value.iteration == 0
        assert worker.peek(1) is None or worker.peek(1).iteration == 1  # nothing wrong was remembered


class Constant(Policy):
    """Decides one split, always: whose decisions a worker got shows in its sizes."""

    name = "constant"

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return Decision(self.sizes, "constant")


@contextlib.contextmanager
def _two_workers(url: str, job: str, *, agree: bool) -> Iterator[list[WorkerClient]]:
    """Two workers of a job of global batch 10 (lag 1), with rank 0's ``agree`` if ``agree``."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.5, lag=1)
    rank0 = rank0_agree()
    workers = [WorkerClient(Store.from_url(url, job), config, w, agree=rank0(w) if agree else None) for w in range(2)]
    try:
        yield workers
    finally:
        for worker in workers:
            worker.close()
            worker.store.close()


def _negative_size(job: str) -> bytes:
    payload = json.loads(Assignment(job, 2, (6, 4), "other").to_json())
    return json.dumps({**payload, "sizes": [100, -52]}).encode()


@pytest.mark.parametrize("garbage", ["text", "negative"])
def test_with_agree_an_invalid_stored_assignment_falls_back_agreed_and_names_the_key(
        redis_url: str, job: str, garbage: str, caplog: pytest.LogCaptureFixture) -> None:
    """A value that something else wrote at assign:{k} had stopped every rank with 'stored assignment is invalid',
    naming no key. With agree, the workers use the previous vector, agreed, and go on at the next iteration."""
    with _two_workers(redis_url, job, agree=True) as workers, caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
        store = workers[0].store
        store.publish(Assignment(job, 1, (7, 3), "decided"))
        store.client.set(store.key("assign", 2), b"garbage" if garbage == "text" else _negative_size(job))
        store.publish(Assignment(job, 3, (6, 4), "decided"))
        got = [[worker.assignment(k) for worker in workers] for k in (1, 2, 3)]
    assert [[a.sizes for a in row] for row in got] == [[(7, 3)] * 2, [(7, 3)] * 2, [(6, 4)] * 2]
    fallback = got[1][0]
    assert fallback.fallback and got[1][1] is fallback
    assert f"{store.key('assign', 2)} is invalid" in fallback.reason
    assert not got[2][0].fallback
    warned = [r.getMessage() for r in caplog.records if store.key("assign", 2) in r.getMessage()]
    assert warned and "not written by lbbsp" in warned[0] and "delete the key" in warned[0], warned


def test_without_agree_an_invalid_stored_assignment_raises_naming_the_key(redis_url: str, job: str) -> None:
    """Without agree no worker can fall back alone; the error had said 'stored assignment is invalid: payload:
    assignment is not valid JSON', without the key or what to do."""
    with _two_workers(redis_url, job, agree=False) as workers:
        store = workers[0].store
        store.client.set(store.key("assign", 2), b"garbage")
        for worker in workers:
            with pytest.raises(LBBSPError, match=rf"Redis key {store.key('assign', 2)} .*delete the key"):
                worker.assignment(2)


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Wait for ``condition`` (a coordinator thread's first claim, its decision), failing the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.02)


def test_a_job_no_coordinator_serves_falls_back_without_waiting_until_one_claims_it(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """After its coordinator stopped, every step of a job waited the whole assignment_timeout_s, for good (3.04 s a
    step with a 3 s timeout). Now the first late step waits, the next fall back at once while no coordinator claims the
    job, and once one does the workers get its decisions again."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.5, lag=1)
    workers = [WorkerClient(Store.from_url(redis_url, job), config, w) for w in range(2)]
    first = Coordinator(Store.from_url(redis_url, job), config, Constant((7, 3)), max_ahead=1).start()
    second = Coordinator(Store.from_url(redis_url, job), config, Constant((6, 4)), max_ahead=1)

    def step(k: int) -> tuple[Assignment, float]:
        started = time.monotonic()
        got = [worker.assignment(k) for worker in workers]
        waited = time.monotonic() - started
        assert got[0].sizes == got[1].sizes, k
        for worker in workers:
            worker.report(k, got[0].sizes[worker.worker], 0.01)
            worker.flush()
        return got[0], waited

    try:
        store = workers[0].store
        _until(lambda: store.coordinator() is not None, "the coordinator's claim")
        for k in range(4):
            step(k)
        _until(lambda: store.get_assignment(4) is not None, "the decision from the reports of 3")
        first.stop()
        assert store.coordinator() is None  # its claim released as it stopped
        with caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
            decided = step(4)[0]
            assert decided.sizes == (7, 3) and not decided.fallback
            late, waited = step(5)
            assert late.fallback and "waited" in late.reason and waited >= 0.45
            unserved = [step(k) for k in range(6, 11)]
        assert all(a.fallback and "no coordinator serves" in a.reason for a, _ in unserved), unserved
        assert sum(w for _, w in unserved) < 2 * config.assignment_timeout_s, unserved  # each had waited 0.5 s
        assert [a.sizes for a, _ in unserved] == [(7, 3)] * 5
        warned = [r.getMessage() for r in caplog.records if "no coordinator serves" in r.getMessage()]
        assert len(warned) == 1 and f"lbbsp coordinator --job {job}" in warned[0], warned
        # its coordinator stopped and released the claim: not "none has claimed it for 5 s", which it had said
        assert "its coordinator stopped, or never started" in warned[0] and "for 5 s" not in warned[0], warned
        second.start()
        _until(lambda: store.coordinator() is not None, "the second coordinator's claim")
        resumed = [step(k)[0] for k in range(11, 14)]
        assert resumed[-1].sizes == (6, 4) and not resumed[-1].fallback, resumed
    finally:
        for coordinator in (first, second):
            coordinator.stop()
            coordinator.store.close()
        for worker in workers:
            worker.close()
            worker.store.close()


def test_the_warning_of_a_dropped_report_names_the_job_and_the_worker(job: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Two ranks printed the same line, 'dropped the report of iteration N ...', naming neither."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.2)
    with EmbeddedRedis() as server:
        workers = [WorkerClient(Store.from_url(server.url, job), config, w) for w in range(2)]
        server.stop()
        try:
            with caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
                for worker in workers:
                    worker.report(0, 5, 0.1)
                    worker.flush(3.0)
        finally:
            for worker in workers:
                worker.close()
                worker.store.close()
    dropped = sorted(r.getMessage() for r in caplog.records if "dropped the report" in r.getMessage())
    assert len(dropped) == 2 and all(line.startswith(f"job {job}, worker {w}: ") for w, line in enumerate(dropped))


def test_a_decision_stored_while_no_coordinator_claims_the_job_makes_the_worker_wait_again(
        redis_url: str, job: str) -> None:
    """A Coordinator driven by step() alone holds no claim: once one of its decisions came late, its workers would have
    stopped waiting for good. A decision found stored shows that something decides: the next step waits for it."""
    with _two_workers(redis_url, job, agree=False) as workers:
        worker, store = workers[0], workers[0].store
        assert worker.assignment(1).fallback  # waited, and no coordinator claims the job
        assert worker.assignment(2).fallback  # not waited for
        store.publish(Assignment(job, 3, (7, 3), "decided"))
        assert worker.assignment(3).sizes == (7, 3)
        timer = threading.Timer(0.1, store.publish, [Assignment(job, 4, (6, 4), "decided")])
        timer.start()
        try:
            got = worker.assignment(4)
        finally:
            timer.join()
    assert (got.sizes, got.fallback) == ((6, 4), False), got


class ConstantSplit(Policy):
    """Decides (7, 3), always: the coordinator's decisions show in the policy name and the fallback flag."""

    name = "constant"

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return Decision((7, 3), "constant")


def test_fallbacks_used_while_redis_was_down_are_written_once_it_is_back(job: str,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """With agree, the workers ran iterations on the previous vector while Redis was down and wrote nothing. Once it
    was back their reports completed those iterations, which had no assignment: the coordinator refused them ('have no
    assignment ... not deciding from them'), so the next step waited its whole assignment_timeout_s and fell back
    again; and the coordinator then wrote its own decisions for iterations the workers had run on the fallback."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.8, lag=1)
    rank0 = rank0_agree()
    with EmbeddedRedis() as server, caplog.at_level(logging.WARNING):
        timeout = worker_socket_timeout(config.assignment_timeout_s)
        workers = [WorkerClient(Store.from_url(server.url, job, socket_timeout_s=timeout), config, w, agree=rank0(w))
                   for w in range(2)]
        coordinator = Coordinator(Store.from_url(server.url, job), config, ConstantSplit(), max_ahead=1).start()

        def assignment(k: int) -> Assignment:
            used = [worker.assignment(k) for worker in workers]
            assert used[0] == used[1]
            return used[0]

        def report(assigned: Assignment) -> None:
            for worker, size in zip(workers, assigned.sizes):
                worker.report(assigned.iteration, size, 0.01)

        def step(k: int) -> Assignment:
            report(used := assignment(k))
            return used

        try:
            assert [step(k).fallback for k in range(2)] == [False] * 2
            assert not (last := assignment(2)).fallback
            server.stop()  # before the reports of 2: no decision of 3 is written that no worker could read
            report(last)  # dropped: the outage lasts past the bound
            outage = [step(k) for k in (3, 4)]  # 3 waits its bound, 4 falls back at once
            server.start()  # within the bound of the reports of 3 and 4: they are sent
            after = [step(k) for k in (5, 6)]
            for worker in workers:
                worker.flush()
        finally:
            coordinator.stop()
            for worker in workers:
                worker.close()
                worker.store.close()
            coordinator.store.close()
        with Store.from_url(server.url, job) as store:
            stored = [store.get_assignment(k) for k in (3, 4)]
    assert all(a.fallback and a.reason.startswith("Redis unusable") for a in outage), outage
    assert [None if raw is None else Assignment.from_json(raw) for raw in stored] == outage
    refused = [r.getMessage() for r in caplog.records if "have no assignment" in r.getMessage()]
    assert not refused, refused
    assert [(a.fallback, a.policy) for a in after] == [(False, "constant")] * 2, after


def test_a_long_outage_writes_only_the_latest_fallbacks(job: str) -> None:
    """What a worker keeps to write is bounded: the latest 2 * (lag + 16) vectors of an outage, the older dropped."""
    config = JobConfig(job, 1, 10, assignment_timeout_s=0.3, lag=1)
    with EmbeddedRedis() as server, Store.from_url(server.url, job) as store, \
            WorkerClient(store, config, 0) as worker:  # alone, a worker falls back without agree
        worker.assignment(0)
        server.stop()
        assert all(worker.assignment(k).fallback for k in range(1, 41))  # 40 fallbacks, the cap 34
        server.start()
        worker.report(40, 10, 0.01)
        worker.flush()
        assert [k for k in range(1, 41) if store.get_assignment(k) is not None] == list(range(7, 41))




def _client(server: EmbeddedRedis, config: JobConfig, worker: int = 0, **kwargs: object) -> WorkerClient:
    """A worker connected as the integrations connect: a socket timeout of a third of assignment_timeout_s."""
    store = Store.from_url(server.url, config.job, socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
    return WorkerClient(store, config, worker, **kwargs)  # type: ignore[arg-type]


def _stall(server: EmbeddedRedis, sig: signal.Signals = signal.SIGSTOP) -> None:
    assert server.pid is not None
    os.kill(server.pid, sig)


def _close(client: WorkerClient) -> None:
    client.close()
    client.store.close()


def _steps(client: WorkerClient, first: int, until: float, sizes: list[int]) -> tuple[list[float], list[Assignment],
                                                                                        StoreUnavailable | None]:
    """Run steps from ``first`` (a 10 ms step, its report, the next assignment) until ``until`` or an error: each
    assignment's time, what it returned, and the StoreUnavailable that ended them, if one did."""
    took: list[float] = []
    used: list[Assignment] = []
    k = first
    while time.monotonic() < until:
        time.sleep(0.01)
        client.report(k - 1, sizes[0], 0.01)
        began = time.monotonic()
        try:
            used.append(client.assignment(k))
        except StoreUnavailable as exc:
            return took, used, exc
        took.append(time.monotonic() - began)
        k += 1
    return took, used, None


def test_the_only_worker_trains_on_through_a_stall_without_its_timeouts_and_stops_at_outage_s(
        server: EmbeddedRedis, job: str) -> None:
    """Before: a lone worker fell back at every step, but each step paid the stalled Redis's socket timeouts (three of
    them: 10 s with the default assignment_timeout_s, here 0.6 s) and outage_s did nothing: it never stopped (in Keras,
    5-10 s a step of 15 ms, for ever). Now the first step waits its bound, the next ones do not ask Redis, and about
    outage_s after the stall began the worker asks once more and raises StoreUnavailable."""
    config = JobConfig(job, 1, 8, assignment_timeout_s=0.6, lag=1)
    client = _client(server, config, outage_s=3.0)
    try:
        assert [client.assignment(k).sizes for k in range(3)] == [(8,)] * 3
        _stall(server)
        stalled = time.monotonic()
        took, used, error = _steps(client, 3, stalled + 12.0, [8])
        ended = time.monotonic() - stalled
    finally:
        _stall(server, signal.SIGCONT)
        _close(client)
    assert error is not None, f"no StoreUnavailable {ended:.1f}s into the stall (outage_s 3); steps took {took[-5:]}"
    assert 3.0 <= ended <= 5.5, ended
    slow = [t for t in took if t > 0.1]
    assert len(slow) <= 1, f"{len(slow)} of {len(took)} steps asked the stalled Redis: {slow}"
    assert len(used) >= 50, len(used)  # steps of about 10 ms for most of 3 s
    assert all(a.sizes == (8,) and a.fallback for a in used), used[:3]
    assert [a.iteration for a in used] == list(range(3, 3 + len(used)))  # one vector per iteration, none skipped
    assert "only worker" in str(error) and "outage_s=" in str(error) and "agree=" not in str(error), error


def test_the_only_worker_asks_redis_again_once_it_answers(server: EmbeddedRedis, job: str) -> None:
    """The steps that do not ask Redis end once it answers (the reports that reach it, or the sender's ping, tell):
    the worker reads Redis again, and the latest vectors it used meanwhile are written to their keys. The reports of
    the iterations whose vectors were too old to keep are not sent (hundreds, with steps that no longer wait)."""
    config = JobConfig(job, 1, 8, assignment_timeout_s=0.6, lag=1)
    client = _client(server, config, outage_s=60.0)
    try:
        assert [client.assignment(k).sizes for k in range(3)] == [(8,)] * 3
        _stall(server)
        took, during, error = _steps(client, 3, time.monotonic() + 2.5, [8])
        assert error is None
        _stall(server, signal.SIGCONT)
        resumed = time.monotonic()
        after: list[Assignment] = []
        k = during[-1].iteration + 1
        while time.monotonic() < resumed + 3.0:
            time.sleep(0.01)
            client.report(k - 1, 8, 0.01)
            after.append(client.assignment(k))
            if not after[-1].reason.startswith("Redis unusable"):
                break
            k += 1
        back = time.monotonic() - resumed
        client.flush()
        with Store.from_url(server.url, job) as store:
            stored = [store.get_assignment(a.iteration) for a in during[-3:]]
            dropped = [a.iteration for a in during[:-2 * (config.lag + 16)]]  # the vectors too old to be written
            # a report with no assignment stored (one in flight as Redis came back wrote its vector first)
            reported = [k for k in dropped if store.reports(k) and store.get_assignment(k) is None]
    finally:
        _close(client)
    assert len([t for t in took if t > 0.1]) <= 1, took
    assert not after[-1].reason.startswith("Redis unusable"), after[-3:]
    assert back < 2.0, back
    assert [None if raw is None else Assignment.from_json(raw) for raw in stored] == during[-3:]
    # their iterations are not reported: the coordinator refused each as having no assignment, with a warning
    assert len(dropped) >= 50 and not reported, (len(dropped), reported[:5])


def test_the_only_worker_with_agree_rides_out_a_stall_without_its_timeouts(server: EmbeddedRedis, job: str) -> None:
    """With agree (the PyTorch Balancer of one rank), the steps of a stall do not ask Redis either, and outage_s does
    not stop it (an agreed fallback is safe for as long as the outage lasts)."""
    config = JobConfig(job, 1, 8, assignment_timeout_s=0.6, lag=1)
    client = _client(server, config, agree=lambda a: a, outage_s=0.6)
    try:
        assert client.assignment(1).sizes == (8,)
        _stall(server)
        took, used, error = _steps(client, 2, time.monotonic() + 2.5, [8])
    finally:
        _stall(server, signal.SIGCONT)
        _close(client)
    assert error is None
    assert len([t for t in took if t > 0.1]) <= 1, took
    assert len(used) >= 50, len(used)


def test_a_report_answered_before_the_stall_but_noted_after_it_does_not_end_the_ride_out(
        server: EmbeddedRedis, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender noted Redis as answering when a report's answer reached it, not when the report was sent: a report
    answered just before the stall, its thread scheduled late, told the next step that Redis answered again, and that
    step waited out the stalled Redis's socket timeout (a Keras test saw a second slow step of 0.5 s). An answer now
    counts from the time its request was sent."""
    config = JobConfig(job, 1, 8, assignment_timeout_s=0.6, lag=1)
    client = _client(server, config, outage_s=60.0)
    posted, failed = threading.Event(), threading.Event()
    post = client.store.post_report

    def late(*args: object, **kwargs: object) -> bool:
        stored = post(*args, **kwargs)  # type: ignore[arg-type]
        posted.set()
        failed.wait(10.0)  # the answer came before the stall; the thread goes on only after the step has failed
        return stored

    try:
        assert client.assignment(1).sizes == (8,)
        monkeypatch.setattr(client.store, "post_report", late)
        client.report(1, 8, 0.01)
        assert posted.wait(10.0)
        _stall(server)
        first = client.assignment(2)
        failed.set()
        client.flush(10.0)  # the sender notes the answer
        after = client.assignment(3)
    finally:
        failed.set()
        _stall(server, signal.SIGCONT)
        _close(client)
    assert first.fallback and first.reason == "Redis unusable (TimeoutError)", first
    assert after.fallback and after.reason == "Redis unusable (not asked: no answer since the last failure)", after


def test_several_workers_still_wait_and_the_error_names_the_callers_way_out(server: EmbeddedRedis, job: str) -> None:
    """Several workers without agree wait for Redis up to outage_s, as before; the error ends with the caller's
    hint where it gives one (WorkerSession takes no agree=, which the core's own hint names)."""
    config = JobConfig(job, 2, 8, assignment_timeout_s=0.6, lag=1)
    plain = _client(server, config, 0, outage_s=0.6)
    hinted = _client(server, config, 1, outage_s=0.6, outage_hint="bring Redis back, or call us")
    try:
        _stall(server)
        errors = []
        for client in (plain, hinted):
            began = time.monotonic()
            with pytest.raises(StoreUnavailable) as caught:
                client.assignment(4)
            assert time.monotonic() - began < 3.0
            errors.append(str(caught.value))
    finally:
        _stall(server, signal.SIGCONT)
        _close(plain)
        _close(hinted)
    assert "give WorkerClient agree=" in errors[0] and "without an agree function" in errors[0], errors[0]
    assert "cannot fall back safely" in errors[1] and "so it stops: bring Redis back, or call us [" in errors[1]
    assert "agree" not in errors[1], errors[1]
    with pytest.raises(Exception, match="outage_hint must be None or a string"):
        _client(server, config, 0, outage_hint=3)


def test_a_peek_in_the_only_workers_outage_does_not_ask_the_stalled_redis(server: EmbeddedRedis, job: str) -> None:
    """The torch integration's prefetch peeks at the next iteration on a thread of its own each step: riding out the
    stall, each peek had waited out three socket timeouts, and a lone rank's prefetch threads piled up to the pool's
    100 connections. A peek now returns None at once while Redis has not answered since it
    last failed."""
    config = JobConfig(job, 1, 8, assignment_timeout_s=0.6, lag=2)
    client = _client(server, config, agree=lambda a: a, outage_s=60.0)
    try:
        for k in range(4):
            client.assignment(k)
            client.report(k, 8, 0.01)
        _stall(server)
        client.assignment(4)  # waits its bound, falls back: the outage begins
        began = time.monotonic()
        assert client.peek(6) is None
        assert time.monotonic() - began < 0.1
    finally:
        _stall(server, signal.SIGCONT)
        _close(client)


def test_a_peek_gives_the_vector_the_worker_used_and_none_for_what_is_not_a_vector(store: Store, job: str) -> None:
    """A peek at an iteration the worker ran gives the vector it used, without asking Redis (its key deleted here);
    one whose key holds what lbbsp does not write is None, not an error on the prefetch thread: the step's own
    assignment() then says what is wrong."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.3, lag=1)
    with WorkerClient(store, config, 0) as client:
        used = client.assignment(1)
        store.client.delete(store.key("assign", 1))
        assert client.peek(1) == used
        store.client.set(store.key("assign", 3), b"not an assignment")
        assert client.peek(3) is None
        assert client.peek(4) is None  # nothing stored yet


def test_the_only_worker_that_sends_nothing_finds_redis_back_by_the_senders_ping(
        server: EmbeddedRedis, job: str) -> None:
    """Steps that report nothing while Redis is back (a long evaluation, steps slower than the sender's 0.5 s idle
    wait): the sender's ping, not a report, tells that Redis answers again, and the next step asks it (here: no
    coordinator, so it waits its bound and falls back for that, not for an unusable Redis)."""
    config = JobConfig(job, 1, 8, assignment_timeout_s=0.6, lag=1)
    client = _client(server, config, outage_s=60.0)
    try:
        assert client.assignment(0).sizes == (8,)
        _stall(server)
        assert client.assignment(1).reason.startswith("Redis unusable")  # waits its bound: the outage begins
        assert client.assignment(2).reason.startswith("Redis unusable")  # rides it out, Redis not asked
    finally:
        _stall(server, signal.SIGCONT)
    try:
        time.sleep(2.0)  # a few idle turns of the sender: pings
        began = time.monotonic()
        back = client.assignment(3)
        waited = time.monotonic() - began
    finally:
        _close(client)
    assert back.reason.startswith("coordinator late"), back
    assert waited >= 0.5, waited


def test_the_only_worker_closed_in_a_stall_returns_at_once_and_says_what_it_did_not_send(
        server: EmbeddedRedis, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """The job's only worker, closed in a Redis outage (a stall: the server accepts and answers nothing): close returns
    without waiting out its reports' retries (it had waited assignment_timeout_s + 1, 11 s with the default, for reports
    that Redis was not taking), drops them, and says so; none but the one being sent reaches Redis afterwards."""
    config = JobConfig(job, 1, 8, assignment_timeout_s=3.0, lag=1)
    store = Store.from_url(server.url, job, socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
    client = WorkerClient(store, config, 0, outage_s=60.0)
    assert server.pid is not None
    try:
        assert [client.assignment(k).sizes for k in range(3)] == [(8,)] * 3
        os.kill(server.pid, signal.SIGSTOP)
        for k in range(3, 6):  # the first step after the stall finds Redis unusable; the next ones do not ask it
            client.report(k - 1, 8, 0.01)
            assert client.assignment(k).fallback
        client.report(5, 8, 0.01)
        began = time.monotonic()
        with caplog.at_level(logging.INFO, logger="lbbsp.worker"):
            client.close()
        took = time.monotonic() - began
        os.kill(server.pid, signal.SIGCONT)
        time.sleep(1.5)  # the sender's attempt in progress ends: after close, it sends nothing more
        arrived = [k for k in range(2, 6) if store.reports(k)]
    finally:
        os.kill(server.pid, signal.SIGCONT)
        client.close()
        store.close()
    assert took < 2.0, f"close took {took:.1f} s in the outage (assignment_timeout_s 3)"
    said = [r.getMessage() for r in caplog.records if "closed in a Redis outage" in r.getMessage()]
    assert len(said) == 1 and "report(s) Redis had not taken are dropped" in said[0], said
    dropped = int(said[0].split("outage: ")[1].split()[0])
    assert dropped >= 1 and len(arrived) <= 1, (dropped, arrived)  # at most the one being sent as it closed
