"""`lbbsp simulate`'s fl-clients flags (a new user's review, s59): the clients' dropout, spreads, local steps and batch
had been reachable only through FLClients in Python; a dropout of 1 ran (no client ever reported); and a per-epoch
row equal to bsp's in a run of 50 iterations or fewer went unexplained."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib.figure
import pytest

from lbbsp.cli import main
from lbbsp.errors import ConfigError
from lbbsp.sim import cli
from lbbsp.sim.scenarios import FLClients


def _simulate(scenario: str, out: Path, *argv: str) -> int:
    return main(["simulate", "--scenario", scenario, "--workers", "8", "--iterations", "12", "--out", str(out), *argv])


def test_the_flags_reach_the_clients_and_name_the_result_files(tmp_path: Path) -> None:
    assert _simulate("fl-clients", tmp_path, "--dropout", "0", "--compute-spread", "2", "--link-spread", "0.5",
                     "--local-steps", "3", "--batch-per-client", "30") == 0
    (path,) = tmp_path.glob("*.json")
    assert path.name == ("simulate_fl-clients_8w_12it_seed0_dropout0_computespread2_linkspread0.5_localsteps3"
                         "_batchperclient30.json")
    result = json.loads(path.read_text())
    assert result["global_batch"] == 8 * 30
    notes = result["notes"]
    assert (notes["dropout"], notes["compute_spread"], notes["link_spread"], notes["local_steps"]) == (0, 2, 0.5, 3)


def test_a_default_given_as_a_flag_keeps_the_default_file_names(tmp_path: Path) -> None:
    assert _simulate("fl-clients", tmp_path, "--dropout", "0.05", "--local-steps", "5") == 0
    assert [p.name for p in tmp_path.glob("*.json")] == ["simulate_fl-clients_8w_12it_seed0.json"]


@pytest.mark.parametrize(("flag", "value", "said"), [
    ("--dropout", "1", "--dropout must be a chance per client and round in [0, 1), got 1.0"),
    ("--local-steps", "0", "--local-steps must be an integer in [1, "),
    ("--compute-spread", "-1", "--compute-spread must be a finite number >= 0"),
])
def test_a_bad_value_is_named_as_its_flag_before_the_run_is_built(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   flag: str, value: str, said: str) -> None:
    assert _simulate("fl-clients", tmp_path / "out", flag, value) == 2
    printed, err = capsys.readouterr()
    assert said in err and "building" not in printed, err
    assert not (tmp_path / "out").exists()


def test_the_flags_are_refused_on_other_scenarios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _simulate("gpu-mix", tmp_path, "--dropout", "0.1") == 2
    assert "--dropout applies to --scenario fl-clients only" in capsys.readouterr().err


def test_a_client_that_always_drops_out_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"dropout must be .* \[0, 1\), got 1"):
        FLClients(4, 10, 0, dropout=1.0)


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
    assert _simulate("fl-clients", tmp_path, "--dropout", dropout) == 0
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
    assert _simulate("fl-clients", tmp_path, "--dropout", "0.1234567") == 0
    assert _simulate("fl-clients", tmp_path, "--dropout", "0.12345671") == 0
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
