"""Resource features for reports: CPU, memory and co-located load (psutil); GPU memory and use (NVML)."""
from __future__ import annotations

import time

import psutil


class ResourceMonitor:
    """Samples resource use since the previous sample, as the feature names of :data:`FEATURE_RANGES`.

    A sample costs about a millisecond of /proc reads, so calls closer together than ``min_interval_s``
    return the previous sample: short training steps do not pay for it every time.
    """

    def __init__(self, gpu_index: int | None = None, *, min_interval_s: float = 0.2) -> None:
        self.min_interval_s = min_interval_s
        self._last: dict[str, float] | None = None
        self._last_at = 0.0
        self._process = psutil.Process()
        self._cores = psutil.cpu_count() or 1
        self._process.cpu_percent(None)
        psutil.cpu_percent(None)
        self._nvml = _nvml_handle(gpu_index) if gpu_index is not None else None

    def sample(self) -> dict[str, float]:
        """Machine CPU use, this process's cores, others' load per core, memory use; GPU when known."""
        now = time.monotonic()
        if self._last is not None and now - self._last_at < self.min_interval_s:
            return dict(self._last)
        cpu_util = min(psutil.cpu_percent(None) / 100.0, 1.0)
        proc_cpu = self._process.cpu_percent(None) / 100.0
        features = {
            "cpu_util": cpu_util,
            "proc_cpu": min(proc_cpu, 1024.0),
            "colocated_load": max(cpu_util * self._cores - proc_cpu, 0.0) / self._cores,
            "mem_util": min(psutil.virtual_memory().percent / 100.0, 1.0),
            "cores": float(self._cores),
        }
        if self._nvml is not None:
            features.update(_nvml_sample(*self._nvml))
        self._last, self._last_at = features, now
        return dict(features)


def _nvml_handle(index: int) -> tuple[object, object] | None:
    try:
        import pynvml  # noqa: PLC0415  (optional: only on machines with NVIDIA GPUs)

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001  (no driver, no library, no such device: GPU features are simply absent)
        return None


def _nvml_sample(pynvml: object, handle: object) -> dict[str, float]:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)  # type: ignore[attr-defined]
    util = pynvml.nvmlDeviceGetUtilizationRates(handle)  # type: ignore[attr-defined]
    return {"gpu_mem_used": float(memory.used), "gpu_mem_free": float(memory.free), "gpu_util": util.gpu / 100.0}
