"""Behaviour a third mutation review (the GPU curve, the federated client model, the auto model, the model base and
``lbbsp simulate``) found no test held: each test here failed with one small change to the code it names, and
passes on the code as it is."""
from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from lbbsp import Report
from lbbsp.errors import ConfigError
from lbbsp.models import (
    AutoCapacityModel,
    BatchTimeCurve,
    EWMAThroughput,
    FLClientModel,
    LastValue,
    fit_hinge,
    fit_memory_cap,
    worker_kind,
)
from lbbsp.models.base import NO_CAP, WorkerIds, whole_caps
from lbbsp.sim import cli
from lbbsp.sim.traces import DEFAULT_TRACE_DIR

GB = 1e9


# ---------------------------------------------------------------- the federated client model


def test_speed_is_blended_by_the_alpha_given() -> None:
    """alpha weighs the newest speed: 0.2 * 200 + 0.8 * 100 (at the default 0.5 alpha and 1 - alpha read alike)."""
    model = FLClientModel(alpha=0.2)
    model.partial_fit([Report("fl", 0, 0, 100, 1.0, features={"download_s": 1.0})])
    model.partial_fit([Report("fl", 0, 1, 200, 1.0, features={"download_s": 1.0})])
    assert model.predict([0])[0] == pytest.approx(120.0)


def test_transfer_seconds_are_blended_not_replaced() -> None:
    """Transfer seconds are exponentially weighted by alpha, as the speed is: 10 s then 20 s at alpha 0.5 is 15 s."""
    model = FLClientModel(alpha=0.5)
    model.partial_fit([Report("fl", 0, 0, 100, 1.0, features={"download_s": 6.0, "upload_s": 4.0})])
    model.partial_fit([Report("fl", 0, 1, 100, 1.0, features={"download_s": 12.0, "upload_s": 8.0})])
    assert model.transfer_s([0])[0] == pytest.approx(15.0)


def test_clients_reporting_bandwidth_alone_without_model_bytes_transfer_in_no_time() -> None:
    """With model_bytes None, bandwidth tells no transfer time: transfer_s is 0 (as documented), not a made-up second."""
    model = FLClientModel()
    model.partial_fit([Report("fl", 0, 0, 100, 1.0, features={"bandwidth_down": 1e6, "bandwidth_up": 1e6})])
    assert model.transfer_s([0, 1]).tolist() == [0.0, 0.0]
    assert model.time_model([0]).time(np.array([100]))[0] == pytest.approx(1.0)


def test_a_client_that_only_announced_itself_gets_its_peers_transfer_time() -> None:
    """An announcement (nothing measured, no transfer feature) tells no transfer time, with model_bytes set too: the
    client is given its peers' (3 s), not 0 s."""
    model = FLClientModel(model_bytes=1e6)
    model.partial_fit([Report("fl", 0, 0, 10, 1.0, features={"bandwidth_down": 1e6, "bandwidth_up": 5e5}),
                       Report("fl", 1, 0, 0, 0.0)])
    assert model.transfer_s([0, 1]).tolist() == pytest.approx([3.0, 3.0])


def test_spike_none_takes_every_jump_at_once() -> None:
    """spike=None holds nothing back: a client ten times faster is learnt at once (it had raised a TypeError)."""
    model = FLClientModel(spike=None, alpha=1.0)
    model.partial_fit([Report("fl", 0, 0, 100, 1.0)])
    model.partial_fit([Report("fl", 0, 1, 100, 0.1)])
    assert model.predict([0])[0] == pytest.approx(1000.0)


@pytest.mark.parametrize("model_bytes", [1e16, float("inf")])
def test_model_bytes_past_a_petabyte_is_refused(model_bytes: float) -> None:
    with pytest.raises(ConfigError, match="model_bytes"):
        FLClientModel(model_bytes=model_bytes).partial_fit([Report("fl", 0, 0, 10, 1.0)])


def test_no_bandwidth_warning_for_clients_that_report_no_bandwidth(caplog: pytest.LogCaptureFixture) -> None:
    """The bandwidth-alone warning names clients that report a bandwidth: one that only announces itself (no transfer
    feature at all) is no such client, and no warning is logged."""
    model = FLClientModel()
    with caplog.at_level(logging.WARNING, logger="lbbsp.models"):
        model.partial_fit([Report("fl", 0, 0, 100, 1.0, features={"download_s": 1.0}), Report("fl", 1, 0, 0, 0.0)])
    assert "bandwidth" not in caplog.text


# ---------------------------------------------------------------- the GPU curve


def test_two_misses_in_a_row_in_one_direction_are_a_change_of_speed() -> None:
    """A GPU that became twice as slow is learnt afresh at its second slow measurement (the first is held out)."""
    model = BatchTimeCurve()
    for it in range(6):
        model.partial_fit([Report("j", 0, it, 100, 1.0, device="cuda:0")])
    model.partial_fit([Report("j", 0, 6, 100, 2.0, device="cuda:0")])
    assert model.predict([0])[0] == pytest.approx(100.0)  # one slow step: held out
    model.partial_fit([Report("j", 0, 7, 100, 2.0, device="cuda:0")])
    assert model.predict([0])[0] == pytest.approx(50.0)


def test_a_knee_that_fits_hardly_better_than_the_line_is_not_taken() -> None:
    """fit_hinge takes a knee only where it fits clearly better (1% less squared error) than the straight line: noisy
    linear times with a knee that would gain under 1% stay the line (knee 0)."""
    x = np.arange(10.0, 90.0, 10.0)[None]
    t = np.array([[1.1035, 1.2082, 1.3033, 1.387, 1.5091, 1.6045, 1.6946, 1.8058]])
    base, knee, slope = fit_hinge(x, t, np.ones_like(x))
    assert knee[0] == 0.0
    assert slope[0] == pytest.approx(0.00997, rel=1e-3) and base[0] == pytest.approx(1.0034, rel=1e-3)


def test_times_that_fall_as_the_batch_grows_fit_a_flat_curve() -> None:
    """The hinge's slope is never negative (the curve is monotone): falling times fit their weighted mean, flat."""
    base, knee, slope = fit_hinge(np.array([[10.0, 20.0, 30.0, 40.0]]), np.array([[4.0, 3.0, 2.0, 1.0]]),
                                  np.ones((1, 4)))
    assert (base[0], knee[0], slope[0]) == (pytest.approx(2.5), 0.0, 0.0)


def test_one_reading_past_the_first_size_is_capped_no_higher_than_all_readings_allow() -> None:
    """With a single reading above the first size, the cap is the lower of the line through the origin (400) and the
    cap from every reading, where bytes grow faster than in proportion (a < 0: 383)."""
    sizes, used = np.array([[50.0, 100.0, 200.0]]), np.array([[1.0 * GB, 2.5 * GB, 5.5 * GB]])
    cap = fit_memory_cap(sizes, used, np.ones((1, 3), dtype=bool), np.array([11 * GB]), first=np.array([100.0]))
    assert cap.tolist() == [383]


def test_a_budget_below_the_fixed_bytes_caps_at_zero_not_below() -> None:
    """Caps are whole samples, none below 0: a budget under the line's fixed part is a cap of 0 (a negative cap had
    passed as a bound)."""
    sizes, used = np.array([[100.0, 200.0]]), np.array([[5 * GB, 6 * GB]])
    cap = fit_memory_cap(sizes, used, np.ones((1, 2), dtype=bool), np.array([1 * GB]))
    assert cap.tolist() == [0]


def _pooling_reports(workers: list[int]) -> list[list[Report]]:
    rng = np.random.default_rng(0)
    slopes, devices, cores = [0.010, 0.0102, 0.02], ["cuda:0", "cuda:1", "cuda:2"], [8.0, 8.0, 16.0]
    history = []
    for it in range(12):
        size, noise = 100 + 20 * (it % 2), rng.normal(0, 0.02, 3)
        history.append([Report("j", w, it, size, (0.2 + slopes[w] * size) * (1 + noise[w]), device=devices[w],
                               features={"cores": cores[w]}) for w in workers])
    return history


def test_two_gpus_of_one_hardware_keep_their_own_curves() -> None:
    """Pooling starts at groups of three: two GPUs sharing a hardware key each keep their own curve, so worker 0 is
    predicted as it is without its twin (they had been pulled to one speed)."""
    both, alone = BatchTimeCurve(), BatchTimeCurve()
    for reports in _pooling_reports([0, 1, 2]):
        both.partial_fit(reports)
    for reports in _pooling_reports([0, 2]):
        alone.partial_fit(reports)
    assert both.known_[:3].all()
    assert both.predict([0])[0] == pytest.approx(alone.predict([0])[0], rel=1e-9)
    assert both.predict([0])[0] != pytest.approx(both.predict([1])[0], rel=1e-3)


def test_explore_moves_at_least_one_sample_at_small_batches() -> None:
    """5% of a batch of 8 rounds to 0: explore still moves one sample, so small batches learn their slope too."""
    model = BatchTimeCurve()
    model.partial_fit([Report("j", w, 0, 8, 1.0, device="cuda:0") for w in range(2)])
    out = model.explore([0, 1], np.array([8, 8]), np.array([1, 1]), np.array([100, 100]))
    assert sorted(out.tolist()) == [7, 9]


def test_a_new_gpu_is_capped_by_its_peers_cap_and_its_announced_memory_whichever_is_lower() -> None:
    """A GPU with no reading of its own takes the smaller of its hardware peers' smallest cap (480) and what its
    announced free memory holds (about 3,775): both apply."""
    model = BatchTimeCurve()
    model.partial_fit([Report("j", 0, 0, 100, 1.0, device="cuda:0",
                              features={"gpu_mem_used": 2 * GB, "gpu_mem_free": 8 * GB}),
                       Report("j", 1, 0, 0, 0.0, device="cuda:1",
                              features={"gpu_mem_used": 0.5 * GB, "gpu_mem_free": 79.5 * GB})])
    caps = model.max_batch([0, 1])
    assert caps[0] == 480 and caps[1] == 480


# ---------------------------------------------------------------- the auto model


@pytest.mark.parametrize("device", ["cuda:0", "GPU:1", "rocm:0", "hip:0", "mps", "xpu:0", "tpu:3"])
def test_every_accelerator_family_is_a_gpu_worker(device: str) -> None:
    assert worker_kind(Report("j", 0, 0, 10, 1.0, device=device)) == "gpu"


def test_the_cpu_model_forecasts_as_far_ahead_as_the_horizon() -> None:
    """AutoCapacityModel(horizon=h) builds its default CPU model (NARX) with that horizon (JobConfig.lag)."""
    model = AutoCapacityModel(horizon=4).partial_fit([Report("j", 0, 0, 10, 1.0)])
    assert model.models_["cpu"].horizon == 4


def test_a_report_with_samples_but_no_time_does_not_count_as_its_kind_measured() -> None:
    """A GPU's report of samples with compute_s 0 measured nothing: the GPU is still planned at the measured CPU's
    speed (the median of the measured kinds), not left unknown (NaN)."""
    model = AutoCapacityModel()
    model.partial_fit([Report("j", 0, 0, 100, 1.0),
                       Report("j", 1, 0, 50, 0.0, device="cuda:0", features={"gpu_mem_used": GB, "gpu_mem_free": GB})])
    assert model.predict([0, 1]).tolist() == pytest.approx([100.0, 100.0])


def test_a_pinned_worker_id_below_zero_is_refused() -> None:
    with pytest.raises(ConfigError, match="kinds' key -1"):
        AutoCapacityModel(kinds={-1: "gpu"}).partial_fit([Report("j", 0, 0, 10, 1.0)])


class _Stalled(EWMAThroughput):
    """EWMA speeds, but workers 0 and 1 are forecast to finish nothing (0 samples/s: a model's "never finishes")."""

    def predict(self, workers: WorkerIds) -> np.ndarray:
        speed = super().predict(workers)
        return np.where(np.asarray(workers) < 2, 0.0, speed)


def test_a_kind_not_measured_yet_is_planned_at_the_median_of_the_speeds_that_are_not_zero() -> None:
    """The first GPU of a CPU job is planned at the measured workers' median speed, leaving out those forecast at 0
    (two stalled of three had made it 0: a GPU that never finishes)."""
    model = AutoCapacityModel(models={"cpu": _Stalled()})
    model.partial_fit([Report("j", w, 0, 100, 1.0) for w in range(3)]
                      + [Report("j", 3, 0, 0, 0.0, device="cuda:0", features={"gpu_mem_used": GB, "gpu_mem_free": GB})])
    assert model.predict([3])[0] == pytest.approx(100.0)
    assert model.time_model([3]).time(np.array([100]))[0] == pytest.approx(1.0)


# ---------------------------------------------------------------- the model base


def test_a_report_of_samples_in_no_time_measured_nothing() -> None:
    """A report with samples but compute_s 0 is not a measurement (its throughput would be infinite): the speed stays
    the last one measured."""
    model = LastValue()
    model.partial_fit([Report("j", 0, 0, 100, 1.0)])
    model.partial_fit([Report("j", 0, 1, 100, 0.0)])
    assert model.predict([0])[0] == pytest.approx(100.0)


def test_caps_at_no_cap_are_no_cap_exactly() -> None:
    """whole_caps: NO_CAP at or past it, exactly (a float at NO_CAP reads 2**61, one past it), and none below 0."""
    caps = whole_caps(np.array([float(NO_CAP), np.inf, 1e30, 7.9, -3.0, np.nan]), nan=NO_CAP)
    assert caps.tolist() == [NO_CAP, NO_CAP, NO_CAP, 7, 0, NO_CAP]


# ---------------------------------------------------------------- lbbsp simulate


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_simulate_refuses_zero_iterations_before_anything_is_made(tmp_path: Path) -> None:
    out = tmp_path / "results"
    with pytest.raises(ConfigError, match="--iterations must be at least 1, got 0"):
        cli.run(_parse("--scenario", "gpu-mix", "--workers", "4", "--iterations", "0", "--out", str(out)))
    assert not out.exists()


def test_a_traces_folder_is_named_by_six_hex_digits_in_the_file_and_the_json(tmp_path: Path) -> None:
    """The result files of a --traces folder carry six hex digits of its traces' SHA-256, as the JSON's sha256_6 does."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.json").write_bytes((DEFAULT_TRACE_DIR / "cpu_numpy_mlp.json").read_bytes())
    assert cli.run(_parse("--scenario", "cpu-contention", "--workers", "4", "--iterations", "4", "--traces", str(mine),
                          "--out", str(tmp_path))) == 0
    [written] = tmp_path.glob("simulate_cpu-contention_4w_4it_seed0_mine-*.json")
    digest = json.loads(written.read_text())["traces"]["sha256_6"]
    assert re.fullmatch("[0-9a-f]{6}", digest) and written.name.endswith(f"_mine-{digest}.json")
