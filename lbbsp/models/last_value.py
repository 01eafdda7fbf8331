"""Baseline capacity model: the next throughput is the last one measured."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..protocol import Report
from .base import CapacityModel


class LastValue(CapacityModel):
    """throughput_i(k+1) = measured_i(k): the naive forecast every other model must beat."""

    def __init__(self) -> None:
        pass

    def partial_fit(self, reports: Sequence[Report]) -> "LastValue":
        if not hasattr(self, "throughput_"):
            self.throughput_: dict[int, float] = {}
        self._remember_hardware(reports)
        for report in reports:
            if report.throughput > 0:
                self.throughput_[report.worker] = report.throughput
        return self

    def predict(self, workers: Sequence[int]) -> np.ndarray:
        self._check_is_fitted("throughput_")
        return self._with_prior(self.throughput_, workers)
