"""What a new user of the models and policies hit from Python: the simulator's oracle and backup workers taken by a
real coordinator, a model of one's own that cannot be cloned, a federated client's bandwidth read as no transfer, a
given model's horizon not checked against the job's lag, an infinite or negative forecast balanced on, and a split of
the wrong length decided on."""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from lbbsp import Coordinator, CoordinatorProcess, JobConfig, Report, Store
from lbbsp.allocation import LinearTime
from lbbsp.coordinator import GuardedPolicy, checked_process_policy
from lbbsp.errors import ConfigError
from lbbsp.models import AutoCapacityModel, BatchTimeCurve, FLClientModel, NARXThroughput
from lbbsp.models.base import CapacityModel, WorkerIds, as_reports
from lbbsp.policies import (
    BackupWorkersPolicy,
    BSPPolicy,
    LBBSPPolicy,
    OraclePolicy,
    PerEpochPolicy,
    Policy,
    StaticProportionalPolicy,
)
from lbbsp.protocol import Assignment
from lbbsp.sim.engine import LevelOracle

SPEEDS = np.array([100.0, 50.0, 50.0, 40.0])  # samples/s; the balanced split of 240 is 100, 50, 50, 40


@pytest.fixture
def store(redis_url: str, job: str) -> Iterator[Store]:
    with Store.from_url(redis_url, job) as opened:
        yield opened
        opened.forget()


def _reports(job: str, k: int, sizes: Sequence[int]) -> list[Report]:
    return [Report(job, w, k, int(s), float(s) / SPEEDS[w]) for w, s in enumerate(sizes)]


def _run(coordinator: Coordinator, store: Store, config: JobConfig, iterations: int,
         oracle: OraclePolicy | None = None) -> list[tuple[int, ...]]:
    """Workers of SPEEDS reporting to ``coordinator``, which decides each iteration (``oracle`` shown the truth
    first, as the simulator shows it); the sizes each iteration ran with, read back from Redis."""
    for k in range(config.lag):
        store.publish(config.initial_assignment(k))
    ran = []
    for k in range(iterations):
        raw = store.get_assignment(k)
        assert raw is not None
        sizes = Assignment.from_json(raw, job=config.job).sizes
        ran.append(sizes)
        store.post_reports(_reports(config.job, k, sizes), config.num_workers)
        if oracle is not None:
            oracle.reveal(LinearTime(SPEEDS))
        coordinator.decide(k)
    return ran


# 1. the simulator's policies --------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [OraclePolicy, LevelOracle], ids=["oracle", "level-oracle"])
def test_a_coordinator_refuses_the_oracle_where_it_is_made(redis_url: str, store: Store, job: str, make) -> None:  # type: ignore[no-untyped-def]
    """It had been taken, and every decision then failed ("the oracle needs reveal(truth)"), the job left on the
    equal split: 12 failed decisions of 12."""
    config = JobConfig(job, 4, 240)
    for build in (lambda: Coordinator(store, config, make()), lambda: checked_process_policy(make(), config),
                  lambda: CoordinatorProcess(redis_url, config, make())):
        with pytest.raises(ConfigError, match=r"the simulator's limit.*lbbsp\.sim"):
            build()
    assert store.decision_count() == 0


def test_the_simulator_runs_the_oracle_through_a_real_coordinator(store: Store, job: str) -> None:
    """``simulated=True`` is the simulator's way through (lbbsp.sim shows the oracle the truth before each decision)."""
    config = JobConfig(job, 4, 240)
    oracle = OraclePolicy()
    coordinator = Coordinator(store, config, oracle, max_ahead=1, simulated=True)
    ran = _run(coordinator, store, config, 4, oracle)
    assert coordinator.failed_decisions == 0
    assert ran[-1] == (100, 50, 50, 40), ran


def test_backup_workers_are_warned_about_once_where_the_coordinator_is_made(
        store: Store, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """They had run as plain BSP, unsaid: a job aggregates every gradient. Refusing them would refuse the simulator's
    own runs of them through Redis and the tests that run them on a real coordinator, so a coordinator warns, once."""
    config = JobConfig(job, 4, 240)
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        checked_process_policy(BackupWorkersPolicy(), config)  # the child's coordinator warns, not every rank
        assert not caplog.records
        coordinator = Coordinator(store, config, BackupWorkersPolicy(), max_ahead=1)
        ran = _run(coordinator, store, config, 6)
    warnings = [record.getMessage() for record in caplog.records if "backup" in record.getMessage()]
    assert len(warnings) == 1, warnings
    assert "exact" in warnings[0] and "lbbsp.sim" in warnings[0] and "plain BSP" in warnings[0], warnings[0]
    assert set(ran) == {config.initial_sizes()} and coordinator.failed_decisions == 0


def test_the_simulator_runs_backup_workers_without_the_warning(
        store: Store, job: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        Coordinator(store, JobConfig(job, 4, 240), BackupWorkersPolicy(), simulated=True)
    assert not caplog.records


# 2. a model of one's own that cannot be cloned --------------------------------------------------------------------

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
        return SPEEDS[np.asarray(workers)] * self.s


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
        _, assignment = guarded.decide(k + config.lag, sizes, _reports("kw", k, sizes))
        sizes = assignment.sizes
    assert guarded.failures == 0 and sizes == (100, 50, 50, 40), sizes


# 3. a federated client's bandwidth without model_bytes ------------------------------------------------------------

def _bandwidth_only(k: int, worker: int = 0) -> Report:
    return Report("fl", worker, k, 32, 0.32, features={"bandwidth_down": 1e7, "bandwidth_up": 1e7})


def _model_bytes_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if "model_bytes" in record.getMessage()]


@pytest.mark.parametrize("make", [FLClientModel, AutoCapacityModel], ids=["fl-client", "auto"])
def test_bandwidth_without_model_bytes_is_warned_about_once(caplog: pytest.LogCaptureFixture, make) -> None:  # type: ignore[no-untyped-def]
    """It had been read as no transfer at all: 0.32 s a round where 100 MB each way over 10 MB/s takes 20.32 s."""
    model = make()
    with caplog.at_level(logging.WARNING, logger="lbbsp.models"):
        for k in range(3):
            model.partial_fit([_bandwidth_only(k, 0), _bandwidth_only(k, 1)])
    warnings = _model_bytes_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "FLClientModel(model_bytes=" in warnings[0] and "download_s" in warnings[0], warnings[0]
    assert "[0, 1]" in warnings[0], warnings[0]


def test_bandwidth_with_model_bytes_or_measured_transfers_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lbbsp.models"):
        given = FLClientModel(model_bytes=1e8).partial_fit([_bandwidth_only(0)])
        FLClientModel().partial_fit([Report("fl", 0, 0, 32, 0.32, features={"download_s": 1.0, "upload_s": 2.0,
                                                                             "bandwidth_down": 1e7})])
    assert not _model_bytes_warnings(caplog)
    assert given.time_model([0]).time(np.array([32])).tolist() == pytest.approx([20.32])


# 4. the horizons of the models given ------------------------------------------------------------------------------

def _horizon_warnings(store: Store, config: JobConfig, model: CapacityModel,
                      caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        Coordinator(store, config, LBBSPPolicy(model))
    return [record.getMessage() for record in caplog.records if "horizon" in record.getMessage()]


def test_a_coordinator_warns_of_a_given_models_horizon_not_the_jobs_lag(
        store: Store, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """Only the automatic model's own horizon had been looked at, which builds no model where "cpu" is given."""
    config = JobConfig(job, 4, 240, lag=3)
    warned = _horizon_warnings(store, config, AutoCapacityModel(models={"cpu": NARXThroughput(horizon=2)}, horizon=3),
                               caplog)
    assert len(warned) == 1 and "models['cpu'] (NARXThroughput)" in warned[0], warned
    assert "forecasts 2 iteration(s) ahead (horizon=2), but each split is decided 3 ahead (lag=3): give it horizon=3" \
           in warned[0], warned
    assert not _horizon_warnings(store, config, AutoCapacityModel(models={"cpu": NARXThroughput(horizon=3)}), caplog)
    assert not _horizon_warnings(store, config, AutoCapacityModel(models={"gpu": BatchTimeCurve()}, horizon=3), caplog)
    assert len(_horizon_warnings(store, config, AutoCapacityModel(models={"gpu": BatchTimeCurve()}), caplog)) == 1


# 5. forecasts that are not throughputs ----------------------------------------------------------------------------

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
    policy.observe(_reports("c", 0, config.initial_sizes()))
    with pytest.raises(ConfigError, match=rf"Const\.predict returned {what}: it must return"):
        policy.decide(2, config.initial_sizes(), config)
    guarded = GuardedPolicy(LBBSPPolicy(Const(value)), config)
    _, assignment = guarded.decide(2, config.initial_sizes(), _reports("c", 0, config.initial_sizes()))
    assert assignment.sizes == config.initial_sizes() and guarded.failures == 1
    with pytest.raises(ConfigError, match=r"Const\.predict returned"):
        AutoCapacityModel(models={"cpu": Const(value)}).partial_fit(_reports("c", 0, (60,) * 4)).predict([0, 1, 2, 3])


def test_nan_stays_unknown_and_a_worker_that_never_finishes_is_said_so_not_as_infs() -> None:
    config = JobConfig("c", 4, 240)
    policy = LBBSPPolicy(Const((np.nan, 10.0, 10.0, 10.0)), hedge=None)
    policy.observe(_reports("c", 0, config.initial_sizes()))
    assert sum(policy.decide(2, config.initial_sizes(), config).sizes) == 240
    policy = LBBSPPolicy(Const((0.0, 10.0, 10.0, 10.0)), hedge=None)
    policy.observe(_reports("c", 0, config.initial_sizes()))
    reason = policy.decide(2, config.initial_sizes(), config).reason
    assert "inf" not in reason and "never for worker(s) [0]" in reason, reason


# 6. a split of the wrong length -----------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [LBBSPPolicy, StaticProportionalPolicy, PerEpochPolicy, OraclePolicy, BSPPolicy,
                                  BackupWorkersPolicy, Policy], ids=lambda make: make.__name__)
@pytest.mark.parametrize("observed", [False, True], ids=["before-reports", "after-reports"])
def test_every_policy_refuses_a_current_split_of_the_wrong_length(make, observed: bool) -> None:  # type: ignore[no-untyped-def]
    """LBBSPPolicy had decided on 3 sizes for 4 workers ("the current split does not fit the bounds")."""
    config = JobConfig("c", 4, 240)
    policy = make()
    if observed:
        for k in range(3):
            policy.observe(_reports("c", k, config.initial_sizes()))
    if isinstance(policy, OraclePolicy):
        policy.reveal(LinearTime(SPEEDS))
    with pytest.raises(ConfigError, match=r"current must hold one size per worker \(4\), got shape \(3,\)"):
        policy.decide(3, (60, 60, 60), config)
    assert sum(policy.decide(3, (60, 60, 60, 60), config).sizes) == 240
