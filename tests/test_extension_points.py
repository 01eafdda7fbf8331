"""The extension points as a user fills them: a capacity model (for every worker or for one kind), a policy and the
hooks it calls (forecasts, capacities, memory caps, availability, dropouts), a time model of one's own, and the
slips a user makes in them, each either working or refused with an error that names the slip, most of them where
the policy is built."""
from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from lbbsp import ConfigError, CoordinatorProcess, EmbeddedRedis, JobConfig, LBBSPPolicy, LinearTime, Report, allocate
from lbbsp.coordinator_process import checked_process_policy
from lbbsp.errors import AllocationError
from lbbsp.guarded_policy import GuardedPolicy
from lbbsp.models import AutoCapacityModel, EWMAThroughput, FLClientModel, LastValue
from lbbsp.models.base import CapacityModel, WorkerIds, as_reports, measured_throughput
from lbbsp.policies import Decision, LeaderStragglerPolicy, OraclePolicy, PerEpochPolicy, Policy
from lbbsp.sim import FLClients, GPUMix, compare
from lbbsp.sim.engine import run_policy
from lbbsp.sim.scenarios import CPUContention
from test_coordinator import UNEVEN_SPEEDS, _reports_at_uneven_speeds
from test_policies import SPEEDS as POLICY_SPEEDS

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


def test_predictions_that_are_not_one_number_a_worker_are_dropped_with_one_warning_not_one_a_decision(
        caplog: pytest.LogCaptureFixture) -> None:
    class OnePrediction(Fixed):
        def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
            return Decision((100,) * 4, "fixed", predicted_throughput=(1.0,))

    with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
        guarded, sizes, _ = _run(OnePrediction(None), 5)
    assert sizes == (100,) * 4 and guarded.failures == 0
    assert len([r for r in caplog.records if "is not one number per worker" in r.getMessage()]) == 1


@pytest.mark.parametrize(("policy", "why"), [
    (Fixed((400, 0, 0, 0), sit_out=0.25), "3 workers given 0 samples, where its sit_out of 0.25 lets at most 1 of 4"),
    (Fixed((100,) * 4, reason=None), "the reason must be a string, got NoneType"),
    (Fixed(np.array([2**63, 2**63, 0, 0], dtype=np.uint64)), "sizes must be at most the global batch"),
    (Fixed((10**30, 0, 0, 0)), "sizes must be at most the global batch"),
    (Fixed((math.inf, 100.0, 100.0, 200.0)), "sizes must be integers, got [inf, 100.0"),  # had read as -2**63
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

    class Raises(Policy):
        def aggregated(self, num_workers: int) -> int:
            raise RuntimeError("not ready")

    # had escaped compare as the bare RuntimeError, naming neither the policy nor the hook
    with pytest.raises(ConfigError, match=r"policy 'm': aggregated\(4\) raised RuntimeError: not ready"):
        compare(CPUContention(4, 3, 0), 3, {"m": Raises()})


class Mean(CapacityModel):
    """A correct minimal model: each worker's mean throughput over its reports so far."""

    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> Mean:
        workers, throughput = measured_throughput(as_reports(reports))
        self.sums_ = getattr(self, "sums_", {})
        for worker, value in zip(workers.tolist(), throughput.tolist()):
            total, count = self.sums_.get(worker, (0.0, 0))
            self.sums_[worker] = (total + value, count + 1)
        return self

    def predict(self, workers: WorkerIds) -> np.ndarray:
        self._check_is_fitted("sums_")
        return np.array([self.sums_[w][0] / self.sums_[w][1] if w in self.sums_ else np.nan for w in workers])


class NoPartialFit(CapacityModel):
    """(a) forgot ``partial_fit``."""

    def predict(self, workers: WorkerIds) -> np.ndarray:
        return np.ones(len(workers))


class NoDefer(Mean):
    """(b) ``partial_fit(self, reports)``, as the first line of docs/models.md had read."""

    def partial_fit(self, reports: Sequence[Report] | Report) -> NoDefer:  # type: ignore[override]
        super().partial_fit(reports)
        return self


class NoPredict(CapacityModel):
    """(c) forgot ``predict``."""

    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> NoPredict:
        return self


class Keywords(Mean):
    """``partial_fit`` that takes ``defer`` among any keywords: within the contract."""

    def partial_fit(self, reports: Sequence[Report] | Report, **kwargs: object) -> Keywords:  # type: ignore[override]
        super().partial_fit(reports)
        return self


@pytest.mark.parametrize(("model", "method", "signature"), [
    (NoPartialFit, "partial_fit", "partial_fit(reports, *, defer=False) -> self"),
    (NoDefer, "partial_fit", "partial_fit(reports, *, defer=False) -> self"),
    (NoPredict, "predict", "predict(workers) -> "),
])
def test_a_model_that_breaks_the_contract_is_refused_where_the_policy_is_built(model: type[CapacityModel],
                                                                              method: str, signature: str) -> None:
    """Each had run: every decision failed (logged as 'policy lbbsp'), the split kept, so the run was BSP's."""
    for build in (lambda m: LBBSPPolicy(m, deadband=0.0, hedge=None), lambda m: PerEpochPolicy(model=m),
                  lambda m: LeaderStragglerPolicy(model=m)):
        with pytest.raises(ConfigError) as caught:
            build(model())
        message = caught.value.message
        assert model.__name__ in message and method in message and signature in message, message


@pytest.mark.parametrize("model", [NoPartialFit, NoDefer, NoPredict])
def test_a_model_of_ones_own_for_one_kind_of_worker_is_held_to_the_contract_too(model: type[CapacityModel]) -> None:
    """Given to AutoCapacityModel for the CPU workers, each had been accepted, and failed each decision."""
    with pytest.raises(ConfigError, match=rf"models\['cpu'\]: {model.__name__}"):
        LBBSPPolicy(AutoCapacityModel(models={"cpu": model()}))


def test_a_partial_fit_that_takes_any_keywords_is_within_the_contract() -> None:
    assert isinstance(LBBSPPolicy(Keywords()).model, Keywords)


def test_the_base_class_says_what_a_model_must_define() -> None:
    with pytest.raises(NotImplementedError, match=r"NoPartialFit must define partial_fit\(reports, \*, defer=False\)"):
        NoPartialFit().partial_fit([])
    with pytest.raises(NotImplementedError, match=r"NoPredict must define predict\(workers\)"):
        NoPredict().predict([0])


def test_a_minimal_model_of_ones_own_balances_in_the_simulator() -> None:
    scenario = GPUMix(8, 30, seed=0)
    runs = compare(scenario, 30, {"oracle": OraclePolicy(), "mine": LBBSPPolicy(Mean(), deadband=0.0, hedge=None),
                                  "keywords": LBBSPPolicy(Keywords(), deadband=0.0, hedge=None)})
    assert runs["mine"].failed_decisions == runs["keywords"].failed_decisions == 0
    assert len({tuple(sizes) for sizes in runs["mine"].sizes}) > 1  # it moved the split
    summary = runs["mine"].summary(np.mean(runs["oracle"].iteration_s))  # np.float64, as the docs' snippet passes
    assert all(type(value) in (float, int) for value in summary.values()), summary  # printed np.float64(...)
    alone = runs["mine"].summary()  # a comparison without the oracle: its other figures, no ratio (a TypeError had)
    assert np.isnan(alone["vs_oracle"]) and {k: v for k, v in alone.items() if k != "vs_oracle"} == {
        k: v for k, v in summary.items() if k != "vs_oracle"}


class _WithAvailabilityParameter(EWMAThroughput):
    """A model of one's own with a parameter named ``availability``, kept on the instance as scikit-learn asks."""

    def __init__(self, alpha: float = 0.3, availability: float = 0.95) -> None:
        super().__init__(alpha)
        self.availability = availability


class _FreeCores(EWMAThroughput):
    """An ``availability()`` that means something else (the share of cores free), with no outcomes to learn from."""

    def availability(self, workers: object) -> np.ndarray:
        return np.full(len(workers), 0.5)  # type: ignore[arg-type]


class _ShortAvailability(FLClientModel):
    def availability(self, workers: object) -> np.ndarray:
        return np.ones(2)


def _decide_with(model: object) -> tuple[int, ...]:
    policy, config = LBBSPPolicy(model, hedge=None), JobConfig("own", 4, 400)  # type: ignore[arg-type]
    policy.observe([Report("own", i, 0, 100, 100 / (100.0 * (i + 1))) for i in range(4)])
    return policy.decide(1, config.initial_sizes(), config).sizes


def test_models_that_do_not_learn_availability_are_not_weighed() -> None:
    """A parameter named availability had made every decision raise (a float is not callable), and an availability()
    of another meaning had capped the fastest worker."""
    plain = _decide_with(EWMAThroughput(0.3))
    assert _decide_with(_WithAvailabilityParameter()) == plain == _decide_with(_FreeCores(0.3))


def test_an_availability_of_the_wrong_length_is_named() -> None:
    with pytest.raises(ConfigError, match=r"_ShortAvailability.availability returned 2 values for 4 workers"):
        LBBSPPolicy(_ShortAvailability(local_steps=1)).dropout(np.arange(4))


def test_a_mixed_job_allocates_with_a_time_model_of_ones_own() -> None:
    class Quadratic:
        def __init__(self, k: np.ndarray) -> None:
            self.k = k

        def time(self, sizes: np.ndarray) -> np.ndarray:
            return self.k * np.asarray(sizes, float) ** 2

    class MyGPU(LastValue):
        def time_model(self, workers: object) -> Quadratic:  # type: ignore[override]
            return Quadratic(1.0 / self.predict(workers))  # type: ignore[arg-type]

    model = AutoCapacityModel(models={"gpu": MyGPU(), "cpu": LastValue()})
    model.partial_fit([Report("j", 0, 0, 10, 0.1, device="cuda:0"), Report("j", 1, 0, 10, 0.1)])
    sizes = allocate(model.time_model([0, 1]), 100, [1, 1], [100, 100])  # an AttributeError before
    assert sizes.sum() == 100 and sizes[0] < sizes[1]  # quadratic time: the GPU worker takes fewer


class _Fixed(Policy):
    def __init__(self, sizes: tuple[float, ...], sit_out: float = 0.0) -> None:
        self.sizes, self.sit_out = sizes, sit_out

    def decide(self, iteration: int, current, config: JobConfig) -> Decision:  # type: ignore[no-untyped-def]
        return Decision(self.sizes, "fixed")  # type: ignore[arg-type]


@pytest.mark.parametrize(("config", "sizes", "sit_out", "refusal"), [
    (JobConfig("j", 4, 400, max_batch=150), (200, 100, 50, 50), 0.0, "worker 0 got 200 samples, outside its bounds"),
    (JobConfig("j", 4, 400, max_batch=120), (150, 50, 100, 100), 0.25, "outside its bounds"),
    (JobConfig("j", 4, 400, min_batch=0), (-0.5, 100.0, 100.0, 200.5), 0.0, "must be integers"),
])
def test_the_guard_refuses_a_split_past_the_bounds_or_of_fractions(config: JobConfig, sizes: tuple[float, ...],
                                                                   sit_out: float, refusal: str) -> None:
    guard = GuardedPolicy(_Fixed(sizes, sit_out), config)
    decision, assignment = guard.decide(5, config.initial_sizes(), [])
    assert assignment.sizes == tuple(config.initial_sizes()) and guard.failures == 1
    assert refusal in decision.reason


def test_the_guard_lets_the_share_allowed_to_sit_out_do_so() -> None:
    config = JobConfig("j", 100, 1000)
    sizes = (0,) * 29 + (10,) * 70 + (300,)  # 29 of 100 at 0, under sit_out 0.29 (a float's 28.999...)
    guard = GuardedPolicy(_Fixed(sizes, 0.29), config)
    assert guard.decide(5, config.initial_sizes(), [])[1].sizes == sizes and guard.failures == 0






class Kw(CapacityModel):
    """Stores its keyword under another name: scikit-learn's clone (and get_params) cannot find ``scale``."""

    def __init__(self, scale: float = 1.0) -> None:
        self.s = scale

    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> Kw:
        as_reports(reports)
        self.seen_ = True
        return self

    def predict(self, workers: WorkerIds) -> np.ndarray:
        self._check_is_fitted("seen_")
        return UNEVEN_SPEEDS[np.asarray(workers)] * self.s


def test_a_model_that_stores_a_keyword_under_another_name_is_refused_by_the_auto_model_by_name() -> None:
    """A raw AttributeError from scikit-learn's clone had come out of the automatic model's check."""
    with pytest.raises(ConfigError, match=r"models\['cpu'\]: Kw cannot be cloned \(.*'scale'.*\); its __init__ must "
                                          r"store each keyword argument as given"):
        AutoCapacityModel(models={"cpu": Kw()})._check_params()
    with pytest.raises(ConfigError, match=r"models\['cpu'\]: Kw cannot be cloned"):
        LBBSPPolicy(AutoCapacityModel(models={"cpu": Kw()}))


def test_the_same_model_given_to_a_policy_directly_balances() -> None:
    """Given directly, nothing clones it: it runs as its own (the automatic model copies the models it is given)."""
    config = JobConfig("kw", 4, 240)
    guarded, sizes = GuardedPolicy(LBBSPPolicy(Kw(), hedge=None), config), config.initial_sizes()
    for k in range(3):
        _, assignment = guarded.decide(k + config.lag, sizes, _reports_at_uneven_speeds("kw", k, sizes))
        sizes = assignment.sizes
    assert guarded.failures == 0 and sizes == (100, 50, 50, 40), sizes


class Const(CapacityModel):
    """Predicts ``value`` for workers 0 to 3, whatever it saw."""

    def __init__(self, value: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)) -> None:
        self.value = value

    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> Const:
        as_reports(reports)
        self.seen_ = True
        return self

    def predict(self, workers: WorkerIds) -> np.ndarray:
        self._check_is_fitted("seen_")
        return np.asarray(self.value, dtype=float)[np.asarray(workers)]


@pytest.mark.parametrize(("value", "what"), [((np.inf, 10.0, 10.0, 10.0), r"inf for worker\(s\) \[0\]"),
                                             ((10.0, 10.0, -5.0, -np.inf), r"-5 for worker\(s\) \[2, 3\]")])
def test_an_infinite_or_negative_forecast_is_refused_naming_the_model_and_workers(value: tuple[float, ...],
                                                                                  what: str) -> None:
    """inf had given its worker 237 of 240 samples; a negative one read as "never finishes"."""
    config = JobConfig("c", 4, 240)
    policy = LBBSPPolicy(Const(value))
    policy.observe(_reports_at_uneven_speeds("c", 0, config.initial_sizes()))
    with pytest.raises(ConfigError, match=rf"Const\.predict returned {what}: it must return"):
        policy.decide(2, config.initial_sizes(), config)
    guarded = GuardedPolicy(LBBSPPolicy(Const(value)), config)
    _, assignment = guarded.decide(2, config.initial_sizes(), _reports_at_uneven_speeds("c", 0, config.initial_sizes()))
    assert assignment.sizes == config.initial_sizes() and guarded.failures == 1
    with pytest.raises(ConfigError, match=r"Const\.predict returned"):
        model = AutoCapacityModel(models={"cpu": Const(value)})
        model.partial_fit(_reports_at_uneven_speeds("c", 0, (60,) * 4)).predict([0, 1, 2, 3])


def test_nan_stays_unknown_and_a_worker_that_never_finishes_is_said_so_not_as_infs() -> None:
    config = JobConfig("c", 4, 240)
    policy = LBBSPPolicy(Const((np.nan, 10.0, 10.0, 10.0)), hedge=None)
    policy.observe(_reports_at_uneven_speeds("c", 0, config.initial_sizes()))
    assert sum(policy.decide(2, config.initial_sizes(), config).sizes) == 240
    policy = LBBSPPolicy(Const((0.0, 10.0, 10.0, 10.0)), hedge=None)
    policy.observe(_reports_at_uneven_speeds("c", 0, config.initial_sizes()))
    reason = policy.decide(2, config.initial_sizes(), config).reason
    assert "inf" not in reason and "never for worker(s) [0]" in reason, reason


class OwnTime:
    """A time model of one's own whose ``capacity`` answers ``drop`` fewer workers, or NaN for worker 1."""

    def __init__(self, speed: np.ndarray, drop: int = 0, nan: bool = False) -> None:
        self.linear, self.drop, self.nan = LinearTime(speed), drop, nan

    def time(self, sizes: np.ndarray) -> np.ndarray:
        return self.linear.time(sizes)

    def capacity(self, deadline: float) -> np.ndarray:
        samples = self.linear.capacity(deadline)[:self.linear.speed.size - self.drop]
        if self.nan:
            samples[1] = np.nan
        return samples


class OwnTimeModel(EWMAThroughput):
    """EWMA whose time model is :class:`OwnTime` with the given slip."""

    def __init__(self, alpha: float = 0.3, drop: int = 0, nan: bool = False) -> None:
        super().__init__(alpha=alpha)
        self.drop, self.nan = drop, nan

    def time_model(self, workers: WorkerIds) -> OwnTime:
        return OwnTime(self.predict(workers), self.drop, self.nan)


class ShortCaps(EWMAThroughput):
    """EWMA with a memory cap for every worker but the last (a user's slip)."""

    def max_batch(self, workers: WorkerIds) -> np.ndarray:
        return np.full(len(workers) - 1, 300.0)


def _reports_of_four(job: str, k: int, sizes: np.ndarray) -> list[Report]:
    return [Report(job, w, k, int(s), float(s) / POLICY_SPEEDS[w]) for w, s in enumerate(sizes)]


def test_a_capacity_of_the_wrong_length_is_named() -> None:
    """It failed deep in the search with numpy's 'operands could not be broadcast together with shapes (3,) (4,)'."""
    with pytest.raises(ConfigError, match=r"OwnTime.capacity returned 3 values for 4 workers: it must return one"):
        allocate(OwnTime(POLICY_SPEEDS, drop=1), 800, [0] * 4, [800] * 4)  # type: ignore[arg-type]


def test_a_capacity_of_nan_is_named() -> None:
    """It was read as 'nothing more': worker 1 got its lower bound, (133, 0, 534, 133) for the balanced (100, 200, 400,
    100)."""
    with pytest.raises(ConfigError, match=r"OwnTime.capacity\(.*\) returned NaN for worker\(s\) \[1\]"):
        allocate(OwnTime(POLICY_SPEEDS, nan=True), 800, [0] * 4, [800] * 4)  # type: ignore[arg-type]


@pytest.mark.parametrize(("make", "why"), [
    (lambda: LBBSPPolicy(OwnTimeModel(drop=1), hedge=None), "OwnTime.capacity returned 3 values for 4 workers"),
    (lambda: LBBSPPolicy(OwnTimeModel(nan=True), hedge=None), r"OwnTime.capacity\(.*\) returned NaN"),
    (lambda: LBBSPPolicy(ShortCaps()), "ShortCaps.max_batch returned 3 values for 4 workers"),
    (lambda: LeaderStragglerPolicy(model=ShortCaps()), "ShortCaps.max_batch returned 3 values for 4 workers"),
], ids=["capacity-length", "capacity-nan", "max-batch-length", "search-max-batch-length"])
def test_a_policy_names_the_model_that_answered_badly(make, why: str) -> None:  # type: ignore[no-untyped-def]
    """A policy's decision failed with numpy's broadcast error (or, for NaN, gave a poor split in silence)."""
    policy = make()
    policy.observe(_reports_of_four("p", 0, np.full(4, 200)))
    with pytest.raises(ConfigError, match=why):
        policy.decide(2, (200, 200, 200, 200), JobConfig("p", 4, 800))


def test_a_max_batch_of_one_cap_for_all_still_holds_every_worker() -> None:
    class OneCap(EWMAThroughput):
        def max_batch(self, workers: WorkerIds) -> np.ndarray:
            return np.array(250.0)

    policy = LBBSPPolicy(OneCap(), hedge=None)
    policy.observe(_reports_of_four("p", 0, np.full(4, 200)))
    assert max(policy.decide(2, (200, 200, 200, 200), JobConfig("p", 4, 800)).sizes) == 250


class _HookedDropout(LBBSPPolicy):
    """A variant whose dropout hook hands back a list, or a NaN where a worker's chance is unknown."""

    def __init__(self, nan: bool) -> None:
        super().__init__(FLClientModel(local_steps=5))
        self.nan = nan

    def dropout(self, workers: np.ndarray) -> np.ndarray | None:
        chances = [0.3] * workers.size
        if self.nan:
            chances[0] = float("nan")
        return chances  # type: ignore[return-value]


@pytest.mark.parametrize("nan", [False, True])
def test_a_dropout_hooks_list_or_nan_fails_no_decision(nan: bool) -> None:
    """A list had failed every decision (list.min in the search's early exit); a NaN, once the cost counted early
    finishes, too (int(nan)): 20 of 20. With a NaN the cost is no number, and the finish alone is damped."""
    run = run_policy(FLClients(16, 20, 0, dropout=0.3), "hooked", _HookedDropout(nan), 20)
    assert run.failed_decisions == 0
    assert any(len(set(sizes)) > 1 for sizes in run.sizes)  # it balanced: the decisions took effect


def test_a_policy_holding_a_torch_model_passes_the_check_on_every_rank() -> None:
    torch = pytest.importorskip("torch")
    policy = LBBSPPolicy()
    policy.net = torch.nn.Linear(64, 64)  # type: ignore[attr-defined]
    checked_process_policy(policy, JobConfig("review", 4, 64))


def test_a_policy_holding_an_nvml_like_handle_is_a_config_error_naming_it() -> None:
    policy = LBBSPPolicy()
    policy.handle = ctypes.pointer(ctypes.c_int(0))  # type: ignore[attr-defined]  # what pynvml hands back
    with pytest.raises(ConfigError, match="policy LBBSPPolicy cannot be pickled"):
        checked_process_policy(policy, JobConfig("review", 4, 64))


class _Caps(LBBSPPolicy):
    """LB-BSP whose model answers ``max_batch`` with ``answer`` as given (a list, a 0-d array, ...)."""

    def __init__(self, answer: object) -> None:
        super().__init__()
        self.model.max_batch = lambda workers: answer  # type: ignore[method-assign,return-value,assignment]


@pytest.mark.parametrize(("answer", "caps"), [
    ([5, 7, 9], [5, 7, 9]), ((5, 7, 9), [5, 7, 9]), ([np.int64(5), np.int32(7), np.uint8(9)], [5, 7, 9]),
    ([5, None, 9], [5, 20, 9]), (np.array(6), [6, 6, 6]), (np.int64(6), [6, 6, 6]),
    (np.array([5.5, 7.9, np.nan], dtype=np.float32), [5, 7, 30]), (None, [10, 20, 30]),
])
def test_a_legitimate_max_batch_answer_still_caps(answer: object, caps: list[int]) -> None:
    config = JobConfig("review", 3, 15, max_batch=(10, 20, 30), min_batch=0)
    _, upper = _Caps(answer).bounds(np.arange(3), np.array([5, 5, 5]), config)
    assert upper.tolist() == caps


class FourArgumentPropose(LBBSPPolicy):
    """A variant whose ``propose`` leaves out ``forecast``, which the policy passes it."""

    def propose(self, time_model, config, lower, upper):  # type: ignore[no-untyped-def, override]
        return super().propose(time_model, config, lower, upper)


class NoCurrentBounds(LBBSPPolicy):
    def bounds(self, workers, config):  # type: ignore[no-untyped-def, override]
        return super().bounds(workers, np.zeros(0), config)


class NoWorkersDropout(LBBSPPolicy):
    def dropout(self):  # type: ignore[no-untyped-def, override]
        return None


@pytest.mark.parametrize(("kind", "hook"), [(FourArgumentPropose, "propose"), (NoCurrentBounds, "bounds"),
                                             (NoWorkersDropout, "dropout")])
def test_a_hook_that_cannot_take_the_policys_arguments_is_refused_where_the_policy_is_built(
        kind: type[LBBSPPolicy], hook: str) -> None:
    # it had been built, and then failed every decision with a TypeError: 30 of 30 in a simulated run
    with pytest.raises(ConfigError, match=rf"{kind.__name__}\.{hook} must take {hook}\(.*LBBSPPolicy calls it with"):
        kind(EWMAThroughput())


class Capped(LBBSPPolicy):
    """Hooks written as the page shows them, and one taking ``*args``: accepted, and they balance."""

    def bounds(self, workers, current, config):  # type: ignore[no-untyped-def]
        lower, upper = super().bounds(workers, current, config)
        return lower, np.minimum(upper, 200)

    def propose(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().propose(*args, **kwargs)


def test_hooks_with_the_documented_arguments_run_without_a_failed_decision() -> None:
    scenario = GPUMix(4, 12, seed=0)
    run = compare(scenario, 12, {"capped": Capped(scenario.capacity_model())})["capped"]
    assert run.failed_decisions == 0 and max(max(sizes) for sizes in run.sizes) <= 200


def test_a_models_class_given_for_its_instance_says_to_call_it() -> None:
    """LBBSPPolicy(EWMAThroughput) was told only that a model must be an instance, with the class's repr."""
    with pytest.raises(ConfigError, match=r"got the class EWMAThroughput: pass EWMAThroughput\(\)$"):
        LBBSPPolicy(EWMAThroughput)  # type: ignore[arg-type]
