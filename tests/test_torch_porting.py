"""A DDP training script ported to lbbsp, with the features real scripts use, on 2 real gloo ranks whose split changes
every step (empty slices included): gradient accumulation, clipping, a per-step scheduler, a logged global loss,
micro-batches of a slice under the hook form, bf16 autocast, and a DDP script's loader options, each matching
single-process SGD and using each sample once an epoch; a no_sync micro-step without scale_loss is refused."""
from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn
from unittest import mock

import numpy as np
import psutil
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import Dataset, TensorDataset  # noqa: E402

import lbbsp.integrations.torch as lbbsp_torch  # noqa: E402
from lbbsp import ConfigError, EmbeddedRedis, GlobalBatchSampler, LBBSPError  # noqa: E402
from lbbsp.integrations import torch_data  # noqa: E402
from lbbsp.integrations.torch import Balancer  # noqa: E402
from test_torch_exact import ChangingSplit, each_recorded, in_gloo_group, run_ranks  # noqa: E402
from test_torch_resume import alone_in_a_group, loader_alone  # noqa: E402

SAMPLES, GLOBAL_BATCH, SEED = 53, 10, 4  # 5 full global batches and a short one of 3


ACCUMULATE, MAX_NORM, LR = 3, 0.05, 0.3


def tensors() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(SAMPLES, 5, generator=g, dtype=torch.float64),
            torch.randn(SAMPLES, 1, generator=g, dtype=torch.float64))


def indexed() -> TensorDataset:
    return TensorDataset(*tensors(), torch.arange(SAMPLES))


class Records(Dataset):
    """A dataset of dicts, as many real ones are."""

    def __init__(self) -> None:
        self.x, self.y = tensors()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "id": i}


def collate(samples: list[dict]) -> dict:
    """A collate_fn of the script's own: the ids stay a list."""
    return {"x": torch.stack([s["x"] for s in samples]), "y": torch.stack([s["y"] for s in samples]),
            "id": [s["id"] for s in samples]}


def linear(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 1).to(dtype)


def optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)


def params(module: torch.nn.Module) -> list:
    return [p.detach().double().tolist() for p in module.parameters()]


def accumulation_with_clipping(lb: Balancer) -> dict:
    """Accumulation over ACCUMULATE global batches with every backward synchronised (hook form, no no_sync), the
    accumulated gradient clipped, a scheduler stepped per update, and the global batch's mean loss logged by
    docs/torch.md's recipe, which is also the NaN guard that every rank applies alike."""
    module = linear()
    model = lb.attach(DDP(module))
    opt, sched = optimizer(model)
    loader = lb.loader(indexed(), seed=SEED)
    result: dict = {"norms": [], "logged": [], "local_nan": 0, "seen": []}
    for epoch in range(2):
        loader.set_epoch(epoch)
        result["seen"].append([])
        for step, (x, y, index) in enumerate(loader):
            loss = F.mse_loss(model(x), y)
            mine = loss.detach() * lb.gradient_weight() if lb.step.samples else loss.new_zeros(())
            dist.all_reduce(mine)  # the mean loss over the global batch, on every rank
            result["local_nan"] += int(not torch.isfinite(loss))  # an empty slice's mean: a local guard would skip
            if not torch.isfinite(mine):
                continue
            result["logged"].append(mine.item())
            (loss / ACCUMULATE).backward()
            if step % ACCUMULATE == ACCUMULATE - 1 or step == len(loader) - 1:
                result["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
                opt.step()
                opt.zero_grad()
                sched.step()
            result["seen"][-1] += index.tolist()
    result["params"] = params(module)
    return result


def chunks_under_the_hook(lb: Balancer, weigh: Callable[[int, int, int], float]) -> dict:
    """Each slice cut into micro-batches of 3, all but the last under no_sync, each chunk's mean loss multiplied by
    ``weigh(chunk size, slice size, chunks)``, with the hook form."""
    module = linear()
    model = lb.attach(DDP(module))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y, _ in lb.loader(indexed(), seed=SEED):
        chunks = list(zip(x.split(3), y.split(3))) or [(x, y)]  # an empty slice: one empty chunk
        for j, (xc, yc) in enumerate(chunks):
            with model.no_sync() if j < len(chunks) - 1 else contextlib.nullcontext():
                (F.mse_loss(model(xc), yc) * weigh(len(yc), len(y), len(chunks))).backward()
        opt.step()
        opt.zero_grad()
    return {"params": params(module)}


def bf16_autocast(lb: Balancer) -> dict:
    """The forward under torch.autocast("cpu", dtype=torch.bfloat16), the loss in float32, plain SGD."""
    module = linear(torch.float32)
    model = lb.attach(DDP(module))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    splits = []
    for x, y, _ in lb.loader(indexed(), seed=SEED):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x.float())
        F.mse_loss(out.float(), y.float()).backward()
        opt.step()
        opt.zero_grad()
        splits.append(list(lb.step.split))
    return {"params": params(module), "splits": splits}


def loader_options(lb: Balancer) -> dict:
    """A DataLoader's options as a DDP script passes them: a dataset of dicts, its own collate_fn, 2 loader workers,
    persistent_workers=True, pin_memory=True (on a CPU) and drop_last=True, over 3 epochs."""
    model = lb.attach(DDP(linear()))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    # workers forked, as a torchrun rank's are on Linux (a spawned test rank would spawn them, each importing torch)
    loader = lb.loader(Records(), seed=SEED, drop_last=True, collate_fn=collate, num_workers=2,
                       persistent_workers=True, pin_memory=True, multiprocessing_context="fork")
    seen: list[list[int]] = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        seen.append([])
        for batch in loader:
            F.mse_loss(model(batch["x"]), batch["y"]).backward()
            opt.step()
            opt.zero_grad()
            seen[-1] += batch["id"]
    return {"seen": seen, "steps": len(loader)}


def no_sync_branch_without_scale_loss(lb: Balancer) -> dict:
    """Accumulation in the loss form, written as two branches, with scale_loss in the synchronised one only."""
    module = linear()
    model = lb.attach(DDP(module), weighting="loss")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (x, y, _) in enumerate(lb.loader(indexed(), seed=SEED)):
        if step % 2 == 0:
            with model.no_sync():
                (F.mse_loss(model(x), y) / 2).backward()  # its gradient enters the update unweighted
        else:
            (lb.scale_loss(F.mse_loss(model(x), y)) / 2).backward()
            opt.step()
            opt.zero_grad()
    return {"params": params(module)}


def weighted_mean(out: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss that is a mean over weights, not samples (as token-level losses are over tokens): the sum of the
    weighted squared errors, and the sum of the weights (0, 1 or 2 a sample)."""
    w = (index % 3).to(torch.float64).unsqueeze(1)
    return (w * (out - y) ** 2).sum(), w.sum()


def global_count(lb: Balancer, weighting: str) -> dict:
    """docs/torch.md's recipe for a loss that is not a mean over samples: the rank's sum over the global count."""
    module = linear()
    model = lb.attach(DDP(module), weighting=weighting)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y, index in lb.loader(indexed(), seed=SEED):
        loss_sum, count = weighted_mean(model(x), y, index)
        dist.all_reduce(count)
        loss = loss_sum / count * (lb.step.total / max(lb.step.samples, 1))
        (lb.scale_loss(loss) if weighting == "loss" else loss).backward()
        opt.step()
        opt.zero_grad()
    return {"params": params(module)}


SCENARIOS: dict[str, Callable[[Balancer], dict]] = {
    "global_count_hook": lambda lb: global_count(lb, "hook"),
    "global_count_loss": lambda lb: global_count(lb, "loss"),
    "accumulation": accumulation_with_clipping,
    "chunks_by_size": lambda lb: chunks_under_the_hook(lb, lambda chunk, whole, _: chunk / max(whole, 1)),
    "chunks_by_count": lambda lb: chunks_under_the_hook(lb, lambda _, __, count: 1 / count),
    "bf16": bf16_autocast,
    "loader": loader_options,
    "no_sync_unscaled": no_sync_branch_without_scale_loss,  # last: it ends in an error, its step unfinished
}


def _scenarios(url: str, job: str) -> dict:
    """Every scenario on one Balancer (each with its own DDP model): starting a Balancer is the slow part."""
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, policy=ChangingSplit(), min_batch=0) as lb:
        return each_recorded({name: functools.partial(scenario, lb) for name, scenario in SCENARIOS.items()})


def _worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    in_gloo_group(rank, world, init, out, lambda: _scenarios(url, job))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, redis_server: EmbeddedRedis) -> list[dict]:
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    return run_ranks(_worker, 2, tmp_path_factory.mktemp("porting"), url, timeout_s=150)


def outcome(ranks: list[dict], scenario: str) -> list[dict]:
    results = [r[scenario] for r in ranks]
    assert all("error" not in r for r in results), results
    return results


def single_process(epochs: int = 1, *, momentum: bool = False, accumulate: int = 1, clip: bool = False,
                   dtype: torch.dtype = torch.float64) -> dict:
    """The same global batches in one process, the mean loss over each, as the ranks' loop does it."""
    x, y = tensors()
    model = linear(dtype)
    opt, sched = optimizer(model) if momentum else (torch.optim.SGD(model.parameters(), lr=LR), None)
    sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)
    result: dict = {"norms": [], "logged": []}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step in range(len(sampler)):
            batch = torch.as_tensor(sampler.global_indices(step))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float32):
                out = model(x[batch].to(dtype))
            loss = F.mse_loss(out.to(dtype), y[batch].to(dtype))
            result["logged"].append(loss.item())
            (loss / accumulate).backward()
            if step % accumulate == accumulate - 1 or step == len(sampler) - 1:
                if clip:
                    result["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
                opt.step()
                opt.zero_grad()
                if sched is not None:
                    sched.step()
    result["params"] = params(model)
    return result


def assert_params(got: list, want: list, rtol: float = 1e-9) -> None:
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=rtol, atol=1e-12)


def distance(a: list, b: list) -> float:
    return max(float(np.abs(np.array(p) - np.array(q)).max()) for p, q in zip(a, b))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_accumulation_clipping_and_a_scheduler_equal_single_process_sgd(ranks: list[dict]) -> None:
    results = outcome(ranks, "accumulation")
    want = single_process(2, momentum=True, accumulate=ACCUMULATE, clip=True)
    for result in results:
        assert_params(result["params"], want["params"])
        np.testing.assert_allclose(result["norms"], want["norms"], rtol=1e-9)  # clipping saw the global gradient
        np.testing.assert_allclose(result["logged"], want["logged"], rtol=1e-9)  # the recipe's logged loss
    assert min(want["norms"]) > MAX_NORM  # clipping was active at every update
    assert sum(r["local_nan"] for r in results) > 0  # an empty slice's loss is NaN: a local guard would have skipped
    for epoch in range(2):
        assert sorted(results[0]["seen"][epoch] + results[1]["seen"][epoch]) == list(range(SAMPLES))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_micro_batches_of_a_slice_under_the_hook_are_exact_when_weighted_by_their_size(ranks: list[dict]) -> None:
    want = single_process()["params"]
    for result in outcome(ranks, "chunks_by_size"):
        assert_params(result["params"], want)
    for result in outcome(ranks, "chunks_by_count"):  # docs/torch.md: dividing by the count mis-weights them
        assert distance(result["params"], want) > 1e-3


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bf16_autocast_is_exact_to_bf16s_rounding(ranks: list[dict]) -> None:
    results = outcome(ranks, "bf16")
    want = single_process(dtype=torch.float32)["params"]
    # what plain DDP's mean of the ranks' means would have trained on the same splits, in float64
    x, y = tensors()
    model = linear()
    sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)
    for step, split in enumerate(results[0]["splits"]):
        batch = torch.as_tensor(sampler.global_indices(step))
        slices = [s for s in batch.split(split) if len(s)]
        grads = [torch.autograd.grad(F.mse_loss(model(x[s]), y[s]), list(model.parameters())) for s in slices]
        with torch.no_grad():
            for p, *g in zip(model.parameters(), *grads):
                p.sub_(LR * sum(g) / len(g))
    unweighted = distance(params(model), want)
    for result in results:
        assert distance(result["params"], want) < unweighted / 20, (distance(result["params"], want), unweighted)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_ddp_scripts_loader_options_are_taken_and_each_sample_is_used_once_an_epoch(ranks: list[dict]) -> None:
    results = outcome(ranks, "loader")
    kept = SAMPLES // GLOBAL_BATCH * GLOBAL_BATCH  # drop_last: the short final batch is not served
    assert [r["steps"] for r in results] == [SAMPLES // GLOBAL_BATCH] * 2
    for epoch in range(3):
        used = sorted(results[0]["seen"][epoch] + results[1]["seen"][epoch])
        assert len(used) == len(set(used)) == kept
    assert len({tuple(sorted(results[0]["seen"][e] + results[1]["seen"][e])) for e in range(3)}) > 1  # reshuffled


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_micro_step_under_no_sync_without_scale_loss_is_refused_in_the_loss_form(ranks: list[dict]) -> None:
    for result in (r["no_sync_unscaled"] for r in ranks):
        assert "ConfigError" in result.get("error", "") and "no_sync" in result["error"], result


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("weighting", ["hook", "loss"])
def test_a_mean_over_weights_is_exact_with_the_global_count(ranks: list[dict], weighting: str) -> None:
    """The rank's own weighted mean gives (b_i/B) S_i/N_i, not S/N, where slices differ; the docs' recipe divides
    the rank's sum by the all-reduced count and undoes b_i/B."""
    x, y = tensors()
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = GlobalBatchSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)
    for step in range(len(sampler)):
        batch = torch.as_tensor(sampler.global_indices(step))
        loss_sum, count = weighted_mean(model(x[batch]), y[batch], batch)
        (loss_sum / count).backward()
        opt.step()
        opt.zero_grad()
    for rank in outcome(ranks, f"global_count_{weighting}"):
        assert_params(rank["params"], params(model))


# -- a script's mistakes met in one process (a gloo group of this test process alone) -----------------------------
def test_a_scripts_mistakes_in_porting_get_errors_that_say_what_to_do(tmp_path: Path, redis_url: str) -> None:
    """from_env before init_process_group, a model that is not DDP's, a comm_hook that is no function, a gradient
    weight asked for before any step, scale_loss under the hook form: each a clear error that leaves the Balancer
    usable, which then trains and closes (twice: close is idempotent)."""
    with pytest.raises(ConfigError, match="torch.distributed is not initialised: call dist.init_process_group first"):
        Balancer.from_env(GLOBAL_BATCH, redis=redis_url)
    with alone_in_a_group(tmp_path):
        lb = Balancer.from_env(GLOBAL_BATCH, redis=redis_url)
        with pytest.raises(ConfigError, match="attach expects a DistributedDataParallel model, got Linear; without "
                                              r"DDP call all_reduce_gradients\(model.parameters\(\)\)"):
            lb.attach(linear())
        model = DDP(linear())
        with pytest.raises(ConfigError, match="comm_hook must be a DDP communication hook .*, got str"):
            lb.attach(model, comm_hook="fp16")  # type: ignore[arg-type]
        with pytest.raises(LBBSPError, match=r"no step in progress: draw batches from Balancer.loader\(...\)"):
            lb.gradient_weight()
        lb.attach(model)  # the refused comm_hook left the model without one
        seen: list[int] = []
        for x, y, index in lb.loader(indexed(), seed=SEED):
            loss = F.mse_loss(model(x), y)
            with pytest.raises(ConfigError, match="scale_loss with the weighted hook would weight twice"):
                lb.scale_loss(loss)
            loss.backward()
            seen += index.tolist()
        assert sorted(seen) == list(range(SAMPLES)) and lb.last_report is not None
        lb.close()
        lb.close()
        assert lb.closed
        del model
        gc.collect()


def test_a_start_that_fails_after_rank_0s_coordinator_started_leaves_nothing_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure (here Ctrl-C) after rank 0 has started its embedded Redis and its coordinator process, as the
    worker's client is made: from_env stops both before it raises."""
    started: dict[str, Any] = {}

    class Coordinator(lbbsp_torch.CoordinatorProcess):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started["coordinator"] = self._process

    class Server(lbbsp_torch.EmbeddedRedis):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started["server"] = self.pid

    def interrupted(*args: object, **kwargs: object) -> NoReturn:
        raise KeyboardInterrupt

    monkeypatch.delenv("LBBSP_REDIS_URL", raising=False)  # rank 0 serves its own Redis
    monkeypatch.setattr(lbbsp_torch, "CoordinatorProcess", Coordinator)
    monkeypatch.setattr(lbbsp_torch, "EmbeddedRedis", Server)
    monkeypatch.setattr(lbbsp_torch, "WorkerClient", interrupted)
    with alone_in_a_group(tmp_path), pytest.raises(KeyboardInterrupt):
        Balancer.from_env(GLOBAL_BATCH)
    assert set(started) == {"coordinator", "server"}, started
    assert not started["coordinator"].is_alive()
    assert not psutil.pid_exists(started["server"]) or psutil.Process(started["server"]).status() == "zombie"


def test_an_empty_slice_with_a_count_it_cannot_cut_says_so_once() -> None:
    """A rank with an empty slice gets the batch's structure cut to no sample; a collate_fn's count of samples cannot
    be cut (it keeps the other rank's sample's 1), which is said once, as the tensors' rows are what to count by."""

    def counted(samples: list[dict]) -> dict:
        return {**collate(samples), "count": len(samples)}

    loader = loader_alone(Records(), GLOBAL_BATCH, collate_fn=counted)
    said = []
    with mock.patch.object(torch_data.log, "warning", side_effect=lambda *a: said.append(a[0] % a[1:])):
        for _ in range(2):
            empty = loader._slice(0, [])
            assert empty["x"].shape == (0, 5) and empty["y"].shape == (0, 1) and empty["id"] == []
            assert empty["count"] == 1
    assert len(said) == 1 and "cannot cut to no sample (int)" in said[0], said


def test_an_empty_slice_keeps_what_is_not_per_sample_and_names_what_it_cannot_cut() -> None:
    """Parts of a batch that are the same for one sample and two (a constant tensor or array a collate_fn adds, in a
    read-only mapping) are kept as they are, silently; a tensor the collate_fn squeezes for one sample (another
    number of axes than for two) cannot be cut and is named."""
    one = MappingProxyType({"x": torch.ones(1, 2), "grid": torch.arange(3), "mask": np.ones(4),
                            "squeezed": torch.ones(2)})
    two = MappingProxyType({"x": torch.ones(2, 2), "grid": torch.arange(3), "mask": np.ones(4),
                            "squeezed": torch.ones(2, 2)})
    leaks: list[str] = []
    empty = torch_data._emptied(one, two, leaks)
    assert isinstance(empty, MappingProxyType) and empty["x"].shape == (0, 2)
    assert empty["grid"] is one["grid"] and empty["mask"] is one["mask"] and empty["squeezed"] is one["squeezed"]
    assert leaks == ["Tensor"]
    leaks.clear()  # a constant that differs between the two batches is named too
    torch_data._emptied({"grid": np.zeros(3)}, {"grid": np.ones(3)}, leaks)
    assert leaks == ["ndarray"]
