"""Coordinator and workers in real processes over a real redis-server: convergence, agreement, bad input."""
from __future__ import annotations

import gc
import json
import logging
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from emulated import DelayedPolicy, HeapProbePolicy, run_coordinator, run_worker, worker_clients
from lbbsp import (
    AllocationError,
    Assignment,
    BSPPolicy,
    ConfigError,
    Coordinator,
    CoordinatorProcess,
    Decision,
    EmbeddedRedis,
    JobConfig,
    LBBSPPolicy,
    ProtocolError,
    Report,
    Store,
)
from lbbsp.coordinator import MAX_AHEAD
from lbbsp.store import ITERATIONS_KEPT

SPAWN = mp.get_context("spawn")


def read_logs(paths: list[Path]) -> list[list[dict]]:
    return [[json.loads(line) for line in p.read_text().splitlines()] for p in paths]


def start_workers(url: str, config: JobConfig, speeds: list[list[float]], iterations: int,
                  tmp_path: Path) -> tuple[list[mp.Process], list[Path]]:
    paths = [tmp_path / f"worker{i}.jsonl" for i in range(config.num_workers)]
    procs = [SPAWN.Process(target=run_worker, args=(url, config.to_json(), i, speeds[i], iterations, str(paths[i])))
             for i in range(config.num_workers)]
    for p in procs:
        p.start()
    return procs, paths


def join_all(procs: list[mp.Process], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a worker hung"
    assert all(p.exitcode == 0 for p in procs)


@pytest.mark.timeout(120)
def test_sizes_converge_to_speed_within_three_iterations(redis_url: str, job: str, tmp_path: Path) -> None:
    config = JobConfig(job, 4, 100, assignment_timeout_s=5.0)
    store = Store.from_url(redis_url, job)
    coordinator = Coordinator(store, config).start()
    try:
        speeds = [[1000.0 * (i + 1)] for i in range(4)]
        procs, paths = start_workers(redis_url, config, speeds, 8, tmp_path)
        join_all(procs, 90)
    finally:
        coordinator.stop()
        store.close()
    logs = read_logs(paths)
    for k in range(8):
        vectors = {tuple(log[k]["sizes"]) for log in logs}
        assert len(vectors) == 1
        assert sum(vectors.pop()) == 100
    for k in range(3, 8):
        sizes = logs[0][k]["sizes"]
        assert all(abs(s - 10 * (i + 1)) <= 1 for i, s in enumerate(sizes)), sizes


@pytest.mark.timeout(240)
def test_every_worker_uses_one_vector_through_delays_crashes_and_a_redis_restart(job: str, tmp_path: Path) -> None:
    # Redis's restart must fit in the bound (a worker that cannot reach Redis past it uses its own fallback, and
    # this test's raw clients have no agree= broadcast): 0.8 s leaves a loaded machine room
    timeout = 0.8
    iterations = 60
    config = JobConfig(job, 4, 120, assignment_timeout_s=timeout)
    speeds = [[2000.0], [4000.0, 1500.0], [3000.0], [6000.0, 6000.0, 1000.0]]
    with EmbeddedRedis(tmp_path / "redis") as server, Store.from_url(server.url, job) as store:

        def serving(not_by: str | None = None) -> str | None:
            """The identity of the coordinator that claims the job, once one other than ``not_by`` does: a spawned
            coordinator takes seconds to import on a loaded machine, and the workers' 15 iterations had all run on
            fallbacks before it served (the test failed: no 'lbbsp' split)."""
            deadline = time.monotonic() + 60
            while (claim := store.coordinator()) in (None, not_by) and time.monotonic() < deadline:
                time.sleep(0.02)
            return claim

        coordinator = SPAWN.Process(target=run_coordinator, args=(server.url, config.to_json(), 0.6, 0.15, 1))
        coordinator.start()
        first = serving()
        procs, paths = start_workers(server.url, config, speeds, iterations, tmp_path)

        def progress() -> int:
            lines = [p.read_text().count("\n") if p.exists() else 0 for p in paths]
            return min(lines)

        def wait_for(k: int) -> None:
            deadline = time.monotonic() + 60
            while progress() < k and time.monotonic() < deadline:
                time.sleep(0.02)

        wait_for(15)
        coordinator.kill()  # the coordinator dies without a word
        coordinator.join()
        wait_for(20)  # the workers go on, on fallback vectors
        coordinator = SPAWN.Process(target=run_coordinator, args=(server.url, config.to_json(), 0.6, 0.15, 2))
        coordinator.start()
        serving(not_by=first)
        wait_for(35)
        server.restart(kill=True)  # redis-server crashes and comes back on the same socket
        join_all(procs, 150)
        coordinator.kill()
        coordinator.join()
    logs = read_logs(paths)
    assert all(len(log) == iterations for log in logs)
    for k in range(iterations):
        vectors = {tuple(log[k]["sizes"]) for log in logs}
        assert len(vectors) == 1, f"iteration {k}: workers used {vectors}"
        assert sum(vectors.pop()) == 120
    waits = [entry["waited"] for log in logs for entry in log]
    assert max(waits) < timeout + 2.0, max(waits)  # every wait is bounded
    policies = {entry["policy"] for log in logs for entry in log}
    assert {"fallback", "lbbsp"} <= policies  # both paths really ran


@pytest.mark.timeout(150)
@pytest.mark.parametrize("in_process", [True, False], ids=["thread", "process"])
@pytest.mark.parametrize("max_ahead", [MAX_AHEAD, 1])
def test_a_coordinator_slower_than_the_steps_runs_ahead_and_every_iteration_keeps_one_split(
        redis_url: str, job: str, tmp_path: Path, max_ahead: int, in_process: bool) -> None:
    """Decisions of 40 ms against steps of 5-10 ms. Running ahead, one decision covers several iterations, so the
    workers do not wait for each: every iteration still has one split, written by the coordinator (no fallback),
    and the split still follows the workers' speeds. With ``max_ahead=1`` it decides every iteration, as before;
    a coordinator in a process of its own takes ``max_ahead`` as one in a thread does."""
    iterations = 150
    config = JobConfig(job, 2, 60)
    store = Store.from_url(redis_url, job)
    policy = DelayedPolicy(0.04, 1.0, seed=0)
    coordinator = (Coordinator(store, config, policy, max_ahead=max_ahead).start() if in_process
                   else CoordinatorProcess(redis_url, config, policy, max_ahead=max_ahead))
    try:
        procs, paths = start_workers(redis_url, config, [[6000.0], [3000.0]], iterations, tmp_path)
        join_all(procs, 120)
    finally:
        coordinator.stop()
    logs = read_logs(paths)
    for k in range(iterations):
        vectors = {tuple(log[k]["sizes"]) for log in logs}
        assert len(vectors) == 1 and sum(vectors.pop()) == 60, k
        assert not logs[0][k]["fallback"], k
    assert logs[0][-1]["sizes"][0] > logs[0][-1]["sizes"][1]  # the faster worker does more
    decisions = [json.loads(d) for d in store.decisions(1000)]
    spans = {record["through"] - record["iteration"] + 1 for record in decisions}
    if max_ahead == 1:
        assert spans == {1} and len(decisions) >= iterations - config.lag
        assert not isinstance(coordinator, Coordinator) or coordinator.ahead == 1
    else:
        assert max(spans) > 1 and len(decisions) < iterations / 2
        assert not isinstance(coordinator, Coordinator) or coordinator.ahead > 1
        # the margins score each decision's newest reports against the split they ran on, though few of those
        # iterations had a decision of their own
        assert policy.risk is not None
        assert not in_process or policy.risk.pooled_.sum() >= 2 * (len(decisions) - 2), policy.risk.pooled_
        status = subprocess.run([sys.executable, "-m", "lbbsp.cli", "status", "--redis", redis_url, "--job", job,
                                 "--decisions", "3"], check=False, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert re.search(r"\b\d+-\d+\b", status.stdout), status.stdout  # the iterations a decision covers
    store.close()


def test_a_decision_also_writes_the_iterations_whose_reports_it_skipped(redis_url: str, job: str) -> None:
    """Deciding from iteration 3 after 0, the coordinator writes the split of 4 (whose reports, of 2, it skipped,
    as one that runs behind does) with that of 5, instead of leaving the workers to wait for 4 and fall back."""
    config = JobConfig(job, 2, 20)
    store = Store.from_url(redis_url, job)
    coordinator = Coordinator(store, config, BSPPolicy())
    with worker_clients(redis_url, config) as clients:
        for k in range(4):
            for client in clients:
                client.report(k, 10, 0.1)
                client.flush()
        first = coordinator.decide(0)
        later = coordinator.decide(3)
    assert (first.assignment.iteration, first.through) == (2, 2)
    assert (later.assignment.iteration, later.through) == (4, 5) and later.written
    assert store.get_assignment(3) is None  # no decision's: the workers ran 3 on what they agreed
    assert all(store.get_assignment(k) is not None for k in (2, 4, 5))
    store.close()


@pytest.mark.timeout(60)
def test_hostile_reports_are_rejected_and_the_coordinator_keeps_serving(redis_url: str, job: str) -> None:
    config = JobConfig(job, 3, 30, lag=1)
    store = Store.from_url(redis_url, job)
    coordinator = Coordinator(store, config)
    with worker_clients(redis_url, config) as clients:
        hostile = {
            "NaN": b'{"v":1,"job":"%s","worker":1,"iteration":%d,"samples":10,"compute_s":NaN}',
            "negative": b'{"v":1,"job":"%s","worker":1,"iteration":%d,"samples":-10,"compute_s":0.1}',
            "huge": b'{"v":1,"job":"%s","worker":1,"iteration":%d,"samples":10,"compute_s":1e300}',
            "wrong job": b'{"v":1,"job":"x%s","worker":1,"iteration":%d,"samples":10,"compute_s":0.1}',
            "wrong type": b'{"v":1,"job":"%s","worker":"1","iteration":%d,"samples":10,"compute_s":0.1}',
            "pickle": b"\x80\x04\x95%s%d.",
        }
        expected_field = {"NaN": "payload", "negative": "samples", "huge": "compute_s", "wrong job": "job",
                          "wrong type": "worker", "pickle": "payload"}
        for k, (kind, template) in enumerate(hostile.items()):
            sizes = clients[0].assignment(k).sizes
            assert store.post_raw_report(k, "1", template % (job.encode(), k), 3) == 1
            for i in (0, 2):
                clients[i].report(k, sizes[i], 0.01 * (i + 1))
                clients[i].flush()
            outcome = coordinator.step(timeout_s=5)
            assert outcome is not None and outcome.written, kind
            assert [r.worker for r in outcome.rejected] == ["1"], kind
            assert f"{expected_field[kind]}:" in outcome.rejected[0].error, (kind, outcome.rejected[0].error)
            assert clients[2].assignment(k + 1) == outcome.assignment
        oversized = b'{"v":1,"pad":"' + b"x" * 5000 + b'"}'
        assert store.post_raw_report(99, "1", oversized, 3) == -1  # refused inside Redis, never stored
        assert store.post_raw_report(99, "7", b"{}", 3) == -2  # not one of the job's workers: never counted
        assert store.report_count(99) == 0
        record = json.loads(store.decisions(1)[0])
        assert record["rejected"][0]["worker"] == "1"
        with pytest.raises(ProtocolError, match="compute_s"):
            clients[0].report(50, 10, float("nan"))  # rejected at the edge, before it is sent
        with pytest.raises(ProtocolError, match="features.bogus"):
            Report(job, 0, 0, 1, 0.1, features={"bogus": 1.0})
    store.close()


@pytest.mark.timeout(60)
def test_a_late_coordinator_loses_to_the_fallback_and_says_so(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.2, lag=1)
    store = Store.from_url(redis_url, job)
    with worker_clients(redis_url, config) as clients:
        for i, client in enumerate(clients):
            assert client.assignment(0).sizes == (5, 5)
            client.report(0, 5, 0.05 * (i + 1))
            client.flush()
        late = clients[0].assignment(1)  # no coordinator yet: the worker writes its fallback
        assert late.fallback and late.sizes == (5, 5)
        outcome = Coordinator(store, config).step(timeout_s=5)
        assert outcome is not None and not outcome.written and outcome.assignment == late
        assert clients[1].assignment(1) == late
        assert json.loads(store.decisions(1)[0])["written_by_coordinator"] is False
    store.close()


def test_a_job_cannot_be_joined_with_other_settings(redis_url: str, job: str) -> None:
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 10))
        with pytest.raises(ConfigError) as raised:
            store.register(JobConfig(job, 2, 12, lag=1))
    # only the settings that differ, the job's first: a whole repr of both configs hid them among the equal ones
    assert raised.value.message == (f"job {job!r} already runs with global_batch=10 (not 12), lag=2 (not 1); use "
                                    "another job name or the same settings")


class FailsOnce(LBBSPPolicy):
    """Fails its first decision in the given way: raising ``error``, or returning ``sizes``."""

    def __init__(self, error: Exception | None = None, sizes: tuple | None = None) -> None:  # type: ignore[type-arg]
        super().__init__()
        self.error, self.sizes, self.failed = error, sizes, False

    def decide(self, iteration, current, config):  # type: ignore[no-untyped-def]
        if not self.failed:
            self.failed = True
            if self.error is not None:
                raise self.error
            return Decision(self.sizes, "broken")
        return super().decide(iteration, current, config)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", [FailsOnce(AllocationError("injected")), FailsOnce(ZeroDivisionError("bug")),
                                    FailsOnce(sizes=(3, 3)), FailsOnce(sizes=(-5, 15)), FailsOnce(sizes=(4.5, 5.5)),
                                    FailsOnce(sizes=(10,))],
                         ids=["raises-lbbsp-error", "raises-bug", "wrong-sum", "negative", "fractional", "too-few"])
def test_a_failing_or_broken_policy_keeps_the_split_and_the_coordinator_serving(redis_url: str, job: str,
                                                                                 policy: FailsOnce) -> None:
    config = JobConfig(job, 2, 10, assignment_timeout_s=5.0, lag=1)
    store = Store.from_url(redis_url, job)
    coordinator = Coordinator(store, config, policy).start()
    with worker_clients(redis_url, config) as clients:
        vectors = []
        for k in range(3):
            started = time.monotonic()
            sizes = [client.assignment(k) for client in clients]
            assert time.monotonic() - started < config.assignment_timeout_s  # nobody waited for a fallback
            assert sizes[0] == sizes[1]
            vectors.append(sizes[0])
            for i, client in enumerate(clients):
                client.report(k, sizes[0].sizes[i], 0.01 * (i + 1) * sizes[0].sizes[i])
        # the failed decision: the coordinator itself wrote the split in force, and why
        assert not vectors[1].fallback and vectors[1].sizes == vectors[0].sizes
        assert "policy failed" in vectors[1].reason
        assert vectors[2].policy == "lbbsp" and vectors[2].reason.startswith("rebalanced")  # serving again
        coordinator.stop()
    store.close()


class LearnsAfterTheWrite(LBBSPPolicy):
    """Notes, whenever it learns, whether the split it just decided is already in Redis."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store
        self.published_before_learning: list[bool] = []
        self._target: int | None = None

    def decide(self, iteration, current, config):  # type: ignore[no-untyped-def]
        self._target = iteration
        return super().decide(iteration, current, config)

    def learn(self) -> None:
        if self._target is not None:
            self.published_before_learning.append(self.store.get_assignment(self._target) is not None)
            self._target = None
        super().learn()


def test_the_policy_learns_after_the_split_is_written(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 64)
    store = Store.from_url(redis_url, job)
    policy = LearnsAfterTheWrite(store)
    coordinator = Coordinator(store, config, policy)
    for k in range(4):
        for i, size in enumerate(config.initial_sizes()):
            store.client.hset(store.key("reports", k), str(i), Report(job, i, k, size, 0.01 * (i + 1) * size).to_json())
        outcome = coordinator.decide(k)
        assert outcome.learn_s > 0
    assert policy.published_before_learning == [True] * 4
    assert json.loads(store.decisions(1)[0])["learn_ms"] > 0
    store.close()


def test_a_long_job_keeps_only_its_latest_iterations_in_redis(redis_url: str, job: str) -> None:
    """Deciding from iteration k deletes the reports and the assignment of k - ITERATIONS_KEPT: kept for ttl_s, a
    long job's filled Redis (9.8 GB an hour at 1,024 workers and 10 iterations a second)."""
    config = JobConfig(job, 2, 64)
    iterations = ITERATIONS_KEPT + 3
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as clients:
        coordinator = Coordinator(store, config)
        for k in range(iterations):
            for i, client in enumerate(clients):  # the workers read each split, as in a job
                assert client.assignment(k).sizes[i] >= 1
            assert store.post_reports([Report(job, i, k, 1, 0.01 * (i + 1)) for i in range(2)], 2) == 2
            assert store.next_ready(1.0) == k
            assert coordinator.decide(k).written
        assert [store.report_count(k) for k in range(iterations)] == [0] * 3 + [2] * ITERATIONS_KEPT
        assert [store.get_assignment(k) is not None for k in range(iterations + config.lag)] == (
            [False] * 3 + [True] * (ITERATIONS_KEPT + config.lag))
        assert all(json.loads(d)["rejected"] == [] for d in store.decisions(iterations))


@pytest.mark.timeout(90)
def test_a_coordinator_process_serves_and_stops(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 30)
    coordinator = CoordinatorProcess(redis_url, config)  # returns once it serves
    with worker_clients(redis_url, config) as clients:
        for k in range(3):
            for i, client in enumerate(clients):
                size = client.assignment(k).sizes[i]
                client.report(k, size, size / (100.0 * (1 + 2 * i)))
        assert clients[1].assignment(3).sizes == (7, 23)  # decided in the child process from iteration 1
        coordinator.stop()
        coordinator.stop()
        assert not coordinator.alive


@pytest.mark.timeout(90)
def test_a_coordinator_process_freezes_its_heap_and_one_in_a_thread_leaves_the_callers_alone(
        redis_url: str, job: str) -> None:
    """The child's full garbage collections scan what serving allocates, not every object its imports made (each
    paused a decision at 1,024 workers by 50-70 ms); the training process's collector is the user's."""
    def frozen_in(coordinator: Coordinator | CoordinatorProcess, config: JobConfig) -> int:
        try:
            with worker_clients(redis_url, config) as clients:
                for client in clients:
                    client.report(0, 15, 0.1)
                reason = clients[0].assignment(2).reason
        finally:
            coordinator.stop()
        assert reason.startswith("frozen "), reason
        return int(reason.removeprefix("frozen "))

    assert frozen_in(CoordinatorProcess(redis_url, JobConfig(job, 2, 30), HeapProbePolicy()),
                     JobConfig(job, 2, 30)) > 10_000  # numpy's, scikit-learn's, redis's and lbbsp's objects
    before = gc.get_freeze_count()
    with Store.from_url(redis_url, f"{job}-thread") as store:
        thread_config = JobConfig(f"{job}-thread", 2, 30)
        assert frozen_in(Coordinator(store, thread_config, HeapProbePolicy()).start(), thread_config) == before


def test_a_coordinator_process_refuses_other_settings_before_it_starts(redis_url: str, job: str) -> None:
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 30))
    with pytest.raises(ConfigError, match="already runs with"):
        CoordinatorProcess(redis_url, JobConfig(job, 2, 32))


def test_reports_posted_together_count_as_posted_one_by_one(redis_url: str, job: str) -> None:
    with Store.from_url(redis_url, job) as store:
        reports = [Report(job, w, 0, 10, 0.1) for w in (0, 1)]
        assert store.post_reports([*reports, reports[0]], 3) == 2  # the repeat is a duplicate, not stored again
        assert store.next_ready(0.01) is None  # 2 of 3 workers: not complete
        assert store.post_reports([Report(job, 2, 0, 10, 0.1)], 3) == 1
        assert store.next_ready(1.0) == 0
        assert sorted(store.reports(0)) == [b"0", b"1", b"2"]


def test_the_config_key_lives_as_long_as_the_job_and_ttl_s_is_the_jobs(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 10, ttl_s=60)
    with Store.from_url(redis_url, job) as store:  # a store made with the default TTL
        coordinator = Coordinator(store, config)
        assert 0 < store.client.ttl(store.key("config")) <= 60
        store.client.expire(store.key("config"), 3)  # as if the job had run for most of its TTL
        for i, size in enumerate(config.initial_sizes()):
            store.post_report(Report(job, i, 0, size, 0.01 * size), 2)
        coordinator.decide(0)
        assert store.client.ttl(store.key("config")) > 50  # renewed by the decision
        assert 50 < store.client.ttl(store.key("assign", 2)) <= 60
        # a read renews the assignment: it is written an iteration before it is read, and with a short TTL it
        # expired between two workers' reads, so the second wrote and used a fallback the first never saw
        store.client.expire(store.key("assign", 2), 3)
        assert store.get_assignment(2) is not None and store.client.ttl(store.key("assign", 2)) > 50


class Verbose(LBBSPPolicy):
    """A policy whose errors, reasons and name are longer than an assignment holds."""

    name = "a-policy-with-a-name-longer-than-the-sixty-four-characters-an-assignment-holds"

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail

    def decide(self, iteration, current, config):  # type: ignore[no-untyped-def]
        if self.fail:
            raise ValueError("x" * 600)
        return Decision(tuple(current), "y" * 2000)


@pytest.mark.parametrize("fail", [True, False], ids=["long error", "long reason"])
def test_long_reasons_and_names_are_cut_not_refused(redis_url: str, job: str, fail: bool) -> None:
    """A policy error of 600 characters made even the kept split's assignment invalid: nothing was written,
    and every iteration waited out assignment_timeout_s for a worker's fallback."""
    config = JobConfig(job, 2, 10)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, Verbose(fail))
        for i, size in enumerate(config.initial_sizes()):
            store.post_report(Report(job, i, 0, size, 0.01 * size), 2)
        outcome = coordinator.decide(0)
        assert outcome.written and outcome.assignment.sizes == config.initial_sizes()
        assert len(outcome.assignment.reason) == 512 and outcome.assignment.reason.endswith("\u2026")
        assert len(outcome.assignment.policy) == 64


@pytest.mark.parametrize(("key", "value"), [("config", {"a": "b"}), ("decisions", "x")])
def test_a_key_of_another_type_in_the_jobs_place_is_named(redis_url: str, job: str, key: str, value: object) -> None:
    """It was Redis's bare 'WRONGTYPE Operation against a key holding the wrong kind of value'."""
    with Store.from_url(redis_url, job) as store:
        if isinstance(value, dict):
            store.client.hset(store.key(key), mapping=value)
        else:
            store.client.set(store.key(key), value)
        with pytest.raises(ConfigError, match=f"Redis key lbbsp:{job}:{key} holds a value of another type"):
            Coordinator(store, JobConfig(job, 2, 10))


def test_a_second_coordinator_and_a_reused_job_name_are_warned_about(redis_url: str, job: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 2, 10)
    with Store.from_url(redis_url, job) as store:
        first = Coordinator(store, config)
        first._heartbeat()
        second = Coordinator(store, config)
        with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
            second._heartbeat()
            assert "another coordinator" not in caplog.text  # first may have just stopped: its claim lasts 5 s
            first._next_heartbeat = second._next_heartbeat = 0.0
            first._heartbeat()  # it is alive: it claims the job back
            second._heartbeat()
        assert "another coordinator" in caplog.text and first._identity in caplog.text
        for i, size in enumerate(config.initial_sizes()):
            store.post_report(Report(job, i, 0, size, 0.01 * size), 2)
        first.decide(0)
        caplog.clear()
        with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
            Coordinator(store, config)
        assert "already has 1 decisions" in caplog.text and "new job name" in caplog.text
        # a coordinator restarted during the run (CoordinatorProcess's after a crash) had been told to rename the job
        assert "right for a coordinator restarted during the run" in caplog.text


def test_a_crashed_coordinators_claim_is_not_taken_for_a_live_one(redis_url: str, job: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A coordinator killed with SIGKILL leaves its claim for up to 5 s: the next one warned that another
    coordinator was serving the job."""
    config = JobConfig(job, 2, 10)
    with Store.from_url(redis_url, job) as store:
        store.claim_coordinator("host:12898:dead", ttl_s=5)
        restarted = Coordinator(store, config)
        with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
            for _ in range(3):
                restarted._next_heartbeat = 0.0
                restarted._heartbeat()
    assert "another coordinator" not in caplog.text


def test_a_stopped_coordinator_leaves_no_claim_for_the_next_run_to_be_warned_about(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 2, 10)
    with Store.from_url(redis_url, job) as store:
        Coordinator(store, config).start().stop()
        assert store.client.get(store.key("coordinator")) is None
        rerun = Coordinator(store, config)
        with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
            rerun._heartbeat()
    assert "another coordinator" not in caplog.text


@pytest.mark.timeout(120)
def test_a_coordinator_process_that_trains_instead_of_serving_says_to_guard_the_script(
        redis_url: str, job: str, tmp_path: Path) -> None:
    # the policy's class lives in the script, so the child runs the script to load it; unguarded, the
    # script's training runs there (a sleep stands in for it) and the child never serves
    script = tmp_path / "train.py"
    script.write_text(f"""
import time
from lbbsp import BSPPolicy, CoordinatorProcess, JobConfig, LBBSPError


class MyPolicy(BSPPolicy):
    name = "mine"


if __name__ == "__mp_main__":
    time.sleep(60)
try:
    CoordinatorProcess({redis_url!r}, JobConfig({job!r}, 2, 10), MyPolicy(), start_timeout_s=5)
except LBBSPError as exc:
    print(exc)
""")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, check=False)
    assert "did not start within 5" in result.stdout and "__name__" in result.stdout, result.stdout + result.stderr


def test_a_worker_without_a_coordinator_says_so_once(redis_url: str, job: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 1, 10, assignment_timeout_s=0.05, lag=1)
    with worker_clients(redis_url, config) as clients, caplog.at_level("WARNING", logger="lbbsp.worker"):
        for k in range(4):
            assert clients[0].assignment(k).sizes == (10,)
    warnings = [r for r in caplog.records if "is a coordinator running" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited: one line, not one per iteration


@pytest.mark.timeout(120)
def test_a_coordinator_process_does_not_run_an_unguarded_script_again(redis_url: str, job: str,
                                                                       tmp_path: Path) -> None:
    # top-level code, as a training script without `if __name__ == "__main__":` would have it
    script = tmp_path / "train.py"
    script.write_text(f"""
import sys
from lbbsp import CoordinatorProcess, JobConfig
print("script body", flush=True)
coordinator = CoordinatorProcess({redis_url!r}, JobConfig({job!r}, 2, 10), start_timeout_s=30)
print("serving", coordinator.alive, flush=True)
coordinator.stop()
""")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("script body") == 1 and "serving True" in result.stdout


@pytest.mark.timeout(120)
def test_a_coordinator_process_warns_of_a_horizon_not_its_lag_once(redis_url: str, job: str, tmp_path: Path) -> None:
    """The warning came twice, from the parent's check and from the child's coordinator: now the child's alone."""
    script = tmp_path / "train.py"
    script.write_text(f"""
from lbbsp import CoordinatorProcess, JobConfig, LBBSPPolicy
from lbbsp.models import NARXThroughput
if __name__ == "__main__":
    CoordinatorProcess({redis_url!r}, JobConfig({job!r}, 2, 10, lag=1), LBBSPPolicy(NARXThroughput())).stop()
""")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("forecasts 2 iteration(s) ahead (horizon=2)") == 1, result.stderr


@pytest.mark.timeout(120)
def test_a_coordinator_process_runs_a_policy_defined_in_the_script(redis_url: str, job: str, tmp_path: Path) -> None:
    # the child needs the script to unpickle the policy, so the script runs there again, under its guard; here
    # from a rank that was itself spawned (as torch.multiprocessing.spawn starts ranks), where the script's
    # module is named __mp_main__
    script = tmp_path / "train.py"
    script.write_text(f"""
import multiprocessing as mp
from lbbsp import BSPPolicy, CoordinatorProcess, JobConfig


class MyPolicy(BSPPolicy):
    name = "mine"


def rank() -> None:
    coordinator = CoordinatorProcess({redis_url!r}, JobConfig({job!r}, 2, 10), MyPolicy(), start_timeout_s=30)
    print("serving", coordinator.alive, flush=True)
    coordinator.stop()


if __name__ == "__main__":
    rank()
    child = mp.get_context("spawn").Process(target=rank)
    child.start()
    child.join()
    raise SystemExit(child.exitcode)
""")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("serving True") == 2


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie that no one reaps, as in a container, counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.timeout(90)
def test_a_coordinator_process_stops_when_its_parent_is_killed(redis_url: str, job: str) -> None:
    """Rank 0 SIGKILLed (the OOM killer, say) left its coordinator child serving for good."""
    code = ("import sys, time\nfrom lbbsp import CoordinatorProcess, JobConfig\n"
            "p = CoordinatorProcess(sys.argv[1], JobConfig(sys.argv[2], 2, 10))\n"
            "print(p._process.pid, flush=True)\ntime.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code, redis_url, job], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    with parent.stdout:
        child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    orphaned = not _gone(child)
    if orphaned:  # leave no process behind for the rest of the session
        os.kill(child, signal.SIGKILL)
    assert not orphaned, "the coordinator child outlived its parent"


def test_ctrl_c_leaves_the_coordinator_process_to_its_parent(redis_url: str, job: str) -> None:
    """Ctrl-C in a terminal signals the whole process group: the coordinator child printed a KeyboardInterrupt
    traceback of its own; now the training script alone handles it, and stops the child."""
    # The script waits in short sleeps, as a training loop runs bytecode: a signal the kernel hands to another of its
    # threads (the coordinator's watch) is raised in the main thread at its next bytecode, where one long sleep held
    # it back for a minute (the test timed out once in a full suite, with no output at all)
    code = ("import signal, sys, time\nfrom lbbsp import CoordinatorProcess, JobConfig\n"
            "if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:\n"
            "    print('SIGINT handler at start:', signal.getsignal(signal.SIGINT), file=sys.stderr, flush=True)\n"
            "p = CoordinatorProcess(sys.argv[1], JobConfig(sys.argv[2], 2, 10))\n"
            "try:\n    print(p._process.pid, flush=True)\n    for _ in range(600):\n        time.sleep(0.1)\n"
            "except KeyboardInterrupt:\n    p.stop()\n    print('stopped', flush=True)\n")
    parent = subprocess.Popen([sys.executable, "-c", code, redis_url, job], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    os.killpg(parent.pid, signal.SIGINT)
    try:
        out, err = parent.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(parent.pid, signal.SIGKILL)
        out, err = parent.communicate()
        pytest.fail(f"the script did not stop within 30 s of Ctrl-C; its output: {out!r}, {err!r}")
    assert "stopped" in out and _gone(child)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("far", [1000, 103])
def test_an_iteration_no_worker_ran_is_not_decided_from_and_deletes_no_split_still_to_be_read(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture, far: int) -> None:
    """Reports of iteration 1000 posted out of line (the job at 3), or a number pushed on the ready list, had been
    decided from: the coordinator then deleted the assignments of iterations up to 900, some not yet read, and
    the workers that had not read them fell back to splits other than those the others had read. 103: the report
    completing it deletes iteration 3's keys, as a decision from it would, only where 103 has an assignment (it had
    deleted the split of 3, and worker 1 read its fallback where worker 0 had read the decided split)."""
    config = JobConfig(job, 2, 30, lag=1)
    store = Store.from_url(redis_url, job)
    coordinator = Coordinator(store, config)
    with worker_clients(redis_url, config) as clients:
        for k in range(3):
            sizes = clients[0].assignment(k).sizes
            for i, client in enumerate(clients):
                client.report(k, sizes[i], 0.01 * (i + 1))
                client.flush()
            assert coordinator.step(timeout_s=5) is not None
        decided = store.get_assignment(3)  # decided from iteration 2, not yet read by any worker
        assert decided is not None
        for worker in (0, 1):
            store.post_report(Report(job, worker, far, 10, 0.1), 2)
        store.client.rpush(store.key("ready"), -5, 10**30)
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            assert [coordinator.step(timeout_s=1) for _ in range(3)] == [None, None, None]
        assert store.get_assignment(3) == decided  # kept: the workers read the split decided for them
        assert all(clients[i].assignment(3).sizes == Assignment.from_json(decided).sizes for i in (0, 1))
        assert coordinator.failed_decisions == 0
    store.close()
    warned = [r.getMessage() for r in caplog.records if "no worker ran them" in r.getMessage()]
    assert len(warned) == 3 and f"iterations {far} are queued as complete" in warned[0], warned
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # -5 had failed the step with a traceback
