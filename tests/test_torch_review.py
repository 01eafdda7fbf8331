"""Found in a review of the torch adapter, on 2 real gloo ranks: a loader drawn after ``lb.close()`` raises the
closed Balancer's error at once, on one rank alone or after the process group is gone (it had waited in the
ranks' check of the epoch, a collective); an empty slice of a ``defaultdict`` batch keeps its structure (it
had raised a TypeError on the rank with nothing to train, leaving the other in the step's all-reduce); and without
DDP a parameter no rank used in a step keeps no gradient, as in one process (a zero one moved it by momentum)."""
from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.multiprocessing import ProcessRaisedException  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from lbbsp import LBBSPError  # noqa: E402
from lbbsp.integrations.torch import Balancer  # noqa: E402
from test_torch_exact import destroy_group, spawn  # noqa: E402
from test_torch_usage import GLOBAL_BATCH, data, linear, trainer  # noqa: E402

GROUP_TIMEOUT = timedelta(seconds=30)  # how long a rank waits in a collective that the other never joins


class OneSample(Dataset):
    """One sample, as a ``defaultdict`` (``default_collate`` keeps the type): with a global batch of 2, the
    epoch's only batch is short, and rank 1's slice is empty."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> defaultdict:
        sample: defaultdict = defaultdict(list)
        sample.update(x=torch.ones(5), y=torch.ones(1))
        return sample


def _draw_after_close(rank: int, url: str, job: str, out: str) -> dict:
    """Train two steps, close, then draw from the loader: on rank 0 alone (rank 1 waits for it outside any
    collective), then on both ranks once the process group is destroyed."""
    result: dict = {}
    model = linear()
    train = trainer(model)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
        lb.attach(model)
        loader = lb.loader(data())
        for (x, y, _), _ in zip(loader, range(2)):
            train(x, y)
    drawn = Path(out, "drawn")
    if rank == 0:
        started = time.monotonic()
        try:
            next(iter(loader))
        except Exception as exc:  # noqa: BLE001  (recorded: the test names what it should have been)
            result["alone"] = f"{type(exc).__name__}: {exc}"
        result["alone_s"] = time.monotonic() - started
        drawn.write_text("")
    else:
        deadline = time.monotonic() + 2 * GROUP_TIMEOUT.total_seconds()
        while not drawn.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    del model, train
    destroy_group()
    try:
        next(iter(loader))
    except Exception as exc:  # noqa: BLE001
        result["no_group"] = f"{type(exc).__name__}: {exc}"
    return result


def _empty_defaultdict_slice(url: str, job: str) -> dict:
    """One epoch of OneSample under a global batch of 2: rank 1 trains an empty slice."""
    model = linear()
    train = trainer(model)
    with Balancer.from_env(2, redis=url, job=job) as lb:
        lb.attach(model)
        batches = []
        for batch in lb.loader(OneSample()):
            train(batch["x"], batch["y"])
            batches.append({"type": type(batch).__name__, "shapes": {k: list(v.shape) for k, v in batch.items()}})
    return {"batches": batches, "params": [p.detach().tolist() for p in model.module.parameters()]}


def _unused_in_some_steps(url: str, job: str) -> dict:
    """Without DDP, SGD with momentum and weight decay on a model whose second layer only the even steps use (on
    every rank): each step's indices and the parameters after the epoch."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Linear(5, 1), torch.nn.Linear(5, 1)])
    opt = torch.optim.SGD(layers.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    steps = []
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
        for step, (x, y, index) in enumerate(lb.loader(data())):
            out = layers[0](x) + (layers[1](x) if step % 2 == 0 else 0)
            F.mse_loss(out, y).backward()
            lb.all_reduce_gradients(layers.parameters())
            opt.step()
            opt.zero_grad()
            steps.append(index.tolist())
    return {"steps": steps, "params": [p.detach().tolist() for p in layers.parameters()]}


def _worker(rank: int, world: int, init: str, url: str, job: str, out: str, scenario: str) -> None:
    """Run ``scenario`` as ``rank``; write what it returned, or what it raised, to out/rank{rank}.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        if scenario == "after_close":
            result = _draw_after_close(rank, url, job, out)
        else:
            result = (_empty_defaultdict_slice if scenario == "empty_defaultdict" else _unused_in_some_steps)(url, job)
            destroy_group()
    except Exception as exc:  # recorded, then raised: this rank ends, and so does the other's wait for it
        Path(out, f"rank{rank}.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run(tmp: Path, url: str, scenario: str) -> list[dict]:
    """Both ranks' results of ``scenario``; the test fails with what each raised, if one did."""
    job = f"test-{uuid.uuid4().hex[:10]}"
    with contextlib.suppress(ProcessRaisedException):  # a rank that raised: its file says what
        spawn(_worker, (2, str(tmp / "rdv"), url, job, str(tmp), scenario), nprocs=2, timeout_s=150)
    ranks = [json.loads(f.read_text()) if (f := tmp / f"rank{r}.json").exists() else {"error": "no result"}
             for r in range(2)]
    assert all("error" not in r for r in ranks), ranks
    return ranks


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_loader_drawn_after_close_raises_at_once_on_one_rank_or_without_a_process_group(
        tmp_path: Path, redis_url: str) -> None:
    outcomes = run(tmp_path, redis_url, "after_close")
    alone = outcomes[0]
    assert alone["alone"].startswith(LBBSPError.__name__) and "Balancer is closed" in alone["alone"], alone
    assert alone["alone_s"] < 5, alone  # it had waited out the process group's timeout in the ranks' check
    for result in outcomes:
        no_group = result["no_group"]
        assert no_group.startswith(LBBSPError.__name__) and "Balancer is closed" in no_group, no_group


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_empty_slice_of_a_defaultdict_batch_keeps_its_structure(tmp_path: Path, redis_url: str) -> None:
    ranks = run(tmp_path, redis_url, "empty_defaultdict")
    assert [r["batches"] for r in ranks] == [[{"type": "defaultdict", "shapes": {"x": [n, 5], "y": [n, 1]}}]
                                             for n in (1, 0)], ranks
    assert ranks[0]["params"] == ranks[1]["params"]
    torch.manual_seed(0)
    alone = torch.nn.Linear(5, 1)  # linear()'s module, trained on the one sample alone
    opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    F.mse_loss(alone(torch.ones(1, 5)), torch.ones(1, 1)).backward()
    opt.step()
    for got, want in zip(ranks[0]["params"], alone.parameters()):
        assert torch.allclose(torch.tensor(got), want.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_ddp_a_parameter_no_rank_used_keeps_no_gradient_as_in_one_process(
        tmp_path: Path, redis_url: str) -> None:
    ranks = run(tmp_path, redis_url, "unused")
    assert ranks[0]["params"] == ranks[1]["params"]
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Linear(5, 1), torch.nn.Linear(5, 1)])
    opt = torch.optim.SGD(layers.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    x_all, y_all, _ = data().tensors
    for step, (mine, theirs) in enumerate(zip(ranks[0]["steps"], ranks[1]["steps"])):
        batch = torch.tensor(sorted(mine + theirs))
        assert len(batch) == GLOBAL_BATCH
        x, y = x_all[batch], y_all[batch]
        out = layers[0](x) + (layers[1](x) if step % 2 == 0 else 0)
        F.mse_loss(out, y).backward()
        opt.step()
        opt.zero_grad()
    for got, want in zip(ranks[0]["params"], layers.parameters()):  # a zero gradient had moved layer 1 by 0.11
        assert torch.allclose(torch.tensor(got), want.detach(), rtol=1e-6, atol=1e-7), (got, want)
