"""A job that imports the torch adapter ends with gloo's threads stopped, before the interpreter's exit.

With torch 2.13, DDP's constructor first imports ``torch.distributed.nn.functional``, whose functions take
``group=group.WORLD`` as a default argument: imported after ``init_process_group``, it holds the default group
for good, and gloo's threads run on into interpreter exit, where one that frees a tensor aborts the process.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

RANK = """
import gc, os, sys
import lbbsp.integrations.torch  # what a training script imports before init_process_group
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = DistributedDataParallel(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
dist.destroy_process_group()
del model
gc.collect()
print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from Linux's /proc")
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gloo_threads_stop_once_the_ddp_model_and_the_group_are_gone(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", RANK, str(tmp_path / "init")], capture_output=True, text=True,
                          timeout=110, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    threads = done.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads
