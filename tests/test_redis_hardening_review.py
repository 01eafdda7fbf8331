"""Review of what the coordinator and workers do with job keys that something other than lbbsp wrote: a key of
another type mid-run, a reports hash of thousands of fields that are no worker, a decision log whose head is deeply
nested JSON, and field names or a coordinator claim that would inject lines or terminal escapes into the logs.
Each against a real redis-server."""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Sequence

import pytest

import lbbsp.coordinator
from lbbsp import BSPPolicy, Coordinator, JobConfig, Report, Store, WorkerClient
from lbbsp.cli import main
from lbbsp.errors import ConfigError, LBBSPError, StoreUnavailable
from lbbsp.store import UNKNOWN_CLAIM


def _post(store: Store, config: JobConfig, iterations: range) -> None:
    """Both workers' reports of ``iterations``, the equal split's samples (what BSP assigns), in one round trip."""
    store.post_reports([Report(config.job, w, k, 5, 0.01) for k in iterations for w in range(2)], 2)


# -- 1. a key of another type at `decisions` or `forgotten`, appearing mid-run ---------------------------------------

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


def test_a_wrong_typed_watermark_reads_as_none_and_does_not_refuse_a_coordinators_write(redis_url: str,
                                                                                       job: str) -> None:
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        store.client.sadd(store.key("forgotten"), "x")
        assert store.forgotten_through() is None
        assert store.publish_all([config.initial_assignment(9)], decided_from=8) == [True]


# -- 2. a key of another type at `assign:{k}` ------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("iteration", [0, 5])  # 0: the initial split's write-once path (publish_or_read)
def test_a_wrong_typed_assign_key_is_an_invalid_assignment_for_a_worker_not_redis_down(
        redis_url: str, job: str, iteration: int) -> None:
    """Without agree, the worker had waited outage_s and raised StoreUnavailable ("bring Redis back"); it is the key's
    value that is wrong, which lbbsp's invalid-assignment path names. With agree, the worker falls back."""
    config = JobConfig(job, 2, 10, assignment_timeout_s=0.5, ttl_s=60)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        store.client.hset(store.key("assign", iteration), "x", "y")
        lone = WorkerClient(Store.from_url(redis_url, job), config, 0, outage_s=3.0)
        agreed = WorkerClient(Store.from_url(redis_url, job), config, 1, agree=lambda a: a)
        try:
            started = time.monotonic()
            with pytest.raises(LBBSPError) as raised:
                lone.assignment(iteration)
            waited = time.monotonic() - started
            fallback = agreed.assignment(iteration)
        finally:
            for worker in (lone, agreed):
                worker.close()
                worker.store.close()
    assert not isinstance(raised.value, StoreUnavailable) and waited < 2.0, (waited, raised.value)
    assert store.key("assign", iteration) in str(raised.value) and "another type" in str(raised.value)
    assert fallback.fallback and fallback.sizes == config.initial_sizes()


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


# -- 3. a reports hash of thousands of fields that are no worker ------------------------------------------------------

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


# -- 4. a deeply nested entry at the head of the decision log ---------------------------------------------------------

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


# -- 5. log and terminal injection ------------------------------------------------------------------------------------

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


def test_a_coordinators_identity_is_read_back_as_written(redis_url: str, job: str) -> None:
    with Store.from_url(redis_url, job) as store:
        assert store.claim_coordinator("host.example:4242:abcd", ttl_s=5) is None
        assert store.claim_coordinator("node-7_a.cluster.local:123456:0f3a9c1e", ttl_s=5) == "host.example:4242:abcd"
        assert store.coordinator() == "node-7_a.cluster.local:123456:0f3a9c1e"
