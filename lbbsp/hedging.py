"""Risk-aware allocation: plan each worker's time with a margin learned from how forecasts like its own missed.

LB-BSP balances for equal *predicted* finish, so an iteration lasts as long as the worst forecast miss among
N workers, and with many workers some miss is always large. Misses are not symmetric: a worker forecast
faster than its peers can mostly only turn slower, a slow one mostly faster. :class:`ForecastRisk` learns
the slowdowns that followed slow, middle and fast forecasts; :func:`hedged` scales a time model by the
resulting factors, so the allocation plans for a common deadline that about ``hedge`` workers are expected
to overrun instead of about half of them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .allocation import HingeTime, LinearTime, TimeModel
from .config import _integer, _real
from .errors import ConfigError
from .models.auto import KINDS, GroupedTime, grouped, model_moved, worker_kind
from .models.base import Hardware, feature, field, hardware_of
from .protocol import Report

#: How many iterations after its own a forecast's split may still be in force, and is scored against their reports:
#: a coordinator running ahead writes one split for up to lag + max_ahead - 1 of them (see Coordinator.ahead).
_REACH = 32
#: A worker whose forecasts have missed, one way, by over MISLED_BY x on average (an EWMA with alpha MISLED_ALPHA of
#: the log slowdowns) after at least MISLED_AFTER of them scored is reported by :meth:`ForecastRisk.misled`: the
#: built-in models' worst such average in the simulator's scenarios is 1.35x (0.63x the other way).
MISLED_BY, MISLED_AFTER, MISLED_ALPHA = 3.0, 20, 0.1


@dataclass(frozen=True)
class HedgedTime:
    """``inner``'s time scaled per worker: time(x) = inner.time(x) * factor; the allocator searches its capacity."""

    inner: TimeModel
    factor: np.ndarray

    def time(self, sizes: np.ndarray) -> np.ndarray:
        """``inner``'s seconds for ``sizes``, each worker's times its factor."""
        return np.asarray(self.inner.time(sizes), dtype=float) * self.factor


@dataclass(frozen=True)
class InvertibleHedgedTime(HedgedTime):
    """:class:`HedgedTime` of a model whose ``capacity`` takes one deadline per worker (an array)."""

    inner: LinearTime | HingeTime

    def capacity(self, deadline: float) -> np.ndarray:
        """``inner``'s capacity with each worker's deadline divided by its factor (closed form, no search)."""
        return self.inner.capacity(deadline / self.factor)


def hedged(model: TimeModel, factor: np.ndarray) -> TimeModel:
    """``model`` with each worker's time multiplied by ``factor`` (one positive number per worker).

    Linear and hinge models invert an array of deadlines, so they keep a closed-form capacity; a mixed job
    is hedged group by group while every group keeps one; any other model is left to the allocator's search.
    """
    factor = np.asarray(factor, dtype=float)
    if isinstance(model, GroupedTime):  # a group of a model of the user's own: the allocator searches
        return grouped(tuple((positions, hedged(inner, factor[positions])) for positions, inner in model.groups),
                       model.size)
    if isinstance(model, (LinearTime, HingeTime)):
        return InvertibleHedgedTime(model, factor)
    return HedgedTime(model, factor)


def sized_throughput(model: TimeModel, sizes: np.ndarray, seconds: np.ndarray | None = None) -> np.ndarray:
    """The throughput ``model`` predicts for each worker at its size in ``sizes``, where that depends on the size
    (a hinge curve: a GPU under its knee takes as long for fewer samples); NaN elsewhere, where the forecast
    throughput is the same at every size (a linear model's speed, a federated client's compute without its
    transfers) and a worker given nothing. ``seconds``: ``model.time(sizes)``, where the caller has it already (a
    decision does), so the curves are not evaluated twice."""
    sizes = np.asarray(sizes, dtype=float)
    out = np.full(sizes.size, np.nan)
    if isinstance(model, GroupedTime):
        for positions, inner in model.groups:
            out[positions] = sized_throughput(inner, sizes[positions], None if seconds is None else seconds[positions])
    elif isinstance(model, HingeTime):
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.where(sizes > 0, sizes / (model.time(sizes) if seconds is None else seconds), np.nan)
    return out


def _per_worker(workers: Sequence[int] | np.ndarray, throughput: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, throughputs) as flat arrays of one length, or a ConfigError that gives both lengths."""
    ids = np.asarray(workers, dtype=np.int64).reshape(-1)
    forecast = np.asarray(throughput, dtype=float).reshape(-1)
    if ids.size != forecast.size:
        raise ConfigError(f"a forecast must give one throughput per worker: {ids.size} workers, "
                          f"{forecast.size} throughputs")
    return ids, forecast


class _Peers(NamedTuple):
    """What :meth:`ForecastRisk._bucket` reads of a list of workers' hardware groups, kept while no worker's group or
    group's kind changes (a decision asks for the same workers each time)."""

    inside: np.ndarray | None  # which ids have an entry in the per-worker arrays; None: all of them
    group: np.ndarray  # each worker's hardware group, -1 where unknown
    seen: np.ndarray  # group >= 0
    offset: np.ndarray  # each worker's kind's first bucket: 2 x buckets x its kind's index in KINDS
    ranking: list[tuple[np.ndarray | None, np.ndarray]] | tuple[np.ndarray, np.ndarray, np.ndarray]  # _ranking's


def _ranking(group: np.ndarray, known: np.ndarray, buckets: int
             ) -> list[tuple[np.ndarray | None, np.ndarray]] | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """How to rank the forecasts of the ``known`` positions among their ``group``'s: for a few groups, each one's
    positions (None: every position) with the rank bucket of each place in its forecasts' order (:func:`_ranked`
    sorts them); for many, one sort by group, then forecast: the known positions, their groups and the rank bucket
    of each place in that order (the groups' order does not depend on the forecasts)."""
    positions = np.flatnonzero(known)
    of_known = group[positions]
    peers = np.unique(of_known)
    if peers.size <= 16:  # a few hardware groups: a sort each (where forecasts tie, the order the stored results had)
        if peers.size == 1:
            return [(None if positions.size == group.size else positions, _rank_buckets(positions.size, buckets))]
        members = [positions[of_known == g] for g in peers.tolist()]
        return [(at, _rank_buckets(at.size, buckets)) for at in members]
    # many (clients that each name their device): one sort by group, then forecast; a loop had taken 9 ms at 1,024
    # workers of 1,024 hardware keys
    ordered = np.sort(of_known)
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    counts = np.diff(np.r_[starts, ordered.size])
    rank = (np.arange(ordered.size) - np.repeat(starts, counts) + 0.5) / np.repeat(counts, counts)
    return positions, of_known, np.minimum((rank * buckets).astype(np.int64), buckets - 1)


def _rank_buckets(count: int, buckets: int) -> np.ndarray:
    """The rank bucket of each place, slowest first, among ``count`` forecasts: its rank (place + 0.5) / count in
    ``buckets`` equal parts."""
    rank = (np.arange(count) + 0.5) / count
    return np.minimum((rank * buckets).astype(np.int64), buckets - 1)


def _ranked(into: np.ndarray, ranking: list[tuple[np.ndarray | None, np.ndarray]] | tuple[np.ndarray, np.ndarray,
            np.ndarray], forecast: np.ndarray) -> None:
    """Write each ranked position's rank bucket by its ``forecast`` (:func:`_ranking`) ``into`` the array of buckets."""
    if isinstance(ranking, list):
        for positions, buckets in ranking:
            if positions is None:
                into[np.argsort(forecast)] = buckets
            else:
                into[positions[np.argsort(forecast[positions])]] = buckets
    else:
        positions, group, buckets = ranking
        into[positions[np.lexsort((forecast[positions], group))]] = buckets


class ForecastRisk:
    """Per-worker time factors: the (1 - hedge/N) quantile of past slowdowns of similar forecasts.

    At decision time :meth:`record` notes each worker's forecast throughput for the target iteration and
    its rank among the forecasts of its peers, the workers on the same hardware (device and cores, as the
    capacity models' cold-start prior groups them), split into ``buckets``: slow .. fast. Among identical
    machines, one forecast much faster than its peers is most likely free of co-located load and can mostly
    only turn slower. Workers that report the ``colocated_load`` feature are also told apart by it: under
    ``loaded_at`` (other processes' busy cores per core) a machine is free and its job can only slow down; at or
    above, it can also speed up; so ranks and load give 2 x ``buckets`` buckets, for each kind of worker (CPU,
    GPU, federated client, as :func:`~lbbsp.models.worker_kind` reads the first report of its hardware group that
    measured something or names an accelerator or transfers; a worker whose model moved joins the group of its
    hardware then) apart: GPUs, whose forecasts miss by about 0.5%,
    pooled with shared CPUs, which miss by tens of percent, had been planned with the CPUs' margins (a mixed job
    of 1,024 workers at 1.59x the oracle's time, 1.16x with the kinds apart). When the target's reports
    arrive (or those of a later iteration that used its split), :meth:`observe` pools each worker's slowdown,
    forecast / measured throughput (= measured seconds / the seconds the forecast implied for the samples
    done), into the ring buffer of its bucket (``pool_size`` log-slowdowns). Throughput, not the time model's seconds, is compared because it is what every capacity
    model predicts in the units reports carry (a federated client's ``compute_s`` excludes the transfers its
    time model includes). Buckets are only a grouping: each learns its own slowdowns, so a grouping that says
    nothing costs little. A bucket with fewer than ``min_samples`` slowdowns gives factor 1, so a cold start is
    plain LB-BSP.
    """

    def __init__(self, hedge: float = 2.0, *, buckets: int = 3, loaded_at: float = 0.1, pool_size: int = 4096,
                 min_samples: int = 50, keep: int = 16) -> None:
        self.hedge = _real(hedge, "hedge", 0.0, 1e6, "a positive number of workers", lo_open=True)
        self.loaded_at = _real(loaded_at, "loaded_at", 0.0, 1e6, "a number >= 0 (other processes' busy cores per core)")
        self.buckets = _integer(buckets, "buckets", 1, None)
        self.pool_size = _integer(pool_size, "pool_size", 2, None)
        self.min_samples = _integer(min_samples, "min_samples", 1, None)
        self.keep = _integer(keep, "keep", 1, None)
        self.peer_group_ = np.zeros(0, dtype=np.int64)  # per worker id: hardware group, -1 until it reports
        self.group_kind_ = np.zeros(0, dtype=np.int64)  # per hardware group: index in KINDS, -1 until one measures
        self.groups_: dict[Hardware, int] = {}
        self.pinned_: Mapping[int, str] = {}  # workers' pinned kinds, as the last observe was given them
        self.loaded_ = np.zeros(0, dtype=bool)  # per worker id: its last report had co-located load
        # per bucket: rank, + buckets if loaded, + 2 x buckets x the kind's index in KINDS
        self.pool_ = np.zeros((2 * buckets * len(KINDS), pool_size))
        self.pooled_ = np.zeros(2 * buckets * len(KINDS), dtype=np.int64)  # per bucket: slowdowns ever written
        self.forecasts_: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # iteration -> ids, tput, bucket
        self._quantiles: tuple[float, np.ndarray] | None = None  # (eps, per-bucket factor), until observe
        self._typical: float | None = None  # typical_miss, until observe
        self._pending: tuple[Sequence[Report], np.ndarray] | None = None  # reports observed, not yet pooled
        self._peers: tuple[bytes, _Peers] | None = None  # (worker ids as bytes, their _Peers) until a group changes
        self.bias_ = np.zeros(0)  # per worker id: EWMA of its forecasts' log slowdowns (misled)
        self.scored_ = np.zeros(0, dtype=np.int64)  # per worker id: how many of its forecasts were scored

    def record(self, iteration: int, workers: Sequence[int] | np.ndarray, throughput: np.ndarray) -> None:
        """Remember the forecast throughput of ``workers`` for ``iteration`` and the bucket each sits in."""
        ids, forecast = _per_worker(workers, throughput)
        self.forecasts_[iteration] = (ids, forecast, self._bucket(ids, forecast))
        while len(self.forecasts_) > self.keep:  # the oldest other than this one (a decision may be re-made late)
            del self.forecasts_[min(k for k in self.forecasts_ if k != iteration)]

    def expect(self, iteration: int, workers: Sequence[int] | np.ndarray, throughput: np.ndarray) -> None:
        """Score the forecasts recorded for ``iteration``, where ``throughput`` is finite, against it instead: what
        the forecast implies at the size each worker was then given (:func:`sized_throughput`). A GPU's forecast at
        its latest size, 64 samples, scored against a step of 1 sample under its knee, had read as a slowdown of
        17x, whose margin gave it 1 sample again (a mixed job ran at 2.9x the oracle's time)."""
        recorded = self.forecasts_.get(iteration)
        if recorded is None:
            return
        ids, predicted, bucket = recorded
        workers, throughput = _per_worker(workers, throughput)
        if workers.size == ids.size and (workers == ids).all() and (ids[1:] > ids[:-1]).all():
            given = throughput  # the usual case: the workers recorded, each once, in the same order
        else:
            position = np.full(int(max(workers.max(initial=-1), ids.max(initial=-1))) + 1, -1, dtype=np.int64)
            position[workers] = np.arange(workers.size)
            at = position[ids]
            given = np.where(at >= 0, throughput[np.maximum(at, 0)], np.nan)
        self.forecasts_[iteration] = (ids, np.where(np.isfinite(given), given, predicted), bucket)

    def observe(self, reports: Sequence[Report], *, defer: bool = False, pinned: Mapping[int, str] | None = None) -> None:
        """Learn each new worker's hardware and each worker's co-located load, and pool the slowdowns of the
        reports against their iteration's recorded forecast; ``defer``: pool in :meth:`finish_learning`
        (the next :meth:`record` needs only the load). Reports that measured nothing are not pooled. ``pinned``:
        workers' kinds as an :class:`~lbbsp.models.AutoCapacityModel`'s ``kinds`` pin them, so that such a worker is
        planned with the margins of the kind its model is, not of the kind its reports show."""
        self.finish_learning()
        if not reports:
            return
        self.pinned_ = pinned or {}
        ids = field(reports, "worker")
        self._remember_hardware(reports, ids)
        self.loaded_[ids] = feature(reports, "colocated_load", 0.0) >= self.loaded_at
        self._pending = (reports, ids)
        if not defer:
            self.finish_learning()

    def finish_learning(self) -> None:
        """Pool the slowdowns of the reports that :meth:`observe` deferred, and take the pools' quantiles and
        typical miss for the next decision now (after the split is written), not during it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        self._regroup_moved(*pending)
        self._pool_pending(*pending)
        if self.forecasts_:
            self._bucket_factors(self._eps(self.forecasts_[max(self.forecasts_)][0].size))
        self.typical_miss()

    def _pool_pending(self, reports: Sequence[Report], ids: np.ndarray) -> None:
        """Pool the slowdowns of ``reports`` (of workers ``ids``) against their iterations' recorded forecasts."""
        iterations, samples, seconds = field(reports, "iteration"), field(reports, "samples"), field(reports, "compute_s")
        measured = (samples > 0) & (seconds > 0)
        ids, iterations, speed = ids[measured], iterations[measured], samples[measured] / seconds[measured]
        if iterations.size and iterations[0] == iterations[-1] and (iterations == iterations[0]).all():
            if (forecast := self._in_force(int(iterations[0]))) is not None:  # the usual case: one iteration's
                self._pool(forecast, ids, speed)
            return
        for iteration in np.unique(iterations).tolist():
            if (forecast := self._in_force(iteration)) is not None:
                at = iterations == iteration
                self._pool(forecast, ids[at], speed[at])

    def _in_force(self, iteration: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The forecast the split of ``iteration`` was planned with: its own, or the newest recorded before it (a
        coordinator running ahead writes one decision's split for several iterations, and a fallback keeps the
        previous split, up to ``_REACH`` iterations after its own); None if there is none."""
        if iteration in self.forecasts_:
            return self.forecasts_[iteration]
        earlier = [k for k in self.forecasts_ if iteration - _REACH <= k < iteration]
        return self.forecasts_[max(earlier)] if earlier else None

    def factors(self, iteration: int) -> np.ndarray:
        """Time factor of each worker recorded for ``iteration``, in the order given to :meth:`record`: the
        (1 - eps) quantile of its bucket's slowdowns, eps = hedge / number of workers."""
        ids, _, bucket = self.forecasts_[iteration]
        return self._bucket_factors(self._eps(ids.size))[bucket]

    def _eps(self, workers: int) -> float:
        """The share of ``workers`` expected to overrun the planned deadline: hedge / workers, within bounds."""
        return min(max(self.hedge / max(workers, 1), 1.0 / self.pool_size), 0.5)

    def _bucket_factors(self, eps: float) -> np.ndarray:
        """Each bucket's (1 - eps) quantile of its slowdowns (1 below ``min_samples``), cached until the pools change."""
        if self._quantiles is None or self._quantiles[0] != eps:
            per_bucket = np.ones(self.pooled_.size)
            for b in np.flatnonzero(self.pooled_ >= self.min_samples):
                pooled = self.pool_[b, :min(int(self.pooled_[b]), self.pool_size)]
                # the "higher" quantile, no interpolation; the slack keeps (1 - 3/9) * 396 = 264.00000000000006 at 264
                k = int(np.ceil((1.0 - eps) * (pooled.size - 1) - 1e-9))
                per_bucket[b] = float(np.exp(np.partition(pooled, k)[k]))
            self._quantiles = (eps, per_bucket)
        return self._quantiles[1]

    def typical_miss(self) -> float | None:
        """The median size of the forecasts' misses, |log(forecast / measured)|, over every bucket with at least
        ``min_samples`` of them (every (n // 256)-th of a bucket's n, so at most 511 each and tens of
        microseconds in all); None before any bucket has that many."""
        if self._typical is None:
            full = np.flatnonzero(self.pooled_ >= self.min_samples)
            if full.size == 0:
                return None
            held = [min(int(self.pooled_[b]), self.pool_size) for b in full.tolist()]
            pooled = [self.pool_[b, :n:max(1, n // 256)] for b, n in zip(full.tolist(), held)]
            self._typical = float(np.median(np.abs(np.concatenate(pooled))))
        return self._typical

    def _bucket(self, ids: np.ndarray, forecast: np.ndarray) -> np.ndarray:
        """Bucket of each forecast by its rank among its hardware peers' forecasts (the middle one for a worker
        whose hardware or forecast is unknown), plus ``buckets`` for a worker under co-located load."""
        peers = self._peers_of(ids)
        if peers.inside is None:
            loaded = self.loaded_[ids]
        else:
            loaded = np.zeros(ids.size, dtype=bool)
            loaded[peers.inside] = self.loaded_[ids[peers.inside]]
        rank = np.full(ids.size, self.buckets // 2, dtype=np.int64)
        finite = np.isfinite(forecast)
        _ranked(rank, peers.ranking if finite.all() else _ranking(peers.group, peers.seen & finite, self.buckets),
                forecast)
        return rank + np.where(loaded, peers.offset + self.buckets, peers.offset)

    def _peers_of(self, ids: np.ndarray) -> _Peers:
        """The hardware groups and kinds of workers ``ids`` as :meth:`_bucket` reads them, cached until a worker's
        group or a group's kind changes. A group whose workers only announced themselves, bare, counts as CPUs; a
        worker never seen, as the workers' most common kind (in a job of one kind, its kind: it then shares its
        peers' pools, as before kinds)."""
        key = ids.tobytes()
        if self._peers is not None and self._peers[0] == key:
            return self._peers[1]
        group = np.full(ids.size, -1, dtype=np.int64)
        inside = (ids >= 0) & (ids < self.peer_group_.size)
        group[inside] = self.peer_group_[ids[inside]]
        seen = group >= 0
        kind = np.zeros(ids.size, dtype=np.int64)
        kind[seen] = np.maximum(self.group_kind_[group[seen]], 0)
        if seen.any() and not seen.all():
            kind[~seen] = np.bincount(kind[seen]).argmax()
        peers = _Peers(None if inside.all() else inside, group, seen, 2 * self.buckets * kind,
                       _ranking(group, seen, self.buckets))
        self._peers = (key, peers)
        return peers

    def _pool(self, forecast: tuple[np.ndarray, np.ndarray, np.ndarray], ids: np.ndarray, speed: np.ndarray) -> None:
        recorded, predicted, bucket = forecast
        if recorded.size == 0:
            return
        position = np.full(int(max(ids.max(), recorded.max())) + 1, -1, dtype=np.int64)
        position[recorded] = np.arange(recorded.size)
        at = position[ids]
        ok = at >= 0
        at, speed = at[ok], speed[ok]
        with np.errstate(divide="ignore", invalid="ignore"):
            log_slowdown = np.log(predicted[at] / speed)
        finite = np.isfinite(log_slowdown)
        log_slowdown, of_bucket = log_slowdown[finite], bucket[at[finite]]
        self._track_bias(recorded[at[finite]], log_slowdown)
        for b in range(self.pooled_.size):
            values = log_slowdown[of_bucket == b][-self.pool_size:]
            slots = (self.pooled_[b] + np.arange(values.size)) % self.pool_size
            self.pool_[b, slots] = values
            self.pooled_[b] += values.size
        self._quantiles = self._typical = None

    def _track_bias(self, workers: np.ndarray, log_slowdown: np.ndarray) -> None:
        """Blend each of ``workers``' log slowdown (one each) into its average miss, for :meth:`misled`."""
        size = int(workers.max()) + 1 if workers.size else 0
        if size > self.bias_.size:
            self.bias_ = np.concatenate([self.bias_, np.zeros(size - self.bias_.size)])
            self.scored_ = np.concatenate([self.scored_, np.zeros(size - self.scored_.size, dtype=np.int64)])
        before = self.bias_[workers]
        self.bias_[workers] = np.where(self.scored_[workers] == 0, log_slowdown,
                                       before + MISLED_ALPHA * (log_slowdown - before))
        self.scored_[workers] += 1

    def misled(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, factors): the workers whose forecasts keep missing one way by over ``MISLED_BY`` x, and each one's
        average forecast / measured throughput. Models that learn from the reports miss by tens of percent; a miss
        that large that stays says the model (one of the user's own?) or the reports are wrong, and the margins that
        cover it are shared with the worker's bucket, whose split it can then hold still."""
        ids = np.flatnonzero((self.scored_ >= MISLED_AFTER) & (np.abs(self.bias_) > np.log(MISLED_BY)))
        return ids, np.exp(self.bias_[ids])

    def _remember_hardware(self, reports: Sequence[Report], ids: np.ndarray) -> None:
        """Give each worker seen for the first time (``ids``: the reports' workers) its hardware group id, and each
        group its kind (as :func:`~lbbsp.models.worker_kind` reads it) from the first of its reports that measured
        something or names an accelerator or transfers, as :class:`~lbbsp.models.AutoCapacityModel` routes it: a
        bare announcement says nothing of its kind, and a client that has not been asked yet shares its peers' pools."""
        size = int(ids.max()) + 1
        if size > self.peer_group_.size:
            self.loaded_ = np.concatenate([self.loaded_, np.zeros(size - self.peer_group_.size, dtype=bool)])
            self.peer_group_ = np.concatenate([self.peer_group_, np.full(size - self.peer_group_.size, -1)])
        groups = self.peer_group_[ids]
        if groups.min() < 0:  # some worker seen for the first time (usually none)
            for at in np.flatnonzero(groups < 0).tolist():
                key = hardware_of(reports[at])
                if (pin := self.pinned_.get(int(ids[at]))) is not None:  # a group of its own, of the pinned kind
                    key = (f"{key[0]} pinned {pin}", key[1])
                self.peer_group_[ids[at]] = self.groups_.setdefault(key, len(self.groups_))
            groups = self.peer_group_[ids]
            self._peers = None
        if len(self.groups_) > self.group_kind_.size:
            self.group_kind_ = np.concatenate([self.group_kind_, np.full(len(self.groups_) - self.group_kind_.size, -1)])
        if self.group_kind_.min() >= 0:  # every group's kind is known (usually)
            return
        for at in np.flatnonzero(self.group_kind_[groups] < 0).tolist():  # its first report showing it
            pin = self.pinned_.get(int(ids[at]))
            kind = pin or worker_kind(reports[at])
            if reports[at].samples > 0 or kind != "cpu" or pin:
                self.group_kind_[groups[at]] = KINDS.index(kind)
                self._peers = None

    def _regroup_moved(self, reports: Sequence[Report], ids: np.ndarray) -> None:
        """Put each worker whose model moved, as :class:`~lbbsp.models.AutoCapacityModel` reads it (a CPU worker that
        reads GPU memory, a GPU worker measuring from device "cpu" with no GPU features), in the group of its hardware
        now: a GPU rank's first report, timed on the CPU before its model's device was known (gloo, no DDP), had kept
        it among the CPUs for good, planned with their margins (a mixed job 12-14% slower). After the split is written:
        the next decision is the first to need it."""
        kinds = [KINDS[k] if k >= 0 else None for k in self.group_kind_[self.peer_group_[ids]].tolist()]
        moved = [at for at, (report, kind) in enumerate(zip(reports, kinds))
                 if model_moved(kind, report) and report.worker not in self.pinned_]
        if moved:
            self.peer_group_[ids[moved]] = -1
            self._remember_hardware(reports, ids)


__all__ = ["ForecastRisk", "HedgedTime", "InvertibleHedgedTime", "hedged", "sized_throughput"]
