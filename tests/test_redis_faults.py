"""What a worker and the coordinator do when Redis misbehaves: answers with errors, refuses writes, loses its data,
stalls, restarts, or holds entries that no lbbsp process wrote. Each against a real redis-server."""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence

import pytest
import redis

from emulated import worker_clients
from lbbsp import Assignment, BSPPolicy, ConfigError, Coordinator, EmbeddedRedis, JobConfig, Report, Store, WorkerClient
from lbbsp.cli import main
from lbbsp.client_history import ClientHistory
from lbbsp.errors import StoreUnavailable
from lbbsp.policies import Decision, Policy
from lbbsp.store import worker_socket_timeout
from test_worker import _until, _written_later


class Fixed(Policy):
    """Writes (7, 3) at its first decision, then keeps whatever split is in force (as per-epoch resizing
    does between epochs): what it keeps shows which split the coordinator believes is in force."""

    name = "fixed"

    def __init__(self) -> None:
        self.decided = 0

    def decide(self, iteration: int, current: tuple[int, ...], config: JobConfig) -> Decision:
        self.decided += 1
        return Decision((7, 3), "first") if self.decided == 1 else Decision(current, "kept")


def test_the_report_sender_survives_an_error_reply_and_sends_the_next_report(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8, assignment_timeout_s=0.3)
    with Store.from_url(redis_url, job) as other, WorkerClient(Store.from_url(redis_url, job), config, 0) as worker:
        other.client.set(other.key("reports", 0), "not a hash")  # every post of iteration 0 answers WRONGTYPE
        worker.report(0, 4, 0.1)
        worker.flush(2.0)
        worker.report(1, 4, 0.1)
        worker.flush(2.0)
        assert worker._sender.is_alive()
        assert set(other.reports(1)) == {b"0"}
        worker.store.close()


@pytest.mark.parametrize("loss", ["flush", "latest split only"])
def test_a_flushed_redis_gets_the_decided_split_back_before_a_worker_falls_back(job: str, loss: str) -> None:
    """A loss of the latest splits that kept the job's settings (a restart from an older snapshot, a failover to a
    replica behind, eviction) had gone unnoticed: only a lost config was, and worker 1 waited out its timeout and
    fell back to (5, 5) while worker 0 had used (7, 3) (found by a review of the agreement rule)."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=3.0, lag=1)
    with EmbeddedRedis() as server:
        coordinator = Coordinator(Store.from_url(server.url, job), config, Fixed()).start()
        workers = [WorkerClient(Store.from_url(server.url, job), config, w) for w in range(2)]
        try:
            for worker in workers:
                worker.report(0, worker.assignment(0).sizes[worker.worker], 0.1)
            first = workers[0].assignment(1)
            assert first.sizes == (7, 3)
            if loss == "flush":  # worker 1 has not read iteration 1's split yet
                workers[0].store.client.flushall()
            else:
                workers[0].store.client.delete(workers[0].store.key("assign", 1))
            time.sleep(1.5)  # the coordinator's heartbeat notices within a second
            second = workers[1].assignment(1)
            assert (second.sizes, second.fallback) == ((7, 3), False)
        finally:
            coordinator.stop()
            for worker in workers:
                worker.close()
                worker.store.close()
            coordinator.store.close()


def test_a_lost_report_does_not_reset_the_split_in_force(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.5, lag=2)
    policy = Fixed()
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, policy)
        workers = [WorkerClient(Store.from_url(redis_url, job), config, w) for w in range(2)]
        try:
            for k in range(7):
                sizes = workers[0].assignment(k).sizes
                assert workers[1].assignment(k).sizes == sizes
                assert sizes == ((5, 5) if k < 2 else (7, 3)), k
                for worker in workers:
                    if (k, worker.worker) != (2, 1):  # worker 1's report of iteration 2 is lost
                        worker.report(k, sizes[worker.worker], 0.1)
                    worker.flush()
                while coordinator.step(0.05) is not None:
                    pass
        finally:
            for worker in workers:
                worker.close()
                worker.store.close()
    assert policy.decided == 6  # every iteration but 2 was complete


def test_a_stalled_redis_holds_a_worker_about_its_assignment_timeout(job: str) -> None:
    config = JobConfig(job, 2, 10, assignment_timeout_s=1.0, lag=1)
    with EmbeddedRedis() as server:
        store = Store.from_url(server.url, job, socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
        # agree= as an integration passes it (a broadcast over its process group; the identity with one worker here)
        with store, WorkerClient(store, config, 0, agree=lambda agreed: agreed) as worker:
            worker.assignment(0)
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                fallback = worker.assignment(1)
                waited = time.monotonic() - started
            finally:
                os.kill(server.pid, signal.SIGCONT)
    assert fallback.fallback and fallback.sizes == (5, 5)
    assert waited < 2.5  # with the default 5 s socket timeout and its retries: 15 s


def test_with_agree_an_outage_costs_one_wait_not_one_per_step(job: str) -> None:
    """Each step of an outage had waited assignment_timeout_s before its agreed fallback, for as long as Redis stayed
    away (about 10 s a step by default, found porting a DDP script). Now the first step waits, the next fall back at
    their first failure, and once Redis answers again a step waits for the decision as before."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=1.5, lag=1)
    with EmbeddedRedis() as server:
        store = Store.from_url(server.url, job, socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
        with store, WorkerClient(store, config, 0, agree=lambda agreed: agreed) as worker:
            worker.assignment(0)
            server.stop()
            waits = []
            for iteration in (1, 2, 3):
                started = time.monotonic()
                assert worker.assignment(iteration).fallback
                waits.append(time.monotonic() - started)
            server.start()
            started = time.monotonic()
            late = worker.assignment(4)  # Redis is back, and no coordinator decides: the whole wait again
            back = time.monotonic() - started
    assert waits[0] >= 1.5 and max(waits[1:]) < 0.75, waits
    assert late.fallback and back >= 1.5


class News:
    """OutageNews in memory, for workers of one process: what each worker told, by iteration."""

    def __init__(self) -> None:
        self.told: list[int] = []

    def tell(self, iteration: int) -> None:
        self.told.append(iteration)

    def heard(self, iteration: int) -> bool:
        return any(told >= iteration - 1 for told in self.told)


class BrokenNews(News):
    """A channel of one's own that fails both ways (a collective that timed out, say)."""

    def tell(self, iteration: int) -> None:
        raise RuntimeError("cannot tell")

    def heard(self, iteration: int) -> bool:
        raise RuntimeError("cannot hear")


@pytest.mark.parametrize("news", ["with", "without", "broken"], ids=["with-news", "without", "broken-news"])
def test_a_worker_that_hears_another_waited_out_redis_falls_back_without_its_own_wait(job: str, news: str) -> None:
    """Worker 0 read iteration 1's vector just before Redis went; worker 1 did not, waited the bound out and fell
    back. Worker 0's next step had waited the whole timeout again: a second stall of the job. With the news of
    worker 1's fallback it falls back at its first failure; the first fallback of each worker is told, once. A channel
    that fails is no news: each worker waits its bound, as without one, and neither step fails on it."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=1.5, lag=1)
    channel = BrokenNews() if news == "broken" else News()
    with EmbeddedRedis() as server:
        stores = [Store.from_url(server.url, job, socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
                  for _ in range(2)]
        workers = [WorkerClient(store, config, w, agree=lambda agreed: agreed,
                                outage_news=None if news == "without" else channel)
                   for w, store in enumerate(stores)]
        try:
            stores[0].publish_or_read(Assignment(job, 1, (4, 6), "test", "decided"))
            assert workers[0].assignment(1).sizes == (4, 6)
            server.stop()
            started = time.monotonic()
            assert workers[1].assignment(1).fallback  # the bound waited out
            assert time.monotonic() - started >= 1.5
            started = time.monotonic()
            assert workers[0].assignment(2).fallback
            waited = time.monotonic() - started
            workers[1].assignment(2)
        finally:
            for worker, store in zip(workers, stores):
                worker.close()
                store.close()
    assert (waited < 0.75) if news == "with" else (waited >= 1.5), waited
    assert channel.told == ([1, 2] if news == "with" else [])


def test_outage_news_that_cannot_tell_or_hear_is_refused_where_the_worker_is_made(store: Store, job: str) -> None:
    with pytest.raises(ConfigError, match=r"outage_news must be None or have tell\(iteration\) and heard"):
        WorkerClient(store, JobConfig(job, 2, 10), 0, agree=lambda agreed: agreed, outage_news=object())  # type: ignore[arg-type]


def test_the_coordinators_wait_for_reports_ends_before_its_socket_timeout(redis_url: str, job: str) -> None:
    with Store.from_url(redis_url, job, socket_timeout_s=1.0) as store:
        coordinator = Coordinator(store, JobConfig(job, 2, 10))
        assert coordinator.step(3.0) is None  # no TimeoutError from the socket


@pytest.mark.parametrize("spelling", ["01", "0x1", "1.0", " 1", "1e0", "-1", "", "+1"])
def test_only_the_plain_decimal_worker_id_counts_towards_a_complete_iteration(redis_url: str, job: str,
                                                                             spelling: str) -> None:
    with Store.from_url(redis_url, job) as store:
        assert store.post_raw_report(0, spelling, b"{}", 2) == -2
        assert store.report_count(0) == 0


def test_a_deeply_nested_report_is_rejected_and_the_others_are_decided_on(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 10, lag=1)
    payload = b"[" * 1900 + b"]" * 1900  # under the size cap; deeper than 3.11's and 3.12's decoders go, not 3.13's
    try:
        json.loads(payload)
    except RecursionError:
        expected = "nested too deeply"
    else:
        expected = "must be a JSON object, got list"
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config)
        store.post_report(Report(job, 0, 0, 5, 0.1), 2)
        store.post_raw_report(0, "1", payload, 2)
        outcome = coordinator.step(1.0)
    assert outcome is not None and outcome.written
    assert [r.worker for r in outcome.rejected] == ["1"] and expected in outcome.rejected[0].error


def test_a_client_index_is_never_given_twice_while_the_job_records(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job, ttl_s=2) as history:
        first, second = history.worker_index("node-a"), history.worker_index("node-b")
        for rnd in range(4):  # longer than the TTL, with a record every second
            history.record([Report(job, first, rnd, 10, 1.0), Report(job, second, rnd, 10, 2.0)], {})
            time.sleep(0.8)
        assert history.worker_index("node-c") == 2


def test_an_embedded_server_outlives_the_thread_that_started_it() -> None:
    started: list[EmbeddedRedis] = []
    thread = threading.Thread(target=lambda: started.append(EmbeddedRedis()))
    thread.start()
    thread.join()
    with started[0] as server, Store.from_url(server.url, "x") as store:
        time.sleep(0.3)
        store.ping()


def test_a_step_that_fails_the_same_way_is_logged_once_not_at_every_retry(redis_url: str, job: str,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config).start()
        store.client.set(store.key("ready"), "not a list")  # every step's pop answers WRONGTYPE
        with caplog.at_level(logging.ERROR, logger="lbbsp.coordinator"):
            time.sleep(1.0)
        coordinator.stop()
    failures = [r for r in caplog.records if "step failed" in r.getMessage()]
    assert len(failures) == 1


def test_a_ready_key_of_another_type_is_named_and_replaced_by_the_report_that_completes_an_iteration(
        redis_url: str, job: str) -> None:
    """A hash at the ready key had failed the report script after its report was stored, so no iteration was queued
    again and every later step waited out assignment_timeout_s, the coordinator's log a bare WRONGTYPE."""
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, policy=BSPPolicy())
        store.client.hset(store.key("ready"), "a", "b")
        for step in (lambda: store.next_ready(0.1), store.drain_ready):
            with pytest.raises(ConfigError, match=f"Redis key {store.key('ready')} holds a value of another type"):
                step()
        for worker in (0, 1):
            assert store.post_report(Report(job, worker, 0, 5, 0.1), config.num_workers)
        outcome = coordinator.step(timeout_s=0.5)
        assert outcome is not None and outcome.iteration == 0 and outcome.written
        assert store.get_assignment(1) is not None


def test_an_iteration_queued_again_is_not_decided_again_nor_taken_for_a_new_run(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """2,000 pushes of an iteration decided from already (only a foreign writer queues one twice) had it decided
    again at each pop, the workers falling back meanwhile, with a warning that the workers' iterations went back."""
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, policy=BSPPolicy())
        for k in range(4):
            if k == 3:
                store.client.rpush(store.key("ready"), *[1] * 2000)
            for worker in (0, 1):
                store.post_report(Report(job, worker, k, 5, 0.1), config.num_workers)
            with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
                outcome = coordinator.step(timeout_s=0.5)
            assert outcome is not None and outcome.iteration == k
        assert store.client.llen(store.key("ready")) == 0 and coordinator.decisions_made == 4
    assert caplog.text.count("iteration(s) 1 queued again as complete") == 1, caplog.text
    assert "went back" not in caplog.text


def test_a_ready_list_of_iterations_decided_or_deleted_already_decides_nothing_and_deletes_nothing(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """A foreign writer's pushes: an iteration decided from already, alone on the list, and one whose keys a clean-up
    deleted (as another coordinator's does while this one is paused): no decision from either (one from iteration 2
    would replace nothing, but deciding from it had deleted the assignments before it), the later splits kept, and
    the second warned about once, not at each push."""
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, policy=BSPPolicy())
        for k in range(6):
            for worker in (0, 1):
                store.post_report(Report(job, worker, k, 5, 0.1), config.num_workers)
            assert coordinator.step(timeout_s=0.5) is not None
        store.client.rpush(store.key("ready"), 5)
        assert coordinator.step(timeout_s=0.5) is None
        store.client.delete(store.key("assign", 2), store.key("reports", 2))
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            for _ in range(2):
                store.client.rpush(store.key("ready"), 2)
                assert coordinator.step(timeout_s=0.5) is None
        assert coordinator.decisions_made == 6 and store.decision_count() == 6
        assert all(store.get_assignment(k) is not None for k in range(3, 7))
    behind = [r.getMessage() for r in caplog.records if "behind the job's latest decision" in r.getMessage()]
    assert len(behind) == 1 and "iterations 2, queued as complete" in behind[0] and "(from iteration 5)" in behind[0]


def test_status_skips_entries_no_coordinator_wrote(redis_url: str, job: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 10))
        store.client.lpush(store.key("decisions"), "not json", "[" * 3000)
        store.client.hset(store.key("workers"), mapping={"x": "{}", "1": '{"size": "big"}'})
        assert main(["status", "--redis", redis_url, "--job", job, "--decisions", "3"]) == 0
    assert f"job {job}" in capsys.readouterr().out


def test_status_skips_a_job_whose_stored_settings_are_broken_and_names_the_key(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """One job's corrupt config key (or a key of another type than lbbsp writes) had stopped `lbbsp status` for every
    job on the Redis, with an error that named no job."""
    names = [job, f"{job}-bad", f"{job}-other", f"{job}-typed"]
    stores = [Store.from_url(redis_url, name) for name in names]
    store, bad, other, typed = stores
    try:
        store.register(JobConfig(job, 2, 10))
        bad.client.set(bad.key("config"), b"garbage{")
        other.client.set(other.key("config"), JobConfig(job, 2, 10).to_json())  # another job's settings
        typed.register(JobConfig(typed.job, 2, 10))
        typed.client.set(typed.key("workers"), b"x")
        assert main(["status", "--redis", redis_url]) == 0
        assert f"job {job}:" in capsys.readouterr().out
        skipped = [r.getMessage() for r in caplog.records if "skipped job" in r.getMessage()]
        assert any(bad.key("config") in m and "not valid JSON" in m for m in skipped), skipped
        assert any(other.key("config") in m and f"settings of job {job!r}" in m for m in skipped), skipped
        assert any(typed.key("workers") in m and "another type than lbbsp writes" in m for m in skipped), skipped
        with pytest.raises(ConfigError, match=f"Redis key {bad.key('config')}: .*delete the key"):
            Coordinator(bad, JobConfig(bad.job, 2, 10))
        assert main(["status", "--redis", redis_url, "--job", bad.job]) == 2
    finally:  # the other tests share this Redis
        for each in stores:
            each.forget()
            each.close()


@pytest.mark.parametrize("columns", [200, 80])  # six columns; folded, "by ..." on each decision's first line
def test_status_tells_a_split_an_earlier_decision_wrote_from_a_fallback(
        redis_url: str, job: str, columns: int, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A coordinator whose earlier decision, running ahead, had covered an iteration records the next decision
    for it as not written by itself: `lbbsp status` had shown that as a worker's fallback."""
    monkeypatch.setenv("COLUMNS", str(columns))
    config = JobConfig(job, 2, 20)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as clients:
        coordinator = Coordinator(store, config)
        for k in range(3):
            for client in clients:
                client.report(k, 10, 0.1)
                client.flush()
        coordinator.ahead = 4
        coordinator.decide(0)  # writes 2-5
        coordinator.ahead = 1
        again = coordinator.decide(1)  # its own iteration, 3, is written already
        assert again.assignment.iteration == 3 and not again.written and not again.assignment.fallback
        store.publish(Assignment(job, 6, (10, 10), "fallback", "coordinator late", fallback=True))
        for client in clients:
            client.report(4, 10, 0.1)
            client.flush()
        lost = coordinator.decide(4)  # a worker's fallback stands at 6
        assert not lost.written and lost.assignment.fallback
        assert main(["status", "--redis", redis_url, "--job", job, "--decisions", "5"]) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.count("│") >= 3 and line.split("│")[1].strip()}  # a row's first line: its iteration
    assert "coordinator" in rows["2-5"] and "earlier decision" in rows["3"] and "fallback" in rows["6"], rows


def test_without_agree_a_worker_waits_out_a_stalled_redis_and_uses_the_decision(job: str) -> None:
    """Without agree= a worker had fallen back to its previous vector after assignment_timeout_s, while another,
    which read the decision just before the stall, used that: 7 samples of a batch of 64 trained twice."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.5, lag=1)
    with EmbeddedRedis() as server:
        assert server.pid is not None
        store = Store.from_url(server.url, job, socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
        with store, WorkerClient(store, config, 1, outage_s=30.0) as worker:
            worker.assignment(0)
            store.publish(Assignment(job, 1, (7, 3), "decided"))  # worker 0 has read this one: then Redis stalls
            os.kill(server.pid, signal.SIGSTOP)
            resume = threading.Timer(2.0, os.kill, (server.pid, signal.SIGCONT))  # 4x the assignment timeout
            resume.start()
            try:
                agreed = worker.assignment(1)
            finally:
                resume.join()
                os.kill(server.pid, signal.SIGCONT)
    assert (agreed.sizes, agreed.fallback) == ((7, 3), False)


def test_without_agree_a_worker_stops_on_a_redis_gone_for_outage_s(job: str) -> None:
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.5, lag=1)
    with EmbeddedRedis() as server:
        store = Store.from_url(server.url, job, socket_timeout_s=worker_socket_timeout(config.assignment_timeout_s))
        with store, WorkerClient(store, config, 1, outage_s=1.5) as worker:
            worker.assignment(0)
            server.close()
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="without an agree function"):
                worker.assignment(1)
    assert 1.5 <= time.monotonic() - started < 10
    with pytest.raises(ConfigError, match="outage_s"):
        WorkerClient(Store.from_url(server.url, job), config, 0, outage_s=0.1)


def test_a_flush_between_a_fallbacks_write_and_its_read_cannot_fail_the_worker(job: str) -> None:
    """The fallback was written, then read back: a FLUSHALL in between raised 'assignment vanished right after it
    was written' (61 of 3,000 steps with a flush every 10 ms). Now one script writes and returns it."""
    config = JobConfig(job, 1, 8, assignment_timeout_s=0.01)
    stop = threading.Event()
    with EmbeddedRedis() as server, Store.from_url(server.url, job) as store, WorkerClient(store, config, 0) as worker:
        flusher = redis.Redis.from_url(server.url)

        def flush() -> None:
            while not stop.is_set():
                flusher.flushall()

        thread = threading.Thread(target=flush)
        thread.start()
        try:
            sizes = [worker.assignment(k).sizes for k in range(600)]
        finally:
            stop.set()
            thread.join()
            flusher.close()
    assert sizes == [(8,)] * 600


def test_a_report_made_on_an_agreed_fallback_is_accepted(redis_url: str, job: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Workers that could not read Redis use, agreed, the split they had; the coordinator had rejected their
    reports against the decision they never read ('39 samples, more than the 1 assigned')."""
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, Fixed())
        for worker, size in enumerate(config.initial_sizes()):
            store.post_report(Report(job, worker, 0, size, 0.1), 2)
        assert coordinator.decide(0).assignment.sizes == (7, 3)
        for worker, size in enumerate((5, 5)):  # iteration 1 ran on the fallback (5, 5), not the decided (7, 3)
            store.post_report(Report(job, worker, 1, size, 0.1), 2)
        assert coordinator.decide(1).rejected == []
        store.post_report(Report(job, 0, 2, 8, 0.1), 2)  # more than any split of worker 0 had
        store.post_report(Report(job, 1, 2, 3, 0.1), 2)
        assert [r.worker for r in coordinator.decide(2).rejected] == ["0"]


def test_an_outage_is_logged_once_it_has_lasted_a_few_seconds(redis_url: str, job: str, caplog, monkeypatch) -> None:
    """The coordinator of a training process that just ended (its embedded Redis went first) printed "Redis
    unavailable; retrying" under the process's own traceback, where it read as the cause."""
    import lbbsp.coordinator as coordinator_module  # noqa: PLC0415

    now = [100.0]
    monkeypatch.setattr(coordinator_module.time, "monotonic", lambda: now[0])
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, JobConfig(job, 2, 8))
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            coordinator._outage(redis.ConnectionError("gone"))
            now[0] += 2.0
            coordinator._outage(redis.ConnectionError("gone"))
            assert "unavailable" not in caplog.text  # the orphan watch stops it within a second: nothing said
            now[0] += 1.5
            coordinator._outage(redis.ConnectionError("gone"))
            assert caplog.text.count("Redis unavailable for 4s (gone); retrying") == 1


def test_a_coordinator_that_finds_redis_refusing_writes_after_an_outage_keeps_serving(
        caplog: pytest.LogCaptureFixture) -> None:
    """After an outage (here a stall past the socket timeout), the coordinator rewrites its latest splits; a Redis
    that answered that with an error (out of memory, a read-only replica in a failover) ended the coordinator's
    thread, and every later step waited assignment_timeout_s for a fallback."""
    job = "refusing"
    config = JobConfig(job, 2, 10)
    with EmbeddedRedis() as server, Store.from_url(server.url, job, socket_timeout_s=0.1) as store, \
            Store.from_url(server.url, job) as workers:
        coordinator = Coordinator(store, config, BSPPolicy()).start()
        for k in range(2):
            for worker, size in enumerate(config.initial_sizes()):
                workers.post_report(Report(job, worker, k, size, 0.01), config.num_workers)
            deadline = time.monotonic() + 10
            while coordinator.decisions_made <= k:
                assert time.monotonic() < deadline, "no decision"
                time.sleep(0.01)
            if k == 0:
                secret = server.command_name("CONFIG")  # the embedded server's name for CONFIG
                workers.client.execute_command(secret, "SET", "maxmemory", 1)  # every write refused: OOM
                with caplog.at_level(logging.ERROR, logger="lbbsp.coordinator"):
                    for _ in range(10):  # each stall ends in the rewrite about every other time
                        workers.client.execute_command(server.command_name("DEBUG"), "SLEEP", "0.6")
                        time.sleep(0.2)
                        assert coordinator._thread is not None and coordinator._thread.is_alive()
                workers.client.execute_command(secret, "SET", "maxmemory", 0)
        coordinator.stop()
        assert workers.get_assignment(3) is not None  # decided from iteration 1, after the refusals


def test_a_report_whose_first_answer_was_lost_is_not_called_a_duplicate(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stall past the socket timeout can store a report's first try and lose Redis's answer; the retry then finds
    the report stored (3 of 372 reports under a 1.5 s stall). That had been warned as an iteration reported
    already, blaming a reused job name or an iteration counter that restarts each epoch. The lost answer is
    made here: the first post is stored, then raises as a timed-out call does."""
    config = JobConfig(job, 2, 8, assignment_timeout_s=5.0)
    with Store.from_url(redis_url, job) as store, WorkerClient(store, config, 0) as worker, \
            caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
        post = store.post_report
        answers: list[bool] = []

        def answer_lost_once(report, num_workers):  # type: ignore[no-untyped-def]
            answers.append(post(report, num_workers))
            if len(answers) == 1:
                raise redis.TimeoutError("Timeout reading from socket")
            return answers[-1]

        monkeypatch.setattr(store, "post_report", answer_lost_once)
        worker.report(0, 4, 0.01)
        worker._outbox.join()
        assert answers == [True, False] and store.report_count(0) == 1
        assert "reported already" not in caplog.text
        worker.report(0, 4, 0.02)  # a real second report of iteration 0 (another measurement) is still warned about
        worker._outbox.join()
    assert [r.getMessage().count("reported already") for r in caplog.records] == [1], caplog.text


def test_reports_that_redis_does_not_take_are_dropped_with_one_warning_a_minute(
        job: str, caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 2, 8, assignment_timeout_s=0.2)
    with EmbeddedRedis() as server:
        store = Store.from_url(server.url, job, socket_timeout_s=worker_socket_timeout(0.2))
        with store, WorkerClient(store, config, 0) as worker, caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
            server.stop()
            for k in range(3):
                worker.report(k, 4, 0.01)
            worker._outbox.join()
    dropped = [r.getMessage() for r in caplog.records if "dropped the report" in r.getMessage()]
    assert len(dropped) == 1 and "1 report(s) of this worker dropped so far" in dropped[0], dropped


def test_a_worker_waiting_through_a_redis_restart_gets_the_split_written_after_it(job: str) -> None:
    """Redis killed and started again while a worker waits: the split written once it is back is the one used (no
    fallback), soon after its write."""
    config = JobConfig(job, 2, 64, assignment_timeout_s=8.0)
    with EmbeddedRedis() as server, Store.from_url(server.url, job) as store, \
            worker_clients(server.url, config) as (worker, _):
        store.publish(Assignment(job, 2, (32, 32), "test"))
        assert worker.assignment(2).sizes == (32, 32)  # in time: not subscribed
        thread, written = _written_later(store, Assignment(job, 3, (40, 24), "test"), 0.6)
        restart = threading.Timer(0.2, server.restart)
        restart.start()
        got = worker.assignment(3)
        returned = time.monotonic()
        restart.join()
        thread.join()
        assert (got.sizes, got.fallback) == ((40, 24), False)
        assert returned - written[0] < 0.5




def _restart_keeping(server: EmbeddedRedis, kept: bytes) -> None:
    """Kill ``server`` and start it again from the append-only file ``kept``, an earlier copy of its own: a restart
    that lost the latest writes and kept the older ones (an RDB snapshot, AOF ``everysec``, a replica promoted while
    behind)."""
    server.stop(kill=True)
    (server.directory / "appendonly.aof").write_bytes(kept)
    server.start()


@pytest.mark.timeout(60)
def test_a_resumed_runs_split_lost_in_a_restart_that_kept_older_data_is_written_back(
        job: str, own_server: EmbeddedRedis) -> None:
    """A job resumed under its name from a checkpoint at iteration 400, its earlier run having cleaned up through
    500; Redis restarts and keeps its older data (the watermark among it) but not the resumed run's latest writes.
    Worker 0 read the decision of iteration 401 before the restart; the coordinator's republish (what it runs after an
    outage) was refused, since neither 401 nor the iteration it was decided from is stored and 401 is below the
    watermark; worker 1 then fell back, and the two used different vectors for iteration 401."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.2, lag=1)
    url = own_server.url
    with Store.from_url(url, job) as store:
        store.register(config)
        store.forget_iterations(0, 500)  # the earlier run's clean-ups: it decided from iteration 600
        kept = (own_server.directory / "appendonly.aof").read_bytes()
        coordinator = Coordinator(store, config, Fixed())
        workers = [WorkerClient(Store.from_url(url, job), config, w) for w in range(2)]
        try:
            for worker in workers:  # the resumed run's first iteration: no decision covers it, the workers fall back
                worker.report(400, worker.assignment(400).sizes[worker.worker], 0.01)
                worker.flush()
            outcome = coordinator.step(1.0)
            assert outcome is not None and outcome.written  # 400's split is stored: the guard lets it through
            read_before = workers[0].assignment(401)
            assert read_before.sizes == (7, 3)
            _restart_keeping(own_server, kept)
            assert store.client.ping() and store.forgotten_through() == 500
            coordinator._republish()  # what the coordinator runs after a step that failed on the outage
            read_after = workers[1].assignment(401)
        finally:
            for worker in workers:
                worker.close()
                worker.store.close()
    assert (read_after.sizes, read_after.fallback) == (read_before.sizes, False), \
        "two workers used different vectors for iteration 401"


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
