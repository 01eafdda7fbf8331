"""Worker 0's ``WorkerSession.close()`` when its own embedded Redis stopped answering (real server, real coordinator
process): worker 0 had exited 11-20 s after the other workers. The coordinator's child, inside a Redis call that lasts
its socket timeout, was given CoordinatorProcess.stop's default 5 s grace, and the stalled server, which cannot act on
SIGTERM, EmbeddedRedis.close's 10 s, though the server's folder (its data) is deleted right after."""
from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from lbbsp import EmbeddedRedis, JobConfig
from lbbsp.coordinator import CoordinatorProcess

pytest.importorskip("tensorflow")  # WorkerSession names the worker's device through TensorFlow
from lbbsp.integrations.keras import WorkerSession


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_worker0_closes_without_waiting_on_its_stalled_embedded_redis(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    graces: list[float] = []
    kills: list[bool] = []
    stop_coordinator, stop_server = CoordinatorProcess.stop, EmbeddedRedis.stop

    def coordinator_stopped(self: CoordinatorProcess, timeout_s: float = 5.0) -> None:
        graces.append(timeout_s)
        stop_coordinator(self, timeout_s)

    def server_stopped(self: EmbeddedRedis, *, kill: bool = False) -> None:
        kills.append(kill)
        stop_server(self, kill=kill)

    monkeypatch.setattr(CoordinatorProcess, "stop", coordinator_stopped)
    monkeypatch.setattr(EmbeddedRedis, "stop", server_stopped)
    session = WorkerSession(JobConfig(job, num_workers=2, global_batch=32), 0)
    assert session.server is not None and session.coordinator is not None
    server: Any = session.server._process
    child = session.coordinator._process
    folder = session.server.directory
    os.kill(server.pid, signal.SIGSTOP)  # the coordinator's next Redis call now lasts its socket timeout
    try:
        session.close()
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGCONT)
            server.kill()
            server.wait()
    # the coordinator's child got a short grace, and was killed inside its Redis call (it could not end by itself)
    assert len(graces) == 1 and graces[0] <= 2.0, graces
    assert child.exitcode == -signal.SIGKILL
    # the server was killed outright, not sent SIGTERM (which a stalled server leaves pending) and waited for
    assert kills and kills[0] is True, kills
    assert server.returncode == -signal.SIGKILL
    assert not folder.exists()
