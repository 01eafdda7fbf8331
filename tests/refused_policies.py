"""Policies that rank 0's coordinator process refuses, and what it says, shared by the Keras and PyTorch tests:
framework-free, so that a PyTorch rank imports no TensorFlow (each spawned rank had imported it, and the PyTorch
failure tests were skipped where TensorFlow is not installed)."""
from __future__ import annotations

import threading

from lbbsp import LBBSPPolicy
from lbbsp.models import AutoCapacityModel
from lbbsp.policies import Policy


class Locked(LBBSPPolicy):
    """A policy holding a lock: it cannot be pickled to the coordinator's child process."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def refused_policy(what: str) -> Policy:
    """A policy that rank 0's CoordinatorProcess refuses, in a job of 2 workers."""
    return LBBSPPolicy(AutoCapacityModel(kinds={5: "gpu"})) if what == "kinds" else Locked()


REFUSALS = {"kinds": "AutoCapacityModel's kinds pin worker(s) [5], outside the job's workers 0..1",
            "pickle": "policy Locked cannot be pickled to the coordinator's child process"}
