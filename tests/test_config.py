"""JobConfig checks every field at construction, and the settings stored in Redis when they are read: a bad value is
a ConfigError naming the job, the value given and what is expected, never a raw TypeError, a silent conversion or a
failure later in the run. A run that joins a job served with other settings is told the setting that differs."""
from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from lbbsp import ConfigError, JobConfig, LBBSPPolicy


def config(**changes: Any) -> JobConfig:
    return JobConfig(**{"job": "j", "num_workers": 2, "global_batch": 8, **changes})


@pytest.mark.parametrize(("changes", "message"), [
    ({"max_batch": "44"}, r"max_batch must be None, an integer or a sequence of 2 integers .*got '44' \(str\)"),
    ({"max_batch": b"44"}, r"max_batch must be None.*got b'44' \(bytes\)"),
    ({"max_batch": [4.7, 4.2]}, r"max_batch\[0\] must be an integer, got 4.7 \(float\)"),
    ({"max_batch": (4, 4.0)}, r"max_batch\[1\] must be an integer, got 4.0 \(float\)"),
    ({"max_batch": np.array([4.0, 4.0])}, r"max_batch\[0\] must be an integer, got 4.0 \(float\)"),
    ({"max_batch": [True, 8]}, r"max_batch\[0\] must be an integer, got True \(bool\)"),
    ({"max_batch": 4.5}, r"max_batch must be None.*got 4.5 \(float\)"),
    ({"max_batch": {4, 5}}, r"max_batch must be None.*\(set\)"),
    ({"max_batch": (4, 4, 4)}, "max_batch has 3 entries for 2 workers"),
    ({"max_batch": (-1, 9), "min_batch": 0}, r"max_batch\[0\] must be an integer in \[0, 10000000\], got -1"),
    ({"max_batch": (0, 9)}, "max_batch is below min_batch 1 for worker 0"),
    ({"max_batch": 2**62}, r"max_batch must be an integer in \[0, 10000000\], got 4611686018427387904"),
    ({"num_workers": True}, r"num_workers must be an integer, got True \(bool\)"),
    ({"num_workers": 2.0}, r"num_workers must be an integer, got 2.0 \(float\)"),
    ({"num_workers": 0}, r"num_workers must be an integer in \[1, "),
    ({"global_batch": "8"}, r"global_batch must be an integer, got '8' \(str\)"),
    ({"min_batch": False}, r"min_batch must be an integer, got False \(bool\)"),
    ({"min_batch": -1}, r"min_batch must be an integer in \[0, "),
    ({"assignment_timeout_s": "10"}, r"assignment_timeout_s must be a number of seconds, got '10' \(str\)"),
    ({"assignment_timeout_s": True}, r"assignment_timeout_s must be a number of seconds, got True \(bool\)"),
    ({"assignment_timeout_s": float("inf")}, r"assignment_timeout_s must be .* in \[0.001, 86400\], got inf"),
    ({"assignment_timeout_s": float("nan")}, r"in \[0.001, 86400\], got nan"),
    ({"assignment_timeout_s": 0}, r"in \[0.001, 86400\], got 0"),
    ({"assignment_timeout_s": -1.0}, r"in \[0.001, 86400\], got -1.0"),
    ({"ttl_s": 60.0}, r"ttl_s must be an integer, got 60.0 \(float\)"),
    ({"ttl_s": 5}, r"ttl_s must be an integer in \[10, "),
    ({"ttl_s": 10**18}, r"ttl_s must be an integer in \[10, "),
    ({"lag": True}, r"lag must be an integer, got True \(bool\)"),
    ({"lag": 9}, r"lag must be an integer in \[1, 8\], got 9"),
])
def test_a_bad_value_is_a_config_error_that_says_what_was_given(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        config(**changes)
    assert raised.value.job == "j"


@pytest.mark.parametrize("job", ["bad name!", "", "j\n", "x" * 129, 7, None])
def test_a_bad_job_name_is_a_config_error(job: object) -> None:
    with pytest.raises(ConfigError, match="job name must match"):
        config(job=job)


def test_valid_configs_are_kept_and_numbers_become_plain_python_ones() -> None:
    assert config().max_batch is None
    assert config(max_batch=4).max_batch == 4
    assert config(max_batch=[4, 5]).max_batch == (4, 5)
    assert config(max_batch=(4, 5)).max_batch == (4, 5)
    from_numpy = config(num_workers=np.int64(2), global_batch=np.int32(8), max_batch=np.array([4, 5]),
                        assignment_timeout_s=np.float64(2.5), ttl_s=np.int64(60), lag=np.int8(1))
    assert from_numpy == config(max_batch=(4, 5), assignment_timeout_s=2.5, ttl_s=60, lag=1)
    assert all(type(value) in (str, int, float, tuple) for value in vars(from_numpy).values())
    assert type(config(max_batch=np.int64(4)).max_batch) is int
    assert config(max_batch=[np.int64(4), 5]).max_batch == (4, 5)
    integral_timeout = config(assignment_timeout_s=5)
    assert integral_timeout.assignment_timeout_s == 5.0 and type(integral_timeout.assignment_timeout_s) is float
    assert config(min_batch=0, max_batch=(0, 8)).bounds() == ([0, 0], [0, 8])


@pytest.mark.parametrize("original", [
    JobConfig("j", 2, 8),
    JobConfig("j", 3, 10, min_batch=2, max_batch=(4, 4, 4), assignment_timeout_s=0.25, ttl_s=60, lag=1),
    JobConfig("j", 2, 8, max_batch=np.array([4, 6])),
    JobConfig("j", 2, 8, max_batch=5),
])
def test_json_round_trip(original: JobConfig) -> None:
    again = JobConfig.from_json(original.to_json())
    assert again == original
    assert hash(again) == hash(original)


@pytest.mark.parametrize(("stored", "message"), [
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object, got list"),
    (json.dumps({"job": "j", "num_workers": 2, "global_batch": 8, "extra": 1}), r"unexpected fields \['extra'\]"),
    (json.dumps({"job": "j", "num_workers": 2}), r"lacks the fields \['global_batch'\]"),
    (json.dumps({"job": "j", "num_workers": 2, "global_batch": 8, "assignment_timeout_s": float("inf")}),
     r"in \[0.001, 86400\], got inf"),
    (json.dumps({"job": "j", "num_workers": 2, "global_batch": 8, "max_batch": "44"}), "max_batch must be None"),
])
def test_a_bad_stored_config_is_a_config_error(stored: str | bytes, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_json(stored)


def test_a_job_config_refuses_a_ttl_below_its_timeout_and_a_timeout_no_decision_can_meet() -> None:
    with pytest.raises(ConfigError, match=r"ttl_s \(10\) must be at least assignment_timeout_s \(100\)"):
        JobConfig("j", 2, 8, ttl_s=10, assignment_timeout_s=100)
    with pytest.raises(ConfigError, match=r"assignment_timeout_s must be a number of seconds in \[0.001"):
        JobConfig("j", 2, 8, assignment_timeout_s=1e-9)
    assert JobConfig("j", 2, 8, ttl_s=10, assignment_timeout_s=10).ttl_s == 10


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


def test_joining_a_job_not_served_yet_keeps_this_config_and_warns_once_asked(caplog: pytest.LogCaptureFixture) -> None:
    """Before the coordinator has stored its settings there is nothing to agree with: this run's config is the one
    in force, with a warning that names the job (unless a caller that is one of many says not to)."""
    mine = JobConfig("j", 2, 30, lag=1)
    with caplog.at_level("WARNING", logger="lbbsp"):
        assert mine.joined(None, caller="the test", warn=False) is mine
        assert not caplog.records
        assert mine.joined(None, caller="the test") is mine
    assert len(caplog.records) == 1 and "job 'j' is not on this Redis yet" in caplog.records[0].getMessage()
