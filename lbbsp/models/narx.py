"""CPU workers on shared machines: a NARX forecast of next-iteration throughput.

NARX = nonlinear autoregression with exogenous inputs. One small MLP is shared by all workers (so it
learns from every report and costs one forward pass per decision). It is scale-free: the inputs are the
worker's recent log-throughputs relative to its latest one, the gap between its EWMA level and its latest
throughput, and the last ``exog_lags`` values of its resource features; the target is the log-ratio of the
next throughput to the latest one. An untrained network outputs about zero, i.e. the last value, and
until ``warmup`` updates have run the model answers with the EWMA level instead.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from sklearn.neural_network import MLPRegressor

from ..errors import ConfigError
from ..protocol import Report
from .base import CapacityModel

DEFAULT_FEATURES = ("cpu_util", "proc_cpu", "colocated_load", "mem_util")


class NARXThroughput(CapacityModel):
    """Online NARX(p=lags, q=exog_lags) throughput forecaster, trained with ``MLPRegressor.partial_fit``.

    Training pairs go to a replay buffer of ``buffer_size`` rows; each ``partial_fit`` takes one gradient
    epoch over at most ``rows_per_update`` rows (the newest first, then random older ones), which keeps
    the cost per decision bounded at any cluster size.
    """

    def __init__(self, lags: int = 4, exog_lags: int = 2, features: Sequence[str] = DEFAULT_FEATURES, *,
                 hidden: tuple[int, ...] = (16,), alpha_ewma: float = 0.3, learning_rate: float = 3e-3,
                 buffer_size: int = 4096, rows_per_update: int = 256, warmup: int = 30,
                 random_state: int = 0) -> None:
        self.lags = lags
        self.exog_lags = exog_lags
        self.features = features
        self.hidden = hidden
        self.alpha_ewma = alpha_ewma
        self.learning_rate = learning_rate
        self.buffer_size = buffer_size
        self.rows_per_update = rows_per_update
        self.warmup = warmup
        self.random_state = random_state

    # -- learning ----------------------------------------------------------------------------------------
    def partial_fit(self, reports: Sequence[Report]) -> "NARXThroughput":
        if not hasattr(self, "net_"):
            self._initialise()
        self._remember_hardware(reports)
        measured = [(r.worker, r.throughput, r.features) for r in reports if r.throughput > 0]
        if not measured:
            return self
        workers = np.fromiter((m[0] for m in measured), dtype=np.int64, count=len(measured))
        self._grow(int(workers.max()) + 1)
        log_thr = np.log([m[1] for m in measured])
        exog = np.array([[f.get(name, 0.0) for name in self.features] for _, _, f in measured], dtype=float)
        ready = self.count_[workers] >= self.lags  # these have a full input row from before this report
        if ready.any():
            rows = self._inputs(workers[ready])
            targets = log_thr[ready] - self.log_thr_[workers[ready], -1]
            self._remember_pairs(rows, targets)
            self._train()
        # shift the new measurement into each worker's history
        self.log_thr_[workers] = np.concatenate([self.log_thr_[workers, 1:], log_thr[:, None]], axis=1)
        self.exog_[workers] = np.concatenate([self.exog_[workers, 1:], exog[:, None, :]], axis=1)
        fresh = self.count_[workers] == 0
        self.log_level_[workers] = np.where(
            fresh, log_thr, self.alpha_ewma * log_thr + (1 - self.alpha_ewma) * self.log_level_[workers])
        self.count_[workers] += 1
        return self

    def predict(self, workers: Sequence[int]) -> np.ndarray:
        self._check_is_fitted("net_")
        workers_arr = np.asarray(list(workers), dtype=np.int64)
        known = (workers_arr < self.count_.size) & (self.count_[np.minimum(workers_arr, self.count_.size - 1)] > 0)
        out = np.full(workers_arr.size, np.nan)
        if known.any():
            seen = workers_arr[known]
            if self.updates_ >= self.warmup:
                full = self.count_[seen] >= self.lags
                forecast = np.exp(self.log_level_[seen])
                if full.any():
                    delta = np.clip(self.net_.predict(self._inputs(seen[full])), -3.0, 3.0)
                    forecast[full] = np.exp(self.log_thr_[seen[full], -1] + delta)
                out[known] = forecast
            else:
                out[known] = np.exp(self.log_level_[seen])
        if not known.all():
            levels = {int(w): float(np.exp(self.log_level_[w])) for w in np.flatnonzero(self.count_ > 0)}
            out[~known] = self._with_prior(levels, workers_arr[~known].tolist())
        return out

    # -- helpers -----------------------------------------------------------------------------------------
    def _initialise(self) -> None:
        if not (isinstance(self.lags, int) and self.lags >= 1 and isinstance(self.exog_lags, int)
                and 0 <= self.exog_lags <= self.lags):
            raise ConfigError(f"need lags >= 1 and 0 <= exog_lags <= lags, got {self.lags}, {self.exog_lags}")
        if not 0 < self.alpha_ewma <= 1:
            raise ConfigError(f"alpha_ewma must be in (0, 1], got {self.alpha_ewma}")
        self.net_ = MLPRegressor(hidden_layer_sizes=self.hidden, learning_rate_init=self.learning_rate,
                                 alpha=1e-4, random_state=self.random_state)
        self.rng_ = np.random.default_rng(self.random_state)
        width = self.lags + self.exog_lags * len(self.features)
        self.buffer_x_ = np.empty((self.buffer_size, width))
        self.buffer_y_ = np.empty(self.buffer_size)
        self.buffered_ = 0  # rows ever written; the ring position is buffered_ % buffer_size
        self.updates_ = 0
        self.log_thr_ = np.zeros((0, self.lags))
        self.exog_ = np.zeros((0, max(self.exog_lags, 1), len(self.features)))
        self.log_level_ = np.zeros(0)
        self.count_ = np.zeros(0, dtype=np.int64)

    def _grow(self, size: int) -> None:
        extra = size - self.count_.size
        if extra > 0:
            self.log_thr_ = np.vstack([self.log_thr_, np.zeros((extra, self.lags))])
            self.exog_ = np.concatenate([self.exog_, np.zeros((extra, *self.exog_.shape[1:]))])
            self.log_level_ = np.concatenate([self.log_level_, np.zeros(extra)])
            self.count_ = np.concatenate([self.count_, np.zeros(extra, dtype=np.int64)])

    def _inputs(self, workers: np.ndarray) -> np.ndarray:
        """One input row per worker from its history: lagged log-ratios, EWMA gap, lagged features."""
        history = self.log_thr_[workers]
        last = history[:, -1:]
        parts = [history[:, :-1] - last, self.log_level_[workers][:, None] - last]
        if self.exog_lags:
            parts.append(self.exog_[workers, -self.exog_lags:].reshape(len(workers), -1))
        return np.concatenate(parts, axis=1)

    def _remember_pairs(self, rows: np.ndarray, targets: np.ndarray) -> None:
        rows, targets = rows[-self.buffer_size:], targets[-self.buffer_size:]
        positions = (self.buffered_ + np.arange(len(rows))) % self.buffer_size
        self.buffer_x_[positions] = rows
        self.buffer_y_[positions] = targets
        self.buffered_ += len(rows)
        self.newest_ = positions

    def _train(self) -> None:
        filled = min(self.buffered_, self.buffer_size)
        newest = self.newest_[-self.rows_per_update:]
        room = self.rows_per_update - newest.size
        older = self.rng_.integers(0, filled, size=min(room, filled)) if room > 0 else np.empty(0, dtype=np.int64)
        picked = np.concatenate([newest, older])
        self.net_.partial_fit(self.buffer_x_[picked], self.buffer_y_[picked])
        self.updates_ += 1
