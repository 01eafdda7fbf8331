"""Splits that weigh the chance that workers drop out (federated clients): a sample given to a client that does not
come back is lost, so a round costs its finish times B / the samples that came back, and a split that puts a large
share on one client pays for it whenever that client drops out (the oracle's split at 64 clients gave one fast phone
60% of the round, and a round it missed cost 3x).

Pure functions on numpy arrays, used by :class:`~lbbsp.policies.LBBSPPolicy` where its model learns availability.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from .allocation import TimeModel, allocate, predicted_makespan

#: The largest shares whose absences are counted exactly (2**_EXACT patterns); the rest by their mean and variance.
_EXACT = 10
#: Each exact pattern as a row: 1 where that share's worker is absent.
_PATTERNS = np.array(list(itertools.product((0.0, 1.0), repeat=_EXACT)))
#: The caps tried on the largest size, as shares of the largest size of the split that ignores dropouts.
CAP_STEPS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
#: Below this predicted saving (a share of the round's cost) the split that ignores dropouts is kept: the search's
#: own figures are no more precise than the availabilities they come from.
MIN_SAVING = 0.005


def weighed_dropout(availability: np.ndarray) -> np.ndarray | None:
    """Each worker's chance of not completing its round, from its learned ``availability``, at least the workers'
    mean (a client's own few rounds say little of a rare miss: one that had never missed had been given 60% of the
    round, lost whenever it did); None where no worker has missed one."""
    availability = np.asarray(availability, dtype=float)
    if not (availability < 1).any():
        return None
    return np.clip(1.0 - np.minimum(availability, availability.mean()), 0.0, 1.0)


def expected_shortfall(sizes: np.ndarray, dropout: np.ndarray) -> float:
    """E[B / the samples of the workers that come back], each worker with ``sizes[i]`` samples absent with chance
    ``dropout[i]``, independently (B = sum(sizes)): 1 where nobody drops out. Exact over the absences of the
    ``_EXACT`` largest shares, a second-order expansion over the rest; a round nobody comes back from counts 1, as if
    all had come (it trains nothing, and costs no sample)."""
    shares = np.asarray(sizes, dtype=float) / max(float(np.sum(sizes)), 1.0)
    dropout = np.asarray(dropout, dtype=float)
    order = np.argsort(-shares, kind="stable")
    shares, dropout = shares[order], dropout[order]
    top = min(_EXACT, shares.size)
    patterns = _PATTERNS[: 2**top, _EXACT - top:]  # the 2**top patterns of the top shares' absences
    chance = np.prod(np.where(patterns == 1.0, dropout[:top], 1.0 - dropout[:top]), axis=1)
    lost_top = patterns @ shares[:top]
    rest, rest_dropout = shares[top:], dropout[top:]
    left = 1.0 - lost_top - float(rest_dropout @ rest)  # the share expected back
    spread = float((rest_dropout * (1.0 - rest_dropout)) @ (rest * rest))
    back = np.maximum(left, 1e-3)
    value = np.where(left > 1e-3, 1.0 / back + spread / back**3, 1.0)
    return float(chance @ value)


def dropout_bounds(model: TimeModel, global_batch: int, lower: np.ndarray, upper: np.ndarray, dropout: np.ndarray,
                   split: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """``upper``, or ``upper`` capped at one size for every worker where that split's predicted finish times
    :func:`expected_shortfall` beats the split that ignores dropouts by more than ``MIN_SAVING``: the cap spreads the
    largest shares over more workers, at the price of a later finish. The caps tried are ``CAP_STEPS`` of the
    largest size that split gives; the best is kept. ``split``: the split a policy makes within given upper bounds
    (default: :func:`~lbbsp.allocation.allocate`'s; a policy that lets workers sit out makes another)."""
    if not (dropout > 0).any():
        return upper
    if split is None:
        split = lambda bounds: allocate(model, global_batch, lower, bounds)  # noqa: E731
    balanced = split(upper)
    shortfall = expected_shortfall(balanced, dropout)
    # what the shares' concentration costs over the samples expected lost (which capping hardly moves): where that
    # is under MIN_SAVING, as with many small shares, there is nothing to search
    expected_back = 1.0 - float(dropout @ balanced) / global_batch
    if not np.isfinite(shortfall) or shortfall * expected_back < 1.0 + MIN_SAVING:
        return upper
    best, best_cost = upper, predicted_makespan(model, balanced) * shortfall * (1 - MIN_SAVING)
    worse = 0
    for step in CAP_STEPS:
        capped = np.maximum(np.minimum(upper, int(balanced.max() * step)), lower)
        if capped.sum() < global_batch:
            break
        sizes = split(capped)
        cost = predicted_makespan(model, sizes) * expected_shortfall(sizes, dropout)
        if cost < best_cost:
            best, best_cost, worse = capped, cost, 0
        elif (worse := worse + 1) == 2:  # past the best: lower caps only finish later
            break
    return best
