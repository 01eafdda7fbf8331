"""`lbbsp simulate`: its flags (the fl-clients ones too) checked before anything is built, the Redis it takes, the
printed table and its notes, the JSON and PNG files and their names, errors, and no folder left behind by a run
refused or stopped."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import matplotlib.figure
import numpy as np
import pytest

from lbbsp import ConfigError, EmbeddedRedis, JobConfig, LinearTime, __version__
from lbbsp.cli import main
from lbbsp.errors import StoreUnavailable
from lbbsp.policies import BSPPolicy, OraclePolicy
from lbbsp.protocol import MAX_WORKERS
from lbbsp.sim import GPUMix, cli, compare
from lbbsp.sim.scenarios import CPUContention, Scenario, Truth
from lbbsp.sim.traces import DEFAULT_TRACE_DIR, TRACE_FEATURES
from test_cli import LBBSP
from test_demo import NOWHERE


@pytest.mark.timeout(120)
def test_simulate_into_a_reader_gone_ends_quietly_with_141(tmp_path: Path) -> None:
    """As status does (the doc names status, forget and simulate)."""
    proc = subprocess.Popen([*LBBSP, "simulate", "--scenario", "gpu-mix", "--workers", "2", "--iterations", "3",
                             "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=110)
    assert (proc.returncode, err) == (141, ""), err


SMALL_SIM = ["simulate", "--scenario", "gpu-mix", "--workers", "2", "--iterations", "1"]


# -- lbbsp simulate --redis ---------------------------------------------------------------------------------------
def test_simulate_redis_without_a_url_takes_the_variables(redis_url: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A bare --redis started an embedded redis-server whatever $LBBSP_REDIS_URL said."""
    monkeypatch.setenv("LBBSP_REDIS_URL", NOWHERE)
    assert main([*SMALL_SIM, "--redis", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "$LBBSP_REDIS_URL" in err and "127.0.0.1:1" in err and "s3cret" not in err
    monkeypatch.setenv("LBBSP_REDIS_URL", redis_url)
    assert main([*SMALL_SIM, "--redis", "--out", str(tmp_path)]) == 0
    assert f"again through Redis ({redis_url}, from $LBBSP_REDIS_URL)" in capsys.readouterr().out
    (result,) = tmp_path.glob("*.json")
    assert json.loads(result.read_text())["redis_check"]["redis"] == redis_url


def test_simulate_redis_with_an_empty_variable_runs_on_an_embedded_server(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LBBSP_REDIS_URL", "")
    assert main([*SMALL_SIM, "--redis", "--out", str(tmp_path)]) == 0
    assert "again through Redis (embedded redis-server)" in capsys.readouterr().out


def test_simulate_without_redis_stays_in_process_whatever_the_variable(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LBBSP_REDIS_URL", NOWHERE)
    assert main([*SMALL_SIM, "--out", str(tmp_path)]) == 0
    assert "through Redis" not in capsys.readouterr().out


@pytest.mark.timeout(30)
def test_simulate_gives_up_soon_on_a_redis_that_never_answers(stalled_redis: EmbeddedRedis, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A redis-server under SIGSTOP: the check before the run waited 17 s (three 5 s socket timeouts) before its
    error, where `lbbsp status` and `lbbsp coordinator` give up within a few seconds."""
    assert stalled_redis.pid is not None
    os.kill(stalled_redis.pid, signal.SIGSTOP)
    started = time.monotonic()
    code = main([*SMALL_SIM, "--redis", stalled_redis.url, "--out", str(tmp_path / "out")])
    took = time.monotonic() - started
    assert code == 2 and "--redis: cannot reach Redis" in capsys.readouterr().err
    assert took < 6.0, f"gave up after {took:.1f}s"
    assert not (tmp_path / "out").exists()


def test_simulate_help_says_where_a_bare_redis_goes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "else $LBBSP_REDIS_URL" in text and "without --redis the policies run in-process" in text


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_simulate_refuses_zero_iterations_before_anything_is_made(tmp_path: Path) -> None:
    out = tmp_path / "results"
    with pytest.raises(ConfigError, match="--iterations must be at least 1, got 0"):
        cli.run(_parse("--scenario", "gpu-mix", "--workers", "4", "--iterations", "0", "--out", str(out)))
    assert not out.exists()


def test_a_traces_folder_is_named_by_six_hex_digits_in_the_file_and_the_json(tmp_path: Path) -> None:
    """The result files of a --traces folder carry six hex digits of its traces' SHA-256, as the JSON's sha256_6 does."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.json").write_bytes((DEFAULT_TRACE_DIR / "cpu_numpy_mlp.json").read_bytes())
    assert cli.run(_parse("--scenario", "cpu-contention", "--workers", "4", "--iterations", "4", "--traces", str(mine),
                          "--out", str(tmp_path))) == 0
    [written] = tmp_path.glob("simulate_cpu-contention_4w_4it_seed0_mine-*.json")
    digest = json.loads(written.read_text())["traces"]["sha256_6"]
    assert re.fullmatch("[0-9a-f]{6}", digest) and written.name.endswith(f"_mine-{digest}.json")


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


def _simulate_scenario(scenario: str, out: Path, *argv: str) -> int:
    return main(["simulate", "--scenario", scenario, "--workers", "8", "--iterations", "12", "--out", str(out), *argv])


def test_the_flags_reach_the_clients_and_name_the_result_files(tmp_path: Path) -> None:
    assert _simulate_scenario("fl-clients", tmp_path, "--dropout", "0", "--compute-spread", "2", "--link-spread", "0.5",
                              "--local-steps", "3", "--batch-per-client", "30") == 0
    (path,) = tmp_path.glob("*.json")
    assert path.name == ("simulate_fl-clients_8w_12it_seed0_dropout0_computespread2_linkspread0.5_localsteps3"
                         "_batchperclient30.json")
    result = json.loads(path.read_text())
    assert result["global_batch"] == 8 * 30
    notes = result["notes"]
    assert (notes["dropout"], notes["compute_spread"], notes["link_spread"], notes["local_steps"]) == (0, 2, 0.5, 3)


def test_a_default_given_as_a_flag_keeps_the_default_file_names(tmp_path: Path) -> None:
    assert _simulate_scenario("fl-clients", tmp_path, "--dropout", "0.05", "--local-steps", "5") == 0
    assert [p.name for p in tmp_path.glob("*.json")] == ["simulate_fl-clients_8w_12it_seed0.json"]


@pytest.mark.parametrize(("flag", "value", "said"), [
    ("--dropout", "1", "--dropout must be a chance per client and round in [0, 1), got 1.0"),
    ("--local-steps", "0", "--local-steps must be an integer in [1, "),
    ("--compute-spread", "-1", "--compute-spread must be a finite number >= 0"),
])
def test_a_bad_value_is_named_as_its_flag_before_the_run_is_built(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   flag: str, value: str, said: str) -> None:
    assert _simulate_scenario("fl-clients", tmp_path / "out", flag, value) == 2
    printed, err = capsys.readouterr()
    assert said in err and "building" not in printed, err
    assert not (tmp_path / "out").exists()


def test_the_flags_are_refused_on_other_scenarios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _simulate_scenario("gpu-mix", tmp_path, "--dropout", "0.1") == 2
    assert "--dropout applies to --scenario fl-clients only" in capsys.readouterr().err


@pytest.mark.parametrize(("iterations", "noted"), [("50", True), ("51", False)])
def test_a_run_too_short_for_per_epoch_to_resize_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        iterations: str, noted: bool) -> None:
    assert main(["simulate", "--scenario", "gpu-mix", "--workers", "4", "--iterations", iterations,
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in printed.splitlines() if line.startswith(("bsp ", "per-epoch "))}
    assert (rows["per-epoch"] == rows["bsp"]) is noted
    assert ("note: per-epoch resizes at each epoch's start, every 50 iterations" in printed) is noted


@pytest.mark.parametrize(("dropout", "said"), [("0.05", True), ("0", False)])
def test_the_table_says_why_a_policy_may_beat_the_oracle_where_clients_drop_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], dropout: str, said: bool) -> None:
    assert _simulate_scenario("fl-clients", tmp_path, "--dropout", dropout) == 0
    assert ("the oracle does not know who will drop out" in capsys.readouterr().out) is said


def test_the_plot_marks_policies_over_memory_and_names_no_window_of_one(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over-memory policies' lines had been drawn like the others (only their bars were hatched), and 15 iterations
    read "rolling mean of 1"."""
    figures: list[matplotlib.figure.Figure] = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda self, *args, **kwargs: (figures.append(self), save(self, *args, **kwargs))[1])
    assert main(["simulate", "--scenario", "mixed", "--workers", "5", "--iterations", "15", "--out", str(tmp_path)]) == 0
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    over = {name for name, figures_of in result["policies"].items() if figures_of["over_memory_iterations"]}
    assert over  # mixed at 5 workers: some policy overfills a GPU
    lines = figures[0].axes[1]
    assert "rolling mean" not in lines.get_ylabel()
    for line in lines.get_lines()[:-1]:  # the last is the oracle's line at 1
        name = line.get_label().removesuffix(" (over GPU memory)")
        assert (line.get_linestyle() == "--") is (name in over) is line.get_label().endswith("(over GPU memory)")


def test_values_a_short_name_would_round_alike_get_files_of_their_own(tmp_path: Path) -> None:
    assert _simulate_scenario("fl-clients", tmp_path, "--dropout", "0.1234567") == 0
    assert _simulate_scenario("fl-clients", tmp_path, "--dropout", "0.12345671") == 0
    assert len(list(tmp_path.glob("*.json"))) == 2  # :g had named both _dropout0.123457


def test_a_batch_too_large_for_the_workers_is_named_as_its_flag_before_the_build(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--scenario", "fl-clients", "--workers", "100000", "--iterations", "8",
                 "--batch-per-client", "200", "--out", str(tmp_path / "out")]) == 2
    printed, err = capsys.readouterr()
    assert "at --batch-per-client 200 make a global batch" in err and "building" not in printed, err


def test_the_help_gives_the_clients_defaults() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "(default 0.05)" in text and "(default 5)" in text and "(default 20)" in text


def _run(tmp_path: Path, *args: str) -> dict:
    assert main(["simulate", "--workers", "4", "--iterations", "6", "--out", str(tmp_path), *args]) == 0
    (result,) = tmp_path.glob("*.json")
    return json.loads(result.read_text())


def test_a_cpu_run_names_its_traces_and_version(tmp_path: Path) -> None:
    result = _run(tmp_path, "--scenario", "cpu-contention")
    assert result["lbbsp_version"] == __version__
    assert result["traces"]["folder"] == str(DEFAULT_TRACE_DIR.resolve())
    copy = tmp_path / "copy"
    shutil.copytree(DEFAULT_TRACE_DIR, copy)
    other = _run(tmp_path / "out2", "--scenario", "cpu-contention", "--traces", str(copy))
    assert other["traces"] == {"folder": str(copy.resolve()), "sha256_6": result["traces"]["sha256_6"]}  # same bytes


def test_a_gpu_run_replays_no_traces(tmp_path: Path) -> None:
    result = _run(tmp_path, "--scenario", "gpu-mix")
    assert "traces" not in result and result["lbbsp_version"] == __version__


def test_an_fl_clients_run_stopped_by_its_options_names_them_as_flags(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--scenario", "fl-clients", "--workers", "4", "--iterations", "3",
                 "--local-steps", "1000000", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "past the 86,400 s a report may carry" in err, err
    assert "--local-steps=1000000" in err and "--compute-spread=1.0" in err, err
    assert "local_steps" not in err and "compute_spread" not in err, err  # no argument the command line takes
    assert "model_mb=4.0" in err  # an option without a flag keeps its name


SMALL = ("--workers", "4", "--iterations", "3")


class TwoSpeeds(Scenario):
    """Two workers at 1 and 3 samples/s, global batch 4: every figure can be worked out by hand."""

    def __init__(self) -> None:
        super().__init__("two-speeds", JobConfig("sim-two", 2, 4), ["cpu", "cpu"], iterations=3)

    def truth(self, iteration: int) -> Truth:
        return Truth(LinearTime(np.array([1.0, 3.0])))

    def features(self, iteration: int, sizes: np.ndarray) -> list[dict[str, float]]:
        return [{}, {}]


def test_idle_fraction_and_ratio_to_the_oracle_match_a_hand_computed_case() -> None:
    """Not a fix: the check of the table's figures. BSP's 2 + 2 takes 2 s and 2/3 s, so the fast worker waits
    2/3 of every iteration (idle 1/3); the oracle runs the initial 2 + 2 for lag = 2 iterations, then 1 + 3
    (1 s each, idle 0): mean 5/3 s, idle 2/9, and BSP is 2 / (5/3) = 1.2 x the oracle, in the table as in the JSON."""
    scenario = TwoSpeeds()
    summary = cli.summarise(compare(scenario, 3, {"oracle": OraclePolicy(), "bsp": BSPPolicy()}))
    assert summary["oracle"]["mean_iteration_s"] == pytest.approx(5 / 3)
    assert summary["oracle"]["idle_fraction"] == pytest.approx(2 / 9)
    assert summary["bsp"]["idle_fraction"] == pytest.approx(1 / 3)
    assert summary["bsp"]["vs_oracle"] == pytest.approx(1.2)
    rows = {line.split()[0]: line.split()[1:4] for line in cli.table(scenario, summary).splitlines()[2:]}
    assert rows == {"oracle": ["1.667", "1.000", "22.2%"], "bsp": ["2", "1.200", "33.3%"]}


def test_a_mixed_cluster_too_small_is_refused_by_its_flag_before_anything_is_built(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--scenario mixed --workers 2` had printed 'building mixed with 2 workers ...' and then failed with
    'num_workers must be at least 4 for a mixed cluster', which names no flag of the command."""
    assert main(["simulate", "--scenario", "mixed", "--workers", "3", "--iterations", "3", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "building" not in out
    assert "--workers must be at least 4 for --scenario mixed, got 3" in err


def test_a_huge_cluster_for_few_iterations_is_refused_before_it_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every scenario generates 8 iterations past the last simulated one, so `--workers 50000000 --iterations 1`
    passed the 50-million cap and started building 9 x 50 million rows of trace (tens of GiB): the cap is
    counted over at least those 8 iterations. Since the flag's own cap is checked first, that names it."""
    class Built(GPUMix):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("the scenario was built")

    monkeypatch.setitem(cli.SCENARIOS, "gpu-mix", Built)
    assert main(["simulate", "--scenario", "gpu-mix", "--workers", "50000000", "--iterations", "1",
                 "--out", str(tmp_path)]) == 2
    assert "--workers must be at most 100,000" in capsys.readouterr().err


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_a_run_stopped_while_writing_leaves_the_previous_results_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: type[BaseException]) -> None:
    """Ctrl-C (or a failure) while the PNG was drawn left the new JSON beside the old PNG, or beside a half-written
    one: the two files of one name described different runs."""
    stem = tmp_path / "simulate_gpu-mix_4w_3it_seed0"
    stem.with_suffix(".json").write_text("old")
    stem.with_suffix(".png").write_bytes(b"old")

    def interrupted(scenario: object, runs: object, summary: object, path: Path) -> None:
        path.write_bytes(b"half a PNG")
        raise stop

    monkeypatch.setattr(cli, "plot", interrupted)
    with pytest.raises(stop):
        cli.run(_parse("--scenario", "gpu-mix", *SMALL, "--out", str(tmp_path)))
    assert stem.with_suffix(".json").read_text() == "old"
    assert stem.with_suffix(".png").read_bytes() == b"old"
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"{stem.name}.json", f"{stem.name}.png"]


def test_results_are_replaced_as_a_pair(tmp_path: Path) -> None:
    """The run that completes replaces both files, and leaves nothing else in --out."""
    stem = tmp_path / "simulate_gpu-mix_4w_3it_seed0"
    stem.with_suffix(".json").write_text("old")
    stem.with_suffix(".png").write_bytes(b"old")
    assert main(["simulate", "--scenario", "gpu-mix", *SMALL, "--out", str(tmp_path)]) == 0
    assert stem.with_suffix(".json").read_text().startswith("{")
    assert stem.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert len(list(tmp_path.iterdir())) == 2


def test_mean_dwells_that_print_alike_get_result_files_of_their_own() -> None:
    """`--mean-dwell 1000000` and `--mean-dwell 1000001` both wrote `_dwell1e+06`: the second run's results
    overwrote the first's without a word. A value that prints exactly keeps its short name."""
    def suffix(dwell: str) -> str:
        return cli._scenario_options(_parse("--scenario", "cpu-contention", "--mean-dwell", dwell))[1]

    assert suffix("1000000") != suffix("1000001")
    assert (suffix("50"), suffix("inf"), suffix("1e6"), suffix("200")) == ("_dwell50", "_dwellinf", "_dwell1e+06", "")


def test_result_files_are_named_as_printed_whatever_dots_the_name_holds(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`--mean-dwell 2.5 --no-noise` printed 'wrote ..._dwell2.5_nonoise.json' and wrote '..._dwell2.json': the name
    was cut at its last dot, so 2.5 and 2.7, with noise or without, all wrote over one file (as did a --traces
    folder with a dot in its name, losing its digest)."""
    assert main(["simulate", "--scenario", "cpu-contention", *SMALL, "--mean-dwell", "2.5", "--no-noise",
                 "--out", str(tmp_path)]) == 0
    stem = "simulate_cpu-contention_4w_3it_seed0_dwell2.5_nonoise"
    assert sorted(path.name for path in tmp_path.iterdir()) == [f"{stem}.json", f"{stem}.png"]
    assert f"wrote {tmp_path / stem}.json and {tmp_path / stem}.png" in capsys.readouterr().out


def test_a_seed_too_long_for_a_file_name_is_refused_before_the_run(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A 300-digit --seed ran every policy, then failed to write its results ('File name too long'), blamed on --out."""
    out = tmp_path / "results"
    assert main(["simulate", "--scenario", "gpu-mix", *SMALL, "--seed", str(10**300), "--out", str(out)]) == 2
    said, err = capsys.readouterr()
    assert "building" not in said and f"--seed must be in [0, {2**64 - 1}], got 1000" in err, err
    assert not out.exists()


def test_a_long_traces_folder_name_is_cut_in_the_result_files_name(tmp_path: Path) -> None:
    """A --traces folder of 230 characters made the result files' names too long to write, after the whole run."""
    folder = tmp_path / ("t" * 230)
    folder.mkdir()
    shipped = sorted(cli.DEFAULT_TRACE_DIR.glob("*.json"))[0]
    (folder / shipped.name).write_bytes(shipped.read_bytes())
    suffix = cli._scenario_options(_parse("--scenario", "cpu-contention", "--traces", str(folder)))[1]
    assert suffix.startswith("_" + "t" * 40 + "-") and len(suffix) < 60, suffix


def test_simulate_refuses_an_out_that_is_its_traces_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--traces same --out same` wrote its result JSON among the traces, and the next run failed reading it as one."""
    traces = tmp_path / "same"
    _write_trace(traces / "mine.json", [0] * 40 + [1] * 40)
    for out in (traces, traces / ".." / "same"):
        assert main(["simulate", "--scenario", "cpu-contention", "--workers", "4", "--iterations", "3",
                     "--traces", str(traces), "--out", str(out)]) == 2
        said, err = capsys.readouterr()
        assert "building" not in said and err.count("\n") == 1, err
        assert f"--out {out} is the folder the CPU traces are read from" in err, err
    assert [p.name for p in traces.iterdir()] == ["mine.json"]
    # without --traces, the shipped traces' folder is theirs (nothing is written there either)
    # by every scenario: gpu-mix's results there had broken every later cpu-contention run
    for scenario in ("mixed", "gpu-mix", "fl-clients"):
        assert main(["simulate", "--scenario", scenario, "--workers", "4", "--iterations", "3",
                     "--out", str(DEFAULT_TRACE_DIR)]) == 2
        assert "is the folder the CPU traces are read from" in capsys.readouterr().err


def test_cli_writes_json_and_png(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--scenario", "fl-clients", "--workers", "6", "--iterations", "10", "--out", str(tmp_path)])
    assert cli.run(args) == 0
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert result["policies"]["oracle"]["vs_oracle"] == 1.0
    assert next(tmp_path.glob("*.png")).stat().st_size > 0


def test_cli_json_is_strict_json_with_no_level_switches(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    cli.run(parser.parse_args(["--scenario", "cpu-contention", "--workers", "4", "--iterations", "5", "--mean-dwell",
                               "inf", "--out", str(tmp_path)]))

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    result = json.loads((tmp_path / "simulate_cpu-contention_4w_5it_seed0_dwellinf.json").read_text(), parse_constant=refuse)
    assert result["notes"]["mean_dwell_iterations"] == "inf"


def test_cli_names_only_options_that_change_the_scenario(tmp_path: Path) -> None:
    # the shipped traces and the default dwell, given explicitly, are the default scenario: its file names
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    cli.run(parser.parse_args(["--scenario", "cpu-contention", "--workers", "4", "--iterations", "5", "--mean-dwell",
                               "200", "--traces", str(DEFAULT_TRACE_DIR), "--out", str(tmp_path)]))
    assert [p.name for p in tmp_path.glob("*.json")] == ["simulate_cpu-contention_4w_5it_seed0.json"]


def test_cli_names_a_non_default_lag_in_its_files(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    for lag in ("1", "2"):
        cli.run(parser.parse_args(["--scenario", "gpu-mix", "--workers", "4", "--iterations", "6", "--lag", lag,
                                   "--out", str(tmp_path)]))
    default = json.loads((tmp_path / "simulate_gpu-mix_4w_6it_seed0.json").read_text())
    lag1 = json.loads((tmp_path / "simulate_gpu-mix_4w_6it_seed0_lag1.json").read_text())
    assert (default["lag"], lag1["lag"]) == (2, 1)
    assert lag1["policies"]["lbbsp"] != default["policies"]["lbbsp"]  # it decides from one iteration fresher reports


def test_cli_replays_the_traces_it_is_given(tmp_path: Path) -> None:
    mine = tmp_path / "my_traces"
    mine.mkdir()
    (mine / "mine.json").write_bytes((DEFAULT_TRACE_DIR / "cpu_numpy_mlp.json").read_bytes())
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--scenario", "cpu-contention", "--workers", "4", "--iterations", "8",
                              "--traces", str(mine), "--out", str(tmp_path)])
    assert cli.run(args) == 0
    [written] = tmp_path.glob("simulate_cpu-contention_4w_8it_seed0_my_traces-*.json")
    result = json.loads(written.read_text())
    assert result["notes"]["traces"] == ["mine"]
    # another folder of the same name, with other traces, writes files of its own (it had overwritten these)
    other = tmp_path / "elsewhere" / "my_traces"
    other.mkdir(parents=True)
    (other / "mine.json").write_bytes((DEFAULT_TRACE_DIR / "cpu_torch_cnn.json").read_bytes())
    assert cli.run(parser.parse_args(["--scenario", "cpu-contention", "--workers", "4", "--iterations", "8",
                                      "--traces", str(other), "--out", str(tmp_path)])) == 0
    assert len(list(tmp_path.glob("simulate_cpu-contention_4w_8it_seed0_my_traces-*.json"))) == 2
    with pytest.raises(ConfigError, match="cpu-contention and mixed only"):
        cli.run(parser.parse_args(["--scenario", "gpu-mix", "--traces", str(mine), "--out", str(tmp_path)]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no CPU traces"):
        cli.run(parser.parse_args(["--scenario", "cpu-contention", "--traces", str(tmp_path / "empty")]))
    for not_a_folder in (tmp_path / "none", mine / "mine.json"):  # said 'no CPU traces in .../mine.json'
        with pytest.raises(ConfigError, match="is not a directory"):
            cli.run(parser.parse_args(["--scenario", "cpu-contention", "--traces", str(not_a_folder)]))


def test_the_redis_password_is_neither_printed_nor_saved(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    scenario = GPUMix(4, 2, seed=0)
    runs = compare(scenario, 2)
    monkeypatch.setattr(cli, "compare", lambda *args, **kwargs: runs)
    _, check = cli._through_redis(scenario, 2, "redis://:s3cret@db.example:6379/0", runs)
    assert check["redis"] == "redis://:***@db.example:6379/0"
    assert "s3cret" not in capsys.readouterr().out


def test_cli_refuses_bad_input_before_simulating(tmp_path: Path) -> None:
    """One worker (backup workers need two), a negative seed, an --out that is a file, cpu-contention's options
    on another scenario and a Redis that does not answer are refused up front, not after the runs."""
    small = ("--workers", "4", "--iterations", "3", "--out", str(tmp_path))
    with pytest.raises(ConfigError, match="--workers"):
        cli.run(_parse("--scenario", "gpu-mix", "--workers", "1", "--out", str(tmp_path)))
    with pytest.raises(ConfigError, match="--seed"):
        cli.run(_parse("--scenario", "gpu-mix", "--seed", "-1", *small))
    (tmp_path / "a-file").touch()
    with pytest.raises(ConfigError, match="--out"):
        cli.run(_parse("--scenario", "gpu-mix", "--workers", "4", "--out", str(tmp_path / "a-file")))
    with pytest.raises(ConfigError, match="cpu-contention and mixed only"):
        cli.run(_parse("--scenario", "gpu-mix", "--traces", str(tmp_path / "none"), *small))
    with pytest.raises(StoreUnavailable, match="--redis: cannot reach Redis"):  # before the scenario is built
        cli.run(_parse("--scenario", "gpu-mix", "--redis", f"unix://{tmp_path}/no.sock", *small))
    with pytest.raises(ConfigError, match="--redis: not a usable Redis URL"):
        cli.run(_parse("--scenario", "gpu-mix", "--redis", "notaurl", *small))
    with pytest.raises(ConfigError, match="at most 50,000,000"):  # not a numpy MemoryError after a long wait
        cli.run(_parse("--scenario", "gpu-mix", "--workers", "16", "--iterations", "2000000000"))
    # named by their flags ('lag must be an integer in [1, 8] [job=sim-cpu]', after the scenario was built)
    with pytest.raises(ConfigError, match="--lag must be in"):
        cli.run(_parse("--scenario", "gpu-mix", "--lag", "9", *small))
    for dwell in ("0.5", "nan"):
        with pytest.raises(ConfigError, match="--mean-dwell must be"):
            cli.run(_parse("--scenario", "cpu-contention", "--mean-dwell", dwell, *small))
    assert not list(tmp_path.glob("*.json"))


def test_results_that_cannot_be_written_are_an_out_error_not_a_redis_one(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "simulate_gpu-mix_4w_3it_seed0.json").mkdir()  # the result file's path is taken by a folder
    assert main(["simulate", "--scenario", "gpu-mix", "--workers", "4", "--iterations", "3", "--out",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path} is not a folder results can be written to" in err and "Redis" not in err


def test_an_out_folder_in_a_symlink_loop_is_refused_as_one_results_cannot_be_written_to(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Comparing it with the traces' folder cannot resolve it (a RuntimeError or OSError, by Python version): that check
    passes it on, and the check of --out refuses it, naming the loop."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert main(["simulate", "--scenario", "gpu-mix", "--workers", "4", "--iterations", "3", "--out",
                 str(tmp_path / "a" / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--out {tmp_path / 'a' / 'out'} is not a folder results can be written to" in err, err
    assert "symbolic links" in err and "Traceback" not in err, err


def test_the_plots_ratio_axis_has_round_ticks_across_the_range() -> None:
    """Its log axis had labelled only 0.9 and 1.0, with lines at 1.2-1.5 x the oracle."""
    assert cli._ratio_ticks(0.95, 1.5) == [0.95, 1.0, 1.1, 1.2, 1.3, 1.5]
    assert cli._ratio_ticks(0.99, 1.02) == [0.99, 1.0, 1.01, 1.02]
    wide = cli._ratio_ticks(0.5, 40)
    assert 1.0 in wide and len(wide) <= 10 and wide == sorted(wide) and 0.5 <= wide[0] and wide[-1] <= 40


def test_nothing_is_built_before_the_arguments_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """'building ...' had been printed before --out, --traces and --redis were refused: the run looked started."""
    (tmp_path / "a-file").touch()
    for bad in (["--out", str(tmp_path / "a-file")], ["--redis", f"unix://{tmp_path}/no.sock"],
                ["--scenario", "cpu-contention", "--traces", str(tmp_path / "none")]):
        assert main(["simulate", "--scenario", "gpu-mix", "--workers", "4", "--iterations", "3",
                     "--out", str(tmp_path), *bad]) == 2
        assert "building" not in capsys.readouterr().out, bad


@pytest.mark.parametrize(("lag", "said"), [(1, "(1 iteration late, as LB-BSP)"), (2, "(2 iterations late, as LB-BSP)")])
def test_the_level_references_note_gives_the_lag_in_words_that_agree(lag: int, said: str) -> None:
    """`--lag 1` had printed "1 iterations late"."""
    scenario = CPUContention(4, 10, seed=0)
    scenario.config = dataclasses.replace(scenario.config, lag=lag)
    row = {"mean_iteration_s": 1.0, "vs_oracle": 1.0, "idle_fraction": 0.0, "decision_ms_mean": 0.1,
           "decision_ms_p99": 0.1, "over_memory_iterations": 0, "failed_decisions": 0}
    assert said in cli.table(scenario, {"oracle": row, "oracle-level": row})


def test_numpy_values_a_scenario_of_ones_own_returns_are_written_as_json_numbers() -> None:
    """A result holding numpy's numbers (a scenario or policy of one's own) is written as numbers: a numpy integer
    had been written as the string "3"."""
    written = json.dumps({"count": np.int64(3), "share": np.float32(0.5), "sizes": np.arange(2)}, default=cli._plain)
    assert json.loads(written) == {"count": 3, "share": 0.5, "sizes": [0, 1]}
