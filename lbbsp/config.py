"""The settings one job shares between its coordinator and its workers."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .errors import ConfigError
from .protocol import MAX_BATCH, MAX_WORKERS, Assignment, equal_split

_JOB_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass(frozen=True)
class JobConfig:
    """Shape of one synchronous job: who takes part, how big the global batch is, and the wait bounds.

    ``max_batch`` caps every worker (an int) or each worker (a sequence), for example from GPU memory.
    ``assignment_timeout_s`` bounds how long a worker waits for the coordinator's vector before it
    falls back to the previous one (agreed through Redis with a write-once key).
    ``lag`` is how many iterations a decision runs ahead: the vector of iteration k is decided from the
    reports of iteration k - lag. With the default 2 the decision overlaps iteration k-1, so the
    coordinator is off the critical path; 1 reacts an iteration sooner but every step waits for it.
    """

    job: str
    num_workers: int
    global_batch: int
    min_batch: int = 1
    max_batch: int | tuple[int, ...] | None = None
    assignment_timeout_s: float = 10.0
    ttl_s: int = 3600
    lag: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.job, str) or not _JOB_NAME.match(self.job):
            raise ConfigError(f"job name must match {_JOB_NAME.pattern}, got {self.job!r}")
        if not isinstance(self.num_workers, int) or not 1 <= self.num_workers <= MAX_WORKERS:
            raise ConfigError(f"num_workers must be an integer in [1, {MAX_WORKERS}], got {self.num_workers!r}",
                              job=self.job)
        if not isinstance(self.global_batch, int) or not 1 <= self.global_batch <= MAX_BATCH:
            raise ConfigError(f"global_batch must be an integer in [1, {MAX_BATCH}], got {self.global_batch!r}",
                              job=self.job)
        if not isinstance(self.min_batch, int) or self.min_batch < 0:
            raise ConfigError(f"min_batch must be a non-negative integer, got {self.min_batch!r}", job=self.job)
        if isinstance(self.max_batch, Sequence):
            object.__setattr__(self, "max_batch", tuple(int(m) for m in self.max_batch))
            if len(self.max_batch) != self.num_workers:
                raise ConfigError(f"max_batch has {len(self.max_batch)} entries for {self.num_workers} workers",
                                  job=self.job)
        lower, upper = self.bounds()
        if any(lo > hi for lo, hi in zip(lower, upper)):
            raise ConfigError("max_batch is below min_batch for some worker", job=self.job)
        if sum(lower) > self.global_batch:
            raise ConfigError(f"min_batch {self.min_batch} x {self.num_workers} workers exceeds the global batch "
                              f"{self.global_batch}", job=self.job)
        if sum(upper) < self.global_batch:
            raise ConfigError(f"the max_batch caps add up to {sum(upper)}, less than the global batch "
                              f"{self.global_batch}", job=self.job)
        if not self.assignment_timeout_s > 0:
            raise ConfigError(f"assignment_timeout_s must be positive, got {self.assignment_timeout_s}",
                              job=self.job)
        if not isinstance(self.lag, int) or not 1 <= self.lag <= 8:
            raise ConfigError(f"lag must be an integer in [1, 8], got {self.lag!r}", job=self.job)
        if not isinstance(self.ttl_s, int) or self.ttl_s < 10:
            raise ConfigError(f"ttl_s must be an integer of at least 10 seconds, got {self.ttl_s!r}", job=self.job)

    def bounds(self) -> tuple[list[int], list[int]]:
        """Per-worker [lower, upper] batch bounds."""
        lower = [self.min_batch] * self.num_workers
        if self.max_batch is None:
            upper = [self.global_batch] * self.num_workers
        elif isinstance(self.max_batch, int):
            upper = [self.max_batch] * self.num_workers
        else:
            upper = list(self.max_batch)
        return lower, upper

    def initial_sizes(self) -> tuple[int, ...]:
        """The vector of the first ``lag`` iterations, before any decision: the equal (BSP) split."""
        return equal_split(self.global_batch, self.num_workers)

    def initial_assignment(self, iteration: int) -> Assignment:
        """The assignment of ``iteration`` when no decision covers it: the initial split."""
        return Assignment(self.job, iteration, self.initial_sizes(), "initial", "initial split")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: str | bytes) -> JobConfig:
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"stored job configuration is not valid JSON: {exc}") from None
        if not isinstance(obj, dict) or set(obj) - set(cls.__dataclass_fields__):
            raise ConfigError("stored job configuration has unexpected fields")
        if isinstance(obj.get("max_batch"), list):
            obj["max_batch"] = tuple(obj["max_batch"])
        return cls(**obj)
