"""Federated clients: a round costs local compute plus the model's download and upload, if the client answers.

The client's *batch size* b is what LB-BSP adapts, with the number of local steps fixed (as in the
paper), so one round takes  time_i(b) = transfer_i + local_steps * b / speed_i.  Availability a_i is the
chance that the client completes a round it is asked to do; the samples of a client that drops are lost,
so a round of sizes b brings back sum_i a_i * b_i samples on average.
"""
from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

from ..allocation import LinearTime
from ..config import _integer, _real
from ..errors import ConfigError
from ..protocol import MAX_SECONDS, MAX_WORKERS, Report
from .base import (
    CapacityModel,
    WorkerIds,
    as_reports,
    by_iteration,
    feature,
    field,
    held_back,
    measured_throughput,
    smoothed,
    worker_ids,
)

log = logging.getLogger("lbbsp.models")
#: The most local steps a round may take: a bound, so that every round time stays a float (10**400 had overflowed).
MAX_LOCAL_STEPS = 10**6

#: Report features that tell a model transfer: a report with any of them comes from a federated client.
TRANSFER_FEATURES = frozenset({"download_s", "upload_s", "bandwidth_down", "bandwidth_up"})
#: Measurements in a row that may disagree with a client's provisional level (each replacing it) before one is blended.
_DOUBTS = 3
#: Each transfer direction: the table it is learned in, its measured-seconds feature and its bandwidth feature.
DIRECTIONS = (("download_s_", "download_s", "bandwidth_down"), ("upload_s_", "upload_s", "bandwidth_up"))


class FLClientModel(CapacityModel):
    """Learns each client's compute throughput and model-transfer seconds (exponentially weighted).

    Reports carry ``samples`` (local_steps * batch), ``compute_s`` (local compute only) and features
    ``download_s``/``upload_s``; without those, ``model_bytes`` over ``bandwidth_down``/``bandwidth_up`` (bytes per
    second) gives each direction's seconds (a client that reports bandwidth alone, with ``model_bytes`` None, has no
    transfer time to learn: a warning says so, once). Each direction is learned from the reports that tell it; a
    direction a client never told is its peers' (on similar hardware first), else, with a warning, its other one.
    Availability is learned from :meth:`record_outcomes` (exponentially weighted by
    ``availability_alpha``, starting from the availability of clients on similar hardware, or "available" where
    nothing is known). Clients never seen get the median of clients on similar hardware, for speed, transfer and
    availability alike. Glitches: a client's level stays provisional until a measurement agrees with it within a
    factor ``spike``, and one that does not replaces it (a first compute time of a millisecond had given a client
    nearly the whole batch for 10 rounds), up to ``_DOUBTS`` in a row, when the level is blended; after that, a speed
    or transfer time more than ``spike`` times the level is held back until the client's next measurement confirms
    it (None: no guard), as NARX's.
    """

    speed_: np.ndarray  # per worker id: local compute throughput, samples per second (NaN: never measured)
    download_s_: np.ndarray  # per worker id: seconds of a model download (NaN: never told)
    upload_s_: np.ndarray  # and of an upload

    def __init__(self, local_steps: int = 1, *, alpha: float = 0.5, model_bytes: float | None = None,
                 availability_alpha: float = 0.2, spike: float | None = 4.0) -> None:
        self.local_steps = local_steps
        self.alpha = alpha
        self.model_bytes = model_bytes
        self.availability_alpha = availability_alpha
        self.spike = spike

    @by_iteration
    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> FLClientModel:
        reports = as_reports(reports)
        self._check_params()
        if not reports:  # an iteration nobody reported in: nothing to learn, and an unfitted model stays so
            return self
        self._remember_hardware(reports)
        workers, measured = measured_throughput(reports)
        self._learn("speed_", workers, measured)
        if self.model_bytes is None and not getattr(self, "_warned_model_bytes", False):
            self._warn_bandwidth_alone(reports)
        clients = field(reports, "worker")
        silent = np.logical_and.reduce([np.isnan(feature(reports, name)) for name in TRANSFER_FEATURES]) & (
            field(reports, "samples") > 0)
        for table, timed, bandwidth in DIRECTIONS:
            seconds = np.where(silent, 0.0, self._direction_seconds(reports, timed, bandwidth))
            told = ~np.isnan(seconds)
            self._learn(table, clients[told], seconds[told])
        return self

    def record_outcomes(self, completed: Mapping[int, bool]) -> FLClientModel:
        """Learn availability from one round: for each client asked, whether it completed (False: it sent no
        reply in time, or an error)."""
        self._check_params()
        ids, done = checked_outcomes(completed)
        # a client's first outcome is blended into what similar clients do (available, where nothing is known):
        # blended into 1 instead, a new client on hardware that completes 70% of rounds would rise on its first miss
        self.availability_ = smoothed(getattr(self, "availability_", None), ids, done, self.availability_alpha,
                                      start=self.availability(ids))
        return self

    def availability(self, workers: WorkerIds) -> np.ndarray:
        """The chance each client completes a round it is asked to do; 1 where nothing is known."""
        table = getattr(self, "availability_", np.full(0, np.nan))
        return np.nan_to_num(self._with_prior(table, workers), nan=1.0)

    def predict(self, workers: WorkerIds) -> np.ndarray:
        """Local compute throughput, samples per second."""
        self._check_is_fitted("speed_")
        return self._with_prior(self.speed_, workers)

    def transfer_s(self, workers: WorkerIds) -> np.ndarray:
        """Predicted download + upload seconds per round; a direction no client told is planned as the client's other
        direction (with a warning, once), and 0 when no client ever reported a transfer."""
        self._check_is_fitted("download_s_")
        down, up = self._with_prior(self.download_s_, workers), self._with_prior(self.upload_s_, workers)
        one = np.isnan(down) != np.isnan(up)
        if one.any() and not getattr(self, "_warned_one_direction", False):
            self._warned_one_direction = True
            log.warning("FLClientModel: no %s time is known for client(s) %s, nor for any other client: planned as "
                        "long as the other direction; report download_s and upload_s (or bandwidth_down and "
                        "bandwidth_up)", "download" if np.isnan(down[one]).any() else "upload",
                        worker_ids(workers)[one][:8].tolist())
        return np.nan_to_num(np.where(np.isnan(down), up, down) + np.where(np.isnan(up), down, up), nan=0.0)

    def time_model(self, workers: WorkerIds) -> LinearTime:
        """Round seconds as a function of the client's batch size, local steps fixed; a client given nothing
        is not asked, so it costs no time (no transfer either)."""
        speed = self.predict(workers)
        speed = np.where(np.isfinite(speed) & (speed > 0), speed, 1.0)
        return LinearTime(speed / self.local_steps, overhead=self.transfer_s(workers), idle_is_free=True)

    def _learn(self, table: str, workers: np.ndarray, values: np.ndarray) -> None:
        """Blend ``values`` into the per-client table ``table`` (``speed_``, ``download_s_`` or ``upload_s_``), guarded
        against one glitched measurement (see the class docstring). Its guard's state, per client: ``<table>held_``,
        whose latest was held back; ``<table>settled_``, whose level a measurement agreed with (levels learned with
        ``spike`` None count as settled); ``<table>doubts_``, how many measurements in a row a provisional level
        disagreed with, each replacing it: at ``_DOUBTS`` the level is blended and settled, so that a client whose
        measurements keep alternating past ``spike`` is smoothed, not planned at its latest."""
        old = getattr(self, table, None)
        if self.spike is None or not workers.size:
            setattr(self, table, smoothed(old, workers, values, self.alpha))
            return
        old = np.zeros(0) if old is None else old
        size = max(old.size, int(workers.max()) + 1)
        level = np.concatenate([old, np.full(size - old.size, np.nan)])
        held = _grown(getattr(self, table + "held_", None), size)
        settled = _grown(getattr(self, table + "settled_", ~np.isnan(old)), size)
        doubts = _grown(getattr(self, table + "doubts_", None), size, np.int64)
        now, was_settled = level[workers], settled[workers]
        known = ~np.isnan(now)
        agrees = known & (values <= self.spike * now) & (values * self.spike >= now)
        disagrees = known & ~was_settled & ~agrees
        settles = known & ~was_settled & (agrees | (doubts[workers] + 1 >= _DOUBTS))
        kept = held_back(held, workers, known & was_settled & (values > self.spike * now))
        hold = np.zeros(workers.size, dtype=bool) if kept is None else ~kept
        settled[workers] = was_settled | settles
        doubts[workers] = np.where(disagrees & ~settles, doubts[workers] + 1, 0)
        take = ~known | (disagrees & ~settles)  # a first measurement, or one that replaces a provisional level
        level[workers] = np.where(hold, now, np.where(take, values, self.alpha * values + (1 - self.alpha) * now))
        setattr(self, table, level)
        setattr(self, table + "held_", held)
        setattr(self, table + "settled_", settled)
        setattr(self, table + "doubts_", doubts)

    def _check_params(self) -> None:
        _integer(self.local_steps, "local_steps", 1, MAX_LOCAL_STEPS)
        if self.spike is not None:
            _real(self.spike, "spike", 1.0, np.inf, "None or a factor above 1", lo_open=True, hi_open=True)
        for name in ("alpha", "availability_alpha"):
            _real(getattr(self, name), name, 0.0, 1.0, "in (0, 1]", lo_open=True)
        if self.model_bytes is not None:
            _real(self.model_bytes, "model_bytes", 0.0, 1e15, "a positive number of bytes or None", lo_open=True)

    def _warn_bandwidth_alone(self, reports: Sequence[Report]) -> None:
        """Warn, once per model, of clients that report bandwidth but no transfer seconds while ``model_bytes`` is
        None: their transfers had been planned as no time at all (0.32 s a round where 20.32 s was right), unsaid."""
        alone = (np.isnan(feature(reports, "download_s")) & np.isnan(feature(reports, "upload_s"))
                 & ((feature(reports, "bandwidth_down") > 0) | (feature(reports, "bandwidth_up") > 0)))
        if alone.any():
            self._warned_model_bytes = True
            log.warning("FLClientModel: client(s) %s report bandwidth_down / bandwidth_up but no download_s / "
                        "upload_s, and model_bytes is None, so their transfer time is unknown (taken from clients "
                        "that report one, else 0 s): pass FLClientModel(model_bytes=<the model's size in bytes>), or "
                        "report download_s and upload_s", sorted(set(field(reports, "worker")[alone].tolist()))[:8])

    def _direction_seconds(self, reports: Sequence[Report], timed: str, bandwidth: str) -> np.ndarray:
        """Each report's seconds in one direction, NaN where it does not tell them: the measured ``timed`` seconds,
        else ``model_bytes`` / ``bandwidth`` (a bandwidth of 0, a failed reading, tells nothing; a glitch near 0
        gives at most two days, what a Report carries as measured times: one of 1e308 s had stayed for good)."""
        seconds = feature(reports, timed)
        if self.model_bytes is None:
            return seconds
        rate = feature(reports, bandwidth)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            from_rate = np.where(rate > 0, np.minimum(self.model_bytes / rate, 2 * MAX_SECONDS), np.nan)
        return np.where(np.isnan(seconds), from_rate, seconds)


def checked_outcomes(completed: Mapping[int, bool]) -> tuple[np.ndarray, np.ndarray]:
    """One round's outcomes, ``{client id: completed}``, as (client ids, 1.0 or 0.0 each); a TypeError or
    ConfigError for anything ``record_outcomes`` cannot learn from."""
    if not isinstance(completed, Mapping):
        raise TypeError(f"record_outcomes takes a mapping {{client id: completed}}, got {type(completed).__name__}")
    ids = worker_ids(list(completed.keys()))
    if ids.size and ids.max() >= MAX_WORKERS:  # the table has a row per id up to the largest
        raise ConfigError(f"record_outcomes takes client ids in [0, {MAX_WORKERS - 1}] (MAX_WORKERS - 1, as "
                          f"reports carry them), got {int(ids.max())}: number the clients from 0, as the Flower "
                          "plugin does, rather than passing their node ids")
    outcomes = list(completed.values())
    # a list, not next(..., None): None is itself wrong (it had been taken, and wiped what the client had learnt);
    # NaN is not in (0, 1), and 1+0j, equal to 1, is no real number
    wrong = [v for v in outcomes if not isinstance(v, (bool, np.bool_))
             and not (isinstance(v, numbers.Real) and v in (0, 1))]
    if wrong:
        raise ConfigError(f"record_outcomes takes True or False (or 1 or 0) per client, whether it completed "
                          f"the round, got {wrong[0]!r}")
    return ids, np.array(outcomes, dtype=float)


def _grown(values: np.ndarray | None, size: int, dtype: type = bool) -> np.ndarray:
    """Per-client values (False, or 0, where none yet) grown to ``size`` clients, as a new array."""
    values = np.zeros(0, dtype=dtype) if values is None else values
    return np.concatenate([values, np.zeros(max(size - values.size, 0), dtype=dtype)])
