"""A spawned child's logging, set up as its parent's: a process started with ``spawn`` starts with none, so its
INFO lines were dropped and its warnings printed bare, whatever the parent (``lbbsp -v``, a training script's
``logging.basicConfig``) had asked for."""
from __future__ import annotations

import logging
from dataclasses import dataclass


@dataclass(frozen=True)
class ParentLogging:
    """The level lbbsp logs at in this process and the format of the first handler its lines reach; taken in the
    parent (:meth:`of_this_process`), passed to the child, applied there first (:meth:`apply`)."""

    level: int
    formatter: logging.Formatter | None

    @classmethod
    def of_this_process(cls) -> ParentLogging:
        """This process's logging, as lbbsp's logger sees it (its own level, or the root's)."""
        logger: logging.Logger | None = logging.getLogger("lbbsp")
        formatter = None
        while logger is not None and formatter is None:  # the handlers a record of lbbsp's propagates to
            formatter = next((h.formatter for h in logger.handlers if h.formatter is not None), None)
            logger = logger.parent if logger.propagate else None
        return cls(logging.getLogger("lbbsp").getEffectiveLevel(), formatter)

    def apply(self) -> None:
        """Log as the parent does: at its level, to stderr, in its format."""
        handler = logging.StreamHandler()
        handler.setFormatter(self.formatter)
        logging.basicConfig(level=self.level, handlers=[handler])
