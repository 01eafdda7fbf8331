"""NARX after a fresh-eyes review: a failed feature reading is the worker's last value, not an idle machine; a
worker back at its speed after one slow measurement is not held as a spike; one glitched worker does not take the
network from the whole job; features on another scale than its inputs are refused."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from lbbsp import ConfigError, Report
from lbbsp.models import NARXThroughput


def _driven(workers: int = 16, iterations: int = 260, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Throughputs (iterations, workers) that a sticky on/off load, reported as colocated_load, halves two
    iterations later (the horizon), over an AR(1) on the log: a process where the features carry the forecast."""
    rng = np.random.default_rng(seed)
    base, x = rng.uniform(50, 500, workers), np.zeros(workers)
    load = np.zeros((iterations, workers))
    load[0] = rng.random(workers) < 0.5
    thr = np.zeros((iterations, workers))
    for t in range(iterations):
        if t:
            load[t] = np.where(rng.random(workers) < 0.1, 1 - load[t - 1], load[t - 1])
        x = 0.8 * x + 0.05 * rng.standard_normal(workers)
        thr[t] = base * np.exp(x - load[max(t - 2, 0)])
    return thr, load


def _features(load: float) -> dict[str, float]:
    return {"colocated_load": load, "cpu_util": 0.5 + 0.4 * load, "mem_util": 0.3, "proc_cpu": 1.0, "cores": 2.0}


def _reports(thr: np.ndarray, load: np.ndarray, t: int) -> list[Report]:
    return [Report("j", w, t, 100, 100 / thr[t, w], features=_features(float(load[t, w]))) for w in range(thr.shape[1])]


@pytest.fixture(scope="module")
def trained() -> tuple[NARXThroughput, np.ndarray, np.ndarray]:
    thr, load = _driven()
    model = NARXThroughput(horizon=2)
    for t in range(250):
        model.partial_fit(_reports(thr, load, t))
    assert model.recent_error_[0] < model.recent_error_[1]  # the network is trusted: the features matter
    return model, thr, load


def test_a_feature_reading_that_failed_is_the_workers_last_value(
        trained: tuple[NARXThroughput, np.ndarray, np.ndarray]) -> None:
    """A worker under load whose readings failed once (a report with no features) is forecast as if they had not
    changed: read as 0, an idle machine, its forecast had come out about 3x too fast."""
    model, thr, load = trained
    loaded = [w for w in range(thr.shape[1]) if load[245:251, w].min() == 1]
    assert loaded
    for worker in loaded:
        steady, failed = copy.deepcopy(model), copy.deepcopy(model)
        reports = _reports(thr, load, 250)
        steady.partial_fit(reports)
        reports[worker] = Report("j", worker, 250, 100, 100 / thr[250, worker], features={"cores": 2.0})
        failed.partial_fit(reports)
        assert failed.predict([worker]) == pytest.approx(steady.predict([worker]), rel=1e-9)


def test_one_glitched_worker_does_not_take_the_network_from_the_job(
        trained: tuple[NARXThroughput, np.ndarray, np.ndarray]) -> None:
    """One report 1,000x too slow: the network stays trusted for every other worker (its error and the level's
    had both grown 1,000-fold on that worker, and their gap there outweighed all others')."""
    model, thr, load = copy.deepcopy(trained[0]), trained[1], trained[2]
    reports = _reports(thr, load, 250)
    reports[3] = Report("j", 3, 250, 100, 100 / (thr[250, 3] / 1000), features=_features(float(load[250, 3])))
    model.partial_fit(reports)
    trusted = []
    for t in range(251, 260):
        model.partial_fit(_reports(thr, load, t))
        trusted.append(model.recent_error_[0] < model.recent_error_[1])
    assert all(trusted)


def test_a_worker_back_at_its_speed_after_one_slow_measurement_is_not_held() -> None:
    """100 samples/s, one measurement at 0.1, then 100 again: the return is learned at once (it had been held as a
    spike for a report, the forecast kept at the glitch's level)."""
    guarded, unguarded = NARXThroughput(), NARXThroughput(spike=None)
    for model in (guarded, unguarded):
        for k, speed in enumerate([100, 100, 100, 100, 0.1, 100]):
            model.partial_fit(Report("j", 0, k, 100, 100 / speed))
    assert guarded.predict([0]) == pytest.approx(unguarded.predict([0]))
    jumped = NARXThroughput()  # a jump past every speed it has had is still held until confirmed
    for k, speed in enumerate([100, 100, 100, 100, 10_000]):
        jumped.partial_fit(Report("j", 0, k, 100, 100 / speed))
    assert jumped.predict([0])[0] == pytest.approx(100)


@pytest.mark.parametrize("name", ["gpu_mem_used", "bandwidth_down", "download_s", "cores"])
def test_features_on_another_scale_than_the_networks_inputs_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="shares and cores per core"):
        NARXThroughput(features=("cpu_util", name)).partial_fit(Report("j", 0, 0, 100, 1.0))
