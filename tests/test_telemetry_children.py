"""A job's own child processes (DataLoader and tf.data workers, a redis-server it started) are its CPU, not another
job's co-located load; the recorder's deliberate "co-located" busy loops, also its children, can be counted as others'."""
from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import multiprocessing.synchronize
import os
import subprocess
import sys
import time
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lbbsp import Report, ResourceMonitor, telemetry
from lbbsp.errors import ConfigError

RECORDER = Path(__file__).resolve().parent.parent / "experiments" / "record_cpu_trace.py"
_FORK = mp.get_context("fork")  # fast, and the target needs no import by name
_Times = namedtuple("_Times", "user system")


def _burn(started: mp.synchronize.Event, done: mp.synchronize.Event, stop: mp.synchronize.Event) -> None:
    """Busy for a second of wall time, then idle until told to stop: alive at the monitors' last sample."""
    started.set()
    until = time.monotonic() + 1.0
    while time.monotonic() < until:
        pass
    done.set()
    stop.wait(30)


@pytest.fixture
def busy_child() -> Iterator[tuple[mp.synchronize.Event, mp.synchronize.Event]]:
    """A child process that has started: yields (done, stop) of :func:`_burn`."""
    started, done, stop = _FORK.Event(), _FORK.Event(), _FORK.Event()
    child = _FORK.Process(target=_burn, args=(started, done, stop), daemon=True)
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


class _Child:
    """A stand-in for a psutil.Process child: its CPU seconds so far, or the psutil error reading them raises."""

    def __init__(self, pid: int, cpu_s: float | psutil.Error) -> None:
        self.pid, self.cpu_s = pid, cpu_s

    def cpu_times(self) -> _Times:
        if isinstance(self.cpu_s, psutil.Error):
            raise self.cpu_s
        return _Times(self.cpu_s, 0.0)


def test_children_that_end_deny_access_or_reuse_a_pid_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each child's failure leaves the others and the sample whole; a pid now another process's is a new child
    (counted from the next sample), not the old one's CPU seconds since."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(psutil.Process, "cpu_percent", lambda *args, **kwargs: 100.0)  # this process: 1 core
    good, reused = _Child(11, 1.0), _Child(12, 5.0)
    failing = [_Child(13, psutil.NoSuchProcess(13)), _Child(14, psutil.AccessDenied(14)),
               _Child(15, psutil.ZombieProcess(15))]
    scans = iter([[good, reused, *failing], [good, _Child(12, 50.0), *failing]])
    monkeypatch.setattr(psutil.Process, "children", lambda *args, **kwargs: next(scans))
    monkeypatch.setattr(telemetry, "_kernel_lists_children", lambda: False)  # psutil's scan, as without /proc's lists
    monitor = ResourceMonitor(min_interval_s=0.0)
    clock[0] += 2.0
    good.cpu_s = 2.0  # one CPU-second in two seconds
    features = monitor.sample()
    assert features["proc_cpu"] == pytest.approx(1.5)  # this process's core and half the good child's


def test_children_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="children must be True or False, got 'no'"):
        ResourceMonitor(children="no")  # type: ignore[arg-type]


def test_the_trace_recorders_busy_loops_are_co_located_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder's busy loops are its children but stand for other jobs: counted as its own, its traces would
    have read proc_cpu 1 and no co-located load while a loop spun (unlike the shipped traces, and a real worker)."""
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # the recorder sets them on import
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    spec = importlib.util.spec_from_file_location("record_cpu_trace", RECORDER)
    assert spec is not None and spec.loader is not None
    recorder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recorder)
    schedule = recorder.ContentionSchedule(min(os.sched_getaffinity(0)), 1, 1e6, 0).start()  # no switch for days
    try:
        schedule._set(1)  # one busy loop on, from now to the end
        loop = psutil.Process(schedule._pids[0])
        before, started = sum(loop.cpu_times()[:2]), time.monotonic()
        rows = recorder.record(lambda: time.sleep(0.05), 1, 1.0, schedule)  # an idle "training step"
        loop_cores = (sum(loop.cpu_times()[:2]) - before) / (time.monotonic() - started)
    finally:
        schedule.close()
    proc_cpu = sum(row[recorder.COLUMNS.index("proc_cpu")] for row in rows) / len(rows)
    assert loop_cores > 0.3, loop_cores  # it did spin
    assert proc_cpu < loop_cores / 2, (proc_cpu, loop_cores)  # and was not the recorder's own CPU
