"""Copies and pickles of what a DDP script holds once lbbsp is attached, on 2 real gloo ranks: an EMA made with
copy.deepcopy of the wrapped module, and torch.save of the whole module, work and leave the job alone; the Balancer,
its loader and the attached DDP model refuse to be copied or pickled with lbbsp's ConfigError, not pickle's
"cannot pickle '_thread.lock' object". Training around them still equals single-process SGD."""
from __future__ import annotations

import copy
import functools
import io
import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from lbbsp import ConfigError  # noqa: E402
from lbbsp.integrations.torch import Balancer  # noqa: E402
from test_torch_exact import (  # noqa: E402
    EPOCHS,
    GLOBAL_BATCH,
    LR,
    SEED,
    ChangingSplit,
    digits,
    in_gloo_group,
    mlp,
    run_ranks,
    single_process_params,
)

COPY_AT = 3  # the step of epoch 0 at which the script copies and saves


def _refusal(action) -> str:
    """What ``action`` raised: lbbsp's ConfigError's message, else the type and message of anything else."""
    try:
        action()
    except ConfigError as exc:
        return "lbbsp: " + exc.message
    except Exception as exc:  # noqa: BLE001  (reported to the test, which names it)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _train(rank: int, url: str, job: str) -> dict:
    module = mlp()
    module.register_buffer("marker", torch.zeros((), dtype=torch.float64))  # a buffer, as BatchNorm's: DDP broadcasts
    model = DDP(module)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    lb = Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, policy=ChangingSplit(), min_batch=0)
    lb.attach(model)
    loader = lb.loader(digits(), seed=SEED)
    out: dict = {}
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for step, (x, y, _) in enumerate(loader):
            if epoch == 0 and step == COPY_AT:
                ema = copy.deepcopy(module)  # an EMA, made in the step before its forward
                lb._clock.pause()  # as DDP's forward leaves it before the module's (its buffer broadcast)
                with torch.no_grad():
                    ema(x)
                out["ema_forward_left_the_clock_paused"] = lb._clock._paused_at is not None
                lb._clock.resume()
                whole = io.BytesIO()
                out["save_module"] = _refusal(functools.partial(torch.save, module, whole))
                out["save_ema"] = _refusal(functools.partial(torch.save, ema, io.BytesIO()))
                whole.seek(0)
                loaded = torch.load(whole, weights_only=False) if out["save_module"] == "no error" else None
                out["loaded_equal"] = loaded is not None and all(
                    torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), module.state_dict().values()))
                out["refused"] = {f"{how.__name__}({name})": _refusal(functools.partial(how, obj)) for name, obj in
                                  (("ddp", model), ("balancer", lb), ("loader", loader))
                                  for how in (copy.deepcopy, pickle.dumps)}
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    lb.close()
    out["params"] = [p.detach().flatten().tolist() for p in module.parameters()]
    del model, opt
    return out


def _worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    in_gloo_group(rank, world, init, out, lambda: _train(rank, url, job))


@pytest.mark.timeout(240)
def test_copies_of_an_attached_model_work_and_live_parts_of_the_job_refuse_clearly(tmp_path: Path,
                                                                                     redis_url: str) -> None:
    results = run_ranks(_worker, 2, tmp_path, redis_url, timeout_s=200)
    for result in results:
        assert result["save_module"] == "no error"  # had been "Can't pickle local object 'Balancer.attach...'"
        assert result["save_ema"] == "no error"
        assert result["loaded_equal"]
        assert result["ema_forward_left_the_clock_paused"]  # the copy's forward had resumed the Balancer's clock
        for name, refusal in result["refused"].items():
            assert refusal.startswith("lbbsp: a ") and "cannot be copied or pickled" in refusal, (name, refusal)
    reference = single_process_params()
    for result in results:
        for got, want in zip(result["params"], reference):
            assert torch.allclose(torch.tensor(got, dtype=torch.float64), want.flatten(), rtol=1e-6, atol=1e-9)
