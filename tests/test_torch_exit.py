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

Rank 0's close gives its coordinator process 1 s before killing it where rank 0's own embedded Redis is stopped
next, and the usual 5 s on a Redis it was given.
"""
from __future__ import annotations

import os
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


RANK0 = """
import sys
import torch.distributed as dist
from lbbsp.coordinator_process import CoordinatorProcess
from lbbsp.integrations.torch import Balancer

graces = []
stop = CoordinatorProcess.stop
def recorded(self, timeout_s=5.0):
    graces.append(timeout_s)
    stop(self, timeout_s)
CoordinatorProcess.stop = recorded
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
lb = Balancer.from_env(global_batch=8, redis=sys.argv[2] or None)
lb.close()
dist.destroy_process_group()
print("graces", graces)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("own_server", [True, False])
def test_torch_rank0_gives_its_coordinator_a_short_grace_only_before_its_own_server(
        own_server: bool, redis_url: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k != "LBBSP_REDIS_URL"}
    done = subprocess.run([sys.executable, "-c", RANK0, str(tmp_path / "init"), "" if own_server else redis_url],
                          capture_output=True, text=True, timeout=200, check=False, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    graces = done.stdout.strip().splitlines()[-1]
    assert graces == ("graces [1.0]" if own_server else "graces [5.0]"), (graces, done.stderr[-2000:])
