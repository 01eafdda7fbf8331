"""The benchmark scripts in experiments/ as a user runs them: defaults stated in --help, bounds and flags refused
before a run, progress as a run goes, Ctrl-C and SIGTERM ending a run in one line with nothing left running, and
--out (a file named where a folder must be, no folder left behind by a run refused, failed or interrupted)."""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import psutil
import pytest

from lbbsp.protocol import MAX_WORKERS
from lbbsp.sim.scenarios import MAX_CELLS
from test_experiments import _experiment, _run

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


SCRIPTS = ["bench_coordinator", "bench_models", "bench_torch", "bench_torch_loading", "bench_keras", "bench_flower",
           "bench_policies", "bench_gpu", "bench_torch_gpu"]


def _parser(name: str) -> argparse.ArgumentParser:
    """The script's own parser, as its ``main`` builds it (caught at ``parse_args``, before anything runs)."""
    captured: list[argparse.ArgumentParser] = []

    def caught(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        captured.append(self)
        raise SystemExit(0)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", caught), mock.patch.object(sys, "argv", [name]):
        with pytest.raises(SystemExit):
            _experiment(name).main()
    return captured[0]


def _written(default: Any) -> list[str]:
    """How a help text may write ``default``: as str() does, as :g does for a float, a list space-separated."""
    if isinstance(default, list):
        return [" ".join(map(str, default))]
    return [str(default)] + ([f"{default:g}"] if isinstance(default, float) else [])


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_option_of_a_benchmark_states_its_default_in_help(name: str) -> None:
    """bench_torch's and bench_torch_loading's --help stated none of their defaults, bench_keras's --epochs said only
    its steps "at the default", bench_flower's --rounds only how long the defaults take, and bench_torch_gpu's --lags
    said "(2 is the default)" of a flag whose default is 2,4."""
    parser = _parser(name)
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            continue
        text = " ".join(((action.help or "") % {**vars(action), "prog": parser.prog}).split())  # as --help does
        flag = action.option_strings[-1]
        assert "(default: " in text, f"{name} {flag}: {text!r}"
        if isinstance(action.default, Path) or "/" in str(action.default):
            continue  # a path: the help may name it in words ("the one the docs quote")
        if action.choices is not None and action.default == sorted(action.choices):
            assert "(default: all)" in text, f"{name} {flag}: {text!r}"
            continue
        assert any(f"default: {written}" in text for written in _written(action.default)), f"{name} {flag}: {text!r}"


def test_bench_gpu_refused_for_want_of_a_gpu_leaves_no_out_folder(tmp_path: Path) -> None:
    """It made --out's folder, then found no GPU and exited: the empty folder stayed behind."""
    if pytest.importorskip("torch").cuda.is_available():
        pytest.skip("a CUDA GPU is here: bench_gpu would run")
    out = tmp_path / "new" / "deeper" / "gpu.json"
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_gpu.py"), "--out", str(out)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == "bench_gpu needs a CUDA GPU; none is visible here"
    assert not (tmp_path / "new").exists()


def _on_one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def test_bench_keras_refused_on_one_core_leaves_no_out_folder_and_says_how_many_it_has(tmp_path: Path) -> None:
    """It made --out's folder before it found it had one core where it needs two; the folder stayed behind."""
    out = tmp_path / "new" / "keras.json"
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_keras.py"), "--out", str(out)],
                            capture_output=True, text=True, timeout=120, check=False, preexec_fn=_on_one_core)
    assert result.returncode == 1, result.stderr
    assert "needs two CPU cores" in result.stderr and "may use 1" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "new").exists()


class _Closable:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def close(self) -> None:
        pass

    def rounds(self) -> list[list[Any]]:  # what a ClientHistory hands bench_flower: one reply of 10 samples
        return [[SimpleNamespace(iteration=1, samples=10)]]


def test_bench_flower_prints_each_round_as_it_ends(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    """The docstring promised progress per round; the rounds of a run were printed only when the whole run had ended
    (a run of 15 rounds with a slow link is 4 silent minutes). Here each round must be on stdout before the next one
    starts."""
    bench = _experiment("bench_flower")
    seen: list[str] = []

    def run(grid: object, cfg: dict[str, Any], history: object,
            on_round: Callable[[dict[str, float]], None] | None = None) -> dict[str, Any]:
        rows = []
        for r in range(int(cfg["num-server-rounds"]) + 1):  # round 0: the starting model, as the ServerApp's
            rows.append({"round": r, "accuracy": 0.1 * r, "elapsed_s": 2.0 * r})
            if on_round is not None:
                on_round(rows[-1])
            seen.append(capsys.readouterr().out)
        return {"rounds": rows}

    monkeypatch.setattr(bench.server_app, "run", run)
    monkeypatch.setattr(bench, "LocalGrid", _Closable)
    monkeypatch.setattr(bench.ClientHistory, "from_url", lambda *args: _Closable())
    monkeypatch.setattr(sys, "argv", ["bench_flower.py", "--rounds", "2", "--clients", "2",
                                      "--out", str(tmp_path / "f.json")])
    bench.main()
    runs = len(bench.RUNS)
    assert len(seen) == 3 * runs
    for r, out in enumerate(seen):
        if r % 3 == 0:
            assert "round" not in out.replace("rounds", ""), out  # round 0 is the start, not a round
        else:
            assert f"round {r % 3:3d}  accuracy {0.1 * (r % 3):.3f}  elapsed {2.0 * (r % 3):7.2f}s" in out, (r, out)
    assert (tmp_path / "f.json").exists()


DOCS_DIR = Path(__file__).resolve().parents[1] / "docs"


def test_torch_docs_name_the_rows_the_torch_benchmarks_print() -> None:
    """docs/torch.md's tables say "no load", "static 2x" and "plain DDP"; bench_torch prints none, a2x, a3x and b,
    bench_torch_loading ddp, lbbsp-no-prefetch and lbbsp, and the page had not said which row was which."""
    page = " ".join((DOCS_DIR / "torch.md").read_text().split())
    for named in ("`none` (no load)", "`a2x` and `a3x` (static 2x and 3x)", "`b` (fluctuating)"):
        assert named in page, named
    for mode in _experiment("bench_torch_loading").MODES:
        assert f"`{mode}`" in page, mode


def test_bench_flower_interrupted_says_so_in_one_line_and_leaves_no_out_folder(tmp_path: Path) -> None:
    """Ctrl-C during a run had printed a 20-line traceback from the wait for a Flower reply, and left the --out folder
    it had made; the other benchmarks that run for minutes in one process end with "interrupted" and status 130."""
    out = tmp_path / "new" / "flower.json"
    proc = subprocess.Popen([sys.executable, str(EXPERIMENTS / "bench_flower.py"), "--clients", "2", "--rounds", "3",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("-- fedavg")  # the first run started
        time.sleep(1.0)  # inside its first round (about 2 s)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # Flower may log a line of its own as it stops: the last line, and no traceback, are what is asked
    assert proc.returncode == 130 and err.rstrip().endswith("interrupted") and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "new").exists()


def test_bench_coordinators_decision_rows_come_with_progress(redis_url: str) -> None:
    """Its rows are printed once every model has run all its iterations, in turns: minutes of silence at 10,000
    workers. A line comes at each quarter, none at the end (the rows follow)."""
    lines: list[str] = []
    bench = _experiment("bench_coordinator")
    ewma = {"EWMA": bench.MODELS["EWMA (baseline)"]}
    times = bench.decision_times(redis_url, 8, 4, 4, models=ewma, progress=lines.append)
    assert lines == [f"  8 workers: {k}/8 iterations of every model" for k in (2, 4, 6)], lines
    assert len(times["EWMA"]["policy"]) == 4


def test_bench_torch_gpus_one_rank_hears_no_batch_norm_warning(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Its lbbsp runs printed the BatchNorm warning's paragraph (slices of different sizes, SyncBatchNorm, one-sample
    batches), in the dry run the docs quote too: with its one rank the slice is the whole global batch, and the CNN's
    last BatchNorm sees 8x8 maps, so none of it applied. Other warnings still show."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist  # noqa: PLC0415  (after the skip)

    from lbbsp.integrations import torch_grad  # noqa: PLC0415

    bench = _experiment("bench_torch_gpu")
    monkeypatch.setattr(torch_grad, "_warned_batch_norm", False)  # it warns once a process: as in a fresh one
    data = torch.utils.data.TensorDataset(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bench.run("lbbsp lag=2", 2, 1, data, torch.device("cpu"))
            warnings.warn("a later warning", UserWarning, stacklevel=1)
    finally:
        dist.destroy_process_group()
    assert not [w for w in caught if w.category is torch_grad.BatchNormWarning], caught
    assert "a later warning" in [str(w.message) for w in caught]  # the filter ends with the run


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_benchmarks_out_help_names_its_default_file_from_the_repository_root(name: str) -> None:
    """bench_policies's and bench_torch_gpu's --help showed this checkout's absolute path, the others "the one the
    docs quote": each now names the file as the docs do, and says it is in the checkout wherever they run."""
    out = next(action for action in _parser(name)._actions if "--out" in action.option_strings)
    assert (f"(default: experiments/results/{out.default.name} in this checkout, whatever the current folder)"
            in " ".join((out.help or "").split())), out.help


UNBUFFERED = {**os.environ, "PYTHONUNBUFFERED": "1"}  # each line as printed, to act on it




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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_kill_ends_the_policy_benchmark_in_one_line_and_takes_back_the_folders_it_made(
        tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C printed a traceback and left the empty --out folder the run had made; a plain `kill` (SIGTERM) ended it
    at once, the folder left too. Both now end every benchmark as interrupted_as_exit says."""
    out = tmp_path / "new" / "results"
    bench = subprocess.Popen([sys.executable, str(EXPERIMENTS / "bench_policies.py"), "--scenarios", "cpu-contention",
                              "--workers", "1024", "--seeds", "20", "--iterations", "150", "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=UNBUFFERED)
    try:
        _wait_for_line(bench, "cpu-contention, 1024 workers")  # past the check of --out, which makes it
        assert out.is_dir()
        bench.send_signal(sig)
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


def test_the_policy_benchmark_refuses_a_size_a_default_scenario_cannot_take_before_it_runs(tmp_path: Path) -> None:
    """--workers 2 passed its check, ran the other scenarios, then ended in a traceback at mixed (4 workers at
    least), and wrote nothing of what it had run."""
    out = tmp_path / "out.json"
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_policies.py"), "--workers", "2", "--seeds", "1",
                             "--iterations", "2", "--out", str(out)], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "--workers 2" in result.stderr and "mixed" in result.stderr, result.stderr
    assert "seeds 0-" not in result.stdout and not out.exists()  # refused before the first run


def test_the_keras_benchmarks_busy_loops_end_with_it(tmp_path: Path) -> None:
    """A plain `kill` of bench_keras had left its busy loops spinning, pinned to worker 1's core, for good."""
    pytest.importorskip("tf_keras")
    bench = subprocess.Popen([sys.executable, str(EXPERIMENTS / "bench_keras.py"), "--epochs", "1", "--hidden", "8",
                              "--global-batch", "64", "--repeats", "1", "--load-procs", "2", "--out",
                              str(tmp_path / "out.json")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        # until both workers have exec'd: one forked but not yet exec'd shows the benchmark's command line, and was
        # counted as a third busy loop (a CI run)
        while time.monotonic() < deadline and sum("keras_digits" in " ".join(c.cmdline()) for c in children) < 2:
            time.sleep(0.2)
            children = psutil.Process(bench.pid).children()
        busy = [c for c in children if "keras_digits" not in " ".join(c.cmdline())]
        assert len(busy) == 2, children
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=30)
        _, alive = psutil.wait_procs(busy, timeout=10)
        assert not alive, alive
    finally:
        bench.kill()
        for child in children:  # the TensorFlow workers, and the busy loops if they outlived it
            if child.is_running():
                child.kill()


def test_the_gpu_benchmark_stops_before_it_runs_without_the_cards_memory_readings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Without NVML (lbbsp[gpu]), the cap test had doubled a worker until it ran out of memory, after the minutes of
    the curve, and written a cap of 2**61 as the card's: its readings of the card's memory are checked first."""
    bench = _experiment("bench_gpu")

    class NoGPUReadings:
        def __init__(self, gpu_index: int | None = None, *, min_interval_s: float = 0.2) -> None:
            pass

        def sample(self) -> dict[str, float]:
            return {"cpu_util": 0.5, "proc_cpu": 0.9, "colocated_load": 0.0, "mem_util": 0.4, "cores": 2.0}

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(bench, "ResourceMonitor", NoGPUReadings)
    monkeypatch.setattr(bench, "measure_curve", lambda *args: pytest.fail("the curve was measured"))
    out = tmp_path / "gpu.json"
    assert bench.main(["--out", str(out)]) == 1
    assert "nvidia-ml-py" in capsys.readouterr().err and not out.exists()


@pytest.mark.timeout(300)
def test_the_torch_gpu_benchmark_takes_a_lag_given_twice_once(capsys: pytest.CaptureFixture[str]) -> None:
    """--lags 2,2 ran the lag twice (with --repeats 2 or more, it then crashed at the ratios, one row per loop name
    and arrays of two lengths, after every run), --sizes 16,16 the size: checked on the CPU with --dry-run."""
    bench = _experiment("bench_torch_gpu")
    assert bench.main(["--dry-run", "--sizes", "16,16", "--lags", "2,2", "--steps", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("b=   16") == 1 and len(re.findall(r"lbbsp lag=2 [0-9.]+x", out)) == 1, out


EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


@pytest.mark.parametrize("under", [False, True])
def test_the_policy_benchmark_calls_a_file_given_as_its_folder_a_file(tmp_path: Path, under: bool) -> None:
    taken = tmp_path / "taken"
    taken.write_text("mine")
    out = taken / "sub" if under else taken
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_policies.py"), "--seeds", "1", "--workers", "4",
                             "--scenarios", "gpu-mix", "--iterations", "3", "--out", str(out)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert f"--out {out}: cannot write results there ({taken} is a file, not a folder" in result.stderr, result.stderr
    assert "gpu-mix, 4 workers" not in result.stdout and taken.read_text() == "mine"


def test_the_coordinator_benchmarks_help_shows_its_defaults() -> None:
    """Its --help showed no default, unlike the other experiment scripts'."""
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_coordinator.py"), "--help"],
                            capture_output=True, text=True, timeout=60, check=True)
    said = " ".join(result.stdout.split())
    for default in ("(default: 100)", "(default: 3)", "(default: 4 16 64)", "(default: 20)", "(default: 1)",
                    "(default: 1 2 4)", "(default: 1024 10000)", "(default: 30)"):
        assert default in said, (default, said)


def _results_file(tmp_path: Path, out: Path) -> Path:
    """experiments/_args.results_file for a benchmark whose default --out is results/bench.json."""
    if str(EXPERIMENTS) not in sys.path:
        sys.path.append(str(EXPERIMENTS))
    from _args import results_file  # noqa: PLC0415  (a script's helper: importable with experiments/ on the path)

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=tmp_path / "results" / "bench.json")
    return results_file(parser, out)


def test_a_benchmarks_out_without_a_suffix_is_a_folder_as_lbbsp_simulates_is(tmp_path: Path) -> None:
    """`--out /tmp/x/bp` had written a JSON file named bp, where `lbbsp simulate --out` makes a folder."""
    assert _results_file(tmp_path, tmp_path / "x" / "bp") == tmp_path / "x" / "bp" / "bench.json"
    assert (tmp_path / "x" / "bp").is_dir()
    assert _results_file(tmp_path, tmp_path / "y" / "mine.json") == tmp_path / "y" / "mine.json"  # a file, as before
    assert (tmp_path / "y").is_dir() and not (tmp_path / "y" / "mine.json").exists()
    (tmp_path / "z.d").mkdir()
    assert _results_file(tmp_path, tmp_path / "z.d") == tmp_path / "z.d" / "bench.json"  # a folder, as before


@pytest.mark.parametrize("under", ["taken", "taken/x.json", "taken/deeper/x.json"])
def test_every_benchmarks_out_under_a_file_names_the_file(under: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Every script's --out (experiments/_args.results_file), not only bench_policies': a file where a folder must be
    is named, where the write's own error had said only "(File exists)" or "(Not a directory)"."""
    (tmp_path / "taken").write_text("keep me")
    with pytest.raises(SystemExit):
        _results_file(tmp_path, tmp_path / under)
    err = capsys.readouterr().err
    assert f"({tmp_path / 'taken'} is a file, not a folder;" in err and "Errno" not in err, err
    assert (tmp_path / "taken").read_text() == "keep me"
