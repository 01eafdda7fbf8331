"""Resource features: valid report fields, and cached between calls closer than the minimum interval."""
from __future__ import annotations

import time

from lbbsp import Report, ResourceMonitor


def test_samples_are_valid_report_features_and_cached_briefly() -> None:
    monitor = ResourceMonitor(min_interval_s=0.05)
    first = monitor.sample()
    assert {"cpu_util", "proc_cpu", "colocated_load", "mem_util", "cores"} <= set(first)
    Report("j", 0, 0, 1, 0.1, features=first)  # validates every feature's name and range
    first["cpu_util"] = -1.0  # a caller's copy: changing it must not change the monitor's cache
    assert monitor.sample()["cpu_util"] >= 0.0
    x = 0
    for i in range(200_000):  # some CPU work, so that a fresh sample sees this process busy
        x += i * i
    time.sleep(0.06)
    assert monitor.sample()["proc_cpu"] > 0.0
    cached = ResourceMonitor(min_interval_s=60.0)
    before = cached.sample()
    for i in range(200_000):
        x += i * i
    assert cached.sample() == before  # within the interval: the same sample, no /proc reads
