"""The extension points as a user fills them: a capacity model, a policy, a time model of one's own, and the slips
a user makes in them, each either working or refused with an error that names the slip."""
from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from lbbsp import CoordinatorProcess, EmbeddedRedis
from lbbsp.allocation import allocate
from lbbsp.config import JobConfig
from lbbsp.coordinator import GuardedPolicy
from lbbsp.errors import AllocationError, ConfigError
from lbbsp.models import AutoCapacityModel, EWMAThroughput
from lbbsp.models.base import CapacityModel, WorkerIds, as_reports
from lbbsp.policies import Decision, LBBSPPolicy, Policy
from lbbsp.protocol import Report
from lbbsp.sim.engine import compare
from lbbsp.sim.scenarios import CPUContention

CONFIG = JobConfig("ext", 4, 400)
SPEEDS = np.array([100.0, 200.0, 300.0, 400.0])


def _reports(k: int, sizes: Sequence[int]) -> list[Report]:
    return [Report("ext", w, k, int(s), float(s / SPEEDS[w])) for w, s in enumerate(sizes)]


def _run(policy: Policy, iterations: int = 3) -> tuple[GuardedPolicy, tuple[int, ...], str]:
    """Drive ``policy`` as the coordinator does; the guard, the last split and its reason."""
    guarded, sizes, reason = GuardedPolicy(policy, CONFIG), CONFIG.initial_sizes(), ""
    for k in range(iterations):
        _, assignment = guarded.decide(k + CONFIG.lag, sizes, _reports(k, sizes))
        guarded.learn(k)
        sizes, reason = assignment.sizes, assignment.reason
    return guarded, sizes, reason


class Answers(CapacityModel):
    """A model of one's own that answers ``predict`` with ``answer`` whatever it is asked (a user's slip)."""

    def __init__(self, answer: object = None) -> None:
        self.answer = answer

    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> Answers:
        as_reports(reports)
        self.seen_ = True
        return self

    def predict(self, workers: WorkerIds) -> np.ndarray:
        self._check_is_fitted("seen_")
        return self.answer  # type: ignore[return-value]


@pytest.mark.parametrize("auto", [False, True])
def test_a_model_that_predicts_a_list_balances_as_with_an_array(auto: bool) -> None:
    model = Answers(SPEEDS.tolist())
    guarded, sizes, _ = _run(LBBSPPolicy(AutoCapacityModel(models={"cpu": model}) if auto else model))
    assert guarded.failures == 0
    assert sizes == (40, 80, 120, 160)


@pytest.mark.parametrize("auto", [False, True])
@pytest.mark.parametrize(("answer", "why"), [([1.0, 2.0, 3.0], "3 values for 4 workers"),
                                             (np.ones(5), "5 values for 4 workers"),
                                             (None, "not numbers"), (["1", "2", "3", "4"], "not numbers")])
def test_a_model_that_predicts_the_wrong_length_or_no_numbers_is_named(auto: bool, answer: object, why: str) -> None:
    model = Answers(answer)
    guarded, sizes, reason = _run(LBBSPPolicy(AutoCapacityModel(models={"cpu": model}) if auto else model))
    assert sizes == CONFIG.initial_sizes() and guarded.failures == 3
    assert "Answers.predict" in reason and why in reason, reason


class Rescaled(EWMAThroughput):
    """Not clonable: ``__init__`` changes the value it is given, so scikit-learn's clone refuses it."""

    def __init__(self, alpha: float = 0.5) -> None:
        super().__init__(alpha / 2)


def test_a_model_that_cannot_be_cloned_is_refused_where_the_auto_model_is_built() -> None:
    with pytest.raises(ConfigError, match=r"models\['cpu'\]: Rescaled cannot be cloned"):
        LBBSPPolicy(AutoCapacityModel(models={"cpu": Rescaled()}))


class ReturnsSizes(Policy):
    """decide returns the bare sizes, not a Decision: a user's slip."""

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return tuple(current)  # type: ignore[return-value]


def test_a_policy_that_returns_no_decision_keeps_the_split_and_says_so() -> None:
    guarded, sizes, reason = _run(ReturnsSizes(), iterations=1)
    assert sizes == CONFIG.initial_sizes() and guarded.failures == 1
    assert "must return a Decision" in reason and "got tuple" in reason, reason


class TableSizes(Policy):
    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return Decision(np.reshape(current, (2, 2)), "a table")  # type: ignore[arg-type]


def test_a_table_of_sizes_is_refused_with_its_shape() -> None:
    _, _, reason = _run(TableSizes(), iterations=1)
    assert "sizes of shape (2, 2) for 4 workers" in reason, reason


class ListHooks(LBBSPPolicy):
    """A variant whose hooks hand back lists: bounds capped at 150, and the proposal as is."""

    def bounds(self, workers: WorkerIds, current: np.ndarray, config: JobConfig) -> tuple[np.ndarray, np.ndarray]:
        lower, upper = super().bounds(workers, current, config)
        return lower.tolist(), [150] * config.num_workers  # type: ignore[return-value]

    def propose(self, *args: object, **kwargs: object) -> np.ndarray:
        return super().propose(*args, **kwargs).tolist()  # type: ignore[arg-type, return-value]


def test_lbbsp_hooks_that_return_lists_work_as_arrays() -> None:
    guarded, sizes, _ = _run(ListHooks(EWMAThroughput()))
    assert guarded.failures == 0
    assert sum(sizes) == 400 and max(sizes) == 150 and sizes[0] < sizes[1] < sizes[2]


class ListTime:
    """A time model of one's own whose ``time`` returns a list."""

    def time(self, sizes: np.ndarray) -> list[float]:
        return (np.asarray(sizes, dtype=float) / SPEEDS).tolist()


def test_a_time_model_that_returns_a_list_is_named() -> None:
    with pytest.raises(AllocationError, match="time model's time.*numpy array.*got list"):
        allocate(ListTime(), 400, [1] * 4, [400] * 4)  # type: ignore[arg-type]


def test_a_model_shared_by_two_policies_of_one_comparison_is_refused() -> None:
    scenario, model = CPUContention(4, 5, 0), EWMAThroughput()
    with pytest.raises(ConfigError, match="policies 'a' and 'b' hold one model object"):
        compare(scenario, 5, {"a": LBBSPPolicy(model), "b": LBBSPPolicy(model)})


class Locked(Policy):
    """Holds a lock: it cannot be pickled to a coordinator's child process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


def test_a_policy_that_cannot_be_pickled_is_refused_by_the_coordinator_process_by_name(
        redis_server: EmbeddedRedis, job: str) -> None:
    with pytest.raises(ConfigError, match=r"policy Locked cannot be pickled.*Coordinator\(store, config, policy\)"):
        CoordinatorProcess(redis_server.url, JobConfig(job, 2, 200), Locked())
