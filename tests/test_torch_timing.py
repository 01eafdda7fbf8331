"""Measure the right thing: a fast rank's reported compute time leaves out its wait for a slow rank."""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import ConcatDataset, Subset, TensorDataset  # noqa: E402

from lbbsp.integrations.torch import Balancer  # noqa: E402
from lbbsp.integrations.torch_data import _subset_fingerprint  # noqa: E402
from lbbsp.policies import BSPPolicy  # noqa: E402
from test_torch_exact import destroy_group, digits, mlp, run_ranks, spawn  # noqa: E402
from test_torch_units import GatedGPUClock  # noqa: E402

STALL_S = 0.25  # rank 1's extra compute per step, inside its forward pass
STEPS = 6


def _worker(rank: int, world: int, init: str, url: str, job: str, out: str, where: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    model = mlp()
    if where == "before the forward":  # a buffer: DDP broadcasts it, a collective, as each forward starts
        model.register_buffer("scale", torch.ones(1))
    accumulating = where == "after a backward under no_sync"
    if rank == 1 and where != "before the forward":  # the straggler: its forward pass really takes longer
        model.register_forward_hook(lambda *_: time.sleep(STALL_S))
    ddp = DDP(model)
    lb = Balancer.from_env(40, redis=url, job=job, policy=BSPPolicy())
    lb.attach(ddp, weighting="loss" if accumulating else "hook")
    loader = lb.loader(digits(), seed=0)
    compute, wall = [], []
    for step, (x, y, _) in enumerate(loader):
        if accumulating and step:  # a step under no_sync is reported as the next one begins: read each then
            compute.append(lb.last_report.compute_s)
        started = time.perf_counter()
        if rank == 1 and where == "before the forward":  # or what comes before it (loading, say)
            time.sleep(STALL_S)
        if accumulating:  # every other step under no_sync, each followed by the logging all-reduce of the loss
            with ddp.no_sync() if step % 2 == 0 else contextlib.nullcontext():
                loss = lb.scale_loss(F.cross_entropy(ddp(x), y))
                loss.backward()
            dist.all_reduce(loss.detach())  # under no_sync, the wait for the straggler is here
        else:
            F.cross_entropy(ddp(x), y).backward()  # the all-reduce inside waits for the straggler
        wall.append(time.perf_counter() - started)
        if not accumulating:
            compute.append(lb.last_report.compute_s)
        if step + 1 == STEPS:
            break
    lb.close()
    if accumulating:
        compute.append(lb.last_report.compute_s)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"compute": compute, "wall": wall}))
    del ddp, model, lb, loader
    destroy_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["in the forward", "before the forward", "after a backward under no_sync"])
def test_reported_compute_leaves_out_the_wait_at_the_all_reduce(tmp_path: Path, redis_server, where: str) -> None:
    """'before the forward', with a model that has a buffer: DDP's buffer broadcast at the start of the forward
    made the fast rank wait inside its step, and it reported the straggler's time (0.407 s against 0.001 s), so
    the split never moved. 'after a backward under no_sync' (gradient accumulation, the loss logged by an all-reduce
    as docs/torch.md shows): no comm hook ended those steps' compute, and the wait in the script's all-reduce was
    counted until the next step began."""
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    fast, slow = run_ranks(_worker, 2, tmp_path, url, where, timeout_s=150)
    # step 0 includes start-up; medians over the other steps, so one scheduling stall of a rank on a loaded
    # machine (which shortens its partner's wait, or lengthens its own compute) cannot decide the test
    assert statistics.median(fast["wall"][1:]) > STALL_S * 0.8, "the fast rank did not wait for the straggler"
    assert statistics.median(fast["compute"][1:]) < STALL_S * 0.4, "the fast rank's wait was counted as compute"
    if where == "after a backward under no_sync":  # steps 2 and 4 (the median above reads the synchronised ones)
        assert max(fast["compute"][2::2]) < STALL_S * 0.4, "the wait after a backward under no_sync was counted"
    assert min(slow["compute"][1:]) > STALL_S, "the straggler's real compute was not counted"


def _misusing_worker(rank: int, world: int, init: str, url: str, job: str, out: str, misuse: str) -> None:
    from lbbsp.errors import ConfigError  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    lb = Balancer.from_env(40, redis=url, job=job, policy=BSPPolicy())
    data = digits()
    if misuse == "a shard per rank" and rank == 1:
        data = torch.utils.data.Subset(data, range(len(data) - 300))  # also one global batch fewer: a hang
    seeds = {"a seed per rank": rank, "seeds 2**63 apart": 5 + rank * 2**63}  # the second passed a check of seed % 2**63
    loader = lb.loader(data, seed=seeds.get(misuse, 0))
    if misuse == "set_epoch on rank 0 only" and rank == 0:
        loader.set_epoch(1)
    try:
        for _ in loader:
            pass
        Path(out, f"rank{rank}.txt").write_text("trained")
    except ConfigError as exc:
        Path(out, f"rank{rank}.txt").write_text(str(exc))
    lb.close()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("misuse", ["a seed per rank", "seeds 2**63 apart", "set_epoch on rank 0 only",
                                   "a shard per rank"])
def test_ranks_whose_loaders_disagree_stop_with_an_error_before_the_epoch(tmp_path: Path, redis_server,
                                                                         misuse: str) -> None:
    """Each of these used some samples twice and others never, without an error; a shard with fewer global
    batches left one rank waiting in a collective until the process group's timeout."""
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    spawn(_misusing_worker, (2, str(tmp_path / "rdv"), url, f"test-{uuid.uuid4().hex[:10]}", str(tmp_path), misuse),
          nprocs=2, timeout_s=90)
    said = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    field = {"a seed per rank": "seed", "seeds 2**63 apart": "seed", "set_epoch on rank 0 only": "epoch",
             "a shard per rank": "dataset size"}
    assert all(f"the ranks' loaders differ in {field[misuse]}" in text for text in said), said


def _late_report_worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ddp = DDP(mlp())
    lb = Balancer.from_env(40, redis=url, job=job, policy=BSPPolicy())
    lb.attach(ddp)
    clock = lb._clock = GatedGPUClock()  # type: ignore[assignment]  # the only stand-in here
    batches = iter(lb.loader(digits(), seed=0))
    result: dict = {}
    x, y, _ = next(batches)
    F.cross_entropy(ddp(x), y).backward()
    started = time.perf_counter()
    next(batches)  # step 0 ends while its "GPU" is still busy: the next step must not wait for it
    result["next_step_s"] = time.perf_counter() - started
    result["queued"] = not lb._gpu_reports.idle
    clock.done.set()
    result["first"] = [lb.last_report.iteration, lb.last_report.compute_s]  # type: ignore[union-attr]
    clock.done.clear()

    def refused(*_: object, **__: object) -> None:
        raise ValueError("Redis refused the report")

    lb.client.report = refused  # type: ignore[method-assign]
    F.cross_entropy(ddp(x), y).backward()
    next(batches)  # step 1's report goes to the thread, which fails once the events are done
    clock.done.set()
    lb._gpu_reports._queue.join()
    try:
        next(batches)  # the failure is raised in the training thread, at the next step's report
    except ValueError as exc:
        result["raised"] = str(exc)
    lb.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    del ddp, lb, batches
    destroy_group()


@pytest.mark.timeout(120)
def test_a_gpu_steps_report_waits_for_its_events_in_a_thread_not_in_the_next_step(tmp_path: Path, redis_url: str) -> None:
    """The path CUDA steps take (tests/test_torch_cuda.py runs it on a GPU), with a stand-in clock on the CPU: the
    next step begins at once, the report follows once the events are done, and a report that fails to send
    raises at a later step of the training thread."""
    [result] = run_ranks(_late_report_worker, 1, tmp_path, redis_url, timeout_s=100)
    assert result["queued"] and result["next_step_s"] < 5, result
    assert result["first"] == [0, 0.25]
    assert result["raised"] == "Redis refused the report"


def test_equal_shards_inside_a_concat_dataset_are_told_apart() -> None:
    """A shard per rank of one size inside a ConcatDataset (a dataset of several files, one sharded): only the
    Subset's indices tell the ranks' datasets apart, and the epoch check's fingerprint reaches them through the
    ConcatDataset; the same parts on every rank agree, and parts without a Subset give none (0)."""
    data = digits()
    extra = TensorDataset(torch.zeros(10, 64, dtype=torch.float64), torch.zeros(10, dtype=torch.int64),
                          torch.arange(10))

    def sharded(rank: int) -> ConcatDataset:
        return ConcatDataset([extra, Subset(data, range(rank, 1796, 2))])

    assert len(sharded(0)) == len(sharded(1))
    assert _subset_fingerprint(sharded(0)) != _subset_fingerprint(sharded(1))
    assert _subset_fingerprint(sharded(1)) == _subset_fingerprint(sharded(1)) != 0
    assert _subset_fingerprint(ConcatDataset([extra, data])) == 0
