"""The settings one job shares between its coordinator and its workers."""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields, replace
from numbers import Integral, Real
from typing import Any

import numpy as np

from .allocation import LinearTime, allocate
from .errors import ConfigError
from .protocol import MAX_BATCH, MAX_WORKERS, Assignment, _is_integer, equal_split

log = logging.getLogger(__name__)

_JOB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")
#: A worker that waits longer than this for a vector is stuck, and ``threading`` rejects infinite waits.
MAX_ASSIGNMENT_TIMEOUT_S = 86_400.0
MIN_ASSIGNMENT_TIMEOUT_S = 0.001  # below a millisecond no decision can come in time: every step would fall back
#: Keys that outlive their job by more than a year are a mistake (and Redis rejects huge expiry times).
MAX_TTL_S = 365 * 86_400


def _given(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _job_name(job: object) -> str:
    """``job`` if it is a valid job name (it becomes part of every Redis key), else a :class:`ConfigError`."""
    if not isinstance(job, str) or not _JOB_NAME.fullmatch(job):
        shown = f"{job[:140]!r}{'...' if len(job) > 140 else ''}" if isinstance(job, str) else f"{job!r:.140}"
        raise ConfigError(f"job name must match {_JOB_NAME.pattern}, got {shown}")
    return job


def _integer(value: object, name: str, lo: int, hi: int | None, job: str | None = None) -> int:
    """``value`` as a plain int in [lo, hi]; numpy integers pass, bools and floats do not."""
    if not _is_integer(value):
        raise ConfigError(f"{name} must be an integer, got {_given(value)}", job=job)
    number = int(value)
    if number < lo or (hi is not None and number > hi):
        raise ConfigError(f"{name} must be an integer in [{lo}, {hi if hi is not None else 'inf'}], "
                          f"got {value!r}", job=job)
    return number


def _float(value: Real, name: str, want: str, job: str | None = None) -> float:
    """``value`` as a float; for one beyond any float (an integer of 400 digits, which JSON may hold), a ConfigError
    saying what ``name`` must be, not an OverflowError (nor the 400 digits)."""
    try:
        return float(value)
    except OverflowError:
        raise ConfigError(f"{name} must be {want}, got a number beyond any float", job=job) from None


def _real(value: object, name: str, lo: float, hi: float, want: str, *, lo_open: bool = False,
          hi_open: bool = False) -> float:
    """``value`` as a float in [lo, hi], or (lo, hi] with ``lo_open`` and [lo, hi) with ``hi_open`` (``want``
    says which in the error); any real number passes (numpy's float32 too), bools do not, and NaN fails."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ConfigError(f"{name} must be {want}, got {_given(value)}")
    number = _float(value, name, want)
    if not (lo < number if lo_open else lo <= number) or not (number < hi if hi_open else number <= hi):
        raise ConfigError(f"{name} must be {want}, got {value!r}")
    return number


def _max_batch(value: object, num_workers: int, job: str) -> int | tuple[int, ...] | None:
    """None, one cap for every worker, or a tuple with one cap per worker (a sequence or a 1-D numpy array)."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        value = value.tolist()  # plain ints (or floats, rejected below); a 0-d array becomes a scalar
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, (Integral, Sequence)):
        raise ConfigError(f"max_batch must be None, an integer or a sequence of {num_workers} integers (one per "
                          f"worker), got {_given(value)}", job=job)
    if not isinstance(value, Sequence):
        return _integer(value, "max_batch", 0, MAX_BATCH, job)
    if len(value) != num_workers:
        raise ConfigError(f"max_batch has {len(value)} entries for {num_workers} workers", job=job)
    return tuple(_integer(cap, f"max_batch[{i}]", 0, MAX_BATCH, job) for i, cap in enumerate(value))


def _seconds(value: object, name: str, lo: float, hi: float, job: str) -> float:
    """``value`` as a float in [lo, hi]: a real, finite number of seconds (NaN and infinity fail the range)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ConfigError(f"{name} must be a number of seconds, got {_given(value)}", job=job)
    seconds = _float(value, name, f"a number of seconds in [{lo:g}, {hi:g}]", job)
    if not lo <= seconds <= hi:
        raise ConfigError(f"{name} must be a number of seconds in [{lo:g}, {hi:g}], got {value!r}", job=job)
    return seconds


@dataclass(frozen=True)
class JobConfig:
    """Shape of one synchronous job: who takes part, how big the global batch is, and the wait bounds.

    ``max_batch`` caps every worker (an int) or each worker (a sequence), for example from GPU memory.
    ``assignment_timeout_s`` bounds how long a worker waits for the coordinator's vector before it
    falls back to the previous one (agreed through Redis with a write-once key).
    ``lag`` is how many iterations a decision runs ahead: the vector of iteration k is decided from the
    reports of iteration k - lag. With the default 2 the decision overlaps iteration k-1, so the
    coordinator is off the critical path; 1 reacts an iteration sooner but every step waits for it.
    ``ttl_s`` is how long the job's keys outlive their last use; an iteration's assignment must outlive the
    time between two workers' reads of it, so keep it well above the longest iteration (or federated round).

    Every field is checked here, with numpy numbers turned into plain ones, so the config always round-trips
    through JSON and a bad value fails at construction with a :class:`ConfigError` rather than mid-run.
    """

    job: str
    num_workers: int
    global_batch: int
    min_batch: int = 1
    max_batch: int | Sequence[int] | None = None  # a sequence is kept as a tuple of plain ints
    assignment_timeout_s: float = 10.0
    ttl_s: int = 3600
    lag: int = 2

    def __post_init__(self) -> None:
        job = _job_name(self.job)
        self._set("num_workers", _integer(self.num_workers, "num_workers", 1, MAX_WORKERS, job))
        self._set("global_batch", _integer(self.global_batch, "global_batch", 1, MAX_BATCH, job))
        self._set("min_batch", _integer(self.min_batch, "min_batch", 0, MAX_BATCH, job))
        self._set("max_batch", _max_batch(self.max_batch, self.num_workers, job))
        lower, upper = self.bounds()
        below = [i for i, (lo, hi) in enumerate(zip(lower, upper)) if lo > hi]
        if below:
            raise ConfigError(f"max_batch is below min_batch {self.min_batch} for worker {below[0]} "
                              f"(cap {upper[below[0]]})", job=job)
        if sum(lower) > self.global_batch:
            raise ConfigError(f"min_batch {self.min_batch} x {self.num_workers} workers exceeds the global batch "
                              f"{self.global_batch}", job=job)
        if sum(upper) < self.global_batch:
            raise ConfigError(f"the max_batch caps add up to {sum(upper)}, less than the global batch "
                              f"{self.global_batch}", job=job)
        self._set("assignment_timeout_s", _seconds(self.assignment_timeout_s, "assignment_timeout_s",
                                                   MIN_ASSIGNMENT_TIMEOUT_S, MAX_ASSIGNMENT_TIMEOUT_S, job))
        self._set("ttl_s", _integer(self.ttl_s, "ttl_s", 10, MAX_TTL_S, job))
        if self.ttl_s < self.assignment_timeout_s:  # a split could expire while a worker still waits for it
            raise ConfigError(f"ttl_s ({self.ttl_s}) must be at least assignment_timeout_s "
                              f"({self.assignment_timeout_s:g}), and well above the longest iteration", job=job)
        self._set("lag", _integer(self.lag, "lag", 1, 8, job))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # the dataclass is frozen; this stores the checked value

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

    def stored_assignment(self, raw: bytes, iteration: int) -> Assignment:
        """The assignment of ``iteration`` read from Redis as ``raw``: a ProtocolError unless it is one of this job's,
        with its worker count, global batch and, within each worker's max_batch, sizes (without one, the sum bounds
        them: no list of caps is made at every read)."""
        return Assignment.from_json(raw, job=self.job, iteration=iteration, num_workers=self.num_workers,
                                    global_batch=self.global_batch,
                                    max_sizes=None if self.max_batch is None else self.bounds()[1])

    def initial_sizes(self) -> tuple[int, ...]:
        """The vector of the first ``lag`` iterations, before any decision: the equal (BSP) split, or, where
        ``max_batch`` caps some workers below it, the most nearly equal split within the bounds."""
        equal = equal_split(self.global_batch, self.num_workers)
        lower, upper = self.bounds()
        if all(lo <= size <= hi for lo, size, hi in zip(lower, equal, upper)):
            return equal
        return tuple(allocate(LinearTime(np.ones(self.num_workers)), self.global_batch, lower, upper).tolist())

    def initial_assignment(self, iteration: int) -> Assignment:
        """The assignment of ``iteration`` when no decision covers it: the initial split."""
        return Assignment(self.job, iteration, self.initial_sizes(), "initial", "initial split")

    def joined(self, stored: JobConfig | None, *, caller: str, warn: bool = True) -> JobConfig:
        """This config as an external coordinator serves it (``stored``, read from Redis): its lag and key TTL
        (the ``lbbsp coordinator`` flags ``--lag`` and ``--ttl``), once every other setting agrees; a ConfigError
        names those that differ and says to pass the coordinator's settings to ``caller``. With nothing stored
        yet (the coordinator has not started), this config, with a warning unless ``warn`` is False (one worker of
        many says it): the workers' steps keep the initial split until then."""
        if stored is None:
            if warn:
                log.warning("job %r is not on this Redis yet: until `lbbsp coordinator --job %s` serves it, its steps "
                            "keep the initial split (the first to find no decision waits assignment_timeout_s, %gs, for "
                            "it); check the job name", self.job, self.job, self.assignment_timeout_s)
            return self
        # compared first: the coordinator's TTL under this run's assignment_timeout_s fails replace() with an error
        # about a TTL the caller never set, where the timeout is what differs
        differ = self.differences(stored, ignore=("lag", "ttl_s"))
        if differ:
            served = ", ".join(f"{name}={theirs!r}" for name, (_, theirs) in differ.items())
            asked = ", ".join(f"{name}={mine!r}" for name, (mine, _) in differ.items())
            raise ConfigError(f"the coordinator serves job {self.job!r} with {served}, but this run asks for {asked}: "
                              f"pass the coordinator's settings to {caller}", job=self.job)
        return replace(self, lag=stored.lag, ttl_s=stored.ttl_s)

    def differences(self, other: JobConfig, ignore: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
        """The settings in which ``other`` differs from this config, by field name: (this value, ``other``'s); the
        fields in ``ignore`` are not compared. What a mismatch between a run and its job's stored settings names."""
        return {f.name: (getattr(self, f.name), getattr(other, f.name)) for f in fields(JobConfig)
                if f.name not in ignore and getattr(self, f.name) != getattr(other, f.name)}

    def to_json(self) -> str:
        """The settings as JSON: what the job's ``config`` key in Redis holds, and a coordinator's child is given."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: str | bytes) -> JobConfig:
        """Read stored settings back, validated; a :class:`ConfigError` for bad JSON or a missing or unknown field."""
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ConfigError(f"stored job configuration is not valid JSON: {exc!r}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"stored job configuration must be a JSON object, got {type(obj).__name__}")
        unexpected = set(obj) - {f.name for f in fields(cls)}
        missing = {f.name for f in fields(cls) if f.default is MISSING} - set(obj)
        if unexpected:
            raise ConfigError(f"stored job configuration has unexpected fields {sorted(unexpected)}")
        if missing:
            raise ConfigError(f"stored job configuration lacks the fields {sorted(missing)}")
        return cls(**obj)


def _job_config(config: object) -> JobConfig:
    """``config`` if it is a JobConfig, else a ConfigError that says so (its missing ``job`` was an AttributeError)."""
    if not isinstance(config, JobConfig):
        raise ConfigError(f"config must be a JobConfig, got {type(config).__name__}")
    return config
