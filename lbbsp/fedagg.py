"""Federated aggregation maths: weight by samples processed, normalise unequal local steps as FedNova does.

Client i starts from the global model x, runs ``steps[i]`` local SGD steps over ``samples[i]`` samples in
all, and returns x_i. Every processed sample should count once, so client i's weight is
p_i = samples_i / sum(samples). Plain weighted averaging, x + sum_i p_i (x_i - x), over-weights clients that
ran more steps: their update is roughly steps_i times longer. FedNova (Wang et al., NeurIPS 2020) divides
each update by its own step count and rescales by the weighted mean step count tau_eff = sum_i p_i steps_i:

    x_new = x + tau_eff * sum_i p_i (x_i - x) / steps_i

With equal steps this is exactly the weighted average. On non-IID clients, weighting by samples processed
moves the objective towards the clients given more work; weighting by each client's data size instead
(``weights`` below may be either) keeps the objective sum_i (n_i / n) F_i of standard FedAvg.
Pure functions on lists of numpy arrays.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import numpy as np

from .config import _given, _is_integer, _real
from .errors import LBBSPError

Arrays = Sequence[np.ndarray]


def sample_weights(samples: Sequence[float]) -> np.ndarray:
    """p_i = samples_i / sum(samples); raises if any count is negative or not a number, or all are zero."""
    bad = LBBSPError(f"sample counts must be a non-empty list of finite non-negative numbers, got {samples}")
    try:
        for i, count in enumerate(samples):  # numpy reads the string "10" as 10.0, and True as one sample
            if isinstance(count, bool) or not isinstance(count, Real):  # numpy's bool is no Real
                raise LBBSPError(f"sample count {i} must be a number (an int or float, numpy's too), got "
                                 f"{_given(count)}")
        counts = np.asarray(samples, dtype=float)
    except (OverflowError, TypeError, ValueError):
        raise bad from None
    if counts.ndim != 1 or counts.size == 0 or not np.isfinite(counts).all() or (counts < 0).any():
        raise bad
    with np.errstate(over="ignore"):
        total = counts.sum()
    if not np.isfinite(total):  # [1e308, 1e308] would give weights of 0
        raise LBBSPError(f"sample counts sum beyond a float: {samples}")
    if total <= 0:
        raise LBBSPError("no client processed any sample: nothing to aggregate")
    return counts / total


def fednova_scales(steps: Sequence[int], weights: Sequence[float]) -> np.ndarray:
    """tau_eff / steps_i per client: the factor FedNova applies to client i's update x_i - x.

    ``weights`` are the clients' aggregation weights up to a factor (samples processed, or data sizes).
    """
    if len(steps) != len(weights) or not all(_is_integer(t) and 0 < t < 2**53 for t in steps):
        raise LBBSPError(f"steps must be one positive integer count per client ({len(weights)}), got {steps}")
    tau = np.asarray(steps, dtype=float)
    return float(sample_weights(weights) @ tau) / tau


def rescale_update(global_arrays: Arrays, local_arrays: Arrays, scale: float) -> list[np.ndarray]:
    """x + scale * (x_i - x): a client's model with its update stretched by ``scale``, a finite number > 0 (0 would
    drop the update, a negative one reverse it, NaN spoil the model).

    The arrays are paired by position, so each pair must have one shape (numpy would broadcast a mismatch).
    Integer arrays (a counter such as BatchNorm's ``num_batches_tracked``) are rounded to the nearest integer,
    not truncated towards zero; they and bool arrays are stretched as floats, since an unsigned difference would
    wrap around and numpy refuses to subtract bools, and held within their dtype's range (a stretch past it
    stops at its end: cast back, -1 would be 255 as a uint8 and True as a bool).
    """
    scale = _real(scale, "scale", 0.0, math.inf, "a finite number > 0 (FedNova's tau_eff / steps_i)", lo_open=True,
                  hi_open=True)
    if len(global_arrays) != len(local_arrays):
        raise LBBSPError(f"model has {len(global_arrays)} arrays, client sent {len(local_arrays)}")
    out = []
    for i, (g, xi) in enumerate(zip(global_arrays, local_arrays)):
        x, local = np.asarray(g), np.asarray(xi)
        if x.shape != local.shape:
            raise LBBSPError(f"array {i} of the model has shape {x.shape}, the client's {local.shape}")
        dtype = np.result_type(x, local)
        if dtype.kind in "iub":
            x, local = x.astype(np.float64), local.astype(np.float64)
        stretched = x + scale * (local - x)
        if dtype.kind in "iub":
            stretched = _saturated(np.rint(stretched), dtype)
        out.append(stretched.astype(dtype, copy=False))
    return out


def _saturated(whole: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Whole numbers held as floats, clipped to the range of the integer or bool ``dtype`` they are cast to."""
    low, high = (0, 1) if dtype.kind == "b" else (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
    top = float(high) if float(high) <= high else np.nextafter(float(high), 0.0)  # 2**63 - 1 rounds up to 2**63
    return np.clip(whole, float(low), top)


def weighted_average(local_arrays: Sequence[Arrays], weights: Sequence[float]) -> list[np.ndarray]:
    """sum_i p_i x_i with p_i = weights_i / sum(weights): FedAvg. Every client's arrays must have the shapes
    of the first client's, position by position."""
    if len(local_arrays) != len(weights) or not local_arrays:
        raise LBBSPError(f"{len(local_arrays)} clients' arrays and {len(weights)} weights: need one weight per "
                         "client, and at least one client")
    p = sample_weights(weights)
    shapes = [np.shape(a) for a in local_arrays[0]]
    for i, arrays in enumerate(local_arrays):
        if [np.shape(a) for a in arrays] != shapes:
            raise LBBSPError(f"client {i} sent arrays of shapes {[np.shape(a) for a in arrays]}, client 0 {shapes}")
    return [sum(w * np.asarray(arrays[j]) for w, arrays in zip(p, local_arrays))
            for j in range(len(local_arrays[0]))]


def fednova(global_arrays: Arrays, local_arrays: Sequence[Arrays], steps: Sequence[int],
            weights: Sequence[float]) -> list[np.ndarray]:
    """x + tau_eff * sum_i p_i (x_i - x) / steps_i, the FedNova aggregate for vanilla local SGD."""
    if len(local_arrays) != len(steps):
        raise LBBSPError(f"{len(local_arrays)} clients' arrays and {len(steps)} step counts: need one per client")
    scales = fednova_scales(steps, weights)
    rescaled = [rescale_update(global_arrays, arrays, s) for arrays, s in zip(local_arrays, scales)]
    return weighted_average(rescaled, weights)
