"""A second `lbbsp coordinator` for a job that a live coordinator serves is refused (it had started, and the two took
turns at the iterations); the claim a crashed coordinator left delays a restart only until it lapses. The first two
tests failed before the fix; the others guard against waiting where nothing is to be waited for."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from emulated import worker_clients
from lbbsp import BSPPolicy, Coordinator, JobConfig, Store
from lbbsp.cli import main

LBBSP = [sys.executable, "-m", "lbbsp.cli"]
CRASHED = "host.example:4242:dead"  # the identity a coordinator that crashed left its claim under (host:pid:tag)


def _flags(url: str, job: str) -> list[str]:
    return ["coordinator", "--redis", url, "--job", job, "--workers", "2", "--global-batch", "30", "--policy", "bsp"]


def _decided_at(url: str, config: JobConfig) -> float:
    """Both workers run iterations 0 and 1; the time.monotonic() at which the coordinator's split of 2 came."""
    with worker_clients(url, config) as clients:
        for k in range(2):
            for i, client in enumerate(clients):
                client.report(k, client.assignment(k).sizes[i], 0.1)
        assignment = clients[0].assignment(2)
        assert not assignment.fallback, "no coordinator decided iteration 2 within the workers' timeout"
        return time.monotonic()


@pytest.mark.timeout(60)
def test_a_second_coordinator_of_a_served_job_is_refused_naming_the_one_that_serves_it(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It had started, said the job had decisions and resumed it, and a second later both coordinators warned of
    each other and kept deciding, each learning from half the iterations."""
    config = JobConfig(job, 2, 30)
    with Store.from_url(redis_url, job) as store:
        live = Coordinator(store, config, BSPPolicy()).start()
        try:
            deadline = time.monotonic() + 10
            while (serving := store.coordinator()) is None:
                assert time.monotonic() < deadline, "the live coordinator never claimed the job"
                time.sleep(0.02)
            started = time.monotonic()
            status = main([*_flags(redis_url, job), "--max-decisions", "1"])
            took = time.monotonic() - started
            assert store.coordinator() == serving, "the refused coordinator touched the live one's claim"
        finally:
            live.stop()
    out, err = capsys.readouterr()
    assert "crash" not in out and "stopped without releasing it) or be renewed" in out, out  # it had said that the
    # live coordinator stopped without releasing its claim, a second before refusing to start because it serves
    assert status == 2, err
    assert err == (f"lbbsp: error: job {job!r} is served by the coordinator {serving} (its claim renewed within the "
                   "last 5 s): stop it first, or use another --job\n"), err
    assert took < 4, f"refused only after {took:.1f} s: its renewals, every second, went unseen until 5 s had passed"


@pytest.mark.timeout(60)
def test_the_claim_a_crashed_coordinator_left_is_waited_out_then_the_job_served(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A restart right after a crash finds the dead coordinator's claim (up to 5 s left, never renewed): it says it
    waits, serves as soon as the claim lapses, not 5 s later, and never before."""
    config = JobConfig(job, 2, 30)
    with Store.from_url(redis_url, job) as store:
        store.claim_coordinator(CRASHED, 3)
        lapses = time.monotonic() + 3
        with ThreadPoolExecutor(1) as pool:
            decided = pool.submit(_decided_at, redis_url, config)
            status = main([*_flags(redis_url, job), "--max-decisions", "2"])
            at = decided.result(timeout=30)
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.startswith(f"job {job!r}: coordinator {CRASHED} holds a claim on this job: waiting up to 5 s for it "
                          "to lapse (a coordinator that stopped without releasing it) or be renewed (one that serves "
                          "the job)\n"), out
    assert f"coordinating job {job!r}" in out, out
    assert lapses - 0.1 < at < lapses + 1.5, f"decided {at - lapses:+.1f} s after the claim lapsed"


@pytest.mark.timeout(60)
def test_a_job_no_coordinator_claims_is_served_at_once(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = JobConfig(job, 2, 30)
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        decided = pool.submit(_decided_at, redis_url, config)
        status = main([*_flags(redis_url, job), "--max-decisions", "2"])
        at = decided.result(timeout=30)
    out = capsys.readouterr().out
    assert status == 0 and "waiting" not in out, out
    assert at - started < 3, f"decided {at - started:.1f} s after the start"


@pytest.mark.timeout(60)
def test_a_signal_while_waiting_for_a_claim_to_lapse_stops_the_command_at_once(redis_url: str, job: str) -> None:
    """Not 3 s later, with a hint to check Redis (the stop's grace period ran out during the wait)."""
    with Store.from_url(redis_url, job) as store:
        store.claim_coordinator(CRASHED, 30)  # set by hand, never renewed: it would be waited on for 5 s
        process = subprocess.Popen([*LBBSP, *_flags(redis_url, job)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line.startswith(f"job {job!r}: coordinator {CRASHED} holds a claim on this job: "
                                   "waiting up to 5 s"), line
            process.send_signal(signal.SIGTERM)
            started = time.monotonic()
            out, err = process.communicate(timeout=10)
            took = time.monotonic() - started
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        assert store.coordinator() == CRASHED
    assert process.returncode == 0 and err == "", (out, err)
    assert out.endswith(f"stopped serving job {job!r} after 0 decisions (SIGTERM)\n"), out
    assert took < 1.5, f"stopped {took:.1f} s after SIGTERM"
