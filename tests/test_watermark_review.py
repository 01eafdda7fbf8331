"""Review of the clean-up's watermark (the ``forgotten`` key): the coordinator's guarded write, the first clean-up's
reach, the watermark's transaction on a Redis that lost its scripts, and values in the key that lbbsp did not write.
Each against a real redis-server, with real coordinators and workers."""
from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator

import pytest

import lbbsp.coordinator
from lbbsp import Assignment, BSPPolicy, Coordinator, EmbeddedRedis, JobConfig, Store, WorkerClient
from tests.test_coordinators_review import SlowBSP, train
from tests.test_redis_faults import Fixed
from tests.test_store_leftovers_review import _left_by_an_earlier_run, _stored


@pytest.fixture
def own_server() -> Iterator[EmbeddedRedis]:
    """A redis-server of this test's own, in a folder the test can read (its append-only file) and a path short
    enough for a unix socket."""
    with tempfile.TemporaryDirectory(prefix="lbbsp-wm-") as folder, EmbeddedRedis(folder) as server:
        yield server


def _restart_keeping(server: EmbeddedRedis, kept: bytes) -> None:
    """Kill ``server`` and start it again from the append-only file ``kept``, an earlier copy of its own: a restart
    that lost the latest writes and kept the older ones (an RDB snapshot, AOF ``everysec``, a replica promoted while
    behind)."""
    server.stop(kill=True)
    (server.directory / "appendonly.aof").write_bytes(kept)
    server.start()


# -- 1. the guard and the invariant -------------------------------------------------------------------------------

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


# -- 2. the first clean-up's reach ---------------------------------------------------------------------------------

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


# -- 3. the watermark's transaction on a Redis without the scripts -------------------------------------------------

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


# -- 4. values in the key that lbbsp did not write ------------------------------------------------------------------

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
