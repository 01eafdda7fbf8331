"""Exactness and coverage of LB-BSP under DDP: real gloo processes, a real Redis, splits that change every step."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from lbbsp import GlobalBatchSampler, JobConfig, Policy  # noqa: E402
from lbbsp.integrations.torch import Balancer  # noqa: E402
from lbbsp.policies import Decision  # noqa: E402

GLOBAL_BATCH = 100  # 1797 digits: 17 full global batches and a short one of 97
EPOCHS = 2
SEED = 3


class ChangingSplit(Policy):
    """A new uneven split every iteration, with an empty slice now and then (min_batch=0)."""

    name = "changing"

    def decide(self, iteration: int, current, config: JobConfig) -> Decision:
        rng = np.random.default_rng(iteration)
        cuts = np.sort(rng.integers(0, config.global_batch + 1, config.num_workers - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [config.global_batch]]))
        if iteration % 5 == 0:  # one rank gets nothing: it must still join the collectives
            sizes[0] += sizes[-1]
            sizes[-1] = 0
        return Decision(tuple(int(s) for s in sizes), "test: a different split each iteration")


def digits() -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x / 16.0, dtype=torch.float64), torch.tensor(y), torch.arange(len(y)))


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)).double()


def _worker(rank: int, world: int, init: str, url: str, job: str, weighting: str, out: str, workers: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    model = DDP(mlp())
    lb = Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, policy=ChangingSplit(), min_batch=0)
    lb.attach(model, weighting)
    loader = lb.loader(digits(), seed=SEED, num_workers=workers)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen, splits = [], []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        seen.append([])
        for x, y, index in loader:
            loss = F.cross_entropy(model(x), y)
            (lb.scale_loss(loss) if weighting == "loss" else loss).backward()
            opt.step()
            opt.zero_grad()
            seen[-1].extend(index.tolist())
            splits.append(list(lb.step.split))
    lb.close()
    params = [p.detach().tolist() for p in model.module.parameters()]
    Path(out, f"rank{rank}.json").write_text(json.dumps({"seen": seen, "splits": splits, "params": params}))
    dist.destroy_process_group()


def run_ranks(tmp_path: Path, url: str, job: str, weighting: str, world: int, workers: int = 0) -> list[dict]:
    mp.spawn(_worker, args=(world, str(tmp_path / "rdv"), url, job, weighting, str(tmp_path), workers),
             nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def single_process_params() -> list[torch.Tensor]:
    """The same global batches, in one process: the mean loss over each whole global batch."""
    data = digits()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=SEED)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for step in range(len(sampler)):
            x, y, _ = data[torch.as_tensor(sampler.global_indices(step))]
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("weighting", ["hook", "loss"])
def test_uneven_changing_splits_match_single_process(tmp_path: Path, redis_url: str, job: str,
                                                     weighting: str) -> None:
    results = run_ranks(tmp_path, redis_url, job, weighting, world=3)
    splits = results[0]["splits"]
    assert all(r["splits"] == splits for r in results), "ranks used different vectors"
    assert len({tuple(s) for s in splits}) > len(splits) // 2, "the splits did not change"
    assert any(0 in s for s in splits) and any(len(set(s)) == 3 for s in splits)
    expected = single_process_params()
    for result in results:
        for got, want in zip(result["params"], expected):
            np.testing.assert_allclose(np.array(got), want.numpy(), rtol=1e-6, atol=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_sample_once_per_epoch_with_loader_workers(tmp_path: Path, redis_url: str, job: str) -> None:
    results = run_ranks(tmp_path, redis_url, job, "hook", world=2, workers=2)
    n = len(digits())
    for epoch in range(EPOCHS):
        used = sorted(i for r in results for i in r["seen"][epoch])
        assert used == list(range(n)), f"epoch {epoch}: samples missing or repeated"
    first = [sorted(r["seen"][0]) for r in results]
    assert not set(first[0]) & set(first[1])
