"""A spawned child's logging, set up as its parent's: a process started with ``spawn`` starts with none, so its
INFO lines were dropped and its warnings printed bare, whatever the parent (``lbbsp -v``, a training script's
``logging.basicConfig``) had asked for."""
from __future__ import annotations

import logging
from dataclasses import dataclass


@dataclass(frozen=True)
class ParentLogging:
    """The level lbbsp logs at in this process and the format of the first handler its lines reach; taken in the
    parent (:meth:`of_this_process`), passed to the child, applied there first (:meth:`apply`). The format is kept as
    its strings, not the formatter: one may not pickle (pytest's holds the terminal) or be a class the child cannot
    import (one defined in the training script), and either had kept the coordinator's child from starting."""

    level: int
    format: str | None = None
    datefmt: str | None = None
    style: str = "%"

    @classmethod
    def of_this_process(cls) -> ParentLogging:
        """This process's logging, as lbbsp's logger sees it (its own level, or the root's)."""
        level = logging.getLogger("lbbsp").getEffectiveLevel()
        logger: logging.Logger | None = logging.getLogger("lbbsp")
        while logger is not None:  # the handlers a record of lbbsp's propagates to
            formatter = next((h.formatter for h in logger.handlers if h.formatter is not None), None)
            if formatter is not None:
                style = next((key for key, (kind, _) in logging._STYLES.items() if type(formatter._style) is kind), "%")
                return cls(level, formatter._fmt, formatter.datefmt, style)
            logger = logger.parent if logger.propagate else None
        return cls(level)

    def apply(self) -> None:
        """Log as the parent does: at its level, to stderr, in its format."""
        handler = logging.StreamHandler()
        if self.format is not None:
            handler.setFormatter(logging.Formatter(self.format, self.datefmt, self.style))  # type: ignore[arg-type]
        logging.basicConfig(level=self.level, handlers=[handler])
