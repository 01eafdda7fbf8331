"""A file system that fills under the embedded Redis (in a container, /dev/shm is 64 MB and PyTorch's DataLoader
workers share it): the server refuses writes until there is room again and then goes on by itself, workers and the
coordinator wait it out as an outage, and a folder that cannot be made is a clear error. A full disk is /dev/full
as the append-only file, or a real small tmpfs where room comes back; mounting one needs root (CAP_SYS_ADMIN), and
elsewhere those tests skip."""
from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from lbbsp import Coordinator, EmbeddedRedis, JobConfig, Store, StoreUnavailable, WorkerClient
from lbbsp.store import refusing


@pytest.fixture
def disk() -> Iterator[Path]:
    """A 2 MB tmpfs (short path: a unix socket's path has at most 107 bytes), unmounted at the end."""
    mount = Path(tempfile.mkdtemp(prefix="lbbsp-disk-", dir="/tmp"))
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=False,
                              capture_output=True)
        why = made.stderr.decode().strip() if made.returncode else ""
    except OSError as exc:  # no mount command
        why = str(exc)
    if why:
        mount.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {why}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)
    mount.rmdir()


def _fill(disk: Path) -> Path:
    """Write zeros to a file on ``disk`` until it has no room left; the file, to remove for room again."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(65536))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return filler


def _refused(attempt) -> redis.ResponseError:  # type: ignore[no-untyped-def]
    """The error answer of ``attempt()``, which must fail with one."""
    with pytest.raises(redis.ResponseError) as caught:
        attempt()
    return caught.value


def _write_until_refused(client: redis.Redis) -> redis.ResponseError:
    """Redis's answer to the first write it refuses: those that still fit in the append-only file's last page are
    taken, and so is the first that does not (its reply is sent before the append fails; it is kept, to append
    once there is room)."""
    for i in range(10_000):
        try:
            client.set(f"during-{i}", "x" * 100)
        except redis.ResponseError as exc:
            return exc
    raise AssertionError("every write was taken on a full disk")


def test_a_full_disk_refuses_writes_and_the_server_stays(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Under appendfsync always, redis-server exited at the first write it could not append, and at every restart
    after: the watch gave up within seconds, and the job had no Redis for good, room or not. Here the append-only
    file is /dev/full, where every write fails with ENOSPC (no root needed)."""
    (tmp_path / "appendonly.aof").symlink_to("/dev/full")
    with caplog.at_level(logging.WARNING, logger="lbbsp.embedded"), EmbeddedRedis(tmp_path) as server:
        client = redis.Redis(unix_socket_path=str(server.socket_path))
        pid = server.pid
        failed = _write_until_refused(client)
        assert "MISCONF" in str(failed) and "No space left on device" in str(failed) and refusing(failed)
        pipe = client.pipeline(transaction=True).set("during", 1).expire("during", 60)
        assert refusing(_refused(pipe.execute))  # "Command # 1 (...) of pipeline caused error: MISCONF ..."
        assert refusing(_refused(lambda: client.eval("return redis.call('SET', KEYS[1], 1)", 1, "during")))
        with Store.from_url(server.url, "full-disk") as store, pytest.raises(
                StoreUnavailable, match=r"Redis at unix://.* refuses for now: MISCONF Errors writing to the AOF"):
            store.ping()  # (it had said "Redis refused the connection's settings")
        time.sleep(1.5)
        assert server.pid == pid and client.get("during-0") == b"x" * 100  # the same server, still read
        client.close()
    assert "died" not in caplog.text, caplog.text


def test_the_server_takes_writes_again_once_the_disk_has_room(disk: Path) -> None:
    """By itself, within a second or so, keeping every write it took (a SIGKILL after shows the file holds them)."""
    with EmbeddedRedis(disk / "r", own_directory=True) as server:
        client = redis.Redis(unix_socket_path=str(server.socket_path))
        client.set("before", 1)
        pid = server.pid
        filler = _fill(disk)
        _write_until_refused(client)
        filler.unlink()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.set("after", 1)
                break
            except redis.ResponseError:
                assert time.monotonic() < deadline, "writes still refused 10 s after the disk had room"
                time.sleep(0.1)
        assert server.pid == pid
        server.restart(kill=True)  # SIGKILL: only the append-only file carries the keys over
        assert client.get("before") == b"1" and client.get("after") == b"1" and client.get("during-0") == b"x" * 100
        client.close()


def test_a_folder_on_a_full_disk_is_an_error_that_says_so(disk: Path) -> None:
    """It had reached `lbbsp demo` as "cannot reach Redis ([Errno 28] No space left on device); check --redis"."""
    _fill(disk)
    with pytest.raises(StoreUnavailable, match=r"cannot make the embedded Redis's folder in .*lbbsp-disk-.*: No space "
                                               r"left on device; free some room there .*shm-size.*a Redis of your own"):
        EmbeddedRedis(disk / "r", own_directory=True)


def test_training_rides_out_a_full_disk_with_one_split_per_iteration(
        disk: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers and the coordinator through a disk that fills for 3 s: every iteration the workers take the same
    vector, the coordinator logs an outage (its traceback had been logged twice a second as a failed step), and
    balancing goes on afterwards."""
    import lbbsp.coordinator as coordinator_module  # noqa: PLC0415

    monkeypatch.setattr(coordinator_module, "_OUTAGE_GRACE_S", 0.5)
    config = JobConfig("full-disk", num_workers=2, global_batch=96, assignment_timeout_s=2.0)
    with EmbeddedRedis(disk / "r", own_directory=True) as server, Store.from_url(server.url, config.job) as store, \
            caplog.at_level(logging.WARNING):
        coordinator = Coordinator(store, config).start()
        clients = [WorkerClient(Store.from_url(server.url, config.job), config, worker=w) for w in range(2)]
        filler: Path | None = None
        try:
            for k in range(30):
                if k == 10:
                    filler = _fill(disk)
                    threading.Timer(3.0, filler.unlink).start()
                vectors: list[tuple[int, ...]] = [(), ()]

                def fetch(w: int, k: int = k, vectors: list[tuple[int, ...]] = vectors) -> None:
                    vectors[w] = clients[w].assignment(k).sizes

                threads = [threading.Thread(target=fetch, args=(w,)) for w in range(2)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(60)
                assert vectors[0] == vectors[1] and sum(vectors[0]) == 96, (k, vectors)
                for w, per_sample in enumerate((1e-4, 3e-4)):
                    clients[w].report(k, vectors[0][w], per_sample * vectors[0][w] + 1e-3)
            assert vectors[0][0] > 60, vectors  # balanced again after the outage: worker 0 is three times faster
        finally:
            for client in clients:
                client.close()
                client.store.close()
            coordinator.stop()
    assert filler is not None and not filler.exists()
    said = caplog.text
    assert "coordinator step failed" not in said, said
    assert "Redis unavailable for" in said and "MISCONF Errors writing to the AOF file" in said, said
    assert "Redis is back after" in said, said


@pytest.mark.parametrize(("error", "refused"), [
    (redis.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to "
                         "disk. Commands that may modify the data set are disabled"), True),  # a save that failed
    (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), True),
    (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), True),
    (redis.ResponseError("NOREPLICAS Not enough good replicas to write."), True),
    (redis.ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."),
     True),
    (redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
    (redis.ResponseError("BUSYKEY Target key name already exists."), False),
    (redis.ResponseError("ERR unknown command 'FCALL'"), False),
    (redis.ConnectionError("Error 111 connecting"), False),  # an outage already, by its class
])
def test_refusals_are_told_from_faults_of_the_command(error: Exception, refused: bool) -> None:
    """What the coordinator waits out as an outage (a state of the server that clears by itself), and what it logs
    as a failed step: the texts are Redis's own, as redis-py raises them."""
    assert refusing(error) is refused


_COORDINATOR_WITHOUT_ROOM = r"""
import json, logging, os, signal, subprocess, sys, tempfile, threading, time
import lbbsp.embedded
from lbbsp import CoordinatorProcess, EmbeddedRedis, JobConfig

if __name__ == "__main__":
    lbbsp.embedded._RETRY_START_S = 1.0  # the restart watch's pause between tries, shortened
    logging.basicConfig(level=logging.WARNING)
    said = []
    logging.getLogger("lbbsp.coordinator").addHandler(type("H", (logging.Handler,), {
        "emit": lambda self, record: said.append(record.getMessage())})())
    with EmbeddedRedis(tempfile.mkdtemp(dir="/tmp"), own_directory=True) as server:  # not in /dev/shm
        process = CoordinatorProcess(server.url, JobConfig("no-room", 2, 16))
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/dev/shm"], check=True)  # this namespace's
        filler = "/dev/shm/filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(bytes(65536))
                    f.flush()
            except OSError:
                pass
        os.kill(process._process.pid, signal.SIGKILL)
        time.sleep(4)  # several tries, each failing: more than RESTARTS (3) had it counted them
        during = {"alive": process.alive, "watching": any(t.name.startswith("lbbsp-coordinator-watch")
                                                          for t in threading.enumerate())}
        os.remove(filler)
        deadline = time.monotonic() + 20
        while not process.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        print(json.dumps({"during": during, "after": process.alive, "restarts": process.restarts, "said": said}))
        process.stop()
"""


def test_a_coordinator_process_that_cannot_start_for_want_of_room_is_started_once_there_is_room(
        tmp_path: Path) -> None:
    """A full /dev/shm (where the start's semaphore lives) had ended the restart watch's thread with an OSError, so
    the coordinator, killed once, stayed dead for the rest of training. Run in a mount namespace of its own, whose
    /dev/shm is a full 1 MB tmpfs (needs root)."""
    script = tmp_path / "no_room.py"
    script.write_text(_COORDINATOR_WITHOUT_ROOM)
    try:
        run = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, str(script)],
                             capture_output=True, text=True, timeout=120, check=False)
    except FileNotFoundError:
        pytest.skip("no unshare command here")
    if "unshare failed" in run.stderr or "mount: " in run.stderr:
        pytest.skip(f"cannot make a mount namespace with a small /dev/shm here (needs root): {run.stderr[-300:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["during"] == {"alive": False, "watching": True}, result
    assert result["after"] is True and result["restarts"] == 1, result
    tries = [line for line in result["said"] if "could not start the coordinator process" in line]
    assert len(tries) >= 3 and all("No space left on device (its semaphores live in /dev/shm" in line
                                   and line.endswith("trying again in 1 s") for line in tries), result["said"]
    assert sum("died" in line for line in result["said"]) == 1, result["said"]  # the death told once
