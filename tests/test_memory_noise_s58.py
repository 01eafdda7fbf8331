"""BatchTimeCurve's memory cap on noisy readings: readings held flat at a warm-up's peak rise by noise alone, and a
slope fitted on them had passed the line's tests, so the cap followed a line far too shallow past the card (219
where 170 fit). The readings' noise is now measured from repeated readings at one size, and the line must rise
out of it; exact readings keep a noise of 0 and their cap."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp.errors import ConfigError
from lbbsp.models import BatchTimeCurve, fit_memory_cap
from lbbsp.protocol import Report

GB, MB = 1e9, 1e6
TOTAL, FIXED, PER_SAMPLE = 16 * GB, 1.5 * GB, 85 * MB  # 170 samples fit the card
FITS = int((TOTAL - FIXED) // PER_SAMPLE)


def _need(size: np.ndarray | float) -> np.ndarray | float:
    """The bytes a step at ``size`` truly needs."""
    return FIXED + PER_SAMPLE * size


def _report(iteration: int, worker: int, size: int, used: float) -> Report:
    """A report reading ``used`` bytes on the card (used + free is the card)."""
    return Report("noise", worker, iteration, size, 0.01 + size / 1000, device="cuda:0",
                  features={"gpu_mem_used": used, "gpu_mem_free": TOTAL - used})


def _grow_after_warm_up(seed: int, noise: float, steps: int = 40, workers: int = 4) -> tuple[BatchTimeCurve, int]:
    """Workers warmed up at 150 samples (NVML holds that peak), started at 100, each size read twice, then grown by
    12 samples within their cap; readings with ``noise`` bytes of Gaussian noise. The model and the largest cap."""
    rng = np.random.default_rng(seed)
    model, size = BatchTimeCurve(), np.full(workers, 100)
    peak, largest = np.full(workers, _need(150)), 0
    for it in range(steps):
        peak = np.maximum(peak, _need(size))
        reads = np.minimum(peak + rng.normal(0.0, noise, workers) if noise else peak, TOTAL)
        model.partial_fit([_report(it, w, int(size[w]), float(reads[w])) for w in range(workers)])
        cap = model.max_batch(np.arange(workers))
        largest = max(largest, int(cap.max()))
        if it % 2:
            size = np.minimum(cap, size + 12).astype(int)
    return model, largest


@pytest.mark.parametrize("noise", [20 * MB, 50 * MB])
@pytest.mark.parametrize("seed", range(5))
def test_noisy_readings_held_at_a_warm_up_peak_never_cap_a_worker_past_its_card(seed: int, noise: float) -> None:
    model, largest = _grow_after_warm_up(seed, noise)
    assert largest <= FITS, f"a cap of {largest} where {FITS} fit"
    assert model.max_batch(np.arange(4)).min() >= 0.9 * FITS  # and still near the card: not a collapse


def test_exact_readings_measure_no_noise_and_keep_their_cap() -> None:
    model, largest = _grow_after_warm_up(0, 0.0)
    assert model.mem_noise_ == 0.0
    assert largest == 168  # what the cap reached before noise was measured


def test_the_noise_is_measured_from_repeated_readings() -> None:
    model, _ = _grow_after_warm_up(0, 20 * MB)
    assert 15 * MB < model.mem_noise_ < 25 * MB


def test_a_cotenant_arriving_is_not_counted_as_noise() -> None:
    model = BatchTimeCurve()
    for it, (size, other) in enumerate([(64, 0.0), (64, 0.0), (128, 0.0), (128, 0.0), (128, 3 * GB), (128, 3 * GB)]):
        model.partial_fit(_report(it, 0, size, float(_need(size)) + other))
    assert model.mem_noise_ == 0.0


def test_fit_memory_cap_leaves_a_slope_within_the_noise_to_the_line_through_the_origin() -> None:
    sizes = np.array([[100.0, 110, 111, 122, 123, 135, 136]])
    held = _need(150) + np.array([[0.0, -10, 5, 15, 10, 30, 35]]) * MB  # held at a peak, rising by noise alone
    budget = np.array([0.99 * TOTAL])
    valid, first = np.ones(sizes.shape, dtype=bool), np.array([100.0])
    assert fit_memory_cap(sizes, held, valid, budget, None, first)[0] > FITS  # read as exact: the line, past the card
    origin = int(budget[0] / (held[0, -1] / sizes[0, -1]))
    assert fit_memory_cap(sizes, held, valid, budget, None, first, np.array([20 * MB]))[0] == origin
    line = _need(sizes) + np.array([[0.0, -5, 2, 8, 5, 15, 18]]) * MB  # a true line, a little noise on it
    exact = fit_memory_cap(sizes, line, valid, budget, None, first)[0]
    assert exact - 3 <= fit_memory_cap(sizes, line, valid, budget, None, first, np.array([20 * MB]))[0] < exact


@pytest.mark.parametrize("noise", [np.array([-1.0]), np.array([np.nan]), np.array([1.0, 2.0])])
def test_fit_memory_cap_refuses_a_noise_not_finite_and_non_negative_per_row(noise: np.ndarray) -> None:
    with pytest.raises(ConfigError, match="noise"):
        fit_memory_cap(np.array([[10.0, 20.0]]), np.array([[1e9, 2e9]]), np.ones((1, 2), dtype=bool),
                       np.array([8e9]), noise=noise)

