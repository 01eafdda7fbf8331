"""The example runs under ``torchrun --nproc-per-node 2`` (env:// rendezvous, embedded Redis) and converges."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torch_digits.py"


def run_example(*args: str, printed: list[str] | None = None) -> dict:  # type: ignore[type-arg]
    """Run the example on two ranks; the JSON line it ends with (and every line in ``printed``)."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
         *args], capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    if printed is not None:
        printed.extend(done.stdout.splitlines())
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_example_converges_under_torchrun() -> None:
    assert run_example("--epochs", "12")["test_accuracy"] >= 0.9


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_example_loss_is_finite_with_an_empty_slice() -> None:
    # 1,437 training digits: one global batch of 1,436, then one of a single sample split (1, 0)
    assert math.isfinite(run_example("--epochs", "1", "--global-batch", "1436")["train_loss"])


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_example_resumes_mid_epoch_from_its_checkpoint(tmp_path: Path) -> None:
    # 1,437 training digits in global batches of 128: 12 a epoch, a checkpoint after the 5th and the 10th
    checkpoint = str(tmp_path / "runs" / "ckpt.pt")  # in a folder not made yet: the example makes it
    run_example("--epochs", "2", "--checkpoint", checkpoint)
    printed: list[str] = []
    result = run_example("--epochs", "12", "--checkpoint", checkpoint, printed=printed)
    assert printed[0] == "resumed at epoch 1, global batch 10"
    assert printed[1].startswith("epoch   1 ") and result["test_accuracy"] >= 0.9
