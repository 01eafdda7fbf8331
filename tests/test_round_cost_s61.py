"""A round's expected cost with dropouts is what the simulator charges on average: the finish of the clients that come
back, not of all those asked (an even split at 16 clients with 90% dropout had been costed 2.7-4.4x what it took, and
LB-BSP kept splits BSP beat), unless the round waits for every client asked (the Flower server, which waits out its
timeout for a client that sends no reply)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from lbbsp.allocation import LinearTime, allocate
from lbbsp.dropouts import dropout_bounds, expected_cost, expected_shortfall
from lbbsp.models import FLClientModel
from lbbsp.policies import LBBSPPolicy
from lbbsp.sim import FLClients
from lbbsp.sim.engine import run_policy


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


class _HookedDropout(LBBSPPolicy):
    """A variant whose dropout hook hands back a list, or a NaN where a worker's chance is unknown."""

    def __init__(self, nan: bool) -> None:
        super().__init__(FLClientModel(local_steps=5))
        self.nan = nan

    def dropout(self, workers: np.ndarray) -> np.ndarray | None:
        chances = [0.3] * workers.size
        if self.nan:
            chances[0] = float("nan")
        return chances  # type: ignore[return-value]


@pytest.mark.parametrize("nan", [False, True])
def test_a_dropout_hooks_list_or_nan_fails_no_decision(nan: bool) -> None:
    """A list had failed every decision (list.min in the search's early exit); a NaN, once the cost counted early
    finishes, too (int(nan)): 20 of 20. With a NaN the cost is no number, and the finish alone is damped."""
    run = run_policy(FLClients(16, 20, 0, dropout=0.3), "hooked", _HookedDropout(nan), 20)
    assert run.failed_decisions == 0
    assert any(len(set(sizes)) > 1 for sizes in run.sizes)  # it balanced: the decisions took effect


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
