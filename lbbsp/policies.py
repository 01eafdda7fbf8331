"""Balancing policies: each turns the reports of iteration k into the batch-size vector of iteration k+1.

The coordinator drives a policy through two small steps, ``observe`` and ``decide``; a variant overrides
one of them. Allocation maths live in :mod:`lbbsp.allocation`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .allocation import allocate, damp, predicted_makespan
from .config import JobConfig
from .models import CapacityModel, EWMAThroughput
from .protocol import Report, equal_split


@dataclass(frozen=True)
class Decision:
    """A split with the reason for it and, when a model made it, each worker's predicted seconds."""

    sizes: tuple[int, ...]
    reason: str
    predicted_s: tuple[float, ...] | None = None
    predicted_throughput: tuple[float, ...] | None = None


class Policy:
    """Base policy: learns nothing and keeps the current split."""

    name = "static"

    def observe(self, reports: Sequence[Report]) -> None:
        """Learn from one iteration's validated reports (some workers may be missing)."""

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return Decision(tuple(int(s) for s in current), "static split")


class BSPPolicy(Policy):
    """Plain bulk synchronous parallel: the equal split, always."""

    name = "bsp"

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return Decision(equal_split(config.global_batch, config.num_workers), "equal split (BSP)")


class LBBSPPolicy(Policy):
    """LB-BSP: predict each worker's speed, allocate for equal predicted finish, damp small changes."""

    name = "lbbsp"

    def __init__(self, model: CapacityModel | None = None, *, deadband: float = 0.03) -> None:
        self.model = model if model is not None else EWMAThroughput()
        self.deadband = deadband
        self._seen = False

    def observe(self, reports: Sequence[Report]) -> None:
        if reports:
            self.model.partial_fit(reports)
            self._seen = True

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        if not self._seen:
            return Decision(tuple(int(s) for s in current), "no measurements yet: keep the split")
        workers = range(config.num_workers)
        time_model = self.model.time_model(workers)
        lower, upper = config.bounds()
        proposed = allocate(time_model, config.global_batch, lower, upper)
        current_arr = np.asarray(current, dtype=np.int64)
        in_bounds = current_arr.shape == proposed.shape and bool(
            ((current_arr >= lower) & (current_arr <= upper)).all())
        sizes, changed = damp(current_arr, proposed, time_model, self.deadband) if in_bounds else (proposed, True)
        predicted = time_model.time(sizes)
        throughput = self.model.predict(workers)
        slowest = int(np.argmin(np.where(np.isfinite(throughput), throughput, np.inf)))
        if changed:
            reason = (f"rebalanced for equal predicted finish {predicted_makespan(time_model, sizes):.4g}s "
                      f"(was {predicted_makespan(time_model, current_arr):.4g}s); slowest worker {slowest} "
                      f"at {throughput[slowest]:.4g} samples/s")
        else:
            reason = (f"kept: predicted gain under the {self.deadband:.0%} dead band "
                      f"(finish {predicted_makespan(time_model, sizes):.4g}s)")
        return Decision(tuple(int(s) for s in sizes), reason, tuple(float(t) for t in predicted),
                        tuple(float(t) for t in throughput))
