"""Per-client history of a federated job in Redis, so capacity estimates outlive the server process.

Keys (under ``lbbsp:{job}:fl:``, each with a TTL refreshed on every write):

==================  ======  ==================================================================================
``ids``             hash    client key (e.g. a Flower node id) -> small worker index, assigned on first sight
``next``            string  the next free worker index
``reports:{i}``     list    report JSON of worker i, oldest first, the newest ``max_reports`` kept
``status``          hash    worker index -> JSON {"round", "status", "reason", "at"}: the last round's outcome
==================  ======  ==================================================================================

Everything is JSON and validated when read (a bad entry is logged and skipped); nothing is unpickled.
"""
from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import redis

from .config import _integer, _job_name, _real
from .errors import ConfigError, ProtocolError, StoreUnavailable
from .protocol import MAX_ITERATION, MAX_PAYLOAD_BYTES, MAX_REASON_CHARS, MAX_WORKERS, Report
from .store import REDIS_FAILURES, connect, explain, explained, not_a_url

T = TypeVar("T")

log = logging.getLogger(__name__)

Outcome = Literal["ok", "missed", "failed"]
_OUTCOMES = ("ok", "missed", "failed")
MAX_CLIENT_KEY_CHARS = 128
#: The highest stored round a run may follow (LoadBalanced numbers a run's rounds on from the highest stored one):
#: it leaves 2**32 rounds, more than runs ever add (a round a millisecond for 49 days), before MAX_ITERATION, past
#: which no report or status can be made. One above it, which no job reaches by its own rounds (that takes about
#: 2**53 of them: only a foreign writer stores one), is skipped when read.
MAX_STORED_ROUND = MAX_ITERATION - 2**32
#: Clients whose stored reports :meth:`ClientHistory.rounds` reads in one round trip (at most 50 reports each).
READ_BATCH = 1000


@dataclass(frozen=True)
class ClientStatus:
    """How a client's last round went: ``ok``, ``missed`` (no reply in time) or ``failed`` (error reply).

    ``round`` is the job's round number, as in the reports' iterations: it carries on across server restarts.
    """

    round: int
    status: Outcome
    reason: str = ""
    at: float = 0.0

    def __post_init__(self) -> None:
        """Checked where made, as where read: a bad one (a NaN time, a negative round) had been written over the
        client's good one, then skipped when read."""
        rnd, at = self.round, self.at
        if isinstance(rnd, bool) or not isinstance(rnd, int) or not 0 <= rnd <= MAX_ITERATION:
            raise ProtocolError(f"must be an integer in [0, {MAX_ITERATION}] (a report's iteration), got {rnd!r}",
                                field="round")
        if self.status not in _OUTCOMES:
            raise ProtocolError(f"must be one of {_OUTCOMES}, got {self.status!r}", field="status")
        if not isinstance(self.reason, str):
            raise ProtocolError(f"must be a string, got {self.reason!r:.80}", field="reason")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
            raise ProtocolError(f"must be a non-negative time, got {at!r}", field="at")
        object.__setattr__(self, "at", float(at))

    @classmethod
    def from_json(cls, data: bytes | str) -> ClientStatus:
        """Parse a stored status, checked as where made; a :class:`ProtocolError` naming the bad field."""
        if len(data) > MAX_PAYLOAD_BYTES:
            raise ProtocolError("status payload too large", field="payload")
        try:
            obj = json.loads(data, parse_constant=lambda name: None)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"status is not valid JSON: {exc!r}", field="payload") from None
        if not isinstance(obj, dict) or set(obj) != {"round", "status", "reason", "at"}:
            raise ProtocolError("status must be an object with round, status, reason, at", field="payload")
        if isinstance(obj["reason"], str) and len(obj["reason"]) > MAX_REASON_CHARS:  # one made is cut to it
            raise ProtocolError("must be a short string", field="reason")
        return cls(obj["round"], obj["status"], obj["reason"], obj["at"])

    def to_json(self) -> str:
        """The JSON kept in Redis (``reason`` cut to 512 characters)."""
        return json.dumps({"round": self.round, "status": self.status, "reason": self.reason[:MAX_REASON_CHARS],
                           "at": self.at}, allow_nan=False)


class ClientHistory:
    """Reports and outcomes of each federated client of one job, kept in Redis across server restarts."""

    # KEYS[1] = ids hash, KEYS[2] = next counter, KEYS[3] = status hash; ARGV[1] = TTL s, ARGV[2] = max index,
    # ARGV[3] = the lowest index a new client may get, ARGV[4..] = client keys.
    # Returns each client's worker index, assigning the next free one to a client the hash lacks (never seen, or
    # its entry lost with Redis's data, or not a decimal index in range: no lbbsp process wrote it); -1 for a
    # client that finds every index taken. A counter that is lost or not a decimal restarts above the hash's
    # indices and those with a stored outcome, whose history a new client must not inherit: that scan, O(hash size),
    # runs at most once a call (the next free index is then counted on), and the counter it sets spares the next.
    ASSIGN_INDICES = """
    local function index_in(raw)
        if raw and string.match(raw, '^%d+$') and #raw <= 6 and tonumber(raw) <= tonumber(ARGV[2]) then
            return tonumber(raw)
        end
        return nil
    end
    local next_free = nil  -- found when the call's first new client needs it
    local out = {}
    for i = 4, #ARGV do
        local index = index_in(redis.call('HGET', KEYS[1], ARGV[i]))
        if not index then
            if not next_free then
                local counter = redis.call('GET', KEYS[2])
                next_free = counter and string.match(counter, '^%d+$') and tonumber(counter)
                if not next_free then
                    next_free = 0
                    local stored = redis.call('HVALS', KEYS[1])
                    for _, worker in ipairs(redis.call('HKEYS', KEYS[3])) do stored[#stored + 1] = worker end
                    for _, raw in ipairs(stored) do
                        local known = index_in(raw)
                        if known and known >= next_free then next_free = known + 1 end
                    end
                    redis.call('SET', KEYS[2], next_free)  -- at most MAX_WORKERS: a decimal the next call reads
                end
                next_free = math.max(next_free, tonumber(ARGV[3]))
            end
            if next_free > tonumber(ARGV[2]) then
                index = -1
            else
                index = next_free
                next_free = next_free + 1
                redis.call('SET', KEYS[2], next_free)
                redis.call('HSET', KEYS[1], ARGV[i], index)
            end
        end
        out[#out + 1] = index
    end
    redis.call('EXPIRE', KEYS[1], ARGV[1])
    redis.call('EXPIRE', KEYS[2], ARGV[1])
    return out
    """

    # KEYS = the keys ASSIGN_INDICES touches: what a history needs of its Redis (its keys, in three hash slots, and
    # scripting), tried at once, changing nothing
    CHECK_ACCESS = """
    return redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3])
    """

    def __init__(self, client: redis.Redis, job: str, *, ttl_s: int = 7 * 86_400, max_reports: int = 50,
                 owns_client: bool = False) -> None:
        not_a_url(client, "ClientHistory", job)
        self.client = client
        self.job = _job_name(job)  # checked here: an invalid one would have every reply refused
        self.ttl_s = _integer(ttl_s, "ttl_s", 1, None, job)  # 0 would delete what each write stores
        self.max_reports = _integer(max_reports, "max_reports", 1, None, job)  # 0 would keep every report
        self.prefix = _prefix(job)
        self._owns_client = owns_client
        self._assign = client.register_script(self.ASSIGN_INDICES)
        self._check_access = client.register_script(self.CHECK_ACCESS)
        self._known: dict[str, int] = {}  # client key -> the index Redis last gave it here
        self._lowest_new = 0  # above every index handed out here, so that none is given twice after a data loss

    def __reduce_ex__(self, protocol: object) -> Any:
        raise ConfigError("a ClientHistory (and the LoadBalanced strategy that holds one) cannot be copied or pickled: "
                          "it holds a live Redis connection; make one in each process with ClientHistory.from_url(url, "
                          "job), which reads the same stored history", job=self.job)

    @classmethod
    def from_url(cls, url: str, job: str, *, ttl_s: int = 7 * 86_400, max_reports: int = 50,
                 socket_timeout_s: float = 2.0) -> ClientHistory:
        """A history on its own connection to ``url``. A call to a Redis that stalls gives up after about three
        ``socket_timeout_s`` (a call and its two retries), so a stall holds a round a few of those: with the
        store's 5 s default, three calls of a round had held it 45 s before the warning."""
        timeout = _real(socket_timeout_s, "socket_timeout_s", 0.0, 60.0, "seconds in (0, 60]", lo_open=True)
        return cls(connect(url, socket_timeout_s=timeout), job, ttl_s=ttl_s, max_reports=max_reports,
                   owns_client=True)

    def close(self) -> None:
        """Close the connection this object opened; safe to call twice."""
        if self._owns_client:
            self._owns_client = False
            self.client.close()

    def __enter__(self) -> ClientHistory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def key(self, *parts: object) -> str:
        """The Redis key of this job's federated state named by ``parts`` (``key("reports", 3)``)."""
        return self.prefix + ":".join(str(p) for p in parts)

    def check_access(self) -> None:
        """A ConfigError where this Redis is a cluster or its user may not do what a history needs
        (:func:`~lbbsp.store.explain`), StoreUnavailable where it does not answer: for a server to check as it starts,
        not at its first round."""
        def check() -> None:
            with explained(self.job):  # a ConfigError, which _call passes on
                self._check_access(keys=[self.key("ids"), self.key("next"), self.key("status")])

        self._call(check)

    def worker_index(self, client_key: str | int) -> int:
        """The stable small index of a client (Reports and capacity models key workers by it)."""
        return self.worker_indices([client_key])[0]

    def worker_indices(self, client_keys: Sequence[str | int]) -> list[int]:
        """Each client's worker index, from Redis in one atomic call, assigned on first sight.

        Redis is asked every time, not a cache: a client whose entry was lost (FLUSHALL, a restart without
        persistence) is indexed again, and never with an index handed out here before, so no two clients share
        one. Raises StoreUnavailable when Redis is unreachable (:meth:`known_index` has what was last seen), and
        ConfigError when a new client finds all ``MAX_WORKERS`` indices taken (they are never reused in a job).
        """
        names = [str(key) for key in client_keys]
        if any(not name or len(name) > MAX_CLIENT_KEY_CHARS for name in names):
            raise ProtocolError(f"client key must be 1 to {MAX_CLIENT_KEY_CHARS} characters", field="client",
                                job=self.job)
        if not names:
            return []
        keys = [self.key("ids"), self.key("next"), self.key("status")]
        indices = [int(i) for i in self._call(self._assign, keys=keys,
                                              args=[self.ttl_s, MAX_WORKERS - 1, self._lowest_new, *names])]
        left_out = indices.count(-1)
        if left_out:
            raise ConfigError(f"every client index of the job is taken: no worker index is left for {left_out} new "
                              f"client{'s' * (left_out != 1)} (indices are handed out in order up to {MAX_WORKERS - 1} "
                              f"and never reused within a job, and the job's counter {self.key('next')} or its stored "
                              f"indices reached the last); run on under a new job name, or, if its history is not "
                              f"needed, `lbbsp forget --job {self.job}` deletes it", job=self.job)
        self._known.update(zip(names, indices))
        self._lowest_new = max(self._lowest_new, max(indices) + 1)
        return indices

    def known_index(self, client_key: str | int) -> int | None:
        """The index Redis last gave this object for the client, or None: what may serve while it is unreachable."""
        return self._known.get(str(client_key))

    def record(self, reports: Iterable[Report], outcomes: dict[int, ClientStatus]) -> None:
        """Append each report to its client's list and set each client's last outcome, in one transaction."""
        pipe = self.client.pipeline(transaction=True)
        for report in reports:
            key = self.key("reports", report.worker)
            pipe.rpush(key, report.to_json())
            pipe.ltrim(key, -self.max_reports, -1)
            pipe.expire(key, self.ttl_s)
        if outcomes:
            pipe.hset(self.key("status"), mapping={str(w): s.to_json() for w, s in outcomes.items()})
            pipe.expire(self.key("status"), self.ttl_s)
        for mapping in ("ids", "next"):  # the client -> index map lives as long as the reports it indexes
            pipe.expire(self.key(mapping), self.ttl_s)
        self._call(pipe.execute)

    def reports(self, worker: int) -> list[Report]:
        """The client's stored reports, oldest first; entries that fail validation or are of a round above
        :data:`MAX_STORED_ROUND` are logged and skipped."""
        return self._parsed(worker, self._call(self.client.lrange, self.key("reports", worker), 0, -1))

    def _parsed(self, worker: int, stored: Sequence[bytes | str]) -> list[Report]:
        """The valid reports of ``worker`` among its ``stored`` entries, as :meth:`reports` returns them."""
        out = []
        for raw in stored:
            try:
                report = Report.from_json(raw, job=self.job)
            except ProtocolError as exc:
                log.warning("skipping a stored report of worker %d of job %s: %s", worker, self.job, exc)
                continue
            if report.iteration > MAX_STORED_ROUND:
                self._no_room("report", report.iteration, self.key("reports", worker))
                continue
            if report.worker == worker:
                out.append(report)
        return out

    def workers(self) -> dict[str, int]:
        """Every client key seen, with its worker index."""
        out = {}
        for name, index in self._call(self.client.hgetall, self.key("ids")).items():
            try:
                out[name.decode() if isinstance(name, bytes) else name] = _index(index)
            except (UnicodeDecodeError, ValueError):
                log.warning("skipping a bad client id entry in job %s", self.job)
        self._known.update(out)  # what known_index serves: a restarted server knows its clients before their round
        return out

    def rounds(self) -> list[list[Report]]:
        """All stored reports grouped by round, oldest round first: the input of ``CapacityModel.fit``."""
        by_round: dict[int, list[Report]] = defaultdict(list)
        indices = sorted(set(self.workers().values()))
        for start in range(0, len(indices), READ_BATCH):  # a round trip per client had taken 3 s for 6,000 at restart
            batch = indices[start:start + READ_BATCH]
            pipe = self.client.pipeline(transaction=False)
            for index in batch:
                pipe.lrange(self.key("reports", index), 0, -1)
            for index, stored in zip(batch, self._call(pipe.execute)):
                for report in self._parsed(index, stored):
                    by_round[report.iteration].append(report)
        return [by_round[k] for k in sorted(by_round)]

    def statuses(self) -> dict[int, ClientStatus]:
        """Each client's last outcome; entries that fail validation or are of a round above
        :data:`MAX_STORED_ROUND` are logged and skipped."""
        out = {}
        for worker, raw in self._call(self.client.hgetall, self.key("status")).items():
            try:  # the field too: int() would take "-1" or "1_000", and a huge index would size the model's tables
                index, status = _index(worker), ClientStatus.from_json(raw)
            except (ValueError, ProtocolError) as exc:
                log.warning("skipping a stored status in job %s: %s", self.job, exc)
                continue
            if status.round > MAX_STORED_ROUND:
                self._no_room("status", status.round, f"{self.key('status')} field {index}")
            else:
                out[index] = status
        return out

    def _no_room(self, what: str, round_: int, where: str) -> None:
        """Log a stored entry skipped for a round above :data:`MAX_STORED_ROUND`, naming where it is kept."""
        log.warning("skipping a stored %s of job %s at round %d (%s): it leaves no room for a run's rounds, which "
                    "follow the highest stored one (at most %d); if the job's history is not needed, `lbbsp forget "
                    "--job %s` deletes it, else delete that entry", what, self.job, round_, where, MAX_STORED_ROUND,
                    self.job)

    def _call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        try:
            return fn(*args, **kwargs)
        except REDIS_FAILURES as exc:  # unreachable, or refusing (out of memory, read-only replica, ...): in a round,
            # the round goes on without the history, as in an outage (a permission revoked mid-run too: raised, it
            # had lost the round's aggregation); check_access refuses what no retry clears at the start
            raise StoreUnavailable(f"Redis unusable ({type(exc).__name__}): {explain(exc) or exc}",
                                   job=self.job) from exc


def flower_jobs(client: redis.Redis) -> list[str]:
    """The names of the federated jobs whose client histories this Redis holds (keys under ``lbbsp:{job}:fl:``), for
    `lbbsp status`, which shows training jobs' coordinators: a Flower job has none. One SCAN of the whole keyspace;
    none found where the Redis user may not SCAN."""
    jobs = set()
    try:
        for key in client.scan_iter(match="lbbsp:*:fl:*", count=1000):
            try:
                jobs.add(_job_name(key.decode()[len("lbbsp:"):].rsplit(":fl:", 1)[0]))
            except (UnicodeDecodeError, ConfigError):  # a foreign writer's key: not a job's
                continue
    except redis.ResponseError:  # NOPERM: only an aside to what status shows
        return []
    return sorted(jobs)


def is_flower_job(client: redis.Redis, job: str) -> bool:
    """Whether ``job`` has a federated client history here (its ``ids`` or ``status`` key): two key lookups."""
    return bool(client.exists(_prefix(job) + "ids", _prefix(job) + "status"))


def _prefix(job: str) -> str:
    """Where a federated job's keys live."""
    return f"lbbsp:{job}:fl:"


def _index(stored: bytes | str) -> int:
    """A stored worker index, read as ASSIGN_INDICES reads it: a decimal below ``MAX_WORKERS``, else a ValueError."""
    text = stored.decode() if isinstance(stored, bytes) else str(stored)
    if not (text.isascii() and text.isdigit() and int(text) < MAX_WORKERS):
        raise ValueError(f"not a worker index: {text[:20]!r}")
    return int(text)
