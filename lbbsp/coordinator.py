"""The BatchSize Manager: turns the reports of iteration k into the one assignment of iteration k + lag."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import socket
import statistics
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from .config import JobConfig, _integer, _job_config, _real
from .errors import ConfigError, LBBSPError, ProtocolError
from .guarded_policy import GuardedPolicy, check_outside_simulator, warn_uncapped
from .models import AutoCapacityModel, CapacityModel, FLClientModel, worker_kind
from .models.base import predicted_throughput
from .policies import BSPPolicy, Decision, LBBSPPolicy, Policy
from .protocol import Assignment, Report
from .repeats import Repeats, failure_site
from .store import ITERATIONS_KEPT, REDIS_FAILURES, Store, _store, unusable

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
            check_outside_simulator(self.policy, config)
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
        self._repeats = Repeats()  # failed steps, see _failed
        self._ready_repeats = Repeats()  # iterations queued that no worker ran, see _out_of_line
        self._decided_from: dict[int, bytes] = {}  # the latest iterations decided from: worker 0's report (_repeated)
        self._repeats_seen = Repeats(" ({} times)")  # iterations queued again, see _repeated
        self._rejections: dict[tuple[str | None, str], Repeats] = {}  # rejected reports by worker and check (_rejected)
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
            self._told_uncapped = warn_uncapped(self.config.job, self.policy, reports)
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
        ones, the same again only every 10 s with a count (:class:`Repeats`, one per worker and check): a worker
        whose every report was refused had a warning at every decision. The fields that name no worker of the job
        (only a writer past POST_REPORT's check makes one) share one, and are logged quoted: thousands of them had a
        line each, and a limiter each for good, and a newline in one had made a log line of its own. The decision
        log records the first ones (_RECORDED_REJECTIONS)."""
        valid = _worker_field(worker, self.config.num_workers)
        repeats = self._rejections.setdefault((worker if valid else None, failure_site(exc)),
                                              Repeats(_REJECTED_AGAIN))
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
        left in the job's keys fails every step) only every 10 s, with a count (:class:`Repeats`)."""
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

