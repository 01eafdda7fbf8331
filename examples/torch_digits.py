"""Train a small MLP on scikit-learn's digits with DDP and lbbsp, under torchrun.

    torchrun --nproc-per-node 2 examples/torch_digits.py                  # embedded Redis, coordinator on rank 0
    torchrun --nproc-per-node 2 examples/torch_digits.py --redis redis://host:6379/0
    torchrun --nnodes 2 --node-rank R --nproc-per-node 2 --master-addr HOST0 --master-port 29500 \
        examples/torch_digits.py                                          # two machines: Redis on rank 0, over TCP
    torchrun --nproc-per-node 2 --max-restarts 3 examples/torch_digits.py --checkpoint ckpt.pt   # resumes from it

The lines marked ``# lbbsp`` are all that differ from a plain DDP script.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from lbbsp import ConfigError, StoreUnavailable
from lbbsp.integrations.torch import Balancer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", default=None, help="Redis URL; default: an embedded server on rank 0")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--checkpoint", default=None, help="save here every --checkpoint-every global batches, "
                        "and resume from it where it exists (mid-epoch too)")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    args = parser.parse_args()
    for flag in ("epochs", "hidden", "checkpoint_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.checkpoint:  # its folder, made now: saving into a missing one had failed at the first checkpoint
        os.makedirs(os.path.dirname(os.path.abspath(args.checkpoint)), exist_ok=True)
    return args


def datasets(device: torch.device) -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    as_set = lambda a, b: TensorDataset(torch.tensor(a, dtype=torch.float32), torch.tensor(b))  # noqa: E731
    return as_set(x_train, y_train), as_set(x_test, y_test)


def main() -> None:
    args = parse_args()
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:  # init_process_group's env:// would fail with a traceback about the first of them
        sys.exit(f"{', '.join(missing)} not set: start this script with torchrun, which sets them for each rank, "
                 "e.g. torchrun --nproc-per-node 2 examples/torch_digits.py")
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        train(args, device)
    except (ConfigError, StoreUnavailable) as exc:  # lbbsp: a bad or unreachable --redis: why, not a traceback
        dist.destroy_process_group()
        sys.exit(f"torch_digits.py: {exc}{' (from --redis)' if isinstance(exc, StoreUnavailable) and args.redis else ''}")
    gc.collect()  # DDP models sit in reference cycles: free the model before the group (docs/torch.md: a hang at exit)
    dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    cuda = device.type == "cuda"
    rank = dist.get_rank()
    train, test = datasets(device)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10)).to(device)
    model = DDP(net, device_ids=[device.index] if cuda else None)
    lb = Balancer.from_env(args.global_batch, redis=args.redis)  # lbbsp
    lb.attach(model)  # lbbsp: gradients weighted by b_i / B, compute timed up to the all-reduce
    loader = lb.loader(train, seed=0, pin_memory=cuda)  # lbbsp: replaces DataLoader + DistributedSampler
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):  # every rank loads the same checkpoint
        ckpt = torch.load(args.checkpoint, map_location=device)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        loader.load_state_dict(ckpt["loader"])  # lbbsp: the epoch goes on after the last global batch saved
        start_epoch = ckpt["epoch"]
        if rank == 0:
            print(f"resumed at epoch {start_epoch}, global batch {ckpt['loader']['step']}", flush=True)

    accuracy = train_loss = 0.0
    full_split: tuple[int, ...] = ()  # the split of the last global batch of args.global_batch samples
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        seen = torch.zeros(2, device=device)  # this rank's summed training loss and its sample count
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            state = loader.state_dict()  # lbbsp: the epoch and its next global batch
            if args.checkpoint and rank == 0 and state["step"] % args.checkpoint_every == 0:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "loader": state, "epoch": epoch},
                           args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)  # a crash while saving leaves the last one
            if len(y):  # an empty slice (a short final batch of fewer samples than ranks) has a NaN mean loss
                seen[0] += loss.detach() * len(y)
                seen[1] += len(y)
            if lb.step is not None and lb.step.total == args.global_batch:  # lbbsp: not the short final batch
                full_split = lb.step.split
        dist.all_reduce(seen)
        if seen[1]:  # none where a checkpoint at an epoch's end resumed it: nothing of it was left
            train_loss = (seen[0] / seen[1]).item()  # the epoch's mean over all ranks' samples
        with torch.no_grad():
            x, y = test.tensors
            accuracy = (net(x.to(device)).argmax(1) == y.to(device)).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch:3d}  loss {train_loss:.4f}  test accuracy {accuracy:.3f}  "
                  f"sizes {list(full_split)}", flush=True)
    lb.close()  # lbbsp
    if rank == 0:
        print(json.dumps({"epochs": args.epochs, "train_loss": round(train_loss, 4),
                          "test_accuracy": round(accuracy, 4)}), flush=True)


if __name__ == "__main__":
    main()
