"""The store and the `lbbsp` command, session 51: one test of whether a job's keys are a finished run's, and one
wording of the hint it gives; the claim's identity and lifetime read in one round trip; `lbbsp forget` that deletes
nothing once a coordinator claims the job, even one that claims it while forget runs; and `lbbsp status` with the
rejected reports a decision recorded beyond those it lists, and without "1 workers" or "iteration -"."""
from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from lbbsp import ConfigError, JobConfig, Store
from lbbsp.cli import main
from lbbsp.store import UNKNOWN_CLAIM

SERVING = "host.example:4242:abcd"  # the identity a live coordinator claims the job with (host:pid:tag)


def _decided(store: Store, **fields: object) -> None:
    """A decision record as a coordinator writes one (iteration 0, two workers), with ``fields`` in place of its
    defaults."""
    store.record_decision(json.dumps({
        "iteration": 0, "through": 0, "sizes": [15, 15], "policy": "bsp", "reason": "equal split",
        "written_by_coordinator": True, "rejected": [], "rejected_more": 0, "time": time.time(), **fields}))


def _keys(store: Store) -> list[bytes]:
    return sorted(set(store.client.scan_iter(match=f"{store.prefix}*")))  # SCAN may give a key twice (a resize)


@pytest.fixture
def store(redis_url: str, job: str) -> Iterator[Store]:
    """The job's store; its keys deleted afterwards (the other tests share this Redis)."""
    with Store.from_url(redis_url, job) as opened:
        try:
            yield opened
        finally:
            opened.forget()


# -- 1. whether the keys are a finished run's, and the hint -------------------------------------------------------
def test_a_run_is_over_once_a_coordinator_decided_and_none_claims_the_job(store: Store) -> None:
    assert store.run_is_over() is False  # no keys at all
    store.register(JobConfig(store.job, 2, 30))
    assert store.run_is_over() is False  # settings, no decision: its workers may start ahead of their coordinator
    _decided(store)
    store.claim_coordinator(SERVING, 5)
    assert store.run_is_over() is False  # a coordinator serves it
    store.client.delete(store.key("coordinator"))
    assert store.run_is_over() is True
    store.client.delete(store.key("decisions"))
    store.client.set(store.key("decisions"), "not a list")  # WRONGTYPE: Redis cannot tell
    assert store.run_is_over() is False


def test_a_run_is_not_over_where_redis_cannot_tell() -> None:
    with Store.from_url("redis://127.0.0.1:1/0", "nowhere", socket_timeout_s=0.2) as unreachable:
        assert unreachable.run_is_over() is False


def _hint(job: str, redis_flag: str = "") -> str:
    forget = f"lbbsp forget --job {job}" + (f" {redis_flag}" if redis_flag else "")
    return (f"its keys are left by an earlier run, whose coordinator has stopped: `{forget}` clears "
            "them once that run is over, or use another job name")


def test_the_store_and_the_command_give_one_hint_for_a_finished_runs_keys(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`lbbsp coordinator` had its own test (no claim, whether or not any coordinator had decided) and its own words;
    the settings stay named as flags."""
    job = store.job
    store.register(JobConfig(job, 2, 30))
    _decided(store)
    with pytest.raises(ConfigError) as raised:
        store.register(JobConfig(job, 3, 30))
    assert raised.value.message == f"job {job!r} was started with num_workers=2 (not 3); {_hint(job)}"
    assert main(["coordinator", "--redis", redis_url, "--job", job, "--workers", "3", "--global-batch", "30"]) == 2
    said = capsys.readouterr().err  # with the --redis that reaches the keys, which the command was given
    hint = _hint(job, f"--redis {redis_url}")
    assert said == f"lbbsp: error: job {job!r} was started with --workers 2 (not 3); {hint}\n"


def test_the_command_offers_no_forget_for_a_job_no_coordinator_has_decided_yet(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Settings its workers stored before any coordinator decided: no earlier run's, and not to be forgotten (it had
    said an earlier run left them, since no coordinator claimed the job)."""
    job = store.job
    store.register(JobConfig(job, 2, 30))
    assert main(["coordinator", "--redis", redis_url, "--job", job, "--workers", "3", "--global-batch", "30"]) == 2
    err = capsys.readouterr().err
    assert err == (f"lbbsp: error: job {job!r} already runs with --workers 2 (not 3): give the job's settings, or "
                   "another --job\n"), err


# -- 2. the claim and its lifetime, in one round trip -------------------------------------------------------------
def test_the_claim_comes_with_its_remaining_lifetime(store: Store) -> None:
    assert store.coordinator_claim() is None
    store.claim_coordinator(SERVING, 5)
    claim = store.coordinator_claim()
    assert claim is not None and claim[0] == SERVING and 0 < claim[1] <= 5000, claim
    store.client.set(store.key("coordinator"), "\x1b[2J not an identity")  # a foreign writer's, without a TTL
    assert store.coordinator_claim() == (UNKNOWN_CLAIM, -1)
    store.client.delete(store.key("coordinator"))
    store.client.hset(store.key("coordinator"), "a", "b")
    with pytest.raises(ConfigError, match=re.escape(f"Redis key {store.key('coordinator')} holds a value of another")):
        store.coordinator_claim()


def test_the_claim_and_its_lifetime_are_read_in_one_transaction(store: Store,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Read apart, the claim could lapse, or another coordinator claim the job, between the two reads."""
    store.claim_coordinator(SERVING, 5)
    pipelines: list[bool] = []
    original = store.client.pipeline

    def pipeline(transaction: bool = True, shard_hint: Any = None) -> Any:
        pipelines.append(transaction)
        return original(transaction=transaction, shard_hint=shard_hint)

    monkeypatch.setattr(store.client, "pipeline", pipeline)
    monkeypatch.setattr(store.client, "pttl", None)  # not called apart
    monkeypatch.setattr(store.client, "get", None)
    assert store.coordinator_claim() is not None
    assert pipelines == [True]


# -- 4. `lbbsp forget`: the check and the deletes in one script ---------------------------------------------------
def test_forget_unless_claimed_deletes_nothing_while_a_coordinator_claims_the_job(store: Store) -> None:
    store.register(JobConfig(store.job, 2, 30))
    _decided(store)
    store.claim_coordinator(SERVING, 5)
    kept = _keys(store)
    with pytest.raises(ConfigError) as raised:
        store.forget(unless_claimed=True)
    assert raised.value.message == (f"job {store.job!r} is served by the coordinator {SERVING}: stop that coordinator "
                                    "first (its workers would lose their settings and splits), then forget the job")
    assert _keys(store) == kept
    store.client.delete(store.key("coordinator"))
    assert store.forget(unless_claimed=True) == 2
    assert _keys(store) == []
    assert store.forget(unless_claimed=True) == 0


def test_forget_unless_claimed_deletes_thousands_of_keys(store: Store) -> None:
    """The script deletes them in chunks: Lua's unpack of them all at once fails past about 8,000."""
    pipe = store.client.pipeline(transaction=False)
    for k in range(9000):
        pipe.set(store.key("assign", k), "x", ex=60)
    pipe.execute()
    assert store.forget(unless_claimed=True) == 9000
    assert _keys(store) == []


def test_forget_never_unless_claimed_deletes_a_claimed_jobs_keys(store: Store) -> None:
    """Store.forget() with no flag stays unconditional: the simulator's and the tests' clean-up."""
    store.register(JobConfig(store.job, 2, 30))
    store.claim_coordinator(SERVING, 5)
    assert store.forget() == 2 and _keys(store) == []


@pytest.mark.timeout(60)
def test_lbbsp_forget_refuses_a_job_a_coordinator_claims_while_it_runs(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """It checked that no coordinator held the claim, then listed the keys and deleted them: a coordinator that claimed
    the job in between lost its settings and decisions (and its claim stayed, on a job with no settings)."""
    store.register(JobConfig(store.job, 2, 30))
    _decided(store)
    kept = _keys(store)
    scan_iter = redis.Redis.scan_iter

    def listed_then_claimed(self: redis.Redis, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        """The job's keys, as Redis lists them; a coordinator claims the job once they are listed."""
        keys = list(scan_iter(self, *args, **kwargs))
        if self is not store.client and kwargs.get("match", "").startswith(store.prefix):
            store.claim_coordinator(SERVING, 5)
        yield from keys

    monkeypatch.setattr(redis.Redis, "scan_iter", listed_then_claimed)
    assert main(["forget", "--redis", redis_url, "--job", store.job]) == 2
    err = capsys.readouterr().err
    assert err == (f"lbbsp: error: job {store.job!r} is served by the coordinator {SERVING}: stop that coordinator "
                   "first (its workers would lose their settings and splits), then forget the job\n"), err
    assert _keys(store) == sorted([*kept, store.key("coordinator").encode()])



def test_a_key_scan_gives_twice_is_listed_and_deleted_once(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """SCAN may return a key twice while Redis resizes its table (a shared server that grows): the job was listed
    twice by `lbbsp status`, and this suite's key listings flaked one test in about ten on a loaded machine."""
    store.register(JobConfig(store.job, 2, 30))
    _decided(store)
    scan_iter = redis.Redis.scan_iter

    def twice(self: redis.Redis, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        keys = list(scan_iter(self, *args, **kwargs))
        yield from keys + keys  # as a resize in the middle of a scan can

    monkeypatch.setattr(redis.Redis, "scan_iter", twice)
    assert list(store.jobs()).count(store.job) == 1
    assert store.forget() == 2  # its settings and its decisions, each once
    monkeypatch.undo()
    assert _keys(store) == []

# -- 3. `lbbsp status`: the rejected reports beyond those listed, and its wording ---------------------------------
def _rejected(count: int) -> list[dict[str, str]]:
    return [{"worker": str(w), "error": f"bad report {w}"} for w in range(count)]


def _status(redis_url: str, job: str, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["status", "--redis", redis_url, "--job", job, *flags]) == 0
    return capsys.readouterr().out


@pytest.mark.timeout(60)
def test_status_shows_how_many_reports_were_rejected_beyond_those_listed(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A decision records 20 rejected reports and counts the rest in rejected_more: status showed the 20 alone."""
    monkeypatch.setenv("COLUMNS", "400")
    store.register(JobConfig(store.job, 2, 30))
    _decided(store, rejected=_rejected(2), rejected_more=12)
    table = _status(redis_url, store.job, capsys, "--decisions", "1")
    assert "worker 0: bad report 0; worker 1: bad report 1; and 12 more rejected" in table, table
    assert _status(redis_url, store.job, capsys, "--brief").endswith(" ago (14 reports rejected)\n")
    shown = json.loads(_status(redis_url, store.job, capsys, "--json", "--decisions", "1"))
    assert shown["decisions"][0]["rejected_more"] == 12
    assert len(shown["decisions"][0]["rejected"]) == 2
    _decided(store, rejected=_rejected(1))
    assert _status(redis_url, store.job, capsys, "--brief").endswith(" ago (1 report rejected)\n")
    _decided(store)
    assert _status(redis_url, store.job, capsys, "--brief").endswith(" s ago\n")  # none rejected: nothing said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("more", [True, -3, 10**400, "12", 1.5, None],
                         ids=["bool", "negative", "huge", "text", "fraction", "null"])
def test_status_ignores_a_stored_rejected_more_that_is_no_count(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        more: object) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    store.register(JobConfig(store.job, 2, 30))
    _decided(store, rejected=_rejected(1), rejected_more=more)
    table = _status(redis_url, store.job, capsys, "--decisions", "1")
    assert "worker 0: bad report 0 " in table and "more" not in table, table
    assert _status(redis_url, store.job, capsys, "--brief").endswith(" ago (1 report rejected)\n")
    shown = json.loads(_status(redis_url, store.job, capsys, "--json", "--decisions", "1"))
    assert shown["decisions"][0]["rejected_more"] is None


@pytest.mark.timeout(60)
def test_status_of_one_worker_and_one_decision_reads_right(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """It printed "1 workers", a caption "iteration -: no decision yet" and a table "last 1 decisions"."""
    monkeypatch.setenv("COLUMNS", "400")
    store.register(JobConfig(store.job, 1, 30))
    out = _status(redis_url, store.job, capsys, "--decisions", "3")
    assert f"job {store.job}: 1 worker, global batch 30" in out and "1 workers" not in out, out
    assert "iteration -" not in out and re.search(r"\n *no decision yet *\n", out), out
    _decided(store, sizes=[30])
    out = _status(redis_url, store.job, capsys, "--decisions", "3")
    assert re.search(rf"\n *last decision of job {store.job} *\n", out) and "last 1 decisions" not in out, out
    _decided(store, iteration=1, sizes=[30])
    assert f"last 2 decisions of job {store.job}, newest first" in _status(redis_url, store.job, capsys,
                                                                           "--decisions", "3")


@pytest.mark.parametrize("command", [["status"], ["forget", "--job", "some-job"]])
def test_an_empty_redis_url_variable_names_no_redis(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """An empty $LBBSP_REDIS_URL (an unset shell variable, exported) is none, as `lbbsp demo` and `simulate` read it:
    the error says to pass --redis, not that "" is no usable Redis URL."""
    monkeypatch.setenv("LBBSP_REDIS_URL", "")
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "no Redis to read: pass --redis URL or set LBBSP_REDIS_URL" in err, err
