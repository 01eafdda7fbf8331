"""Closing what an integration started, when its own embedded Redis stopped answering: the server is killed, not
sent SIGTERM and waited for (a stalled server cannot act on it: 10 s, then a kill), and the coordinator process gets
a short grace before it is killed (inside a call to that Redis it never ends by itself). Rank 0 of a torch job and
Keras worker 0 (tests/test_keras_exit_s51.py) had exited 11-20 s after the other workers; the folder, and with it
anything a shutdown would save, is deleted right after."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lbbsp import EmbeddedRedis


@pytest.mark.timeout(60)
def test_closing_an_embedded_server_that_owns_its_folder_kills_it_even_when_stalled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    signalled: list[bool] = []
    end = EmbeddedRedis._end

    def recorded(process: subprocess.Popen[bytes] | None, kill: bool) -> None:
        signalled.append(kill)
        end(process, kill)

    monkeypatch.setattr(EmbeddedRedis, "_end", staticmethod(recorded))
    server = EmbeddedRedis()
    process = server._process
    assert process is not None
    folder = server.directory
    os.kill(process.pid, signal.SIGSTOP)
    try:
        server.close()
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.wait()
    assert signalled == [True]  # SIGKILL at once: a SIGTERM had waited 10 s on the stalled server, then killed it
    assert process.returncode == -signal.SIGKILL
    assert not folder.exists()


@pytest.mark.timeout(60)
def test_closing_an_embedded_server_in_a_folder_it_keeps_shuts_it_down(tmp_path: Path) -> None:
    """A folder given (and kept) holds the append-only file a shutdown writes: the server gets SIGTERM there."""
    server = EmbeddedRedis(tmp_path)
    process = server._process
    assert process is not None
    server.close()
    assert process.returncode == 0  # redis-server's own exit on SIGTERM, having saved
    assert tmp_path.exists()


RANK0 = """
import sys
import torch.distributed as dist
from lbbsp.coordinator import CoordinatorProcess
from lbbsp.integrations.torch import Balancer

graces = []
stop = CoordinatorProcess.stop
def recorded(self, timeout_s=5.0):
    graces.append(timeout_s)
    stop(self, timeout_s)
CoordinatorProcess.stop = recorded
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
lb = Balancer.from_env(global_batch=8, redis=sys.argv[2] or None)
lb.close()
dist.destroy_process_group()
print("graces", graces)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("own_server", [True, False])
def test_torch_rank0_gives_its_coordinator_a_short_grace_only_before_its_own_server(
        own_server: bool, redis_url: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "LBBSP_REDIS_URL"}
    done = subprocess.run([sys.executable, "-c", RANK0, str(tmp_path / "init"), "" if own_server else redis_url],
                          capture_output=True, text=True, timeout=200, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    graces = done.stdout.strip().splitlines()[-1]
    assert graces == ("graces [1.0]" if own_server else "graces [5.0]"), (graces, done.stderr[-2000:])
