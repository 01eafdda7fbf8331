"""What a new user of the models and the simulator met in a fresh-eyes walk: one "no cap" value, scikit-learn's
fit(X, y) refused with a message, the reason a model forgot, a model class given for an instance, a trace level
never recorded, a worker count past a job's global batch, and the model a coordinator starts with."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from lbbsp import ConfigError, Report
from lbbsp.cli import _model_said, _policy, build_parser
from lbbsp.models import NO_CAP, AutoCapacityModel, BatchTimeCurve, EWMAThroughput, NotFittedError, fit_memory_cap
from lbbsp.sim.scenarios import GPUMix, MixedCluster
from lbbsp.sim.traces import DEFAULT_TRACE_DIR, load_traces

GPU = {"gpu_mem_used": 1e9, "gpu_mem_free": 1e10}


def test_every_model_answers_one_no_cap_value() -> None:
    """The auto model's CPU workers and the curve's unseen GPUs are both uncapped: both answer NO_CAP (the auto
    model's had been one more, read through a float)."""
    reports = [Report("j", 0, 0, 8, 0.1), Report("j", 1, 0, 8, 0.1, device="cuda:0", features=GPU)]
    caps = AutoCapacityModel().fit(reports).max_batch([0, 1, 5])
    assert caps is not None and caps[0] == caps[2] == NO_CAP and caps[1] < NO_CAP
    curve = BatchTimeCurve().fit([Report("j", 1, 0, 8, 0.1, device="cuda:0")])
    assert curve.max_batch([7]).tolist() == [NO_CAP]
    nothing_read = fit_memory_cap(np.array([[8.0, 16.0]]), np.array([[1e9, 2e9]]), np.zeros((1, 2), bool),
                                  np.array([1e10]))
    assert nothing_read.tolist() == [NO_CAP]  # through a float it had read 2**61


def test_fit_refuses_scikit_learns_x_and_y_in_its_own_name() -> None:
    with pytest.raises(TypeError, match=r"not fit\(X, y\)"):
        EWMAThroughput().fit(np.ones((3, 2)), np.ones(3))
    with pytest.raises(TypeError, match="^fit takes a list of lbbsp.Report"):  # it had named partial_fit
        EWMAThroughput().fit(np.ones((3, 2)))


def test_a_model_that_forgot_for_a_new_parameter_says_so() -> None:
    history = [Report("j", 0, k, 8 + k, 0.1, device="cuda:0") for k in range(3)]
    model = BatchTimeCurve().fit(history).set_params(window=4)
    with pytest.raises(NotFittedError, match="forgot what it had learned when set_params changed window"):
        model.predict([0])
    assert np.isfinite(model.fit(history).predict([0])).all()
    with pytest.raises(NotFittedError, match="has seen no report yet"):
        BatchTimeCurve().predict([0])


def test_a_model_class_given_for_a_kind_is_named_with_the_instance_meant() -> None:
    with pytest.raises(ConfigError, match=r"did you mean EWMAThroughput\(\)\?"):
        AutoCapacityModel(models={"cpu": EWMAThroughput}).fit([Report("j", 0, 0, 8, 0.1)])


def test_a_trace_level_the_recorder_ran_but_never_measured_is_named(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    shipped = json.loads(next(DEFAULT_TRACE_DIR.glob("*.json")).read_text())
    level = shipped["columns"].index("hog_level")
    shipped["rows"] = [row for row in shipped["rows"] if row[level] == 0][:100]  # a short recording: level 0 only
    (tmp_path / "short.json").write_text(json.dumps(shipped))
    with caplog.at_level(logging.WARNING, logger="lbbsp.sim.traces"):
        load_traces(tmp_path)
    assert [m for m in caplog.messages if "has 0 rows" in m and ("level 1" in m or "level 2" in m)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lbbsp.sim.traces"):
        load_traces(DEFAULT_TRACE_DIR)
    assert not caplog.messages


def test_a_worker_count_past_a_jobs_global_batch_is_named_with_the_most_that_fit() -> None:
    with pytest.raises(ConfigError, match="at most 89,285 workers at that batch"):
        GPUMix(100_000, 1, 0)
    assert MixedCluster(100_000, 1, 0).config.global_batch == 112 * 50_000 + 16 * 50_000  # fits: not refused


@pytest.mark.parametrize(("flags", "said"), [
    ([], " with the auto model"),
    (["--model", "ewma"], " with the ewma model"),
    (["--kind", "3=gpu", "--kind-model", "cpu=ewma"], " with the auto model (--kind 3=gpu, --kind-model cpu=ewma)"),
    (["--policy", "per-epoch"], " with its own slow EWMA"),
    (["--policy", "static-proportional"], ""),
    (["--policy", "bsp"], ""),
])
def test_the_coordinators_start_line_names_the_model_and_what_routes_it(flags: list[str], said: str) -> None:
    """`lbbsp coordinator` said the model only where --model was given, and never the kinds pinned."""
    args = build_parser().parse_args(["coordinator", "--job", "j", "--workers", "4", "--global-batch", "64", *flags])
    assert _model_said(args, _policy(args)) == said
