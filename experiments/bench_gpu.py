"""The GPU batch-time curve and memory cap, measured on a real GPU (prints figures; needs CUDA and NVML).

    python experiments/bench_gpu.py [--sizes 1,2,4,...] [--repeats 10] [--free-gib 4] [--expandable-segments]
                                    [--out F]

(1) The curve. A small CNN on synthetic 3x32x32 images; each batch size's training step (forward, backward,
SGD step) is timed with CUDA events, the median of ``--repeats`` after warm-up. ``BatchTimeCurve`` learns from
every other size, fed as one worker's reports in a seeded order, and predicts the sizes it never saw. Beside it,
what a throughput model (EWMA, LastValue) assumes: time proportional to the batch, at the throughput measured at
the median of the sizes learnt from.
(2) The memory cap. A ballast tensor leaves ``--free-gib`` of the card free. A worker that starts at 32 samples
is grown at each step to the smaller of twice its size and the model's cap, as the allocator grows the fastest
worker, with the card's memory as NVML reads it (PyTorch's cache included), which is what the PyTorch
integration reports; the largest size that fits is then found by bisection. PyTorch's allocator runs with
fixed segments unless ``--expandable-segments``. Figures go to stdout and to --out (default
experiments/results/bench_gpu.json, the file the docs quote).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _args import empty_folders_removed_on_failure, out_help, results_file, run_record
from torch import nn

from lbbsp import Report
from lbbsp.integrations.torch import expandable_segments
from lbbsp.models import BatchTimeCurve
from lbbsp.telemetry import ResourceMonitor

DEFAULT_SIZES = "1,2,4,8,12,16,24,32,48,64,96,128,192,256,384,512,768,1024,1536,2048"
GIB = 2.0**30
OUT = Path(__file__).resolve().parent / "results" / "bench_gpu.json"


def cnn() -> nn.Module:
    """About 0.4 GFLOP per sample forward, a few MB of activations per sample: compute-bound from a few dozen."""
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
    return nn.Sequential(*block(3, 64), *block(64, 128), nn.MaxPool2d(2), *block(128, 256), nn.MaxPool2d(2),
                         *block(256, 256), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))


class Trainer:
    """One model, its optimizer and a pool of synthetic data on the GPU; :meth:`step` trains on ``n`` samples."""

    def __init__(self, device: torch.device, pool: int) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = cnn().to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.x = torch.randn(pool, 3, 32, 32, device=device)
        self.y = torch.randint(0, 10, (pool,), device=device)

    def step(self, n: int) -> float:
        """One training step on ``n`` samples; its GPU time in seconds (CUDA events)."""
        x = self.x[:n] if n <= len(self.x) else self.x.repeat((n + len(self.x) - 1) // len(self.x), 1, 1, 1)[:n]
        y = self.y[:n] if n <= len(self.y) else self.y.repeat((n + len(self.y) - 1) // len(self.y))[:n]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.opt.zero_grad(set_to_none=True)
        F.cross_entropy(self.model(x), y).backward()
        self.opt.step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def fits(self, n: int) -> bool:
        try:
            self.step(n)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            torch.cuda.empty_cache()


def measure_curve(trainer: Trainer, sizes: list[int], repeats: int) -> dict[int, list[float]]:
    times = {}
    for n in sizes:
        for _ in range(3):
            trainer.step(n)
        times[n] = [trainer.step(n) for _ in range(repeats)]
        print(f"  b={n:5d}  {1e3 * np.median(times[n]):8.3f} ms  {1e6 * np.median(times[n]) / n:8.2f} us/sample",
              flush=True)
    return times


def curve_figures(times: dict[int, list[float]], device: str, seed: int = 0) -> dict[str, Any]:
    """Learn from every other size (one worker's reports, in a seeded order); predict every size."""
    sizes = sorted(times)
    learnt = sizes[1::2]
    reports = [(n, t) for n in learnt for t in times[n]]
    order = np.random.default_rng(seed).permutation(len(reports))
    model = BatchTimeCurve()
    for iteration, k in enumerate(order.tolist()):
        n, t = reports[k]
        model.partial_fit([Report("bench-gpu", 0, iteration, n, t, device=device)])
    median = {n: float(np.median(times[n])) for n in sizes}
    predicted = model.time_model([0]).time(np.array(sizes, dtype=float))
    ref = learnt[len(learnt) // 2]
    proportional = {n: median[ref] * n / ref for n in sizes}
    rows = [{"batch": n, "measured_s": median[n], "curve_s": float(p), "proportional_s": proportional[n],
             "learnt": n in learnt} for n, p in zip(sizes, predicted)]
    held_out = [r for r in rows if not r["learnt"] and learnt[0] < r["batch"] < learnt[-1]]

    def mape(key: str) -> float:
        return float(np.mean([abs(r[key] / r["measured_s"] - 1) for r in held_out]) * 100)

    return {"rows": rows, "knee": float(model.knee_[0]), "slots": sorted(float(s) for s in model.slot_size_[0]
                                                                      if s > 0),
            "held_out_mape_curve_pct": mape("curve_s"), "held_out_mape_proportional_pct": mape("proportional_s"),
            "proportional_reference_batch": ref}


def grow_to_cap(trainer: Trainer, device: str, steps: int) -> dict[str, Any]:
    """Grow one worker as the allocator grows the fastest: to min(2 x its size, the cap), with the card's memory
    as NVML reads it (what the PyTorch integration reports)."""
    monitor = ResourceMonitor(trainer.device.index, min_interval_s=0.0)
    model = BatchTimeCurve()
    size = 32
    path: list[dict[str, Any]] = []
    for iteration in range(steps):
        try:
            seconds = trainer.step(size)
        except torch.OutOfMemoryError:
            path.append({"batch": size, "oom": True})
            print(f"  step {iteration}: b={size} ran out of memory: the cap was too high", flush=True)
            torch.cuda.empty_cache()
            break
        features = {k: v for k, v in monitor.sample().items() if k.startswith("gpu_mem")}
        model.partial_fit([Report("bench-gpu", 0, iteration, size, seconds, features=features, device=device)])
        cap = int(model.max_batch([0])[0])
        path.append({"batch": size, "gpu_mem_used_gib": features.get("gpu_mem_used", float("nan")) / GIB,
                     "gpu_mem_free_gib": features.get("gpu_mem_free", float("nan")) / GIB, "cap": cap})
        print(f"  step {iteration:2d}: b={size:6d}  used {path[-1]['gpu_mem_used_gib']:7.3f} GiB, free "
              f"{path[-1]['gpu_mem_free_gib']:6.3f} GiB  -> cap {cap}", flush=True)
        size = max(1, min(2 * size, cap))
    caps = [p["cap"] for p in path if "cap" in p]
    return {"path": path, "final_cap": caps[-1] if caps else None, "oom": any(p.get("oom") for p in path)}


def largest_that_fits(trainer: Trainer, start: int) -> int:
    """The largest batch whose step fits, by doubling then bisection from ``start`` (which fits)."""
    low, high = start, start * 2
    while trainer.fits(high):
        low, high = high, high * 2
    while high - low > max(1, low // 200):
        mid = (low + high) // 2
        low, high = (mid, high) if trainer.fits(mid) else (low, mid)
    return low


class _Refused(Exception):
    """This machine cannot run the benchmark: main prints why and returns 1."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help="batch sizes of the curve, comma-separated (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed steps per size (after 3 warm-up steps) (default: %(default)s)")
    parser.add_argument("--free-gib", type=float, default=4.0,
                        help="GPU memory left free for the cap test (default: %(default)s)")
    parser.add_argument("--grow-steps", type=int, default=24, help="steps of the growing worker (default: %(default)s)")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="run PyTorch's CUDA allocator with expandable segments (what docs/torch.md advises)")
    parser.add_argument("--out", type=Path, default=OUT, help=out_help(OUT))
    args = parser.parse_args(argv)
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",")})
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if len(sizes) < 4 or sizes[0] < 1:
        parser.error("--sizes needs at least 4 sizes, each >= 1")
    if args.repeats < 1 or args.grow_steps < 1 or not 0.5 <= args.free_gib <= 1e4:
        parser.error("--repeats and --grow-steps must be >= 1, --free-gib in [0.5, 1e4]")
    try:  # a run refused here removes the --out folder results_file made for it (one without a GPU had left it)
        with empty_folders_removed_on_failure(args.out):
            args.out = results_file(parser, args.out)
            if args.expandable_segments:  # read when CUDA starts, which is below
                os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            if not torch.cuda.is_available():
                raise _Refused("bench_gpu needs a CUDA GPU; none is visible here")
            gpu = torch.device("cuda", torch.cuda.current_device())
            if "gpu_mem_used" not in ResourceMonitor(gpu.index, min_interval_s=0.0).sample():  # before the curve
                raise _Refused("bench_gpu needs NVML's readings of the card's memory for its cap test (pip install "
                               "'lbbsp[gpu]', or nvidia-ml-py); none came (the warning above says why)")
    except _Refused as exc:
        print(exc, file=sys.stderr)
        return 1
    device = f"cuda:{torch.cuda.get_device_name(gpu)}"[:64]
    print(f"{torch.cuda.get_device_name(gpu)}, torch {torch.__version__}, expandable segments "
          f"{expandable_segments()}, TF32 matmul "
          f"{torch.backends.cuda.matmul.allow_tf32}, cuDNN TF32 {torch.backends.cudnn.allow_tf32}", flush=True)
    print("(1) training step time per batch size (median of CUDA-event timings):", flush=True)
    curve = curve_figures(measure_curve(Trainer(gpu, max(sizes)), sizes, args.repeats), device)
    print(f"BatchTimeCurve learnt from {len(curve['rows']) // 2} sizes: knee {curve['knee']:.0f}, slots "
          f"{[round(s) for s in curve['slots']]}")
    print("  batch  measured ms  curve ms (err)        proportional ms (err)")
    for r in curve["rows"]:
        mark = "learnt" if r["learnt"] else ""
        print(f"  {r['batch']:5d}  {1e3 * r['measured_s']:10.3f}  {1e3 * r['curve_s']:8.3f} "
              f"({100 * (r['curve_s'] / r['measured_s'] - 1):+6.1f}%)  {1e3 * r['proportional_s']:10.3f} "
              f"({100 * (r['proportional_s'] / r['measured_s'] - 1):+8.1f}%)  {mark}")
    print(f"held-out sizes inside the learnt range: MAPE curve {curve['held_out_mape_curve_pct']:.1f}%, "
          f"proportional (at b={curve['proportional_reference_batch']}) "
          f"{curve['held_out_mape_proportional_pct']:.1f}%", flush=True)

    print(f"(2) memory cap with {args.free_gib:g} GiB of the card left free:", flush=True)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(gpu)
    ballast = torch.empty(max(int(free - args.free_gib * GIB), 0), dtype=torch.uint8, device=gpu)
    trainer = Trainer(gpu, 256)
    grown = grow_to_cap(trainer, device, args.grow_steps)
    limit = largest_that_fits(trainer, max(p["batch"] for p in grown["path"] if not p.get("oom")))
    cap = grown["final_cap"]
    print(f"cap after {len(grown['path'])} steps {cap}, largest batch that fits {limit} (cap / limit "
          f"{cap / limit:.3f}); ran out of memory while growing: {grown['oom']}")
    memory = {"free_gib": args.free_gib, **grown, "largest_that_fits": limit, "cap_over_limit": cap / limit}
    del ballast
    result = {"gpu": torch.cuda.get_device_name(gpu), "torch": torch.__version__, "python": platform.python_version(),
              "total_gib": total / GIB, "expandable_segments": expandable_segments(), "repeats": args.repeats, "curve": curve, "memory": memory}
    args.out.write_text(json.dumps({**result, "run": run_record()}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
