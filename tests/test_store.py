"""The Redis store (lbbsp.store): the URL given, else $LBBSP_REDIS_URL; connecting and waiting for Redis; errors
that name the URL (never its password) or the variable; keys, the coordinator's claim, what an earlier run left,
and listing and forgetting jobs."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from emulated import worker_clients
from lbbsp import (
    Assignment,
    ConfigError,
    Coordinator,
    CoordinatorProcess,
    EmbeddedRedis,
    JobConfig,
    LBBSPError,
    ProtocolError,
    Report,
    Store,
    StoreUnavailable,
    WorkerClient,
)
from lbbsp.cli import main
from lbbsp.client_history import ClientHistory
from lbbsp.store import (
    ITERATIONS_KEPT,
    UNKNOWN_CLAIM,
    answering,
    connect,
    redis_url,
    wait_for_redis,
    worker_socket_timeout,
)
from test_cli import DOC, SERVING, _decided, _store_keys


def test_entries_of_the_ready_list_that_are_not_iterations_are_skipped_not_fatal(redis_url: str, job: str) -> None:
    """A number of over 4,300 digits on the ready list (only a foreign writer puts one there) made int() raise after
    the list had been emptied: the coordinator's step failed, and the iterations queued beside it were lost."""
    with Store.from_url(redis_url, job) as store:
        store.client.rpush(store.key("ready"), b"3", b"9" * 5000, b"junk", b"-1", b"5")
        assert store.drain_ready() == [3, -1, 5]  # a negative one is the coordinator's to refuse, with a warning
        store.client.rpush(store.key("ready"), b"9" * 5000, b"7")
        assert store.next_ready(1.0) is None and store.next_ready(1.0) == 7
        store.forget()


def test_a_foreign_key_that_names_no_job_is_left_out_of_the_jobs_listed(redis_url: str, job: str) -> None:
    """A key of the config pattern whose middle is no job name (a space, a colon, bytes that are not UTF-8) made
    Store.jobs() yield it, and `lbbsp status` then failed for every job with "job name must match ..."."""
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 10))
        foreign = [b"lbbsp:a b:config", b"lbbsp:a:b:config", b"lbbsp:\xff:config"]
        for key in foreign:
            store.client.set(key, b"{}")
        try:
            assert job in set(store.jobs()) and not {"a b", "a:b"} & set(store.jobs())
        finally:
            store.client.delete(*foreign)
            store.forget()


def test_a_store_refuses_reports_and_assignments_that_are_not_its_jobs(redis_url: str, job: str) -> None:
    with pytest.raises(ConfigError, match="job name"):
        Store.from_url(redis_url, "a b")
    with pytest.raises(ConfigError, match="job name"):
        Store.from_url(redis_url, None)  # type: ignore[arg-type]
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 8))
        with pytest.raises(ProtocolError, match="worker: worker 5 is not one of the job's 2 workers"):
            store.post_report(Report(job, 5, 0, 4, 0.1), 2)
        with pytest.raises(ProtocolError, match="job: report of job 'other'"):
            store.post_report(Report("other", 0, 0, 4, 0.1), 2)
        for workers in (0, -1):
            with pytest.raises(ConfigError, match="num_workers"):
                store.post_report(Report(job, 0, 0, 4, 0.1), workers)
        assert store.report_count(0) == 0
        with pytest.raises(ProtocolError, match="job: assignment of job 'other'"):
            store.publish(Assignment("other", 3, (4, 4), "p"))
        assert store.get_assignment(3) is None  # nothing written, for good, under this job's key
        assert store.post_report(Report(job, 1, 0, 4, 0.1), 2)


def test_a_url_that_reaches_another_service_is_store_unavailable_naming_it() -> None:
    """An HTTP server on the port had given 30 lines of redis-py traceback ending in InvalidResponse, on every rank."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def answer_as_http() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"<html>not redis</html>\r\n")

        threading.Thread(target=answer_as_http, daemon=True).start()
        with Store.from_url(f"redis://127.0.0.1:{port}/0", "j") as store, \
                pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port} does not answer as Redis does.*check redis="):
            store.ping(hint="check redis= or $LBBSP_REDIS_URL")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [["status"], ["status", "--brief"], ["forget", "--job", "x"],
                                     ["coordinator", "--workers", "2", "--global-batch", "4"]])
@pytest.mark.parametrize(("url", "said"), [("http://host:6379/0", "not a usable Redis URL: http://host:6379/0"),
                                           ("redis://127.0.0.1:1/0", "cannot reach Redis at 127.0.0.1:1")])
def test_an_error_about_the_variables_url_names_the_variable(
        command: list[str], url: str, said: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A URL set in $LBBSP_REDIS_URL, perhaps long ago in a shell's profile, was quoted without saying where it came
    from ("cannot reach Redis at 127.0.0.1:1"), where `lbbsp simulate --redis` names the variable; a URL typed after
    --redis is not named again."""
    monkeypatch.setenv("LBBSP_REDIS_URL", url)
    assert main(command) == 2
    assert capsys.readouterr().err.startswith(f"lbbsp: error: $LBBSP_REDIS_URL: {said}")
    monkeypatch.delenv("LBBSP_REDIS_URL")
    assert main([*command, "--redis", url]) == 2
    assert capsys.readouterr().err.startswith(f"lbbsp: error: {said}")
    assert "begins with `$LBBSP_REDIS_URL:`" in DOC  # the doc says so


@pytest.mark.parametrize(("url", "said"), [
    ("redis://:pw@127.0.0.1:6379/abc", "6379/abc: what follows host:port is no database number"),  # redis-py: db 0
    ("redis://127.0.0.1:6379/1/2", "6379/1/2: what follows host:port is no database number"),  # redis-py: db 12
    ("rediss://127.0.0.1:6379/0;x", "6379/0;x: what follows host:port is no database number"),  # redis-py: db 0
    ("redis://127.0.0.1:6379/0?socket_timeout=20", "the Redis URL's query sets socket_timeout, which lbbsp sets"),
    ("unix:///tmp/r.sock?retry_on_timeout=1&socket_connect_timeout=3&db=2",
     "sets retry_on_timeout, socket_connect_timeout, which lbbsp sets itself"),
    ("redis://127.0.0.1:6379/x?password=pw", "6379/x?password=***: what follows host:port is no database number"),
    ("redis://user:p/w@127.0.0.1:6379", "no database number (/0, /1, ...) (a / in the password is written %2F)"),
    # redis-py hands every query option to the connection: one it does not take failed the first command with a
    # TypeError out of the CLI (a traceback)
    ("redis://:pw@127.0.0.1:6379/0?foo=bar", "lbbsp takes no option 'foo' in a redis:// URL's query"),
    ("redis://127.0.0.1:6379/0?ssl_cert_reqs=none", "no option 'ssl_cert_reqs' in a redis:// URL's query (none "
                                                     "redis-py does not take, or takes as an object; ssl_* options "
                                                     "need rediss://)"),
    ("unix:///tmp/r.sock?foo=1&bar=2", "lbbsp takes no option 'bar', 'foo' in a unix:// URL's query"),
    ("redis://127.0.0.1:6379/0?retry=3&parser_class=x", "no option 'parser_class', 'retry'"),  # objects, not strings
])
def test_a_url_redis_py_would_read_otherwise_than_written_is_refused(url: str, said: str) -> None:
    """redis-py drops a path's slashes and ignores one that is no number, and lets the query's options win over the
    timeouts lbbsp sets: a typo put a job on another database, and a URL's socket_timeout=20 held a step 6 s where
    its assignment_timeout_s was 1."""
    with pytest.raises(ConfigError, match=re.escape(said)) as raised:
        connect(url)
    assert "pw" not in str(raised.value)


def test_urls_with_a_database_number_or_none_connect() -> None:
    for url in ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379/", "redis://127.0.0.1:6379/12",
                "redis://[::1]:6379/2/", "redis://127.0.0.1:6379/0 ", "redis://127.0.0.1:6379/%31",
                "redis://127.0.0.1:6379/abc?db=2", "redis://127.0.0.1:6379/0?health_check_interval=5",
                "unix:///tmp/r.sock?db=3", "redis://127.0.0.1:6379/0?max_connections=4",
                "rediss://127.0.0.1:6379/0?ssl_cert_reqs=none", "redis://127.0.0.1:6379/0?client_name=x&protocol=3",
                "redis://127.0.0.1:6379/0?decode_responses=True"):
        connect(url).close()


def test_a_redis_that_does_not_answer_is_named_by_the_source_given_and_only_then() -> None:
    """One helper reaches Redis for the commands and simulate: its error led by the source given, and by nothing
    where none is (an embedded server's had begun ": cannot reach ...")."""
    for source, lead in [("", "cannot reach Redis"), ("$LBBSP_REDIS_URL", "$LBBSP_REDIS_URL: cannot reach Redis")]:
        with pytest.raises(StoreUnavailable) as raised:
            answering("redis://127.0.0.1:1/0", "j", source=source, socket_timeout_s=0.2)
        assert raised.value.message.startswith(lead), raised.value.message
    with pytest.raises(ConfigError, match=r"^--redis: not a usable Redis URL"):
        answering("http://host", "j", source="--redis")


def test_connection_settings_that_are_not_numbers_are_config_errors(redis_url: str, job: str) -> None:
    """A socket_timeout_s of "5" (from a command line) had failed inside redis-py: '<' not supported between float
    and str; a ttl_s of True was taken as a TTL of 1 second."""
    with pytest.raises(ConfigError, match=r"socket_timeout_s must be seconds in \(0, 86400\], got '5'"):
        Store.from_url(redis_url, job, socket_timeout_s="5")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ttl_s must be an integer, got True"):
        Store.from_url(redis_url, job, ttl_s=True)


@pytest.mark.parametrize("cls", [Store, ClientHistory])
def test_a_url_where_a_redis_client_belongs_says_to_use_from_url(cls: type) -> None:
    with pytest.raises(ConfigError, match=rf"{cls.__name__} takes a Redis client; for a URL, use "
                                          rf"{cls.__name__}\.from_url\(url, job\)") as caught:
        cls("redis://user:secret@localhost:6379/0", "job")
    assert "secret" not in str(caught.value)


def test_a_wrong_typed_watermark_reads_as_none_and_does_not_refuse_a_coordinators_write(redis_url: str,
                                                                                       job: str) -> None:
    config = JobConfig(job, 2, 10, lag=1)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        store.client.sadd(store.key("forgotten"), "x")
        assert store.forgotten_through() is None
        assert store.publish_all([config.initial_assignment(9)], decided_from=8) == [True]


def test_a_coordinators_identity_is_read_back_as_written(redis_url: str, job: str) -> None:
    with Store.from_url(redis_url, job) as store:
        assert store.claim_coordinator("host.example:4242:abcd", ttl_s=5) is None
        assert store.claim_coordinator("node-7_a.cluster.local:123456:0f3a9c1e", ttl_s=5) == "host.example:4242:abcd"
        assert store.coordinator() == "node-7_a.cluster.local:123456:0f3a9c1e"


def test_a_claim_key_of_another_type_is_no_claim_and_is_replaced(redis_url: str, job: str) -> None:
    with Store.from_url(redis_url, job) as store:
        store.client.hset(store.key("coordinator"), "x", "1")
        assert store.claim_coordinator("host.example:4242:abcd", ttl_s=5) is None
        assert store.coordinator() == "host.example:4242:abcd"


def test_a_claim_if_free_claims_only_a_job_nobody_claims(redis_url: str, job: str) -> None:
    """In one step: two coordinators started together had both read no claim, and both served."""
    with Store.from_url(redis_url, job) as store:
        store.client.hset(store.key("coordinator"), "x", "1")  # another type: no claim, replaced
        assert store.claim_if_free("host.example:4242:abcd", ttl_s=5) is None
        assert store.claim_if_free("host.example:4243:ef01", ttl_s=5) == "host.example:4242:abcd"
        assert store.coordinator() == "host.example:4242:abcd"  # the second wrote nothing
        assert 0 < store.client.ttl(store.key("coordinator")) <= 5


def test_the_given_url_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LBBSP_REDIS_URL", "redis://env:6379/0")
    assert redis_url("redis://flag:6379/0") == ("redis://flag:6379/0", "--redis")
    assert redis_url("unix:///tmp/r.sock", "redis=") == ("unix:///tmp/r.sock", "redis=")
    assert redis_url(None) == ("redis://env:6379/0", "$LBBSP_REDIS_URL")
    assert redis_url("") == ("redis://env:6379/0", "$LBBSP_REDIS_URL")  # an empty flag gives none


def test_an_empty_or_unset_variable_names_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LBBSP_REDIS_URL", "")
    assert redis_url(None) == (None, "")
    monkeypatch.delenv("LBBSP_REDIS_URL")
    assert redis_url("") == (None, "")






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


def _missing_database(url: str) -> str:
    """``url`` with a database number no Redis has by default (16 databases)."""
    if url.startswith("unix://"):
        return url.split("?")[0] + "?db=9999"
    return url.rsplit("/", 1)[0] + "/9999"


def test_a_database_the_server_does_not_have_is_a_config_error_that_says_so(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """redis-py selects the URL's database as it connects, and Redis answers an error ("DB index is out of range"):
    no outage to wait out, nor a StoreUnavailable's "cannot reach"."""
    url = _missing_database(redis_url)
    with Store.from_url(url, job) as store, pytest.raises(ConfigError) as raised:
        store.ping()
    assert raised.value.message == "Redis refused the connection's settings: DB index is out of range"
    assert main(["status", "--redis", url, "--job", job]) == 2
    assert "lbbsp: error: Redis refused the connection's settings: DB index is out of range" in capsys.readouterr().err


def test_a_worker_or_coordinator_given_a_database_the_server_does_not_have_gets_the_config_error(
        redis_url: str, job: str) -> None:
    """Where ``lbbsp status`` and CoordinatorProcess (which ping first) say "Redis refused the connection's
    settings", a Coordinator or WorkerClient built on the store had raised redis-py's bare ResponseError, no
    LBBSPError."""
    with Store.from_url(_missing_database(redis_url), job) as store:
        with pytest.raises(ConfigError, match="refused the connection"):
            Coordinator(store, JobConfig(job, 2, 10))
        with pytest.raises(ConfigError, match="refused the connection"):
            WorkerClient(store, JobConfig(job, 2, 10), 0)


def test_a_store_refuses_the_settings_of_another_job(store: Store) -> None:
    with pytest.raises(ConfigError, match=f"config is for job 'other', store for {store.job!r}"):
        store.register(JobConfig("other", 2, 10))
    assert not store.has_config()


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
    kept = _store_keys(store)
    with pytest.raises(ConfigError) as raised:
        store.forget(unless_claimed=True)
    assert raised.value.message == (f"job {store.job!r} is served by the coordinator {SERVING}: stop that coordinator "
                                    "first (its workers would lose their settings and splits), then forget the job")
    assert _store_keys(store) == kept
    store.client.delete(store.key("coordinator"))
    assert store.forget(unless_claimed=True) == 2
    assert _store_keys(store) == []
    assert store.forget(unless_claimed=True) == 0


def test_forget_unless_claimed_deletes_thousands_of_keys(store: Store) -> None:
    """The script deletes them in chunks: Lua's unpack of them all at once fails past about 8,000."""
    pipe = store.client.pipeline(transaction=False)
    for k in range(9000):
        pipe.set(store.key("assign", k), "x", ex=60)
    pipe.execute()
    assert store.forget(unless_claimed=True) == 9000
    assert _store_keys(store) == []


def test_forget_never_unless_claimed_deletes_a_claimed_jobs_keys(store: Store) -> None:
    """Store.forget() with no flag stays unconditional: the simulator's and the tests' clean-up."""
    store.register(JobConfig(store.job, 2, 30))
    store.claim_coordinator(SERVING, 5)
    assert store.forget() == 2 and _store_keys(store) == []


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
    assert _store_keys(store) == []


@pytest.mark.parametrize("command", [["status"], ["forget", "--job", "some-job"]])
def test_an_empty_redis_url_variable_names_no_redis(command: list[str], monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """An empty $LBBSP_REDIS_URL (an unset shell variable, exported) is none, as `lbbsp demo` and `simulate` read it:
    the error says to pass --redis, not that "" is no usable Redis URL."""
    monkeypatch.setenv("LBBSP_REDIS_URL", "")
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "no Redis to read: pass --redis URL or set LBBSP_REDIS_URL" in err, err


SECRET = "s3cretpw"


TLS_HINT = "(the URL asks for TLS (rediss://): if the server has none, use redis://)"


@pytest.mark.parametrize("url", [
    f"redis//:{SECRET}@127.0.0.1:1",  # the scheme's colon missing
    f"redis:/:{SECRET}@127.0.0.1:1",  # a slash missing
    f"redis:{SECRET}@127.0.0.1:1",  # both slashes missing
    f":{SECRET}@127.0.0.1:1",  # no scheme
    f"user:{SECRET}@127.0.0.1:1",
    f"http://:{SECRET}@127.0.0.1:1",
    f"redis://user:{SECRET}@127.0.0.1:1/0",  # well formed
    f"redis://:{SECRET}@127.0.0.1:1/0@x",  # an @ after the host
    f"redis://:pa/{SECRET}@127.0.0.1:1/0",  # a slash in the password
    f"redis://:{SECRET}@127.0.0.1:99999/0",  # a port out of range
    f"redis://:{SECRET}\uff03@127.0.0.1:1/0",  # a character that the URL parser quotes the netloc for
    f"unix://:{SECRET}@/tmp/lbbsp-no-such.sock",
    f"unix://:{SECRET}@",  # no socket
])
def test_no_error_about_a_url_shows_its_password(url: str, job: str) -> None:
    errors: list[Exception] = []
    for attempt in (lambda: Store.from_url(url, job, socket_timeout_s=0.2).ping(),
                    lambda: wait_for_redis(url, 0.1, socket_timeout_s=0.2)):
        with pytest.raises(LBBSPError) as raised:
            attempt()
        errors.append(raised.value)
    for error in errors:
        assert SECRET not in str(error), error
    assert "***" in str(errors[1]), errors[1]  # wait_for_redis names the URL, password masked


def test_the_cli_masks_the_password_of_a_malformed_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--redis", f"redis//:{SECRET}@127.0.0.1:6390"]) == 2
    err = capsys.readouterr().err
    assert "not a usable Redis URL: redis//:***@127.0.0.1:6390" in err, err
    assert SECRET not in err


def test_a_tls_url_to_a_server_without_tls_says_so() -> None:
    with EmbeddedRedis(listen="127.0.0.1") as server:
        plain = server.tcp_url("127.0.0.1")
        tls = plain.replace("redis://", "rediss://", 1)
        started = time.monotonic()
        with Store.from_url(tls, "", socket_timeout_s=0.2) as store, pytest.raises(LBBSPError) as raised:
            store.ping()
        assert TLS_HINT in raised.value.message, raised.value
        with pytest.raises(LBBSPError) as waited:
            wait_for_redis(tls, 0.3, socket_timeout_s=0.2)
        assert TLS_HINT in waited.value.message, waited.value
        assert time.monotonic() - started < 5
        with Store.from_url(plain, "") as store:
            store.ping()  # the same server, reached without TLS


def test_a_tls_url_where_nothing_listens_gives_no_tls_hint() -> None:
    """A refused connection is no TLS matter: switching to redis:// would not help."""
    with Store.from_url("rediss://127.0.0.1:1/0", "", socket_timeout_s=0.2) as store, \
            pytest.raises(LBBSPError) as raised:
        store.ping()
    assert "Connection refused" in raised.value.message and "TLS" not in raised.value.message, raised.value


def test_other_settings_than_a_finished_run_s_say_the_run_is_over(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 10)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        with worker_clients(redis_url, config) as clients:
            for client in clients:
                client.assignment(0)
                client.report(0, 5, 0.05)
                client.flush()
            Coordinator(store, config).run(max_decisions=1, poll_s=0.05)  # decides, then releases its claim
        assert store.decision_count() == 1 and store.coordinator() is None
        with pytest.raises(ConfigError) as raised:
            store.register(JobConfig(job, 2, 12))
        assert raised.value.message == (
            f"job {job!r} was started with global_batch=10 (not 12); its keys are left by an earlier run, whose "
            f"coordinator has stopped: `lbbsp forget --job {job}` clears them once that run is over, or use another "
            "job name")
        assert main(["forget", "--redis", redis_url, "--job", job]) == 0  # as the message advises
        assert store.register(JobConfig(job, 2, 12)).global_batch == 12


def test_other_settings_than_a_served_job_s_say_it_runs(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 10)
    with Store.from_url(redis_url, job) as store:
        store.register(config)
        store.record_decision("{}")  # a decision of the coordinator that serves the job
        store.claim_coordinator("host:1:serving", ttl_s=5)
        with pytest.raises(ConfigError) as raised:
            store.register(JobConfig(job, 2, 12))
    assert raised.value.message == (f"job {job!r} already runs with global_batch=10 (not 12); use another job name or "
                                    "the same settings")




@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a stalled Redis behind a proxy, a wrong service)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(2)
    for conn in accepted:
        conn.close()
    listener.close()


def test_wait_for_redis_gives_up_after_its_timeout_on_a_server_that_never_answers(silent_port: int) -> None:
    """Before: each ping ran with the client's two retries at the worker's socket timeout (3.3 s for the default
    assignment_timeout_s), so a 1 s wait took 10.1 s and said 'did not answer within 1s'. Now each ping is one try
    bounded by the time left."""
    url = f"redis://127.0.0.1:{silent_port}/0"
    began = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"did not answer within 1s") as caught:
        wait_for_redis(url, 1.0, socket_timeout_s=worker_socket_timeout(10.0))
    waited = time.monotonic() - began
    assert 0.9 <= waited <= 1.8, (waited, str(caught.value))


def test_a_coordinator_process_on_a_server_that_never_answers_fails_within_seconds(silent_port: int, job: str) -> None:
    """CoordinatorProcess had waited 30 s (three 5 s tries to register the job, then three to ping) before its
    StoreUnavailable, whatever start_timeout_s; it now pings first, as `lbbsp coordinator` does."""
    began = time.monotonic()
    with pytest.raises(StoreUnavailable, match=f"cannot reach Redis at 127.0.0.1:{silent_port}"):
        CoordinatorProcess(f"redis://127.0.0.1:{silent_port}/0", JobConfig(job, 2, 8))
    assert time.monotonic() - began < 6


def test_wait_for_redis_returns_a_client_with_its_socket_timeout_and_retries(server: EmbeddedRedis) -> None:
    """The client returned is the usual one (the caller's socket timeout, retried commands), not the bounded probe."""
    client = wait_for_redis(server.url, 5.0, socket_timeout_s=0.7)
    try:
        assert client.ping()
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.7
        assert kwargs["retry"]._retries == 2
    finally:
        client.close()


@pytest.mark.parametrize("post", ["post_report", "post_reports"])
def test_posting_what_is_no_report_is_a_type_error_that_says_what_to_build(store: Store, job: str, post: str) -> None:
    """A dict of a report's fields had raised AttributeError: 'dict' object has no attribute 'job'."""
    fields = {"job": job, "worker": 0, "iteration": 1, "samples": 8, "compute_s": 0.1}
    with pytest.raises(TypeError, match=r"expected a Report, got dict: build one with Report\(job, worker"):
        if post == "post_report":
            store.post_report(fields, 2)  # type: ignore[arg-type]
        else:
            store.post_reports([Report(job, 1, 1, 8, 0.1), fields], 2)  # type: ignore[list-item]
    assert store.client.exists(store.key("reports", 1)) == 0  # nothing of the batch was posted


def test_a_job_that_runs_without_a_coordinator_keeps_its_keys_bounded_and_its_settings(redis_url: str,
                                                                                        job: str) -> None:
    """With no coordinator serving (stopped, given up, or coordinator=False), nothing cleaned up: the ready queue grew
    by one a step for good (30,000 entries after 30,000 steps), each iteration's keys stayed for ttl_s (60,205 keys),
    and the job's settings expired after ttl_s, so `lbbsp status` said 'no lbbsp jobs' of a job still training."""
    kept = ITERATIONS_KEPT
    with Store.from_url(redis_url, job, ttl_s=600) as store:
        store.register(JobConfig(job, 2, 8, ttl_s=600))
        store.client.expire(store.key("config"), 30)  # as if registered long ago
        for k in range(kept + 150):
            store.publish(Assignment(job, k, (4, 4), "fallback", fallback=True))  # a worker's, written once
            for worker in (0, 1):
                store.post_report(Report(job, worker, k, 4, 0.01), 2)
        assert store.client.llen(store.key("ready")) == kept
        assert [k for k in range(kept + 150) if store.reports(k)] == list(range(150, kept + 150))
        assert store.client.exists(*(store.key("assign", k) for k in range(150))) == 0
        assert store.forgotten_through() == 149
        assert store.client.ttl(store.key("config")) > 30 and job in set(store.jobs())


#: Stores made one after another in one process, as tests/emulated.py's worker_clients makes a WorkerClient's
#: each, until one fails; the embedded Redis is started from this process, so it takes the same limit on its clients
_FILES_SCRIPT = textwrap.dedent("""
    import uuid
    from lbbsp import EmbeddedRedis, JobConfig, StoreUnavailable, Store

    server = EmbeddedRedis()
    config = JobConfig(f"fds-{uuid.uuid4().hex[:8]}", 1, 8)
    stores = []
    try:
        for _ in range(2000):
            store = Store.from_url(server.url, config.job)
            store.register(config)
            stores.append(store)
    except StoreUnavailable as exc:
        print(f"FAILED after {len(stores)}: {exc}")
    finally:
        for store in stores:
            store.close()
        server.close()
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("limit", ["-n 256", "-Sn 256"])  # the server bound by the limit too, or raising its own
def test_running_out_of_file_descriptors_is_named_as_such(limit: str) -> None:
    """Many Stores in one process under a small `ulimit -n` (1,000 WorkerClients under 1024): the error had read
    "cannot reach Redis" with redis-py's "Broken pipe", "max number of clients reached" or "Too many open files"."""
    done = subprocess.run(["bash", "-c", f'ulimit {limit} && exec "$0" -c "$1"', sys.executable, _FILES_SCRIPT],
                          capture_output=True, text=True, timeout=100, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("FAILED after"))
    assert int(line.split()[2].rstrip(":")) > 100  # it did run out, far from the start
    assert "ulimit -n" in line and "limit of 256" in line, line  # what to raise, and where it stands
