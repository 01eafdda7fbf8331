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


class FLClientModel(CapacityModel):
    """Learns each client's compute throughput and model-transfer seconds (exponentially weighted).

    Reports carry ``samples`` (local_steps * batch), ``compute_s`` (local compute only) and features
    ``download_s``/``upload_s``; without those, ``model_bytes`` over ``bandwidth_down``/``bandwidth_up``
    gives the transfer time (a client that reports bandwidth alone, with ``model_bytes`` None, has no transfer time
    to learn: a warning says so, once). Availability is learned from :meth:`record_outcomes` (exponentially weighted
    by ``availability_alpha``, starting from the availability of clients on similar hardware, or "available"
    where nothing is known). Clients never seen get the median of clients on
    similar hardware, for speed, transfer and availability alike. A speed more than ``spike`` times a client's level
    is held back until its next measurement confirms it (None: none is), as NARX's: one glitched compute time of a
    microsecond had given a client nearly the whole batch for some 20 rounds. A client's first is taken as it is.
    """

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
        if (kept := self._unless_spike(workers, measured)) is not None:
            workers, measured = workers[kept], measured[kept]
        self.speed_ = smoothed(getattr(self, "speed_", None), workers, measured, self.alpha)
        seconds = self._transfer_seconds(reports)
        told = ~np.isnan(seconds)
        warned = getattr(self, "_warned_model_bytes", False)
        if not told.all() and self.model_bytes is None and not warned:  # some told no transfer seconds
            self._warn_bandwidth_alone(reports)
        self.transfer_s_ = smoothed(getattr(self, "transfer_s_", None), field(reports, "worker")[told], seconds[told],
                                    self.alpha)
        return self

    def record_outcomes(self, completed: Mapping[int, bool]) -> FLClientModel:
        """Learn availability from one round: for each client asked, whether it completed (False: it sent no
        reply in time, or an error)."""
        self._check_params()
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
        done = np.array(outcomes, dtype=float)
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
        """Predicted download + upload seconds per round; 0 when no client ever reported a transfer."""
        self._check_is_fitted("transfer_s_")
        return np.nan_to_num(self._with_prior(self.transfer_s_, workers), nan=0.0)

    def time_model(self, workers: WorkerIds) -> LinearTime:
        """Round seconds as a function of the client's batch size, local steps fixed; a client given nothing
        is not asked, so it costs no time (no transfer either)."""
        speed = self.predict(workers)
        speed = np.where(np.isfinite(speed) & (speed > 0), speed, 1.0)
        return LinearTime(speed / self.local_steps, overhead=self.transfer_s(workers), idle_is_free=True)

    def _unless_spike(self, workers: np.ndarray, speed: np.ndarray) -> np.ndarray | None:
        """Which measurements to learn from (None: all): all but a first one over ``spike`` times the client's level,
        which is held back (``held_``) until the client's next measurement confirms the jump."""
        # the client's own level: a first measurement is taken as it is (peers on other hardware, or of another
        # spread, tell too little: a fast server among phones had been held back)
        table = getattr(self, "speed_", None)
        if self.spike is None or not workers.size or table is None or not table.size:
            return None
        held, size = getattr(self, "held_", np.zeros(0, dtype=bool)), int(workers.max()) + 1
        if held.size < size:
            held = self.held_ = np.concatenate([held, np.zeros(size - held.size, dtype=bool)])
        level = np.where(workers < table.size, table[np.minimum(workers, table.size - 1)], np.nan)
        return held_back(held, workers, speed > self.spike * level)  # not high where the level is unknown (NaN)

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
        alone = [r.worker for r in reports if not {"download_s", "upload_s"} & r.features.keys()
                 and any(r.features.get(name, 0.0) > 0 for name in ("bandwidth_down", "bandwidth_up"))]
        if alone:
            self._warned_model_bytes = True
            log.warning("FLClientModel: client(s) %s report bandwidth_down / bandwidth_up but no download_s / "
                        "upload_s, and model_bytes is None, so their transfer time is unknown (taken from clients "
                        "that report one, else 0 s): pass FLClientModel(model_bytes=<the model's size in bytes>), or "
                        "report download_s and upload_s", sorted(set(alone))[:8])

    def _transfer_seconds(self, reports: Sequence[Report]) -> np.ndarray:
        """Each report's transfer seconds, NaN where it does not tell them. A measurement with no transfer feature
        at all transferred nothing: a worker that once claimed a transfer (a day of it, say) and then reports like
        the training process it is does not keep that claim for good."""
        down, up = feature(reports, "download_s"), feature(reports, "upload_s")
        bandwidth_down, bandwidth_up = feature(reports, "bandwidth_down"), feature(reports, "bandwidth_up")
        timed = ~np.isnan(down) | ~np.isnan(up)
        silent = np.logical_and.reduce([np.isnan(feature(reports, name)) for name in TRANSFER_FEATURES]) & (
            field(reports, "samples") > 0)
        seconds = np.where(timed, np.nan_to_num(down) + np.nan_to_num(up), np.nan)
        if self.model_bytes is not None:
            with np.errstate(divide="ignore"):
                from_bandwidth = (np.where(bandwidth_down > 0, self.model_bytes / bandwidth_down, 0.0)
                                  + np.where(bandwidth_up > 0, self.model_bytes / bandwidth_up, 0.0))
            # a direction measured at 0 (a failed reading) tells nothing: it had counted as free, 4 s where 8 s was right
            from_bandwidth[(bandwidth_down == 0) | (bandwidth_up == 0)] = np.nan
            # a bandwidth near 0 (a glitch) would give a time no average recovers from: at most what a Report
            # carries as measured transfer times, a day each way
            seconds = np.where(timed | (from_bandwidth <= 0), seconds, np.minimum(from_bandwidth, 2 * MAX_SECONDS))
        return np.where(silent, 0.0, seconds)
