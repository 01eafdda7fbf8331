"""The ``lbbsp`` command: run a coordinator, show a job's status, forget a finished job, run the demo or the
simulator."""
from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import importlib
import io
import json
import logging
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import redis

from . import __version__
from .client_history import flower_jobs, is_flower_job
from .config import JobConfig, _job_name
from .embedded import EmbeddedRedis, no_room
from .errors import ConfigError, LBBSPError
from .job_status import brief_status, json_status, print_status, read_job
from .signals import off_the_handler
from .store import (
    PROBE_TIMEOUT_S,
    REDIS_ERRORS,
    REDIS_URL_VARIABLE,
    Store,
    answering,
    explain,
    left_by_earlier_run,
    no_expiry,
    redacted,
    redis_url,
)

# The coordinator, the models and the policies import scikit-learn, seconds on a loaded machine: `lbbsp --help`,
# `status` and `forget` need none of them, so `coordinator` alone imports them, where it uses them.
if TYPE_CHECKING:

    from .coordinator import Coordinator
    from .models import CapacityModel
    from .policies import Policy

#: Subcommands that live beside a framework or a heavy module; each module has add_arguments() and run().
_EXTERNAL = {
    "demo": ("lbbsp.integrations.demo", "train a model with plain BSP and with LB-BSP, side by side"),
    "simulate": ("lbbsp.sim.cli", "compare balancing policies on a simulated cluster"),
}


def _given_redis(args: argparse.Namespace) -> tuple[str, str]:
    """The Redis URL of ``--redis`` or $LBBSP_REDIS_URL, and which gave it: `status` and `forget` work on a job's
    Redis, and start none."""
    url, source = redis_url(args.redis)
    if url is None:
        raise LBBSPError("no Redis to read: pass --redis URL or set LBBSP_REDIS_URL (the coordinator prints it)")
    return url, source


def probe_redis(url: str, job: str, source: str, *, socket_timeout_s: float | None = None) -> Store:
    """A store of ``job`` whose Redis answered (on the commands' short timeout unless ``socket_timeout_s`` is given);
    its error names $LBBSP_REDIS_URL where the URL is the variable's (a URL typed after --redis, or the embedded
    server's, goes unnamed): the commands' and `lbbsp demo`'s one rule."""
    named = source if source == f"${REDIS_URL_VARIABLE}" else ""
    timeout_s = PROBE_TIMEOUT_S if socket_timeout_s is None else socket_timeout_s
    return answering(url, job, source=named, socket_timeout_s=timeout_s)


def _models() -> dict[str, Callable[[int, int], CapacityModel]]:
    """``lbbsp coordinator --model``: the capacity model each name builds, given the job's lag (the forecast
    horizon) and the federated clients' local steps per round (the client model's)."""
    from .models import (  # noqa: PLC0415  (scikit-learn: see the imports above)
        AutoCapacityModel,
        BatchTimeCurve,
        EWMAThroughput,
        FLClientModel,
        LastValue,
        NARXThroughput,
        TimeWeightedThroughput,
    )

    return {
        "auto": lambda lag, steps: AutoCapacityModel({"fl": FLClientModel(steps)} if steps > 1 else None, horizon=lag),
        "narx": lambda lag, steps: NARXThroughput(horizon=lag), "ewma": lambda lag, steps: EWMAThroughput(),
        "time-weighted": lambda lag, steps: TimeWeightedThroughput(),
        "last-value": lambda lag, steps: LastValue(), "gpu-curve": lambda lag, steps: BatchTimeCurve(),
        "fl-client": lambda lag, steps: FLClientModel(steps),
    }


def _policies() -> dict[str, Callable[[CapacityModel | None, argparse.Namespace], Policy]]:
    """``lbbsp coordinator --policy``: the policy each name builds around a model. Not the simulator's oracle, which
    needs the future, nor backup workers, whose dropped gradients no integration implements."""
    from .policies import (  # noqa: PLC0415  (scikit-learn: see the imports above)
        PER_EPOCH_ITERATIONS,
        BSPPolicy,
        LBBSPPolicy,
        LeaderStragglerPolicy,
        PerEpochPolicy,
        StaticProportionalPolicy,
    )

    return {
        "lbbsp": lambda model, args: LBBSPPolicy(model), "bsp": lambda model, args: BSPPolicy(),
        "static-proportional": lambda model, args: StaticProportionalPolicy(),
        "per-epoch": lambda model, args: PerEpochPolicy(args.epoch_iterations or PER_EPOCH_ITERATIONS, model=model),
        "leader-straggler": lambda model, args: LeaderStragglerPolicy(model=model),
    }


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum`` (a negative count was taken, and meant nothing)
    and at most ``maximum``; argparse's error then names the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"in [{minimum}, {maximum}]" if maximum is not None else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def batch_caps(text: str) -> int | tuple[int, ...]:
    """An argparse type: one cap for every worker (48), or one per worker, comma-separated (48,16; one worker's,
    48,), as ``JobConfig(max_batch=...)`` takes them; JobConfig checks the count and the bounds."""
    parts = [part.strip() for part in text.split(",")]
    per_worker = len(parts) > 1
    if per_worker and not parts[-1]:
        parts.pop()  # "48,": the caps of a job of one worker
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected one cap, or whole numbers separated by commas, got {text!r}")
    caps = tuple(map(whole_number(0), parts))
    return caps if per_worker else caps[0]


def kind_pin(text: str) -> tuple[int, str]:
    """An argparse type: WORKER=KIND, a worker id and one of the kinds :class:`AutoCapacityModel` routes to."""
    from .models import KINDS  # noqa: PLC0415  (scikit-learn: see the imports above)

    worker, _, kind = text.partition("=")
    if not (worker.strip().isascii() and worker.strip().isdigit()) or kind not in KINDS:  # "١" and "²" are digits
        raise argparse.ArgumentTypeError(f"expected WORKER=KIND with WORKER a worker id (0 and up) and KIND one of "
                                         f"{', '.join(KINDS)} (e.g. 3=gpu), got {text!r}")
    return int(worker), kind


def _kind_values_joined(argv: list[str]) -> list[str]:
    """``argv`` with each ``--kind VALUE`` whose VALUE starts as a negative number does (``-1=gpu``) given as
    ``--kind=VALUE``: argparse takes such a VALUE for an option and said only "expected one argument", where
    :func:`kind_pin` says what is wrong with it. Nothing after ``--`` is touched."""
    joined: list[str] = []
    for arg in argv:
        if joined and joined[-1] == "--kind" and re.match(r"-\d", arg) and "--" not in joined:
            joined[-1] = f"--kind={arg}"
        else:
            joined.append(arg)
    return joined


def kind_model(text: str) -> tuple[str, str]:
    """An argparse type: KIND=MODEL, the model one kind's workers get under ``--model auto``."""
    from .models import KINDS  # noqa: PLC0415  (scikit-learn: see the imports above)

    kind, _, name = text.partition("=")
    names = sorted(set(_models()) - {"auto"})
    if kind not in KINDS or name not in names:
        raise argparse.ArgumentTypeError(f"expected KIND=MODEL with KIND one of {', '.join(KINDS)} and MODEL one of "
                                         f"{', '.join(names)} (e.g. cpu=ewma), got {text!r}")
    return kind, name


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


#: The flag of each JobConfig field that ``lbbsp coordinator`` sets, for the errors that JobConfig raises.
_FLAGS = {"num_workers": "--workers", "global_batch": "--global-batch", "min_batch": "--min-batch",
          "max_batch": "--max-batch", "assignment_timeout_s": "--timeout", "ttl_s": "--ttl", "lag": "--lag",
          "job name": "--job"}


def _job_config(args: argparse.Namespace) -> JobConfig:
    """The job's settings from the flags; a ConfigError that names the flags, not JobConfig's fields."""
    try:
        return JobConfig(args.job, args.workers, args.global_batch, min_batch=args.min_batch,
                         max_batch=args.max_batch, assignment_timeout_s=args.timeout, lag=args.lag, ttl_s=args.ttl)
    except ConfigError as exc:
        raise _flagged(exc) from None


def _job_flag(job: str) -> str:
    """``--job``'s value if it is a job name, else a ConfigError that names the flag, in every subcommand alike."""
    try:
        return _job_name(job)
    except ConfigError as exc:
        raise _flagged(exc) from None


def _flagged(exc: ConfigError) -> ConfigError:
    """``exc`` with JobConfig's names of the settings replaced by the flags that set them."""
    names = "|".join(re.escape(name) for name in _FLAGS)  # not in a value quoted after "got": what was typed
    return ConfigError(re.sub(rf"""(got (?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"))|\b({names})\b""",
                              lambda m: m[1] or _FLAGS[m[2]], str(exc)))


def _redis_flag(url: str, source: str) -> str:
    """The ``--redis`` a command offered in an error needs to reach ``url``: none where $LBBSP_REDIS_URL gave it (read
    again), the URL quoted for a shell, or ``--redis URL`` where it holds a password, which an error never shows."""
    if source != "--redis":
        return ""
    return "--redis URL" if redacted(url) != url else f"--redis {shlex.quote(url)}"


def _same_settings(store: Store, config: JobConfig, redis_flag: str = "") -> None:
    """A ConfigError naming, as flags, the settings in which the flags' ``config`` differs from those the job's
    ``store`` holds: the one the coordinator would raise names JobConfig's fields, which a user of this command never
    sets. Where they are a finished run's (:meth:`Store.run_is_over`), kept ttl_s after its last decision, the error
    says how to clear them, in the store's words, with the ``redis_flag`` that reaches them."""
    stored = store.load_config()
    differ = [f"{_FLAGS.get(name, name)} {_setting(ours)} (not {_setting(theirs)})"
              for name, (ours, theirs) in (stored.differences(config) if stored is not None else {}).items()]
    if not differ:
        return
    if store.run_is_over():
        raise ConfigError(left_by_earlier_run(config.job, ", ".join(differ), redis_flag))
    raise ConfigError(f"job {config.job!r} already runs with {', '.join(differ)}: give the job's settings, or "
                      "another --job")


def _setting(value: object) -> str:
    """A JobConfig value as its flag takes it: 10 for 10.0 seconds, "unset" for None."""
    if isinstance(value, tuple):  # per-worker caps, as --max-batch takes them ("40," for one worker's)
        return ",".join(map(str, value)) + "," * (len(value) == 1)
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _host(url: str) -> str:
    """The host of a redis:// URL, for listing the other addresses a server is reached at."""
    return url.rpartition("@")[2].rpartition(":")[0]


_Key = TypeVar("_Key", int, str)


def _once(flag: str, given: list[tuple[_Key, str]] | None) -> dict[_Key, str]:
    """A repeatable KEY=VALUE flag's pairs as a dict; a key given two different values is an error (not the last
    silently winning)."""
    pairs: dict[_Key, str] = {}
    for key, value in given or ():
        if pairs.setdefault(key, value) != value:
            raise LBBSPError(f"{flag} {key}={pairs[key]} and {flag} {key}={value} contradict each other: give {key} "
                             "one value")
    return pairs


def _routing(args: argparse.Namespace) -> tuple[dict[int, str], dict[str, str], list[str], bool]:
    """The kinds pinned (``--kind``), the models of kinds (``--kind-model``), the two as flags, and whether the
    policy keeps its own average of speed (per-epoch given no model): what :func:`_policy` builds from, and what the
    start-up line says."""
    pins, kind_models = _once("--kind", args.kind), _once("--kind-model", args.kind_model)
    flags = [f"--kind {w}={k}" for w, k in pins.items()] + [f"--kind-model {k}={m}" for k, m in kind_models.items()]
    return pins, kind_models, flags, args.model is None and args.policy == "per-epoch" and not flags


def _policy(args: argparse.Namespace) -> Policy:
    """The policy the flags name; ``--model`` only where the policy predicts with one, ``--kind`` and
    ``--kind-model`` only with the auto model."""
    from .models import AutoCapacityModel  # noqa: PLC0415  (scikit-learn: see the imports above)

    pins, kind_models, flags, own_average = _routing(args)
    routed = " ".join(flags)
    if args.model is not None and args.policy in ("bsp", "static-proportional"):
        raise LBBSPError(f"--policy {args.policy} uses no capacity model; drop --model {args.model}")
    if routed and (args.policy in ("bsp", "static-proportional") or args.model not in (None, "auto")):
        raise LBBSPError(f"{routed}: only the auto model routes workers by kind, and --policy {args.policy} "
                         f"{'uses no model' if args.model is None else f'with --model {args.model} does not'}")
    if outside := sorted(w for w in pins if w >= args.workers):
        raise LBBSPError(f"--kind: worker(s) {outside} outside the job's workers 0..{args.workers - 1}")
    if args.epoch_iterations is not None and args.policy != "per-epoch":
        raise LBBSPError(f"--epoch-iterations is per-epoch's; --policy {args.policy} decides every iteration")
    fl_model = (kind_models.get("fl", "fl-client") if args.model in (None, "auto") else args.model) == "fl-client"
    if args.local_steps is not None and (not fl_model or own_average or args.policy in ("bsp", "static-proportional")):
        raise LBBSPError(f"--local-steps is the fl-client model's (the clients' steps per round), and --policy "
                         f"{args.policy}" + (f" with --model {args.model}" if args.model else "")
                         + (" with --kind-model fl=" + kind_models["fl"] if "fl" in kind_models else "")
                         + " has none")
    steps = args.local_steps or 1
    models, policies = _models(), _policies()
    if own_average:
        return policies[args.policy](None, args)
    if routed:
        given = {"fl": "fl-client"} | kind_models if steps > 1 else kind_models
        model: CapacityModel = AutoCapacityModel({kind: models[name](args.lag, steps) for kind, name in given.items()},
                                                 pins, horizon=args.lag)
    else:
        model = models[args.model or "auto"](args.lag, steps)
    return policies[args.policy](model, args)


def _model_said(args: argparse.Namespace, policy: Policy) -> str:
    """The model the policy predicts with, as the start-up line says it, with the kinds pinned and the models of
    kinds given (they had gone unsaid, so that a user could not tell they were taken); "" for a policy without."""
    if getattr(policy, "model", None) is None or args.policy == "static-proportional":  # the latter: its own profile
        return ""
    _, _, flags, own_average = _routing(args)
    said = " with its own slow EWMA" if own_average else f" with the {args.model or 'auto'} model"
    given = flags + ([f"--local-steps {args.local_steps}"] if args.local_steps else [])
    return said + (f" ({', '.join(given)})" if given else "")


def _coordinator(args: argparse.Namespace) -> int:
    from .coordinator import Coordinator  # noqa: PLC0415  (scikit-learn: see the imports above)
    from .coordinator_process import freeze_heap  # noqa: PLC0415  (scikit-learn: see the imports above)

    config = _job_config(args)  # bad flags: no server
    policy = _policy(args)
    url, source = redis_url(args.redis)
    if url is not None and args.listen is not None:
        raise LBBSPError("--listen serves the embedded Redis on TCP: drop it, or drop --redis (and $LBBSP_REDIS_URL)")
    server, store, stop = None, None, _StopSignals()
    # from here on, so that a stop during start-up (as PID 1, a SIGTERM had been ignored) is one too; and to the end,
    # so that one during the final clean-up (the claim released) changes nothing (_StopSignals.closing)
    with stop:
        try:
            if url is None:
                server = EmbeddedRedis(listen=args.listen)
                url = server.url
                print(f"started an embedded redis-server: --redis {url}", flush=True)
                if args.listen is not None:
                    first, *others = server.peer_urls()
                    also = f" (or the same at {', '.join(_host(u) for u in others)})" if others else ""
                    print(f"workers on other machines: --redis {first}{also}", flush=True)
            # checked on a short timeout, as `lbbsp status` does: a Redis that never answers is an error in seconds
            with probe_redis(url, args.job, source) as probe:
                _same_settings(probe, config, _redis_flag(url, source))
                if (serving := probe.coordinator()) is not None:
                    _claim_lapsed(probe, serving, stop)
            store = Store.from_url(url, args.job)
            coordinator = Coordinator(store, config, policy, max_ahead=args.max_ahead)
            # one that claimed the job since the check above (a signal during the wait: it stops before serving)
            if stop.received is None and (serving := coordinator.claim()) is not None:
                raise LBBSPError(f"job {args.job!r} is served by the coordinator {serving}, which started beside this "
                                 "one: stop it first, or use another --job")
            stop.serving(coordinator)
            print(f"coordinating job {args.job!r}: {args.workers} workers, global batch {args.global_batch}, policy "
                  f"{policy.name}{_model_said(args, policy)}", flush=True)
            freeze_heap()
            coordinator.run(max_decisions=args.max_decisions)
        except _CutShort as exc:
            stop.closing()
            when, hint = exc.args
            left = ("without releasing the coordinator's claim on it (which expires within 5 s)"
                    if stop.coordinator is not None else "before serving it")
            print(f"lbbsp: job {args.job!r}: stopped {when}, {left}{hint}", file=sys.stderr)
            return 128 + stop.signum
        finally:
            stop.closing()
            if store is not None:
                store.close()
            if server is not None:
                server.close()
        made = coordinator.decisions_made
        print(f"stopped serving job {args.job!r} after {made} decision{'s' * (made != 1)} "
              f"({stop.received or '--max-decisions'})", flush=True)
    return 0


def _claim_lapsed(store: Store, claim: str, stop: _StopSignals) -> None:
    """Return once ``claim``, another coordinator's claim on the job found at start-up, lapses (one that crashed
    leaves it to expire), or a signal came; an LBBSPError where it is a live coordinator's: renewed (its TTL went
    back up, or another identity wrote it) or still there when the claim's lifetime is over. Two coordinators of one
    job take turns at its iterations, and each model learns from only part of them."""
    from .coordinator import CLAIM_S  # noqa: PLC0415  (scikit-learn: see the imports above)

    def endless(held: tuple[str, int] | None) -> tuple[str, int] | None:
        if held is not None and held[1] == -1:
            raise LBBSPError(f"job {store.job!r}: {no_expiry(store.key('coordinator'), held[0])}")
        return held

    held = endless(store.coordinator_claim())
    # neutral: the claim may be a live coordinator's (then refused below, within about a second) or a crashed one's
    print(f"job {store.job!r}: coordinator {claim} holds a claim on this job: waiting up to {CLAIM_S} s for it to "
          "lapse (a coordinator that stopped without releasing it) or be renewed (one that serves the job)", flush=True)
    deadline = time.monotonic() + CLAIM_S
    before_ms: int | None = None  # the claim's lifetime left at the read before
    while stop.received is None:
        if held is None:
            return
        seen, left_ms = held
        if seen != claim or (before_ms is not None and left_ms > before_ms) or time.monotonic() > deadline:
            raise LBBSPError(f"job {store.job!r} is served by the coordinator {seen} (its claim renewed within the "
                             f"last {CLAIM_S} s): stop it first, or use another --job")
        before_ms = left_ms
        time.sleep(0.1)
        held = endless(store.coordinator_claim())


#: Seconds a signalled coordinator has to end its step and release its claim on the job before it exits anyway: each
#: call to a Redis that stopped answering waits out a 5 s socket timeout, three times (29 s in all), and `docker stop`
#: kills at 10 s.
STOP_GRACE_S = 3.0
#: A repeat of the first stop signal this soon after it is the same stop, not a second one that cuts the stop short.
_SAME_SIGNAL_S = 0.2


class _CutShort(KeyboardInterrupt):
    """A stopping coordinator's clean-up cut short, by a second signal or by :data:`STOP_GRACE_S` running out; its
    args: when, and a hint. A KeyboardInterrupt, so that no ``except Exception`` on the way (a step's) holds it."""


class _StopSignals:
    """While in use: SIGTERM, SIGINT and SIGHUP stop ``coordinator`` after its current step, which then releases its
    claim on the job; a second signal (not the first's repeat within :data:`_SAME_SIGNAL_S`), or :data:`STOP_GRACE_S`
    later, raises :class:`_CutShort` in the main thread,
    and again every 0.25 s (the step's clean-up makes Redis calls of its own, each of which would wait 15 s).
    A signal ignored when the command started (SIGHUP under nohup, SIGINT in a background job) stays ignored."""

    def __init__(self) -> None:
        self.coordinator: Coordinator | None = None
        self.received: str | None = None  # the first signal's name
        self.signum = 0
        self._first_at = 0.0  # when the first signal came (time.monotonic)
        self._cut: tuple[str, str] | None = None  # what _CutShort says
        self._closing = False  # whether only the clean-up is left (closing)
        self._previous: dict[int, Any] = {}

    def serving(self, coordinator: Coordinator) -> Coordinator:
        """``coordinator``, the one to stop from now on: stopped already if a signal came while it was built."""
        self.coordinator = coordinator
        if self.received is not None:
            coordinator.stop(timeout_s=0)
        return coordinator

    def __enter__(self) -> _StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._stop)
        self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._again)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def closing(self) -> None:
        """From here on only the command's clean-up is left (closing its Redis, the embedded server; the coordinator's
        claim released or given up): a signal changes nothing, where it had killed the process (-15) and left the
        embedded server's files behind. No :data:`STOP_GRACE_S` either: the clean-up takes no Redis call."""
        self._closing = True
        signal.setitimer(signal.ITIMER_REAL, 0)

    def _stop(self, signum: int, frame: object) -> None:
        if self._closing:
            return
        if self.received is None:
            self.received, self.signum, self._first_at = signal.Signals(signum).name, signum, time.monotonic()
            if self.coordinator is not None:
                off_the_handler(functools.partial(self.coordinator.stop, timeout_s=0))
            signal.setitimer(signal.ITIMER_REAL, STOP_GRACE_S, 0.25)
        elif signum == self.signum and time.monotonic() - self._first_at < _SAME_SIGNAL_S:
            return  # one stop sent twice: GNU timeout signals the process, then its group, microseconds apart
        elif self._cut is None:
            self._cut = (f"at a second {signal.Signals(signum).name}", "")
            signal.setitimer(signal.ITIMER_REAL, 0.25, 0.25)
            raise _CutShort(*self._cut)

    def _again(self, signum: int, frame: object) -> None:
        if self._closing:
            return
        self._cut = self._cut or (f"{STOP_GRACE_S:g} s after {self.received}", ": does Redis answer?")
        raise _CutShort(*self._cut)


def _status(args: argparse.Namespace) -> int:
    """Show each job (or --job): a sentence and a table, one line (--brief) or one JSON document (--json); 1 with
    --check where a job listed has no coordinator or could not be read."""
    url, source = _given_redis(args)
    if args.job is not None:
        _job_flag(args.job)
    if args.brief and args.decisions:
        raise LBBSPError(f"--brief shows one line per job, without decisions: drop --decisions {args.decisions}, or "
                         "--brief for the tables")
    with probe_redis(url, args.job or "", source) as probe:
        jobs = [args.job] if args.job else sorted(probe.jobs())
        only_federated = bool(args.job) and not probe.has_config() and is_flower_job(probe.client, args.job)
        federated = flower_jobs(probe.client) if not jobs and not args.json else []  # a SCAN, only where none shows
    if only_federated:
        raise LBBSPError(f"{args.job!r} is a federated job (LoadBalanced's client history), with no coordinator to "
                         f"show: its rounds are in the ServerApp's log (`flwr log RUN_ID`); `lbbsp forget --job "
                         f"{args.job}` deletes its history")
    if not jobs and not args.json:
        print("no lbbsp jobs on this Redis" + (f" but the client histories of federated jobs, whose rounds are in "
                                               f"their ServerApps' logs: {', '.join(federated)}" if federated else ""))
        return 0
    shown: list[dict[str, Any]] = []
    unread = unserved = 0
    for job in jobs:
        status = read_job(url, job, args.decisions, named=bool(args.job))
        if status is None:
            unread += 1
            continue
        unserved += status.serving is None
        if args.json:
            shown.append(json_status(status, args.decisions))
        elif args.brief:
            print(brief_status(status))
        else:
            print_status(status, args.decisions)
    if args.json:
        print(json.dumps(shown[0] if args.job else shown, indent=2))
    return 1 if args.check and (unread or unserved) else 0


def _forget(args: argparse.Namespace) -> int:
    """Delete a finished job's keys now, not ttl_s after its last decision: a rerun under its name then starts
    afresh, with any settings, where it would resume the old run or be refused for settings that differ. Refused
    while a coordinator serves the job, whose workers would lose their settings and splits."""
    url, source = _given_redis(args)
    with probe_redis(url, _job_flag(args.job), source) as store:
        try:  # whether a coordinator claims the job is checked in the script that deletes: also one that just did
            deleted = store.forget(unless_claimed=True)
        except ConfigError as exc:
            raise LBBSPError(exc.message) from None  # it names the job: no "[job=...]" after it
    if deleted:
        print(f"forgot job {args.job!r}: deleted its {deleted} key{'s' * (deleted != 1)} from this Redis")
    else:
        print(f"no job {args.job!r} on this Redis (it never started, or its keys expired): nothing to forget; "
              "`lbbsp status` lists the jobs there")
    return 0


class _WithDefaults(argparse.HelpFormatter):
    """Help that shows each flag's default, unless its text already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


def _verbose_flag(parser: argparse.ArgumentParser) -> None:
    """-v, taken before a subcommand and after it alike."""
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def _coordinator_flags(coordinator: argparse.ArgumentParser) -> None:
    """The flags of ``lbbsp coordinator``."""
    from .coordinator import AHEAD_LIMIT, MAX_AHEAD  # noqa: PLC0415  (scikit-learn: see the imports above)
    from .models import KINDS  # noqa: PLC0415
    from .models.fl_client import MAX_LOCAL_STEPS  # noqa: PLC0415
    from .policies import PER_EPOCH_ITERATIONS  # noqa: PLC0415

    coordinator.add_argument("--redis", help="Redis URL (redis://, rediss://, unix://); default: $LBBSP_REDIS_URL, "
                                             "or else start an embedded one")
    coordinator.add_argument("--listen", metavar="ADDRESS", default=None,
                             help="with no --redis: serve the embedded Redis on TCP at ADDRESS too (an IPv4 or "
                                  "IPv6 address; 0.0.0.0: every IPv4 interface; '::': every interface) for workers "
                                  "on other machines, behind a random password; the URL to give them is printed")
    coordinator.add_argument("--job", default="default", help="job name shared with the workers")
    coordinator.add_argument("--workers", type=whole_number(1), required=True, help="number of workers")
    coordinator.add_argument("--global-batch", type=whole_number(1), required=True, help="global batch size B")
    coordinator.add_argument("--min-batch", type=whole_number(0), default=1, help="smallest per-worker batch")
    coordinator.add_argument("--max-batch", type=batch_caps, default=None, metavar="CAP[,CAP...]",
                             help="largest per-worker batch: one for every worker, or one per worker, comma-separated")
    coordinator.add_argument("--timeout", type=seconds, default=10.0, help="assignment timeout of the workers, s")
    coordinator.add_argument("--lag", type=whole_number(1, 8), default=2,
                             help="decide iteration k + LAG from the reports of k (2: off the critical path)")
    coordinator.add_argument("--ttl", type=whole_number(10), default=3600,
                             help="seconds the job's keys live after its last decision (JobConfig.ttl_s)")
    coordinator.add_argument("--policy", choices=sorted(_policies()), default="lbbsp",
                             help="how sizes are chosen (docs/simulator.md compares them)")
    coordinator.add_argument("--model", choices=sorted(_models()), default=None,
                             help="the capacity model of lbbsp, per-epoch or leader-straggler (default: auto, which "
                                  "picks NARX, the GPU curve or the client model from each worker's reports; per-epoch's "
                                  "is its own slow EWMA, which sets no memory caps: give GPU jobs --model auto)")
    coordinator.add_argument("--kind", type=kind_pin, action="append", metavar="WORKER=KIND",
                             help=f"with the auto model: pin a worker's kind ({', '.join(KINDS)}) instead of reading "
                                  "it from its reports, e.g. --kind 3=gpu; repeatable")
    coordinator.add_argument("--kind-model", type=kind_model, action="append", metavar="KIND=MODEL",
                             help="with the auto model: the model of one kind's workers, e.g. --kind-model cpu=ewma "
                                  "(defaults: cpu=narx, gpu=gpu-curve, fl=fl-client); repeatable")
    coordinator.add_argument("--local-steps", type=whole_number(1, MAX_LOCAL_STEPS), default=None, metavar="N",
                             help="federated clients: local steps each client runs per round, which the fl-client "
                                  "model (also auto's for fl workers) weighs compute by (default 1)")
    coordinator.add_argument("--epoch-iterations", type=whole_number(1), default=None, metavar="N",
                             help=f"--policy per-epoch: iterations between rebalancings, as an epoch's (default "
                                  f"{PER_EPOCH_ITERATIONS})")
    coordinator.add_argument("--max-ahead", type=whole_number(1, AHEAD_LIMIT), default=MAX_AHEAD, metavar="N",
                             help="most iterations one decision covers while decisions take longer than the workers' "
                                  "steps (1: one decision per iteration, which the workers then wait for)")
    coordinator.add_argument("--max-decisions", type=whole_number(1), default=None,
                             help="exit after this many decisions")


def build_parser(*, coordinator_flags: bool = True) -> argparse.ArgumentParser:
    """The ``lbbsp`` command's parser; ``demo`` and ``simulate`` are only named here (their modules parse them).
    ``coordinator_flags=False`` leaves out the flags of ``coordinator``, whose choices and defaults come from the
    models and policies (scikit-learn, seconds to import): a command line of another subcommand parses without."""
    parser = argparse.ArgumentParser(prog="lbbsp", description="Load-balanced BSP: run a job's coordinator, show "
                                     "what each job is doing, forget a finished job, run the demo or the simulator.")
    parser.add_argument("--version", action="version", version=f"lbbsp {__version__}")
    _verbose_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    coordinator = sub.add_parser("coordinator", help="run the BatchSize Manager for one job",
                                 description="Decide each iteration's batch-size vector for one job from its workers' "
                                             "reports, until stopped (Ctrl-C, SIGTERM or SIGHUP: after its step) or "
                                             "--max-decisions. The integrations start one on worker 0 by themselves; "
                                             "Balancer.from_env(..., coordinator=False) "
                                             "leaves a PyTorch job to this one.",
                                 formatter_class=_WithDefaults)
    if coordinator_flags:
        _coordinator_flags(coordinator)
    _verbose_flag(coordinator)
    coordinator.set_defaults(handler=_coordinator)

    status = sub.add_parser("status", help="show each worker's size, speed and wait, and the last decision",
                            description="Show, for each job on a Redis (or --job), each worker's latest size, "
                                        "throughput, compute and wait, and the last decision with its reason.",
                            formatter_class=_WithDefaults)
    status.add_argument("--redis", help="Redis URL (default: $LBBSP_REDIS_URL)")
    status.add_argument("--job", help="job name (default: every job on this Redis)")
    status.add_argument("--decisions", type=whole_number(0), default=0, metavar="N",
                        help="also list the last N decisions with their reasons and rejected reports (with --json: "
                             "a 'decisions' list in each job)")
    view = status.add_mutually_exclusive_group()
    view.add_argument("--json", action="store_true",
                      help="print one JSON document instead: a list of the jobs (the job itself with --job), each "
                           "with name, num_workers, global_batch, served_by (the coordinator, or null), "
                           "last_decision (iteration, time, seconds_ago, policy, reason; or null) and "
                           "workers (each row of the table; null where it shows '-'); with --decisions, each decision's "
                           "rejected reports as listed, and rejected_more: how many beyond those")
    view.add_argument("--brief", action="store_true",
                      help="one line per job instead: its workers, the coordinator serving it or 'no coordinator', "
                           "how long ago it last decided, and how many reports that decision rejected, if any")
    status.add_argument("--check", action="store_true",
                        help="exit 1, after the output, if a job listed has no live coordinator or could not be "
                             "read (2 stays for errors). A finished job counts until its keys expire (ttl_s after "
                             "its last decision) or `lbbsp forget` deletes them: Redis cannot tell it from a job "
                             "whose coordinator died; pass --job to check one job")
    _verbose_flag(status)
    status.set_defaults(handler=_status)

    forget = sub.add_parser("forget", help="delete a finished job's keys, so that its name starts afresh",
                            description="Delete a job's keys from Redis now, rather than --ttl seconds after its last "
                                        "decision: a new run under its name then starts afresh (with any settings) "
                                        "instead of resuming the old run or being refused for other settings. "
                                        "Refused while a coordinator serves the job, or claims it while its keys are "
                                        "deleted (nothing is deleted then); for a job that is over.",
                            formatter_class=_WithDefaults)
    forget.add_argument("--redis", help="Redis URL (default: $LBBSP_REDIS_URL)")
    forget.add_argument("--job", required=True, help="the job's name")
    _verbose_flag(forget)
    forget.set_defaults(handler=_forget)

    for name, (module, help_text) in _EXTERNAL.items():
        external = sub.add_parser(name, help=help_text)
        external.set_defaults(module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lbbsp`` command on ``argv`` (default: ``sys.argv[1:]``) and return its exit status: 2 for an
    lbbsp or Redis error, printed in a line instead of a traceback, 130 for Ctrl-C (a coordinator stopped by a
    signal: 128 + its number)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = False
    while argv and argv[0] in ("-v", "--verbose"):  # the global flag, before any subcommand
        verbose = True
        argv.pop(0)
    parser = build_parser(coordinator_flags=bool(argv) and argv[0] == "coordinator")
    if argv and argv[0] in _EXTERNAL:  # these parse their own flags, after importing their module
        module = importlib.import_module(_EXTERNAL[argv[0]][0])
        external = argparse.ArgumentParser(prog=f"lbbsp {argv[0]}", description=_EXTERNAL[argv[0]][1],
                                           formatter_class=_WithDefaults)
        module.add_arguments(external)
        _verbose_flag(external)
        args = external.parse_args(argv[1:])
        runner = module.run
    else:
        args = parser.parse_args(_kind_values_joined(argv) if argv[:1] == ["coordinator"] else argv)
        runner = args.handler
    logging.basicConfig(level=logging.INFO if verbose or getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        with _unencodable_replaced():
            code = int(runner(args) or 0)
        if sys.stdout is not None:  # None where it was closed (`>&-`): what was printed went nowhere
            sys.stdout.flush()  # here, not at exit: a reader gone by then (`| head`) had Python print a traceback
        return code
    except LBBSPError as exc:
        print(f"lbbsp: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of stdout stopped (`| head`): no "cannot reach Redis", no traceback
        return _reader_gone()
    except REDIS_ERRORS as exc:
        if isinstance(exc, OSError) and (no_room(exc) or exc.errno in (errno.EFBIG, errno.EIO)):
            print(f"lbbsp: error: {_cannot_write(exc)}", file=sys.stderr)
            return 2
        print(f"lbbsp: error: cannot reach Redis ({exc}); check --redis or LBBSP_REDIS_URL", file=sys.stderr)
        return 2
    except redis.RedisError as exc:
        print(f"lbbsp: error: {explain(exc) or f'Redis answered with an error: {exc}'}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was running stops, without a traceback
        print("lbbsp: interrupted", file=sys.stderr)
        return 130


@contextlib.contextmanager
def _unencodable_replaced() -> Iterator[None]:
    """stdout writing "?" for a character its encoding lacks, where it raised UnicodeEncodeError: under
    PYTHONIOENCODING=ascii or a Latin-1 locale, rich's "…" in a cell cut to fit a narrow terminal ended `lbbsp status`
    in a traceback and exit 1, which ``--check`` means by a job unserved. Put back after, for callers that go on."""
    stream = sys.stdout
    if not isinstance(stream, io.TextIOWrapper) or stream.errors != "strict":
        yield
        return
    stream.reconfigure(errors="replace")
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):  # a reader gone, or a stdout closed meanwhile
            stream.reconfigure(errors="strict")


def _cannot_write(exc: OSError) -> str:
    """What a file or device of this machine that failed a write says: a bare OSError that redis-py, which raises its
    own errors for its connections, never does. Output to a full disk (`> /dev/full`), a terminal gone (EIO) or a
    queue's semaphore in a full /dev/shm had been told as "cannot reach Redis ([Errno 28] ...); check --redis"."""
    where = exc.filename or "the output, or /dev/shm, where the semaphores of its processes' queues live"
    return f"cannot write to {where}: {exc.strerror or exc}"


def _reader_gone() -> int:
    """End quietly after stdout's reader closed the pipe, with 141 (128 + SIGPIPE), as a tool that SIGPIPE ends:
    stdout now writes to /dev/null, where Python's flush at exit had failed again."""
    with contextlib.suppress(OSError, ValueError):  # a stdout without a descriptor (pytest's capture)
        stdout = sys.stdout.fileno()  # first: a stdout without one opens nothing to leak
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stdout)
        os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
