"""Record a real CPU training trace under real co-located load, for the cpu-contention scenario and bench_models.

A small model trains on one core: an MLP in numpy or a CNN in torch. Beside it, "co-located jobs" (busy-loop processes pinned to
the same core with ``os.sched_setaffinity``) are switched on and off at random times, independently of the
iterations, with exponentially distributed dwell times: level 0, 1 or 2 busy processes. After each
iteration the recorder writes the measured throughput and the worker's :class:`lbbsp.ResourceMonitor`
features, as a worker reports them except sampled fresh every iteration (a worker reuses a sample for 0.2 s) and
without this process's children (the busy loops, which stand for other jobs), plus the true contention level (for
analysis only).

    python experiments/record_cpu_trace.py --backend numpy --seconds 180 --out my_traces/cpu_numpy.json
    lbbsp simulate --scenario cpu-contention --traces my_traces

Record into a folder of your own: experiments/traces holds the shipped traces, which bench_models.py and
``lbbsp simulate`` read by default (every *.json there). They were recorded with ``--backend numpy --batch
2048 --seed 1 --core 0`` (cpu_numpy_mlp, 2026-11-28) and ``--backend torch --batch 256 --seed 2 --core 1``
(cpu_torch_cnn, 2026-11-22). experiments/traces_heldout holds two recorded as those were, with seeds 3 and 4,
that no model was tuned on (docs/models.md).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core for the training step, before numpy/torch load
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import ctypes
import json
import multiprocessing as mp
import platform
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import numpy as np

from lbbsp import ResourceMonitor
from lbbsp.sim.cli import MAX_SEED
from lbbsp.sim.traces import MIN_LEVEL_ROWS, CPUTrace, rows_said, thin_level_why

_PR_SET_PDEATHSIG = 1  # prctl's option: the signal a process gets when its parent ends
FEATURES = ("cpu_util", "proc_cpu", "colocated_load", "mem_util", "cores")
COLUMNS = ("iteration", "t_s", "samples", "compute_s", "throughput", *FEATURES, "hog_level")
#: Samples per iteration by backend, as the shipped traces were recorded: the numpy MLP's step at 256 takes about
#: 8 ms, where a scheduler slice is a large share of an iteration (docs/simulator.md).
DEFAULT_BATCH = {"numpy": 2048, "torch": 256}
#: Most samples per iteration: a step then takes about 0.6 s and 0.4 GiB with numpy, 3 s and 2.5 GiB with torch (a
#: batch of 10**11 had failed with numpy's traceback for 570 TiB).
MAX_BATCH = 16_384
#: Most co-located busy loops per core of the machine (--max-level 100000 had forked for 11 minutes).
LOOPS_PER_CORE = 4
READY_TIMEOUT_S = 30.0  # for a busy loop to tie its end to the recorder's
FORK = mp.get_context("fork")  # busy_loop ties itself to its parent: this process, not a forkserver


def busy_loop(core: int, parent: int, ready: Connection | None = None) -> None:
    """A co-located CPU-bound job on ``core`` (this recorder's, and bench_keras's); Ctrl-C is its parent's to handle
    (it stops these itself), and it ends with its parent however that ends: a plain `kill` had left it spinning.
    It sends a byte on ``ready`` once it will end with its parent: a loop the parent stopped (SIGSTOP) before then,
    and never continued, had outlived a `kill -9` of the parent, stopped, holding its stdout open."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler, which a fork copies
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # Linux, as sched_setaffinity
    if os.getppid() != parent:  # it ended before the line above
        return
    if ready is not None:
        ready.send_bytes(b"1")
        ready.close()
    os.sched_setaffinity(0, {core})
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def numpy_step(batch: int, rng: np.random.Generator) -> Callable[[], None]:
    """One SGD step of a 784-256-10 MLP with softmax loss in numpy. The weights are updated in place, as frameworks
    do: new weight arrays at every step (until 2026-11-27) made glibc's allocator alternate between two layouts,
    and with them the step's speed, by up to 18% between even and odd iterations, in some runs and not others."""
    w1, w2 = rng.normal(0, 0.05, (784, 256)), rng.normal(0, 0.05, (256, 10))
    x, y = rng.normal(size=(batch, 784)), rng.integers(0, 10, batch)

    def step() -> None:
        h = np.maximum(x @ w1, 0)
        logits = h @ w2
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(batch), y] -= 1
        g2 = h.T @ p / batch
        gh = (p @ w2.T) * (h > 0)
        np.subtract(w1, 0.01 * (x.T @ gh / batch), out=w1)
        np.subtract(w2, 0.01 * g2, out=w2)

    return step


def torch_step(batch: int, rng: np.random.Generator) -> Callable[[], None]:
    """One SGD step of a small CNN on 28x28 inputs in torch (one thread)."""
    import torch  # noqa: PLC0415  (optional backend)

    torch.set_num_threads(1)
    torch.manual_seed(int(rng.integers(1 << 31)))
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Flatten(), torch.nn.Linear(8 * 13 * 13, 10))
    optimiser = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))

    def step() -> None:
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimiser.step()

    return step


class ContentionSchedule:
    """Switches ``max_level`` pinned busy-loop processes between levels at exponential random times."""

    def __init__(self, core: int, max_level: int, mean_dwell_s: float, seed: int) -> None:
        self.level = 0
        self._rng = np.random.default_rng(seed)
        self._mean_dwell_s = mean_dwell_s
        self._procs: list[BaseProcess] = []
        self._pids: list[int] = []
        try:
            for _ in range(max_level):
                self._pids.append(self._start_stopped(core))
        except BaseException:  # Ctrl-C, SIGTERM or a loop that did not start: none is left behind
            self._kill()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _start_stopped(self, core: int) -> int:
        """Start one busy loop and stop it (SIGSTOP) once it is tied to this process's end; its pid."""
        ready, tell = FORK.Pipe(duplex=False)
        proc = FORK.Process(target=busy_loop, args=(core, os.getpid(), tell), daemon=True)
        self._procs.append(proc)
        proc.start()
        tell.close()  # the loop's copy is the only one left: an end before it is ready reads as an end of file
        with ready:
            try:
                said = ready.poll(READY_TIMEOUT_S) and ready.recv_bytes()
            except EOFError:  # it ended before it was ready
                said = b""
        if not said:
            raise RuntimeError(f"a co-located busy loop ended, or was not ready within {READY_TIMEOUT_S:g}s")
        assert proc.pid is not None  # start() set it
        os.kill(proc.pid, signal.SIGSTOP)
        return proc.pid

    def start(self) -> ContentionSchedule:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(float(self._rng.exponential(self._mean_dwell_s))):
            self._set(int(self._rng.integers(0, len(self._procs) + 1)))

    def _set(self, level: int) -> None:
        for i, pid in enumerate(self._pids):
            os.kill(pid, signal.SIGCONT if i < level else signal.SIGSTOP)
        self.level = level

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._kill()

    def _kill(self) -> None:
        """End every busy loop started. SIGKILL, not SIGTERM: a loop stopped before it set SIGTERM's default had
        caught the SIGTERM with the handler a fork copies, then set the default before Python ran that handler: the
        signal was lost and join() waited for good (2 of 8 Ctrl-Cs on a loaded machine). SIGKILL ends a stopped
        process too."""
        for proc in self._procs:
            if proc.pid is not None:
                proc.kill()
                proc.join()


def record(step: Callable[[], None], batch: int, seconds: float, schedule: ContentionSchedule,
           progress_every_s: float = 15.0) -> list[list[float]]:
    """Run ``step`` until ``seconds`` have passed, or Ctrl-C (the rows so far are kept); one row per iteration
    (see COLUMNS)."""
    # a fresh sample every iteration: the trace is the data. The busy loops are this process's children but stand
    # for other jobs: their CPU is co-located load, as a worker beside such jobs would report it
    monitor = ResourceMonitor(min_interval_s=0.0, children=False)
    rows: list[list[float]] = []
    started = last_progress = time.perf_counter()
    try:
        while (now := time.perf_counter()) - started < seconds:
            t0 = time.perf_counter()
            step()
            compute_s = time.perf_counter() - t0
            level = schedule.level
            features = monitor.sample()
            rows.append([len(rows), round(t0 - started, 4), batch, round(compute_s, 6), round(batch / compute_s, 2),
                         *(round(features[name], 4) for name in FEATURES), level])
            if now - last_progress > progress_every_s:
                last_progress = now
                recent = np.mean([r[4] for r in rows[-50:]])
                print(f"  {now - started:5.0f}s  {len(rows)} iterations, recent throughput {recent:.0f}/s", flush=True)
    except KeyboardInterrupt:  # the iteration cut short is not a row; the ones before it are kept
        print(f"stopped after {time.perf_counter() - started:.0f}s: keeping the {len(rows)} iterations recorded",
              flush=True)
    return rows


def _stop_recording(signum: int, frame: object) -> None:
    """SIGTERM ends the recording as Ctrl-C does: the rows so far are written, the co-located jobs stopped."""
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("numpy", "torch"), default="numpy",
                        help="the training step: a numpy MLP or a torch CNN (default: numpy)")
    parser.add_argument("--batch", type=int, default=None,
                        help=f"samples per iteration, at most {MAX_BATCH:,} (default: {DEFAULT_BATCH['numpy']} for "
                             f"numpy, {DEFAULT_BATCH['torch']} for torch, as the shipped traces were recorded)")
    parser.add_argument("--seconds", type=float, default=180.0, help="how long to record (default: 180)")
    parser.add_argument("--core", type=int, default=0,
                        help="the core the worker and its co-located jobs share (default: 0)")
    most_loops = LOOPS_PER_CORE * (os.cpu_count() or 1)
    parser.add_argument("--max-level", type=int, default=2,
                        help=f"most co-located busy loops at once, at most {most_loops} ({LOOPS_PER_CORE} per core of "
                             "this machine) (default: 2)")
    parser.add_argument("--mean-dwell-s", type=float, default=3.0,
                        help="mean seconds between load switches (default: 3)")
    parser.add_argument("--seed", type=int, default=0,
                        help=f"seeds the model, its data and the load switches, 0 to {MAX_SEED} (default: 0)")
    parser.add_argument("--out", required=True,
                        help="trace file to write, NAME.json (lbbsp simulate --traces DIR reads every *.json in DIR)")
    args = parser.parse_args()
    if args.batch is None:
        args.batch = DEFAULT_BATCH[args.backend]
    # checked before recording: each of these failed only after it (or stopped the load switches unseen)
    for wrong, message in ((args.batch < 1, f"--batch must be at least 1, got {args.batch}"),
                           (args.batch > MAX_BATCH, f"--batch must be at most {MAX_BATCH:,}, got {args.batch}"),
                           (args.max_level < 0, f"--max-level must be at least 0, got {args.max_level}"),
                           (args.max_level > most_loops, f"--max-level must be at most {most_loops} ({LOOPS_PER_CORE} "
                                                        f"busy loops per core of this machine), got {args.max_level}"),
                           (not 0 <= args.seed <= MAX_SEED, f"--seed must be in [0, {MAX_SEED}], got {args.seed}"),
                           (not 0 < args.mean_dwell_s < 1e6,  # inf stopped the switches
                            f"--mean-dwell-s must be positive and below a million seconds, got {args.mean_dwell_s:g}"),
                           (not 0 < args.seconds < 1e6, f"--seconds must be positive and below a million, got "
                                                        f"{args.seconds:g}"),
                           (Path(args.out).suffix != ".json",  # a trace named otherwise is not read as one
                            f"--out must end in .json (lbbsp simulate --traces DIR and bench_models.py read every "
                            f"*.json in DIR), got {args.out}")):
        if wrong:
            parser.error(message)
    if args.core not in os.sched_getaffinity(0):
        parser.error(f"--core {args.core} is not one this process may run on: {sorted(os.sched_getaffinity(0))}")
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"cannot create the folder of --out: {exc}")
    existed = out.exists()
    try:  # opened now, not after the recording (os.access says yes to root, whatever the file system)
        out.open("a").close()
    except OSError as exc:
        parser.error(f"--out {out} is not a file this process can write: {exc}")
    if not existed:
        out.unlink()

    os.sched_setaffinity(0, {args.core})
    rng = np.random.default_rng(args.seed)
    step = (numpy_step if args.backend == "numpy" else torch_step)(args.batch, rng)
    step()  # warm up caches and allocators outside the trace
    signal.signal(signal.SIGTERM, _stop_recording)  # a plain `kill` keeps the rows recorded, as Ctrl-C does
    schedule = ContentionSchedule(args.core, args.max_level, args.mean_dwell_s, args.seed).start()
    print(f"recording {args.backend} on core {args.core} for {args.seconds:g}s", flush=True)
    try:
        rows = record(step, args.batch, args.seconds, schedule)
    finally:
        schedule.close()
    if not rows:
        parser.error(f"no iteration finished within --seconds {args.seconds:g}")
    meta = {"backend": args.backend, "batch": args.batch, "core": args.core, "max_level": args.max_level,
            "mean_dwell_s": args.mean_dwell_s, "seed": args.seed, "machine": platform.machine(),
            "processor": platform.processor(), "cpu_count": os.cpu_count(), "recorded": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(out, "w") as f:
        json.dump({"meta": meta, "columns": list(COLUMNS), "rows": rows}, f, separators=(",", ":"))
    throughput = np.array([r[COLUMNS.index("throughput")] for r in rows])
    at_level = [sum(r[COLUMNS.index("hog_level")] == level for r in rows) for level in range(args.max_level + 1)]
    print(f"wrote {args.out}: {len(rows)} iterations ("
          + ", ".join(f"level {level}: {count} rows" for level, count in enumerate(at_level))
          + f"), throughput p10/p50/p90 {np.percentile(throughput, 10):.0f}/{np.median(throughput):.0f}/"
            f"{np.percentile(throughput, 90):.0f} samples/s")
    # the rows a replay uses, as lbbsp simulate and bench_models count them when they load it and warn (0 included)
    for level, (used, left_out) in CPUTrace.load(out).level_rows().items():
        if used < MIN_LEVEL_ROWS:
            print(f"  level {level} has {rows_said(used, left_out)}, {thin_level_why(used)}; record longer (--seconds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
