"""Baseline capacity model: the next throughput is the last one measured."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..protocol import Report
from .base import CapacityModel, WorkerIds, as_reports, by_iteration, measured_throughput, smoothed


class LastValue(CapacityModel):
    """throughput_i(k+1) = measured_i(k): the naive forecast every other model must beat."""

    def __init__(self) -> None:
        pass

    @by_iteration
    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> LastValue:
        reports = as_reports(reports)
        if not reports:  # an iteration nobody reported in: nothing to learn, and an unfitted model stays so
            self._check_params()
            return self
        self._remember_hardware(reports)
        workers, measured = measured_throughput(reports)
        self.throughput_ = smoothed(getattr(self, "throughput_", None), workers, measured, alpha=1.0)
        return self

    def predict(self, workers: WorkerIds) -> np.ndarray:
        self._check_is_fitted("throughput_")
        return self._with_prior(self.throughput_, workers)
