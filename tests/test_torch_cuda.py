"""The CUDA path on a real GPU: CUDA-event timing, exactness, the device and GPU memory reported, NCCL.

Skipped without a GPU (CI has none); run on a machine with one. Two ranks share GPU 0 when there is only one:
NCCL refuses two ranks on one device, so the two-rank tests use gloo with CUDA models, and NCCL runs one rank.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from lbbsp.integrations.torch import Balancer  # noqa: E402
from lbbsp.policies import BSPPolicy  # noqa: E402
from test_torch_exact import (  # noqa: E402
    ACCUMULATE,
    _train,
    destroy_group,
    digits,
    in_gloo_group,
    mlp,
    single_process_params,
    spawn,
)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.slow]

STALL_S = 0.2  # the straggler's extra work per step
STEPS = 8
CUDA_MODES = {"eager": ["hook", "loss", "accumulate"],  # "amp" of the CPU test uses a CPU GradScaler
              "compiled": ["compiled", "compiled-module"]}  # inductor's Triton kernels; aot_eager under DDP


def gpu_of(rank: int) -> torch.device:
    """Each rank its own GPU where there are enough, else they share."""
    return torch.device("cuda", rank % torch.cuda.device_count())


@functools.cache
def _cycles_per_second() -> float:
    """The GPU's clock, measured once it is busy (an idle GPU clocks down: a stall calibrated then ran short)."""
    probe_cycles, rate = 50_000_000, 0.0
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe_cycles)
        end.record()
        end.synchronize()
        rate = probe_cycles / (start.elapsed_time(end) / 1e3)
    return rate


def gpu_sleep(seconds: float) -> None:
    """Queue about ``seconds`` of GPU work; the host goes on at once."""
    torch.cuda._sleep(int(_cycles_per_second() * seconds))


class GPUStall:
    """A forward hook that keeps the GPU busy for about ``seconds`` while the host goes on (the host only queues
    the kernel); :meth:`seconds_taken` is what the stalls really took, by CUDA events."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        _cycles_per_second()

    def __call__(self, *_: object) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gpu_sleep(self.seconds)
        end.record()
        self.events.append((start, end))

    def seconds_taken(self) -> float:
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) / 1e3 for a, b in self.events)


def _exact_worker(rank: int, world: int, init: str, url: str, job: str, out: str, modes: str) -> None:
    torch.cuda.set_device(gpu_of(rank))
    in_gloo_group(rank, world, init, out, lambda: {mode: _train(mode, rank, url, job, f"cuda:{gpu_of(rank).index}")
                                                   for mode in CUDA_MODES[modes]})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("modes", list(CUDA_MODES))
def test_cuda_models_under_gloo_match_single_process_and_report_their_gpu(tmp_path: Path, redis_server,
                                                                          modes: str) -> None:
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    spawn(_exact_worker, (3, str(tmp_path / "rdv"), url, f"test-{uuid.uuid4().hex[:10]}", str(tmp_path), modes),
          nprocs=3, timeout_s=270)
    trained = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    n = len(digits())
    for mode in CUDA_MODES[modes]:
        results = [r[mode] for r in trained]
        assert all(r["splits"] == results[0]["splits"] for r in results), f"{mode}: ranks used different vectors"
        expected = single_process_params(ACCUMULATE if mode == "accumulate" else 1)  # on the CPU, in one process
        for result in results:
            assert result["device"] == f"cuda:{torch.cuda.get_device_name(0)}"[:64], result["device"]
            for got, want in zip(result["params"], expected):
                np.testing.assert_allclose(np.array(got), want.numpy(), rtol=1e-6, atol=1e-9)
        for epoch in range(2):
            used = sorted(i for r in results for i in r["seen"][epoch])
            assert used == list(range(n)), f"{mode}, epoch {epoch}: samples missing or repeated"


def _timing_worker(rank: int, world: int, init: str, url: str, job: str, out: str, backend: str, stall: str) -> None:
    device = gpu_of(rank)
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    model = mlp().to(device)
    gpu_stall = GPUStall(STALL_S) if rank == world - 1 and stall == "on the GPU" else None
    if rank == world - 1:  # the straggler (the only rank under NCCL): its forward really takes longer
        model.register_forward_hook(gpu_stall if gpu_stall else lambda *_: time.sleep(STALL_S))
    ddp = DDP(model)
    lb = Balancer.from_env(40, redis=url, job=job, policy=BSPPolicy())
    lb.attach(ddp)
    compute, wall = [], []
    for step, (x, y, _) in enumerate(lb.loader(digits(), seed=0)):
        torch.cuda.synchronize()
        started = time.perf_counter()
        F.cross_entropy(ddp(x.to(device)), y.to(device)).backward()  # gloo's all-reduce waits for the straggler
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - started)
        if step:
            compute.append(lb.last_report.compute_s)  # a GPU step is reported once its events are done
        if step == STEPS:
            break
    lb.close()
    report = lb.last_report
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "compute": compute, "wall": wall[:-1], "device": report.device, "features": sorted(report.features),
        "backend": dist.get_backend(), "stall": gpu_stall.seconds_taken() if gpu_stall else STALL_S}))
    del ddp, model, lb
    destroy_group()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stall", ["on the GPU", "on the host"])
def test_gloo_with_cuda_models_times_the_gpu_and_leaves_out_the_wait(tmp_path: Path, redis_server, stall: str) -> None:
    """Under gloo the collectives run on the CPU: every rank with a CUDA model had reported the device "cpu" and
    no GPU memory (so the CPU model balanced it, with no memory cap). Its steps are now timed by CUDA events on
    the model's GPU, which count a stall the host only queued and leave out the wait at the all-reduce."""
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    spawn(_timing_worker, (2, str(tmp_path / "rdv"), url, f"test-{uuid.uuid4().hex[:10]}", str(tmp_path), "gloo",
                           stall), nprocs=2, timeout_s=200)
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    took = slow["stall"]
    assert took > STALL_S / 4, f"the stall took {took:.3f}s: too short to tell a wait from compute"
    assert statistics.median(fast["wall"]) > took * 0.8, "the fast rank did not wait for the straggler"
    assert statistics.median(slow["compute"]) > took * 0.8, "the straggler's GPU work was not counted"
    assert statistics.median(fast["compute"]) < took * 0.4, "the fast rank's wait was counted as compute"
    for rank in (fast, slow):
        assert rank["device"].startswith("cuda:"), rank["device"]
        _check_gpu_features(rank["features"])


@pytest.mark.timeout(180)
def test_nccl_times_a_gpu_stall_and_reports_the_gpu(tmp_path: Path, redis_server) -> None:
    """One rank (NCCL refuses two on one GPU): the agreed vector travels on the GPU, the step is timed by CUDA
    events, which see a stall that the host only queued."""
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    spawn(_timing_worker, (1, str(tmp_path / "rdv"), url, f"test-{uuid.uuid4().hex[:10]}", str(tmp_path), "nccl",
                           "on the GPU"), nprocs=1, timeout_s=150)
    only = json.loads((tmp_path / "rank0.json").read_text())
    assert only["backend"] == "nccl"
    assert only["stall"] > STALL_S / 4 and min(only["compute"]) > only["stall"] * 0.8, (only["stall"], only["compute"])
    assert only["device"].startswith("cuda:"), only["device"]
    _check_gpu_features(only["features"])


def _check_gpu_features(features: list[str]) -> None:
    try:
        import pynvml  # noqa: F401, PLC0415
    except ImportError:
        return  # no NVML bindings: reports go without GPU readings
    assert {"gpu_mem_used", "gpu_mem_free"} <= set(features), features


PER_SAMPLE_S = 0.004  # the GPU straggler's extra work per sample of its slice


def _balancing_worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    device = gpu_of(rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    model = mlp().to(device)
    if rank == 1:  # slower per sample, on the GPU: the host only queues the work
        _cycles_per_second()
        model.register_forward_hook(lambda _, inputs, __: gpu_sleep(PER_SAMPLE_S * len(inputs[0])))
    ddp = DDP(model)
    lb = Balancer.from_env(80, redis=url, job=job)  # the default policy: LB-BSP with the automatic model
    lb.attach(ddp)
    loader = lb.loader(digits(), seed=0)
    splits = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for x, y, _ in loader:
            F.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
            splits.append(list(lb.step.split))
    lb.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"splits": splits, "device": lb.last_report.device}))
    del ddp, model, lb, loader
    destroy_group()


@pytest.mark.timeout(240)
def test_lbbsp_moves_samples_off_a_gpu_straggler(tmp_path: Path, redis_server) -> None:
    """End to end on a GPU: the coordinator's default model routes the ranks' CUDA reports to the batch-time curve,
    and the split moves off the rank whose GPU work per sample is the larger."""
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    spawn(_balancing_worker, (2, str(tmp_path / "rdv"), url, f"test-{uuid.uuid4().hex[:10]}", str(tmp_path)),
          nprocs=2, timeout_s=200)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["splits"] == ranks[1]["splits"], "the ranks used different vectors"
    splits = ranks[0]["splits"]
    assert splits[0] == [40, 40], splits[:3]
    late = [s[1] / sum(s) for s in splits[-10:]]
    assert max(late) < 0.3, f"the straggler kept {max(late):.0%} of the batch: {splits[-10:]}"
    assert all(r["device"].startswith("cuda:") for r in ranks)
