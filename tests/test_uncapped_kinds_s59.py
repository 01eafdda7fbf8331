"""The coordinator's warning that GPU workers go uncapped, for AutoCapacityModel: a GPU worker routed to a kind whose
model sets no memory caps (``models={"gpu": EWMAThroughput()}``, or the worker pinned to 'cpu') had been left uncapped
unsaid, as the auto model itself has a max_batch."""
from __future__ import annotations

import logging

import pytest

from lbbsp import LBBSPPolicy, Report
from lbbsp.coordinator import _warn_uncapped
from lbbsp.models import AutoCapacityModel, BatchTimeCurve, EWMAThroughput
from test_coordinator_models_review_s58 import _warnings


def test_a_gpu_kind_given_a_model_without_caps_is_named(redis_url: str, job: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    (said,) = _warnings(redis_url, job, LBBSPPolicy(AutoCapacityModel(models={"gpu": EWMAThroughput()})), caplog)
    assert "worker(s) [0, 1]" in said and "to kind 'gpu', whose model, EWMAThroughput, sets no memory caps" in said
    assert "BatchTimeCurve()" in said
    assert "(lbbsp coordinator: --kind-model gpu=gpu-curve)" in said  # the fix for a user of the command, too


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


def test_workers_pinned_to_gpu_are_told_to_give_the_gpu_kind_a_curve(redis_url: str, job: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # pinned to 'gpu' already, they had been told to pin themselves to 'gpu'
    model = AutoCapacityModel(models={"gpu": EWMAThroughput()}, kinds={0: "gpu", 1: "gpu"})
    (said,) = _warnings(redis_url, job, LBBSPPolicy(model), caplog)
    assert "BatchTimeCurve()" in said and "pin them" not in said and "(pinned there)" not in said


def test_a_cpu_only_job_is_not_scanned_at_every_decision() -> None:
    """With the default models no worker can go uncapped: settled at the first decision, whatever the reports."""
    assert _warn_uncapped("j", LBBSPPolicy(), [])
    assert _warn_uncapped("j", LBBSPPolicy(AutoCapacityModel(kinds={3: "fl"})), [])
    assert not _warn_uncapped("j", LBBSPPolicy(AutoCapacityModel(kinds={3: "cpu"})), [])  # a GPU may come, pinned


def test_federated_clients_reading_gpu_memory_are_not_told_to_take_a_gpu_curve(
        caplog: pytest.LogCaptureFixture) -> None:
    """Their model plans transfers: a BatchTimeCurve in its place would drop them."""
    report = Report("j", 0, 0, 10, 1.0, device="cuda:0",
                    features={"download_s": 1.0, "upload_s": 1.0, "gpu_mem_used": 1e9, "gpu_mem_free": 1e9})
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        _warn_uncapped("j", LBBSPPolicy(AutoCapacityModel(models={"gpu": EWMAThroughput()})), [report])
    assert "report GPU memory" not in caplog.text
