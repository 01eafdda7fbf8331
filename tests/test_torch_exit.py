"""A job that imports the torch adapter ends with gloo's threads stopped, before the interpreter's exit.

With torch 2.13, DDP's constructor first imports ``torch.distributed.nn.functional``, whose functions take
``group=group.WORLD`` as a default argument: imported after ``init_process_group``, it holds the default group
for good, and gloo's threads run on into interpreter exit, where one that frees a tensor aborts the process.

The child frees the DDP model before it destroys the group, as docs/torch.md advises ("A hang at exit"). The
other way round, torch 2.13 deadlocked in 3 runs of 88 here (2 processes at once on 2 cores), and once in CI.
gdb showed why: the model's C++ Reducer held the group's last reference and freed it under the GIL. The group's
destructor then joined gloo's worker thread, which was still freeing the backward's all-reduce work. That work's
thread-local state holds a Python object (the context that backward stashes), so the thread waited for the GIL
for ever. In this order: 0 hangs in 200 runs.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

RANK = """
import faulthandler, gc, os, sys
faulthandler.dump_traceback_later(90, exit=True)  # a hang shows where, before the test's timeout
import lbbsp.integrations.torch  # what a training script imports before init_process_group
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = DistributedDataParallel(torch.nn.Linear(4, 2))
model(torch.randn(3, 4)).sum().backward()
del model
gc.collect()
dist.destroy_process_group()
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
