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
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import pytest

from lbbsp import Report, ResourceMonitor, telemetry
from lbbsp.errors import ConfigError

RECORDER = Path(__file__).resolve().parent.parent / "experiments" / "record_cpu_trace.py"
_FORK = mp.get_context("fork")  # fast, and the target needs no import by name
_Times = namedtuple("_Times", "user system children_user children_system")


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
