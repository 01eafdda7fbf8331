"""Capacity models: learn each worker's speed from its reports and predict the next iteration's."""
from .auto import KINDS, AutoCapacityModel, GroupedTime, MixedTime, worker_kind
from .base import NO_CAP, CapacityModel, NotFittedError, hardware_of, similar_hardware_prior
from .ewma import EWMAThroughput, TimeWeightedThroughput
from .fl_client import FLClientModel
from .gpu_curve import BatchTimeCurve, fit_hinge, fit_memory_cap
from .last_value import LastValue
from .narx import NARXThroughput

__all__ = ["KINDS", "NO_CAP", "AutoCapacityModel", "BatchTimeCurve", "CapacityModel", "EWMAThroughput", "FLClientModel", "GroupedTime",
           "LastValue", "MixedTime", "NARXThroughput", "NotFittedError", "TimeWeightedThroughput", "fit_hinge",
           "fit_memory_cap", "hardware_of", "similar_hardware_prior", "worker_kind"]
