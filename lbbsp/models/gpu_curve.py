"""GPU workers: a batch-time curve per worker (flat while under-used, then linear) and a memory cap.

Speed on a dedicated GPU is stable, but time(batch) is not proportional to the batch: small batches leave
the device under-used, so the time stays flat up to a knee and grows linearly after it. Each worker's last
``window`` (batch, seconds) measurements are fitted with the best hinge whose knee is 0 or one of the
measured sizes (non-negative slope, so the fit is monotone, i.e. isotonic). Memory: bytes = a + b * batch is
fitted from the reported ``gpu_mem_used`` and capped at (1 - memory_margin) of used + free.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..allocation import HingeTime
from ..errors import ConfigError
from ..protocol import Report
from .base import CapacityModel

_NO_CAP = np.iinfo(np.int64).max // 4


def fit_hinge(sizes: np.ndarray, times: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least-squares hinge  t = base + slope * max(x - knee, 0)  per row, slope >= 0; knee from {0} and the row's
    sizes. Arrays are (workers, window). A row with a single distinct size says nothing about the shape: it
    gets the proportional line through the origin (the CPU assumption) until exploration adds a second
    size. Pure function."""
    n = sizes.shape[0]
    weight = valid.astype(float)
    knees = np.concatenate([np.zeros((n, 1)), np.where(valid, sizes, 0.0)], axis=1)  # (n, J)
    z = np.maximum(sizes[:, None, :] - knees[:, :, None], 0.0) * weight[:, None, :]  # (n, J, W)
    t = np.where(valid, times, 0.0)
    s_w = weight.sum(1)[:, None]
    s_z, s_zz = z.sum(2), (z * z).sum(2)
    s_t, s_zt = t.sum(1)[:, None], (z * t[:, None, :]).sum(2)
    det = s_w * s_zz - s_z ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        slope = np.where(det > 1e-9 * np.maximum(s_w * s_zz, 1e-300), (s_w * s_zt - s_z * s_t) / det, 0.0)
        slope = np.maximum(slope, 0.0)
        base = (s_t - slope * s_z) / np.maximum(s_w, 1.0)
    residual = (t[:, None, :] - base[:, :, None] - slope[:, :, None] * z) * weight[:, None, :]
    sse = (residual ** 2).sum(2)
    smallest = np.where(valid, sizes, np.inf).min(1)
    # A knee must sit above the smallest size (flat observations exist) and fit clearly better than the line.
    tolerance = 0.99 * sse[:, :1] - 1e-12 * (t * t).sum(1)[:, None]
    sse[:, 1:] = np.where((knees[:, 1:] > smallest[:, None]) & (sse[:, 1:] < tolerance), sse[:, 1:], np.inf)
    pick = np.arange(n), np.argmin(sse, axis=1)
    base, knee, slope = np.maximum(base[pick], 1e-9), knees[pick], slope[pick]
    spread = np.where(valid, sizes, -np.inf).max(1) - np.where(valid, sizes, np.inf).min(1)
    single = ~(spread > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        proportional = (t / np.maximum(sizes, 1.0)).sum(1) / np.maximum(weight.sum(1), 1.0)
    return np.where(single, 1e-9, base), np.where(single, 0.0, knee), np.where(single, proportional, slope)


def fit_memory_cap(sizes: np.ndarray, used: np.ndarray, valid: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """Largest batch whose predicted bytes (a + b * batch, least squares per row) stay within ``budget``.

    With under two distinct sizes, or a non-positive fitted b, the line goes through the origin and the
    largest measurement, which over-predicts bytes above it (a >= 0), so the cap errs low. Pure function.
    """
    weight = valid.astype(float)
    count = weight.sum(1)
    x, y = np.where(valid, sizes, 0.0), np.where(valid, used, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_x, mean_y = x.sum(1) / count, y.sum(1) / count
        dx = (x - mean_x[:, None]) * weight
        var = (dx * dx).sum(1)
        b = np.where(var > 0, (dx * (y - mean_y[:, None])).sum(1) / var, np.nan)
        a = mean_y - b * mean_x
        largest = np.argmax(np.where(valid, sizes, -1.0), axis=1)
        rows = np.arange(sizes.shape[0])
        through_origin = used[rows, largest] / np.maximum(sizes[rows, largest], 1.0)
        linear = np.isfinite(b) & (b > 0) & (a >= 0)
        cap = np.where(linear, (budget - np.where(linear, a, 0.0)) / np.where(linear, b, 1.0),
                       budget / through_origin)
    cap = np.where(count > 0, cap, np.inf)
    return np.floor(np.clip(np.nan_to_num(cap, nan=0.0, posinf=_NO_CAP), 0, _NO_CAP)).astype(np.int64)


class BatchTimeCurve(CapacityModel):
    """Per-worker hinge curve time(batch) and memory cap, from a sliding window of measurements."""

    def __init__(self, window: int = 8, *, memory_margin: float = 0.05, explore_fraction: float = 0.05) -> None:
        self.window = window
        self.memory_margin = memory_margin
        self.explore_fraction = explore_fraction

    def partial_fit(self, reports: Sequence[Report]) -> "BatchTimeCurve":
        if not hasattr(self, "sizes_"):
            if not isinstance(self.window, int) or self.window < 2:
                raise ConfigError(f"window must be an integer >= 2, got {self.window!r}")
            if not 0 <= self.memory_margin < 1:
                raise ConfigError(f"memory_margin must be in [0, 1), got {self.memory_margin}")
            self.sizes_ = np.zeros((0, self.window))
            self.times_ = np.zeros((0, self.window))
            self.mem_used_ = np.full((0, self.window), np.nan)
            self.mem_total_ = np.full(0, np.nan)
            self.count_ = np.zeros(0, dtype=np.int64)
        self._remember_hardware(reports)
        measured = [r for r in reports if r.samples > 0 and r.compute_s > 0]
        if not measured:
            return self
        workers = np.array([r.worker for r in measured], dtype=np.int64)
        self._grow(int(workers.max()) + 1)
        used = np.array([r.features.get("gpu_mem_used", np.nan) for r in measured])
        free = np.array([r.features.get("gpu_mem_free", np.nan) for r in measured])
        self.sizes_[workers] = np.column_stack([self.sizes_[workers, 1:], [r.samples for r in measured]])
        self.times_[workers] = np.column_stack([self.times_[workers, 1:], [r.compute_s for r in measured]])
        self.mem_used_[workers] = np.column_stack([self.mem_used_[workers, 1:], used])
        self.mem_total_[workers] = np.where(np.isfinite(used + free), used + free, self.mem_total_[workers])
        self.count_[workers] += 1
        valid = self._valid(workers)
        base, knee, slope = fit_hinge(self.sizes_[workers], self.times_[workers], valid)
        window = np.where(valid, self.sizes_[workers], np.nan)
        shaped = np.nanmax(window, axis=1) > np.nanmin(window, axis=1)
        keep = ~shaped & self.known_[workers]  # a window of one size says less than the curve already known
        self.base_[workers] = np.where(keep, self.base_[workers], base)
        self.knee_[workers] = np.where(keep, self.knee_[workers], knee)
        self.slope_[workers] = np.where(keep, self.slope_[workers], slope)
        self.known_[workers] |= shaped
        return self

    def predict(self, workers: Sequence[int]) -> np.ndarray:
        """Throughput at each worker's latest batch size, as the curve predicts it."""
        self._check_is_fitted("sizes_")
        seen = np.flatnonzero(self.count_ > 0)
        latest = self.sizes_[seen, -1]
        known = dict(zip(seen.tolist(), (latest / self._curve(seen).time(latest)).tolist()))
        return self._with_prior(known, list(workers))

    def time_model(self, workers: Sequence[int]) -> HingeTime:
        workers_arr = np.asarray(list(workers), dtype=np.int64)
        curve = self._curve(workers_arr)
        unseen = curve.observed_max <= 0
        if unseen.any():  # cold start: a straight line at the similar-hardware prior throughput
            speed = np.nan_to_num(self.predict(workers_arr[unseen]), nan=1.0)
            curve.base[unseen], curve.knee[unseen], curve.slope[unseen] = 1e-9, 0.0, 1.0 / speed
        return curve

    def max_batch(self, workers: Sequence[int]) -> np.ndarray:
        """Largest batch each worker's GPU memory holds (with the margin); a huge number where unknown."""
        self._check_is_fitted("sizes_")
        workers_arr = np.asarray(list(workers), dtype=np.int64)
        inside = workers_arr < self.count_.size
        caps = np.full(workers_arr.size, _NO_CAP, dtype=np.int64)
        seen = workers_arr[inside]
        if seen.size:
            valid = self._valid(seen) & np.isfinite(self.mem_used_[seen])
            budget = (1 - self.memory_margin) * self.mem_total_[seen]
            caps[inside] = np.where(np.isfinite(budget),
                                    fit_memory_cap(self.sizes_[seen], self.mem_used_[seen], valid,
                                                   np.nan_to_num(budget)), _NO_CAP)
        return caps

    def explore(self, workers: Sequence[int], sizes: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        """Move ``explore_fraction`` of a batch between pairs of workers whose curve is still unknown
        (never two distinct sizes in one window), so the next reports reveal each slope; sum unchanged."""
        self._check_is_fitted("sizes_")
        workers_arr = np.asarray(list(workers), dtype=np.int64)
        inside = workers_arr < self.count_.size
        known = np.zeros(workers_arr.size, dtype=bool)
        known[inside] = self.known_[workers_arr[inside]]
        unknown = np.flatnonzero(~known)
        return perturb_pairs(np.asarray(sizes, dtype=np.int64), unknown, self.explore_fraction, lower, upper)

    def _grow(self, size: int) -> None:
        extra = size - self.count_.size
        if extra > 0:
            self.sizes_ = np.vstack([self.sizes_, np.zeros((extra, self.window))])
            self.times_ = np.vstack([self.times_, np.zeros((extra, self.window))])
            self.mem_used_ = np.vstack([self.mem_used_, np.full((extra, self.window), np.nan)])
            self.mem_total_ = np.concatenate([self.mem_total_, np.full(extra, np.nan)])
            self.count_ = np.concatenate([self.count_, np.zeros(extra, dtype=np.int64)])
            for name in ("base_", "knee_", "slope_"):
                setattr(self, name, np.concatenate([getattr(self, name, np.zeros(0)), np.zeros(extra)]))
            self.known_ = np.concatenate([getattr(self, "known_", np.zeros(0, dtype=bool)), np.zeros(extra, dtype=bool)])

    def _valid(self, workers: np.ndarray) -> np.ndarray:
        filled = np.minimum(self.count_[workers], self.window)
        return np.arange(self.window)[None, :] >= (self.window - filled)[:, None]

    def _curve(self, workers: Sequence[int] | np.ndarray) -> HingeTime:
        workers_arr = np.asarray(workers, dtype=np.int64)
        inside = workers_arr < self.count_.size
        safe = np.where(inside, workers_arr, 0)
        observed = np.where(inside, np.where(self._valid(safe), self.sizes_[safe], 0.0).max(axis=1), 0.0)
        return HingeTime(np.where(inside, self.base_[safe], 0.0), np.where(inside, self.knee_[safe], 0.0),
                         np.where(inside, self.slope_[safe], 0.0), observed)


def perturb_pairs(sizes: np.ndarray, who: np.ndarray, fraction: float, lower: np.ndarray,
                  upper: np.ndarray) -> np.ndarray:
    """Shift round(fraction * size) samples within consecutive pairs of ``who`` (first gives, second takes),
    within the bounds; the total is unchanged. Pure function."""
    out = sizes.copy()
    lower, upper = np.asarray(lower, dtype=np.int64), np.asarray(upper, dtype=np.int64)
    giver, taker = who[0:len(who) - 1:2], who[1::2]
    step = np.maximum(1, np.round(fraction * np.minimum(out[giver], out[taker]))).astype(np.int64)
    step = np.minimum(step, np.minimum(out[giver] - lower[giver], upper[taker] - out[taker]))
    step = np.maximum(step, 0)
    out[giver] -= step
    out[taker] += step
    return out
