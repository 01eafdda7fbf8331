"""What a docs walkthrough hit: ``lbbsp simulate`` left an empty --out folder behind when it was refused or
stopped, and ``lbbsp demo``'s closing lines were wrapped at 80 columns when piped. Each test failed before its fix."""
from __future__ import annotations

import contextlib
import io
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lbbsp.cli import main

LBBSP = [sys.executable, "-m", "lbbsp.cli"]


@pytest.mark.parametrize("bad", [["--redis", "redis://127.0.0.1:1/0"], ["--mean-dwell", "5"]],
                         ids=["unreachable-redis", "option-gpu-mix-refuses"])
def test_a_refused_run_creates_no_folder(bad: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A --redis that does not answer was checked after the default --out (experiments/results) was created: the
    run was refused "before anything runs" (docs/simulator.md) and left an empty folder behind. (--mean-dwell on
    gpu-mix was refused before the folder was made already: kept as a guard on the order of the checks.)"""
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--scenario", "gpu-mix", "--workers", "4", "--iterations", "3", *bad]) == 2
    assert "lbbsp: error: " in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_a_run_stopped_midway_removes_the_folders_it_made_and_keeps_those_it_found(tmp_path: Path) -> None:
    """Ctrl-C while the policies ran left the --out folders the run had just made, empty; a folder that was there
    before the run stays, empty or not."""
    found = tmp_path / "found"
    found.mkdir()
    run = subprocess.Popen([*LBBSP, "simulate", "--scenario", "gpu-mix", "--workers", "64", "--iterations", "100000",
                            "--out", str(found / "made" / "deeper")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, cwd=tmp_path)
    try:
        assert run.stdout is not None
        assert run.stdout.readline().startswith("building")  # past every check: the folders exist now
        assert (found / "made" / "deeper").is_dir()
        run.send_signal(signal.SIGINT)
        _, stderr = run.communicate(timeout=30)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 130 and "lbbsp: interrupted" in stderr, stderr
    assert list(tmp_path.iterdir()) == [found] and list(found.iterdir()) == []


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
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich's own switch: write as to a terminal
    assert not _console().soft_wrap
