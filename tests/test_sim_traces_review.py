"""The simulator's traces and scenario arguments from a new user's side: what a wrong one says, and where."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lbbsp.errors import ConfigError
from lbbsp.sim.scenarios import CPUContention, FLClients, GPUMix, MixedCluster
from lbbsp.sim.traces import TRACE_FEATURES, CPUTrace, load_traces

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
COLUMNS = ["throughput", *TRACE_FEATURES, "hog_level"]
GOOD = [900.0, 0.5, 0.9, 0.0, 0.3, 4, 1]  # one row of COLUMNS a replay can use


@pytest.mark.parametrize("build", [CPUContention, MixedCluster])
@pytest.mark.parametrize("folder", ["my_traces", Path("my_traces")])
def test_a_folder_given_as_traces_is_shown_as_given_with_the_call_that_reads_it(build: type, folder: object) -> None:
    """traces="my_traces" had said 'got ['m', 'y', '_', 't', 'r', 'a', 'c', 'e', 's']' (the string as a list)."""
    with pytest.raises(ConfigError) as raised:
        build(8, 20, 0, traces=folder)
    said = str(raised.value)
    assert f"got the folder {folder!r}" in said and "traces=load_traces('my_traces')" in said, said
    assert "['m', 'y'" not in said


@pytest.mark.parametrize(("traces", "shown"), [([1, 2], "got [1, 2]"), (5, "got 5"), ([], "got []")])
def test_traces_that_are_no_traces_are_shown_as_passed(traces: object, shown: str) -> None:
    """A list of other things is shown as it was passed; a non-iterable (5) had raised TypeError from list()."""
    with pytest.raises(ConfigError, match=re.escape(shown)):
        CPUContention(4, 10, 0, traces=traces)


def test_a_folder_without_json_traces_says_what_it_holds(tmp_path: Path) -> None:
    """A trace saved without .json, or one in a subfolder, had given only 'no CPU traces in DIR', though the
    recorder writes whatever --out says."""
    (tmp_path / "cpu_torch").write_text(json.dumps({"columns": COLUMNS, "rows": [GOOD] * 3}))
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "t.json").write_text("{}")
    with pytest.raises(ConfigError) as raised:
        load_traces(tmp_path)
    said = str(raised.value)
    assert f"no CPU traces in {tmp_path}: no *.json files directly in it" in said, said
    assert "it holds cpu_torch, inner/" in said, said
    (tmp_path / "more").mkdir()
    for i in range(6):
        (tmp_path / "more" / f"f{i}").touch()
    with pytest.raises(ConfigError, match=re.escape("it holds f0, f1, f2, f3, f4 and 1 more")):
        load_traces(tmp_path / "more")


def test_the_recorder_refuses_an_out_that_lbbsp_would_not_read_before_recording(tmp_path: Path) -> None:
    """`--out my_traces/cpu` recorded for minutes into a file that `--traces my_traces` then ignored."""
    out = tmp_path / "my_traces" / "cpu"
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "record_cpu_trace.py"), "--seconds", "0.3", "--out",
                             str(out)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "--out must end in .json" in result.stderr, result.stderr
    assert "recording" not in result.stdout and not out.exists()


@pytest.mark.parametrize(("column", "value", "said"), [
    (1, "NaN", "cpu_util must be in [0.0, 1.0], row 4 has nan"),
    (0, "0.0", "throughput must be in [0.1, 1e12] samples/s, row 4 has 0"),
    (0, "-5.0", "throughput must be in [0.1, 1e12] samples/s, row 4 has -5"),
    (0, "1e400", "throughput must be in [0.1, 1e12] samples/s, row 4 has inf"),
    (0, "1e308", "throughput must be in [0.1, 1e12] samples/s, row 4 has 1e+308"),  # a level's median overflowed
    (0, "1e-06", "throughput must be in [0.1, 1e12] samples/s, row 4 has 1e-06"),  # a day's time, blamed on options
    (6, "1.5", "hog_level must be a whole number in [0, 2**53), row 4 has 1.5"),
])
def test_a_bad_value_in_a_trace_is_located_by_row_and_column(tmp_path: Path, column: int, value: str, said: str) -> None:
    """A NaN feature, a throughput of 0, -5 or 1e400 and a hog_level of 1.5 had all said the same sentence
    naming neither the row nor the column."""
    rows = [list(GOOD) for _ in range(6)]
    rows[4][column] = 12345.5  # a marker, replaced in the text by the bad value (NaN and 1e400 are no JSON)
    rows[5][column] = 12345.5  # a second bad row: the first is named, the count says there are more
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"columns": COLUMNS, "rows": rows}).replace("12345.5", value))
    with pytest.raises(ConfigError, match=re.escape(f"cannot read CPU trace {path}: {said} (2 rows out of range)")):
        CPUTrace.load(path)


def test_the_first_bad_row_is_named_whichever_column_it_is_in(tmp_path: Path) -> None:
    rows = [list(GOOD) for _ in range(5)]
    rows[3][0], rows[2][5] = 0.0, 0  # throughput bad in row 3, cores (below 1) in row 2: row 2 is the first
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"columns": COLUMNS, "rows": rows}))
    with pytest.raises(ConfigError, match=re.escape("cores must be in [1.0, 100000.0], row 2 has 0 (1 row out of")):
        CPUTrace.load(path)


@pytest.mark.parametrize(("build", "least"), [(GPUMix, 2), (CPUContention, 2), (FLClients, 2), (MixedCluster, 4)])
@pytest.mark.parametrize("workers", [0, 1, -3])
def test_too_few_workers_name_the_scenarios_own_minimum(build: type, least: int, workers: int) -> None:
    """0 workers had said 'must be an integer in [1, inf]', and then 1 was refused with 'must be at least 2'."""
    with pytest.raises(ConfigError, match=re.escape(f"num_workers must be at least {least} ")) as raised:
        build(workers, 10, seed=0)
    assert "[1, inf]" not in str(raised.value)
    with pytest.raises(ConfigError, match="num_workers must be an integer, got 2.5"):
        build(2.5, 10, seed=0)


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
