"""The worker side: report each iteration without blocking, then fetch the one agreed assignment.

Agreement rule (GUIDE step 5): the assignment of iteration k lives in a write-once key. The coordinator
writes it when all reports of k - lag are in (``JobConfig.lag``). A worker that has waited ``assignment_timeout_s`` writes its
fallback (the vector of k-1) with the same write-once operation and then uses whatever the key holds, so
every worker ends up with the same vector. If Redis itself cannot be reached within the bound, the worker
falls back to the vector of k-1 only when the integration gives an ``agree`` function (a broadcast over the
training framework's own process group), which makes every worker use the same one, or when it is the job's only
worker, which has nobody to split from. Without either, a worker that cannot reach Redis keeps trying, up to
``outage_s``, and then raises: another worker may have read the decision just before the outage, and a fallback of
its own would split from it. A stored assignment that is not
valid (something else wrote the key) is fallen back from the same way: with ``agree``, else an error naming the key.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import redis

from .config import JobConfig, _integer, _is_integer, _job_config, _real
from .errors import ConfigError, LBBSPError, ProtocolError, StoreUnavailable
from .protocol import MAX_DEVICE_CHARS, MAX_ITERATION, Assignment, Report
from .store import REDIS_ERRORS, REDIS_FAILURES, Store, _store

log = logging.getLogger("lbbsp.worker")

Agree = Callable[[Assignment], Assignment]


class OutageNews(Protocol):
    """How a job's workers tell each other of a Redis outage, over a channel that works while Redis does not (the
    PyTorch integration's: its process group's key-value store). With it, an outage costs the job one wait: a worker
    that had read a step's vector just before Redis went hears at its next failure that another worker waited the
    outage out already, where it had waited ``assignment_timeout_s`` again, a second stall of every worker."""

    def tell(self, iteration: int) -> None:
        """This worker fell back at ``iteration``, Redis being unusable past the bound."""

    def heard(self, iteration: int) -> bool:
        """Whether a worker fell back so at ``iteration - 1`` or later."""


_KEEP_ASSIGNMENTS = 8
#: Seconds the job's only worker, closed in an outage, gives its report thread (see :meth:`WorkerClient.close`).
_SILENT_CLOSE_S = 0.5
#: Seconds a worker waits out an unusable Redis before it raises, unless told otherwise (or the job's
#: assignment_timeout_s is longer).
DEFAULT_OUTAGE_S = 60.0


class _EveryMinute:
    """Counts the occurrences of something worth a warning, and says when to give it: at most once a minute."""

    def __init__(self) -> None:
        self.count = 0
        self._next = 0.0

    def due(self) -> bool:
        """Count one occurrence; True if the warning is due now."""
        self.count += 1
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + 60.0
        return True


def checked_outage(outage_s: float | None, config: JobConfig) -> float:
    """``outage_s`` as seconds in [``assignment_timeout_s``, a day]; None: 60, or the timeout if that is longer."""
    if outage_s is None:
        return max(DEFAULT_OUTAGE_S, config.assignment_timeout_s)
    return _real(outage_s, "outage_s", config.assignment_timeout_s, 86_400.0,
                 f"seconds in [assignment_timeout_s ({config.assignment_timeout_s:g}), 86400]")


class WorkerClient:
    """One worker's connection to the job: ``report`` after computing, ``assignment`` before the next step."""

    def __init__(self, store: Store, config: JobConfig, worker: int, *, agree: Agree | None = None,
                 device: str = "cpu", outage_s: float | None = None, outage_hint: str | None = None,
                 outage_news: OutageNews | None = None) -> None:
        config = _job_config(config)
        store = _store(store, config.job)
        if agree is not None and not callable(agree):
            raise ConfigError(f"agree must be None or a function from Assignment to Assignment, got {agree!r}",
                              job=config.job)
        if outage_news is not None and not all(callable(getattr(outage_news, name, None))
                                               for name in ("tell", "heard")):
            raise ConfigError("outage_news must be None or have tell(iteration) and heard(iteration) (OutageNews), "
                              f"got {outage_news!r:.80}", job=config.job)
        if not isinstance(device, str) or len(device) > MAX_DEVICE_CHARS:
            raise ConfigError(f"device must be a string of at most {MAX_DEVICE_CHARS} characters ('cpu', "
                              f"'cuda:A100', ...), got {device!r:.80}", job=config.job)
        worker = _integer(worker, "worker", 0, config.num_workers - 1, config.job)  # True is not worker 1
        if outage_hint is not None and not isinstance(outage_hint, str):
            raise ConfigError(f"outage_hint must be None or a string, got {outage_hint!r:.80}", job=config.job)
        self.outage_s = checked_outage(outage_s, config)
        self.outage_hint = outage_hint
        self.store = store
        self.config = store.register(config)
        self.worker = worker
        self.device = device
        self.agree = agree
        self.outage_news = outage_news if agree is not None else None  # only an agreed fallback may come early
        self._known: dict[int, Assignment] = {}
        # The vectors this worker used where Redis was unusable, by iteration, not stored (Redis was down): the sender
        # writes them before its next report, see _write_unwritten. The latest 2 * (lag + 16) (the coordinator's
        # default max_ahead), as many as it republishes; the lock: the sender takes them while a step adds one.
        self._unwritten: dict[int, Assignment] = {}
        self._unwritten_cap = 2 * (self.config.lag + 16)
        self._unwritten_lock = threading.Lock()
        # The iterations whose vectors were dropped from _unwritten (never to be written): their reports are not sent,
        # since the coordinator refuses an iteration with no assignment, warning of each ("queued as complete ... but
        # have no assignment"): hundreds once the job's only worker trains on through an outage without waiting
        self._lost: set[int] = set()
        self._outbox: queue.Queue[Report | None] = queue.Queue()
        # Set where the job's only worker closes in an outage: the sender drops what it has not sent, and ends after
        # the attempt in progress (close does not wait for it, nor does a report reach Redis after close has said so)
        self._abandoned = False
        self._sender = threading.Thread(target=self._send_loop, name=f"lbbsp-report-{worker}", daemon=True)
        self._sender.start()
        self._pubsub: redis.client.PubSub | None = None
        self._listening = False  # whether _pubsub is subscribed: between waits that come one after another
        self._late = _EveryMinute()  # fallbacks this worker wrote because no decision came in time
        # Whether the last wait for a decision timed out with no coordinator claiming the job: the next iterations not
        # stored then check the claim and fall back at once while there is none (each step of a job whose coordinator
        # had stopped for good waited assignment_timeout_s, for as long as the job ran)
        self._unserved = False
        self._invalid = _EveryMinute()  # stored assignments that were not valid, fallen back from with agree
        self._unusable = _EveryMinute()  # iterations this worker found Redis unusable past the bound
        # Whether the last assignment fell back on an unusable Redis: the next one, still failing, falls back at once
        # (each step of an outage had waited assignment_timeout_s, for as long as Redis stayed away)
        self._fell_back_unusable = False
        # The job's only worker, in an outage: when the assignment that first found Redis unusable began (None: no
        # outage), when this thread last found it unusable, and when the sender thread last found it answering. Its
        # steps use its split without asking Redis while Redis has not answered since it last failed: each had paid
        # the stalled Redis's socket timeouts (5-10 s a step of 15 ms), for as long as the stall lasted
        self._outage_since: float | None = None
        self._failed_at = 0.0
        self._answered_at = 0.0
        self._duplicates = _EveryMinute()  # reports Redis ignored: this worker had reported their iteration already
        self._dropped = _EveryMinute()  # reports Redis did not take within the bound
        self._closed = False
        self._closing = threading.Lock()  # report's check and queueing, and close's flag and stop marker, each at once

    # -- reporting --------------------------------------------------------------------------------------
    def report(self, iteration: int, samples: int, compute_s: float, *, comm_s: float | None = None,
               wait_s: float | None = None, features: Mapping[str, float] | None = None) -> Report:
        """Validate and queue this iteration's measurement; returns at once (a thread sends it)."""
        iteration = self._iteration(iteration)
        self._refuse_if_closed(iteration)
        report = Report(job=self.config.job, worker=self.worker, iteration=iteration, samples=samples,
                        compute_s=compute_s, comm_s=comm_s, wait_s=wait_s, features=features or {},  # Report copies it
                        device=self.device)
        report.to_json()  # size check at the edge, before it is queued
        with self._closing:  # a close() between the check and the queueing had put its stop marker first: the report
            self._refuse_if_closed(iteration)  # queued behind it was never sent, without a word
            self._outbox.put(report)
        return report

    def _refuse_if_closed(self, iteration: int) -> None:
        if self._closed:  # the sender has stopped: the report would be dropped without a word
            raise LBBSPError("report() after close(): the report would never be sent", job=self.config.job,
                             worker=self.worker, iteration=iteration)

    def _send_loop(self) -> None:
        while True:
            try:
                report = self._outbox.get(timeout=0.5)
            except queue.Empty:  # idle: in a lone worker's outage, find out whether Redis answers again
                self._probe()
                continue
            if report is None:
                self._outbox.task_done()
                return
            deadline = time.monotonic() + self.config.assignment_timeout_s
            retried = False
            # (dropped while Redis did not take it, or as the job's only worker closed in an outage)
            while not (self._abandoned or self._lost and self._is_lost(report.iteration)):
                tried = time.monotonic()  # an answer proves Redis up since the request was sent, not since it came
                try:
                    if self._unwritten:  # before the report that may complete their iteration
                        self._write_unwritten()
                    # a retry that finds the report stored found this report's own first try, whose answer was
                    # lost: this loop's retry, or redis-py's own within one call
                    if (not self.store.post_report(report, self.config.num_workers) and not retried
                            and not self.store.holds(report)):
                        self._warn_duplicate(report.iteration)
                    self._answered_at = tried
                    break
                except ConfigError as exc:  # a key of another type, which the store names: no retry clears it, and
                    # retries had held up the reports behind it
                    if self._dropped.due():
                        log.warning("job %s, worker %d: dropped the report of iteration %d: %s; %d report(s) of this "
                                    "worker dropped so far", self.config.job, self.worker, report.iteration,
                                    exc.message, self._dropped.count)
                    break
                except REDIS_FAILURES as exc:  # the thread must outlive any one report, or every later one is lost
                    if time.monotonic() > deadline:
                        if self._dropped.due():
                            log.warning("job %s, worker %d: dropped the report of iteration %d: Redis did not take it "
                                        "within assignment_timeout_s (%s: %s), unless it runs a send it has not "
                                        "answered yet (a stall); %d report(s) of this worker dropped so far",
                                        self.config.job, self.worker, report.iteration, type(exc).__name__, exc,
                                        self._dropped.count)
                        break
                    retried = True
                    time.sleep(0.05)
            self._outbox.task_done()

    def _silent(self) -> bool:
        """Whether this worker, the job's only one, is in an outage and Redis has answered no request sent since it last
        failed."""
        return self._outage_since is not None and self._answered_at <= self._failed_at

    def _probe(self) -> None:
        """In a lone worker's outage with no report to send, ping Redis (on this thread: the steps do not wait), and
        note when it answers, for :meth:`assignment` to ask it again."""
        if not self._silent():
            return
        pinged = time.monotonic()
        try:
            self.store.client.ping()
        except REDIS_FAILURES:
            return
        self._answered_at = pinged

    def _write_unwritten(self) -> None:
        """Write the vectors used where Redis was unusable to their keys, write-once (one that holds another, the
        coordinator's or another worker's, is left), in one round trip; an error goes to the sender's retries and
        this is tried again. Left unwritten, the coordinator refused the iterations run on them ('have no assignment')
        and the next step fell back once more, and it wrote decisions of its own where no worker had used them."""
        with self._unwritten_lock:
            pending = list(self._unwritten.values())
        written = self.store.publish_all(pending)
        with self._unwritten_lock:
            for assignment in pending:
                if self._unwritten.get(assignment.iteration) is assignment:
                    del self._unwritten[assignment.iteration]
        if not all(written):
            log.debug("job %s, worker %d: iterations %s, run while Redis was unusable, already held an assignment "
                      "(the coordinator's or another worker's): left as it is", self.config.job, self.worker,
                      [a.iteration for a, w in zip(pending, written) if not w])

    def _keep_unwritten(self, assignment: Assignment) -> None:
        """Keep the vector used at an iteration where Redis was unusable, for :meth:`_write_unwritten`; the latest
        ``_unwritten_cap`` of them."""
        with self._unwritten_lock:
            self._unwritten[assignment.iteration] = assignment
            for old in sorted(self._unwritten)[:-self._unwritten_cap]:
                del self._unwritten[old]
                self._lost.add(old)

    def _is_lost(self, iteration: int) -> bool:
        """Whether ``iteration`` ran on a vector dropped from those to write (its report is not sent); forgets the
        lost iterations before it, whose reports are past."""
        with self._unwritten_lock:
            self._lost = {k for k in self._lost if k >= iteration}
            if iteration not in self._lost:
                return False
            self._lost.discard(iteration)
            return True

    def _warn_duplicate(self, iteration: int) -> None:
        """Say, at most once a minute, that a report was ignored because the first one of its iteration counts: an
        iteration counter that restarts each epoch silently replays the first epoch's splits and stops learning."""
        if self._duplicates.due():
            log.warning("job %s, worker %d: iteration %d was reported already, so this report is ignored (%d time(s) "
                        "so far): an earlier run used this job name in this Redis (give each run a new one: the "
                        "PyTorch Balancer picks one with job=None; an external `lbbsp coordinator` serves one job, "
                        "so start one with a new --job for each run), the iteration number restarts each epoch "
                        "(it must count across epochs), or this worker reported the iteration twice (report(k) "
                        "called twice for one k, or a worker restarted from an earlier iteration)", self.config.job,
                        self.worker, iteration, self._duplicates.count)

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until every queued report has been sent, including the one in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._outbox.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)

    # -- the agreed assignment --------------------------------------------------------------------------
    def assignment(self, iteration: int) -> Assignment:
        """The vector every worker uses at ``iteration``; waits at most about ``assignment_timeout_s``. On a Redis
        that stalls, add up to three of the store's socket timeouts (a call and its two retries): connect with
        :func:`~lbbsp.store.worker_socket_timeout` (a third of the timeout) as the integrations do. Without
        ``agree`` (and more than one worker), an unusable Redis is waited for up to ``outage_s`` instead, then
        :class:`StoreUnavailable` is raised: only an agreed fallback is safe. The job's only worker falls back past the
        bound, and its next steps do not ask Redis until it answers again (its report thread tells), without ``agree``
        up to ``outage_s`` after the outage began, then it raises likewise. With ``agree``, once an assignment has
        fallen back on an unusable Redis, the next ones fall back at their first failure, until Redis answers: an
        outage costs one wait, not one per step (a Redis that stalls still costs its socket timeouts each step), and
        with ``outage_news`` not one per worker either (:class:`OutageNews`); the
        vectors so used are written to their keys (write-once) before this worker's next report reaches Redis.
        Likewise, once a wait has timed out with no coordinator claiming the job, the next iterations not stored fall
        back without waiting (write-once, agreed as ever) until a coordinator claims it or a decision is found. Once
        Redis answers after failing, the worker waits afresh: a Redis restarted without its data gets its latest
        decisions back from the coordinator within about a second."""
        iteration = self._iteration(iteration)
        known = self._known.get(iteration)
        if known is not None:
            return known
        started = time.monotonic()
        deadline = wait_until = started + self.config.assignment_timeout_s
        unusable = False  # whether this worker falls back, Redis being unusable: nothing stores what it uses
        while True:
            if self._riding_out(iteration):  # the only worker, Redis silent since it last failed: not asked
                agreed = self._fallback(iteration, "Redis unusable (not asked: no answer since the last failure)")
                unusable = True
                break
            try:
                agreed = self._fetch(iteration, wait_until)
                self._fell_back_unusable = False
                self._outage_since = None
                break
            except ProtocolError as exc:  # _parse: what assign:{k} holds is no assignment of this job
                self._outage_since = None  # Redis answered
                agreed = self._invalid_stored(iteration, exc)
                break
            except REDIS_FAILURES as exc:  # retry within the bound: Redis may be restarting (not again once it has
                self._drop_subscription()  # stayed away a whole bound: an outage's steps then fall back at once)
                self._failed_at = time.monotonic()
                if ((self._fell_back_unusable or self._failed_at >= deadline or self._heard_of_outage(iteration))
                        and self._unusable_past_bound(iteration, exc, started)):
                    agreed = self._fallback(iteration, f"Redis unusable ({type(exc).__name__})")
                    if not self._fell_back_unusable:  # the outage's first fallback here: the others hear of it
                        self._tell_of_outage(iteration)
                    self._fell_back_unusable = unusable = True
                    if self.config.num_workers == 1 and self._outage_since is None:
                        self._outage_since = started
                    break
                time.sleep(0.05)
                # once Redis answers, a whole wait: one restarted without its data gets the decision back from the
                # coordinator's heartbeat (about a second); a worker whose wait had run out during the outage wrote its
                # fallback at once, over the decision another worker had read (without agree, a split of its own)
                wait_until = time.monotonic() + self.config.assignment_timeout_s
        if self.agree is not None:
            agreed = self._agreed(self.agree(agreed), iteration)
        if unusable:
            self._keep_unwritten(agreed)
        self._remember(agreed)
        return agreed

    def _heard_of_outage(self, iteration: int) -> bool:
        """Whether ``outage_news`` says another worker fell back on an unusable Redis at the last iteration or this
        one; False where it cannot tell (its own channel failing is no outage of Redis)."""
        if self.outage_news is None:
            return False
        try:
            return bool(self.outage_news.heard(iteration))
        except Exception as exc:  # noqa: BLE001  (the wait goes on as without news)
            log.debug("job %s, worker %d: outage_news.heard failed: %r", self.config.job, self.worker, exc)
            return False

    def _tell_of_outage(self, iteration: int) -> None:
        """Tell the others, through ``outage_news``, that this worker fell back at ``iteration``, Redis unusable."""
        if self.outage_news is None:
            return
        try:
            self.outage_news.tell(iteration)
        except Exception as exc:  # noqa: BLE001  (the others then wait the outage out on their own)
            log.debug("job %s, worker %d: outage_news.tell failed: %r", self.config.job, self.worker, exc)

    def _agreed(self, agreed: object, iteration: int) -> Assignment:
        """What ``agree`` returned, checked: this job's assignment of ``iteration``, one size per worker summing to
        the global batch. Every worker uses it, so anything else is a ConfigError here, not a split of its own."""
        try:
            if not isinstance(agreed, Assignment):
                raise ProtocolError(f"{agreed!r:.80} is not an Assignment")
            return agreed.validate(job=self.config.job, iteration=iteration, num_workers=self.config.num_workers,
                                   global_batch=self.config.global_batch)
        except ProtocolError as exc:
            raise ConfigError(f"agree returned an unusable value ({exc.message}): it must return the Assignment it is "
                              "given or one worker's (rank 0's, say) of the same iteration", job=self.config.job,
                              worker=self.worker, iteration=iteration) from None

    def peek(self, iteration: int) -> Assignment | None:
        """The vector of ``iteration`` if one is stored now, else None: no wait, no fallback, no agreement. A guess
        to prepare the step's data with, which the caller checks against :meth:`assignment` (an ``agree`` may
        replace what Redis holds); safe to call from another thread."""
        iteration = self._iteration(iteration)
        known = self._known.get(iteration)
        if known is not None:
            return known
        if iteration < self.config.lag:  # the initial split: what every worker writes there
            return self.config.initial_assignment(iteration)
        if self._silent():  # not asked: each peek had waited out the stalled Redis on a thread of its own, and a lone
            return None  # rank's prefetch threads piled up to the pool's 100 connections
        try:
            return self._read(iteration)
        except (*REDIS_FAILURES, LBBSPError):
            return None

    def _invalid_stored(self, iteration: int, exc: ProtocolError) -> Assignment:
        """The fallback of ``iteration`` where its stored assignment is invalid (something other than lbbsp wrote it),
        with ``agree``, which makes every worker use one vector (alone, a worker has no one to split from); without
        it, an LBBSPError that names the key: each worker would fall back to a vector of its own."""
        key = self.store.key("assign", iteration)
        if self.agree is None and self.config.num_workers > 1:
            raise LBBSPError(f"Redis key {key} holds no valid assignment ({exc.message}); lbbsp writes only valid "
                             "ones, so something else wrote it, and without an agree function the workers cannot "
                             "fall back together: delete the key (the workers then write their fallback there) and "
                             f"check what else writes to lbbsp:{self.config.job}:*", job=self.config.job,
                             worker=self.worker, iteration=iteration) from exc
        if self._invalid.due():
            log.warning("job %s, worker %d: Redis key %s holds no valid assignment (%s), not written by lbbsp; using "
                        "the previous vector, agreed (%d time(s) so far): delete the key and check what else writes "
                        "to lbbsp:%s:*", self.config.job, self.worker, key, exc.message, self._invalid.count,
                        self.config.job)
        why = f"the stored assignment at key {key} is invalid"
        return dataclasses.replace(self._fallback(iteration, why), policy="fallback", reason=why, fallback=True)

    def _riding_out(self, iteration: int) -> bool:
        """True if this worker, the job's only one, uses its split at ``iteration`` without asking Redis: Redis has not
        answered since it last failed (the sender's reports and pings tell), within ``outage_s`` of the outage's start
        (with ``agree``, for as long as it lasts). At ``outage_s`` without ``agree`` Redis is asked once more, and
        :meth:`_unusable_past_bound` raises if it still fails."""
        since = self._outage_since
        if since is None or not self._silent():
            return False
        if self.agree is None and time.monotonic() - since >= self.outage_s:
            return False
        if self._unusable.due():
            log.warning("job %s, worker %d, iteration %d: Redis still unusable; the job's only worker trains on with "
                        "its split without asking Redis until it answers again%s (%d step(s) so far)", self.config.job,
                        self.worker, iteration, "" if self.agree is not None else
                        f", up to outage_s ({self.outage_s:g}s) after the outage began", self._unusable.count)
        return True

    def _unusable_past_bound(self, iteration: int, exc: Exception, started: float) -> bool:
        """True if this worker may fall back, Redis being unusable past the bound: with ``agree`` every worker
        then uses one vector; alone, it has no one to split from, so it trains on up to ``outage_s`` after the outage
        began (with ``agree``, for as long as it lasts), then raises. Otherwise another worker may have read the
        decision of ``iteration`` before the outage, so this one waits for Redis, and raises after ``outage_s``.
        ``started``: when this assignment began to wait."""
        alone = self.config.num_workers == 1
        if self.agree is not None or alone:
            since = self._outage_since if self._outage_since is not None else started
            waited = time.monotonic() - since
            if self.agree is None and waited >= self.outage_s:
                hint = self.outage_hint or "bring Redis back, or give WorkerClient a longer outage_s="
                raise StoreUnavailable(f"Redis unusable for {waited:.0f}s ({type(exc).__name__}: {exc}); the job's only "
                                       "worker trains on without Redis (its split is the whole global batch) for up to "
                                       f"outage_s ({self.outage_s:g}s), so it stops: {hint}", job=self.config.job,
                                       worker=self.worker, iteration=iteration) from exc
            if self._unusable.due():
                log.warning("worker %d, iteration %d: Redis unusable (%s: %s); using the previous vector, agreed "
                            "(%d time(s) so far)%s", self.worker, iteration, type(exc).__name__, exc,
                            self._unusable.count, "" if not alone else
                            "; the job's only worker: its next steps do not ask Redis until it answers again"
                            + ("" if self.agree is not None else f", up to outage_s ({self.outage_s:g}s)"))
            return True
        waited = time.monotonic() - started
        if waited >= self.outage_s:
            # the caller's hint where it gives one: a WorkerSession takes no agree=
            who, hint = (("without an agree function a worker", "bring Redis back, or give WorkerClient agree=")
                         if self.outage_hint is None else ("a worker on its own", self.outage_hint))
            raise StoreUnavailable(f"Redis unusable for {waited:.0f}s ({type(exc).__name__}: {exc}); {who} cannot fall "
                                   f"back safely (another may have read the decision), so it stops: {hint}",
                                   job=self.config.job, worker=self.worker, iteration=iteration) from exc
        if self._unusable.due():
            log.warning("worker %d, iteration %d: Redis unusable (%s: %s); waiting for it, up to %gs (no agreed "
                        "fallback)", self.worker, iteration, type(exc).__name__, exc, self.outage_s)
        return False

    def _iteration(self, value: object) -> int:
        """``value`` as a plain int (numpy's integers pass), checked before any wait: the fallback written after
        one must carry the same iteration number as the key read before it."""
        number = int(value) if _is_integer(value) else -1
        if not 0 <= number <= MAX_ITERATION:
            raise ProtocolError(f"must be an integer in [0, {MAX_ITERATION}], got {value!r}", field="iteration",
                                job=self.config.job, worker=self.worker)
        return number

    def _fetch(self, iteration: int, deadline: float) -> Assignment:
        found = self._read(iteration)
        if found is not None:
            self._stop_listening()  # no wait: decisions come in time
            # a decision: something decides, with a claim or without (a Coordinator driven by step() alone)
            self._unserved = self._unserved and found.fallback
            return found
        if iteration < self.config.lag:
            # Nothing to wait for: no decision covers the first ``lag`` iterations. They use the initial
            # split, agreed through the same write-once key.
            return self._parse(self.store.publish_or_read(self.config.initial_assignment(iteration))[1], iteration)
        if self._unserved:  # the last wait found no coordinator: wait again once one claims the job
            claim = self._claim()
            if claim is None:
                return self._publish_fallback(iteration, f"no coordinator serves the job: worker {self.worker} did "
                                                         "not wait", claim, waited=False)
            self._unserved = False
        pubsub = self._listen()
        announced = str(iteration).encode()
        while found is None and (remaining := deadline - time.monotonic()) > 0:
            message = pubsub.get_message(timeout=min(remaining, 0.25))
            # read once subscribed (a write before was announced to no one), at this iteration's write, or after a
            # quiet poll; not at other iterations' writes, nor at what the waits before left unread
            if message is None or message["type"] == "subscribe" or message["data"] == announced:
                found = self._read(iteration)
        if found is not None:
            return found
        claim = self._claim()
        self._unserved = claim is None
        return self._publish_fallback(iteration, f"coordinator late: worker {self.worker} waited "
                                                 f"{self.config.assignment_timeout_s:g}s", claim, waited=True)

    def _claim(self) -> str | None:
        """The identity of the coordinator whose claim on the job is live (one GET), None if none; where the claim's
        key holds what lbbsp does not write there, the claim of an unknown one: the worker waits, as before."""
        try:
            return self.store.coordinator()
        except ConfigError:
            return "unknown"  # the claim of a coordinator whose identity cannot be read

    def _publish_fallback(self, iteration: int, why: str, claim: str | None, *, waited: bool) -> Assignment:
        """Write this worker's fallback of ``iteration`` (write-once: every worker then uses what the key holds), with
        a warning once a minute if it was this worker's that counted; ``claim``: the coordinator's, for the warning."""
        written, raw = self.store.publish_or_read(self._fallback(iteration, why))
        if written:
            self._warn_late(iteration, claim, waited=waited)
        return self._parse(raw, iteration)

    def _warn_late(self, iteration: int, claim: str | None, *, waited: bool) -> None:
        """Say, at most once a minute, that this worker wrote a fallback because no decision came in time (``waited``)
        or because no coordinator serves the job (``claim`` None: the next steps do not wait until one claims it), and
        which split it wrote (as :meth:`_fallback` chose it); a late iteration skipped some, if so (no decision covers
        it then)."""
        if not self._late.due():
            return
        job = self.config.job
        if claim is None:
            ask = (f"; no coordinator serves the job (no live claim on it: its coordinator stopped, or never started, "
                   f"or Redis evicted the claim; is a coordinator running for this job? lbbsp status), so its steps "
                   f"fall back without waiting until one starts (`lbbsp coordinator --job {job} ...`)")
        else:
            ask = (f"; a coordinator ({claim}) claimed the job in the last 5 s but decided late (slow, or stopped: "
                   "lbbsp status)")
        if iteration - 1 in self._known:
            used = f"so the split of iteration {iteration - 1} is used"
        elif self._known:  # the iteration skipped some (or went back): no decision covers it, whatever runs
            last = max(self._known)
            gap = f"{iteration - last} past" if iteration > last else f"{last - iteration} before"
            used = (f"and iteration {iteration} is {gap} this worker's last ({last}): k must count up by one, across "
                    "epochs too; the equal split is used")
            ask = ask if claim is None else ""
        else:
            used = "so the equal split is used (this worker knows no split before it)"
        within = f"within {self.config.assignment_timeout_s:g}s" if waited else "stored, not waited for"
        log.warning("job %s, worker %d: no decision for iteration %d %s, %s (%d time(s) so far)%s", job, self.worker,
                    iteration, within, used, self._late.count, ask)

    def _fallback(self, iteration: int, why: str) -> Assignment:
        """The previous iteration's vector (the initial split if unknown), marked as a fallback."""
        if iteration < self.config.lag:
            return self.config.initial_assignment(iteration)
        previous = self._known.get(iteration - 1)
        sizes = previous.sizes if previous is not None else self.config.initial_sizes()
        return Assignment(self.config.job, iteration, sizes, "fallback", why, fallback=True)

    def _read(self, iteration: int) -> Assignment | None:
        raw = self.store.get_assignment(iteration)
        return None if raw is None else self._parse(raw, iteration)

    def _parse(self, raw: bytes, iteration: int) -> Assignment:
        """The stored assignment ``raw`` of ``iteration``; a ProtocolError if it is not one of this job's."""
        return self.config.stored_assignment(raw, iteration)

    def _remember(self, assignment: Assignment) -> None:
        self._known[assignment.iteration] = assignment
        for old in [k for k in self._known if k < assignment.iteration - _KEEP_ASSIGNMENTS]:
            del self._known[old]

    def _listen(self) -> redis.client.PubSub:
        """The subscription to the job's announcements, for a wait: subscribed again where it was stopped (on the same
        connection), kept while this worker waits at every iteration."""
        if self._pubsub is None or not self._listening:
            self._pubsub = self.store.subscribe(self._pubsub)
            self._listening = True
        return self._pubsub

    def _stop_listening(self) -> None:
        """Unsubscribe once a split is there without waiting. Kept subscribed, Redis queued every later announcement
        for this worker, which read none until its next wait (1.1 MB in 20,000 iterations, up to Redis's limit of 8 MB
        a subscriber), and that wait then read Redis once for each queued one."""
        if self._pubsub is None or not self._listening:
            return
        self._listening = False
        try:
            self._pubsub.unsubscribe()  # sent, not waited for: the next wait reads the reply
        except REDIS_FAILURES:
            self._drop_subscription()

    def _drop_subscription(self) -> None:
        if self._pubsub is not None:
            try:
                self._pubsub.close()
            except REDIS_ERRORS:
                pass
            self._pubsub, self._listening = None, False

    def close(self) -> None:
        """Send what is queued, stop the sender thread and the subscription; safe to call twice. The job's only worker
        in an outage, which Redis has not answered since, does not wait for what it cannot send (logged)."""
        with self._closing:
            self._closed = True
            sending = self._sender.is_alive()
            if sending:
                # the job's only worker in an outage: Redis has not answered since it last failed, and waiting out the
                # retries of what is queued had held close for assignment_timeout_s + 1 (11 s)
                self._abandoned = self._silent()
                unsent = self._outbox.unfinished_tasks  # those queued and the one being sent
                self._outbox.put(None)
        if sending:
            self._sender.join(_SILENT_CLOSE_S if self._abandoned else self.config.assignment_timeout_s + 1)
            if self._abandoned and unsent:
                log.info("job %s, worker %d: closed in a Redis outage: %d report(s) Redis had not taken are dropped, "
                         "but for one it may yet take (the job's only worker: nothing waits for them)",
                         self.config.job, self.worker, unsent)
            elif self._sender.is_alive():  # each report queued has assignment_timeout_s of its own: with several
                # queued in an outage, the sender had gone on posting them after close returned, through a store
                # its owner then closed, and into a new run of the job
                self._abandoned = True
                self._sender.join(_SILENT_CLOSE_S)  # the rest dropped at once, but for a send under way
                log.warning("job %s, worker %d: closed while Redis did not take this worker's reports within "
                            "assignment_timeout_s: those still queued are dropped, but for one it may yet take",
                            self.config.job, self.worker)
        self._drop_subscription()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
