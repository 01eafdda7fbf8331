"""Run balancing policies side by side on one simulated cluster, through the production policy code."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import JobConfig, _integer
from ..coordinator import Coordinator
from ..errors import ConfigError, LBBSPError
from ..guarded_policy import GuardedPolicy
from ..models import AutoCapacityModel, CapacityModel, EWMAThroughput, FLClientModel
from ..models.auto import default_models
from ..models.base import learns_availability
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
from ..protocol import MAX_SECONDS, MIN_COMPUTE_S, Assignment, Report
from ..store import Store
from .scenarios import SCENARIOS, Scenario, Truth

log = logging.getLogger(__name__)

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
    failed_decisions: int = 0  # decisions that failed or broke the job's rules: the split in force was kept

    def summary(self, oracle_mean_s: float | np.floating[Any] | None = None) -> dict[str, float]:
        """The run's figures for the table and the JSON: mean seconds per iteration, that over the oracle's
        ``oracle_mean_s`` (NaN without it: a comparison run without the oracle), idle share, decision times,
        iterations over a GPU's memory and failed decisions."""
        mean = float(np.mean(self.iteration_s))
        ratio = float("nan") if oracle_mean_s is None else float(mean / oracle_mean_s)
        return {"mean_iteration_s": mean, "vs_oracle": ratio,
                "idle_fraction": float(np.mean(self.idle_fraction)),
                "decision_ms_mean": 1e3 * float(np.mean(self.decision_s)),
                "decision_ms_p99": 1e3 * float(np.percentile(self.decision_s, 99)),
                "over_memory_iterations": self.over_memory, "failed_decisions": self.failed_decisions}


class LevelOracle(OraclePolicy):
    """A reference, not a policy: allocates with each worker's speed without the per-iteration noise
    (:meth:`Scenario.expected`), as it was ``delay`` iterations before the iteration decided.

    With ``delay=0`` it shows what perfect knowledge of every worker's slow process is worth; with
    ``delay = lag`` it knows that process exactly, but only as of the reports a lag-``lag`` policy has.
    ``hedge``: plan with margins learned from its misses, as LB-BSP does (``LBBSPPolicy(hedge=...)``)."""

    def __init__(self, delay: int = 0, hedge: float | None = None) -> None:
        super().__init__(hedge=hedge)
        self.delay = delay


def _scenario(scenario: object) -> Scenario:
    """``scenario`` if it is a built :class:`Scenario`; else a :class:`ConfigError` that says how to build one."""
    if isinstance(scenario, Scenario):
        return scenario
    kinds = {name: kind.__name__ for name, kind in SCENARIOS.items()}
    named = kinds.get(scenario) if isinstance(scenario, str) else getattr(scenario, "__name__", None)
    hint = (f": build it first, e.g. {named}(num_workers, iterations, seed)" if named in kinds.values()
            else f" (one of {', '.join(sorted(kinds.values()))}, built with (num_workers, iterations, seed))")
    raise ConfigError(f"scenario must be a Scenario instance, got {scenario!r}{hint}")


def standard_policies(scenario: Scenario) -> dict[str, Policy]:
    """Every policy of the comparison, fresh: the oracle first, LB-BSP with the scenario's automatic model;
    where the scenario separates noise from its slow process, the :class:`LevelOracle` references too (now,
    as late as LB-BSP's reports, and as late with LB-BSP's margins);
    where a worker given nothing is not asked (federated clients), LB-BSP letting as many sit out as backup
    workers drop, and the oracle doing the same as a reference."""
    n = _scenario(scenario).config.num_workers
    backups = max(1, n // 20)
    lbbsp = LBBSPPolicy(scenario.capacity_model())
    references: dict[str, Policy] = {}
    sitting_out: dict[str, Policy] = {}
    if scenario.expected(0) is not None:
        lag = scenario.config.lag
        references = {"oracle-level": LevelOracle(), "oracle-level-late": LevelOracle(delay=lag),
                      "oracle-level-late-hedged": LevelOracle(delay=lag, hedge=lbbsp.hedge)}
    if getattr(scenario.truth(0).time_model, "idle_is_free", False):
        references["oracle-sit-out"] = OraclePolicy(sit_out=backups / n)
        sitting_out = {"lbbsp-sit-out": LBBSPPolicy(scenario.capacity_model(), sit_out=backups / n)}
    return {
        "oracle": OraclePolicy(),
        **references,
        "lbbsp": lbbsp,
        **sitting_out,
        "lbbsp-ewma": LBBSPPolicy(EWMAThroughput()),
        "bsp": BSPPolicy(),
        "static-proportional": StaticProportionalPolicy(),
        "per-epoch": PerEpochPolicy(),
        "leader-straggler": LeaderStragglerPolicy(model=scenario.capacity_model()),
        "backup": BackupWorkersPolicy(backups=backups),
    }


#: Every policy object a run has driven, and the capacity model each held, by identity: one keeps what it learned, so
#: a second run would start warm (and its margins would look up forecasts of iterations it numbered before), and so
#: would a second policy given the same model (``LBBSPPolicy(model)`` twice), which no comparison should hide. Not a
#: WeakSet: that compares with ``==``, which refused a fresh policy equal to one that ran, and skipped unhashable ones.
_DRIVEN: dict[int, weakref.ref[object]] = {}


#: Seconds between progress lines within one policy's run (a large run takes minutes a policy).
PROGRESS_EVERY_S = 30.0


def _check_policies(policies: object) -> dict[str, Policy]:
    """``policies`` as a dict, once every entry is a name and a :class:`Policy` instance, none of which nor any of
    whose models has run, and none given twice: a :class:`ConfigError` before any of them runs (and learns) if not."""
    if not isinstance(policies, Mapping):
        raise ConfigError(f"policies must be a mapping of name to Policy, got {type(policies).__name__}")
    seen: dict[int, str] = {}
    for name, policy in policies.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"policy names must be non-empty strings, got {name!r}")
        if isinstance(policy, CapacityModel):
            raise ConfigError(f"policy {name!r} is a capacity model, not a policy: wrap it, "
                              f"LBBSPPolicy({type(policy).__name__}())")
        if isinstance(policy, type):
            raise ConfigError(f"policy {name!r} is the class {policy.__name__}: give an instance, e.g. "
                              f"{policy.__name__}()")
        if not isinstance(policy, Policy):
            raise ConfigError(f"policy {name!r} is a {type(policy).__name__}, not a Policy")
        for held, whose in _learners(name, policy):
            if (known := _DRIVEN.get(id(held))) is not None and known() is held:
                raise ConfigError(f"{whose} has run already and keeps what it learned: give each run fresh "
                                  "policies (standard_policies(scenario) builds a new set)")
            if (other := seen.get(id(held))) is not None:
                shared = "are one object" if held is policy else "hold one model object"
                raise ConfigError(f"policies {other!r} and {name!r} {shared}: the second would start with what "
                                  "the first learned; give each its own")
            seen[id(held)] = name
    return dict(policies)


def _learners(name: str, policy: Policy) -> list[tuple[object, str]]:
    """What in ``policy`` keeps what a run taught it (the policy, and the capacity model it holds), each named."""
    model = getattr(policy, "model", None)
    held: list[tuple[object, str]] = [(policy, f"policy {name!r}")]
    return held + [(model, f"the model of policy {name!r}")] if isinstance(model, CapacityModel) else held


def _remember(driven: object) -> None:
    """Add ``driven`` to :data:`_DRIVEN` (one of the user's own that takes no weak reference, a class with
    ``__slots__``, has nothing to remember it by)."""
    key = id(driven)
    with contextlib.suppress(TypeError):
        _DRIVEN[key] = weakref.ref(driven, lambda ref: _DRIVEN.pop(key) if _DRIVEN.get(key) is ref else None)


def run_policy(scenario: Scenario, name: str, policy: Policy, iterations: int,
               redis_url: str | None = None, progress: Progress | None = None) -> PolicyRun:
    """Drive ``policy`` for ``iterations`` barriers: true times -> reports -> observe -> decide.

    As in production, the reports of iteration k decide iteration k + lag (``JobConfig.lag``); the first
    ``lag`` iterations use the initial split. With ``redis_url`` the reports are posted to that Redis and a
    real :class:`Coordinator` decides, as in a job: the sizes each iteration runs with are read back from
    its write-once assignment key. ``progress`` is told how far the run is every ``PROGRESS_EVERY_S`` seconds.
    """
    n = _scenario(scenario).config.num_workers
    _check_policies({name: policy})
    # a policy of one's own answering 0 had been timed by its fastest worker alone, a win from nothing
    try:
        waits_for = policy.aggregated(n)
    except LBBSPError:
        raise
    except Exception as exc:  # a policy of one's own: its bare error had named neither the policy nor the hook
        raise ConfigError(f"policy {name!r}: aggregated({n}) raised {type(exc).__name__}: {exc}") from exc
    aggregated = _integer(waits_for, f"policy {name!r}: aggregated({n}), the gradients waited for,", 1, n)
    for held, _ in _learners(name, policy):
        _remember(held)
    run = PolicyRun(name)
    decider = (_InProcess(policy, scenario.config, name) if redis_url is None
               else _ThroughRedis(policy, scenario.config, redis_url))
    config = decider.config

    def reveal(target: int) -> None:
        """Show an oracle the truth of the iteration it is about to decide (no other policy sees it)."""
        if isinstance(policy, OraclePolicy):
            coming = _shown(scenario, policy, target)
            policy.reveal(coming.time_model, coming.max_batch)

    told = time.perf_counter()
    try:
        for k in range(iterations):
            if progress is not None and time.perf_counter() - told >= PROGRESS_EVERY_S:
                told = time.perf_counter()
                progress(f"  {name:<24} at iteration {k:,} of {iterations:,}")
            sizes = decider.sizes(k)
            truth = scenario.truth(k)
            seconds = truth.time_model.time(sizes)
            if not (carried := np.isfinite(seconds) & (seconds <= MAX_SECONDS)).all():  # else a report fails on it
                _out_of_range(scenario, name, k, seconds, int(np.argmin(carried)))
            asked = np.ones(n, dtype=bool)
            if getattr(truth.time_model, "idle_is_free", False):  # a client given nothing is not asked
                asked = sizes > 0
            present = asked & truth.present if truth.present is not None else asked
            # a round that none of its asked workers reaches trains nothing: it is charged as if they had come,
            # so that no policy gains from it (nobody to wait for would make it free)
            timed = present if present.any() else asked
            by_finish = np.flatnonzero(timed)[np.argsort(seconds[timed], kind="stable")]
            # the first `aggregated` to finish (backup workers: N - b), or all that came if fewer did: workers that
            # dropped out are among the b that backup workers do without
            waited_for = by_finish[:max(1, min(aggregated, int(timed.sum())))]
            slowest = float(seconds[waited_for[-1]])
            # time per full global batch of B samples: the samples of workers not waited for (backup workers'
            # drops, clients that dropped out) are lost, so an iteration is charged B / the samples it trained on
            used = int(sizes[waited_for].sum())
            run.iteration_s.append(slowest * (config.global_batch / used if used else n / aggregated))
            run.idle_fraction.append(float(np.mean(1.0 - np.minimum(seconds[timed], slowest) / slowest)))
            run.sizes.append(sizes.tolist())
            run.over_memory += int(truth.max_batch is not None and bool((sizes > truth.max_batch).any()))
            samples, compute_s = scenario.measured(sizes, seconds)
            if (fast := present & (compute_s > 0) & (compute_s < MIN_COMPUTE_S)).any():  # else a report fails on it
                _too_fast(scenario, name, k, compute_s, int(np.argmax(fast)))
            features = scenario.features(k, sizes)
            reports = [Report(config.job, int(i), k, int(samples[i]), float(compute_s[i]), features=features[i],
                              device=scenario.devices[int(i)]) for i in np.flatnonzero(present)]
            if truth.present is not None:  # who came back of those asked, as the Flower plugin tells its model
                _record_outcomes(policy, asked, present)
            run.decision_s.append(decider.decide(k, sizes, reports, reveal))
        run.failed_decisions = decider.failures()
    finally:
        decider.close()
    return run


def _record_outcomes(policy: Policy, asked: np.ndarray, present: np.ndarray) -> None:
    """Tell ``policy``'s model, where it learns availability, which of the workers ``asked`` completed the round."""
    model = getattr(policy, "model", None)
    if learns_availability(model):
        model.record_outcomes({int(w): bool(present[w]) for w in np.flatnonzero(asked)})  # type: ignore[union-attr]


class _InProcess:
    """Decides as the coordinator does, in this process and through the same :class:`GuardedPolicy`:
    observe -> decide -> (split out) -> learn. A failure is logged under the run's ``name``."""

    def __init__(self, policy: Policy, config: JobConfig, name: str) -> None:
        self.guarded, self.config = GuardedPolicy(policy, config, name), config
        initial = np.asarray(config.initial_sizes(), dtype=np.int64)
        self.planned = {k: initial for k in range(config.lag)}

    def sizes(self, k: int) -> np.ndarray:
        return self.planned.pop(k)

    def decide(self, k: int, sizes: np.ndarray, reports: list[Report], reveal: Callable[[int], None]) -> float:
        """Decide iteration k + lag from the reports of k; the seconds until the split is out."""
        target = k + self.config.lag
        started = time.perf_counter()
        reveal(target)
        _, assignment = self.guarded.decide(target, tuple(self.planned.get(target - 1, sizes).tolist()), reports)
        decision_s = time.perf_counter() - started
        self.guarded.learn(k)  # as the coordinator does once the split is written
        self.planned[target] = np.asarray(assignment.sizes, dtype=np.int64)
        return decision_s

    def failures(self) -> int:
        return self.guarded.failures

    def close(self) -> None:
        pass


class _ThroughRedis:
    """Decides through Redis: each report posted as a worker posts it (the whole cluster's in one round
    trip), a real Coordinator deciding, and every iteration's sizes read back from its write-once key. A
    fresh job name per run."""

    def __init__(self, policy: Policy, config: JobConfig, url: str) -> None:
        self.config = dataclasses.replace(config, job=f"{config.job}-{uuid.uuid4().hex[:8]}")
        self.store = Store.from_url(url, self.config.job)
        try:
            # decided in lockstep with the simulated steps, whatever a decision's wall time against their
            # simulated seconds: one iteration a decision, as a coordinator that keeps up (Coordinator.ahead)
            self.coordinator = Coordinator(self.store, self.config, policy, max_ahead=1, simulated=True)
            for k in range(self.config.lag):  # the workers' initial split, agreed through the same write-once key
                self.store.publish(self.config.initial_assignment(k))
        except BaseException:  # the caller gets no object to close: close the connection here
            self.store.close()
            raise

    def sizes(self, k: int) -> np.ndarray:
        raw = self.store.get_assignment(k)
        if raw is None:  # written at start (k < lag) or by the decision of iteration k - lag
            raise LBBSPError("the coordinator wrote no assignment", job=self.config.job, iteration=k)
        return np.asarray(Assignment.from_json(raw, job=self.config.job).sizes, dtype=np.int64)

    def decide(self, k: int, sizes: np.ndarray, reports: list[Report], reveal: Callable[[int], None]) -> float:
        self.store.post_reports(reports, self.config.num_workers)
        reveal(k + self.config.lag)
        return self.coordinator.decide(k).decision_s

    def failures(self) -> int:
        return self.coordinator.failed_decisions

    def close(self) -> None:
        """Delete the run's keys (nothing is left on a shared Redis) and close the connection."""
        try:
            self.store.forget()
        finally:
            self.store.close()


def _options(scenario: Scenario) -> str:
    """The scenario's numeric options as ``name=value``, for an error that blames them."""
    options = ", ".join(f"{key}={value!r}" for key, value in scenario.notes.items() if isinstance(value, (int, float)))
    return options or "see its notes"


def _out_of_range(scenario: Scenario, policy: str, iteration: int, seconds: np.ndarray, worker: int) -> None:
    """A :class:`ConfigError` for ``worker``'s time under ``policy``'s split, which no report can carry: the scenario's
    options, not a worker, are to blame (a jitter of 1,000 had been a worker's report refused for a compute_s of inf).
    Named by the policy, since an even split may fit where a policy's uneven one does not."""
    raise ConfigError(f"scenario {scenario.name}: the split of policy {policy!r} gives worker {worker} "
                      f"{seconds[worker]:.4g} s in iteration {iteration}, past the {MAX_SECONDS:,.0f} s a report may "
                      f"carry: check the magnitudes of its options ({_options(scenario)})")


def _too_fast(scenario: Scenario, policy: str, iteration: int, compute_s: np.ndarray, worker: int) -> None:
    """A :class:`ConfigError` for ``worker``'s measured compute time, above 0 but under what a report may carry: the
    scenario's options make its workers too fast to measure (its report had failed with a ProtocolError)."""
    batch = [option for option in inspect.signature(type(scenario)).parameters if "batch" in option]
    raise ConfigError(f"scenario {scenario.name}: the split of policy {policy!r} gives worker {worker} "
                      f"{compute_s[worker]:.3g} s of compute in iteration {iteration}, under the {MIN_COMPUTE_S:g} s "
                      f"a report may carry as measured (lbbsp.protocol.MIN_COMPUTE_S): its workers are too fast to "
                      f"measure; give them more samples ({' or '.join(batch) or 'a larger batch'}) or slower compute "
                      f"(check the magnitudes of its options: {_options(scenario)})")


def _shown(scenario: Scenario, oracle: OraclePolicy, target: int) -> Truth:
    """What an oracle is shown before deciding ``target``: its truth, or a level oracle's noise-free view."""
    if not isinstance(oracle, LevelOracle):
        return scenario.truth(target)
    expected = scenario.expected(max(0, target - oracle.delay))
    if expected is None:
        raise ConfigError(f"scenario {scenario.name} does not separate noise from its slow process: no level oracle")
    return expected


def compare(scenario: Scenario, iterations: int, policies: Mapping[str, Policy] | None = None,
            progress: Progress | None = None, redis_url: str | None = None) -> dict[str, PolicyRun]:
    """Run every policy on the same scenario, one after the other (through the Redis at ``redis_url``, if
    given: see :func:`run_policy`). Each policy must be fresh: one that has run already is a ConfigError."""
    scenario = _scenario(scenario)
    iterations = _integer(iterations, "iterations", 1, None)  # numpy's integers too, as the scenarios take them
    if scenario.iterations is not None and iterations > scenario.iterations:
        raise ConfigError(f"the {scenario.name} scenario was built for {scenario.iterations} iterations, not "
                          f"{iterations}: build it with at least as many")
    chosen = _check_policies(policies) if policies is not None else standard_policies(scenario)
    _warn_local_steps(scenario, chosen)
    runs = {}
    for name, policy in chosen.items():
        started = time.perf_counter()
        run = runs[name] = run_policy(scenario, name, policy, iterations, redis_url, progress)
        if progress is not None:
            # a run whose decisions failed ran the split kept in force (at worst the initial one throughout)
            failed = (f"; {run.failed_decisions} of {iterations} decisions failed, the split was kept: see the log"
                      if run.failed_decisions else "")
            progress(f"  {name:<24} {np.mean(run.iteration_s):.4g} s/iteration "
                     f"({time.perf_counter() - started:.1f}s to simulate{failed})")
    return runs


def _warn_local_steps(scenario: Scenario, policies: Mapping[str, Policy]) -> None:
    """Warn of each policy whose model plans federated clients with other local steps than ``scenario`` runs: clients
    report local_steps x batch samples, so such a model misjudges their compute, unsaid (1.275x the oracle where the
    scenario's own model is 1.000: AutoCapacityModel's default client model has local_steps=1, FLClients 5)."""
    steps = getattr(scenario, "local_steps", None)
    if steps is None:
        return
    for name, policy in policies.items():
        planned = _planned_local_steps(getattr(policy, "model", None))
        if planned is not None and planned != steps:
            log.warning("policy %r plans federated clients with local_steps=%s, but scenario %s runs %s local steps a "
                        "round: give it the scenario's model (model=scenario.capacity_model(), as in "
                        "LBBSPPolicy(scenario.capacity_model())), or FLClientModel(local_steps=%s) (in "
                        "AutoCapacityModel(models={'fl': ...}))",
                        name, planned, scenario.name, steps, steps)


def _planned_local_steps(model: object) -> object:
    """The local steps ``model`` plans federated clients with: an :class:`FLClientModel`'s, or that of an
    :class:`AutoCapacityModel`'s client model (given, else its default); None for a model that plans none."""
    if isinstance(model, AutoCapacityModel):
        given = model.models if isinstance(model.models, Mapping) else {}
        model = given.get("fl", default_models()["fl"])
    return model.local_steps if isinstance(model, FLClientModel) else None
