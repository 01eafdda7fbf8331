"""Resource features for reports: CPU, memory and co-located load (psutil); GPU memory and use (NVML)."""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

import psutil

from .config import _real
from .errors import ConfigError
from .protocol import FEATURE_RANGES, _flag, _is_integer

log = logging.getLogger("lbbsp.telemetry")

_CGROUP_ROOT = "/sys/fs/cgroup"  # where cgroup v2's tree, or v1's controller folders, are mounted
_PROC_SELF_CGROUP = "/proc/self/cgroup"  # this process's cgroup in each hierarchy
# How much earlier than the wall clock psutil's process creation times can read: on Linux they add the boot time, which
# /proc/stat gives in whole seconds, to the start in clock ticks since boot (0.96 s early on the machine this was
# written on), so a process started just after a sample may read as a second and a tick before it
_CREATE_TIME_EARLY_S = 1.02
# Whether psutil reads a process's reaped children's CPU times (children_user, children_system: 0 on macOS and Windows)
_READS_REAPED_TIMES = not (psutil.MACOS or psutil.WINDOWS)


class ResourceMonitor:
    """Samples resource use since the previous sample, as the feature names of :data:`FEATURE_RANGES`.

    A sample costs about 0.1 ms of /proc reads, plus reads of this process's tasks and descendants, so calls closer
    together than ``min_interval_s`` return the previous sample's CPU, memory and GPU use: short training steps do
    not pay for it every time.
    GPU memory is read at every call (an NVML call of microseconds): it is the memory of the batch size just
    run, and a reading kept from an earlier, smaller batch had let a GPU's learned cap pass its card.
    ``cores`` is the machine's cores capped by the process's cgroup CPU quota and cpuset: a container limited to 2
    CPUs, or to CPUs 0-1, on a 64-core host is a 2-core machine to the models. ``cpu_util`` and ``colocated_load``
    stay the whole machine's (psutil counts every host CPU).
    ``proc_cpu`` counts this process's descendants too (``children``, the default): DataLoader or tf.data workers and
    a redis-server the job started are the job's own CPU, not co-located load. A descendant counts from the window it
    starts in to the one it ends in (its last part through its parent's reaped-children times). ``children=False``
    counts them as others' (this process's own user and system time only, as psutil's cpu_percent), for a process
    that runs stand-ins for other jobs as its children (experiments/record_cpu_trace.py).
    """

    def __init__(self, gpu_index: int | None = None, *, min_interval_s: float = 0.2, children: bool = True) -> None:
        if gpu_index is not None and (not _is_integer(gpu_index) or gpu_index < 0):
            raise ConfigError(f"gpu_index must be None or torch's index of a CUDA device (an integer >= 0), got "
                              f"{gpu_index!r}")
        self.min_interval_s = _real(min_interval_s, "min_interval_s", 0.0, 3600.0, "seconds in [0, 3600]")
        self.children = _flag(children, "children")
        self._last: dict[str, float] | None = None
        self._last_at = 0.0
        self._failed: set[str] = set()  # the readings that failed once (logged then, not every time)
        # The machine's cores, capped by its cgroup's CPU quota and cpuset, read once: the worker's hardware, which a
        # sample must not pay for. Not the CPU affinity: Linux keeps one per thread, and OpenMP's binding
        # (OMP_PROC_BIND) pins the main thread to one core of those its threads use, which had read as a 1-core
        # worker; a cgroup's cpuset is the process's, whatever its threads are pinned to.
        self._host_cores = psutil.cpu_count() or 1
        self._cores = float(available_cores())
        self._process = self._read("process CPU", psutil.Process)
        self._process_cpu()  # the baseline of this monitor's own Process object
        # The CPU-seconds at the previous reading of each descendant (its own and its reaped descendants') and of this
        # process (its reaped descendants' only: its own are cpu_percent's), by pid with its Process object (psutil
        # compares creation times too, so a reused pid is another process); and when that was, on the monotonic and
        # the wall clock (creation times are on that)
        self._descendants: dict[int, tuple[psutil.Process, float]] = {}
        self._descendants_at, self._descendants_wall = time.monotonic(), time.time()
        self._proc_children = _kernel_lists_children()
        if children:
            self._descendants_cpu()  # their baselines
        self._cpu_times = self._read("machine CPU", psutil.cpu_times)  # the machine's (psutil keeps one per thread)
        self._nvml = _nvml_handle(int(gpu_index)) if gpu_index is not None else None

    def sample(self) -> dict[str, float]:
        """Machine CPU use, this process's cores, other processes' busy cores per core of the machine, memory use; GPU
        when known."""
        now = time.monotonic()
        if self._last is None or now - self._last_at >= self.min_interval_s:
            self._last, self._last_at = self._use(), now
        features = dict(self._last)
        if self._nvml is not None:
            features.update(self._gpu("GPU memory", _gpu_memory, *self._nvml))
        return features

    def _use(self) -> dict[str, float]:
        """CPU, memory and GPU use since the previous call; a reading that fails leaves its features out."""
        features = {"cores": self._cores}
        cpu_util = self._read("machine CPU", self._machine_busy_share)
        proc_cpu = self._process_cpu()
        descendants = self._descendants_cpu() if self.children else 0.0
        if proc_cpu is not None:
            proc_cpu += descendants
        if cpu_util is not None:
            features["cpu_util"] = cpu_util
        if proc_cpu is not None:
            features["proc_cpu"] = min(proc_cpu / 100.0, 1024.0)
        if cpu_util is not None and proc_cpu is not None:  # other processes' busy cores per core of the machine
            features["colocated_load"] = max(cpu_util * self._host_cores - proc_cpu / 100.0, 0.0) / self._host_cores
        memory = self._read("memory", psutil.virtual_memory)
        if memory is not None:
            features["mem_util"] = min(memory.percent / 100.0, 1.0)
        if self._nvml is not None:
            features.update(self._gpu("GPU utilisation", _gpu_utilisation, *self._nvml))
        return features

    def _process_cpu(self) -> float | None:
        """This process's CPU use since the previous call, in percent of one core, or None where it cannot be read:
        user and system time, as psutil's cpu_percent counts them (not its reaped children's)."""
        return self._read("process CPU", self._process.cpu_percent, None) if self._process is not None else None

    def _descendants_cpu(self) -> float:
        """The CPU use of this process's descendants since the previous call, in percent of one core; 0 where they
        cannot be read (the next call then spans this window too) and at the first call (their baselines).

        Each descendant counts its user and system time and its reaped descendants' (children_user, children_system),
        and this process its reaped descendants': a descendant that ends is reaped by its parent, in the tree, whose
        children_* times then take its whole total, so the tree's total runs on across exits. One that ended in the
        window counts its last part (its parent's jump, less its total at the previous call); one born in the window
        counts whole; a new one that was not (it could not be read before) only sets its baseline, so no history
        lands in one window. Left: a descendant that ends unwaited for (orphaned to init in the window, as a
        daemonising child's child is, or its parent ignores SIGCHLD) takes its time with it, not to a parent in the
        tree: that window reads low (clamped at 0)."""
        now, wall = time.monotonic(), time.time()
        found = self._read("child processes' CPU", self._list_descendants) if self._process is not None else None
        if self._process is None or found is None:
            return 0.0
        totals, failed = _tree_cpu_s(self._process, found)
        before, born_after = self._descendants, self._descendants_wall - _CREATE_TIME_EARLY_S
        elapsed = now - self._descendants_at
        self._descendants, self._descendants_at, self._descendants_wall = dict(totals), now, wall
        if not before:  # this call read the baselines
            return 0.0
        used = 0.0
        for pid, (process, total) in totals.items():
            previous = before.get(pid)
            if previous is not None and previous[0] == process:  # the same process: psutil compares creation times
                used += total - previous[1]
            elif _created_after(process, born_after):  # born in the window: all its time is the window's
                used += total
        for pid, (process, total) in before.items():
            if pid in totals and totals[pid][0] == process:
                continue
            if pid in failed and failed[pid] == process:  # unreadable now (AccessDenied): its time since counts
                self._descendants[pid] = (process, total)  # when it can be read again
            elif _READS_REAPED_TIMES and not process.is_running():  # ended: its total is in its parent's
                used -= total  # children_* times now
            # else it runs out of the tree (orphaned to init, or not listed), or its last window is not known
        return 100.0 * max(used, 0.0) / elapsed if elapsed > 0 else 0.0

    def _list_descendants(self) -> list[psutil.Process]:
        """This process's descendants: from the kernel's lists of each task's children where it keeps them (reads of
        the descendants only), else psutil's scan of every process on the machine (17 us for each)."""
        assert self._process is not None
        if not self._proc_children:
            return self._process.children(recursive=True)
        out = []
        for pid in _descendant_pids(self._process.pid):
            try:
                out.append(psutil.Process(pid))
            except psutil.Error:  # ended since the listing
                continue
        return out

    def _machine_busy_share(self) -> float | None:
        """The share of the machine's CPU time spent busy since this monitor's previous call, counted as
        psutil.cpu_percent counts it (idle and iowait are idle; guest time is already in user time), but from this
        monitor's own baseline: psutil keeps one per thread (older psutil one in all), so two monitors in one
        thread cut each other's window short."""
        before, self._cpu_times = self._cpu_times, psutil.cpu_times()
        if before is None:  # no baseline (/proc/stat failed before): unknown
            return None
        delta = {name: max(getattr(self._cpu_times, name) - getattr(before, name), 0.0) for name in before._fields}
        total = sum(delta.values()) - delta.get("guest", 0.0) - delta.get("guest_nice", 0.0)
        if total <= 0:  # within one clock tick of the previous call
            return 0.0
        return min(max(1.0 - (delta["idle"] + delta.get("iowait", 0.0)) / total, 0.0), 1.0)

    def _read(self, what: str, reading: Callable[..., Any], *args: Any) -> Any:
        """One reading, or None if it fails (/proc not mounted or not readable, AccessDenied in a sandbox): the
        training step that reports must not fail with it. Logged once per reading."""
        try:
            return reading(*args)
        except Exception as exc:  # noqa: BLE001  (psutil.Error, OSError, or NVMLError of any pynvml version)
            self._warn_once(what, f"cannot be read ({type(exc).__name__}: {exc})")
            return None

    def _gpu(self, what: str, reading: Callable[[Any, Any], dict[str, float]], pynvml: Any,
             handle: Any) -> dict[str, float]:
        """One NVML reading, or nothing if NVML fails it (utilisation is not supported on a MIG instance; a lost
        GPU fails every call) or gives a value no report may carry (free memory that wrapped below zero where used
        passed total): the report would fail validation in the training step."""
        features = self._read(what, reading, pynvml, handle) or {}
        bad = {name: value for name, value in features.items()
               if not FEATURE_RANGES[name][0] <= value <= FEATURE_RANGES[name][1]}
        if bad:
            self._warn_once(what, f"is out of range ({', '.join(f'{k}={v!r}' for k, v in bad.items())})")
            return {}
        return features

    def _warn_once(self, what: str, why: str) -> None:
        if what not in self._failed:
            self._failed.add(what)
            log.warning("the %s %s: reports go without it", what, why)


def available_cores() -> int:
    """The machine's cores capped by this process's cgroup CPU quota and cpuset, at least 1: the cores a worker (or a
    Flower client) reports as its hardware. A container limited to 2 CPUs on a 64-core host has 2."""
    quota, cpuset = _cgroup_cpu_quota(), _cgroup_cpuset_size()
    return int(max(min(psutil.cpu_count() or 1, math.ceil(quota) if quota is not None else math.inf,
                       cpuset if cpuset is not None else math.inf), 1))


def _cgroup_cpu_quota() -> float | None:
    """The CPUs per second this process's cgroup may use (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), the
    smallest quota on the path from its cgroup to the root; None where none is set or none can be read. A Kubernetes
    limit of 2 CPUs on a 64-core host leaves the worker 2 cores' worth, wherever it runs."""
    quotas = []
    for v2, folders in _cgroup_folders("cpu"):  # v2's cpu.max holds "quota period" or "max period"
        files = ("cpu.max",) if v2 else ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        quotas += [q for q in (_quota(folder, files) for folder in folders) if q is not None]
    return min(quotas, default=None)


def _cgroup_cpuset_size() -> int | None:
    """How many CPUs this process's cgroup cpuset holds (cgroup v2 ``cpuset.cpus.effective``, v1
    ``cpuset.effective_cpus`` or ``cpuset.cpus``), the fewest on the path from its cgroup to the root (v2 has the file
    only where the cpuset controller is enabled); None where none can be read. Docker's ``--cpuset-cpus=0-3`` on a
    64-core host leaves the worker 4 cores."""
    sizes = []
    for v2, folders in _cgroup_folders("cpuset"):  # v2's cpuset.cpus is empty where inherited: its effective list
        files = ("cpuset.cpus.effective",) if v2 else ("cpuset.effective_cpus", "cpuset.cpus")
        sizes += [n for n in (_cpu_list_size(os.path.join(folder, name)) for folder in folders for name in files)
                  if n is not None]
    return min(sizes, default=None)


def _cgroup_folders(controller: str) -> list[tuple[bool, list[str]]]:
    """For each cgroup hierarchy of this process that can hold ``controller`` (v2's one tree, v1's tree of that
    controller): whether it is v2, and its folders from the root down to this process's cgroup. Empty where
    /proc/self/cgroup cannot be read."""
    try:
        with open(_PROC_SELF_CGROUP) as f:
            memberships = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return []
    hierarchies = []
    for entry in memberships:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":  # v2: one tree
            folders = [_CGROUP_ROOT]
        elif controller in controllers.split(","):  # v1: the controller's own tree
            folders = [os.path.join(_CGROUP_ROOT, controllers)]
        else:
            continue
        for part in path.strip("/").split("/") if path.strip("/") else []:
            folders.append(os.path.join(folders[-1], part))
        hierarchies.append((controllers == "", folders))
    return hierarchies


def _quota(folder: str, files: tuple[str, ...]) -> float | None:
    """The quota in CPUs that ``files`` in ``folder`` set, or None (no such file, no limit, not numbers)."""
    words: list[str] = []
    try:
        for name in files:
            with open(os.path.join(folder, name)) as f:
                words += f.read().split()
        quota, period = float(words[0]), float(words[1])
    except (OSError, ValueError, IndexError):  # not there, or "max": no limit
        return None
    return quota / period if quota > 0 and period > 0 and math.isfinite(quota / period) else None


def _kernel_lists_children() -> bool:
    """Whether the kernel keeps each task's children in /proc (CONFIG_PROC_CHILDREN), read at this process's main
    thread."""
    return os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def _descendant_pids(pid: int) -> list[int]:
    """The pids of ``pid``'s descendants, from /proc/<pid>/task/<tid>/children (Linux 3.5+ with
    CONFIG_PROC_CHILDREN): a read per task of the descendants, not a scan of every process. Tasks and processes that
    end while it reads are skipped."""
    found: list[int] = []
    parents = [pid]
    while parents:
        parent = parents.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(child) for child in f.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            parents += children
    return found


def _tree_cpu_s(process: psutil.Process, descendants: list[psutil.Process]) -> tuple[
        dict[int, tuple[psutil.Process, float]], dict[int, psutil.Process]]:
    """By pid, the CPU-seconds of ``process`` (this one) that its reaped descendants used (os.times: no /proc read)
    and of each descendant, its own and its reaped descendants'; and the descendants that cannot be read
    (AccessDenied). ``descendants`` lists parents before their children, so a child read was not yet reaped when its
    parent was. One that ended since the listing was reaped before or after its parent was read: all are read again
    (up to twice), so that each parent's reading holds the children that are gone."""
    for _ in range(3):
        reaped = os.times()  # read on macOS too, where psutil reads no descendant's: there an ended one is dropped,
        # not taken off, so this process's would count it twice (its whole past in one window)
        own = reaped.children_user + reaped.children_system if _READS_REAPED_TIMES else 0.0
        totals = {process.pid: (process, own)}
        failed: dict[int, psutil.Process] = {}
        kept, ended = [], False
        for descendant in descendants:
            try:
                times = descendant.cpu_times()
            except psutil.ZombieProcess:  # a NoSuchProcess, but not reaped
                failed[descendant.pid] = descendant
            except psutil.NoSuchProcess:
                ended = True
                continue
            except (psutil.Error, OSError):  # AccessDenied
                failed[descendant.pid] = descendant
            else:
                totals[descendant.pid] = (descendant, times.user + times.system + times.children_user
                                          + times.children_system)
            kept.append(descendant)
        if not ended:
            break
        descendants = kept
    return totals, failed


def _created_after(process: psutil.Process, since: float) -> bool:
    """Whether ``process`` started after ``since`` (the wall clock); False where its creation time cannot be read."""
    try:
        return bool(process.create_time() > since)
    except (psutil.Error, OSError):
        return False


def _cpu_list_size(file: str) -> int | None:
    """How many CPUs the Linux CPU list in ``file`` names ("0-3,8,10-11": 7), or None (no such file, empty, or not
    such a list)."""
    count = 0
    try:
        with open(file) as f:
            for part in f.read().strip().split(","):
                first, _, last = part.partition("-")
                low, high = int(first), int(last or first)
                if not 0 <= low <= high:
                    return None
                count += high - low + 1
    except (OSError, ValueError):  # not there, empty, or a stride ("0-7:2") the kernel does not write
        return None
    return count


def _nvml_handle(index: int) -> tuple[Any, Any] | None:
    """pynvml and the handle of torch's GPU ``index``, or None (no driver, no library, no such device). Under
    ``CUDA_VISIBLE_DEVICES`` torch's index counts the listed GPUs only: ``3,5`` makes cuda:1 the machine's GPU 5,
    which NVML numbers 5 (in the PCI bus order, as CUDA's with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical
    GPUs). A listed UUID is looked up by UUID."""
    try:
        import pynvml  # noqa: PLC0415  (optional: only on machines with NVIDIA GPUs)
    except ImportError:
        log.warning("GPU %d: pynvml is not installed (pip install 'lbbsp[gpu]', or nvidia-ml-py): reports go "
                    "without GPU memory, so no model learns the GPU's memory cap", index)
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001  (no driver: GPU features are absent)
        log.warning("GPU %d: NVML does not start (%s: %s): reports go without GPU features", index,
                    type(exc).__name__, exc)
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    listed = [entry.strip() for entry in visible.split(",")] if visible is not None else None
    try:
        if listed is None:
            return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        if index >= len(listed) or not listed[index]:
            raise LookupError(f"no device {index} in CUDA_VISIBLE_DEVICES={visible!r}")
        if listed[index].isdigit():
            return pynvml, pynvml.nvmlDeviceGetHandleByIndex(int(listed[index]))
        if not hasattr(pynvml, "nvmlDeviceGetHandleByUUID"):
            raise LookupError(f"this pynvml cannot look up {listed[index]!r} of CUDA_VISIBLE_DEVICES by UUID")
        return pynvml, pynvml.nvmlDeviceGetHandleByUUID(listed[index])
    except Exception as exc:  # noqa: BLE001  (as above: reports go without GPU features)
        log.warning("NVML cannot find GPU %d (%s: %s): no GPU features in reports", index, type(exc).__name__, exc)
        return None


def _gpu_memory(pynvml: Any, handle: Any) -> dict[str, float]:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return {"gpu_mem_used": float(memory.used), "gpu_mem_free": float(memory.free)}


def _gpu_utilisation(pynvml: Any, handle: Any) -> dict[str, float]:
    return {"gpu_util": pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0}
