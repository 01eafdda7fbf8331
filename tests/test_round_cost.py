"""A federated round's expected cost with dropouts (lbbsp.dropouts): the simulator's charge on average, a round that
waits for every client, slow clients and clients sure to come, rare rounds only a tiny share comes back from, and
the costs a decision keeps (RoundCosts), each computed once."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from lbbsp.allocation import LinearTime, allocate
from lbbsp.dropouts import RoundCosts, _largest_first, dropout_bounds, expected_cost, expected_shortfall
from lbbsp.errors import ConfigError


def _charged(model: LinearTime, sizes: np.ndarray, dropout: np.ndarray, draws: int = 100_000) -> float:
    """The simulator's charge for a round (lbbsp.sim.engine), averaged over random absences: the slowest finish of the
    clients that came back times B / their samples, and the slowest finish of all where nobody came back."""
    back = (np.random.default_rng(7).random((draws, sizes.size)) >= dropout) & (sizes > 0)
    times = model.time(sizes)
    finish = np.where(back, times, -np.inf).max(axis=1)
    samples = (back * sizes).sum(axis=1)
    nobody = samples == 0
    finish[nobody] = times[sizes > 0].max()
    return float(np.mean(finish * np.where(nobody, 1.0, sizes.sum() / np.maximum(samples, 1))))


def _clients(seed: int) -> tuple[LinearTime, np.ndarray, np.ndarray]:
    """Sixteen clients of widely spread speeds, each with 1 s of transfers: (model, balanced split, even split)."""
    model = LinearTime(np.random.default_rng(seed).lognormal(0.0, 1.0, 16), overhead=np.full(16, 1.0))
    balanced = allocate(model, 320, np.ones(16, dtype=np.int64), np.full(16, 320, dtype=np.int64))
    return model, balanced, np.full(16, 20, dtype=np.int64)


@pytest.mark.parametrize("chance", [0.9, 0.5, 0.05])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_cost_is_the_simulators_charge_on_average(chance: float, seed: int) -> None:
    model, balanced, even = _clients(seed)
    dropout = np.full(16, chance)
    for sizes in (balanced, even):
        assert expected_cost(model, sizes, dropout) == pytest.approx(_charged(model, sizes, dropout), rel=0.015)


def test_a_round_that_waits_for_all_is_charged_the_finish_of_all() -> None:
    model, balanced, even = _clients(1)
    dropout = np.full(16, 0.9)
    for sizes in (balanced, even):
        waited = expected_cost(model, sizes, dropout, waits_for_all=True)
        assert waited == pytest.approx(float(model.time(sizes).max()) * expected_shortfall(sizes, dropout))
    # the even split's slowest clients are seldom back at 90%: its round mostly ends far sooner
    assert expected_cost(model, even, dropout) < 0.5 * expected_cost(model, even, dropout, waits_for_all=True)
    assert expected_cost(model, even, None, waits_for_all=True) == expected_cost(model, even, None)
    lower, upper = np.ones(16, dtype=np.int64), np.full(16, 320, dtype=np.int64)
    _, chosen = dropout_bounds(model, 320, lower, upper, dropout, waits_for_all=True)
    cost = [expected_cost(model, s, dropout, waits_for_all=True) for s in (chosen, balanced, even)]
    assert cost[0] <= min(cost[1:]) * (1 + 1e-9)  # the search weighs what the round will be charged


def test_a_slow_client_that_seems_surest_to_miss_is_not_counted_on_to_miss() -> None:
    """Learned availabilities are noisy, and each client is weighed as missing at least as often as the mean one: a
    slow client whose few rounds made it look surest to stay away would make an even split look cheap (at 64 clients
    with 90% dropout one had been chosen, 13% dearer than the split it replaced). Its absence is weighed at the least
    dropout of those asked, so a higher estimate for it makes the split dearer (more of its share lost), not cheaper."""
    model, _, even = _clients(1)
    slowest = int(np.argmax(model.time(even)))
    pooled, doubted = np.full(16, 0.9), np.full(16, 0.9)
    doubted[slowest] = 0.99
    assert expected_cost(model, even, doubted) >= expected_cost(model, even, pooled)
    # and never under what the round is charged with those chances, nor over the finish of all asked
    for seed in range(3):
        dropout = np.random.default_rng(seed).uniform(0.3, 0.99, 16)
        cost = expected_cost(model, even, dropout)
        assert _charged(model, even, dropout) * 0.99 <= cost <= expected_cost(model, even, dropout, waits_for_all=True)


def test_a_worker_sure_to_come_counts_only_where_it_is_among_the_slowest() -> None:
    """A worker whose kind learns no availability is weighed as always coming (dropout 0): where it is among the
    slowest, the round waits for it; where it is fast, the clients slower than it still save by missing (it had
    cancelled their saving, and a GPU among phones gave an even split no credit at all)."""
    model, _, even = _clients(1)
    order = np.argsort(-model.time(even))
    fast_sure, slow_sure = np.full(16, 0.9), np.full(16, 0.9)
    fast_sure[order[-1]] = 0.0
    slow_sure[order[0]] = 0.0
    assert expected_cost(model, even, fast_sure) == pytest.approx(_charged(model, even, fast_sure), rel=0.015)
    assert expected_cost(model, even, slow_sure) == pytest.approx(
        expected_cost(model, even, slow_sure, waits_for_all=True))  # the slowest always comes: nothing saved


def test_a_chance_that_is_no_number_leaves_the_cost_no_number_and_a_list_is_taken() -> None:
    """A policy's dropout hook that hands back NaN: the cost is NaN, and LB-BSP falls back to damping by the finish,
    as before the cost counted early finishes (that had raised from int(nan), failing every decision)."""
    model, _, even = _clients(1)
    dropout = np.full(16, 0.9)
    dropout[3] = np.nan
    assert np.isnan(expected_cost(model, even, dropout))
    listed = [0.5] * 16
    assert expected_cost(model, even, listed) == expected_cost(model, even, np.array(listed))  # type: ignore[arg-type]


def test_the_rounds_only_a_tiny_share_comes_back_from_are_counted_however_rare() -> None:
    """Three slow workers of 1,000 samples and a fast one of 1: the rounds all three miss are rare (0.05^3) but cost
    B / 1 sample each, and leaving them out by their chance alone had put the cost 33% over; here it is exact."""
    model = LinearTime(np.array([1.0, 1.1, 1.2, 100.0]), overhead=np.full(4, 1.0))
    sizes, dropout = np.array([1000, 1000, 1000, 1]), np.full(4, 0.05)
    times, exact = model.time(sizes), 0.0
    for pattern in itertools.product((False, True), repeat=4):
        back = np.array(pattern)
        chance = float(np.prod(np.where(back, 0.95, 0.05)))
        exact += chance * (times[back].max() * sizes.sum() / sizes[back].sum() if back.any() else times.max())
    assert expected_cost(model, sizes, dropout) == pytest.approx(exact, rel=1e-9)


class _Counted(LinearTime):
    """LinearTime that counts its time() calls: a split costed again asks for no times."""

    calls = 0

    def time(self, sizes: np.ndarray) -> np.ndarray:
        type(self).calls += 1
        return super().time(sizes)


def _counted_clients(workers: int = 64) -> tuple[_Counted, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    model = _Counted(rng.lognormal(3.0, 1.0, workers), overhead=np.full(workers, 1.0))
    return model, np.ones(workers, dtype=np.int64), np.full(workers, 64 * workers, dtype=np.int64), rng.uniform(
        0.02, 0.6, workers)


@pytest.mark.parametrize("waits_for_all", [False, True])
def test_a_kept_cost_is_expected_cost_and_computed_once(waits_for_all: bool) -> None:
    model, lower, upper, dropout = _counted_clients()
    sizes = allocate(model, 64 * 64, lower, upper)
    costs = RoundCosts(model, dropout, waits_for_all=waits_for_all)
    assert costs(sizes) == expected_cost(model, sizes, dropout, waits_for_all=waits_for_all)
    assert RoundCosts(model, None)(sizes) == expected_cost(model, sizes, None)
    before = _Counted.calls
    assert costs(sizes.copy()) == costs(sizes)  # another array of the same sizes: the kept figure
    assert _Counted.calls == before


def test_the_search_keeps_the_cost_of_the_split_it_chooses() -> None:
    model, lower, upper, dropout = _counted_clients()
    costs = RoundCosts(model, dropout)
    _, chosen = dropout_bounds(model, 64 * 64, lower, upper, dropout, costs=costs)
    before = _Counted.calls
    kept = costs(chosen)
    assert _Counted.calls == before  # asked again where the policy weighs it: no second computation
    assert kept == expected_cost(model, chosen, dropout)
    # and the search chooses as it does with costs of its own
    assert np.array_equal(chosen, dropout_bounds(model, 64 * 64, lower, upper, dropout)[1])


def test_costs_of_another_model_or_dropout_are_refused() -> None:
    model, lower, upper, dropout = _counted_clients()
    other = LinearTime(model.speed * 2)
    for costs in (RoundCosts(other, dropout), RoundCosts(model, dropout * 0.5), RoundCosts(model, None),
                  RoundCosts(model, dropout, waits_for_all=True)):
        with pytest.raises(ConfigError, match="same model, dropout and waits_for_all"):
            dropout_bounds(model, 64 * 64, lower, upper, dropout, costs=costs)


@pytest.mark.parametrize("high", [3, 1000, 70_000, 10_000_000])
def test_the_largest_first_is_the_order_of_the_shares(high: int) -> None:
    rng = np.random.default_rng(high)
    for workers in (1, 5, 1024):
        sizes = rng.integers(0, high, workers)
        shares = sizes.astype(float) / max(float(sizes.sum()), 1.0)
        assert np.array_equal(_largest_first(sizes, shares), np.argsort(-shares, kind="stable"))  # ties in worker order
