"""Resuming in the middle of an epoch from a checkpoint: 2 real gloo ranks train part of epoch 0 and save the
loader's state with the model; 3 ranks, under a new job, load it and finish. The result equals single-process
SGD on the same global batches, and every sample of the interrupted epoch is used once."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from lbbsp import ConfigError, EmbeddedRedis, JobConfig  # noqa: E402
from lbbsp.integrations.torch import Balancer  # noqa: E402
from lbbsp.integrations.torch_data import BalancedLoader  # noqa: E402
from test_torch_exact import (  # noqa: E402
    EPOCHS,
    GLOBAL_BATCH,
    SEED,
    ChangingSplit,
    destroy_group,
    digits,
    in_gloo_group,
    mlp,
    single_process_params,
    spawn,
)

STOP_AFTER = 7  # global batches of epoch 0 trained before the "crash"


def _first_run(rank: int, url: str, job: str, checkpoint: str) -> dict:
    """Train epoch 0's first STOP_AFTER global batches, checkpoint (rank 0), and stop as a crash would."""
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    lb = Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, policy=ChangingSplit(), min_batch=0)
    lb.attach(model)
    loader = lb.loader(digits(), seed=SEED)
    loader.set_epoch(0)
    seen: list[int] = []
    for step, (x, y, index) in enumerate(loader):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        seen.extend(index.tolist())
        if step == STOP_AFTER - 1:
            state = loader.state_dict()
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "loader": state,
                            "epoch": 0}, checkpoint)
            break
    lb.close()
    return {"seen": seen, "state": state}


def _resumed_run(rank: int, url: str, job: str, checkpoint: str) -> dict:
    """Load the checkpoint on 3 ranks and train to the end of EPOCHS; first, two misuses of loader states."""
    ckpt = torch.load(checkpoint)
    module = mlp()
    module.load_state_dict(ckpt["model"])
    model = DDP(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.load_state_dict(ckpt["opt"])
    lb = Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, policy=ChangingSplit(), min_batch=0)
    lb.attach(model)
    out: dict = {}

    finished = lb.loader(digits(), seed=SEED)  # a state saved at an epoch's end: nothing of that epoch is left
    finished.load_state_dict({**ckpt["loader"], "step": len(finished)})
    out["after_the_end"] = len(list(finished))

    uneven = lb.loader(digits(), seed=SEED)  # only rank 0 loads the state: every rank is told, none waits
    if rank == 0:
        uneven.load_state_dict(ckpt["loader"])
    try:
        next(iter(uneven))
    except ConfigError as exc:
        out["uneven"] = str(exc)

    loader = lb.loader(digits(), seed=SEED)
    loader.load_state_dict(ckpt["loader"])
    out["state_after_load"] = loader.state_dict()
    seen: list[list[int]] = []
    for epoch in range(ckpt["epoch"], EPOCHS):
        loader.set_epoch(epoch)  # the checkpoint's epoch again: the loaded position holds
        seen.append([])
        for x, y, index in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            seen[-1].extend(index.tolist())
    lb.close()
    out.update(seen=seen, params=[p.detach().tolist() for p in model.module.parameters()])
    return out


def _first(rank: int, world: int, init: str, url: str, job: str, out: str, checkpoint: str) -> None:
    in_gloo_group(rank, world, init, out, lambda: _first_run(rank, url, job, checkpoint))


def _second(rank: int, world: int, init: str, url: str, job: str, out: str, checkpoint: str) -> None:
    in_gloo_group(rank, world, init, out, lambda: _resumed_run(rank, url, job, checkpoint))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, redis_server: EmbeddedRedis) -> tuple[list[dict], list[dict]]:
    tmp = tmp_path_factory.mktemp("resume")
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    checkpoint = str(tmp / "checkpoint.pt")
    results = []
    for name, fn, world in (("first", _first, 2), ("second", _second, 3)):
        out = tmp / name
        out.mkdir()
        job = f"test-{uuid.uuid4().hex[:10]}"  # a new job for the resumed run, as a restart uses
        spawn(fn, (world, str(tmp / f"rdv-{name}"), url, job, str(out), checkpoint), nprocs=world, timeout_s=200)
        results.append([json.loads((out / f"rank{r}.json").read_text()) for r in range(world)])
    return results[0], results[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_resumed_mid_epoch_on_more_ranks_matches_single_process_sgd(runs) -> None:
    first, second = runs
    assert all(r["state"] == {"epoch": 0, "step": STOP_AFTER, "dataset_size": 1797, "global_batch": GLOBAL_BATCH,
                              "seed": SEED, "shuffle": True, "drop_last": False} for r in first)
    assert all(r["state_after_load"] == first[0]["state"] for r in second)
    expected = single_process_params()
    for result in second:
        for got, want in zip(result["params"], expected):
            np.testing.assert_allclose(np.array(got), want.numpy(), rtol=1e-6, atol=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_sample_of_the_interrupted_epoch_is_used_once(runs) -> None:
    first, second = runs
    before = [i for r in first for i in r["seen"]]
    assert len(before) == STOP_AFTER * GLOBAL_BATCH
    for epoch in range(EPOCHS):
        after = [i for r in second for i in r["seen"][epoch]]
        used = sorted(after + (before if epoch == 0 else []))
        assert used == list(range(1797)), f"epoch {epoch}: samples missing or repeated across the restart"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_loaded_states_that_leave_nothing_or_differ_by_rank(runs) -> None:
    _, second = runs
    assert all(r["after_the_end"] == 0 for r in second)
    for r in second:  # told on every rank, not left waiting in a collective
        assert "differ in first global batch" in r["uneven"] and f"[{STOP_AFTER}, 0, 0]" in r["uneven"]


def loader_alone(dataset: object = None, global_batch: int = GLOBAL_BATCH, **options: object) -> BalancedLoader:
    """A loader of one rank (of the digits by default), for what needs no process group: a stand-in Balancer,
    whose config alone is read."""
    balancer = SimpleNamespace(config=JobConfig("unit", 1, global_batch), _loaders=set(), world_size=1)
    return BalancedLoader(digits() if dataset is None else dataset, balancer, seed=SEED, **options)


def test_state_follows_set_epoch_and_round_trips_before_the_loop() -> None:
    loader = loader_alone()
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["step"] == 0
    loader.set_epoch(3)
    assert (loader.state_dict()["epoch"], loader.state_dict()["step"]) == (3, 0)
    loader.load_state_dict({**loader.state_dict(), "epoch": 1, "step": 5})
    assert (loader.sampler.epoch, loader.state_dict()["step"]) == (1, 5)  # saved again before the loop: unchanged
    loader.set_epoch(2)  # the next loop serves epoch 2 from its first batch, and a checkpoint says so
    assert (loader.state_dict()["epoch"], loader.state_dict()["step"]) == (2, 0)


@pytest.mark.parametrize(("change", "message"), [
    ({"global_batch": 50}, "saved with global_batch=50, this loader has global_batch=100"),
    ({"dataset_size": 1000}, "saved with dataset_size=1000"),
    ({"seed": SEED + 1}, "saved with seed=4"),
    ({"shuffle": 1}, "saved with shuffle=1, this loader has shuffle=True"),
    ({"step": 19}, "the state's step must be an integer in [0, 18]"),
    ({"epoch": -1}, "the state's epoch must be an integer in [0, inf]"),
    ({"extra": 1}, "not a BalancedLoader state (keys ['dataset_size', 'drop_last', 'epoch', 'extra'"),
])
def test_a_state_from_another_loader_is_refused_and_changes_nothing(change: dict, message: str) -> None:
    loader = loader_alone()
    with pytest.raises(ConfigError, match=re.escape(message)):
        loader.load_state_dict({**loader.state_dict(), **change})
    assert (loader.sampler.epoch, loader.state_dict()["step"]) == (0, 0)
    with pytest.raises(ConfigError, match="not a BalancedLoader state"):
        loader.load_state_dict([0, 7])


@contextlib.contextmanager
def alone_in_a_group(folder: Path) -> Iterator[None]:
    """This test process as the only rank of a gloo group (a real Balancer, in one process), destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{folder / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_group()


def test_a_state_of_another_epoch_than_the_one_iterated_serves_that_epoch_whole_and_says_what_is_skipped(
        tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A state saved mid-epoch 0, then set_epoch(1) (a script that resumes at the checkpoint's epoch + 1): epoch 1
    is served from its first batch, every sample once, and the rest of epoch 0 is said to be skipped. Loading a state
    while the loader is iterated is refused and leaves the loop as it was."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with alone_in_a_group(tmp_path), Balancer.from_env(GLOBAL_BATCH, redis=redis_url) as lb:
        loader = lb.loader(digits(), seed=SEED)
        saved = {**loader.state_dict(), "step": STOP_AFTER}
        loader.load_state_dict(saved)
        loader.set_epoch(1)
        assert (loader.state_dict()["epoch"], loader.state_dict()["step"]) == (1, 0)
        seen: list[int] = []
        for step, (x, y, index) in enumerate(loader):
            if step == 1:
                with pytest.raises(ConfigError, match="load_state_dict while the loader is being iterated"):
                    loader.load_state_dict(saved)
            F.cross_entropy(model(x), y).backward()
            lb.all_reduce_gradients(model.parameters())
            opt.step()
            opt.zero_grad()
            seen += index.tolist()
        assert sorted(seen) == list(range(1797)) and loader.sampler.epoch == 1
        assert loader.state_dict()["step"] == len(loader)
    warned = [r.getMessage() for r in caplog.records if r.name == "lbbsp.torch" and r.levelno == logging.WARNING]
    assert any(f"resumes epoch 0 at global batch {STOP_AFTER}, but epoch 1 is iterated" in m
               and "the rest of epoch 0 is not served" in m for m in warned), warned
