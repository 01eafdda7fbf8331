"""What workers report and what the coordinator assigns: validated dataclasses, JSON on the wire.

Nothing here ever unpickles or evaluates: payloads are size-capped JSON, checked field by field, and every
rejection is a :class:`~lbbsp.errors.ProtocolError` that names the field.
"""
from __future__ import annotations

import difflib
import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import Any, TypeGuard

import numpy as np

from .errors import ConfigError, ProtocolError
from .errors import printable as printable  # its home before errors.py: lbbsp.protocol.printable still imports

PROTOCOL_VERSION = 1
MAX_PAYLOAD_BYTES = 4096  # one report
MAX_ASSIGNMENT_BYTES = 1024 + 12 * 100_000  # one vector for up to MAX_WORKERS workers
MAX_BATCH = 10_000_000
MAX_ITERATION = 2**53
MAX_SECONDS = 86_400.0
MIN_COMPUTE_S = 1e-9  # a measured compute time below a nanosecond is a broken timer: its throughput overflows
MAX_REASON_CHARS = 512
MAX_POLICY_NAME_CHARS = 64
MAX_DEVICE_CHARS = 64
MAX_NAME_SHOWN = 64  # characters of an unknown name in an error, which the coordinator keeps in its decision log
MAX_WORKERS = 100_000

#: Resource features a report may carry, with their allowed closed ranges.
FEATURE_RANGES: dict[str, tuple[float, float]] = {
    "cpu_util": (0.0, 1.0),  # whole machine, fraction of all cores busy
    "proc_cpu": (0.0, 1024.0),  # this process, in cores
    "colocated_load": (0.0, 1e4),  # other processes' busy cores per core of the machine
    "mem_util": (0.0, 1.0),  # fraction of machine memory in use
    "cores": (1.0, 1e5),
    "gpu_util": (0.0, 1.0),
    "gpu_mem_used": (0.0, 1e15),  # bytes
    "gpu_mem_free": (0.0, 1e15),  # bytes
    "download_s": (0.0, MAX_SECONDS),  # model download, federated clients
    "upload_s": (0.0, MAX_SECONDS),
    "bandwidth_down": (0.0, 1e13),  # bytes per second
    "bandwidth_up": (0.0, 1e13),
}

_REPORT_FIELDS = {"v", "job", "worker", "iteration", "samples", "compute_s", "comm_s", "wait_s",
                  "features", "device"}
_ASSIGNMENT_FIELDS = {"v", "job", "iteration", "sizes", "policy", "reason", "fallback", "created"}


def _known_features(name: object) -> str:
    """The feature names a report may carry, for an unknown one's message, the closest first where one is close (a
    misspelt 'downlod_s' had been refused without a word of what was meant)."""
    close = difflib.get_close_matches(str(name)[:MAX_NAME_SHOWN], FEATURE_RANGES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (known: {', '.join(FEATURE_RANGES)})"


def _fail(message: str, field_name: str, **where: Any) -> ProtocolError:
    return ProtocolError(message, field=field_name, **where)


def _flag(value: object, name: str, job: str | None = None) -> bool:
    """``value`` as a plain bool; numpy's pass, anything else is a ConfigError: a string from an environment variable or
    a command line ("false", "no") is true, and had silently meant the opposite."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be True or False, got {value!r:.60} ({type(value).__name__})", job=job)
    return bool(value)


def _is_integer(value: object) -> TypeGuard[int | np.integer[Any]]:
    """Whether ``value`` is a whole number as callers hold one: a plain or numpy integer, not a bool (True would
    pass for 1) and not a float (2.0 fails later, inside numpy or as an index)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _int(value: Any, name: str, lo: int, hi: int, **where: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"must be an integer, got {type(value).__name__}", name, **where)
    if not lo <= value <= hi:
        raise _fail(f"must be in [{lo}, {hi}], got {value}", name, **where)
    return value


def _float(value: Any, name: str, lo: float, hi: float, **where: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(f"must be a number, got {type(value).__name__}", name, **where)
    try:
        value = float(value)
    except OverflowError:  # an integer beyond any float (JSON has no limit): out of range, not a crash
        raise _fail(f"must be in [{lo}, {hi}], got an integer of {value.bit_length()} bits", name, **where) from None
    if not math.isfinite(value):
        raise _fail(f"must be finite, got {value}", name, **where)
    if not lo <= value <= hi:
        raise _fail(f"must be in [{lo}, {hi}], got {value}", name, **where)
    return value


def _python_real(value: Any) -> Any:
    """A real number of numpy's (np.float32, np.int64) as Python's float; any other value (bools among them) as it is."""
    if type(value) in (int, float) or isinstance(value, bool) or not isinstance(value, Real):
        return value
    return float(value)


def _in_range(value: Any, lo: float, hi: float) -> bool:
    """The fast check: a plain int or float in [lo, hi] (NaN fails the range); anything else gets _float's."""
    return type(value) in (int, float) and lo <= value <= hi


def _str(value: Any, name: str, max_chars: int, **where: Any) -> str:
    if not isinstance(value, str):
        raise _fail(f"must be a string, got {type(value).__name__}", name, **where)
    if len(value) > max_chars:
        raise _fail(f"must be at most {max_chars} characters, got {len(value)}", name, **where)
    return value


def _decode(data: bytes | str, kind: str, allowed: set[str], max_bytes: int) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview, str)):  # bytes(5) would be five zero bytes
        raise _fail(f"{kind} must be JSON as bytes or str, got {type(data).__name__}", "payload")
    try:
        raw = data.encode() if isinstance(data, str) else bytes(data)
    except UnicodeEncodeError:  # a str with a lone surrogate: no JSON a worker could have sent
        raise _fail(f"{kind} is not valid UTF-8 text", "payload") from None
    if len(raw) > max_bytes:
        raise _fail(f"{kind} payload is {len(raw)} bytes, more than {max_bytes}", "payload")
    try:
        obj = _json(raw.decode("utf-8"))
    except ProtocolError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(f"{kind} is not valid JSON: {exc}", "payload") from None
    except RecursionError:  # [[[...]]] under the size cap: the decoder's stack, not the whole decision, gives out
        raise _fail(f"{kind} is nested too deeply", "payload") from None
    except ValueError:  # an integer literal of more than 4,300 digits: Python's limit on reading one
        raise _fail(f"{kind} holds a number too long to read", "payload") from None
    if not isinstance(obj, dict):
        raise _fail(f"{kind} must be a JSON object, got {type(obj).__name__}", "payload")
    unknown = [] if allowed.issuperset(obj) else sorted(set(obj) - allowed)
    if unknown:
        shown = ", ".join(repr(name[:MAX_NAME_SHOWN]) for name in unknown[:4]) + (", ..." if len(unknown) > 4 else "")
        raise _fail(f"unknown field(s) in {kind}: {shown}", unknown[0][:MAX_NAME_SHOWN])
    version = obj.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # true and 1.0 equal 1 in Python
        raise _fail(f"unsupported protocol version {version!r}, expected {PROTOCOL_VERSION}", "v")
    return obj


def _reject_constant(name: str) -> None:
    raise _fail(f"{name} is not allowed", "payload")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # one decoder: NaN and Infinity are refused


def _json(text: str) -> Any:
    """One JSON document. Payloads come without whitespace around them, so ``raw_decode`` reads one without
    ``decode``'s two whitespace scans (about a tenth of a report's parse); anything else gets ``decode``'s error."""
    try:
        obj, end = _DECODER.raw_decode(text)
        if end == len(text):
            return obj
    except json.JSONDecodeError:
        pass
    return _DECODER.decode(text)


def _require(obj: Mapping[str, Any], name: str) -> Any:
    if name not in obj:
        raise _fail("is missing", name)
    return obj[name]


def _plain(job: Any, worker: Any, iteration: Any, samples: Any, compute_s: Any, comm_s: Any, wait_s: Any,
           features: Any, device: Any) -> bool:
    """True for a report's fields of plain types within every range (what well-behaved workers send): the quick
    pass; a report it does not accept gets the checks that name the bad field."""
    if not (type(job) is str and 0 < len(job) <= 128 and type(device) is str and len(device) <= MAX_DEVICE_CHARS
            and type(worker) is int and 0 <= worker < MAX_WORKERS
            and type(iteration) is int and 0 <= iteration <= MAX_ITERATION
            and type(samples) is int and 0 <= samples <= MAX_BATCH
            and _in_range(compute_s, 0.0, MAX_SECONDS) and not 0 < compute_s < MIN_COMPUTE_S
            and (comm_s is None or _in_range(comm_s, 0.0, MAX_SECONDS))
            and (wait_s is None or _in_range(wait_s, 0.0, MAX_SECONDS))
            and type(features) is dict and ("gpu_mem_used" in features) == ("gpu_mem_free" in features)):
        return False
    for name, value in features.items():
        bounds = FEATURE_RANGES.get(name)
        if bounds is None or type(value) not in (int, float) or not bounds[0] <= value <= bounds[1]:
            return False
    return "gpu_mem_free" not in features or features["gpu_mem_used"] + features["gpu_mem_free"] > 0


@dataclass(frozen=True, slots=True)
class Report:
    """One worker's measurement of one iteration.

    ``compute_s`` is the time spent computing ``samples`` samples, *excluding* any wait at the barrier;
    ``wait_s`` is that wait, reported separately so it can be shown but never mistaken for slowness.
    """

    job: str
    worker: int
    iteration: int
    samples: int
    compute_s: float
    comm_s: float | None = None
    wait_s: float | None = None
    features: Mapping[str, float] = field(default_factory=dict, hash=False)  # a dict: hashed, a report had raised
    device: str = "cpu"

    def __post_init__(self) -> None:
        if isinstance(self.features, Mapping):  # a copy: the caller's dict, changed later, had changed the report
            object.__setattr__(self, "features", dict(self.features))
        self.validate()

    @property
    def throughput(self) -> float:
        """Samples per second of compute; 0.0 when nothing was measured."""
        return self.samples / self.compute_s if self.samples > 0 and self.compute_s > 0 else 0.0

    def validate(self) -> Report:
        """Check every field's type and range: one quick pass, then the detailed checks that name the bad field
        for a report the quick pass does not accept."""
        if _plain(self.job, self.worker, self.iteration, self.samples, self.compute_s, self.comm_s, self.wait_s,
                  self.features, self.device):
            return self
        self._as_plain_numbers()
        where: dict[str, Any] = {"job": self.job if isinstance(self.job, str) else None}
        _str(self.job, "job", 128, **where)
        if not self.job:
            raise _fail("must not be empty", "job")
        _int(self.worker, "worker", 0, MAX_WORKERS - 1, **where)
        where["worker"] = self.worker
        _int(self.iteration, "iteration", 0, MAX_ITERATION, **where)
        where["iteration"] = self.iteration
        _int(self.samples, "samples", 0, MAX_BATCH, **where)
        for name, value, optional in (("compute_s", self.compute_s, False), ("comm_s", self.comm_s, True),
                                      ("wait_s", self.wait_s, True)):
            if not (optional and value is None or _in_range(value, 0.0, MAX_SECONDS)):
                _float(value, name, 0.0, MAX_SECONDS, **where)  # raises, naming what is wrong
        if 0 < self.compute_s < MIN_COMPUTE_S:
            raise _fail(f"must be 0 (nothing measured) or at least {MIN_COMPUTE_S} s, got {self.compute_s}",
                        "compute_s", **where)
        if not isinstance(self.features, dict):
            raise _fail("must be an object", "features", **where)
        for name, value in self.features.items():
            bounds = FEATURE_RANGES.get(name)
            if bounds is None:
                # (the name once, in the field: a hostile report's error is kept in the decision log)
                raise _fail(f"unknown feature{_known_features(name)}", f"features.{str(name)[:MAX_NAME_SHOWN]}",
                            **where)
            if not _in_range(value, *bounds):
                _float(value, f"features.{name}", *bounds, **where)
        if ("gpu_mem_used" in self.features) != ("gpu_mem_free" in self.features):  # a cap needs the card's size
            given, missing = (("gpu_mem_used", "gpu_mem_free") if "gpu_mem_used" in self.features
                              else ("gpu_mem_free", "gpu_mem_used"))
            raise _fail(f"{given} without {missing}: report both (NVML's memory info, or torch.cuda.mem_get_info's "
                        "free and total - free), or neither; from one alone no memory cap can be set",
                        f"features.{missing}", **where)
        if "gpu_mem_free" in self.features and self.features["gpu_mem_used"] + self.features["gpu_mem_free"] <= 0:
            raise _fail("gpu_mem_used and gpu_mem_free are both 0, a card of no memory, which would cap the worker at 0 "
                        "samples: leave both out where the reading failed", "features.gpu_mem_free", **where)
        _str(self.device, "device", MAX_DEVICE_CHARS, **where)
        return self

    def _as_plain_numbers(self) -> None:
        """numpy's numbers (np.int64 from a count, np.float32 from a timer) as Python's, which the checks and the
        JSON take; bools stay as they are, refused below. Only reports the quick pass did not accept get here."""
        for name in ("worker", "iteration", "samples"):
            value = getattr(self, name)
            if type(value) is not int and isinstance(value, Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))
        for name in ("compute_s", "comm_s", "wait_s"):
            object.__setattr__(self, name, _python_real(getattr(self, name)))
        if isinstance(self.features, dict):
            object.__setattr__(self, "features", {name: _python_real(v) for name, v in self.features.items()})

    def check_belongs(self, *, job: str | None = None, num_workers: int | None = None) -> Report:
        """Raise unless the report is for ``job`` and its worker id is below ``num_workers``."""
        if job is not None and self.job != job:
            raise _fail(f"report is for job {self.job!r}, not {job!r}", "job", job=job)
        if num_workers is not None and self.worker >= num_workers:
            raise _fail(f"must be in [0, {num_workers - 1}], got {self.worker}", "worker", job=self.job,
                        iteration=self.iteration)
        return self

    def to_json(self) -> bytes:
        """The compact JSON a worker posts to Redis; a :class:`ProtocolError` if it would pass the 4 KiB cap."""
        obj: dict[str, Any] = {
            "v": PROTOCOL_VERSION, "job": self.job, "worker": self.worker, "iteration": self.iteration,
            "samples": self.samples, "compute_s": self.compute_s, "features": dict(self.features),
            "device": self.device,
        }
        if self.comm_s is not None:
            obj["comm_s"] = self.comm_s
        if self.wait_s is not None:
            obj["wait_s"] = self.wait_s
        data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
        if len(data) > MAX_PAYLOAD_BYTES:
            raise _fail(f"encoded report is {len(data)} bytes, more than {MAX_PAYLOAD_BYTES}", "payload")
        return data

    @classmethod
    def from_json(cls, data: bytes | str, *, job: str | None = None,
                  num_workers: int | None = None) -> Report:
        """Parse and validate; raises :class:`ProtocolError` naming the bad field."""
        obj = _decode(data, "report", _REPORT_FIELDS, MAX_PAYLOAD_BYTES)
        values: tuple[Any, ...] = (obj.get("job"), obj.get("worker"), obj.get("iteration"), obj.get("samples"),
                                   obj.get("compute_s"), obj.get("comm_s"), obj.get("wait_s"), obj.get("features", {}),
                                   obj.get("device", "cpu"))
        if _plain(*values):  # a missing field is None here, which the quick pass refuses
            report = cls._checked_already(values)
        else:  # the checks that name what is wrong
            if not isinstance(obj.get("features", {}), dict):
                raise _fail("must be an object", "features")
            for name in ("job", "worker", "iteration", "samples", "compute_s"):
                _require(obj, name)
            report = cls(*values)
        return report.check_belongs(job=job, num_workers=num_workers)

    @classmethod
    def _checked_already(cls, values: tuple[Any, ...]) -> Report:
        """A report of field values, in declaration order, that :func:`_plain` accepted, without the dataclass's
        set-up and a second pass: the coordinator parses one per worker per iteration, and that pass and set-up
        were a third of a parse."""
        report = object.__new__(cls)
        for store, value in zip(_REPORT_SLOTS, values):
            store(report, value)
        return report


#: Setters of a report's slots in declaration order (a report has slots, no ``__dict__``: the models read a few of
#: its fields from each of 1,024 reports several times a decision, and that read took 2x as long from a dict that
#: ``_checked_already`` had filled as from slots).
_REPORT_SLOTS = tuple(getattr(Report, f.name).__set__ for f in fields(Report))

@dataclass(frozen=True)
class Assignment:
    """The batch-size vector every worker uses at ``iteration``, with who decided it and why."""

    job: str
    iteration: int
    sizes: tuple[int, ...]
    policy: str
    reason: str = ""
    fallback: bool = False
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if isinstance(self.sizes, (str, bytes)) or not isinstance(self.sizes, Iterable):
            raise _fail(f"must be a sequence of integers, got {type(self.sizes).__name__}", "sizes",
                        job=self.job if isinstance(self.job, str) else None)
        object.__setattr__(self, "sizes", tuple(self.sizes))
        if type(self.iteration) is not int and _is_integer(self.iteration):
            object.__setattr__(self, "iteration", int(self.iteration))
        self.validate()

    def offset(self, worker: int) -> int:
        """Position in the global batch where ``worker``'s slice starts (a ProtocolError for no worker of it)."""
        if not _is_integer(worker) or not 0 <= worker < len(self.sizes):
            raise _fail(f"must be a worker of this assignment, an integer in [0, {len(self.sizes) - 1}], "
                        f"got {worker!r}", "worker", job=self.job, iteration=self.iteration)
        return sum(self.sizes[:int(worker)])

    def validate(self, *, job: str | None = None, iteration: int | None = None, num_workers: int | None = None,
                 global_batch: int | None = None, max_sizes: Sequence[int] | None = None) -> Assignment:
        """Check every field, and that it is the assignment of ``job`` and ``iteration`` (the key it was read from),
        within each worker's ``max_sizes`` (its max_batch: more may not fit in its memory) where given."""
        where: dict[str, Any] = {"job": self.job if isinstance(self.job, str) else None}
        _str(self.job, "job", 128, **where)
        if job is not None and self.job != job:
            raise _fail(f"assignment is for job {self.job!r}, not {job!r}", "job", job=job)
        _int(self.iteration, "iteration", 0, MAX_ITERATION, **where)
        if iteration is not None and self.iteration != iteration:
            raise _fail(f"assignment is for iteration {self.iteration}, not {iteration}", "iteration", job=self.job,
                        iteration=iteration)
        where["iteration"] = self.iteration
        if not self.sizes or len(self.sizes) > MAX_WORKERS:
            raise _fail(f"must hold 1 to {MAX_WORKERS} sizes, got {len(self.sizes)}", "sizes", **where)
        sizes = self.sizes
        if not (all(type(size) is int for size in sizes) and 0 <= min(sizes) and max(sizes) <= MAX_BATCH):
            # the slow path: numpy's integers (a policy's array) as Python's, as Report takes them; the first bad size
            sizes = tuple(int(size) if _is_integer(size) else size for size in sizes)
            object.__setattr__(self, "sizes", sizes)
            for i, size in enumerate(sizes):
                _int(size, f"sizes[{i}]", 0, MAX_BATCH, **where)
        if num_workers is not None and len(self.sizes) != num_workers:
            raise _fail(f"has {len(self.sizes)} sizes for {num_workers} workers", "sizes", **where)
        if global_batch is not None and sum(self.sizes) != global_batch:
            raise _fail(f"sums to {sum(self.sizes)}, not the global batch {global_batch}", "sizes", **where)
        if max_sizes is not None and (over := [i for i, (size, cap) in enumerate(zip(self.sizes, max_sizes))
                                               if size > cap]):
            raise _fail(f"{self.sizes[over[0]]} is over worker {over[0]}'s max_batch {max_sizes[over[0]]}",
                        f"sizes[{over[0]}]", **where)
        _str(self.policy, "policy", MAX_POLICY_NAME_CHARS, **where)
        _str(self.reason, "reason", MAX_REASON_CHARS, **where)
        if not isinstance(self.fallback, bool):
            raise _fail("must be a boolean", "fallback", **where)
        _float(self.created, "created", 0.0, 1e11, **where)
        return self

    def to_json(self) -> bytes:
        """The compact JSON stored under the iteration's ``assign:{k}`` key (``reason`` cut to 512 characters)."""
        return json.dumps(
            {"v": PROTOCOL_VERSION, "job": self.job, "iteration": self.iteration, "sizes": list(self.sizes),
             "policy": self.policy, "reason": self.reason[:MAX_REASON_CHARS], "fallback": self.fallback,
             "created": self.created},
            separators=(",", ":"), allow_nan=False,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes | str, *, job: str | None = None, iteration: int | None = None,
                  num_workers: int | None = None, global_batch: int | None = None,
                  max_sizes: Sequence[int] | None = None) -> Assignment:
        """Parse and validate, also against the job, iteration, worker count, global batch and caps where given (the
        key it was read from); raises :class:`ProtocolError` naming the bad field."""
        obj = _decode(data, "assignment", _ASSIGNMENT_FIELDS, MAX_ASSIGNMENT_BYTES)
        sizes = _require(obj, "sizes")
        if not isinstance(sizes, list):
            raise _fail("must be a list", "sizes")
        assignment = cls(
            job=_require(obj, "job"), iteration=_require(obj, "iteration"), sizes=tuple(sizes),
            policy=_require(obj, "policy"), reason=obj.get("reason", ""), fallback=obj.get("fallback", False),
            created=_require(obj, "created"),
        )
        return assignment.validate(job=job, iteration=iteration, num_workers=num_workers, global_batch=global_batch,
                                   max_sizes=max_sizes)


def equal_split(global_batch: int, num_workers: int) -> tuple[int, ...]:
    """The BSP split: sizes differ by at most one, larger ones first."""
    for name, value, lo, hi in (("global_batch", global_batch, 0, MAX_BATCH * MAX_WORKERS),
                                ("num_workers", num_workers, 1, MAX_WORKERS)):
        if not _is_integer(value) or not lo <= value <= hi:
            raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    global_batch, num_workers = int(global_batch), int(num_workers)
    base, extra = divmod(global_batch, num_workers)
    return (base + 1,) * extra + (base,) * (num_workers - extra)  # (a generator over the workers: 20x the time)
