"""What a new user of the lbbsp command hit: Ctrl-C in the demo, the embedded Redis under Ctrl-C, a missing
torch, and negative counts taken as flags. Each test failed before its fix."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from lbbsp.cli import main

LBBSP = [sys.executable, "-m", "lbbsp.cli"]


def _ctrl_c_able(**kwargs: object) -> subprocess.Popen[str]:
    """A process in a session of its own, with Ctrl-C at its default (a test runner may have it ignored)."""
    return subprocess.Popen(start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
                            **kwargs)  # type: ignore[call-overload]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pid: int, what: str, timeout_s: float = 10.0) -> None:
    """Wait until process ``pid`` has ended; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while _running(pid):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_ctrl_c_in_the_demo_prints_no_traceback_and_leaves_nothing_running() -> None:
    """Ctrl-C (SIGINT to the terminal's process group) mid-demo printed the coordinator process's traceback,
    and after the fix of that, the coordinator outlived the command and logged that Redis was gone."""
    pytest.importorskip("torch")  # the demo's workers (lbbsp[torch])
    demo = _ctrl_c_able(args=[*LBBSP, "demo", "--steps", "2000"])
    assert demo.stdout is not None
    started: dict[int, str] = {}  # every process the demo started, with its command line
    try:
        for line in demo.stdout:
            if " step " in line:  # training: workers, load, coordinator process and redis-server all run
                break
        started = {p.pid: " ".join(p.cmdline()) for p in psutil.Process(demo.pid).children(recursive=True)}
        assert sum("redis-server" in cmd for cmd in started.values()) == 1
        assert sum("spawn_main" in cmd for cmd in started.values()) == 3  # 2 workers and 1 coordinator
        os.killpg(demo.pid, signal.SIGINT)
        assert demo.wait(timeout=60) == 130
        left = [cmd for pid, cmd in started.items() if "resource_tracker" not in cmd and _running(pid)]
        assert left == [], "processes outlived lbbsp demo"
        rest = demo.stdout.read()  # to EOF: also what a process that outlived the command printed
    finally:
        for pid in [demo.pid, *started]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    assert [line for line in rest.splitlines() if " step " not in line] == ["lbbsp: interrupted"], rest


@pytest.mark.timeout(90)
def test_a_demo_worker_stopped_then_aborted_leaves_its_coordinator_quiet(redis_url: str, job: str) -> None:
    """The launcher's SIGTERM, then gloo aborting rank 0 before its cleanup ran (os._exit here): its coordinator
    process, orphaned, logged that its parent was gone, under the demo's "lbbsp: interrupted" (one CI run)."""
    worker = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, time\n"
        "from lbbsp.integrations import demo\n"
        "from lbbsp import CoordinatorProcess, JobConfig\n"
        "if __name__ == '__main__':\n"
        f"    demo._running = CoordinatorProcess({redis_url!r}, JobConfig({job!r}, 2, 64))\n"
        "    signal.signal(signal.SIGTERM, demo._exit_on_sigterm)\n"
        "    try:\n"
        "        print(demo._running._process.pid, flush=True)  # inside the try: SIGTERM may come once it is read\n"
        "        time.sleep(60)\n"
        "    except SystemExit:\n"
        "        os._exit(134)  # an abort: no cleanup of this process's own\n")],
        text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert worker.stdout is not None and worker.stderr is not None
    coordinator = int(worker.stdout.readline())
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 134
    _gone_within(coordinator, "the coordinator outlived its worker")
    assert "is gone" not in worker.stderr.read()


@pytest.mark.timeout(60)
def test_ctrl_c_does_not_stop_the_embedded_server_before_its_owner_cleans_up() -> None:
    """The server shared the terminal's process group, so Ctrl-C stopped it at once, under the owner's cleanup
    (a coordinator releasing its lease, a worker's last report)."""
    owner = _ctrl_c_able(args=[sys.executable, "-c", (
        "import time\n"
        "from lbbsp import EmbeddedRedis, Store\n"
        "server = EmbeddedRedis()\n"
        "try:\n"
        "    print(server.pid, flush=True)  # inside the try: Ctrl-C may come as soon as it is read\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    time.sleep(0.5)  # cleanup that takes a moment\n"
        "    with Store.from_url(server.url, 'j') as store:\n"
        "        store.ping()\n"
        "    print('cleaned up with the server', flush=True)\n"
        "server.close()\n")])
    assert owner.stdout is not None
    redis_pid = int(owner.stdout.readline())
    os.killpg(owner.pid, signal.SIGINT)
    out, _ = owner.communicate(timeout=30)
    assert owner.returncode == 0 and "cleaned up with the server" in out, out
    _gone_within(redis_pid, "the embedded server outlived its owner")  # and it still goes when its owner closes it


def test_the_demo_without_torch_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Without torch (pip install lbbsp, no extras) each demo worker failed with an ImportError traceback."""
    monkeypatch.setitem(sys.modules, "torch", None)  # what a missing package looks like to the import system
    assert main(["demo", "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert "PyTorch, which is not installed" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [["coordinator", "--workers", "2", "--global-batch", "8", "--max-decisions", "-1"],
                                  ["coordinator", "--workers", "2", "--global-batch", "8", "--max-decisions", "0"],
                                  ["status", "--redis", "unix:///nowhere.sock", "--decisions", "-3"]])
def test_a_negative_count_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """--max-decisions -1 started a coordinator (and an embedded Redis) that exited at once with status 0, and
    --decisions -3 was taken as 1."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "must be at least" in capsys.readouterr().err


def test_the_demo_warns_when_workers_share_a_core(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """More workers than cores put the slow worker's load on another worker too, with no word of it."""
    pytest.importorskip("torch")  # the demo's workers (lbbsp[torch])
    from lbbsp.integrations import demo  # noqa: PLC0415

    monkeypatch.setattr(demo, "cores_for", lambda workers: [0] * workers)
    assert main(["demo", "--redis", "unix:///nowhere.sock"]) == 2  # stops at the Redis check, after the header
    assert "2 workers share 1 core(s)" in " ".join(capsys.readouterr().out.split())
