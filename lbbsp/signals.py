"""Signals around the child processes a launcher starts (`lbbsp demo`, the Flower example, the benchmarks): a SIGTERM
taken as SystemExit so that the launcher's cleanup stops its children, Ctrl-C left to the launcher, and signals held
back while a spawned child is being started."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator

#: What a terminal, a service manager or a launcher sends to stop a process.
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _main_thread() -> bool:
    """Whether this is the main thread, the only one that may set a handler (and the one Python runs them in)."""
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _handled(signum: signal.Signals, handler: signal.Handlers | Callable[[int, object], None]) -> Iterator[None]:
    """``signum`` handled by ``handler`` inside the block, by its own handler again after; in the main thread only."""
    if not _main_thread():
        yield
        return
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def off_the_handler(call: Callable[[], object]) -> None:
    """Run ``call`` (a stop) on a thread of its own, from a signal handler: Python runs the handler on the main thread
    between two bytecodes, where that thread may hold the lock of the very event the stop sets (inside
    ``Event.wait``), and setting it there had deadlocked the process."""
    threading.Thread(target=call, name="lbbsp-stop", daemon=True).start()


@contextlib.contextmanager
def term_and_hangup_as_exit() -> Iterator[None]:
    """SIGTERM (kill, timeout(1), a CI job's cancel) as ``SystemExit(143)``, and SIGHUP (an ssh session that drops, a
    closed terminal) as ``SystemExit(129)`` unless it is ignored (nohup), so that the cleanup of the ``with`` blocks
    they pass through stops what they started: at their default they end the process alone, its temp folders stay,
    and the children run on. Elsewhere than in the main thread, nothing changes."""
    with contextlib.ExitStack() as stack:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signum == signal.SIGTERM or signal.getsignal(signum) != signal.SIG_IGN:
                stack.enter_context(_handled(signum, lambda number, frame: sys.exit(128 + number)))
        yield


def tracker_ignoring_hangup() -> None:
    """Start multiprocessing's resource tracker now, with SIGHUP ignored (it ignores SIGINT and SIGTERM itself): a
    hangup to the process group killed it, so the spawn queue's semaphores stayed in /dev/shm, or the launcher's exit
    started another that printed a KeyError traceback per semaphore. Call it before creating them; once it runs, this
    does nothing. Elsewhere than in the main thread, it starts the tracker as is."""
    from multiprocessing import resource_tracker  # noqa: PLC0415

    with _handled(signal.SIGHUP, signal.SIG_IGN):
        resource_tracker.ensure_running()


def ctrl_c_ignored() -> contextlib.AbstractContextManager[None]:
    """SIGINT ignored, around the start of child processes, which inherit that (and so do theirs): a terminal's Ctrl-C
    reaches the whole process group, and every child printed a KeyboardInterrupt traceback of its own; the launcher
    alone stops them. Elsewhere than in the main thread, nothing changes."""
    return _handled(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def signals_held(signals: tuple[signal.Signals, ...] = STOPPING) -> Iterator[None]:
    """Around ``Process.start()``: ``signals`` that arrive meanwhile reach the handlers they had once the block ends,
    each once. Raised half-way through a spawned child's start (a SIGTERM taken as SystemExit, Ctrl-C), a handler had
    cut short the pickled arguments the child was reading, and the half-made child printed multiprocessing's "pickle
    data was truncated" traceback as it died. An ignored signal stays ignored (a child inherits that), a handler set
    outside Python is left alone, and elsewhere than in the main thread, where Python runs no handler, nothing
    changes."""
    if not _main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {}
    for signum in signals:
        handler = signal.getsignal(signum)
        if handler is not None and handler != signal.SIG_IGN:
            previous[signum] = signal.signal(signum, lambda number, frame: arrived.append(number))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for held in dict.fromkeys(arrived):
            signal.raise_signal(held)
