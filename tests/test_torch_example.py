"""The example's printed loss stays finite when a rank's slice is empty (a 1-sample final global batch)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_digits.py"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_example_loss_is_finite_with_an_empty_slice() -> None:
    # 1,437 training digits: one global batch of 1,436, then one of a single sample split (1, 0)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
         "--epochs", "1", "--global-batch", "1436"], capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert math.isfinite(result["train_loss"]), done.stdout
