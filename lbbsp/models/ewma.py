"""Baseline capacity model: an exponentially weighted moving average of each worker's throughput."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import ConfigError
from ..protocol import Report
from .base import CapacityModel


class EWMAThroughput(CapacityModel):
    """throughput_i <- alpha * measured_i + (1 - alpha) * throughput_i; the first measurement is taken as is."""

    def __init__(self, alpha: float = 0.5) -> None:
        self.alpha = alpha

    def partial_fit(self, reports: Sequence[Report]) -> "EWMAThroughput":
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"alpha must be in (0, 1], got {self.alpha}")
        if not hasattr(self, "throughput_"):
            self.throughput_: dict[int, float] = {}
        self._remember_hardware(reports)
        for report in reports:
            measured = report.throughput
            if measured <= 0:
                continue  # nothing computed (an empty final slice): no information about speed
            previous = self.throughput_.get(report.worker)
            self.throughput_[report.worker] = (
                measured if previous is None else self.alpha * measured + (1 - self.alpha) * previous
            )
        return self

    def predict(self, workers: Sequence[int]) -> np.ndarray:
        self._check_is_fitted("throughput_")
        return self._with_prior(self.throughput_, workers)
