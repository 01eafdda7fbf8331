"""`lbbsp status` for monitoring many jobs: an operator review found only a table and a long sentence per job, however
many jobs and however long finished, an exit status of 0 for a job that no coordinator serves, and no output a
program could read. --json, --brief and --check, against jobs that real coordinators served."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from lbbsp import Coordinator, JobConfig, Report, Store
from lbbsp.cli import main
from lbbsp.policies import BSPPolicy

#: Each worker's compute per iteration, s: worker 0 measures 5 / 0.1 = 50 samples/s, worker 1 5 / 0.25 = 20.
_COMPUTE_S = (0.1, 0.25)


def _reported(store: Store, config: JobConfig, iterations: int) -> None:
    """Every worker's report of the first ``iterations`` iterations, at the initial split."""
    for k in range(iterations):
        for worker, size in enumerate(config.initial_sizes()):
            store.post_report(Report(config.job, worker, k, size, _COMPUTE_S[worker], wait_s=0.02),
                              config.num_workers)


def _rows_of_last_decision(store: Store, timeout_s: float = 10.0) -> None:
    """Wait until the workers' status rows are those of the job's latest decision (written once the coordinator
    idles)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        decisions, rows = store.decisions(1), store.worker_statuses()
        if decisions and rows and {json.loads(r)["iteration"] for r in rows.values()} == {
                json.loads(decisions[0])["iteration"]}:
            return
        time.sleep(0.05)
    raise AssertionError(f"no status rows of the last decision of job {store.job}")


@pytest.fixture
def served_and_stopped(redis_url: str, job: str) -> Iterator[tuple[str, str]]:
    """Two jobs of 2 workers: one a coordinator serves (two decisions made), one whose coordinator made two
    decisions and stopped."""
    served, stopped = JobConfig(f"{job}-served", 2, 10), JobConfig(f"{job}-stopped", 2, 10)
    with Store.from_url(redis_url, served.job) as serving_store, Store.from_url(redis_url, stopped.job) as old_store, \
            Store.from_url(redis_url, served.job) as workers:
        coordinator = Coordinator(serving_store, served, BSPPolicy())
        try:
            finished = Coordinator(old_store, stopped, BSPPolicy())
            _reported(old_store, stopped, 2)
            finished.run(max_decisions=2, poll_s=0.05)  # then it releases its claim
            _reported(workers, served, 2)
            coordinator.start()
            _rows_of_last_decision(workers)
            yield served.job, stopped.job
        finally:  # the other tests share this Redis
            coordinator.stop()
            serving_store.forget()
            old_store.forget()


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`lbbsp` run in-process on ``argv``: its exit status and what it printed."""
    code = main(argv)
    return code, capsys.readouterr().out


@pytest.mark.timeout(60)
def test_json_gives_each_jobs_coordinator_last_decision_and_workers(
        served_and_stopped: tuple[str, str], redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every job as one JSON document: the coordinator's identity or null, the last decision's iteration, age, policy
    and reason, and each worker's row as the table shows it (null where it shows "-")."""
    served, stopped = served_and_stopped
    code, out = _run(["status", "--redis", redis_url, "--json"], capsys)
    assert code == 0
    jobs = {j["name"]: j for j in json.loads(out)}
    with Store.from_url(redis_url, served) as store:
        last = json.loads(store.decisions(1)[0])
        identity = store.coordinator()
    assert identity is not None
    job = jobs[served]
    assert (job["num_workers"], job["global_batch"], job["served_by"]) == (2, 10, identity)
    decision = job["last_decision"]
    assert (decision["iteration"], decision["policy"], decision["reason"]) == (last["iteration"], "bsp", last["reason"])
    assert 0 <= decision["seconds_ago"] < 30 and decision["time"] == last["time"]
    assert job["workers"] == [
        {"index": 0, "iteration": last["iteration"], "size": 5, "predicted_throughput": None,
         "predicts": False, "measured_throughput": 50.0, "compute_s": 0.1, "wait_s": 0.02, "kind": None},
        {"index": 1, "iteration": last["iteration"], "size": 5, "predicted_throughput": None,
         "predicts": False, "measured_throughput": 20.0, "compute_s": 0.25, "wait_s": 0.02, "kind": None}]
    assert "decisions" not in job  # only with --decisions N
    assert jobs[stopped]["served_by"] is None and jobs[stopped]["last_decision"]["policy"] == "bsp"
    assert len(jobs[stopped]["workers"]) == 2

    code, out = _run(["status", "--redis", redis_url, "--job", stopped, "--json", "--decisions", "5"], capsys)
    one = json.loads(out)  # the one job, not a list
    assert code == 0 and one["name"] == stopped and one["served_by"] is None
    assert [d["sizes"] for d in one["decisions"]] == [[5, 5], [5, 5]]
    assert [d["written_by"] for d in one["decisions"]] == ["coordinator"] * 2
    assert one["decisions"][0]["iteration"] == one["last_decision"]["iteration"]


#: Stored where a coordinator writes text: an escape that clears the screen, colour, and a newline.
_HOSTILE = "\x1b[2J\x1b[31mRED\nFAKE"


@pytest.mark.timeout(60)
def test_json_carries_stored_values_checked_and_text_escaped(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Values read from Redis go out as the table reads them: a number no float holds, or no number, as null; text as
    JSON strings, whose control characters JSON escapes; a claim that is no coordinator identity as 'unknown'."""
    with Store.from_url(redis_url, job) as store:
        try:
            store.register(JobConfig(job, 2, 10))
            store.client.set(store.key("coordinator"), f"host:1:{_HOSTILE}", ex=60)
            store.client.lpush(store.key("decisions"), json.dumps({
                "iteration": 4, "sizes": [5, _HOSTILE, 10**400], "policy": _HOSTILE, "written_by_coordinator": True,
                "reason": _HOSTILE, "rejected": [{"worker": _HOSTILE, "error": 3}, "junk"], "time": "yesterday"}))
            store.client.hset(store.key("workers"), mapping={
                "0": json.dumps({"iteration": 4, "size": 5, "predicted_throughput": 10**400, "predicts": 0,
                                 "measured_throughput": -1, "compute_s": None, "wait_s": 0.5, "kind": _HOSTILE}),
                "1": b'{"iteration": 4, "size": true, "predicted_throughput": NaN, "measured_throughput": Infinity, '
                     b'"compute_s": -Infinity, "wait_s": null, "kind": 7}',
                "2": b"not json"})
            code, out = _run(["status", "--redis", redis_url, "--job", job, "--json", "--decisions", "1"], capsys)
        finally:
            store.forget()
    assert code == 0
    assert "\x1b" not in out and "\nFAKE" not in out  # escaped: "\\u001b", "\\n"
    for bad in ("NaN", "Infinity"):
        assert bad not in out
    status = json.loads(out)
    assert status["served_by"] == "unknown (not an lbbsp claim)"
    assert status["last_decision"] == {"iteration": 4, "time": None, "seconds_ago": None,
                                       "policy": _HOSTILE, "reason": _HOSTILE}
    assert status["decisions"][0]["sizes"] == [5, None, None]
    assert status["decisions"][0]["rejected"] == [{"worker": _HOSTILE, "error": None}]
    assert status["workers"] == [
        {"index": 0, "iteration": 4, "size": 5, "predicted_throughput": None, "predicts": None,
         "measured_throughput": -1.0, "compute_s": None, "wait_s": 0.5, "kind": _HOSTILE},
        {"index": 1, "iteration": 4, "size": None, "predicted_throughput": None, "predicts": None,
         "measured_throughput": None, "compute_s": None, "wait_s": None, "kind": None}]


@pytest.mark.timeout(60)
def test_brief_gives_one_line_per_job(served_and_stopped: tuple[str, str], redis_url: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A line per job, whatever else is on this Redis: its name, workers, coordinator and the last decision's age."""
    served, stopped = served_and_stopped
    with Store.from_url(redis_url, "") as probe:  # read before: another test's job may expire while status runs
        jobs = set(probe.jobs())
    code, out = _run(["status", "--redis", redis_url, "--brief"], capsys)
    with Store.from_url(redis_url, "") as probe:
        identity = Store(probe.client, served).coordinator()
    lines = out.splitlines()
    names = [line.split(":", 1)[0] for line in lines]
    # one line per job, each a job of this Redis (other tests' jobs with unreadable settings are skipped, with a warning)
    assert code == 0 and len(names) == len(set(names)) and set(names) <= jobs and {served, stopped} <= set(names), out
    by_job = {line.split(":", 1)[0]: line for line in lines}
    assert by_job[served].startswith(f"{served}: 2 workers, served by {identity}, last decision "), by_job[served]
    assert by_job[stopped].startswith(f"{stopped}: 2 workers, no coordinator, last decision "), by_job[stopped]
    for line in (by_job[served], by_job[stopped]):
        assert line.endswith(" s ago") and float(line.rsplit(" ", 3)[1]) < 30, line


@pytest.mark.timeout(60)
def test_check_fails_where_a_job_has_no_coordinator(served_and_stopped: tuple[str, str], redis_url: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """--check: exit 1, after the usual output, where a job listed has no coordinator; 0 where each has one."""
    served, stopped = served_and_stopped
    assert _run(["status", "--redis", redis_url, "--job", served, "--check"], capsys)[0] == 0
    code, out = _run(["status", "--redis", redis_url, "--job", stopped, "--check"], capsys)
    assert code == 1 and out.startswith(f"job {stopped}: no coordinator serves it"), out
    code, out = _run(["status", "--redis", redis_url, "--check", "--brief"], capsys)
    assert code == 1 and f"{stopped}: 2 workers, no coordinator" in out
    code, out = _run(["status", "--redis", redis_url, "--job", served, "--check", "--json"], capsys)
    assert code == 0 and json.loads(out)["name"] == served
    code, out = _run(["status", "--redis", redis_url, "--job", stopped, "--check", "--json"], capsys)
    assert code == 1 and json.loads(out)["served_by"] is None


@pytest.mark.timeout(60)
def test_check_fails_for_a_job_it_could_not_read(redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A job whose keys status cannot read is skipped with a warning; --check does not pass it as served."""
    with Store.from_url(redis_url, job) as store:
        try:
            store.register(JobConfig(job, 2, 10))
            store.client.set(store.key("coordinator"), "host:1:abc", ex=60)
            store.client.set(store.key("decisions"), "not a list")  # WRONGTYPE for the log
            code, out = _run(["status", "--redis", redis_url, "--brief", "--check"], capsys)
        finally:
            store.forget()
    assert code == 1 and job not in out


@pytest.mark.timeout(30)
def test_flags_that_contradict_are_refused(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--json with --brief is a usage error; --brief, one line per job, with --decisions N is refused naming both."""
    with pytest.raises(SystemExit) as exited:
        main(["status", "--redis", redis_url, "--json", "--brief"])
    assert exited.value.code == 2
    assert "argument --brief: not allowed with argument --json" in capsys.readouterr().err
    assert main(["status", "--redis", redis_url, "--brief", "--decisions", "3"]) == 2
    assert "--brief shows one line per job" in capsys.readouterr().err


def test_status_help_describes_the_monitoring_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--json", "--brief", "--check"):
        assert flag in out
    assert "exit 1" in out and "lbbsp forget" in out
