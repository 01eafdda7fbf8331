"""Splits that weigh the chance that federated clients drop out (lbbsp.dropouts): a sample given to a client that
does not come back is lost, and the oracle's split at 64 clients had given one fast phone 60% of the round, so a
round it missed cost 3x. LB-BSP, whose model learns availability, now caps the largest shares where the predicted
finish times the expected shortfall of samples pays for it."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp import JobConfig, LBBSPPolicy, LinearTime, Report, allocate
from lbbsp.dropouts import MIN_SAVING, dropout_bounds, expected_shortfall
from lbbsp.models import AutoCapacityModel, FLClientModel
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
    capped = dropout_bounds(model, 320, lower, upper, dropout)
    before, after = allocate(model, 320, lower, upper), allocate(model, 320, lower, capped)
    assert before[0] == 250 and after[0] <= 50 and (capped == capped[0]).all()  # one cap for all
    assert float(model.time(after).max()) == float(model.time(before).max())  # the slow link's round, still
    assert expected_shortfall(after, dropout) < (1 - MIN_SAVING) * expected_shortfall(before, dropout)


def test_no_cap_where_spreading_costs_more_time_than_it_saves() -> None:
    model, lower, upper, dropout = _one_fast(0.05, slow_link=1.0)  # then the slow clients' compute sets the round
    assert dropout_bounds(model, 320, lower, upper, dropout) is upper


@pytest.mark.parametrize("dropout", [0.0, 1e-4])
def test_no_cap_where_nobody_drops_out_or_it_would_not_pay(dropout: float) -> None:
    model, lower, upper, chance = _one_fast(dropout)
    assert dropout_bounds(model, 320, lower, upper, chance) is upper


def test_many_small_shares_are_left_alone() -> None:
    speed = np.random.default_rng(1).uniform(5, 15, 512)
    model, lower, upper = LinearTime(speed), np.ones(512, dtype=np.int64), np.full(512, 10_000, dtype=np.int64)
    assert dropout_bounds(model, 512 * 20, lower, upper, np.full(512, 0.1)) is upper


def _policy_after_rounds(missed: bool) -> tuple[LBBSPPolicy, tuple[int, ...]]:
    """LB-BSP with the FL client model over rounds of sixteen clients, one 50x faster and one on a slow link; with
    ``missed``, two of the others miss a round."""
    policy, config = LBBSPPolicy(FLClientModel(local_steps=1), hedge=None), JobConfig("fl", 16, 320)
    sizes = config.initial_sizes()
    speed = [500.0] + [10.0] * 15
    for k in range(6):
        policy.observe([Report("fl", i, k, sizes[i], sizes[i] / speed[i], device="phone",
                               features={"download_s": 0.5, "upload_s": 9.5 if i == 15 else 0.5}) for i in range(16)])
        if missed and k == 2:
            policy.model.record_outcomes({1: False, 2: False})
        sizes = policy.decide(k + 1, sizes, config).sizes
        policy.learn()
    return policy, sizes


def test_lbbsp_caps_the_fast_client_once_clients_are_seen_to_drop_out() -> None:
    _, uncapped = _policy_after_rounds(missed=False)
    policy, capped = _policy_after_rounds(missed=True)
    assert uncapped[0] > 0.7 * 320  # nobody missed a round: the balanced split
    assert capped[0] < uncapped[0] and sum(capped) == 320
    # the client that never missed is weighed as likely to miss as the mean client, not as certain to come
    dropout = policy.dropout(np.arange(16))
    assert dropout is not None and dropout[3] > 0 and dropout[0] == pytest.approx(dropout[3])


def test_the_auto_model_routes_availability_to_its_clients_model() -> None:
    model = AutoCapacityModel()
    assert (model.availability([0, 1]) == 1.0).all()  # before any report
    model.partial_fit([Report("j", 0, 0, 10, 1.0, device="phone", features={"download_s": 1.0, "upload_s": 1.0}),
                       Report("j", 1, 0, 10, 1.0, device="cuda:0",
                              features={"gpu_mem_used": 1e9, "gpu_mem_free": 1e9})])
    model.record_outcomes({0: False, 1: False, 7: False})  # the GPU worker's and an unknown worker's are left out
    available = model.availability([0, 1, 7])
    assert available[0] < 1.0 and available[1] == 1.0
    with pytest.raises(TypeError, match="mapping"):
        model.record_outcomes([(0, True)])  # type: ignore[arg-type]


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

