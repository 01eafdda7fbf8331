"""`lbbsp simulate`'s JSON says which lbbsp ran and which recorded traces the CPU workers replayed."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from lbbsp import __version__
from lbbsp.cli import main
from lbbsp.sim.traces import DEFAULT_TRACE_DIR


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
