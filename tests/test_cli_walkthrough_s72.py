"""A new user's walk through docs/cli.md, against a real embedded Redis: `lbbsp status --decisions` at 80 columns
(its six columns had left a decision's reason a word a line), errors about a URL that $LBBSP_REDIS_URL gave (which
had not said where the URL came from), output piped into a reader that stops early (`| head`: "cannot reach Redis
([Errno 32] Broken pipe)", exit 2, or rich's exit 1, which --check means for a job unserved), and the doc's
statements of these."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from emulated import worker_clients
from lbbsp import Coordinator, JobConfig, Report
from lbbsp.cli import _redis_flag, main
from lbbsp.errors import ConfigError, StoreUnavailable
from lbbsp.store import Store, answering

LBBSP = [sys.executable, "-m", "lbbsp.cli"]
DOC = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()


@pytest.fixture
def decided(redis_url: str, job: str) -> Iterator[str]:
    """A job of 2 workers whose coordinator decided iterations 2 and 3 from real reports, worker 1's report of
    iteration 1 rejected (a negative compute time); its keys are forgotten afterwards."""
    config = JobConfig(job, 2, 30)
    with Store.from_url(redis_url, job) as store, worker_clients(redis_url, config) as clients:
        coordinator = Coordinator(store, config)
        try:
            bad = json.loads(Report(job, 1, 1, 15, 0.1).to_json()) | {"compute_s": -1.0}  # as a sender of its own
            store.post_raw_report(1, "1", json.dumps(bad).encode(), 2)
            for k in range(2):
                for i, client in enumerate(clients):
                    size = client.assignment(k).sizes[i]
                    if (k, i) != (1, 1):  # the bad one stands for it
                        client.report(k, size, size / (100.0 * (1 + 2 * i)))
                assert coordinator.step(5.0) is not None
            yield job
        finally:
            store.forget()


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("view", [[], ["--brief"], ["--json"], ["--decisions", "2"]])
def test_output_into_a_reader_gone_ends_quietly_with_141(redis_url: str, decided: str, view: list[str]) -> None:
    """`lbbsp status | head -1`: the reader closes the pipe, and the next write fails. That had ended --json and
    --brief with "lbbsp: error: cannot reach Redis ([Errno 32] Broken pipe)" and 2, and the table with rich's exit
    1, which --check means for a job unserved. Now every view ends with 141, as a tool that SIGPIPE ends, silent."""
    proc = subprocess.Popen([*LBBSP, "status", "--redis", redis_url, "--job", decided, *view],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()  # before the command writes: its first write fails
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (141, ""), err
    assert "end quietly with 141" in DOC


@pytest.mark.timeout(60)
def test_the_doc_quotes_the_coordinators_first_line_which_status_takes(job: str) -> None:
    """Without --redis, `lbbsp status` and `forget` need the embedded server's URL, which the coordinator prints as
    its first line; the doc's Output paragraph had named only the job's line and the last one."""
    env = {"PATH": "", "COLUMNS": "200"}  # no $LBBSP_REDIS_URL: an embedded server of its own
    coordinator = subprocess.Popen([*LBBSP, "coordinator", "--job", job, "--workers", "2", "--global-batch", "4",
                                    "--max-decisions", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env)
    try:
        assert coordinator.stdout is not None
        first = coordinator.stdout.readline()
        url = re.fullmatch(r"started an embedded redis-server: --redis (unix://\S+)\n", first)
        assert url, first
        assert "`started an embedded redis-server: --redis unix:///dev/shm/lbbsp-redis-.../redis.sock`" in DOC
        coordinator.stdout.readline()  # "coordinating job ...": it serves the job now
        status = subprocess.run([*LBBSP, "status", "--redis", url[1], "--brief"], capture_output=True, text=True,
                                env=env, timeout=30, check=False)
        assert status.returncode == 0 and status.stdout.startswith(f"{job}: 2 workers, served by"), status
    finally:
        coordinator.terminate()
        coordinator.communicate(timeout=30)


def test_a_redis_that_does_not_answer_is_named_by_the_source_given_and_only_then() -> None:
    """One helper reaches Redis for the commands and simulate: its error led by the source given, and by nothing
    where none is (an embedded server's had begun ": cannot reach ...")."""
    for source, lead in [("", "cannot reach Redis"), ("$LBBSP_REDIS_URL", "$LBBSP_REDIS_URL: cannot reach Redis")]:
        with pytest.raises(StoreUnavailable) as raised:
            answering("redis://127.0.0.1:1/0", "j", source=source, socket_timeout_s=0.2)
        assert raised.value.message.startswith(lead), raised.value.message
    with pytest.raises(ConfigError, match=r"^--redis: not a usable Redis URL"):
        answering("http://host", "j", source="--redis")


@pytest.mark.parametrize(("url", "flag"), [("redis://h:6379/0", "--redis redis://h:6379/0"),
                                           ("redis://h/0?a=1&b=2", "--redis 'redis://h/0?a=1&b=2'"),
                                           ("redis://:secret@h:6379/0", "--redis URL")])
def test_the_forget_command_offered_can_be_pasted(url: str, flag: str) -> None:
    """It had quoted the URL as errors show it: a password as ***, which then failed, and a query's & unquoted, which
    a shell splits."""
    assert _redis_flag(url, "--redis") == flag
    assert _redis_flag(url, "$LBBSP_REDIS_URL") == ""  # read again from the variable


@pytest.mark.timeout(120)
def test_simulate_into_a_reader_gone_ends_quietly_with_141(tmp_path: Path) -> None:
    """As status does (the doc names status, forget and simulate)."""
    proc = subprocess.Popen([*LBBSP, "simulate", "--scenario", "gpu-mix", "--workers", "2", "--iterations", "3",
                             "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=110)
    assert (proc.returncode, err) == (141, ""), err
