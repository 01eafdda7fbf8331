"""Balancing policies: each turns the reports of iteration k into the batch-size vector of a coming iteration.

The coordinator drives a policy through small steps: ``observe`` and ``decide``, then, once the split is
written, ``learn`` (what the next decision can do without, kept off the decision's path); a variant overrides
one of them (or one of LB-BSP's hooks: ``bounds``, ``propose``). Allocation maths live in
:mod:`lbbsp.allocation`. Every policy returns a split with sum B within the job's bounds.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .allocation import (
    LinearTime,
    RoundsOut,
    TimeModel,
    allocate_sitting_out,
    damp,
    numbers_per_worker,
    sit_out_share,
)
from .config import JobConfig, _integer, _real
from .dropouts import RoundCosts, dropout_bounds, weighed_dropout
from .errors import ConfigError, printable
from .hedging import MISLED_AFTER, ForecastRisk, hedged, sized_throughput
from .models import AutoCapacityModel, CapacityModel, EWMAThroughput
from .models.auto import GroupedTime
from .models.base import WorkerIds, as_reports, check_contract, learnt_availability, predicted_throughput
from .protocol import Report, equal_split

log = logging.getLogger("lbbsp.policies")

#: The dead band narrows to this many times the forecasts' median miss where that is under ``deadband``...
BAND_PER_MISS = 3.0
#: ...but never below this.
MIN_BAND = 0.005


def _model(model: object) -> CapacityModel | None:
    """``model`` (None stays None); a :class:`ConfigError` for anything that is not a capacity model (a name
    such as "ewma" is what the command line takes, not a policy), or one of one's own that breaks its contract
    (:func:`~lbbsp.models.base.check_contract`)."""
    if model is None:
        return model
    if isinstance(model, CapacityModel):
        check_contract(model)
        model._check_params()  # EWMAThroughput(alpha=5) fails here, not at every decision of a running job
        return model
    if isinstance(model, type) and issubclass(model, CapacityModel):  # as checked_policy says of a policy's class
        raise ConfigError(f"model must be a CapacityModel instance, got the class {model.__name__}: pass "
                          f"{model.__name__}()")
    raise ConfigError(f"model must be a CapacityModel instance (lbbsp.models: EWMAThroughput(), NARXThroughput(), "
                      f"FLClientModel(), ...), got {model!r}")


def _model_or(model: object, default: Callable[[], CapacityModel]) -> CapacityModel:
    """``model`` checked as :func:`_model` checks it, or ``default()`` where it is None (only then: a model of one's
    own whose ``__len__`` is 0 before it learns had been swapped for the default without a word)."""
    checked = _model(model)
    return default() if checked is None else checked


def checked_policy(policy: object, job: str | None = None) -> Policy | None:
    """``policy`` (None, the default, stays None) if it is a :class:`Policy` instance; a ConfigError otherwise,
    before a coordinator starts: a name or a class would fail at every decision, each kept as the split before."""
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, type) and issubclass(policy, Policy):
        raise ConfigError(f"policy must be a Policy instance, got the class {policy.__name__}: pass "
                          f"{policy.__name__}()", job=job)
    raise ConfigError(f"policy must be a Policy instance (LBBSPPolicy(), BSPPolicy(), ...; a name such as 'lbbsp' "
                      f"is what `lbbsp coordinator --policy` takes), got {policy!r}", job=job)


#: LBBSPPolicy's hooks that a variant may override, as the policy calls them (positionally; docs/models.md).
#: Each with the number of arguments it is passed and its signature.
HOOKS = {"bounds": (3, "bounds(workers, current, config) -> (lower, upper)"),
         "propose": (5, "propose(time_model, config, lower, upper, forecast=None) -> sizes"),
         "dropout": (1, "dropout(workers) -> each worker's chance of missing its round, or None")}


def _check_hooks(policy: LBBSPPolicy) -> None:
    """A ConfigError naming the class and the hook where ``policy`` overrides one of :data:`HOOKS` with a method
    that cannot take the arguments the policy passes it: each decision had failed with a TypeError (logged, the
    split in force kept), and a simulated run read as a policy that never moved."""
    for hook, (count, signature) in HOOKS.items():
        if getattr(type(policy), hook) is getattr(LBBSPPolicy, hook):
            continue
        try:
            inspect.signature(getattr(policy, hook)).bind(*[None] * count)
        except TypeError:
            raise ConfigError(f"{type(policy).__name__}.{hook} must take {signature}: LBBSPPolicy calls it with "
                              f"{count} argument{'s' * (count > 1)} (docs/models.md, A policy of your own)") from None
        except ValueError:  # no signature to read (a callable written in C): trusted
            pass


@dataclass(frozen=True)
class Decision:
    """A split with the reason for it and, when a model made it, each worker's predicted seconds."""

    sizes: tuple[int, ...]
    reason: str
    predicted_s: tuple[float, ...] | None = None
    predicted_throughput: tuple[float, ...] | None = None


class Policy:
    """Base policy: learns nothing and keeps the current split."""

    name = "static"
    #: The share of workers the policy may give nothing in an iteration (they sit it out); 0 for most policies.
    sit_out: float = 0.0

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A policy of one's own that sets no ``name`` is named for its class, not "static" (its failures had been
        logged, and its splits written, as the static policy's)."""
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__ and cls.name == Policy.name:
            cls.name = cls.__name__

    def observe(self, reports: Sequence[Report]) -> None:
        """Learn from one iteration's validated reports (some workers may be missing); this one learns nothing,
        but refuses what is not a list of reports, as every policy does (a TypeError)."""
        as_reports(reports, "observe")

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        """The split for ``iteration``, the iteration the decision is for (that of the newest reports observed
        plus the job's lag); ``current`` is the split before it, kept where the policy fails (one size per worker,
        or a ConfigError: every policy checks it, as :func:`_split_of` does)."""
        return Decision(tuple(_split_of(current, config).tolist()), "static split")

    def learn(self) -> None:
        """Finish learning from the observed reports after the split is written (the next ``observe`` does it
        when nobody called this)."""

    def aggregated(self, num_workers: int) -> int:
        """How many workers' gradients an iteration waits for (all of them, in synchronous training)."""
        return num_workers


class BSPPolicy(Policy):
    """Plain bulk synchronous parallel: the equal split, always."""

    name = "bsp"

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        _split_of(current, config)  # checked, as every policy checks it, though the equal split does not read it
        return Decision(config.initial_sizes(), "equal split (BSP)")


class BackupWorkersPolicy(BSPPolicy):
    """Equal split; each iteration aggregates the first N - ``backups`` gradients and drops the rest
    (Chen et al., "Revisiting distributed synchronous SGD", 2016)."""

    name = "backup"

    def __init__(self, backups: int = 1) -> None:
        self.backups = _integer(backups, "backups", 0, None)

    def aggregated(self, num_workers: int) -> int:
        if not 0 <= self.backups < num_workers:
            raise ConfigError(f"backups must be in [0, {num_workers}), got {self.backups}: an iteration of "
                              f"{num_workers} workers must aggregate at least one gradient")
        return num_workers - self.backups

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        """The equal split, where ``backups`` leaves a gradient to aggregate; a ConfigError otherwise (only the
        simulator asks ``aggregated``, so a coordinator had run this policy with every gradient dropped, unsaid)."""
        self.aggregated(config.num_workers)
        return super().decide(iteration, current, config)


class LBBSPPolicy(Policy):
    """LB-BSP: predict each worker's speed, allocate for equal predicted finish, damp small changes.

    Bounds are the job's, tightened by the model's memory caps; a model that is still learning a curve
    may nudge the result (``CapacityModel.explore``). ``hedge``: how many workers the split may expect to
    overrun the common finish; each worker's time is planned with a margin learned from how the model's
    past forecasts missed (:class:`~lbbsp.hedging.ForecastRisk`); None or 0 plans on the forecast alone.
    ``Decision.predicted_s`` stays the forecast's own seconds, without margins. ``sit_out``: the share of
    workers that may be given nothing in an iteration, where the rest then finish sooner
    (:func:`~lbbsp.allocation.allocate_sitting_out`); it pays for federated clients, whose transfers a round
    spares the clients it does not ask (the torch and Keras integrations expect every worker to get samples).
    ``rejoin_after``: no worker is given nothing more iterations in a row than this (None: no limit), whether it
    sits out or the job's ``min_batch`` is 0, so that each trains on its data now and then and its estimate
    (which only a measurement renews) catches up with a worker that got faster.
    """

    name = "lbbsp"

    def __init__(self, model: CapacityModel | None = None, *, deadband: float = 0.03,
                 hedge: float | None = 2.0, sit_out: float = 0.0, rejoin_after: int | None = 10) -> None:
        _check_hooks(self)
        self.model: CapacityModel = _model_or(model, AutoCapacityModel)
        self.deadband = _real(deadband, "deadband", 0.0, 0.99, "a share of the predicted finish in [0, 0.99]")
        self.hedge = None if hedge is None else _real(hedge, "hedge", 0.0, 1e6, "None or a number of workers >= 0")
        self.sit_out = sit_out_share(sit_out)
        self.rounds_out = RoundsOut(rejoin_after)
        self.risk = ForecastRisk(hedge) if hedge else None
        self._seen = False
        self._warned_caps = False
        self._warned_misled = np.zeros(0, dtype=bool)  # per worker id: its persistent forecast misses were warned about
        self._job_bounds: tuple[tuple[object, ...], np.ndarray, np.ndarray] | None = None  # (job's shape, bounds)
        self._caps_read: tuple[np.ndarray, np.ndarray | None] | None = None  # (upper bounds, caps) of bounds()
        self._split: tuple[tuple[int, ...], np.ndarray] | None = None  # the last split decided, and its array

    def observe(self, reports: Sequence[Report]) -> None:
        """Update what the next forecast reads; training and the margins' bookkeeping wait for ``learn`` (or,
        when nobody calls it, for the next ``observe``: the model and the margins finish pending work first)."""
        reports = as_reports(reports, "observe")
        if reports:
            self.model.partial_fit(reports, defer=True)
            if self.risk is not None:
                pinned = self.model.kinds if isinstance(self.model, AutoCapacityModel) else None
                self.risk.observe(reports, defer=True, pinned=pinned if isinstance(pinned, Mapping) else None)
            self._seen = True

    def learn(self) -> None:
        self.model.finish_learning()
        if self.risk is not None:
            self.risk.finish_learning()

    def bounds(self, workers: WorkerIds, current: np.ndarray, config: JobConfig) -> tuple[np.ndarray, np.ndarray]:
        """The job's bounds, with each upper bound lowered to the model's memory cap where that is feasible."""
        lower, upper = self._bounds_of(config)
        caps = _whole_caps(self.model, workers, upper)
        capped = _capped(lower, upper, caps, current, config.global_batch)
        capped = upper.copy() if capped is upper else capped  # the kept arrays are never handed out
        self._caps_read = (capped, caps)  # for the decision's reason: the model is not asked twice
        return lower.copy(), capped

    def dropout(self, workers: np.ndarray) -> np.ndarray | None:
        """Each worker's chance of not completing its round (:func:`~lbbsp.dropouts.weighed_dropout`), where the model
        learns availability (:func:`~lbbsp.models.base.learnt_availability`) and some worker has missed one; None: none
        to weigh."""
        available = learnt_availability(self.model, workers)
        return None if available is None else weighed_dropout(available)

    def _bounds_of(self, config: JobConfig) -> tuple[np.ndarray, np.ndarray]:
        """The job's bounds as int64 arrays, kept while the job's sizes and bounds are the same (reading a thousand
        ints into an array takes tens of microseconds a decision)."""
        shape = (type(config), config.num_workers, config.global_batch, config.min_batch, config.max_batch)
        if self._job_bounds is None or self._job_bounds[0] != shape:
            lower, upper = (np.asarray(b, dtype=np.int64) for b in config.bounds())
            self._job_bounds = (shape, lower, upper)
        return self._job_bounds[1], self._job_bounds[2]

    def _caps_for(self, workers: np.ndarray, upper: np.ndarray) -> np.ndarray | None:
        """The memory caps of ``workers`` as :func:`_whole_caps` gives them for the upper bounds ``upper`` that this
        decision's :meth:`bounds` returned: where this class's own :meth:`bounds` returned them, the caps it read
        (the same numbers: those bounds are never under the caps, which are never over the job's bounds); else,
        for a variant's bounds, asked of the model."""
        read = self._caps_read
        if type(self).bounds is LBBSPPolicy.bounds and read is not None and read[0] is upper:
            return read[1]
        return _whole_caps(self.model, workers, upper)

    def _split_array(self, current: Sequence[int], config: JobConfig) -> np.ndarray:
        """``current`` as :func:`_split_of` reads it; the array of the last split decided where it is that split
        (the usual case), which saves reading a thousand ints again."""
        if self._split is not None and isinstance(current, tuple) and current == self._split[0]:
            # the same job's split: a config whose batch changed has it checked (and refused) as any other
            if self._split[1].shape == (config.num_workers,) and int(self._split[1].sum()) == config.global_batch:
                return self._split[1].copy()
        return _split_of(current, config)

    def with_margins(self, iteration: int, time_model: TimeModel,
                     throughput: np.ndarray) -> tuple[TimeModel, np.ndarray]:
        """The model to plan with: ``time_model`` scaled by the margins learned for forecasts like
        ``throughput`` (recorded, to be scored against the reports of ``iteration``), and the margins. Margins
        that differ by less than the dead band only perturb the split by noise: then ``time_model`` itself."""
        if self.risk is None:
            return time_model, np.ones(throughput.size)
        self.risk.record(iteration, np.arange(throughput.size), throughput)
        factor = self.risk.factors(iteration)
        if factor.max() > (1 + self.deadband) * factor.min():
            return hedged(time_model, factor), factor
        return time_model, factor

    def band(self, time_model: TimeModel | None = None, current: np.ndarray | None = None) -> float:
        """The dead band in force: ``deadband``, narrowed where forecasts are precise to ``BAND_PER_MISS`` times
        their median miss (at least ``MIN_BAND``): a predicted gain several times what forecasts usually miss by
        is real, and keeping a split that far off would cost it in every iteration. Given the ``time_model``
        and the ``current`` split, it is a share of what the forecast covers of the slowest worker's time (at
        least ``MIN_BAND``): a federated client's transfers are part of its time but not of the misses. ``deadband``
        caps the band in the round's terms, after that share is taken: capped before it, a forecast missing by 5% (a
        band of 15% of the compute) made 0.5% of a round whose transfers took 85%, and LB-BSP chased the noise of
        identical clients in 144 of 149 rounds, 1.1% slower than the even split."""
        miss = self.risk.typical_miss() if self.risk is not None else None
        wide = self.deadband if miss is None else BAND_PER_MISS * miss  # a share of what the forecast covers
        share = 1.0 if time_model is None or current is None else _forecast_share(time_model, current)
        return min(self.deadband, max(MIN_BAND, wide * share))

    def propose(self, time_model: TimeModel, config: JobConfig, lower: np.ndarray, upper: np.ndarray,
                forecast: TimeModel | None = None) -> np.ndarray:
        """The split with the earliest predicted finish under ``time_model``. With ``sit_out``, the workers
        slowest at their smallest size under ``forecast`` (the forecast without margins; by default
        ``time_model``) may sit out, where that is predicted to gain more than the dead band: margins learned
        from compute misses would mis-rank transfer-bound clients. Workers out ``rejoin_after`` times in a row
        stay in."""
        stay = self.rounds_out.due(range(config.num_workers)) if self._may_idle(lower) else None
        return allocate_sitting_out(time_model, config.global_batch, lower, upper, self.sit_out, self.deadband,
                                    ranked_by=forecast, stay=stay)

    def _may_idle(self, lower: np.ndarray) -> bool:
        """Whether a worker can be given nothing: it may sit out, or the job lets a size be 0."""
        return bool(self.sit_out) or not lower.all()

    #: What ``rejoin_after`` counts, as the decision's reason says it: this policy's decisions.
    _rounds = "iteration(s)"

    def _due_back(self, current: np.ndarray, lower: np.ndarray) -> np.ndarray:
        """The workers given nothing ``rejoin_after`` decisions in a row, where a worker may be given nothing."""
        if not self._may_idle(lower):
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(self.rounds_out.due(np.arange(current.size)) & (current == 0))

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        # a split of the wrong length is refused, as PerEpochPolicy refuses it: it had been decided on ("the current
        # split does not fit the bounds")
        current_arr = self._split_array(current, config)
        if not self._seen:
            return Decision(tuple(current_arr.tolist()), "no measurements yet: keep the split")
        workers = np.arange(config.num_workers)
        time_model = self.model.time_model(workers)
        throughput = predicted_throughput(self.model, workers)
        plan, factor = self.with_margins(iteration, time_model, throughput)
        # the hooks' answers as arrays: a variant's that hands back lists had failed on a missing attribute
        lower, upper = (np.asarray(b) for b in self.bounds(workers, current_arr, config))

        def split_within(bounds: np.ndarray) -> np.ndarray:
            return numbers_per_worker(self.propose(plan, config, lower, bounds, time_model), config.num_workers,
                                      f"{type(self).__name__}.propose", "one size per worker")

        dropout, job_upper = self.dropout(workers), upper  # the job's bounds and memory caps, without dropouts
        if dropout is not None:  # a hook's list, as the bounds' (it had failed every decision on list.min)
            dropout = np.asarray(dropout, dtype=float)
        cost_of = RoundCosts(plan, dropout)  # each split's cost once, the search's included
        if dropout is None:
            proposed = split_within(upper)
        else:  # clients that may not come back: the largest shares capped where that pays
            upper, proposed = dropout_bounds(plan, config.global_batch, lower, upper, dropout, split_within,
                                             costs=cost_of)
        capped_for_dropouts = int(upper.max()) if upper is not job_upper else None
        may_idle = self._may_idle(lower)
        # the split in force fits the bounds (a worker sitting out does), unless one due back would stay out
        back = self._due_back(current_arr, lower)
        in_bounds = (current_arr.shape == proposed.shape and _within(current_arr, lower, job_upper, bool(self.sit_out))
                     and not back.size)
        band = self.band(time_model, current_arr)
        if not in_bounds:
            sizes, changed = proposed, True
        else:
            # with dropouts, the samples expected back weighed too: the cap chosen moves with noise, and had moved
            # the split in 138 of 149 rounds where the finish alone was damped
            cost = [np.inf] if dropout is None else [cost_of(s) for s in (proposed, current_arr)]
            if np.isfinite(cost).all():
                sizes, changed = (proposed, True) if cost[0] * (1 + band) < cost[1] else (current_arr, False)
            else:  # no dropouts, or a worker predicted never to finish (damp weighs what it is given)
                sizes, changed = damp(current_arr, proposed, plan, band)
        even = np.asarray(equal_split(config.global_batch, config.num_workers), dtype=np.int64)
        if (changed and not np.array_equal(sizes, even) and not (sizes >= job_upper).any()
                and _within(even, lower, job_upper, False)):
            # balancing that the forecasts cannot tell from their noise: the even split, where it is within the band
            # of the split chosen (identical federated clients had their split follow the noise of their
            # forecasts, 1.1% slower than the even split); not where a worker is held at its upper bound, whose
            # memory cap grows only as it is measured larger (back at even, a worker 4x faster than the others grew
            # to 861 samples in 120 iterations, where the best split its card holds gives it 914)
            cost = [cost_of(s) for s in (even, sizes)]
            if np.isfinite(cost).all() and cost[0] <= cost[1] * (1 + band):
                sizes, changed = even, not np.array_equal(even, current_arr)
        if not changed and ((proposed > current_arr) & (proposed >= job_upper)).any():
            # a worker held by its memory cap: the cap grows only once it is measured at a larger size, by less
            # than the dead band a step on a nearly full card, so a damped split had kept it there for good (1.7x
            # slower than the split its card holds)
            sizes, changed = proposed, True
        # a list is taken as its array, as predict's answer is; the wrong length or no numbers name the model
        damped, sizes = sizes, numbers_per_worker(self.model.explore(workers, sizes, lower, job_upper), config.num_workers,
                                                  f"{type(self.model).__name__}.explore", "one size per worker")
        explored = int(np.abs(sizes - damped).sum()) // 2  # said in the reason: a "kept" split had been changed
        predicted = time_model.time(sizes)
        if self.risk is not None:  # margins learn from misses at the sizes run, where the forecast depends on them
            self.risk.expect(iteration, workers, sized_throughput(time_model, sizes, predicted))
        if plan is time_model:
            planned = predicted
        elif type(self).with_margins is LBBSPPolicy.with_margins and _scales_per_worker(time_model):
            planned = np.asarray(predicted, dtype=float) * factor  # plan is hedged(time_model, factor): its seconds
        else:
            planned = plan.time(sizes)
        finish = _finish(planned)
        finish_label = "predicted finish" if plan is time_model else "finish with margins"
        if changed:
            was = (f"was {_finish(plan.time(current_arr))}" if in_bounds
                   else f"worker(s) {back[:8].tolist()} due back after {self.rounds_out.rejoin_after} {self._rounds} "
                        "given nothing" if back.size else "the current split does not fit the bounds")
            slowest = int(np.argmin(np.where(np.isfinite(throughput), throughput, np.inf)))
            reason = (f"rebalanced for equal {finish_label} {finish} ({was}); slowest worker {slowest} "
                      f"at {throughput[slowest]:.4g} samples/s")
        elif lower.sum() == config.global_batch or job_upper.sum() == config.global_batch:  # one split fits
            reason = f"kept: the bounds allow no other split ({finish_label} {finish})"
        else:
            reason = f"kept: predicted gain under the {band:.1%} dead band ({finish_label} {finish})"
        if plan is not time_model:
            reason += f"; slowdown margins x{factor.min():.3g} to x{factor.max():.3g}"  # x1e+300, not 300 digits
        if changed and capped_for_dropouts is not None:  # its finish is then later than an equal one's would be
            reason += f"; the largest shares capped at {capped_for_dropouts} for clients that may drop out"
        if explored:
            reason += f"; then {explored} sample(s) moved to learn the workers' batch-time curves (explore)"
        if may_idle:
            self.rounds_out.record(workers, sizes)
        if self.sit_out and not sizes.all():
            reason += f"; {int((sizes == 0).sum())} sit out"
        caps = self._caps_for(workers, job_upper)
        if caps is not None and (over := np.flatnonzero(sizes > caps)).size:  # bounds() could not keep them
            held = int(np.minimum(caps, job_upper).sum())
            why = (f"the caps hold {held} samples, the global batch is {config.global_batch}"
                   if held < config.global_batch else f"caps under the job's min_batch of {config.min_batch}")
            reason += f"; over the memory cap of worker(s) {over[:8].tolist()}: {why}"
            if not self._warned_caps:
                self._warned_caps = True
                log.warning("job %s: some workers are given more than their GPU memory is predicted to hold (%s)",
                            config.job, why)
        if self.risk is not None:
            self._warn_misled(config.job)
        split = tuple(sizes.tolist())
        self._split = (split, sizes.copy()) if sizes.dtype == np.int64 else None
        return Decision(split, reason, tuple(predicted.tolist()), tuple(throughput.tolist()))

    def _warn_misled(self, job: str) -> None:
        """Warn, once a worker, where the model's forecasts of a worker keep missing one way by several times
        (:meth:`~lbbsp.hedging.ForecastRisk.misled`): the split can then hold still, with no other sign."""
        assert self.risk is not None
        ids, factors = self.risk.misled()
        if ids.size and ids[-1] >= self._warned_misled.size:
            self._warned_misled = np.concatenate([self._warned_misled, np.zeros(ids[-1] + 1 - self._warned_misled.size,
                                                                                dtype=bool)])
        fresh = ~self._warned_misled[ids]  # (arrays: every worker of 10,000 misled had cost 1 ms a decision as a list)
        if not fresh.any():
            return
        self._warned_misled[ids[fresh]] = True
        new = list(zip(ids[fresh].tolist(), factors[fresh].tolist()))
        said = ", ".join(f"worker {w} at {f:.3g}x" for w, f in new[:8]) + (f" and {len(new) - 8} more" if len(new) > 8
                                                                             else "")
        log.warning("job %s: %s's forecasts keep missing the measured throughput (%s, forecast / measured, an average "
                    "weighted toward the latest ten iterations, after %d); a model that learns from the reports misses "
                    "by tens of percent. Is it a model of your own, or do the reports' samples and compute_s say what the "
                    "workers did? The split gives these workers the wrong share, and the margins that cover a forecast "
                    "too high hold back the workers forecast like it, and can keep the split where it is; said once a "
                    "worker", job, type(self.model).__name__, said, MISLED_AFTER)


def _scales_per_worker(model: TimeModel) -> bool:
    """Whether :func:`~lbbsp.hedging.hedged` scales ``model``'s seconds themselves, so that ``hedged(model,
    factor).time(x)`` is ``model.time(x) * factor`` to the bit: any model but a grouped one whose ``time`` is not
    its groups' own."""
    if isinstance(model, GroupedTime):
        return type(model).time is GroupedTime.time and all(_scales_per_worker(inner) for _, inner in model.groups)
    return True


def _within(sizes: np.ndarray, lower: np.ndarray, upper: np.ndarray, zero_fits: bool) -> bool:
    """Whether every size is within its bounds, or 0 where ``zero_fits`` (a worker sitting out is within them)."""
    fits = sizes >= lower
    if zero_fits:
        fits |= sizes == 0
    return bool((fits & (sizes <= upper)).all())


def _finish(seconds: np.ndarray) -> str:
    """The finish of a split whose workers take ``seconds``, for a decision's reason: the slowest worker's seconds,
    and which workers never finish (given samples at a forecast of 0 samples/s), where some do not; an infinite
    finish had read "infs"."""
    never = np.flatnonzero(~np.isfinite(seconds))
    if not never.size:
        return f"{float(np.max(seconds)):.4g}s"
    finite = np.delete(seconds, never)
    return f"{f'{float(finite.max()):.4g}s, ' if finite.size else ''}never for worker(s) {never[:8].tolist()}"


def _split_of(current: Sequence[int], config: JobConfig) -> np.ndarray:
    """``current`` as an int64 array, once it is a split of ``config``'s: one whole size per worker, none below 0,
    adding up to the global batch; else a ConfigError that names the rule it breaks (a split of 40 samples where
    the job's batch is 64 had come back from the leader/straggler search still short of it)."""
    raw = np.asarray(None if isinstance(current, (str, bytes)) else current)
    n, batch = config.num_workers, config.global_batch
    if raw.shape != (n,):
        raise ConfigError(f"current must hold one size per worker ({n}), got shape {raw.shape}", job=config.job)
    if raw.dtype.kind not in "iu":
        raise ConfigError(f"current must hold whole numbers of samples, got {raw.dtype} values", job=config.job)
    sizes = raw.astype(np.int64, copy=False)
    if (sizes < 0).any() or (sizes > batch).any() or int(sizes.sum()) != batch:
        raise ConfigError(f"current must be sizes of 0 or more that add up to the global batch ({batch}), got "
                          f"{printable(str(sizes.tolist()), 120)}", job=config.job)
    return sizes


def _whole_caps(model: CapacityModel, workers: WorkerIds, upper: np.ndarray) -> np.ndarray | None:
    """``model``'s memory caps for ``workers`` as whole samples (a cap of 10.5 holds 10), the job's upper bound where a
    cap is NaN; None where it sets none. A ConfigError naming the model where it answers with neither one cap per
    worker nor one for all (numpy's broadcast error had failed each decision) or with no numbers."""
    answer = model.max_batch(workers)
    if answer is None:
        return None
    try:
        given = np.asarray(answer)
        caps: np.ndarray | None = given.astype(float)
    except (TypeError, ValueError):  # ragged (numpy's "inhomogeneous shape" had been the message), or not numbers
        given, caps = np.asarray(None), None
    if given.dtype.kind == "b":  # True had been read as a cap of 1 sample on every worker
        raise ConfigError(f"{type(model).__name__}.max_batch returned {str(answer)[:80]}: it must return one cap "
                          "(samples; NaN where unknown) per worker asked, or None, not booleans")
    if caps is None or caps.shape not in ((), upper.shape):
        what = f"{caps.size} values" if caps is not None and caps.ndim == 1 else str(answer)[:80]
        raise ConfigError(f"{type(model).__name__}.max_batch returned {what} for {upper.size} workers: it must "
                          "return one cap (samples; NaN where unknown) per worker asked, or None")
    return np.where(np.isnan(caps), upper, np.floor(np.clip(caps, -1.0, upper))).astype(np.int64)


def _capped(lower: np.ndarray, upper: np.ndarray, caps: np.ndarray | None, current: np.ndarray,
            global_batch: int) -> np.ndarray:
    """The upper bounds lowered to the memory ``caps`` (not below ``lower``); where those cannot place B, no worker's
    bound below its ``current`` size (the excess had nowhere to go), and the job's bounds where even that cannot."""
    if caps is None:
        return upper
    capped = np.maximum(np.minimum(upper, caps), lower)
    if capped.sum() < global_batch:
        capped = np.maximum(capped, np.minimum(current, upper)) if current.shape == upper.shape else upper
    return capped if capped.sum() >= global_batch else upper


def _forecast_share(time_model: TimeModel, sizes: np.ndarray) -> float:
    """The share of the slowest worker's predicted time that depends on its throughput forecast: all of it,
    less a linear model's overhead (a federated client's download and upload), in a mixed job too."""
    overhead = _overhead(time_model, sizes.size)
    if overhead is None:
        return 1.0
    times = time_model.time(sizes)
    slowest = int(np.argmax(times))
    if not (np.isfinite(times[slowest]) and times[slowest] > 0):
        return 1.0
    return max(times[slowest] - float(overhead[slowest]), 0.0) / float(times[slowest])


def _overhead(time_model: TimeModel, count: int) -> np.ndarray | None:
    """Each of ``count`` workers' time that no forecast sets (a :class:`LinearTime`'s overhead; a
    :class:`GroupedTime` has its groups'), or None where there is none."""
    if isinstance(time_model, LinearTime):
        return np.broadcast_to(time_model.overhead, (count,)) if np.any(time_model.overhead) else None
    if isinstance(time_model, GroupedTime):
        parts = [(positions, _overhead(model, positions.size)) for positions, model in time_model.groups]
        if all(part is None for _, part in parts):
            return None
        out = np.zeros(count)
        for positions, part in parts:
            if part is not None:
                out[positions] = part
        return out
    return None


class StaticProportionalPolicy(LBBSPPolicy):
    """Sizes proportional to each worker's speed, profiled over the first ``profile_iterations`` (an EWMA with
    alpha 0.5: the latest counts most) and then fixed. A worker first measured after that (one that joined late)
    is profiled from that measurement, and the split fixed again, as it is when the job's batch or bounds change:
    its share had stayed the median speed's for good, and a split fixed for a batch of 64 had been handed to a job
    of 128. A worker never measured is planned at the median speed."""

    name = "static-proportional"

    def __init__(self, profile_iterations: int = 3) -> None:
        super().__init__(EWMAThroughput(alpha=0.5), deadband=0.0, hedge=None)
        self.profile_iterations = _integer(profile_iterations, "profile_iterations", 1, None)
        self._observed = 0
        self._measured: set[int] = set()  # the workers with a measurement
        self._fixed: tuple[tuple[object, ...], Decision] | None = None  # (the job's shape, the split fixed for it)

    def observe(self, reports: Sequence[Report]) -> None:
        reports = as_reports(reports, "observe")
        timed = [report for report in reports if report.throughput]  # announcements alone profile nothing
        if self._observed < self.profile_iterations and reports:
            self._observed += bool(timed)
            super().observe(reports)
        elif late := [report for report in timed if report.worker not in self._measured]:
            super().observe(late)
            self._fixed = None
        self._measured.update(report.worker for report in timed)

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        checked = tuple(_split_of(current, config).tolist())
        if self._observed < self.profile_iterations:
            return Decision(checked, "profiling")
        shape = (config.num_workers, config.global_batch, config.min_batch, config.max_batch)
        if self._fixed is None or self._fixed[0] != shape:
            decision = super().decide(iteration, checked, config)
            self._fixed = (shape, Decision(decision.sizes, "proportional to the speeds profiled at the start"))
        return self._fixed[1]


#: PerEpochPolicy's iterations between rebalancings where none is given (``lbbsp coordinator --epoch-iterations``).
PER_EPOCH_ITERATIONS = 50


class PerEpochPolicy(LBBSPPolicy):
    """Re-balances once every ``iterations_per_epoch`` iterations, as DBS and OmniLearn do once per epoch, from a
    slow EWMA of each worker's speed (alpha 0.05: about the last 20 iterations, across epoch boundaries)."""

    name = "per-epoch"

    def __init__(self, iterations_per_epoch: int = PER_EPOCH_ITERATIONS, model: CapacityModel | None = None) -> None:
        super().__init__(_model_or(model, lambda: EWMAThroughput(alpha=0.05)), deadband=0.0, hedge=None)
        self.iterations_per_epoch = _integer(iterations_per_epoch, "iterations_per_epoch", 1, None)
        self._decided: int | None = None  # the iteration of the previous decision
        self._probed: int | None = None  # the iteration that brought back workers due after rejoin_after epochs out

    _rounds = "epoch(s)"

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        current_arr = _split_of(current, config)
        # a memory cap that shrank below a worker's size is acted on at once (bounds() lifts caps it cannot keep)
        over_caps = self._seen and bool((current_arr > self.bounds(np.arange(config.num_workers), current_arr,
                                                                      config)[1]).any())
        # an epoch starts at this iteration or, where a coordinator running ahead skipped some, since the last one;
        # iterations that went back (a new job, a run resumed from an earlier checkpoint) start afresh
        n, previous, self._decided = self.iterations_per_epoch, self._decided, iteration
        starts = iteration % n == 0 if previous is None or iteration < previous else iteration // n > previous // n
        if previous is not None and iteration < previous:
            self._probed = None
        # workers due back (a job whose min_batch is 0) are given samples until the decision that reads the reports of
        # the first iteration with them (``lag`` iterations on), which decides again: the split that brought them
        # back had been kept a whole epoch, and one decided the next iteration had not measured them yet (lag 2)
        probed = self._probed is not None and iteration >= self._probed + config.lag
        if not starts and not over_caps and not probed:
            return Decision(tuple(int(s) for s in current), "within the epoch: keep the split")
        lower = np.asarray(config.bounds()[0])
        self._probed = iteration if self._due_back(current_arr, lower).size else None
        decision = super().decide(iteration, current, config)
        if probed and not starts:
            return Decision(decision.sizes, f"after the workers due back were measured: {decision.reason}",
                            decision.predicted_s, decision.predicted_throughput)
        return decision


class LeaderStragglerPolicy(Policy):
    """The LB-BSP paper's search for GPU clusters: every ``window`` iterations move ``step`` samples from the
    slowest worker (straggler) to the fastest one with memory to spare (leader); when a worker that just
    received samples becomes the straggler (the sizes oscillate), halve the step. The window pools only the
    reports of iterations that ran the split in force: under ``JobConfig.lag`` the first reports after a move
    still measure the split before it, and acting on them overshoots. ``rejoin_after``: a worker given nothing (a
    job whose min_batch is 0) counts as finishing at once, a leader, after that many windows at 0 (None: never), so
    that one that became fast is found; a slow one is then measured and moved back."""

    name = "leader-straggler"

    def __init__(self, window: int = 3, initial_step_fraction: float = 0.25, model: CapacityModel | None = None,
                 rejoin_after: int | None = 10) -> None:
        self.window = _integer(window, "window", 1, None)
        self.initial_step_fraction = _real(initial_step_fraction, "initial_step_fraction", 1e-9, 1.0,
                                           "a share of the mean batch in (0, 1]")
        self.model = _model(model)
        self.rounds_out = RoundsOut(rejoin_after)
        self._times: dict[int, list[float]] = {}
        self._observed = 0
        self._step: int | None = None
        self._last_leader: int | None = None
        self._since = 0  # the first iteration of the split in force
        self._fed = False  # whether the model has had a report
        self._latest = -1  # the iteration of the newest report observed

    def observe(self, reports: Sequence[Report]) -> None:
        reports = as_reports(reports, "observe")
        if self.model is not None and reports:
            self.model.partial_fit(reports)
            self._fed = True
        if reports:
            if reports[0].iteration < self._latest:
                # the iterations went back (a new job, a run resumed from an earlier checkpoint): search afresh, or
                # every report before the last move's iteration had been dropped until the count caught up
                self._step, self._last_leader = None, None
                self._window_from(0)
            self._latest = reports[-1].iteration  # reports come in iteration order
        # compute_s = 0 measured nothing (an announcement, a step left untimed): read as 0 s, it made its worker the
        # leader at every window
        current = [report for report in reports if report.iteration >= self._since and report.compute_s > 0]
        for report in current:
            self._times.setdefault(report.worker, []).append(report.compute_s)
        self._observed += bool(current)

    def _moved(self, iteration: int, decision: Decision) -> Decision:
        """``decision``, which changes the split from ``iteration`` on: the window starts again from there."""
        self._window_from(iteration)
        return decision

    def _window_from(self, iteration: int) -> None:
        """Start the window again, pooling the reports of ``iteration`` on."""
        self._since = iteration
        self._times.clear()
        self._observed = 0

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        sizes = _split_of(current, config).copy()
        lower, upper = (np.asarray(b, dtype=np.int64) for b in config.bounds())
        if self.model is not None and self._fed:  # a model that has seen no report knows no cap (it raises)
            # caps too tight to place B had left the excess nowhere to go, and the search stopped for good
            upper = _capped(lower, upper, _whole_caps(self.model, range(config.num_workers), upper), sizes,
                            config.global_batch)
        # A worker that sent no report in the window (it left, or its reports were refused) keeps its size:
        # it is neither the straggler nor the leader, and does not hold up the search of the others.
        window, times = self.window, self._times  # a Python mean per worker: np.mean's 5 us each took 5 ms at 1,024
        mean_time = np.array([sum(t := times[w][-window:]) / len(t) if w in times else np.nan
                              for w in range(config.num_workers)])
        if (over := sizes > upper).any():  # a memory cap that shrank comes first, window or not
            return self._moved(iteration, self._shed(sizes, upper, over, mean_time))
        if self._observed < self.window or not self._times:
            return Decision(tuple(int(s) for s in sizes), "observing")
        self._times.clear()
        self._observed = 0
        # a worker given nothing for rejoin_after windows finishes at once: a leader, as it has no report to make it
        # one (it had been left out of the search for good however fast it became; every window, a slow one had
        # been pulled back at every other window, 1.9x slower)
        mean_time[self.rounds_out.due(np.arange(sizes.size)) & (sizes == 0)] = 0.0
        decision, moved = self._search(sizes, lower, upper, mean_time, config)
        self.rounds_out.record(np.arange(sizes.size), decision.sizes)
        return self._moved(iteration, decision) if moved else decision

    def _search(self, sizes: np.ndarray, lower: np.ndarray, upper: np.ndarray, mean_time: np.ndarray,
                config: JobConfig) -> tuple[Decision, bool]:
        """One step of the search at the end of a window: move ``step`` samples from the straggler to the leader
        (and whether it moved any)."""
        if self._step is None:
            self._step = max(1, int(self.initial_step_fraction * config.global_batch / config.num_workers))
        reported = ~np.isnan(mean_time)
        straggler = int(np.argmax(np.where(reported, mean_time, -np.inf)))
        if straggler == self._last_leader:
            self._step = max(1, self._step // 2)
        has_room = np.flatnonzero((sizes < upper) & reported)
        has_room = has_room[has_room != straggler]
        if has_room.size == 0:
            return Decision(tuple(int(s) for s in sizes), "no worker has memory to spare"), False
        leader = int(has_room[np.argmin(mean_time[has_room])])
        if mean_time[straggler] <= mean_time[leader]:  # workers equally fast: a move only makes one the straggler
            return Decision(tuple(int(s) for s in sizes), "balanced: the slowest worker is as fast as the leader"), False
        moved = int(min(self._step, sizes[straggler] - lower[straggler], upper[leader] - sizes[leader]))
        sizes[straggler] -= moved
        sizes[leader] += moved
        self._last_leader = leader
        return Decision(tuple(int(s) for s in sizes), f"moved {moved} sample{'s' * (moved != 1)} from straggler {straggler} to leader "
                        f"{leader} (step {self._step})"), True

    @staticmethod
    def _shed(sizes: np.ndarray, upper: np.ndarray, over: np.ndarray, mean_time: np.ndarray) -> Decision:
        """Move what the workers ``over`` their upper bound (a memory cap that shrank) hold beyond it to the
        fastest workers with room, before any search step: the search only ever takes from the straggler."""
        excess = int((sizes[over] - upper[over]).sum())
        room = np.where(over, 0, upper - sizes)  # at least the excess: the bounds hold B (JobConfig, _capped)
        sizes = np.minimum(sizes, upper)
        left = excess
        for worker in np.argsort(np.where(np.isnan(mean_time), np.inf, mean_time), kind="stable").tolist():
            taken = int(min(left, room[worker]))
            sizes[worker] += taken
            left -= taken
        return Decision(tuple(int(s) for s in sizes), f"moved {excess} samples off worker(s) "
                                                      f"{np.flatnonzero(over)[:8].tolist()}, over their memory caps")


class OraclePolicy(LBBSPPolicy):
    """The limit: allocates with each worker's true time model for the coming iteration, which a simulator
    hands it through :meth:`reveal` before each decision. ``hedge`` is for references shown a truth that is
    not exact (:class:`~lbbsp.sim.engine.LevelOracle`): they then plan with LB-BSP's margins."""

    name = "oracle"

    def __init__(self, *, sit_out: float = 0.0, rejoin_after: int | None = 10, hedge: float | None = None) -> None:
        super().__init__(EWMAThroughput(), deadband=0.0, hedge=hedge, sit_out=sit_out, rejoin_after=rejoin_after)
        self._truth: TimeModel | None = None
        self._caps: np.ndarray | None = None

    def reveal(self, truth: TimeModel, max_batch: np.ndarray | None = None) -> None:
        """The true time model (and memory caps) of the iteration about to be decided."""
        self._truth, self._caps = truth, max_batch

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        current_arr = _split_of(current, config)
        if self._truth is None:
            raise ConfigError("the oracle needs reveal(truth) before each decision")
        lower, upper = (np.asarray(b, dtype=np.int64) for b in config.bounds())
        if self._caps is not None:
            upper = np.maximum(np.minimum(upper, self._caps), lower)
        plan = self._truth
        if self.risk is not None:  # margins learned from its own misses, for a truth that is not exact
            ran = np.maximum(current_arr, 1)
            plan, _ = self.with_margins(iteration, self._truth, ran / self._truth.time(ran))
        sizes = self.propose(plan, config, lower, upper, self._truth)
        if self._may_idle(lower):  # as LB-BSP records them: rejoin_after binds the limit as it binds LB-BSP
            self.rounds_out.record(range(config.num_workers), sizes)
        return Decision(tuple(sizes.tolist()), "true speeds of the coming iteration",
                        tuple(self._truth.time(sizes).tolist()))


__all__ = ["BSPPolicy", "BackupWorkersPolicy", "Decision", "LBBSPPolicy", "LeaderStragglerPolicy",
           "OraclePolicy", "PerEpochPolicy", "Policy", "StaticProportionalPolicy"]
