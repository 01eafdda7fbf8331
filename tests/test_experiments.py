"""The benchmark scripts in experiments/: what they compute and print (each model against the decision-time goal,
the policies' seeds as `lbbsp simulate` runs them, the parts of a GPU step, the model and Flower benchmarks' tables),
the cores they pin to, bad arguments refused at once, and a benchmark whose workers die saying so."""
from __future__ import annotations

import importlib.util
import json
import logging
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from lbbsp.sim.cli import summarise
from lbbsp.sim.engine import compare
from lbbsp.sim.scenarios import SCENARIOS
from test_sim_cli import _write_trace

pytest.importorskip("flwr")

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"

# Each of these crashed late with a traceback, printed rows of NaN or 0.000, or wrote invalid JSON.
BAD_ARGUMENTS = [
    ("bench_coordinator.py", ["--iterations", "5"]),
    ("bench_coordinator.py", ["--compute-ms", "-5"]),
    ("bench_coordinator.py", ["--decision-workers", "0"]),
    ("bench_models.py", ["--skip", "-5"]),
    ("bench_policies.py", ["--seeds", "0"]),
    ("bench_flower.py", ["--rounds", "0"]),
    ("bench_flower.py", ["--dropout", "3"]),
    ("bench_torch.py", ["--global-batch", "2000"]),
    ("bench_torch_loading.py", ["--read-us", "-1"]),
    ("bench_keras.py", ["--repeats", "0"]),
    ("bench_gpu.py", ["--sizes", "1,2"]),
    ("bench_torch_gpu.py", ["--lags", "9"]),
    ("bench_torch_gpu.py", ["--sizes", "64,x"]),
    ("record_cpu_trace.py", ["--mean-dwell-s", "inf"]),
    ("record_cpu_trace.py", ["--seconds", "0"]),
    ("bench_torch_loading.py", ["--read-us", "nan"]),  # had failed in the workers, as a sleep of NaN
    ("bench_keras.py", ["--global-batch", "8"]),  # the example's 8 a worker: had failed in the workers
    ("bench_coordinator.py", ["--redis", "redis://127.0.0.1:1"]),  # had ended in a 115-line traceback
    ("record_cpu_trace.py", ["--seconds", "nan"]),
]


@pytest.mark.parametrize(("script", "bad"), BAD_ARGUMENTS, ids=[f"{s}{' '.join(a)}" for s, a in BAD_ARGUMENTS])
def test_a_benchmark_refuses_a_bad_argument_before_it_runs(script: str, bad: list[str], tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(EXPERIMENTS / script), "--out", str(tmp_path / "out.json"), *bad],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "error:" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("script", ["bench_torch.py", "bench_torch_loading.py", "bench_keras.py", "bench_flower.py",
                                    "bench_policies.py", "bench_gpu.py", "bench_torch_gpu.py"])
def test_a_benchmark_refuses_an_out_it_cannot_write_before_it_runs(script: str, tmp_path: Path) -> None:
    """A bad --out had been found only when the figures were written, minutes later, as a traceback."""
    (tmp_path / "a-file").touch()
    dry = ["--dry-run"] if script == "bench_torch_gpu.py" else []
    result = subprocess.run([sys.executable, str(EXPERIMENTS / script), *dry, "--out", str(tmp_path / "a-file" / "x.json")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and f"--out {tmp_path / 'a-file' / 'x.json'}: cannot write results there" in \
        result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_the_gpu_benchmark_stops_without_cuda_unless_asked_for_a_dry_run(tmp_path: Path) -> None:
    """It had run a long CPU dry run by default and written its figures as the GPU results."""
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_torch_gpu.py"), "--out", str(tmp_path / "x.json")],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1 and "needs a CUDA GPU" in result.stderr and "--dry-run" in result.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_benchmark_names_the_flag_that_is_wrong(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "record_cpu_trace.py"), "--out", str(tmp_path / "t.json"),
                             "--max-level", "-1"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "--max-level must be at least 0, got -1" in result.stderr
    assert "--batch" not in result.stderr.splitlines()[-1]


def test_the_policy_benchmark_checks_its_out_first_and_takes_a_folder(tmp_path: Path) -> None:
    (tmp_path / "a-file").touch()
    taken = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_policies.py"), "--out",
                            str(tmp_path / "a-file" / "x.json")], capture_output=True, text=True, timeout=120, check=False)
    assert taken.returncode == 2 and "--out" in taken.stderr and "seeds 0-" not in taken.stdout  # before any run
    small = ["--seeds", "1", "--workers", "4", "--scenarios", "gpu-mix", "--iterations", "3"]
    folder = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_policies.py"), "--out", str(tmp_path), *small],
                            capture_output=True, text=True, timeout=300, check=False)
    assert folder.returncode == 0, folder.stderr
    assert json.loads((tmp_path / "bench_policies.json").read_text())["iterations"] == 3
    # a run of another scenario keeps the file's others (one had overwritten the committed file with its own part)
    other = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_policies.py"), "--out", str(tmp_path),
                            *small[:-3], "fl-clients", "--iterations", "3"],
                           capture_output=True, text=True, timeout=300, check=False)
    assert other.returncode == 0, other.stderr
    assert sorted(json.loads((tmp_path / "bench_policies.json").read_text())["policies"]) == ["fl-clients", "gpu-mix"]


def _experiment(name: str) -> ModuleType:
    """The script ``name`` as a module, imported as running it would: its folder on the path (for _args)."""
    if str(EXPERIMENTS) not in sys.path:
        sys.path.append(str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_critical_path_benchmark_fails_when_a_worker_dies(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead worker had left its slots at 0.0: the row read 0.000 ms and the script exited 0."""
    bench = _experiment("bench_coordinator")
    real = bench._worker

    def dies_at_once(url: str, config_json: str, worker: int, *rest: object) -> None:
        if worker == 1:
            raise RuntimeError("worker 1 died")
        real(url, config_json, worker, *rest)

    monkeypatch.setattr(bench, "_worker", dies_at_once)  # the forked workers run it: a stand-in inside one test
    monkeypatch.setattr(bench, "BARRIER_TIMEOUT_S", 3.0)
    with pytest.raises(SystemExit, match=r"worker\(s\) \[.*1.*\] failed"):
        bench.critical_path(redis_url, 3, 20, 2, 0.001)
    monkeypatch.setattr(bench, "_worker", real)
    added = bench.critical_path(redis_url, 2, 10, 2, 0.001)  # and without the stand-in, a row of real figures
    assert added.size == 10 - bench.WARM_UP and (added > 0).all()


def test_the_coordinator_benchmark_says_whether_each_model_met_the_decision_time_goal() -> None:
    bench = _experiment("bench_coordinator")
    met = bench.goal_verdict({"EWMA (baseline)": 1.3, "auto (half gpu, half cpu)": 2.85})
    assert met.endswith("met by every model (slowest: auto (half gpu, half cpu), 2.85 ms)"), met
    missed = bench.goal_verdict({"EWMA (baseline)": 4.99, "NARX (cpu)": 5.0, "auto (half gpu, half cpu)": float("nan")})
    assert missed.endswith("missed by 2 of 3 models (NARX (cpu) 5.00 ms, auto (half gpu, half cpu) nan ms)"), missed
    assert "under 5 ms at 1,024 workers" in met


def test_the_policy_benchmark_runs_each_seed_as_lbbsp_simulate_does_and_counts_the_seeds_lbbsp_leads() -> None:
    bench = _experiment("bench_policies")
    figures = bench.run("gpu-mix", 8, 20, range(3))
    for seed in range(3):  # seed by seed, the figures of a run of that seed on its own
        alone = summarise(compare(SCENARIOS["gpu-mix"](8, 20, seed), 20))
        assert {name: (f["vs_oracle"][seed], f["over_memory"][seed]) for name, f in figures.items()} == {
            name: (s["vs_oracle"], s["over_memory_iterations"]) for name, s in alone.items()}
    assert len(set(figures["backup"]["vs_oracle"])) == 3
    figures["static-proportional"]["over_memory"] = [0, 7, 0]  # a policy faster than lbbsp in a seed it fails
    figures["static-proportional"]["vs_oracle"] = [0.5, 0.5, 0.5]
    rows = {line.split()[0]: line for line in bench.table(figures).splitlines()[1:]}
    assert rows["static-proportional"].split()[-6:] == "1 of 3 1 of 3".split(), rows["static-proportional"]
    assert not any(figures["lbbsp"]["over_memory"])
    for name, f in figures.items():  # ahead: faster, or the other went over some GPU's memory
        ahead = sum(ours < theirs or over > 0
                    for ours, theirs, over in zip(figures["lbbsp"]["vs_oracle"], f["vs_oracle"], f["over_memory"]))
        assert rows[name].endswith(f"{ahead} of 3") != (name == "lbbsp" or name.startswith("oracle")), rows[name]


def test_the_gpu_overhead_benchmark_times_lbbsps_parts_of_a_step_within_the_step(tmp_path: Path) -> None:
    """Its dry run on the CPU: each part of lbbsp's host work is timed over the timed steps alone, a part within
    another takes no longer than it, and none takes longer than the step (they overlap: no sum is checked)."""
    out = tmp_path / "gpu.json"
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_torch_gpu.py"), "--sizes", "4", "--lags", "2",
                             "--steps", "3", "--repeats", "1", "--dry-run", "--out", str(out)], capture_output=True,
                            text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    parts = json.loads(out.read_text())["rows"][0]["host_ms_per_step"]
    assert set(parts) == {"step", "begin_step", "Redis read of the vector", "agreement broadcast", "report",
                          "telemetry", "loading the slice"}, parts
    assert all(v > 0 for v in parts.values()), parts
    assert parts["Redis read of the vector"] + parts["agreement broadcast"] <= parts["begin_step"], parts
    assert parts["telemetry"] <= parts["report"], parts
    assert max(v for k, v in parts.items() if k != "step") < parts["step"], parts
    assert "its host work per step (ms): begin_step" in result.stdout, result.stdout


@pytest.mark.parametrize("how", ["term", "kill"])
def test_the_trace_recorders_co_located_jobs_end_with_it(how: str, tmp_path: Path) -> None:
    """A plain `kill` of the recorder had left its busy loops spinning, pinned to the core, and written nothing.
    SIGTERM now ends it as Ctrl-C does (the rows so far are written); even SIGKILL takes its busy loops along."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "trace.json"
    recorder = subprocess.Popen([sys.executable, str(EXPERIMENTS / "record_cpu_trace.py"), "--seconds", "60", "--batch",
                                 "64", "--max-level", "2", "--mean-dwell-s", "0.2", "--core",
                                 str(min(psutil.Process().cpu_affinity())), "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert recorder.stdout is not None and "recording" in recorder.stdout.readline()
        busy = psutil.Process(recorder.pid).children()
        assert len(busy) == 2
        time.sleep(1.0)
        recorder.send_signal(signal.SIGTERM if how == "term" else signal.SIGKILL)
        said = recorder.communicate(timeout=30)[0]
    finally:
        recorder.kill()
    gone, alive = psutil.wait_procs(busy, timeout=10)
    assert not alive, alive
    if how == "term":
        assert recorder.returncode == 0, said
        assert "keeping the" in said and json.loads(out.read_text())["rows"], said


def _run(script: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXPERIMENTS / script), *argv], capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_model_benchmarks_table_fits_its_longest_trace_name(tmp_path: Path) -> None:
    """A trace name past 16 characters pushed its row, and only its row, out of line with the header."""
    for name in ("a_trace_named_past_sixteen_characters", "b"):
        _write_trace(tmp_path / f"{name}.json", [0] * 40 + [1] * 40)
    result = _run("bench_models.py", "--traces", str(tmp_path), "--skip", "10", "--out", str(tmp_path / "m.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for start in (i for i, line in enumerate(lines) if line.startswith("trace ")):
        table = lines[start:start + 4]  # the header, a row per trace, the mean
        assert table[-1].startswith("mean ") and len({len(line) for line in table}) == 1, "\n".join(table)
        for row in table[1:3]:  # each trace's 80 rows, 70 scored, right under the header's "rows" and "scored"
            assert row.index(" 80 ") + 3 == table[0].index("rows") + len("rows"), "\n".join(table)
            assert row.index(" 70 ") + 3 == table[0].index("scored") + len("scored"), "\n".join(table)


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


def test_the_flower_benchmark_table_says_not_reached_instead_of_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The rows whose run never reached the target had printed None under "to target s" and "rounds". The benchmark
    quietens Flower's warnings while it runs, and gives the "flwr" logger its level back: it had left it at ERROR, and
    the later tests that check Flower's warnings found none."""
    bench = _experiment("bench_flower")

    def run_one(mode: str, *args: object) -> tuple[list[dict[str, float]], float | None]:
        best = 0.9 if mode == "fedavg" else 0.5  # lbbsp's runs never reach the target here
        return [{"round": r, "accuracy": best * r / 2, "elapsed_s": 1.5 * r} for r in range(3)], \
            None if mode == "fedavg" else 1.0

    monkeypatch.setattr(bench, "run_one", run_one)
    monkeypatch.setattr(sys, "argv", ["bench_flower.py", "--rounds", "2", "--out", str(tmp_path / "b.json")])
    level = logging.getLogger("flwr").level
    bench.main()
    assert logging.getLogger("flwr").level == level
    table = capsys.readouterr().out.split("emulated times", 1)[1]
    assert "None" not in table
    fedavg_row = next(line for line in table.splitlines() if line.startswith("fedavg (weight by data)"))
    lbbsp_row = next(line for line in table.splitlines() if line.startswith("lbbsp (weight by data) "))
    assert fedavg_row.split()[4:7] == ["1.50", "3.00", "2"]
    assert re.search(r"1\.50 +not reached +- +0\.500", lbbsp_row), lbbsp_row






def test_the_model_benchmark_calls_its_references_references_not_a_noise_floor(tmp_path: Path) -> None:
    """The 'noise floor' it printed holds the level oracle, whose MAPE is worse than every model's."""
    for name in ("a", "b"):
        _write_trace(tmp_path / f"{name}.json", [0] * 40 + [1] * 40)
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_models.py"), "--traces", str(tmp_path),
                             "--skip", "10", "--out", str(tmp_path / "m.json")], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "noise floor" not in result.stdout
    assert "references that see the whole trace" in result.stdout


def test_the_model_benchmark_gives_the_iterations_it_scored_beside_the_rows(tmp_path: Path) -> None:
    """With the default --skip 50 a 72-row trace showed 72 under 'iterations', though 22 were scored."""
    _write_trace(tmp_path / "t.json", [0] * 36 + [1] * 36)
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_models.py"), "--traces", str(tmp_path),
                             "--out", str(tmp_path / "m.json")], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("trace ")]
    assert len(headers) == 2, result.stdout
    for start in headers:
        assert lines[start].split()[1:3] == ["rows", "scored"], lines[start]
        assert lines[start + 1].split()[:3] == ["t", "72", "22"], lines[start + 1]
