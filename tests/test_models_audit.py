"""Capacity models, from a read-and-probe audit: a copied NARX keeps learning, memory caps stay on the card
when readings are noisy or the card is partly taken, parameters apply as documented, a knee between measured
sizes is found, one glitched bandwidth does not poison a client, and a mixed job takes a model of one's own.
A second, new-user audit (2026-11-29): bad round outcomes, an equal list for a tuple parameter, nested
parameters of a dict, a table of worker ids, an empty iteration, and fit_hinge's inputs."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from lbbsp.allocation import allocate
from lbbsp.errors import ConfigError
from lbbsp.models import (
    AutoCapacityModel,
    BatchTimeCurve,
    EWMAThroughput,
    FLClientModel,
    LastValue,
    NARXThroughput,
    NotFittedError,
    fit_hinge,
    fit_memory_cap,
)
from lbbsp.protocol import Report

GB, MB = 1e9, 1e6


def _cpu_history(iterations: int, start: int = 0) -> list[list[Report]]:
    rng = np.random.default_rng(start)
    return [[Report("j", w, k, 100, float(rng.uniform(0.5, 1.5)) * (1 + w), features={"cpu_util": 0.5})
             for w in range(3)] for k in range(start, start + iterations)]


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


def test_a_memory_line_from_close_sizes_is_not_followed_past_the_card() -> None:
    """4 GB + 20 MB per sample on a 16 GB card (592 samples fit 99%), measured at sizes 5% apart with 40 MB of
    noise: the slope is off by what the noise is over 24 samples, and 611 caps in 2,000 lay past the card."""
    rng = np.random.default_rng(0)
    sizes = np.tile([240.0, 252.0, 264.0], (2000, 1))
    used = 4 * GB + 20 * MB * sizes + rng.normal(0, 40 * MB, sizes.shape)
    budget = np.minimum(0.99 * 16 * GB, used[:, 2] + 0.95 * (16 * GB - used[:, 2]))
    caps = fit_memory_cap(sizes, used, np.ones(sizes.shape, bool), budget)
    assert (4 * GB + 20 * MB * caps <= 16 * GB).all()
    assert (caps > 264).all()  # it still grows, along the line through the origin


def test_a_new_gpu_is_not_planned_on_memory_already_in_use() -> None:
    model = BatchTimeCurve()
    for k, size in enumerate([100, 300]):  # 2 GB + 20 MB per sample on 16 GB cards
        model.partial_fit([Report("j", w, k, size, 0.1, device="cuda:T4", features={
            "gpu_mem_used": 2 * GB + 20 * MB * size, "gpu_mem_free": 14 * GB - 20 * MB * size}) for w in (0, 1)])
    other = 6 * GB  # another process holds 6 GB of the new worker's card
    model.partial_fit([Report("j", 2, 2, 0, 0.0, device="cuda:T4",
                              features={"gpu_mem_used": other, "gpu_mem_free": 16 * GB - other})])
    cap = int(model.max_batch([2])[0])
    assert other + 2 * GB + 20 * MB * cap <= 16 * GB  # it was 581 samples: 19.6 GB
    assert cap > 300


def test_new_memory_margins_apply_to_the_caps_at_once() -> None:
    model = BatchTimeCurve()
    for k, size in enumerate([100, 400]):
        model.partial_fit([Report("j", 0, k, size, 0.1, device="cuda:0", features={
            "gpu_mem_used": 2 * GB + 10 * MB * size, "gpu_mem_free": 14 * GB - 10 * MB * size})])
    model.set_params(memory_margin=0.9, memory_floor=0.5)  # at most 8 GB of the card
    fresh = BatchTimeCurve(memory_margin=0.9, memory_floor=0.5)
    for k, size in enumerate([100, 400]):
        fresh.partial_fit([Report("j", 0, k, size, 0.1, device="cuda:0", features={
            "gpu_mem_used": 2 * GB + 10 * MB * size, "gpu_mem_free": 14 * GB - 10 * MB * size})])
    assert model.max_batch([0])[0] == fresh.max_batch([0])[0] <= 600  # it kept the old cap, 1,155


@pytest.mark.parametrize("model, change", [(BatchTimeCurve(), {"window": 4, "windw": 3}),
                                           (NARXThroughput(), {"lags": 6, "lag": 1})], ids=["gpu", "narx"])
def test_a_misspelt_parameter_changes_nothing(model: BatchTimeCurve | NARXThroughput,
                                              change: dict[str, int]) -> None:
    model.fit([[Report("j", w, k, 10 + k, 0.1, device="cuda:0") for w in range(2)] for k in range(4)])
    before = model.get_params()
    misspelt = next(name for name in change if name not in before)
    with pytest.raises(ValueError, match=f"Invalid parameter '{misspelt}' for {type(model).__name__}; valid") as raised:
        model.set_params(**change)
    assert "=" not in str(raised.value)  # scikit-learn's message showed the model with the valid value set
    assert model.get_params() == before  # the valid name had been set, without the forgetting it needs
    model.partial_fit([Report("j", 5, 9, 20, 0.1, device="cuda:0")])  # the GPU curve had crashed here


def test_a_knee_between_measured_sizes_is_found() -> None:
    sizes = np.array([[16.0, 48, 80, 112, 144]])  # flat 0.1 s up to 64 samples, then 2 ms per sample
    base, knee, slope = fit_hinge(sizes, 0.1 + 0.002 * np.maximum(sizes - 64, 0), np.ones(sizes.shape, bool))
    assert (base[0], knee[0], slope[0]) == pytest.approx((0.1, 64, 0.002))  # knee 48, slope 0.00165 before


def test_one_glitched_bandwidth_does_not_poison_a_client() -> None:
    model = FLClientModel(model_bytes=1e8)
    fine = {"bandwidth_down": 1e7, "bandwidth_up": 1e7}
    model.partial_fit([Report("j", w, 0, 100, 1.0, features=fine) for w in (0, 1)])
    model.partial_fit([Report("j", 0, 1, 100, 1.0, features={"bandwidth_down": 1e-300, "bandwidth_up": 1e7}),
                       Report("j", 1, 1, 100, 1.0, features=fine)])
    for k in range(2, 22):
        model.partial_fit([Report("j", w, k, 100, 1.0, features=fine) for w in (0, 1)])
    assert model.transfer_s([0])[0] < 1.1 * model.transfer_s([1])[0]  # it was 4.8e301 s, and 1 sample of 200
    assert allocate(model.time_model([0, 1]), 200, [1, 1], [200, 200]).min() > 90


def test_a_mixed_job_allocates_with_a_time_model_of_ones_own() -> None:
    class Quadratic:
        def __init__(self, k: np.ndarray) -> None:
            self.k = k

        def time(self, sizes: np.ndarray) -> np.ndarray:
            return self.k * np.asarray(sizes, float) ** 2

    class MyGPU(LastValue):
        def time_model(self, workers: object) -> Quadratic:  # type: ignore[override]
            return Quadratic(1.0 / self.predict(workers))  # type: ignore[arg-type]

    model = AutoCapacityModel(models={"gpu": MyGPU(), "cpu": LastValue()})
    model.partial_fit([Report("j", 0, 0, 10, 0.1, device="cuda:0"), Report("j", 1, 0, 10, 0.1)])
    sizes = allocate(model.time_model([0, 1]), 100, [1, 1], [100, 100])  # an AttributeError before
    assert sizes.sum() == 100 and sizes[0] < sizes[1]  # quadratic time: the GPU worker takes fewer


def test_set_params_still_refuses_a_bad_value() -> None:
    model = BatchTimeCurve().fit([[Report("j", 0, 0, 10, 0.1, device="cuda:0")]])
    with pytest.raises(ConfigError, match="memory_margin"):
        model.set_params(memory_margin=1.5)
    assert model.memory_margin == 0.05


def test_a_claimed_transfer_ages_out_once_reports_carry_none() -> None:
    # a training worker whose first report claimed a day of transfer was routed to the client model, which kept
    # that day for good: the predicted finish never fell below it, so the job kept the equal split
    model = AutoCapacityModel()
    model.partial_fit([Report("j", 0, 0, 100, 1.0, features={"download_s": 86_400.0, "upload_s": 0.0}),
                       Report("j", 1, 0, 100, 1.0)])
    for k in range(1, 30):
        model.partial_fit([Report("j", w, k, 100, 1.0) for w in (0, 1)])
    assert model.time_model([0, 1]).time(np.array([100, 100])).max() < 1.1


@pytest.mark.parametrize("ids", [[0.9, 1.9], ["1"], [True, False]], ids=["floats", "strings", "bools"])
def test_worker_ids_that_are_not_integers_are_refused(ids: list[object]) -> None:
    model = LastValue().fit([[Report("j", w, 0, 10, 0.1) for w in range(2)]])
    with pytest.raises(ConfigError, match="worker ids must be integers"):
        model.predict(ids)  # type: ignore[arg-type]  (0.9 had been read as worker 0)
    assert model.predict([]).size == 0 and model.predict(np.arange(2)).size == 2


def _fl_model() -> FLClientModel:
    return FLClientModel().partial_fit([Report("f", w, 0, 20, 1.0 + w, features={"download_s": 1.0, "upload_s": 2.0})
                                        for w in range(3)])


@pytest.mark.parametrize(("outcomes", "error", "words"), [
    ({0: 5}, ConfigError, "True or False .* got 5"),
    ({1: float("nan")}, ConfigError, "got nan"),
    ({0: "no"}, ConfigError, "got 'no'"),
    ({1.5: False}, ConfigError, "worker ids must be integers"),
    ([1, 2], TypeError, "mapping {client id: completed}, got list"),
])
def test_a_bad_round_outcome_is_refused_and_changes_nothing(outcomes: object, error: type, words: str) -> None:
    """{0: 5} had made a chance of completing of 1.64 (and given new clients a prior above 1), NaN had wiped a
    client's history, and 1.5 was taken as client 1."""
    model = _fl_model().record_outcomes({0: True, 1: False, 2: np.bool_(True)})
    before = model.availability([0, 1, 2, 3])
    with pytest.raises(error, match=words):
        model.record_outcomes(outcomes)  # type: ignore[arg-type]
    np.testing.assert_array_equal(model.availability([0, 1, 2, 3]), before)
    assert ((before > 0) & (before <= 1)).all() and before[1] < before[0]


def test_an_equal_list_for_a_tuple_parameter_forgets_nothing() -> None:
    """hidden=[16, 16] equals the default (16, 16): a fitted NARX had taken it as new and forgotten everything."""
    model = NARXThroughput().fit(_cpu_history(20))
    before = model.predict([0, 1])
    model.set_params(hidden=[16, 16], features=list(model.features))
    np.testing.assert_array_equal(model.predict([0, 1]), before)
    with pytest.raises(NotFittedError):  # a new value still makes it relearn
        model.set_params(hidden=[8]).predict([0])


def test_nested_parameters_of_a_dict_are_refused_with_what_to_do() -> None:
    model = AutoCapacityModel(models={"cpu": EWMAThroughput()})
    with pytest.raises(ValueError, match="'models' is not an estimator .* pass a whole new models="):
        model.set_params(models__cpu__alpha=0.9)
    assert model.models["cpu"].alpha == EWMAThroughput().alpha


@pytest.mark.parametrize("model", [LastValue(), EWMAThroughput(), NARXThroughput(), BatchTimeCurve(),
                                   FLClientModel(), AutoCapacityModel()], ids=lambda m: type(m).__name__)
def test_an_iteration_nobody_reported_in_leaves_a_model_unfitted_and_a_table_of_ids_is_refused(model) -> None:  # type: ignore[no-untyped-def]
    """predict had answered NaN after partial_fit([]) (docs: NotFittedError before any report), and flattened a
    2-D array of ids into four predictions."""
    model.partial_fit([])
    with pytest.raises(NotFittedError):
        model.predict([0])
    model.partial_fit([Report("j", w, 0, 100, 0.5, device="cpu") for w in range(2)]).partial_fit([])
    assert model.predict([0, 1]).shape == (2,) and model.predict(1).shape == (1,)
    with pytest.raises(ConfigError, match=r"1-D sequence .* shape \(2, 2\)"):
        model.predict([[0, 1], [1, 0]])


@pytest.mark.parametrize(("arrays", "words"), [
    ((np.array([16.0, 48]), np.array([0.1, 0.2]), np.ones(2)), r"\(workers, points\) arrays of one shape"),
    ((np.ones((2, 3)), np.ones((2, 2)), np.ones((2, 3))), "of one shape"),
    ((np.array([[16.0, 48]]), np.array([[0.1, np.nan]]), np.ones((1, 2))), "finite"),
])
def test_fit_hinge_refuses_arrays_it_cannot_fit(arrays: tuple[np.ndarray, ...], words: str) -> None:
    """A 1-D row had raised numpy's AxisError, and a NaN time had given a NaN base and slope."""
    with pytest.raises(ConfigError, match=words):
        fit_hinge(*arrays)


def test_fit_hinge_ignores_what_an_absent_point_holds() -> None:
    sizes, weight = np.array([[16.0, 48, 64]]), np.array([[1.0, 0.0, 1.0]])
    fits = [fit_hinge(sizes, np.array([[0.1, absent, 0.3]]), weight) for absent in (0.2, np.nan, np.inf)]
    for fit in fits[1:]:
        np.testing.assert_array_equal(np.concatenate(fit), np.concatenate(fits[0]))


@pytest.mark.parametrize("model", [LastValue, EWMAThroughput, NARXThroughput, BatchTimeCurve, FLClientModel,
                                   AutoCapacityModel])
def test_reports_of_several_iterations_are_learned_in_iteration_order(model: type) -> None:
    # a worker's last report is its latest: given out of order, iteration 4 had overwritten iteration 5
    history = _cpu_history(12)
    flat = [report for reports in history for report in reports]
    rng = np.random.default_rng(0)
    in_order, shuffled = model().partial_fit(flat), model().partial_fit([flat[i] for i in rng.permutation(len(flat))])
    np.testing.assert_allclose(shuffled.predict([0, 1, 2]), in_order.predict([0, 1, 2]))
    latest = LastValue().partial_fit(list(reversed(flat)))
    np.testing.assert_allclose(latest.predict([0, 1, 2]), [r.samples / r.compute_s for r in history[-1]])
