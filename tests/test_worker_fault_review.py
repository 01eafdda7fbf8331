"""Fixes from a fault walkthrough of the worker side: a stored assignment that something else wrote, a coordinator
that is gone for good, and a dropped report's warning that named no job or worker."""
from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import redis

from emulated import rank0_agree
from lbbsp import Assignment, Coordinator, EmbeddedRedis, JobConfig, LBBSPError, Store, WorkerClient
from lbbsp.policies import Decision, Policy


class Constant(Policy):
    """Decides one split, always: whose decisions a worker got shows in its sizes."""

    name = "constant"

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return Decision(self.sizes, "constant")



@contextlib.contextmanager
def _two_workers(url: str, job: str, *, agree: bool) -> Iterator[list[WorkerClient]]:
    """Two workers of a job of global batch 10 (lag 1), with rank 0's ``agree`` if ``agree``."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.5, lag=1)
    rank0 = rank0_agree()
    workers = [WorkerClient(Store.from_url(url, job), config, w, agree=rank0(w) if agree else None) for w in range(2)]
    try:
        yield workers
    finally:
        for worker in workers:
            worker.close()
            worker.store.close()


def _negative_size(job: str) -> bytes:
    payload = json.loads(Assignment(job, 2, (6, 4), "other").to_json())
    return json.dumps({**payload, "sizes": [100, -52]}).encode()


@pytest.mark.parametrize("garbage", ["text", "negative"])
def test_with_agree_an_invalid_stored_assignment_falls_back_agreed_and_names_the_key(
        redis_url: str, job: str, garbage: str, caplog: pytest.LogCaptureFixture) -> None:
    """A value that something else wrote at assign:{k} had stopped every rank with 'stored assignment is invalid',
    naming no key. With agree, the workers use the previous vector, agreed, and go on at the next iteration."""
    with _two_workers(redis_url, job, agree=True) as workers, caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
        store = workers[0].store
        store.publish(Assignment(job, 1, (7, 3), "decided"))
        store.client.set(store.key("assign", 2), b"garbage" if garbage == "text" else _negative_size(job))
        store.publish(Assignment(job, 3, (6, 4), "decided"))
        got = [[worker.assignment(k) for worker in workers] for k in (1, 2, 3)]
    assert [[a.sizes for a in row] for row in got] == [[(7, 3)] * 2, [(7, 3)] * 2, [(6, 4)] * 2]
    fallback = got[1][0]
    assert fallback.fallback and got[1][1] is fallback
    assert f"{store.key('assign', 2)} is invalid" in fallback.reason
    assert not got[2][0].fallback
    warned = [r.getMessage() for r in caplog.records if store.key("assign", 2) in r.getMessage()]
    assert warned and "not written by lbbsp" in warned[0] and "delete the key" in warned[0], warned


def test_without_agree_an_invalid_stored_assignment_raises_naming_the_key(redis_url: str, job: str) -> None:
    """Without agree no worker can fall back alone; the error had said 'stored assignment is invalid: payload:
    assignment is not valid JSON', without the key or what to do."""
    with _two_workers(redis_url, job, agree=False) as workers:
        store = workers[0].store
        store.client.set(store.key("assign", 2), b"garbage")
        for worker in workers:
            with pytest.raises(LBBSPError, match=rf"Redis key {store.key('assign', 2)} .*delete the key"):
                worker.assignment(2)


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Wait for ``condition`` (a coordinator thread's first claim, its decision), failing the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.02)


def test_a_job_no_coordinator_serves_falls_back_without_waiting_until_one_claims_it(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """After its coordinator stopped, every step of a job waited the whole assignment_timeout_s, for good (3.04 s a
    step with a 3 s timeout). Now the first late step waits, the next fall back at once while no coordinator claims the
    job, and once one does the workers get its decisions again."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.5, lag=1)
    workers = [WorkerClient(Store.from_url(redis_url, job), config, w) for w in range(2)]
    first = Coordinator(Store.from_url(redis_url, job), config, Constant((7, 3)), max_ahead=1).start()
    second = Coordinator(Store.from_url(redis_url, job), config, Constant((6, 4)), max_ahead=1)

    def step(k: int) -> tuple[Assignment, float]:
        started = time.monotonic()
        got = [worker.assignment(k) for worker in workers]
        waited = time.monotonic() - started
        assert got[0].sizes == got[1].sizes, k
        for worker in workers:
            worker.report(k, got[0].sizes[worker.worker], 0.01)
            worker.flush()
        return got[0], waited

    try:
        store = workers[0].store
        _until(lambda: store.coordinator() is not None, "the coordinator's claim")
        for k in range(4):
            step(k)
        _until(lambda: store.get_assignment(4) is not None, "the decision from the reports of 3")
        first.stop()
        assert store.coordinator() is None  # its claim released as it stopped
        with caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
            decided = step(4)[0]
            assert decided.sizes == (7, 3) and not decided.fallback
            late, waited = step(5)
            assert late.fallback and "waited" in late.reason and waited >= 0.45
            unserved = [step(k) for k in range(6, 11)]
        assert all(a.fallback and "no coordinator serves" in a.reason for a, _ in unserved), unserved
        assert sum(w for _, w in unserved) < 2 * config.assignment_timeout_s, unserved  # each had waited 0.5 s
        assert [a.sizes for a, _ in unserved] == [(7, 3)] * 5
        warned = [r.getMessage() for r in caplog.records if "no coordinator serves" in r.getMessage()]
        assert len(warned) == 1 and f"lbbsp coordinator --job {job}" in warned[0], warned
        # its coordinator stopped and released the claim: not "none has claimed it for 5 s", which it had said
        assert "its coordinator stopped, or never started" in warned[0] and "for 5 s" not in warned[0], warned
        second.start()
        _until(lambda: store.coordinator() is not None, "the second coordinator's claim")
        resumed = [step(k)[0] for k in range(11, 14)]
        assert resumed[-1].sizes == (6, 4) and not resumed[-1].fallback, resumed
    finally:
        for coordinator in (first, second):
            coordinator.stop()
            coordinator.store.close()
        for worker in workers:
            worker.close()
            worker.store.close()


def test_the_warning_of_a_dropped_report_names_the_job_and_the_worker(job: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Two ranks printed the same line, 'dropped the report of iteration N ...', naming neither."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.2)
    with EmbeddedRedis() as server:
        workers = [WorkerClient(Store.from_url(server.url, job), config, w) for w in range(2)]
        server.stop()
        try:
            with caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
                for worker in workers:
                    worker.report(0, 5, 0.1)
                    worker.flush(3.0)
        finally:
            for worker in workers:
                worker.close()
                worker.store.close()
    dropped = sorted(r.getMessage() for r in caplog.records if "dropped the report" in r.getMessage())
    assert len(dropped) == 2 and all(line.startswith(f"job {job}, worker {w}: ") for w, line in enumerate(dropped))


def test_a_decision_stored_while_no_coordinator_claims_the_job_makes_the_worker_wait_again(
        redis_url: str, job: str) -> None:
    """A Coordinator driven by step() alone holds no claim: once one of its decisions came late, its workers would have
    stopped waiting for good. A decision found stored shows that something decides: the next step waits for it."""
    with _two_workers(redis_url, job, agree=False) as workers:
        worker, store = workers[0], workers[0].store
        assert worker.assignment(1).fallback  # waited, and no coordinator claims the job
        assert worker.assignment(2).fallback  # not waited for
        store.publish(Assignment(job, 3, (7, 3), "decided"))
        assert worker.assignment(3).sizes == (7, 3)
        timer = threading.Timer(0.1, store.publish, [Assignment(job, 4, (6, 4), "decided")])
        timer.start()
        try:
            got = worker.assignment(4)
        finally:
            timer.join()
    assert (got.sizes, got.fallback) == ((6, 4), False), got


class Alternating(Policy):
    """(7, 3) for even iterations, (6, 4) for odd ones: a fallback (the vector of k-1) differs from the decision."""

    name = "alternating"

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return Decision((7, 3) if iteration % 2 == 0 else (6, 4), "alternating")


def test_a_worker_that_lost_redis_waits_afresh_once_it_answers_for_the_decision_put_back(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis restarted without its data while one worker had read iteration k's decision and the other could not
    reach Redis: the second, its wait run out meanwhile, wrote its fallback the moment Redis answered, before the
    coordinator (its heartbeat, about a second) put the lost decision back, and the two workers trained on different
    vectors (tf_keras, no agree). Now a worker waits afresh once Redis answers after failing, and reads the decision."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=2.0, lag=1)
    workers = [WorkerClient(Store.from_url(redis_url, job), config, w) for w in range(2)]
    coordinator = Coordinator(Store.from_url(redis_url, job), config, Alternating(), max_ahead=1).start()
    try:
        store = workers[0].store
        for k in range(4):
            got = [worker.assignment(k) for worker in workers]
            for worker in workers:
                worker.report(k, got[0].sizes[worker.worker], 0.01)
                worker.flush()
        _until(lambda: store.get_assignment(4) is not None, "the decision from the reports of 3")
        assert workers[0].assignment(4).sizes == (7, 3)
        back = time.monotonic() + 2.5  # longer than the timeout: the second worker's wait runs out while it fails
        real_get = workers[1].store.get_assignment

        def unreachable_until_back(iteration: int) -> bytes | None:
            if time.monotonic() < back:
                raise redis.ConnectionError("Redis restarting (test)")
            return real_get(iteration)

        monkeypatch.setattr(workers[1].store, "get_assignment", unreachable_until_back)
        flusher = threading.Timer(2.2, store.client.flushall)  # the restart loses every key, the decision's too
        flusher.start()
        try:
            second = workers[1].assignment(4)
        finally:
            flusher.join()
    finally:
        coordinator.stop()
        coordinator.store.close()
        for worker in workers:
            worker.close()
            worker.store.close()
    assert (second.sizes, second.fallback) == ((7, 3), False), second
