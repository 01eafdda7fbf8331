"""Fixes from an audit of the coordinator's edges: reports beyond their assignment, a policy's predictions,
restarting a coordinator whose thread is stuck, trace files, NVML and the protocol version."""
from __future__ import annotations

import json
import logging
import re
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lbbsp import Coordinator, JobConfig, LBBSPError, ProtocolError, Report, ResourceMonitor, Store
from lbbsp.cli import main
from lbbsp.coordinator import GuardedPolicy
from lbbsp.errors import ConfigError
from lbbsp.models import AutoCapacityModel, EWMAThroughput, FLClientModel
from lbbsp.policies import Decision, LBBSPPolicy, Policy
from lbbsp.sim.traces import CPUTrace

SPEEDS = (100.0, 200.0, 300.0, 400.0)


@pytest.fixture
def store(redis_url: str, job: str) -> Iterator[Store]:
    with Store.from_url(redis_url, job) as store:
        yield store
        store.forget()


def post_measured(store: Store, coordinator: Coordinator, iteration: int) -> tuple[int, ...]:
    """Every worker reports the split in force at ``iteration``, computed at its speed in SPEEDS."""
    sizes = coordinator._in_force(iteration).sizes
    for worker, size in enumerate(sizes):
        store.post_report(Report(store.job, worker, iteration, size, size / SPEEDS[worker]), len(sizes))
    return sizes


def test_a_report_of_more_samples_than_assigned_is_rejected_and_does_not_skew_the_split(
        store: Store, job: str) -> None:
    """One report claiming 10M samples (B = 400) was accepted: EWMA then gave its worker 397 of 400 samples for
    ten iterations (true iteration time 10x the balanced one)."""
    coordinator = Coordinator(store, JobConfig(job, 4, 400, lag=1), LBBSPPolicy(EWMAThroughput()))
    for k in range(6):
        post_measured(store, coordinator, k)
        coordinator.decide(k)
    balanced = coordinator._in_force(6).sizes
    store.post_report(Report(job, 0, 6, 10_000_000, balanced[0] / SPEEDS[0]), 4)
    post_measured(store, coordinator, 6)  # the other workers' reports (worker 0's is in: write-once)
    outcome = coordinator.decide(6)
    assert [r.worker for r in outcome.rejected] == ["0"]
    assert "samples:" in outcome.rejected[0].error and f"{balanced[0]} assigned" in outcome.rejected[0].error
    assert json.loads(store.decisions(1)[0])["rejected"][0]["worker"] == "0"
    for k in range(7, 10):  # the coordinator keeps serving, and the split stays balanced
        post_measured(store, coordinator, k)
        sizes = coordinator.decide(k).assignment.sizes
        assert max(s / v for s, v in zip(sizes, SPEEDS)) < 0.5, sizes  # balanced: 0.4 s


def test_without_a_known_assignment_samples_are_bounded_by_the_global_batch(store: Store, job: str) -> None:
    coordinator = Coordinator(store, JobConfig(job, 4, 400, lag=1))
    store.post_report(Report(job, 0, 50, 401, 0.1), 4)  # no assignment of iteration 50 is stored
    store.post_report(Report(job, 1, 50, 300, 0.1), 4)  # more than an equal share, within the global batch
    for worker in (2, 3):
        store.post_report(Report(job, worker, 50, 100, 0.1), 4)
    outcome = coordinator.decide(50)
    assert [r.worker for r in outcome.rejected] == ["0"]
    assert "global batch 400" in outcome.rejected[0].error


def test_a_federated_clients_samples_count_its_local_steps(store: Store, job: str) -> None:
    """A federated client reports local_steps x its batch (the simulator's fl-clients through Redis does): the
    assigned size bounds one step, not the round: the client model's local_steps steps of it."""
    model = AutoCapacityModel(models={"fl": FLClientModel(local_steps=5)}, horizon=1)
    coordinator = Coordinator(store, JobConfig(job, 2, 40, lag=1), LBBSPPolicy(model))
    for worker in (0, 1):
        store.post_report(Report(job, worker, 0, 5 * 20, 1.0, features={"download_s": 1.0, "upload_s": 2.0}), 2)
    assert coordinator.decide(0).rejected == []


class Predicting(Policy):
    """Keeps the split and predicts ``predicted`` as each worker's throughput."""

    name = "predicting"

    def __init__(self, predicted: object) -> None:
        self.predicted = predicted

    def decide(self, iteration, current, config):  # type: ignore[no-untyped-def]
        return Decision(tuple(current), "keep", predicted_throughput=self.predicted)


@pytest.mark.parametrize("predicted", [(1.0,), ("a",) * 4, (1.0, 2.0, None, 4.0), 3.0],
                         ids=["too few", "strings", "none", "not a sequence"])
def test_bad_predictions_are_dropped_and_the_decision_still_counts(store: Store, job: str, predicted: object,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Predictions that did not fit the workers raised after the split was out: the decision was never
    recorded or counted, and run(max_decisions=2) never returned."""
    coordinator = Coordinator(store, JobConfig(job, 4, 40, lag=1), Predicting(predicted))
    for k in (0, 1):
        for worker in range(4):
            store.post_report(Report(job, worker, k, 10, 0.1), 4)
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        serving = threading.Thread(target=coordinator.run, kwargs={"max_decisions": 2, "poll_s": 0.1}, daemon=True)
        serving.start()
        serving.join(10)
    coordinator.stop()
    assert not serving.is_alive() and coordinator.decisions_made == 2
    assert store.decision_count() == 2
    assert "predicted throughput" in caplog.text
    statuses = {int(w): json.loads(s) for w, s in store.worker_statuses().items()}
    assert [statuses[w]["predicted_throughput"] for w in range(4)] == [None] * 4


def test_predictions_as_an_array_are_recorded_as_numbers(store: Store, job: str) -> None:
    predicted = np.array([1.0, 2.0, np.nan, 4.0])  # NaN: a worker the model knows nothing about yet
    coordinator = Coordinator(store, JobConfig(job, 4, 40, lag=1), Predicting(predicted))
    for worker in range(4):
        store.post_report(Report(job, worker, 0, 10, 0.1), 4)
    coordinator.decide(0)
    assert coordinator.decisions_made == 1
    statuses = {int(w): json.loads(s) for w, s in store.worker_statuses().items()}
    assert [statuses[w]["predicted_throughput"] for w in range(4)] == [1.0, 2.0, None, 4.0]


def test_worker_statuses_are_written_once_a_second_and_the_last_ones_when_the_coordinator_stops(
        store: Store, job: str, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every decision had rebuilt and rewritten every worker's status line: 5-8 ms of the coordinator's time per
    decision at 1,024 workers, a fifth to a quarter of it. The decision log still gets every decision."""
    coordinator = Coordinator(store, JobConfig(job, 4, 400, lag=1), LBBSPPolicy(EWMAThroughput()))
    coordinator.STATUS_EVERY_S = 3600.0  # no second write within this test

    def rows() -> dict[int, dict[str, object]]:
        return {int(w): json.loads(s) for w, s in store.worker_statuses().items()}

    for k in range(3):
        post_measured(store, coordinator, k)
        coordinator.decide(k)
        assert {row["iteration"] for row in rows().values()} == {1}  # the first decision's, written at once
    assert [json.loads(d)["iteration"] for d in store.decisions(10)] == [3, 2, 1]
    assert main(["status", "--redis", redis_url, "--job", job]) == 0
    assert "the workers' rows are of iteration 1" in capsys.readouterr().out
    coordinator.run(max_decisions=3)  # made already: returns at once, as a serving coordinator stops
    last = coordinator._in_force(3).sizes
    assert {w: (row["iteration"], row["size"]) for w, row in rows().items()} == {w: (3, last[w]) for w in range(4)}
    assert [row["compute_s"] for row in rows().values()] == pytest.approx(
        [size / speed for size, speed in zip(coordinator._in_force(2).sizes, SPEEDS)])  # iteration 2's reports
    assert main(["status", "--redis", redis_url, "--job", job]) == 0
    assert "rows are of iteration" not in capsys.readouterr().out


def test_start_after_a_stop_that_timed_out_does_not_start_a_second_thread(store: Store, job: str) -> None:
    """stop() during a stalled Redis call returned with the thread alive and forgot it; start() then started a
    second thread serving the same coordinator and policy."""
    coordinator = Coordinator(store, JobConfig(job, 2, 20, lag=1))
    stalled, release = threading.Event(), threading.Event()

    def stalled_step(timeout_s: float = 1.0) -> None:
        stalled.set()
        release.wait(30)

    coordinator.step = stalled_step  # type: ignore[method-assign]
    coordinator.start()
    assert stalled.wait(10)
    coordinator.stop(timeout_s=0.1)

    def serving() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == f"lbbsp-coordinator-{job}" and t.is_alive()]

    assert len(serving()) == 1
    with pytest.raises(LBBSPError, match="has not stopped"):
        coordinator.start(timeout_s=0.1)
    assert len(serving()) == 1
    release.set()
    coordinator.start()  # the old thread ends now: a new one serves
    assert len(serving()) == 1
    coordinator.stop()
    assert serving() == []


@pytest.mark.parametrize("text", ['{"columns": ["throughput"], "rows": [[1' + "0" * 400 + "]]}",
                                  "[" * 100_000 + "]" * 100_000],
                         ids=["integer beyond a float", "nested too deeply"])
def test_an_unreadable_trace_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="cannot read CPU trace"):
        CPUTrace.load(path)


class NVMLNotSupported(Exception):
    pass


def fake_nvml(monkeypatch: pytest.MonkeyPatch, *, by_uuid: bool = True) -> list[object]:
    """A stand-in pynvml whose utilisation is not supported (as on a MIG instance); returns the devices looked up."""
    asked: list[object] = []
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
    def handle(key: object) -> object:
        asked.append(key)
        return ("handle", key)

    nvml.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    if by_uuid:
        nvml.nvmlDeviceGetHandleByUUID = handle  # type: ignore[attr-defined]
    memory = types.SimpleNamespace(used=1e9, free=3e9)
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: memory  # type: ignore[attr-defined]

    def utilisation(handle: object) -> None:
        raise NVMLNotSupported("Not Supported")

    nvml.nvmlDeviceGetUtilizationRates = utilisation  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return asked


def test_a_failing_nvml_call_omits_its_feature_and_is_logged_once(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    fake_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = ResourceMonitor(gpu_index=0, min_interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
        for _ in range(3):
            features = monitor.sample()
            assert features["gpu_mem_used"] == 1e9 and features["gpu_mem_free"] == 3e9
            assert "gpu_util" not in features
            Report("j", 0, 0, 1, 0.1, features=features)
    assert caplog.text.count("utilisation") == 1


def test_gpu_memory_is_read_at_every_sample_while_the_rest_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU memory belongs to the batch size just run: a reading kept for 0.2 s from an earlier, smaller batch
    (the default interval, on steps shorter than it) had let a learned cap pass its card."""
    fake_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    used = iter([1e9, 2e9, 3e9])
    sys.modules["pynvml"].nvmlDeviceGetMemoryInfo = (  # type: ignore[attr-defined]
        lambda handle: types.SimpleNamespace(used=(u := next(used)), free=4e9 - u))
    monitor = ResourceMonitor(gpu_index=0, min_interval_s=60.0)
    samples = [monitor.sample() for _ in range(3)]
    assert [f["gpu_mem_used"] for f in samples] == [1e9, 2e9, 3e9]
    assert [f["gpu_mem_free"] for f in samples] == [3e9, 2e9, 1e9]
    assert len({f["cpu_util"] for f in samples}) == 1  # the /proc readings are the cached sample's


@pytest.mark.parametrize(("visible", "index", "expected"),
                         [("3", 0, [3]), ("5, 2", 1, [2]), ("GPU-8f2a", 0, ["GPU-8f2a"]), (None, 1, [1])])
def test_the_gpu_is_looked_up_through_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch, visible: str | None,
                                                          index: int, expected: list[object]) -> None:
    """With CUDA_VISIBLE_DEVICES=3, cuda:0 is the machine's GPU 3: NVML was asked for GPU 0."""
    asked = fake_nvml(monkeypatch)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert "gpu_mem_used" in ResourceMonitor(gpu_index=index).sample()
    assert asked == expected


@pytest.mark.parametrize("visible", ["GPU-8f2a", "0", ""], ids=["uuid without lookup", "index beyond", "none"])
def test_a_gpu_nvml_cannot_find_goes_without_gpu_features(monkeypatch: pytest.MonkeyPatch, visible: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    fake_nvml(monkeypatch, by_uuid=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
        features = ResourceMonitor(gpu_index=0 if visible.startswith("GPU") else 1).sample()
    assert not {"gpu_mem_used", "gpu_mem_free", "gpu_util"} & set(features)
    assert "no GPU features" in caplog.text


@pytest.mark.parametrize("version", ["true", "1.0", '"1"'])
def test_the_protocol_version_must_be_the_integer_1(version: str) -> None:
    payload = f'{{"v":{version},"job":"j","worker":0,"iteration":0,"samples":1,"compute_s":0.1}}'
    with pytest.raises(ProtocolError, match="v: unsupported protocol version"):
        Report.from_json(payload)
    assert Report.from_json(payload.replace(version, "1", 1)).worker == 0


def test_a_report_far_below_its_workers_previous_throughput_is_named_in_a_warning(
        store: Store, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """A valid report of 86,400 s (a stall, or a timer that jumped) had taken its worker from 39 samples to 1 for
    several iterations with nothing in the log to say why; a slowdown of 2x, ordinary contention, says nothing."""
    coordinator = Coordinator(store, JobConfig(job, 4, 400, lag=1), LBBSPPolicy(EWMAThroughput()))
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        for k in range(8):
            sizes = coordinator._in_force(k).sizes
            for worker, size in enumerate(sizes):
                seconds = size / SPEEDS[worker]
                if worker == 0:
                    seconds = {3: 2 * seconds, 5: 86400.0, 7: 86400.0}.get(k, seconds)
                store.post_report(Report(job, worker, k, size, seconds), len(sizes))
            coordinator.decide(k)
    warned = [r.getMessage() for r in caplog.records if "under 1/100 of the previous" in r.getMessage()]
    assert len(warned) == 1, warned  # at most once a minute: iteration 7's stall is counted, not logged
    assert re.search(r"iteration 5: worker 0: [\d.e-]+ samples/s, after 100 \(1 such report", warned[0]), warned


class _Broken(Policy):
    """A custom policy with a bug that fails every decision the same way; it sets no name, so it is named for its
    class (it had been logged as the static policy)."""

    def decide(self, iteration: int, current, config):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in a custom policy")


def test_a_policy_that_fails_every_decision_is_logged_once_with_a_count_not_at_every_one(
        caplog: pytest.LogCaptureFixture) -> None:
    """A buggy policy had logged its full traceback at every decision (20 a second from a fast job); each decision
    still keeps the split in force and is counted."""
    config = JobConfig("j", 2, 10)
    guarded = GuardedPolicy(_Broken(), config)
    with caplog.at_level(logging.ERROR, logger="lbbsp.coordinator"):
        for k in range(50):
            _, assignment = guarded.decide(k + 2, (5, 5), [])
            assert assignment.sizes == (5, 5)
    assert guarded.failures == 50
    assert [r.getMessage() for r in caplog.records] == [
        "job j: policy _Broken failed to decide iteration 2; keeping the current split"]


class _Counting(Policy):
    """A custom policy whose bug fails every decision with a message that names the iteration, and, once, fails
    elsewhere; its learning fails every time too."""

    def decide(self, iteration: int, current, config):  # type: ignore[no-untyped-def]
        if iteration == 30:
            raise ValueError("another bug")
        raise RuntimeError(f"no split for iteration {iteration}")

    def learn(self) -> None:
        raise KeyError(f"worker {np.random.default_rng().integers(1000)}")


def test_a_policy_that_fails_each_time_with_another_message_is_logged_once_per_place_it_fails(
        caplog: pytest.LogCaptureFixture) -> None:
    """Failures are told apart by type and traceback, not message: a policy's error that named the iteration had
    logged its traceback at every decision, and a failure to learn was logged at every iteration."""
    guarded = GuardedPolicy(_Counting(), JobConfig("j", 2, 10))
    with caplog.at_level(logging.ERROR, logger="lbbsp.coordinator"):
        for k in range(2, 52):
            _, assignment = guarded.decide(k, (5, 5), [])
            assert assignment.sizes == (5, 5)
            guarded.learn(k)
    assert guarded.failures == 50
    assert [r.getMessage() for r in caplog.records] == [
        "job j: policy _Counting failed to decide iteration 2; keeping the current split",
        "job j: policy _Counting failed to learn from iteration 2",
        "job j: policy _Counting failed to decide iteration 30; keeping the current split",  # another place: at once
        "job j: policy _Counting failed to decide iteration 31; keeping the current split"]  # a change from the last
    assert "no split for iteration 31" in caplog.records[-1].exc_text  # the traceback logged is the new one
