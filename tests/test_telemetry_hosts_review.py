"""Review of resource features where ML jobs run: pinned to a few cores, under a cgroup CPU quota, with /proc or
NVML failing. The features must describe the CPUs this process may use, and a failing reading must leave its
features out (logged once), never fail the training step that reports."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import psutil
import pytest

from lbbsp import Report, ResourceMonitor, telemetry

needs_two_cores = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                     reason="needs CPU affinity and at least two usable cores")


def _pinned_sample(script: str) -> str:
    """Run ``script`` in a fresh interpreter pinned to CPU 0 (as taskset or a cpuset would) and return its output."""
    code = "import os; os.sched_setaffinity(0, {0})\n" + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                          check=True).stdout


@needs_two_cores
def test_a_main_thread_pinned_to_one_core_still_reports_the_machines_cores() -> None:
    """Affinity is per thread on Linux, and OpenMP's binding (OMP_PROC_BIND, KMP_AFFINITY) pins the main thread to one
    of the cores its threads use: read from the affinity, a 2-core worker reported 1 core, and its CPU use counted
    that core only. Only the cgroup quota limits what the process has (this machine sets none)."""
    out = _pinned_sample("""
        from lbbsp import ResourceMonitor, telemetry
        quota = telemetry._cgroup_cpu_quota()
        print(ResourceMonitor(min_interval_s=0.0).sample()["cores"], quota)
    """)
    cores, quota = out.split()
    if quota != "None":
        pytest.skip(f"this machine's cgroup sets a CPU quota ({quota})")
    assert float(cores) == psutil.cpu_count()


def _cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, membership: str, files: dict[str, str]) -> None:
    """A cgroup tree under ``tmp_path`` laid out as /sys/fs/cgroup, and a /proc/self/cgroup naming this process's."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(membership)
    monkeypatch.setattr(telemetry, "_CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(telemetry, "_PROC_SELF_CGROUP", str(tmp_path / "self-cgroup"))


@pytest.mark.parametrize(("membership", "files", "quota"), [
    ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),  # a container's own cgroup namespace
    ("0::/job/step\n", {"job/cpu.max": "250000 100000\n", "job/step/cpu.max": "max 100000\n"}, 2.5),  # an ancestor's
    ("0::/job\n", {"cpu.max": "400000 100000\n", "job/cpu.max": "800000 100000\n"}, 4.0),  # the smallest on the path
    ("4:cpu,cpuacct:/pod\n0::/\n", {"cpu,cpuacct/pod/cpu.cfs_quota_us": "150000\n",
                                    "cpu,cpuacct/pod/cpu.cfs_period_us": "100000\n"}, 1.5),  # cgroup v1
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # no limit
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("0::/\n", {"cpu.max": "garbage\n"}, None),  # unreadable: no limit known, not a crash
    ("0::/\n", {"cpu.max": "0 100000\n"}, None),
    ("", {}, None),  # no cgroup file at all (not Linux, /proc not mounted)
])
def test_the_cgroup_cpu_quota_is_read_from_the_process_cgroup_and_its_ancestors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, membership: str, files: dict[str, str],
        quota: float | None) -> None:
    _cgroup(tmp_path, monkeypatch, membership, files)
    assert telemetry._cgroup_cpu_quota() == quota


def test_a_cpu_quota_below_the_usable_cores_sets_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container limited to half a CPU on this host reported all of the host's cores; a quota rounds up to whole
    cores (as the JVM and Go count a quota), at least 1."""
    _cgroup(tmp_path, monkeypatch, "0::/\n", {"cpu.max": "50000 100000\n"})
    features = ResourceMonitor(min_interval_s=0.0).sample()
    assert features["cores"] == 1.0
    Report("j", 0, 0, 1, 0.1, features=features)


def test_failing_proc_reads_leave_their_features_out_and_warn_once(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """/proc unreadable (a sandbox, hidepid, AccessDenied): the monitor's constructor and every sample raised into
    the training step."""
    def denied(*args: object, **kwargs: object) -> None:
        raise psutil.AccessDenied(os.getpid())

    def missing(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError(2, "No such file or directory", "/proc/stat")

    monkeypatch.setattr(psutil, "cpu_times", missing)
    monkeypatch.setattr(psutil, "virtual_memory", denied)
    monkeypatch.setattr(psutil.Process, "cpu_percent", denied)
    with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
        monitor = ResourceMonitor(min_interval_s=0.0)
        for _ in range(3):
            features = monitor.sample()
            Report("j", 0, 0, 1, 0.1, features=features)
    assert not {"cpu_util", "proc_cpu", "colocated_load", "mem_util"} & set(features)
    assert features["cores"] >= 1.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings  # one per reading, not one per sample
    assert any("/proc/stat" in w for w in warnings), warnings


def test_the_process_reading_alone_failing_keeps_the_machine_share(monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(*args: object, **kwargs: object) -> None:
        raise psutil.AccessDenied(os.getpid())

    monkeypatch.setattr(psutil.Process, "cpu_percent", denied)
    features = ResourceMonitor(min_interval_s=0.0).sample()
    assert "cpu_util" in features and "mem_util" in features
    assert "proc_cpu" not in features and "colocated_load" not in features  # others' load needs ours to subtract


def test_gpu_readings_out_of_range_are_left_out(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """NVML's free memory as an unsigned count that wrapped below zero (used past total, seen on vGPU and unified
    memory) is 1.8e19 bytes: the report built from the sample raised ProtocolError in the training step."""
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda index: "handle"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = (  # type: ignore[attr-defined]
        lambda handle: types.SimpleNamespace(used=17 * 2**30, free=2**64 - 2**30))
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=250)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = ResourceMonitor(gpu_index=0, min_interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
        for _ in range(3):
            features = monitor.sample()
            Report("j", 0, 0, 1, 0.1, features=features, device="cuda:0")
    assert not {"gpu_mem_used", "gpu_mem_free", "gpu_util"} & set(features)
    assert caplog.text.count("out of range") == 2, caplog.text  # memory and utilisation, once each
