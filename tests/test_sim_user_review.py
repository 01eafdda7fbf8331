"""`lbbsp simulate` from a new user's side: what it refuses, what it writes, and whether its figures add up."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lbbsp.allocation import LinearTime
from lbbsp.cli import main
from lbbsp.config import JobConfig
from lbbsp.errors import ConfigError
from lbbsp.models import EWMAThroughput
from lbbsp.policies import BSPPolicy, OraclePolicy
from lbbsp.sim import cli
from lbbsp.sim.engine import compare, standard_policies
from lbbsp.sim.scenarios import FLClients, GPUMix, MixedCluster, Scenario, Truth
from lbbsp.sim.traces import load_traces
from test_sim import _parse

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


def test_a_policy_that_compares_equal_to_one_that_ran_is_still_fresh() -> None:
    """A fresh policy of the user's own whose class compares by value was refused as 'has run already' when an
    equal one had run; a policy that cannot be hashed (a plain dataclass) was never checked at all."""
    class Tuned(BSPPolicy):
        def __init__(self, knob: int) -> None:
            super().__init__()
            self.knob = knob

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Tuned) and other.knob == self.knob

        def __hash__(self) -> int:
            return hash(self.knob)

    ran = Tuned(1)  # kept alive, as a user's notebook keeps it
    compare(GPUMix(4, 3, 0), 3, {"tuned": ran})
    assert compare(GPUMix(4, 3, 0), 3, {"tuned": Tuned(1)})["tuned"].iteration_s

    class Unhashable(BSPPolicy):
        __hash__ = None  # type: ignore[assignment]

    twice = Unhashable()
    compare(GPUMix(4, 3, 0), 3, {"once": twice})
    with pytest.raises(ConfigError, match="has run already"):
        compare(GPUMix(4, 3, 0), 3, {"twice": twice})


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


class Counting(BSPPolicy):
    """Counts its decisions: shows whether a comparison ran it before refusing a later entry."""

    def __init__(self) -> None:
        super().__init__()
        self.decided = 0

    def decide(self, *args: object, **kwargs: object) -> object:
        self.decided += 1
        return super().decide(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("entry", "message"), [
    (EWMAThroughput(), r"'bad' is a capacity model, not a policy: wrap it, LBBSPPolicy\(EWMAThroughput\(\)\)"),
    (BSPPolicy, r"'bad' is the class BSPPolicy: give an instance, e.g. BSPPolicy\(\)"),
    ("bsp", "'bad' is a str, not a Policy"),
])
def test_a_comparison_refuses_an_entry_that_is_not_a_policy_before_any_runs(entry: object, message: str) -> None:
    """A model, a class or a string among the policies failed with AttributeError or TypeError, and only once
    the entries before it had run (and used themselves up): now a ConfigError that says what to give, up front."""
    first = Counting()
    with pytest.raises(ConfigError, match=message):
        compare(GPUMix(4, 3, 0), 3, {"first": first, "bad": entry})  # type: ignore[dict-item]
    assert first.decided == 0
    assert compare(GPUMix(4, 3, 0), 3, {"first": first})["first"].iteration_s  # still fresh


def test_a_comparison_refuses_a_policy_given_twice_or_used_before_any_runs() -> None:
    first, used, twice = Counting(), BSPPolicy(), BSPPolicy()
    compare(GPUMix(4, 3, 0), 3, {"used": used})
    with pytest.raises(ConfigError, match="policy 'again' has run already"):
        compare(GPUMix(4, 3, 0), 3, {"first": first, "again": used})
    with pytest.raises(ConfigError, match="policies 'a' and 'b' are one object"):
        compare(GPUMix(4, 3, 0), 3, {"first": first, "a": twice, "b": twice})
    with pytest.raises(ConfigError, match="mapping of name to Policy, got list"):
        compare(GPUMix(4, 3, 0), 3, [first])  # type: ignore[arg-type]
    assert first.decided == 0


@pytest.mark.parametrize("scenario", ["gpu-mix", GPUMix])
def test_a_scenario_name_or_class_is_refused_with_how_to_build_one(scenario: object) -> None:
    """compare("gpu-mix", ...) and standard_policies(GPUMix) failed with AttributeError."""
    for call in (lambda: compare(scenario, 3), lambda: standard_policies(scenario)):  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"must be a Scenario instance.*GPUMix\(num_workers, iterations, seed\)"):
            call()


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


def test_sim_inputs_a_new_user_tries_are_named() -> None:
    assert compare(GPUMix(4, 3, 0), np.int64(3), {"bsp": BSPPolicy()})["bsp"].iteration_s  # as the scenarios take it
    for folder in ("", None, 5):  # '' had read the current folder, the others a bare TypeError
        with pytest.raises(ConfigError, match="is not a directory"):
            load_traces(folder)  # type: ignore[arg-type]


@pytest.mark.parametrize(("build", "message"), [
    (lambda: GPUMix(4, 5, 0, fixed_gb=11), "its 12 GB hold 11 samples of gb_per_sample 0.085 beside fixed_gb 11"),
    (lambda: MixedCluster(4, 3, 0, gpu_batch=200), "mixed cluster of 4 workers, its GPUs .gpu_batch as their "
                                                    "batch_per_worker.: batch_per_worker 200 does not fit"),
    (lambda: MixedCluster(4, 3, 0, cpu_batch=10**7), "its CPU workers .cpu_batch as their batch_per_worker.: "),
    (lambda: MixedCluster(10**6, 3, 0), r"num_workers must be an integer in \[2, 100000\], got 1000000$"),
    (lambda: GPUMix(4, 10**9, 0), "num_workers x iterations must be at most 50,000,000"),
    (lambda: FLClients(4, 3, 0, local_steps=10**400), r"local_steps must be an integer in \[1, 1000000\]"),
])
def test_scenario_options_are_named_as_the_user_gave_them(build: Any, message: str) -> None:
    """A fixed_gb of 11 blamed batch_per_worker; a mixed cluster's errors named its halves' options and halved its
    workers; 10**9 iterations were a MemoryError and 10**400 local steps an OverflowError."""
    with pytest.raises(ConfigError, match=message):
        build()


@pytest.mark.parametrize("scenario", [lambda: GPUMix(4, 3, 0, jitter=1e3), lambda: FLClients(4, 3, 0, model_mb=1e308),
                                      lambda: MixedCluster(4, 3, 0, cpu_images_per_s=1e-300)])
def test_options_that_make_times_no_report_can_carry_are_blamed_not_a_worker(scenario: Any) -> None:
    """They had failed as one worker's report: 'compute_s: must be finite, got inf [worker=0]'."""
    with np.errstate(all="ignore"), pytest.raises(ConfigError, match=r"past the 86,400 s a report may carry: check "
                                                                    r"the magnitudes of its options \("):
        compare(scenario(), 3, {"bsp": BSPPolicy()})
