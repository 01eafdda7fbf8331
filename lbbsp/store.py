"""Redis key layout of one job, and the atomic operations the coordinator and workers perform on it.

Keys (all under ``lbbsp:{job}:``, all with a TTL so that finished jobs do not leak memory):

=====================  =======  ==========================================================================
``config``             string   the :class:`JobConfig` as JSON, written once by whoever comes first
``reports:{k}``        hash     worker id -> report JSON for iteration k (first report per worker wins)
``ready``              list     iterations whose reports are all in, for the coordinator to pop
``assign:{k}``         string   the assignment JSON for iteration k, written once (SET NX)
``assigned``           channel  iteration numbers, published when ``assign:{k}`` is written
``decisions``          list     the latest decisions with their reasons, newest first (capped)
``workers``            hash     worker id -> status JSON for ``lbbsp status``
``coordinator``        string   the serving coordinator's host:pid:id, renewed every second (expires in 5 s)
``forgotten``          string   the latest iteration whose keys a coordinator's clean-up deleted (only rises)
=====================  =======  ==========================================================================

``reports:{k}`` and ``assign:{k}`` go sooner: when iteration k + ``ITERATIONS_KEPT`` is complete (its last report,
and the coordinator's decision from it, delete them), which every worker has finished, so none reads them again.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import os
import re
import resource
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from .config import MAX_TTL_S, JobConfig, _integer, _job_name, _real
from .errors import ConfigError, LBBSPError, ProtocolError, StoreUnavailable, printable
from .protocol import MAX_PAYLOAD_BYTES, MAX_WORKERS, Assignment, Report

DECISION_LOG_LENGTH = 1000
#: Iterations whose reports and assignment stay in Redis, the latest ones (to look at): deciding from iteration k, when
#: every worker has finished k, the coordinator deletes those of k - ITERATIONS_KEPT, which would otherwise pile up for
#: ``ttl_s`` (at 1,024 workers, 266 KB of reports and 6 KB of assignment an iteration: 9.8 GB in the default hour at 10
#: iterations a second, where the latest 100 hold 27 MB)
ITERATIONS_KEPT = 100
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
#: Those, and Redis answering with an error (a key of the wrong type, out of memory, a read-only replica during a
#: failover), which may clear as well: what a worker rides out within its bound, and a shutdown ignores.
REDIS_FAILURES = (*REDIS_ERRORS, redis.RedisError)
#: What :meth:`Store.coordinator` and :meth:`Store.claim_coordinator` return for a claim whose value is no
#: coordinator identity as lbbsp writes one (host:pid:tag): a live claim all the same, of a coordinator unknown.
UNKNOWN_CLAIM = "unknown (not an lbbsp claim)"
#: A coordinator's identity as it writes its claim (host:pid:tag, see Coordinator): a host name of printable ASCII
#: without a colon, well under 300 characters in all. Anything else at the claim's key is not logged or printed as it is.
_IDENTITY = re.compile(rb"[!-9;-~]{1,253}:[0-9]{1,10}:[0-9A-Za-z]{1,32}")
#: A URL's scheme as written, even wrongly ("redis://", "redis//", "redis:/"), then its credentials: up to the last @
_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*(?::/+|/+))?(.*)@", re.DOTALL)


def _wrong_type(exc: redis.ResponseError) -> bool:
    """Whether Redis's error answer is WRONGTYPE: a key of the job's holds another type than lbbsp writes there."""
    return "WRONGTYPE" in str(exc)


#: Redis's error answers for a state of the server that clears by itself: a full disk under its append-only file
#: (MISCONF), no memory left (OOM), a read-only replica or a lost primary in a failover, a script that runs long.
#: redis-py gives some their own classes and drops the code from the text; in a script's error the code stays.
_REFUSAL = re.compile(r"(?:^|: -?)(?:MISCONF|OOM|READONLY|NOREPLICAS|MASTERDOWN|BUSY)\b")
_REFUSAL_CLASSES = tuple(getattr(redis.exceptions, name) for name in ("OutOfMemoryError", "ReadOnlyError",
                                                                      "MasterDownError")
                         if hasattr(redis.exceptions, name))  # (those this redis-py has)


def refusing(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing for a while, as a command, in a pipeline ("Command # 2 (...) of pipeline
    caused error: MISCONF ...") or in a script: an outage to wait out, not a fault of the step."""
    return isinstance(exc, _REFUSAL_CLASSES) or (isinstance(exc, redis.ResponseError)
                                                 and _REFUSAL.search(str(exc)) is not None)


def unusable(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis out of reach or :func:`refusing` for now: an outage to wait out."""
    return isinstance(exc, REDIS_ERRORS) or refusing(exc)


def _claimant(claim: bytes | None) -> str | None:
    """The identity in a coordinator's claim as read from Redis; UNKNOWN_CLAIM where it is none that lbbsp writes: it
    is logged and printed, and a newline, a terminal escape or a megabyte there came out as they were."""
    if claim is None:
        return None
    return claim.decode("ascii") if _IDENTITY.fullmatch(claim) else UNKNOWN_CLAIM


def _queued(item: bytes | str) -> int | None:
    """An entry of the ready list as an iteration, None for anything else (only a foreign writer puts one there; a
    number of over 4,300 digits, which int() refuses, had ended the coordinator's step after the list was emptied)."""
    try:
        return int(item)
    except ValueError:
        return None


#: The environment variable that names a job's Redis where no URL is given (set to "", it names none).
REDIS_URL_VARIABLE = "LBBSP_REDIS_URL"


def redis_url(given: str | None, source: str = "--redis") -> tuple[str | None, str]:
    """The Redis URL that every command and integration uses: ``given``, else $LBBSP_REDIS_URL, else None (an empty
    value counts as none), with where it came from: ``source`` (the flag or argument that gave it),
    "$LBBSP_REDIS_URL", or "" for none."""
    if given:
        return given, source
    if variable := os.environ.get(REDIS_URL_VARIABLE):
        return variable, f"${REDIS_URL_VARIABLE}"
    return None, ""


#: The connection options lbbsp sets itself, which redis-py lets a URL's query override: a URL's socket_timeout=20 had
#: held a worker's call to a stalled Redis 6 s where its assignment_timeout_s was 1.
_OWN_OPTIONS = ("socket_timeout", "socket_connect_timeout", "retry_on_timeout", "retry_on_error")
#: A password or user name in a URL's query (redis-py takes both there), up to the next option.
_QUERY_SECRET = re.compile(r"(?i)((?:^|[?&;])(?:password|username)=)[^&;#]*")


def connect(url: str, *, socket_timeout_s: float = 5.0, retries: int = 2) -> redis.Redis:
    """A client from one URL (redis://, rediss:// for TLS, unix://; password and db in the URL).

    Retries a failed command ``retries`` times, briefly, with backoff; each try blocks at most ``socket_timeout_s``.
    """
    expected = "expected redis://host:port/db, rediss://... (TLS) or unix:///path/to/socket"
    # a string from a command line had failed inside redis-py, on a comparison of a float with a str
    socket_timeout_s = _real(socket_timeout_s, "socket_timeout_s", 0.0, 86_400.0, "seconds in (0, 86400]",
                             lo_open=True)
    retries = _integer(retries, "retries", 0, 100)
    if not isinstance(url, str):
        raise ConfigError(f"a Redis URL must be a string, got {url!r:.60}; {expected}")
    _check_url(url, expected)
    try:
        client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=min(socket_timeout_s, 2.0),
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.005), retries),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError], health_check_interval=0,
        )
    except ValueError as exc:  # its text may quote the URL's host part, password included
        raise ConfigError(f"not a usable Redis URL: {redacted(url)} ({redacted(str(exc))}); {expected}") from exc
    pool = client.connection_pool
    if issubclass(pool.connection_class, redis.UnixDomainSocketConnection) and not pool.connection_kwargs.get("path"):
        client.close()
        raise ConfigError(f"not a usable Redis URL: {redacted(url)} names no socket; {expected}")
    return client


def _check_url(url: str, expected: str) -> None:
    """A ConfigError for what redis-py would take silently: a query option that lbbsp sets itself, or a path that is
    no database number (redis-py drops its slashes and reads ``/1/2`` as db 12, and ``/abc`` as db 0)."""
    try:
        parts = urllib.parse.urlparse(url)  # as redis-py parses it (";params" are no part of the path)
    except ValueError:  # ("Invalid IPv6 URL"): redis-py's own error says so, below
        return
    query = urllib.parse.parse_qs(parts.query)
    if unknown := sorted(set(query) - _url_options(parts.scheme.lower())):
        shown = ", ".join(repr(printable(name, 40)) for name in unknown[:4])
        raise ConfigError(f"not a usable Redis URL: {redacted(url)}: lbbsp takes no option {shown} in a "
                          f"{parts.scheme or 'redis'}:// URL's query (none redis-py does not take, or takes as an "
                          f"object; ssl_* options need rediss://); {expected}")
    if own := sorted(set(query) & set(_OWN_OPTIONS)):
        raise ConfigError(f"the Redis URL's query sets {', '.join(own)}, which lbbsp sets itself (a worker's "
                          "from its assignment_timeout_s, which bounds a step's wait on a stalled Redis): remove "
                          f"{'them' if len(own) > 1 else 'it'} from the URL")
    if not url.lower().startswith(("redis://", "rediss://")) or "db" in query:  # the query's db wins over the path
        return
    db = urllib.parse.unquote(parts.path).strip()
    db = db.removeprefix("/").removesuffix("/").strip()  # what redis-py reads, but for slashes inside
    if not re.fullmatch(r"[0-9]*", db):
        hint = " (a / in the password is written %2F)" if "@" in parts.path else ""
        raise ConfigError(f"not a usable Redis URL: {redacted(url)}: what follows host:port is no database number "
                          f"(/0, /1, ...){hint}; {expected}")


#: Query options redis-py passes on as the strings they are (the others it parses: URL_QUERY_ARGUMENT_PARSERS, whose
#: list grows with its versions: protocol is parsed from redis-py 8, and taken as a string before).
_STRING_OPTIONS = frozenset({"username", "password", "client_name", "lib_name", "lib_version", "encoding",
                             "encoding_errors", "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs",
                             "ssl_ca_path", "ssl_ca_data", "ssl_password", "ssl_ciphers", "protocol",
                             "decode_responses"})


@functools.cache
def _url_options(scheme: str) -> frozenset[str]:
    """The query options a URL of ``scheme`` may carry: those redis-py reads from a string and the connection class
    (or the pool) takes. redis-py hands every option on, and one it does not take, or an object's (``retry``) as a
    string, had failed the first command with a TypeError or an AttributeError."""
    kind = {"rediss": redis.SSLConnection, "unix": redis.UnixDomainSocketConnection}.get(scheme, redis.Connection)
    taken = {"max_connections"}
    for cls in kind.__mro__:
        if "__init__" in vars(cls):
            taken.update(inspect.signature(vars(cls)["__init__"]).parameters)
    return frozenset((set(redis.connection.URL_QUERY_ARGUMENT_PARSERS) | _STRING_OPTIONS) & taken)


def worker_socket_timeout(assignment_timeout_s: float) -> float:
    """The socket timeout for a worker's connection: with its retries, a call to a stalled Redis gives up
    within about ``assignment_timeout_s``, so a step waits about that long, not three 5 s timeouts."""
    return min(5.0, max(0.05, assignment_timeout_s / 3))


def not_a_url(client: object, owner: str, job: object) -> None:
    """Raise a ConfigError if a URL was passed where ``owner`` takes a Redis client (``from_url`` takes the URL)."""
    if isinstance(client, (str, bytes)):
        raise ConfigError(f"{owner} takes a Redis client; for a URL, use {owner}.from_url(url, job)",
                          job=job if isinstance(job, str) else None)


#: What lbbsp needs of a Redis user, as the errors below name it (docs/core.md, "Your own Redis").
NEEDS = ("keys ~lbbsp:*, channels &lbbsp:* and scripting (EVALSHA), as `ACL SETUSER <user> on ~lbbsp:* resetchannels "
         "&lbbsp:* +@all -@dangerous` grants")


def explain(exc: BaseException) -> str | None:
    """What a user can do about an error answer that no retry clears, where it is one: a Redis Cluster's (a job's keys
    lie in several hash slots) or a permission the Redis user lacks; None for any other (an outage's, OOM...)."""
    text = str(exc)
    # (redis-py before 6 raised a cluster's redirections as plain error answers "MOVED 1234 host:port")
    if isinstance(exc, (redis.exceptions.ClusterCrossSlotError, redis.exceptions.MovedError, redis.exceptions.AskError)
                  ) or text.startswith(("MOVED ", "ASK ")) or "CROSSSLOT" in text or "hash to the same slot" in text:
        return (f"this Redis runs in cluster mode ({text}), which lbbsp does not support: its scripts touch several "
                "of a job's keys at once, and those lie in different hash slots; use a standalone Redis (a primary "
                "with replicas is fine)")
    # a refusal inside a script: "The user executing the script can't ..." (Redis 6.2, 7.0), "ERR ACL failure in
    # script: ..." (7.2 on, Valkey), which redis-py raises as a plain error answer
    if isinstance(exc, redis.exceptions.NoPermissionError) or any(
            said in text for said in ("user executing the script", "ACL failure in script")):
        return f"the Redis user may not do what lbbsp needs ({text}): lbbsp needs {NEEDS}"
    return None


@contextlib.contextmanager
def explained(job: str) -> Iterator[None]:
    """An error answer that :func:`explain` explains (a cluster's, a permission's) as a ConfigError that says what to
    do: at a job's start, where a worker had taken it for an outage, waited it out (60 s) and told the user to bring
    Redis back, and a coordinator had logged it at every step, deciding nothing."""
    try:
        yield
    except redis.ResponseError as exc:
        if (why := explain(exc)) is None:
            raise
        raise ConfigError(why, job=job) from None


def redacted(url: str) -> str:
    """``url`` without the password (what follows the user name before the last @), for error messages: with any
    scheme, or one written wrongly or left out, as in a malformed URL that an error quotes."""
    url = _QUERY_SECRET.sub(r"\1***", url)
    match = _CREDENTIALS.match(url)
    if match is None or ":" not in match[2]:
        return url
    return f"{match[1] or ''}{match[2].partition(':')[0]}:***@{url[match.end():]}"


def _tls_hint(client: redis.Redis, exc: BaseException) -> str:
    """A hint for a client whose URL asks for TLS (rediss://) and whose server did not answer: a server without TLS
    never completes the handshake. No hint where the connection was refused: nothing listens there, TLS or not."""
    refused = isinstance(exc.__cause__ or exc.__context__, ConnectionRefusedError)
    if refused or not issubclass(client.connection_pool.connection_class, redis.SSLConnection):
        return ""
    return " (the URL asks for TLS (rediss://): if the server has none, use redis://)"


def _files_hint(exc: BaseException) -> str:
    """A hint for a connection that failed for want of file descriptors: this process near its ``ulimit -n`` (an
    EMFILE, or, where the server took the same limit, as an embedded one does, its maxclients: "max number of clients
    reached", or the broken pipe of a connection it closed at once), or the server's maxclients. Each Store (each
    WorkerClient) holds a connection of its own: at 1,000 in one process under ``ulimit -n 1024`` the error had read
    "cannot reach Redis ...: Broken pipe"."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError as err:  # none left even to list them (EMFILE), or no /proc
        used = soft if err.errno in (errno.EMFILE, errno.ENFILE) else 0
    if 0 < soft != resource.RLIM_INFINITY and soft - used <= max(64, soft // 10):
        return (f" (this process has {used} files open of its limit of {soft}, `ulimit -n`: each Store, and each "
                "WorkerClient's, holds a Redis connection; raise the limit before the process starts, which an "
                "embedded Redis started from it takes as its own bound on clients too)")
    if isinstance(exc, getattr(redis.exceptions, "MaxClientsReachedError", ())):
        return " (the server's maxclients: each Store holds a connection; raise maxclients, or the server's ulimit -n)"
    return ""


def no_expiry(key: str, claimant: str) -> str:
    """The error for a claim on a job that never expires, which no coordinator of lbbsp's writes (each renews one of 5
    s): it would pass for a live coordinator's for good, and lock the job out of `lbbsp forget` and new coordinators."""
    return (f"the claim on this job at Redis key {key} ({claimant}) has no expiry, which no lbbsp coordinator writes "
            "(something else wrote it, or removed its TTL): if no coordinator serves the job, delete that key")


def left_by_earlier_run(job: str, settings: str, redis_flag: str = "") -> str:
    """The error for settings that differ from those a finished run of ``job`` left (:meth:`Store.run_is_over`), with
    how to clear them: one wording wherever lbbsp refuses them. ``settings`` names the differences as the caller's
    user sets them (JobConfig's fields, or the command's flags); ``redis_flag`` is the ``--redis URL`` the command
    needs, where the user typed one (without it `lbbsp forget` has no Redis to read)."""
    forget = f"lbbsp forget --job {job}" + (f" {redis_flag}" if redis_flag else "")
    return (f"job {job!r} was started with {settings}; its keys are left by an earlier run, whose coordinator has "
            f"stopped: `{forget}` clears them once that run is over, or use another job name")


def agreed_config(store: Store, index: int,
                  all_gather: Callable[[str | None], Sequence[str | None]]) -> JobConfig | None:
    """The job's settings as worker 0 read them from ``store`` (None before a coordinator stored them), the same on
    every worker: ``all_gather`` is the framework's collective (a string or None from each worker, in order)."""
    stored = store.load_config() if index == 0 else None
    shared = all_gather(stored.to_json() if stored is not None else None)[0]
    return JobConfig.from_json(shared) if shared is not None else None


class Store:
    """Atomic operations on one job's keys; owns its Redis connections only if it made them.

    The client must return bytes (no ``decode_responses``), as :func:`connect` makes it.
    """

    # The watermark at ``key`` as a number where it is what a clean-up writes (plain digits, at most 16), else false, as
    # forgotten_through reads it: Lua's tonumber made "inf" or 400 digits infinite, which refused every write for good.
    # Read with pcall: a key of another type (an error reply) is no watermark either, and the clean-up's SET repairs it;
    # it had failed every decision after its split was written.
    _WATERMARK = """
    local function watermark(key)
        local raw = redis.pcall('GET', key)
        return type(raw) == 'string' and string.len(raw) <= 16 and string.match(raw, '^%d+$') and tonumber(raw)
    end
    """

    # KEYS[1] = reports:{k} hash, KEYS[2] = ready list, KEYS[3] = config string; where k >= ARGV[7], KEYS[4] =
    # reports:{k - ARGV[7]} hash, KEYS[5] = assign:{k - ARGV[7]} string, KEYS[6] = forgotten string, KEYS[7] =
    # assign:{k} string
    # ARGV[1] = worker id, ARGV[2] = report JSON, ARGV[3] = number of workers, ARGV[4] = TTL s,
    # ARGV[5] = iteration k, ARGV[6] = max payload bytes, ARGV[7] = iterations kept (ITERATIONS_KEPT)
    # Returns 1 if stored, 0 if this worker already reported iteration k, -1 if the payload is too big,
    # -2 if the worker id is not one of the job's, written in decimal without sign or leading zeros (another
    # spelling of a worker, "0x1" or "1.0", would fill the hash while the real report is still missing).
    # A ready key of another type (no writer of lbbsp's leaves one) is replaced: the RPUSH had failed after the HSETNX,
    # so the iteration was never queued, and every later one neither, until the run ended.
    # An iteration k completed also does what a coordinator's decision from it does to the job's keys, which every
    # worker has then finished: the queue keeps the newest ARGV[7] (the older ones' keys go: none is decided from),
    # the settings are renewed, and, where k has an assignment (every worker reads it before it runs k: reports
    # posted out of line for a k no worker ran had deleted a split still to be read), k - ARGV[7]'s reports and
    # assignment (KEYS[4], KEYS[5]) are deleted and the clean-up's watermark (KEYS[6]) raised to it where it stood
    # just below (else a coordinator's first clean-up reaches back from where the watermark stands, as ever, to the
    # keys a crash left). While no coordinator served (stopped, or given up), the queue had grown by one
    # a step for good, each iteration's keys stayed for ttl_s (at 1,024 workers, 9.8 GB in the default hour at 10
    # iterations a second), and the settings expired, so `lbbsp status` no longer listed a job that trained.
    POST_REPORT = _WATERMARK + """
    if string.len(ARGV[2]) > tonumber(ARGV[6]) then return -1 end
    if not string.match(ARGV[1], '^%d+$') then return -2 end
    local worker = tonumber(ARGV[1])
    if tostring(worker) ~= ARGV[1] or worker >= tonumber(ARGV[3]) then return -2 end
    local added = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
    redis.call('EXPIRE', KEYS[1], ARGV[4])
    if added == 1 and redis.call('HLEN', KEYS[1]) == tonumber(ARGV[3]) then
        if redis.call('TYPE', KEYS[2]).ok ~= 'list' then redis.call('DEL', KEYS[2]) end
        redis.call('RPUSH', KEYS[2], ARGV[5])
        redis.call('LTRIM', KEYS[2], -tonumber(ARGV[7]), -1)
        redis.call('EXPIRE', KEYS[2], ARGV[4])
        redis.call('EXPIRE', KEYS[3], ARGV[4])
        local old = tonumber(ARGV[5]) - tonumber(ARGV[7])
        if KEYS[4] and old >= 0 and redis.call('EXISTS', KEYS[7]) == 1 then
            redis.call('UNLINK', KEYS[4], KEYS[5])
            if (watermark(KEYS[6]) or -1) == old - 1 then redis.call('SET', KEYS[6], old, 'EX', ARGV[4]) end
        end
    end
    return added
    """

    # KEYS[1] = assign:{k} string, KEYS[2] = assigned channel; a coordinator's write adds KEYS[3] = forgotten string
    # (the clean-up's watermark) and KEYS[4] = assign:{j} string, j the iteration it decided from
    # ARGV[1] = assignment JSON, ARGV[2] = TTL s, ARGV[3] = iteration k
    # Returns {1, the JSON} if this call wrote the assignment, else {0, the one already there} (write-once),
    # its TTL renewed: read in the same script, so no flush or expiry can fall between the write and the read.
    # A coordinator's write returns {-1, nil} instead where a clean-up has deleted k (k at or below the watermark, its
    # key gone) and j too: it resumed after another coordinator had decided on and cleaned up. A new run under the
    # job's name, whose j is stored, still writes below the watermark its run before left; a worker's write (two
    # KEYS) is never refused.
    PUBLISH_ASSIGNMENT = _WATERMARK + """
    if KEYS[3] and redis.call('EXISTS', KEYS[1]) == 0 and redis.call('EXISTS', KEYS[4]) == 0 then
        local through = watermark(KEYS[3])
        if through and tonumber(ARGV[3]) <= through then return {-1, false} end
    end
    if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
        redis.call('PUBLISH', KEYS[2], ARGV[3])
        return {1, ARGV[1]}
    end
    redis.call('EXPIRE', KEYS[1], ARGV[2])
    return {0, redis.call('GET', KEYS[1])}
    """

    # KEYS[1] = forgotten string, ARGV[1] = the last iteration a clean-up deleted, ARGV[2] = TTL s: raise the
    # watermark to it (never lower it: two coordinators' clean-ups may land out of order), its TTL renewed
    RAISE_WATERMARK = _WATERMARK + """
    local through = watermark(KEYS[1])
    if through and through >= tonumber(ARGV[1]) then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
    return redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
    """

    # KEYS = three of the job's keys (in three hash slots), ARGV[1] = a channel of the job's: what every worker and
    # coordinator needs of its Redis (keys, scripting, publishing), tried at once, changing nothing
    CHECK_ACCESS = """
    redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3])
    redis.call('PUBLISH', ARGV[1], '')
    return 1
    """

    # KEYS[1] = coordinator string, ARGV[1] = identity: delete the claim only if it is still this identity's
    RELEASE_COORDINATOR = """
    if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
    return 0
    """

    # KEYS[1] = coordinator string; ARGV = identity, ttl_s. The claim there, where a string holds one; else ARGV[1]'s
    # claim is written (a key of another type is no claim, as the other scripts read it) and nil returned.
    CLAIM_IF_FREE = """
    if redis.call('TYPE', KEYS[1]).ok == 'string' then return redis.call('GET', KEYS[1]) end
    redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
    return false
    """

    # KEYS[1] = coordinator string, KEYS[2..] = the job's keys to delete (as listed by a scan)
    # Returns {0, the claim, its TTL in ms} and deletes nothing where KEYS[1] exists (a coordinator claims the job: one
    # that claimed it after the keys were listed keeps them), the claim false where it is no string; else {1, the number
    # deleted}.
    # UNLINK takes the keys a thousand at a time: Lua's unpack of them all fails past about 8,000.
    FORGET_UNCLAIMED = """
    if redis.call('EXISTS', KEYS[1]) == 1 then
        local claim = redis.pcall('GET', KEYS[1])
        return {0, type(claim) == 'string' and claim, redis.call('PTTL', KEYS[1])}
    end
    local deleted = 0
    for first = 2, #KEYS, 1000 do
        deleted = deleted + redis.call('UNLINK', unpack(KEYS, first, math.min(first + 999, #KEYS)))
    end
    return {1, deleted}
    """

    def __init__(self, client: redis.Redis, job: str, *, ttl_s: int = 3600, owns_client: bool = False) -> None:
        not_a_url(client, "Store", job)
        try:
            if job != "":  # "": a probe of the server, touching no job's keys
                _job_name(job)
            ttl_s = _integer(ttl_s, "ttl_s", 1, MAX_TTL_S, job or None)
        except ConfigError:
            if owns_client:
                client.close()
            raise
        self.client = client
        self.job = job
        self.ttl_s = ttl_s
        self.prefix = f"lbbsp:{job}:"
        self._owns_client = owns_client
        self._post_report = client.register_script(self.POST_REPORT)
        self._publish = client.register_script(self.PUBLISH_ASSIGNMENT)
        self._release = client.register_script(self.RELEASE_COORDINATOR)
        self._claim_if_free = client.register_script(self.CLAIM_IF_FREE)
        self._raise_watermark = client.register_script(self.RAISE_WATERMARK)
        self._forget_unclaimed = client.register_script(self.FORGET_UNCLAIMED)
        self._check_access = client.register_script(self.CHECK_ACCESS)

    @classmethod
    def from_url(cls, url: str, job: str, *, ttl_s: int = 3600, socket_timeout_s: float = 5.0) -> Store:
        """A store of ``job``'s keys on a connection of its own to ``url`` (see :func:`connect`), closed by
        :meth:`close` or at the end of a ``with`` block."""
        return cls(connect(url, socket_timeout_s=socket_timeout_s), job, ttl_s=ttl_s, owns_client=True)

    def key(self, *parts: object) -> str:
        """The Redis key of this job's ``parts``: ``key("assign", 7)`` is ``lbbsp:JOB:assign:7``."""
        return self.prefix + ":".join(str(p) for p in parts)

    def close(self) -> None:
        """Close the connections this store opened; safe to call twice."""
        if self._owns_client:
            self._owns_client = False
            self.client.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ping(self, *, hint: str = "") -> None:
        """Raise :class:`StoreUnavailable` with the URL and its error (and ``hint``) if Redis does not answer."""
        where = self.client.connection_pool.connection_kwargs
        url = (f"unix://{where['path']}" if "path" in where
               else f"{where.get('host') or 'localhost'}:{where.get('port') or 6379}")
        try:
            self.client.ping()
        except redis.AuthenticationError as exc:  # it answers, but not to us: say so, not "cannot reach"
            why = "refused the URL's password" if where.get("password") else "needs a password, and the URL gives none"
            raise StoreUnavailable(f"Redis at {url} {why}: give it as redis://:PASSWORD@host:port/db (or "
                                   "redis://USER:PASSWORD@...)", job=self.job or None) from exc
        except REDIS_ERRORS as exc:
            detail = (str(exc).rstrip(".") + _tls_hint(self.client, exc) + _files_hint(exc) +
                      (f"; {hint}" if hint else ""))
            raise StoreUnavailable(f"cannot reach Redis at {url}: {detail}", job=self.job or None) from exc
        except redis.InvalidResponse as exc:  # something answers there, but not in Redis's protocol
            raise StoreUnavailable(f"the server at {url} does not answer as Redis does ({exc}): another service on "
                                   f"that port?" + (f" {hint}" if hint else ""), job=self.job or None) from exc
        except redis.ResponseError as exc:  # e.g. a database number the server does not have
            if refusing(exc):  # a full disk under its append-only file refuses even a ping: no setting of ours
                raise StoreUnavailable(f"Redis at {url} refuses for now: {exc}", job=self.job or None) from exc
            raise ConfigError(f"Redis refused the connection's settings: {exc}", job=self.job or None) from exc

    # -- configuration ------------------------------------------------------------------------------------
    def register(self, config: JobConfig) -> JobConfig:
        """Store the job's configuration if none is stored; raise if a different one is. From here on the
        job's keys live ``config.ttl_s`` seconds after their last write."""
        if config.job != self.job:
            raise ConfigError(f"config is for job {config.job!r}, store for {self.job!r}", job=self.job)
        self.ttl_s = config.ttl_s
        key = self.key("config")
        try:
            with explained(self.job):
                self._check_access(keys=[self.key("config"), self.key("ready"), self.key("coordinator")],
                                   args=[self.key("access")])
                with self._typed("config"):  # (a user whose keys are read-only passes the check: refused here)
                    self.client.set(key, config.to_json(), nx=True, ex=self.ttl_s)
                    stored = self._config_from(self.client.get(key) or b"{}")
        except (*REDIS_ERRORS, redis.ResponseError):
            # a StoreUnavailable that names the URL where Redis does not answer; a ConfigError where it refuses the
            # connection's settings (a database it does not have: redis-py selects it as it connects)
            self.ping()
            raise
        differ = stored.differences(config)
        if differ:
            settings = ", ".join(f"{name}={ours!r} (not {theirs!r})" for name, (ours, theirs) in differ.items())
            if self.run_is_over():
                raise ConfigError(left_by_earlier_run(self.job, settings), job=self.job)
            raise ConfigError(f"job {self.job!r} already runs with {settings}; use another job name or the same "
                              "settings", job=self.job)
        return stored

    def eviction_policy(self) -> str | None:
        """The server's maxmemory-policy where it may evict the job's keys (a maxmemory set, and a policy other than
        noeviction: every key of lbbsp's has a TTL, so a volatile-* policy evicts them as an allkeys-* one does); None
        where it may not, or where the user may not run INFO."""
        try:
            memory = self.client.info("memory")
        except redis.RedisError:
            return None
        policy = str(memory.get("maxmemory_policy", "noeviction"))
        return policy if int(memory.get("maxmemory", 0) or 0) > 0 and policy != "noeviction" else None

    def run_is_over(self) -> bool:
        """Whether the job's keys are a finished run's: a coordinator decided for the job and none holds its claim now
        (none renewed it in 5 s). False where Redis cannot tell, and before any decision: the job's workers may be
        starting ahead of their coordinator. What decides whether an error offers `lbbsp forget`."""
        try:
            return self.decision_count() > 0 and self.coordinator() is None
        except (ConfigError, *REDIS_FAILURES):
            return False

    @contextlib.contextmanager
    def _typed(self, *parts: object, invalid: bool = False) -> Iterator[None]:
        """Turn Redis's WRONGTYPE answer about the job's key of ``parts`` into a ConfigError that names the key; into a
        ProtocolError where ``invalid`` (an assignment's key: a worker then takes the path of an invalid stored one,
        which says what to do, where it had taken the error for Redis being down)."""
        try:
            yield
        except redis.ResponseError as exc:
            if not _wrong_type(exc):
                raise
            what = f"Redis key {self.key(*parts)} holds a value of another type than lbbsp writes there"
            if invalid:
                raise ProtocolError(what, job=self.job) from None
            raise ConfigError(f"{what} (left by something else?): delete it, or use another job name",
                              job=self.job) from None

    def has_config(self) -> bool:
        """Whether the job's configuration is stored: False once Redis has lost the job's keys."""
        return bool(self.client.exists(self.key("config")))

    def load_config(self) -> JobConfig | None:
        """The job's stored configuration, None if there is none, a ConfigError naming the key if it is not one."""
        with self._typed("config"):
            data = self.client.get(self.key("config"))
        return self._config_from(data) if data is not None else None

    def _config_from(self, data: bytes | str) -> JobConfig:
        """The stored configuration ``data`` of this job, or a ConfigError that names its key and what to do."""
        try:
            config = JobConfig.from_json(data)
        except ConfigError as exc:
            raise ConfigError(f"Redis key {self.key('config')}: {exc}; delete the key (it is the job's settings, "
                              "written by its first coordinator or worker), or use another job name",
                              job=self.job) from None
        if config.job != self.job:
            raise ConfigError(f"Redis key {self.key('config')} holds the settings of job {config.job!r}, not of "
                              f"{self.job!r}: delete the key, or use another job name", job=self.job)
        return config

    # -- reports ------------------------------------------------------------------------------------------
    def post_report(self, report: Report, num_workers: int) -> bool:
        """Store a report; when it completes iteration k, queue k for the coordinator. False if duplicate; a
        ProtocolError for a report of another job, or of a worker the job of ``num_workers`` does not have."""
        _check_report(report)
        if report.job != self.job:
            raise ProtocolError(f"report of job {report.job!r} posted to the store of {self.job!r}", field="job",
                                job=self.job, worker=report.worker, iteration=report.iteration)
        stored = self.post_raw_report(report.iteration, str(report.worker), report.to_json(), num_workers)
        if stored == -2:
            raise ProtocolError(f"worker {report.worker} is not one of the job's {num_workers} workers", field="worker",
                                job=self.job, worker=report.worker, iteration=report.iteration)
        return stored == 1

    def raw_report(self, iteration: int, worker: int) -> bytes | None:
        """The payload stored for ``worker``'s report of ``iteration``, as posted; None if there is none."""
        with self._typed("reports", iteration):
            return cast("bytes | None", self.client.hget(self.key("reports", iteration), str(worker)))

    def holds(self, report: Report) -> bool:
        """Whether ``report`` itself is stored, not another of its worker and iteration: a resend's duplicate answer
        is then its own first send's, whose answer was lost (redis-py resends a command after a socket timeout)."""
        stored, sent = self.raw_report(report.iteration, report.worker), report.to_json()
        return stored in (sent, sent.decode())  # (a str from a client that decodes responses)

    def post_reports(self, reports: Sequence[Report], num_workers: int) -> int:
        """Store many reports in one round trip, each exactly as :meth:`post_report` would (a simulator's
        whole cluster); the number newly stored."""
        for report in reports:
            _check_report(report)
        pipe = self.client.pipeline(transaction=False)
        for report in reports:
            self._post_raw(report.iteration, str(report.worker), report.to_json(), num_workers, client=pipe)
        return sum(int(result) == 1 for result in pipe.execute())

    def post_raw_report(self, iteration: int, worker: str, payload: bytes, num_workers: int) -> int:
        """Store a payload as-is (the coordinator validates it later); used by tests of hostile input. 1 if
        stored, 0 for a duplicate, -1 for a payload too big, -2 for a worker id not among ``num_workers``. A ConfigError
        names the iteration's reports key where it holds another type (the only key of the script that can)."""
        _integer(num_workers, "num_workers", 1, MAX_WORKERS, self.job or None)
        with self._typed("reports", iteration):
            return int(self._post_raw(iteration, worker, payload, num_workers))

    def _post_raw(self, iteration: int, worker: str, payload: bytes, num_workers: int,
                  client: redis.client.Pipeline | None = None) -> Any:
        """Run the POST_REPORT script (on ``client``, a pipeline, when given: its result comes with execute)."""
        keys = [self.key("reports", iteration), self.key("ready"), self.key("config")]
        if iteration >= ITERATIONS_KEPT:
            old = iteration - ITERATIONS_KEPT
            keys += [self.key("reports", old), self.key("assign", old), self.key("forgotten"),
                     self.key("assign", iteration)]
        return self._post_report(keys=keys, args=[worker, payload, num_workers, self.ttl_s, iteration,
                                                  MAX_PAYLOAD_BYTES, ITERATIONS_KEPT], client=client)

    def next_ready(self, timeout_s: float) -> int | None:
        """Pop the next iteration whose reports are complete, waiting up to ``timeout_s`` (less than the
        connection's socket timeout, which would otherwise end the wait as an error)."""
        socket_timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout")
        if socket_timeout:
            timeout_s = min(timeout_s, max(socket_timeout - 1.0, socket_timeout / 2))
        with self._typed("ready"):
            item = self.client.blpop([self.key("ready")], timeout=timeout_s)
        return None if item is None else _queued(item[1])

    def drain_ready(self) -> list[int]:
        """Pop every iteration queued as complete, without waiting: a coordinator that runs behind the workers
        decides from the newest of them."""
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(self.key("ready"), 0, -1)
        pipe.delete(self.key("ready"))
        with self._typed("ready"):
            items, _ = pipe.execute()
        return [k for k in map(_queued, items) if k is not None]

    def reports(self, iteration: int) -> dict[bytes, bytes]:
        """The raw payloads posted for ``iteration``, keyed by the worker field as posted."""
        with self._typed("reports", iteration):
            return cast("dict[bytes, bytes]", self.client.hgetall(self.key("reports", iteration)))

    def forget_iterations(self, first: int, last: int) -> None:
        """Delete the reports and the assignments of iterations ``first`` to ``last``, and raise the job's clean-up
        watermark to ``last`` in the same transaction (a coordinator's write below it is refused, see
        PUBLISH_ASSIGNMENT); the coordinator does, :data:`ITERATIONS_KEPT` iterations later."""
        keys = [self.key(kind, k) for k in range(first, last + 1) for kind in ("reports", "assign")]
        if keys:
            pipe = self.client.pipeline(transaction=True)
            self._raise_watermark(keys=[self.key("forgotten")], args=[last, self.ttl_s], client=pipe)
            pipe.unlink(*keys)
            pipe.execute()

    def forgotten_through(self) -> int | None:
        """The latest iteration whose keys a clean-up of the job deleted (by any coordinator, within ``ttl_s``), None
        if none did: where the iterations still stored start."""
        try:
            through = cast("bytes | None", self.client.get(self.key("forgotten")))
        except redis.ResponseError as exc:
            if not _wrong_type(exc):
                raise
            return None  # a key of another type is no watermark, as the scripts read it; the clean-up's SET repairs it
        # as the scripts read it (_WATERMARK): plain ASCII digits, at most 16, or none
        return int(through) if through is not None and len(through) <= 16 and through.isdigit() else None

    def report_count(self, iteration: int) -> int:
        """How many workers' reports of ``iteration`` are stored."""
        return int(self.client.hlen(self.key("reports", iteration)))

    # -- assignments --------------------------------------------------------------------------------------
    def publish(self, assignment: Assignment) -> bool:
        """Write the assignment for its iteration if none exists yet; True if this call wrote it."""
        return self.publish_or_read(assignment)[0]

    def publish_or_read(self, assignment: Assignment) -> tuple[bool, bytes]:
        """Write the assignment for its iteration if none exists yet, and return whether this call wrote it and
        the stored one, in one step: a worker that read after writing could find the key flushed in between."""
        with self._typed("assign", assignment.iteration, invalid=True):
            written, raw = self._publish_on(assignment)
        return written == 1, cast("bytes", raw)

    def publish_all(self, assignments: Sequence[Assignment], *, decided_from: int | None = None) -> list[bool | None]:
        """:meth:`publish` each of ``assignments`` (a decision that covers several iterations), in one round
        trip; whether each was written, or None where it was refused: given the iteration ``decided_from``, one that
        a clean-up has deleted together with that iteration (another coordinator decided on meanwhile). False where
        the key holds another type than lbbsp writes: not written, as where an invalid value is stored (its reader
        says so), and the others are written all the same."""
        pipe = self.client.pipeline(transaction=False)
        for assignment in assignments:
            self._publish_on(assignment, pipe, decided_from)
        results = pipe.execute(raise_on_error=False)
        for result in results:
            if isinstance(result, redis.ResponseError) and not _wrong_type(result):
                raise result
        return [False if isinstance(result, redis.ResponseError) else None if int(result[0]) < 0 else int(result[0]) == 1
                for result in results]

    def _publish_on(self, assignment: Assignment, client: redis.client.Pipeline | None = None,
                    decided_from: int | None = None) -> Any:
        """Run the PUBLISH_ASSIGNMENT script (on ``client``, a pipeline, when given: its result comes with execute),
        with the clean-up's guard where ``decided_from`` is given (a coordinator's write)."""
        if assignment.job != self.job:  # it would be this job's split for good: the key is written once
            raise ProtocolError(f"assignment of job {assignment.job!r} published to the store of {self.job!r}",
                                field="job", job=self.job, iteration=assignment.iteration)
        keys = [self.key("assign", assignment.iteration), self.key("assigned")]
        if decided_from is not None:
            keys += [self.key("forgotten"), self.key("assign", decided_from)]
        return self._publish(keys=keys, args=[assignment.to_json(), self.ttl_s, assignment.iteration], client=client)

    def assigned(self, iterations: list[int]) -> list[bool]:
        """Whether each iteration has an assignment key (one round trip): every worker read it before it ran
        the iteration, so a report of an iteration without one came from out of line."""
        pipe = self.client.pipeline(transaction=False)
        for k in iterations:
            pipe.exists(self.key("assign", k))
        return [bool(n) for n in pipe.execute()]

    def get_assignment(self, iteration: int) -> bytes | None:
        """The stored assignment of ``iteration``, its TTL renewed in the same transaction: the key is written
        an iteration before it is read (lag 2), so with a short TTL it could expire between two workers' reads,
        and the second would write and use a fallback the first never saw."""
        key = self.key("assign", iteration)
        pipe = self.client.pipeline(transaction=True)
        pipe.get(key)
        pipe.expire(key, self.ttl_s)
        with self._typed("assign", iteration, invalid=True):
            raw, _ = pipe.execute()
        return cast("bytes | None", raw)

    def subscribe(self, pubsub: redis.client.PubSub | None = None) -> redis.client.PubSub:
        """A subscription to the channel that announces each newly written assignment by its iteration number, on
        ``pubsub`` where given (one unsubscribed before: its connection is reused). Redis's confirmations of
        subscribing and unsubscribing come as messages too, so that a reader can tell them from a quiet poll."""
        pubsub = pubsub if pubsub is not None else self.client.pubsub()
        pubsub.subscribe(self.key("assigned"))
        return pubsub

    # -- decision log and status --------------------------------------------------------------------------
    def record_decision(self, payload: str) -> None:
        """Log a decision (``payload``, JSON, kept among the newest ``DECISION_LOG_LENGTH``), renewing the job's
        TTL; what ``lbbsp status`` reads."""
        pipe = self.client.pipeline(transaction=True)
        pipe.lpush(self.key("decisions"), payload)
        pipe.ltrim(self.key("decisions"), 0, DECISION_LOG_LENGTH - 1)
        pipe.expire(self.key("decisions"), self.ttl_s)
        pipe.expire(self.key("config"), self.ttl_s)  # a job that runs longer than the TTL keeps its settings
        with self._typed("decisions"):
            pipe.execute()

    def record_statuses(self, statuses: dict[int, str]) -> None:
        """Store each worker's status line (JSON, by worker), renewing their TTL; what ``lbbsp status`` shows."""
        if statuses:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(self.key("workers"), mapping={str(k): v for k, v in statuses.items()})
            pipe.expire(self.key("workers"), self.ttl_s)
            with self._typed("workers"):
                pipe.execute()

    def decision_count(self) -> int:
        """How many decisions the job's log holds (at most ``DECISION_LOG_LENGTH``): 0 for a new job."""
        with self._typed("decisions"):
            return int(self.client.llen(self.key("decisions")))

    def claim_coordinator(self, identity: str, ttl_s: int) -> str | None:
        """Mark ``identity`` as the job's coordinator for ``ttl_s`` seconds; the identity of another live
        coordinator that had marked it, if any (UNKNOWN_CLAIM where its value is no identity lbbsp writes; none where
        the key held another Redis type, which is no claim, as the scripts read it: the SET replaces it)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.key("coordinator"))
        pipe.set(self.key("coordinator"), identity, ex=ttl_s)
        previous, written = pipe.execute(raise_on_error=False)
        for result in (previous, written):
            if isinstance(result, redis.ResponseError) and not _wrong_type(result):
                raise result
        if isinstance(previous, redis.ResponseError):
            return None
        return _claimant(previous) if previous != identity.encode() else None

    def claim_if_free(self, identity: str, ttl_s: int) -> str | None:
        """Mark ``identity`` as the job's coordinator for ``ttl_s`` seconds where no coordinator claims the job, in one
        step: a check and a claim apart had let two coordinators started together both find the job free; else the
        identity of the one that claims it (as :meth:`coordinator` reads it), and nothing is written."""
        claim = self._claim_if_free(keys=[self.key("coordinator")], args=[identity, ttl_s])
        return _claimant(cast("bytes | None", claim))

    def coordinator(self) -> str | None:
        """The identity (host:pid:tag) of the coordinator that claimed the job in the last few seconds, if any:
        a serving coordinator renews its claim every second, for 5 s. UNKNOWN_CLAIM where the claim's value is no
        identity lbbsp writes (a live claim all the same)."""
        with self._typed("coordinator"):
            return _claimant(cast("bytes | None", self.client.get(self.key("coordinator"))))

    def coordinator_claim(self) -> tuple[str, int] | None:
        """The job's claim as :meth:`coordinator` reads it, with the milliseconds it has left (-1 for a claim without
        a TTL, which only a foreign writer leaves), read in one transaction: apart, the claim could lapse, or another
        coordinator's replace it, between the two reads. None where no coordinator claims the job."""
        pipe = self.client.pipeline(transaction=True)
        pipe.get(self.key("coordinator"))
        pipe.pttl(self.key("coordinator"))
        with self._typed("coordinator"):
            claim, left_ms = pipe.execute()
        identity = _claimant(claim)
        return None if identity is None else (identity, int(left_ms))

    def release_coordinator(self, identity: str) -> None:
        """Drop ``identity``'s claim on the job, if it still holds it: the next coordinator of the job (a
        rerun under the same name) is then not warned about one that has stopped."""
        self._release(keys=[self.key("coordinator")], args=[identity])

    def decisions(self, count: int = 20) -> list[bytes]:
        """The newest ``count`` decision records, newest first."""
        with self._typed("decisions"):
            return cast("list[bytes]", self.client.lrange(self.key("decisions"), 0, count - 1))

    def worker_statuses(self) -> dict[bytes, bytes]:
        """Each worker's latest status line as the coordinator wrote it, by worker id (bytes, as stored)."""
        with self._typed("workers"):
            return cast("dict[bytes, bytes]", self.client.hgetall(self.key("workers")))

    def forget(self, *, unless_claimed: bool = False) -> int:
        """Delete every key of this job now, rather than at its TTL (a simulated job on a shared Redis); the
        number deleted. With ``unless_claimed`` (`lbbsp forget`), a ConfigError that names the coordinator claiming
        the job, and nothing deleted, where one does: the check and the deletes are one script, so a coordinator
        that claims the job while its keys are listed keeps them."""
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + "*"  # the prefix, escaped
        # SCAN may give a key twice while Redis resizes its table (a busy shared server): each is deleted once
        keys = list(dict.fromkeys(self.client.scan_iter(match=pattern, count=1000)))
        if not unless_claimed:
            return int(self.client.unlink(*keys)) if keys else 0
        deleted, result, *left_ms = self._forget_unclaimed(keys=[self.key("coordinator"), *keys])
        if not deleted:
            claimant = _claimant(result) or UNKNOWN_CLAIM
            if left_ms == [-1]:
                raise ConfigError(no_expiry(self.key("coordinator"), claimant), job=self.job)
            raise ConfigError(f"job {self.job!r} is served by the coordinator {claimant}: stop that coordinator first "
                              "(its workers would lose their settings and splits), then forget the job", job=self.job)
        return int(result)

    def jobs(self) -> Iterator[str]:
        """Names of the jobs with a stored configuration on this Redis; a key of that pattern whose middle is no job
        name (not UTF-8, a space, a colon: only a foreign writer makes one) is skipped, not fatal to the listing. Each
        job once: SCAN may give a key twice while Redis resizes its table, and `lbbsp status` had then shown a job
        twice."""
        for key in dict.fromkeys(self.client.scan_iter(match="lbbsp:*:config", count=1000)):
            try:
                job = _job_name(key.decode()[len("lbbsp:"):-len(":config")])
            except (UnicodeDecodeError, ConfigError):
                continue
            yield job


def _store(store: object, job: str, for_url: str = "Store.from_url(url, job)") -> Store:
    """``store`` if it is a Store, else a ConfigError that says what to pass for a URL (``for_url``), the URL's
    password left out of it."""
    if not isinstance(store, Store):
        given = redacted(store) if isinstance(store, str) else store
        raise ConfigError(f"store must be a Store (for a URL: {for_url}), got {given!r:.80}", job=job)
    return store


def _check_report(report: object) -> None:
    """A TypeError for what is no Report (a dict of its fields had raised an AttributeError on ``.job``)."""
    if not isinstance(report, Report):
        raise TypeError(f"expected a Report, got {type(report).__name__}: build one with Report(job, worker, "
                        "iteration, samples, compute_s, features=...), or Report.from_json(data)")


#: Seconds the commands' first look at a Redis (`lbbsp status`, `lbbsp coordinator` as it starts, `lbbsp simulate
#: --redis`) waits on each call (three tries): a Redis that accepts but never answers had held them 16-17 s (5 s socket
#: timeouts) before a word.
PROBE_TIMEOUT_S = 1.0


def answering(url: str, job: str, *, source: str = "", socket_timeout_s: float = 5.0) -> Store:
    """A store of ``job`` on ``url`` whose Redis answered a ping; else its ConfigError (a URL it cannot use) or
    StoreUnavailable, the message led by ``source`` where one is given (``$LBBSP_REDIS_URL``: a user who had set it
    and forgotten was told "cannot reach Redis at ..." of a URL never typed)."""
    def sourced(exc: LBBSPError) -> LBBSPError:
        return type(exc)(f"{source}: {exc.message}", job=exc.job) if source else exc

    try:
        store = Store.from_url(url, job, socket_timeout_s=socket_timeout_s)
    except ConfigError as exc:
        raise sourced(exc) from None
    try:
        store.ping()
    except StoreUnavailable as exc:
        store.close()
        raise sourced(exc) from None
    return store


def wait_for_redis(url: str, timeout_s: float, *, socket_timeout_s: float = 5.0) -> redis.Redis:
    """Connect and ping until Redis answers or ``timeout_s`` passes; a client with ``socket_timeout_s`` and the usual
    retries. Each ping is one try, bounded by the time left, so a server that accepts but never answers is given up on
    after about ``timeout_s``: a ping with the client's own retries had waited three socket timeouts (10 s for 1)."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    hint = ""
    while True:
        left = deadline - time.monotonic()
        if last is not None and left <= 0:
            break
        probe = connect(url, socket_timeout_s=min(socket_timeout_s, max(left, 0.05)), retries=0)
        try:
            probe.ping()
        except REDIS_ERRORS as exc:
            last, hint = exc, _tls_hint(probe, exc)
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))
            continue
        finally:
            probe.close()
        return connect(url, socket_timeout_s=socket_timeout_s)
    raise StoreUnavailable(f"Redis at {redacted(url)} did not answer within {timeout_s:g}s: {last}{hint}")
