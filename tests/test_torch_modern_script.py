"""A modern DDP training script ported to lbbsp, feature by feature, on 2 real gloo ranks whose split changes every
step (an empty slice every fifth): each run must equal single-process training on the same global batches, as a user
expects of the weighted aggregation. Gradient clipping, bf16 autocast with a GradScaler (unscale_, clip, step),
OneCycleLR with zero_grad(set_to_none=True), accumulation under no_sync as docs/torch.md says, find_unused_parameters
with frozen layers, torch.compile inside DDP, and all of them at once."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from lbbsp import EmbeddedRedis, GlobalBatchSampler  # noqa: E402
from lbbsp.integrations.torch import Balancer  # noqa: E402
from test_torch_exact import ChangingSplit, digits, each_recorded, in_gloo_group, mlp, run_ranks  # noqa: E402

GLOBAL_BATCH, SEED = 100, 5  # 1797 digits: 17 full global batches and a short one of 97
LR, MAX_NORM, ACCUMULATE = 0.5, 0.5, 2
ROUTED_PIXEL, ROUTED_ABOVE = 5, 0.9  # 12% of the digits take the routed head


class Run:
    """One run of a script: as a rank of the job (``lb``), or in one process on the same global batches, where the
    loss is the global batch's mean or, given the ranks' ``splits``, the plain mean of the slices' means (what DDP's
    unweighted average would have trained on)."""

    def __init__(self, lb: Balancer | None = None, weighting: str = "hook",
                 splits: list[list[int]] | None = None) -> None:
        self.lb, self.weighting, self.splits = lb, weighting, splits
        self.data = digits()
        self.loader = lb.loader(self.data, seed=SEED) if lb is not None else None
        self.sampler = GlobalBatchSampler(len(self.data), GLOBAL_BATCH, seed=SEED)
        self.seen: list[list[int]] = []  # the split of each step (on a rank)
        self._slices: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.loader) if self.loader is not None else len(self.sampler)

    def model(self, module: nn.Module, **ddp: object) -> nn.Module:
        """``module`` as the script trains it: attached in DDP on a rank, itself in one process."""
        return module if self.lb is None else self.lb.attach(DDP(module, **ddp), self.weighting)

    def batches(self, epochs: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(step of the epoch, features, labels) of each step: the rank's slice, or the whole global batch."""
        if self.lb is not None and self.loader is not None:
            for epoch in range(epochs):
                self.loader.set_epoch(epoch)
                for step, (x, y, _) in enumerate(self.loader):
                    self.seen.append(list(self.lb.step.split))
                    yield step, x, y
            return
        splits = iter(self.splits or [])
        for epoch in range(epochs):
            self.sampler.set_epoch(epoch)
            for step in range(len(self.sampler)):
                x, y, _ = self.data[torch.as_tensor(self.sampler.global_indices(step))]
                if self.splits is not None:
                    self._slices = [s for s in torch.arange(len(y)).split(next(splits)) if len(s)]
                yield step, x, y

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy, the batch's mean (through ``lb.scale_loss`` in the loss form)."""
        if self._slices is not None:
            return torch.stack([F.cross_entropy(out[s], y[s]) for s in self._slices]).mean()
        loss = F.cross_entropy(out, y)
        return self.lb.scale_loss(loss) if self.lb is not None and self.weighting == "loss" else loss

    def no_sync(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """``model.no_sync()`` on a rank for a micro-step that does not synchronise."""
        return model.no_sync() if self.lb is not None and not sync else contextlib.nullcontext()


def params(model: nn.Module) -> list:
    return [p.detach().double().tolist() for p in model.parameters()]


class Routed(nn.Module):
    """A frozen input layer, a trunk and a head; an auxiliary head used only when asked (odd steps leave it unused
    on every rank); a head only for the digits whose pixel 5 is bright (unused on a rank whose slice has none)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(64, 32).requires_grad_(False)
        self.trunk = nn.Linear(32, 32)
        self.head, self.aux, self.routed = nn.Linear(32, 10), nn.Linear(32, 10), nn.Linear(32, 10)
        self.double()

    def forward(self, x: torch.Tensor, aux: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(torch.tanh(self.frozen(x))))
        out = self.head(h) + (self.aux(h) if aux else 0)
        bright = (x[:, ROUTED_PIXEL] > ROUTED_ABOVE).nonzero().squeeze(1)
        if len(bright):
            out = out.index_add(0, bright, self.routed(h[bright]))
        return out


# -- the script's features, each a loop as a user writes it ----------------------------------------------------------
def clipped(run: Run) -> dict:
    """1: clip_grad_norm_ after backward, before the step (the default weighting)."""
    model = run.model(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    norms = []
    for _, x, y in run.batches(1):
        run.loss(model(x), y).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": params(model), "norms": norms}


def mixed_precision(run: Run) -> dict:
    """2: the forward and loss under bf16 autocast, a GradScaler, and its unscale_ + clip + step path."""
    model = run.model(mlp().float())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    for _, x, y in run.batches(1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run.loss(model(x.float()), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return {"params": params(model)}


def scheduled(run: Run) -> dict:
    """3: OneCycleLR stepped at each optimizer step over 2 epochs, zero_grad(set_to_none=True)."""
    model = run.model(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=2 * len(run))
    rates = []
    for _, x, y in run.batches(2):
        run.loss(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        rates.append(sched.get_last_lr()[0])
    return {"params": params(model), "rates": rates}


def accumulated(run: Run) -> dict:
    """4: 2 micro-steps an update, the first under no_sync (forward and backward), as docs/torch.md says: the loss
    form, each micro-step's loss through lb.scale_loss and divided by the count."""
    model = run.model(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step, x, y in run.batches(1):
        sync = step % ACCUMULATE == ACCUMULATE - 1 or step == len(run) - 1
        with run.no_sync(model, sync):
            (run.loss(model(x), y) / ACCUMULATE).backward()
        if sync:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"params": params(model)}


def partly_used(run: Run) -> dict:
    """5: find_unused_parameters=True, a head unused on odd steps (every rank) and one unused where a slice has no
    bright digit, a frozen layer; AdamW with weight decay, which moves a parameter with a zero gradient."""
    model = run.model(Routed(), find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    routed, aux_grads = [], []
    for step, x, y in run.batches(1):
        run.loss(model(x, step % 2 == 0), y).backward()
        routed.append(int((x[:, ROUTED_PIXEL] > ROUTED_ABOVE).sum()))
        aux_grads.append(model.module.aux.weight.grad is not None if run.lb else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": params(model), "routed": routed, "aux_grads": aux_grads}


def compiled(run: Run) -> dict:
    """6: torch.compile(model) (inductor) wrapped in DDP; the single-process reference runs eagerly."""
    model = run.model(torch.compile(mlp()) if run.lb is not None else mlp())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _, x, y in run.batches(1):
        run.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": params(model)}


def everything(run: Run) -> dict:
    """All at once, in float64: accumulation under no_sync in the loss form, a GradScaler with unscale_ and clipping,
    OneCycleLR, find_unused_parameters with frozen and partly used heads, AdamW."""
    model = run.model(Routed(), find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    updates = -(-len(run) // ACCUMULATE)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=updates)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for step, x, y in run.batches(1):
        sync = step % ACCUMULATE == ACCUMULATE - 1 or step == len(run) - 1
        with run.no_sync(model, sync):
            scaler.scale(run.loss(model(x, step % 4 == 0), y) / ACCUMULATE).backward()
        if sync:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
    return {"params": params(model)}


#: name -> (script, weighting)
SCRIPTS: dict[str, tuple[Callable[[Run], dict], str]] = {
    "clipped": (clipped, "hook"),
    "amp_hook": (mixed_precision, "hook"),
    "amp_loss": (mixed_precision, "loss"),
    "scheduled": (scheduled, "hook"),
    "accumulated": (accumulated, "loss"),
    "partly_used": (partly_used, "hook"),
    "everything": (everything, "loss"),
    "compiled": (compiled, "hook"),
}


def _scripts(url: str, job: str) -> dict:
    """Every script in turn on one Balancer, each with its own DDP model (starting ranks is the slow part)."""
    # max_ahead=1: every step its own split, empty slices included; a coordinator behind the steps (a loaded machine)
    # writes one split for several, and in a CI run under load had left out every split with an empty slice
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, policy=ChangingSplit(), min_batch=0, max_ahead=1) as lb:

        def scripted(script: Callable[[Run], dict], weighting: str) -> Callable[[], dict]:
            def go() -> dict:
                run = Run(lb, weighting)
                return script(run) | {"splits": run.seen}
            return go

        return each_recorded({name: scripted(*entry) for name, entry in SCRIPTS.items()})


def _worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    in_gloo_group(rank, world, init, out, lambda: _scripts(url, job))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, redis_server: EmbeddedRedis) -> list[dict]:
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    return run_ranks(_worker, 2, tmp_path_factory.mktemp("modern"), url, timeout_s=150)


def outcome(ranks: list[dict], name: str) -> list[dict]:
    """Both ranks' results of script ``name``, which ran on the same splits, uneven and changing."""
    results = [r[name] for r in ranks]
    assert all("error" not in r for r in results), results
    splits = results[0]["splits"]
    assert all(r["splits"] == splits for r in results), "ranks used different vectors"
    assert any(0 in s for s in splits) and any(abs(a - b) > GLOBAL_BATCH // 2 for a, b in splits if a and b), splits
    return results


def reference(name: str, splits: list[list[int]] | None = None) -> dict:
    """Script ``name`` in one process on the same global batches (unweighted by ``splits``, if given)."""
    script, _ = SCRIPTS[name]
    return script(Run(splits=splits))


def distance(a: list, b: list) -> float:
    return max(float(np.abs(np.array(p) - np.array(q)).max()) for p, q in zip(a, b))


def assert_exact(results: list[dict], name: str, rtol: float = 1e-9) -> dict:
    """Each rank's parameters equal the single-process run's (float64: to ``rtol``), and the unweighted mean of the
    slices' means would not have come within 1000 times that; the reference run's result."""
    want = reference(name)
    for result in results:
        for got, expected in zip(result["params"], want["params"]):
            np.testing.assert_allclose(np.array(got), np.array(expected), rtol=rtol, atol=rtol * 1e-3)
    assert distance(reference(name, results[0]["splits"])["params"], want["params"]) > rtol * 1e3
    return want


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_clipping_sees_the_global_batchs_gradient(ranks: list[dict]) -> None:
    results = outcome(ranks, "clipped")
    want = assert_exact(results, "clipped")
    for result in results:
        np.testing.assert_allclose(result["norms"], want["norms"], rtol=1e-9)
    assert sum(n > MAX_NORM for n in want["norms"]) > len(want["norms"]) // 2  # clipping was active


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["amp_hook", "amp_loss"])
def test_bf16_autocast_with_a_grad_scaler_is_single_process_to_bf16s_rounding(ranks: list[dict], name: str) -> None:
    results = outcome(ranks, name)
    want = reference(name)["params"]
    unweighted = distance(reference(name, results[0]["splits"])["params"], want)
    for result in results:
        assert distance(result["params"], want) < unweighted / 10, (distance(result["params"], want), unweighted)
    assert results[0]["params"] == results[1]["params"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_one_cycle_lr_per_step_with_set_to_none(ranks: list[dict]) -> None:
    results = outcome(ranks, "scheduled")
    want = assert_exact(results, "scheduled")
    assert all(r["rates"] == want["rates"] for r in results)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_accumulation_under_no_sync_as_the_docs_say(ranks: list[dict]) -> None:
    assert_exact(outcome(ranks, "accumulated"), "accumulated")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_unused_and_frozen_parameters_with_find_unused_parameters(ranks: list[dict]) -> None:
    results = outcome(ranks, "partly_used")
    assert_exact(results, "partly_used")
    torch.manual_seed(0)
    frozen = Routed().frozen
    for result in results:  # untouched, by the optimizer's weight decay too
        assert result["params"][:2] == params(frozen)
        assert result["aux_grads"][1::2] == [False] * len(result["aux_grads"][1::2])  # left None, as in one process
    routed = [r["routed"] for r in results]
    assert any(a == 0 < b or b == 0 < a for a, b in zip(*routed))  # the routed head unused on one rank only


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_everything_at_once_in_float64(ranks: list[dict]) -> None:
    assert_exact(outcome(ranks, "everything"), "everything")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_torch_compile_inside_ddp(ranks: list[dict]) -> None:
    assert_exact(outcome(ranks, "compiled"), "compiled", rtol=1e-6)
