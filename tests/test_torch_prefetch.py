"""Loading a step's slice while the step before computes: on 2 real gloo ranks with a loader worker process and a
split that changes every step, most steps are served from the prefetch and training still equals single-process
SGD; a prefetch cut by another vector than the one agreed is dropped, and one cancelled never loads."""
from __future__ import annotations

import json
import os
import threading
import time
import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from lbbsp import EmbeddedRedis  # noqa: E402
from lbbsp.integrations.torch import Balancer  # noqa: E402
from lbbsp.integrations.torch_data import Prefetch  # noqa: E402
from test_torch_exact import (  # noqa: E402
    EPOCHS,
    GLOBAL_BATCH,
    SEED,
    ChangingSplit,
    digits,
    in_gloo_group,
    mlp,
    single_process_params,
    spawn,
)


class SlowDigits(Dataset):
    """The digits, read as from slow storage: 0.1 ms a sample."""

    def __init__(self) -> None:
        self.data = digits()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple:
        time.sleep(1e-4)
        return self.data[i]


def _train(rank: int, url: str, job: str) -> dict:
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    lb = Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, policy=ChangingSplit(), min_batch=0)
    lb.attach(model)
    loader = lb.loader(SlowDigits(), seed=SEED, num_workers=1)
    seen: list[list[int]] = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        seen.append([])
        for x, y, index in loader:
            time.sleep(0.02)  # a step long enough for the coordinator's decision to land within it
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            seen[-1].extend(index.tolist())
    lb.close()
    return {"seen": seen, "prefetched": loader.prefetched, "steps": EPOCHS * len(loader), "on": loader.prefetch,
            "params": [p.detach().tolist() for p in model.module.parameters()]}


def _worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    in_gloo_group(rank, world, init, out, lambda: _train(rank, url, job))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, redis_server: EmbeddedRedis) -> list[dict]:
    tmp = tmp_path_factory.mktemp("prefetch")
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    spawn(_worker, (2, str(tmp / "rdv"), url, f"test-{uuid.uuid4().hex[:10]}", str(tmp)), nprocs=2, timeout_s=200)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_prefetched_steps_train_exactly_and_use_every_sample_once(trained: list[dict]) -> None:
    for result in trained:
        assert result["on"] and result["prefetched"] >= result["steps"] // 2, result["prefetched"]
        for got, want in zip(result["params"], single_process_params()):
            np.testing.assert_allclose(np.array(got), want.numpy(), rtol=1e-6, atol=1e-9)
    for epoch in range(EPOCHS):
        assert sorted(i for r in trained for i in r["seen"][epoch]) == list(range(len(digits())))


def test_a_prefetch_cut_by_another_vector_is_dropped() -> None:
    ahead = Prefetch(lambda sizes: f"batch cut by {sizes}", lambda: (3, 5))
    time.sleep(0.05)
    assert ahead.take([3, 5]) == "batch cut by (3, 5)"
    ahead = Prefetch(lambda sizes: f"batch cut by {sizes}", lambda: (3, 5))
    time.sleep(0.05)
    assert ahead.take((4, 4)) is None


def test_a_cancelled_prefetch_never_loads() -> None:
    stored: list[tuple[int, ...]] = []
    loads = threading.Event()
    ahead = Prefetch(lambda sizes: loads.set(), lambda: stored[0] if stored else None)
    time.sleep(0.01)
    assert ahead.take((3, 5)) is None  # the vector was not there yet: the step loads its slice itself
    stored.append((3, 5))  # and it lands just after
    assert not loads.wait(0.1)
