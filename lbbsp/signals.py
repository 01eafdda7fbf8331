"""Signals held back while the main thread starts a spawned child, then delivered: a handler that raised in the middle
of the start (a SIGTERM taken as SystemExit, Ctrl-C) cut short the pickled arguments the child was reading, and the
half-made child printed multiprocessing's "pickle data was truncated" (or "Ran out of input") traceback as it died."""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

#: What a terminal, a service manager or a launcher sends to stop a process.
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_held(signals: tuple[signal.Signals, ...] = STOPPING) -> Iterator[None]:
    """Around ``Process.start()``: ``signals`` that arrive meanwhile reach the handlers they had once the block ends,
    each once. An ignored signal stays ignored (a child inherits that), a handler set outside Python is left alone,
    and elsewhere than in the main thread, where Python runs no handler, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
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
