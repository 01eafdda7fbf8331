"""``lbbsp demo``: train one model with plain BSP and then with LB-BSP while real co-located load slows a worker.

It starts an embedded Redis and several real worker processes (torch.distributed, gloo), each pinned to its
own CPU core. A busy-loop process pinned to the slow worker's core competes with it for that core and is
switched on and off by step (the same steps in both runs). Both runs go through the same lbbsp code path;
only the policy differs (equal split, then balanced), so the speedup measures balancing alone, and because
both see the same global batches their parameters must agree along the whole trajectory.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lbbsp.child_logging import ParentLogging
from lbbsp.cli import probe_redis, whole_number
from lbbsp.errors import ConfigError, LBBSPError
from lbbsp.job_status import piped_console
from lbbsp.signals import ctrl_c_ignored, signals_held, term_and_hangup_as_exit, tracker_ignoring_hangup
from lbbsp.store import redacted, redis_url

if TYPE_CHECKING:
    from rich.console import Console

    from lbbsp.coordinator_process import CoordinatorProcess
    from lbbsp.policies import Policy

_PR_SET_PDEATHSIG = 1
#: Seconds with nothing printed after which the launcher, piped, prints what it waits for (the workers' start alone
#: took 14 s on a 2-core machine, its first run).
SILENCE_S = 10.0


# -- co-located load --------------------------------------------------------------------------------------------
class ColocatedLoad:
    """``procs`` busy-loop processes pinned to one core, paused (SIGSTOP) until :meth:`set` switches them on.

    One busy process on a core makes a single-threaded worker pinned there run at about half speed (the
    kernel shares the core fairly); two make it about a third.
    """

    def __init__(self, core: int, procs: int) -> None:
        if procs < 0:
            raise ConfigError(f"load processes must be non-negative, got {procs}")
        self.core = core
        self.on = False
        self._procs: list[subprocess.Popen[bytes]] = []
        for _ in range(procs):
            proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                    preexec_fn=self._pin_and_die_with_parent)  # noqa: PLW1509  (child-side setup)
            os.kill(proc.pid, signal.SIGSTOP)
            self._procs.append(proc)

    def _pin_and_die_with_parent(self) -> None:
        os.sched_setaffinity(0, {self.core})
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    def set(self, on: bool) -> None:
        """Switch the load on or off (a no-op if it already is); with no busy processes it stays off, and is shown so."""
        on = on and bool(self._procs)
        if on != self.on:
            for proc in self._procs:
                os.kill(proc.pid, signal.SIGCONT if on else signal.SIGSTOP)
            self.on = on

    def close(self) -> None:
        """Kill the busy processes; safe to call twice."""
        procs, self._procs = self._procs, []
        for proc in procs:
            proc.kill()
            proc.wait()
        self.on = False


def parse_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """``"0-0.5,0.75-1"`` -> the fractions of the run during which the load is on."""
    spans = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            lo, hi = (float(v) for v in part.split("-"))
        except ValueError:
            raise ConfigError(f"load schedule spans look like 0-0.5, got {part!r}") from None
        if not 0 <= lo < hi <= 1:
            raise ConfigError(f"load schedule span {part!r} must satisfy 0 <= start < end <= 1")
        spans.append((lo, hi))
    return tuple(spans)


def _when_on(schedule: tuple[tuple[float, float], ...]) -> str:
    """When the load is on, for the launcher's header; an empty schedule (no span) leaves it off throughout."""
    if not schedule:
        return "never switched on: --load-schedule is empty"
    return f"during {','.join(f'{lo:g}-{hi:g}' for lo, hi in schedule)} of each run"


def load_on(schedule: tuple[tuple[float, float], ...], step: int, steps: int) -> bool:
    """Whether the busy loop runs at ``step`` of ``steps``: the step's share of the run falls in a span of
    ``schedule`` (``[start, end)``, as :func:`parse_schedule` reads ``--load-schedule``)."""
    return any(lo <= step / steps < hi for lo, hi in schedule)


def cores_for(workers: int) -> list[int]:
    """One core per worker, round robin over the cores this process may use."""
    allowed = sorted(os.sched_getaffinity(0))
    return [allowed[r % len(allowed)] for r in range(workers)]


# -- the training run in each worker ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoConfig:
    """The demo's knobs; validated once in the launcher."""

    workers: int = 2
    global_batch: int = 512
    hidden: int = 512
    steps: int = 120
    slow_worker: int = 1
    load_procs: int = 2
    schedule: tuple[tuple[float, float], ...] = ((0.0, 0.5), (0.75, 1.0))
    lr: float = 0.05
    checkpoints: int = 6

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ConfigError(f"the demo needs at least 2 workers, got {self.workers}")
        if not 0 <= self.slow_worker < self.workers:
            raise ConfigError(f"--slow-worker {self.slow_worker} is not one of the {self.workers} workers "
                              f"(0 to {self.workers - 1})")
        if self.global_batch < self.workers or self.global_batch > 1797:
            raise ConfigError(f"--global-batch must be in [{self.workers}, 1797] (a sample for each of the "
                              f"{self.workers} workers, at most the digits data), got {self.global_batch}")
        for name, value, least in (("steps", self.steps, 10), ("hidden", self.hidden, 1),
                                   ("load_procs", self.load_procs, 0)):
            if value < least:  # each named as its flag: the launcher's options are these fields
                raise ConfigError(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be positive, got {self.lr}")


def build(hidden: int) -> tuple[Any, Any]:
    """The digits data set (float64, for a crisp trajectory check) and a seeded MLP."""
    import torch  # noqa: PLC0415  (torch is imported only by the demo's workers)
    from sklearn.datasets import load_digits  # noqa: PLC0415
    from torch.utils.data import TensorDataset  # noqa: PLC0415

    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float64), torch.tensor(y))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                                torch.nn.Tanh(), torch.nn.Linear(hidden, 10)).double()
    return data, model


def _worker(rank: int, config: DemoConfig, init: str, url: str, events: Any, logs: ParentLogging) -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logs.apply()
    try:
        _train_both(rank, config, init, url, events)
    except Exception:  # the launcher shows it and stops the others
        events.put(("error", rank, traceback.format_exc()))
        raise


#: The coordinator process this worker started (rank 0, during a phase), stopped first when the launcher stops it.
_running: CoordinatorProcess | None = None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """The launcher's stop (after Ctrl-C or a failed peer) as SystemExit: the worker's cleanup runs, so its load
    processes end with it instead of outliving the launcher. Its stderr goes quiet first: a peer stopped at the
    same moment can make gloo abort this process mid-collective ("terminate called after throwing an instance of
    'gloo::IoException'"), noise under the launcher's own report. Rank 0's coordinator process is stopped here,
    before that abort can come: orphaned by it, the coordinator logged that its parent was gone."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    if _running is not None:
        _running.stop(timeout_s=2.0)
    raise SystemExit(128 + signum)


def _train_both(rank: int, config: DemoConfig, init: str, url: str, events: Any) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from lbbsp.policies import BSPPolicy, LBBSPPolicy  # noqa: PLC0415

    cores = cores_for(config.workers)  # before pinning: afterwards this process may use its own core only
    os.sched_setaffinity(0, {cores[rank]})
    torch.set_num_threads(1)
    # a store, not a file:// URL, whose path torch takes unquoted up to a '?' or '#': in a TMPDIR with '?' in its name
    # each worker failed with an IndexError, and with '#' they met in a file outside the run's folder (and waited
    # there for good where one of that name was the user's)
    dist.init_process_group("gloo", store=dist.FileStore(init, config.workers), rank=rank,
                            world_size=config.workers)
    events.put(("joined", rank))
    load = ColocatedLoad(cores[config.slow_worker], config.load_procs) if rank == 0 else None
    reference: dict[int, Any] = {}
    try:
        for phase, policy in (("BSP", BSPPolicy()), ("LB-BSP", LBBSPPolicy())):
            _train_phase(rank, config, phase, policy, url, events, load, reference)
    finally:
        if load is not None:
            load.close()
        gc.collect()  # the phases' DDP models sit in reference cycles: free them before the group (docs/torch.md)
        dist.destroy_process_group()


def _train_phase(rank: int, config: DemoConfig, phase: str, policy: Policy, url: str, events: Any,
                 load: ColocatedLoad | None, reference: dict[int, Any]) -> None:
    """One run of ``config.steps`` steps under ``policy``; BSP's run records the parameters at each checkpoint in
    ``reference``, LB-BSP's measures its drift from them."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    from .torch import Balancer  # noqa: PLC0415

    every = max(config.steps // config.checkpoints, 1)
    data, model = build(config.hidden)
    model = DDP(model)
    lb = Balancer.from_env(config.global_batch, redis=url, policy=policy)
    global _running  # noqa: PLW0603  (read by the SIGTERM handler)
    _running = lb.coordinator
    lb.attach(model)
    loader = lb.loader(data, seed=0, drop_last=True)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr)
    drift = 0.0
    dist.barrier()
    started = time.perf_counter()
    step = 0
    while step < config.steps:
        loader.set_epoch(step // len(loader))
        for x, y in loader:
            if load is not None:
                load.set(load_on(config.schedule, step, config.steps))
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            report, current = lb.last_report, lb.step
            events.put(("step", phase, rank, step, current.samples if current else len(x),
                        report.compute_s if report else None, bool(load and load.on)))
            step += 1
            if rank == 0 and (step % every == 0 or step == config.steps):
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                if phase == "BSP":
                    reference[step] = flat
                else:
                    drift = max(drift, float((flat - reference[step]).norm() / reference[step].norm()))
            if step == config.steps:
                break
    lb.close()
    _running = None
    if rank == 0:
        events.put(("phase", phase, time.perf_counter() - started, drift, len(reference)))


# -- the launcher and its live table ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``lbbsp demo``'s flags to ``parser`` (the command imports this module only when it is asked for)."""
    parser.add_argument("--workers", type=whole_number(2, 1797), default=2,
                        help="worker processes, each pinned to a core (at most the global batch)")
    parser.add_argument("--global-batch", type=whole_number(2, 1797), default=512,
                        help="global batch B (kept in both runs; at most the digits data's 1,797 samples)")
    parser.add_argument("--hidden", type=whole_number(1), default=512, help="MLP width: the compute per sample")
    parser.add_argument("--steps", type=whole_number(10), default=120, help="training steps per run (at least 10)")
    parser.add_argument("--slow-worker", type=whole_number(0), default=1, help="the worker whose core gets the load")
    parser.add_argument("--load-procs", type=whole_number(0), default=2,
                        help="busy processes on the slow worker's core (1: about 2x slower, 2: about 3x)")
    parser.add_argument("--load-schedule", default="0-0.5,0.75-1",
                        help="fractions of the run with the load on, e.g. 0-0.5,0.75-1 (empty: never on)")
    parser.add_argument("--redis", default=None,
                        help="Redis URL; default: $LBBSP_REDIS_URL where set, else an embedded redis-server")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="print only the results: the speedup and the parameter check (and any warning or error); "
                             "no header, progress lines, live table or table of times")


def redis_for(given: str | None) -> tuple[str | None, str]:
    """The demo's Redis, as the other commands find theirs: ``--redis``, else $LBBSP_REDIS_URL, else None (an
    embedded redis-server; an empty flag or variable counts as none given), and how to name it (no password)."""
    url, source = redis_url(given)
    if url is None:
        return None, "an embedded redis-server"
    return url, f"{redacted(url)} ({source if source == '--redis' else f'from {source}'})"


def run(args: argparse.Namespace) -> int:
    """Run ``lbbsp demo``: the BSP run, then the LB-BSP run, live; 0 when both trained the same parameters, 1 when
    they differ."""
    import multiprocessing as mp  # noqa: PLC0415

    from rich.live import Live  # noqa: PLC0415

    from lbbsp.embedded import EmbeddedRedis  # noqa: PLC0415

    if importlib.util.find_spec("torch") is None:  # else each worker failed with an ImportError traceback
        raise LBBSPError("the demo trains with PyTorch, which is not installed: pip install 'lbbsp[torch]' (or torch)")
    config = DemoConfig(workers=args.workers, global_batch=args.global_batch, hidden=args.hidden,
                        steps=args.steps, slow_worker=args.slow_worker, load_procs=args.load_procs,
                        schedule=parse_schedule(args.load_schedule))
    console = _console()
    cores = cores_for(config.workers)
    given, named = redis_for(args.redis)
    if not args.quiet:
        console.print(f"[bold]lbbsp demo[/]: {config.workers} gloo workers on cores {cores}, global batch "
                      f"{config.global_batch}, {config.steps} steps per run; {config.load_procs} busy process(es) on "
                      f"core {cores[config.slow_worker]} (worker {config.slow_worker}) {_when_on(config.schedule)}")
        console.print(f"Redis: {named}", markup=False, highlight=False)
    if len(set(cores)) < len(cores):
        console.print(f"[yellow]warning[/]: {config.workers} workers share {len(set(cores))} core(s): the busy "
                      "processes slow the workers that share the slow worker's core too, and the speedup shown is "
                      "smaller than on one core per worker")
    server = None if given else EmbeddedRedis()
    url = given or server.url  # type: ignore[union-attr]
    # a clear error here, not one traceback per worker process; the variable's URL named as the other commands do
    probe_redis(url, "", redis_url(args.redis)[1] if given else "", socket_timeout_s=5.0).close()
    ctx = mp.get_context("spawn")
    tracker_ignoring_hangup()  # before the queue's semaphores: it unlinks them once this process is gone
    events = ctx.Queue()
    view = _View(config, cores)
    logs = ParentLogging.of_this_process()  # spawned, the workers start with no logging
    with tempfile.TemporaryDirectory(prefix="lbbsp-demo-") as tmp, term_and_hangup_as_exit():
        procs = [ctx.Process(target=_worker, args=(r, config, os.path.join(tmp, "rdv"), url, events, logs),
                             daemon=False)
                 for r in range(config.workers)]
        try:
            # Ctrl-C ignored is inherited: the children, theirs too, leave it to this process; a SIGTERM waits until
            # each child is started whole
            with ctrl_c_ignored(), signals_held():
                for proc in procs:
                    proc.start()
            # a dumb terminal (TERM=dumb: Emacs' shell, some CI consoles) gets a live table drawn once, at its end:
            # the lines of a pipe instead
            live = (Live(view.table(), console=console, refresh_per_second=4)
                    if console.is_terminal and not console.is_dumb_terminal and not args.quiet else None)
            progress = _Progress(view, console.print, live=live, quiet=args.quiet)
            with live or contextlib.nullcontext():
                while len(view.phases) < 2:
                    try:
                        event = events.get(timeout=0.5)
                    except queue.Empty:
                        if any(p.exitcode not in (None, 0) for p in procs):
                            raise LBBSPError("a demo worker died; see its output above") from None
                        progress.tick()
                        continue
                    if event[0] == "error":
                        raise LBBSPError(f"demo worker {event[1]} failed:\n{event[2]}")
                    progress.saw(event)
                    progress.tick()
            for proc in procs:
                proc.join(30)
        finally:  # the workers started so far, also after a SIGTERM between two starts (left to multiprocessing's
            # exit, they had been waited for until each started up and failed, with a traceback)
            started = [proc for proc in procs if proc.pid is not None]
            for proc in started:
                if proc.is_alive():
                    proc.terminate()
            for proc in started:  # gone before their Redis is, and before this process exits
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
            if server is not None:
                server.close()
    return view.summary(console, quiet=args.quiet)


def _console() -> Console:
    """rich's console for the demo's output; piped (not a terminal), it wraps no line at 80 columns, so that each
    sentence and the table's title stay on one line for a log or grep."""
    console = piped_console()  # a reader gone (`lbbsp demo | head`) ends it with 141, as the other commands
    console.soft_wrap = not console.is_terminal
    return console


class _View:
    """The live per-worker table and the closing summary, fed by the workers' events."""

    def __init__(self, config: DemoConfig, cores: list[int]) -> None:
        self.config = config
        self.cores = cores
        self.phase = "BSP"
        self.step = 0
        self.rows: dict[int, tuple[int, float | None]] = {}
        self.load = False
        self.phases: dict[str, tuple[float, float, int]] = {}
        self.joined: set[int] = set()  # the workers in the gloo group
        # Each worker's row of a step that ends a tenth of the run, until every worker has sent it: a progress
        # line shows one step of all workers (their sizes then sum to the global batch).
        self._tenths: dict[tuple[str, int], dict[int, tuple[int, float | None, bool]]] = {}

    def update(self, event: tuple[Any, ...]) -> None:
        if event[0] == "step":
            _, self.phase, rank, step, samples, compute_s, load = event
            self.rows[rank] = (samples, compute_s)
            if rank == 0:
                self.step, self.load = step, load
            if self._ends_a_tenth(step):
                self._tenths.setdefault((self.phase, step), {})[rank] = (samples, compute_s, load)
        elif event[0] == "phase":
            _, phase, seconds, drift, checkpoints = event
            self.phases[phase] = (seconds, drift, checkpoints)
        elif event[0] == "joined":
            self.joined.add(event[1])

    def status(self) -> str:
        """What the runs are at: a line for a wait with nothing else printed, and the table's title before the first
        step (the workers' start, spawned processes that import torch, is the demo's longest silence)."""
        workers = self.config.workers
        if not self.rows:
            line = f"starting the {workers} workers: {len(self.joined)} of {workers} have joined the gloo group"
            return line + ("; each builds the model and rank 0 starts the coordinator" if len(self.joined) == workers
                           else "")
        if self.phase in self.phases:  # BSP's, the LB-BSP run's first step still to come
            return f"{self.phase} run done in {self.phases[self.phase][0]:.1f}s; starting the LB-BSP run"
        return f"{self.phase} run: at step {self.step + 1} of {self.config.steps}"

    def table(self) -> Any:
        from rich.table import Table  # noqa: PLC0415

        table = Table(title=self.status() if not self.rows else
                      f"{self.phase}: step {self.step + 1}/{self.config.steps}, load "
                      f"{'ON' if self.load else 'off'} on worker {self.config.slow_worker}")
        for column in ("worker", "core", "load", "batch", "compute ms", "samples/s"):
            table.add_column(column, justify="right", overflow="fold")  # a narrow terminal: "2000" folds, not "2…"
        for rank in sorted(self.rows):
            samples, compute_s = self.rows[rank]
            loaded = self.load and rank == self.config.slow_worker
            table.add_row(str(rank), str(self.cores[rank]), "busy" if loaded else "-", str(samples),
                          f"{compute_s * 1e3:.1f}" if compute_s else "-",
                          f"{samples / compute_s:.0f}" if compute_s else "-")
        return table

    def _ends_a_tenth(self, step: int) -> bool:
        return (step + 1) % max(self.config.steps // 10, 1) == 0

    def progress_line(self, event: tuple[Any, ...]) -> str | None:
        """Without a terminal: one line per tenth of each run, once every worker has sent that step."""
        if event[0] != "step" or not self._ends_a_tenth(event[3]):
            return None
        key = (event[1], event[3])
        rows = self._tenths.get(key, {})
        if len(rows) < self.config.workers:
            return None
        del self._tenths[key]
        cells = ", ".join(f"w{r}: {s} @ {c * 1e3:.0f} ms" if c else f"w{r}: {s}" for r, (s, c, _) in sorted(rows.items()))
        load = "ON " if rows[0][2] else "off"  # rank 0 switches the load on the slow worker's core
        return f"{event[1]:>6} step {event[3] + 1:4d}/{self.config.steps}  load {load}  {cells}"

    def summary(self, console: Any, *, quiet: bool = False) -> int:
        """Print the runs' times (not when ``quiet``), the speedup and the parameter check; 0 when the parameters
        match, 1 when they differ."""
        from rich.table import Table  # noqa: PLC0415

        samples = self.config.steps * self.config.global_batch
        table = Table(title="BSP vs LB-BSP (same model, same global batches)")
        for column in ("run", "seconds", "samples/s"):
            table.add_column(column, justify="right")
        for phase, (seconds, _, _) in self.phases.items():
            table.add_row(phase, f"{seconds:.2f}", f"{samples / seconds:.0f}")
        if not quiet:
            console.print(table)
        bsp, lb = self.phases["BSP"][0], self.phases["LB-BSP"][0]
        drift, checkpoints = self.phases["LB-BSP"][1], self.phases["LB-BSP"][2]
        console.print(f"speedup of LB-BSP over BSP: [bold]{bsp / lb:.2f}x[/]")
        match = drift <= 1e-9
        console.print(f"parameter trajectories: max relative difference {drift:.2e} over {checkpoints} checkpoints "
                      f"-> {'[green]match[/]' if match else '[red]DIFFER[/]'}")
        return 0 if match else 1


class _Progress:
    """What the launcher shows of the workers' events while the runs go: in a terminal, the live table; piped, a
    line per tenth of each run, and what it waits for once nothing has been printed for :data:`SILENCE_S`; quiet
    (``--quiet``), nothing."""

    def __init__(self, view: _View, say: Callable[[str], object], *, live: Any, quiet: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.view = view
        self.live = live
        self.quiet = quiet
        self._say = say
        self._clock = clock
        self._said = clock()

    def saw(self, event: tuple[Any, ...]) -> None:
        """Take in a worker's event and show it."""
        self.view.update(event)
        if self.live is not None:
            self.live.update(self.view.table())
        elif not self.quiet and (line := self.view.progress_line(event)) is not None:
            self._print(line)

    def tick(self) -> None:
        """Piped and not quiet: print what the runs are at if nothing has been printed for :data:`SILENCE_S`."""
        if self.live is None and not self.quiet and self._clock() - self._said >= SILENCE_S:
            self._print(self.view.status())

    def _print(self, line: str) -> None:
        self._say(line)
        self._said = self._clock()
