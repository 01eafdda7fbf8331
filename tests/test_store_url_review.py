"""An operator's review of the store's errors: a malformed URL's password kept out of them, a hint where a TLS URL
meets a server without TLS, and a mismatch with a finished run's settings told apart from one with a running job."""
from __future__ import annotations

import time

import pytest

from lbbsp import Coordinator, EmbeddedRedis, JobConfig, Store
from lbbsp.cli import main
from lbbsp.errors import ConfigError, LBBSPError
from lbbsp.store import wait_for_redis
from tests.emulated import worker_clients

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
