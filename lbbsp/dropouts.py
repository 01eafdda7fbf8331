"""Splits that weigh the chance that workers drop out (federated clients): a sample given to a client that does not
come back is lost, so a round costs its finish times B / the samples that came back, and a split that puts a large
share on one client pays for it whenever that client drops out (the oracle's split at 64 clients gave one fast phone
60% of the round, and a round it missed cost 3x).

Pure functions on numpy arrays (and :class:`RoundCosts`, which keeps one decision's costs), used by
:class:`~lbbsp.policies.LBBSPPolicy` and the Flower plugin where their model learns availability.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from .allocation import TimeModel, allocate
from .errors import AllocationError, ConfigError

#: The largest shares whose absences are counted exactly (2**_EXACT patterns); the rest below, unless
#: there are no more than _FEW of them (a normal of a few shares where most drop out is far off: 9.5 where 6.6).
_EXACT, _FEW = 10, 4
#: Each exact pattern as a row: 1 where that share's worker is absent (_PATTERNS), 1 where it is there (_PRESENT).
_PATTERNS = np.array(list(itertools.product((0.0, 1.0), repeat=_EXACT + _FEW)))
_PRESENT = 1.0 - _PATTERNS
#: Gauss-Hermite nodes and weights (normalised) for the rest's loss, a normal of their mean and variance, kept within
#: what they hold: a second-order expansion had blown up where few workers are left and most drop out (121 where 6.6).
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(8)
_WEIGHTS = _WEIGHTS / _WEIGHTS.sum()
#: The normal serves where the rest's share back has a spread of at most this share of its mean (within 0.6% of
#: the exact value over 1,600 random draws, always above it); beyond it, few of the rest come back and the normal was
#: far off both ways (31 where 11 at 16 workers with 90% dropout, 12 where 25 at 40), so the Laplace transform is
#: integrated instead.
_NORMAL_SPREAD = 0.15
#: That integral's grid: t = exp(v), v in steps of _STEP from log(_T_LOW) to log(40 / the smallest share), by the
#: trapezoid rule, whose error for this integrand falls as exp(-pi^2 / _STEP): within 1e-4 of a grid 4x finer.
_STEP, _T_LOW = 0.5, 1e-7
#: Finishes within this share of the slowest are one level in :func:`_early_finish`, charged its top; at most
#: _MAX_LEVELS levels below the slowest are counted, and none where all above are absent with a chance under _TAIL
#: times the share the others hold.
_LEVEL, _MAX_LEVELS, _TAIL = 0.002, 24, 1e-3
#: The caps tried on the largest size, as shares of the largest size of the split that ignores dropouts; the search
#: stops after two in a row that do worse than the best (smaller caps only finish later).
CAP_STEPS = (0.8, 0.6, 0.4, 0.25, 0.1)
#: The shares of an even split (over the workers asked) mixed into the best split the caps give, tried after them:
#: where most clients drop out, a round that only clients given a few samples come back from costs B / those few, which
#: no cap on the largest shares helps (at 16 clients with 90% dropout, LB-BSP had been 1.31x BSP with the caps alone).
EVEN_MIX = (0.25, 0.5, 0.75, 1.0)
#: Below this predicted saving (a share of the round's cost) the split that ignores dropouts is kept: the search's
#: own figures are no more precise than the availabilities they come from.
MIN_SAVING = 0.005


def weighed_dropout(availability: np.ndarray) -> np.ndarray | None:
    """Each worker's chance of not completing its round, from its learned ``availability`` (NaN: its kind learns none,
    and it is weighed as always coming), at least the mean of the workers that learn one (a client's own few rounds
    say little of a rare miss: one that had never missed had been given 60% of the round, lost whenever it did);
    None where no worker has missed one."""
    availability = np.asarray(availability, dtype=float)
    learns = ~np.isnan(availability)
    if not (availability[learns] < 1).any():
        return None
    floor = float(availability[learns].mean())
    return np.where(learns, np.clip(1.0 - np.minimum(np.nan_to_num(availability), floor), 0.0, 1.0), 0.0)


def expected_shortfall(sizes: np.ndarray, dropout: np.ndarray) -> float:
    """E[B / the samples of the workers that come back], each worker with ``sizes[i]`` samples absent with chance
    ``dropout[i]``, independently (B = sum(sizes)): 1 where nobody drops out. Exact for up to ``_EXACT + _FEW``
    workers; for more, exact over the absences of the ``_EXACT`` largest shares, and the rest's share back as a
    normal of its mean and variance (Gauss-Hermite, within what they hold) where that is close (many of them come
    back), else through its Laplace transform (:func:`_mean_inverse`): within 0.6% of exact either way. A round nobody
    comes back from counts 1, as if all had come (it trains nothing, and costs no sample)."""
    sizes = np.asarray(sizes)
    shares = sizes.astype(float) / max(float(np.sum(sizes)), 1.0)
    dropout = np.asarray(dropout, dtype=float)
    order = _largest_first(sizes, shares)
    shares, dropout = shares[order], dropout[order]
    top = shares.size if shares.size <= _EXACT + _FEW else _EXACT
    patterns = _PATTERNS[: 2**top, _EXACT + _FEW - top:]  # the 2**top patterns of the top shares' absences
    present, top_dropout = _PRESENT[: 2**top, _EXACT + _FEW - top:], dropout[:top]
    # each pattern's chance as exp of a product with the logs (a tenth of where + prod's time); 0 and 1 clipped to
    # chances that still round to them (by maximum and minimum: half np.clip's time)
    chance = np.exp(patterns @ np.log(np.minimum(np.maximum(top_dropout, 1e-300), 1.0))
                    + present @ np.log(np.minimum(np.maximum(1.0 - top_dropout, 1e-300), 1.0)))
    rest, rest_dropout = shares[top:], dropout[top:]
    rest_total = float(rest.sum())
    mean = float(rest_dropout @ rest)
    spread = float(np.sqrt((rest_dropout * (1.0 - rest_dropout)) @ (rest * rest)))
    top_back = float(shares[:top].sum()) - patterns @ shares[:top]
    if spread > _NORMAL_SPREAD * (rest_total - mean):
        return float(chance @ _mean_inverse(top_back, rest, rest_dropout))
    rest_back = rest_total - np.minimum(np.maximum(mean + spread * _NODES, 0.0), rest_total)
    back = top_back[:, None] + rest_back[None, :]
    # the least share back is the least of each (rounding keeps the order): where it is above 0, so is every one
    if float(top_back.min()) + float(rest_back.min()) > 1e-12:
        value = np.divide(1.0, back, out=back)
    else:
        value = np.where(back > 1e-12, 1.0 / np.maximum(back, 1e-12), 1.0)
    return float(chance @ (value @ _WEIGHTS))


def _largest_first(sizes: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """The order of ``shares`` (``sizes`` over their sum) from the largest, ties in worker order: for whole sizes that
    span less than 2**16, the stable sort of 16-bit keys that is a radix sort (a seventh of the float sort's time at
    1,024 workers; a share's order is its size's)."""
    if sizes.dtype.kind in "iu" and sizes.size and (most := int(sizes.max())) - int(sizes.min()) < 2**16:
        return np.argsort((most - sizes).astype(np.uint16), kind="stable")
    return np.argsort(-shares, kind="stable")


def _mean_inverse(top_back: np.ndarray, rest: np.ndarray, rest_dropout: np.ndarray) -> np.ndarray:
    """E[1 / (c + X)] for each ``c`` in ``top_back``, X the share back of the workers of shares ``rest`` (each absent
    with chance ``rest_dropout``), 1 where nothing comes back: the integral over t > 0 of exp(-t c) E[exp(-t X)], where
    E[exp(-t X)] is a product over the workers, exact but for the quadrature (for c = 0, E[1 / X; X > 0] is the
    integral of E[exp(-t X)] less the chance that X = 0)."""
    there = rest > 0
    rest, rest_dropout = rest[there], rest_dropout[there]
    t = np.exp(np.arange(np.log(_T_LOW), np.log(40.0 / rest.min()) + _STEP, _STEP))
    with np.errstate(divide="ignore"):  # a worker sure to come back, at a t where its term underflows: log 0
        laplace = np.exp(np.log(rest_dropout[:, None] + (1.0 - rest_dropout[:, None]) * np.exp(-np.outer(rest, t)))
                         .sum(axis=0))
    none_back = float(np.prod(rest_dropout))
    some = top_back > 1e-12
    value = np.empty_like(top_back)
    value[some] = _STEP * (np.exp(-np.outer(top_back[some], t)) @ (laplace * t))
    value[~some] = _STEP * float((laplace - none_back) @ t) + none_back
    return value


def expected_cost(model: TimeModel, sizes: np.ndarray, dropout: np.ndarray | None, *,
                  waits_for_all: bool = False) -> float:
    """What a split costs a round: E[its finish times B / the samples back] (:func:`expected_shortfall`); the predicted
    finish alone where ``dropout`` is None, nobody weighed as dropping out. The finish is that of the workers that come
    back, as the simulator charges it, where a drop is known at once (a round nobody comes back from is charged the
    finish of all): a split whose slowest workers drop out finishes sooner, which is what an even split saves where
    most clients drop out (costed at the finish of all asked, an even split of 16 clients with 90% dropout had been
    costed 2.7-4.4x what it takes, and LB-BSP was 20% behind BSP there; now 5%). ``waits_for_all``: the round waits
    for every worker asked (a Flower server waits out its timeout for a client that sends no reply), so the finish is
    that of all of them."""
    return RoundCosts(model, dropout, waits_for_all=waits_for_all)(sizes)


class RoundCosts:
    """:func:`expected_cost` of splits under one time model and one ``dropout`` (None: nobody weighed as dropping
    out), each split and its shortfall computed once: a decision costs the split it chooses in
    :func:`dropout_bounds`, and asks that cost again where it weighs the split against the one in force (one cost is
    0.1-0.2 ms at 1,024 clients). Splits are told apart by their sizes as whole numbers."""

    def __init__(self, model: TimeModel, dropout: np.ndarray | None, *, waits_for_all: bool = False) -> None:
        self.model = model
        self.dropout = None if dropout is None else np.asarray(dropout, dtype=float)
        self.waits_for_all = waits_for_all
        self._shortfalls: dict[bytes, float] = {}
        self._costs: dict[bytes, float] = {}

    def shortfall(self, sizes: np.ndarray) -> float:
        """:func:`expected_shortfall` of ``sizes`` under this dropout (1 where it is None)."""
        key = np.asarray(sizes, dtype=np.int64).tobytes()
        if key not in self._shortfalls:
            self._shortfalls[key] = 1.0 if self.dropout is None else expected_shortfall(sizes, self.dropout)
        return self._shortfalls[key]

    def __call__(self, sizes: np.ndarray) -> float:
        """:func:`expected_cost` of ``sizes``."""
        whole = np.asarray(sizes, dtype=np.int64)
        key = whole.tobytes()
        if key not in self._costs:
            times = np.asarray(self.model.time(whole), dtype=float)
            if self.dropout is None:
                self._costs[key] = float(times.max())
            elif self.waits_for_all:
                self._costs[key] = float(times.max()) * self.shortfall(sizes)
            else:
                self._costs[key] = (float(times.max()) * self.shortfall(sizes)
                                    - _early_finish(times, np.asarray(sizes), self.dropout))
        return self._costs[key]


def _early_finish(times: np.ndarray, sizes: np.ndarray, dropout: np.ndarray) -> float:
    """What rounds whose slowest workers drop out save on the finish of all (the finish of each level below the
    slowest is charged from the first worker back): the sum over levels of (the level above's finish - its own) times
    E[B / the samples back; every worker above the level absent, someone back]. A worker's absence is weighed at the
    least dropout of the workers asked that may drop out (0 for one that may not): the weighing that makes a share's
    loss likelier (see :func:`weighed_dropout`) would make a slow worker's absence likelier too, and an even split had
    been chosen at 64 clients with 90% dropout for the slow clients that their few rounds had made look surest to stay
    away (about 16% dearer a round than the split it replaced). Finishes within ``_LEVEL`` of the slowest share a
    level, charged its top; levels past ``_MAX_LEVELS`` or whose workers above are all absent with a chance under
    ``_TAIL`` times the share the others hold are charged the last level's: each only ever counts a round dearer than
    it is (for an even split at 99% dropout, where more than _MAX_LEVELS levels count, by 7-9% at 64 clients and
    38-69% at 128-256: a search there prefers a balanced split more than it should). 0 where no chance is a number."""
    asked = np.flatnonzero(sizes > 0)
    everyone = asked.size == sizes.size  # (then the arrays are taken as they are: no copies indexed by ``asked``)
    asked_dropout = dropout if everyone else dropout[asked]
    may_miss = asked_dropout[asked_dropout > 0]  # (a NaN is not > 0)
    least = float(may_miss.min()) if may_miss.size else 0.0
    if not 0.0 < least <= 1.0 or np.isnan(asked_dropout).any():
        return 0.0
    asked_times = times if everyone else times[asked]
    slowest_time = float(asked_times.max())
    if np.isfinite(slowest_time) and slowest_time - float(asked_times.min()) <= _LEVEL * slowest_time:
        return 0.0  # one level, every worker asked finishing with the slowest (a balanced split): nothing is saved
    # only the slowest few can all be absent with a chance of at least _TAIL: those are sorted, not all
    few = asked.size if least == 1.0 else min(asked.size, int(np.ceil(np.log(_TAIL) / np.log(least))) + 2)
    slowest = asked[np.argpartition(-asked_times, few - 1)[:few]] if few < asked.size else asked
    order = slowest[np.argsort(-times[slowest], kind="stable")]
    top = float(times[order[0]])
    if not np.isfinite(top) or top <= 0.0:
        return 0.0
    forced = np.array(dropout, dtype=float)
    total, left = max(float((sizes if everyone else sizes[asked]).sum()), 1.0), 1.0
    saved, level, absent, levels = 0.0, top, 1.0, 0
    for above, worker in zip(order[:-1], order[1:]):
        absent *= least if dropout[above] > 0 else 0.0
        left -= float(sizes[above]) / total
        forced[above] = 1.0
        # the chance weighed by what the shortfall grows to as the workers above are taken away (about 1 / the share
        # left): a fast worker given 1 sample under three slow ones of 1,000 each had gone uncounted, 33% over
        if absent < _TAIL * max(left, 1.0 / total) or levels == _MAX_LEVELS:
            break
        if level - float(times[worker]) <= _LEVEL * top:
            continue
        none_back = float(np.prod(forced[asked]))  # (the round nobody comes back from is charged the slowest's)
        saved += (level - float(times[worker])) * absent * max(expected_shortfall(sizes, forced) - none_back, 0.0)
        level, levels = float(times[worker]), levels + 1
    return saved


def dropout_bounds(model: TimeModel, global_batch: int, lower: np.ndarray, upper: np.ndarray, dropout: np.ndarray,
                   split: Callable[[np.ndarray], np.ndarray] | None = None, *, waits_for_all: bool = False,
                   costs: RoundCosts | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The upper bounds to split within, and the split chosen within them: ``upper`` and the split that ignores
    dropouts, unless another's :func:`expected_cost` (``waits_for_all`` passed on) beats it by more than ``MIN_SAVING``:
    ``upper`` capped at one size for every worker, and the split made within it (the cap spreads the largest shares
    over more workers, at the price of a later finish), the caps tried being ``CAP_STEPS`` of the largest size that
    split gives; or the best of those mixed with the even split over the workers it asks (``EVEN_MIX``), with its
    largest size as the bounds' cap (such a split is no split made within bounds). The best is kept. ``split``: the
    split a policy makes within given upper bounds (default: :func:`~lbbsp.allocation.allocate`'s; a policy that
    lets workers sit out makes another). ``costs``: the splits' costs, kept for a caller that asks them again (those
    of ``model``, ``dropout`` and ``waits_for_all``)."""
    if costs is None:
        costs = RoundCosts(model, dropout, waits_for_all=waits_for_all)
    elif (costs.model is not model or costs.waits_for_all != waits_for_all or costs.dropout is None
          or not (costs.dropout is dropout or np.array_equal(costs.dropout, dropout, equal_nan=True))):
        raise ConfigError("dropout_bounds: costs must be a RoundCosts of the same model, dropout and waits_for_all")
    if split is None:
        split = lambda bounds: allocate(model, global_batch, lower, bounds)  # noqa: E731
    balanced = split(upper)
    shortfall = costs.shortfall(balanced)
    # no split's slowest finishes sooner than the balanced one's, nor has a shortfall under _least_shortfall's: where
    # even that saves under MIN_SAVING, the search is skipped (a split that only its slowest workers' absences would
    # make cheaper is then not looked for)
    if not np.isfinite(shortfall) or shortfall < (1.0 + MIN_SAVING) * _least_shortfall(balanced, dropout):
        return upper, balanced
    best = (upper, balanced, costs(balanced) * (1 - MIN_SAVING))
    worse = 0
    for step in CAP_STEPS:
        capped = np.maximum(np.minimum(upper, int(balanced.max() * step)), lower)
        if capped.sum() < global_batch:
            break
        try:
            sizes = split(capped)
        except AllocationError:  # a caller's split that refuses the cap
            break
        cost = costs(sizes)
        if cost < best[2]:
            best, worse = (capped, sizes, cost), 0
        elif (worse := worse + 1) == 2:
            break
    capped_best = best[1]
    asked = capped_best > 0
    even = np.zeros(capped_best.size)
    even[asked] = global_batch / asked.sum()
    for mix in EVEN_MIX:
        sizes = _whole((1.0 - mix) * capped_best + mix * even, global_batch)
        if ((sizes < lower) & asked).any() or (sizes > upper).any():  # (a worker sitting out stays out, at 0)
            break  # further toward the even split stays out of the bounds
        cost = costs(sizes)
        if cost >= best[2]:
            break  # the cost along the way is near convex: one step that does worse ends it
        best = (np.minimum(upper, sizes.max()), sizes, cost)
    return best[0], best[1]


def _whole(shares: np.ndarray, total: int) -> np.ndarray:
    """``shares`` (summing to ``total``) as whole numbers summing to it: rounded down, the largest remainders up."""
    sizes = np.floor(shares + 1e-9).astype(np.int64)
    short = total - int(sizes.sum())
    if short > 0:
        sizes[np.argsort(-(shares - sizes), kind="stable")[:short]] += 1
    return sizes


def _least_shortfall(sizes: np.ndarray, dropout: np.ndarray) -> float:
    """A floor under :func:`expected_shortfall` for every split that asks at least the workers ``sizes`` asks: with
    P0 the chance that none of them comes back (a round counted 1) and the samples back at most the most reliable
    worker's share, Jensen's inequality gives P0 + (1 - P0)^2 / (1 - its dropout), which falls as P0 grows up to
    1 - (1 - its dropout) / 2 (asking more workers only lowers P0); past that, the least it takes. Jensen's bound alone,
    1 / (1 - the least dropout), had stood above the shortfall where most drop out (10 where 8 at 16 clients with 90%
    dropout), and the search was skipped where capping paid most."""
    best_back = 1.0 - float(dropout.min())
    none_back = float(np.prod(dropout[np.asarray(sizes) > 0]))
    if none_back >= 1.0 - best_back / 2:  # also where every worker is sure to drop out: then every split counts 1
        return 1.0 - best_back / 4
    return none_back + (1.0 - none_back) ** 2 / best_back
