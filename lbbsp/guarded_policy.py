"""A policy held to the job's rules, as the coordinator and the simulator run it, and the checks of a policy against
the job it is given."""
from __future__ import annotations

import dataclasses
import logging
import numbers
from collections.abc import Iterator, Mapping

import numpy as np

from .allocation import sit_out_share
from .config import JobConfig
from .errors import ConfigError, PolicyError, ProtocolError
from .models import AutoCapacityModel, CapacityModel, worker_kind
from .models.auto import default_models
from .policies import BackupWorkersPolicy, Decision, OraclePolicy, Policy, StaticProportionalPolicy, checked_policy
from .protocol import MAX_POLICY_NAME_CHARS, MAX_REASON_CHARS, Assignment, Report
from .repeats import Repeats

log = logging.getLogger("lbbsp.coordinator")  # the coordinator's lines, under the logger its users configure


def _clipped(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in an ellipsis where it was cut."""
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def check_for_job(policy: Policy | None, config: JobConfig, *, warn: bool = True) -> None:
    """A ConfigError for worker kinds pinned outside the job (a typo, or a rank off by one, had been kept
    silently) or backup workers that would drop every gradient (refused at each decision, and the job ran on), and
    (``warn``) a warning where the model, or a model an AutoCapacityModel is given, forecasts further or less far
    ahead than the job's lag (a hand-built model does not take the lag; the default and `lbbsp coordinator --model`
    do)."""
    if isinstance(policy, BackupWorkersPolicy):
        policy.aggregated(config.num_workers)
    model = getattr(policy, "model", None)
    pinned = getattr(model, "kinds", None) if isinstance(model, AutoCapacityModel) else None
    # numpy's integers too (a pin map built from np.flatnonzero had gone unchecked)
    outside = sorted(w for w in map(_as_int, pinned or {}) if w is not None and not 0 <= w < config.num_workers)
    if outside:
        raise ConfigError(f"AutoCapacityModel's kinds pin worker(s) {outside[:8]}, outside the job's workers "
                          f"0..{config.num_workers - 1}", job=config.job)
    for name, horizon in _horizons(model) if warn else ():
        if horizon != config.lag:
            log.warning("job %s: the model%s forecasts %d iteration(s) ahead (horizon=%d), but each split is decided "
                        "%d ahead (lag=%d): give it horizon=%d (LBBSPPolicy()'s own model: LBBSPPolicy("
                        "AutoCapacityModel(horizon=%d)))", config.job, name, horizon, horizon, config.lag,
                        config.lag, config.lag, config.lag)


def _as_int(value: object) -> int | None:
    """``value`` as an int where it is an integer (numpy's too) and not a bool, else None."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


def _horizons(model: object, name: str = "") -> Iterator[tuple[str, int]]:
    """(what the warning calls it after "the model", horizon) for ``model`` and for each model an
    :class:`AutoCapacityModel` is given, where it has a whole ``horizon``: the automatic model's own counts only where
    it builds the CPU workers' NARX (no model given for "cpu"); those given in ``models`` had gone unchecked."""
    if isinstance(model, AutoCapacityModel):
        given = model.models if isinstance(model.models, Mapping) else {}
        if "cpu" not in given:
            yield from _whole(model.horizon, name)
        for kind, inner in given.items():
            yield from _horizons(inner, f" models[{kind!r}] ({type(inner).__name__})")
        return
    yield from _whole(getattr(model, "horizon", None), name)


def _whole(horizon: object, name: str) -> Iterator[tuple[str, int]]:
    """(``name``, ``horizon``) where ``horizon`` is a whole number of iterations; nothing otherwise."""
    if isinstance(horizon, (int, np.integer)) and not isinstance(horizon, bool):
        yield name, int(horizon)


def check_outside_simulator(policy: Policy | None, config: JobConfig, *, warn: bool = True) -> None:
    """A ConfigError for the oracle, which needs each coming iteration's true speeds, known only to the simulator (a
    job's coordinator had failed every decision, the job left on the equal split), and (``warn``) a warning for
    backup workers, whose dropped gradients no integration implements (a job had run them as plain BSP, unsaid).
    Where a coordinator is made for a job, not where the simulator makes one (``Coordinator(..., simulated=True)``)."""
    if isinstance(policy, OraclePolicy):
        raise ConfigError(f"{type(policy).__name__} is the simulator's limit, not a policy a job can run: it decides "
                          "from each coming iteration's true speeds, which only lbbsp.sim knows (`lbbsp simulate`, "
                          "lbbsp.sim.compare); for a job, use LBBSPPolicy()", job=config.job)
    if warn and isinstance(policy, BackupWorkersPolicy):
        log.warning("job %s: backup workers drop the slowest %d gradient(s) of each iteration, which breaks "
                    "exactness (each global batch's samples no longer all count); a job's workers aggregate every "
                    "gradient, so this one runs as plain BSP, the equal split: lbbsp.sim runs backup workers as they "
                    "are meant, to compare against", config.job, policy.backups)


class GuardedPolicy:
    """A policy held to the job's rules, as the coordinator runs it: a split that breaks them, or a policy that
    fails, keeps the split in force (logged with the reason) instead of stopping the job. The simulator runs
    its policies through this too, so that a split it measures is one a job would have written. ``name``: what
    its log lines call the policy (the simulator's name of the run); the policy's own name by default."""

    def __init__(self, policy: Policy, config: JobConfig, name: str | None = None) -> None:
        checked_policy(policy, config.job)
        check_for_job(policy, config)
        self.policy, self.config = policy, config
        self.name = str(policy.name) if name is None else name
        # how many workers a decision may leave at 0 below their lower bound: a policy of one's own that let
        # workers sit out (any true sit_out) had been let leave all but one at 0
        try:
            self._may_sit_out = int(sit_out_share(policy.sit_out) * config.num_workers + 1e-9)
        except ConfigError as exc:
            raise ConfigError(f"policy {self.name}'s {exc.message}", job=config.job) from None
        self._bounds = tuple(np.asarray(b, dtype=np.int64) for b in config.bounds())
        # an assignment holds a name and a reason of bounded length: longer ones are cut, not refused (a policy
        # error's long message made even the split kept in force invalid, and nothing was written)
        self._name = _clipped(str(policy.name), MAX_POLICY_NAME_CHARS)
        #: Decisions that failed or broke the job's rules, each kept the split in force (and was logged).
        self.failures = 0
        self._repeats, self._learn_repeats, self._prediction_repeats = Repeats(), Repeats(), Repeats()

    def decide(self, target: int, current: tuple[int, ...], reports: list[Report]) -> tuple[Decision, Assignment]:
        """Observe ``reports`` and decide the assignment of ``target``; ``current`` (the split of ``target - 1``)
        is kept if the policy fails or breaks the rules."""
        try:
            self.policy.observe(reports)
            decision = self.policy.decide(target, current, self.config)
            assignment = self._checked(target, decision)
            return dataclasses.replace(decision, predicted_throughput=self._predictions(target, decision)), assignment
        # a policy's bug, an OSError too (none is Redis's here), a sys.exit() in it or a library it calls (which had
        # ended the coordinator's thread without a word): keep the split in force. Ctrl-C still stops the coordinator.
        except (Exception, SystemExit) as exc:
            self.failures += 1
            if (repeats := self._repeats.note(exc)) is not None:
                log.exception("job %s: policy %s failed to decide iteration %d%s; keeping the current split",
                              self.config.job, self.name, target, repeats)
            decision = Decision(current, f"policy failed ({type(exc).__name__}: {exc}); kept the split")
            return decision, Assignment(self.config.job, target, current, self._name, _clipped(decision.reason,
                                                                                               MAX_REASON_CHARS))

    def learn(self, iteration: int) -> None:
        """Let the policy learn from the reports of ``iteration`` once the split is out; a failure is logged."""
        try:
            self.policy.learn()
        except (Exception, SystemExit) as exc:  # as above: logged, and the next decision goes on
            if (repeats := self._learn_repeats.note(exc)) is not None:
                log.exception("job %s: policy %s failed to learn from iteration %d%s", self.config.job, self.name,
                              iteration, repeats)

    def _predictions(self, target: int, decision: Decision) -> tuple[float, ...] | None:
        """The decision's predicted throughputs as one float per worker (NaN or inf where the model knows none:
        shown as null), or None, with a warning, if they are not that: the split is good, and the status the
        coordinator records after writing it must not fail on them."""
        if decision.predicted_throughput is None:
            return None
        try:
            predicted = np.asarray(decision.predicted_throughput)
        except (TypeError, ValueError):  # ragged
            predicted = np.asarray(None)
        if predicted.shape != (self.config.num_workers,) or predicted.dtype.kind not in "iuf":
            # at every decision otherwise: every 10 s, with a count
            if (repeats := self._prediction_repeats.note("predicted throughput")) is not None:
                log.warning("job %s: policy %s's predicted throughput for iteration %d is not one number per worker "
                            "(%.80r); recording none%s", self.config.job, self.name, target,
                            decision.predicted_throughput, repeats)
            return None
        return tuple(predicted.astype(float, copy=False).tolist())

    def _checked(self, target: int, decision: Decision) -> Assignment:
        """The decision as the assignment of ``target``, or a :class:`PolicyError` if it breaks the job's rules
        (an integer size per worker, within its bounds or 0 where the policy lets workers sit out, summing to
        the global batch): once written it could not be replaced, and every worker would refuse it. Checked
        on arrays: a fraction of a millisecond at 1,024 workers."""
        def refuse(why: str) -> PolicyError:
            return PolicyError(f"policy {self.name} returned an invalid split: {why}", job=self.config.job,
                               iteration=target)

        if not isinstance(decision, Decision):  # the bare sizes, say: it had failed on a missing attribute
            raise refuse(f"decide must return a Decision(sizes, reason), got {type(decision).__name__}")
        if not isinstance(decision.reason, str):  # it had failed on len() with no word of the reason
            raise refuse(f"the reason must be a string, got {type(decision.reason).__name__}")
        try:
            raw = np.asarray(decision.sizes)
        except (TypeError, ValueError) as exc:
            raise refuse(f"sizes are not numbers ({exc})") from exc
        if raw.shape != (self.config.num_workers,):
            what = f"{raw.size} sizes" if raw.ndim == 1 else f"sizes of shape {raw.shape}"
            raise refuse(f"{what} for {self.config.num_workers} workers")
        whole = raw.dtype.kind in "iu" or (raw.dtype.kind == "f" and bool(np.isfinite(raw).all())
                                           and np.array_equal(raw, np.round(raw)))  # inf had read as -2**63 samples
        if not whole:  # an int past int64 (10**30) makes an object array: integers, but no size a batch holds
            kind = "at most the global batch" if raw.dtype.kind == "O" else "integers"
            raise refuse(f"sizes must be {kind}, got {raw[:8].tolist()}")
        if raw.dtype.kind == "u" and (raw > self.config.global_batch).any():  # 2**63 had wrapped to a negative
            raise refuse(f"sizes must be at most the global batch, got {raw[:8].tolist()}")
        sizes = raw.astype(np.int64)
        lower, upper = self._bounds
        outside = (sizes < lower) | (sizes > upper)
        if self._may_sit_out:  # such a policy gives a worker sitting out 0, up to its share of the workers
            sitting = outside & (sizes == 0)
            if (count := int(sitting.sum())) > self._may_sit_out:
                raise refuse(f"{count} workers given 0 samples, where its sit_out of "
                             f"{self.policy.sit_out:g} lets at most {self._may_sit_out} of {sizes.size} sit out")
            outside &= ~sitting
        if outside.any():
            w = int(np.argmax(outside))
            raise refuse(f"worker {w} got {sizes[w]} samples, outside its bounds [{lower[w]}, {upper[w]}] "
                         f"({int(outside.sum())} workers outside)")
        try:
            return Assignment(self.config.job, target, tuple(sizes.tolist()), self._name,
                              _clipped(decision.reason, MAX_REASON_CHARS)).validate(global_batch=self.config.global_batch)
        except ProtocolError as exc:
            raise refuse(exc.message) from exc


def warn_uncapped(job: str, policy: Policy, reports: list[Report]) -> bool:
    """Warn, and say True, where ``reports`` read GPU memory but ``policy``'s model sets no memory caps (it has no
    ``max_batch`` of its own): their workers' sizes are then not held below what their cards fit (per-epoch's own slow
    EWMA had given GPUs that held 716 samples 787-932, unsaid). A policy of one's own without a ``model`` is not asked."""
    if not hasattr(policy, "model"):
        return True
    model = policy.model
    if isinstance(model, AutoCapacityModel):  # a kind's model of the user's own, or a GPU worker pinned to another kind
        return _warn_uncapped_kinds(job, policy, model, reports)
    if _sets_caps(model):
        return True
    gpus = sorted({report.worker for report in reports if "gpu_mem_used" in report.features})
    if gpus:
        name = getattr(policy, "name", type(policy).__name__)
        why = ("has no model to set memory caps" if model is None
               else f"has a model, {type(model).__name__}, that sets no memory caps")
        remedy = ("use a policy that takes a model, with AutoCapacityModel() (lbbsp coordinator --policy lbbsp)"
                  if isinstance(policy, StaticProportionalPolicy) else
                  "give it AutoCapacityModel() or BatchTimeCurve() (lbbsp coordinator --model auto)")
        log.warning("job %s: worker(s) %s report GPU memory, but the %s policy %s, so their sizes are not held below "
                    "what their cards fit: %s", job, gpus[:8], name, why, remedy)
    return bool(gpus)


def _sets_caps(model: object) -> bool:
    """Whether ``model`` has a ``max_batch`` of its own, and so can hold workers below what their cards fit."""
    return isinstance(model, CapacityModel) and type(model).max_batch is not CapacityModel.max_batch


def _warn_uncapped_kinds(job: str, policy: Policy, model: AutoCapacityModel, reports: list[Report]) -> bool:
    """:func:`warn_uncapped` for an :class:`AutoCapacityModel`: the workers that read GPU memory and go (by their pin,
    else by their report) to the CPU or GPU kind whose model sets no caps. Federated clients are left out: their
    model plans transfers, not a card's memory. True at once where no worker can go to such a kind, as a CPU-only
    job's reports had been scanned at every decision (3 ms at 100,000 workers)."""
    pins, given = dict(model.kinds or {}), dict(model.models or {})
    capping = {kind: _sets_caps(kind_model) for kind, kind_model in (default_models(1) | given).items()}
    if capping["gpu"] and all(capping.get(kind, True) or kind == "fl" for kind in pins.values()):
        return True
    gpus = [report for report in reports if "gpu_mem_used" in report.features]
    if not gpus:
        return False
    uncapped: dict[str, list[int]] = {}
    for report in gpus:
        kind = pins.get(report.worker, worker_kind(report))
        if kind != "fl" and not capping.get(kind, True):  # a kind the model does not know: it refuses that itself
            uncapped.setdefault(kind, []).append(report.worker)
    for kind, workers in sorted(uncapped.items()):
        pinned = kind != "gpu" and any(w in pins for w in workers)
        why = f"to kind {kind!r}" + (" (pinned there)" if pinned else "") + (
            f", whose model, {type(given[kind]).__name__}, sets no memory caps" if kind in given
            else ", whose default model sets no memory caps")
        remedy = ("pin them to 'gpu', or leave them unpinned" if pinned
                  else f"give that kind BatchTimeCurve(), the default for 'gpu' (lbbsp coordinator: --kind-model "
                       f"{kind}=gpu-curve)")
        log.warning("job %s: worker(s) %s report GPU memory, but the %s policy's AutoCapacityModel routes them %s, so "
                    "their sizes are not held below what their cards fit: %s", job, sorted(set(workers))[:8],
                    getattr(policy, "name", type(policy).__name__), why, remedy)
    return True
