"""Mixed clusters: one capacity model per worker kind (CPU, GPU, federated client), chosen per worker.

A worker's kind is set from its first report (device string and features) and can be overridden; an
announcement that measured nothing and shows no accelerator or transfer features does not set it (a federated
client or a GPU worker may announce itself that way), and goes to every kind's model. Each kind's model sees
only its own workers' reports. The job's time model stitches the kinds' time models
together, so one allocation balances GPU and CPU workers against each other.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
from sklearn.base import clone

from ..allocation import InvertibleTimeModel, LinearTime, TimeModel
from ..config import _integer
from ..errors import ConfigError, printable
from ..protocol import Report
from .base import (
    NO_CAP,
    CapacityModel,
    CheckedReports,
    Hardware,
    WorkerIds,
    as_reports,
    by_iteration,
    check_contract,
    device_family,
    feature,
    field,
    hardware_of,
    learns_availability,
    learnt_availability,
    predicted_throughput,
    whole_caps,
    worker_ids,
)
from .fl_client import TRANSFER_FEATURES, FLClientModel, checked_outcomes
from .gpu_curve import BatchTimeCurve
from .narx import NARXThroughput

KINDS = ("cpu", "gpu", "fl")
#: The most rounds of outcomes kept from before any report (availability forgets older ones anyway: alpha 0.2).
MAX_EARLY_ROUNDS = 64
#: Device family prefixes of accelerators: a report from such a device is a GPU worker's.
GPU_DEVICES = ("cuda", "gpu", "rocm", "hip", "mps", "xpu", "tpu")


def worker_kind(report: Report) -> str:
    """'fl' for a report with model-transfer features (``TRANSFER_FEATURES``), 'gpu' for an accelerator device (one whose
    family, see :func:`device_family`, starts with one of ``GPU_DEVICES``, in any case) or GPU memory features, else
    'cpu'."""
    features = report.features
    if not TRANSFER_FEATURES.isdisjoint(features):
        return "fl"
    if "gpu_mem_used" in features or device_family(report.device).startswith(GPU_DEVICES):
        return "gpu"
    return "cpu"


def model_moved(kind: str | None, report: Report) -> bool:
    """Whether ``report`` shows its worker, of ``kind``, on another model now: a CPU worker reading GPU memory, or a
    GPU worker measuring on the CPU with no GPU features (a GPU rank's first step, timed before its model's device
    was known). Cheap tests first: it runs for every report."""
    if kind == "cpu":
        return "gpu_mem_used" in report.features
    return (kind == "gpu" and report.samples > 0 and "gpu_mem_used" not in report.features
            and device_family(report.device) == "cpu" and worker_kind(report) == "cpu")


def grouped(groups: tuple[tuple[np.ndarray, TimeModel], ...], size: int) -> GroupedTime:
    """A :class:`MixedTime` of ``groups`` where each has ``capacity``, else a :class:`GroupedTime`."""
    if all(hasattr(model, "capacity") for _, model in groups):
        return MixedTime(cast(tuple[tuple[np.ndarray, InvertibleTimeModel], ...], groups), size)
    return GroupedTime(groups, size)


def default_models(horizon: int = 2) -> dict[str, CapacityModel]:
    """NARX for CPU workers (forecasting ``horizon`` iterations ahead), the batch-time curve for GPUs, the
    client model for federated clients."""
    return {"cpu": NARXThroughput(horizon=horizon), "gpu": BatchTimeCurve(), "fl": FLClientModel()}


@dataclass(frozen=True)
class GroupedTime:
    """Time model of a job whose workers are split into groups, each with its own time model; the allocator
    searches it (:class:`MixedTime` where every group's model is invertible)."""

    groups: tuple[tuple[np.ndarray, TimeModel], ...]  # (positions in the job's worker list, model)
    size: int

    def time(self, sizes: np.ndarray) -> np.ndarray:
        """Each worker's predicted seconds for its size in ``sizes``, from its group's model."""
        sizes, out = np.asarray(sizes), np.empty(self.size)
        for positions, model in self.groups:
            out[positions] = model.time(sizes[positions])
        return out


@dataclass(frozen=True)
class MixedTime(GroupedTime):
    """Time model of a job whose workers are split into groups, each with its own invertible time model."""

    groups: tuple[tuple[np.ndarray, InvertibleTimeModel], ...]

    def capacity(self, deadline: float) -> np.ndarray:
        """How many samples each worker finishes by ``deadline`` seconds, from its group's model (-1 for none)."""
        out = np.empty(self.size)
        for positions, model in self.groups:
            out[positions] = model.capacity(deadline)
        return out


class AutoCapacityModel(CapacityModel):
    """Routes each worker to the model of its kind; ``models`` replaces any kind's model, ``kinds`` pins
    a worker's kind (``{worker: "gpu"}``); ``horizon`` is how far ahead forecasts are used (``JobConfig.lag``).
    A kind once set stays, but for a worker whose model moved: a CPU worker that starts to report GPU memory, or a
    GPU worker that reports a measurement from device "cpu" with no GPU features."""

    _STRUCTURAL = frozenset({"models", "kinds", "horizon"})
    # (worker ids as bytes, each kind's positions in them and its workers' ids)
    _groups_cache: tuple[bytes, dict[str, tuple[np.ndarray, np.ndarray]]] | None
    # (worker ids of reports as bytes, each one's kind, see _known_kinds); None: made again at the next reports
    _kinds_cache: tuple[bytes, tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]] | None] | None = None
    _early_outcomes: list[dict[int, bool]] = []  # rounds' outcomes recorded before any report (record_outcomes)

    def __init__(self, models: Mapping[str, CapacityModel] | None = None,
                 kinds: Mapping[int, str] | None = None, *, horizon: int = 2) -> None:
        self.models = models
        self.kinds = kinds
        self.horizon = horizon

    @by_iteration
    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> AutoCapacityModel:
        reports = as_reports(reports)
        if not reports:  # an iteration nobody reported in: nothing to learn, and an unfitted model stays so
            self._check_params()
            return self
        if not hasattr(self, "models_"):
            self._check_params()
            given = dict(self.models or {})
            # clones, as scikit-learn's meta-estimators do: the parameter stays as given, so models built from the
            # same parameters, or one fitted again, do not learn into each other's state
            self.models_ = default_models(self.horizon) | {kind: clone(model) for kind, model in given.items()}
            self.kind_: dict[int, str] = {}
            self._kind_codes = np.full(0, -1, dtype=np.int64)  # kind_ by worker id as KINDS indices, -1: none yet
            self.hardware_: dict[int, Hardware] = {}  # each worker's, from its first report
            self.fed_: set[str] = set()  # kinds whose model has had reports: the others cannot answer yet
            self.measured_: set[str] = set()  # kinds whose model has had a measurement, not just announcements
            self._groups_cache = self._kinds_cache = None  # from before a refit, perhaps
        by_kind = self._route(reports)
        for kind, group in by_kind.items():
            if group:
                self.models_[kind].partial_fit(group, defer=defer)
                if kind not in self.fed_:
                    self.fed_.add(kind)
                    self._groups_cache = None
                if kind not in self.measured_ and any(r.samples > 0 and r.compute_s > 0 for r in group):
                    self.measured_.add(kind)
        early, self._early_outcomes = self._early_outcomes, []
        for completed in early:  # rounds whose outcomes came before any report, routed now that kinds are known
            self.record_outcomes(completed)
        return self

    def _forget(self) -> None:
        super()._forget()
        self._early_outcomes = []

    def _route(self, reports: CheckedReports) -> dict[str, CheckedReports]:
        """Each kind's reports, in order, setting the kind of each worker from its first report that shows it. In
        array operations where every report's worker has its kind and none shows its model moved (the usual case),
        else report by report."""
        ids = field(reports, "worker")
        if ids.max() >= self._kind_codes.size:
            self._kind_codes = np.concatenate([self._kind_codes, np.full(ids.max() + 1 - self._kind_codes.size, -1)])
        gpu_memory = np.isfinite(feature(reports, "gpu_mem_used"))
        known = self._known_kinds(ids)
        # the usual case: the GPU workers read GPU memory and no other does. Else a CPU worker reading it has moved,
        # and a GPU worker measuring with no GPU features may be on the CPU now: read its device
        if known is not None and (gpu_memory != known[1]).any():
            unsure = np.flatnonzero(known[1] & ~gpu_memory & (field(reports, "samples") > 0))
            if any(device_family(reports[at].device) == "cpu" for at in unsure.tolist()) or ((known[0] == 0) & gpu_memory).any():
                known = None
        if known is not None:
            return {kind: reports.subset(at) if at.size else CheckedReports() for kind, at in known[2].items()}
        self._kinds_cache = None  # kinds are set below
        positions: dict[str, list[int]] = {kind: [] for kind in KINDS}
        for at, report in enumerate(reports):
            kind = self.kind_.get(report.worker)
            if model_moved(kind, report) and report.worker not in (self.kinds or {}):  # its kind, hardware set again
                kind = None
                self.hardware_.pop(report.worker, None)
            if kind is None:  # a worker's kind is set by its first report that shows it
                if report.worker not in self.hardware_:  # what its kind is guessed from until then
                    self.hardware_[report.worker] = hardware_of(report)
                    self._groups_cache = None
                pinned = (self.kinds or {}).get(report.worker)
                kind = pinned or worker_kind(report)
                bare = pinned is None and report.samples == 0 and kind == "cpu"
                if bare:  # an announcement with nothing measured and no accelerator or transfer features says only
                    # what the hardware is: every model learns that (for its cold-start prior), none claims it
                    for group in positions.values():
                        group.append(at)
                    continue
                self.kind_[report.worker] = kind
                self._kind_codes[report.worker] = KINDS.index(kind)
                self._groups_cache = None
            positions[kind].append(at)
        return {kind: reports.subset(group) for kind, group in positions.items()}

    def _known_kinds(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]] | None:
        """(The kind of each worker in ``ids`` as its index in KINDS, whether it is "gpu", the positions of each kind),
        None where a worker's kind is not set: cached, as a job's reports come from the same workers each iteration,
        until a kind is set (``_route`` forgets it)."""
        key = ids.tobytes()
        cached = self._kinds_cache
        if cached is None or cached[0] != key:
            kinds = self._kind_codes[ids]
            known = None if (kinds < 0).any() else (
                kinds, kinds == 1, {kind: np.flatnonzero(kinds == code) for code, kind in enumerate(KINDS)})
            cached = self._kinds_cache = (key, known)
        return cached[1]

    def _check_params(self) -> None:
        _integer(self.horizon, "horizon (JobConfig.lag)", 1, 8)
        for name in ("models", "kinds"):
            if not isinstance(getattr(self, name), (Mapping, type(None))):
                raise ConfigError(f"{name} must be a mapping or None, got {getattr(self, name)!r}")
        for worker in self.kinds or {}:
            _integer(worker, f"kinds' key {worker!r} (a worker id)", 0, None)
        given = dict(self.models or {})
        # each named where it was given (a kind given as a list, unhashable, had been numpy's TypeError)
        unknown = [f"models' key {kind!r}" for kind in given if not (isinstance(kind, str) and kind in KINDS)]
        unknown += [f"kinds[{worker!r}] = {kind!r}" for worker, kind in (self.kinds or {}).items()
                    if not (isinstance(kind, str) and kind in KINDS)]
        if unknown:
            raise ConfigError(f"unknown worker kind: {', '.join(unknown[:4])}; a worker kind is one of "
                              f"{', '.join(map(repr, KINDS))} (lower case)")
        wrong = sorted(kind for kind, model in given.items() if not isinstance(model, CapacityModel))
        if wrong:
            model = given[wrong[0]]
            hint = f" (did you mean {model.__name__}()?)" if isinstance(model, type) else ""
            raise ConfigError(f"models for {wrong} are not CapacityModel instances: models[{wrong[0]!r}] is "
                              f"{printable(repr(model), 80)}{hint}")
        for kind, model in given.items():  # here, not at the first report of its kind (a decision of a running job)
            try:
                check_contract(model)
                model._check_params()
            except ConfigError as exc:
                raise ConfigError(f"models[{kind!r}]: {exc.message}") from None
            try:
                clone(model)  # as the first fit does: a model that cannot be cloned had failed every decision
            # scikit-learn's refusals, and get_params' AttributeError where __init__ stored a keyword under another name
            except (AttributeError, RuntimeError, TypeError) as exc:
                raise ConfigError(f"models[{kind!r}]: {type(model).__name__} cannot be cloned ({exc}); its __init__ "
                                  "must store each keyword argument as given (the scikit-learn contract)") from None

    def finish_learning(self) -> AutoCapacityModel:
        for model in getattr(self, "models_", {}).values():
            model.finish_learning()
        return self

    def predict(self, workers: WorkerIds) -> np.ndarray:
        """Each worker's throughput as its kind's model predicts it; for a kind that has announced itself but
        measured nothing yet (the first GPU of a CPU job), the median of the other kinds' predictions."""
        self._check_is_fitted("models_")
        ids = worker_ids(workers)
        out = self._per_kind(ids, predicted_throughput, np.nan)
        unmeasured = [positions for kind, (positions, _) in self._groups(ids).items() if kind not in self.measured_]
        if unmeasured:
            out[np.concatenate(unmeasured)] = self._median_speed()
        return out

    def max_batch(self, workers: WorkerIds) -> np.ndarray | None:
        self._check_is_fitted("models_")
        caps = self._per_kind(worker_ids(workers), lambda model, ids: _or_no_cap(model.max_batch(ids)), np.inf)
        if np.isinf(caps).all():
            return None
        return whole_caps(caps, nan=NO_CAP)

    def explore(self, workers: WorkerIds, sizes: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        self._check_is_fitted("models_")
        out = np.asarray(sizes, dtype=np.int64).copy()
        ids = worker_ids(workers)
        lower, upper = np.asarray(lower), np.asarray(upper)
        for name, given in (("sizes", out), ("lower", lower), ("upper", upper)):
            if given.shape != ids.shape:
                raise ConfigError(f"explore's {name} must hold one value per worker ({ids.size}), got shape "
                                  f"{given.shape}")
        for kind, (positions, members) in self._groups(ids).items():
            if kind in self.fed_:
                out[positions] = self.models_[kind].explore(members, out[positions], lower[positions], upper[positions])
        return out

    def availability(self, workers: WorkerIds) -> np.ndarray:
        """The chance each worker completes a round it is asked to do, as its kind's model learns it (federated
        clients: :meth:`FLClientModel.availability`); NaN for a kind whose model learns none (a GPU worker is not
        a client that may miss a round), 1 before any report."""
        ids = worker_ids(workers)
        if not hasattr(self, "models_"):
            return np.ones(ids.size)
        return self._per_kind(ids, learnt_availability, np.nan)

    def record_outcomes(self, completed: Mapping[int, bool]) -> AutoCapacityModel:
        """Learn availability from one round (see :meth:`FLClientModel.record_outcomes`): each outcome goes to the
        model of its worker's kind (a worker that never reported: its pin's or its peers', as :meth:`availability`
        answers it), where that model learns availability. Rounds before any report (a federated job's first, whose
        clients have not reported yet) are kept, the latest ``MAX_EARLY_ROUNDS``, and learned at the first report."""
        if not isinstance(completed, Mapping):
            raise TypeError(f"record_outcomes takes a mapping {{worker id: completed}}, got {type(completed).__name__}")
        if not hasattr(self, "models_"):
            if completed:
                checked_outcomes(completed)  # refused now, as the model would refuse it later
                self._early_outcomes = [*self._early_outcomes[1 - MAX_EARLY_ROUNDS:], dict(completed)]
            return self
        if completed:
            ids, outcomes = worker_ids(list(completed)), list(completed.values())
            for kind, (positions, members) in self._groups(ids).items():  # routed as availability() answers them
                model = self.models_[kind]
                if learns_availability(model):
                    model.record_outcomes({int(w): outcomes[at] for w, at in zip(members.tolist(), positions.tolist())})
        return self

    def routed_kinds(self, workers: WorkerIds) -> list[str]:
        """The kind each of ``workers`` is answered as: its own once a report set it, else its pin, else its peers'
        (what ``lbbsp status`` shows); [] before any report, once ``workers`` are checked."""
        ids = worker_ids(workers)
        if not hasattr(self, "models_"):
            return []
        out = [""] * ids.size
        for kind, (positions, _) in self._groups(ids).items():
            for at in positions.tolist():
                out[at] = kind
        return out

    def time_model(self, workers: WorkerIds) -> TimeModel:
        """One time model per kind; a :class:`MixedTime` where the job mixes kinds (a :class:`GroupedTime`,
        searched, where a model of the user's own gives one without ``capacity``)."""
        self._check_is_fitted("models_")
        ids = worker_ids(workers)
        groups = self._groups(ids)
        if len(groups) == 1:
            return self._time_model(next(iter(groups)), ids)
        return grouped(tuple((positions, self._time_model(kind, members))
                             for kind, (positions, members) in groups.items()), ids.size)

    def _time_model(self, kind: str, ids: np.ndarray) -> TimeModel:
        """The ``kind``'s model's time model; where that model has measured nothing yet, the median speed of the
        other kinds' workers (its own fallback, 1 sample/s, had starved the first GPU of a CPU job)."""
        if kind in self.measured_:
            return self.models_[kind].time_model(ids)
        return LinearTime(np.full(ids.size, np.nan_to_num(self._median_speed(), nan=1.0)))

    def _median_speed(self) -> float:
        """The median predicted throughput of the workers whose kind's model has measured something (NaN where none
        has): the cold-start prior of everyone, across kinds."""
        speeds = np.concatenate([np.empty(0)] + [
            predicted_throughput(self.models_[kind], np.array([w for w, k in self.kind_.items() if k == kind],
                                                              dtype=np.int64))
            for kind in self.measured_])
        speeds = speeds[np.isfinite(speeds) & (speeds > 0)]
        return float(np.median(speeds)) if speeds.size else np.nan

    def _groups(self, ids: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Positions of each kind in ``ids``, with the ids at them (read-only: shared by the calls); a worker whose kind
        is not set yet is of the kind ``kinds`` pins (once that kind's model has had reports), else of the kind most
        common among workers of its hardware, then of its device family (a CPU worker that only announced itself, in a
        job of mostly GPUs, had been routed to the GPUs' model and given a GPU's share), else among all workers (the
        kinds whose models have had reports before any is set). Ties go to the first in KINDS: the same in every
        process. Cached until a worker or kind is new, since a decision asks several times for the same workers."""
        key = ids.tobytes()
        cached = getattr(self, "_groups_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        pinned = self.kinds or {}
        kinds = [self.kind_.get(w) or (kind if (kind := pinned.get(w)) in self.fed_ else None) for w in ids.tolist()]
        if None in kinds:
            # among all workers, not those asked: a worker's answer had depended on which others were asked with it
            seen = list(self.kind_.values()) or sorted(self.fed_)
            common = max(KINDS, key=seen.count)
            by_hardware: dict[Hardware | str, list[str]] = {}
            for worker, kind in self.kind_.items():
                hardware = self.hardware_.get(worker)
                if hardware is not None:
                    by_hardware.setdefault(hardware, []).append(kind)
                    by_hardware.setdefault(hardware[0], []).append(kind)
            for at in [i for i, kind in enumerate(kinds) if kind is None]:
                hardware = self.hardware_.get(int(ids[at]))
                peers = by_hardware.get(hardware) or by_hardware.get(hardware[0]) if hardware else None
                kinds[at] = max(KINDS, key=peers.count) if peers else common
        labels = np.array(kinds)
        groups = {}
        for kind in KINDS:
            positions = np.flatnonzero(labels == kind)
            if positions.size:
                members = ids[positions]
                members.flags.writeable = False
                groups[kind] = (positions, members)
        self._groups_cache = (key, groups)
        return groups

    def _per_kind(self, ids: np.ndarray, ask: Callable[[CapacityModel, np.ndarray], np.ndarray | None],
                  fill: float) -> np.ndarray:
        """What ``ask`` answers each kind's model for its workers among ``ids`` (checked ids), ``fill`` where it answers
        None or the kind's model has had no report."""
        out = np.full(ids.size, fill, dtype=float)
        for kind, (positions, members) in self._groups(ids).items():
            if kind in self.fed_:  # a model with no report cannot answer: its workers keep ``fill``
                answer = ask(self.models_[kind], members)
                if answer is not None:
                    out[positions] = answer
        return out


def _or_no_cap(caps: np.ndarray | None) -> np.ndarray | None:
    """A kind's caps as floats, inf where it sets none: NaN (no cap known, as the policies read it; cast to int64 it
    had become -2**63, a cap below every lower bound); None (no caps) as it is."""
    if caps is None:
        return None
    caps = np.asarray(caps, dtype=float)
    return np.where(np.isnan(caps), np.inf, caps)
