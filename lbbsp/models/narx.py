"""CPU workers on shared machines: a NARX forecast of throughput ``horizon`` iterations ahead.

NARX = nonlinear autoregression with exogenous inputs. One small MLP is shared by all workers (so it
learns from every report and costs one forward pass per decision). It is scale-free: the inputs are the
worker's recent log-throughputs relative to its latest one, the gap between its level and its latest
throughput, and the last ``exog_lags`` values of its resource features, each a share of the machine
(``proc_cpu``, reported in cores, is divided by the report's ``cores``, so the network reads a 2-core and a
64-core host alike); the target is the log-ratio of the
throughput ``horizon`` iterations later to the latest one. ``horizon`` should equal ``JobConfig.lag`` (2 by
default): a decision for iteration k is made from the reports of k - lag. The loss is a Huber loss on the
relative error forecast / actual - 1, which is what a wrong split costs and what MAPE scores; with a small
``huber_delta`` it is close to the absolute relative error, so the forecast is a (1/actual-weighted) median
rather than a mean: co-located load makes rare very slow iterations that a squared loss would chase. An
untrained network outputs about zero, i.e. the last value. The model answers with the level instead
until ``warmup`` updates have run and for as long as the network's recent error, scored on each pair
before it is trained on, is not below the level's: a small job with little data never gets a worse
forecast than the smoothed speed.

The level is the worker's rate over its recent steps' time: its samples and its seconds, each an exponentially
weighted average, divided. An average of each step's rate (or of their logarithms) weighs a short fast step as much
as a long slow one, where the barrier waits on time: a worker under a CPU quota, whose short steps either run at
full speed or stall until the quota's next period, read as up to 40% faster than it was, and got too many samples.

A measurement more than ``spike`` times what the worker was expected to do (the largest of its level and its
last ``lags`` measurements) is held back until its next one confirms it: a timing glitch that claims a hundredfold
speed would otherwise hand that worker most of the batch for several iterations, while a real speed-up is
followed one report late. Slowdowns are taken at once: they must be, and a false one costs only that
worker's share. The shipped traces' largest real jump up is 3.0x, the held-out ones' 3.5x (a co-located job leaving).

The network is a few lines of numpy (ReLU layers, Adam) rather than ``MLPRegressor``, whose partial_fit
costs about 1 ms per update (mostly input checks), several times the arithmetic.
"""
from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import numpy as np

from ..config import _integer, _real
from ..errors import ConfigError
from ..protocol import Report
from .base import CapacityModel, WorkerIds, as_reports, by_iteration, feature, field, held_back

DEFAULT_FEATURES = ("cpu_util", "proc_cpu", "colocated_load", "mem_util")
#: The report features NARX may take: shares and cores per core, on the scale of its log-ratio inputs (bytes, seconds
#: and bytes per second, fed raw at 1e9, had left the network worse than the level and never used, unsaid).
NARX_FEATURES = ("colocated_load", "cpu_util", "gpu_util", "mem_util", "proc_cpu")
#: Bounds on the network's size, so that an absurd value is a ConfigError naming it, not a MemoryError or numpy's
#: "maximum allowed dimension exceeded" (a hidden=(10**5, 10**5) asked for 75 GiB of weights).
MAX_LAGS, MAX_LAYERS, MAX_WIDTH = 256, 8, 1024
MAX_BUFFER_VALUES = 2**26  # float64 values in the replay buffer: 512 MiB
#: The most one forecast's miss counts when the network and the level are compared: 300%, a measurement 4x off
#: (the default ``spike``); beyond, one glitched worker would decide for the whole job. The shipped traces' figures
#: are the same with it (a cap of 100% had cost 0.1-0.2 points of MAPE there: contention that arrives is missed by more)
MAX_MISS = 3.0


class NARXThroughput(CapacityModel):
    """Online NARX(p=lags, q=exog_lags) throughput forecaster ``horizon`` iterations ahead.

    Training pairs go to a replay buffer of ``buffer_size`` rows; each update takes one Adam step per
    mini-batch of 128 over at most ``rows_per_update`` rows (the newest first, a random subset of them when
    more arrived, then random older ones), which
    keeps the cost per decision bounded at any cluster size.
    """

    _STRUCTURAL = frozenset({"lags", "exog_lags", "features", "horizon", "hidden", "buffer_size", "random_state"})
    pending_: tuple[np.ndarray, np.ndarray] | None = None  # (rows, targets) not scored or trained on yet; fit forgets
    forecast_: np.ndarray | None = None  # every worker's forecast, computed on the first predict after an update
    rows_: np.ndarray  # per worker, the input row made at each of the last ``horizon`` reports (C-contiguous)
    bases_: np.ndarray  # the log-throughput each of those rows is relative to (C-contiguous)

    def __init__(self, lags: int = 4, exog_lags: int = 2, features: Sequence[str] = DEFAULT_FEATURES, *,
                 horizon: int = 2, hidden: tuple[int, ...] = (16, 16), alpha_ewma: float = 0.5,
                 learning_rate: float = 3e-3, huber_delta: float = 0.02, buffer_size: int = 4096,
                 rows_per_update: int = 256, warmup: int = 30, spike: float | None = 4.0,
                 random_state: int = 0) -> None:
        self.lags = lags
        self.exog_lags = exog_lags
        self.features = features
        self.horizon = horizon
        self.hidden = hidden
        self.alpha_ewma = alpha_ewma
        self.learning_rate = learning_rate
        self.huber_delta = huber_delta
        self.buffer_size = buffer_size
        self.rows_per_update = rows_per_update
        self.warmup = warmup
        self.spike = spike
        self.random_state = random_state

    # -- learning ----------------------------------------------------------------------------------------
    @by_iteration
    def partial_fit(self, reports: Sequence[Report] | Report, *, defer: bool = False) -> NARXThroughput:
        """Shift the reports into each worker's history and train on the pairs whose targets just arrived;
        ``defer``: score and train in :meth:`finish_learning` instead (the forecast then uses the network of
        one update before, the histories of now)."""
        reports = as_reports(reports)
        if not reports:  # an iteration nobody reported in: nothing to learn, and an unfitted model stays so
            self._check_params()
            return self
        if not hasattr(self, "weights_"):
            self._initialise()
        self.finish_learning()
        workers = field(reports, "worker")
        self._grow(int(workers.max()) + 1)
        count = self.count_[workers]
        fewest = int(count.min())  # in the usual case every worker has full rows: no masks to take below
        # hardware is recorded once per worker, so only workers with no measurement yet need a look
        if not fewest:
            self._remember_hardware(reports.subset(np.flatnonzero(count == 0)))
        samples, seconds = field(reports, "samples"), field(reports, "compute_s")
        measured = (samples > 0) & (seconds > 0)  # a report that computed nothing says nothing about speed
        taken = None  # positions of the reports learned from; None: all
        if not measured.all():
            if not measured.any():
                return self
            taken = np.flatnonzero(measured)
            workers, count, samples, seconds = workers[taken], count[taken], samples[taken], seconds[taken]
        log_thr = np.log(samples / seconds)
        history, level = self.log_thr_[workers], self.log_level_[workers]  # as they were: the newest last
        kept = self._unless_spike(workers, log_thr, count, history, level)
        if kept is not None:
            if not kept.any():
                return self
            taken = np.flatnonzero(kept) if taken is None else taken[kept]
            workers, count, log_thr = workers[kept], count[kept], log_thr[kept]
            samples, seconds = samples[kept], seconds[kept]
            history, level = history[kept], level[kept]
        exog = self._exogenous(reports)
        if taken is not None:
            exog = exog[taken]
            fewest = int(count.min())
        if (missing := np.isnan(exog)).any():  # a reading that failed: the worker's last (0 before any)
            exog = np.where(missing, self.exog_[workers, -1], exog)
        # each worker's rows and bases as one ring of ``horizon`` slots; the slot of this report held the row made
        # ``horizon`` measurements ago, which now has its target (where it was full), and takes the row made now
        # views of them (np.zeros and np.concatenate make them contiguous), written through
        rows, bases = self.rows_.reshape(-1, self.rows_.shape[-1]), self.bases_.reshape(-1)
        slot = workers * self.horizon + count % self.horizon
        due = None if fewest >= self.lags + self.horizon - 1 else count >= self.lags + self.horizon - 1
        if due is None:
            self.pending_ = (rows[slot], log_thr - bases[slot])
        elif due.any():
            self.pending_ = (rows[slot[due]], log_thr[due] - bases[slot[due]])
        # shift the new measurement into each worker's history; of a worker twice in ``reports``, the last stays
        history = np.concatenate([history[:, 1:], log_thr[:, None]], axis=1)
        exog = np.concatenate([self.exog_[workers, 1:], exog[:, None]], axis=1)
        # the level: samples and seconds smoothed apart, a worker's first measurement taken as is
        alpha = self.alpha_ewma
        level_samples = alpha * samples + (1 - alpha) * self.level_samples_[workers]
        level_seconds = alpha * seconds + (1 - alpha) * self.level_seconds_[workers]
        if not fewest:
            level_samples = np.where(count == 0, samples, level_samples)
            level_seconds = np.where(count == 0, seconds, level_seconds)
        level = np.log(level_samples / level_seconds)
        self.level_samples_[workers], self.level_seconds_[workers] = level_samples, level_seconds
        self.log_thr_[workers], self.exog_[workers], self.log_level_[workers] = history, exog, level
        self.count_[workers] = count + 1
        full = None if fewest >= self.lags - 1 else count >= self.lags - 1
        if full is None:
            rows[slot], bases[slot] = self._inputs(history, level, exog), log_thr
        elif full.any():
            rows[slot[full]] = self._inputs(history[full], level[full], exog[full])
            bases[slot[full]] = log_thr[full]
        if not defer:
            self.finish_learning()
        self.forecast_ = None  # predictions are computed once per update, on the first predict
        return self

    def finish_learning(self) -> NARXThroughput:
        """Score the network and the level on the pairs that got their targets, then train on them."""
        pending, self.pending_ = self.pending_, None
        if pending is not None:
            self._score(*pending)
            self._remember_pairs(*pending)
            self._train()
            self.forecast_ = None
        return self

    def predict(self, workers: WorkerIds) -> np.ndarray:
        self._check_is_fitted("weights_")
        if self.forecast_ is None:
            self.forecast_ = self._forecast_all()
        return self._with_prior(self.forecast_, workers)

    # -- helpers -----------------------------------------------------------------------------------------
    def _unless_spike(self, workers: np.ndarray, log_thr: np.ndarray, count: np.ndarray, history: np.ndarray,
                      level: np.ndarray) -> np.ndarray | None:
        """Which measurements to learn from (None: all): all but a first one over ``spike`` times the worker's
        expected throughput (the largest of its ``level`` and its measurements in ``history``, the last
        ``lags`` as logs, of which ``count`` are real), which is held back (``held_``) until the worker's next
        measurement confirms the jump. A worker back at the speed it had before one slow measurement is not a spike
        (its return had been held too, and its forecast kept at the glitch one report longer)."""
        if self.spike is None:
            return None
        real = np.arange(history.shape[1])[None, :] >= history.shape[1] - count[:, None]  # the newest are last
        expected = np.maximum(level, np.where(real, history, -np.inf).max(axis=1))
        return held_back(self.held_, workers, (log_thr > expected + np.log(self.spike)) & (count > 0))

    def _check_params(self) -> None:
        lags = _integer(self.lags, "lags", 1, MAX_LAGS)
        _integer(self.exog_lags, "exog_lags", 0, lags)
        _integer(self.horizon, "horizon (JobConfig.lag)", 1, 8)
        _real(self.alpha_ewma, "alpha_ewma", 0.0, 1.0, "in (0, 1]", lo_open=True)
        _real(self.huber_delta, "huber_delta", 0.0, np.inf, "a positive number", lo_open=True, hi_open=True)
        # Adam's step: past 1 the weights overflow (1e300 had been taken, and numpy warned of overflow every update)
        _real(self.learning_rate, "learning_rate", 0.0, 1.0, "in (0, 1]", lo_open=True)
        if not (isinstance(self.hidden, (tuple, list)) and 1 <= len(self.hidden) <= MAX_LAYERS
                and all(not isinstance(h, bool) and isinstance(h, Integral) and 1 <= h <= MAX_WIDTH
                        for h in self.hidden)):
            raise ConfigError(f"hidden must be a tuple of 1 to {MAX_LAYERS} layer widths, each in [1, {MAX_WIDTH}], "
                              f"got {self.hidden!r}")
        buffer_size = _integer(self.buffer_size, "buffer_size", 1, None)
        for name in ("rows_per_update", "warmup"):
            _integer(getattr(self, name), name, 1 if name != "warmup" else 0, None)
        if self.spike is not None:
            _real(self.spike, "spike", 1.0, np.inf, "None or a factor above 1", lo_open=True, hi_open=True)
        if self.random_state is not None:
            _integer(self.random_state, "random_state", 0, None)
        # a string would be read as its letters, a generator used up by the first look, and a name reports never
        # carry as a column of zeros
        if not (isinstance(self.features, (tuple, list)) and all(isinstance(f, str) for f in self.features)
                and set(self.features) <= set(NARX_FEATURES)):
            raise ConfigError(f"features must be a list or tuple of report features {list(NARX_FEATURES)} (shares and "
                              "cores per core; bytes and seconds would swamp the network's inputs), "
                              f"got {self.features!r}")
        width = self._input_width()
        if buffer_size * width > MAX_BUFFER_VALUES:  # the replay buffer is allocated whole at the first report
            raise ConfigError(f"buffer_size x the input width (lags + exog_lags x features: {width}) must be at most "
                              f"{MAX_BUFFER_VALUES:,} values (512 MiB), got {buffer_size:,} x {width}")

    def _input_width(self) -> int:
        """Inputs per row: ``lags`` log-throughput ratios and ``exog_lags`` rows of the resource features."""
        return int(self.lags) + int(self.exog_lags) * len(self.features)

    def _initialise(self) -> None:
        self._check_params()
        self.rng_ = np.random.default_rng(self.random_state)
        width = self._input_width()
        # all weights and biases in one flat vector (Adam then updates it in a few array operations);
        # weights_ holds (W, b) views into it. Glorot-uniform weights and zero biases, as MLPRegressor.
        self.params_ = np.zeros(sum(a * b + b for a, b in self._shapes()))
        self.weights_ = self._views()
        for w, _ in self.weights_:
            fan_in, fan_out = w.shape
            w[:] = self.rng_.uniform(-1, 1, w.shape) * np.sqrt(6.0 / (fan_in + fan_out))
        self.moments_ = np.zeros((2, self.params_.size))  # Adam's first and second moments
        self.buffer_x_ = np.empty((self.buffer_size, width))
        self.buffer_y_ = np.empty(self.buffer_size)
        self.buffered_ = 0  # rows ever written; the ring position is buffered_ % buffer_size
        self.steps_ = 0  # Adam steps taken
        self.updates_ = 0
        self.log_thr_ = np.zeros((0, self.lags))
        self.exog_ = np.zeros((0, max(self.exog_lags, 1), len(self.features)))
        self.log_level_ = np.zeros(0)  # log(level_samples_ / level_seconds_)
        self.level_samples_, self.level_seconds_ = np.zeros(0), np.zeros(0)
        self.count_ = np.zeros(0, dtype=np.int64)
        self.held_ = np.zeros(0, dtype=bool)  # whose latest measurement was held back as a possible spike
        self.rows_ = np.zeros((0, self.horizon, width))  # input row made at each of the last horizon reports
        self.bases_ = np.zeros((0, self.horizon))  # the log-throughput each of those rows is relative to
        self.forecast_ = None
        self.pending_ = None
        self.recent_error_ = np.full(2, np.inf)  # (network, level), smoothed over updates

    def _shapes(self) -> list[tuple[int, int]]:
        """(fan in, fan out) of each layer."""
        width = self._input_width()
        return list(zip([width, *self.hidden], [*self.hidden, 1]))

    def _views(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(W, b) of each layer as views into ``params_``, which Adam updates in place."""
        views, start = [], 0
        for fan_in, fan_out in self._shapes():
            w = self.params_[start:start + fan_in * fan_out].reshape(fan_in, fan_out)
            start += fan_in * fan_out
            views.append((w, self.params_[start:start + fan_out]))
            start += fan_out
        return views

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling (and deepcopy) copies ``weights_`` apart from ``params_``: make them views again, or Adam
        would update parameters the network no longer reads (a policy sent to a spawned coordinator froze)."""
        super().__setstate__(state)
        if "params_" in self.__dict__:
            self.weights_ = self._views()

    def _grow(self, size: int) -> None:
        extra = size - self.count_.size
        if extra > 0:
            def grown(a: np.ndarray) -> np.ndarray:
                return np.concatenate([a, np.zeros((extra, *a.shape[1:]), dtype=a.dtype)])
            self.log_thr_, self.exog_, self.log_level_ = grown(self.log_thr_), grown(self.exog_), grown(self.log_level_)
            self.count_, self.rows_, self.bases_ = grown(self.count_), grown(self.rows_), grown(self.bases_)
            self.held_ = grown(self.held_)
            self.level_samples_, self.level_seconds_ = grown(self.level_samples_), grown(self.level_seconds_)

    def _exogenous(self, reports: Sequence[Report]) -> np.ndarray:
        """The ``features`` columns of each report, NaN where one is missing (``partial_fit`` then takes the worker's
        last value: read as 0, a failed reading had looked like an idle machine, and a forecast 3x too fast
        followed), with ``proc_cpu`` per core of the report's machine (as is when it reports no ``cores``)."""
        columns = [feature(reports, name) / feature(reports, "cores", 1.0) if name == "proc_cpu"
                   else feature(reports, name) for name in self.features]
        return np.array(columns, dtype=float).reshape(len(columns), len(reports)).T

    def _inputs(self, history: np.ndarray, level: np.ndarray, exog: np.ndarray) -> np.ndarray:
        """One input row per worker from its ``history`` of log-throughputs, ``level`` and ``exog`` features
        (as ``log_thr_``, ``log_level_`` and ``exog_`` hold them): lagged log-ratios, level gap, lagged features."""
        parts = [history[:, :-1], level[:, None]]
        if self.exog_lags:
            parts.append(exog[:, -self.exog_lags:].reshape(len(history), -1))
        rows = np.concatenate(parts, axis=1)
        rows[:, :self.lags] -= history[:, -1:]  # the log-throughputs and the level relative to the latest
        return rows

    def _forecast_all(self) -> np.ndarray:
        """Every known worker's forecast (NaN for ids never seen): the network's once warm, else the level."""
        forecast = np.where(self.count_ > 0, np.exp(self.log_level_), np.nan)
        if self.updates_ >= self.warmup and self.recent_error_[0] < self.recent_error_[1]:  # the network is trusted
            full = np.flatnonzero(self.count_ >= self.lags)
            if full.size:
                slot = full * self.horizon + (self.count_[full] - 1) % self.horizon  # the latest row's, as partial_fit
                delta = np.clip(self._net(self.rows_.reshape(-1, self.rows_.shape[-1])[slot])[-1][:, 0], -3.0, 3.0)
                forecast[full] = np.exp(self.bases_.reshape(-1)[slot] + delta)
        return forecast

    def _score(self, rows: np.ndarray, targets: np.ndarray, weight: float = 0.1) -> None:
        """Track the mean relative error of the network and of the level on pairs not yet trained on, each pair's
        counted at most ``MAX_MISS``: one measurement 1,000x too slow had made both errors 1,000-fold, their small gap
        on that one worker outweighed every other worker's, and the whole job lost the network for dozens of updates."""
        network = np.clip(self._net(rows)[-1][:, 0], -3.0, 3.0)
        level = rows[:, self.lags - 1]  # the input column that holds log(level / latest)
        errors = np.array([np.mean(np.minimum(np.abs(np.expm1(network - targets)), MAX_MISS)),
                           np.mean(np.minimum(np.abs(np.expm1(level - targets)), MAX_MISS))])
        self.recent_error_ = errors if np.isinf(self.recent_error_).all() else (
            (1 - weight) * self.recent_error_ + weight * errors)

    def _net(self, x: np.ndarray) -> list[np.ndarray]:
        """The activations of every layer for inputs ``x``, the input first and the output last."""
        layers = [x]
        for w, b in self.weights_[:-1]:
            layers.append(np.maximum(layers[-1] @ w + b, 0.0))
        w, b = self.weights_[-1]
        layers.append(layers[-1] @ w + b)
        return layers

    def _remember_pairs(self, rows: np.ndarray, targets: np.ndarray) -> None:
        rows, targets = rows[-self.buffer_size:], targets[-self.buffer_size:]
        positions = (self.buffered_ + np.arange(len(rows))) % self.buffer_size
        self.buffer_x_[positions] = rows
        self.buffer_y_[positions] = targets
        self.buffered_ += len(rows)
        self.newest_ = positions

    def _train(self) -> None:
        """One pass of Adam over the newest pairs plus random older ones, in mini-batches of 128. Where more
        new pairs arrived than ``rows_per_update``, a random subset of them: reports come in worker order, so
        the last ones would always be the same (highest-id) workers, and the network would never see the rest."""
        filled = min(self.buffered_, self.buffer_size)
        newest = self.newest_
        if newest.size > self.rows_per_update:
            newest = self.rng_.choice(newest, self.rows_per_update, replace=False)
        room = min(self.rows_per_update - newest.size, filled)
        picked = np.concatenate([newest, self.rng_.integers(0, filled, size=room)]) if room > 0 else newest
        for start in range(0, picked.size, 128):
            batch = picked[start:start + 128]
            self._adam_step(self.buffer_x_[batch], self.buffer_y_[batch])
        self.updates_ += 1

    def _adam_step(self, x: np.ndarray, y: np.ndarray, beta1: float = 0.9, beta2: float = 0.999,
                   l2: float = 1e-4) -> None:
        layers = self._net(x)
        # d(mean Huber loss of the relative error exp(output - y) - 1)/d(output)
        ratio = np.exp(np.clip(layers[-1][:, 0] - y, -3.0, 3.0))
        grad = (np.clip(ratio - 1, -self.huber_delta, self.huber_delta) * ratio)[:, None] / len(y)
        grads = []
        for i in range(len(self.weights_) - 1, -1, -1):
            w, _ = self.weights_[i]
            grads += [grad.sum(axis=0), (layers[i].T @ grad + l2 * w).ravel()]
            if i:
                grad = (grad @ w.T) * (layers[i] > 0)
        flat = np.concatenate(grads[::-1])  # the order of params_: W0, b0, W1, b1, ...
        self.steps_ += 1
        m, v = self.moments_
        m += (1 - beta1) * (flat - m)
        v += (1 - beta2) * (flat * flat - v)
        step = self.learning_rate * np.sqrt(1 - beta2 ** self.steps_) / (1 - beta1 ** self.steps_)
        self.params_ -= step * m / (np.sqrt(v) + 1e-8)
