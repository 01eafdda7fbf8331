"""Trace-driven cluster simulator that runs the production policy code."""
from .engine import LevelOracle, PolicyRun, compare, standard_policies
from .scenarios import SCENARIOS, CPUContention, FLClients, GPUMix, MixedCluster, Scenario

__all__ = ["SCENARIOS", "CPUContention", "FLClients", "GPUMix", "LevelOracle", "MixedCluster", "PolicyRun",
           "Scenario", "compare", "standard_policies"]
