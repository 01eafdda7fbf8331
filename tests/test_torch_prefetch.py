"""Loading a step's slice while the step before computes: on 2 real gloo ranks with a loader worker process and a
split that changes every step, most steps are served from the prefetch and training still equals single-process
SGD; a prefetch cut by another vector than the one agreed, or loaded for another loop's step, is dropped; one
cancelled never loads; a script that ends with a prefetch loading exits; a failed load is not counted served;
``prefetch=`` is a parameter of ``Balancer.loader`` and reaches the loader."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from lbbsp import ConfigError, EmbeddedRedis  # noqa: E402
from lbbsp.integrations.torch import BalancedLoader, Balancer  # noqa: E402
from lbbsp.integrations.torch_data import Prefetch  # noqa: E402
from test_torch_exact import (  # noqa: E402
    EPOCHS,
    GLOBAL_BATCH,
    SEED,
    ChangingSplit,
    digits,
    in_gloo_group,
    mlp,
    run_ranks,
    single_process_params,
)
from test_torch_resume import loader_alone  # noqa: E402
from test_torch_usage import samples, stand_in  # noqa: E402


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
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    return run_ranks(_worker, 2, tmp_path_factory.mktemp("prefetch"), url, timeout_s=200)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_prefetched_steps_train_exactly_and_use_every_sample_once(trained: list[dict]) -> None:
    for result in trained:
        assert result["on"] and result["prefetched"] >= result["steps"] // 2, result["prefetched"]
        for got, want in zip(result["params"], single_process_params()):
            np.testing.assert_allclose(np.array(got), want.numpy(), rtol=1e-6, atol=1e-9)
    for epoch in range(EPOCHS):
        assert sorted(i for r in trained for i in r["seen"][epoch]) == list(range(len(digits())))


class Positions(Dataset):
    """Sample i is i, read in 20 ms; reading one of ``bad`` fails."""

    def __init__(self, bad: tuple[int, ...] = ()) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        time.sleep(0.02)
        if i in self.bad:
            raise ValueError(f"sample {i} cannot be read")
        return i


def _alone(rank: int, url: str, job: str) -> dict:
    """One rank: a second loop while the first, suspended, has a prefetch loaded; then a load that fails."""
    lb = Balancer.from_env(8, redis=url, job=job)
    loader = lb.loader(Positions(), shuffle=False, num_workers=1)
    suspended = iter(loader)
    for _ in range(2):
        next(suspended)
        lb.gradients_ready()
    time.sleep(0.5)  # global batch 2's slice is loaded ahead for the suspended loop
    second = iter(loader)
    first = next(second).tolist()
    lb.gradients_ready()
    del second, suspended
    failing = lb.loader(Positions(bad=(17,)), shuffle=False, num_workers=1)
    served = []
    try:
        for batch in failing:
            served.append(batch.tolist())
            lb.gradients_ready()
    except ValueError:
        pass
    lb.close()
    return {"first": first, "served": served, "state": failing.state_dict()}


def _alone_worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    in_gloo_group(rank, world, init, out, lambda: _alone(rank, url, job))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_second_loop_gets_its_own_batches_and_a_failed_load_is_not_served(
        tmp_path, redis_server: EmbeddedRedis) -> None:
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    [result] = run_ranks(_alone_worker, 1, tmp_path, url, timeout_s=100)
    assert result["first"] == list(range(8)), "the second loop was served another loop's prefetched step"
    assert result["served"] == [list(range(8)), list(range(8, 16))]
    assert result["state"]["step"] == 2, "a checkpoint after the failed load would skip global batch 2"


EXITS = """
import sys, tempfile, time
sys.path.insert(0, {tests!r})
import torch.distributed as dist
from lbbsp.integrations.torch import Balancer
from test_torch_prefetch import Positions
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
lb = Balancer.from_env(8)
it = iter(lb.loader(Positions(), shuffle=False, num_workers=1))
for _ in range(2):
    next(it)
    lb.gradients_ready()
time.sleep(0.05)
print("ends while global batch 2 is loaded ahead", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_that_ends_while_a_prefetch_loads_exits() -> None:
    script = EXITS.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, check=False)
    assert "ends while" in done.stdout, done.stderr[-2000:]


def test_prefetch_true_without_loader_workers_is_refused() -> None:
    with pytest.raises(ConfigError, match="prefetch=True needs DataLoader worker processes: pass num_workers >= 1"):
        loader_alone(Positions(), 8, prefetch=True)
    assert not loader_alone(Positions(), 8).prefetch  # and off by default without them
    with pytest.raises(ConfigError, match=r"prefetch must be True, False or None \(with loader workers\), got 'no'"):
        loader_alone(Positions(), 8, prefetch="no", num_workers=1)  # a truthy string had turned it on


def test_a_prefetch_cut_by_another_vector_is_dropped() -> None:
    ahead = Prefetch((0, 1, 1), lambda sizes: f"batch cut by {sizes}", lambda: (3, 5))
    time.sleep(0.05)
    assert ahead.take([3, 5]) == "batch cut by (3, 5)"
    ahead = Prefetch((0, 1, 1), lambda sizes: f"batch cut by {sizes}", lambda: (3, 5))
    time.sleep(0.05)
    assert ahead.take((4, 4)) is None


def test_a_cancelled_prefetch_never_loads() -> None:
    stored: list[tuple[int, ...]] = []
    loads = threading.Event()
    ahead = Prefetch((0, 1, 1), lambda sizes: loads.set(), lambda: stored[0] if stored else None)
    time.sleep(0.01)
    assert ahead.take((3, 5)) is None  # the vector was not there yet: the step loads its slice itself
    stored.append((3, 5))  # and it lands just after
    assert not loads.wait(0.1)


def test_the_loaders_prefetch_is_a_parameter_of_balancer_loader_and_passed_on() -> None:
    """docs/torch.md lists prefetch= in lb.loader's signature; it went through **dataloader_kwargs, unseen by
    inspect.signature and by an editor's completion."""
    for function in (Balancer.loader, BalancedLoader.__init__):
        parameter = inspect.signature(function).parameters["prefetch"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None
    with pytest.raises(ConfigError, match="prefetch=True needs DataLoader worker processes"):
        Balancer.loader(stand_in(8, 1), samples(), prefetch=True)  # type: ignore[arg-type]
    assert Balancer.loader(stand_in(8, 1), samples(), prefetch=False, num_workers=1).prefetch is False  # type: ignore[arg-type]
