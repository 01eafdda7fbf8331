"""The contract every capacity model follows, in the scikit-learn manner.

A capacity model learns each worker's speed from the reports of past iterations and predicts its
throughput for the next one. ``__init__`` only stores keyword arguments; learned state ends in ``_``.

Learning that the next forecast does not need (training a network, for example) may wait:
``partial_fit(reports, defer=True)`` updates what the coming decision reads and keeps the rest for
:meth:`CapacityModel.finish_learning`, which a coordinator calls after it has written the split. The next
``partial_fit`` finishes anything still pending first, so nothing is ever skipped.

Cold start: every model remembers each reporting worker's hardware (device family, cores), also from
reports with ``samples == 0``, which a joining worker can send to announce itself. A worker with no
throughput history of its own is predicted from the median of workers on similar hardware.
"""
from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

import numpy as np
from sklearn import exceptions
from sklearn.base import BaseEstimator

if TYPE_CHECKING:  # scikit-learn ships no types: a model subclassing it had been Any to its users' type checkers
    class _Estimator:
        """What CapacityModel takes from scikit-learn's BaseEstimator, as a type checker sees it."""

        def get_params(self, deep: bool = True) -> dict[str, Any]: ...
        def set_params(self, **params: Any) -> Self: ...
        def __setstate__(self, state: dict[str, Any]) -> None: ...
else:
    _Estimator = BaseEstimator

from ..allocation import LinearTime, TimeModel, numbers_per_worker
from ..errors import ConfigError, LBBSPError
from ..protocol import Report

#: What a model knows about a worker's hardware: (device family, cores); cores 0 when not reported.
Hardware = tuple[str, int]
#: Worker ids as callers hold them: a sequence of ints or an integer array.
WorkerIds = Sequence[int] | np.ndarray

_DEVICE_INDEX = re.compile(r"[:/]\d+$")


def worker_ids(workers: WorkerIds) -> np.ndarray:
    """``workers`` (one id, or a 1-D sequence of them) as a flat int64 array; a clear error for a negative id
    (numpy would wrap it to the last), for ids that are not integers (0.9 and "1" had been read as workers 0 and
    1), and for a table of ids (a 2-D one had been flattened, its predictions no longer matching its shape)."""
    given = np.asarray(workers)
    if given.ndim > 1:
        raise ConfigError(f"worker ids must be one id or a 1-D sequence of them, got an array of shape {given.shape}")
    if given.size and given.dtype.kind not in "iu":
        odd = [w for w in given.flat if not isinstance(w, int) or isinstance(w, bool)]
        if not odd:  # Python ints, one past uint64 (numpy holds them as objects)
            raise ConfigError(f"worker ids must be integers in [0, 2**63 - 1], got {max(given.flat, key=abs)}")
        raise ConfigError(f"worker ids must be integers, got {given.dtype} values such as {odd[0]!r}")
    if given.dtype.kind == "u" and given.size and given.max() > np.iinfo(np.int64).max:  # the cast would wrap it
        raise ConfigError(f"worker ids must be integers in [0, 2**63 - 1], got {int(given.max())}")
    ids = given.astype(np.int64).reshape(-1)
    if ids.size and ids.min() < 0:
        raise ConfigError(f"worker ids must be >= 0, got {int(ids.min())}")
    return ids


#: What a model's ``max_batch`` answers for a worker it sets no memory cap for, where it caps others (an int64
#: array holds no NaN or inf; a quarter of int64's range, so that sums of a few caps do not wrap).
NO_CAP = int(np.iinfo(np.int64).max // 4)


def whole_caps(caps: np.ndarray, nan: int = 0) -> np.ndarray:
    """Caps in samples as whole int64s: rounded down, none below 0, and ``NO_CAP`` at or past it (inf included),
    ``nan`` for NaN. Exact at the top, where a float's clip to ``NO_CAP`` (2**61 - 1) had read 2**61."""
    values = np.floor(np.nan_to_num(np.asarray(caps, dtype=float), nan=float(nan)))  # inf: the largest float
    out = np.full(values.shape, NO_CAP, dtype=np.int64)
    below = values < NO_CAP
    out[below] = np.maximum(values[below], 0)
    return out


#: What :func:`predicted_throughput` tells a model of one's own that ``predict`` must return.
THROUGHPUT = "one throughput (samples/s) per worker asked, at least 0, NaN where unknown"


def predicted_throughput(model: CapacityModel, workers: np.ndarray) -> np.ndarray:
    """``model.predict(workers)`` as one float per worker, or a ConfigError naming the model: a model of one's own that
    answered with the wrong length, or with no numbers, had failed deep inside each decision (a broadcast error,
    ``isnan`` on strings); one that answered inf had its worker given nearly the whole batch, and a negative
    throughput was read as "never finishes". NaN is "unknown" (the median speed fills it); a list is taken as its
    array."""
    source = f"{type(model).__name__}.predict"
    values = numbers_per_worker(model.predict(workers), len(workers), source, THROUGHPUT).astype(float, copy=False)
    wrong = np.flatnonzero(np.isinf(values) | (values < 0))
    if wrong.size:
        raise ConfigError(f"{source} returned {values[wrong[0]]:.6g} for worker(s) "
                          f"{np.asarray(workers)[wrong][:8].tolist()}: it must return {THROUGHPUT}")
    return values


class CheckedReports(list[Report]):
    """Reports :func:`as_reports` has checked and put in iteration order, or a sub-list of them kept in order: they
    pass through it again unchecked (a policy checks them, then its model, then each model of a mixed job). Their
    fields are read into arrays once (:func:`field`, :func:`feature`) and shared by all who read them: each pass
    over a thousand reports in Python cost 0.1-0.3 ms, and one decision had made about fifteen."""

    __slots__ = ("_columns",)

    def __init__(self, reports: Iterable[Report] = ()) -> None:
        super().__init__(reports)
        self._columns: dict[Any, Any] = {}

    def subset(self, positions: Sequence[int] | np.ndarray) -> CheckedReports:
        """The reports at ``positions`` (ascending), in order, with the arrays of the fields read so far taken along
        (a list field is read again: as quick as slicing it)."""
        at = np.asarray(positions, dtype=np.int64)
        out = CheckedReports(map(self.__getitem__, at.tolist()))
        for key, values in self._columns.items():
            if isinstance(values, np.ndarray):
                out._columns[key] = _read_only(values[at])
        return out


#: How :func:`field` reads each field (a comprehension: about 30 us for a thousand reports, where ``map`` with
#: ``attrgetter`` took 40-60 us), with the dtype of the numbers' array; None: a list.
_FIELDS: dict[str, tuple[Callable[[Sequence[Report]], list[Any]], type | None]] = {
    "worker": (lambda reports: [r.worker for r in reports], np.int64),
    "iteration": (lambda reports: [r.iteration for r in reports], np.int64),
    "samples": (lambda reports: [r.samples for r in reports], float),
    "compute_s": (lambda reports: [r.compute_s for r in reports], float),
    "features": (lambda reports: [r.features for r in reports], None),
    "device": (lambda reports: [r.device for r in reports], None),
}


def field(reports: Sequence[Report], name: str) -> Any:
    """Field ``name`` of every report: an array for the numbers (``worker``, ``iteration``: int64; ``samples``,
    ``compute_s``: float), a list for ``features`` and ``device``. Read once per :class:`CheckedReports` and then
    shared, so the arrays are read-only: take a copy to change one."""
    columns = reports._columns if type(reports) is CheckedReports else None
    if columns is not None and name in columns:
        return columns[name]
    read, dtype = _FIELDS[name]
    values = read(reports) if dtype is None else _read_only(np.fromiter(read(reports), dtype, len(reports)))
    if columns is not None:
        columns[name] = values
    return values


def feature(reports: Sequence[Report], name: str, missing: float = np.nan) -> np.ndarray:
    """Feature ``name`` of every report as a read-only float array, ``missing`` where a report lacks it; read once
    per :class:`CheckedReports` (and ``missing``)."""
    columns = reports._columns if type(reports) is CheckedReports else None
    key = (name, missing) if missing == missing else (name, None)  # NaN, the usual missing, never equals itself
    if columns is not None and key in columns:
        return cast(np.ndarray, columns[key])
    values = _read_only(feature_column(field(reports, "features"), name, missing))
    if columns is not None:
        columns[key] = values
    return values


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


def as_reports(reports: Sequence[Report] | Iterable[Report] | Report, caller: str = "partial_fit") -> CheckedReports:
    """One iteration's reports as a sequence: one report alone is a list of one, any other iterable a list;
    reports of several iterations in iteration order (a stable sort where they were not: :func:`by_iteration`
    learns them one iteration at a time; a model without it takes a worker's last report as its latest). A
    TypeError, in ``caller``'s name, names the first item that is not a :class:`Report` (a decoded dict, a
    report's JSON)."""
    if type(reports) is CheckedReports:
        return reports
    if isinstance(reports, Report):
        return CheckedReports((reports,))
    if not isinstance(reports, (list, tuple)):
        if isinstance(reports, (str, bytes, Mapping)) or not isinstance(reports, Iterable):
            raise TypeError(f"{caller} takes a list of lbbsp.Report, got {type(reports).__name__}")
        reports = list(reports)
    if not all(map(isinstance, reports, repeat(Report))):
        bad = next(item for item in reports if not isinstance(item, Report))
        raise TypeError(f"{caller} takes a list of lbbsp.Report, got a {type(bad).__name__} in it "
                        "(Report.from_json reads one from its JSON)")
    checked = CheckedReports(reports)
    iterations = field(checked, "iteration")
    if (iterations[1:] < iterations[:-1]).any():
        return CheckedReports(sorted(reports, key=attrgetter("iteration")))
    return checked


_PartialFit = TypeVar("_PartialFit", bound=Callable[..., Any])


def by_iteration(partial_fit: _PartialFit) -> _PartialFit:
    """Decorates a model's ``partial_fit`` so that reports of several iterations given at once are learnt one
    iteration at a time, in order, as :meth:`CapacityModel.fit` replays them (an EWMA given three iterations had
    learnt only each worker's last one). One iteration's reports, the coordinator's every call, pass straight on."""
    @functools.wraps(partial_fit)
    def learn(self: CapacityModel, reports: Sequence[Report] | Report, *, defer: bool = False) -> Any:
        checked = as_reports(reports)
        iterations = field(checked, "iteration")  # in order, read once by as_reports already
        if len(checked) < 2 or iterations[0] == iterations[-1]:
            return partial_fit(self, checked, defer=defer)
        for positions in np.split(np.arange(len(checked)), np.flatnonzero(np.diff(iterations)) + 1):
            partial_fit(self, checked.subset(positions), defer=defer)
        return self
    return cast(_PartialFit, learn)


class NotFittedError(LBBSPError, exceptions.NotFittedError):
    """A model was asked to predict before it saw any report (also scikit-learn's NotFittedError)."""


def learnt_availability(model: object, workers: np.ndarray) -> np.ndarray | None:
    """Each of ``workers``' chance of completing a round it is asked to do, where ``model`` learns availability (an
    ``availability(workers)`` method and ``record_outcomes``, as :class:`FLClientModel` and
    :class:`AutoCapacityModel` have); None where it does not (an ``availability`` that is a parameter, or a method
    without outcomes to learn from, means something else). A ConfigError naming the model where the answer is not one
    number per worker."""
    if not learns_availability(model):
        return None
    return numbers_per_worker(model.availability(workers), workers.size,  # type: ignore[attr-defined]
                              f"{type(model).__name__}.availability", "one chance per worker").astype(float)


def learns_availability(model: object) -> bool:
    """Whether ``model`` learns availability: an ``availability(workers)`` method and ``record_outcomes``."""
    return callable(getattr(model, "availability", None)) and callable(getattr(model, "record_outcomes", None))


def held_back(held: np.ndarray, workers: np.ndarray, high: np.ndarray) -> np.ndarray | None:
    """Which of ``workers``' measurements to learn from (None: all): all but each worker's first that is ``high`` (past
    a model's spike factor), held back until its next measurement confirms the jump. ``held`` (per worker id: whose
    latest was held back) is updated in place. Shared by the models that guard against one glitched measurement."""
    hold = high & ~held[workers]
    held[workers] = hold
    return ~hold if hold.any() else None


def device_family(device: str) -> str:
    """A report's device as a lower-case family name, so that every kind test reads devices alike: "cuda:3" and
    "CUDA:A100" -> "cuda", TensorFlow's "/device:GPU:0" (and its longer "/job:.../device:GPU:0") -> "gpu", "" -> "cpu"
    (a GPU worker falling back to "CPU" or "cpu:0" had not been seen to move off the GPU curve)."""
    name = device.strip().lower()
    if "device:" in name:
        name = name[name.rfind("device:") + len("device:"):]
    return name.split(":", 1)[0].strip() or "cpu"


def hardware_of(report: Report) -> Hardware:
    """The hardware key of a report: its device, lower-cased, without a trailing index ("cuda:3" -> "cuda", "cuda:A100"
    -> "cuda:a100") or
    TensorFlow's task path ("/job:worker/replica:0/task:1/device:GPU:0" -> "gpu": it had made each task's GPU
    hardware of its own, so a new one got no peers' prior), and cores."""
    name = report.device.strip().lower()
    if "device:" in name:
        name = name[name.rfind("device:") + len("device:"):]
    return _DEVICE_INDEX.sub("", name) or "cpu", int(report.features.get("cores", 0))


def similar_hardware_prior(values: Mapping[int, float], hardware: Mapping[int, Hardware],
                           workers: WorkerIds, default: float = np.nan) -> np.ndarray:
    """For each worker, the median of ``values`` over workers with the same hardware, then the same
    device family, then all workers; ``default`` when nothing at all is known. Pure function."""
    known = np.fromiter(values.keys(), dtype=np.int64, count=len(values))
    asked = worker_ids(workers)
    codes, family_of = _number_hardware(list(map(hardware.get, known.tolist() + asked.tolist())))
    return _prior(np.fromiter(values.values(), dtype=float, count=len(values)), codes[:known.size],
                  codes[known.size:], family_of, default)


def _number_hardware(keys: Sequence[Hardware | None]) -> tuple[np.ndarray, np.ndarray]:
    """(Each of ``keys`` as a number, -1 for None; each number's device family as a number, and -1 last, which -1
    reads), so that the prior groups workers in array operations."""
    distinct = [key for key in dict.fromkeys(keys) if key is not None]
    code: dict[Hardware | None, int] = dict(zip(distinct, range(len(distinct))))
    code[None] = -1
    families = list(dict.fromkeys(key[0] for key in distinct))
    family_of = np.array([families.index(key[0]) for key in distinct] + [-1], dtype=np.int64)
    return np.fromiter(map(code.__getitem__, keys), dtype=np.int64, count=len(keys)), family_of


def _prior(values: np.ndarray, known: np.ndarray, asked: np.ndarray, family_of: np.ndarray,
           default: float = np.nan) -> np.ndarray:
    """:func:`similar_hardware_prior` in array operations, from the workers' hardware as :func:`_number_hardware` numbers
    them: ``values`` of the workers of hardware ``known``, the prior for workers of hardware ``asked``. It runs at
    every predict that asks for a worker with no history: a loop in Python over the workers with one had taken
    1.4 ms a predict at 1,024 workers."""
    finite = np.isfinite(values)
    if not finite.any():
        return np.full(asked.size, default, dtype=float)
    order = np.argsort(values[finite])  # sorted once: a group's median is then its middle
    values, known = values[finite][order], known[finite][order]
    overall = (values[(values.size - 1) // 2] + values[values.size // 2]) / 2
    by_exact = _group_medians(known, values, family_of.size - 1)[asked]
    by_family = _group_medians(family_of[known], values, int(family_of.max()) + 1)[family_of[asked]]
    return np.where(np.isnan(by_exact), np.where(np.isnan(by_family), overall, by_family), by_exact)


def _group_medians(groups: np.ndarray, ordered: np.ndarray, count: int) -> np.ndarray:
    """The median of the values ``ordered`` (ascending) in each of groups 0 to ``count`` - 1, NaN for a group with
    none, and NaN last, which index -1 reads: a value of group -1 is in none."""
    inside = groups >= 0
    groups = groups[inside]
    ordered = ordered[inside][np.argsort(groups, kind="stable")]  # by group, each group's values still ascending
    sizes = np.bincount(groups, minlength=count)
    low = np.cumsum(sizes) - sizes + (sizes - 1) // 2
    high = low + (sizes % 2 == 0)
    out = np.full(count + 1, np.nan)
    filled = sizes > 0
    out[:count][filled] = (ordered[low[filled]] + ordered[high[filled]]) / 2  # np.median's mean of the middle two
    return out


#: The methods a model of one's own must define, with their signatures: every other one has a default.
CONTRACT = {"partial_fit": "partial_fit(reports, *, defer=False) -> self",
            "predict": "predict(workers) -> throughput per worker (samples/s)"}


def check_contract(model: CapacityModel) -> None:
    """A ConfigError naming ``model``'s class and method where it leaves ``partial_fit`` or ``predict`` to the base
    class, or its ``partial_fit`` takes no ``defer`` keyword: each had failed every decision of a running job (the
    split kept, logged), and a simulated run read as BSP's. Once, where a policy takes the model."""
    name = type(model).__name__
    for method, signature in CONTRACT.items():
        given = getattr(type(model), method, None)
        if given is getattr(CapacityModel, method) or not callable(given):
            raise ConfigError(f"{name} must define {signature}: CapacityModel leaves {method} to each model "
                              "(docs/models.md)")
    try:
        inspect.signature(model.partial_fit).bind([], defer=True)
    except TypeError:
        raise ConfigError(f"{name}.partial_fit must take the keyword defer: {CONTRACT['partial_fit']} (or **kwargs; "
                          "a model with nothing to defer ignores it): the policies call partial_fit(reports, "
                          "defer=True)") from None
    except ValueError:  # no signature to read (a callable written in C): trusted
        pass


class CapacityModel(_Estimator):
    """Base class: ``partial_fit`` one iteration's reports, ``predict`` next-iteration throughput. A scikit-learn
    estimator: ``get_params``, ``set_params`` and ``sklearn.base.clone`` work on every model."""

    #: Parameters that shape what a model learns (array widths, a network's layers): see :meth:`set_params`.
    _STRUCTURAL: frozenset[str] = frozenset()
    _forgotten_for: list[str] | None = None  # the parameters whose new values made the model forget, until it relearns
    hardware_codes_: tuple[np.ndarray, np.ndarray] | None  # the cold-start prior's numbering (_hardware_codes)

    def set_params(self, **params: Any) -> Self:
        """scikit-learn's ``set_params``, checked at once: a bad value is a ConfigError and changes nothing. A new
        value of a parameter that shapes what was learned (``window``, ``lags``, ...) makes a fitted model forget
        it, as :meth:`fit` does, so that the model relearns with the value instead of ignoring it."""
        before = self.get_params(deep=False)
        for name in params:
            outer = name.partition("__")[0]
            if outer not in before:  # before anything is set: scikit-learn's message showed the values it had set
                raise ValueError(f"Invalid parameter {outer!r} for {type(self).__name__}; valid parameters are "
                                 f"{sorted(before)}")
            if outer != name and not hasattr(before[outer], "set_params"):  # scikit-learn would call it
                raise ValueError(f"Invalid parameter {name!r} for {type(self).__name__}: {outer!r} is not an "
                                 f"estimator with parameters of its own; pass a whole new {outer}= instead")
        try:
            super().set_params(**params)
            self._check_params()
        # a bad value, a value of the wrong type that a check read as another (TypeError), or a misspelt nested name
        # (scikit-learn sets the names before it): all put back, so a fitted model is left as it was
        except (ConfigError, ValueError, TypeError):
            super().set_params(**{name: before[name] for name in params if name in before})
            raise
        changed = {name for name, value in params.items() if name in before and _changed(before[name], value)}
        if changed & self._STRUCTURAL:
            self._forget()
            self._forgotten_for = sorted(changed & self._STRUCTURAL)  # said where it is asked before it relearns
        elif changed:
            self._parameters_changed(changed)
        return self

    def _parameters_changed(self, names: set[str]) -> None:
        """Apply new values of ``names`` (none structural) to what was learned, where a model caches what they
        shape; otherwise they apply from the next update."""

    def fit(self, history: Iterable[Sequence[Report]] | Iterable[Report], y: None = None) -> Self:
        """Forget what was learned, then learn from each iteration's reports in order: ``history`` holds one
        list of reports per iteration, or is one flat list of reports, taken iteration by iteration. ``y`` is
        scikit-learn's place for targets, which reports carry themselves: a TypeError if given."""
        if y is not None:
            raise TypeError("fit takes the workers' reports alone, fit(history), not fit(X, y): each lbbsp.Report "
                            "carries its samples and seconds (docs/models.md)")
        if isinstance(history, (str, bytes, Mapping, Report)) or not isinstance(history, Iterable):
            raise TypeError(f"fit takes a history: one list of reports per iteration, or one flat list of reports, "
                            f"got {type(history).__name__}")
        iterations: list[Any] = list(history)
        flat = [isinstance(item, Report) for item in iterations]
        if any(flat):
            if not all(flat):
                raise TypeError("fit takes one list of reports per iteration, or one flat list of reports; this "
                                "history mixes reports with lists")
            by_iteration: dict[int, list[Report]] = {}
            for report in iterations:
                by_iteration.setdefault(report.iteration, []).append(report)
            iterations = [by_iteration[k] for k in sorted(by_iteration)]
        checked = [as_reports(reports, "fit") for reports in iterations]  # in fit's name: partial_fit was not called
        self._forget()
        for reports in checked:
            self.partial_fit(reports)
        return self

    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> CapacityModel:
        """Learn from one iteration's reports (one report alone is taken as a list of one: :func:`as_reports`,
        which every model calls first); ``defer``: keep what the next forecast can do without for
        :meth:`finish_learning` (a model with nothing to defer ignores it)."""
        raise NotImplementedError(f"{type(self).__name__} must define {CONTRACT['partial_fit']} (docs/models.md)")

    def finish_learning(self) -> CapacityModel:
        """Do the learning that ``partial_fit(..., defer=True)`` left for later; nothing unless a model defers."""
        return self

    def predict(self, workers: WorkerIds) -> np.ndarray:
        """Predicted samples per second for each worker; a similar-hardware prior for a worker with no
        history, NaN only when no worker has any."""
        raise NotImplementedError(f"{type(self).__name__} must define {CONTRACT['predict']} (docs/models.md)")

    def time_model(self, workers: WorkerIds) -> TimeModel:
        """Predicted time as a function of batch size; linear in the size unless a model knows better. A worker
        with no forecast (NaN) is taken at the median speed; one predicted at 0 never finishes."""
        speed = predicted_throughput(self, worker_ids(workers))
        unknown = np.isnan(speed)
        if not unknown.any():  # the usual case: no median to take (about 20 us at 1,024 workers)
            return LinearTime(speed)
        known = speed > 0
        fill = float(np.median(speed[known])) if known.any() else 1.0
        return LinearTime(np.where(unknown, fill, speed))

    def max_batch(self, workers: WorkerIds) -> np.ndarray | None:
        """The largest batch each worker can hold (GPU memory; ``NO_CAP`` or NaN where it sets none), or None when
        the model caps no worker."""
        worker_ids(workers)  # a bad id is an error here too, as in every model that sets a cap
        return None

    def explore(self, workers: WorkerIds, sizes: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        """Sizes nudged to learn what the model does not know yet (same sum, within bounds); as is by default."""
        return sizes

    def _check_params(self) -> None:
        """Raise a ConfigError naming the first parameter out of its range; a model with parameters overrides it."""

    def _forget(self) -> None:
        """Drop everything learned (the attributes ending in ``_``): the next ``partial_fit`` starts afresh."""
        for name in [n for n in vars(self) if n.endswith("_") and not n.startswith("_")]:
            delattr(self, name)
        self._forgotten_for = None

    def _check_is_fitted(self, attribute: str) -> None:
        if not hasattr(self, attribute):
            if changed := self._forgotten_for:
                raise NotFittedError(f"{type(self).__name__} forgot what it had learned when set_params changed "
                                     f"{', '.join(changed)}; call fit or partial_fit again")
            raise NotFittedError(f"{type(self).__name__} has seen no report yet; call partial_fit first")

    def _remember_hardware(self, reports: Sequence[Report]) -> None:
        """Record each reporting worker's hardware key in ``hardware_`` (for the cold-start prior)."""
        if not hasattr(self, "hardware_"):
            self.hardware_: dict[int, Hardware] = {}
        known = self.hardware_
        ids = field(reports, "worker").tolist()
        if all(map(known.__contains__, ids)):  # the usual case: every worker seen before
            return
        for at, worker in enumerate(ids):
            if worker not in known:  # hardware does not change under a running worker
                known[worker] = hardware_of(reports[at])
                self.hardware_codes_ = None

    def _with_prior(self, values: np.ndarray, workers: WorkerIds) -> np.ndarray:
        """``values`` (indexed by worker id, NaN where unknown) for ``workers``, the similar-hardware prior
        where a worker has none."""
        ids = worker_ids(workers)
        if ids.size and ids.max() < values.size:
            out = values[ids]
            if np.isfinite(out).all():  # the usual case: every worker asked has a value, no prior to take
                return out
        out = np.full(ids.size, np.nan)
        inside = ids < values.size
        out[inside] = values[ids[inside]]
        missing = ~np.isfinite(out)
        if missing.any():
            codes, family_of = self._hardware_codes()
            known = np.flatnonzero(np.isfinite(values))
            last = codes.size - 1  # ids past the table read its last entry, -1: no hardware known
            out[missing] = _prior(values[known], codes[np.minimum(known, last)], codes[np.minimum(ids[missing], last)],
                                  family_of)
        return out

    def _hardware_codes(self) -> tuple[np.ndarray, np.ndarray]:
        """(Each worker id's hardware as a :func:`_number_hardware` number, -1 where unknown, and -1 last; each number's
        device family), made again only after a new worker's hardware is recorded."""
        cached = getattr(self, "hardware_codes_", None)
        if cached is None:
            hardware = getattr(self, "hardware_", {})
            ids = np.fromiter(hardware.keys(), dtype=np.int64, count=len(hardware))
            codes, family_of = _number_hardware(list(hardware.values()))
            table = np.full(int(ids.max(initial=-1)) + 2, -1, dtype=np.int64)
            table[ids] = codes
            cached = self.hardware_codes_ = (table, family_of)
        return cached


def _changed(old: Any, new: Any) -> bool:
    """Whether a parameter's new value differs from its old one (``==`` of values such as tuples and numbers; a
    list equals the tuple of the same items, as the parameters take either)."""
    if old is new:
        return False
    try:
        return bool(_as_tuple(old) != _as_tuple(new))
    except (TypeError, ValueError):  # values that do not compare to one bool: take them as changed
        return True


def _as_tuple(value: Any) -> Any:
    """A list or tuple as a tuple, nested ones too; any other value as it is."""
    return tuple(map(_as_tuple, value)) if isinstance(value, (list, tuple)) else value


def smoothed(table: np.ndarray | None, workers: np.ndarray, values: np.ndarray, alpha: float,
             start: float | np.ndarray | None = None) -> np.ndarray:
    """A per-worker-id table (NaN where unknown, grown as ids appear) with ``values`` blended in at ``workers``
    by exponential weighting: alpha * new + (1 - alpha) * old, the first value taken as is, or blended into
    ``start`` when one is given (one value, or one per worker in ``workers``). Pure function."""
    size = int(workers.max()) + 1 if workers.size else 0
    if table is None:
        table = np.full(size, np.nan)
    elif table.size < size:
        table = np.concatenate([table, np.full(size - table.size, np.nan)])
    else:
        table = table.copy()
    previous = table[workers]
    if start is not None:
        previous = np.where(np.isnan(previous), start, previous)
    table[workers] = np.where(np.isnan(previous), values, alpha * values + (1 - alpha) * previous)
    return table


def feature_column(features: Sequence[Mapping[str, float]], name: str, missing: float = np.nan) -> np.ndarray:
    """Feature ``name`` of every report's features, ``missing`` where one lacks it (a C-level lookup per value)."""
    try:
        return np.fromiter(map(itemgetter(name), features), dtype=float, count=len(features))
    except KeyError:
        plain = cast(Sequence[dict[str, float]], features)  # a Report keeps its features as a dict
        return np.fromiter(map(dict.get, plain, repeat(name), repeat(missing)), dtype=float, count=len(features))


def measured(reports: Sequence[Report]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(worker ids, samples, compute seconds) of the reports that measured something, as arrays."""
    samples, seconds = field(reports, "samples"), field(reports, "compute_s")
    kept = (samples > 0) & (seconds > 0)
    return field(reports, "worker")[kept], samples[kept], seconds[kept]


def measured_throughput(reports: Sequence[Report]) -> tuple[np.ndarray, np.ndarray]:
    """(worker ids, samples per second) of the reports that measured something, as arrays."""
    workers, samples, seconds = measured(reports)
    return workers, samples / seconds
