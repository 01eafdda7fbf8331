"""BatchTimeCurve's faster paths learn exactly what the plain ones do: the rows it updates in place through slices
(every worker, or every other one as a mixed job's GPUs) against the same rows copied out and written back."""
from __future__ import annotations

import numpy as np
import pytest

from lbbsp.models import gpu_curve
from lbbsp.models.gpu_curve import BatchTimeCurve
from lbbsp.protocol import Report

GB, MB = 1e9, 1e6


def _run(workers: int) -> tuple[BatchTimeCurve, list[np.ndarray]]:
    """A job of ``workers`` GPUs: all report, then only the even ids; sizes that repeat and change, a GPU that slows
    down, an outlier, a co-tenant on one card, and a report that measured nothing."""
    rng = np.random.default_rng(7)
    model, answers = BatchTimeCurve(), []
    size = rng.integers(100, 400, workers)
    for k in range(60):
        ids = np.arange(workers) if k < 30 else np.arange(0, workers, 2)
        if k % 7 == 3:
            size = np.where(rng.random(workers) < 0.5, size + rng.integers(-40, 40, workers), size)
        reports = []
        for i in ids.tolist():
            samples = 0 if (k, i) == (40, 4) else int(size[i])
            seconds = (0.02 + 1e-4 * max(samples - 150, 0)) * (1.6 if i == 2 and k >= 45 else 1.0)
            seconds *= 3.0 if (k, i) == (20, 1) else float(rng.lognormal(0.0, 0.02))
            used = 1 * GB + 20 * MB * samples + (5 * GB if i == 6 and 35 <= k < 50 else 0.0)
            reports.append(Report("views", i, k, samples, seconds, device="cuda:0",
                                  features={"gpu_mem_used": used, "gpu_mem_free": 16 * GB - used}))
        model.partial_fit(reports, defer=k % 2 == 0)
        answers += [model.predict(np.arange(workers)), model.max_batch(np.arange(workers)),
                    model.time_model(np.arange(workers)).slope]
        model.finish_learning()
    return model, answers


def test_rows_updated_in_place_learn_what_copied_rows_learn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run with every row set taken as an index array (copies written back) instead of a slice."""
    seen = {"shifted": 0, "other": 0}
    shifted, watch_others = BatchTimeCurve._shifted, BatchTimeCurve._watch_others

    def count_shifts(self: BatchTimeCurve, rows: np.ndarray | slice, miss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        answer = shifted(self, rows, miss)
        seen["shifted"] += int(answer[0].sum())
        return answer

    def count_others(self: BatchTimeCurve, rows: np.ndarray | slice, size: np.ndarray, used: np.ndarray,
                     check: np.ndarray) -> np.ndarray:
        answer = watch_others(self, rows, size, used, check)
        seen["other"] += int(answer.sum())
        return answer

    monkeypatch.setattr(BatchTimeCurve, "_shifted", count_shifts)
    monkeypatch.setattr(BatchTimeCurve, "_watch_others", count_others)
    sliced, sliced_answers = _run(12)
    assert seen["shifted"] and seen["other"]  # the run went through the slowdown and the co-tenant
    monkeypatch.setattr(gpu_curve, "_all_or", lambda rows, total: rows)
    copied, copied_answers = _run(12)
    assert vars(sliced).keys() == vars(copied).keys()
    for name, value in vars(sliced).items():
        if isinstance(value, np.ndarray):
            assert value.tobytes() == vars(copied)[name].tobytes(), name
        elif isinstance(value, float):
            assert np.float64(value).tobytes() == np.float64(vars(copied)[name]).tobytes(), name
    for mine, theirs in zip(sliced_answers, copied_answers):
        assert mine.tobytes() == theirs.tobytes()
