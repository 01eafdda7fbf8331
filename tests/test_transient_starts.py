"""Restarts that fail for a cause that clears by itself are tried again every so often, not counted against the
restart budget: a coordinator process restarted while its Redis is down or refusing writes (its child cannot set up),
an embedded redis-server restarted while fork() fails (a pids limit, no memory). Counted at a try every 0.5 s, a few
seconds of either had spent the budget, and the job had no coordinator, or no Redis, for the rest of training."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

import lbbsp.embedded
from lbbsp import BSPPolicy, CoordinatorProcess, EmbeddedRedis, JobConfig
from test_coordinator import _until


@pytest.mark.timeout(150)
@pytest.mark.parametrize("unusable", ["refusing writes", "down"])
def test_a_coordinator_process_restarted_while_redis_is_unusable_serves_again_once_it_is_back(
        unusable: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Down, or refusing writes (a full Redis's OOM): each restart's child died in its set-up (Store.register)."""
    monkeypatch.setattr(lbbsp.embedded, "_RETRY_START_S", 1.0)  # the watch's pause between tries, shortened
    with EmbeddedRedis() as server:
        running = CoordinatorProcess(server.url, JobConfig(f"unusable-{unusable[:4]}", 2, 8), BSPPolicy())
        running.RESTARTS = 1  # what a few seconds of outage spent of the default 3
        client = redis.Redis(unix_socket_path=str(server.socket_path))
        try:
            with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
                if unusable == "down":
                    server.stop()  # stop() is not restarted by the server's watch: an outage until start()
                else:
                    client.execute_command(server.command_name("CONFIG"), "SET", "maxmemory", 1)  # OOM to writes
                os.kill(running._process.pid, signal.SIGKILL)  # type: ignore[arg-type]
                _until(lambda: caplog.text.count("could not start the coordinator process") >= 3
                       or "not starting it again" in caplog.text, 90.0)
                assert "not starting it again" not in caplog.text, "a Redis unusable for seconds spent the restarts"
                if unusable == "down":
                    server.start()
                else:
                    client.execute_command(server.command_name("CONFIG"), "SET", "maxmemory", 0)
                _until(lambda: running.alive and running.restarts == 1, 30.0)
            assert "Redis is unusable for now" in caplog.text
        finally:
            running.stop()
            client.close()


_WITHOUT_FORK = r"""
import json, logging, os, signal, sys, threading, time
import redis
import lbbsp.embedded
from lbbsp import EmbeddedRedis

lbbsp.embedded._RETRY_START_S = 1.0  # the watch's pause between tries, shortened
cgroup = sys.argv[1]
def put(name, value):
    with open(os.path.join(cgroup, name), "w") as f:
        f.write(str(value))
def answers(server):
    try:
        return redis.Redis(unix_socket_path=str(server.socket_path), socket_timeout=1).ping()
    except redis.RedisError:
        return False
put("cgroup.procs", os.getpid())
with EmbeddedRedis() as server:
    put("pids.max", 1)  # below what runs here already: each fork now fails with EAGAIN
    os.kill(server.pid, signal.SIGKILL)  # the server dies meanwhile (the OOM killer, say)
    time.sleep(4)  # 8 tries at 0.5 s: more than RESTARTS (5) had they been counted
    during = {"answers": answers(server), "watching": any(t.name == "lbbsp-redis-watch"
                                                          for t in threading.enumerate())}
    put("pids.max", "max")
    deadline = time.monotonic() + 20
    while not answers(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(json.dumps({"during": during, "after": answers(server)}))
"""


def _pids_hierarchy() -> Path | None:
    """Where a pids cgroup of this test's own can be made: cgroup v1's pids hierarchy, or v2's root with pids on."""
    v1 = Path("/sys/fs/cgroup/pids")
    if (v1 / "cgroup.procs").exists():
        return v1
    v2 = Path("/sys/fs/cgroup")
    try:
        return v2 if "pids" in (v2 / "cgroup.subtree_control").read_text().split() else None
    except OSError:
        return None


@pytest.mark.timeout(90)
def test_an_embedded_redis_that_died_while_fork_failed_is_started_again_once_it_works(tmp_path: Path) -> None:
    """An embedded redis-server that dies while fork() fails (a pids cgroup at its limit, as in a container with
    --pids-limit; EAGAIN) is started again once processes can be made. Run in a child process put in a pids cgroup of
    its own, whose limit is lowered below what runs there (needs root and a pids controller; skipped elsewhere)."""
    hierarchy = _pids_hierarchy()
    cgroup = hierarchy / f"lbbsp-test-{uuid.uuid4().hex[:8]}" if hierarchy is not None else None
    try:
        assert cgroup is not None
        cgroup.mkdir()
    except (AssertionError, OSError) as exc:
        pytest.skip(f"cannot make a pids cgroup here (needs root and a pids controller): {exc}")
    script = tmp_path / "without_fork.py"
    script.write_text(_WITHOUT_FORK)
    try:
        run = subprocess.run([sys.executable, str(script), str(cgroup)], capture_output=True, text=True, timeout=60,
                             check=False)
    finally:
        cgroup.rmdir()  # empty: the child and its server have ended
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["during"] == {"answers": False, "watching": True}, run.stderr[-3000:]
    assert result["after"], run.stderr[-3000:]
    assert "Resource temporarily unavailable" in run.stderr
