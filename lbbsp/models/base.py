"""The contract every capacity model follows, in the scikit-learn manner.

A capacity model learns each worker's speed from the reports of past iterations and predicts its
throughput for the next one. ``__init__`` only stores keyword arguments; learned state ends in ``_``.
"""
from __future__ import annotations

import inspect
from typing import Iterable, Sequence

import numpy as np

from ..allocation import LinearTime, TimeModel
from ..errors import LBBSPError
from ..protocol import Report


class NotFittedError(LBBSPError, AttributeError):
    """A model was asked to predict before it saw any report."""


class CapacityModel:
    """Base class: ``partial_fit`` one iteration's reports, ``predict`` next-iteration throughput."""

    def get_params(self) -> dict[str, object]:
        """The constructor's keyword arguments, so a model can be cloned: ``type(m)(**m.get_params())``."""
        names = inspect.signature(type(self).__init__).parameters
        return {name: getattr(self, name) for name in names if name != "self"}

    def fit(self, history: Iterable[Sequence[Report]]) -> "CapacityModel":
        """Forget what was learned, then learn from each iteration's reports in order."""
        for name in [n for n in vars(self) if n.endswith("_") and not n.startswith("_")]:
            delattr(self, name)
        for reports in history:
            self.partial_fit(reports)
        return self

    def partial_fit(self, reports: Sequence[Report]) -> "CapacityModel":
        raise NotImplementedError

    def predict(self, workers: Sequence[int]) -> np.ndarray:
        """Predicted samples per second for each worker; NaN for a worker never seen."""
        raise NotImplementedError

    def time_model(self, workers: Sequence[int]) -> TimeModel:
        """Predicted time as a function of batch size; linear in the size unless a model knows better."""
        speed = self.predict(workers)
        known = np.isfinite(speed) & (speed > 0)
        fill = float(np.median(speed[known])) if known.any() else 1.0
        return LinearTime(np.where(known, speed, fill))

    def _check_is_fitted(self, attribute: str) -> None:
        if not hasattr(self, attribute):
            raise NotFittedError(f"{type(self).__name__} has seen no report yet; call partial_fit first")
