"""The experiment scripts' command lines (review s56): bounds named by their flags before anything runs, Ctrl-C and
SIGTERM ending a benchmark in one line with nothing left running or behind, and busy loops that end with the trace
recorder even when they were never resumed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lbbsp.protocol import MAX_WORKERS
from lbbsp.sim.cli import MAX_SEED
from lbbsp.sim.scenarios import MAX_CELLS
from test_experiments import EXPERIMENTS, _experiment
from test_sim_cli_s51 import _write_trace

LOOPS = 4 * (os.cpu_count() or 1)  # record_cpu_trace's --max-level bound: 4 busy loops per core
UNBUFFERED = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each line as printed, to act on it


def _run(script: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXPERIMENTS / script), *argv], capture_output=True, text=True,
                          timeout=120, check=False)


def _refused(result: subprocess.CompletedProcess[str], message: str) -> bool:
    """A one-line argparse error that says ``message``, no traceback."""
    return (result.returncode == 2 and "Traceback" not in result.stderr
            and message in result.stderr.splitlines()[-1])


def _wait_for_line(proc: subprocess.Popen[str], start: str, timeout_s: float = 90.0) -> None:
    """Read ``proc``'s stdout up to a line that starts with ``start`` (fails at its end or after ``timeout_s``)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"ended before a line starting {start!r}"
        if line.startswith(start):
            return
    pytest.fail(f"no line starting {start!r} within {timeout_s:g}s")


def _kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


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


def test_the_policy_benchmark_counts_the_iterations_in_its_size_check(tmp_path: Path) -> None:
    """It checked each size with 1 iteration: 16 workers x 10,000,000 iterations passed, made --out, and failed in
    the first run with a ConfigError's traceback."""
    out = tmp_path / "new" / "x"
    result = _run("bench_policies.py", "--scenarios", "cpu-contention", "--workers", "16", "--iterations", "10000000",
                  "--out", str(out))
    assert _refused(result, f"--workers x --iterations must be at most {MAX_CELLS:,}"), result.stderr[-2000:]
    assert "got 16 x 10000000" in result.stderr and "seeds 0-" not in result.stdout
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("flag", ["--workers", "--decision-workers", "--short-workers"])
def test_the_coordinator_benchmark_bounds_its_workers_at_a_jobs_most(flag: str) -> None:
    """200,000 had passed to JobConfig, which failed with a ConfigError's traceback."""
    result = _run("bench_coordinator.py", flag, "2", str(MAX_WORKERS + 1))
    assert _refused(result, f"{flag} must be at least 1 and at most {MAX_WORKERS:,}"), result.stderr[-2000:]
    assert result.stderr.rstrip().endswith(f"got {MAX_WORKERS + 1}"), result.stderr


def test_ctrl_c_ends_the_model_benchmark_in_one_line() -> None:
    """Ctrl-C printed the traceback of whichever model was learning."""
    bench = subprocess.Popen([sys.executable, str(EXPERIMENTS / "bench_models.py")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=UNBUFFERED)
    try:
        _wait_for_line(bench, "trace ")  # the first table's header: the models are being scored
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=60)
    finally:
        bench.kill()
    assert bench.returncode == 130 and err.strip() == "interrupted", err[-3000:]


def test_ctrl_c_ends_the_policy_benchmark_in_one_line_and_takes_back_the_folders_it_made(tmp_path: Path) -> None:
    """Ctrl-C printed a traceback and left the empty --out folder the run had made."""
    out = tmp_path / "new" / "results"
    bench = subprocess.Popen([sys.executable, str(EXPERIMENTS / "bench_policies.py"), "--scenarios", "cpu-contention",
                              "--workers", "1024", "--seeds", "20", "--iterations", "150", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=UNBUFFERED)
    try:
        _wait_for_line(bench, "cpu-contention, 1024 workers")  # past the check of --out, which makes it
        assert out.is_dir()
        bench.send_signal(signal.SIGINT)
        _, err = bench.communicate(timeout=60)
    finally:
        bench.kill()
    assert bench.returncode == 130 and err.strip() == "interrupted", err[-3000:]
    assert not (tmp_path / "new").exists()


def test_a_failed_run_takes_back_only_the_empty_folders_it_made(tmp_path: Path) -> None:
    args = _experiment("_args")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "theirs.txt").touch()
    with pytest.raises(SystemExit), args.empty_folders_removed_on_failure(tmp_path / "new" / "deeper" / "x.json"):
        (tmp_path / "new" / "deeper").mkdir(parents=True)
        raise SystemExit(2)
    assert not (tmp_path / "new").exists()
    with pytest.raises(KeyboardInterrupt), args.empty_folders_removed_on_failure(tmp_path / "kept" / "sub"):
        (tmp_path / "kept" / "sub").mkdir()
        (tmp_path / "kept" / "sub" / "half-written.json").touch()
        raise KeyboardInterrupt
    assert (tmp_path / "kept" / "sub" / "half-written.json").exists()  # not empty: left as it is
    with args.empty_folders_removed_on_failure(tmp_path / "ok"):  # a run that ends well keeps its folder
        (tmp_path / "ok").mkdir()
    assert (tmp_path / "ok").is_dir()


def test_sigterm_ends_the_coordinator_benchmark_and_its_workers() -> None:
    """A plain `kill` ended the main process alone: its worker processes ran on, each ending in tracebacks."""
    bench = subprocess.Popen([sys.executable, str(EXPERIMENTS / "bench_coordinator.py"), "--workers", "4", "--rounds",
                              "1", "--iterations", "300", "--skip-heap", "--short-workers", "1", "--decision-workers",
                              "16", "--warmup", "1", "--repeats", "2"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and sum("python" in p.name() for p in descendants) < 4:
            time.sleep(0.2)
            descendants = psutil.Process(bench.pid).children(recursive=True)
        assert sum("python" in p.name() for p in descendants) == 4, descendants  # the workers, beside redis-server
        time.sleep(1.0)  # well into the run
        descendants = psutil.Process(bench.pid).children(recursive=True)  # a row's workers may have ended since
        bench.terminate()
        _, err = bench.communicate(timeout=60)
        _, alive = psutil.wait_procs(descendants, timeout=10)
        assert not alive, alive
    finally:
        bench.kill()
        _kill_all(descendants)
    assert bench.returncode == 130 and err.strip() == "interrupted", err[-3000:]


def test_the_model_benchmarks_table_fits_its_longest_trace_name(tmp_path: Path) -> None:
    """A trace name past 16 characters pushed its row, and only its row, out of line with the header."""
    for name in ("a_trace_named_past_sixteen_characters", "b"):
        _write_trace(tmp_path / f"{name}.json", [0] * 40 + [1] * 40)
    result = _run("bench_models.py", "--traces", str(tmp_path), "--skip", "10")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for start in (i for i, line in enumerate(lines) if line.startswith("trace ")):
        table = lines[start:start + 4]  # the header, a row per trace, the mean
        assert table[-1].startswith("mean ") and len({len(line) for line in table}) == 1, "\n".join(table)
        for row in table[1:3]:  # each trace's 80 rows, 70 scored, right under the header's "rows" and "scored"
            assert row.index(" 80 ") + 3 == table[0].index("rows") + len("rows"), "\n".join(table)
            assert row.index(" 70 ") + 3 == table[0].index("scored") + len("scored"), "\n".join(table)
