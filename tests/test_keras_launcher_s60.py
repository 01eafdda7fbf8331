"""examples/keras_digits.py --workers 2 stops its workers when it is stopped: killed with SIGTERM, the launcher had left
both workers training, orphaned (TensorFlow's coordination service catches SIGTERM, so only SIGKILL ended them)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "keras_digits.py"


def _workers_of(launcher: psutil.Process) -> list[psutil.Process]:
    return [p for p in launcher.children() if "--index" in p.cmdline()]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_launcher_stopped_with_sigterm_stops_its_workers() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CONFIG", "LBBSP_"))}
    launcher = subprocess.Popen([sys.executable, str(EXAMPLE), "--workers", "2", "--epochs", "1000"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        parent = psutil.Process(launcher.pid)
        deadline = time.monotonic() + 60
        while len(workers := _workers_of(parent)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(workers) == 2
        time.sleep(15)  # into training: TensorFlow's coordination service holds SIGTERM by now
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, [p.pid for p in alive]
    finally:  # the launcher and its workers share a process group of their own
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait()
