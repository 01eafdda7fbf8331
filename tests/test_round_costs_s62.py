"""A decision's round costs are kept (lbbsp.dropouts.RoundCosts): each split is costed once, the search's chosen split
included, with the very figures expected_cost gives; and the shortfall's faster sort orders shares as the float sort
did."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp.allocation import LinearTime, allocate
from lbbsp.dropouts import RoundCosts, _largest_first, dropout_bounds, expected_cost
from lbbsp.errors import ConfigError


class _Counted(LinearTime):
    """LinearTime that counts its time() calls: a split costed again asks for no times."""

    calls = 0

    def time(self, sizes: np.ndarray) -> np.ndarray:
        type(self).calls += 1
        return super().time(sizes)


def _clients(workers: int = 64) -> tuple[_Counted, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    model = _Counted(rng.lognormal(3.0, 1.0, workers), overhead=np.full(workers, 1.0))
    return model, np.ones(workers, dtype=np.int64), np.full(workers, 64 * workers, dtype=np.int64), rng.uniform(
        0.02, 0.6, workers)


@pytest.mark.parametrize("waits_for_all", [False, True])
def test_a_kept_cost_is_expected_cost_and_computed_once(waits_for_all: bool) -> None:
    model, lower, upper, dropout = _clients()
    sizes = allocate(model, 64 * 64, lower, upper)
    costs = RoundCosts(model, dropout, waits_for_all=waits_for_all)
    assert costs(sizes) == expected_cost(model, sizes, dropout, waits_for_all=waits_for_all)
    assert RoundCosts(model, None)(sizes) == expected_cost(model, sizes, None)
    before = _Counted.calls
    assert costs(sizes.copy()) == costs(sizes)  # another array of the same sizes: the kept figure
    assert _Counted.calls == before


def test_the_search_keeps_the_cost_of_the_split_it_chooses() -> None:
    model, lower, upper, dropout = _clients()
    costs = RoundCosts(model, dropout)
    _, chosen = dropout_bounds(model, 64 * 64, lower, upper, dropout, costs=costs)
    before = _Counted.calls
    kept = costs(chosen)
    assert _Counted.calls == before  # asked again where the policy weighs it: no second computation
    assert kept == expected_cost(model, chosen, dropout)
    # and the search chooses as it does with costs of its own
    assert np.array_equal(chosen, dropout_bounds(model, 64 * 64, lower, upper, dropout)[1])


def test_costs_of_another_model_or_dropout_are_refused() -> None:
    model, lower, upper, dropout = _clients()
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
