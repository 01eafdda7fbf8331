"""The BatchSize Manager: turns the reports of iteration k into the one assignment of iteration k + lag."""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import json
import logging
import math
import multiprocessing
import multiprocessing.synchronize
import numbers
import os
import pickle
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from .allocation import sit_out_share
from .child_logging import ParentLogging
from .config import JobConfig, _integer, _job_config, _real
from .embedded import SHM_IN_CONTAINERS, RestartBudget, no_room, release_cpu_pinning
from .errors import ConfigError, LBBSPError, PolicyError, ProtocolError, StoreUnavailable
from .models import AutoCapacityModel, CapacityModel, FLClientModel, worker_kind
from .models.auto import default_models
from .models.base import predicted_throughput
from .policies import (
    BackupWorkersPolicy,
    BSPPolicy,
    Decision,
    LBBSPPolicy,
    OraclePolicy,
    Policy,
    StaticProportionalPolicy,
    checked_policy,
)
from .protocol import MAX_POLICY_NAME_CHARS, MAX_REASON_CHARS, Assignment, Report
from .signals import off_the_handler, signals_held
from .store import ITERATIONS_KEPT, PROBE_TIMEOUT_S, REDIS_FAILURES, Store, _store, answering, unusable

log = logging.getLogger("lbbsp.coordinator")

_LOOK_BACK = 16  # how many iterations back the coordinator looks for the split in force (see _in_force)
#: The most iterations one decision covers when the coordinator is slower than the workers' steps (see
#: Coordinator.ahead): a decision then runs further ahead of the reports it was made from.
MAX_AHEAD = 16
AHEAD_LIMIT = 1024  # the largest max_ahead accepted
#: The most iterations one clean-up deletes (20,000 keys, about 12 ms): a coordinator's first reaches back this far where
#: no earlier clean-up of the job says where its stored iterations start, and one after a long pause no further.
CLEAN_UP_REACH = 10_000


def checked_max_ahead(value: object, job: str | None = None) -> int:
    """``value`` as a ``max_ahead``: a whole number in [1, AHEAD_LIMIT], or a ConfigError that says so; None is
    the default, MAX_AHEAD. The integrations check it on every worker, not only where the coordinator starts."""
    return MAX_AHEAD if value is None else _integer(value, "max_ahead", 1, AHEAD_LIMIT, job)

_PACE_WINDOW = 5  # decisions over which the coordinator's own time and the workers' step are taken (medians)
_DROP = 100  # a report under 1/_DROP of its worker's previous throughput is worth a warning (_warn_dropped)
#: How long a serving coordinator's claim on its job lasts, renewed every second (_heartbeat); `lbbsp coordinator`
#: waits that long at most for a stale one to lapse.
CLAIM_S = 5
#: Seconds an integration gives its coordinator process to stop, before it is killed, where the Redis it serves on is
#: the integration's own embedded one, deleted next: its last writes (status rows, its claim) are lost anyway, and a
#: child inside a call to a Redis that stopped answering never ends by itself (5 s a call, three tries).
GRACE_BEFORE_OWN_SERVER_S = 1.0
#: The exit code of a coordinator child that could not set up because Redis was unusable (down, stalled, refusing):
#: a cause that clears, which its restart watch does not count against RESTARTS (sysexits' EX_TEMPFAIL)
_EXIT_REDIS_UNUSABLE = 75
_OUTAGE_GRACE_S = 3.0  # a coordinator whose training process ended is stopped by then (_stop_when_orphaned)
_REJECTED_AGAIN = " ({} earlier ones like it, logged at most every 10 s)"  # a rejection's count (_rejected)
#: The most rejected reports a decision's record lists, the rest counted: a reports hash of 20,000 fields that are no
#: worker (written past POST_REPORT's check) had made a record of 1.6 MB.
_RECORDED_REJECTIONS = 20

#: One worker's status in the ``workers`` hash, as JSON (``lbbsp status`` reads it).
_STATUS = ('{"iteration": %d, "size": %d, "predicted_throughput": %s, "predicts": %s, "measured_throughput": %s, '
           '"compute_s": %s, "wait_s": %s, "kind": %s}')


def _number(value: float | None) -> str:
    """A JSON number, or null for a missing or non-finite value."""
    return "null" if value is None or not math.isfinite(value) else repr(float(value))


@dataclass
class Rejection:
    """A report the coordinator refused, with the reason; the worker's slot counts as missing."""

    worker: str
    error: str


@dataclass
class Outcome:
    """What one decision step did: the assignment it wrote (or found already written) and why; not written and not
    logged where another coordinator's clean-up had deleted its iteration meanwhile (``written`` False)."""

    iteration: int
    assignment: Assignment
    written: bool
    decision_s: float
    rejected: list[Rejection] = field(default_factory=list)
    learn_s: float = 0.0  # the policy's learning after the write, off the decision's path
    through: int = field(kw_only=True)  # the last iteration it covers (its assignment's, unless it ran ahead)


def _worker_field(field: str, num_workers: int) -> bool:
    """Whether ``field`` of a reports hash names a worker of a job of ``num_workers``, as POST_REPORT lets one in:
    decimal, without sign or leading zeros."""
    return field.isdecimal() and str(int(field)) == field and int(field) < num_workers


def _clipped(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in an ellipsis where it was cut."""
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


class _Repeats:
    """Whether a failure is worth a log line now: a new one at once, the same one again (a bug that fails every
    step, 20 times a second) only every 10 s, saying how many times in a row it came (``counted``, its ``{}`` the
    count). An exception is the same as the last where it is of the same type with the same traceback, whatever its
    message: a policy's error that named the iteration or a sum had logged a traceback at every decision."""

    def __init__(self, counted: str = " ({} times in a row)") -> None:
        self._counted = counted
        self._what, self._count, self._next = "", 0, 0.0

    def note(self, failure: object) -> str | None:
        """Count ``failure`` (an exception, or what names one); None if it is not to be logged now, else what to
        add to the line ("" or a count)."""
        now, what = time.monotonic(), _failure_site(failure)
        again = what == self._what
        told = None
        if not again or now >= self._next:
            told = self._counted.format(self._count) if again and self._count > 1 else ""
            self._next = now + 10.0
        self._what, self._count = what, self._count + 1 if again else 1
        return told


def _failure_site(failure: object) -> str:
    """What makes two failures the same one: an exception's type and the lines its traceback passed through (its
    message where it has no traceback); any other object's text."""
    if not isinstance(failure, BaseException) or failure.__traceback__ is None:
        return f"{type(failure).__name__}: {failure}"
    lines = (f"{frame.f_code.co_filename}:{line}" for frame, line in traceback.walk_tb(failure.__traceback__))
    return f"{type(failure).__name__} via {' '.join(lines)}"


def _check_for_job(policy: Policy | None, config: JobConfig, *, warn: bool = True) -> None:
    """A ConfigError for worker kinds pinned outside the job (a typo, or a rank off by one, had been kept
    silently) or backup workers that would drop every gradient (refused at each decision, and the job ran on), and
    (``warn``) a warning where the model, or a model an AutoCapacityModel is given, forecasts further or less far
    ahead than the job's lag (a hand-built model does not take the lag; the default and `lbbsp coordinator --model`
    do)."""
    if isinstance(policy, BackupWorkersPolicy):
        policy.aggregated(config.num_workers)
    model = getattr(policy, "model", None)
    pinned = getattr(model, "kinds", None) if isinstance(model, AutoCapacityModel) else None
    # numpy's integers too (a pin map built from np.flatnonzero had gone unchecked)
    outside = sorted(w for w in map(_as_int, pinned or {}) if w is not None and not 0 <= w < config.num_workers)
    if outside:
        raise ConfigError(f"AutoCapacityModel's kinds pin worker(s) {outside[:8]}, outside the job's workers "
                          f"0..{config.num_workers - 1}", job=config.job)
    for name, horizon in _horizons(model) if warn else ():
        if horizon != config.lag:
            log.warning("job %s: the model%s forecasts %d iteration(s) ahead (horizon=%d), but each split is decided "
                        "%d ahead (lag=%d): give it horizon=%d (LBBSPPolicy()'s own model: LBBSPPolicy("
                        "AutoCapacityModel(horizon=%d)))", config.job, name, horizon, horizon, config.lag,
                        config.lag, config.lag, config.lag)


def _as_int(value: object) -> int | None:
    """``value`` as an int where it is an integer (numpy's too) and not a bool, else None."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


def _horizons(model: object, name: str = "") -> Iterator[tuple[str, int]]:
    """(what the warning calls it after "the model", horizon) for ``model`` and for each model an
    :class:`AutoCapacityModel` is given, where it has a whole ``horizon``: the automatic model's own counts only where
    it builds the CPU workers' NARX (no model given for "cpu"); those given in ``models`` had gone unchecked."""
    if isinstance(model, AutoCapacityModel):
        given = model.models if isinstance(model.models, Mapping) else {}
        if "cpu" not in given:
            yield from _whole(model.horizon, name)
        for kind, inner in given.items():
            yield from _horizons(inner, f" models[{kind!r}] ({type(inner).__name__})")
        return
    yield from _whole(getattr(model, "horizon", None), name)


def _whole(horizon: object, name: str) -> Iterator[tuple[str, int]]:
    """(``name``, ``horizon``) where ``horizon`` is a whole number of iterations; nothing otherwise."""
    if isinstance(horizon, (int, np.integer)) and not isinstance(horizon, bool):
        yield name, int(horizon)


def _check_outside_simulator(policy: Policy | None, config: JobConfig, *, warn: bool = True) -> None:
    """A ConfigError for the oracle, which needs each coming iteration's true speeds, known only to the simulator (a
    job's coordinator had failed every decision, the job left on the equal split), and (``warn``) a warning for
    backup workers, whose dropped gradients no integration implements (a job had run them as plain BSP, unsaid).
    Where a coordinator is made for a job, not where the simulator makes one (``Coordinator(..., simulated=True)``)."""
    if isinstance(policy, OraclePolicy):
        raise ConfigError(f"{type(policy).__name__} is the simulator's limit, not a policy a job can run: it decides "
                          "from each coming iteration's true speeds, which only lbbsp.sim knows (`lbbsp simulate`, "
                          "lbbsp.sim.compare); for a job, use LBBSPPolicy()", job=config.job)
    if warn and isinstance(policy, BackupWorkersPolicy):
        log.warning("job %s: backup workers drop the slowest %d gradient(s) of each iteration, which breaks "
                    "exactness (each global batch's samples no longer all count); a job's workers aggregate every "
                    "gradient, so this one runs as plain BSP, the equal split: lbbsp.sim runs backup workers as they "
                    "are meant, to compare against", config.job, policy.backups)


class GuardedPolicy:
    """A policy held to the job's rules, as the coordinator runs it: a split that breaks them, or a policy that
    fails, keeps the split in force (logged with the reason) instead of stopping the job. The simulator runs
    its policies through this too, so that a split it measures is one a job would have written. ``name``: what
    its log lines call the policy (the simulator's name of the run); the policy's own name by default."""

    def __init__(self, policy: Policy, config: JobConfig, name: str | None = None) -> None:
        checked_policy(policy, config.job)
        _check_for_job(policy, config)
        self.policy, self.config = policy, config
        self.name = str(policy.name) if name is None else name
        # how many workers a decision may leave at 0 below their lower bound: a policy of one's own that let
        # workers sit out (any true sit_out) had been let leave all but one at 0
        try:
            self._may_sit_out = int(sit_out_share(policy.sit_out) * config.num_workers + 1e-9)
        except ConfigError as exc:
            raise ConfigError(f"policy {self.name}'s {exc.message}", job=config.job) from None
        self._bounds = tuple(np.asarray(b, dtype=np.int64) for b in config.bounds())
        # an assignment holds a name and a reason of bounded length: longer ones are cut, not refused (a policy
        # error's long message made even the split kept in force invalid, and nothing was written)
        self._name = _clipped(str(policy.name), MAX_POLICY_NAME_CHARS)
        #: Decisions that failed or broke the job's rules, each kept the split in force (and was logged).
        self.failures = 0
        self._repeats, self._learn_repeats, self._prediction_repeats = _Repeats(), _Repeats(), _Repeats()

    def decide(self, target: int, current: tuple[int, ...], reports: list[Report]) -> tuple[Decision, Assignment]:
        """Observe ``reports`` and decide the assignment of ``target``; ``current`` (the split of ``target - 1``)
        is kept if the policy fails or breaks the rules."""
        try:
            self.policy.observe(reports)
            decision = self.policy.decide(target, current, self.config)
            assignment = self._checked(target, decision)
            return dataclasses.replace(decision, predicted_throughput=self._predictions(target, decision)), assignment
        # a policy's bug, an OSError too (none is Redis's here), a sys.exit() in it or a library it calls (which had
        # ended the coordinator's thread without a word): keep the split in force. Ctrl-C still stops the coordinator.
        except (Exception, SystemExit) as exc:
            self.failures += 1
            if (repeats := self._repeats.note(exc)) is not None:
                log.exception("job %s: policy %s failed to decide iteration %d%s; keeping the current split",
                              self.config.job, self.name, target, repeats)
            decision = Decision(current, f"policy failed ({type(exc).__name__}: {exc}); kept the split")
            return decision, Assignment(self.config.job, target, current, self._name, _clipped(decision.reason,
                                                                                               MAX_REASON_CHARS))

    def learn(self, iteration: int) -> None:
        """Let the policy learn from the reports of ``iteration`` once the split is out; a failure is logged."""
        try:
            self.policy.learn()
        except (Exception, SystemExit) as exc:  # as above: logged, and the next decision goes on
            if (repeats := self._learn_repeats.note(exc)) is not None:
                log.exception("job %s: policy %s failed to learn from iteration %d%s", self.config.job, self.name,
                              iteration, repeats)

    def _predictions(self, target: int, decision: Decision) -> tuple[float, ...] | None:
        """The decision's predicted throughputs as one float per worker (NaN or inf where the model knows none:
        shown as null), or None, with a warning, if they are not that: the split is good, and the status the
        coordinator records after writing it must not fail on them."""
        if decision.predicted_throughput is None:
            return None
        try:
            predicted = np.asarray(decision.predicted_throughput)
        except (TypeError, ValueError):  # ragged
            predicted = np.asarray(None)
        if predicted.shape != (self.config.num_workers,) or predicted.dtype.kind not in "iuf":
            # at every decision otherwise: every 10 s, with a count
            if (repeats := self._prediction_repeats.note("predicted throughput")) is not None:
                log.warning("job %s: policy %s's predicted throughput for iteration %d is not one number per worker "
                            "(%.80r); recording none%s", self.config.job, self.name, target,
                            decision.predicted_throughput, repeats)
            return None
        return tuple(predicted.astype(float, copy=False).tolist())

    def _checked(self, target: int, decision: Decision) -> Assignment:
        """The decision as the assignment of ``target``, or a :class:`PolicyError` if it breaks the job's rules
        (an integer size per worker, within its bounds or 0 where the policy lets workers sit out, summing to
        the global batch): once written it could not be replaced, and every worker would refuse it. Checked
        on arrays: a fraction of a millisecond at 1,024 workers."""
        def refuse(why: str) -> PolicyError:
            return PolicyError(f"policy {self.name} returned an invalid split: {why}", job=self.config.job,
                               iteration=target)

        if not isinstance(decision, Decision):  # the bare sizes, say: it had failed on a missing attribute
            raise refuse(f"decide must return a Decision(sizes, reason), got {type(decision).__name__}")
        if not isinstance(decision.reason, str):  # it had failed on len() with no word of the reason
            raise refuse(f"the reason must be a string, got {type(decision.reason).__name__}")
        try:
            raw = np.asarray(decision.sizes)
        except (TypeError, ValueError) as exc:
            raise refuse(f"sizes are not numbers ({exc})") from exc
        if raw.shape != (self.config.num_workers,):
            what = f"{raw.size} sizes" if raw.ndim == 1 else f"sizes of shape {raw.shape}"
            raise refuse(f"{what} for {self.config.num_workers} workers")
        whole = raw.dtype.kind in "iu" or (raw.dtype.kind == "f" and bool(np.isfinite(raw).all())
                                           and np.array_equal(raw, np.round(raw)))  # inf had read as -2**63 samples
        if not whole:  # an int past int64 (10**30) makes an object array: integers, but no size a batch holds
            kind = "at most the global batch" if raw.dtype.kind == "O" else "integers"
            raise refuse(f"sizes must be {kind}, got {raw[:8].tolist()}")
        if raw.dtype.kind == "u" and (raw > self.config.global_batch).any():  # 2**63 had wrapped to a negative
            raise refuse(f"sizes must be at most the global batch, got {raw[:8].tolist()}")
        sizes = raw.astype(np.int64)
        lower, upper = self._bounds
        outside = (sizes < lower) | (sizes > upper)
        if self._may_sit_out:  # such a policy gives a worker sitting out 0, up to its share of the workers
            sitting = outside & (sizes == 0)
            if (count := int(sitting.sum())) > self._may_sit_out:
                raise refuse(f"{count} workers given 0 samples, where its sit_out of "
                             f"{self.policy.sit_out:g} lets at most {self._may_sit_out} of {sizes.size} sit out")
            outside &= ~sitting
        if outside.any():
            w = int(np.argmax(outside))
            raise refuse(f"worker {w} got {sizes[w]} samples, outside its bounds [{lower[w]}, {upper[w]}] "
                         f"({int(outside.sum())} workers outside)")
        try:
            return Assignment(self.config.job, target, tuple(sizes.tolist()), self._name,
                              _clipped(decision.reason, MAX_REASON_CHARS)).validate(global_batch=self.config.global_batch)
        except ProtocolError as exc:
            raise refuse(exc.message) from exc


def _warn_uncapped(job: str, policy: Policy, reports: list[Report]) -> bool:
    """Warn, and say True, where ``reports`` read GPU memory but ``policy``'s model sets no memory caps (it has no
    ``max_batch`` of its own): their workers' sizes are then not held below what their cards fit (per-epoch's own slow
    EWMA had given GPUs that held 716 samples 787-932, unsaid). A policy of one's own without a ``model`` is not asked."""
    if not hasattr(policy, "model"):
        return True
    model = policy.model
    if isinstance(model, AutoCapacityModel):  # a kind's model of the user's own, or a GPU worker pinned to another kind
        return _warn_uncapped_kinds(job, policy, model, reports)
    if _sets_caps(model):
        return True
    gpus = sorted({report.worker for report in reports if "gpu_mem_used" in report.features})
    if gpus:
        name = getattr(policy, "name", type(policy).__name__)
        why = ("has no model to set memory caps" if model is None
               else f"has a model, {type(model).__name__}, that sets no memory caps")
        remedy = ("use a policy that takes a model, with AutoCapacityModel() (lbbsp coordinator --policy lbbsp)"
                  if isinstance(policy, StaticProportionalPolicy) else
                  "give it AutoCapacityModel() or BatchTimeCurve() (lbbsp coordinator --model auto)")
        log.warning("job %s: worker(s) %s report GPU memory, but the %s policy %s, so their sizes are not held below "
                    "what their cards fit: %s", job, gpus[:8], name, why, remedy)
    return bool(gpus)


def _sets_caps(model: object) -> bool:
    """Whether ``model`` has a ``max_batch`` of its own, and so can hold workers below what their cards fit."""
    return isinstance(model, CapacityModel) and type(model).max_batch is not CapacityModel.max_batch


def _warn_uncapped_kinds(job: str, policy: Policy, model: AutoCapacityModel, reports: list[Report]) -> bool:
    """:func:`_warn_uncapped` for an :class:`AutoCapacityModel`: the workers that read GPU memory and go (by their pin,
    else by their report) to the CPU or GPU kind whose model sets no caps. Federated clients are left out: their
    model plans transfers, not a card's memory. True at once where no worker can go to such a kind, as a CPU-only
    job's reports had been scanned at every decision (3 ms at 100,000 workers)."""
    pins, given = dict(model.kinds or {}), dict(model.models or {})
    capping = {kind: _sets_caps(kind_model) for kind, kind_model in (default_models(1) | given).items()}
    if capping["gpu"] and all(capping.get(kind, True) or kind == "fl" for kind in pins.values()):
        return True
    gpus = [report for report in reports if "gpu_mem_used" in report.features]
    if not gpus:
        return False
    uncapped: dict[str, list[int]] = {}
    for report in gpus:
        kind = pins.get(report.worker, worker_kind(report))
        if kind != "fl" and not capping.get(kind, True):  # a kind the model does not know: it refuses that itself
            uncapped.setdefault(kind, []).append(report.worker)
    for kind, workers in sorted(uncapped.items()):
        pinned = kind != "gpu" and any(w in pins for w in workers)
        why = f"to kind {kind!r}" + (" (pinned there)" if pinned else "") + (
            f", whose model, {type(given[kind]).__name__}, sets no memory caps" if kind in given
            else ", whose default model sets no memory caps")
        remedy = ("pin them to 'gpu', or leave them unpinned" if pinned
                  else f"give that kind BatchTimeCurve(), the default for 'gpu' (lbbsp coordinator: --kind-model "
                       f"{kind}=gpu-curve)")
        log.warning("job %s: worker(s) %s report GPU memory, but the %s policy's AutoCapacityModel routes them %s, so "
                    "their sizes are not held below what their cards fit: %s", job, sorted(set(workers))[:8],
                    getattr(policy, "name", type(policy).__name__), why, remedy)
    return True


class Coordinator:
    """Collect the reports of each iteration, ask the policy, write the next assignment exactly once.

    Run it in its own process (``lbbsp coordinator``) or in-process with :meth:`start`, for example on
    rank 0. Each decision is recorded with its reason in the job's decision log.

    When a decision takes longer than the workers' steps, the workers would wait for each vector and the job
    would run at the coordinator's pace. The coordinator then runs ahead (:attr:`ahead`): it decides from the
    newest iteration whose reports are all in and writes that split for the next ``ahead`` iterations, each
    still exactly once; ``max_ahead=1`` turns this off.

    ``simulated=True`` is for the simulator (lbbsp.sim), which shows an :class:`~lbbsp.policies.OraclePolicy` the
    truth before each decision and charges backup workers' dropped gradients: it lets the oracle through, which a
    coordinator of a job refuses, and backup workers without the warning that a job runs them as plain BSP.
    """

    #: Each worker's status line (``lbbsp status``) is written at most this often, and at the first decision, when a
    #: poll finds nothing to decide (the coordinator is idle) and when it stops serving: building and writing 1,024 of
    #: them took 5-8 ms, a fifth to a quarter of its whole time per decision at that size (its pace), for a table a
    #: person reads. The decision log gets every one.
    STATUS_EVERY_S = 1.0

    def __init__(self, store: Store, config: JobConfig, policy: Policy | None = None, *,
                 max_ahead: int = MAX_AHEAD, simulated: bool = False) -> None:
        config = _job_config(config)
        # CoordinatorProcess takes a URL, this a Store: an easy mix-up
        store = _store(store, config.job, "Store.from_url(url, job), or CoordinatorProcess(url, config)")
        self.max_ahead = checked_max_ahead(max_ahead, config.job)
        self.policy = policy if policy is not None else LBBSPPolicy(AutoCapacityModel(horizon=config.lag))
        self._guarded = GuardedPolicy(self.policy, config)  # checks the policy, before the job is registered
        if not simulated:
            _check_outside_simulator(self.policy, config)
        # whether GPU workers' reports were seen by a policy whose model sets no memory caps (the equal split needs none)
        self._told_uncapped = simulated or isinstance(self.policy, BSPPolicy)
        self.store = store
        self.config = store.register(config)
        if not simulated and (evicts := store.eviction_policy()) is not None:
            log.warning("job %s: this Redis evicts keys when it is full (maxmemory-policy %s): an evicted split or "
                        "claim costs the workers a wait of assignment_timeout_s and a fallback; give lbbsp a Redis "
                        "with maxmemory-policy noeviction", config.job, evicts)
        self._renewed = time.monotonic()  # when this coordinator last renewed the job's TTL (register, each decision)
        self.decisions_made = 0
        self._identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._next_heartbeat = 0.0
        self._warned_about: str | None = None
        self._outage_since: float | None = None
        self._next_outage_log = 0.0
        self._repeats = _Repeats()  # failed steps, see _failed
        self._ready_repeats = _Repeats()  # iterations queued that no worker ran, see _out_of_line
        self._decided_from: dict[int, bytes] = {}  # the latest iterations decided from: worker 0's report (_repeated)
        self._repeats_seen = _Repeats(" ({} times)")  # iterations queued again, see _repeated
        self._rejections: dict[tuple[str | None, str], _Repeats] = {}  # rejected reports by worker and check (_rejected)
        self._expired_after: int | None = None  # decisions made when the job's keys last expired, see _put_back
        self._expiries = 0  # how often they expired since then
        #: How many iterations the next decision covers: 1 while the coordinator keeps up with the workers' steps.
        self.ahead = 1
        self._written_through = self.config.lag - 1  # the latest iteration whose split this coordinator wrote
        self._forgotten_through: int | None = None  # the latest iteration whose keys it deleted
        self._busy_s: deque[float] = deque(maxlen=_PACE_WINDOW)  # its time per decision, learning included
        self._compute_s: deque[float] = deque(maxlen=_PACE_WINDOW)  # the slowest worker's compute per iteration
        self._interval_s: deque[float] = deque(maxlen=_PACE_WINDOW)  # wall time per iteration between decisions
        self._previous: tuple[int, float] | None = None  # the iteration of the previous decision, and its start
        self._next_pace_log = 0.0
        self._written: deque[Assignment] = deque(maxlen=2 * (self.config.lag + self.max_ahead))  # maybe not read yet
        # the splits of the latest iterations: a worker that fell back (agreed, Redis unusable) used one of them
        self._recent: deque[tuple[int, ...]] = deque([self.config.initial_sizes()], maxlen=_LOOK_BACK)
        self._claim_seen: str | None = None  # the other coordinator's claim found last, and when (_heartbeat)
        self._claim_seen_at = 0.0
        self._measured: dict[int, float] = {}  # each worker's latest measured throughput (_record)
        self._drops, self._next_drop_log = 0, 0.0  # reports far below their worker's previous one (_warn_dropped)
        self._next_status = 0.0  # when the workers' status lines are next written (_record)
        self._unwritten: tuple[Assignment, Decision, list[Report]] | None = None  # the latest ones not written
        self._predicted: tuple[float, ...] | None = None  # the latest predictions a decision carried (_record)
        stored = store.decision_count()
        if stored:
            # said for a restart within the run too (CoordinatorProcess's after a crash, an operator's): carry on
            log.warning("job %s already has %d decisions in this Redis: resuming it, and reusing its stored "
                        "assignments (right for a coordinator restarted during the run); for a new run, use a new job "
                        "name, or `lbbsp forget` the old one", self.config.job, stored)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()  # two start() calls at once had started two threads sharing one policy

    @property
    def failed_decisions(self) -> int:
        """Decisions whose policy failed or broke the job's rules: each kept the split in force (logged)."""
        return self._guarded.failures

    # -- one step ---------------------------------------------------------------------------------------
    def step(self, timeout_s: float = 1.0) -> Outcome | None:
        """Wait up to ``timeout_s`` for an iteration whose reports are all in, and decide the next one."""
        iteration = self.store.next_ready(_real(timeout_s, "timeout_s", 0.0, 1e6, "seconds > 0", lo_open=True))
        if iteration is None:
            return None
        again = iteration in self._decided_from
        queued = [iteration, *self.store.drain_ready()] if self.ahead > 1 or again else [iteration]
        if any(k in self._decided_from for k in queued):
            queued = [k for k in queued if k not in self._repeated(set(queued))]
            if not queued:
                return None
        # behind the workers, the iterations queued meanwhile are covered by the newest that the workers ran; the
        # first lag run the initial split, which a worker may know without reading its key
        later = [k for k in queued if k >= self.config.lag]
        assigned = dict(zip(later, self.store.assigned(later))) if later else {}
        ran = [k for k in queued if 0 <= k < self.config.lag or assigned.get(k, False)]
        if len(ran) < len(queued):
            self._out_of_line(sorted(set(queued) - set(ran)))
        return self.decide(max(ran)) if ran else None

    def _out_of_line(self, iterations: list[int]) -> None:
        """Warn (at most every 10 s for the same entries) of iterations queued as complete that no worker can
        have run: negative, or with no assignment, which each worker reads before it runs an iteration. Deciding from
        one far ahead (a report posted out of line, a number pushed on the ready list) had deleted the
        assignments of the 100 iterations before it, some still to be read, and the workers' fallbacks then
        disagreed with the splits some had read. Ones behind the job's latest decision ran long ago: a coordinator
        paused while holding them finds their keys deleted by another one, and is told so."""
        shown = ", ".join(str(k) for k in iterations[:5]) + (" ..." if len(iterations) > 5 else "")
        if self._ready_repeats.note(shown) is None:
            return
        latest = self._latest_decided()
        if latest is not None and 0 <= min(iterations) <= max(iterations) < latest:  # ran long ago, keys deleted since
            log.warning("job %s: iterations %s, queued as complete, are behind the job's latest decision (from "
                        "iteration %d) and no longer stored: another coordinator decided on while this one was paused "
                        "or slow: not deciding from them", self.config.job, shown, latest)
            return
        log.warning("job %s: iterations %s are queued as complete (the %s list) but have no assignment: their "
                    "keys were deleted (a FLUSHALL or FLUSHDB, eviction), or no worker ran them (reports posted out "
                    "of line?): not deciding from them", self.config.job, shown, self.store.key("ready"))

    def _repeated(self, queued: set[int]) -> set[int]:
        """Those of ``queued`` that this coordinator decided from already, on the reports stored now (worker 0's the
        same): a worker posts each report once, and the one that completes an iteration queues it, so only a writer
        other than the job's workers queues one again (a new run's reports, after the old ones were deleted, are new
        ones). 200,000 pushes of one iteration had it decided 28,878 times while the workers fell back, and taken
        for a new run ("the workers' iterations went back")."""
        repeated = {k for k in queued if k in self._decided_from
                    and self.store.raw_report(k, 0) == self._decided_from[k]}
        if repeated and (count := self._repeats_seen.note(min(repeated))) is not None:
            log.warning("job %s: iteration(s) %s queued again as complete (the %s list), with the reports already "
                        "decided from: only a writer other than the job's workers queues one twice; not deciding "
                        "from them again%s", self.config.job, ", ".join(map(str, sorted(repeated)[:5])),
                        self.store.key("ready"), count)
        return repeated

    def _latest_decided(self) -> int | None:
        """The iteration the job's latest recorded decision was made from (by any coordinator), None if unknown."""
        try:
            latest = json.loads(self.store.decisions(1)[0])["from_reports_of"]
        except (IndexError, ValueError, TypeError, KeyError, RecursionError):  # RecursionError: deeply nested JSON
            return None
        return latest if isinstance(latest, int) else None

    def decide(self, iteration: int) -> Outcome:
        """Decide the assignment of ``iteration + lag`` from the stored reports of ``iteration``; running
        :attr:`ahead`, also those of the iterations after it, and of any before it that no decision covers."""
        started = time.perf_counter()
        if self._previous is not None and iteration < self._previous[0]:
            self._went_back(self._previous[0], iteration)
        targets = self._targets(iteration)
        reports, rejected = self._parse_reports(iteration)
        if not self._told_uncapped:
            self._told_uncapped = _warn_uncapped(self.config.job, self.policy, reports)
        decision, assignment = self._guarded.decide(targets[0], self._in_force(targets[0] - 1).sizes, reports)
        covered = [assignment, *(dataclasses.replace(assignment, iteration=t) for t in targets[1:])]
        written = self.store.publish_all(covered, decided_from=iteration)
        decision_s = time.perf_counter() - started
        self._guarded.learn(iteration)  # the split is out: the workers need not wait for this
        learn_s = time.perf_counter() - started - decision_s
        # the ones written are kept for a republish, also where the first was refused: running far ahead, one
        # decision may cover iterations past those another coordinator deleted
        self._written.extend(a for a, w in zip(covered, written) if w)
        self._written_through = max(self._written_through, targets[-1])
        if written[0] is None:
            log.warning("job %s: the keys of iteration %d were deleted while this coordinator decided it from the "
                        "reports of iteration %d (paused or slow, while another decided on and cleaned up): not writing "
                        "or logging its split", self.config.job, targets[0], iteration)
            return Outcome(iteration, assignment, False, decision_s, rejected, learn_s, through=targets[-1])
        if not written[0]:
            assignment = self._assignment(targets[0])
        self._recent.append(assignment.sizes)
        try:
            self._record(iteration, assignment, written[0], decision, reports, rejected, decision_s, learn_s,
                         targets[-1])
        finally:  # the split is written and the workers use it: the decision happened, even where its record failed
            self._forget(iteration)
            self.decisions_made += 1
            self._pace(iteration, started, reports)
        return Outcome(iteration, assignment, written[0], decision_s, rejected, learn_s, through=targets[-1])

    def _went_back(self, before: int, iteration: int) -> None:
        """Start the written and deleted iterations afresh, and say so, where the workers' iterations went back (the
        ready list is in order otherwise): kept from the run before, they had made each decision write its own
        iteration only (no running ahead: the workers waited for every decision) and delete no old keys, until the
        new run passed the old one's last iteration."""
        log.warning("job %s: the workers' iterations went back from %d to %d (a new run under this job name, one "
                    "resumed from an earlier checkpoint, or an iteration number that restarts each epoch): deciding on "
                    "from there; give a new run a new job name, since the old run's splits still stored are used "
                    "again", self.config.job, before, iteration)
        self._written_through, self._forgotten_through = self.config.lag - 1, None
        self._written.clear()  # the old run's splits: a republish had written them back for the new run to use

    def _targets(self, iteration: int) -> list[int]:
        """The iterations the decision from ``iteration`` writes: ``iteration + lag`` and the next ``ahead - 1``,
        from the first this coordinator has not written (those of reports it skipped while behind included:
        the workers, past ``iteration``, need them next); only ``iteration + lag`` where all are written (the
        stored split then stands, as a worker's fallback does)."""
        own = iteration + self.config.lag
        first, last = max(iteration + 1, self._written_through + 1), own + self.ahead - 1
        return list(range(first, last + 1)) if first <= last else [own]

    def _forget(self, iteration: int) -> None:
        """Delete the keys of the iterations up to ``iteration - ITERATIONS_KEPT``: every worker is past them,
        and kept for ttl_s they filled Redis. The first clean-up deletes all the earlier ones still stored too (left
        by a coordinator that crashed, or before a restart, which had stayed for their TTL): from where the job's
        clean-ups stopped, or from 0 where none did or they reach past this one's (its iterations went back); each
        at most CLEAN_UP_REACH iterations."""
        last = iteration - ITERATIONS_KEPT
        if last < 0:
            return
        if self._forgotten_through is not None:
            first = self._forgotten_through + 1
        else:
            through = self.store.forgotten_through()
            first = through + 1 if through is not None and through < last else 0
        first = max(first, last - CLEAN_UP_REACH + 1)
        if last >= first:
            self.store.forget_iterations(first, last)
            self._forgotten_through = last

    def _pace(self, iteration: int, started: float, reports: list[Report]) -> None:
        """Set :attr:`ahead` from the medians of this coordinator's time per decision and of the step: the longer
        of the iterations' slowest compute and the wall time per iteration the workers advanced by between two
        decisions (which holds what compute leaves out, loading say, and is the coordinator's own pace where
        the workers wait for it). 1 while a decision fits in the slack ``lag`` gives (``lag - 1`` steps, at lag 1
        one, with a fifth to spare); otherwise enough iterations that the next decision is written before the
        workers reach the end of this one's, with a step to spare."""
        self._busy_s.append(time.perf_counter() - started)
        if reports:
            self._compute_s.append(max(r.compute_s for r in reports))
        if self._previous is not None and iteration > self._previous[0]:
            self._interval_s.append((started - self._previous[1]) / (iteration - self._previous[0]))
        self._previous = (iteration, started)
        if self.max_ahead == 1 or len(self._busy_s) < 3 or not (self._compute_s or self._interval_s):
            return
        step = max(statistics.median(s) for s in (self._compute_s, self._interval_s) if s)
        busy, lag = statistics.median(self._busy_s), self.config.lag
        keeps_up = busy <= 0.8 * max(lag - 1, 1) * step  # at lag 1 every step waits for its decision anyway
        ahead = 1 if keeps_up else min(self.max_ahead, max(2, math.ceil(2 * busy / max(step, 1e-6)) - lag + 2))
        if ahead != self.ahead and time.monotonic() >= self._next_pace_log:
            self._next_pace_log = time.monotonic() + 60.0
            if ahead > 1:
                log.info("job %s: a decision takes %.1f ms and the workers' steps %.1f ms, so each decision now "
                         "covers %d iterations (the workers would otherwise wait for each split)", self.config.job,
                         busy * 1e3, step * 1e3, ahead)
            else:
                log.info("job %s: the coordinator keeps up with the workers again (a decision %.1f ms, a step %.1f "
                         "ms): one iteration a decision", self.config.job, busy * 1e3, step * 1e3)
        self.ahead = ahead

    def _parse_reports(self, iteration: int) -> tuple[list[Report], list[Rejection]]:
        reports: list[Report] = []
        rejected: list[Rejection] = []
        assigned = self._sizes_used(iteration)
        raw = self.store.reports(iteration)
        if (first := raw.get(b"0")) is not None:  # what tells this iteration queued again from a new run's (_repeated)
            self._decided_from[iteration] = first
            for old in list(self._decided_from)[:-_LOOK_BACK]:
                del self._decided_from[old]
        for raw_worker, payload in raw.items():
            worker = raw_worker.decode(errors="replace")[:32]
            try:
                report = Report.from_json(payload, job=self.config.job, num_workers=self.config.num_workers)
                if str(report.worker) != worker or report.iteration != iteration:
                    raise ProtocolError(f"report for worker {report.worker}, iteration {report.iteration} "
                                        f"was posted under worker {worker!r}, iteration {iteration}",
                                        field="worker", job=self.config.job)
                self._check_samples(report, assigned)
            except ProtocolError as exc:
                self._rejected(worker, iteration, exc)
                rejected.append(Rejection(worker, str(exc)))
                continue
            reports.append(report)
        reports.sort(key=attrgetter("worker"))  # Redis hash order varies: the same reports, the same split
        return reports, rejected

    def _rejected(self, worker: str, iteration: int, exc: ProtocolError) -> None:
        """Log a rejected report: at once where it is the worker's first, or failed another check than its earlier
        ones, the same again only every 10 s with a count (:class:`_Repeats`, one per worker and check): a worker
        whose every report was refused had a warning at every decision. The fields that name no worker of the job
        (only a writer past POST_REPORT's check makes one) share one, and are logged quoted: thousands of them had a
        line each, and a limiter each for good, and a newline in one had made a log line of its own. The decision
        log records the first ones (_RECORDED_REJECTIONS)."""
        valid = _worker_field(worker, self.config.num_workers)
        repeats = self._rejections.setdefault((worker if valid else None, _failure_site(exc)),
                                              _Repeats(_REJECTED_AGAIN))
        if (told := repeats.note(exc)) is not None:
            log.warning("job %s: rejected report of worker %s for iteration %d: %s%s", self.config.job,
                        worker if valid else repr(worker), iteration, exc, told)

    def _sizes_used(self, iteration: int) -> tuple[int, ...] | None:
        """The sizes the workers computed at ``iteration``, where known: the assignment this coordinator wrote for
        it, the initial split, or the stored one; None if Redis no longer holds it."""
        for written in self._written:
            if written.iteration == iteration:
                return written.sizes
        if iteration < self.config.lag:
            return self.config.initial_sizes()
        stored = self._stored(iteration)
        return stored.sizes if stored is not None else None

    def _check_samples(self, report: Report, assigned: tuple[int, ...] | None) -> None:
        """Raise unless ``report`` claims at most the samples its worker was assigned (the global batch where the
        assignment is not known), or had in one of the latest splits (workers that could not reach Redis fall
        back, agreed, to the split they last had): one report of 10M samples in a global batch of 400 gave its
        worker nearly the whole batch for 20 iterations under EWMA. A federated client's samples count its
        local steps, so its bound is that many times larger; only the protocol's holds where no model says how many."""
        known = assigned is not None
        most = assigned[report.worker] if assigned is not None else self.config.global_batch
        if report.samples <= most:
            return
        steps = self._local_steps(report)
        if steps is None or report.samples <= steps * most:
            return
        lately = max(sizes[report.worker] for sizes in self._recent)
        if report.samples > steps * lately:
            bound = (f"the {most} assigned to worker {report.worker} (or its {lately} in the splits of the last "
                     f"{len(self._recent)} iterations, which a fallback uses)" if known else f"the global batch {most}")
            if steps > 1 or worker_kind(report) == "fl":
                bound = (f"{steps} local step(s) x {bound}: where the clients take more local steps, give the model "
                         "local_steps (lbbsp coordinator --local-steps N, or FLClientModel(local_steps=N))")
            raise ProtocolError(f"{report.samples} samples, more than {bound}", field="samples", job=self.config.job,
                                worker=report.worker, iteration=report.iteration)

    def _local_steps(self, report: Report) -> int | None:
        """How many samples ``report`` may count per sample assigned: a federated client's local steps, as the
        policy's client model takes them, None where no model says (a policy without one, or a model of the user's
        own), and 1 for any other worker."""
        model = getattr(self.policy, "model", None)
        if isinstance(model, FLClientModel):
            return model.local_steps
        if not isinstance(model, AutoCapacityModel):
            return None if worker_kind(report) == "fl" else 1
        kind = ((model.kinds or {}).get(report.worker) or getattr(model, "kind_", {}).get(report.worker)
                or worker_kind(report))
        if kind != "fl":
            return 1
        client = getattr(model, "models_", model.models or {}).get("fl", FLClientModel())  # unfitted: the default's
        return client.local_steps if isinstance(client, FLClientModel) else None

    def _assignment(self, iteration: int) -> Assignment:
        """The stored assignment of ``iteration`` (validated), or the initial split if none is stored."""
        return self._stored(iteration) or self.config.initial_assignment(iteration)

    def _in_force(self, iteration: int) -> Assignment:
        """The split the workers will use at ``iteration``: its stored assignment, or, where none is stored
        yet (its reports were lost, so no decision will come), the latest stored one before it, as the
        workers' fallback rule gives them; the initial split if none is stored within ``_LOOK_BACK``."""
        for earlier in range(iteration, max(iteration - _LOOK_BACK, -1), -1):
            stored = self._stored(earlier)
            if stored is not None:
                return stored
        return self.config.initial_assignment(iteration)

    def _stored(self, iteration: int) -> Assignment | None:
        """The stored assignment of ``iteration`` (validated), or None."""
        if self._written and self._written[-1].iteration == iteration:
            return self._written[-1]  # what this coordinator wrote, once: no need to read it back
        try:  # a key of another type than lbbsp writes there is a ProtocolError too (Store.get_assignment)
            raw = self.store.get_assignment(iteration)
            if raw is not None:
                return self.config.stored_assignment(raw, iteration)
        except ProtocolError as exc:
            log.error("job %s: stored assignment of iteration %d is invalid: %s", self.config.job, iteration, exc)
        return None

    def _record(self, iteration: int, assignment: Assignment, written: bool, decision: Decision,
                reports: list[Report], rejected: list[Rejection], decision_s: float, learn_s: float,
                through: int) -> None:
        measured, dropped = self._measured, []
        for report in reports:
            if now := report.throughput:  # a measurement (0.0: nothing measured)
                if now * _DROP < measured.get(report.worker, 0.0):
                    dropped.append((report.worker, now, measured[report.worker]))
                measured[report.worker] = now
        record = {
            "iteration": assignment.iteration, "through": through, "from_reports_of": iteration,
            "sizes": list(assignment.sizes),
            "policy": assignment.policy, "reason": assignment.reason, "fallback": assignment.fallback,
            "written_by_coordinator": written, "decision_ms": round(decision_s * 1e3, 3),
            "learn_ms": round(learn_s * 1e3, 3),
            "rejected": [{"worker": r.worker, "error": r.error} for r in rejected[:_RECORDED_REJECTIONS]],
            "rejected_more": max(len(rejected) - _RECORDED_REJECTIONS, 0), "time": time.time(),
        }
        self.store.record_decision(json.dumps(record))
        self._renewed = time.monotonic()
        self._predicted = decision.predicted_throughput or self._predicted
        self._unwritten = (assignment, decision, reports)
        if self._renewed >= self._next_status:
            self._write_statuses()
        if dropped:
            self._warn_dropped(iteration, dropped)

    def _write_statuses(self) -> None:
        """Write each worker's status line (its size, predicted and measured throughput, times, kind) from the
        latest decision, if not written yet; none past 4,096 workers. The prediction is the latest the coordinator
        holds: the decision's, else its policy's model's now (per-epoch within an epoch, leader-straggler: their
        decisions carry none, and every row had shown none), else an earlier decision's; ``predicts`` is false
        where the policy has no model and made none, so that ``lbbsp status`` says so rather than show it missing."""
        if self._unwritten is None:
            return
        assignment, decision, reports = self._unwritten
        self._unwritten, self._next_status = None, time.monotonic() + self.STATUS_EVERY_S
        if self.config.num_workers > 4096:
            return
        by_worker = {r.worker: r for r in reports}
        model = getattr(self.policy, "model", None)
        predicted = decision.predicted_throughput or self._model_predictions(model) or self._predicted
        predicts = "true" if predicted is not None or isinstance(model, CapacityModel) else "false"
        # the kind the automatic model routes each worker as (one of KINDS, plain names; a worker whose kind is still
        # open, by its pin or peers, had shown none), shown by status
        routed = model.routed_kinds(range(len(assignment.sizes))) if isinstance(model, AutoCapacityModel) else []
        kinds = dict(enumerate(routed))
        statuses = {}
        for worker, size in enumerate(assignment.sizes):  # a template: json.dumps per worker costs 6 ms at 1,024
            report = by_worker.get(worker)
            statuses[worker] = _STATUS % (
                assignment.iteration, size, _number(predicted[worker] if predicted is not None else None), predicts,
                _number(report.throughput if report is not None else None),
                _number(report.compute_s if report else None),
                _number(report.wait_s if report else None), f'"{kinds[worker]}"' if worker in kinds else "null")
        self.store.record_statuses(statuses)

    def _model_predictions(self, model: object) -> tuple[float, ...] | None:
        """``model``'s predicted throughput of each worker now, for the status lines; None where it is no capacity
        model, has seen no report yet, or fails (a decision that asks it logs that: the status lines do not)."""
        if not isinstance(model, CapacityModel):
            return None
        try:
            return tuple(predicted_throughput(model, np.arange(self.config.num_workers)).tolist())
        except Exception:  # noqa: BLE001  (the status lines are written after the split, and must not fail on it)
            return None

    def _warn_dropped(self, iteration: int, dropped: list[tuple[int, float, float]]) -> None:
        """Say, at most once a minute, which workers measured under 1/_DROP of their previous throughput: valid
        reports, and the models act on them, but one such report (a stall, or a timer that jumped) takes
        samples off its worker for several iterations, which the split alone does not explain. Every worker at
        once is a pause of the whole job (torch.compile recompiling on every rank as the sizes first change),
        which moves the split only as far as their drops differ."""
        self._drops += len(dropped)
        if time.monotonic() < self._next_drop_log:
            return
        self._next_drop_log = time.monotonic() + 60.0
        shown = "; ".join(f"worker {w}: {now:.3g} samples/s, after {before:.3g}" for w, now, before in dropped[:3])
        if len(dropped) == self.config.num_workers:
            why = ("every worker at once: a pause of the whole job (a recompile, as torch.compile's when the batch "
                   "sizes first change; a checkpoint; a garbage collection) rather than a straggler? The split "
                   "follows the workers' relative speeds, so it moves only as far as their drops differ, until they "
                   "measure again")
        else:
            why = ("a stall (preempted, swapped out, paused) or a timer that jumped? The model gives such a worker few "
                   "samples until it measures again")
        log.warning("job %s, iteration %d: %s%s (%d such report(s) so far): under 1/%d of the previous measurement, "
                    "%s", self.config.job, iteration, shown, f" and {len(dropped) - 3} more" if len(dropped) > 3 else "",
                    self._drops, _DROP, why)

    # -- running ----------------------------------------------------------------------------------------
    def claim(self) -> str | None:
        """Claim the job for this coordinator before it serves, where no coordinator claims it (in one step with the
        check); else the identity of the one that does, and nothing is claimed. ``lbbsp coordinator`` refuses to start
        beside another that way: checked apart, two started together had both found the job free."""
        return self.store.claim_if_free(self._identity, CLAIM_S)

    def run(self, *, max_decisions: int | None = None, poll_s: float = 0.5) -> None:
        """Serve until :meth:`stop` (or ``max_decisions``); survives Redis outages by retrying."""
        if max_decisions is not None:
            _integer(max_decisions, "max_decisions", 0, None, self.config.job)
        poll_s = _real(poll_s, "poll_s", 0.0, 1e6, "seconds > 0", lo_open=True)
        try:
            self._serve(max_decisions, poll_s)
        finally:
            with contextlib.suppress(ConfigError, *REDIS_FAILURES):  # ConfigError: a key of another type at `workers`
                self._write_statuses()  # the last decision's, where the once-a-second limit held them back
            with contextlib.suppress(*REDIS_FAILURES):
                self.store.release_coordinator(self._identity)

    def _serve(self, max_decisions: int | None, poll_s: float) -> None:
        while not self._stop.is_set():
            if max_decisions is not None and self.decisions_made >= max_decisions:
                return
            try:
                self._heartbeat()
                if self.step(poll_s) is None:  # idle: the rows STATUS_EVERY_S held back, if any
                    self._write_statuses()
            except Exception as exc:  # noqa: BLE001  (whatever one step hits, the coordinator keeps serving)
                if unusable(exc):  # a full disk had logged tracebacks twice a second
                    self._outage(exc)
                    self._stop.wait(0.05)
                    self._republish()
                    continue
                self._failed(exc)
                self._stop.wait(0.05)
            if self._outage_since is not None:
                lasted = time.monotonic() - self._outage_since
                if lasted >= _OUTAGE_GRACE_S:  # an outage that was logged
                    log.warning("job %s: Redis is back after %.1fs; serving again", self.config.job, lasted)
                self._outage_since = None

    def _outage(self, exc: Exception) -> None:
        """Log an outage once it has lasted ``_OUTAGE_GRACE_S``, then every 10 s, not at every retry. The grace
        keeps quiet the coordinator of a training process that just ended: its embedded Redis went first, and
        "Redis unavailable; retrying" under the process's own traceback read as the cause."""
        now = time.monotonic()
        if self._outage_since is None:
            self._outage_since, self._next_outage_log = now, now + _OUTAGE_GRACE_S
        elif now >= self._next_outage_log:
            self._next_outage_log = now + 10.0
            log.warning("job %s: Redis unavailable for %.0fs (%s); retrying", self.config.job, now - self._outage_since,
                        exc)

    def _failed(self, exc: Exception) -> None:
        """Log a failed step with its traceback; the same failure again (a key of the wrong type that someone
        left in the job's keys fails every step) only every 10 s, with a count (:class:`_Repeats`)."""
        if (repeats := self._repeats.note(exc)) is not None:
            log.exception("job %s: coordinator step failed%s; still serving", self.config.job, repeats)

    def _heartbeat(self) -> None:
        """About once a second: put the job back if Redis lost it, renew this coordinator's claim on the job,
        and warn if another one claimed it (two coordinators take turns at the iterations, so each model
        learns from half of them)."""
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + 1.0
        if not self.store.has_config():
            self._put_back()
        elif lost := self._lost_splits():
            # the job's settings kept, some latest splits lost: a restart from a snapshot older than them, a failover
            # to a replica behind, eviction. Only a lost config had been noticed, and a worker that had not read a
            # lost split waited out assignment_timeout_s and fell back, unlike the workers that had read it.
            log.warning("job %s: %d assignments this coordinator wrote are gone from Redis, the job's settings kept "
                        "(a restart from an older snapshot, a failover, eviction?): writing them again",
                        self.config.job, len(lost))
            self._republish(lost)
        other = self.store.claim_coordinator(self._identity, ttl_s=CLAIM_S)
        # A claim found once may be a stopped coordinator's, left to expire (a crash leaves it up to 5 s); one
        # found again, at any later heartbeat, has overwritten this coordinator's claim in between, so it is alive.
        # Not only at the next heartbeat: one whose heartbeats came at about half this one's rate was found only at
        # every other one, and never warned about.
        if other is not None:
            if other == self._claim_seen and other != self._warned_about:
                log.warning("another coordinator (%s) is serving job %s too: they split the iterations between them "
                            "and each model learns from only part of them; stop one", other, self.config.job)
                self._warned_about = other
            self._claim_seen, self._claim_seen_at = other, now
        elif now - self._claim_seen_at > CLAIM_S:  # gone: warn again if it comes back
            self._claim_seen = self._warned_about = None

    def _put_back(self) -> None:
        """Register the job again and republish its latest splits, its keys gone from Redis; with a warning, but where
        they expire again before the next decision, at debug level only: a coordinator left running after its job had
        warned every ttl_s, for days. They are put back all the same: workers that paused for longer than ttl_s (an
        evaluation, a checkpoint) need the job's settings and splits when they come back, and a coordinator cannot
        tell such a pause from a job that is over."""
        now = time.monotonic()  # when they were found gone: by an earlier reading, keys that expired since were a flush
        idle, ttl = now - self._renewed, self.config.ttl_s
        # expired, where nothing renewed the TTL for ttl_s (less a second: Redis started it a round trip earlier)
        expired = idle > ttl - 1
        if expired and self._expired_after == self.decisions_made:  # warned of already, in this stretch without any
            self._expiries += 1
            log.debug("job %s: its keys expired again, %d times since the last decision: registering the job again "
                      "and republishing its last %d assignments", self.config.job, self._expiries, len(self._written))
        else:
            why = (f"expired: no decision for {idle:.0f}s, past the job's ttl_s ({ttl}s); for pauses that long, raise "
                   "ttl_s, or, if the job is over, stop this coordinator; until the next decision, their expiries "
                   "are logged at debug level only" if expired else
                   "restarted without persistence, flushed, or evicted")
            log.warning("job %s's keys are gone from Redis (%s): registering the job again and republishing its last "
                        "%d assignments", self.config.job, why, len(self._written))
            if expired:
                self._expired_after, self._expiries = self.decisions_made, 1
        self.store.register(self.config)
        self._renewed = now
        self._republish()

    def _lost_splits(self) -> list[Assignment]:
        """The assignments this coordinator wrote last whose keys Redis no longer holds, but for those a clean-up
        deleted (at or behind its watermark: every worker had run them). One round trip while none is lost."""
        held = self.store.assigned([a.iteration for a in self._written])
        if all(held):
            return []
        through = self.store.forgotten_through()
        return [a for a, kept in zip(self._written, held) if not kept and (through is None or a.iteration > through)]

    def _republish(self, assignments: Sequence[Assignment] | None = None) -> None:
        """Write the assignments that workers may still read again (write-once; by default the last written), in case
        Redis lost them: a worker that finds none would write its fallback, and split from one that had read the
        decision. Any Redis error is let go: it runs after an outage, unguarded, where a refusal (out of memory,
        read-only) had ended serving."""
        try:
            again = list(self._written) if assignments is None else list(assignments)
            if again:  # unguarded: a restart that kept older data, a watermark too, lost the latest splits
                self.store.publish_all(again)
        except REDIS_FAILURES:
            pass

    def start(self, timeout_s: float = 5.0) -> Coordinator:
        """Serve in a daemon thread of this process (still serving if it does already). A thread that
        :meth:`stop` left running, stuck in a call to a stalled Redis, is waited for up to ``timeout_s``;
        an :class:`LBBSPError` if it is still running then: two threads would share one policy."""
        with self._starting:
            if self._thread is not None and self._thread.is_alive():
                if not self._stop.is_set():
                    return self
                self._thread.join(timeout_s)
                if self._thread.is_alive():
                    raise LBBSPError(f"the coordinator's previous thread has not stopped within {timeout_s}s (a Redis "
                                     "call stalled?): call start() again later", job=self.config.job)
            self._stop.clear()
            self._thread = threading.Thread(target=self.run, name=f"lbbsp-coordinator-{self.config.job}",
                                            daemon=True)
            self._thread.start()
            return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving, waiting up to ``timeout_s`` for the thread to end; safe to call twice or before
        :meth:`start`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._thread = None


#: Why a worker that joins an external coordinator (``coordinator=False``) refuses a policy of its own.
EXTERNAL_POLICY = ("policy= is the coordinator's: with an external one (coordinator=False), name the policy by its "
                   "--policy and --model flags")
#: Why such a worker refuses a max_ahead of its own.
EXTERNAL_MAX_AHEAD = ("max_ahead= is the coordinator's: with an external one (coordinator=False), set its "
                      "--max-ahead")


def checked_process_policy(policy: Policy | None, config: JobConfig) -> None:
    """The checks :class:`CoordinatorProcess` makes of ``policy`` before its child starts, for the integrations to
    make on every worker: a ConfigError for a policy that is none, is the simulator's oracle, pins worker kinds
    outside the job, or cannot be pickled to the child (on rank 0 alone, the other ranks had gone on and failed later,
    in gloo's words)."""
    checked_policy(policy, config.job)
    _check_for_job(policy, config, warn=False)  # the child's coordinator warns
    _check_outside_simulator(policy, config, warn=False)
    _refers_to_main(policy, config.job)


class CoordinatorProcess:
    """A coordinator in a child process of its own: no GIL or CPU core shared with a training worker.

    ``CoordinatorProcess(url, config, policy)`` starts serving at once; :meth:`stop` ends it; ``max_ahead`` is
    :class:`Coordinator`'s. The child drops any CPU pinning it inherited, so the kernel can run it beside
    whichever worker is idle, and freezes its heap once it is set up (:func:`freeze_heap`). A child that dies
    before :meth:`stop` (the OOM killer, a stray ``kill -9``) is started again, with the policy as given (its
    model learns afresh) and resuming from the job's state in Redis, at most ``RESTARTS`` times in 5 minutes:
    without a coordinator every step would wait ``assignment_timeout_s`` and fall back, to the end of training.
    """

    #: Restarts of a dead child allowed within 5 minutes (:class:`RestartBudget`); then it is left dead, with an error.
    RESTARTS = 3

    def __init__(self, url: str, config: JobConfig, policy: Policy | None = None, *,
                 max_ahead: int = MAX_AHEAD, start_timeout_s: float = 60.0) -> None:
        config = _job_config(config)
        max_ahead = checked_max_ahead(max_ahead, config.job)
        checked_policy(policy, config.job)
        _check_for_job(policy, config, warn=False)  # the child's coordinator warns; _spawn checks the pickling
        _check_outside_simulator(policy, config, warn=False)
        if multiprocessing.current_process().daemon:
            raise LBBSPError("a daemonic process cannot start the coordinator process: start this worker with "
                             "daemon=False, or run Coordinator(store, config).start() in a thread", job=config.job)
        with answering(url, config.job, socket_timeout_s=PROBE_TIMEOUT_S):  # a Redis that accepts and never
            pass  # answers had held the constructor 30 s (5 s tries, then a ping) before its StoreUnavailable
        with Store.from_url(url, config.job, ttl_s=config.ttl_s) as store:
            store.register(config)  # a mismatch with the job's stored settings is raised here, not in the child
        self._args = (url, config.to_json(), policy, max_ahead, ParentLogging.of_this_process())
        self._job, self._start_timeout_s = config.job, start_timeout_s
        self._stopping = threading.Event()
        # a restart and stop() take turns: stop() never leaves a new child running. Reentrant: a signal handler may
        # call stop() while the thread it interrupted is inside stop()
        self._lock = threading.RLock()
        self.restarts = 0
        self._process = self._spawn()
        atexit.register(self._stopping.set)  # runs before multiprocessing ends its children: no restart then
        threading.Thread(target=self._supervise, name=f"lbbsp-coordinator-watch-{config.job}", daemon=True).start()

    def _spawn(self) -> multiprocessing.process.BaseProcess:
        """Start a child serving the job and wait until it serves; a clear LBBSPError if it does not."""
        policy = self._args[2]
        context = multiprocessing.get_context("spawn")
        reruns_main = _refers_to_main(policy, self._job)
        try:  # a full /dev/shm had ended the restart watch's thread with its OSError: no restart ever again
            ready = context.Event()  # (a semaphore, in /dev/shm)
            process = context.Process(target=_serve, args=(*self._args, ready), name=f"lbbsp-coordinator-{self._job}",
                                      daemon=True)
            with _main_not_rerun(rerun=reruns_main), signals_held():  # a child started whole, however it is stopped
                process.start()
        except OSError as exc:
            where = f" (its semaphores live in /dev/shm: free some room there; {SHM_IN_CONTAINERS})" if no_room(
                exc) else ""
            raise LBBSPError(f"cannot start the coordinator process: {exc.strerror or exc}{where}",
                             job=self._job) from exc
        deadline = time.monotonic() + self._start_timeout_s
        try:
            self._wait_ready(process, ready, deadline, reruns_main)
        except BaseException:  # Ctrl-C in the wait too: the child had served on, an orphan, as long as we lived
            _end(process, 5.0)
            raise
        return process

    def _wait_ready(self, process: multiprocessing.process.BaseProcess, ready: multiprocessing.synchronize.Event,
                    deadline: float, reruns_main: bool) -> None:
        """Wait until the child serves; a clear LBBSPError if it exits or does not serve by ``deadline``."""
        while not ready.wait(0.1):  # serving before training starts, or a clear error
            if not process.is_alive() or time.monotonic() > deadline:
                exited = not process.is_alive()
                _end(process, 5.0)
                guard = ("the policy's class is defined in the script itself, so the child runs the script's top "
                         "level to load it: guard the script's training with `if __name__ == \"__main__\":` and "
                         "start nothing at module level (a MultiWorkerMirroredStrategy there starts a server the "
                         "child cannot bind), or move the class into a module")
                if exited and process.exitcode == _EXIT_REDIS_UNUSABLE:
                    raise StoreUnavailable("the coordinator process could not start: Redis is unusable for now (down, "
                                           "stalled or refusing writes; its log says why)", job=self._job)
                if exited and process.exitcode is not None and process.exitcode < 0:  # killed: it left no traceback
                    raise LBBSPError(f"the coordinator process was killed as it started "
                                     f"({_how_it_ended(process.exitcode)})", job=self._job)
                if exited:
                    hint = f"; its traceback is above ({guard})" if reruns_main else "; its traceback is above"
                else:
                    hint = f"; {guard} (unguarded, the child trains instead of serving)" if reruns_main else ""
                raise LBBSPError(f"the coordinator process exited or did not start within {self._start_timeout_s}s "
                                 f"(exit code {process.exitcode}){hint}", job=self._job)

    def _supervise(self, poll_s: float = 0.5) -> None:
        """Start the child again when it died before :meth:`stop`, within the limit of ``RESTARTS``."""
        budget = RestartBudget()
        while not self._stopping.wait(poll_s):
            if self._process.is_alive():
                continue
            with self._lock:
                if self._stopping.is_set():
                    return
                if not budget.allow(self.RESTARTS):
                    log.error("the coordinator process of job %s died, or did not start again, %d times in 5 "
                              "minutes: not starting it again. The workers now keep the split before (the first step "
                              "waits assignment_timeout_s); start `lbbsp coordinator` for the job, with the same "
                              "settings and its Redis URL", self._job, self.RESTARTS + 1)
                    return
                if not budget.retrying:  # (the death was told before the try that failed)
                    log.warning("the coordinator process of job %s died (%s): starting it again; it resumes from the "
                                "job's state in Redis", self._job, _how_it_ended(self._process.exitcode))
                try:
                    self._process = self._spawn()
                except LBBSPError as exc:
                    # no room, no memory, a Redis unusable for now: it clears, unlike a crash. Counted, a Redis
                    # outage of a few seconds after a death had spent RESTARTS, and no coordinator ever came back
                    clears = isinstance(exc.__cause__, OSError) or isinstance(exc, StoreUnavailable)
                    log.error("could not start the coordinator process of job %s again: %s%s", self._job, exc,
                              budget.failed(clears))
                else:
                    self.restarts += 1
                    budget.started()
            if budget.retrying:
                self._stopping.wait(budget.retry_s)  # (not holding the lock, which stop() takes)

    @property
    def alive(self) -> bool:
        """Whether the coordinator's process is running (it may be between a death and its restart)."""
        return self._process.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving; safe to call twice."""
        self._stopping.set()
        with self._lock:  # waits for a restart under way: its child is stopped too
            _end(self._process, timeout_s)
        atexit.unregister(self._stopping.set)


def _how_it_ended(code: int | None) -> str:
    """A dead coordinator child's exit code, with what it tells: a signal's name, a SIGTERM (its handler ends the
    child cleanly, with 0), or an error."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        return f"exit code {code}, {name}" + (": the OOM killer, or a kill -9?" if code == -signal.SIGKILL else "")
    if code == 0:
        return "exit code 0: a SIGTERM stopped it"
    return f"exit code {code}: an error, its traceback above"


def _end(process: multiprocessing.process.BaseProcess, timeout_s: float) -> None:
    """Stop ``process`` (SIGTERM, then SIGKILL after ``timeout_s``) and reap it."""
    if process.is_alive():
        process.terminate()
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
    process.join()


#: Held by :func:`_main_not_rerun` around a child's start, so that no start saves, or reads, another one's hiding.
_MAIN_HIDDEN = threading.Lock()


@contextlib.contextmanager
def _main_not_rerun(*, rerun: bool) -> Iterator[None]:
    """Start a spawned child without running the parent's ``__main__`` again: spawn re-imports the main
    script, so a training script without an ``if __name__ == "__main__":`` guard would start training (and,
    under torchrun, join the process group) in the coordinator's child, and one with the guard would still
    import its framework there. Hiding the script's path for the start does it; a policy that refers to
    something defined in the script needs the script in the child to be unpickled, so then (``rerun``, from
    :func:`_refers_to_main`) it is re-run."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    # a restart on the watch thread beside a new CoordinatorProcess: the second had saved what the first had hidden,
    # and put it back last, leaving the script's __spec__ None for good (and a start that re-runs the script had found
    # it hidden)
    with _MAIN_HIDDEN:
        if rerun:
            yield
            return
        names = ("__file__", "__spec__")
        saved: dict[str, object] = {name: main.__dict__[name] for name in names if name in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__dict__["__spec__"] = None
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _refers_to_main(policy: Policy | None, job: str) -> bool:
    """Whether unpickling ``policy`` needs the main script: its class, or anything it holds, defined there
    (named ``__main__``, or ``__mp_main__`` in a process that multiprocessing itself spawned). A ConfigError naming
    the policy if it cannot be pickled at all: pickle's own words ("cannot pickle '_thread.lock' object") named
    neither the policy nor the way around it."""
    if policy is None:
        return False
    try:
        data = pickle.dumps(policy)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:  # ValueError: a ctypes pointer
        raise ConfigError(f"policy {type(policy).__name__} cannot be pickled to the coordinator's child process "
                          f"({exc}): keep no lock, lambda or open file in it, or serve it in a thread of this process "
                          "with Coordinator(store, config, policy).start()", job=job) from exc
    return b"__main__" in data or b"__mp_main__" in data


def _stop_when_orphaned(coordinator: Coordinator, parent: int, poll_s: float = 0.5) -> None:
    """Stop serving once the process that started this one is gone (killed with SIGKILL, say, by the OOM
    killer: no stop() comes then, and the child served on, logging that Redis was unavailable, for good). Said at
    INFO: what ended the parent is said where it ended (torchrun, a launcher), and a warning here came under every
    interrupted run whose peers a collective's error had aborted before the parent's own stop could run."""
    while not coordinator._stop.wait(poll_s):
        if os.getppid() != parent:
            log.info("job %s: the process that started this coordinator (pid %d) is gone: stopping",
                     coordinator.config.job, parent)
            coordinator.stop(timeout_s=0)
            return


def freeze_heap() -> None:
    """Put every object alive now, the imports' mostly (about 95,000 with scikit-learn), out of the garbage
    collector's reach, so that its full collections scan only what serving allocates: in a process that only
    coordinates, each paused a decision at 1,024 workers by 50-70 ms, and by under 2 ms after this. For a process
    of the coordinator's own only: it changes the collector for everything in the process."""
    gc.collect()  # what is garbage already is freed, not frozen for good
    gc.freeze()


def _serve(url: str, config_json: str, policy: Policy | None, max_ahead: int, logs: ParentLogging,
           ready: threading.Event) -> None:
    logs.apply()  # the coordinator's warnings and INFO lines as the parent logs (spawned, it had none)
    release_cpu_pinning()
    parent = os.getppid()
    config = JobConfig.from_json(config_json)
    store = Store.from_url(url, config.job)
    try:
        coordinator = Coordinator(store, config, policy, max_ahead=max_ahead)
    except Exception as exc:
        if not unusable(exc):
            raise
        log.warning("job %s: the coordinator process cannot set up, Redis unusable for now: %s", config.job, exc)
        store.close()
        sys.exit(_EXIT_REDIS_UNUSABLE)
    freeze_heap()
    signal.signal(signal.SIGTERM, lambda *_: off_the_handler(lambda: coordinator.stop(timeout_s=0)))
    # a terminal's Ctrl-C reaches the whole process group: the child printed a KeyboardInterrupt traceback under
    # the training script's own; its parent stops it (stop(), or by exiting: _stop_when_orphaned)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_stop_when_orphaned, args=(coordinator, parent), name="lbbsp-parent-watch",
                     daemon=True).start()
    ready.set()
    try:
        coordinator.run()
    finally:
        store.close()
