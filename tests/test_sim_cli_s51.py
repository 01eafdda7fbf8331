"""`lbbsp simulate` and the simulator's experiment scripts from a new user's side (review s51): limits named by their
flags before anything prints, runs too short to balance, thin traces, files given as folders, and readable output."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lbbsp.cli import main
from lbbsp.protocol import MAX_WORKERS
from lbbsp.sim import cli
from lbbsp.sim.scenarios import GPUMix
from lbbsp.sim.traces import TRACE_FEATURES, load_traces

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
COLUMNS = ["throughput", *TRACE_FEATURES, "hog_level"]


def _write_trace(path: Path, levels: list[int]) -> Path:
    """A trace of one row per entry of ``levels`` (that row's contention level), every row one a replay can use."""
    rows = [[900.0 + 10 * (i % 7), 0.5, 0.9, 0.0, 0.3, 4, level] for i, level in enumerate(levels)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"columns": COLUMNS, "rows": rows}))
    return path


def _simulate(*argv: str) -> int:
    return main(["simulate", "--scenario", "gpu-mix", *argv])


def test_more_workers_than_a_job_may_have_are_refused_by_the_flag_before_anything_prints(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--workers 1000000 --iterations 10` passed the cells check, printed 'building ...' and then failed with
    JobConfig's 'num_workers must be an integer in [1, 100000]', which names no flag of the command."""
    out = tmp_path / "results"
    assert _simulate("--workers", str(MAX_WORKERS + 1), "--iterations", "10", "--out", str(out)) == 2
    said, err = capsys.readouterr()
    assert "building" not in said and "num_workers" not in err, err
    assert f"--workers must be at most {MAX_WORKERS:,}" in err and f"got {MAX_WORKERS + 1:,}" in err, err
    assert not out.exists()
    # over both caps: the flag's own is named, not only the product's (which named no 100,000)
    assert _simulate("--workers", "200000", "--iterations", "300", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert f"--workers must be at most {MAX_WORKERS:,}" in err and "50,000,000" not in err, err


def test_the_help_says_how_many_workers_a_run_may_have() -> None:
    parser = cli.argparse.ArgumentParser()
    cli.add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert f"at most {MAX_WORKERS:,}" in help_text, help_text


@pytest.mark.parametrize(("iterations", "lag"), [("2", "2"), ("1", "2"), ("3", "3")])
def test_a_run_no_longer_than_its_lag_says_that_every_policy_ran_the_equal_split(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], iterations: str, lag: str) -> None:
    """With --iterations at most --lag no decision took effect: every policy, the oracle too, ran the equal split
    (1.000 of the oracle all round) and nothing said so."""
    assert _simulate("--workers", "4", "--iterations", iterations, "--lag", lag, "--out", str(tmp_path)) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert (f"warning: --iterations {iterations} is at most --lag {lag}: the first {lag} iterations of every policy, "
            "the oracle's too, run the equal split") in said, said
    assert "well above --lag" in said


def test_a_run_longer_than_its_lag_has_no_such_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _simulate("--workers", "4", "--iterations", "3", "--out", str(tmp_path)) == 0
    assert "warning" not in capsys.readouterr().out


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


def test_the_model_benchmark_calls_its_references_references_not_a_noise_floor(tmp_path: Path) -> None:
    """The 'noise floor' it printed holds the level oracle, whose MAPE is worse than every model's."""
    for name in ("a", "b"):
        _write_trace(tmp_path / f"{name}.json", [0] * 40 + [1] * 40)
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_models.py"), "--traces", str(tmp_path),
                             "--skip", "10"], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "noise floor" not in result.stdout
    assert "references that see the whole trace" in result.stdout


@pytest.mark.parametrize("under", [False, True])
def test_an_out_that_is_a_file_is_called_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                under: bool) -> None:
    """A raw '[Errno 17] File exists' (or 'Not a directory', for a folder under a file)."""
    taken = tmp_path / "taken"
    taken.write_text("mine")
    out = taken / "sub" if under else taken
    assert _simulate("--workers", "4", "--iterations", "3", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: {taken} is a file, not a folder" in err and "Errno" not in err, err
    assert taken.read_text() == "mine"


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


def test_the_redis_check_is_said_in_words(tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It ended in a Python bool: '... in all 150 iterations: True'."""
    assert _simulate("--workers", "4", "--iterations", "3", "--redis", redis_url, "--out", str(tmp_path)) == 0
    said = capsys.readouterr().out
    assert "every policy decided the same sizes as in-process in all 3 iterations\n" in said, said
    assert "True" not in said and "False" not in said


def test_a_redis_check_that_found_a_difference_names_the_policies_in_words() -> None:
    line = cli.redis_check_line({"redis": "embedded redis-server", "iterations": 5,
                                 "identical": {"oracle": True, "zeta": False, "alpha": False}})
    assert line == ("through Redis (embedded redis-server): not every policy decided the same sizes as in-process "
                    "in all 5 iterations\n  zeta differs\n  alpha differs")


def test_the_policies_over_memory_are_named_in_the_tables_order() -> None:
    figures = {"mean_iteration_s": 1.0, "idle_fraction": 0.1, "decision_ms_mean": 0.1}
    summary = {"oracle": {**figures, "vs_oracle": 1.0, "over_memory_iterations": 0},
               "alpha": {**figures, "vs_oracle": 1.2, "over_memory_iterations": 3},
               "zeta": {**figures, "vs_oracle": 0.9, "over_memory_iterations": 5}}
    text = cli.table(GPUMix(4, 2, 0), summary)
    assert text.index("zeta") < text.index("alpha")
    assert "listed last, whatever their time: zeta, alpha gave" in text, text


def test_the_coordinator_benchmarks_help_shows_its_defaults() -> None:
    """Its --help showed no default, unlike the other experiment scripts'."""
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "bench_coordinator.py"), "--help"],
                            capture_output=True, text=True, timeout=60, check=True)
    said = " ".join(result.stdout.split())
    for default in ("(default: 100)", "(default: 3)", "(default: 4 16 64)", "(default: 20)", "(default: 1)",
                    "(default: 1 2 4)", "(default: 1024 10000)", "(default: 30)"):
        assert default in said, (default, said)
