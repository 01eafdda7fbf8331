"""Baseline capacity model: an exponentially weighted moving average of each worker's throughput."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..config import _real
from ..protocol import Report
from .base import CapacityModel, WorkerIds, as_reports, by_iteration, measured_throughput, smoothed


class EWMAThroughput(CapacityModel):
    """throughput_i <- alpha * measured_i + (1 - alpha) * throughput_i; the first measurement is taken as is."""

    def __init__(self, alpha: float = 0.5) -> None:
        self.alpha = alpha

    @by_iteration
    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> EWMAThroughput:
        reports = as_reports(reports)
        self._check_params()
        if not reports:  # an iteration nobody reported in: nothing to learn, and an unfitted model stays so
            return self
        self._remember_hardware(reports)
        # a report that computed nothing (an empty final slice) says nothing about speed
        workers, measured = measured_throughput(reports)
        self.throughput_ = smoothed(getattr(self, "throughput_", None), workers, measured, self.alpha)
        return self

    def _check_params(self) -> None:
        _real(self.alpha, "alpha", 0.0, 1.0, "in (0, 1]", lo_open=True)

    def predict(self, workers: WorkerIds) -> np.ndarray:
        self._check_is_fitted("throughput_")
        return self._with_prior(self.throughput_, workers)
