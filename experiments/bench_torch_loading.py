"""Data loading overlapped with compute: plain DDP vs lbbsp with and without its prefetch (prints figures).

    python experiments/bench_torch_loading.py [--steps 60] [--read-us 600] [--hidden 1024] [--repeats 3] [--out F]

Two gloo workers train an MLP on the digits read as from slow storage (``--read-us`` of latency a sample, in a
loader worker process). Plain DDP's ``DataLoader`` loads ahead as its workers allow. lbbsp serves each step at
the size agreed for it, so a step's slice can be loaded only once its vector is stored: with the prefetch
(the default with loader workers) it is loaded while the step before computes, whenever the vector is stored
by then; without it (``prefetch=False``) the step waits for its own load. The modes run in turn, ``--repeats``
times, so that the machine's changes of speed fall on all alike; ratios are the median of the repeats. The
commands the Redis server processed per timed step (all ranks and the coordinator) show what the prefetch's
polling adds.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _args import out_help, run_record, spawn_ranks, writing_results
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from lbbsp import EmbeddedRedis, GlobalBatchSampler, equal_split
from lbbsp.integrations.demo import build
from lbbsp.integrations.torch import Balancer

WORLD = 2
MODES = ("ddp", "lbbsp-no-prefetch", "lbbsp")
OUT = Path(__file__).resolve().parent / "results" / "bench_torch_loading.json"


class SlowStorage(Dataset):
    """A dataset whose every read waits ``read_s`` first, as a read from network storage does."""

    def __init__(self, data: Any, read_s: float) -> None:
        self.data, self.read_s = data, read_s

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.read_s)
        return self.data[i]


class CommandCount:
    """Commands the Redis server processed between two readings, from every client, less the readings' own (a
    connection's handshake and the INFO: plain DDP, which sends none, had read 4 a step over 1 step)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.client.ping()  # the connection's own commands, before the first reading
        self.start = self._processed()

    def _processed(self) -> int:
        return int(self.client.info("stats")["total_commands_processed"])

    def since_start(self) -> int:
        """The count since construction: the first INFO is the one command of ours counted."""
        try:
            return self._processed() - self.start - 1
        finally:
            self.client.close()


def train(mode: str, args: argparse.Namespace, url: str) -> tuple[float, int, int]:
    """One run of ``args.steps`` timed steps: (seconds, steps served from a prefetch, Redis commands)."""
    rank = dist.get_rank()
    data, model = build(args.hidden)
    data = SlowStorage(data, args.read_us * 1e-6)
    model = DDP(model)
    lb = None
    if mode == "ddp":  # the same global batches, equal split, loaded ahead by DataLoader's worker
        sampler = GlobalBatchSampler(len(data), args.global_batch, seed=0, drop_last=True)
        split = equal_split(args.global_batch, WORLD)
        plan = [sampler.worker_indices(k, split, rank).tolist() for k in range(len(sampler))]
        loader: Any = DataLoader(data, batch_sampler=plan, num_workers=1, persistent_workers=True)
    else:
        lb = Balancer.from_env(args.global_batch, redis=url)
        lb.attach(model)
        loader = lb.loader(data, seed=0, drop_last=True, num_workers=1, prefetch=mode == "lbbsp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step, started, count = 0, 0.0, None
    while step < args.warmup + args.steps:
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if step == args.warmup:  # the loader's worker processes have started: time from here
                started = time.perf_counter()
                count = CommandCount(url) if rank == 0 else None
            if step == args.warmup + args.steps:
                break
    seconds = time.perf_counter() - started  # the ranks keep in step through DDP's all-reduce
    issued = count.since_start() if count is not None else 0
    prefetched = getattr(loader, "prefetched", 0)
    if lb is not None:
        lb.close()
    return seconds, prefetched, issued


def _worker(rank: int, args: argparse.Namespace, init: str, url: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(init, WORLD), rank=rank, world_size=WORLD)
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    issued: dict[str, list[int]] = {mode: [] for mode in MODES}
    prefetched: list[int] = []
    for _ in range(args.repeats):
        for mode in MODES:
            took, hits, count = train(mode, args, url)
            seconds[mode].append(took)
            issued[mode].append(count)
            if mode == "lbbsp":
                prefetched.append(hits)
        if rank == 0:
            print("  repeat: " + ", ".join(f"{m} {seconds[m][-1]:.2f}s" for m in MODES), flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "prefetched": prefetched, "commands": issued}))
    gc.collect()  # train's DDP models sit in reference cycles: freed before the group (docs/torch.md)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps timed per run (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="steps before the timing starts (worker start-up) (default: %(default)s)")
    parser.add_argument("--read-us", type=float, default=600.0,
                        help="storage latency per sample, microseconds (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="MLP width (compute per sample) (default: %(default)s)")
    parser.add_argument("--global-batch", type=int, default=128,
                        help="at most 1797 (the digits data) (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, in turn (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help=out_help(OUT))
    args = parser.parse_args()
    if min(args.steps, args.warmup, args.hidden, args.repeats) < 1:
        parser.error("--steps, --warmup, --hidden and --repeats must be at least 1")
    if not 0 <= args.read_us < 1e6:  # NaN and inf too: they had failed in the workers, as a sleep of NaN
        parser.error(f"--read-us must be at least 0 and below a million microseconds, got {args.read_us:g}")
    if not WORLD <= args.global_batch <= 1797:
        parser.error("--global-batch must lie in [2, 1797]")
    with writing_results(parser, args.out) as args.out:
        benchmark(args)
    return 0


def benchmark(args: argparse.Namespace) -> None:
    """The modes in turn, ``--repeats`` times, on the ranks; then the table, and the JSON file."""
    print(f"bench_torch_loading: {WORLD} gloo workers, {args.steps} steps x global batch {args.global_batch}, "
          f"{args.read_us:g} us a sample read, MLP width {args.hidden}; {args.repeats} runs of each mode in turn",
          flush=True)
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory(prefix="lbbsp-bench-") as tmp:
        out = os.path.join(tmp, "out.json")
        spawn_ranks(_worker, (args, os.path.join(tmp, "rdv"), server.url, out), WORLD)
        raw = json.loads(Path(out).read_text())
    seconds = raw["seconds"]
    rate = {m: statistics.median(args.steps * args.global_batch / s for s in seconds[m]) for m in MODES}
    ratio = {m: [seconds["ddp"][r] / seconds[m][r] for r in range(args.repeats)] for m in MODES[1:]}
    per_step = {m: statistics.median(raw["commands"][m]) / args.steps for m in MODES}
    print(f"\n{'mode':<20}{'samples/s':>10}{'/ DDP':>8}{'(range)':>15}{'Redis commands/step':>21}")
    for m in MODES:
        spread = f"{min(ratio[m]):.2f}-{max(ratio[m]):.2f}" if m in ratio else ""
        versus = f"{statistics.median(ratio[m]):.2f}" if m in ratio else "1.00"
        print(f"{m:<20}{rate[m]:>10.0f}{versus:>8}{spread:>15}{per_step[m]:>21.1f}")
    served = ", ".join(map(str, raw["prefetched"]))  # one count per repeat (it had printed the list: "[60]")
    print(f"lbbsp steps served from its prefetch: {served} of {args.warmup + args.steps} per run, warm-up included "
          "(rank 0)")
    result = {"args": {**vars(args), "out": str(args.out)}, "samples_per_s": rate,
              "vs_ddp": {m: statistics.median(r) for m, r in ratio.items()}, "vs_ddp_runs": ratio,
              "prefetched": raw["prefetched"], "redis_commands_per_step": per_step}
    args.out.write_text(json.dumps({**result, "run": run_record()}, indent=1))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
