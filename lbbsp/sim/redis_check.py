"""The simulator's ``--redis`` path: LB-BSP through a real Coordinator and Store on an embedded Redis."""
from __future__ import annotations

import dataclasses
import uuid

import numpy as np

from ..coordinator import Coordinator
from ..embedded import EmbeddedRedis
from ..errors import LBBSPError
from ..policies import LBBSPPolicy
from ..protocol import Assignment, Report
from ..store import Store
from .engine import run_policy
from .scenarios import Scenario


def check_through_redis(scenario: Scenario, iterations: int) -> dict[str, object]:
    """Post the scenario's reports to Redis, let a Coordinator decide, and compare its sizes with the
    in-process run of the same policy: the production path must decide exactly the same."""
    in_process = run_policy(scenario, "lbbsp", LBBSPPolicy(scenario.capacity_model()), iterations)
    base = scenario.config
    config = dataclasses.replace(base, job=f"sim-{uuid.uuid4().hex[:8]}")
    through_redis, decision_s = [], []
    with EmbeddedRedis() as server, Store.from_url(server.url, config.job) as store:
        coordinator = Coordinator(store, config, LBBSPPolicy(scenario.capacity_model()))
        for k in range(iterations):
            if k < config.lag:  # the workers' initial split, agreed through the same write-once key
                store.publish(Assignment(config.job, k, config.initial_sizes(), "initial"))
            raw = store.get_assignment(k)
            if raw is None:  # written above (k < lag) or by the decision of iteration k - lag
                raise LBBSPError("the coordinator wrote no assignment", job=config.job, iteration=k)
            sizes = np.asarray(Assignment.from_json(raw, job=config.job).sizes, dtype=np.int64)
            through_redis.append(sizes.tolist())
            truth = scenario.truth(k)
            present = truth.present if truth.present is not None else np.ones(config.num_workers, dtype=bool)
            samples, compute_s = scenario.measured(sizes, truth.time_model.time(sizes))
            features = scenario.features(k, sizes)
            for i in np.flatnonzero(present):
                store.post_report(Report(config.job, int(i), k, int(samples[i]), float(compute_s[i]),
                                         features=features[i], device=scenario.devices[int(i)]), config.num_workers)
            outcome = coordinator.decide(k)
            decision_s.append(outcome.decision_s)
    return {"iterations": iterations, "identical": through_redis == in_process.sizes,
            "decision_ms_mean": 1e3 * float(np.mean(decision_s))}
