"""`lbbsp status`: its tables and decision log, --json, --brief, --check and --decisions, on real Redis; whether a
coordinator serves each job, and what Redis holds shown checked and escaped, one bad entry stopping nothing else."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator

import pytest

from emulated import worker_clients
from lbbsp import BSPPolicy, Coordinator, EmbeddedRedis, JobConfig, Report, Store
from lbbsp.cli import main
from lbbsp.client_history import ClientHistory
from test_cli import LBBSP, _decided, _ended, _pause, _serving, two_iterations
from test_redis_access import GRANTED, _user


def test_status_of_a_job_whose_key_holds_another_type_names_the_key(redis_url: str, job: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with Store.from_url(redis_url, job) as store:
        store.client.rpush(store.key("config"), "x")
        try:
            assert main(["status", "--redis", redis_url, "--job", job]) == 2
        finally:
            store.forget()
    err = capsys.readouterr().err
    assert f"Redis key lbbsp:{job}:config holds a value of another type" in err, err


def test_status_names_federated_jobs_for_what_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    """A Flower job's client history has no coordinator: status had said "no lbbsp jobs" and, given its name, that it
    never started, while `lbbsp forget` then deleted its keys."""
    with EmbeddedRedis() as server, ClientHistory.from_url(server.url, "fl-run") as history:
        history.worker_indices([7])
        assert main(["status", "--redis", server.url]) == 0
        assert "no lbbsp jobs on this Redis but the client histories of federated jobs" in capsys.readouterr().out
        assert main(["status", "--redis", server.url, "--job", "fl-run"]) == 2
        assert "'fl-run' is a federated job (LoadBalanced's client history)" in capsys.readouterr().err


def test_status_says_whether_a_coordinator_serves_the_job(redis_url: str, job: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A coordinator killed for good had left `lbbsp status` showing the last decision and nothing else."""
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, JobConfig(job, 2, 8), BSPPolicy()).start()
        try:
            deadline = time.monotonic() + 10
            while store.coordinator() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert main(["status", "--redis", redis_url, "--job", job]) == 0
            assert f"job {job}: served by the coordinator {store.coordinator()}" in capsys.readouterr().out
        finally:
            coordinator.stop()
        assert store.coordinator() is None  # a coordinator that stops releases its claim
        assert main(["status", "--redis", redis_url, "--job", job]) == 0
        assert f"job {job}: no coordinator serves it" in capsys.readouterr().out
        store.forget()


def _status_rows(url: str, job: str) -> list[dict[str, object]]:
    """The workers' rows of `lbbsp status --json`, from a process of its own."""
    status = subprocess.run([*LBBSP, "status", "--redis", url, "--job", job, "--json"], capture_output=True,
                            text=True, timeout=30, check=False)
    assert status.returncode == 0, status.stderr
    rows: list[dict[str, object]] = json.loads(status.stdout)["workers"]
    return rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "predicted"), [(["--policy", "per-epoch"], True),
                                                  (["--policy", "leader-straggler"], True),
                                                  (["--policy", "static-proportional"], True),
                                                  (["--policy", "bsp"], False)])
def test_status_shows_each_workers_latest_prediction_or_says_the_policy_makes_none(
        redis_url: str, job: str, flags: list[str], predicted: bool) -> None:
    """Under per-epoch (within an epoch) and leader-straggler, whose decisions carry no prediction, every row showed
    "-" for it, as if it were missing, though the coordinator's model predicted each worker's speed."""
    coordinator = subprocess.Popen([*LBBSP, "coordinator", "--redis", redis_url, "--job", job, "--workers", "2",
                                    "--global-batch", "30", "--max-decisions", "2", *flags],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with worker_clients(redis_url, JobConfig(job, 2, 30)) as clients:
        assert two_iterations(clients).sizes == (15, 15)  # within the epoch, observing, profiling, equal
        out, _ = coordinator.communicate(timeout=30)
    assert coordinator.returncode == 0, out
    rows = _status_rows(redis_url, job)
    speeds = [row["predicted_throughput"] for row in rows]
    if predicted:  # the model's forecasts: worker 0 measured 100 samples/s, worker 1 300
        assert all(isinstance(s, float) for s in speeds) and speeds[0] < speeds[1], rows  # type: ignore[operator]
        assert [row.get("predicts") for row in rows] == [True, True], rows
    else:
        assert speeds == [None, None] and [row.get("predicts") for row in rows] == [False, False], rows
    table = subprocess.run([*LBBSP, "status", "--redis", redis_url, "--job", job], capture_output=True, text=True,
                           env={"COLUMNS": "160", "PATH": ""}, timeout=30, check=False).stdout
    worker_rows = [line for line in table.splitlines() if " 15 " in line]
    assert len(worker_rows) == 2 and all(("no model" in row) != predicted for row in worker_rows), table
    with Store.from_url(redis_url, job) as store:
        store.forget()




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


def test_status_help_shows_the_default_of_decisions(capsys: pytest.CaptureFixture[str]) -> None:
    """`lbbsp status --help` showed no default for --decisions, where every other subcommand's help shows them."""
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    assert "(default: 0)" in " ".join(capsys.readouterr().out.split())




def _status(job: str, columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """What `lbbsp status --job JOB --decisions 2` prints in a terminal ``columns`` wide."""
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["status", "--job", job, "--decisions", "2"]) == 0
    return capsys.readouterr().out


@pytest.mark.timeout(60)
def test_the_decision_log_folds_at_80_columns_and_keeps_its_reason_readable(
        redis_url: str, decided: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """At 80 columns the log's six columns had left the reason 22 characters and a rejected report's error 10: a
    decision took 8 lines, a word or two each. Folded, each decision is a line of its sizes with the policy and who
    wrote them, its reason on the next, then its rejected reports; nothing is cut, and no line is wider than 80."""
    monkeypatch.setenv("LBBSP_REDIS_URL", redis_url)
    out = _status(decided, 80, monkeypatch, capsys)
    log = out[out.index(f"last 2 decisions of job {decided}"):]
    assert max(map(len, log.splitlines())) <= 80, log  # the sentence above, one line, is the terminal's to wrap
    assert "sizes (policy, by), reason, rejected" in log, log
    sizes = re.findall(r"│ (\d+) +│ ([\d ]+) \((\w+), by (coordinator|fallback|earlier decision)\)", log)
    assert [(k, policy) for k, _, policy, _ in sizes] == [("3", "lbbsp"), ("2", "lbbsp")], log
    cells = "".join(line.split("│")[2].strip() + " " for line in log.splitlines() if line.count("│") == 3)
    assert re.search(r"rejected: worker 1: compute_s: must be in \[0\.0, 86400\.0\], got -1\.0 \[job=\S+, worker=1, "
                     r"iteration=1\]", cells), cells  # whole, folded at the cell's edge only
    reasons = re.findall(r"(?:kept|rebalanced)[^│]{40,}", log)
    assert len(reasons) == 2, log  # each reason's first line runs 40 characters and more, not a word


@pytest.mark.timeout(60)
def test_a_wide_terminal_keeps_the_six_columns(
        redis_url: str, decided: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("LBBSP_REDIS_URL", redis_url)
    out = _status(decided, 200, monkeypatch, capsys)
    assert re.search(r"┃ iteration ┃ sizes +┃ policy ┃ by +┃ reason +┃ rejected +┃", out), out
    assert "sizes (policy, by)" not in out
    assert re.search(r"│ 3 +│ \d+ \d+ +│ lbbsp +│ coordinator +│ (kept|rebalanced)", out), out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("field", "shown"), [("[/x]", "'[/x]'"), ("[bold]loud", "'[bold]loud'"),
                                              ("\\ud800", "'\\ud800'")])
def test_status_shows_a_hostile_reports_rejection_as_it_is(redis_url: str, job: str, field: str, shown: str,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A report with an unknown field named "[/x]" (rich's markup for a closing tag) or "\\ud800" (a JSON escape of
    a lone surrogate, which no terminal encodes) is rejected, as it should be, and its error recorded in the decision
    log; `lbbsp status --decisions` then ended in a MarkupError or UnicodeEncodeError traceback, and "[bold]" was
    eaten as markup."""
    monkeypatch.setenv("COLUMNS", "200")
    config = JobConfig(job, 2, 30)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config)
        store.post_report(Report(job, 0, 0, 15, 0.1), 2)
        store.post_raw_report(0, "1", Report(job, 1, 0, 15, 0.1).to_json()[:-1] + f',"{field}":1}}'.encode(), 2)
        outcome = coordinator.step(timeout_s=5)
        assert outcome is not None and [r.worker for r in outcome.rejected] == ["1"]
        assert main(["status", "--redis", redis_url, "--job", job, "--decisions", "1"]) == 0
    out = capsys.readouterr().out
    assert f"unknown field(s) in report: {shown}" in out


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


def _stored_status(**fields: object) -> bytes:
    """A worker's status line as the coordinator writes it, with ``fields`` in place of its defaults."""
    return json.dumps({"iteration": 1, "size": 5, "predicted_throughput": None, "measured_throughput": None,
                       "compute_s": None, "wait_s": None, **fields}).encode()


@pytest.mark.timeout(60)
def test_one_bad_entry_stops_neither_the_job_nor_the_jobs_after_it(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A throughput of 10**400 had ended `lbbsp status` in an OverflowError (int too large to convert to float), and a
    status field of 5,000 digits in a ValueError (exceeds the limit for integer string conversion): tracebacks that
    listed no job after it. Values no float holds show as "-"; fields that are no worker index are skipped, counted
    in one warning."""
    monkeypatch.setenv("COLUMNS", "200")
    with Store.from_url(redis_url, f"{job}-a") as bad, Store.from_url(redis_url, f"{job}-z") as good:
        try:
            bad.register(JobConfig(bad.job, 4, 20))
            good.register(JobConfig(good.job, 2, 10))
            bad.client.hset(bad.key("workers"), mapping={
                "0": json.dumps({"iteration": 1, "size": 5, "predicted_throughput": 10**400, "measured_throughput": -1,
                                 "compute_s": None, "wait_s": None}),
                "1": b'{"iteration": 1, "size": 6, "predicted_throughput": NaN, "measured_throughput": Infinity, '
                     b'"compute_s": -Infinity, "wait_s": null}',
                "2": _stored_status(size=7, predicted_throughput=12.5, measured_throughput=11.25, compute_s=0.4),
                "9" * 5000: _stored_status(), "-1": _stored_status(), "100000": _stored_status(), "3": b"not json",
            })
            assert main(["status", "--redis", redis_url]) == 0
            out = capsys.readouterr().out
            assert f"job {good.job}:" in out  # the listing went on past the bad job
            assert re.search(r"│ +0 │ +5 │ +- │ +-1 │ +- │ +- │", out), out  # 10**400 fits no float
            assert re.search(r"│ +1 │ +6 │ +- │ +- │ +- │ +- │", out), out
            assert re.search(r"│ +2 │ +7 │ +12\.5 │ +11\.25 │ +0\.4 │ +- │", out), out
            skipped = [r.getMessage() for r in caplog.records  # of this job: other tests' jobs share this Redis
                       if "not lbbsp's" in r.getMessage() and f"job {bad.job}:" in r.getMessage()]
            assert len(skipped) == 1 and f"job {bad.job}: skipped 4 entries" in skipped[0], skipped
        finally:  # the other tests share this Redis
            bad.forget()
            good.forget()


#: Stored where status prints it: an OSC that sets the terminal's title, a clear screen, colour, a C1 CSI (the one
#: byte form of ESC [), and a newline that would fake a line of the output.
_HOSTILE_TITLE = "\x1b]0;OWNED\x07\x1b[2J\x1b[31mRED\x9b5m\nFAKE LINE"


@pytest.mark.timeout(60)
def test_status_prints_control_characters_from_redis_escaped(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator's claim, a decision's policy, reason, rejections and sizes, and a worker's kind are read from
    Redis: their ESC sequences had reached the terminal raw (setting its title, clearing the screen), and a newline in
    them started a line of its own. They show as backslash escapes now, each value on its line."""
    monkeypatch.setenv("COLUMNS", "400")
    for variable in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):  # rich's own styles would be ESC too
        monkeypatch.delenv(variable, raising=False)
    with Store.from_url(redis_url, job) as store:
        try:
            store.register(JobConfig(job, 2, 10))
            store.client.set(store.key("coordinator"), f"host:1:{_HOSTILE_TITLE}", ex=60)
            store.client.lpush(store.key("decisions"), json.dumps({
                "iteration": 1, "sizes": [5, _HOSTILE_TITLE], "policy": f"p{_HOSTILE_TITLE}",
                "written_by_coordinator": True, "reason": f"r{_HOSTILE_TITLE}",
                "rejected": [{"worker": _HOSTILE_TITLE, "error": _HOSTILE_TITLE}], "time": 1.0}))
            store.client.hset(store.key("workers"), mapping={"0": _stored_status(kind="\x1b[2J\n"),
                                                             "1": _stored_status(size=5, kind="cpu")})
            assert main(["status", "--redis", redis_url, "--job", job, "--decisions", "1"]) == 0
        finally:
            store.forget()
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x9b" not in out and "\x07" not in out, repr(out)
    assert re.search(r"\n\W*FAKE LINE", out) is None, out  # no stored newline starts a line
    escaped = re.escape(r"\x1b]0;OWNED\x07\x1b[2J\x1b[31mRED\x9b5m\nFAKE LINE")
    assert "served by the coordinator unknown (not an lbbsp claim)" in out, out  # Store reads no such claim back
    assert len(re.findall(escaped, out)) == 6, out  # sizes, policy, reason and caption, rejected twice
    assert re.search(r"│ +0 │ +5 │ +- │ +- │ +- │ +- │ +\\x1b\[2J\\n │", out), out
    assert re.search(r"last decision of job", out) and re.search(r"│ +1 │ +5 │ +- │ +- │ +- │ +- │ +cpu │", out)


@pytest.mark.timeout(60)
def test_the_folded_decision_log_escapes_control_characters_too(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """At 80 columns the decision log is folded into one cell of lines (sizes with policy and writer, reason,
    rejected): each stored value in it shows escaped, as in the six columns."""
    monkeypatch.setenv("COLUMNS", "80")
    for variable in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(variable, raising=False)
    with Store.from_url(redis_url, job) as store:
        try:
            store.register(JobConfig(job, 2, 10))
            store.client.lpush(store.key("decisions"), json.dumps({
                "iteration": 1, "sizes": [5, _HOSTILE_TITLE], "policy": f"p{_HOSTILE_TITLE}",
                "written_by_coordinator": True, "reason": f"r{_HOSTILE_TITLE}",
                "rejected": [{"worker": _HOSTILE_TITLE, "error": _HOSTILE_TITLE}], "time": 1.0}))
            assert main(["status", "--redis", redis_url, "--job", job, "--decisions", "1"]) == 0
        finally:
            store.forget()
    out = capsys.readouterr().out
    assert "sizes (policy, by), reason, rejected" in out, out  # folded
    assert "\x1b" not in out and "\x9b" not in out and "\x07" not in out, repr(out)
    assert "OWNED" in out and "rejected: " in out, out


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
_HOSTILE_TEXT = "\x1b[2J\x1b[31mRED\nFAKE"


@pytest.mark.timeout(60)
def test_json_carries_stored_values_checked_and_text_escaped(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Values read from Redis go out as the table reads them: a number no float holds, or no number, as null; text as
    JSON strings, whose control characters JSON escapes; a claim that is no coordinator identity as 'unknown'."""
    with Store.from_url(redis_url, job) as store:
        try:
            store.register(JobConfig(job, 2, 10))
            store.client.set(store.key("coordinator"), f"host:1:{_HOSTILE_TEXT}", ex=60)
            store.client.lpush(store.key("decisions"), json.dumps({
                "iteration": 4, "sizes": [5, _HOSTILE_TEXT, 10**400], "policy": _HOSTILE_TEXT,
                "written_by_coordinator": True, "reason": _HOSTILE_TEXT,
                "rejected": [{"worker": _HOSTILE_TEXT, "error": 3}, "junk"], "time": "yesterday"}))
            store.client.hset(store.key("workers"), mapping={
                "0": json.dumps({"iteration": 4, "size": 5, "predicted_throughput": 10**400, "predicts": 0,
                                 "measured_throughput": -1, "compute_s": None, "wait_s": 0.5, "kind": _HOSTILE_TEXT}),
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
                                       "policy": _HOSTILE_TEXT, "reason": _HOSTILE_TEXT}
    assert status["decisions"][0]["sizes"] == [5, None, None]
    assert status["decisions"][0]["rejected"] == [{"worker": _HOSTILE_TEXT, "error": None}]
    assert status["workers"] == [
        {"index": 0, "iteration": 4, "size": 5, "predicted_throughput": None, "predicts": None,
         "measured_throughput": -1.0, "compute_s": None, "wait_s": 0.5, "kind": _HOSTILE_TEXT},
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




# -- 3. `lbbsp status`: the rejected reports beyond those listed, and its wording ---------------------------------
def _rejected(count: int) -> list[dict[str, str]]:
    return [{"worker": str(w), "error": f"bad report {w}"} for w in range(count)]


def _status_output(redis_url: str, job: str, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["status", "--redis", redis_url, "--job", job, *flags]) == 0
    return capsys.readouterr().out


@pytest.mark.timeout(60)
def test_status_shows_how_many_reports_were_rejected_beyond_those_listed(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A decision records 20 rejected reports and counts the rest in rejected_more: status showed the 20 alone."""
    monkeypatch.setenv("COLUMNS", "400")
    store.register(JobConfig(store.job, 2, 30))
    _decided(store, rejected=_rejected(2), rejected_more=12)
    table = _status_output(redis_url, store.job, capsys, "--decisions", "1")
    assert "worker 0: bad report 0; worker 1: bad report 1; and 12 more rejected" in table, table
    assert _status_output(redis_url, store.job, capsys, "--brief").endswith(" ago (14 reports rejected)\n")
    shown = json.loads(_status_output(redis_url, store.job, capsys, "--json", "--decisions", "1"))
    assert shown["decisions"][0]["rejected_more"] == 12
    assert len(shown["decisions"][0]["rejected"]) == 2
    _decided(store, rejected=_rejected(1))
    assert _status_output(redis_url, store.job, capsys, "--brief").endswith(" ago (1 report rejected)\n")
    _decided(store)
    assert _status_output(redis_url, store.job, capsys, "--brief").endswith(" s ago\n")  # none rejected: nothing said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("more", [True, -3, 10**400, "12", 1.5, None],
                         ids=["bool", "negative", "huge", "text", "fraction", "null"])
def test_status_ignores_a_stored_rejected_more_that_is_no_count(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        more: object) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    store.register(JobConfig(store.job, 2, 30))
    _decided(store, rejected=_rejected(1), rejected_more=more)
    table = _status_output(redis_url, store.job, capsys, "--decisions", "1")
    assert "worker 0: bad report 0 " in table and "more" not in table, table
    assert _status_output(redis_url, store.job, capsys, "--brief").endswith(" ago (1 report rejected)\n")
    shown = json.loads(_status_output(redis_url, store.job, capsys, "--json", "--decisions", "1"))
    assert shown["decisions"][0]["rejected_more"] is None


@pytest.mark.timeout(60)
def test_status_of_one_worker_and_one_decision_reads_right(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """It printed "1 workers", a caption "iteration -: no decision yet" and a table "last 1 decisions"."""
    monkeypatch.setenv("COLUMNS", "400")
    store.register(JobConfig(store.job, 1, 30))
    out = _status_output(redis_url, store.job, capsys, "--decisions", "3")
    assert f"job {store.job}: 1 worker, global batch 30" in out and "1 workers" not in out, out
    assert "iteration -" not in out and re.search(r"\n *no decision yet *\n", out), out
    _decided(store, sizes=[30])
    out = _status_output(redis_url, store.job, capsys, "--decisions", "3")
    assert re.search(rf"\n *last decision of job {store.job} *\n", out) and "last 1 decisions" not in out, out
    _decided(store, iteration=1, sizes=[30])
    assert f"last 2 decisions of job {store.job}, newest first" in _status_output(redis_url, store.job, capsys,
                                                                                  "--decisions", "3")


def test_status_for_a_user_who_may_not_scan_says_what_lbbsp_needs(own_server: EmbeddedRedis,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The list of jobs takes a SCAN, which the rules the docs give grant (+@all -@dangerous): a user without it got
    Redis's error answer, with no word of what lbbsp needs."""
    url = _user(own_server, "noscan", *GRANTED, "-scan")
    assert main(["status", "--redis", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lbbsp: error: the Redis user may not do what lbbsp needs (") and "'scan'" in err, err
    assert " ".join(GRANTED) in err and "acl-test-pw" not in err, err


def test_a_narrow_terminal_folds_the_workers_numbers_rather_than_cut_them(redis_url: str, decided: str,
                                                                          capsys: pytest.CaptureFixture[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """At 40 columns (a split pane) rich had cut a cell to fit: a size of 114 showed as "1…", a compute time as
    "0.1…"; the numbers fold onto a second line instead (the headers, known, may still be cut)."""
    monkeypatch.setenv("COLUMNS", "40")
    assert main(["status", "--redis", redis_url, "--job", decided]) == 0
    out = capsys.readouterr().out
    body = out[out.index("┡"):out.index("└")].splitlines()[1:]
    assert body and not [line for line in body if "…" in line], out
