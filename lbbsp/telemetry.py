"""Resource features for reports: CPU, memory and co-located load (psutil); GPU memory and use (NVML)."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import psutil

from .config import _real
from .errors import ConfigError
from .protocol import _is_integer

log = logging.getLogger("lbbsp.telemetry")


class ResourceMonitor:
    """Samples resource use since the previous sample, as the feature names of :data:`FEATURE_RANGES`.

    A sample costs about a millisecond of /proc reads, so calls closer together than ``min_interval_s``
    return the previous sample's CPU, memory and GPU use: short training steps do not pay for it every time.
    GPU memory is read at every call (an NVML call of microseconds): it is the memory of the batch size just
    run, and a reading kept from an earlier, smaller batch had let a GPU's learned cap pass its card.
    """

    def __init__(self, gpu_index: int | None = None, *, min_interval_s: float = 0.2) -> None:
        if gpu_index is not None and (not _is_integer(gpu_index) or gpu_index < 0):
            raise ConfigError(f"gpu_index must be None or torch's index of a CUDA device (an integer >= 0), got "
                              f"{gpu_index!r}")
        self.min_interval_s = _real(min_interval_s, "min_interval_s", 0.0, 3600.0, "seconds in [0, 3600]")
        self._last: dict[str, float] | None = None
        self._last_at = 0.0
        self._process = psutil.Process()
        self._cores = psutil.cpu_count() or 1
        self._process.cpu_percent(None)  # the baseline of this monitor's own Process object
        self._cpu_times = psutil.cpu_times()  # and of the machine's: psutil.cpu_percent keeps one per thread
        self._nvml = _nvml_handle(int(gpu_index)) if gpu_index is not None else None
        self._nvml_failed: set[str] = set()  # the GPU readings that failed once (logged then, not every time)

    def sample(self) -> dict[str, float]:
        """Machine CPU use, this process's cores, others' load per core, memory use; GPU when known."""
        now = time.monotonic()
        if self._last is None or now - self._last_at >= self.min_interval_s:
            self._last, self._last_at = self._use(), now
        features = dict(self._last)
        if self._nvml is not None:
            features.update(self._gpu("memory", _gpu_memory, *self._nvml))
        return features

    def _use(self) -> dict[str, float]:
        """CPU, memory and GPU use since the previous call."""
        cpu_util = self._machine_busy_share()
        proc_cpu = self._process.cpu_percent(None) / 100.0
        features = {
            "cpu_util": cpu_util,
            "proc_cpu": min(proc_cpu, 1024.0),
            "colocated_load": max(cpu_util * self._cores - proc_cpu, 0.0) / self._cores,
            "mem_util": min(psutil.virtual_memory().percent / 100.0, 1.0),
            "cores": float(self._cores),
        }
        if self._nvml is not None:
            features.update(self._gpu("utilisation", _gpu_utilisation, *self._nvml))
        return features

    def _machine_busy_share(self) -> float:
        """The share of the machine's CPU time spent busy since this monitor's previous call, counted as
        psutil.cpu_percent counts it (idle and iowait are idle; guest time is already in user time), but from this
        monitor's own baseline: psutil keeps one per thread (older psutil one in all), so two monitors in one
        thread cut each other's window short."""
        before, self._cpu_times = self._cpu_times, psutil.cpu_times()
        delta = {name: max(getattr(self._cpu_times, name) - getattr(before, name), 0.0) for name in before._fields}
        total = sum(delta.values()) - delta.get("guest", 0.0) - delta.get("guest_nice", 0.0)
        if total <= 0:  # within one clock tick of the previous call
            return 0.0
        return min(max(1.0 - (delta["idle"] + delta.get("iowait", 0.0)) / total, 0.0), 1.0)

    def _gpu(self, what: str, reading: Callable[[Any, Any], dict[str, float]], pynvml: Any,
             handle: Any) -> dict[str, float]:
        """One NVML reading, or nothing if NVML fails it (utilisation is not supported on a MIG instance; a lost
        GPU fails every call): the training step that reports must not fail with it. Logged once per reading."""
        try:
            return reading(pynvml, handle)
        except Exception as exc:  # noqa: BLE001  (NVMLError, or whatever another pynvml version raises)
            if what not in self._nvml_failed:
                self._nvml_failed.add(what)
                log.warning("NVML cannot read the GPU's %s (%s: %s): reports go without it", what, type(exc).__name__,
                            exc)
            return {}


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
