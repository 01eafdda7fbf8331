"""What a user of ``lbbsp demo`` hit: an empty --redis, a kill of the command, a worker count beyond the data, and
"load ON" with no load. Each test failed before its fix."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from lbbsp.cli import main
from test_cli_audit import _running

LBBSP = [sys.executable, "-m", "lbbsp.cli"]


@pytest.mark.timeout(180)
def test_an_empty_redis_url_runs_on_the_embedded_server() -> None:
    """``--redis "$LBBSP_REDIS_URL"`` with the variable unset ended in an AttributeError traceback (no server was
    started, and the empty URL was then read from it); ``lbbsp coordinator`` takes an empty URL as none given."""
    demo = subprocess.run([*LBBSP, "demo", "--redis", "", "--steps", "10", "--hidden", "8"], capture_output=True,
                          text=True, timeout=150, check=False)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "Traceback" not in demo.stderr and "speedup of LB-BSP over BSP" in demo.stdout


@pytest.mark.timeout(180)
def test_a_killed_demo_stops_its_workers_and_their_load() -> None:
    """SIGTERM to the command (kill, timeout(1), a CI job's cancel) ended the launcher alone: both workers, the
    coordinator process and the busy-loop processes, each burning a core, trained on for the rest of the run."""
    demo = subprocess.Popen([*LBBSP, "demo", "--steps", "2000", "--hidden", "64"], start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert demo.stdout is not None
    started: dict[int, str] = {}
    try:
        for line in demo.stdout:
            if " step " in line:  # training: workers, load, coordinator process and redis-server all run
                break
        started = {p.pid: " ".join(p.cmdline()) for p in psutil.Process(demo.pid).children(recursive=True)}
        assert sum("while True" in cmd for cmd in started.values()) == 2  # the busy processes, by default
        demo.terminate()
        assert demo.wait(timeout=60) == 128 + signal.SIGTERM
        left = [cmd for pid, cmd in started.items() if "resource_tracker" not in cmd and _running(pid)]
        assert left == [], "processes outlived a killed lbbsp demo"
    finally:
        for pid in [demo.pid, *started]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        demo.stdout.close()


def test_more_workers_than_samples_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """--workers 2000 was refused as "global batch must be in [2000, 1797]", a range with nothing in it."""
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--workers", "2000"])
    assert exit_.value.code == 2
    assert "argument --workers: must be in [2, 1797], got 2000" in capsys.readouterr().err


def test_no_busy_processes_is_never_shown_as_load_on() -> None:
    """--load-procs 0 (a baseline with nothing on the core) printed "load ON" and "busy" on the schedule's steps."""
    from lbbsp.integrations.demo import ColocatedLoad, DemoConfig, _View  # noqa: PLC0415  (imports torch)

    load = ColocatedLoad(core=0, procs=0)
    load.set(True)
    assert not load.on
    view = _View(DemoConfig(steps=10, load_procs=0), cores=[0, 1])
    for rank in (0, 1):
        event = ("step", "BSP", rank, 0, 256, 0.02, bool(load and load.on))  # as _train_phase sends it
        view.update(event)
        line = view.progress_line(event)
    assert line is not None and "load off" in line
