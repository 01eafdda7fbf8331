"""Capacity models: learn each worker's speed from its reports and predict the next iteration's."""
from .base import CapacityModel, NotFittedError
from .ewma import EWMAThroughput

__all__ = ["CapacityModel", "EWMAThroughput", "NotFittedError"]
