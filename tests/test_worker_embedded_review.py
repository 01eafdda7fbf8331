"""Fixes from a review of the worker side and the embedded Redis: a server started in a forked child, a forked child's
exit, a socket path too long for a unix socket, a server that dies by itself, and what an ``agree`` returns."""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest
import redis

from lbbsp import Assignment, ConfigError, EmbeddedRedis, JobConfig, Store, StoreUnavailable, WorkerClient, embedded


def _in_a_forked_child(body: str, server: EmbeddedRedis, timeout_s: float = 20.0) -> int:
    """Run ``body`` (``child_started``, ``child_closed``) in a child forked from this process; its exit code, or -1
    if it still ran after ``timeout_s`` (it is then killed). The child never returns into pytest."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if body == "child_started":  # a child starts a server of its own
                with EmbeddedRedis() as own, Store.from_url(own.url, "child") as store:
                    store.ping()
            else:  # a child that exits normally runs the atexit hooks it inherited: the parent's server's close()
                server.close()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1


def test_a_child_forked_after_a_server_started_can_start_one_of_its_own() -> None:
    """The child waited forever for the parent's launcher thread, which a fork does not copy (multiprocessing's
    default start method on Linux forks)."""
    with EmbeddedRedis() as server:
        assert _in_a_forked_child("child_started", server) == 0


def test_a_forked_child_that_exits_leaves_the_parents_server_and_folder_alone() -> None:
    """The child's atexit close() removed the parent's folder, socket and append-only file included: every new
    connection then failed with 'No such file or directory', and a restart would have lost every assignment."""
    with EmbeddedRedis() as server:
        assert _in_a_forked_child("child_closed", server) == 0
        assert sorted(p.name for p in server.directory.iterdir()) == ["appendonly.aof", "owner", "redis.log",
                                                                      "redis.sock"]
        with Store.from_url(server.url, "parent") as store:
            store.ping()
    assert not server.directory.exists()  # the parent's own close() still removes it


def test_a_socket_path_too_long_for_a_unix_socket_is_a_config_error_at_once(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-server listened on the path cut at 107 bytes, where no client looked: start_timeout_s (10 s) later,
    'did not start within 10.0s' with a Redis log that said nothing of the path."""
    long_folder = tmp_path / ("x" * 110)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"unix socket .* is \d+ bytes long, more than the 107"):
        EmbeddedRedis(long_folder, own_directory=True, start_timeout_s=2.0)
    assert not long_folder.exists()
    long_parent = tmp_path / ("t" * 90)  # a long TMPDIR where /dev/shm is not writable
    long_parent.mkdir()
    monkeypatch.setattr(embedded, "temp_parent", lambda: str(long_parent))
    with pytest.raises(ConfigError, match="shorter directory"):
        EmbeddedRedis(start_timeout_s=2.0)
    assert list(long_parent.iterdir()) == []  # the folder it made is removed
    assert time.monotonic() - started < 1.5


def test_a_server_that_dies_by_itself_is_logged_with_what_it_said(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A full /dev/shm: redis-server exits at its first write ('Error writing to the AOF file: No space left on
    device'), which only its log said, in a folder close() removes; the warning said 'died (exit code 1)'."""
    (tmp_path / "appendonly.aof").symlink_to("/dev/full")  # every write fails with ENOSPC, as on a full disk
    with caplog.at_level(logging.WARNING, logger="lbbsp.embedded"), EmbeddedRedis(tmp_path) as server:
        with Store.from_url(server.url, "full", socket_timeout_s=1.0) as store, pytest.raises(redis.ConnectionError):
            store.client.set("k", "v")
        deadline = time.monotonic() + 5
        while "died" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        server.stop()
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert died and "No space left on device" in died[0], caplog.text


@pytest.mark.parametrize("returns", ["none", "sizes", "other iteration", "other batch"])
def test_an_agree_that_returns_no_assignment_of_the_iteration_is_a_config_error(redis_url: str, job: str,
                                                                                returns: str) -> None:
    """A None or a tuple ended in "AttributeError: 'NoneType' object has no attribute 'iteration'"; an assignment of
    another iteration or global batch was every worker's split, unchecked."""
    config = JobConfig(job, 2, 10, lag=1)
    wrong = {"none": lambda a: None, "sizes": lambda a: a.sizes,
             "other iteration": lambda a: Assignment(job, a.iteration + 1, a.sizes, "fallback"),
             "other batch": lambda a: Assignment(job, a.iteration, (6, 6), "fallback")}[returns]
    with Store.from_url(redis_url, job) as store, WorkerClient(store, config, 0, agree=wrong) as worker:
        with pytest.raises(ConfigError, match="agree returned") as raised:
            worker.assignment(0)
        assert raised.value.iteration == 0
        assert worker.peek(1) is None or worker.peek(1).iteration == 1  # nothing wrong was remembered


def test_a_server_in_a_directory_given_relative_to_the_current_one_starts_and_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: str) -> None:
    """redis-server changes into its --dir before it opens its log and socket, so a relative directory had them
    looked up inside itself ('Can't open the log file'): 'embedded redis-server did not start within 10.0s: ' with
    nothing after it, and the socket-path check had measured a path the server never used."""
    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis("redis-data", start_timeout_s=5.0) as server, Store.from_url(server.url, job) as store:
        store.ping()
        assert server.socket_path == tmp_path / "redis-data" / "redis.sock"
    assert (tmp_path / "redis-data" / "appendonly.aof").exists()  # a directory given is kept
    with EmbeddedRedis("owned", own_directory=True, start_timeout_s=5.0) as server:
        assert server.directory == tmp_path / "owned"
    assert not (tmp_path / "owned").exists()  # and one owned is removed, wherever the process has moved since


def test_a_server_that_exits_at_start_is_reported_at_once_with_its_exit_code_and_what_it_said(tmp_path: Path) -> None:
    """A corrupt append-only file makes redis-server exit at once: the start-up probe's client had retried its
    connection with backoff for seconds past the exit, and the error said 'did not start within 10.0s'."""
    (tmp_path / "appendonly.aof").write_text("*garbage\r\nnot redis\r\n")
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        EmbeddedRedis(tmp_path, start_timeout_s=10.0)
    assert time.monotonic() - started < 2.0
    assert "exited at start (exit code 1)" in str(caught.value) and "Bad file format" in str(caught.value)
