"""One root exception for lbbsp, with subclasses that say which job, worker and iteration went wrong; and how an
error or a log line shows text that came from outside (:func:`printable`)."""
from __future__ import annotations

#: Characters of a job name (at most 128 when valid) or field name an error shows.
MAX_JOB_SHOWN = 130


def printable(text: str, limit: int | None = None) -> str:
    """``text``, read from Redis or a remote client, safe for one log line or a terminal: each character that a reader
    or terminal acts on (a newline fakes a line, ESC starts an escape sequence, a bidi override reorders what follows,
    a lone surrogate encodes to nothing) as its Python escape; cut to ``limit`` characters, with an ellipsis."""
    shown = text if text.isprintable() else "".join(
        c if c.isprintable() else repr(c)[1:-1] for c in (text if limit is None else text[:limit + 1]))
    return shown if limit is None or len(shown) <= limit else shown[:limit - 1] + "\u2026"


class LBBSPError(Exception):
    """Root of every error lbbsp raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        job: str | None = None,
        worker: int | None = None,
        iteration: int | None = None,
    ) -> None:
        self.job = job
        self.worker = worker
        self.iteration = iteration
        where = ", ".join(  # a job read from Redis or a remote client could fake a log line: shown escaped
            f"{name}={printable(value, MAX_JOB_SHOWN) if isinstance(value, str) else value}"
            for name, value in (("job", job), ("worker", worker), ("iteration", iteration))
            if value is not None
        )
        super().__init__(f"{message} [{where}]" if where else message)
        self.message = message


class ConfigError(LBBSPError, ValueError):
    """A configuration value is invalid or disagrees with the job's stored configuration."""


class ProtocolError(LBBSPError, ValueError):
    """A report or assignment failed validation; ``field`` names the offending field."""

    def __init__(self, message: str, *, field: str | None = None, **where: object) -> None:
        self.field = field
        shown = printable(field, MAX_JOB_SHOWN) if field else field  # a field name may come from a payload
        super().__init__(f"{shown}: {message}" if shown else message, **where)  # type: ignore[arg-type]


class AllocationError(LBBSPError, ValueError):
    """The global batch cannot be placed within the per-worker bounds."""


class PolicyError(LBBSPError):
    """A balancing policy failed, or returned a split that breaks the job's rules."""


class StoreUnavailable(LBBSPError, ConnectionError):
    """Redis could not be reached (or stopped answering) within the allowed time."""
