"""``cores`` of a worker confined by its cgroup's cpuset (Docker's --cpuset-cpus, Kubernetes' static CPU manager,
Slurm): the CPUs it may run on, not the host's, so that it does not share a hardware group with unconfined workers.
The cgroup tree is a fake one under tmp_path, laid out as /sys/fs/cgroup."""
from __future__ import annotations

import collections
from pathlib import Path

import psutil
import pytest

from lbbsp import Report, ResourceMonitor, telemetry
from test_telemetry_hosts_review import _cgroup  # a fake cgroup tree under tmp_path


@pytest.mark.parametrize(("membership", "files", "cpus"), [
    ("0::/\n", {"cpuset.cpus.effective": "0-3\n"}, 4),  # a container's own cgroup namespace
    ("0::/job/step\n", {"cpuset.cpus.effective": "0-63\n", "job/cpuset.cpus.effective": "0-7\n",
                        "job/step/cpuset.cpus.effective": "0-3,8,10-11\n"}, 7),  # the process's own cgroup
    ("0::/job/step\n", {"cpuset.cpus.effective": "0-63\n", "job/cpuset.cpus.effective": "4-5\n"}, 2),  # an
    # ancestor's, where the cpuset controller is not enabled down to the process's cgroup
    ("0::/\n", {"cpuset.cpus": "\n", "cpuset.cpus.effective": "2\n"}, 1),  # v2's cpuset.cpus empty: inherited
    ("3:cpuset:/docker/abc\n0::/\n", {"cpuset/cpuset.cpus": "0-63\n", "cpuset/docker/abc/cpuset.cpus": "0-3\n",
                                      "cpuset/docker/abc/cpuset.effective_cpus": "0-3\n"}, 4),  # cgroup v1
    ("3:cpuset:/\n", {"cpuset/cpuset.cpus": "0-5\n"}, 6),  # v1 without effective_cpus (older kernels)
    ("0::/\n", {"cpuset.cpus.effective": "\n"}, None),  # empty: no cap
    ("0::/\n", {"cpuset.cpus.effective": "0-3:2\n"}, None),  # malformed: no cap, not a crash
    ("0::/\n", {"cpuset.cpus.effective": "3-1\n"}, None),
    ("0::/\n", {"cpuset.cpus.effective": "zero\n"}, None),
    ("0::/\n", {}, None),  # no cpuset controller in the tree
    ("", {}, None),  # no cgroup file at all (not Linux, /proc not mounted)
])
def test_the_cpuset_size_is_read_from_the_process_cgroup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, membership: str, files: dict[str, str],
        cpus: int | None) -> None:
    _cgroup(tmp_path, monkeypatch, membership, files)
    assert telemetry._cgroup_cpuset_size() == cpus


def test_a_cpuset_caps_the_cores_but_not_the_machine_wide_load(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A container given --cpuset-cpus=0-3 on a 64-core host with no quota reported 64 cores, and shared a hardware
    group with the host's unconfined workers. cpu_util and colocated_load stay the machine's: psutil counts every
    host CPU, so they are per core of the machine."""
    _cgroup(tmp_path, monkeypatch, "0::/\n", {"cpuset.cpus.effective": "0-3\n", "cpu.max": "max 100000\n"})
    times = collections.namedtuple("times", "user system idle iowait")
    readings = iter([times(0.0, 0.0, 0.0, 0.0), times(40.0, 8.0, 48.0, 0.0)])  # half of 96 CPU-seconds busy
    monkeypatch.setattr(psutil, "cpu_count", lambda *args, **kwargs: 64)
    monkeypatch.setattr(psutil, "cpu_times", lambda *args, **kwargs: next(readings))
    monkeypatch.setattr(psutil.Process, "cpu_percent", lambda *args, **kwargs: 400.0)  # this process: 4 cores
    features = ResourceMonitor(min_interval_s=0.0).sample()
    assert features["cores"] == 4.0
    assert features["cpu_util"] == 0.5
    assert features["colocated_load"] == pytest.approx((0.5 * 64 - 4.0) / 64)  # others' 28 busy cores of 64
    Report("j", 0, 0, 1, 0.1, features=features)


def test_the_smaller_of_cpuset_and_quota_sets_the_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(psutil, "cpu_count", lambda *args, **kwargs: 64)
    _cgroup(tmp_path, monkeypatch, "0::/\n", {"cpuset.cpus.effective": "0-7\n", "cpu.max": "250000 100000\n"})
    assert ResourceMonitor(min_interval_s=0.0).sample()["cores"] == 3.0
    _cgroup(tmp_path, monkeypatch, "0::/\n", {"cpuset.cpus.effective": "0-1\n", "cpu.max": "800000 100000\n"})
    assert ResourceMonitor(min_interval_s=0.0).sample()["cores"] == 2.0
