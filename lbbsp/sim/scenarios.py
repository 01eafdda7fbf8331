"""Simulated clusters: each worker's true time model per iteration, and the features it would report.

A scenario is generated in full from its seed before any policy runs, so every policy sees the same trace.
Every draw over the iterations fills them in order and is the last its generator makes (cpu-contention's
processes each have a generator; gpu-mix and fl-clients draw the per-worker constants first), so a longer
run of the same seed begins with the same iterations as a shorter one.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import ClassVar

import numpy as np

from ..allocation import HingeTime, LinearTime
from ..config import JobConfig, _integer, _real
from ..errors import ConfigError, printable
from ..models import AutoCapacityModel, CapacityModel, FLClientModel, MixedTime
from ..models.fl_client import MAX_LOCAL_STEPS
from ..protocol import MAX_BATCH, MAX_WORKERS, _flag, _is_integer
from .traces import TRACE_FEATURES, CPUTrace, load_traces

#: Iterations past the last simulated one that a scenario generates: decisions run up to ``lag`` (at most 8)
#: iterations ahead, and the oracle is shown the truth of the iteration it decides.
LOOKAHEAD = 8
#: Largest workers x iterations a scenario may be built for: 10,000 workers for 5,000 iterations.
MAX_CELLS = 50_000_000


def _run(num_workers: object, iterations: object, seed: object, batch: object, batch_name: str) -> None:
    """Check what every scenario takes, before anything is drawn: a ConfigError naming the argument."""
    if _is_integer(num_workers) and num_workers < Scenario.min_workers:  # the bound and why (0 had said [1, inf])
        raise ConfigError(f"num_workers must be at least {Scenario.min_workers} (backup workers, one of the policies "
                          f"compared, drop one), got {num_workers!r}")
    _integer(num_workers, "num_workers", Scenario.min_workers, MAX_WORKERS)  # not an integer, or past a job's
    _integer(iterations, "iterations", 1, None)
    # each scenario draws a few workers x (iterations + LOOKAHEAD) arrays: numpy's MemoryError or "maximum allowed
    # dimension exceeded" had named neither argument
    if int(num_workers) * max(int(iterations), LOOKAHEAD) > MAX_CELLS:  # type: ignore[call-overload]
        raise ConfigError(f"num_workers x iterations must be at most {MAX_CELLS:,} (a few GiB of trace; fewer than "
                          f"{LOOKAHEAD} iterations count as {LOOKAHEAD}), got {num_workers} x "
                          f"{printable(str(iterations), 40)}")
    _integer(seed, "seed", 0, None)
    _integer(batch, batch_name, 1, None)


def _job(job: str, num_workers: int, global_batch: int, batch: str) -> JobConfig:
    """The scenario's job; a ConfigError naming the workers and their batch where together they take the global batch
    past a job's most (JobConfig's message had named global_batch, which no option of a scenario sets)."""
    if global_batch > MAX_BATCH:
        fewer = num_workers * MAX_BATCH // global_batch  # under 2, no scenario's job: only a smaller batch does
        raise ConfigError(f"{num_workers:,} workers at {batch} make a global batch of {global_batch:,}, past a job's "
                          f"most ({MAX_BATCH:,}, lbbsp.protocol.MAX_BATCH): {num_workers:,} workers take at most "
                          f"{MAX_BATCH // num_workers:,} samples each"
                          + (f", or at most {fewer:,} workers at that batch" if fewer >= 2 else ""))
    return JobConfig(job, num_workers, global_batch)


def _at_least_zero(name: str, value: object) -> float:
    return _real(value, name, 0.0, math.inf, "a finite number >= 0", hi_open=True)


def _above_zero(name: str, value: object) -> float:
    return _real(value, name, 0.0, math.inf, "a finite number > 0", lo_open=True, hi_open=True)


@dataclass(frozen=True)
class Truth:
    """What is really going to happen in one iteration: each worker's time model, memory cap, presence."""

    time_model: LinearTime | HingeTime | MixedTime
    max_batch: np.ndarray | None = None
    present: np.ndarray | None = None  # False for a federated client that drops out this round


@dataclass
class Scenario:
    """Base class: a job config, device names, ``truth(k)`` and the ``features(k, sizes)`` reports carry."""

    name: str
    config: JobConfig
    devices: Sequence[str]
    notes: dict[str, object] = field(default_factory=dict)
    iterations: int | None = None  # how many iterations its trace covers (None: as many as asked)
    #: The fewest workers the scenario is built with (backup workers, one of the policies compared, drop one).
    min_workers: ClassVar[int] = 2

    def truth(self, iteration: int) -> Truth:
        """What really happens in ``iteration``: the engine times each worker's share with it; only the oracle
        sees it."""
        raise NotImplementedError

    def expected(self, iteration: int) -> Truth | None:
        """The truth without its per-iteration noise (what a perfect model of the slow process could know), or
        None where the scenario does not separate the two."""
        return None

    def features(self, iteration: int, sizes: np.ndarray) -> list[dict[str, float]]:
        """Each worker's report features in ``iteration`` given its size in ``sizes`` (what ResourceMonitor, or a
        federated client's transfer timing, would measure)."""
        raise NotImplementedError

    def measured(self, sizes: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What each worker reports as (samples, compute_s) after taking ``seconds`` for ``sizes``."""
        return sizes, seconds

    def capacity_model(self) -> CapacityModel:
        """LB-BSP's model here: the automatic per-kind choice, forecasting as far ahead as decisions run."""
        return AutoCapacityModel(horizon=self.config.lag)


#: Mean iterations between a cpu-contention worker's level draws, by default (``--mean-dwell``).
MEAN_DWELL = 200.0


class CPUContention(Scenario):
    """CPU workers on shared machines, calibrated from recorded traces.

    Each worker follows a contention level (co-located busy loops, 0 to 2) that switches with probability
    1/``mean_dwell`` per iteration. While at a level it replays, in order, the recorded iterations of one
    trace at that level: their real throughput relative to the trace's own (each trace is scaled so that its lowest
    level's median is 1,000 samples/s, then by the worker's machine speed, lognormal with sigma ``machine_spread``:
    a trace's absolute speed is not kept) and their real resource features.

    Two options take the scenario apart, to show where a policy loses time against the oracle (which knows
    every worker's speed of the coming iteration, noise included): a huge ``mean_dwell`` leaves out the
    level switches; ``noise=False`` replaces each replayed throughput by the median of its level in its
    trace, which leaves out the per-iteration noise (the features stay as recorded).
    """

    def __init__(self, num_workers: int, iterations: int, seed: int, *, traces: Sequence[CPUTrace] | None = None,
                 batch_per_worker: int = 64, mean_dwell: float = MEAN_DWELL, machine_spread: float = 0.25,
                 noise: bool = True) -> None:
        _run(num_workers, iterations, seed, batch_per_worker, "batch_per_worker")
        _at_least_zero("machine_spread", machine_spread)
        _real(mean_dwell, "mean_dwell", 1.0, math.inf, ">= 1 iteration (inf: the levels never switch)")
        given = traces
        if isinstance(given, (str, PathLike)):  # a folder's name had been listed letter by letter
            raise ConfigError(f"traces must be None (the shipped ones) or a non-empty list of CPUTrace, got the folder "
                              f"{given!r}: pass traces=load_traces({str(given)!r}) (from lbbsp.sim)")
        traces = load_traces() if given is None else list(given) if isinstance(given, Iterable) else []
        if not traces or not all(isinstance(trace, CPUTrace) for trace in traces):
            raise ConfigError(f"traces must be None (the shipped ones) or a non-empty list of CPUTrace, as "
                              f"load_traces(directory) gives, got {given!r:.80}")
        noise = _flag(noise, "noise")
        rng, *replay_rngs = _streams(seed, 1 + len(traces))
        super().__init__("cpu-contention", _job("sim-cpu", num_workers, batch_per_worker * num_workers,
                                                   f"batch_per_worker {batch_per_worker}"),
                         ["cpu"] * num_workers,
                         {"traces": [t.name for t in traces], "mean_dwell_iterations": mean_dwell,
                          "machine_spread": machine_spread, "noise": noise}, iterations)
        which = np.arange(num_workers) % len(traces)
        machine = rng.lognormal(0.0, machine_spread, num_workers)
        steady = [trace.steady_rows() for trace in traces]
        rows = np.empty((iterations + LOOKAHEAD, num_workers), dtype=np.int64)
        for t, trace in enumerate(traces):
            members = np.flatnonzero(which == t)
            rows[:, members] = _level_replay(trace, steady[t], members.size, iterations + LOOKAHEAD, mean_dwell,
                                             replay_rngs[t])
        medians = [_level_medians(trace, mask) for trace, mask in zip(traces, steady)]
        scale = np.array([1000.0 / m[t.level == t.level.min()][0] for t, m in zip(traces, medians)])[which]

        def replay(per_trace: Sequence[np.ndarray]) -> np.ndarray:
            """Each worker's replayed rows of its trace's array, stacked as (iterations, workers, ...)."""
            return np.stack([per_trace[t][rows[:, i]] for i, t in enumerate(which.tolist())], axis=1)

        self.level_speed = replay(medians) * (machine * scale)
        self.speed = replay([t.throughput for t in traces]) * (machine * scale) if noise else self.level_speed
        self.feature_rows = replay([t.features for t in traces])

    def truth(self, iteration: int) -> Truth:
        return Truth(LinearTime(self.speed[iteration]))

    def expected(self, iteration: int) -> Truth:
        """Each worker's speed at its true contention level (its level's median), without the noise."""
        return Truth(LinearTime(self.level_speed[iteration]))

    def features(self, iteration: int, sizes: np.ndarray) -> list[dict[str, float]]:
        return [dict(zip(TRACE_FEATURES, row)) for row in self.feature_rows[iteration].tolist()]


def _streams(seed: int, count: int) -> list[np.random.Generator]:
    """``count`` independent generators from one seed: one per random process of a scenario."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(count)]


def _level_medians(trace: CPUTrace, steady: np.ndarray) -> np.ndarray:
    """Each row's throughput replaced by the median throughput of its contention level over the ``steady``
    rows of the trace."""
    levels, index = np.unique(trace.level, return_inverse=True)
    return np.array([np.median(trace.throughput[(trace.level == lv) & steady]) for lv in levels])[index]


def _level_replay(trace: CPUTrace, steady: np.ndarray, workers: int, iterations: int, mean_dwell: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Row indices (iterations, workers): a Markov level per worker, replaying that level's ``steady`` rows in
    order."""
    levels = np.unique(trace.level)
    rows_at = [np.flatnonzero((trace.level == lv) & steady) for lv in levels]
    level = rng.integers(0, levels.size, workers)
    pointer = rng.integers(0, 1 << 30, (workers, levels.size))
    out = np.empty((iterations, workers), dtype=np.int64)
    for k in range(iterations):
        switch = rng.random(workers) < 1.0 / mean_dwell
        level = np.where(switch, rng.integers(0, levels.size, workers), level)
        for j, rows in enumerate(rows_at):
            at = level == j
            out[k, at] = rows[pointer[at, j] % rows.size]
            pointer[at, j] += 1
    return out


#: GPU generations for ``gpu-mix``: one-GPU ResNet-50 training images/s as published in FP32 (TF32 on the A100):
#: K80 (one die) and P100 from TensorFlow's tf_cnn_benchmarks page, V100 and A100 from NVIDIA's
#: DeepLearningExamples; the T4's is derived (no training figure is published; see docs/simulator.md).
#: Memory from the same sources; the knee, the batch below which a card is under-used, is an assumption.
GPU_GENERATIONS: dict[str, dict[str, float]] = {
    "k80": {"share": 0.15, "memory_gb": 12, "images_per_s": 51.9, "knee": 8},
    "p100": {"share": 0.20, "memory_gb": 16, "images_per_s": 219, "knee": 16},
    "t4": {"share": 0.20, "memory_gb": 16, "images_per_s": 130, "knee": 16},
    "v100": {"share": 0.30, "memory_gb": 16, "images_per_s": 412, "knee": 32},
    "a100": {"share": 0.15, "memory_gb": 40, "images_per_s": 909, "knee": 64},
}


class GPUMix(Scenario):
    """A mix of GPU generations: time(b) = overhead + max(b, knee) / speed, memory a + b * batch, small jitter."""

    def __init__(self, num_workers: int, iterations: int, seed: int, *, batch_per_worker: int = 112,
                 overhead_s: float = 0.015, fixed_gb: float = 1.5, gb_per_sample: float = 0.085,
                 jitter: float = 0.005) -> None:
        _run(num_workers, iterations, seed, batch_per_worker, "batch_per_worker")
        for name, value in (("overhead_s", overhead_s), ("fixed_gb", fixed_gb), ("jitter", jitter)):
            _at_least_zero(name, value)
        _above_zero("gb_per_sample", gb_per_sample)
        rng = np.random.default_rng(seed)
        names = list(GPU_GENERATIONS)
        shares = np.array([GPU_GENERATIONS[n]["share"] for n in names])
        kind = rng.choice(len(names), size=num_workers, p=shares / shares.sum())
        table = {key: np.array([GPU_GENERATIONS[names[k]][key] for k in kind], dtype=float)
                 for key in ("memory_gb", "images_per_s", "knee")}
        self.total_bytes = table["memory_gb"] * 1e9
        self.fixed_bytes = np.full(num_workers, fixed_gb * 1e9)
        self.bytes_per_sample = np.full(num_workers, gb_per_sample * 1e9)
        holds = np.floor((self.total_bytes - self.fixed_bytes) / self.bytes_per_sample)
        if (holds < batch_per_worker).any():  # named by all three options (a fixed_gb of 11 had blamed the batch)
            smallest = int(np.argmin(holds))
            raise ConfigError(f"batch_per_worker {batch_per_worker} does not fit the smallest GPU: its "
                              f"{table['memory_gb'][smallest]:g} GB hold {max(0, int(holds[smallest]))} samples of "
                              f"gb_per_sample {gb_per_sample:g} beside fixed_gb {fixed_gb:g}")
        self.cap = np.minimum(holds, MAX_BATCH).astype(np.int64)  # a tiny gb_per_sample: no cap past any batch
        global_batch = batch_per_worker * num_workers
        super().__init__("gpu-mix", _job("sim-gpu", num_workers, global_batch, f"batch_per_worker {batch_per_worker}"),
                         [f"cuda:{names[k]}" for k in kind],
                         {"generations": GPU_GENERATIONS, "overhead_s": overhead_s, "fixed_gb": fixed_gb,
                          "gb_per_sample": gb_per_sample, "jitter": jitter}, iterations)
        self.speed, self.knee, self.overhead = table["images_per_s"], table["knee"], overhead_s
        self.jitter = rng.lognormal(0.0, jitter, (iterations + LOOKAHEAD, num_workers))

    def truth(self, iteration: int) -> Truth:
        factor = self.jitter[iteration]
        slope = factor / self.speed
        return Truth(HingeTime(factor * self.overhead + self.knee * slope, self.knee, slope,
                               np.full(self.speed.size, 1e12)), max_batch=self.cap)

    def features(self, iteration: int, sizes: np.ndarray) -> list[dict[str, float]]:
        used = self.fixed_bytes + self.bytes_per_sample * np.asarray(sizes, dtype=float)
        used = np.minimum(used, self.total_bytes)  # past the cap a real GPU would fail; the engine counts it
        return [{"gpu_mem_used": u, "gpu_mem_free": f, "gpu_util": min(1.0, s / k)}
                for u, f, s, k in zip(used.tolist(), (self.total_bytes - used).tolist(), list(sizes), self.knee.tolist())]


class FLClients(Scenario):
    """Federated clients, FedScale's completion time: transfers + local_steps * batch * 3 * ms_per_sample / 1000.

    ms per sample (of inference; FedScale's 3 counts forward and backward) and down/up kbps are lognormal
    across clients, with spreads ``compute_spread`` and ``link_spread`` (about two orders of magnitude from
    p2 to p98 each by default; medians and spreads are assumptions, see docs/simulator.md). Each round every
    client's speed wobbles by ``round_noise`` and drops out with ``dropout``. A client given no samples is not
    asked: it takes no time and sends no report.
    """

    def __init__(self, num_workers: int, iterations: int, seed: int, *, batch_per_client: int = 20,
                 local_steps: int = 5, model_mb: float = 4.0, median_ms_per_sample: float = 40.0,
                 compute_spread: float = 1.0, median_kbps_down: float = 5000.0, median_kbps_up: float = 2000.0,
                 link_spread: float = 1.0, round_noise: float = 0.05, dropout: float = 0.05) -> None:
        _run(num_workers, iterations, seed, batch_per_client, "batch_per_client")
        _integer(local_steps, "local_steps", 1, MAX_LOCAL_STEPS)  # as FLClientModel bounds it
        for name, value in (("model_mb", model_mb), ("compute_spread", compute_spread), ("link_spread", link_spread),
                            ("round_noise", round_noise)):
            _at_least_zero(name, value)
        for name, value in (("median_ms_per_sample", median_ms_per_sample), ("median_kbps_down", median_kbps_down),
                            ("median_kbps_up", median_kbps_up)):
            _above_zero(name, value)
        # 1 had run: no client ever reported, and every policy was charged as if all had come
        _real(dropout, "dropout", 0.0, 1.0, "a chance per client and round in [0, 1)", hi_open=True)
        rng, presence = _streams(seed, 2)
        super().__init__("fl-clients", _job("sim-fl", num_workers, batch_per_client * num_workers,
                                                 f"batch_per_client {batch_per_client}"),
                         ["phone"] * num_workers,
                         {"local_steps": local_steps, "model_mb": model_mb, "median_ms_per_sample": median_ms_per_sample,
                          "compute_spread": compute_spread, "median_kbps_down": median_kbps_down,
                          "median_kbps_up": median_kbps_up, "link_spread": link_spread, "round_noise": round_noise,
                          "dropout": dropout}, iterations)
        self.local_steps = local_steps
        ms_per_sample = rng.lognormal(np.log(median_ms_per_sample), compute_spread, num_workers)
        bits = model_mb * 8e6
        # a huge spread draws 0 (and inf): numpy's bare "divide by zero" warning had come before the engine's error,
        # which names the options, for the time of inf that follows
        with np.errstate(divide="ignore", over="ignore"):
            self.samples_per_s = 1000.0 / (3.0 * ms_per_sample)  # FedScale counts forward + backward as 3x
            self.download_s = bits / (1e3 * rng.lognormal(np.log(median_kbps_down), link_spread, num_workers))
            self.upload_s = bits / (1e3 * rng.lognormal(np.log(median_kbps_up), link_spread, num_workers))
        self.noise = rng.lognormal(0.0, round_noise, (iterations + LOOKAHEAD, num_workers))
        self.present = presence.random((iterations + LOOKAHEAD, num_workers)) >= dropout

    def truth(self, iteration: int) -> Truth:
        speed = self.samples_per_s / self.noise[iteration] / self.local_steps  # batch -> seconds, steps fixed
        return Truth(LinearTime(speed, overhead=self.download_s + self.upload_s, idle_is_free=True),
                     present=self.present[iteration])

    def measured(self, sizes: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Clients report local samples (steps x batch) and compute seconds without the transfers."""
        return self.local_steps * sizes, np.maximum(seconds - self.download_s - self.upload_s, 0.0)

    def capacity_model(self) -> CapacityModel:
        return AutoCapacityModel(models={"fl": FLClientModel(local_steps=self.local_steps)}, horizon=self.config.lag)

    def features(self, iteration: int, sizes: np.ndarray) -> list[dict[str, float]]:
        return [{"download_s": d, "upload_s": u} for d, u in zip(self.download_s.tolist(), self.upload_s.tolist())]


class MixedCluster(Scenario):
    """GPU and CPU workers in one job, every other worker a GPU: the GPUs of gpu-mix and the CPU workers of
    cpu-contention (their contention levels and recorded noise), each CPU worker's speed scaled so that its
    uncontended median is ``cpu_images_per_s`` times its machine's factor (an assumption, not a published figure:
    a CPU node training what the GPUs train). LB-BSP's automatic model routes each worker by what it reports."""

    min_workers = 4  # two of each kind, as each scenario it is made of needs

    def __init__(self, num_workers: int, iterations: int, seed: int, *, traces: Sequence[CPUTrace] | None = None,
                 mean_dwell: float = MEAN_DWELL, noise: bool = True, cpu_images_per_s: float = 60.0,
                 gpu_batch: int = 112, cpu_batch: int = 16) -> None:
        if _is_integer(num_workers) and num_workers < self.min_workers:
            raise ConfigError(f"num_workers must be at least {self.min_workers} for a mixed cluster (two GPUs, two CPUs), "
                              f"got {num_workers!r}")
        _run(num_workers, iterations, seed, gpu_batch, "gpu_batch")
        _integer(cpu_batch, "cpu_batch", 1, None)
        _above_zero("cpu_images_per_s", cpu_images_per_s)
        self.gpus_at, self.cpus_at = np.arange(0, num_workers, 2), np.arange(1, num_workers, 2)
        try:  # its two halves' errors name their own options: say which half, under the mixed cluster's names
            self.gpus = GPUMix(self.gpus_at.size, iterations, seed, batch_per_worker=gpu_batch)
            self.cpus = CPUContention(self.cpus_at.size, iterations, seed, traces=traces, batch_per_worker=cpu_batch,
                                      mean_dwell=mean_dwell, noise=noise)
        except ConfigError as exc:
            half = "GPUs (gpu_batch as their batch_per_worker)" if not hasattr(self, "gpus") else \
                "CPU workers (cpu_batch as their batch_per_worker)"
            raise ConfigError(f"mixed cluster of {num_workers} workers, its {half}: {exc.message}") from None
        scale = cpu_images_per_s / 1000.0  # cpu-contention's uncontended median is 1,000 samples/s
        self.cpus.speed, self.cpus.level_speed = self.cpus.speed * scale, self.cpus.level_speed * scale
        devices = np.empty(num_workers, dtype=object)
        devices[self.gpus_at], devices[self.cpus_at] = list(self.gpus.devices), list(self.cpus.devices)
        global_batch = gpu_batch * self.gpus_at.size + cpu_batch * self.cpus_at.size
        super().__init__("mixed", _job("sim-mixed", num_workers, global_batch,
                                              f"gpu_batch {gpu_batch} / cpu_batch {cpu_batch}"), devices.tolist(),
                         {"gpus": self.gpus.notes, "cpus": self.cpus.notes, "cpu_images_per_s": cpu_images_per_s,
                          "gpu_batch": gpu_batch, "cpu_batch": cpu_batch}, iterations)
        self.cap = np.full(num_workers, global_batch, dtype=np.int64)  # a CPU worker's memory holds the batch
        self.cap[self.gpus_at] = self.gpus.cap

    def truth(self, iteration: int) -> Truth:
        return Truth(MixedTime(((self.gpus_at, self.gpus.truth(iteration).time_model),
                                (self.cpus_at, self.cpus.truth(iteration).time_model)), self.config.num_workers),
                     max_batch=self.cap)

    def features(self, iteration: int, sizes: np.ndarray) -> list[dict[str, float]]:
        out: list[dict[str, float]] = [{}] * self.config.num_workers
        for at, part in ((self.gpus_at, self.gpus), (self.cpus_at, self.cpus)):
            for i, features in zip(at.tolist(), part.features(iteration, np.asarray(sizes)[at])):
                out[i] = features
        return out


SCENARIOS = {"cpu-contention": CPUContention, "gpu-mix": GPUMix, "fl-clients": FLClients, "mixed": MixedCluster}
