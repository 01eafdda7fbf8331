"""Per-client history of a federated job in Redis, so capacity estimates outlive the server process.

Keys (under ``lbbsp:{job}:fl:``, each with a TTL refreshed on every write):

==================  ======  ==================================================================================
``ids``             hash    client key (e.g. a Flower node id) -> small worker index, assigned once
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, TypeVar

import redis

from .errors import ProtocolError, StoreUnavailable
from .protocol import MAX_PAYLOAD_BYTES, MAX_REASON_CHARS, MAX_WORKERS, Report
from .store import REDIS_ERRORS, connect

T = TypeVar("T")

log = logging.getLogger(__name__)

Outcome = Literal["ok", "missed", "failed"]
_OUTCOMES = ("ok", "missed", "failed")
MAX_CLIENT_KEY_CHARS = 128


@dataclass(frozen=True)
class ClientStatus:
    """How a client's last round went: ``ok``, ``missed`` (no reply in time) or ``failed`` (error reply).

    ``round`` is the job's round number, as in the reports' iterations: it carries on across server restarts.
    """

    round: int
    status: Outcome
    reason: str = ""
    at: float = 0.0

    @classmethod
    def from_json(cls, data: bytes | str) -> ClientStatus:
        if len(data) > MAX_PAYLOAD_BYTES:
            raise ProtocolError("status payload too large", field="payload")
        try:
            obj = json.loads(data, parse_constant=lambda name: None)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"status is not valid JSON: {exc!r}", field="payload") from None
        if not isinstance(obj, dict) or set(obj) != {"round", "status", "reason", "at"}:
            raise ProtocolError("status must be an object with round, status, reason, at", field="payload")
        rnd, status, reason, at = obj["round"], obj["status"], obj["reason"], obj["at"]
        if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0:
            raise ProtocolError(f"must be a non-negative integer, got {rnd!r}", field="round")
        if status not in _OUTCOMES:
            raise ProtocolError(f"must be one of {_OUTCOMES}, got {status!r}", field="status")
        if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
            raise ProtocolError("must be a short string", field="reason")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0:
            raise ProtocolError(f"must be a non-negative time, got {at!r}", field="at")
        return cls(rnd, status, reason, float(at))

    def to_json(self) -> str:
        return json.dumps({"round": self.round, "status": self.status, "reason": self.reason[:MAX_REASON_CHARS],
                           "at": self.at}, allow_nan=False)


class ClientHistory:
    """Reports and outcomes of each federated client of one job, kept in Redis across server restarts."""

    # KEYS[1] = ids hash, KEYS[2] = next counter; ARGV[1] = client key, ARGV[2] = TTL s, ARGV[3] = max index
    # Returns the client's worker index, assigning the next free one on first sight; -1 when all are taken.
    ASSIGN_INDEX = """
    local index = redis.call('HGET', KEYS[1], ARGV[1])
    if not index then
        index = redis.call('INCR', KEYS[2]) - 1
        if index > tonumber(ARGV[3]) then return -1 end
        redis.call('HSET', KEYS[1], ARGV[1], index)
    end
    redis.call('EXPIRE', KEYS[1], ARGV[2])
    redis.call('EXPIRE', KEYS[2], ARGV[2])
    return tonumber(index)
    """

    def __init__(self, client: redis.Redis, job: str, *, ttl_s: int = 7 * 86_400, max_reports: int = 50,
                 owns_client: bool = False) -> None:
        self.client = client
        self.job = job
        self.ttl_s = ttl_s
        self.max_reports = max_reports
        self.prefix = f"lbbsp:{job}:fl:"
        self._owns_client = owns_client
        self._assign = client.register_script(self.ASSIGN_INDEX)
        self._index_cache: dict[str, int] = {}

    @classmethod
    def from_url(cls, url: str, job: str, *, ttl_s: int = 7 * 86_400, max_reports: int = 50) -> ClientHistory:
        return cls(connect(url), job, ttl_s=ttl_s, max_reports=max_reports, owns_client=True)

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
        return self.prefix + ":".join(str(p) for p in parts)

    def worker_index(self, client_key: str | int) -> int:
        """The stable small index of a client (Reports and capacity models key workers by it)."""
        name = str(client_key)
        if not name or len(name) > MAX_CLIENT_KEY_CHARS:
            raise ProtocolError(f"client key must be 1 to {MAX_CLIENT_KEY_CHARS} characters", field="client",
                                job=self.job)
        if name not in self._index_cache:
            index = int(self._call(self._assign, keys=[self.key("ids"), self.key("next")],
                                   args=[name, self.ttl_s, MAX_WORKERS - 1]))
            if index < 0:
                raise StoreUnavailable(f"job has more than {MAX_WORKERS} clients", job=self.job)
            self._index_cache[name] = index
        return self._index_cache[name]

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
        """The client's stored reports, oldest first; entries that fail validation are logged and skipped."""
        out = []
        for raw in self._call(self.client.lrange, self.key("reports", worker), 0, -1):
            try:
                report = Report.from_json(raw, job=self.job)
            except ProtocolError as exc:
                log.warning("skipping a stored report of worker %d of job %s: %s", worker, self.job, exc)
                continue
            if report.worker == worker:
                out.append(report)
        return out

    def workers(self) -> dict[str, int]:
        """Every client key seen, with its worker index."""
        out = {}
        for name, index in self._call(self.client.hgetall, self.key("ids")).items():
            try:
                out[name.decode() if isinstance(name, bytes) else name] = int(index)
            except (UnicodeDecodeError, ValueError):
                log.warning("skipping a bad client id entry in job %s", self.job)
        return out

    def rounds(self) -> list[list[Report]]:
        """All stored reports grouped by round, oldest round first: the input of ``CapacityModel.fit``."""
        by_round: dict[int, list[Report]] = defaultdict(list)
        for index in sorted(set(self.workers().values())):
            for report in self.reports(index):
                by_round[report.iteration].append(report)
        return [by_round[k] for k in sorted(by_round)]

    def statuses(self) -> dict[int, ClientStatus]:
        """Each client's last outcome; entries that fail validation are logged and skipped."""
        out = {}
        for worker, raw in self._call(self.client.hgetall, self.key("status")).items():
            try:
                out[int(worker)] = ClientStatus.from_json(raw)
            except (ValueError, ProtocolError) as exc:
                log.warning("skipping a stored status in job %s: %s", self.job, exc)
        return out

    def _call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        try:
            return fn(*args, **kwargs)
        except REDIS_ERRORS as exc:
            raise StoreUnavailable(f"cannot reach Redis: {exc}", job=self.job) from exc
