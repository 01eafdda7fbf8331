"""BatchNorm under unequal slices: plain BatchNorm warns once; synchronised batch norm stays exact (loss form).

torch's SyncBatchNorm runs on GPUs only (DDP refuses it on CPU modules), so the exactness test uses a module
with the same semantics on CPU: statistics summed over ranks with a differentiable all-reduce, gradients
summed back the same way. The checks on the real SyncBatchNorm class run in one process.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.nn.functional import all_reduce  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from lbbsp import ConfigError, EmbeddedRedis, GlobalBatchSampler  # noqa: E402
from lbbsp.integrations.torch import Balancer, BatchNormWarning, batch_norm_layers  # noqa: E402
from lbbsp.integrations.torch_grad import check_batch_norm  # noqa: E402
from test_torch_exact import SEED, ChangingSplit, destroy_group, digits, run_ranks  # noqa: E402

GLOBAL_BATCH = 150


class CPUSyncBatchNorm(nn.Module):
    """SyncBatchNorm's maths on CPU (training mode, no running statistics): batch statistics of all ranks."""

    def __init__(self, channels: int, track_running_stats: bool = False, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        local = torch.cat([x.sum(0), (x * x).sum(0), x.new_full((1,), x.shape[0])])
        total = all_reduce(local) if dist.is_initialized() else local
        mean = total[:channels] / total[-1]
        var = total[channels:2 * channels] / total[-1] - mean * mean
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def bn_mlp(norm: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), norm(32, track_running_stats=False), nn.Tanh(),
                         nn.Linear(32, 10)).double()


def _worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    result: dict[str, object] = {}
    lb = Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, policy=ChangingSplit(), min_batch=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lb.attach(DDP(bn_mlp(nn.BatchNorm1d)))
        lb.attach(DDP(bn_mlp(nn.BatchNorm1d)))
    result["plain_warnings"] = [str(w.message) for w in caught if issubclass(w.category, BatchNormWarning)]
    model = lb.attach(DDP(bn_mlp(CPUSyncBatchNorm)), weighting="loss")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = lb.loader(digits(), seed=SEED)
    splits = []
    for x, y, _ in loader:
        lb.scale_loss(F.cross_entropy(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
        splits.append(list(lb.step.split))
    lb.close()
    result["splits"] = splits
    result["params"] = [p.detach().tolist() for p in model.module.parameters()]
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    del model, opt, lb, loader
    destroy_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_batch_norm_warning_and_synchronised_batch_norm_exact(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    results = run_ranks(_worker, 2, tmp_path, url, timeout_s=150)
    for result in results:
        assert len(result["plain_warnings"]) <= 1
    assert sum(len(r["plain_warnings"]) for r in results) >= 1 and "BatchNorm" in results[0]["plain_warnings"][0]
    assert len({tuple(s) for s in results[0]["splits"]}) > 3

    data = digits()
    model = bn_mlp(nn.BatchNorm1d)  # one process, whole global batch: plain batch norm is the definition
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler = GlobalBatchSampler(len(data), GLOBAL_BATCH, seed=SEED)
    for step in range(len(sampler)):
        x, y, _ = data[torch.as_tensor(sampler.global_indices(step))]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for result in results:
        for got, want in zip(result["params"], model.parameters()):
            np.testing.assert_allclose(np.array(got), want.detach().numpy(), rtol=1e-6, atol=1e-9)


def test_sync_batch_norm_refuses_the_hook_form_and_plain_batch_norm_is_found() -> None:
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(bn_mlp(nn.BatchNorm1d))
    with pytest.raises(ConfigError, match="weighting='loss'"):
        check_batch_norm(synced, "hook")
    check_batch_norm(synced, "loss")
    assert batch_norm_layers(bn_mlp(nn.BatchNorm1d)) == (["1"], [])
    assert batch_norm_layers(synced) == ([], ["1"])
