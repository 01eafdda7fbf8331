"""The job's only worker, closed in a Redis outage (a stall: the server accepts and answers nothing): close returns
without waiting out its reports' retries (it had waited assignment_timeout_s + 1, 11 s with the default, for reports
that Redis was not taking), drops them, and says so; none but the one being sent reaches Redis afterwards."""
from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator

import pytest

from lbbsp import EmbeddedRedis, JobConfig, Store, WorkerClient
from lbbsp.store import worker_socket_timeout


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A redis-server of the test's own, which it stops (SIGSTOP) and lets go on (SIGCONT)."""
    with EmbeddedRedis() as own:
        yield own
        if own.pid is not None:
            os.kill(own.pid, signal.SIGCONT)


def test_the_only_worker_closed_in_a_stall_returns_at_once_and_says_what_it_did_not_send(
        server: EmbeddedRedis, job: str, caplog: pytest.LogCaptureFixture) -> None:
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
