"""Reports and assignments: JSON round trips, and every kind of bad input rejected with the field named."""
from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from lbbsp import Assignment, JobConfig, ProtocolError, Report
from lbbsp.errors import ConfigError
from lbbsp.protocol import MAX_PAYLOAD_BYTES


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
