"""`lbbsp demo`: the Redis it runs on (the flag's, else $LBBSP_REDIS_URL's, else an embedded one), its progress and
quiet output, its warnings and errors, and Ctrl-C or SIGTERM stopping it with its workers and their load."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from rich.console import Console

from lbbsp import EmbeddedRedis
from lbbsp.cli import main
from lbbsp.integrations import demo
from lbbsp.store import Store

pytest.importorskip("torch")  # the demo's workers and the ranks of the policy checks train with it


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


def _started_once_training(demo: subprocess.Popen[str]) -> dict[int, str]:
    """Every process the demo started, with its command line, read once it trains: workers, load, coordinator process
    and its one redis-server all run then."""
    assert demo.stdout is not None
    for line in demo.stdout:
        if " step " in line:
            break
    started = {p.pid: " ".join(p.cmdline()) for p in psutil.Process(demo.pid).children(recursive=True)}
    assert sum("redis-server" in cmd for cmd in started.values()) == 1
    return started


@pytest.mark.timeout(180)
def test_ctrl_c_in_the_demo_prints_no_traceback_and_leaves_nothing_running() -> None:
    """Ctrl-C (SIGINT to the terminal's process group) mid-demo printed the coordinator process's traceback,
    and after the fix of that, the coordinator outlived the command and logged that Redis was gone."""
    pytest.importorskip("torch")  # the demo's workers (lbbsp[torch])
    demo = _ctrl_c_able(args=[*LBBSP, "demo", "--steps", "2000"])
    assert demo.stdout is not None
    started: dict[int, str] = {}  # every process the demo started, with its command line
    try:
        started = _started_once_training(demo)
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


def test_the_demo_without_torch_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Without torch (pip install lbbsp, no extras) each demo worker failed with an ImportError traceback."""
    monkeypatch.setitem(sys.modules, "torch", None)  # what a missing package looks like to the import system
    assert main(["demo", "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert "PyTorch, which is not installed" in err and "Traceback" not in err


def test_the_demo_warns_when_workers_share_a_core(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """More workers than cores put the slow worker's load on another worker too, with no word of it."""
    pytest.importorskip("torch")  # the demo's workers (lbbsp[torch])
    from lbbsp.integrations import demo  # noqa: PLC0415

    monkeypatch.setattr(demo, "cores_for", lambda workers: [0] * workers)
    assert main(["demo", "--redis", "unix:///nowhere.sock"]) == 2  # stops at the Redis check, after the header
    assert "2 workers share 1 core(s)" in " ".join(capsys.readouterr().out.split())


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


#: The tests that run the demo's launcher: it refuses to start without torch (its workers train with it).
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the demo needs lbbsp[torch]")


NOWHERE = "redis://:s3cret@127.0.0.1:1/0"  # nothing listens on port 1: refused at once


# -- lbbsp demo: which Redis -------------------------------------------------------------------------------------
@needs_torch
def test_the_demo_takes_the_variables_redis_and_says_so_without_the_password(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """$LBBSP_REDIS_URL was ignored: the demo started an embedded server (and ran two minutes) whatever it said."""
    monkeypatch.setenv("LBBSP_REDIS_URL", NOWHERE)
    assert main(["demo", "--steps", "10", "--hidden", "8"]) == 2  # the Redis check, before any worker starts
    out, err = capsys.readouterr()
    assert "Redis: redis://:***@127.0.0.1:1/0 (from $LBBSP_REDIS_URL)" in out
    assert "$LBBSP_REDIS_URL" in err and "s3cret" not in out + err


@pytest.mark.parametrize(("given", "variable", "expected"), [
    (None, None, (None, "an embedded redis-server")),
    (None, "", (None, "an embedded redis-server")),  # an empty variable counts as unset
    ("", "", (None, "an embedded redis-server")),  # --redis "$LBBSP_REDIS_URL" with the variable empty
    (None, "redis://h:1/0", ("redis://h:1/0", "redis://h:1/0 (from $LBBSP_REDIS_URL)")),
    ("", "redis://h:1/0", ("redis://h:1/0", "redis://h:1/0 (from $LBBSP_REDIS_URL)")),
    ("redis://:pw@g:2/0", "redis://h:1/0", ("redis://:pw@g:2/0", "redis://:***@g:2/0 (--redis)")),  # the flag first
])
def test_the_demos_redis_is_the_flags_then_the_variables_then_embedded(
        given: str | None, variable: str | None, expected: tuple[str | None, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    if variable is None:
        monkeypatch.delenv("LBBSP_REDIS_URL", raising=False)
    else:
        monkeypatch.setenv("LBBSP_REDIS_URL", variable)
    assert demo.redis_for(given) == expected


@needs_torch
@pytest.mark.timeout(180)
def test_a_quiet_demo_prints_its_results_alone_and_runs_on_the_variables_redis() -> None:
    """-q did not exist: the header, a line per tenth of each run and the table were all there is."""
    with EmbeddedRedis() as server:  # a Redis of this test's own: the demo's jobs are the only ones on it
        env = {**_env(), "LBBSP_REDIS_URL": server.url}
        run = subprocess.run([*LBBSP, "demo", "-q", "--steps", "10", "--hidden", "8"], capture_output=True, text=True,
                             timeout=150, check=False, env=env)
        with Store.from_url(server.url, "") as store:
            jobs = list(store.jobs())
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if not line.startswith("warning")]  # a 1-core machine's
    assert len(lines) == 2, run.stdout
    assert lines[0].startswith("speedup of LB-BSP over BSP: ")
    assert lines[1].startswith("parameter trajectories: ") and lines[1].endswith("-> match")
    assert len(jobs) == 2  # the BSP run's job and the LB-BSP run's, on the variable's Redis


@needs_torch
@pytest.mark.timeout(180)
def test_the_demo_runs_in_a_temp_dir_whose_name_a_url_reads_otherwise(tmp_path: Path) -> None:
    """The workers met through a file:// URL of a file in the temp dir, whose path torch takes as it is, up to a '?'
    or '#': in a TMPDIR with '?' in its name each worker failed with an IndexError traceback, and with '#' they met
    in a file outside the run's folder (one of that name of the user's held them for good)."""
    odd = tmp_path / "q?a#b"
    odd.mkdir()
    with EmbeddedRedis() as server:
        env = {**_env(), "LBBSP_REDIS_URL": server.url, "TMPDIR": str(odd)}
        run = subprocess.run([*LBBSP, "demo", "-q", "--steps", "10", "--hidden", "8"], capture_output=True, text=True,
                             timeout=150, check=False, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("-> match"), run.stdout
    assert sorted(tmp_path.iterdir()) == [odd]  # nothing written beside the temp dir


@needs_torch
def test_quiet_keeps_the_demos_warnings(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(demo, "cores_for", lambda workers: [0] * workers)
    assert main(["demo", "-q", "--redis", NOWHERE]) == 2  # stops at the Redis check, after the warning
    out, err = capsys.readouterr()
    assert out.startswith("warning: 2 workers share 1 core(s)") and "lbbsp demo:" not in out and "Redis:" not in out
    assert "127.0.0.1:1" in err


def test_the_quiet_summary_is_the_speedup_and_the_parameter_check() -> None:
    loud, quiet = _summary(quiet=False), _summary(quiet=True)
    assert "BSP vs LB-BSP (same model, same global batches)" in loud
    assert quiet == ["speedup of LB-BSP over BSP: 1.67x",
                     "parameter trajectories: max relative difference 1.00e-12 over 7 checkpoints -> match"]


# -- lbbsp demo: what it prints while it runs --------------------------------------------------------------------
class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _progress(*, quiet: bool = False, live: Any = None) -> tuple[demo._Progress, Clock, list[str]]:
    printed: list[str] = []
    clock = Clock()
    view = demo._View(demo.DemoConfig(steps=20), cores=[0, 1])
    return demo._Progress(view, printed.append, live=live, quiet=quiet, clock=clock), clock, printed


def test_a_long_start_says_how_far_the_workers_are() -> None:
    """The workers' start (spawn, import torch, join gloo, build, start the coordinator) printed nothing for 14 s."""
    progress, clock, printed = _progress()
    clock.now = demo.SILENCE_S - 1
    progress.tick()
    assert printed == []  # not yet
    clock.now = demo.SILENCE_S + 1
    progress.tick()
    assert printed == ["starting the 2 workers: 0 of 2 have joined the gloo group"]
    progress.saw(("joined", 0))
    progress.saw(("joined", 1))
    clock.now = 2 * demo.SILENCE_S + 2
    progress.tick()
    assert printed[1] == ("starting the 2 workers: 2 of 2 have joined the gloo group; each builds the model and "
                          "rank 0 starts the coordinator")


def test_a_long_run_says_which_step_it_is_at_and_a_printed_line_restarts_the_wait() -> None:
    progress, clock, printed = _progress()
    for rank in (0, 1):
        progress.saw(("step", "BSP", rank, 1, 256, 0.02, True))  # step 2 of 20 ends a tenth: its line
    assert len(printed) == 1 and "step    2/20" in printed[0]
    clock.now = demo.SILENCE_S - 1  # since that line
    progress.tick()
    assert len(printed) == 1
    clock.now = demo.SILENCE_S + 1
    progress.tick()
    assert printed[1] == "BSP run: at step 2 of 20"
    progress.saw(("phase", "BSP", 3.0, 0.0, 5))
    clock.now = 2 * demo.SILENCE_S + 2
    progress.tick()
    assert printed[2] == "BSP run done in 3.0s; starting the LB-BSP run"


def test_quiet_and_the_terminals_live_table_print_no_progress_lines() -> None:
    quiet, clock, printed = _progress(quiet=True)
    for rank in (0, 1):
        quiet.saw(("step", "BSP", rank, 1, 256, 0.02, True))
    clock.now = 10 * demo.SILENCE_S
    quiet.tick()
    assert printed == []

    class Live:
        def __init__(self) -> None:
            self.titles: list[str] = []

        def update(self, table: Any) -> None:
            self.titles.append(str(table.title))

    live = Live()
    shown, clock, printed = _progress(live=live)
    shown.saw(("joined", 1))
    clock.now = 10 * demo.SILENCE_S
    shown.tick()
    assert printed == []  # the table shows it, refreshed by rich
    assert live.titles == ["starting the 2 workers: 1 of 2 have joined the gloo group"]


# -- helpers ------------------------------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    """This process's environment without $LBBSP_REDIS_URL."""
    return {k: v for k, v in os.environ.items() if k != "LBBSP_REDIS_URL"}


def _summary(*, quiet: bool) -> list[str]:
    """The demo's closing lines for a run of 10 s and one of 6 s, as a pipe receives them."""
    view = demo._View(demo.DemoConfig(), cores=[0, 1])
    for event in (("phase", "BSP", 10.0, 0.0, 7), ("phase", "LB-BSP", 6.0, 1e-12, 7)):  # as _train_phase sends them
        view.update(event)
    piped = io.StringIO()
    assert view.summary(Console(file=piped, soft_wrap=True, width=80), quiet=quiet) == 0
    return piped.getvalue().splitlines()


@needs_torch
@pytest.mark.timeout(150)
@pytest.mark.parametrize("lines", [0, 4])
def test_the_demo_into_a_reader_gone_ends_quietly_with_141(lines: int) -> None:
    """`lbbsp demo | head` had ended with rich's exit 1, which the demo means for parameters that differ; now with
    141 and nothing on stderr, as the other commands, whether the reader goes at once or during the BSP run (its
    workers stopped: none left behind)."""
    proc = subprocess.Popen([*LBBSP, "demo", "--steps", "10", "--hidden", "8"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout is not None
    read = [proc.stdout.readline() for _ in range(lines)]
    proc.stdout.close()
    _, err = proc.communicate(timeout=140)
    assert (proc.returncode, err) == (141, ""), (read, err)
    assert all(read) and (not read or "step" in read[-1]), read


@needs_torch
def test_the_variables_url_that_is_no_url_is_named_by_the_demo(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Its "not a usable Redis URL" did not say the URL was $LBBSP_REDIS_URL's, as an unreachable one's hint did."""
    monkeypatch.setenv("LBBSP_REDIS_URL", "http://host")
    assert main(["demo", "--steps", "10", "--hidden", "8"]) == 2
    assert "lbbsp: error: $LBBSP_REDIS_URL: not a usable Redis URL: http://host" in capsys.readouterr().err


TESTS = str(Path(__file__).parent)


# -- the demo's workers, started by its real launcher -----------------------------------------------------------
def probe_worker(rank: int, *args: Any) -> None:
    """The demo's worker with its training replaced: one INFO line, then an error event that ends the launcher."""
    from lbbsp.integrations import demo  # noqa: PLC0415

    def logs_at_info(rank: int, config: object, init: str, url: str, events: Any) -> None:
        logging.getLogger("lbbsp.probe").info("worker %d logs at INFO", rank)
        events.put(("error", rank, "the probe is done"))

    demo._train_both = logs_at_info
    demo._worker(rank, *args)


def launch_with_probe_workers(*argv: str) -> int:
    """``lbbsp *argv`` (a demo) whose workers are :func:`probe_worker`."""
    from lbbsp.integrations import demo  # noqa: PLC0415

    demo._worker = probe_worker
    return main(list(argv))


def launch_with_sigterm_at_start(*argv: str) -> int:
    """``lbbsp *argv`` (a demo), sent SIGTERM right after its first worker process starts; prints that one's pid."""
    import multiprocessing.process  # noqa: PLC0415

    start = multiprocessing.process.BaseProcess.start

    def start_then_sigterm(process: multiprocessing.process.BaseProcess) -> None:
        start(process)
        print(f"started {process.pid}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    multiprocessing.process.BaseProcess.start = start_then_sigterm  # type: ignore[method-assign]
    return main(list(argv))


def run_launcher(launch: str, *argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``launch(*argv)`` of this module in a fresh interpreter (the demo's workers import it by name)."""
    code = f"import sys; sys.path.insert(0, {TESTS!r}); import {__name__} as t; sys.exit(t.{launch}(*{argv!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          check=False)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("argv", [("demo", "-v"), ("-v", "demo")])
def test_verbose_reaches_the_demo_workers(argv: tuple[str, ...]) -> None:
    """The workers, spawned, logged nothing below WARNING whatever -v said: the launcher's logging never reached them."""
    launcher = run_launcher("launch_with_probe_workers", *argv, "--steps", "10", "--hidden", "8")
    assert launcher.returncode == 2 and "the probe is done" in launcher.stderr, launcher.stderr
    assert re.search(r"lbbsp\.probe INFO worker [01] logs at INFO", launcher.stderr), launcher.stderr


def test_an_empty_load_schedule_is_shown_as_no_load(capsys: pytest.CaptureFixture[str]) -> None:
    """``--load-schedule ""`` (no span: the load never goes on) was shown as "during  of each run"."""
    assert main(["demo", "--load-schedule", "", "--redis", "redis://127.0.0.1:1"]) == 2  # the header, then no Redis
    header = " ".join(capsys.readouterr().out.split())
    assert "during of each run" not in header
    assert "(worker 1) never switched on: --load-schedule is empty" in header, header
    assert main(["demo", "--load-schedule", " 0-0.5 , ", "--redis", "redis://127.0.0.1:1"]) == 2
    assert "(worker 1) during 0-0.5 of each run" in " ".join(capsys.readouterr().out.split())


@pytest.mark.timeout(90)
def test_a_sigterm_while_the_demos_workers_start_stops_them_at_once() -> None:
    """A SIGTERM right after the first worker's start waits until every worker is started whole (a start cut short
    leaves a child that prints "pickle data was truncated"), then stops them all at once. It had left the started ones
    out of the launcher's cleanup: the launcher exited only once multiprocessing's exit had waited for each to start up
    and fail, printing a FileNotFoundError traceback (its queue's semaphore was gone)."""
    launcher = run_launcher("launch_with_sigterm_at_start", "demo", "--steps", "10", "--hidden", "8")
    started = [int(pid) for pid in re.findall(r"^started (\d+)$", launcher.stdout, re.MULTILINE)]
    assert launcher.returncode == 128 + signal.SIGTERM and len(started) == 2, launcher.stdout + launcher.stderr
    assert "Traceback" not in launcher.stderr, launcher.stderr
    assert not any(map(_running, started))


def test_piped_demo_summary_keeps_each_sentence_on_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped (not a terminal), rich wrapped at 80 columns: "... over 7 checkpoints -> " with "match" on the next
    line, and the table's title in two halves; in a terminal the console stays as rich sets it up."""
    from lbbsp.integrations.demo import DemoConfig, _console, _View  # noqa: PLC0415  (imports torch)

    view = _View(DemoConfig(), cores=[0, 1])
    for event in (("phase", "BSP", 10.0, 0.0, 7), ("phase", "LB-BSP", 6.0, 1e-12, 7)):  # as _train_phase sends them
        view.update(event)
    piped = io.StringIO()
    with contextlib.redirect_stdout(piped):
        assert view.summary(_console()) == 0
    lines = piped.getvalue().splitlines()
    assert "BSP vs LB-BSP (same model, same global batches)" in lines[0]
    assert "speedup of LB-BSP over BSP: 1.67x" in lines
    assert "parameter trajectories: max relative difference 1.00e-12 over 7 checkpoints -> match" in lines
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich>=13.0 and 14 both read it: write as to a terminal
    assert not _console().soft_wrap


def failing_worker(rank: int, *args: Any) -> None:
    """The demo's worker with its training replaced: rank 0 fails as $DEMO_FAILURE says (an exception, or an exit
    with no word, as a process the OOM killer ends), rank 1 trains on (waits) until the launcher stops it."""
    from lbbsp.integrations import demo  # noqa: PLC0415

    def fails(rank: int, config: object, init: str, url: str, events: Any) -> None:
        if rank != 0:
            time.sleep(300)
        elif os.environ["DEMO_FAILURE"] == "raises":
            raise ValueError("a bug in the training of worker 0")
        else:
            os._exit(3)

    demo._train_both = fails
    demo._worker(rank, *args)


def launch_with_failing_workers(how: str, *argv: str) -> int:
    """``lbbsp *argv`` (a demo) whose workers are :func:`failing_worker`, rank 0 failing as ``how`` says; prints
    each worker's pid as it starts."""
    import multiprocessing.process  # noqa: PLC0415

    from lbbsp.integrations import demo  # noqa: PLC0415

    start = multiprocessing.process.BaseProcess.start

    def start_and_say(process: multiprocessing.process.BaseProcess) -> None:
        start(process)
        print(f"started {process.pid}", flush=True)

    multiprocessing.process.BaseProcess.start = start_and_say  # type: ignore[method-assign, assignment]
    os.environ["DEMO_FAILURE"] = how  # the spawned workers inherit it
    demo._worker = failing_worker  # type: ignore[assignment]
    return main(list(argv))


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("how", "said"), [
    ("raises", r"demo worker 0 failed:\nTraceback .*ValueError: a bug in the training of worker 0"),
    ("exits", r"a demo worker died; see its output above"),
])
def test_a_failing_worker_ends_the_demo_with_its_error_and_stops_the_others(how: str, said: str) -> None:
    """A worker's exception reaches the launcher with its traceback; a worker gone without a word (killed) is
    found by its exit code. Either ends the demo at once (not after the other worker's 300 s), with exit code 2 and
    no worker left running."""
    launcher = run_launcher("launch_with_failing_workers", how, "demo", "--steps", "10", "--hidden", "8",
                            timeout_s=120)
    assert launcher.returncode == 2, launcher.stdout + launcher.stderr
    assert re.search(said, launcher.stderr, re.DOTALL), launcher.stderr
    workers = [int(pid) for pid in re.findall(r"^started (\d+)$", launcher.stdout, re.MULTILINE)]
    assert len(workers) == 2 and not any(map(_running, workers)), launcher.stdout


def test_the_live_table_shows_each_workers_batch_speed_and_load() -> None:
    """In a terminal the launcher shows a row per worker: its core, its load (on the slow worker's core only, while
    on), its batch, compute time and samples per second ("-" before a report came)."""
    view = demo._View(demo.DemoConfig(steps=20, slow_worker=1), cores=[3, 5])
    view.update(("step", "LB-BSP", 1, 4, 160, 0.08, True))
    view.update(("step", "LB-BSP", 0, 4, 352, None, True))  # as _train_phase sends them: rank 0 says the load
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(view.table())
    text = console.export_text()
    assert "LB-BSP: step 5/20, load ON on worker 1" in text
    rows = [line.replace("│", " ").split() for line in text.splitlines() if re.match(r"^│\s+\d+\s+│", line)]
    assert rows == [["0", "3", "-", "352", "-", "-"], ["1", "5", "busy", "160", "80.0", "2000"]], text
    narrow = Console(record=True, width=30, file=io.StringIO())  # a split pane: rich had cut 2000 to "2…"
    narrow.print(view.table())
    cells = [line for line in narrow.export_text().splitlines() if line.startswith("│")]
    assert cells and not [line for line in cells if "…" in line], narrow.export_text()


@needs_torch
@pytest.mark.parametrize(("flags", "said"), [
    (["--global-batch", "3"], "--global-batch must be in [4, 1797] (a sample for each of the 4 workers, at most the "
                              "digits data), got 3"),
    (["--slow-worker", "4"], "--slow-worker 4 is not one of the 4 workers (0 to 3)"),
], ids=["global-batch", "slow-worker"])
def test_flags_that_do_not_fit_the_workers_are_refused_by_name_before_anything_starts(
        flags: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--workers", "4", *flags, "--redis", NOWHERE]) == 2
    err = capsys.readouterr().err
    assert said in err, err


@pytest.mark.timeout(180)
@pytest.mark.parametrize("group", [True, False], ids=["session-hangup", "demo-alone"])
def test_a_hangup_stops_the_demo_as_sigterm_does_and_leaves_no_folder_or_process(tmp_path: Path, group: bool) -> None:
    """SIGHUP (an ssh session that drops, a closed terminal) ended the launcher at its default, without its cleanup:
    its temp folder in $TMPDIR stayed for good, with its embedded Redis's folder in /dev/shm and, where the group got
    it, the spawn queue's semaphores; sent to the launcher alone, its workers trained on without it."""
    demo = subprocess.Popen([*LBBSP, "demo", "--steps", "2000", "--hidden", "64"], start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "TMPDIR": str(tmp_path)},
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # noqa: PLW1509
    assert demo.stdout is not None
    started: dict[int, str] = {}
    shm_before = set(os.listdir("/dev/shm"))
    try:
        started = _started_once_training(demo)
        if group:
            os.killpg(demo.pid, signal.SIGHUP)
        else:
            demo.send_signal(signal.SIGHUP)
        assert demo.wait(timeout=60) == 128 + signal.SIGHUP
        for pid, cmd in started.items():
            _gone_within(pid, f"{cmd} outlived a hung-up lbbsp demo")
        rest = demo.stdout.read()
    finally:
        for pid in [demo.pid, *started]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        demo.stdout.close()
    assert "Traceback" not in rest and "resource_tracker" not in rest, rest
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("lbbsp-demo-")] == []
    assert not [name for name in set(os.listdir("/dev/shm")) - shm_before
                if name.startswith("lbbsp-redis-") and (Path("/dev/shm", name, "owner").read_text().split()[0]
                                                       == str(demo.pid))]


@needs_torch
@pytest.mark.timeout(180)
def test_a_dumb_terminal_gets_the_progress_lines_of_a_pipe() -> None:
    """Under TERM=dumb (Emacs' shell, some CI consoles) rich draws a live table once, when it stops: such a terminal
    saw nothing between the header and the results, 25 s of the default demo on a 2-core machine."""
    import pty  # noqa: PLC0415

    leader, follower = pty.openpty()
    with subprocess.Popen([*LBBSP, "demo", "--steps", "10", "--hidden", "8", "--global-batch", "64"],
                          stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                          env={**_env(), "TERM": "dumb"}) as run:
        os.close(follower)
        out = b""
        with contextlib.suppress(OSError):  # EIO: the terminal's last writer is gone
            while chunk := os.read(leader, 4096):
                out += chunk
        os.close(leader)
    text = out.decode(errors="replace")
    assert run.returncode == 0, text
    assert re.search(r"\bBSP step +1/10", text) and re.search(r"LB-BSP step +10/10", text), text
