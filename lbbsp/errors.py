"""One root exception for lbbsp, with subclasses that say which job, worker and iteration went wrong."""
from __future__ import annotations


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
        where = ", ".join(
            f"{name}={value}"
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
        super().__init__(f"{field}: {message}" if field else message, **where)  # type: ignore[arg-type]


class AllocationError(LBBSPError, ValueError):
    """The global batch cannot be placed within the per-worker bounds."""


class PolicyError(LBBSPError):
    """A balancing policy failed, or returned a split that breaks the job's rules."""


class StoreUnavailable(LBBSPError, ConnectionError):
    """Redis could not be reached (or stopped answering) within the allowed time."""
