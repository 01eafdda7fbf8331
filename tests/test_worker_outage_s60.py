"""A Redis outage as the core's WorkerClient meets it, against a real redis-server stopped with SIGSTOP (a stall: it
accepts, and answers nothing): the job's only worker trains on without paying the stalled Redis's timeouts each step,
and stops at ``outage_s``; ``wait_for_redis`` gives up after the time it is given; the error names the caller's way
out."""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from lbbsp import Assignment, EmbeddedRedis, JobConfig, Store, WorkerClient
from lbbsp.errors import StoreUnavailable
from lbbsp.store import wait_for_redis, worker_socket_timeout


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A redis-server of the test's own, which it may stop (SIGSTOP) and let go on (SIGCONT)."""
    with EmbeddedRedis() as own:
        yield own
        if own.pid is not None:
            os.kill(own.pid, signal.SIGCONT)


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


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a stalled Redis behind a proxy, a wrong service)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(2)
    for conn in accepted:
        conn.close()
    listener.close()


def test_wait_for_redis_gives_up_after_its_timeout_on_a_server_that_never_answers(silent_port: int) -> None:
    """Before: each ping ran with the client's two retries at the worker's socket timeout (3.3 s for the default
    assignment_timeout_s), so a 1 s wait took 10.1 s and said 'did not answer within 1s'. Now each ping is one try
    bounded by the time left."""
    url = f"redis://127.0.0.1:{silent_port}/0"
    began = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"did not answer within 1s") as caught:
        wait_for_redis(url, 1.0, socket_timeout_s=worker_socket_timeout(10.0))
    waited = time.monotonic() - began
    assert 0.9 <= waited <= 1.8, (waited, str(caught.value))


def test_wait_for_redis_returns_a_client_with_its_socket_timeout_and_retries(server: EmbeddedRedis) -> None:
    """The client returned is the usual one (the caller's socket timeout, retried commands), not the bounded probe."""
    client = wait_for_redis(server.url, 5.0, socket_timeout_s=0.7)
    try:
        assert client.ping()
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.7
        assert kwargs["retry"]._retries == 2
    finally:
        client.close()


def test_a_peek_in_the_only_workers_outage_does_not_ask_the_stalled_redis(server: EmbeddedRedis, job: str) -> None:
    """The torch integration's prefetch peeks at the next iteration on a thread of its own each step: riding out the
    stall, each peek had waited out three socket timeouts, and a lone rank's prefetch threads piled up to the pool's
    100 connections (review of this pass). A peek now returns None at once while Redis has not answered since it
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
