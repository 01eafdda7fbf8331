"""Capacity models, allocator and simulator, from a fresh-eyes review: each test fails on the code before its fix."""
from __future__ import annotations

import warnings

import numpy as np

from lbbsp.config import JobConfig
from lbbsp.models import AutoCapacityModel, EWMAThroughput
from lbbsp.models.base import WorkerIds
from lbbsp.policies import LBBSPPolicy
from lbbsp.protocol import Report


class _CapUnknownForWorker0(EWMAThroughput):
    """A model of one's own that knows worker 1's memory cap and not worker 0's (NaN: no cap known)."""

    def max_batch(self, workers: WorkerIds) -> np.ndarray:
        return np.array([np.nan if w == 0 else 500.0 for w in np.atleast_1d(workers)])


def test_a_nan_memory_cap_under_the_auto_model_is_no_cap() -> None:
    # LBBSPPolicy reads a NaN cap as the job's upper bound; AutoCapacityModel had cast it to -2**63, a cap below
    # every lower bound, so two equally fast GPUs were split 1 / 63 where the model alone gave 32 / 32
    reports = [Report("j", w, 0, 32, 0.1, device="cuda:0") for w in range(2)]
    config = JobConfig("j", 2, 64)
    splits = []
    for model in (_CapUnknownForWorker0(), AutoCapacityModel(models={"gpu": _CapUnknownForWorker0()})):
        policy = LBBSPPolicy(model, hedge=None)
        policy.observe(reports)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy's "invalid value encountered in cast" too
            splits.append(policy.decide(2, (16, 48), config).sizes)
    assert splits == [(32, 32), (32, 32)]
