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


class Explores(EWMAThroughput):
    """A model of one's own whose ``explore`` answers with ``answer(sizes)``."""

    def __init__(self, answer: object = None) -> None:
        super().__init__()
        self.answer = answer

    def explore(self, workers: WorkerIds, sizes: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        return self.answer(sizes)  # type: ignore[operator,no-any-return]


def test_an_explore_that_returns_a_list_balances_as_with_an_array() -> None:
    guarded, sizes, _ = _run(LBBSPPolicy(Explores(list), hedge=None))  # had been "'list' has no attribute 'tolist'"
    assert guarded.failures == 0 and sizes == (40, 80, 120, 160)


@pytest.mark.parametrize(("answer", "why"), [(lambda s: None, "Explores.explore returned None, not numbers"),
                                             (lambda s: s[:3], "Explores.explore returned 3 values for 4 workers")])
def test_an_explore_of_the_wrong_length_or_no_numbers_is_named(answer: object, why: str) -> None:
    guarded, sizes, reason = _run(LBBSPPolicy(Explores(answer), hedge=None))
    assert sizes == CONFIG.initial_sizes() and guarded.failures == 3 and why in reason, reason


class ShortPropose(LBBSPPolicy):
    def propose(self, time_model: object, config: JobConfig, lower: np.ndarray, upper: np.ndarray,
                truth: object = None) -> np.ndarray:
        return np.array([200, 200])


def test_a_propose_hook_of_the_wrong_length_is_named() -> None:
    guarded, sizes, reason = _run(ShortPropose(EWMAThroughput()))  # had been a bare IndexError
    assert guarded.failures == 3 and "ShortPropose.propose returned 2 values for 4 workers" in reason, reason


class Timed(EWMAThroughput):
    """A model of one's own whose time model answers ``seconds(sizes)``."""

    def __init__(self, seconds: object = None) -> None:
        super().__init__()
        self.seconds = seconds

    def time_model(self, workers: WorkerIds) -> Timed:
        return self

    def time(self, sizes: np.ndarray) -> np.ndarray:
        return self.seconds(np.asarray(sizes, dtype=float))  # type: ignore[operator,no-any-return]


@pytest.mark.parametrize("seconds", [lambda x: -x, lambda x: 1000.0 - x])
def test_a_time_below_zero_or_falling_with_the_batch_is_refused(seconds: object) -> None:
    """-size had kept the equal split at a 'predicted finish -16s', 1000 - size passed as a time: neither said so."""
    guarded, sizes, reason = _run(LBBSPPolicy(Timed(seconds), hedge=None))
    assert guarded.failures == 3 and "seconds must be at least 0 and grow with the batch" in reason, reason


class TrueCaps(EWMAThroughput):
    def max_batch(self, workers: WorkerIds) -> np.ndarray:
        return np.ones(len(workers), dtype=bool)


def test_boolean_memory_caps_are_refused_by_name() -> None:
    guarded, _, reason = _run(LBBSPPolicy(TrueCaps(), hedge=None))  # True had been a cap of 1 sample
    assert guarded.failures == 3 and "TrueCaps.max_batch returned" in reason and "not booleans" in reason, reason


class Fixed(Policy):
    """A policy of one's own that decides ``sizes`` with ``reason`` whatever it sees, letting ``sit_out`` sit out."""

    def __init__(self, sizes: object, reason: object = "fixed", sit_out: object = 0.0) -> None:
        self.sizes, self.reason, self.sit_out = sizes, reason, sit_out  # type: ignore[assignment]

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return Decision(self.sizes, self.reason)  # type: ignore[arg-type]


@pytest.mark.parametrize(("policy", "why"), [
    (Fixed((400, 0, 0, 0), sit_out=0.25), "3 workers given 0 samples, where its sit_out of 0.25 lets at most 1 of 4"),
    (Fixed((100,) * 4, reason=None), "the reason must be a string, got NoneType"),
    (Fixed(np.array([2**63, 2**63, 0, 0], dtype=np.uint64)), "sizes must be at most the global batch"),
    (Fixed((10**30, 0, 0, 0)), "sizes must be at most the global batch"),
])
def test_a_policy_of_ones_own_is_held_to_its_sit_out_and_the_splits_rules(policy: Policy, why: str) -> None:
    """Any true sit_out had let a policy leave all but one worker at 0; a reason of None failed on len(); 2**63 as
    uint64 wrapped to a negative size; 10**30 was said not to be an integer."""
    guarded, sizes, reason = _run(policy, 1)
    assert sizes == CONFIG.initial_sizes() and guarded.failures == 1 and why in reason, reason
    assert _run(Fixed((0, 100, 100, 200), sit_out=0.25), 1)[1] == (0, 100, 100, 200)  # its share may sit out


def test_a_sit_out_that_is_not_a_share_and_an_aggregated_out_of_range_are_refused_where_the_run_starts() -> None:
    with pytest.raises(ConfigError, match=r"policy Fixed's sit_out must be a share in \[0, 1\), got 'no'"):
        GuardedPolicy(Fixed((100,) * 4, sit_out="no"), CONFIG)

    class WaitsForNone(Policy):
        def aggregated(self, num_workers: int) -> int:
            return 0

    # had been timed by its fastest worker alone: a 'win' from nothing, and None or 3.0 a TypeError deep inside
    with pytest.raises(ConfigError, match=r"policy 'm': aggregated\(4\), the gradients waited for, must be an "
                                          r"integer in \[1, 4\], got 0"):
        compare(CPUContention(4, 3, 0), 3, {"m": WaitsForNone()})
