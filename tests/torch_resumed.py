"""One rank of a job that resumes from a checkpoint, on however many ranks it is started: trains a linear model on an
indexed data set, rank 0 checkpoints every 3 global batches, and each rank appends what it saw to
OUT/<job>.w<world size>.rank<r>.jsonl: a first line with the job and world size, then one line a step.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/torch_resumed.py OUT REDIS_URL JOB EPOCHS
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from lbbsp.integrations.torch import Balancer

SAMPLES, GLOBAL_BATCH = 240, 24  # 10 global batches an epoch


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Random features and labels that also yield each sample's index: what each rank used is told exactly."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=generator, dtype=torch.float64)
        self.y = torch.randint(0, 3, (SAMPLES,), generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def main(out: str, redis: str, job: str, epochs: int) -> None:
    """Train ``epochs`` epochs, from the checkpoint where there is one."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 3).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lb = Balancer.from_env(GLOBAL_BATCH, redis=redis, job=job)
    lb.attach(model)
    loader = lb.loader(Indexed(), seed=0)
    checkpoint, start_epoch = Path(out, "ckpt.pt"), 0
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        loader.load_state_dict(saved["loader"])
        start_epoch = saved["epoch"]
    with open(Path(out, f"{job}.w{dist.get_world_size()}.rank{rank}.jsonl"), "a") as log:
        log.write(json.dumps({"job": job, "world": dist.get_world_size()}) + "\n")
        for epoch in range(start_epoch, epochs):
            loader.set_epoch(epoch)
            for step, (x, y, index) in enumerate(loader, start=loader.state_dict()["step"]):
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                split = lb.step.split if lb.step is not None else ()  # a step is in progress inside the loop
                log.write(json.dumps({"epoch": epoch, "step": step, "split": list(split),
                                      "index": index.tolist()}) + "\n")
                if rank == 0 and loader.state_dict()["step"] % 3 == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                                "loader": loader.state_dict(), "epoch": epoch}, f"{checkpoint}.tmp")
                    os.replace(f"{checkpoint}.tmp", checkpoint)
    lb.close()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
