"""A Redis of the user's own that lbbsp cannot work with, as managed services provide them: a user without the
permissions lbbsp needs, or a Redis Cluster, is refused at the start with what to do (a worker had taken their error
answers for an outage, waited 60 s and said to bring Redis back; a coordinator had decided nothing, logging a
traceback every 10 s); a Redis that evicts keys when full is warned about. A user with what lbbsp needs works."""
from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from lbbsp import (
    BSPPolicy,
    ConfigError,
    Coordinator,
    EmbeddedRedis,
    JobConfig,
    Store,
    StoreUnavailable,
    WorkerClient,
)
from lbbsp.cli import main
from lbbsp.client_history import ClientHistory
from lbbsp.embedded import redis_server_binary

PASSWORD = "acl-test-pw"
#: What `docs/core.md` (Your own Redis) tells a user to grant.
GRANTED = ("~lbbsp:*", "resetchannels", "&lbbsp:*", "+@all", "-@dangerous")


def _user(server: EmbeddedRedis, name: str, *rules: str) -> str:
    """A URL of ``server`` for a new ACL user ``name`` with ``rules``."""
    with redis.Redis.from_url(server.url) as admin:
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{PASSWORD}", *rules)
    path = server.url.removeprefix("unix://").split("?")[0]
    return f"unix://{name}:{PASSWORD}@{path}?db=0"


@pytest.mark.parametrize(("rules", "said"), [
    ((*GRANTED, "-@scripting"), "evalsha"),
    (("~other:*", *GRANTED[1:]), "key"),
    (("~lbbsp:*", "resetchannels", "+@all", "-@dangerous"), "publish"),
])
def test_a_user_without_what_lbbsp_needs_is_refused_at_the_start_naming_it(
        own_server: EmbeddedRedis, job: str, rules: tuple[str, ...], said: str) -> None:
    url = _user(own_server, "limited", *rules)
    config = JobConfig(job, 2, 16)
    for start in (lambda store: WorkerClient(store, config, 0), lambda store: Coordinator(store, config, BSPPolicy())):
        with Store.from_url(url, job) as store:
            began = time.monotonic()
            with pytest.raises(ConfigError) as raised:
                start(store)
            assert time.monotonic() - began < 5
        message = raised.value.message
        assert message.startswith("the Redis user may not do what lbbsp needs (") and said in message.lower(), message
        assert " ".join(GRANTED) in message, message
    with redis.Redis.from_url(own_server.url) as admin:
        assert admin.exists(f"lbbsp:{job}:config") == 0, "a refused start left the job's settings behind"


def test_a_user_granted_what_the_docs_say_runs_a_job(own_server: EmbeddedRedis, job: str) -> None:
    url = _user(own_server, "granted", *GRANTED)
    config = JobConfig(job, 2, 16, lag=1)
    with Store.from_url(url, job) as store:
        coordinator = Coordinator(store, config, BSPPolicy())
        workers = [WorkerClient(Store.from_url(url, job), config, w) for w in range(2)]
        try:
            for k in range(3):
                coordinator.step(timeout_s=2.0)
                sizes = {worker.assignment(k).sizes for worker in workers}
                assert sizes == {(8, 8)}
                for w, worker in enumerate(workers):
                    worker.report(k, 8, 0.01 * (w + 1))
                    worker.flush()
        finally:
            for worker in workers:
                worker.close()
                worker.store.close()


def test_the_command_line_and_the_flower_history_refuse_such_a_user_naming_what_lbbsp_needs(
        own_server: EmbeddedRedis, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = _user(own_server, "noscript", *GRANTED, "-@scripting")
    status = main(["coordinator", "--redis", url, "--job", job, "--workers", "2", "--global-batch", "16",
                   "--max-decisions", "1"])
    err = capsys.readouterr().err
    assert status == 2 and "the Redis user may not do what lbbsp needs" in err and PASSWORD not in err, err
    with ClientHistory.from_url(url, job) as history:
        with pytest.raises(ConfigError, match="may not do what lbbsp needs"):
            history.check_access()
        # in a round, as an outage: the round goes on without the history (raised, it had lost the round's results)
        with pytest.raises(StoreUnavailable, match="may not do what lbbsp needs"):
            history.worker_indices(["client-a"])


def test_the_flower_strategy_refuses_such_a_user_as_it_is_built_not_at_its_first_round(
        own_server: EmbeddedRedis, job: str) -> None:
    pytest.importorskip("flwr")
    from flwr.serverapp.strategy import FedAvg  # noqa: PLC0415  (optional: the flower extra)

    from lbbsp.integrations.flower import LoadBalanced  # noqa: PLC0415

    url = _user(own_server, "noscript", *GRANTED, "-@scripting")
    with ClientHistory.from_url(url, job) as history, pytest.raises(ConfigError, match="may not do what lbbsp needs"):
        LoadBalanced(FedAvg(), history)


def _free_port_pair() -> int:
    """A TCP port p below 55536 where p and p + 10000 are both free on the loopback (for a moment)."""
    for _ in range(100):
        with contextlib.ExitStack() as held:
            first = held.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 55536:
                continue
            try:
                held.enter_context(socket.socket()).bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            return int(port)
    raise AssertionError("no two free ports 10000 apart")


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A one-node Redis Cluster holding every hash slot, on a unix socket: its URL."""
    folder = Path(tmp_path_factory.mktemp("cluster", numbered=True))
    path = folder / "r.sock"
    # the cluster's bus listens on the port + 10000 (on every interface with port 0: 10000, which a second run clashed
    # with): two free ones, on the loopback only
    process = subprocess.Popen([redis_server_binary(), "--port", str(_free_port_pair()), "--bind", "127.0.0.1",
                                "--unixsocket", str(path), "--dir", str(folder), "--cluster-enabled", "yes",
                                "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not path.exists():
            assert time.monotonic() < deadline and process.poll() is None, "the cluster's redis-server did not start"
            time.sleep(0.02)
        with redis.Redis(unix_socket_path=str(path)) as admin:
            admin.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
            while admin.execute_command("CLUSTER", "INFO").decode().find("cluster_state:ok") < 0:
                assert time.monotonic() < deadline, "the one-node cluster did not come up"
                time.sleep(0.05)
        yield f"unix://{path}"
    finally:
        process.terminate()
        process.wait(10)


def test_a_redis_cluster_is_refused_at_the_start_as_unsupported(cluster: str, job: str) -> None:
    config = JobConfig(job, 2, 16)
    with Store.from_url(cluster, job) as store:
        began = time.monotonic()
        with pytest.raises(ConfigError, match="this Redis runs in cluster mode .*which lbbsp does not support"):
            WorkerClient(store, config, 0)
        assert time.monotonic() - began < 5


def test_a_redis_that_evicts_keys_when_full_is_warned_about(own_server: EmbeddedRedis, job: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    config_command = own_server.command_name("CONFIG")
    with redis.Redis.from_url(own_server.url) as admin:
        admin.execute_command(config_command, "SET", "maxmemory", "1gb")
        with Store.from_url(own_server.url, job) as store, caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            Coordinator(store, JobConfig(job, 2, 16), BSPPolicy())  # maxmemory-policy noeviction, the default
            assert "evicts keys" not in caplog.text
            admin.execute_command(config_command, "SET", "maxmemory-policy", "volatile-lru")
            Coordinator(store, JobConfig(job, 2, 16), BSPPolicy())
    said = [r.getMessage() for r in caplog.records if "evicts keys" in r.getMessage()]
    assert len(said) == 1 and "(maxmemory-policy volatile-lru)" in said[0] and "noeviction" in said[0], said
