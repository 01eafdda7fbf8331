"""Measure the right thing: a fast rank's reported compute time leaves out its wait for a slow rank."""
from __future__ import annotations

import json
import os
import statistics
import time
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from lbbsp.integrations.torch import Balancer  # noqa: E402
from lbbsp.policies import BSPPolicy  # noqa: E402
from test_torch_exact import digits, mlp, spawn  # noqa: E402

STALL_S = 0.25  # rank 1's extra compute per step, inside its forward pass
STEPS = 6


def _worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    model = mlp()
    if rank == 1:  # the straggler: its forward pass really takes longer
        model.register_forward_hook(lambda *_: time.sleep(STALL_S))
    ddp = DDP(model)
    lb = Balancer.from_env(40, redis=url, job=job, policy=BSPPolicy())
    lb.attach(ddp)
    loader = lb.loader(digits(), seed=0)
    compute, wall = [], []
    for step, (x, y, _) in enumerate(loader):
        started = time.perf_counter()
        F.cross_entropy(ddp(x), y).backward()  # the all-reduce inside waits for the straggler
        wall.append(time.perf_counter() - started)
        compute.append(lb.last_report.compute_s)
        if step + 1 == STEPS:
            break
    lb.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"compute": compute, "wall": wall}))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_reported_compute_leaves_out_the_wait_at_the_all_reduce(tmp_path: Path, redis_server) -> None:
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    spawn(_worker, (2, str(tmp_path / "rdv"), url, f"test-{uuid.uuid4().hex[:10]}", str(tmp_path)), nprocs=2,
          timeout_s=150)
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # step 0 includes start-up; medians over the other steps, so one scheduling stall of a rank on a loaded
    # machine (which shortens its partner's wait, or lengthens its own compute) cannot decide the test
    assert statistics.median(fast["wall"][1:]) > STALL_S * 0.8, "the fast rank did not wait for the straggler"
    assert statistics.median(fast["compute"][1:]) < STALL_S * 0.4, "the fast rank's wait was counted as compute"
    assert min(slow["compute"][1:]) > STALL_S, "the straggler's real compute was not counted"
