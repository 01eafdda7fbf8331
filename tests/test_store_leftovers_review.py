"""Left from earlier reviews: a coordinator that resumes after another one's clean-up, a coordinator's first clean-up,
and a policy that exits."""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

import lbbsp.coordinator
from lbbsp import Assignment, BSPPolicy, Coordinator, JobConfig, Report, Store, WorkerClient
from lbbsp.policies import Decision
from tests.test_coordinators_review import train


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
    from test_policy_leftovers_review import _reports  # noqa: PLC0415

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
