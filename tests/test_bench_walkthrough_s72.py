"""What a new user running the benchmark scripts met: defaults --help did not state (and one it misstated), a run
refused before it started that left its --out folder behind, and bench_flower's rounds printed only once a whole run
of them had ended, though its docstring promised progress per round."""
from __future__ import annotations

import argparse
import os
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

import pytest

from test_experiments import EXPERIMENTS, _experiment

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


DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_torch_docs_name_the_rows_the_torch_benchmarks_print() -> None:
    """docs/torch.md's tables say "no load", "static 2x" and "plain DDP"; bench_torch prints none, a2x, a3x and b,
    bench_torch_loading ddp, lbbsp-no-prefetch and lbbsp, and the page had not said which row was which."""
    page = " ".join((DOCS / "torch.md").read_text().split())
    for named in ("`none` (no load)", "`a2x` and `a3x` (static 2x and 3x)", "`b` (fluctuating)"):
        assert named in page, named
    for mode in _experiment("bench_torch_loading").MODES:
        assert f"`{mode}`" in page, mode


@pytest.mark.parametrize(("page", "script"), [("torch.md", "bench_torch"), ("torch.md", "bench_torch_loading"),
                                              ("keras.md", "bench_keras"), ("flower.md", "bench_flower")])
def test_each_benchmark_page_gives_a_quick_run_its_script_takes(page: str, script: str) -> None:
    """A quick run with --out for every framework benchmark (bench_torch_loading and bench_flower had none: their
    defaults take minutes), in flags the script accepts."""
    text = " ".join((DOCS / page).read_text().split())
    start = text.index(f"For a quick look, `python experiments/{script}.py ")
    command = text[start:].split("`")[1].split()[2:]
    assert "--out" in command, command
    parser = _parser(script)
    args = parser.parse_args(command)
    assert str(args.out).startswith("/tmp/"), args.out


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


@pytest.mark.parametrize("name", [name for name in SCRIPTS if name not in ("bench_coordinator", "bench_models")])
def test_a_benchmarks_out_help_names_its_default_file_from_the_repository_root(name: str) -> None:
    """bench_policies's and bench_torch_gpu's --help showed this checkout's absolute path, the others "the one the
    docs quote": each now names the file as the docs do."""
    out = next(action for action in _parser(name)._actions if "--out" in action.option_strings)
    assert f"(default: experiments/results/{out.default.name})" in " ".join((out.help or "").split()), out.help
