"""lbbsp: load-balanced bulk synchronous parallel training.

At every synchronisation barrier a coordinator resizes each worker's mini-batch so that all workers
finish together while the global batch stays the same.
"""
from .allocation import LinearTime, allocate
from .config import JobConfig
from .coordinator import Coordinator, CoordinatorProcess
from .embedded import EmbeddedRedis
from .errors import AllocationError, ConfigError, LBBSPError, PolicyError, ProtocolError, StoreUnavailable
from .models import CapacityModel, EWMAThroughput
from .policies import BSPPolicy, Decision, LBBSPPolicy, Policy
from .protocol import Assignment, Report, equal_split
from .sampling import GlobalBatchSampler, scale_split
from .store import Store
from .telemetry import ResourceMonitor
from .worker import WorkerClient

__version__ = "0.1.0"

__all__ = [
    "AllocationError", "Assignment", "BSPPolicy", "CapacityModel", "ConfigError", "Coordinator", "CoordinatorProcess", "Decision",
    "EWMAThroughput", "EmbeddedRedis", "GlobalBatchSampler", "JobConfig", "LBBSPError", "LBBSPPolicy",
    "LinearTime", "Policy", "PolicyError", "ProtocolError", "Report", "ResourceMonitor", "Store", "StoreUnavailable",
    "WorkerClient", "allocate", "equal_split", "scale_split",
]
