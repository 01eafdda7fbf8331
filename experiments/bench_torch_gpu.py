"""What lbbsp's per-step work costs on a GPU with nothing to balance: plain DDP vs lbbsp (prints figures).

    python experiments/bench_torch_gpu.py [--sizes 64,256,1024] [--lags 2,4] [--steps 60] [--repeats 3] [--out F]

One rank under NCCL trains bench_gpu's small CNN on synthetic 3x32x32 images held on the host, loaded with
pinned memory and copied without blocking, as a GPU training loop does; nothing on the host waits for the GPU
inside the loop. Three loops of the same steps run in turn, ``--repeats`` times per batch size, so that a change
in the machine's speed falls on all of them alike:
  ddp        plain DDP over a DataLoader;
  ddp-synced the same, with the host waiting for the GPU before it loads each batch (what a per-step
             synchronisation costs: the GPU idles while the host loads the batch and queues the step);
  lbbsp      lb.attach(DDP(m)) over lb.loader, with the default policy and an embedded Redis, at each lag of
             ``--lags`` (``Balancer.from_env(lag=...)``; "lbbsp lag=2" is the default).
The ratios (samples/s over DDP's) are the medians of the runs' ratios. With one rank there is nothing to
balance, so lbbsp/DDP is its overhead alone. One more lbbsp run per size (at the first lag) times lbbsp's parts
of each step on the host, each wrapped in a timer: where that overhead goes. Without CUDA it stops, unless
--dry-run asks for a run on the CPU under gloo, to check the script: its figures say nothing of a GPU, and it
writes them only to an --out given. Figures go to stdout and to --out (default
experiments/results/bench_torch_gpu.json). The default run takes a few minutes on a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _args import out_help, results_file, run_record
from bench_gpu import cnn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import lbbsp.integrations.torch as lbbsp_torch
from lbbsp.integrations.torch import Balancer, BatchNormWarning
from lbbsp.integrations.torch_data import BalancedLoader
from lbbsp.store import Store
from lbbsp.telemetry import ResourceMonitor

BASELINES = ("ddp", "ddp-synced")
OUT = Path(__file__).resolve().parent / "results" / "bench_torch_gpu.json"
WARMUP = 10  # steps before the clock starts: cuDNN's autotuning, the allocator's first segments, lbbsp's first lag
#: lbbsp's work on the host in each step, by part (indented: within the part above), for the timed run. begin_step
#: includes the wait for the vector; the report of a GPU step is made in the next begin_step (on the CPU, from the
#: gradient hook), so the parts do not add up.
PARTS: dict[str, tuple[Any, str]] = {
    "begin_step": (Balancer, "begin_step"),
    "  Redis read of the vector": (Store, "get_assignment"),
    "  agreement broadcast": (lbbsp_torch, "agree_with_rank0"),
    "report": (Balancer, "_finish_step"),
    "  telemetry": (ResourceMonitor, "sample"),
    "loading the slice": (BalancedLoader, "_load"),
}


def run(loop: str, batch: int, steps: int, data: TensorDataset, device: torch.device,
        on_start: Callable[[], None] | None = None) -> float:
    """One run of ``loop`` ("ddp", "ddp-synced" or "lbbsp lag=L"): samples per second over ``steps`` steps after
    the warm-up (``on_start`` is called as the clock starts)."""
    torch.manual_seed(0)
    model = DDP(cnn().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    lb = None
    if loop.startswith("lbbsp"):
        lb = Balancer.from_env(batch, lag=int(loop.split("=")[1]))
        with warnings.catch_warnings():
            # The CNN's BatchNorm: with one rank its slice is the whole global batch, normalised as BSP does, and the
            # last BatchNorm sees 8x8 maps; a warning about slices of different sizes says nothing here
            warnings.filterwarnings("ignore", category=BatchNormWarning)
            lb.attach(model)
        batches: Iterable[Any] = lb.loader(data, seed=0, drop_last=True, pin_memory=device.type == "cuda")
    else:
        batches = DataLoader(data, batch_size=batch, shuffle=True, drop_last=True, pin_memory=device.type == "cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    started = 0.0
    epoch = iter(batches)
    for done in range(WARMUP + steps):
        if done == WARMUP:
            synchronize(device)
            if on_start is not None:
                on_start()
            started = time.perf_counter()
        if loop == "ddp-synced":
            synchronize(device)  # before the next batch is loaded: the host's work for it no longer overlaps the GPU's
        pair = next(epoch, None)
        if pair is None:
            epoch = iter(batches)
            pair = next(epoch)
        x, y = (t.to(device, non_blocking=True) for t in pair)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    synchronize(device)
    seconds = time.perf_counter() - started
    if lb is not None:
        lb.close()
    return steps * batch / seconds


def host_parts(lag: int, batch: int, steps: int, data: TensorDataset, device: torch.device) -> dict[str, float]:
    """One lbbsp run with each of :data:`PARTS` wrapped in a timer: ms per step of each, and of the whole step."""
    spent = dict.fromkeys(PARTS, 0.0)

    def timed(call: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - started
        return wrapper

    with contextlib.ExitStack() as stack:
        for label, (owner, name) in PARTS.items():
            stack.enter_context(mock.patch.object(owner, name, timed(getattr(owner, name), label)))
        samples_per_s = run(f"lbbsp lag={lag}", batch, steps, data, device,
                            on_start=lambda: spent.update(dict.fromkeys(spent, 0.0)))
    return {"step": 1e3 * batch / samples_per_s, **{label.strip(): 1e3 * t / steps for label, t in spent.items()}}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,256,1024",
                        help="global batch sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--lags", default="2,4",
                        help="lbbsp's lags, comma-separated, a run each (default: %(default)s; lbbsp's own is 2)")
    parser.add_argument("--steps", type=int, default=60,
                        help="timed steps per run (after 10 warm-up steps) (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each loop per size, in turn (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help=out_help(OUT))
    parser.add_argument("--dry-run", action="store_true",
                        help="without CUDA: run on the CPU under gloo to check the script (figures say nothing of a "
                             "GPU; written only to an --out given)")
    args = parser.parse_args(argv)
    try:
        sizes = list(dict.fromkeys(int(s) for s in args.sizes.split(",")))  # a size or lag given twice runs once
        lags = list(dict.fromkeys(int(s) for s in args.lags.split(",")))
    except ValueError:
        parser.error(f"--sizes and --lags must be comma-separated integers, got {args.sizes!r}, {args.lags!r}")
    if not sizes or min(sizes) < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--sizes, --steps and --repeats must be at least 1")
    if not lags or not all(1 <= lag <= 8 for lag in lags):
        parser.error("--lags must be in [1, 8]")
    loops = [*BASELINES, *(f"lbbsp lag={lag}" for lag in lags)]
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("bench_torch_gpu needs a CUDA GPU; none is visible here (--dry-run checks the script on the CPU)",
              file=sys.stderr)
        return 1
    out = results_file(parser, args.out) if cuda or args.out != OUT else None  # a dry run's figures are no GPU's
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rendezvous = tempfile.NamedTemporaryFile(prefix="bench-torch-gpu-", delete=False)
    rendezvous.close()
    try:
        rows, name = measure(sizes, lags, loops, args.steps, args.repeats, rendezvous.name, device)
    finally:
        Path(rendezvous.name).unlink(missing_ok=True)  # the FileStore may have removed it; Ctrl-C had left it
    result = {"device": name, "torch": torch.__version__, "python": platform.python_version(),
              "steps": args.steps, "repeats": args.repeats, "rows": rows}
    if out is None:
        print("dry run: not written (pass --out to keep its figures)")
        return 0
    out.write_text(json.dumps({**result, "run": run_record()}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def measure(sizes: list[int], lags: list[int], loops: list[str], steps: int, repeats: int, rendezvous: str,
            device: torch.device) -> tuple[list[dict[str, Any]], str]:
    """Every loop at every size, ``repeats`` times in turn, and lbbsp's host parts; the rows and the device's name."""
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(rendezvous, 1), rank=0,
                            world_size=1)
    name = torch.cuda.get_device_name(device) if cuda else f"CPU (dry run, {torch.get_num_threads()} threads)"
    print(f"{name}, torch {torch.__version__}, backend {dist.get_backend()}", flush=True)
    generator = torch.Generator().manual_seed(0)
    pool = max(sizes) * (WARMUP + steps) // 4 + max(sizes)  # a few epochs of the largest size
    data = TensorDataset(torch.randn(pool, 3, 32, 32, generator=generator),
                         torch.randint(0, 10, (pool,), generator=generator))
    rows = []
    for batch in sizes:
        speed: dict[str, list[float]] = {loop: [] for loop in loops}
        for _ in range(repeats):
            for loop in loops:
                speed[loop].append(run(loop, batch, steps, data, device))
        ddp = np.array(speed["ddp"])
        row: dict[str, Any] = {"batch": batch, "samples_per_s": {k: float(np.median(v)) for k, v in speed.items()},
                               "step_ms_ddp": 1e3 * batch / float(np.median(ddp))}
        for loop in loops[1:]:
            ratio = np.array(speed[loop]) / ddp
            row[f"{loop}/ddp"] = float(np.median(ratio))
            row[f"{loop}/ddp_range"] = [float(ratio.min()), float(ratio.max())]
        row["host_ms_per_step"] = parts = host_parts(lags[0], batch, steps, data, device)
        rows.append(row)
        print(f"  b={batch:5d}  DDP {row['step_ms_ddp']:7.2f} ms/step  "
              + "samples/s vs DDP: " + "  ".join(f"{loop} {row[f'{loop}/ddp']:.3f}x ({row[f'{loop}/ddp_range'][0]:.3f}-"
                          f"{row[f'{loop}/ddp_range'][1]:.3f})" for loop in loops[1:]), flush=True)
        print(f"           lbbsp lag={lags[0]} with timers: {parts['step']:.2f} ms/step; its host work per step (ms): "
              + ", ".join(f"{label.strip()} {parts[label.strip()]:.3f}" for label in PARTS), flush=True)
    gc.collect()  # the runs' DDP models sit in reference cycles: freed before the group (docs/torch.md)
    dist.destroy_process_group()
    return rows, name


if __name__ == "__main__":
    sys.exit(main())
