"""A coordinator in a child process of its own, as the integrations start one: spawning it, watching it, restarting
it after a death, and stopping it with its parent."""
from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.synchronize
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Iterator

from .child_logging import ParentLogging
from .config import JobConfig, _job_config
from .coordinator import MAX_AHEAD, Coordinator, checked_max_ahead
from .embedded import SHM_IN_CONTAINERS, RestartBudget, no_room, release_cpu_pinning
from .errors import ConfigError, LBBSPError, StoreUnavailable
from .guarded_policy import check_for_job, check_outside_simulator
from .policies import Policy, checked_policy
from .signals import off_the_handler, signals_held
from .store import PROBE_TIMEOUT_S, Store, answering, unusable

log = logging.getLogger("lbbsp.coordinator")  # the coordinator's lines, under the logger its users configure

#: Seconds an integration gives its coordinator process to stop, before it is killed, where the Redis it serves on is
#: the integration's own embedded one, deleted next: its last writes (status rows, its claim) are lost anyway, and a
#: child inside a call to a Redis that stopped answering never ends by itself (5 s a call, three tries).
GRACE_BEFORE_OWN_SERVER_S = 1.0
#: The exit code of a coordinator child that could not set up because Redis was unusable (down, stalled, refusing):
#: a cause that clears, which its restart watch does not count against RESTARTS (sysexits' EX_TEMPFAIL)
_EXIT_REDIS_UNUSABLE = 75


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
    check_for_job(policy, config, warn=False)  # the child's coordinator warns
    check_outside_simulator(policy, config, warn=False)
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
        check_for_job(policy, config, warn=False)  # the child's coordinator warns; _spawn checks the pickling
        check_outside_simulator(policy, config, warn=False)
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
