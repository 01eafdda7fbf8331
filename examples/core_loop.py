"""LB-BSP with lbbsp's core alone, no framework: two worker processes train a linear model by SGD.

Each iteration, every worker fetches the agreed batch-size vector, takes its slice of the global batch, computes
the sum of its samples' gradients (timed, without any waiting), reports, and sends the sum to this launcher,
which stands in for an all-reduce: it adds the workers' sums and divides by the global batch, that is
sum_i b_i g_i / B with g_i each worker's mean gradient. Worker 1 runs on a "slower machine" (it sleeps longer
per sample), so the coordinator moves samples to worker 0; the launcher then checks that the weights equal
single-process SGD on the same global batches.

    python examples/core_loop.py [--epochs 3] [--global-batch 128]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue

import numpy as np

from lbbsp import (
    CoordinatorProcess,
    EmbeddedRedis,
    GlobalBatchSampler,
    JobConfig,
    ResourceMonitor,
    Store,
    WorkerClient,
)
from lbbsp.store import worker_socket_timeout

#: Seconds of "compute" per sample on each worker's machine: worker 1 is three times slower.
SECONDS_PER_SAMPLE = (0.0002, 0.0006)


def make_data(n: int = 2048, d: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A noisy linear relation, the same in every process."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    return x, x @ rng.normal(size=d) + 0.1 * rng.normal(size=n)


def worker(rank: int, url: str, config: JobConfig, epochs: int, to_launcher: Queue, from_launcher: Queue) -> None:
    """One worker's loop: the one in docs/core.md, with a gradient sum exchanged through the launcher."""
    store = Store.from_url(url, config.job, socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
    client = WorkerClient(store, config, worker=rank)
    x, y = make_data()
    sampler = GlobalBatchSampler(len(x), config.global_batch, seed=0)
    monitor = ResourceMonitor()
    w = np.zeros(x.shape[1])
    k = 0  # the job's iteration, counted across epochs
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step in range(len(sampler)):
            sizes = client.assignment(k).sizes  # identical on every worker
            idx = sampler.worker_indices(step, sizes, rank)
            t0 = time.perf_counter()
            gradient_sum = x[idx].T @ (x[idx] @ w - y[idx])
            time.sleep(SECONDS_PER_SAMPLE[rank] * len(idx))  # the slower machine
            compute_s = time.perf_counter() - t0  # no waiting inside: the exchange below is not timed
            client.report(k, len(idx), compute_s, features=monitor.sample())  # returns at once
            to_launcher.put((rank, k, sizes, gradient_sum, len(idx)))
            w = receive(from_launcher)
            k += 1
    client.close()
    store.close()


def receive(from_launcher: Queue) -> np.ndarray:
    """The launcher's next weights; SystemExit once the launcher is gone. Killed (SIGKILL, or a SIGTERM or SIGHUP
    at its default), it had left both workers waiting here for ever."""
    while True:
        try:
            return from_launcher.get(timeout=1)
        except queue.Empty:
            launcher = mp.parent_process()
            if launcher is not None and not launcher.is_alive():
                raise SystemExit("the launcher is gone") from None


def reference(epochs: int, global_batch: int, lr: float) -> np.ndarray:
    """Single-process SGD on the same global batches (one worker taking the whole of each)."""
    x, y = make_data()
    sampler = GlobalBatchSampler(len(x), global_batch, seed=0)
    w = np.zeros(x.shape[1])
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step in range(len(sampler)):
            idx = sampler.worker_indices(step, (global_batch,), 0)  # the whole batch, short final one included
            w = w - lr * x[idx].T @ (x[idx] @ w - y[idx]) / len(idx)
    return w


def gather(parts: Queue, procs: Sequence[BaseProcess], k: int, timeout_s: float = 120) -> list[tuple]:
    """Every worker's part of iteration ``k``. A worker that died, or sent nothing for ``timeout_s``, ends the run,
    named, rather than leaving the launcher (and the other workers, which wait for it) waiting for ever."""
    received: list[tuple] = []
    deadline = time.monotonic() + timeout_s
    while len(received) < len(procs):
        try:
            received.append(parts.get(timeout=1))
        except queue.Empty:
            missing = sorted(set(range(len(procs))) - {part[0] for part in received})
            dead = [(rank, procs[rank].exitcode) for rank in missing if procs[rank].exitcode is not None]
            if dead:
                raise SystemExit(f"worker {dead[0][0]} exited (exit code {dead[0][1]}) before sending its part of "
                                 f"iteration {k} (any error it printed is above)") from None
            if time.monotonic() > deadline:
                raise SystemExit(f"no part of iteration {k} from worker {missing[0]} in {timeout_s:g}s") from None
    return received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    workers = 2
    if args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    if args.global_batch < workers:
        parser.error(f"--global-batch must be at least {workers}, a sample for each worker, got {args.global_batch}")
    config = JobConfig("core-loop", num_workers=workers, global_batch=args.global_batch)
    ctx = mp.get_context("spawn")
    with EmbeddedRedis() as server:  # a private redis-server, removed at the end
        coordinator = CoordinatorProcess(server.url, config)
        to_launcher = ctx.Queue()
        to_workers = [ctx.Queue() for _ in range(config.num_workers)]
        procs = [ctx.Process(target=worker, args=(r, server.url, config, args.epochs, to_launcher, to_workers[r]))
                 for r in range(config.num_workers)]
        for proc in procs:
            proc.start()
        w = np.zeros(make_data()[0].shape[1])
        iterations = args.epochs * -(-len(make_data()[1]) // args.global_batch)
        started = time.perf_counter()
        try:
            for k in range(iterations):  # the stand-in for the all-reduce
                parts = gather(to_launcher, procs, k)
                vectors = {tuple(sizes) for _, _, sizes, _, _ in parts}
                assert len(vectors) == 1 and {part[1] for part in parts} == {k}, f"iteration {k}: {parts}"
                total = sum(part[4] for part in parts)
                w = w - args.lr * sum(part[3] for part in parts) / total
                for to_worker in to_workers:
                    to_worker.put(w)
                if k % 8 == 0 or k == iterations - 1:
                    print(f"iteration {k:3d}: split {vectors.pop()}", flush=True)
        except BaseException:
            for proc in procs:  # a worker left waiting for the launcher would hold its exit, which joins them
                proc.kill()
            raise
        for proc in procs:
            proc.join(60)
        coordinator.stop()
    elapsed = time.perf_counter() - started
    gap = float(np.abs(w - reference(args.epochs, args.global_batch, args.lr)).max())
    print(f"{iterations} iterations in {elapsed:.1f}s; largest difference from single-process SGD: {gap:.2e}")
    if gap > 1e-9:
        raise SystemExit("the weights differ from single-process SGD")
    print("matches single-process SGD")


if __name__ == "__main__":
    main()
