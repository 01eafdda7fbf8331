"""Capacity models: learn each worker's speed from its reports and predict the next iteration's."""
from .base import CapacityModel, NotFittedError, hardware_of, similar_hardware_prior
from .ewma import EWMAThroughput
from .fl_client import FLClientModel

__all__ = ["CapacityModel", "EWMAThroughput", "FLClientModel", "NotFittedError", "hardware_of",
           "similar_hardware_prior"]
