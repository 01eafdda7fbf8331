"""``lbbsp demo`` and ``lbbsp simulate --redis`` take $LBBSP_REDIS_URL as the other commands do (an empty one counts
as unset), ``lbbsp demo -q`` prints only its results, and the demo's launcher says what it waits for when nothing
else has been printed for a while. Each test failed before its fix."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from lbbsp import EmbeddedRedis
from lbbsp.cli import main
from lbbsp.integrations import demo
from lbbsp.store import Store

#: The tests that run the demo's launcher: it refuses to start without torch (its workers train with it).
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the demo needs lbbsp[torch]")

LBBSP = [sys.executable, "-m", "lbbsp.cli"]
NOWHERE = "redis://:s3cret@127.0.0.1:1/0"  # nothing listens on port 1: refused at once
SMALL_SIM = ["simulate", "--scenario", "gpu-mix", "--workers", "2", "--iterations", "1"]


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


# -- lbbsp simulate --redis ---------------------------------------------------------------------------------------
def test_simulate_redis_without_a_url_takes_the_variables(redis_url: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A bare --redis started an embedded redis-server whatever $LBBSP_REDIS_URL said."""
    monkeypatch.setenv("LBBSP_REDIS_URL", NOWHERE)
    assert main([*SMALL_SIM, "--redis", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "$LBBSP_REDIS_URL" in err and "127.0.0.1:1" in err and "s3cret" not in err
    monkeypatch.setenv("LBBSP_REDIS_URL", redis_url)
    assert main([*SMALL_SIM, "--redis", "--out", str(tmp_path)]) == 0
    assert f"again through Redis ({redis_url}, from $LBBSP_REDIS_URL)" in capsys.readouterr().out
    (result,) = tmp_path.glob("*.json")
    assert json.loads(result.read_text())["redis_check"]["redis"] == redis_url


def test_simulate_redis_with_an_empty_variable_runs_on_an_embedded_server(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LBBSP_REDIS_URL", "")
    assert main([*SMALL_SIM, "--redis", "--out", str(tmp_path)]) == 0
    assert "again through Redis (embedded redis-server)" in capsys.readouterr().out


def test_simulate_without_redis_stays_in_process_whatever_the_variable(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LBBSP_REDIS_URL", NOWHERE)
    assert main([*SMALL_SIM, "--out", str(tmp_path)]) == 0
    assert "through Redis" not in capsys.readouterr().out


def test_simulate_help_says_where_a_bare_redis_goes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "else $LBBSP_REDIS_URL" in text and "without --redis the policies run in-process" in text


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
