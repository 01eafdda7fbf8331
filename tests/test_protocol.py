"""Reports and assignments: JSON round trips, numpy numbers taken as Python's, and every kind of bad input rejected
with the field named; a misspelt feature is refused with the name meant, and a long unknown name is not echoed."""
from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Callable

import numpy as np
import pytest

from lbbsp import Assignment, ConfigError, JobConfig, ProtocolError, Report
from lbbsp.protocol import FEATURE_RANGES, MAX_PAYLOAD_BYTES
from test_coordinator import HUGE, report_json


def good(**overrides: object) -> dict:
    obj = {"v": 1, "job": "j", "worker": 1, "iteration": 7, "samples": 32, "compute_s": 0.25,
           "features": {"cpu_util": 0.5, "colocated_load": 0.1}, "device": "cpu"}
    obj.update(overrides)
    return obj


def test_report_round_trip() -> None:
    report = Report("j", 1, 7, 32, 0.25, comm_s=0.01, wait_s=0.02, features={"mem_util": 0.3})
    again = Report.from_json(report.to_json(), job="j", num_workers=4)
    assert again == report
    assert again.throughput == pytest.approx(128.0)


def test_a_report_keeps_the_features_it_was_built_with_and_hashes() -> None:
    """It held the caller's dict: a feature changed there after the report was validated changed the report, out of
    range too; and a report could not be hashed (its dict)."""
    features = {"cpu_util": 0.5}
    report = Report("j", 1, 7, 32, 0.25, features=features)
    features["cpu_util"] = 9.0
    assert report.features == {"cpu_util": 0.5}
    same = Report("j", 1, 7, 32, 0.25, features={"cpu_util": 0.5})
    assert hash(report) == hash(same) and {report, same} == {report}
    assert Report("j", 1, 7, 32, 0.25, features={"cpu_util": 0.4}) != report


def test_a_parsed_report_is_the_report_its_fields_make_and_stays_frozen() -> None:
    """The parse builds a plain report without the dataclass's set-up: it must still be that report."""
    parsed = Report.from_json(json.dumps(good(comm_s=0.01)), job="j", num_workers=4)
    assert parsed == Report("j", 1, 7, 32, 0.25, comm_s=0.01, features={"cpu_util": 0.5, "colocated_load": 0.1})
    assert (parsed.wait_s, parsed.device) == (None, "cpu")
    assert Report.from_json(json.dumps({k: v for k, v in good().items() if k not in ("features", "device")})) == \
        Report("j", 1, 7, 32, 0.25)  # the optional fields take their defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.samples = 64  # type: ignore[misc]
    assert dataclasses.replace(parsed, samples=64) == Report("j", 1, 7, 64, 0.25, comm_s=0.01, features={
        "cpu_util": 0.5, "colocated_load": 0.1})  # every slot is set: replace and copies work
    assert pickle.loads(pickle.dumps(parsed)) == parsed
    spaced = b"  \n" + json.dumps(good(), indent=2).encode() + b"\n "
    assert Report.from_json(spaced) == Report.from_json(json.dumps(good()))  # whitespace around: still one report

@pytest.mark.parametrize("overrides, field", [
    ({"compute_s": float("nan")}, "payload"),  # NaN is not JSON: rejected by the parser itself
    ({"samples": -1}, "samples"),
    ({"compute_s": -0.5}, "compute_s"),
    ({"samples": 10**12}, "samples"),
    ({"compute_s": 1e12}, "compute_s"),
    ({"compute_s": 5e-324}, "compute_s"),  # a broken timer: 32 samples in it is an infinite throughput
    ({"worker": "1"}, "worker"),
    ({"worker": 4}, "worker"),
    ({"iteration": 1.5}, "iteration"),
    ({"samples": True}, "samples"),
    ({"job": "other"}, "job"),
    ({"surprise": 1}, "surprise"),
    ({"features": {"gpu_temp": 80.0}}, "features.gpu_temp"),
    ({"features": {"cpu_util": 3.0}}, "features.cpu_util"),
    ({"features": [1, 2]}, "features"),
    ({"features": {"gpu_mem_used": 4e9}}, "features.gpu_mem_free"),  # no memory cap can come of one alone
    ({"features": {"gpu_mem_free": 4e9, "cpu_util": 0.5}}, "features.gpu_mem_used"),
    ({"v": 2}, "v"),
])
def test_hostile_reports_are_rejected_naming_the_field(overrides: dict, field: str) -> None:
    payload = json.dumps(good(**overrides), allow_nan=True)
    with pytest.raises(ProtocolError) as info:
        Report.from_json(payload, job="j", num_workers=4)
    assert info.value.field == field
    assert field in str(info.value)


def test_missing_field_oversized_and_non_json_payloads() -> None:
    obj = good()
    del obj["compute_s"]
    with pytest.raises(ProtocolError, match="compute_s: is missing"):
        Report.from_json(json.dumps(obj))
    with pytest.raises(ProtocolError, match="more than 4096"):
        Report.from_json(b"{" + b" " * MAX_PAYLOAD_BYTES + b"}")
    with pytest.raises(ProtocolError, match="not valid JSON"):
        Report.from_json(b"\x80\x04\x95 pickle")
    with pytest.raises(ProtocolError, match="JSON object"):
        Report.from_json(b"[1, 2]")
    with pytest.raises(ProtocolError, match="Infinity is not allowed"):
        Report.from_json(json.dumps(good(compute_s=float("inf"))))


def test_reports_are_validated_when_built_too() -> None:
    with pytest.raises(ProtocolError, match="compute_s"):
        Report("j", 0, 0, 8, float("nan"))
    with pytest.raises(ProtocolError, match="gpu_mem_used without gpu_mem_free: report both"):
        Report("j", 0, 0, 8, 0.1, features={"gpu_mem_used": 4e9}, device="cuda:0")


def test_assignment_round_trip_and_checks() -> None:
    assignment = Assignment("j", 3, (5, 7, 4), "lbbsp", "because")
    assert Assignment.from_json(assignment.to_json(), job="j", num_workers=3, global_batch=16) == assignment
    assert assignment.offset(2) == 12
    with pytest.raises(ProtocolError, match="sums to 16, not the global batch 17"):
        Assignment.from_json(assignment.to_json(), global_batch=17)
    with pytest.raises(ProtocolError, match="3 sizes for 4 workers"):
        Assignment.from_json(assignment.to_json(), num_workers=4)
    with pytest.raises(ProtocolError, match=r"sizes\[1\]"):
        Assignment("j", 3, (5, -7, 4), "lbbsp")


def test_job_config_validates_itself() -> None:
    with pytest.raises(ConfigError, match="exceeds the global batch"):
        JobConfig("j", 4, 3)
    with pytest.raises(ConfigError, match="add up to 8, less than"):
        JobConfig("j", 4, 64, max_batch=2)
    with pytest.raises(ConfigError, match="job name"):
        JobConfig("bad name!", 2, 8)
    config = JobConfig("j", 3, 10, max_batch=(4, 4, 4))
    assert JobConfig.from_json(config.to_json()) == config
    assert config.initial_sizes() == (4, 3, 3)


def test_numpys_numbers_are_taken_as_pythons() -> None:
    """np.int64 samples (a count) and np.float32 times (a timer) had been refused: 'must be an integer, got int64'.
    They are stored as Python's numbers, so the JSON and every check see plain ones; bools stay refused."""
    np = pytest.importorskip("numpy")
    report = Report("j", np.int64(1), np.int32(3), np.int64(4), np.float32(0.25), wait_s=np.float64(0.01),
                    features={"cpu_util": np.float32(0.5)})
    assert (type(report.worker), type(report.samples), type(report.compute_s)) == (int, int, float)
    assert type(report.features["cpu_util"]) is float
    assert Report.from_json(report.to_json()) == report
    with pytest.raises(ProtocolError, match="samples: must be an integer, got float64"):
        Report("j", 0, 0, np.float64(4.0), 0.1)
    with pytest.raises(ProtocolError, match="compute_s: must be a number, got bool"):
        Report("j", 0, 0, 4, np.bool_(True))


def test_an_assignment_gives_offsets_of_its_own_workers_only() -> None:
    assignment = Assignment("j", 0, (3, 5), "p")
    assert [assignment.offset(w) for w in (0, 1, np.int64(1))] == [0, 3, 3]
    for worker in (2, -1, 1.5, "a", True):
        with pytest.raises(ProtocolError, match=r"worker: .*\[0, 1\]"):
            assignment.offset(worker)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="sizes: must be a sequence"):
        Assignment("j", 0, None, "p")  # type: ignore[arg-type]


def test_a_card_of_no_memory_is_refused_where_it_would_cap_the_worker_at_nothing() -> None:
    with pytest.raises(ProtocolError, match="gpu_mem_used and gpu_mem_free are both 0"):
        Report("job", 0, 0, 100, 0.1, features={"gpu_mem_used": 0.0, "gpu_mem_free": 0.0}, device="cuda:0")
    Report("job", 0, 0, 100, 0.1, features={"gpu_mem_used": 0.0, "gpu_mem_free": 8e9}, device="cuda:0")


@pytest.mark.parametrize("version", ["true", "1.0", '"1"'])
def test_the_protocol_version_must_be_the_integer_1(version: str) -> None:
    payload = f'{{"v":{version},"job":"j","worker":0,"iteration":0,"samples":1,"compute_s":0.1}}'
    with pytest.raises(ProtocolError, match="v: unsupported protocol version"):
        Report.from_json(payload)
    assert Report.from_json(payload.replace(version, "1", 1)).worker == 0


@pytest.mark.parametrize("payload", [report_json(compute_s=HUGE), report_json(features=f'{{"cpu_util":{HUGE}}}')])
def test_an_integer_too_large_for_a_float_is_a_protocol_error(payload: str) -> None:
    with pytest.raises(ProtocolError, match="bits"):
        Report.from_json(payload)
    with pytest.raises(ProtocolError, match="created"):
        Assignment("j", 0, (4, 4), "p", created=10**400)


def test_an_assignment_with_a_number_too_long_to_read_is_a_protocol_error() -> None:
    payload = '{"v":1,"job":"j","iteration":0,"sizes":[4,' + "4" * 5000 + '],"policy":"p","created":1.0}'
    with pytest.raises(ProtocolError, match="too long"):
        Assignment.from_json(payload)


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


def test_a_rejection_shows_names_and_jobs_from_a_payload_escaped_on_one_line() -> None:
    """A field name or job holding a newline had faked a log line of the coordinator's ("x\\nCRITICAL ..."), an ESC
    cleared the worker's terminal, and a stored assignment's job of 40,000 characters was logged whole."""
    forged = "x\nCRITICAL lbbsp.coordinator: FORGED\x1b[2J"
    for payload in (good(**{forged: 1}), good(job=forged, worker="1"),
                    {**good(), "features": {forged: 1.0}}):
        with pytest.raises(ProtocolError) as info:
            Report.from_json(json.dumps(payload))
        assert "\n" not in str(info.value) and "\x1b" not in str(info.value) and "\\nCRITICAL" in str(info.value)
    stored = json.dumps({"v": 1, "job": "A\n" * 20_000, "iteration": 3, "sizes": [4, 4], "policy": "p",
                         "created": 1.0})
    with pytest.raises(ProtocolError, match="job: must be at most 128 characters") as info:
        Assignment.from_json(stored)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_a_stored_split_over_a_workers_max_batch_is_refused() -> None:
    """Only a writer other than lbbsp's coordinator could store it; a worker had trained 7 samples with max_batch 5,
    which its memory may not hold."""
    config = JobConfig("j", 2, 8, max_batch=(5, 8))
    raw = Assignment("j", 3, (1, 7), "other").to_json()
    assert config.stored_assignment(raw, 3).sizes == (1, 7)
    over = Assignment("j", 3, (7, 1), "other").to_json()
    with pytest.raises(ProtocolError, match=r"sizes\[0\]: 7 is over worker 0's max_batch 5"):
        config.stored_assignment(over, 3)


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


def test_a_misspelt_feature_is_refused_with_the_name_meant_and_the_known_ones() -> None:
    meant = r"features\.downlod_s: unknown feature; did you mean 'download_s'\?"
    with pytest.raises(ProtocolError, match=meant) as caught:
        Report("fl", 0, 0, 10, 1.0, features={"downlod_s": 3.0})
    assert all(name in str(caught.value) for name in FEATURE_RANGES)


def test_a_feature_like_none_known_is_refused_with_the_known_ones_only() -> None:
    with pytest.raises(ProtocolError, match=r"features\.temperature: unknown feature \(known: cpu_util, ") as caught:
        Report("w", 0, 0, 10, 1.0, features={"temperature": 60.0})
    assert "did you mean" not in str(caught.value)


@pytest.mark.parametrize(("build", "field", "said"), [
    (lambda: Report("", 0, 0, 8, 0.1), "job", "must not be empty"),
    (lambda: Report("j", 0, 0, 8, 0.1, features=[("cpu_util", 0.5)]),  # type: ignore[arg-type]
     "features", "must be an object"),
    (lambda: Assignment("j", 3, (), "lbbsp"), "sizes", "must hold 1 to 100000 sizes, got 0"),
    (lambda: Assignment("j", 3, (5, 5), "lbbsp", fallback=1),  # type: ignore[arg-type]
     "fallback", "must be a boolean"),
], ids=["empty-job", "features-not-a-mapping", "no-sizes", "fallback-not-a-bool"])
def test_reports_and_assignments_built_in_code_are_refused_naming_the_field(build: Callable[[], object], field: str,
                                                                              said: str) -> None:
    with pytest.raises(ProtocolError, match=said) as info:
        build()
    assert info.value.field == field


def test_a_stored_assignment_of_another_job_or_without_a_list_of_sizes_is_refused() -> None:
    """The split read from a job's key must be that job's; sizes must be a JSON list (a string of digits is not)."""
    stored = Assignment("j", 3, (5, 5), "lbbsp", "because").to_json()
    with pytest.raises(ProtocolError, match="assignment is for job 'j', not 'k'") as info:
        Assignment.from_json(stored, job="k")
    assert info.value.field == "job"
    with pytest.raises(ProtocolError, match="sizes: must be a list"):
        Assignment.from_json(stored.replace(b"[5,5]", b'"55"'))
    with pytest.raises(ProtocolError, match="fallback: must be a boolean"):
        Assignment.from_json(stored.replace(b'"fallback":false', b'"fallback":0'))
