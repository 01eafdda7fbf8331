"""Recorded CPU traces: loading them (a bad value located by row and column, thin or empty levels named), replaying a
level at its median, and the recorder (experiments/record_cpu_trace.py): its bounds, help, --out and busy loops."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from lbbsp import ConfigError
from lbbsp.policies import BSPPolicy
from lbbsp.sim.cli import MAX_SEED
from lbbsp.sim.engine import compare
from lbbsp.sim.scenarios import CPUContention, GPUMix, MixedCluster
from lbbsp.sim.traces import DEFAULT_TRACE_DIR, TRACE_FEATURES, CPUTrace, load_traces
from test_bench_cli import EXPERIMENTS, _kill_all, _refused, _wait_for_line
from test_experiments import _run
from test_sim_cli import COLUMNS, _write_trace


@pytest.mark.parametrize("text", ['{"columns": ["throughput"], "rows": [[1' + "0" * 400 + "]]}",
                                  "[" * 100_000 + "]" * 100_000],
                         ids=["integer beyond a float", "nested too deeply"])
def test_an_unreadable_trace_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="cannot read CPU trace"):
        CPUTrace.load(path)


def test_a_hog_level_beyond_an_integer_is_refused(tmp_path: Path) -> None:
    """A hog_level of 1e300 passed as a whole number >= 0, then loaded as -2**63."""
    path = tmp_path / "huge.json"
    path.write_text(json.dumps({"columns": ["throughput", "hog_level", *TRACE_FEATURES],
                                "rows": [[1.0, 1e300, 0.5, 0.5, 0.1, 0.5, 4.0]]}))
    with pytest.raises(ConfigError, match="hog_level"):
        CPUTrace.load(path)


LOOPS = 4 * (os.cpu_count() or 1)  # record_cpu_trace's --max-level bound: 4 busy loops per core


#: Runs the script in argv[1] with the rest as its arguments, its child processes slow to reach ctypes.CDLL (the busy
#: loops' way to prctl): the recorder had stopped them before they got there more often than not; now always.
SLOW_CHILDREN = """
import ctypes, os, runpy, sys, time
parent, real = os.getpid(), ctypes.CDLL
def slow(*args, **kwargs):
    if os.getpid() != parent:
        time.sleep(0.5)
    return real(*args, **kwargs)
ctypes.CDLL = slow
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_kill_9_of_the_recorder_takes_even_busy_loops_never_resumed_along(tmp_path: Path) -> None:
    """The busy loops were stopped (SIGSTOP) before they had tied their end to the recorder's: with no load switch
    before a `kill -9` they outlived it, stopped, under init, holding its stdout open."""
    recorder = subprocess.Popen([sys.executable, "-c", SLOW_CHILDREN, str(EXPERIMENTS / "record_cpu_trace.py"),
                                 "--seconds", "60", "--batch", "64", "--max-level", "2", "--mean-dwell-s", "1e5",
                                 "--core", str(min(os.sched_getaffinity(0))), "--out", str(tmp_path / "t.json")],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    busy: list[psutil.Process] = []
    try:
        _wait_for_line(recorder, "recording")
        busy = psutil.Process(recorder.pid).children()
        deadline = time.monotonic() + 10  # a SIGSTOP takes effect when the loop next runs
        while time.monotonic() < deadline and any(p.status() != psutil.STATUS_STOPPED for p in busy):
            time.sleep(0.05)
        assert len(busy) == 2 and all(p.status() == psutil.STATUS_STOPPED for p in busy), busy
        recorder.kill()
        recorder.wait(timeout=30)
        _, alive = psutil.wait_procs(busy, timeout=10)
        assert not alive, alive
    finally:
        recorder.kill()
        _kill_all(busy)
        recorder.communicate(timeout=30)


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-level", str(LOOPS + 1)], f"--max-level must be at most {LOOPS} (4 busy loops per core"),  # had forked on
    (["--seed", "-1"], f"--seed must be in [0, {MAX_SEED}], got -1"),  # numpy's traceback
    (["--seed", str(MAX_SEED + 1)], f"--seed must be in [0, {MAX_SEED}], got {MAX_SEED + 1}"),
    (["--batch", "100000000000"], "--batch must be at most 16,384, got 100000000000"),  # a traceback for 570 TiB
], ids=["max-level", "seed-negative", "seed-too-big", "batch"])
def test_the_recorder_refuses_sizes_past_its_bounds_in_one_line(argv: list[str], message: str, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert _refused(_run("record_cpu_trace.py", "--out", str(out), *argv), message)
    assert not out.exists()


def test_the_recorder_takes_its_bounds_themselves_and_gives_them_in_its_help(tmp_path: Path) -> None:
    """At each bound, the next check (--seconds nan) is the one that refuses the run."""
    at_bounds = _run("record_cpu_trace.py", "--out", str(tmp_path / "t.json"), "--max-level", str(LOOPS), "--seed",
                     str(MAX_SEED), "--batch", "16384", "--seconds", "nan")
    assert _refused(at_bounds, "--seconds must be positive"), at_bounds.stderr
    said = " ".join(_run("record_cpu_trace.py", "--help").stdout.split())
    assert f"at most {LOOPS} (4 per core of this machine)" in said and "at most 16,384" in said, said
    assert f"0 to {MAX_SEED}" in said, said


def test_a_trace_level_the_recorder_ran_but_never_measured_is_named(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    shipped = json.loads(next(DEFAULT_TRACE_DIR.glob("*.json")).read_text())
    level = shipped["columns"].index("hog_level")
    shipped["rows"] = [row for row in shipped["rows"] if row[level] == 0][:100]  # a short recording: level 0 only
    (tmp_path / "short.json").write_text(json.dumps(shipped))
    with caplog.at_level(logging.WARNING, logger="lbbsp.sim.traces"):
        load_traces(tmp_path)
    assert [m for m in caplog.messages if "has 0 rows" in m and ("level 1" in m or "level 2" in m)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lbbsp.sim.traces"):
        load_traces(DEFAULT_TRACE_DIR)
    assert not caplog.messages


def test_a_level_is_replayed_at_its_median(tmp_path: Path) -> None:
    """Level 0 runs at 1, 1 and 10 samples/s (median 1, mean 4), level 1 at 0.5: without noise a worker runs at
    1,000 or 500 samples/s (the levels' medians, the first scaled to 1,000), not at 1,000 or 125."""
    columns = ["throughput", "hog_level", "cpu_util", "proc_cpu", "colocated_load", "mem_util", "cores"]
    rows = [[t, 0, 0.5, 0.5, 0.0, 0.3, 8] for t in [1.0, 1.0, 10.0] * 20] + [[0.5, 1, 0.9, 0.5, 1.0, 0.3, 8]] * 60
    (tmp_path / "a.json").write_text(json.dumps({"columns": columns, "rows": rows}))
    scenario = CPUContention(8, 40, 0, traces=load_traces(tmp_path), noise=False, machine_spread=0.0, mean_dwell=5)
    assert sorted(np.unique(np.round(scenario.speed, 6)).tolist()) == [500.0, 1000.0]


def test_a_trace_warns_of_the_levels_short_of_rows_and_only_those(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    columns = ["throughput", "hog_level", "cpu_util", "proc_cpu", "colocated_load", "mem_util", "cores"]
    # level 1: 30 rows a replay uses, the first of 31 ran partly at level 0
    rows = [[1000.0, 0, 0.5, 0.5, 0.0, 0.3, 8]] * 30 + [[500.0, 1, 0.9, 0.5, 1.0, 0.3, 8]] * 31
    (tmp_path / "a.json").write_text(json.dumps({"columns": columns, "rows": rows, "meta": {"max_level": 2}}))
    with caplog.at_level(logging.WARNING, logger="lbbsp.sim.traces"):
        load_traces(tmp_path)
    assert len(caplog.messages) == 1 and "level 2 has 0 rows" in caplog.messages[0]


def test_a_thin_level_in_a_trace_is_named_with_its_rows_when_the_traces_are_loaded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A hand-made 3-row trace, or an 8-second recording with 4 rows at level 1, was replayed without a word:
    every worker at that level replays those few rows over and over."""
    _write_trace(tmp_path / "mine" / "short.json", [0] * 40 + [1] * 4 + [2] * 35)
    _write_trace(tmp_path / "mine" / "tiny.json", [0, 0, 0])
    with caplog.at_level(logging.WARNING, logger="lbbsp.sim.traces"):
        traces = load_traces(tmp_path / "mine")
    assert [t.name for t in traces] == ["short", "tiny"]
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 2, said
    assert "CPU trace short" in said[0] and "at least 30" in said[0], said
    assert "level 1 has 3 rows a replay uses (1 more ran partly at the level before)" in said[0], said
    assert "CPU trace tiny" in said[1] and "level 0 has 3 rows" in said[1], said


def test_the_shipped_traces_load_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lbbsp.sim.traces"):
        load_traces()
        load_traces(EXPERIMENTS / "traces_heldout")
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_the_recorder_uses_its_backends_batch_and_counts_rows_per_level(tmp_path: Path) -> None:
    """--batch defaulted to 256 for numpy too (steps of about 8 ms, which docs/simulator.md calls noisy), where the
    shipped numpy trace used 2048; and the summary gave no count per level, where a short recording leaves a level
    with a handful of rows."""
    out = tmp_path / "t.json"
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "record_cpu_trace.py"), "--backend", "numpy",
                             "--seconds", "0.3", "--max-level", "1", "--mean-dwell-s", "1e5", "--core",
                             str(min(os.sched_getaffinity(0))), "--out", str(out)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    trace = json.loads(out.read_text())
    assert trace["meta"]["batch"] == 2048
    rows = len(trace["rows"])
    assert rows < 30  # 0.3 s of 2048-sample steps (about 11 here): fewer rows than a replay should rely on
    summary = " ".join(result.stdout.split())
    assert "for 0.3s" in summary, summary  # (it said "for 0s")
    assert f"{rows} iterations (level 0: {rows} rows, level 1: 0 rows)" in summary, summary
    assert f"level 0 has {rows} rows" in summary and "--seconds" in summary, summary


def test_the_recorders_help_gives_each_backends_batch() -> None:
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "record_cpu_trace.py"), "--help"],
                            capture_output=True, text=True, timeout=60, check=True)
    said = " ".join(result.stdout.split())
    assert "(default: 2048 for numpy, 256 for torch" in said, said
    assert "small MLP (numpy or torch)" not in said


GOOD = [900.0, 0.5, 0.9, 0.0, 0.3, 4, 1]  # one row of COLUMNS a replay can use


@pytest.mark.parametrize("build", [CPUContention, MixedCluster])
@pytest.mark.parametrize("folder", ["my_traces", Path("my_traces")])
def test_a_folder_given_as_traces_is_shown_as_given_with_the_call_that_reads_it(build: type, folder: object) -> None:
    """traces="my_traces" had said 'got ['m', 'y', '_', 't', 'r', 'a', 'c', 'e', 's']' (the string as a list)."""
    with pytest.raises(ConfigError) as raised:
        build(8, 20, 0, traces=folder)
    said = str(raised.value)
    assert f"got the folder {folder!r}" in said and "traces=load_traces('my_traces')" in said, said
    assert "['m', 'y'" not in said


@pytest.mark.parametrize(("traces", "shown"), [([1, 2], "got [1, 2]"), (5, "got 5"), ([], "got []")])
def test_traces_that_are_no_traces_are_shown_as_passed(traces: object, shown: str) -> None:
    """A list of other things is shown as it was passed; a non-iterable (5) had raised TypeError from list()."""
    with pytest.raises(ConfigError, match=re.escape(shown)):
        CPUContention(4, 10, 0, traces=traces)


def test_a_folder_without_json_traces_says_what_it_holds(tmp_path: Path) -> None:
    """A trace saved without .json, or one in a subfolder, had given only 'no CPU traces in DIR', though the
    recorder writes whatever --out says."""
    (tmp_path / "cpu_torch").write_text(json.dumps({"columns": COLUMNS, "rows": [GOOD] * 3}))
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "t.json").write_text("{}")
    with pytest.raises(ConfigError) as raised:
        load_traces(tmp_path)
    said = str(raised.value)
    assert f"no CPU traces in {tmp_path}: no *.json files directly in it" in said, said
    assert "it holds cpu_torch, inner/" in said, said
    (tmp_path / "more").mkdir()
    for i in range(6):
        (tmp_path / "more" / f"f{i}").touch()
    with pytest.raises(ConfigError, match=re.escape("it holds f0, f1, f2, f3, f4 and 1 more")):
        load_traces(tmp_path / "more")


def test_the_recorder_refuses_an_out_that_lbbsp_would_not_read_before_recording(tmp_path: Path) -> None:
    """`--out my_traces/cpu` recorded for minutes into a file that `--traces my_traces` then ignored."""
    out = tmp_path / "my_traces" / "cpu"
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "record_cpu_trace.py"), "--seconds", "0.3", "--out",
                             str(out)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "--out must end in .json" in result.stderr, result.stderr
    assert "recording" not in result.stdout and not out.exists()


@pytest.mark.parametrize(("column", "value", "said"), [
    (1, "NaN", "cpu_util must be in [0.0, 1.0], row 4 has nan"),
    (0, "0.0", "throughput must be in [0.1, 1e12] samples/s, row 4 has 0"),
    (0, "-5.0", "throughput must be in [0.1, 1e12] samples/s, row 4 has -5"),
    (0, "1e400", "throughput must be in [0.1, 1e12] samples/s, row 4 has inf"),
    (0, "1e308", "throughput must be in [0.1, 1e12] samples/s, row 4 has 1e+308"),  # a level's median overflowed
    (0, "1e-06", "throughput must be in [0.1, 1e12] samples/s, row 4 has 1e-06"),  # a day's time, blamed on options
    (6, "1.5", "hog_level must be a whole number in [0, 2**53), row 4 has 1.5"),
])
def test_a_bad_value_in_a_trace_is_located_by_row_and_column(tmp_path: Path, column: int, value: str, said: str) -> None:
    """A NaN feature, a throughput of 0, -5 or 1e400 and a hog_level of 1.5 had all said the same sentence
    naming neither the row nor the column."""
    rows = [list(GOOD) for _ in range(6)]
    rows[4][column] = 12345.5  # a marker, replaced in the text by the bad value (NaN and 1e400 are no JSON)
    rows[5][column] = 12345.5  # a second bad row: the first is named, the count says there are more
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"columns": COLUMNS, "rows": rows}).replace("12345.5", value))
    with pytest.raises(ConfigError, match=re.escape(f"cannot read CPU trace {path}: {said} (2 rows out of range)")):
        CPUTrace.load(path)


def test_the_first_bad_row_is_named_whichever_column_it_is_in(tmp_path: Path) -> None:
    rows = [list(GOOD) for _ in range(5)]
    rows[3][0], rows[2][5] = 0.0, 0  # throughput bad in row 3, cores (below 1) in row 2: row 2 is the first
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"columns": COLUMNS, "rows": rows}))
    with pytest.raises(ConfigError, match=re.escape("cores must be in [1.0, 100000.0], row 2 has 0 (1 row out of")):
        CPUTrace.load(path)


def test_sim_inputs_a_new_user_tries_are_named() -> None:
    assert compare(GPUMix(4, 3, 0), np.int64(3), {"bsp": BSPPolicy()})["bsp"].iteration_s  # as the scenarios take it
    for folder in ("", None, 5):  # '' had read the current folder, the others a bare TypeError
        with pytest.raises(ConfigError, match="is not a directory"):
            load_traces(folder)  # type: ignore[arg-type]


RECORDER = Path(__file__).resolve().parent.parent / "experiments" / "record_cpu_trace.py"


def test_the_trace_recorders_busy_loops_are_co_located_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder's busy loops are its children but stand for other jobs: counted as its own, its traces would
    have read proc_cpu 1 and no co-located load while a loop spun (unlike the shipped traces, and a real worker)."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # the recorder sets them on import
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    spec = importlib.util.spec_from_file_location("record_cpu_trace", RECORDER)
    assert spec is not None and spec.loader is not None
    recorder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recorder)
    schedule = recorder.ContentionSchedule(min(os.sched_getaffinity(0)), 1, 1e6, 0).start()  # no switch for days
    try:
        schedule._set(1)  # one busy loop on, from now to the end
        loop = psutil.Process(schedule._pids[0])
        before, started = sum(loop.cpu_times()[:2]), time.monotonic()
        rows = recorder.record(lambda: time.sleep(0.05), 1, 1.0, schedule)  # an idle "training step"
        loop_cores = (sum(loop.cpu_times()[:2]) - before) / (time.monotonic() - started)
    finally:
        schedule.close()
    proc_cpu = sum(row[recorder.COLUMNS.index("proc_cpu")] for row in rows) / len(rows)
    assert loop_cores > 0.3, loop_cores  # it did spin
    assert proc_cpu < loop_cores / 2, (proc_cpu, loop_cores)  # and was not the recorder's own CPU


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
