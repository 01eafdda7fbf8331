"""The example runs under ``torchrun --nproc-per-node 2`` (env:// rendezvous, embedded Redis) and converges."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_digits.py"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_example_converges_under_torchrun() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
         "--epochs", "12"], capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["test_accuracy"] >= 0.9, done.stdout
