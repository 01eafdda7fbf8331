"""`lbbsp coordinator` run as a service (systemd, a container, nohup) and watched with `lbbsp status`: signals,
a Redis that stops answering, and what status says of a job nobody serves. Each test failed before its fix."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from lbbsp import EmbeddedRedis, Store

LBBSP = [sys.executable, "-m", "lbbsp.cli"]


def _reset_signals() -> None:
    """In the child: SIGINT and SIGHUP at their defaults, whatever the test runner had (nohup ignores SIGHUP)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _serving(url: str, job: str, preexec: Callable[[], object] = _reset_signals) -> subprocess.Popen[str]:
    """An `lbbsp coordinator` of ``job`` on ``url``, returned once it has claimed the job."""
    process = subprocess.Popen([*LBBSP, "coordinator", "--redis", url, "--job", job, "--workers", "2",
                                "--global-batch", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=preexec)  # noqa: PLW1509  (signals as a service manager sets them)
    with Store.from_url(url, job) as store:
        deadline = time.monotonic() + 20
        while store.coordinator() is None:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
    return process


def _pause(server: EmbeddedRedis, sig: signal.Signals = signal.SIGSTOP) -> None:
    """Stop the redis-server process (SIGSTOP: it stops answering, as a partitioned one does), or continue it."""
    assert server.pid is not None
    os.kill(server.pid, sig)


@pytest.fixture
def stalled_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server of its own, for the test to stop (:func:`_pause`) and the fixture to continue."""
    with EmbeddedRedis() as server:
        try:
            yield server
        finally:
            _pause(server, signal.SIGCONT)


def _ended(process: subprocess.Popen[str], within_s: float) -> tuple[str, str, float]:
    """Its stdout, stderr and the seconds it took to exit; killed, and the test failed, if it takes longer."""
    started = time.monotonic()
    try:
        out, err = process.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"still running {within_s}s after it was stopped")
    return out, err, time.monotonic() - started


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_stops_the_coordinator_cleanly_says_so_and_releases_its_claim(redis_url: str, job: str,
                                                                              sig: signal.Signals) -> None:
    """SIGHUP (a closed terminal, systemd's reload) killed it: exit -1, its claim left for 5 s, not a word. SIGTERM and
    SIGINT stopped it with code 0 and no line in the log: a stop and a crash read the same."""
    coordinator = _serving(redis_url, job)
    try:
        coordinator.send_signal(sig)
        out, err, _ = _ended(coordinator, 10)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 0, err
    assert f"stopped serving job '{job}' after 0 decisions ({sig.name})" in out, out + err
    assert "Traceback" not in err, err
    with Store.from_url(redis_url, job) as store:
        assert store.coordinator() is None  # a replacement is not taken for a second coordinator
        store.forget()


@pytest.mark.timeout(60)
def test_a_sigterm_as_soon_as_it_says_it_serves_is_a_clean_stop_too(redis_url: str, job: str) -> None:
    """The handler came after the "coordinating job" line and the heap's freeze: a SIGTERM at that line killed it
    (-15, no word), and as a container's PID 1, which the kernel spares signals it has no handler for, was ignored."""
    coordinator = subprocess.Popen([*LBBSP, "coordinator", "--redis", redis_url, "--job", job, "--workers", "2",
                                    "--global-batch", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert coordinator.stdout is not None
        assert coordinator.stdout.readline().startswith(f"coordinating job '{job}'")
        coordinator.terminate()
        out, err, _ = _ended(coordinator, 10)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 0 and f"stopped serving job '{job}'" in out, err
    with Store.from_url(redis_url, job) as store:
        store.forget()


@pytest.mark.timeout(60)
def test_under_nohup_sighup_leaves_the_coordinator_serving(redis_url: str, job: str) -> None:
    """The fix above must not undo nohup, which ignores SIGHUP so that a closed terminal leaves the command running."""
    coordinator = _serving(redis_url, job, preexec=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        coordinator.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert coordinator.poll() is None
        coordinator.terminate()
        out, _, _ = _ended(coordinator, 10)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 0 and "(SIGTERM)" in out, out
    with Store.from_url(redis_url, job) as store:
        store.forget()


@pytest.mark.timeout(60)
def test_a_stop_while_redis_does_not_answer_ends_within_seconds(stalled_redis: EmbeddedRedis, job: str) -> None:
    """With Redis stalled (a partition, a paused server), SIGTERM took 29 s to end the coordinator (a 5 s socket
    timeout, three tries, for its step and each call of its clean-up): docker stop kills at 10 s."""
    coordinator = _serving(stalled_redis.url, job)
    try:
        _pause(stalled_redis)
        coordinator.terminate()
        _, err, took = _ended(coordinator, 8)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 128 + signal.SIGTERM, err
    assert took < 6, took  # 3 s of grace; it had taken 29
    assert f"job '{job}': stopped 3 s after SIGTERM, without releasing the coordinator's claim" in err, err


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_ends_a_stopping_coordinator_at_once(stalled_redis: EmbeddedRedis, job: str) -> None:
    """A second Ctrl-C while the clean-up waited on a stalled Redis ended it with code 0 and no word, as if it had
    stopped cleanly."""
    coordinator = _serving(stalled_redis.url, job)
    try:
        _pause(stalled_redis)
        coordinator.send_signal(signal.SIGINT)
        time.sleep(0.5)
        coordinator.send_signal(signal.SIGINT)
        _, err, took = _ended(coordinator, 8)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 128 + signal.SIGINT, err
    assert took < 1.5, took
    assert f"job '{job}': stopped at a second SIGINT" in err and "Traceback" not in err, err


@pytest.mark.timeout(60)
def test_status_of_a_redis_that_does_not_answer_fails_within_seconds(stalled_redis: EmbeddedRedis) -> None:
    """`lbbsp status` on a stalled Redis took 16.6 s to say it cannot reach it."""
    _pause(stalled_redis)
    started = time.monotonic()
    result = subprocess.run([*LBBSP, "status", "--redis", stalled_redis.url], capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 2 and "cannot reach Redis" in result.stderr, result.stderr
    assert time.monotonic() - started < 9  # the interpreter's start-up, and about 3 s for Redis (it had taken 17)


@pytest.mark.timeout(60)
def test_status_of_a_job_nobody_serves_says_when_it_was_last_decided(redis_url: str, job: str) -> None:
    """A finished job was shown as one whose every step waits for the coordinator, with a call to start one, and
    nothing told it from a job whose coordinator died a moment ago."""
    coordinator = _serving(redis_url, job)
    try:
        coordinator.terminate()
        _ended(coordinator, 10)
    finally:
        coordinator.kill()
    with Store.from_url(redis_url, job) as store:
        store.record_decision('{"iteration": 7, "sizes": [15, 15], "policy": "lbbsp", "written_by_coordinator": true, '
                              f'"reason": "kept", "rejected": [], "time": {time.time() - 150}}}')
        result = subprocess.run([*LBBSP, "status", "--redis", redis_url, "--job", job], capture_output=True, text=True,
                                env={**os.environ, "COLUMNS": "200"}, timeout=30, check=False)
        store.forget()
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"job {job}: no coordinator serves it"), first
    # 150 s before the call, plus the CLI's start-up (seconds on a loaded machine): 2.5 min, or a little more
    assert re.search(r"last decision \(iteration 7\) was 2\.[5-9] min ago", first), first
    assert "while its workers run, they keep the split before (after one wait" in first, first
