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
    busy_until = time.process_time() + 0.1  # 10 clock ticks of CPU work: the kernel counts CPU time in ticks,
    while time.process_time() < busy_until:  # and a fixed loop took under one on a fast day (read as 0 busy)
        pass
    time.sleep(0.06)
    assert monitor.sample()["proc_cpu"] > 0.0
    cached = ResourceMonitor(min_interval_s=60.0)
    before = cached.sample()
    busy_until = time.process_time() + 0.05
    while time.process_time() < busy_until:
        pass
    assert cached.sample() == before  # within the interval: the same sample, no /proc reads
