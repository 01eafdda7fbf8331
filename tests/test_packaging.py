"""What a non-editable install (a built wheel) holds: every package, the recorded traces the simulator reads, and the
PEP 561 marker, so that a user's mypy checks calls into lbbsp against its type hints instead of treating it as untyped.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built with the installed setuptools (no download) from a copy of this checkout's sources:
    setuptools builds in the tree, and a build/ left from an earlier build still held files deleted since."""
    source, out = tmp_path_factory.mktemp("source") / "lbbsp", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", ".mypy", ".*_cache", ".hypothesis", "build", "dist", "*.egg-info", "__pycache__",
        "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, capture_output=True, timeout=300)
    return next(out.glob("lbbsp-*.whl"))


def test_the_wheel_holds_every_package_the_traces_and_the_typed_markers(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("lbbsp", "lbbsp/models", "lbbsp/sim", "lbbsp/integrations"):
        assert f"{package}/__init__.py" in names, package
    assert {f"lbbsp/sim/recorded/{trace.name}" for trace in (ROOT / "experiments" / "traces").glob("*.json")} <= names
    assert {"lbbsp/py.typed", "lbbsp/integrations/py.typed"} <= names


def test_a_users_mypy_reads_lbbsp_s_type_hints_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    """Installed without the marker, lbbsp was untyped to a user's mypy: ``import-untyped`` at every import, and a
    wrong argument went unnoticed. Skipped without mypy: the README's install (``.[all]``) has none, ``.[dev]`` has."""
    pytest.importorskip("mypy", reason="mypy is a dev tool (pip install -e '.[dev]'); the README's install has none")
    site = tmp_path / "site-packages"
    zipfile.ZipFile(wheel).extractall(site)
    user = tmp_path / "train.py"
    user.write_text("from lbbsp import JobConfig\nfrom lbbsp.integrations.torch import LBBSPTrainer\n\n"
                    "config = JobConfig('job', num_workers='four', global_batch=256)\n")
    # mypy reads installed packages from the search path of the interpreter it runs on, PYTHONPATH included: the
    # wheel's contents there stand in for an installed lbbsp (the editable install's import hook is not followed)
    result = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", "/dev/null", str(user)], check=False,
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(site)})
    assert "import-untyped" not in result.stdout, result.stdout
    assert 'Argument "num_workers" to "JobConfig" has incompatible type "str"' in result.stdout, result.stdout
