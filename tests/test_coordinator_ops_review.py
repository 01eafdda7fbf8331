"""Fixes from an operator review of the coordinator's log: a rejected report logged at every decision, a coordinator
left running after its job warning every ttl_s that the keys expired, and lines that did not name their job."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Iterator

import pytest

from emulated import worker_clients
from lbbsp import Coordinator, EmbeddedRedis, JobConfig, Report, Store
from lbbsp.coordinator import _stop_when_orphaned
from lbbsp.policies import Decision, Policy


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


@pytest.fixture
def store(redis_url: str, job: str) -> Iterator[Store]:
    with Store.from_url(redis_url, job) as store:
        yield store
        store.forget()


def _with_garbage(report: Report) -> bytes:
    """``report`` as JSON with a field the protocol does not know."""
    return json.dumps({**json.loads(report.to_json()), "garbage": 1}).encode()


def test_a_report_rejected_at_every_decision_is_logged_every_10_s_with_a_count_and_recorded_each_time(
        store: Store, job: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that reported more samples than assigned had a warning at every decision (117 lines in 300
    iterations); another worker, or another check failed, is still news, logged at once."""
    clock = _Clock()
    monkeypatch.setattr("lbbsp.coordinator.time", clock)
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
        _stop_when_orphaned(coordinator, parent=-1, poll_s=0.01)  # no process has pid -1: its parent is gone
        coordinator.stop()
    lines = _messages(caplog)
    for said in ("failed to decide", "failed to learn", "predicted throughput", "stored assignment of iteration 1",
                 "step failed", "is gone: stopping"):
        assert [m for m in lines if said in m and m.startswith(f"job {job}: ")], (said, lines)
    assert all(m.startswith(f"job {job}") for m in lines), lines
