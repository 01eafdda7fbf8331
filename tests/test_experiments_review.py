"""The benchmark scripts as a user runs them: sizes a scenario cannot take refused before any run, co-located load
that ends with the benchmark however it ends, and a GPU benchmark that says what it lacks instead of writing
figures that mean nothing."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_experiments import EXPERIMENTS, _experiment


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
        while time.monotonic() < deadline and sum("keras_digits" not in " ".join(c.cmdline()) for c in children) < 2:
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


def test_the_keras_benchmark_pins_to_the_cores_it_may_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers and load were pinned to CPUs 0 and 1 whatever the cpuset (Docker's --cpuset-cpus, Slurm): where those
    were not allowed, a worker failed with an OSError. Popen stands in for the TensorFlow workers here."""
    bench = _experiment("bench_keras")
    commands: list[list[str]] = []

    class Worker:
        returncode = 0

        def __init__(self, command: list[str], **_: object) -> None:
            commands.append(command)
            index = command[command.index("--index") + 1]
            (tmp_path / f"bsp{index}.json").write_text(
                '{"seconds": 1.0, "global_samples_per_s": 9.0, "sizes": [[4, 4]], "steps": 1}')

        def communicate(self) -> tuple[str, None]:
            return "", None

    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {5, 3, 9})
    monkeypatch.setattr(bench.subprocess, "Popen", Worker)
    args = bench.argparse.Namespace(load_procs=0, epochs=1, hidden=8, global_batch=64)
    assert bench.run_mode("bsp", args, tmp_path)["steps"] == 1
    assert [command[command.index("--cpu") + 1] for command in commands] == ["3", "5"]


@pytest.mark.timeout(300)
def test_the_torch_gpu_benchmark_takes_a_lag_given_twice_once(capsys: pytest.CaptureFixture[str]) -> None:
    """--lags 2,2 ran the lag twice (with --repeats 2 or more, it then crashed at the ratios, one row per loop name
    and arrays of two lengths, after every run), --sizes 16,16 the size: checked on the CPU with --dry-run."""
    bench = _experiment("bench_torch_gpu")
    assert bench.main(["--dry-run", "--sizes", "16,16", "--lags", "2,2", "--steps", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("b=   16") == 1 and out.count("lbbsp lag=2/DDP") == 1, out
