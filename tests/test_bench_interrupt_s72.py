"""Ctrl-C in the framework benchmarks that run their workers as processes (bench_torch, bench_torch_loading,
bench_keras): a terminal sends SIGINT to the whole process group, and each torch.distributed rank or Keras worker
printed a traceback under the script's own, which left its --out folder behind. Each test failed before the fix."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_experiments import EXPERIMENTS

#: script -> (its arguments for a short run that is still running at its first progress line, that line's text, and
#: seconds to wait after it: bench_torch's next case, "a2x", keeps a busy-loop process running on a rank's core)
RUNS = {
    "bench_torch": (["--steps", "3", "--hidden", "8", "--global-batch", "64", "--repeats", "1"], "done: none", 3.0),
    "bench_torch_loading": (["--steps", "5", "--warmup", "1", "--read-us", "1000", "--hidden", "8", "--global-batch",
                             "16", "--repeats", "3"], "repeat: ", 0.0),
    "bench_keras": (["--epochs", "3", "--hidden", "8", "--global-batch", "64", "--repeats", "1", "--load-procs", "1"],
                    "repeat 1/1, bsp", 0.0),
}


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _in_session(session: int) -> list[psutil.Process]:
    """The processes still running in ``session`` (a process started with start_new_session=True leads its own)."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError):  # ended since the listing
            if os.getsid(process.pid) == session and _running(process):
                found.append(process)
    return found


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def _keras_workers_started(pid: int, timeout_s: float = 60.0) -> None:
    """Wait until bench_keras's two workers run (its progress line comes before it starts them): a Ctrl-C in the
    milliseconds of their start is ignored, as the workers' inherit that."""
    deadline = time.monotonic() + timeout_s
    while sum("keras_digits" in _command(c) for c in psutil.Process(pid).children()) < 2:
        assert time.monotonic() < deadline, "bench_keras started no workers"
        time.sleep(0.1)
    time.sleep(2.0)  # inside their start-up (TensorFlow's import takes seconds)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", sorted(RUNS))
def test_ctrl_c_to_the_process_group_ends_the_benchmark_in_one_line_and_leaves_nothing_behind(
        script: str, tmp_path: Path) -> None:
    pytest.importorskip("tf_keras" if script == "bench_keras" else "torch")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the benchmarks need two CPU cores, one per worker")
    args, first_line, settle_s = RUNS[script]
    out = tmp_path / "new" / "results.json"
    with (tmp_path / "stderr").open("w+") as stderr:  # a file: a pipe left unread could fill and stall the run
        bench = subprocess.Popen([sys.executable, str(EXPERIMENTS / f"{script}.py"), *args, "--out", str(out)],
                                 start_new_session=True, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        started: list[psutil.Process] = []
        try:
            assert bench.stdout is not None
            for line in bench.stdout:
                if first_line in line:
                    break
            else:
                stderr.seek(0)
                pytest.fail(f"{script} ended before its first progress line:\n{stderr.read()[-3000:]}")
            if script == "bench_keras":
                _keras_workers_started(bench.pid)
            time.sleep(settle_s)
            started = psutil.Process(bench.pid).children(recursive=True)  # its Redis server has a session of its own
            os.killpg(bench.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the script and everything it started
            assert bench.wait(timeout=120) == 130
            deadline = time.monotonic() + 10  # orphans a moment to be reaped
            while (left := [*filter(_running, started), *_in_session(bench.pid)]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not left, [_command(p)[:120] for p in left]
        finally:
            bench.kill()
            bench.wait()
            for process in [*started, *_in_session(bench.pid)]:
                with contextlib.suppress(psutil.Error):
                    process.kill()
        stderr.seek(0)
        err = stderr.read()
    # libraries may log on the way out: the last line, and no traceback, are what is asked
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err, err[-3000:]
    assert not (tmp_path / "new").exists()  # the --out folder the run had made
