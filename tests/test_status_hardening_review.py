"""`lbbsp status` against entries no coordinator wrote: a review with a real Redis found one bad entry ending the
listing of every job in a traceback, and escape sequences stored in Redis reaching the operator's terminal."""
from __future__ import annotations

import json
import re

import pytest

from lbbsp import JobConfig
from lbbsp.cli import main
from lbbsp.store import Store


def _status(**fields: object) -> bytes:
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
                "2": _status(size=7, predicted_throughput=12.5, measured_throughput=11.25, compute_s=0.4),
                "9" * 5000: _status(), "-1": _status(), "100000": _status(), "3": b"not json",
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
_HOSTILE = "\x1b]0;OWNED\x07\x1b[2J\x1b[31mRED\x9b5m\nFAKE LINE"


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
            store.client.set(store.key("coordinator"), f"host:1:{_HOSTILE}", ex=60)
            store.client.lpush(store.key("decisions"), json.dumps({
                "iteration": 1, "sizes": [5, _HOSTILE], "policy": f"p{_HOSTILE}", "written_by_coordinator": True,
                "reason": f"r{_HOSTILE}", "rejected": [{"worker": _HOSTILE, "error": _HOSTILE}], "time": 1.0}))
            store.client.hset(store.key("workers"), mapping={"0": _status(kind="\x1b[2J\n"),
                                                             "1": _status(size=5, kind="cpu")})
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
                "iteration": 1, "sizes": [5, _HOSTILE], "policy": f"p{_HOSTILE}", "written_by_coordinator": True,
                "reason": f"r{_HOSTILE}", "rejected": [{"worker": _HOSTILE, "error": _HOSTILE}], "time": 1.0}))
            assert main(["status", "--redis", redis_url, "--job", job, "--decisions", "1"]) == 0
        finally:
            store.forget()
    out = capsys.readouterr().out
    assert "sizes (policy, by), reason, rejected" in out, out  # folded
    assert "\x1b" not in out and "\x9b" not in out and "\x07" not in out, repr(out)
    assert "OWNED" in out and "rejected: " in out, out
