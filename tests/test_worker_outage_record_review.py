"""After an outage of Redis, the workers that ran on agreed local fallbacks write them to their keys, so the
coordinator decides on from the iterations they ran and the record shows the vectors they used. Real redis-server,
stopped and started again (its append-only file keeps the data)."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from emulated import rank0_agree
from lbbsp import Assignment, Coordinator, EmbeddedRedis, JobConfig, Store, WorkerClient
from lbbsp.policies import Decision, Policy
from lbbsp.store import worker_socket_timeout


class Constant(Policy):
    """Decides (7, 3), always: the coordinator's decisions show in the policy name and the fallback flag."""

    name = "constant"

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        return Decision((7, 3), "constant")



def test_fallbacks_used_while_redis_was_down_are_written_once_it_is_back(job: str,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """With agree, the workers ran iterations on the previous vector while Redis was down and wrote nothing. Once it
    was back their reports completed those iterations, which had no assignment: the coordinator refused them ('have no
    assignment ... not deciding from them'), so the next step waited its whole assignment_timeout_s and fell back
    again; and the coordinator then wrote its own decisions for iterations the workers had run on the fallback."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.8, lag=1)
    rank0 = rank0_agree()
    with EmbeddedRedis() as server, caplog.at_level(logging.WARNING):
        timeout = worker_socket_timeout(config.assignment_timeout_s)
        workers = [WorkerClient(Store.from_url(server.url, job, socket_timeout_s=timeout), config, w, agree=rank0(w))
                   for w in range(2)]
        coordinator = Coordinator(Store.from_url(server.url, job), config, Constant(), max_ahead=1).start()

        def assignment(k: int) -> Assignment:
            used = [worker.assignment(k) for worker in workers]
            assert used[0] == used[1]
            return used[0]

        def report(assigned: Assignment) -> None:
            for worker, size in zip(workers, assigned.sizes):
                worker.report(assigned.iteration, size, 0.01)

        def step(k: int) -> Assignment:
            report(used := assignment(k))
            return used

        try:
            assert [step(k).fallback for k in range(2)] == [False] * 2
            assert not (last := assignment(2)).fallback
            server.stop()  # before the reports of 2: no decision of 3 is written that no worker could read
            report(last)  # dropped: the outage lasts past the bound
            outage = [step(k) for k in (3, 4)]  # 3 waits its bound, 4 falls back at once
            server.start()  # within the bound of the reports of 3 and 4: they are sent
            after = [step(k) for k in (5, 6)]
            for worker in workers:
                worker.flush()
        finally:
            coordinator.stop()
            for worker in workers:
                worker.close()
                worker.store.close()
            coordinator.store.close()
        with Store.from_url(server.url, job) as store:
            stored = [store.get_assignment(k) for k in (3, 4)]
    assert all(a.fallback and a.reason.startswith("Redis unusable") for a in outage), outage
    assert [None if raw is None else Assignment.from_json(raw) for raw in stored] == outage
    refused = [r.getMessage() for r in caplog.records if "have no assignment" in r.getMessage()]
    assert not refused, refused
    assert [(a.fallback, a.policy) for a in after] == [(False, "constant")] * 2, after


def test_a_long_outage_writes_only_the_latest_fallbacks(job: str) -> None:
    """What a worker keeps to write is bounded: the latest 2 * (lag + 16) vectors of an outage, the older dropped."""
    config = JobConfig(job, 1, 10, assignment_timeout_s=0.3, lag=1)
    with EmbeddedRedis() as server, Store.from_url(server.url, job) as store, \
            WorkerClient(store, config, 0) as worker:  # alone, a worker falls back without agree
        worker.assignment(0)
        server.stop()
        assert all(worker.assignment(k).fallback for k in range(1, 41))  # 40 fallbacks, the cap 34
        server.start()
        worker.report(40, 10, 0.01)
        worker.flush()
        assert [k for k in range(1, 41) if store.get_assignment(k) is not None] == list(range(7, 41))
