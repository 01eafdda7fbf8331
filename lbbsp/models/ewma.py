"""Capacity models that smooth each worker's throughput by exponential weighting: of each step's rate (the baseline),
or of its samples and seconds apart (its rate over time)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..config import _real
from ..protocol import Report
from .base import CapacityModel, WorkerIds, as_reports, by_iteration, measured, measured_throughput, smoothed


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
        self._learn(reports)
        return self

    def _learn(self, reports: Sequence[Report]) -> None:
        """Blend the reports' throughputs in; a report that computed nothing (an empty final slice) says nothing about
        speed."""
        workers, throughputs = measured_throughput(reports)
        self.throughput_ = smoothed(getattr(self, "throughput_", None), workers, throughputs, self.alpha)

    def _check_params(self) -> None:
        _real(self.alpha, "alpha", 0.0, 1.0, "in (0, 1]", lo_open=True)

    def predict(self, workers: WorkerIds) -> np.ndarray:
        self._check_is_fitted("throughput_")
        return self._with_prior(self.throughput_, workers)


class TimeWeightedThroughput(EWMAThroughput):
    """throughput_i <- EWMA(samples_i) / EWMA(compute_s_i): the rate over the recent steps' time. Each step counts by
    its seconds, as at the barrier; an average of each step's rate reads a worker under a CPU quota, whose short steps
    run at full speed or stall until the quota's next period, as faster than it is."""

    def _learn(self, reports: Sequence[Report]) -> None:
        workers, samples, seconds = measured(reports)
        self.samples_ = smoothed(getattr(self, "samples_", None), workers, samples, self.alpha)
        self.seconds_ = smoothed(getattr(self, "seconds_", None), workers, seconds, self.alpha)
        self.throughput_ = self.samples_ / self.seconds_
