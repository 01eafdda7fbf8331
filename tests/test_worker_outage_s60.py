"""A Redis outage as the core's WorkerClient meets it, against a real redis-server stopped with SIGSTOP (a stall: it
accepts, and answers nothing): the job's only worker trains on without paying the stalled Redis's timeouts each step,
and stops at ``outage_s``; ``wait_for_redis`` gives up after the time it is given; the error names the caller's way
out."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from lbbsp import EmbeddedRedis
from lbbsp.errors import StoreUnavailable
from lbbsp.store import wait_for_redis, worker_socket_timeout


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    """A redis-server of the test's own, which it may stop (SIGSTOP) and let go on (SIGCONT)."""
    with EmbeddedRedis() as own:
        yield own
        if own.pid is not None:
            os.kill(own.pid, signal.SIGCONT)


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
