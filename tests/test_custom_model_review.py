"""A capacity model of one's own, as docs/models.md describes it, run in the simulator as docs/simulator.md shows:
a model that breaks the contract is refused where the policy is built, naming the class, the method and the
signature; one that fails at run time is said in the progress line and logged under the run's name."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import pytest

from lbbsp.errors import ConfigError
from lbbsp.models import AutoCapacityModel
from lbbsp.models.base import CapacityModel, WorkerIds, as_reports, measured_throughput
from lbbsp.policies import LBBSPPolicy, LeaderStragglerPolicy, OraclePolicy, PerEpochPolicy
from lbbsp.protocol import Report
from lbbsp.sim import GPUMix, compare


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


class Broken(Mean):
    """Within the contract, but ``predict`` fails at run time."""

    def predict(self, workers: WorkerIds) -> np.ndarray:
        raise RuntimeError("predict is broken")


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


def test_a_run_whose_decisions_fail_says_so_in_its_progress_line_and_log(caplog: pytest.LogCaptureFixture) -> None:
    """Its result line had read like any other (it was BSP's), and the log named the policy's class, not the run."""
    lines: list[str] = []
    with caplog.at_level(logging.ERROR, logger="lbbsp.coordinator"):
        run = compare(GPUMix(4, 10, seed=0), 10, {"mine": LBBSPPolicy(Broken())}, progress=lines.append)["mine"]
    assert run.failed_decisions == 10
    assert "10 of 10 decisions failed" in lines[-1], lines
    failed = [record.getMessage() for record in caplog.records if "failed to decide" in record.getMessage()]
    assert failed and all(message.startswith("job sim-gpu: policy mine ") for message in failed), failed


def test_a_run_whose_decisions_all_succeed_says_nothing_of_failures() -> None:
    lines: list[str] = []
    compare(GPUMix(4, 5, seed=0), 5, {"mine": LBBSPPolicy(Mean())}, progress=lines.append)
    assert "failed" not in lines[-1], lines
