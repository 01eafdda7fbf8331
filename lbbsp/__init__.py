"""lbbsp: load-balanced bulk synchronous parallel training.

At every synchronisation barrier a coordinator resizes each worker's mini-batch so that all workers
finish together while the global batch stays the same.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .allocation import LinearTime, allocate
from .config import JobConfig
from .embedded import EmbeddedRedis
from .errors import AllocationError, ConfigError, LBBSPError, PolicyError, ProtocolError, StoreUnavailable
from .protocol import Assignment, Report, equal_split
from .sampling import GlobalBatchSampler, scale_split
from .store import Store
from .telemetry import ResourceMonitor
from .worker import OutageNews, WorkerClient

if TYPE_CHECKING:
    from .coordinator import Coordinator
    from .coordinator_process import CoordinatorProcess
    from .models import (
        AutoCapacityModel,
        BatchTimeCurve,
        CapacityModel,
        EWMAThroughput,
        FLClientModel,
        LastValue,
        NARXThroughput,
        TimeWeightedThroughput,
    )
    from .policies import (
        BackupWorkersPolicy,
        BSPPolicy,
        Decision,
        LBBSPPolicy,
        LeaderStragglerPolicy,
        OraclePolicy,
        PerEpochPolicy,
        Policy,
        StaticProportionalPolicy,
    )

#: The exports whose modules import scikit-learn (seconds), by module: imported on first use (PEP 562), so that
#: what needs none of them (`lbbsp status`, a worker) does not wait for it.
_LAZY = {"Coordinator": ".coordinator", "CoordinatorProcess": ".coordinator_process",
         **dict.fromkeys(["AutoCapacityModel", "BatchTimeCurve", "CapacityModel", "EWMAThroughput", "FLClientModel",
                          "LastValue", "NARXThroughput", "TimeWeightedThroughput"], ".models"),
         **dict.fromkeys(["BSPPolicy", "BackupWorkersPolicy", "Decision", "LBBSPPolicy", "LeaderStragglerPolicy",
                          "OraclePolicy", "PerEpochPolicy", "Policy", "StaticProportionalPolicy"], ".policies")}


def __getattr__(name: str) -> Any:
    """``lbbsp.X`` and ``from lbbsp import X`` for an export of :data:`_LAZY`, imported now and kept."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "AllocationError", "Assignment", "AutoCapacityModel", "BSPPolicy", "BackupWorkersPolicy", "BatchTimeCurve",
    "CapacityModel", "ConfigError", "Coordinator", "CoordinatorProcess", "Decision", "EWMAThroughput",
    "EmbeddedRedis", "FLClientModel", "GlobalBatchSampler", "JobConfig", "LBBSPError", "LBBSPPolicy", "LastValue",
    "LeaderStragglerPolicy", "LinearTime", "NARXThroughput", "OraclePolicy", "PerEpochPolicy", "Policy",
    "PolicyError", "ProtocolError", "Report", "ResourceMonitor", "StaticProportionalPolicy", "Store",
    "OutageNews", "StoreUnavailable", "TimeWeightedThroughput", "WorkerClient", "allocate", "equal_split",
    "scale_split",
]
