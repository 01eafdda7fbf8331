"""BatchTimeCurve's memory cap where a warm-up at a larger batch left NVML's reading held at its peak: the steps after
the first read that same peak until the size passes the warm-up's. The line had left out only the first size's
reading, so one flat reading and the first that rose fitted a line far too shallow (28 MB a sample where 95 were),
and the cap followed it past the card (154 where 146 fit; 5 runs of 150 of 4-GPU jobs with exact readings)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from lbbsp import JobConfig, LBBSPPolicy, Report
from lbbsp.models import AutoCapacityModel, fit_memory_cap

MiB, GiB = 2.0**20, 2.0**30
GRANULE = 20 * MiB  # PyTorch's expandable segments (the granule that keeps flat readings in: test_models_gpu_curve)


def test_a_reading_held_flat_with_the_first_is_left_out_of_the_line() -> None:
    fixed, per_sample, total = 2.5 * GiB, 95 * MiB, 16 * GiB
    fits = int((total - fixed) // per_sample)
    need = lambda size: fixed + per_sample * size  # noqa: E731
    sizes = np.array([[115.0, 124.0, 134.0]])
    held = np.array([[need(131), need(131), need(134)]])  # warmed up at 131: flat up to it
    valid, budget, first = np.ones(sizes.shape, dtype=bool), np.array([total]), np.array([115.0])
    assert fit_memory_cap(sizes, held, valid, budget, None, first)[0] <= fits
    # read honestly, the same sizes give the line, which reaches the card
    honest = np.array([[need(115), need(124), need(134)]])
    assert fit_memory_cap(sizes, honest, valid, budget, None, first)[0] == fits


def _job_after_warm_up(seed: int, iterations: int = 60) -> tuple[list[int], int, list[int]]:
    """A 4-GPU job with LB-BSP and the default models, each card warmed up at 50-95% of what fits, its readings held
    at the peak so far in 20 MiB granules. The sizes that passed the card, what fits, and the final caps."""
    r = random.Random(seed)
    per_sample, fixed, total = r.uniform(40, 100) * MiB, r.uniform(1, 4) * GiB, 16 * GiB
    fits = int((total - fixed) / per_sample)
    speed = [r.choice([1, 1, 2, 4]) for _ in range(4)]
    peak = [fixed + per_sample * int(fits * r.uniform(0.5, 0.95)) for _ in range(4)]
    config = JobConfig("warm", 4, int(fits * 4 * r.uniform(0.6, 0.9)))
    policy, noise = LBBSPPolicy(AutoCapacityModel()), random.Random(seed)
    splits, past = {0: config.initial_sizes(), 1: config.initial_sizes()}, []
    for k in range(iterations):
        reports = []
        for w, size in enumerate(splits[k]):
            if size > fits:
                past.append(size)
            peak[w] = max(peak[w], float(np.ceil((fixed + per_sample * size) / GRANULE) * GRANULE))
            used = min(peak[w], total)
            seconds = (0.01 + 0.1 / speed[w] * max(size - 8, 0) / 1000) * noise.uniform(0.98, 1.02)
            reports.append(Report("warm", w, k, size, seconds, device="cuda:V100",
                                  features={"cores": 16.0, "gpu_mem_used": used, "gpu_mem_free": total - used}))
        policy.observe(reports)
        splits[k + 2] = policy.decide(k + 2, splits[k + 1], config).sizes
        policy.learn()
    return past, fits, [int(c) for c in policy.model.max_batch(np.arange(4))]


@pytest.mark.parametrize("seed", [3, 11, 89, 96, 100, 113, 118])  # the runs of 150 that had passed the card
def test_a_job_warmed_up_at_a_larger_batch_never_passes_the_card(seed: int) -> None:
    past, fits, caps = _job_after_warm_up(seed)
    assert not past, f"sizes {past} where {fits} fit"
    assert max(caps) <= fits


def test_a_held_reading_a_rounding_above_the_others_is_still_flat() -> None:
    """A merged slot's mean of two equal readings can exceed them by 2e-6 bytes: that one reading had stayed in the
    line while the flat ones beside it were left out, and with the first that rose it fitted one far too shallow
    (140 where 130 fit; from a review of the change, s59)."""
    peak, top = 16148070400.0, 16756244480.0
    sizes = np.array([[78.0, 84, 92, 99, 104, 112, 120, 126]])
    used = np.array([[peak] * 7 + [top]])
    used[0, 2] = (1.0 * peak + 1.9330329915368074 * peak) / 2.9330329915368074  # merged, weights 1 and 1.93
    valid, budget, first = np.ones(sizes.shape, dtype=bool), np.array([17008070492.16]), np.array([78.0])
    assert fit_memory_cap(sizes, used, valid, budget, None, first)[0] <= 130


@pytest.mark.parametrize(("total", "fixed", "per_sample", "warm", "sizes", "offsets", "noise", "fits"), [
    # 24 GiB, warmed up at 683: the reading at 125 is 61 MiB over the peak, just past the 4-sigma band (2,120)
    (24 * GiB, 1.5 * GiB, 20 * MiB, 683, [32, 50, 79, 125, 198, 314, 498, 790], [0, 0, 36, 61, 36, 41, 31, 0],
     15.9e6, 1139),
    # 16 GiB, warmed up at 85: the last held reading 68 MiB over it (161)
    (16 * GiB, 2.5 * GiB, 95 * MiB, 85, [32, 48, 72, 108], [0, 0, 68, 0], 17.7e6, 143),
])
def test_one_noisy_held_reading_past_the_band_does_not_make_a_line(total: float, fixed: float, per_sample: float,
                                                                    warm: int, sizes: list[int], offsets: list[int],
                                                                    noise: float, fits: int) -> None:
    need = fixed + per_sample * np.array([sizes], dtype=float)
    used = np.maximum(need, fixed + per_sample * warm) + np.array([offsets]) * MiB
    cap = fit_memory_cap(np.array([sizes], dtype=float), used, np.ones(need.shape, dtype=bool),
                         np.array([0.99 * total]), np.array([False]), np.array([float(sizes[0])]), np.array([noise]))
    assert cap[0] <= fits
