"""The coordinator's warning that GPU workers go uncapped, for AutoCapacityModel: a GPU worker routed to a kind whose
model sets no memory caps (``models={"gpu": EWMAThroughput()}``, or the worker pinned to 'cpu') had been left uncapped
unsaid, as the auto model itself has a max_batch."""
from __future__ import annotations

import pytest

from lbbsp import LBBSPPolicy
from lbbsp.models import AutoCapacityModel, BatchTimeCurve, EWMAThroughput
from test_coordinator_models_review_s58 import _warnings


def test_a_gpu_kind_given_a_model_without_caps_is_named(redis_url: str, job: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (said,) = _warnings(redis_url, job, LBBSPPolicy(AutoCapacityModel(models={"gpu": EWMAThroughput()})), caplog)
    assert "worker(s) [0, 1]" in said and "to kind 'gpu', whose model, EWMAThroughput, sets no memory caps" in said
    assert "BatchTimeCurve()" in said


def test_a_gpu_worker_pinned_to_cpu_is_named_alone(redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    (said,) = _warnings(redis_url, job, LBBSPPolicy(AutoCapacityModel(kinds={1: "cpu"})), caplog)
    assert "worker(s) [1]" in said and "to kind 'cpu' (pinned there), whose default model sets no memory caps" in said
    assert "pin them to 'gpu'" in said


@pytest.mark.parametrize("model", [AutoCapacityModel(), AutoCapacityModel(models={"gpu": BatchTimeCurve(window=4)}),
                                   AutoCapacityModel(models={"cpu": EWMAThroughput()}, kinds={0: "gpu"})])
def test_gpu_workers_routed_to_a_model_with_caps_say_nothing(redis_url: str, job: str,
                                                             caplog: pytest.LogCaptureFixture,
                                                             model: AutoCapacityModel) -> None:
    assert _warnings(redis_url, job, LBBSPPolicy(model), caplog) == []
