"""Bugs found in a review of the core's edges: the status table, the job's settings and the wire format."""
from __future__ import annotations

import json

import numpy as np
import pytest

from lbbsp import Assignment, ConfigError, Coordinator, JobConfig, ProtocolError, Report
from lbbsp.cli import main
from lbbsp.policies import LBBSPPolicy
from lbbsp.store import Store


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


@pytest.mark.parametrize("name", ["assignment_timeout_s", "deadband"])
def test_a_number_too_large_for_a_float_is_a_config_error(name: str) -> None:
    """assignment_timeout_s=10**400 (also as an integer in the job's stored JSON settings, which workers, the
    coordinator and `lbbsp status` read from Redis) raised OverflowError, not a ConfigError naming the setting."""
    with pytest.raises(ConfigError, match=name):
        if name == "deadband":
            LBBSPPolicy(deadband=10**400)
        else:
            JobConfig("j", 2, 30, assignment_timeout_s=10**400)


def test_stored_settings_with_a_huge_integer_are_a_config_error() -> None:
    stored = json.dumps({"job": "j", "num_workers": 2, "global_batch": 30, "assignment_timeout_s": 10**400})
    with pytest.raises(ConfigError, match="assignment_timeout_s"):
        JobConfig.from_json(stored)


def test_joined_names_the_setting_that_differs_not_the_ttl_it_took() -> None:
    """A worker asking for a 20 s timeout of a coordinator serving 5 s with a 10 s TTL was told "ttl_s (10) must be at
    least assignment_timeout_s (20)": a TTL it never set, from taking the coordinator's before comparing."""
    stored = JobConfig("j", 2, 30, assignment_timeout_s=5, ttl_s=10)
    with pytest.raises(ConfigError, match=r"serves job 'j' with assignment_timeout_s=5\.0, but this run asks for "
                                          r"assignment_timeout_s=20\.0"):
        JobConfig("j", 2, 30, assignment_timeout_s=20).joined(stored, caller="the test")


def test_a_str_payload_that_is_not_unicode_text_is_a_protocol_error() -> None:
    """from_json takes str as well as bytes; a str with a lone surrogate raised UnicodeEncodeError."""
    for parse in (Report.from_json, Assignment.from_json):
        with pytest.raises(ProtocolError, match="payload"):
            parse('{"v": 1, "job": "\ud800"}')


@pytest.mark.parametrize("where", ["field", "feature"])
def test_a_rejection_does_not_echo_a_long_unknown_name(where: str) -> None:
    """A report of 4 KiB with one unknown field (or feature) named by 3,900 characters was rejected with an error of
    7,900 characters, the name twice; the coordinator keeps each rejection's error in its decision log (1,000
    decisions, ten times as long as the reports themselves), so each hostile report stored twice its size there."""
    report = json.loads(Report("j", 0, 0, 5, 0.1).to_json())
    (report["features"] if where == "feature" else report)["x" * 3_900] = 1
    with pytest.raises(ProtocolError) as info:
        Report.from_json(json.dumps(report))
    assert "xxxx" in str(info.value) and len(str(info.value)) < 300


def test_a_rejection_lists_a_few_unknown_fields() -> None:
    report = json.loads(Report("j", 0, 0, 5, 0.1).to_json())
    report.update({f"f{i}": 1 for i in range(300)})
    with pytest.raises(ProtocolError, match=r"unknown field\(s\) in report: 'f0', 'f1', 'f10', 'f100', \.\.\.$"):
        Report.from_json(json.dumps(report))


def test_an_assignment_takes_numpy_integers_as_a_report_does() -> None:
    """A policy of the user's own that returned its sizes as a numpy array, and the iteration as numpy's integer,
    got "sizes[0]: must be an integer, got int64" from Assignment, where Report takes numpy's numbers; the
    assignment holds Python ints (what its JSON takes) and refuses what is not an integer as before."""
    assignment = Assignment("j", np.int64(3), np.array([5, 7], dtype=np.int32), "mine")
    assert assignment.sizes == (5, 7) and all(type(size) is int for size in assignment.sizes)
    assert type(assignment.iteration) is int and assignment.iteration == 3
    assert Assignment.from_json(assignment.to_json(), job="j", iteration=3) == assignment
    for bad in ([5.0, 7], [True, 7], np.array([5.5, 7.0])):
        with pytest.raises(ProtocolError, match=r"sizes\[0\]: must be an integer"):
            Assignment("j", 3, bad, "mine")
