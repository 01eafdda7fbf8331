"""The embedded redis-server: starts on demand, keeps data across a crash, and leaves no process behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from lbbsp import EmbeddedRedis, Store, StoreUnavailable


def test_start_restart_and_clean_stop() -> None:
    server = EmbeddedRedis()
    pid, directory = server.pid, server.directory
    with Store.from_url(server.url, "embedded") as store:
        store.client.set("k", "v")
        server.restart(kill=True)  # SIGKILL: only the append-only file can carry the key over
        assert store.client.get("k") == b"v"
    server.close()
    server.close()  # safe twice
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not directory.exists()


def test_the_server_dies_with_the_process_that_started_it() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import lbbsp, time; s = lbbsp.EmbeddedRedis(); print(s.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    redis_pid = int(child.stdout.readline())
    assert psutil.pid_exists(redis_pid)
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(redis_pid) and psutil.Process(redis_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "redis-server outlived its parent"
        time.sleep(0.05)


def test_unreachable_redis_gives_a_clear_error(tmp_path: os.PathLike) -> None:
    with Store.from_url(f"unix://{tmp_path}/nothing.sock", "j") as store:
        with pytest.raises(StoreUnavailable, match="cannot reach Redis"):
            store.ping()
