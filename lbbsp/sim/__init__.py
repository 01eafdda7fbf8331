"""Trace-driven cluster simulator that runs the production policy code."""
from .engine import LevelOracle, PolicyRun, compare, standard_policies
from .scenarios import SCENARIOS, CPUContention, FLClients, GPUMix, MixedCluster, Scenario
from .traces import CPUTrace, load_traces

__all__ = ["SCENARIOS", "CPUContention", "CPUTrace", "FLClients", "GPUMix", "LevelOracle", "MixedCluster", "PolicyRun",
           "Scenario", "compare", "load_traces", "standard_policies"]
