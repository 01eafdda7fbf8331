"""Plain DDP vs lbbsp on real gloo workers with real co-located load (prints figures; not a timed test).

    python experiments/bench_torch.py [--steps 60] [--hidden 512] [--global-batch 1024] [--repeats 3] [--out F]

Two workers, each pinned to its own core; busy-loop processes pinned to worker 1's core slow it down.
(none) no load: what lbbsp costs when there is nothing to balance. (a) static load: 1 busy process (about
2x slower) and 2 (about 3x). In (none) and (a) a fixed split runs through lbbsp for reference, the "oracle":
the equal split with no load, else the split profiled under the same load. lbbsp/oracle is then what the
balancing itself costs or gains, apart from lbbsp's per-step work, which both share; in (none), oracle/DDP
is that per-step work's cost. (b) fluctuating load: 0, 1 or 2 busy processes, changing every few steps by
a seeded schedule. Each case runs DDP, lbbsp and the oracle in turn, ``--repeats`` times, so that a change
in the machine's speed falls on all three alike; the ratios are the median of the repeats. Every run sees
the same global batches, so plain DDP and lbbsp must end with the same parameters. Figures go to stdout
and, with the arguments, to --out (default experiments/results/bench_torch.json, the file the docs quote).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _args import out_help, run_record, spawn_ranks, writing_results
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from lbbsp import EmbeddedRedis, GlobalBatchSampler, JobConfig, LBBSPPolicy, LinearTime, Policy, allocate, equal_split
from lbbsp.integrations.demo import ColocatedLoad, build, cores_for
from lbbsp.integrations.torch import Balancer
from lbbsp.policies import Decision

WORLD = 2
DIGITS = 1797  # samples in scikit-learn's digits, the data of every run
SLOW = 1
OUT = Path(__file__).resolve().parent / "results" / "bench_torch.json"


class FixedSplit(Policy):
    """The oracle of case (a): one split, known in advance, for every iteration."""

    name = "oracle"

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    def decide(self, iteration: int, current: Any, config: JobConfig) -> Decision:
        return Decision(self.sizes, "oracle split from profiled speeds")


def load_level(case: str, step: int) -> int:
    """Busy processes on the slow core at ``step``: fixed in (a), a seeded walk over 0-2 in (b)."""
    if case == "none":
        return 0
    if case == "a2x":
        return 1
    if case == "a3x":
        return 2
    return int(np.random.default_rng([7, step // 8]).integers(0, 3))


def profile_split(model: torch.nn.Module, data: Any, global_batch: int) -> tuple[int, ...]:
    """Each rank's throughput on half a global batch under the current load; the min-max split of B."""
    x, y = data[torch.arange(global_batch // 2)]
    times = []
    for _ in range(5):
        started = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        times.append(time.perf_counter() - started)
    model.zero_grad()
    speed = torch.tensor([len(x) / float(np.median(times))], dtype=torch.float64)
    speeds = [torch.zeros_like(speed) for _ in range(WORLD)]
    dist.all_gather(speeds, speed)
    sizes = allocate(LinearTime(np.array([float(s) for s in speeds])), global_batch, [1] * WORLD,
                     [global_batch] * WORLD)
    return tuple(int(s) for s in sizes)


def train(mode: str, case: str, args: argparse.Namespace, url: str, loads: list[ColocatedLoad] | None,
          oracle: tuple[int, ...] | None = None) -> tuple[float, torch.Tensor]:
    """One run; returns (seconds, final flat parameters)."""
    rank = dist.get_rank()
    data, model = build(args.hidden)
    model = DDP(model)
    if mode == "ddp":  # plain DDP: equal split of the same global batches, DDP's own mean
        sampler = GlobalBatchSampler(len(data), args.global_batch, seed=0, drop_last=True)
        split = equal_split(args.global_batch, WORLD)
        plan = [sampler.worker_indices(k, split, rank).tolist() for k in range(len(sampler))]
        loader: Any = DataLoader(data, batch_sampler=plan)
        lb = None
    else:
        lb = Balancer.from_env(args.global_batch, redis=url,
                               policy=LBBSPPolicy() if mode == "lbbsp" else FixedSplit(oracle or ()))
        lb.attach(model)
        loader = lb.loader(data, seed=0, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dist.barrier()
    started = time.perf_counter()
    step = 0
    while step < args.steps:
        for x, y in loader:
            if loads is not None:
                level = load_level(case, step)
                for i, load in enumerate(loads):
                    load.set(i < level)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if step == args.steps:
                break
    dist.barrier()
    seconds = time.perf_counter() - started
    if lb is not None:
        lb.close()
    return seconds, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _worker(rank: int, args: argparse.Namespace, init: str, url: str, out: str) -> None:
    cores = cores_for(WORLD)  # before pinning: afterwards this process may use its own core only
    os.sched_setaffinity(0, {cores[rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(init, WORLD), rank=rank, world_size=WORLD)
    loads = [ColocatedLoad(cores[SLOW], 1) for _ in range(2)] if rank == 0 else None
    results = []
    try:
        for case in ("none", "a2x", "a3x", "b"):
            oracle = None
            if case == "none":  # identical ranks: the equal split, so lbbsp/oracle is the balancing's own cost
                oracle = equal_split(args.global_batch, WORLD)
            elif case != "b":  # a static load: profile the oracle split under it
                if loads is not None:
                    for i, load in enumerate(loads):
                        load.set(i < load_level(case, 0))
                dist.barrier()  # the load is on before any rank profiles
                data, model = build(args.hidden)
                oracle = profile_split(model, data, args.global_batch)
            # the runs of a case alternate, so that a change in the machine's speed falls on all of them alike
            seconds: dict[str, list[float]] = {"ddp": [], "lbbsp": [], "oracle": []}
            diffs = []
            for _ in range(args.repeats):
                ddp_s, ddp_params = train("ddp", case, args, url, loads)
                lb_s, lb_params = train("lbbsp", case, args, url, loads)
                seconds["ddp"].append(ddp_s)
                seconds["lbbsp"].append(lb_s)
                if oracle:
                    seconds["oracle"].append(train("oracle", case, args, url, loads, oracle)[0])
                diffs.append(float((lb_params - ddp_params).norm() / ddp_params.norm()))
            results.append(_summary(case, seconds, oracle, diffs, args.steps * args.global_batch))
            if rank == 0:
                print(f"  done: {case}", flush=True)
    finally:
        if loads is not None:
            for load in loads:
                load.close()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    gc.collect()  # train's DDP models sit in reference cycles: freed before the group (docs/torch.md)
    dist.destroy_process_group()


def _summary(case: str, seconds: dict[str, list[float]], oracle: tuple[int, ...] | None, diffs: list[float],
             samples: int) -> dict[str, Any]:
    """One case's figures: median samples/s of each mode, and the median and range of the ratios of the runs
    made one after the other (repeat r of lbbsp against repeat r of DDP and of the oracle split)."""
    ddp, lb, fixed = (np.array(seconds[mode]) for mode in ("ddp", "lbbsp", "oracle"))
    ratio, versus = ddp / lb, (fixed / lb if fixed.size else None)
    return {
        "case": case, "repeats": int(ddp.size), "ddp_samples_per_s": samples / float(np.median(ddp)),
        "lbbsp_samples_per_s": samples / float(np.median(lb)), "ratio": float(np.median(ratio)),
        "ratio_range": [float(ratio.min()), float(ratio.max())], "oracle_split": oracle,
        "oracle_samples_per_s": samples / float(np.median(fixed)) if fixed.size else None,
        "lbbsp_vs_oracle": float(np.median(versus)) if versus is not None else None,
        "lbbsp_vs_oracle_range": [float(versus.min()), float(versus.max())] if versus is not None else None,
        "param_rel_diff": max(diffs),
    }


def _span(pair: list[float] | None) -> str:
    """A ratio range as printed: "0.87-0.98", or "-" where the case has none."""
    return f"{pair[0]:.2f}-{pair[1]:.2f}" if pair else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=512, help="MLP width (compute per sample) (default: %(default)s)")
    parser.add_argument("--global-batch", type=int, default=1024,
                        help=f"at most {DIGITS} (the digits data) (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating runs of each mode per case (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help=out_help(OUT))
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 1 or args.hidden < 1:
        parser.error("--repeats, --steps and --hidden must be at least 1")
    if not WORLD <= args.global_batch <= DIGITS:
        parser.error(f"--global-batch must lie in [{WORLD}, {DIGITS}]: a sample per worker, and a whole batch of "
                     "the digits data")
    with writing_results(parser, args.out) as args.out:
        benchmark(args)
    return 0


def benchmark(args: argparse.Namespace) -> None:
    """The four cases, each mode in turn, on the ranks; then the table, and the JSON file."""
    print(f"bench_torch: {WORLD} gloo workers on cores {cores_for(WORLD)}, load on worker {SLOW}'s core; "
          f"{args.steps} steps x global batch {args.global_batch}, MLP width {args.hidden} (float64); "
          f"{args.repeats} alternating runs of each mode per case", flush=True)
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory(prefix="lbbsp-bench-") as tmp:
        cases = os.path.join(tmp, "cases.json")
        spawn_ranks(_worker, (args, os.path.join(tmp, "rdv"), server.url, cases), WORLD)
        results = json.loads(Path(cases).read_text())
    args.out.write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "cases": results,
                                    "run": run_record()}))
    print(f"\n{'case':<6}{'DDP /s':>10}{'lbbsp /s':>10}{'lbbsp/DDP':>11}{'(range)':>13}{'oracle /s':>11}"
          f"{'lbbsp/oracle':>14}{'(range)':>13}{'oracle split':>14}{'param diff':>12}")
    for r in results:
        oracle = f"{r['oracle_samples_per_s']:.0f}" if r["oracle_samples_per_s"] else "-"
        versus = f"{r['lbbsp_vs_oracle']:.2f}" if r["lbbsp_vs_oracle"] else "-"
        split = "/".join(map(str, r["oracle_split"])) if r["oracle_split"] else "-"
        print(f"{r['case']:<6}{r['ddp_samples_per_s']:>10.0f}{r['lbbsp_samples_per_s']:>10.0f}{r['ratio']:>11.2f}"
              f"{_span(r['ratio_range']):>13}{oracle:>11}{versus:>14}{_span(r['lbbsp_vs_oracle_range']):>13}{split:>14}"
              f"{r['param_rel_diff']:>12.1e}")
    print("samples/s: medians over the repeats; ratios: the median (and range) of each repeat's runs, made one "
          "after the other")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
