"""Worker and coordinator processes for the coordination tests: compute is emulated as size / speed."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence

from lbbsp import Assignment, BSPPolicy, Coordinator, JobConfig, LBBSPPolicy, Store, WorkerClient
from lbbsp.policies import Decision


def rank0_agree() -> Callable[[int], Callable[[Assignment], Assignment]]:
    """Each worker's ``agree``, as a broadcast of rank 0's vector makes it, for workers in one process (worker 0 asks
    first at each iteration)."""
    rank0: dict[int, Assignment] = {}

    def for_worker(worker: int) -> Callable[[Assignment], Assignment]:
        def agree(assignment: Assignment) -> Assignment:
            if worker == 0:
                rank0[assignment.iteration] = assignment
            return rank0[assignment.iteration]
        return agree
    return for_worker


@contextlib.contextmanager
def worker_clients(url: str, config: JobConfig) -> Iterator[list[WorkerClient]]:
    """One client per worker of the job, each with its own connection; all closed on the way out."""
    clients = [WorkerClient(Store.from_url(url, config.job), config, i) for i in range(config.num_workers)]
    try:
        yield clients
    finally:
        for client in clients:
            client.close()
            client.store.close()


def run_worker(url: str, config_json: str, worker: int, speeds: Sequence[float], iterations: int,
               out_path: str) -> None:
    """Fetch, 'compute' for size/speed seconds (speed may change per iteration), report; log each vector."""
    config = JobConfig.from_json(config_json)
    store = Store.from_url(url, config.job)
    client = WorkerClient(store, config, worker)
    with open(out_path, "w") as out:
        for k in range(iterations):
            started = time.monotonic()
            assignment = client.assignment(k)
            waited = time.monotonic() - started
            out.write(json.dumps({"k": k, "sizes": assignment.sizes, "fallback": assignment.fallback,
                                  "policy": assignment.policy, "waited": waited}) + "\n")
            out.flush()
            size = assignment.sizes[worker]
            compute_s = size / speeds[k % len(speeds)]
            time.sleep(compute_s)
            client.report(k, size, compute_s)
    client.close()
    store.close()


class DelayedPolicy(LBBSPPolicy):
    """LB-BSP that sometimes takes longer than the workers' timeout to decide (injected delay)."""

    def __init__(self, delay_s: float, probability: float, seed: int) -> None:
        super().__init__()
        self.delay_s, self.probability, self.rng = delay_s, probability, random.Random(seed)

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        if self.rng.random() < self.probability:
            time.sleep(self.delay_s)
        return super().decide(iteration, current, config)


class HeapProbePolicy(BSPPolicy):
    """BSP whose every reason says how many objects the garbage collector of its process has frozen."""

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return dataclasses.replace(super().decide(iteration, current, config), reason=f"frozen {gc.get_freeze_count()}")


def run_coordinator(url: str, config_json: str, delay_s: float, probability: float, seed: int) -> None:
    config = JobConfig.from_json(config_json)
    store = Store.from_url(url, config.job)
    Coordinator(store, config, DelayedPolicy(delay_s, probability, seed)).run()
