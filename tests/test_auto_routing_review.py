"""Fresh-eyes reviews of the automatic model's choice per worker kind (pins, open kinds, devices, what status
shows) and of the GPU and federated-client models' inputs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from lbbsp import Coordinator, JobConfig, LBBSPPolicy, Report, Store
from lbbsp.errors import ConfigError, ProtocolError
from lbbsp.models import KINDS, AutoCapacityModel, BatchTimeCurve, EWMAThroughput, FLClientModel, worker_kind
from lbbsp.models.auto import model_moved
from lbbsp.models.base import device_family


def _cpu(worker: int, iteration: int, samples: int, speed: float, cores: int = 16) -> Report:
    return Report("job", worker, iteration, samples, samples / speed if samples else 0.0,
                  features={"cores": cores, "cpu_util": 0.5}, device="cpu")


def _gpu(worker: int, iteration: int, samples: int, speed: float) -> Report:
    used = 2e9 + samples * 2e7
    return Report("job", worker, iteration, samples, 0.02 + samples / speed,
                  features={"cores": 8, "gpu_mem_used": used, "gpu_mem_free": 16e9 - used}, device="cuda:A100")


def test_a_worker_of_open_kind_is_answered_alike_whichever_workers_are_asked_with_it() -> None:
    """Worker 9 had been predicted as a CPU (100/s) alone and as a GPU (1,875/s) beside GPU worker 3: its kind came
    from the workers asked with it, where the docs say all workers."""
    model = AutoCapacityModel()
    for k in range(5):
        model.partial_fit([_cpu(0, k, 10, 100), _cpu(1, k, 10, 100), _cpu(2, k, 10, 100), _gpu(3, k, 100, 3000)])
    alone = model.predict([9])
    assert model.predict([9, 3])[0] == alone[0] == model.predict([0, 1, 2, 3, 9])[4]
    assert model.routed_kinds([9]) == model.routed_kinds([9, 3])[:1] == ["cpu"]  # three CPUs, one GPU
    assert type(model.time_model([9])) is type(model.time_model([9, 0]))


def test_status_shows_the_kind_a_worker_of_open_kind_is_routed_as(redis_url: str, job: str) -> None:
    """A worker that only announced its hardware is routed with its peers, but its status row had shown no kind."""
    store, config = Store.from_url(redis_url, job), JobConfig(job, 3, 300, lag=1)
    coordinator = Coordinator(store, config, LBBSPPolicy(AutoCapacityModel(horizon=1)))
    for k in range(3):
        for worker in range(3):
            measured = worker != 2  # worker 2 only announces its hardware
            store.post_report(Report(job, worker, k, 100 * measured, 1.0 * measured, features={"cores": 16},
                                     device="cpu"), 3)
        coordinator.decide(k)
    coordinator.stop()
    rows = {int(w): json.loads(s) for w, s in store.worker_statuses().items()}
    assert coordinator.policy.model.kind_ == {0: "cpu", 1: "cpu"}  # worker 2's kind is still open
    assert [rows[w]["kind"] for w in range(3)] == ["cpu"] * 3


def test_a_pin_map_with_numpy_ids_outside_the_job_is_refused(redis_url: str, job: str) -> None:
    """{9: "gpu"} was refused for a job of 4 workers, {np.int64(9): "gpu"} (a map built from np.flatnonzero) kept."""
    config = JobConfig(job, 4, 256)
    for pin in (9, np.int64(9), np.uint8(9)):
        with pytest.raises(ConfigError, match=r"pin worker\(s\) \[9\], outside the job's workers 0..3"):
            Coordinator(Store.from_url(redis_url, job), config, LBBSPPolicy(AutoCapacityModel(kinds={pin: "gpu"})))


def test_margins_follow_a_pinned_kind_not_the_kind_the_reports_show() -> None:
    """A worker pinned "gpu" whose reports look like a CPU's had been planned with the CPUs' margins."""
    config = JobConfig("job", 3, 300, lag=1)
    policy = LBBSPPolicy(AutoCapacityModel(kinds={2: "gpu"}, models={"gpu": EWMAThroughput()}, horizon=1))
    current = list(config.initial_sizes())
    for k in range(3):
        policy.observe([_cpu(w, k, current[w], 100) for w in range(3)])
        current = list(policy.decide(k + 1, current, config).sizes)
        policy.learn()
    risk = policy.risk
    assert risk is not None and policy.model.kind_ == {0: "cpu", 1: "cpu", 2: "gpu"}
    assert [KINDS[risk.group_kind_[risk.peer_group_[w]]] for w in range(3)] == ["cpu", "cpu", "gpu"]
    assert risk.peer_group_[2] != risk.peer_group_[0] == risk.peer_group_[1]


@pytest.mark.parametrize(("device", "family"), [
    ("cuda:3", "cuda"), ("CUDA:A100", "cuda"), ("/device:GPU:0", "gpu"),
    ("/job:worker/replica:0/task:0/device:GPU:1", "gpu"), ("CPU", "cpu"), ("cpu:0", "cpu"), (" ", "cpu"),
    ("gpu:NVIDIA H100", "gpu"), ("mps", "mps"),
])
def test_devices_are_read_as_one_family_by_every_kind_test(device: str, family: str) -> None:
    """TensorFlow's "/device:GPU:0" had been read as a CPU worker's (NARX, no memory cap), and a GPU worker falling
    back to "CPU" or "cpu:0" had not been seen to move off the GPU curve, where "cpu" was."""
    assert device_family(device) == family
    report = Report("job", 0, 0, 10, 0.1, features={"cores": 4}, device=device)
    assert worker_kind(report) == ("cpu" if family == "cpu" else "gpu")
    assert model_moved("gpu", report) == (family == "cpu")


def test_auto_models_and_kinds_with_unknown_kinds_are_named_where_given() -> None:
    with pytest.raises(ConfigError, match=r"unknown worker kind: models' key 'GPU', kinds\[3\] = 'CPU'; a worker kind "
                                          r"is one of 'cpu', 'gpu', 'fl' \(lower case\)"):
        AutoCapacityModel(models={"GPU": EWMAThroughput()}, kinds={3: "CPU"}).partial_fit(_cpu(0, 0, 10, 100))


def test_auto_explore_with_arrays_of_another_length_names_the_argument() -> None:
    model = AutoCapacityModel().partial_fit([_gpu(0, 0, 100, 3000), _gpu(1, 0, 100, 3000)])
    with pytest.raises(ConfigError, match=r"explore's sizes must hold one value per worker \(2\), got shape \(1,\)"):
        model.explore([0, 1], np.array([5]), np.array([1, 1]), np.array([100, 100]))
    assert model.explore([0, 1], np.array([100, 100]), np.array([1, 1]), np.array([190, 190])).sum() == 200


@pytest.mark.parametrize("outcome", [None, 1 + 0j, "1", float("nan"), 2])
def test_an_fl_outcome_that_is_not_a_yes_or_no_is_refused_and_changes_nothing(outcome: object) -> None:
    """{0: None} had been taken, and wiped what client 0 had learnt (its availability back to the prior); 1+0j was
    numpy's bare TypeError."""
    model = FLClientModel().record_outcomes({0: True, 1: False})
    before = model.availability([0, 1])
    with pytest.raises(ConfigError, match=r"record_outcomes takes True or False \(or 1 or 0\) per client"):
        model.record_outcomes({0: outcome})
    np.testing.assert_array_equal(model.availability([0, 1]), before)


def test_a_card_of_no_memory_is_refused_where_it_would_cap_the_worker_at_nothing() -> None:
    with pytest.raises(ProtocolError, match="gpu_mem_used and gpu_mem_free are both 0"):
        Report("job", 0, 0, 100, 0.1, features={"gpu_mem_used": 0.0, "gpu_mem_free": 0.0}, device="cuda:0")
    Report("job", 0, 0, 100, 0.1, features={"gpu_mem_used": 0.0, "gpu_mem_free": 8e9}, device="cuda:0")


def test_a_split_that_explore_moved_says_so_in_its_reason() -> None:
    """Four equal GPUs, curves unknown: the split came back (95, 105, 95, 105) with the reason 'kept: predicted gain
    under the dead band'."""
    policy, config = LBBSPPolicy(BatchTimeCurve()), JobConfig("job", 4, 400)
    policy.observe([Report("job", w, 0, 100, 0.265, device="cuda:0") for w in range(4)])
    decision = policy.decide(2, (100, 100, 100, 100), config)
    assert decision.sizes != (100, 100, 100, 100) and sum(decision.sizes) == 400
    moved = sum(abs(s - 100) for s in decision.sizes) // 2
    assert f"then {moved} sample(s) moved to learn the workers' batch-time curves (explore)" in decision.reason


def test_a_bandwidth_measured_at_zero_tells_no_transfer_time() -> None:
    """bandwidth_down 0 beside bandwidth_up 1e6, model 4 MB: 4 s a round (the download free), where 1e-6 gave two
    days and 1e6 gave 8 s."""
    def transfer(down: float) -> float:
        model = FLClientModel(model_bytes=4e6)
        model.partial_fit([Report("job", 0, 0, 10, 1.0, features={"bandwidth_down": 1e6, "bandwidth_up": 1e6}),
                           Report("job", 1, 0, 10, 1.0, features={"bandwidth_down": down, "bandwidth_up": 1e6})])
        return float(model.transfer_s([1])[0])
    assert transfer(1e6) == 8.0 and transfer(0.0) == 8.0  # unknown: the other clients' time


def test_one_glitched_fast_measurement_does_not_hand_an_fl_client_the_batch() -> None:
    """Four equal clients; client 0's compute timer read a microsecond once: it was given 397 of 400 samples for the
    11 rounds after, rounds of 5.97 s where 3 s was right. The jump is held back until a second measurement confirms
    it, and one that does is learnt."""
    policy, config, sizes = LBBSPPolicy(FLClientModel()), JobConfig("job", 4, 400), (100, 100, 100, 100)
    for k in range(8):
        glitch = k == 3
        policy.observe([Report("job", w, k, sizes[w], 1e-6 if glitch and w == 0 else sizes[w] / 100.0,
                               features={"download_s": 1.0, "upload_s": 1.0}) for w in range(4)])
        sizes = policy.decide(k + 1, sizes, config).sizes
        policy.learn()
        assert sizes == (100, 100, 100, 100), (k, sizes)
    model = FLClientModel()
    for k in range(4):  # a settled client that did become 10x faster is learnt at its second fast measurement
        model.partial_fit([Report("job", 0, k, 100, 1.0 if k < 2 else 0.1)])
    assert model.predict([0])[0] == pytest.approx(550.0)  # 100, then 1,000 held, then confirmed: 0.5 x 1,000 + 0.5 x 100
    with pytest.raises(ConfigError, match="spike must be None or a factor above 1"):
        FLClientModel(spike=1.0).partial_fit(Report("job", 0, 0, 100, 1.0))
