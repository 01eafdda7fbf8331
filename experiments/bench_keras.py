"""Plain BSP versus LB-BSP under MultiWorkerMirroredStrategy, with one worker slowed by real co-located load.
(The defaults take many minutes on 2 cores: each run starts TensorFlow twice; progress prints per run.)

    python experiments/bench_keras.py [--epochs 60] [--hidden 1024] [--global-batch 1024] [--load-procs 2]
                                      [--repeats 3] [--out F]

Two tf_keras workers train the digits MLP of examples/keras_digits.py, each pinned to one of the first two cores
this process may use, and busy-loop processes (``--load-procs``, pinned to worker 1's core) take most of its core.
Both modes run the same pipeline (data source, callback, coordinator); "plain" uses BSPPolicy, the equal split,
"lbbsp" uses LBBSPPolicy. The modes take turns, ``--repeats`` times, so that a change in the machine's speed
falls on both alike. Prints global throughput (samples/s) of each run, the median and range of the repeats'
ratios, and writes them with the arguments to --out (default experiments/results/bench_keras.json, the file
the docs quote).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _args import out_help, run_record, stop_process_trees, writing_results
from record_cpu_trace import busy_loop

from lbbsp.signals import ctrl_c_ignored

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "keras_digits.py"
OUT = ROOT / "experiments" / "results" / "bench_keras.json"
DIGITS = 1797  # samples in scikit-learn's digits, the example's data
MIN_BATCH = 8  # the example's least batch of a worker (its MIN_BATCH)


def free_ports(count: int) -> list[str]:
    ports = []
    for _ in range(count):
        with socket.socket() as s:
            s.bind(("localhost", 0))
            ports.append(str(s.getsockname()[1]))
    return ports


def run_mode(policy: str, args: argparse.Namespace, out: Path) -> dict:
    """Two workers under MWMS with the busy loop on worker 1's core; returns their figures."""
    ports = ",".join(free_ports(2))
    job = f"bench-{policy}-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    cores = sorted(os.sched_getaffinity(0))[:2]  # the first two this process may use: a cpuset may leave out 0 and 1
    loads = [multiprocessing.Process(target=busy_loop, args=(cores[1], os.getpid()), daemon=True)
             for _ in range(args.load_procs)]
    with ctrl_c_ignored():  # the busy loops and workers, and what they start, leave it to us
        for load in loads:
            load.start()
        procs = [subprocess.Popen([sys.executable, str(EXAMPLE), "--index", str(i), "--ports", ports, "--job", job,
                                   "--cpu", str(cores[i]), "--policy", policy, "--epochs", str(args.epochs),
                                   "--hidden", str(args.hidden), "--global-batch", str(args.global_batch),
                                   "--result", str(out / f"{policy}{i}.json")], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate()[0] for p in procs]
    except BaseException:  # Ctrl-C, say: this process stops the workers, and the processes they started
        stop_process_trees([p.pid for p in procs if p.poll() is None])
        for p in procs:
            p.wait()
        raise
    finally:
        for load in loads:
            load.kill()
            load.join()
    for proc, log in zip(procs, logs):
        if proc.returncode != 0:
            raise SystemExit(f"{policy} worker failed:\n{log[-3000:]}")
    results = [json.loads((out / f"{policy}{i}.json").read_text()) for i in range(2)]
    # fit is synchronous: both workers end together, and the one that started last (worker 0, which first
    # starts Redis and the coordinator) trained the whole time the other was not just waiting for it.
    joint = min(results, key=lambda r: r["seconds"])
    return {"seconds": joint["seconds"], "samples_per_s": joint["global_samples_per_s"],
            "final_split": results[0]["sizes"][-1], "steps": results[0]["steps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=60,
                        help="epochs of the digits data (1,797 samples / --global-batch steps each: 2 at the "
                             "default batch); the first ones include tracing (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024,
                        help="width of the MLP's two hidden layers (default: %(default)s)")
    parser.add_argument("--load-procs", type=int, default=2,
                        help="busy loops on worker 1's core (one alone is often outrun: worker 1 sleeps at each "
                             "all-reduce, and the scheduler favours a task that slept) (default: %(default)s)")
    parser.add_argument("--global-batch", type=int, default=1024,
                        help="samples a step over both workers, in [16, 1797] (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each mode (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help=out_help(OUT))
    args = parser.parse_args()
    if min(args.epochs, args.hidden, args.repeats) < 1 or args.load_procs < 0:
        parser.error("--epochs, --hidden and --repeats must be at least 1, --load-procs at least 0")
    if not 2 * MIN_BATCH <= args.global_batch <= DIGITS:
        parser.error(f"--global-batch must lie in [{2 * MIN_BATCH}, {DIGITS}]: the example's {MIN_BATCH} samples "
                     "or more per worker, and a whole batch of the digits data")
    if len(os.sched_getaffinity(0)) < 2:  # before results_file makes --out's folder: a refused run had left it
        raise SystemExit("bench_keras needs two CPU cores, one per worker; this process may use "
                         f"{len(os.sched_getaffinity(0))}")
    with writing_results(parser, args.out) as args.out:
        benchmark(args)


def benchmark(args: argparse.Namespace) -> None:
    """Each mode in turn, ``--repeats`` times, each run printed as it ends; then the ratio, and the JSON file."""
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            figures = {}
            for policy in ("bsp", "lbbsp"):
                print(f"[{time.strftime('%H:%M:%S')}] repeat {r + 1}/{args.repeats}, {policy}: 2 workers, "
                      f"{args.load_procs} busy loop(s) on worker 1's core ...", flush=True)
                figures[policy] = run_mode(policy, args, Path(tmp))
                f = figures[policy]
                print(f"  {policy:5s}: {f['samples_per_s']:8.1f} samples/s over {f['steps']} steps "
                      f"({f['seconds']:.1f}s), final split {f['final_split']}", flush=True)
            runs.append({**figures, "ratio": figures["lbbsp"]["samples_per_s"] / figures["bsp"]["samples_per_s"]})
    ratios = [run["ratio"] for run in runs]
    print(f"lbbsp / plain BSP throughput: {statistics.median(ratios):.2f}x (median of {len(ratios)} repeats; "
          f"each {', '.join(f'{x:.2f}' for x in ratios)})")
    args.out.write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "runs": runs,
                                    "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                                    "time": time.time(), "run": run_record()}, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
