"""Repeated failures, logged once and then every 10 s with a count: a bug that fails every step must not flood the
log, nor hide how often it came."""
from __future__ import annotations

import time
import traceback


class Repeats:
    """Whether a failure is worth a log line now: a new one at once, the same one again (a bug that fails every
    step, 20 times a second) only every 10 s, saying how many times in a row it came (``counted``, its ``{}`` the
    count). An exception is the same as the last where it is of the same type with the same traceback, whatever its
    message: a policy's error that named the iteration or a sum had logged a traceback at every decision."""

    def __init__(self, counted: str = " ({} times in a row)") -> None:
        self._counted = counted
        self._what, self._count, self._next = "", 0, 0.0

    def note(self, failure: object) -> str | None:
        """Count ``failure`` (an exception, or what names one); None if it is not to be logged now, else what to
        add to the line ("" or a count)."""
        now, what = time.monotonic(), failure_site(failure)
        again = what == self._what
        told = None
        if not again or now >= self._next:
            told = self._counted.format(self._count) if again and self._count > 1 else ""
            self._next = now + 10.0
        self._what, self._count = what, self._count + 1 if again else 1
        return told


def failure_site(failure: object) -> str:
    """What makes two failures the same one: an exception's type and the lines its traceback passed through (its
    message where it has no traceback); any other object's text."""
    if not isinstance(failure, BaseException) or failure.__traceback__ is None:
        return f"{type(failure).__name__}: {failure}"
    lines = (f"{frame.f_code.co_filename}:{line}" for frame, line in traceback.walk_tb(failure.__traceback__))
    return f"{type(failure).__name__} via {' '.join(lines)}"
