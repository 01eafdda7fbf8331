"""lbbsp.signals: a SIGTERM as SystemExit, Ctrl-C ignored, and signals held while the main thread starts a child (one
that arrives meanwhile reaches its handler afterwards, once; an ignored one stays ignored); other threads are left as
they are."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

from lbbsp.signals import ctrl_c_ignored, off_the_handler, signals_held, term_and_hangup_as_exit


class Stopped(Exception):
    """What the test's SIGTERM handler raises."""


@pytest.fixture
def sigterm_raises() -> Iterator[list[int]]:
    """A SIGTERM handler that counts its calls and raises :class:`Stopped`; the test's old handler again after."""
    calls: list[int] = []

    def handler(signum: int, frame: object) -> None:
        calls.append(signum)
        raise Stopped

    previous = signal.signal(signal.SIGTERM, handler)
    yield calls
    signal.signal(signal.SIGTERM, previous)


def test_a_signal_inside_the_block_reaches_its_handler_once_when_the_block_ends(sigterm_raises: list[int]) -> None:
    reached = False
    with pytest.raises(Stopped), signals_held():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        reached = True
    assert reached
    assert sigterm_raises == [signal.SIGTERM]


def test_the_handlers_are_those_of_before_once_the_block_ends(sigterm_raises: list[int]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with signals_held():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(Stopped):
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_ignored_before_stays_ignored_inside_the_block_as_a_child_inherits_it() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals_held():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_block_exits_with_its_own_error_chained_to_the_signals(sigterm_raises: list[int]) -> None:
    with pytest.raises(Stopped) as raised, signals_held():
        os.kill(os.getpid(), signal.SIGTERM)
        raise ValueError("the block's own")
    assert isinstance(raised.value.__context__, ValueError)


def test_a_sigterm_is_a_system_exit_of_143_inside_and_the_handler_of_before_after(sigterm_raises: list[int]) -> None:
    with pytest.raises(SystemExit) as raised, term_and_hangup_as_exit():
        os.kill(os.getpid(), signal.SIGTERM)
    assert raised.value.code == 128 + signal.SIGTERM and sigterm_raises == []
    with pytest.raises(Stopped):
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_hangup_is_a_system_exit_of_129_inside_unless_nohup_ignores_it() -> None:
    """A dropped ssh session's SIGHUP had ended `lbbsp demo` at its default, without the cleanup of its blocks."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with pytest.raises(SystemExit) as raised, term_and_hangup_as_exit():
            os.kill(os.getpid(), signal.SIGHUP)
        assert raised.value.code == 128 + signal.SIGHUP and signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts it
        with term_and_hangup_as_exit():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_ctrl_c_is_ignored_inside_and_its_handler_is_back_after() -> None:
    before = signal.getsignal(signal.SIGINT)
    with ctrl_c_ignored():
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("block", [signals_held, term_and_hangup_as_exit, ctrl_c_ignored])
def test_outside_the_main_thread_nothing_is_held_or_changed(block: Callable[[], AbstractContextManager[None]]) \
        -> None:
    seen: list[object] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with block():
                seen.append((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)))
        except BaseException as exc:  # noqa: BLE001  (signal.signal's ValueError outside the main thread)
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert failed == [] and seen == [(signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))]


@pytest.mark.timeout(20)
def test_a_stop_set_off_the_handler_never_deadlocks_the_thread_waiting_on_it() -> None:
    """The coordinator's SIGTERM handler had set its stop event itself: run between two bytecodes of the thread that
    waits on that event (inside ``Event.wait``, which holds the event's lock a moment), it deadlocked the process, here
    within a few signals. Run off the handler, the stop waits for the lock instead."""
    stop, handled = threading.Event(), [0]

    def handler(signum: int, frame: object) -> None:
        handled[0] += 1
        off_the_handler(stop.set)

    previous = signal.signal(signal.SIGVTALRM, handler)
    signal.setitimer(signal.ITIMER_VIRTUAL, 0.001, 0.001)  # a signal per millisecond of CPU (SIGALRM is the timeout's)
    try:
        end = time.monotonic() + 15  # (the signals come with the CPU this process gets: few on a busy machine)
        while handled[0] < 150 and time.monotonic() < end:
            stop.wait(1e-5)  # set: returns at once, its lock held a larger share of the time
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)
    assert handled[0] >= 150
