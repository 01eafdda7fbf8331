"""The CPU-trace tools from a new user's side (review s61): the recorder names empty levels as simulate does, the
loader refuses levels above a trace's max_level, simulate keeps its results out of the traces folder, and the model
benchmark says how many iterations it scored."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lbbsp.cli import main
from lbbsp.errors import ConfigError
from lbbsp.sim.traces import DEFAULT_TRACE_DIR, CPUTrace, load_traces
from test_experiments import EXPERIMENTS
from test_sim_cli_s51 import COLUMNS, _write_trace


def test_the_recorder_names_a_level_with_no_rows_as_simulate_does(tmp_path: Path) -> None:
    """A 2-second recording with no row at levels 1 and 2 printed their 0 rows without a warning, where simulate then
    warned of both: the recorder warned only of 1 to 29 rows."""
    out = tmp_path / "t.json"
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "record_cpu_trace.py"), "--seconds", "1",
                             "--max-level", "1", "--mean-dwell-s", "1e5", "--core", str(min(os.sched_getaffinity(0))),
                             "--out", str(out)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stdout.split())
    assert "level 1: 0 rows" in said and "level 1 has 0 rows, so a replay never visits it" in said, said
    assert "record longer (--seconds)" in said, said  # the loader's words, as simulate will warn


def test_the_loader_says_a_level_with_no_rows_is_never_visited(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Its warning for 0 rows said 'a replay wants at least 30 (every worker at that level replays them in turn)',
    where the scenario draws levels among those with rows only (docs/simulator.md says so)."""
    path = _write_trace(tmp_path / "short.json", [0] * 40)
    trace = json.loads(path.read_text())
    path.write_text(json.dumps({**trace, "meta": {"max_level": 1}}))
    with caplog.at_level(logging.WARNING, logger="lbbsp.sim.traces"):
        load_traces(tmp_path)
    assert len(caplog.messages) == 1 and "level 1 has 0 rows, so a replay never visits it" in caplog.messages[0]
    assert "replays them in turn" not in caplog.messages[0], caplog.messages


def test_a_trace_with_rows_above_its_max_level_is_refused(tmp_path: Path) -> None:
    """Rows at level 7 with max_level 2 were accepted, with a warning that levels 0-2 had 0 rows."""
    rows = [[900.0, 0.5, 0.9, 0.0, 0.3, 4, 7]] * 40
    path = tmp_path / "seven.json"
    path.write_text(json.dumps({"meta": {"max_level": 2}, "columns": COLUMNS, "rows": rows}))
    with pytest.raises(ConfigError) as refused:
        CPUTrace.load(path)
    said = str(refused.value)
    assert "\n" not in said and str(path) in said, said
    assert "hog_level must be at most meta's max_level 2, row 0 has 7 (40 rows above max_level)" in said, said


def test_simulate_refuses_an_out_that_is_its_traces_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--traces same --out same` wrote its result JSON among the traces, and the next run failed reading it as one."""
    traces = tmp_path / "same"
    _write_trace(traces / "mine.json", [0] * 40 + [1] * 40)
    for out in (traces, traces / ".." / "same"):
        assert main(["simulate", "--scenario", "cpu-contention", "--workers", "4", "--iterations", "3",
                     "--traces", str(traces), "--out", str(out)]) == 2
        said, err = capsys.readouterr()
        assert "building" not in said and err.count("\n") == 1, err
        assert f"--out {out} is the folder the traces are read from" in err, err
    assert [p.name for p in traces.iterdir()] == ["mine.json"]
    # without --traces, the shipped traces' folder is theirs (nothing is written there either)
    assert main(["simulate", "--scenario", "mixed", "--workers", "4", "--iterations", "3",
                 "--out", str(DEFAULT_TRACE_DIR)]) == 2
    assert "is the folder the traces are read from" in capsys.readouterr().err


def test_the_model_benchmark_gives_the_iterations_it_scored_beside_the_rows(tmp_path: Path) -> None:
    """With the default --skip 50 a 72-row trace showed 72 under 'iterations', though 22 were scored."""
    _write_trace(tmp_path / "t.json", [0] * 36 + [1] * 36)
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_models.py"), "--traces", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("trace ")]
    assert len(headers) == 2, result.stdout
    for start in headers:
        assert lines[start].split()[1:3] == ["rows", "scored"], lines[start]
        assert lines[start + 1].split()[:3] == ["t", "72", "22"], lines[start + 1]


def test_the_recorders_help_says_how_its_features_differ_from_a_workers() -> None:
    """It said 'exactly as a worker would report them', where it samples every iteration and without children."""
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "record_cpu_trace.py"), "--help"],
                            capture_output=True, text=True, timeout=60, check=True)
    said = " ".join(result.stdout.split())
    assert "exactly as a worker" not in said and "0.2 s" in said and "without this process's children" in said, said


def test_a_level_is_counted_by_the_rows_a_replay_uses(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A level of 30 rows, the first run partly at the level before, replays 29 (the scenario leaves out rows across
    a switch) and was said to have enough; the recorder's summary counted the same way."""
    _write_trace(tmp_path / "edge.json", [0] * 40 + [1] * 30 + [0] * 40)
    trace = CPUTrace.load(tmp_path / "edge.json")
    assert trace.level_rows() == {0: (79, 1), 1: (29, 1)}
    assert trace.steady_rows().sum() == 108 and not trace.steady_rows()[[40, 70]].any()
    with caplog.at_level(logging.WARNING, logger="lbbsp.sim.traces"):
        load_traces(tmp_path)
    assert len(caplog.messages) == 1, caplog.messages
    assert "level 1 has 29 rows a replay uses (1 more ran partly at the level before)" in caplog.messages[0]


def test_a_level_seen_only_across_switches_keeps_those_rows(tmp_path: Path) -> None:
    """Its rows are all it has: left out, a replay would never visit the level."""
    _write_trace(tmp_path / "flicker.json", [0] * 40 + [1] + [0] * 40 + [1] + [0] * 40)
    assert CPUTrace.load(tmp_path / "flicker.json").level_rows() == {0: (118, 2), 1: (2, 0)}
