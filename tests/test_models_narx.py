"""NARXThroughput: learns known autoregressive processes at the horizon production uses, resists outliers and
glitched reports, forecasts scale-free, and handles workers that join late, skip an iteration or report fewer
features; parameters and features it cannot use are refused by name."""
from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest

from lbbsp import ConfigError, Report
from lbbsp.models import EWMAThroughput, LastValue, NARXThroughput, NotFittedError
from test_models import _cpu_history
from test_models_auto import _history
from test_policies import _reports_of


def _forecast_errors(models: dict, log_x: np.ndarray, features: list[list[dict[str, float]]], horizon: int,
                     score_from: int) -> dict[str, float]:
    """Feed each iteration's reports to every model; score the forecast made ``horizon`` iterations earlier."""
    n, workers = log_x.shape
    forecasts: dict[str, dict[int, np.ndarray]] = {name: {} for name in models}
    errors: dict[str, list[float]] = {name: [] for name in models}
    for t in range(n):
        reports = [Report("ar", w, t, 100, 100 / float(np.exp(log_x[t, w])), features=features[t][w])
                   for w in range(workers)]
        for name, model in models.items():
            if t >= score_from:
                errors[name].extend(np.abs(forecasts[name][t - horizon] / np.exp(log_x[t]) - 1))
            model.partial_fit(reports)
            forecasts[name][t] = model.predict(range(workers))
    return {name: float(np.mean(e)) for name, e in errors.items()}


@pytest.mark.parametrize("horizon", [1, 2])
def test_narx_learns_an_ar_process_with_an_exogenous_driver(horizon: int) -> None:
    """log x(t) = 0.5 log x(t-1) + 0.3 log x(t-2) - 0.8 u(t-1) + noise (about log 100), u a sticky on/off
    load reported as colocated_load: at its horizon, NARX beats LastValue and EWMA by at least 20% MAPE."""
    rng = np.random.default_rng(1)
    n, workers = 300, 8
    u = np.zeros((n, workers))
    for t in range(1, n):
        u[t] = np.where(rng.random(workers) < 0.1, 1 - u[t - 1], u[t - 1])
    log_x = np.zeros((n, workers))
    for t in range(2, n):
        log_x[t] = 0.5 * log_x[t - 1] + 0.3 * log_x[t - 2] - 0.8 * u[t - 1] + rng.normal(0, 0.02, workers)
    log_x += np.log(100)
    features = [[{"colocated_load": float(u[t, w])} for w in range(workers)] for t in range(n)]
    models = {"narx": NARXThroughput(horizon=horizon, warmup=20), "ewma": EWMAThroughput(), "last": LastValue()}
    mape = _forecast_errors(models, log_x, features, horizon, score_from=150)
    assert mape["narx"] <= 0.8 * min(mape["ewma"], mape["last"]), mape


def test_narx_learns_a_period_two_rhythm_at_the_horizon_it_is_built_for() -> None:
    """Speeds that alternate fast/slow (as time slicing with a co-located job can make them): NARX finds the
    rhythm within 3% one and two iterations ahead, where LastValue is off by 50-100% one ahead; a model built
    for one horizon and asked at the other is as wrong as LastValue, so ``horizon`` must match JobConfig.lag."""
    n, workers = 200, 4
    log_x = np.log(np.where(np.arange(n)[:, None] % 2 == 0, 200.0, 100.0)) + np.zeros((n, workers))
    log_x += np.random.default_rng(2).normal(0, 0.005, log_x.shape)
    features = [[{"cpu_util": 0.5}] * workers] * n
    for horizon in (1, 2):
        models = {"narx": NARXThroughput(horizon=horizon, warmup=20),
                  "other": NARXThroughput(horizon=3 - horizon, warmup=20), "last": LastValue()}
        mape = _forecast_errors(models, log_x, features, horizon, score_from=150)
        assert mape["narx"] < 0.03 and mape["other"] > 0.4, (horizon, mape)
        assert mape["last"] > 0.4 if horizon == 1 else mape["last"] < 0.03, (horizon, mape)


def test_narx_learns_from_every_worker_when_more_report_than_it_trains_on_per_update() -> None:
    """512 workers, 64 training rows per update: the 384 lowest ids follow a period-4 rhythm (forecastable 2
    ahead), the rest are steady. Reports come in worker order, so training on the last 64 new pairs only
    (the highest, steady ids) never saw the rhythm: 32% MAPE on those workers, against 1.0% now."""
    workers, rhythm = 512, np.arange(512) < 384
    wave = np.array([1.3, 1.3, 1 / 1.3, 1 / 1.3])
    rng = np.random.default_rng(0)
    log_x = np.log(1000 * np.where(rhythm, wave[(np.arange(160)[:, None] + np.arange(workers)) % 4], 1.0)
                   * np.exp(rng.normal(0, 0.01, (160, workers))))
    model = NARXThroughput(exog_lags=0, rows_per_update=64)
    forecasts = {}
    errors = []
    for t in range(160):
        if t >= 120:
            errors.append(np.abs(forecasts[t - 2][rhythm] / np.exp(log_x[t, rhythm]) - 1).mean())
        model.partial_fit([Report("ar", w, t, 100, 100 / float(np.exp(log_x[t, w]))) for w in range(workers)])
        forecasts[t] = model.predict(range(workers))
    assert np.mean(errors) < 0.05


def test_narx_forecast_is_a_median_not_pulled_down_by_rare_slow_iterations() -> None:
    """Steady 1000 samples/s with one iteration in 20 at a third of the speed (a burst of co-located load):
    the usual iteration is forecast within 3%, where a mean would sit about 3% lower."""
    rng = np.random.default_rng(3)
    n, workers = 300, 16
    slow = rng.random((n, workers)) < 0.05
    log_x = np.log(np.where(slow, 1000 / 3, 1000.0)) + rng.normal(0, 0.01, (n, workers))
    model = NARXThroughput(warmup=20)
    for t in range(n):
        model.partial_fit([Report("o", w, t, 100, 100 / float(np.exp(log_x[t, w]))) for w in range(workers)])
    usual = ~slow[-1] & ~slow[-2] & ~slow[-3]
    assert np.abs(model.predict(range(workers))[usual] / 1000 - 1).max() < 0.03


def test_narx_holds_back_a_lone_spike_and_follows_a_confirmed_jump() -> None:
    """A report claiming 100x the worker's speed (a timing glitch) moves no forecast and is not learned from;
    a real tenfold speed-up is followed one report late; with ``spike=None`` the glitch is taken as is."""
    def steady(model: NARXThroughput, start: int, stop: int, seconds: float = 0.1) -> None:
        for t in range(start, stop):
            model.partial_fit([Report("s", w, t, 100, seconds * (1 + 0.01 * ((t + w) % 3))) for w in range(4)])

    guarded, unguarded = NARXThroughput(warmup=0), NARXThroughput(warmup=0, spike=None)
    for model in (guarded, unguarded):
        steady(model, 0, 40)
    before = guarded.predict(range(4))
    for model in (guarded, unguarded):
        model.partial_fit([Report("s", w, 40, 100, 0.001 if w == 0 else 0.1) for w in range(4)])
    assert guarded.predict([0])[0] == pytest.approx(before[0], rel=0.02) and guarded.count_[0] == 40
    assert unguarded.predict([0])[0] > 3 * before[0]
    steady(guarded, 41, 43)  # the next reports are ordinary: the spike is dropped, not kept for later
    assert guarded.predict([0])[0] == pytest.approx(1000, rel=0.05)

    guarded.partial_fit([Report("s", w, 43, 100, 0.01 if w == 0 else 0.1) for w in range(4)])
    assert guarded.predict([0])[0] == pytest.approx(1000, rel=0.05)  # held: one report is no proof
    guarded.partial_fit([Report("s", w, 44, 100, 0.01 if w == 0 else 0.1) for w in range(4)])
    assert guarded.predict([0])[0] > 3000  # confirmed: followed


def test_narx_handles_late_joiners_skipped_iterations_and_missing_features() -> None:
    model = NARXThroughput(warmup=0)
    for t in range(40):
        reports = [Report("j", 0, t, 100, 0.1, features={"cpu_util": 0.5, "proc_cpu": 1.0}),
                   Report("j", 1, t, 0 if t % 5 == 0 else 100, 0.0 if t % 5 == 0 else 0.2)]
        model.partial_fit(reports)
    model.partial_fit([Report("j", 3, 40, 0, 0.0, features={"cores": 2.0})])  # announces itself, no speed yet
    speed = model.predict([0, 1, 3, 7])
    assert speed[0] == pytest.approx(1000, rel=0.05) and speed[1] == pytest.approx(500, rel=0.05)
    assert np.isfinite(speed[2:]).all() and (speed[2:] > 0).all()  # the similar-hardware prior
    assert model.count_[1] == 32  # the eight reports with no samples left worker 1's history alone


def test_deferred_training_changes_when_the_network_learns_not_what() -> None:
    """partial_fit(defer=True) trains on the same pairs in the same order, in finish_learning or in the next
    partial_fit; its forecast meanwhile reads the newest histories with the network of one update before."""
    rng = np.random.default_rng(5)
    now, deferred, caught_up = (NARXThroughput(warmup=0, random_state=2) for _ in range(3))
    for t in range(60):
        reports = [Report("d", w, t, 100, 0.1 * float(rng.lognormal(0.0, 0.2))) for w in range(6)]
        now.partial_fit(reports)
        before = deferred.params_.copy() if t else None
        deferred.partial_fit(reports, defer=True)
        if before is not None:
            assert np.array_equal(deferred.params_, before)  # nothing trained yet
        np.testing.assert_array_equal(deferred.log_thr_, now.log_thr_)
        deferred.finish_learning()
        caught_up.partial_fit(reports, defer=True)  # never told to finish: the next partial_fit does it
    caught_up.finish_learning()
    np.testing.assert_array_equal(deferred.params_, now.params_)
    np.testing.assert_array_equal(caught_up.params_, now.params_)
    np.testing.assert_array_equal(caught_up.predict(range(6)), now.predict(range(6)))


@pytest.mark.parametrize("params", [{"horizon": 0}, {"horizon": 9}, {"lags": 2, "exog_lags": 3},
                                    {"huber_delta": 0.0}, {"alpha_ewma": 1.5}, {"hidden": (0,)}, {"hidden": (-4,)},
                                    {"hidden": 16}, {"learning_rate": 0.0}, {"buffer_size": 0},
                                    {"rows_per_update": 0}, {"features": "cpu_util"}, {"features": ("cpu_load",)},
                                    {"spike": 1.0}, {"spike": float("inf")}, {"spike": "4"}])
def test_narx_rejects_bad_parameters_at_first_fit(params: dict) -> None:
    with pytest.raises(ConfigError):
        NARXThroughput(**params).partial_fit([Report("b", 0, 0, 10, 0.1)])


def test_fit_forgets_training_that_a_deferred_update_left_pending() -> None:
    """fit forgets everything learned, the pairs a ``defer=True`` update kept for finish_learning included: the
    coordinator's finish_learning after a refit must find nothing to train on (it found pairs for a network
    that no longer existed), and a refit learns as a fresh model does."""
    history = [[Report("f", 0, t, 100, 0.1 + 0.01 * (t % 3))] for t in range(12)]
    model = NARXThroughput(warmup=0)
    for reports in history:
        model.partial_fit(reports, defer=True)
    model.fit([]).finish_learning()
    with pytest.raises(NotFittedError):
        model.predict([0])
    model.partial_fit(history[0], defer=True)
    np.testing.assert_array_equal(model.fit(history).predict([0]), NARXThroughput(warmup=0).fit(history).predict([0]))


@pytest.mark.parametrize("copy_of", [lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy],
                         ids=["pickle", "deepcopy"])
def test_a_copied_narx_learns_on_exactly_as_the_original(copy_of: object) -> None:
    # the coordinator pickles its policy into a spawned process: the copy's network had stopped reading what
    # Adam updated, so a pre-trained NARX froze there
    original = NARXThroughput(random_state=0, warmup=0).fit(_cpu_history(30))
    twin = copy_of(original)  # type: ignore[operator]
    for reports in _cpu_history(20, start=30):
        original.partial_fit(reports)
        twin.partial_fit(reports)
    np.testing.assert_array_equal(twin.predict([0, 1, 2]), original.predict([0, 1, 2]))
    assert np.shares_memory(twin.weights_[0][0], twin.params_)


@pytest.mark.parametrize("features", [None, 5, True, (f for f in ["cpu_util"]), [["cpu_util"]]])
def test_narx_features_of_the_wrong_type_are_a_config_error_and_set_params_keeps_the_old(features: object) -> None:
    """features=None (or an int, a generator) was a bare TypeError from deep inside, and set_params left the bad
    value in a fitted model, which then failed at every partial_fit."""
    history = _history(6)
    with pytest.raises(ConfigError, match="features must be a list or tuple of report features"):
        NARXThroughput(features=features).partial_fit(history[0])
    model = NARXThroughput().fit(history[:5])
    with pytest.raises(ConfigError, match="features must be"):
        model.set_params(features=features)
    assert model.features == NARXThroughput().features
    model.partial_fit(history[5])  # still learns


@pytest.mark.parametrize(("params", "message"), [
    ({"hidden": (10**5, 10**5)}, r"hidden must be a tuple of 1 to 8 layer widths, each in \[1, 1024\]"),
    ({"hidden": (8,) * 9}, "hidden must be a tuple of 1 to 8"),
    ({"lags": 10**400}, r"lags must be an integer in \[1, 256\]"),
    ({"buffer_size": 10**400}, r"buffer_size x the input width \(lags \+ exog_lags x features: 12\)"),
    ({"buffer_size": 10**7}, "must be at most 67,108,864 values"),
])
def test_narx_sizes_past_what_memory_holds_are_refused_by_name(params: dict[str, Any], message: str) -> None:
    """hidden=(10**5, 10**5) was a MemoryError asking for 75 GiB, lags=10**400 numpy's 'maximum allowed dimension
    exceeded': neither named the parameter."""
    with pytest.raises(ConfigError, match=message):
        NARXThroughput(**params).partial_fit(_history(1)[0])


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


def test_narx_predicts_the_same_for_workers_it_knows_and_workers_it_does_not() -> None:
    reports = [Report("narx", w, k, 64, 64 / (100.0 * (w + 1)), features={"cores": 4, "proc_cpu": 2.0})
               for k in range(6) for w in range(3)]
    model = NARXThroughput(lags=2).fit(reports)
    known = model.predict([2, 0, 1])
    assert known.tolist() == model.predict(np.array([2, 0, 1], dtype=np.uint8)).tolist()
    assert known == pytest.approx([300.0, 100.0, 200.0], rel=0.1)
    # with a worker never seen, the others' forecasts are the same and the new one gets the prior
    mixed = model.predict([2, 0, 7, 1])
    assert mixed[[0, 1, 3]].tolist() == known.tolist() and mixed[2] == np.median(known)
    mixed[0] = -1.0  # a copy: the next predict is unchanged
    assert model.predict([2, 0, 1]).tolist() == known.tolist()


def test_narx_forecasts_are_scale_free() -> None:
    """The same relative series at 1x and 100x: forecasts 100x apart, the network's and the level's alike."""
    rng = np.random.default_rng(0)
    series = 100 * np.exp(np.cumsum(rng.normal(0, 0.05, (80, 3)), axis=0))
    small, large = NARXThroughput(warmup=5), NARXThroughput(warmup=5)
    for k in range(80):
        small.partial_fit(_reports_of("n", k, [100] * 3, series[k]))
        large.partial_fit(_reports_of("n", k, [100] * 3, 100 * series[k]))
    np.testing.assert_allclose(large.predict([0, 1, 2]), 100 * small.predict([0, 1, 2]), rtol=1e-6)


def test_narx_answers_with_its_level_before_warm_up_samples_and_seconds_smoothed_apart() -> None:
    model = NARXThroughput(alpha_ewma=0.3)
    for k, (samples, seconds) in enumerate([(100, 1.0), (300, 1.5)]):  # 100/s, then 200/s
        model.partial_fit(Report("n", 0, k, samples, seconds))
    assert model.predict([0])[0] == pytest.approx((0.3 * 300 + 0.7 * 100) / (0.3 * 1.5 + 0.7 * 1.0))  # 139.1


def test_narx_level_of_a_throttled_worker_is_its_rate_over_time_not_its_typical_step() -> None:
    """Under a CPU quota, a short step runs at full speed (20 samples in 0.02 s) or waits out the period (0.14 s): the
    worker does 40 samples in 0.16 s, 250/s. Its level swings with each step, about 250/s over a pair of them; an
    average of the steps' log-rates would read it 1.5x faster (378/s), and it would get too many samples."""
    model = NARXThroughput(alpha_ewma=0.5, warmup=10**6)  # the level alone
    forecasts = []
    for k in range(40):
        model.partial_fit(Report("n", 0, k, 20, 0.14 if k % 2 else 0.02))
        forecasts.append(model.predict([0])[0])
    assert np.exp(np.mean(np.log(forecasts[20:]))) == pytest.approx(250, rel=0.05)



def test_narx_refuses_a_learning_rate_past_one() -> None:
    with pytest.raises(ConfigError, match=r"learning_rate must be in \(0, 1\]"):
        NARXThroughput(learning_rate=1e300).partial_fit([Report("j", 0, 0, 10, 1.0)])
    NARXThroughput(learning_rate=1.0).partial_fit([Report("j", 0, 0, 10, 1.0)])
