"""Resource features: valid report fields, cached between calls closer than the minimum interval (GPU memory read at
every sample); the job's own CPU with its children, co-located load, cores from the cpuset or CPU quota, GPUs through
NVML and CUDA_VISIBLE_DEVICES, and readings that fail or are out of range left out."""
from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import multiprocessing as mp
import multiprocessing.synchronize
import os
import subprocess
import sys
import textwrap
import time
import types
from collections import namedtuple
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import pytest

from lbbsp import ConfigError, Report, ResourceMonitor, telemetry


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


def test_a_resource_monitor_checks_its_gpu_index_and_says_when_it_cannot_read_the_gpu(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    for index in (-1, "a", 1.0, True):
        with pytest.raises(ConfigError, match="gpu_index"):
            ResourceMonitor(gpu_index=index)  # type: ignore[arg-type]
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # as where nvidia-ml-py is not installed
    with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
        features = ResourceMonitor(gpu_index=0).sample()
    assert "gpu_mem_used" not in features and "cpu_util" in features
    assert "pynvml is not installed (pip install 'lbbsp[gpu]'" in caplog.text


class NVMLNotSupported(Exception):
    pass


def fake_nvml(monkeypatch: pytest.MonkeyPatch, *, by_uuid: bool = True) -> list[object]:
    """A stand-in pynvml whose utilisation is not supported (as on a MIG instance); returns the devices looked up."""
    asked: list[object] = []
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
    def handle(key: object) -> object:
        asked.append(key)
        return ("handle", key)

    nvml.nvmlDeviceGetHandleByIndex = handle  # type: ignore[attr-defined]
    if by_uuid:
        nvml.nvmlDeviceGetHandleByUUID = handle  # type: ignore[attr-defined]
    memory = types.SimpleNamespace(used=1e9, free=3e9)
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: memory  # type: ignore[attr-defined]

    def utilisation(handle: object) -> None:
        raise NVMLNotSupported("Not Supported")

    nvml.nvmlDeviceGetUtilizationRates = utilisation  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return asked


def test_a_failing_nvml_call_omits_its_feature_and_is_logged_once(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    fake_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = ResourceMonitor(gpu_index=0, min_interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
        for _ in range(3):
            features = monitor.sample()
            assert features["gpu_mem_used"] == 1e9 and features["gpu_mem_free"] == 3e9
            assert "gpu_util" not in features
            Report("j", 0, 0, 1, 0.1, features=features)
    assert caplog.text.count("utilisation") == 1


def test_gpu_memory_is_read_at_every_sample_while_the_rest_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU memory belongs to the batch size just run: a reading kept for 0.2 s from an earlier, smaller batch
    (the default interval, on steps shorter than it) had let a learned cap pass its card."""
    fake_nvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    used = iter([1e9, 2e9, 3e9])
    sys.modules["pynvml"].nvmlDeviceGetMemoryInfo = (  # type: ignore[attr-defined]
        lambda handle: types.SimpleNamespace(used=(u := next(used)), free=4e9 - u))
    monitor = ResourceMonitor(gpu_index=0, min_interval_s=60.0)
    samples = [monitor.sample() for _ in range(3)]
    assert [f["gpu_mem_used"] for f in samples] == [1e9, 2e9, 3e9]
    assert [f["gpu_mem_free"] for f in samples] == [3e9, 2e9, 1e9]
    assert len({f["cpu_util"] for f in samples}) == 1  # the /proc readings are the cached sample's


@pytest.mark.parametrize(("visible", "index", "expected"),
                         [("3", 0, [3]), ("5, 2", 1, [2]), ("GPU-8f2a", 0, ["GPU-8f2a"]), (None, 1, [1])])
def test_the_gpu_is_looked_up_through_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch, visible: str | None,
                                                          index: int, expected: list[object]) -> None:
    """With CUDA_VISIBLE_DEVICES=3, cuda:0 is the machine's GPU 3: NVML was asked for GPU 0."""
    asked = fake_nvml(monkeypatch)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert "gpu_mem_used" in ResourceMonitor(gpu_index=index).sample()
    assert asked == expected


@pytest.mark.parametrize("visible", ["GPU-8f2a", "0", ""], ids=["uuid without lookup", "index beyond", "none"])
def test_a_gpu_nvml_cannot_find_goes_without_gpu_features(monkeypatch: pytest.MonkeyPatch, visible: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    fake_nvml(monkeypatch, by_uuid=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
        features = ResourceMonitor(gpu_index=0 if visible.startswith("GPU") else 1).sample()
    assert not {"gpu_mem_used", "gpu_mem_free", "gpu_util"} & set(features)
    assert "no GPU features" in caplog.text


def _busy_share(before: Any, after: Any) -> float:
    """The machine's busy share of CPU time between two psutil.cpu_times() readings, as psutil.cpu_percent counts
    it (idle and iowait are idle; guest time is already in user time)."""
    delta = {name: max(getattr(after, name) - getattr(before, name), 0.0) for name in before._fields}
    total = sum(delta.values()) - delta.get("guest", 0.0) - delta.get("guest_nice", 0.0)
    return 1.0 - (delta["idle"] + delta.get("iowait", 0.0)) / total


def _burn(cpu_s: float) -> None:
    """Busy-loop until this process has used ``cpu_s`` seconds of CPU (ticks, not a loop count: see test_telemetry)."""
    until = time.process_time() + cpu_s
    while time.process_time() < until:
        pass


def test_two_monitors_in_one_thread_each_measure_their_own_window() -> None:
    """B's window is idle then busy, A's busy then idle; each sample's cpu_util must match the machine's busy share
    over that monitor's own window. With one baseline per thread, A's second sample covered only the idle part after
    B's sample (about 0 on a quiet machine instead of about 0.3), and B's only the busy part after A's first."""
    a, b = ResourceMonitor(min_interval_s=0.0), ResourceMonitor(min_interval_s=0.0)
    b_start = psutil.cpu_times()
    time.sleep(0.3)
    a_start = psutil.cpu_times()
    a.sample()
    _burn(0.3)
    b_cpu = b.sample()["cpu_util"]
    b_end = psutil.cpu_times()
    time.sleep(0.3)
    a_cpu = a.sample()["cpu_util"]
    a_end = psutil.cpu_times()
    assert a_cpu == pytest.approx(_busy_share(a_start, a_end), abs=0.08)
    assert b_cpu == pytest.approx(_busy_share(b_start, b_end), abs=0.08)


_TIMES = type(psutil.cpu_times())  # psutil's scputimes of this platform


def test_the_machine_busy_share_is_psutils_cpu_percent_on_the_same_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor's own baseline counts as psutil.cpu_percent does (idle and iowait idle, guest in user already)."""
    start = _TIMES(**dict.fromkeys(_TIMES._fields, 100.0))
    after = _TIMES(*(100.0 + step for step, _ in zip(itertools.cycle([3.0, 0.5, 1.0, 4.0, 2.0]), _TIMES._fields)))
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: start)
    monitor = ResourceMonitor()
    psutil.cpu_percent(None)  # psutil's baseline for this thread: the same times
    monkeypatch.setattr(psutil, "cpu_times", lambda percpu=False: after)
    assert monitor._machine_busy_share() == pytest.approx(psutil.cpu_percent(None) / 100.0, abs=5e-4)


_FORK = mp.get_context("fork")  # fast, and the target needs no import by name


_Times = namedtuple("_Times", "user system children_user children_system")


def _burn_then_idle(started: mp.synchronize.Event, done: mp.synchronize.Event, stop: mp.synchronize.Event) -> None:
    """Busy for a second of wall time, then idle until told to stop: alive at the monitors' last sample."""
    started.set()
    until = time.monotonic() + 1.0
    while time.monotonic() < until:
        pass
    done.set()
    stop.wait(30)


@pytest.fixture
def busy_child() -> Iterator[tuple[mp.synchronize.Event, mp.synchronize.Event]]:
    """A child process that has started: yields (done, stop) of :func:`_burn_then_idle`."""
    started, done, stop = _FORK.Event(), _FORK.Event(), _FORK.Event()
    child = _FORK.Process(target=_burn_then_idle, args=(started, done, stop), daemon=True)
    child.start()
    try:
        assert started.wait(30), "the busy child did not start"
        yield done, stop
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()


def test_a_busy_child_is_the_jobs_own_cpu_unless_children_is_false(
        busy_child: tuple[mp.synchronize.Event, mp.synchronize.Event]) -> None:
    """A DataLoader worker busy for a second read as proc_cpu 0.0 and colocated_load 0.5 on 2 cores: another job's
    load, which put the worker in hedging's "loaded" bucket. With children=False (the recorder's hogs) it is."""
    done, _ = busy_child
    own, others = ResourceMonitor(min_interval_s=0.0), ResourceMonitor(min_interval_s=0.0, children=False)
    own.sample(), others.sample()  # both windows start with the child known and busy
    assert done.wait(30), "the busy child did not finish"
    with_children, without = own.sample(), others.sample()
    Report("j", 0, 0, 1, 0.1, features=with_children)
    cores = psutil.cpu_count()
    assert with_children["proc_cpu"] > 0.4, with_children  # over a second of busy child on 2 cores, even loaded
    assert with_children["proc_cpu"] >= without["proc_cpu"] + 0.3, (with_children, without)
    assert without["colocated_load"] * cores >= with_children["colocated_load"] * cores + 0.25, (with_children, without)


def test_the_kernels_lists_find_a_grandchild_without_scanning_every_process(
        busy_child: tuple[mp.synchronize.Event, mp.synchronize.Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil's children() reads every process on the machine (17 us each: 17 ms a sample on a host of 1,000);
    the kernel's /proc lists of each task's children are read for this process's descendants only."""
    if not telemetry._kernel_lists_children():
        pytest.skip("this kernel keeps no /proc/<pid>/task/<tid>/children")
    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    relay = subprocess.Popen([sys.executable, "-c", f"import subprocess, time; subprocess.Popen({sleeper!r}); "
                              "time.sleep(30)"])  # a process with a child of its own
    grandchildren: set[int] = set()
    try:
        for _ in range(500):  # until the relay has started its child
            grandchildren = {child.pid for child in psutil.Process(relay.pid).children()}
            if grandchildren:
                break
            time.sleep(0.01)
        assert grandchildren and grandchildren | {relay.pid} <= set(telemetry._descendant_pids(os.getpid()))
        monkeypatch.setattr(psutil.Process, "children", lambda *args, **kwargs: pytest.fail("scanned every process"))
        done, _ = busy_child
        monitor = ResourceMonitor(min_interval_s=0.0)
        monitor.sample()
        assert done.wait(30), "the busy child did not finish"
        assert monitor.sample()["proc_cpu"] > 0.4
    finally:
        for pid in grandchildren:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        relay.kill()
        relay.wait()


def test_a_child_that_exits_between_samples_leaves_the_next_sample_whole(
        busy_child: tuple[mp.synchronize.Event, mp.synchronize.Event]) -> None:
    done, stop = busy_child
    monitor = ResourceMonitor(min_interval_s=0.0)
    monitor.sample()
    assert done.wait(30)
    stop.set()  # it exits: a zombie until the fixture joins it, gone after
    time.sleep(0.1)
    for _ in range(2):
        features = monitor.sample()
        assert {"proc_cpu", "colocated_load"} <= set(features), features
        Report("j", 0, 0, 1, 0.1, features=features)


def _spend(cpu_s: float) -> None:
    """Busy until this process has used ``cpu_s`` CPU-seconds, however loaded the machine is."""
    while time.process_time() < cpu_s:
        pass


def _cpu_s() -> float:
    """This process's CPU-seconds and its reaped children's, as the kernel counts them (clock ticks, as /proc's)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _spend_and_tell(go: mp.synchronize.Event, cpu_s: float, stop: mp.synchronize.Event | None,
                    tell: Connection) -> None:
    """When told to go, spends ``cpu_s`` CPU-seconds and tells how many it used; then exits, or waits for ``stop``."""
    assert go.wait(30)
    _spend(cpu_s)
    tell.send(_cpu_s())
    if stop is not None:
        stop.wait(30)


def _reap_a_busy_grandchild(cpu_s: float, tell: Connection) -> None:
    """Forks a grandchild that spends ``cpu_s`` CPU-seconds, reaps it, and tells its own and the grandchild's."""
    pid = os.fork()
    if pid == 0:
        _spend(cpu_s)
        os._exit(0)
    os.waitpid(pid, 0)
    tell.send(_cpu_s())


def _child(target: Callable[..., None], *args: Any) -> tuple[mp.process.BaseProcess, Connection]:
    """A forked child running ``target(*args, tell)``, and the end of the pipe it tells its CPU-seconds on."""
    heard, tell = _FORK.Pipe(duplex=False)
    return _FORK.Process(target=target, args=(*args, tell), daemon=True), heard


def _heard(heard: Connection) -> float:
    assert heard.poll(30), "the child did not tell its CPU-seconds"
    told: float = heard.recv()
    return told


def _window_cpu_s(monitors: list[ResourceMonitor], during: Callable[[], None]) -> tuple[list[float], float]:
    """The CPU-seconds each monitor's proc_cpu gives a window in which ``during`` runs (proc_cpu times the window's
    length), and this process's own in it."""
    for monitor in monitors:
        monitor.sample()
    start, own = time.monotonic(), time.process_time()
    during()
    own, length = time.process_time() - own, time.monotonic() - start
    return [monitor.sample()["proc_cpu"] * length for monitor in monitors], own


@contextlib.contextmanager
def _ended(child: mp.process.BaseProcess) -> Iterator[None]:
    try:
        yield
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()


def test_a_child_that_ends_between_two_samples_counts_its_last_window() -> None:
    """A child's CPU from the last sample that saw it to its exit was lost (proc_cpu ~0 while it burnt 0.3 s), and
    read as co-located load: its parent reaps it, and its total moves into the parent's children_* times."""
    go = _FORK.Event()
    child, heard = _child(_spend_and_tell, go, 0.3, None)
    child.start()
    told = [0.0]

    def burn_and_reap() -> None:
        go.set()
        told[0] = _heard(heard)
        child.join(30)  # reaped by this process

    with _ended(child):  # started: the first sample sees it
        (used,), own = _window_cpu_s([ResourceMonitor(min_interval_s=0.0)], burn_and_reap)
    assert child.exitcode == 0
    assert told[0] - 0.1 <= used <= told[0] + own + 0.1, (used, told[0], own)


def test_a_child_started_after_a_sample_counts_in_the_next_window() -> None:
    """A child first seen at a sample counted only from the next (its first window was its baseline): DataLoader
    workers restarted each epoch were under-counted, and their CPU read as co-located load."""
    go, stop = _FORK.Event(), _FORK.Event()
    go.set()
    child, heard = _child(_spend_and_tell, go, 0.3, stop)
    told = [0.0]

    def start_and_burn() -> None:
        child.start()
        told[0] = _heard(heard)  # it still runs at the next sample

    with _ended(child):
        (used,), own = _window_cpu_s([ResourceMonitor(min_interval_s=0.0)], start_and_burn)
        stop.set()
    assert told[0] - 0.1 <= used <= told[0] + own + 0.1, (used, told[0], own)


def test_a_grandchild_reaped_by_its_child_counts_once() -> None:
    """A grandchild's time is in its parent's children_* times once reaped, and in ours once we reap that parent:
    born, reaped and gone within a window, the tree counts it once (0.4 s here), not twice, and not never."""
    child, heard = _child(_reap_a_busy_grandchild, 0.4)
    told = [0.0]

    def start_and_reap() -> None:
        child.start()
        told[0] = _heard(heard)
        child.join(30)

    with _ended(child):
        (used,), own = _window_cpu_s([ResourceMonitor(min_interval_s=0.0)], start_and_reap)
    assert told[0] >= 0.35, told[0]  # the grandchild's 0.4 s, as the kernel counts it in clock ticks
    assert told[0] - 0.1 <= used <= told[0] + own + 0.1, (used, told[0], own)


def test_children_false_leaves_a_reaped_childs_cpu_out() -> None:
    """children=False counts this process's own CPU only, as psutil's cpu_percent does (user + system, not the
    children_* times that a reaped child's total moves into): the recorder's busy loops stay co-located load, while
    with children (the default) that child is the job's."""
    go = _FORK.Event()
    go.set()
    child, heard = _child(_spend_and_tell, go, 0.3, None)
    told = [0.0]

    def start_burn_and_reap() -> None:
        child.start()
        told[0] = _heard(heard)
        child.join(30)

    with _ended(child):
        (with_children, without), own = _window_cpu_s(
            [ResourceMonitor(min_interval_s=0.0), ResourceMonitor(min_interval_s=0.0, children=False)],
            start_burn_and_reap)
    assert without <= own + 0.05, (without, own, told[0])
    assert told[0] - 0.1 <= with_children <= told[0] + own + 0.1, (with_children, told[0], own)


class _Child:
    """A stand-in for a descendant's psutil.Process: its CPU seconds so far (or the psutil error reading them raises),
    when it started (0: long before any sample), and whether it still runs where it is not listed."""

    def __init__(self, pid: int, cpu_s: float | psutil.Error, created: float = 0.0, running: bool = False) -> None:
        self.pid, self.cpu_s, self.created, self.running = pid, cpu_s, created, running

    def cpu_times(self) -> _Times:
        if isinstance(self.cpu_s, psutil.Error):
            raise self.cpu_s
        return _Times(self.cpu_s, 0.0, 0.0, 0.0)

    def create_time(self) -> float:
        return self.created

    def is_running(self) -> bool:
        return self.running


def _fake_tree(monkeypatch: pytest.MonkeyPatch, cores: list[float], reaped: Callable[[], float],
               scans: Iterator[list[_Child]]) -> tuple[ResourceMonitor, list[float]]:
    """A monitor whose process uses ``cores[0]`` cores of its own (psutil's cpu_percent), whose reaped children's
    CPU-seconds read ``reaped()``, and whose descendants are each next of ``scans`` (psutil's scan, as without /proc's
    lists); and the monotonic clock it reads (seconds, to move on)."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(psutil.Process, "cpu_percent", lambda *args, **kwargs: 100.0 * cores[0])
    # this process's own times run on (a core) in os.times too: they are cpu_percent's, not to be counted again
    monkeypatch.setattr(os, "times", lambda: _Times(clock[0], 0.0, reaped(), 0.0))
    monkeypatch.setattr(psutil.Process, "children", lambda *args, **kwargs: next(scans))
    monkeypatch.setattr(telemetry, "_kernel_lists_children", lambda: False)
    return ResourceMonitor(min_interval_s=0.0), clock


def test_children_that_end_deny_access_reuse_a_pid_or_leave_the_tree_are_counted_as_far_as_they_can_be(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each child's failure leaves the others and the sample whole. A pid now another process's: the old one's last
    window (its reaper's children_* jump, less its total at the previous sample) and the new one, born in the window,
    whole. One that left the tree alive (orphaned to init) took its time with it: nothing is taken off for it."""
    reaped = [0.0]
    good, old = _Child(11, 1.0), _Child(12, 5.0)
    failing = [_Child(13, psutil.NoSuchProcess(13)), _Child(14, psutil.AccessDenied(14)),
               _Child(15, psutil.ZombieProcess(15))]
    orphan = _Child(17, 4.0, running=True)
    scans = [[good, old, *failing, orphan]]
    monitor, clock = _fake_tree(monkeypatch, [1.0], lambda: reaped[0], iter(scans))
    clock[0] += 2.0
    good.cpu_s = 2.0  # half a core
    reaped[0] = 6.0  # this process reaped the old pid 12, whose total ended at 6
    scans.append([good, _Child(12, 0.5, created=time.time()), *failing])  # the new pid 12, born since
    # a core of its own, and 1 (good) + 6 - 5 (the old 12's last second) + 0.5 (the new 12) CPU-seconds in 2 seconds
    assert monitor.sample()["proc_cpu"] == pytest.approx(1.0 + 1.25)


def test_a_child_that_cannot_be_read_for_a_while_is_counted_when_it_can_and_an_unseen_old_one_only_from_then(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A child unreadable at one sample (AccessDenied) keeps its total and counts it all at the next that reads it; a
    child never read before that started long before the previous sample counts from now, not its whole history."""
    child, hidden = _Child(11, 1.0), _Child(12, psutil.AccessDenied(12))
    monitor, clock = _fake_tree(monkeypatch, [0.0], lambda: 0.0, iter([[child, hidden]] * 4))
    clock[0] += 2.0
    child.cpu_s = psutil.AccessDenied(11)
    assert monitor.sample()["proc_cpu"] == 0.0
    clock[0] += 2.0
    child.cpu_s, hidden.cpu_s = 3.0, 50.0  # two CPU-seconds over both windows; 50 over its life, before these samples
    assert monitor.sample()["proc_cpu"] == pytest.approx(1.0)
    clock[0] += 2.0
    hidden.cpu_s = 51.0
    assert monitor.sample()["proc_cpu"] == pytest.approx(0.5)


def test_a_child_reaped_while_the_tree_is_read_is_counted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child listed but reaped before it is read may or may not be in its parent's children_* times as read: the
    tree is read again, so its last window is counted now, not lost and then counted whole in the next."""
    reads = [0]

    def reaped() -> float:  # the child, whose total ended at 3, is reaped after this process's first read
        reads[0] += 1
        return 0.0 if reads[0] <= 2 else 3.0

    child = _Child(11, 1.0)
    monitor, clock = _fake_tree(monkeypatch, [0.5], reaped, iter([[child], [child], []]))
    clock[0] += 2.0
    child.cpu_s = psutil.NoSuchProcess(11)
    assert monitor.sample()["proc_cpu"] == pytest.approx(0.5 + (3.0 - 1.0) / 2)
    clock[0] += 2.0
    assert monitor.sample()["proc_cpu"] == pytest.approx(0.5)


def test_where_psutil_reads_no_reaped_childrens_times_a_child_that_ends_is_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On macOS and Windows children_user and children_system stay 0: an ended child's total moves nowhere that is
    read, so taking it off would read its whole past as the window's deficit (proc_cpu 0 beside a busy process)."""
    monkeypatch.setattr(telemetry, "_READS_REAPED_TIMES", False)
    monitor, clock = _fake_tree(monkeypatch, [0.5], lambda: 0.0, iter([[_Child(11, 30.0)], []]))
    clock[0] += 2.0
    assert monitor.sample()["proc_cpu"] == pytest.approx(0.5)


def test_where_psutil_reads_no_reaped_childrens_times_ours_are_not_read_either(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """os.times reads this process's reaped children on macOS, where psutil reads none of a child's: a child that
    ended is dropped without taking its total off, so ours must not count it either (it had counted its whole past,
    30 s, in the window it ended in)."""
    monkeypatch.setattr(telemetry, "_READS_REAPED_TIMES", False)
    reaped = [0.0]
    monitor, clock = _fake_tree(monkeypatch, [0.5], lambda: reaped[0], iter([[_Child(11, 30.0)], []]))
    clock[0] += 2.0
    reaped[0] = 31.0  # we reaped it: its 30 s and the last second it ran
    assert monitor.sample()["proc_cpu"] == pytest.approx(0.5)


def test_children_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="children must be True or False, got 'no'"):
        ResourceMonitor(children="no")  # type: ignore[arg-type]


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


class NVMLError_LibraryNotFound(Exception):  # pynvml's name for it: the warning quotes it
    pass


def test_nvml_that_does_not_start_leaves_gpu_features_out_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """nvidia-ml-py installed on a machine without the NVIDIA driver (lbbsp[gpu] on a CPU node): nvmlInit raises
    NVMLError_LibraryNotFound; the monitor works on without GPU features."""
    fake_nvml(monkeypatch)

    def no_driver() -> None:
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    sys.modules["pynvml"].nvmlInit = no_driver  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
        monitor = ResourceMonitor(gpu_index=0, min_interval_s=0.0)
        features = monitor.sample()
    assert not {"gpu_mem_used", "gpu_mem_free", "gpu_util"} & set(features) and "cpu_util" in features
    assert "GPU 0: NVML does not start (NVMLError_LibraryNotFound: NVML Shared Library Not Found)" in caplog.text
    Report("j", 0, 0, 1, 0.1, features=monitor.sample(), device="cuda:0")


def test_readings_that_fail_when_the_monitor_is_made_are_left_out_and_the_machine_share_comes_back(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """This process unreadable (no /proc/<pid> in a sandbox) and /proc/stat failing once, at the constructor: the
    first sample has no baseline for the machine's CPU (unknown, not a share of CPU time since boot); the next has
    it. The process's own CPU, and so the co-located load, stay out."""
    def gone(*args: object, **kwargs: object) -> None:
        raise psutil.NoSuchProcess(os.getpid())

    cpu_times = psutil.cpu_times
    calls = itertools.count()

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        if next(calls) == 0:
            raise FileNotFoundError(2, "No such file or directory", "/proc/stat")
        return cpu_times(*args, **kwargs)

    monkeypatch.setattr(psutil, "Process", gone)
    monkeypatch.setattr(psutil, "cpu_times", fails_once)
    with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
        monitor = ResourceMonitor(min_interval_s=0.0)
        first = monitor.sample()
        time.sleep(0.05)
        second = monitor.sample()
    assert set(first) == {"cores", "mem_util"}
    assert set(second) == {"cores", "mem_util", "cpu_util"}
    for features in (first, second):
        Report("j", 0, 0, 1, 0.1, features=features)
    assert caplog.text.count("process CPU cannot be read") == 1 and caplog.text.count("machine CPU") == 1


def test_descendants_that_end_while_they_are_listed_are_skipped(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A child (a DataLoader worker at an epoch's end) that ends between the kernel's listing and its read is left
    out, not the whole listing: the others' CPU still counts in that window, and nothing is logged."""
    if not telemetry._kernel_lists_children():
        pytest.skip("the kernel keeps no lists of children here")
    ended = subprocess.Popen(["true"])
    ended.wait()
    assert telemetry._descendant_pids(ended.pid) == []  # its /proc entries are gone
    live = subprocess.Popen(["sleep", "30"])
    try:
        monitor = ResourceMonitor(min_interval_s=0.0)
        monkeypatch.setattr(telemetry, "_descendant_pids", lambda pid: [ended.pid, live.pid])
        with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
            assert [child.pid for child in monitor._list_descendants()] == [live.pid]
            monitor.sample()
        assert caplog.text == ""
    finally:
        live.kill()
        live.wait()


class _Unborn(_Child):
    """A descendant whose creation time cannot be read (AccessDenied, as psutil may raise on macOS)."""

    def create_time(self) -> float:
        raise psutil.AccessDenied(self.pid)


def test_a_new_child_whose_start_cannot_be_read_counts_from_its_first_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not known to be born in the window, its 50 CPU-seconds so far are not this window's: only its baseline."""
    child = _Unborn(11, 50.0)
    monitor, clock = _fake_tree(monkeypatch, [0.0], lambda: 0.0, iter([[], [child], [child]]))
    clock[0] += 2.0
    assert monitor.sample()["proc_cpu"] == 0.0
    clock[0] += 2.0
    child.cpu_s = 51.0
    assert monitor.sample()["proc_cpu"] == pytest.approx(0.5)


def test_without_a_cgroup_file_the_machines_cores_are_the_workers(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """No /proc/self/cgroup (not Linux, /proc not mounted): no quota, no cpuset, all the machine's cores."""
    monkeypatch.setattr(telemetry, "_PROC_SELF_CGROUP", str(tmp_path / "absent"))
    assert telemetry._cgroup_cpu_quota() is None and telemetry._cgroup_cpuset_size() is None
    assert telemetry.available_cores() == (psutil.cpu_count() or 1)
