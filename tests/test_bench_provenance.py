"""The run record the benchmarks write beside their figures (experiments/_args.py's ``run_record``): the commit of the
checkout, null outside one or without git, the time and the machine; and the results files of bench_models,
bench_coordinator and bench_policies, which carry it beside the figures they print."""
from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from test_sim_cli import _write_trace

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
if str(EXPERIMENTS) not in sys.path:  # as running a script there puts it
    sys.path.append(str(EXPERIMENTS))

import _args  # noqa: E402

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed here")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git checkout of one committed file, ``tracked``."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "tracked").write_text("1")
    _git(repo, "add", "tracked")
    _git(repo, "commit", "-q", "-m", "one")
    return repo


@needs_git
def test_the_record_names_the_commit_and_whether_tracked_files_changed(repo: Path) -> None:
    record = _args.run_record(repo)
    assert record["commit"] == _git(repo, "rev-parse", "HEAD") and record["dirty"] is False
    (repo / "untracked").write_text("results")  # a results file not added: the code is still the commit's
    assert _args.run_record(repo)["dirty"] is False
    (repo / "tracked").write_text("2")
    assert _args.run_record(repo)["dirty"] is True


@needs_git
def test_the_record_names_this_checkouts_commit() -> None:
    if not (_args.ROOT / ".git").exists():
        pytest.skip("these tests run outside a checkout")
    record = _args.run_record()
    assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]), record
    _git(_args.ROOT, "cat-file", "-e", f"{record['commit']}^{{commit}}")  # a commit of this checkout
    assert isinstance(record["dirty"], bool)


@needs_git
def test_the_record_has_no_commit_outside_a_checkout_nor_below_another_ones_top(repo: Path, tmp_path: Path) -> None:
    """Code installed elsewhere: in no checkout at all, or in a folder of another repository (whose commit is not the
    code's)."""
    (tmp_path / "plain").mkdir()
    (repo / "site-packages").mkdir()
    for root in (tmp_path / "plain", repo / "site-packages"):
        record = _args.run_record(root)
        assert (record["commit"], record["dirty"]) == (None, None), root


def test_the_record_has_no_commit_without_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    record = _args.run_record()
    assert (record["commit"], record["dirty"]) == (None, None)
    assert record["machine"]["python"] == platform.python_version()  # the rest is still there


def test_the_record_gives_the_time_and_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(__version__="9.9.9"))  # imported by the run
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)  # not imported: not looked for
    record = _args.run_record()
    written = datetime.fromisoformat(record["utc"])
    assert written.utcoffset() == timedelta(0) and abs(datetime.now(UTC) - written) < timedelta(minutes=1)
    machine = record["machine"]
    assert machine["platform"] == platform.platform() and machine["python"] == platform.python_version()
    assert machine["cpus"] == os.cpu_count() and machine["cpus_usable"] == len(os.sched_getaffinity(0))
    cpuinfo = Path("/proc/cpuinfo")
    models = re.findall(r"^model name\s*:\s*(.*)$", cpuinfo.read_text(), re.M) if cpuinfo.exists() else []
    assert machine["cpu_model"] == (models[0].strip() if models else None)
    assert machine["packages"]["torch"] == "9.9.9" and "tensorflow" not in machine["packages"]
    import numpy  # noqa: PLC0415  (imported by the tests already: its version is in the record)

    assert machine["packages"]["numpy"] == numpy.__version__
    json.dumps(record, allow_nan=False)  # JSON as it stands


def _bench(script: str, *argv: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, str(EXPERIMENTS / script), *argv], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _assert_this_checkouts_record(record: dict[str, Any]) -> None:
    """``record`` is a run's of this checkout: its commit one of this repository's (none where these tests run
    outside a checkout, or without git)."""
    assert set(record) == {"commit", "dirty", "utc", "machine"} and record["machine"]["cpus"] == os.cpu_count()
    if _args.run_record()["commit"] is None:
        assert record["commit"] is None
    else:  # not compared with HEAD: a commit made meanwhile would fail the test
        assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]), record
        _git(_args.ROOT, "cat-file", "-e", f"{record['commit']}^{{commit}}")


def test_the_model_benchmark_writes_the_tables_it_prints(tmp_path: Path) -> None:
    for name, half in (("a", 40), ("b", 45)):  # lengths apart: figures apart
        _write_trace(tmp_path / "traces" / f"{name}.json", [0] * half + [1] * half)
    out = tmp_path / "m.json"
    printed = _bench("bench_models.py", "--traces", str(tmp_path / "traces"), "--skip", "10", "--out", str(out)).stdout
    written = json.loads(out.read_text())
    assert written["args"] == {"traces": str(tmp_path / "traces"), "skip": 10, "out": str(out)}
    _assert_this_checkouts_record(written["run"])
    lines = printed.splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("trace ")]
    assert [h["horizon"] for h in written["horizons"]] == [2, 1] and len(tables) == 2
    for start, horizon in zip(tables, written["horizons"]):
        models = list(horizon["mean_mape_pct"])
        assert models == ["NARX", "NARX no-feat", "EWMA", "LastValue"]
        for line, row in zip(lines[start + 1:start + 3], horizon["traces"]):  # a row per trace, as printed
            assert line.split() == [row["trace"], str(row["rows"]), str(row["scored"]),
                                    *(f"{row['mape_pct'][m]:.2f}" for m in models)], (line, row)
        assert lines[start + 3].split() == ["mean", *(f"{horizon['mean_mape_pct'][m]:.2f}" for m in models)]
        versus, mean = horizon["narx_vs_best_baseline"], horizon["mean_mape_pct"]
        best = min(mean["EWMA"], mean["LastValue"])
        assert versus["best_baseline_mape_pct"] == best
        assert versus["goal_met"] is (mean["NARX"] <= 0.8 * best)
        assert f"MAPE {abs(versus['narx_lower_pct']):.1f}% " in lines[start + 4], lines[start + 4]
        assert lines[start + 5].startswith("  second half of each trace, mean MAPE%: " + ", ".join(
            f"{name} {v:.2f}" for name, v in horizon["second_half_mean_mape_pct"].items()))
    for name, reference in written["references_mape_pct"].items():
        line = next(line for line in lines if line.startswith(f"  {name} "))
        assert line.split()[-2:] == ["mean", f"{reference['mean']:.2f}"]
        assert " ".join(f"{t} {v:.2f}" for t, v in reference["per_trace"].items()) in line


def _experiment(name: str) -> ModuleType:
    """The script ``name`` as a module, imported as running it would (its folder is on the path above)."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_coordinator_benchmark_writes_its_decision_times_and_the_goals_verdict(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """At 16 workers standing in for the goal's 1,024, in this process: its heap is not frozen (the tests' own)."""
    bench = _experiment("bench_coordinator")
    monkeypatch.setattr(bench, "GOAL_WORKERS", 16)
    monkeypatch.setattr(bench, "freeze_heap", lambda: None)
    out = tmp_path / "c.json"
    monkeypatch.setattr(sys, "argv", ["bench_coordinator.py", "--skip-critical-path", "--skip-heap", "--warmup", "2",
                                      "--repeats", "3", "--decision-workers", "8", "16", "--redis", redis_url,
                                      "--out", str(out)])
    bench.main()
    printed = capsys.readouterr().out.splitlines()
    written = json.loads(out.read_text())
    assert written["complete"] is True and "critical_path" not in written and "heap" not in written
    assert written["args"]["decision_workers"] == [8, 16] and written["args"]["out"] == str(out)
    _assert_this_checkouts_record(written["run"])
    assert [size["workers"] for size in written["decision_time"]] == [8, 16]
    speeds = [line for line in printed if line.startswith("(this machine's speed just before")]
    assert speeds == [f"(this machine's speed just before: reference workload {size['machine_speed_ms']:.1f} ms)"
                      for size in written["decision_time"]]
    for size in written["decision_time"]:
        assert [row["model"] for row in size["rows"]] == list(bench.MODELS)
        for row in size["rows"]:
            line = next(line for line in printed if line.startswith(f"{row['model']:<26} {size['workers']:>8} "))
            assert line.split()[-7:] == [f"{row[key]:.3f}" for key in (
                "policy_p50_ms", "policy_p99_ms", "policy_cpu_p50_ms", "step_p50_ms", "step_p99_ms", "learn_p50_ms",
                "cycle_p50_ms")], line
    goal = written["goal"]
    p50 = {row["model"]: row["policy_p50_ms"] for row in written["decision_time"][1]["rows"]}
    assert goal["verdict"] in printed and goal["verdict"] == bench.goal_verdict(p50)
    assert goal["met"] is all(ms < bench.GOAL_MS for ms in p50.values()) and goal["workers"] == 16


def test_the_policy_benchmark_adds_the_record_and_keeps_its_keys(tmp_path: Path) -> None:
    _bench("bench_policies.py", "--seeds", "1", "--workers", "4", "--scenarios", "gpu-mix", "--iterations", "3",
           "--out", str(tmp_path))
    written = json.loads((tmp_path / "bench_policies.json").read_text())
    assert list(written) == ["iterations", "seeds", "policies", "run"] and list(written["policies"]) == ["gpu-mix"]
    _assert_this_checkouts_record(written["run"])
