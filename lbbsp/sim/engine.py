"""Run balancing policies side by side on one simulated cluster, through the production policy code."""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from ..models import EWMAThroughput
from ..policies import (
    BackupWorkersPolicy,
    BSPPolicy,
    LBBSPPolicy,
    LeaderStragglerPolicy,
    OraclePolicy,
    PerEpochPolicy,
    Policy,
    StaticProportionalPolicy,
)
from ..protocol import Report
from .scenarios import Scenario, Truth

Progress = Callable[[str], None]


@dataclass
class PolicyRun:
    """One policy's per-iteration record on one scenario."""

    name: str
    iteration_s: list[float] = field(default_factory=list)
    idle_fraction: list[float] = field(default_factory=list)
    decision_s: list[float] = field(default_factory=list)
    sizes: list[list[int]] = field(default_factory=list)
    over_memory: int = 0  # iterations in which some worker was given more than its GPU memory holds

    def summary(self, oracle_mean_s: float) -> dict[str, float]:
        mean = float(np.mean(self.iteration_s))
        return {"mean_iteration_s": mean, "vs_oracle": mean / oracle_mean_s,
                "idle_fraction": float(np.mean(self.idle_fraction)),
                "decision_ms_mean": 1e3 * float(np.mean(self.decision_s)),
                "decision_ms_p99": 1e3 * float(np.percentile(self.decision_s, 99)),
                "over_memory_iterations": self.over_memory}


class LevelOracle(OraclePolicy):
    """A reference, not a policy: allocates with each worker's speed without the per-iteration noise
    (:meth:`Scenario.expected`), as it was ``delay`` iterations before the iteration decided.

    With ``delay=0`` it shows what perfect knowledge of every worker's slow process is worth; with
    ``delay = lag`` it knows that process exactly, but only as of the reports a lag-``lag`` policy has."""

    def __init__(self, delay: int = 0) -> None:
        super().__init__()
        self.delay = delay


def standard_policies(scenario: Scenario) -> dict[str, Policy]:
    """Every policy of the comparison, fresh: the oracle first, LB-BSP with the scenario's automatic model;
    where the scenario separates noise from its slow process, the two :class:`LevelOracle` references too."""
    n = scenario.config.num_workers
    references: dict[str, Policy] = {}
    if scenario.expected(0) is not None:
        references = {"oracle-level": LevelOracle(), "oracle-level-late": LevelOracle(delay=scenario.config.lag)}
    return {
        "oracle": OraclePolicy(),
        **references,
        "lbbsp": LBBSPPolicy(scenario.capacity_model()),
        "lbbsp-ewma": LBBSPPolicy(EWMAThroughput()),
        "bsp": BSPPolicy(),
        "static-proportional": StaticProportionalPolicy(),
        "per-epoch": PerEpochPolicy(),
        "leader-straggler": LeaderStragglerPolicy(model=scenario.capacity_model()),
        "backup": BackupWorkersPolicy(backups=max(1, n // 20)),
    }


def run_policy(scenario: Scenario, name: str, policy: Policy, iterations: int) -> PolicyRun:
    """Drive ``policy`` for ``iterations`` barriers: true times -> reports -> observe -> decide.

    As in production, the reports of iteration k decide iteration k + lag (``JobConfig.lag``); the first
    ``lag`` iterations use the initial split.
    """
    config = scenario.config
    n = config.num_workers
    aggregated = policy.aggregated(n)
    run = PolicyRun(name)
    initial = np.asarray(config.initial_sizes(), dtype=np.int64)
    planned = {k: initial for k in range(config.lag)}
    for k in range(iterations):
        sizes = planned.pop(k)
        truth = scenario.truth(k)
        seconds = truth.time_model.time(sizes)
        present = truth.present if truth.present is not None else np.ones(n, dtype=bool)
        finish = np.sort(seconds[present])
        waited_for = finish[:max(1, round(aggregated * present.sum() / n))]
        iteration_s = float(waited_for[-1]) * (n / aggregated)  # time per full global batch of B samples
        run.iteration_s.append(iteration_s)
        run.idle_fraction.append(float(np.mean(1.0 - np.minimum(seconds[present], waited_for[-1]) / waited_for[-1])))
        run.sizes.append(sizes.tolist())
        run.over_memory += int(truth.max_batch is not None and bool((sizes > truth.max_batch).any()))
        samples, compute_s = scenario.measured(sizes, seconds)
        features = scenario.features(k, sizes)
        reports = [Report(config.job, int(i), k, int(samples[i]), float(compute_s[i]), features=features[i],
                          device=scenario.devices[int(i)]) for i in np.flatnonzero(present)]
        target = k + config.lag
        started = time.perf_counter()
        policy.observe(reports)
        if isinstance(policy, OraclePolicy):
            coming = _shown(scenario, policy, target)
            policy.reveal(coming.time_model, coming.max_batch)
        decision = policy.decide(target, tuple(planned.get(target - 1, sizes).tolist()), config)
        run.decision_s.append(time.perf_counter() - started)
        policy.learn()  # as the coordinator does once the split is written
        planned[target] = np.asarray(decision.sizes, dtype=np.int64)
    return run


def _shown(scenario: Scenario, oracle: OraclePolicy, target: int) -> Truth:
    """What an oracle is shown before deciding ``target``: its truth, or a level oracle's noise-free view."""
    if not isinstance(oracle, LevelOracle):
        return scenario.truth(target)
    expected = scenario.expected(max(0, target - oracle.delay))
    if expected is None:
        raise ConfigError(f"scenario {scenario.name} does not separate noise from its slow process: no level oracle")
    return expected


def compare(scenario: Scenario, iterations: int, policies: Mapping[str, Policy] | None = None,
            progress: Progress | None = None) -> dict[str, PolicyRun]:
    """Run every policy on the same scenario, one after the other."""
    policies = policies if policies is not None else standard_policies(scenario)
    runs = {}
    for name, policy in policies.items():
        started = time.perf_counter()
        runs[name] = run_policy(scenario, name, policy, iterations)
        if progress is not None:
            progress(f"  {name:<20} {np.mean(runs[name].iteration_s):.4g} s/iteration "
                     f"({time.perf_counter() - started:.1f}s to simulate)")
    return runs
