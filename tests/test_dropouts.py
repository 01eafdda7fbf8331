"""Dropouts (lbbsp.dropouts): the samples a round is expected to lose to clients that do not come back, capping the
shares where that pays, the search and its floor, and round outcomes told before the first report."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from lbbsp import JobConfig, LBBSPPolicy, LinearTime, Report, allocate
from lbbsp.allocation import allocate_sitting_out
from lbbsp.dropouts import (
    MIN_SAVING,
    _least_shortfall,
    dropout_bounds,
    expected_cost,
    expected_shortfall,
    weighed_dropout,
)
from lbbsp.errors import AllocationError, ConfigError
from lbbsp.models import AutoCapacityModel, FLClientModel
from lbbsp.models.auto import MAX_EARLY_ROUNDS
from lbbsp.sim import FLClients, compare, standard_policies


def test_the_shortfall_is_exact_for_few_workers() -> None:
    # both come (0.81): 1; one of them (0.18): 2; neither (0.01): counted as all came, 1
    assert expected_shortfall(np.array([50, 50]), np.array([0.1, 0.1])) == pytest.approx(0.81 + 0.18 * 2 + 0.01)
    assert expected_shortfall(np.array([90, 10]), np.array([0.0, 0.5])) == pytest.approx(0.5 + 0.5 / 0.9)
    assert expected_shortfall(np.array([3, 7]), np.zeros(2)) == 1.0


def test_the_shortfall_of_many_shares_matches_sampling() -> None:
    rng = np.random.default_rng(0)
    sizes, dropout = rng.integers(1, 200, 300), rng.uniform(0.0, 0.3, 300)
    absent = rng.random((100_000, 300)) < dropout
    sampled = np.mean(sizes.sum() / np.where(absent, 0, sizes).sum(axis=1))
    assert expected_shortfall(sizes, dropout) == pytest.approx(sampled, rel=1e-3)


def _one_fast(dropout: float, slow_link: float = 10.0) -> tuple[LinearTime, np.ndarray, np.ndarray, np.ndarray]:
    """Sixteen clients, one 50x faster than the rest, and one whose transfers take ``slow_link`` seconds (the others'
    1 s): the round lasts as long as those, and balanced, the fast one takes 250 of 320 samples."""
    speed, overhead = np.full(16, 10.0), np.full(16, 1.0)
    speed[0], overhead[15] = 500.0, slow_link
    return (LinearTime(speed, overhead=overhead), np.ones(16, dtype=np.int64), np.full(16, 640, dtype=np.int64),
            np.full(16, dropout))


def test_a_share_the_round_would_lose_is_capped_where_that_pays() -> None:
    model, lower, upper, dropout = _one_fast(0.05)
    capped, after = dropout_bounds(model, 320, lower, upper, dropout)
    before = allocate(model, 320, lower, upper)
    assert (after == allocate(model, 320, lower, capped)).all()  # the split made within the bounds it returns
    # one cap for all, at most a quarter of the fast one's 250 (a quarter and a tenth of it cost within 0.05% of each
    # other: 10.348 and 10.352 s a round, a Monte Carlo of the engine's charge 10.305 and 10.303)
    assert before[0] == 250 and after[0] <= 250 // 4 and (capped == capped[0]).all()
    assert float(model.time(after).max()) == float(model.time(before).max())  # the slow link's round, still
    assert expected_shortfall(after, dropout) < (1 - MIN_SAVING) * expected_shortfall(before, dropout)


def test_no_cap_where_spreading_costs_more_time_than_it_saves() -> None:
    model, lower, upper, dropout = _one_fast(0.05, slow_link=1.0)  # then the slow clients' compute sets the round
    assert dropout_bounds(model, 320, lower, upper, dropout)[0] is upper


@pytest.mark.parametrize("dropout", [0.0, 1e-4])
def test_no_cap_where_nobody_drops_out_or_it_would_not_pay(dropout: float) -> None:
    model, lower, upper, chance = _one_fast(dropout)
    bounds, sizes = dropout_bounds(model, 320, lower, upper, chance)
    assert bounds is upper and (sizes == allocate(model, 320, lower, upper)).all()


def test_many_small_shares_are_left_alone() -> None:
    speed = np.random.default_rng(1).uniform(5, 15, 512)
    model, lower, upper = LinearTime(speed), np.ones(512, dtype=np.int64), np.full(512, 10_000, dtype=np.int64)
    assert dropout_bounds(model, 512 * 20, lower, upper, np.full(512, 0.1))[0] is upper


def test_in_the_simulator_lbbsp_learns_who_drops_out_and_beats_the_oracle_that_does_not() -> None:
    """One phone far faster than the rest (compute spread 2) takes most of the oracle's rounds, and 5% of them it
    misses; without dropouts LB-BSP's split is the balanced one, as before."""
    scenario = FLClients(64, 60, 0, compute_spread=2.0)
    runs = compare(scenario, 60, {name: policy for name, policy in standard_policies(scenario).items()
                                  if name in ("oracle", "lbbsp", "lbbsp-ewma")})
    mean = {name: float(np.mean(run.iteration_s)) for name, run in runs.items()}
    assert mean["lbbsp"] < 0.97 * mean["oracle"] and mean["lbbsp"] < mean["lbbsp-ewma"]
    steady = FLClients(64, 60, 0, compute_spread=2.0, dropout=0.0)
    runs = compare(steady, 60, {name: policy for name, policy in standard_policies(steady).items()
                                if name in ("oracle", "lbbsp")})
    assert np.mean(runs["lbbsp"].iteration_s) == pytest.approx(np.mean(runs["oracle"].iteration_s), rel=1e-3)


def test_the_shortfall_stays_exact_for_a_tiny_share_left_and_sane_where_most_drop_out() -> None:
    # the one that stays brings back 1 sample in 10,000: that round costs 10,000x (it had been counted 1)
    assert expected_shortfall(np.array([9999, 1]), np.array([0.5, 0.0])) == pytest.approx(0.5 + 0.5 * 10_000)
    rng = np.random.default_rng(2)
    for workers, dropout in [(12, 0.9), (14, 0.95), (16, 0.8), (16, 0.3)]:
        absent = rng.random((200_000, workers)) < dropout
        back = (~absent).sum(axis=1)
        sampled = np.mean(np.where(back > 0, workers / np.maximum(back, 1), 1.0))
        # a second-order expansion had given 121 where 6.6 is right at 12 workers with 90% dropout
        assert expected_shortfall(np.ones(workers), np.full(workers, dropout)) == pytest.approx(sampled, rel=0.06)


def test_the_split_does_not_swing_with_the_cap_chosen_each_round() -> None:
    """The cost is flat across the caps, and the chosen one moved with the noise: the split had changed in 138 of 149
    rounds (the dead band applied to the finish alone, and a split over the new cap counted as out of bounds)."""
    scenario = FLClients(64, 150, 0, compute_spread=2.0)
    run = compare(scenario, 150, {"lbbsp": standard_policies(scenario)["lbbsp"]})["lbbsp"]
    changes = sum(a != b for a, b in zip(run.sizes, run.sizes[1:]))
    assert changes < 40, changes


class _Stalled(FLClientModel):
    """Clients 0-5 predicted never to finish (0 samples/s); the rest as learnt."""

    def predict(self, workers: object) -> np.ndarray:
        speed = super().predict(workers)  # type: ignore[arg-type]
        return np.where(np.arange(speed.size) < 6, 0.0, speed)


def test_a_cap_the_other_workers_cannot_hold_ends_the_search_instead_of_the_decision() -> None:
    """With six clients predicted never to finish and the job's min_batch 0, a low cap left the global batch to them:
    allocate raised, and with it the decision."""
    policy, config = LBBSPPolicy(_Stalled(local_steps=1), hedge=None), JobConfig("fl", 16, 320, min_batch=0)
    sizes = config.initial_sizes()
    for k in range(4):
        policy.observe([Report("fl", i, k, sizes[i], 1.0 + sizes[i] / (500.0 if i == 6 else 10.0), device="phone",
                               features={"download_s": 0.5, "upload_s": 0.5}) for i in range(16) if sizes[i]])
        policy.model.record_outcomes({1: False, 2: False})
        sizes = policy.decide(k + 1, sizes, config).sizes
        policy.learn()
    assert sum(sizes) == 320


def test_workers_of_different_reliability_are_searched_even_when_many() -> None:
    """1,000 clients, the fast half flaky: capping saved 14.9% by the search's own figures, and an exit that assumed the
    expected loss hardly moves had skipped it."""
    fast = np.arange(1000) < 500
    overhead = np.where(np.arange(1000) == 999, 60.0, 1.0)  # one slow link sets the round: the others have slack
    model = LinearTime(np.where(fast, 100.0, 10.0), overhead=overhead, idle_is_free=True)
    lower, upper = np.ones(1000, dtype=np.int64), np.full(1000, 20_000, dtype=np.int64)
    dropout = weighed_dropout(np.where(fast, 0.5, 0.98))
    assert dropout is not None
    bounds, sizes = dropout_bounds(model, 20_000, lower, upper, dropout)
    balanced = allocate(model, 20_000, lower, upper)
    cost = [float(model.time(s).max()) * expected_shortfall(s, dropout) for s in (balanced, sizes)]
    assert bounds is not upper and cost[1] < 0.9 * cost[0]


ROUND = {0: False, 1: True, 2: True}


def _client_reports() -> list[Report]:
    return [Report("fl", i, 0, 10, 1.0, features={"download_s": 1.0, "upload_s": 0.5}) for i in (1, 2)]


def test_outcomes_before_the_first_report_count_as_if_told_after_it() -> None:
    early = AutoCapacityModel().record_outcomes(ROUND).record_outcomes(ROUND)
    early.partial_fit(_client_reports())
    late = AutoCapacityModel().partial_fit(_client_reports())
    late.record_outcomes(ROUND).record_outcomes(ROUND)
    assert early.availability([0, 1, 2]).tolist() == late.availability([0, 1, 2]).tolist()
    assert early.availability([0])[0] == pytest.approx(0.64)  # two misses at availability_alpha 0.2


def test_only_the_latest_early_rounds_are_kept_and_fit_forgets_them() -> None:
    model = AutoCapacityModel()
    model.record_outcomes({0: False})
    for _ in range(MAX_EARLY_ROUNDS):
        model.record_outcomes({0: True})
    model.partial_fit(_client_reports())
    assert model.availability([0])[0] == 1.0  # the miss fell out of the rounds kept
    refitted = AutoCapacityModel().record_outcomes({0: False})
    refitted.fit([_client_reports()])  # fit forgets what was learned, early outcomes too
    assert refitted.availability([0])[0] == 1.0


def test_a_wrong_outcome_is_refused_before_any_report() -> None:
    model = AutoCapacityModel()
    with pytest.raises(ConfigError, match=r"True or False \(or 1 or 0\)"):
        model.record_outcomes({0: None})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="client ids in"):
        model.record_outcomes({10**9: False})
    model.partial_fit(_client_reports())
    assert model.availability([0])[0] == 1.0  # nothing of the refused calls was kept


def _enumerated_shortfall(sizes: np.ndarray, dropout: np.ndarray) -> float:
    """E[B / the samples back] over every pattern of absences (1 where none come back)."""
    absent = np.array(list(itertools.product((0.0, 1.0), repeat=sizes.size)))
    chance = np.prod(np.where(absent == 1, dropout, 1.0 - dropout), axis=1)
    back = (1.0 - absent) @ sizes
    return float(chance @ np.where(back > 0, sizes.sum() / np.maximum(back, 1.0), 1.0))


@pytest.mark.parametrize("workers", [16, 18])
@pytest.mark.parametrize("dropout", [0.05, 0.5, 0.7, 0.9, 0.97])
def test_the_shortfall_is_near_exact_where_most_of_many_clients_drop_out(workers: int, dropout: float) -> None:
    """Past 14 workers, the rest beyond the 10 largest shares were a normal, far off where few of them come back:
    31 where 11 at 16 workers with 90% dropout, 4.5 where 7.0 with 70%. Those are now integrated exactly."""
    rng = np.random.default_rng(workers)
    sizes = rng.integers(1, 300, workers).astype(float)
    chances = np.clip(rng.normal(dropout, 0.05, workers), 1e-6, 0.999)
    assert expected_shortfall(sizes, chances) == pytest.approx(_enumerated_shortfall(sizes, chances), rel=0.004)


def test_the_shortfall_of_many_clients_that_mostly_drop_out_matches_sampling() -> None:
    """40 clients at 90% dropout: 12 had been given where 25 is right."""
    rng = np.random.default_rng(4)
    sizes, dropout = rng.integers(1, 200, 40), np.full(40, 0.9)
    absent = rng.random((400_000, 40)) < dropout
    back = np.where(absent, 0, sizes).sum(axis=1)
    sampled = np.mean(np.where(back > 0, sizes.sum() / np.maximum(back, 1), 1.0))
    assert expected_shortfall(sizes, dropout) == pytest.approx(sampled, rel=0.03)


def test_the_search_floor_lies_under_every_split_that_asks_the_same_clients() -> None:
    """The search is skipped where the balanced split's shortfall is within MIN_SAVING of a floor no split goes under.
    Jensen's 1 / (1 - the least dropout) is no such floor where a round nobody comes back to counts 1: at 16 clients
    with 90% dropout an even split's shortfall is 8.3, under its 10, and the search had been skipped."""
    rng = np.random.default_rng(7)
    even = np.full(16, 20)
    assert expected_shortfall(even, np.full(16, 0.9)) < 1 / (1 - 0.9)
    for _ in range(200):
        workers = int(rng.integers(2, 40))
        dropout = rng.uniform(0.0, 0.97, workers)
        sizes = rng.integers(1, 100, workers)
        floor = _least_shortfall(rng.integers(1, 100, workers), dropout)  # any split asking every client
        assert expected_shortfall(sizes, dropout) >= floor * (1 - 1e-9)


def test_where_most_clients_drop_out_the_split_moves_toward_the_even_one() -> None:
    """At 16 clients with 90% dropout, capping the largest shares left the others uneven, slow clients a few samples
    each, and a round only they came back from cost up to 320x: LB-BSP had been 1.31x BSP (2.3x before the shortfall
    was exact). The search now also mixes the even split in: 1.05x."""
    scenario = FLClients(16, 150, 0, dropout=0.9)
    policies = {name: policy for name, policy in standard_policies(scenario).items() if name in ("lbbsp", "bsp")}
    runs = compare(scenario, 150, policies)
    assert np.mean(runs["lbbsp"].iteration_s) < 1.1 * np.mean(runs["bsp"].iteration_s)


def test_clients_that_never_come_back_leave_the_split_as_it_is() -> None:
    """Every client's availability at 0 (after ~165 missed rounds at availability_alpha 0.2): the search's floor
    divided by the most reliable client's chance of coming back, 0, and decide raised ZeroDivisionError."""
    model = LinearTime(np.full(4, 10.0), overhead=np.full(4, 0.5))
    lower, upper = np.ones(4, dtype=np.int64), np.full(4, 40, dtype=np.int64)
    bounds, sizes = dropout_bounds(model, 40, lower, upper, np.ones(4))
    assert bounds is upper and sizes.tolist() == [10, 10, 10, 10]
    policy, config = LBBSPPolicy(FLClientModel(availability_alpha=1.0), hedge=None), JobConfig("fl", 4, 40)
    policy.observe([Report("fl", i, 0, 10, 1.0, features={"download_s": 0.5, "upload_s": 0.5}) for i in range(4)])
    policy.model.record_outcomes({i: False for i in range(4)})
    assert policy.decide(1, (10, 10, 10, 10), config).sizes == (10, 10, 10, 10)


def test_the_even_mix_keeps_a_client_that_sits_out_at_zero() -> None:
    """With a client sitting out (0 where the lower bound is 1), the mix toward the even split had stopped at its first
    step, out of bounds, and was never costed. Now it is, and the client stays out."""
    speed = np.r_[np.linspace(20.0, 80.0, 15), 0.02]  # rounds mostly transfers: evening the split costs little
    model = LinearTime(speed, overhead=np.full(16, 30.0))
    lower, upper = np.ones(16, dtype=np.int64), np.full(16, 320, dtype=np.int64)

    def split(bounds: np.ndarray) -> np.ndarray:
        return allocate_sitting_out(model, 320, lower, bounds, 0.1, 0.03)

    balanced = split(upper)
    assert balanced[15] == 0
    _, sizes = dropout_bounds(model, 320, lower, upper, np.full(16, 0.9), split)
    assert sizes[15] == 0 and sizes.sum() == 320
    assert sizes[:15].min() >= 15  # the mix: capping alone had left the slowest client 9 of 320


def test_a_split_whose_slowest_workers_never_finish_costs_inf_not_nan() -> None:
    """The early finish of a round whose slowest workers never finish is not counted: with two of them, inf - inf
    had made its cost NaN, which loses every comparison, so such a split could not be told dearer than one that
    finishes."""
    model = LinearTime(np.array([10.0, 0.0, 0.0, 10.0]), overhead=np.full(4, 1.0))
    assert expected_cost(model, np.array([10, 1, 1, 10]), np.full(4, 0.5)) == np.inf
    assert expected_cost(model, np.array([11, 0, 0, 11]), np.full(4, 0.5)) < np.inf


def test_a_split_that_refuses_a_cap_ends_the_search_with_the_best_so_far() -> None:
    """A policy's split (``split``) that raises AllocationError for a cap ends the search for caps there, as one the
    others cannot hold does, instead of failing the decision; the result is still a split of B within the bounds."""
    model, lower, upper, dropout = _one_fast(0.05)

    def split(bounds: np.ndarray) -> np.ndarray:
        if (bounds < upper).any():
            raise AllocationError("no split within these caps")
        return allocate(model, 320, lower, bounds)

    bounds, sizes = dropout_bounds(model, 320, lower, upper, dropout, split)
    assert sizes.sum() == 320 and (sizes >= lower).all() and (sizes <= bounds).all() and (bounds <= upper).all()
    assert expected_cost(model, sizes, dropout) <= expected_cost(model, allocate(model, 320, lower, upper), dropout)


def test_the_even_mix_stops_at_a_memory_cap_under_the_even_share() -> None:
    """Seven clients capped at 12 samples, under the even share of 20: the mix toward the even split would put more
    on them than their memory holds, so it stops there, and the split returned stays within every cap."""
    model, lower, upper, _ = _one_fast(0.05)
    upper = upper.copy()
    upper[1:8] = 12
    bounds, sizes = dropout_bounds(model, 320, lower, upper, np.full(16, 0.9))
    assert sizes.sum() == 320 and (sizes >= lower).all() and (sizes <= upper).all() and (sizes <= bounds).all()
