"""Fixes from this pass's review of issue 4 as a new user tries it (s60)."""
from __future__ import annotations

import numpy as np

from lbbsp import Report
from lbbsp.models import BatchTimeCurve, EWMAThroughput, hardware_of


def _tf(task: int) -> str:
    return f"/job:worker/replica:0/task:{task}/device:GPU:0"


def test_tensorflow_task_paths_are_one_hardware_for_the_cold_start_prior() -> None:
    """TensorFlow's full device names kept the task in the hardware key, so every task's GPU was hardware of its own:
    a new one was predicted at the median of all workers, CPUs included (505 samples/s where its peers do 1,000), and
    given no memory cap (its peers': 269)."""
    assert hardware_of(Report("j", 0, 0, 1, 1.0, device=_tf(1))) == ("gpu", 0)
    assert hardware_of(Report("j", 0, 0, 1, 1.0, device="cuda:A100")) == ("cuda:a100", 0)  # a model name is kept
    speed, memory = EWMAThroughput(), BatchTimeCurve()
    for k in range(20):
        gpus = [Report("j", w, k, 100 + 10 * ((k + w) % 4), 0.01 + (100 + 10 * ((k + w) % 4)) / 1000, device=_tf(w),
                       features={"gpu_mem_used": 1e9 + 5e7 * (100 + 10 * ((k + w) % 4)),
                                 "gpu_mem_free": 15e9 - 5e7 * (100 + 10 * ((k + w) % 4))}) for w in range(3)]
        cpus = [Report("j", w, k, 100, 10.0, features={"cores": 4}) for w in range(3, 6)]
        speed.partial_fit(gpus + cpus)
        memory.partial_fit(gpus)
    new = Report("j", 6, 20, 0, 0.0, device=_tf(6))
    speed.partial_fit([new])
    memory.partial_fit([new])
    assert speed.predict([6])[0] > 900
    assert memory.max_batch([6])[0] == memory.max_batch([0])[0] < 1000
    assert np.isfinite(speed.predict([0, 3])).all()
