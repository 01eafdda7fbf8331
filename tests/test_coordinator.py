"""The Coordinator and its process: its step and decision log, bad reports and failing policies it survives, policies
it refuses or warns of where it is made, several coordinators of one job, a process that dies and is started again,
the clean-up of old iterations and its watermark, and log lines that name the job."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lbbsp.coordinator
from emulated import worker_clients
from lbbsp import (
    Assignment,
    BSPPolicy,
    ConfigError,
    Coordinator,
    CoordinatorProcess,
    EmbeddedRedis,
    EWMAThroughput,
    JobConfig,
    LBBSPError,
    LBBSPPolicy,
    LinearTime,
    Report,
    Store,
    WorkerClient,
)
from lbbsp.cli import main
from lbbsp.coordinator_process import _stop_when_orphaned, checked_process_policy
from lbbsp.guarded_policy import GuardedPolicy
from lbbsp.models import AutoCapacityModel, BatchTimeCurve, FLClientModel, NARXThroughput
from lbbsp.models.base import CapacityModel
from lbbsp.policies import BackupWorkersPolicy, Decision, OraclePolicy, Policy
from lbbsp.protocol import _REPORT_FIELDS, FEATURE_RANGES
from lbbsp.sim.engine import LevelOracle
from lbbsp.store import UNKNOWN_CLAIM
from test_redis_faults import Fixed

torch = pytest.importorskip("torch")
from test_worker import _run  # noqa: E402


class _GivesUp(Policy):
    """A custom policy whose solver runs under a time limit: ``concurrent.futures`` raises the builtin TimeoutError,
    an OSError, as a socket's timeout is."""

    def decide(self, iteration: int, current, config):  # type: ignore[no-untyped-def]
        raise TimeoutError("the solver ran past its time limit")


def test_a_policy_that_raises_an_os_error_keeps_the_split_and_is_not_taken_for_a_redis_outage(
        redis_url: str, job: str) -> None:
    """The guard re-raised every OSError as a Redis outage: nothing was written, the iteration was lost, and every
    worker waited assignment_timeout_s for a fallback at every step while the log said Redis was unavailable."""
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, _GivesUp())
        for worker, size in enumerate(config.initial_sizes()):
            store.post_report(Report(job, worker, 0, size, 0.01), config.num_workers)
        outcome = coordinator.step(1.0)
        assert outcome is not None and outcome.written
        assert outcome.assignment.sizes == config.initial_sizes() and "policy failed (TimeoutError" in \
            outcome.assignment.reason
        assert coordinator.failed_decisions == 1
        assert store.get_assignment(1) is not None
        store.forget()


def test_a_coordinator_given_a_url_or_no_job_config_says_what_it_takes(redis_url: str, job: str) -> None:
    """Coordinator takes a Store where CoordinatorProcess takes a URL: a URL given had failed with AttributeError
    ('str' object has no attribute 'register'), as had a config that is not a JobConfig (WorkerClient says so)."""
    config = JobConfig(job, 2, 10)
    with pytest.raises(ConfigError, match=r"store must be a Store \(for a URL: Store\.from_url\(url, job\), or "
                                          r"CoordinatorProcess\(url, config\)\)"):
        Coordinator(redis_url, config)  # type: ignore[arg-type]
    with Store.from_url(redis_url, job) as store:
        with pytest.raises(ConfigError, match="config must be a JobConfig, got dict"):
            Coordinator(store, {"job": job, "num_workers": 2, "global_batch": 10})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="config must be a JobConfig, got str"):
        CoordinatorProcess(redis_url, job)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as caught:
        Coordinator("redis://:hunter2@10.0.0.5:6379/0", config)  # type: ignore[arg-type]
    assert "hunter2" not in str(caught.value) and "redis://:***@10.0.0.5" in str(caught.value)


def test_a_coordinator_refuses_kinds_pinned_outside_the_job_and_warns_of_a_horizon_not_its_lag(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 4, 64, lag=1)
    with Store.from_url(redis_url, job) as store:
        with pytest.raises(ConfigError, match=r"kinds pin worker\(s\) \[4, 99\], outside the job's workers 0..3"):
            Coordinator(store, config, LBBSPPolicy(AutoCapacityModel(kinds={0: "gpu", 4: "gpu", 99: "cpu"}, horizon=1)))
        with pytest.raises(ConfigError, match="outside the job's workers"):  # before a child process is spawned
            CoordinatorProcess(redis_url, config, LBBSPPolicy(AutoCapacityModel(kinds={4: "gpu"}, horizon=1)))
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            Coordinator(store, config, LBBSPPolicy(AutoCapacityModel(kinds={3: "gpu"}, horizon=1)))
            assert not caplog.records
            Coordinator(store, config, LBBSPPolicy(NARXThroughput()))
        assert "forecasts 2 iteration(s) ahead (horizon=2), but each split is decided 1 ahead (lag=1): give it " \
               "horizon=1" in caplog.text


def test_a_coordinator_refuses_a_policy_that_is_not_a_policy_instance(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8)
    with Store.from_url(redis_url, job) as store:
        with pytest.raises(ConfigError, match=r"got the class LBBSPPolicy: pass LBBSPPolicy\(\)"):
            Coordinator(store, config, LBBSPPolicy)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="a name such as 'lbbsp'"):
            Coordinator(store, config, "lbbsp")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="Policy instance"):  # before a child process is spawned
            CoordinatorProcess(redis_url, config, "x")  # type: ignore[arg-type]
        coordinator = Coordinator(store, config, BSPPolicy())
        with pytest.raises(ConfigError, match="timeout_s"):
            coordinator.step(timeout_s=-1)
        with pytest.raises(ConfigError, match="max_decisions"):
            coordinator.run(max_decisions=-1)


WORKERS, GLOBAL_BATCH, ITERATIONS = 3, 30, 4


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)


#: Values at the edges a worker's numbers reach: ranges' ends, tiny, huge, negative, not finite, wrong types.
_edges = st.sampled_from([0, -1, 1, 2**53 + 1, 10**30, 1e-300, 5e-324, 1e300, math.inf, -math.inf, math.nan, -0.0,
                          True, "1", [], {}])


_fields = st.sampled_from(sorted(_REPORT_FIELDS | {"extra"}))


def _report(job: str, iteration: int, samples: int) -> dict[str, Any]:
    return {"v": 1, "job": job, "worker": 1, "iteration": iteration, "samples": samples, "compute_s": 0.02,
            "features": {"cpu_util": 0.5, "cores": 4}}


@st.composite
def _payloads(draw: st.DrawFn) -> tuple[str, Any, Any]:
    """How worker 1's report is spoiled: raw bytes, one field, one feature or the device, with any JSON value."""
    how = draw(st.sampled_from(["bytes", "field", "feature", "device"]))
    if how == "bytes":
        return how, None, draw(st.binary(max_size=200))
    value = draw(_edges | _json)
    if how == "field":
        return how, draw(_fields), value
    if how == "feature":
        return how, draw(st.sampled_from([*sorted(FEATURE_RANGES), "bogus"])), value
    return how, "device", draw(st.sampled_from(["cuda:0", "phone", "", "x" * 100]) | st.text(max_size=8) | _edges)


def _spoiled(job: str, iteration: int, samples: int, how: str, name: Any, value: Any) -> bytes:
    if how == "bytes":
        return bytes(value)
    report = _report(job, iteration, samples)
    if how == "feature":
        report["features"][name] = value
    else:
        report[name] = value
    return json.dumps(report).encode()  # NaN and Infinity written as JSON5-like tokens, as a hostile sender might


@pytest.mark.timeout(600)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spoil=_payloads(), at=st.integers(0, ITERATIONS - 1))
def test_any_single_bad_report_leaves_every_step_a_whole_split(redis_url: str, spoil: tuple[str, Any, Any],
                                                              at: int) -> None:
    job = f"fuzz-{uuid.uuid4().hex[:10]}"
    config = JobConfig(job, WORKERS, GLOBAL_BATCH, lag=1)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as clients:
        coordinator = Coordinator(store, config)
        for k in range(ITERATIONS):
            sizes = clients[0].assignment(k).sizes
            if k == at:
                payload = _spoiled(job, k, sizes[1], *spoil)
                stored = store.post_raw_report(k, "1", payload, WORKERS)
                assert stored in (1, -1), stored  # stored, or refused inside Redis as too big
            else:
                clients[1].report(k, sizes[1], 0.02)
                clients[1].flush()
            for i in (0, 2):
                clients[i].report(k, sizes[i], 0.01 * (i + 1))
                clients[i].flush()
            outcome = coordinator.step(timeout_s=5 if k != at or stored == 1 else 0.5)
            assert outcome is not None and outcome.written, (k, spoil)
            split = outcome.assignment.sizes
            assert len(split) == WORKERS and sum(split) == GLOBAL_BATCH and min(split) >= config.min_batch, split
            assert {r.worker for r in outcome.rejected} <= ({"1"} if k == at else set()), (spoil, outcome.rejected)
            assert all(r.error for r in outcome.rejected)
            assert clients[2].assignment(k + 1) == outcome.assignment
        assert coordinator.failed_decisions == 0, spoil


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


@pytest.mark.parametrize("predicted", [(1.0,), ("a",) * 4, (1.0, 2.0, None, 4.0), 3.0, (1.0, [2.0, 3.0], 3.0, 4.0)],
                         ids=["too few", "strings", "none", "not a sequence", "ragged"])
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


class _RaggedSizes(Policy):
    """Answers sizes that are no flat sequence of numbers: numpy cannot make an array of them."""

    name = "ragged"

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        ragged: Any = ((1, 2), 3, 4, 5)
        return Decision(ragged, "ragged")


def test_sizes_that_are_no_array_keep_the_split_with_an_error_that_says_so(store: Store, job: str) -> None:
    coordinator = Coordinator(store, JobConfig(job, 4, 40, lag=1), _RaggedSizes())
    for worker in range(4):
        store.post_report(Report(job, worker, 0, 10, 0.1), 4)
    outcome = coordinator.decide(0)
    assert outcome.written and outcome.assignment.sizes == (10,) * 4  # the split kept, as for any policy failure
    assert "invalid split: sizes are not numbers" in outcome.assignment.reason, outcome.assignment.reason
    assert coordinator.decisions_made == 1


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


def test_two_starts_at_once_start_one_serving_thread(redis_url: str) -> None:
    """start() had checked its thread and then replaced it with no lock: two callers at once (a watchdog beside the
    main thread) both started one, sharing one policy, and stop() joined only the second (76 of 200 such races)."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for k in range(15):
            job = f"double-start-{k}-{uuid.uuid4().hex[:8]}"
            with Store.from_url(redis_url, job) as store:
                coordinator = Coordinator(store, JobConfig(job, 2, 64), BSPPolicy())
                gate = threading.Barrier(2)
                starts = [threading.Thread(target=lambda g=gate, c=coordinator: (g.wait(), c.start()))
                          for _ in range(2)]
                for thread in starts:
                    thread.start()
                for thread in starts:
                    thread.join()
                serving = [t for t in threading.enumerate() if t.name == f"lbbsp-coordinator-{job}"]
                coordinator.stop()
                assert len(serving) == 1, f"race {k}: {len(serving)} serving threads"
    finally:
        sys.setswitchinterval(switch)


def test_two_coordinator_children_started_at_once_leave_the_script_as_it_was() -> None:
    """A child's start hides the script's path from it (``_main_not_rerun``); a restart on the watch thread beside a
    new CoordinatorProcess had saved the first one's hiding as the script's own, and put it back last: ``__spec__``
    stayed None for good."""
    main, names, missing = sys.modules["__main__"], ("__file__", "__spec__"), object()
    before = {name: main.__dict__.get(name, missing) for name in names}
    inside, leave, first_done = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with lbbsp.coordinator_process._main_not_rerun(rerun=False):
            inside.set()
            leave.wait(10)
        first_done.set()

    def second() -> None:
        with lbbsp.coordinator_process._main_not_rerun(rerun=False):
            first_done.wait(10)  # ends after the first

    starts = [threading.Thread(target=first), threading.Thread(target=second)]
    starts[0].start()
    assert inside.wait(10)
    starts[1].start()
    time.sleep(0.05)  # the second start, under way while the first hides the script
    leave.set()
    for thread in starts:
        thread.join(10)
    assert {name: main.__dict__.get(name, missing) for name in names} == before


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


class _Clock:
    """The ``time`` module as the coordinator sees it: its monotonic clock ``speed`` times as fast as the real one,
    and moved on by hand by ``ahead_s``, so that seconds of the coordinator's pass without waiting for them."""

    def __init__(self, speed: float = 1.0) -> None:
        self.speed, self.ahead_s, self._start = speed, 0.0, time.monotonic()

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    def monotonic(self) -> float:
        return self._start + (time.monotonic() - self._start) * self.speed + self.ahead_s


def _wait_until(done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _messages(caplog: pytest.LogCaptureFixture, level: int = logging.DEBUG) -> list[str]:
    """The coordinator's log lines at ``level`` or above."""
    return [r.getMessage() for r in caplog.records if r.name == "lbbsp.coordinator" and r.levelno >= level]


def _with_garbage(report: Report) -> bytes:
    """``report`` as JSON with a field the protocol does not know."""
    return json.dumps({**json.loads(report.to_json()), "garbage": 1}).encode()


def test_a_report_rejected_at_every_decision_is_logged_every_10_s_with_a_count_and_recorded_each_time(
        store: Store, job: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that reported more samples than assigned had a warning at every decision (117 lines in 300
    iterations); another worker, or another check failed, is still news, logged at once."""
    clock = _Clock()
    monkeypatch.setattr("lbbsp.coordinator.time", clock)
    monkeypatch.setattr("lbbsp.repeats.time", clock)  # which says when a repeat is logged again
    coordinator = Coordinator(store, JobConfig(job, 2, 64))
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        for k in range(40):
            sizes = coordinator._in_force(k).sizes
            first = Report(job, 0, k, sizes[0], 0.1)
            if k == 30:  # another worker's report rejected
                store.post_raw_report(k, "0", _with_garbage(first), 2)
            else:
                store.post_report(first, 2)
            second = Report(job, 1, k, sizes[1] + 100, 0.1)
            if k == 31:  # another check that worker 1's report fails
                store.post_raw_report(k, "1", _with_garbage(dataclasses.replace(second, samples=sizes[1])), 2)
            else:
                store.post_report(second, 2)
            if k == 35:
                clock.ahead_s += 11.0  # 10 s on: the same rejection is logged again, with a count
            assert coordinator.decide(k).written  # every decision still made
    rejected = [m for m in _messages(caplog) if "rejected report" in m]
    assert [m.split(":")[1] for m in rejected] == [" rejected report of worker 1 for iteration 0",
                                                   " rejected report of worker 0 for iteration 30",
                                                   " rejected report of worker 1 for iteration 31",
                                                   " rejected report of worker 1 for iteration 35"], rejected
    assert all(m.startswith(f"job {job}: rejected report of worker ") for m in rejected), rejected
    assert "samples: 132 samples, more than" in rejected[0] and "garbage" in rejected[1] and "garbage" in rejected[2]
    # before iteration 35, those of 0-30 and 32-34 were rejected in the same way
    assert re.search(r"\(34 earlier ones like it, logged at most every 10 s\)$", rejected[3]), rejected[3]
    decisions = [json.loads(d) for d in store.decisions(100)]
    assert len(decisions) == 40
    assert all("1" in [r["worker"] for r in d["rejected"]] for d in decisions)  # each one still in the decision log
    assert sum(len(d["rejected"]) for d in decisions) == 41


def test_a_coordinator_left_idle_after_its_job_warns_once_that_its_keys_expired_not_every_ttl_s(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A coordinator left running after its job ended warned every ttl_s, for days, that the keys were gone, and
    advised raising ttl_s; it warns once per stretch without decisions, and says a finished job's may be stopped."""
    config = JobConfig(job, 2, 64, ttl_s=10)
    clock = _Clock()
    monkeypatch.setattr("lbbsp.coordinator.time", clock)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as clients:
        def run_iteration(k: int) -> None:
            for i, client in enumerate(clients):
                client.report(k, client.assignment(k).sizes[i], 0.01 * (i + 1))
                client.flush()

        def expire() -> None:
            clock.ahead_s += config.ttl_s + 1  # no decision for 11 s (first the clock: not mistaken for a flush)
            store.forget()  # what Redis's expiry does then
            _wait_until(store.has_config)  # registered again

        coordinator = Coordinator(store, config)
        for k in range(3):
            run_iteration(k)
            assert store.next_ready(1.0) == k
            coordinator.decide(k)
        with caplog.at_level(logging.DEBUG, logger="lbbsp.coordinator"):
            coordinator.start()
            try:
                for _ in range(3):  # three ttl periods with nothing to decide: a job that is over
                    expire()
                run_iteration(3)  # the workers came back: the splits republished are there
                _wait_until(lambda: coordinator.decisions_made == 4)
                expire()  # a new idle stretch: warned again
            finally:
                coordinator.stop()
        store.forget()
    warned = [m for m in _messages(caplog, logging.WARNING) if "keys are gone" in m]
    assert len(warned) == 2, warned
    assert re.search(r"expired: no decision for 1\ds, past the job's ttl_s \(10s\)", warned[0]), warned
    assert "or, if the job is over, stop this coordinator" in warned[0]
    quiet = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "expired again" in r.getMessage()]
    assert len(quiet) == 2 and "2 times since the last decision" in quiet[0] and "3 times" in quiet[1], quiet


def test_keys_that_expire_while_the_heartbeat_runs_are_called_expired_not_flushed(
        store: Store, job: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The heartbeat read the clock, then found the keys gone: where they expired in between, it judged the idle time
    by the reading before and warned of a flush (one CI run of the test above)."""
    config = JobConfig(job, 2, 64, ttl_s=10)
    clock = _Clock()
    monkeypatch.setattr("lbbsp.coordinator.time", clock)
    coordinator = Coordinator(store, config)
    found = store.has_config

    def expiring() -> bool:  # the TTL runs out just after the heartbeat read the clock
        clock.ahead_s += config.ttl_s + 1
        store.forget()
        return found()

    monkeypatch.setattr(store, "has_config", expiring)
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        coordinator._heartbeat()
    gone = [m for m in _messages(caplog, logging.WARNING) if "keys are gone" in m]
    assert len(gone) == 1 and "expired: no decision for 11s" in gone[0], gone


def test_splits_lost_ahead_of_the_clean_up_are_written_again_and_those_it_deleted_are_not(
        store: Store, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """The heartbeat writes back the splits it wrote that Redis lost with the settings kept; one a clean-up deleted
    (at or behind its watermark: every worker had run it) is neither warned of nor written back."""
    config = JobConfig(job, 2, 64)
    coordinator = Coordinator(store, config)
    store.register(config)
    written = [dataclasses.replace(config.initial_assignment(k), sizes=(40, 24)) for k in (5, 12)]
    coordinator._written.extend(written)
    store.client.set(store.key("forgotten"), 10)  # a clean-up deleted iterations up to 10
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        coordinator._heartbeat()
    assert store.assigned([5, 12]) == [False, True] and b"[40,24]" in (store.get_assignment(12) or b"")
    assert [m for m in _messages(caplog, logging.WARNING) if "1 assignments this coordinator wrote are gone" in m]
    coordinator._next_heartbeat = 0.0
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        caplog.clear()
        coordinator._heartbeat()  # nothing lost now but the one cleaned up: no word
    assert not [m for m in _messages(caplog, logging.WARNING) if "gone" in m]


def test_the_coordinators_outage_lines_name_its_job(job: str, caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """"Redis unavailable for 3s (...); retrying" named no job: many coordinators' logs gathered in one place could not
    be told apart."""
    monkeypatch.setattr("lbbsp.coordinator.time", _Clock(speed=20.0))  # the 3 s grace in 0.15 s
    with EmbeddedRedis() as server, Store.from_url(server.url, job, socket_timeout_s=1.0) as store:
        coordinator = Coordinator(store, JobConfig(job, 2, 8)).start()
        try:
            with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
                server.stop()
                _wait_until(lambda: "Redis unavailable" in caplog.text)
                server.start()
                _wait_until(lambda: "Redis is back" in caplog.text)
        finally:
            coordinator.stop()
    lines = _messages(caplog)
    assert any("Redis unavailable" in m for m in lines) and any("Redis is back" in m for m in lines)
    assert all(m.startswith(f"job {job}") for m in lines), lines


class _Faulty(Policy):
    """A policy whose decisions fail at odd iterations, whose predictions are not numbers, and whose learning
    fails."""

    def decide(self, iteration: int, current, config):  # type: ignore[no-untyped-def]
        if iteration % 2:
            raise RuntimeError("a bug in deciding")
        return Decision(tuple(current), "kept", predicted_throughput=("fast", "slow"))

    def learn(self) -> None:
        raise KeyError("a bug in learning")


def test_the_coordinators_other_warnings_and_errors_name_its_job(store: Store, job: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A policy's failures, a stored assignment that is invalid, a step that failed and a parent process gone were
    logged without the job (or with it at the end)."""
    coordinator = Coordinator(store, JobConfig(job, 2, 8), _Faulty())
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        store.client.set(store.key("assign", 1), "not an assignment")
        for k in range(2):
            for worker, size in enumerate(coordinator._in_force(k).sizes):
                store.post_report(Report(job, worker, k, size, 0.1), 2)
            assert store.next_ready(1.0) == k
            coordinator.decide(k)
        coordinator.start()
        store.client.set(store.key("ready"), "not a list")  # every step fails on it
        _wait_until(lambda: "step failed" in caplog.text)
        with caplog.at_level(logging.INFO, logger="lbbsp.coordinator"):  # said at INFO: see _stop_when_orphaned
            _stop_when_orphaned(coordinator, parent=-1, poll_s=0.01)  # no process has pid -1: its parent is gone
        coordinator.stop()
    lines = _messages(caplog)
    for said in ("failed to decide", "failed to learn", "predicted throughput", "stored assignment of iteration 1",
                 "step failed", "is gone: stopping"):
        assert [m for m in lines if said in m and m.startswith(f"job {job}: ")], (said, lines)
    assert all(m.startswith(f"job {job}") for m in lines), lines


class SlowBSP(BSPPolicy):
    """BSP that takes ``delay_s`` per decision: slower than the workers' steps, so the coordinator runs ahead."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        time.sleep(self.delay_s)
        return super().decide(iteration, current, config)


def train(url: str, config: JobConfig, iterations: range, step_s: float = 0.002,
          hook: Callable[[int], None] | None = None) -> list[list[Assignment]]:
    """Every worker of ``config`` in a thread of its own, fetching, 'computing' and reporting ``iterations`` (worker 0
    calls ``hook`` before each); the vectors each used, by worker, the same for all. No thread may hang."""
    used: list[list[Assignment]] = [[] for _ in range(config.num_workers)]

    def work(worker: int) -> None:
        with Store.from_url(url, config.job) as store, WorkerClient(store, config, worker) as client:
            for k in iterations:
                if hook is not None and worker == 0:
                    hook(k)
                assignment = client.assignment(k)
                used[worker].append(assignment)
                time.sleep(step_s)
                client.report(k, assignment.sizes[worker], step_s)
            client.flush()

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(config.num_workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(len(iterations) * (config.assignment_timeout_s + 0.5))
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    assert all(len(vectors) == len(iterations) for vectors in used)
    assert all(vectors == used[0] for vectors in used), "two workers used different vectors for one iteration"
    return used


@pytest.mark.timeout(120)
def test_a_coordinator_that_outlives_its_run_serves_the_next_run_under_the_name_as_it_did_the_first(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An `lbbsp coordinator` left serving a job name that a new run (or one resumed from an early checkpoint)
    reuses: it had kept the iterations it wrote and deleted in the first run, so in the second each decision wrote
    only its own iteration (no running ahead: the workers waited for every decision, twice as long) and deleted no
    old iteration's keys until the run passed the first one's last iteration."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 20)  # so that two short runs show it
    config = JobConfig(job, 2, 20, assignment_timeout_s=0.3, lag=2)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, SlowBSP(0.02)).start()
        try:
            train(redis_url, config, range(80))  # its last 20 iterations' keys stay, above the next run's
            time.sleep(0.2)  # its last decisions, from the reports of the last iterations
            started = time.time()
            with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
                train(redis_url, config, range(45))
        finally:
            coordinator.stop()
        second = [d for d in map(json.loads, store.decisions(100)) if d["time"] >= started]
        assert any(d["through"] > d["iteration"] for d in second), "the second run's decisions never ran ahead"
        assert not store.client.exists(store.key("reports", 5)), "the second run's old reports were not deleted"
    assert re.search(f"job {job}: the workers' iterations went back from 7[0-9] to [0-9] .*a new run under this job "
                     "name", caplog.text)


def serve_cli(url: str, config: JobConfig, log_path: Path, kept: int) -> subprocess.Popen[bytes]:
    """`lbbsp coordinator` for ``config`` in a process of its own, keeping ``kept`` iterations' keys, its log in
    ``log_path``; once it has claimed the job."""
    flags = ["coordinator", "--redis", url, "--job", config.job, "--workers", str(config.num_workers), "--global-batch",
             str(config.global_batch), "--timeout", str(config.assignment_timeout_s), "--ttl", str(config.ttl_s)]
    code = f"import lbbsp.coordinator, lbbsp.cli; lbbsp.coordinator.ITERATIONS_KEPT = {kept}; lbbsp.cli.main({flags!r})"
    with log_path.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)
    return process


@pytest.mark.timeout(120)
def test_a_coordinator_paused_while_another_took_over_keeps_one_split_and_both_say_what_happened(
        redis_url: str, job: str, tmp_path: Path) -> None:
    """`lbbsp coordinator` stopped (SIGSTOP) past the workers' timeout: they fall back; a second one started meanwhile
    decides on, and deletes old iterations' keys; the first, continued (SIGCONT), had taken an iteration off the ready
    list while stopped. Every worker uses one vector per iteration, each coordinator names the other, and the first
    does not say that no worker ran the iteration it held: they had, and its keys had gone meanwhile (it had said so
    in about one run in two, and had named no other coordinator in one in three)."""
    config = JobConfig(job, 3, 60, assignment_timeout_s=0.3, ttl_s=10)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    coordinators = [serve_cli(redis_url, config, logs[0], kept=10)]
    with Store.from_url(redis_url, job) as store:
        try:
            deadline = time.monotonic() + 60
            while store.coordinator() is None and time.monotonic() < deadline:
                time.sleep(0.05)

            def hook(k: int) -> None:
                if k == 10:
                    coordinators[0].send_signal(signal.SIGSTOP)
                elif k == 15:
                    coordinators.append(serve_cli(redis_url, config, logs[1], kept=10))
                elif k == 70:
                    coordinators[0].send_signal(signal.SIGCONT)

            used = train(redis_url, config, range(100), hook=hook)[0]
            time.sleep(3.0)  # each heartbeat, once a second, finds the other's claim; the second time it warns
        finally:
            for process in coordinators:
                process.send_signal(signal.SIGCONT)
                process.terminate()
                process.wait(10)
    assert sum(a.fallback for a in used) >= 5, "the workers did not fall back while no coordinator served them"
    first, second = (path.read_text() for path in logs)
    assert f":{coordinators[1].pid}:" in first and f":{coordinators[0].pid}:" in second, (first, second)
    assert f"is serving job {job} too" in first and "no worker ran" not in first, first


def test_a_coordinator_whose_heartbeats_come_at_half_the_others_rate_is_warned_about(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """The other's claim, found again at any later heartbeat, is a live coordinator's, not only at the next one: a
    coordinator busy deciding heartbeats less often, and found at every other heartbeat (its own claim between)
    had never been warned about."""
    config = JobConfig(job, 2, 10)
    with Store.from_url(redis_url, job) as store:
        fast, slow = Coordinator(store, config), Coordinator(store, config)
        with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
            for beats in (slow, fast, fast, slow, fast, fast, slow, fast):
                beats._next_heartbeat = 0.0
                beats._heartbeat()
        assert caplog.text.count(f"another coordinator ({slow._identity}) is serving job {job} too") == 1


CHILD_LOGS = """
import logging, sys
from lbbsp import CoordinatorProcess, JobConfig, LBBSPPolicy
from lbbsp.models import NARXThroughput
logging.basicConfig(format="PARENT-FORMAT %(levelname)s %(name)s: %(message)s", level=logging.INFO)
if __name__ == "__main__":
    process = CoordinatorProcess(sys.argv[1], JobConfig(sys.argv[2], 2, 10, lag=2), LBBSPPolicy(NARXThroughput(horizon=1)))
    process.stop()
"""


@pytest.mark.timeout(120)
def test_the_coordinator_process_logs_as_its_parent_does(redis_url: str, job: str, tmp_path: Path) -> None:
    """The child, spawned, started with no logging: its warning about the model's horizon came bare (Python's last
    resort), not in the format the training script had set, and its INFO lines not at all."""
    script = tmp_path / "train.py"
    script.write_text(CHILD_LOGS)
    done = subprocess.run([sys.executable, str(script), redis_url, job], capture_output=True, text=True, timeout=100,
                          check=True)
    assert re.search(r"^PARENT-FORMAT WARNING lbbsp\.coordinator: job \S+: the model forecasts 1 iteration", done.stderr,
                     re.MULTILINE), done.stderr


HUGE = "1" + "0" * 400  # a JSON integer no float can hold


def report_json(compute_s: str = "0.1", features: str = "{}", job: str = "j", worker: int = 0) -> str:
    return (f'{{"v":1,"job":"{job}","worker":{worker},"iteration":0,"samples":4,"compute_s":{compute_s},'
            f'"features":{features}}}')


def test_a_report_with_a_huge_integer_is_rejected_and_the_others_are_decided_on(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8, lag=1)
    with Store.from_url(redis_url, job) as store, Store.from_url(redis_url, job) as own:
        store.register(config)
        store.post_report(Report(job, 0, 0, 4, 0.1), 2)
        store.post_raw_report(0, "1", report_json(compute_s=HUGE, job=job, worker=1).encode(), 2)
        outcome = Coordinator(own, config).step(2.0)
        assert outcome is not None and [r.worker for r in outcome.rejected] == ["1"]
        assert store.get_assignment(1) is not None


def test_the_coordinator_refuses_a_stored_assignment_of_another_iteration(redis_url: str, job: str) -> None:
    """The split in force at iteration 5, where key 5 holds iteration 3's: the latest one truly of an iteration
    before it (4's, as the workers, who refuse key 5, fall back to), not the misplaced one."""
    config = JobConfig(job, 2, 8)
    store = Store.from_url(redis_url, job)
    store.publish(Assignment(job, 3, (7, 1), "p"))
    store.publish(Assignment(job, 4, (6, 2), "p"))
    store.client.set(store.key("assign", 5), store.get_assignment(3) or b"")
    assert Coordinator(store, config)._in_force(5).sizes == (6, 2)
    store.close()


@pytest.mark.timeout(30)
def test_worker_rows_catch_up_once_the_coordinator_is_idle(redis_url: str, job: str) -> None:
    """16 quick iterations, then a pause with the coordinator up: `lbbsp status` showed rows of iteration 2 beside
    the last decision of iteration 17, since the rows held back by the once-a-second limit waited for run()'s end."""
    config = JobConfig(job, 2, 30, assignment_timeout_s=5.0)
    coordinator = Coordinator(Store.from_url(redis_url, job), config, BSPPolicy())
    coordinator.STATUS_EVERY_S = 60.0  # every decision after the first is held back, however slow this machine
    coordinator.start()
    try:
        with worker_clients(redis_url, config) as clients:
            _run(clients, range(16))
            clients[0].assignment(17)
            store = clients[0].store
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                rows = {int(w): s for w, s in store.worker_statuses().items()}
                if rows and all(b'"iteration": 17' in s for s in rows.values()):
                    break
                time.sleep(0.1)
            assert coordinator._thread is not None and coordinator._thread.is_alive()  # still serving
    finally:
        coordinator.stop()
        coordinator.store.close()
    assert sorted(rows) == [0, 1] and all(b'"iteration": 17' in s for s in rows.values()), rows


STEPS, CLIENTS, BATCH, SPEED = 5, 4, 80, 100.0


def _rejected(policy: object, features: dict[str, float], samples: int = STEPS * 20) -> list[str]:
    """What a coordinator with ``policy`` refuses of two clients that each ran 5 local steps of their 20 samples."""
    with EmbeddedRedis() as redis, Store.from_url(redis.url, "fljob") as store:
        try:
            coordinator = Coordinator(store, JobConfig("fljob", 2, 40, lag=1), policy)  # type: ignore[arg-type]
            for worker in (0, 1):
                store.post_report(Report("fljob", worker, 0, samples, 1.0 + worker, features=features), 2)
            return [rejection.error for rejection in coordinator.decide(0).rejected]
        finally:
            store.forget()


def test_the_coordinator_takes_local_steps_from_the_client_model() -> None:
    # reports of 5 x 20 samples with no transfer had been refused as "more than the 20 assigned", every round
    assert _rejected(LBBSPPolicy(FLClientModel(local_steps=STEPS)), {}) == []
    transfer = {"download_s": 1.0, "upload_s": 1.0}
    auto = LBBSPPolicy(AutoCapacityModel(models={"fl": FLClientModel(local_steps=STEPS)}))
    assert _rejected(auto, transfer) == []
    assert len(_rejected(auto, transfer, samples=STEPS * 20 + 1)) == 2  # past the bound that local steps make


def test_the_coordinator_refuses_local_steps_its_model_does_not_take_and_says_how() -> None:
    # the default model's clients take one step: 5 were learned as a client 5x faster than it is, unsaid
    errors = _rejected(LBBSPPolicy(), {"download_s": 1.0, "upload_s": 1.0})
    assert len(errors) == 2 and "1 local step(s) x the 20 assigned" in errors[0]
    assert "--local-steps N" in errors[0]
    assert _rejected(BSPPolicy(), {"download_s": 1.0, "upload_s": 1.0}) == []  # no model: the protocol's bound


class _Later:
    """The ``time`` module as the coordinator sees it, its monotonic clock ``ahead_s`` later: a pause without waiting."""

    def __init__(self, ahead_s: float) -> None:
        self.ahead_s = ahead_s

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead_s


def test_keys_that_expired_in_a_pause_longer_than_ttl_s_are_not_blamed_on_redis(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Workers that paused for longer than ttl_s (an evaluation, a checkpoint) found the coordinator warning that Redis
    had been restarted without persistence or flushed: the job's keys had expired, as ttl_s says they do."""
    config = JobConfig(job, 2, 64, ttl_s=10)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as clients:
        coordinator = Coordinator(store, config)
        for k in range(3):
            for i, client in enumerate(clients):
                client.report(k, client.assignment(k).sizes[i], 0.01 * (i + 1))
                client.flush()
            assert store.next_ready(1.0) == k
            coordinator.decide(k)
        monkeypatch.setattr("lbbsp.coordinator.time", _Later(config.ttl_s + 1))  # 11 s on, no decision since
        store.forget()  # what Redis's expiry did meanwhile
        with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
            coordinator.start()
            deadline = time.monotonic() + 3.0
            while "keys are gone" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            coordinator.stop()
        assert "keys are gone" in caplog.text and "flushed" not in caplog.text
        assert "expired: no decision for 11s, past the job's ttl_s (10s)" in caplog.text
        assert clients[0].assignment(4).fallback is False  # republished, as after a flush


UNEVEN_SPEEDS = np.array([100.0, 50.0, 50.0, 40.0])  # samples/s; the balanced split of 240 is 100, 50, 50, 40


def _reports_at_uneven_speeds(job: str, k: int, sizes: Sequence[int]) -> list[Report]:
    return [Report(job, w, k, int(s), float(s) / UNEVEN_SPEEDS[w]) for w, s in enumerate(sizes)]


def _coordinate(coordinator: Coordinator, store: Store, config: JobConfig, iterations: int,
                oracle: OraclePolicy | None = None) -> list[tuple[int, ...]]:
    """Workers of UNEVEN_SPEEDS reporting to ``coordinator``, which decides each iteration (``oracle`` shown the truth
    first, as the simulator shows it); the sizes each iteration ran with, read back from Redis."""
    for k in range(config.lag):
        store.publish(config.initial_assignment(k))
    ran = []
    for k in range(iterations):
        raw = store.get_assignment(k)
        assert raw is not None
        sizes = Assignment.from_json(raw, job=config.job).sizes
        ran.append(sizes)
        store.post_reports(_reports_at_uneven_speeds(config.job, k, sizes), config.num_workers)
        if oracle is not None:
            oracle.reveal(LinearTime(UNEVEN_SPEEDS))
        coordinator.decide(k)
    return ran


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
    ran = _coordinate(coordinator, store, config, 4, oracle)
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
        ran = _coordinate(coordinator, store, config, 6)
    warnings = [record.getMessage() for record in caplog.records if "backup" in record.getMessage()]
    assert len(warnings) == 1, warnings
    assert "exact" in warnings[0] and "lbbsp.sim" in warnings[0] and "plain BSP" in warnings[0], warnings[0]
    assert set(ran) == {config.initial_sizes()} and coordinator.failed_decisions == 0


def test_the_simulator_runs_backup_workers_without_the_warning(
        store: Store, job: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        Coordinator(store, JobConfig(job, 4, 240), BackupWorkersPolicy(), simulated=True)
    assert not caplog.records


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


def _post(store: Store, config: JobConfig, iterations: range) -> None:
    """Both workers' reports of ``iterations``, the equal split's samples (what BSP assigns), in one round trip."""
    store.post_reports([Report(config.job, w, k, 5, 0.01) for k in iterations for w in range(2)], 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "after"), [("decisions", 8), ("forgotten", 2), ("forgotten", 8)])
def test_a_wrong_typed_decisions_or_forgotten_key_mid_run_keeps_the_coordinator_deciding_and_forgetting(
        redis_url: str, job: str, name: str, after: int, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A set at the job's ``decisions`` or ``forgotten`` key, appearing after ``after`` decisions (before the first
    clean-up, at 5, or after it): every later decision had failed after its split was written, so the old keys were
    never deleted, decisions_made stopped counting and run(max_decisions=...) never returned."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 5)
    total = 30
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, BSPPolicy(), max_ahead=1)
        _post(store, config, range(total))
        coordinator.run(max_decisions=after, poll_s=0.2)
        store.client.delete(store.key(name))
        store.client.sadd(store.key(name), "x")
        guard = threading.Timer(20.0, coordinator.stop)  # before the fix, run() never returned
        guard.start()
        try:
            with caplog.at_level(logging.ERROR, logger="lbbsp.coordinator"):
                coordinator.run(max_decisions=total, poll_s=0.2)
        finally:
            guard.cancel()
        assign_keys = len(list(store.client.scan_iter(store.key("assign", "*"))))
        kind = store.client.type(store.key(name))
    assert coordinator.decisions_made == total
    assert assign_keys <= 5 + 2, f"{assign_keys} assign keys left: the old ones were not forgotten"
    if name == "decisions":  # recording fails on: logged once (the same failure every step), naming the key
        failed = [r for r in caplog.records if "step failed" in r.getMessage()]
        assert len(failed) == 1 and store.key("decisions") in caplog.text, caplog.text
    else:  # the clean-up's SET repairs the watermark
        assert kind == b"string" and not caplog.records, caplog.text


def test_the_coordinator_meeting_a_wrong_typed_assign_key_logs_it_and_decides_on(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """The step had raised a bare WRONGTYPE from the publish script, the ready entry it popped lost."""
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, BSPPolicy(), max_ahead=1)
        store.client.hset(store.key("assign", 1), "x", "y")
        _post(store, config, range(1))
        with caplog.at_level(logging.ERROR, logger="lbbsp.coordinator"):
            first = coordinator.step(1.0)
        _post(store, config, range(1, 2))  # the workers ran iteration 1 on their fallback
        second = coordinator.step(1.0)
        assign_2 = store.get_assignment(2)
    assert first is not None and not first.written
    assert store.key("assign", 1) in caplog.text and "another type" in caplog.text, caplog.text
    assert second is not None and second.written and assign_2 is not None
    assert coordinator.decisions_made == 2


class _Observed(BSPPolicy):
    """BSP that keeps the workers of the reports it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def observe(self, reports: Sequence[Report]) -> None:
        self.seen.append([r.worker for r in reports])


def test_thousands_of_fields_that_are_no_worker_neither_flood_the_log_nor_the_decision_record(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """Written by HSET, past POST_REPORT's check: each field had its own log line (the rate limiter had an entry per
    field name, never dropped) and its own entry in the decision record (1.6 MB for 20,000)."""
    config = JobConfig(job, 2, 10, lag=1)
    policy = _Observed()
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, policy, max_ahead=1)
        outcomes = []
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            for k in range(2):
                _post(store, config, range(k, k + 1))
                store.client.hset(store.key("reports", k), mapping={f"w{k}-{n}": b"{}" for n in range(5000)})
                outcomes.append(coordinator.step(1.0))
        records = [json.loads(raw) for raw in store.decisions(2)]
        sizes = [len(raw) for raw in store.decisions(2)]
    assert all(o is not None and len(o.rejected) == 5000 for o in outcomes)
    assert policy.seen == [[0, 1], [0, 1]]
    assert len(caplog.records) <= 2, len(caplog.records)
    assert len(coordinator._rejections) <= 2
    assert max(sizes) < 8000, sizes
    assert all(len(r["rejected"]) == 20 and r["rejected_more"] == 4980 for r in records)


def test_a_real_workers_rejection_is_still_logged_at_once_beside_the_junk_fields(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, BSPPolicy(), max_ahead=1)
        store.client.hset(store.key("reports", 0), mapping={f"junk{n}": b"{}" for n in range(50)})
        store.post_raw_report(0, "0", Report(job, 0, 0, 5, 0.01).to_json(), 2)
        store.post_raw_report(0, "1", b"{}", 2)
        store.client.rpush(store.key("ready"), 0)  # HLEN passed 2 with the junk: POST_REPORT queued nothing
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            coordinator.step(1.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert sum(f"job {job}: rejected report of worker 1 for iteration 0" in line for line in lines) == 1, lines


@pytest.mark.parametrize("head", ["nested", "wrong type"])
def test_a_broken_decision_log_head_does_not_lose_a_real_decision(redis_url: str, job: str, head: str) -> None:
    """A stray entry on the ready list makes the step look up the latest decision; a deeply nested JSON head of the
    log (RecursionError), or a log that is no list, had ended the step after it emptied the ready list."""
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, BSPPolicy())
        coordinator.ahead = 2  # behind the workers: the step drains the ready list
        if head == "nested":
            store.client.lpush(store.key("decisions"), "[" * 100_000)
        else:
            store.client.sadd(store.key("decisions"), "x")
        store.client.rpush(store.key("ready"), 10**6)  # an iteration no worker ran
        _post(store, config, range(1))
        if head == "nested":
            coordinator.step(1.0)
        else:  # the record of the decision made cannot be written to a log that is no list: said, naming the key
            with pytest.raises(ConfigError, match=re.escape(store.key("decisions"))):
                coordinator.step(1.0)
        assert store.get_assignment(1) is not None and coordinator.decisions_made == 1


def test_a_report_field_name_cannot_inject_a_log_line(redis_url: str, job: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, BSPPolicy())
        store.client.hset(store.key("reports", 0), "1\nCRITICAL all good", Report(job, 1, 0, 5, 0.01).to_json())
        store.post_report(Report(job, 0, 0, 5, 0.01), 2)  # HLEN reaches 2: iteration 0 queued
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            outcome = coordinator.step(1.0)
    assert outcome is not None and len(outcome.rejected) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert messages and all("\n" not in m for m in messages), messages
    assert any(r"'1\nCRITICAL all good'" in m for m in messages), messages


_CLAIMS = {"newline": "evil:1:x\n2026-12-03 00:00:00 lbbsp.coordinator INFO job stopped cleanly",
           "escape": "host:1:x\x1b]0;OWNED TITLE\x1b\\\x1b[2J\x1b[31mRED",
           "1 MB": "A" * 1_000_000}


@pytest.mark.parametrize("claim", list(_CLAIMS))
def test_a_claim_that_is_no_coordinator_identity_is_neither_logged_nor_printed_as_it_is(
        redis_url: str, job: str, claim: str, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The claim's value had been decoded whole and logged by the coordinator and printed by `lbbsp status` raw: a
    fake log line, terminal escapes (a window title, a cleared screen), or a megabyte a line."""
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, BSPPolicy())
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            for _ in range(2):  # found twice: a live coordinator, warned about
                store.client.set(store.key("coordinator"), _CLAIMS[claim], ex=60)
                coordinator._next_heartbeat = 0
                coordinator._heartbeat()
        store.client.set(store.key("coordinator"), _CLAIMS[claim], ex=60)
        read = store.coordinator()
        assert main(["status", "--redis", redis_url, "--job", job]) == 0
        printed = capsys.readouterr().out
    assert read == UNKNOWN_CLAIM
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and UNKNOWN_CLAIM in warned[0] and len(warned[0]) < 400, warned
    assert UNKNOWN_CLAIM in printed and "\x1b" not in printed and "OWNED" not in printed and len(printed) < 5000


def _until(condition, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _decided(clients: list[WorkerClient], first: int, count: int) -> list[bool]:
    """Run ``count`` iterations from ``first`` on every client (report, then read the next vector); whether each
    vector read was a coordinator's decision, not a fallback."""
    decided = []
    for k in range(first, first + count):
        for worker, client in enumerate(clients):
            client.report(k, client.assignment(k).sizes[worker], 0.01)
        decided += [not client.assignment(k + 1).fallback for client in clients]
    return decided


def test_a_coordinator_process_killed_is_started_again_and_decides_on(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 2, 8, assignment_timeout_s=5.0)
    running = CoordinatorProcess(redis_url, config, BSPPolicy())
    clients = [WorkerClient(Store.from_url(redis_url, job), config, w) for w in range(2)]
    try:
        assert all(_decided(clients, 0, 3))
        first = running._process.pid
        assert first is not None
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            os.kill(first, signal.SIGKILL)
            _until(lambda: running.restarts == 1 and running.alive)
        assert running._process.pid != first
        assert "died (exit code -9" in caplog.text and "starting it again" in caplog.text
        assert all(_decided(clients, 3, 5))  # the new child resumes the job: decisions, no fallback
    finally:
        for client in clients:
            client.close()
            client.store.close()
        running.stop()
    assert not running.alive
    time.sleep(1.0)
    assert not running.alive and running.restarts == 1  # stopped on purpose: not started again


def test_a_coordinator_process_stopped_by_sigterm_is_said_so_and_started_again(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """A SIGTERM to the child (a process group's, from timeout(1) or a job's cancel) ends it with exit code 0; the
    warning had blamed "the OOM killer, or a kill?" for that too."""
    running = CoordinatorProcess(redis_url, JobConfig(job, 2, 8), BSPPolicy())
    try:
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            os.kill(running._process.pid, signal.SIGTERM)  # type: ignore[arg-type]
            _until(lambda: running.restarts == 1 and running.alive)
        assert "died (exit code 0: a SIGTERM stopped it): starting it again" in caplog.text
        assert "OOM" not in caplog.text
    finally:
        running.stop()


def test_a_coordinator_process_that_keeps_dying_is_left_dead_with_an_error(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    running = CoordinatorProcess(redis_url, JobConfig(job, 2, 8), BSPPolicy())
    running.RESTARTS = 0
    try:
        with caplog.at_level(logging.ERROR, logger="lbbsp.coordinator"):
            os.kill(running._process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            _until(lambda: "not starting it again" in caplog.text, 10.0)
        assert not running.alive and running.restarts == 0
        assert "start `lbbsp coordinator` for the job" in caplog.text
    finally:
        running.stop()


class _FormatterHoldingALock(logging.Formatter):
    """A formatter that cannot be pickled, as pytest's own coloured one (it holds the terminal's file)."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(message)s")
        self.lock = threading.Lock()


@pytest.fixture
def unpicklable_lbbsp_formatter() -> Iterator[None]:
    handler = logging.StreamHandler()
    handler.setFormatter(_FormatterHoldingALock())
    logger = logging.getLogger("lbbsp")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


@pytest.mark.timeout(60)
def test_a_coordinator_process_starts_whatever_formatter_the_parent_logs_with(
        redis_url: str, job: str, unpicklable_lbbsp_formatter: None) -> None:
    process = CoordinatorProcess(redis_url, JobConfig(job, 2, 8), start_timeout_s=20)
    process.stop()


@pytest.mark.timeout(60)
def test_a_script_whose_formatter_class_is_its_own_starts_the_coordinator_process(redis_url: str, job: str,
                                                                                   tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import logging
        from lbbsp import JobConfig
        from lbbsp.coordinator_process import CoordinatorProcess

        class MyFormatter(logging.Formatter):
            pass

        if __name__ == "__main__":
            handler = logging.StreamHandler()
            handler.setFormatter(MyFormatter("MINE %(message)s"))
            logging.basicConfig(level=logging.INFO, handlers=[handler])
            CoordinatorProcess({redis_url!r}, JobConfig({job!r}, 2, 8), start_timeout_s=20).stop()
            print("STARTED")
    """))
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=50)
    assert "STARTED" in done.stdout, done.stderr[-2000:]


class PausedBSP(BSPPolicy):
    """BSP that, deciding iteration ``at``, waits until ``resume`` is set: its coordinator paused in the middle of a
    decision (SIGSTOP and SIGCONT, a long GC pause), where step() has already checked that the workers ran the iteration
    it decides from."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.paused, self.resume = threading.Event(), threading.Event()

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        if iteration == self.at:
            self.paused.set()
            self.resume.wait(30)
        return super().decide(iteration, current, config)


@pytest.mark.timeout(60)
def test_a_coordinator_resumed_after_another_deleted_its_iteration_neither_writes_nor_logs_it(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Coordinator A pauses while deciding iteration 12 from the reports of 10; B takes over, the workers go on, and
    B's clean-up deletes the keys of iterations 10 and 12 among others. A, resumed, had written assign:12 again (no
    worker would read it; it stayed until A's next clean-up, or its TTL where A decided no more) and logged a decision
    for it as its own."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 10)
    config = JobConfig(job, 2, 20, assignment_timeout_s=0.3, lag=2)
    policy = PausedBSP(at=12)
    with Store.from_url(redis_url, job) as store_a, Store.from_url(redis_url, job) as store_b:
        first = Coordinator(store_a, config, policy, max_ahead=1).start()
        second = Coordinator(store_b, config, BSPPolicy())

        def hook(k: int) -> None:
            if k == 12:
                assert policy.paused.wait(10), "the first coordinator never decided iteration 12"
                second.start()
            elif k == 50:  # the second has deleted the keys of iterations up to about 38 by now
                deadline = time.monotonic() + 10
                while store_b.client.exists(store_b.key("assign", 10), store_b.key("assign", 12)):
                    assert time.monotonic() < deadline, "the second coordinator did not clean up"
                    time.sleep(0.01)
                policy.resume.set()
                first.stop()  # once its decision is done: its next clean-up would delete what it wrote

        try:
            with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
                train(redis_url, config, range(60), hook=hook)
        finally:
            policy.resume.set()
            first.stop()
            second.stop()
        assert not store_a.client.exists(store_a.key("assign", 12)), "the resumed coordinator wrote assign:12 again"
        logged = [d for d in map(json.loads, store_a.decisions(1000)) if d["iteration"] == 12]
        assert len(logged) == 1, logged  # the second coordinator's, from the reports of 11
        assert logged[0]["from_reports_of"] == 11
    assert f"job {job}: the keys of iteration 12 were deleted" in caplog.text


def test_the_guard_leaves_the_workers_fallback_and_a_new_runs_decisions_alone(redis_url: str, job: str) -> None:
    """Below the clean-up's watermark, a worker's fallback is written and used as before (a new run under the job's
    name, or one resumed from an earlier checkpoint, falls back there), and so is a coordinator's decision from an
    iteration whose assignment is stored (the new run's); only one from an iteration whose keys are gone too is
    refused."""
    config = JobConfig(job, 1, 10, assignment_timeout_s=0.05)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        store.forget_iterations(0, 50)  # an earlier run's clean-up
        with WorkerClient(store, config, 0) as client:
            assignment = client.assignment(5)  # no coordinator: the worker's fallback
        assert assignment.fallback and store.get_assignment(5) == assignment.to_json()
        decided = [Assignment(job, k, (10,), "bsp") for k in (6, 7)]
        assert store.publish_all(decided[:1], decided_from=5) == [True]  # 5's split is stored: the new run's
        assert store.publish_all(decided[1:], decided_from=4) == [None]  # 4's is gone: refused
        assert store.publish_all([Assignment(job, 51, (10,), "bsp")], decided_from=4) == [True]  # above it
        assert store.publish_all(decided[:1], decided_from=4) == [False]  # stored already: as before
        assert not store.client.exists(store.key("assign", 7))


def _left_by_an_earlier_run(store: Store, config: JobConfig, iterations: range) -> None:
    """The keys ``iterations`` leave, as the workers write them: each worker's report and the iteration's split;
    the ready list emptied (a coordinator that had popped them and crashed)."""
    for k in iterations:
        store.publish(config.initial_assignment(k))
        for worker in range(config.num_workers):
            store.post_report(Report(config.job, worker, k, config.initial_sizes()[worker], 0.01), config.num_workers)
    store.drain_ready()


def _stored(store: Store, iterations: range) -> list[int]:
    """Those of ``iterations`` with a report or an assignment still stored."""
    return [k for k in iterations if store.client.exists(store.key("reports", k), store.key("assign", k))]


@pytest.mark.parametrize("cleaned_through", [None, 20])
def test_a_coordinators_first_clean_up_deletes_every_earlier_iteration_left(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch, cleaned_through: int | None) -> None:
    """A coordinator that starts on a job whose earlier iterations' keys are stored (a coordinator that crashed
    before deleting them, or none ever ran): its first clean-up had deleted one iteration, and left the rest for
    their TTL. It deletes all of them now, from the oldest one an earlier clean-up left (or 0); later ones go on
    one at a time."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 10)
    config = JobConfig(job, 2, 20)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        _left_by_an_earlier_run(store, config, range(61))
        if cleaned_through is not None:
            store.forget_iterations(0, cleaned_through)
        coordinator = Coordinator(store, config, BSPPolicy())
        coordinator.decide(60)
        assert _stored(store, range(61)) == list(range(51, 61))
        _left_by_an_earlier_run(store, config, range(61, 62))
        coordinator.decide(61)
        assert _stored(store, range(62)) == list(range(52, 62))


def test_a_first_clean_up_far_into_a_job_reaches_back_a_bounded_number_of_iterations(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no earlier clean-up says where the stored iterations start, the first one reaches back
    CLEAN_UP_REACH iterations, not to iteration 0 of a job resumed at iteration 1,000,000."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 10)
    config = JobConfig(job, 2, 20)
    reach, now = lbbsp.coordinator.CLEAN_UP_REACH, 1_000_000
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        edge = now - 10 - reach  # the last iteration out of reach, and the first in it
        _left_by_an_earlier_run(store, config, range(edge, edge + 2))
        _left_by_an_earlier_run(store, config, range(now, now + 1))
        Coordinator(store, config, BSPPolicy()).decide(now)
        assert _stored(store, range(edge, now + 1)) == [edge, now]


class ExitingBSP(BSPPolicy):
    """BSP whose decision of iteration ``decide_at`` and learning after iteration ``learn_at`` call sys.exit: a
    library that exits on an error, or an exit() left in while debugging."""

    def __init__(self, decide_at: int, learn_at: int) -> None:
        super().__init__()
        self.decide_at, self.learn_at, self.decided = decide_at, learn_at, -1

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        self.decided = iteration
        if iteration == self.decide_at:
            sys.exit("no split today")
        return super().decide(iteration, current, config)

    def learn(self) -> None:
        if self.decided == self.learn_at:
            sys.exit(3)


@pytest.mark.timeout(60)
def test_a_policy_that_exits_is_a_failed_decision_and_the_coordinator_serves_on(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """SystemExit from a policy's decide or learn had passed the guard and ended the coordinator's thread without a
    word (threads drop SystemExit silently): every later step waited assignment_timeout_s and fell back."""
    config = JobConfig(job, 2, 20, assignment_timeout_s=0.2, lag=2)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, ExitingBSP(decide_at=6, learn_at=9), max_ahead=1).start()
        try:
            with caplog.at_level("ERROR", logger="lbbsp.coordinator"):
                train(redis_url, config, range(20))
        finally:
            coordinator.stop()
        logged = {d["iteration"]: d for d in map(json.loads, store.decisions(100))}
    assert "policy failed (SystemExit: no split today); kept the split" in logged[6]["reason"]
    assert max(logged) >= 19 and coordinator.failed_decisions == 1  # it decided on, to the end
    assert "policy bsp failed to decide iteration 6; keeping the current split" in caplog.text
    assert "policy bsp failed to learn from iteration" in caplog.text


def test_a_keyboard_interrupt_in_a_policy_still_stops_the_coordinator(redis_url: str, job: str) -> None:
    """Ctrl-C lands in whatever runs in the main thread, a policy's decide too: it stops `lbbsp coordinator`, not a
    failed decision."""
    class Interrupted(BSPPolicy):
        def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
            raise KeyboardInterrupt

    config = JobConfig(job, 1, 10)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, Interrupted())
        store.post_report(Report(job, 0, 0, 10, 0.01), 1)
        with pytest.raises(KeyboardInterrupt):
            coordinator.run(max_decisions=1, poll_s=0.1)
        assert coordinator.failed_decisions == 0 and store.coordinator() is None  # its claim released on the way out


def test_a_coordinator_whose_iterations_went_back_does_not_republish_the_old_runs_splits(redis_url: str,
                                                                                         job: str) -> None:
    """Kept from the run before, they were written again after an outage: keys that run's clean-up or TTL had
    removed came back, and the new run, reaching those iterations, used the old run's splits."""
    from test_extension_points import _reports_of_four as _reports  # noqa: PLC0415

    with Store.from_url(redis_url, job) as store:
        config = JobConfig(job, 4, 800)
        coordinator = Coordinator(store, config, BSPPolicy(), max_ahead=1)
        for k in range(config.lag):
            store.publish(config.initial_assignment(k))
        for k in range(30):  # the first run
            store.post_reports(_reports(job, k, np.full(4, 200)), config.num_workers)
            coordinator.decide(k)
        store.forget_iterations(0, 40)  # its keys gone (a TTL, another coordinator's clean-up)
        for k in range(config.lag):  # a new run under the name
            store.publish(config.initial_assignment(k))
        store.post_reports(_reports(job, 0, np.full(4, 200)), config.num_workers)
        coordinator.decide(0)
        coordinator._republish()  # as after an outage
        assert [k for k in range(3, 40) if store.get_assignment(k) is not None] == []
        store.forget()


def test_every_worker_slowed_at_once_is_named_as_a_pause_of_the_whole_job(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """torch.compile recompiles on every rank when the slice size first changes: the warning had called each rank
    a stalled worker that 'the model gives few samples', where the split hardly moves (their speeds keep their
    ratio)."""
    speeds = (4500.0, 8000.0)
    coordinator = Coordinator(Store.from_url(redis_url, job), JobConfig(job, 2, 32, lag=1),
                              LBBSPPolicy(EWMAThroughput()))
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        for k in range(6):
            sizes = coordinator._in_force(k).sizes
            for worker, size in enumerate(sizes):
                seconds = {0: 1.0, 1: 0.5}[worker] if k == 4 else size / speeds[worker]  # both paused at once
                coordinator.store.post_report(Report(job, worker, k, size, seconds), 2)
            coordinator.decide(k)
    warned = [r.getMessage() for r in caplog.records if "previous measurement" in r.getMessage()]
    assert len(warned) == 1, warned
    assert re.search(r"iteration 4: worker 0: [\d.e+]+ samples/s, after 4\.5e\+03; worker 1: ", warned[0]), warned
    assert "every worker at once" in warned[0] and "recompile" in warned[0], warned
    assert "gives such a worker few samples" not in warned[0], warned
    assert coordinator._in_force(5).sizes == (11, 21)  # the split kept its ratio




@pytest.mark.timeout(60)
def test_a_paused_coordinator_running_ahead_past_the_watermark_leaves_no_split_that_nobody_republishes(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Coordinator A, running ahead by 30 iterations (past ITERATIONS_KEPT + lag: with the defaults, max_ahead over
    101), pauses holding iteration 5; B decides on through iteration 21 and cleans up through 11. A, resumed: its first
    target (6) is refused, but 23 to 35, which nobody had written, are written with A's split; A had kept none of
    them for a republish. Worker 0 reads iteration 23 (A's split, B's write having found it there); the
    job's keys are then lost and both coordinators republish what they hold: nobody held 23, and worker 1 fell back
    to another vector."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 10)
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.2, lag=1)
    with Store.from_url(redis_url, job) as store_a, Store.from_url(redis_url, job) as store_b:
        paused = Coordinator(store_a, config, Fixed(), max_ahead=64)
        paused.ahead = 30  # its decisions were slower than the workers' steps
        other = Coordinator(store_b, config, BSPPolicy(), max_ahead=1)
        workers = [WorkerClient(Store.from_url(redis_url, job), config, w) for w in range(2)]
        try:
            for k in range(22):
                assert {worker.assignment(k).sizes for worker in workers} == {(5, 5)}
                other.decide(k)
            assert store_b.forgotten_through() == 11
            outcome = paused.decide(5)
            assert not outcome.written
            other.decide(22)
            read_before = workers[0].assignment(23)
            workers[1].assignment(22)
            store_b.forget()  # Redis lost the job's keys (restarted without persistence, or flushed)
            store_b.register(config)
            for coordinator in (paused, other):
                coordinator._republish()
            read_after = workers[1].assignment(23)
        finally:
            for worker in workers:
                worker.close()
                worker.store.close()
    assert (read_after.sizes, read_after.fallback) == (read_before.sizes, False), \
        "two workers used different vectors for iteration 23"


@pytest.mark.timeout(120)
def test_a_new_run_under_the_name_below_the_earlier_runs_watermark_gets_every_decision(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A second run under the job's name, with a coordinator of its own, lag 2 and running ahead, all of it below the
    watermark the first run's clean-ups left: no decision is refused (each is logged, none warned about), the workers
    agree (train checks), and the new coordinator's first clean-up deletes the second run's old iterations from 0.
    Fails where the guard refuses without looking at the iteration decided from, or looks at the wrong one."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 10)
    config = JobConfig(job, 2, 20, assignment_timeout_s=0.3, lag=2)
    with Store.from_url(redis_url, job) as store:
        first = Coordinator(store, config, SlowBSP(0.005)).start()
        try:
            train(redis_url, config, range(50))
            time.sleep(0.2)  # its decisions from the last iterations
        finally:
            first.stop()
        watermark = store.forgotten_through()
        assert watermark is not None and watermark >= 35
        started = time.time()
        second = Coordinator(store, config, SlowBSP(0.005)).start()
        try:
            with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
                train(redis_url, config, range(30))
                time.sleep(0.2)
        finally:
            second.stop()
        decided = [d for d in map(json.loads, store.decisions(200)) if d["time"] >= started]
        covered = {k for d in decided for k in range(d["iteration"], d["through"] + 1)}
        assert set(range(config.lag, 30)) <= covered, sorted(set(range(config.lag, 30)) - covered)
        assert _stored(store, range(10)) == [], "the second run's first iterations were not deleted"
        assert store.forgotten_through() == watermark  # never lowered
    assert "were deleted while this coordinator decided" not in caplog.text


@pytest.mark.parametrize("watermark", [51, 60, 10**6])
def test_a_first_clean_up_below_an_earlier_runs_watermark_deletes_from_0_and_keeps_the_latest(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch, watermark: int) -> None:
    """A new run's coordinator whose first clean-up (deciding from 60, so through 50) finds a watermark above it:
    it deletes 0 to 50, every one at least ITERATIONS_KEPT behind, keeps 51 to 60, which workers may still read, and
    leaves the watermark as it was. Fails where it starts after the watermark (nothing deleted), deletes up to it (the
    live iterations), or lowers it."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 10)
    config = JobConfig(job, 2, 20)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        _left_by_an_earlier_run(store, config, range(61))
        store.client.set(store.key("forgotten"), watermark)  # the earlier run's clean-ups reached there
        Coordinator(store, config, BSPPolicy()).decide(60)
        assert _stored(store, range(61)) == list(range(51, 61))
        assert store.forgotten_through() == watermark


def test_no_clean_up_before_iteration_kept_and_the_first_one_deletes_iteration_0(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decisions from iterations before ITERATIONS_KEPT delete nothing and set no watermark; the one from
    ITERATIONS_KEPT deletes iteration 0 alone."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 10)
    config = JobConfig(job, 2, 20)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        _left_by_an_earlier_run(store, config, range(11))
        coordinator = Coordinator(store, config, BSPPolicy())
        for k in range(10):
            coordinator.decide(k)
        assert _stored(store, range(11)) == list(range(11)) and store.forgotten_through() is None
        coordinator.decide(10)
        assert _stored(store, range(11)) == list(range(1, 11)) and store.forgotten_through() == 0


def test_a_clean_up_and_the_guard_work_after_redis_forgot_its_scripts(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SCRIPT FLUSH (what a restart does) before the first clean-up, whose script runs inside MULTI, and before a
    guarded write: both load their script again. Fails where the clean-up's transaction sends the script by its hash
    alone (NOSCRIPT inside EXEC: the keys deleted, the watermark not raised, the step failed)."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 10)
    config = JobConfig(job, 2, 20)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        _left_by_an_earlier_run(store, config, range(61))
        coordinator = Coordinator(store, config, BSPPolicy())
        store.client.script_flush()
        coordinator.decide(60)
        assert _stored(store, range(61)) == list(range(51, 61)) and store.forgotten_through() == 50
        store.client.script_flush()
        assert store.publish_all([Assignment(job, 8, (10, 10), "bsp")], decided_from=7) == [None]


@pytest.mark.timeout(60)
def test_after_a_restart_that_kept_its_data_the_watermark_stands_and_clean_ups_go_on(
        job: str, own_server: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded server killed and started again from its append-only file: the watermark and the deletes of the
    clean-up's transaction are kept (its scripts too on Redis 6, which logs SCRIPT LOAD there; Redis 7 starts without
    them, as the flush does); the coordinator's next clean-up raises the watermark, and a stale write below it is still
    refused."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 10)
    config = JobConfig(job, 2, 20)
    with Store.from_url(own_server.url, job) as store:
        store.register(config)
        _left_by_an_earlier_run(store, config, range(62))
        coordinator = Coordinator(store, config, BSPPolicy())
        coordinator.decide(60)
        own_server.restart()
        store.client.script_flush()
        assert store.forgotten_through() == 50
        assert _stored(store, range(61)) == list(range(51, 61))
        coordinator.decide(61)
        assert store.forgotten_through() == 51 and _stored(store, range(62)) == list(range(52, 62))
        assert store.publish_all([Assignment(job, 51, (10, 10), "bsp")], decided_from=50) == [None]


@pytest.mark.parametrize("value", ["12abc", "1_000", "", "nan", "0x10", "-"])
def test_a_watermark_that_is_no_number_neither_refuses_a_write_above_it_nor_survives_a_clean_up(
        redis_url: str, job: str, value: str) -> None:
    """A value that Lua's tonumber and Python's int both read as no number (or as a small one): a coordinator's write
    of iteration 50 whose keys were never stored goes through, and the next clean-up writes its own watermark over
    the value. Fails where the guard takes an unreadable watermark for a high one, or the clean-up keeps it."""
    config = JobConfig(job, 2, 20)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        store.client.set(store.key("forgotten"), value)
        assert store.publish_all([Assignment(job, 50, (10, 10), "bsp")], decided_from=49) == [True]
        store.forget_iterations(0, 100)
        assert store.forgotten_through() == 100


@pytest.mark.parametrize("value", ["inf", "1e400", "9" * 5000])
def test_a_watermark_that_python_reads_as_none_is_none_to_the_guard_too(redis_url: str, job: str, value: str) -> None:
    """A value in the key that the coordinator reads as no watermark (forgotten_through() is None, so its first
    clean-up reaches from 0): the script took it for infinity, refused a write of iteration 1,000,000 whose keys were
    never stored, and kept it through every clean-up (its TTL renewed), since it never lowers the watermark."""
    config = JobConfig(job, 2, 20)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        store.client.set(store.key("forgotten"), value)
        assert store.forgotten_through() is None
        written = store.publish_all([Assignment(job, 10**6, (10, 10), "bsp")], decided_from=10**6 - 1)
        store.forget_iterations(0, 100)
        assert (written, store.forgotten_through()) == ([True], 100)


@pytest.mark.timeout(60)
def test_a_sigterm_half_way_through_starting_the_coordinator_process_leaves_no_half_made_child(
        redis_url: str, job: str, tmp_path: Path) -> None:
    """The SIGTERM arrives when half of the child's pickled arguments are written: the script exits as its handler says,
    and the child, started whole and then stopped, prints nothing (it had printed "pickle data was truncated")."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import builtins, os, signal, sys
        import multiprocessing.popen_spawn_posix as popen
        from lbbsp import JobConfig
        from lbbsp.coordinator_process import CoordinatorProcess

        class StoppedHalfWay:
            def __init__(self, *args, **kwargs):
                self._file = builtins.open(*args, **kwargs)
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                self._file.close()
            def write(self, data):
                self._file.write(data[:len(data) // 2])
                self._file.flush()
                os.kill(os.getpid(), signal.SIGTERM)
                self._file.write(data[len(data) // 2:])

        if __name__ == "__main__":
            popen.open = StoppedHalfWay  # the pipe to the spawned child
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
            CoordinatorProcess({redis_url!r}, JobConfig({job!r}, 2, 8), start_timeout_s=20)
            print("NOT STOPPED")
    """))
    done = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=50)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert "NOT STOPPED" not in done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_coordinator_that_keeps_up_again_decides_one_iteration_at_a_time_again(
        store: Store, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """Decisions slower than the workers' steps make each decision cover several iterations (ahead > 1); once the
    decisions are fast again (a policy's model that no longer refits, say), ahead must come back to 1, or the split
    would follow the workers' speeds ``ahead`` iterations late for the rest of the run. Driven through _pace with
    chosen times: the decision's time is perf_counter() - started."""
    coordinator = Coordinator(store, JobConfig(job, 2, 10, lag=2), BSPPolicy())
    fast_steps = [Report(job, w, 0, 5, 0.01) for w in range(2)]
    for k in range(5):  # 0.3 s a decision against steps of 10 ms
        coordinator._pace(k, time.perf_counter() - 0.3, fast_steps)
    assert coordinator.ahead > 1
    slow_steps = [Report(job, w, 0, 5, 1.0) for w in range(2)]
    coordinator._next_pace_log = 0.0  # the change is logged at most once a minute
    with caplog.at_level(logging.INFO, logger="lbbsp.coordinator"):
        for k in range(5, 10):  # decisions of about nothing against steps of 1 s
            coordinator._pace(k, time.perf_counter(), slow_steps)
    assert coordinator.ahead == 1
    assert "keeps up with the workers again" in caplog.text


def _construct_in_daemon(url: str, job: str, answers: Any) -> None:
    try:
        CoordinatorProcess(url, JobConfig(job, 2, 8))
    except LBBSPError as exc:
        answers.put(exc.message)
    else:
        answers.put("started")


def test_a_daemonic_process_is_told_how_to_start_the_coordinator_instead() -> None:
    """A daemonic process cannot have children: multiprocessing's own AssertionError ("daemonic processes are not
    allowed to have children") named neither lbbsp nor what to do. Refused before Redis is asked (none listens at
    this URL)."""
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    child = context.Process(target=_construct_in_daemon, args=("redis://127.0.0.1:1/0", "daemonic", answers),
                            daemon=True)
    child.start()
    try:
        said = answers.get(timeout=30)
    finally:
        child.join(10)
    assert "a daemonic process cannot start the coordinator process" in said and "daemon=False" in said, said


class _FailsInTheChild(BSPPolicy):
    """Pickles, but its unpickling fails in the coordinator's child (int("...") raises), as a policy whose module the
    child cannot import does: the child exits before it serves."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (int, ("not a policy in the child",))


class _SlowInTheChild(BSPPolicy):
    """Its unpickling in the coordinator's child sleeps a minute: the child is still starting."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (time.sleep, (60,))


@pytest.mark.timeout(60)
def test_a_child_killed_as_it_starts_is_said_so_not_sent_to_a_traceback(redis_url: str, job: str) -> None:
    """A child killed before it served (a SIGTERM to the process group as a job starts) had been reported as
    "(exit code -15); its traceback is above", where there was none."""
    def kill_the_child() -> None:
        while True:
            starting = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
            if starting:
                starting[0].send_signal(signal.SIGTERM)
                return
            time.sleep(0.05)

    threading.Thread(target=kill_the_child, daemon=True).start()
    with pytest.raises(LBBSPError, match=r"the coordinator process was killed as it started \(exit code -15, "
                                         r"SIGTERM\) \[job=") as raised:
        CoordinatorProcess(redis_url, JobConfig(job, 2, 8), _SlowInTheChild(), start_timeout_s=50)
    assert "traceback" not in str(raised.value)


@pytest.mark.timeout(60)
def test_a_child_that_exits_before_it_serves_is_an_error_and_a_restart_that_fails_is_logged(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 2, 8)
    with pytest.raises(LBBSPError, match=r"the coordinator process exited or did not start within 20s "
                                         r"\(exit code 1\); its traceback is above \[job="):
        CoordinatorProcess(redis_url, config, _FailsInTheChild(), start_timeout_s=20)
    # a child that served, then died, whose restart fails so: logged, and left dead once RESTARTS are spent (no loop)
    running = CoordinatorProcess(redis_url, config, BSPPolicy(), start_timeout_s=20)
    running.RESTARTS = 1
    try:
        running._args = (running._args[0], running._args[1], _FailsInTheChild(), *running._args[3:])
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            os.kill(running._process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            _until(lambda: "not starting it again" in caplog.text, 30.0)
        assert f"could not start the coordinator process of job {job} again" in caplog.text
        assert "(exit code 1); its traceback is above" in caplog.text
        assert not running.alive and running.restarts == 0
    finally:
        running.stop()
