"""A new user's walkthrough of README.md and docs/core.md: a worker whose iteration jumps ahead, worker rows left stale
by an idle coordinator, `lbbsp coordinator` at a Redis that never answers, and `lbbsp status` and settings-clash
messages. Each test failed before its fix."""
from __future__ import annotations

import logging
import signal
import time

import pytest

from emulated import worker_clients
from lbbsp import BSPPolicy, Coordinator, EmbeddedRedis, JobConfig, Store
from lbbsp.cli import main
from test_cli_operator_review import _pause, stalled_redis  # noqa: F401  (the fixture, for pytest)


def _run(clients: list, iterations: range) -> None:
    """Every worker fetches and reports each of ``iterations``, worker 1 three times slower."""
    for k in iterations:
        for i, client in enumerate(clients):
            size = client.assignment(k).sizes[i]
            client.report(k, size, size / (100.0 * (1 + 2 * i)))


@pytest.mark.timeout(30)
def test_a_worker_whose_iteration_jumps_ahead_is_told_so(redis_url: str, job: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Iterations 0-5, then 1000: the warning said "the previous split is used; is a coordinator running?" while the
    coordinator ran and the split used was the equal one, not iteration 5's. It now names the jump and its cause."""
    config = JobConfig(job, 2, 128, assignment_timeout_s=0.3)
    coordinator = Coordinator(Store.from_url(redis_url, job), config).start()
    try:
        with worker_clients(redis_url, config) as clients:
            _run(clients, range(6))
            assert clients[0].assignment(5).sizes != config.initial_sizes()  # rebalanced: "previous" is not equal
            with caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
                jumped = clients[0].assignment(1000)
    finally:
        coordinator.stop()
        coordinator.store.close()
    assert jumped.fallback and jumped.sizes == config.initial_sizes()  # which vector: unchanged
    warning = [r.getMessage() for r in caplog.records if "iteration 1000" in r.getMessage()]
    assert warning and "iteration 1000 is 995 past this worker's last (5): k must count up by one, across epochs " \
        "too; the equal split is used" in warning[0], caplog.text
    assert "coordinator running" not in warning[0]


@pytest.mark.timeout(30)
def test_a_late_decision_says_which_split_is_used(redis_url: str, job: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """With no coordinator: a worker that knows iteration k-1's split says it uses that one; one that knows none says
    the equal split (it had said "the previous split" either way)."""
    config = JobConfig(job, 2, 128, assignment_timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="lbbsp.worker"):
        with worker_clients(redis_url, config) as clients:
            _run(clients, range(2))  # iterations below lag take the initial split, with no wait
            clients[0].assignment(2)
        with worker_clients(redis_url, config) as fresh:  # a worker started (or restarted) at iteration 9
            fresh[1].assignment(9)
    messages = [r.getMessage() for r in caplog.records]
    assert any("no decision for iteration 2 within 0.2s, so the split of iteration 1 is used" in m
               for m in messages), messages
    assert any("no decision for iteration 9 within 0.2s, so the equal split is used (this worker knows no split "
               "before it)" in m for m in messages), messages


@pytest.mark.timeout(30)
def test_worker_rows_catch_up_once_the_coordinator_is_idle(redis_url: str, job: str) -> None:
    """16 quick iterations, then a pause with the coordinator up: `lbbsp status` showed rows of iteration 2 beside
    the last decision of iteration 17, since the rows held back by the once-a-second limit waited for run()'s end."""
    config = JobConfig(job, 2, 30, assignment_timeout_s=5.0)
    coordinator = Coordinator(Store.from_url(redis_url, job), config, BSPPolicy())
    coordinator.STATUS_EVERY_S = 60.0  # every decision after the first is held back, however slow this machine
    coordinator.start()
    try:
        with worker_clients(redis_url, config) as clients:
            _run(clients, range(16))
            clients[0].assignment(17)
            store = clients[0].store
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                rows = {int(w): s for w, s in store.worker_statuses().items()}
                if rows and all(b'"iteration": 17' in s for s in rows.values()):
                    break
                time.sleep(0.1)
            assert coordinator._thread is not None and coordinator._thread.is_alive()  # still serving
    finally:
        coordinator.stop()
        coordinator.store.close()
    assert sorted(rows) == [0, 1] and all(b'"iteration": 17' in s for s in rows.values()), rows


@pytest.mark.timeout(30)
def test_the_coordinator_gives_up_soon_on_a_redis_that_never_answers(stalled_redis: EmbeddedRedis,  # noqa: F811
                                                                      job: str, capsys: pytest.CaptureFixture[str]) \
        -> None:
    """A redis-server under SIGSTOP: `lbbsp coordinator` waited 16 s in silence (three 5 s socket timeouts) before
    its error, where `lbbsp status` gives up within a few seconds."""
    _pause(stalled_redis, signal.SIGSTOP)
    started = time.monotonic()
    code = main(["coordinator", "--redis", stalled_redis.url, "--job", job, "--workers", "2", "--global-batch", "30"])
    took = time.monotonic() - started
    assert code == 2 and "cannot reach Redis" in capsys.readouterr().err
    assert took < 6.0, f"gave up after {took:.1f}s"


def test_status_of_a_job_without_decisions_says_so(redis_url: str, job: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`--decisions 3` on a job that has none printed an empty table titled "last 0 decisions of job ..."."""
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 30))
        assert main(["status", "--redis", redis_url, "--job", job, "--decisions", "3"]) == 0
        store.forget()
    out = " ".join(capsys.readouterr().out.split())
    assert "last 0 decisions" not in out
    assert f"no decisions yet for job {job}" in out, out


def test_a_settings_clash_names_the_flags_that_differ(redis_url: str, job: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The clash named JobConfig's fields (`JobConfig(... global_batch=256 ...)`) to a user who sets flags."""
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 256, assignment_timeout_s=5.0))
        code = main(["coordinator", "--redis", redis_url, "--job", job, "--workers", "4", "--global-batch", "256",
                     "--timeout", "5", "--max-decisions", "1"])
        store.forget()
    err = capsys.readouterr().err
    assert code == 2 and "JobConfig(" not in err, err
    assert f"job '{job}' already runs with --workers 2 (not 4):" in err, err
    assert "--global-batch" not in err and "--timeout" not in err, err  # only what differs
