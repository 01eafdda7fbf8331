"""What a user's training loop does to a Balancer, on 2 real gloo ranks: steps left early are harmless, silently
wrong gradients are refused, a second Balancer on one DDP model is refused, an external coordinator's --lag and
--ttl are adopted, bad settings (DDP's per-rank batch_size too) get errors that say what to do, and likely mistakes
(a DataLoader for a dataset, set_epoch inside the loop, a forward around DDP, a loader used after close, a global
batch larger than the dataset) are caught. Without DDP a parameter no rank used keeps no gradient, as in one process."""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.multiprocessing import ProcessRaisedException  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset  # noqa: E402

import lbbsp.integrations.torch as lbbsp_torch  # noqa: E402
from emulated import DelayedPolicy  # noqa: E402
from lbbsp import BSPPolicy, ConfigError, EmbeddedRedis, JobConfig, LBBSPError, Store, StoreUnavailable  # noqa: E402
from lbbsp.integrations.torch import BalancedLoader, Balancer  # noqa: E402
from test_torch_exact import destroy_group, in_gloo_group, spawn  # noqa: E402

SAMPLES, GLOBAL_BATCH = 64, 8  # 8 steps per epoch
GROUP_TIMEOUT = timedelta(seconds=1234)  # the ranks' process group's: gloo's default is 30 minutes


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 5, generator=g), torch.randn(SAMPLES, 1, generator=g),
                         torch.arange(SAMPLES))


def linear() -> DDP:
    torch.manual_seed(0)
    return DDP(torch.nn.Linear(5, 1))


def trainer(model: DDP) -> Callable[[torch.Tensor, torch.Tensor], None]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return train


def abandoned_steps(url: str, job: str) -> dict:
    """break, continue, a forward without backward, an evaluation pass and zip, then one full epoch."""
    model = linear()
    train = trainer(model)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
        lb.attach(model)
        loader = lb.loader(data())
        for i, (x, y, _) in enumerate(loader):
            if i == 2:  # left after the loader yielded, before any forward
                break
            train(x, y)
        for i, (x, y, _) in enumerate(loader):  # the same loader again
            if i == 0:
                continue  # a bad batch, skipped
            if i == 1:
                model(x)  # a forward whose loss is not used
                continue
            train(x, y)
        said = _Said()
        logging.getLogger("lbbsp.torch").addHandler(said)
        with torch.no_grad():  # an evaluation pass (the docs advise a plain DataLoader): a warning, once
            for _ in range(2):
                for x, _, _ in loader:
                    model(x)
        logging.getLogger("lbbsp.torch").removeHandler(said)
        for (x, y, _), _ in zip(loader, range(3)):  # zip draws a 4th step before range(3) ends
            train(x, y)
        seen: list[int] = []
        for x, y, index in loader:
            train(x, y)
            seen += index.tolist()
        return {"steps": lb.step.iteration + 1, "seen": seen, "said": said.messages}


class _Said(logging.Handler):
    """The messages logged to the logger it is added to."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def no_sync_with_the_hook(url: str, job: str) -> dict:
    """Gradient accumulation with the hook form: what the no_sync error is for."""
    model = linear()
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
        lb.attach(model)
        for i, (x, y, _) in enumerate(lb.loader(data())):
            with model.no_sync() if i % 2 == 0 else contextlib.nullcontext():
                F.mse_loss(model(x), y).backward()
    return {}


def without_attach(url: str, job: str) -> dict:
    model = linear()
    train = trainer(model)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
        for x, y, _ in lb.loader(data()):
            train(x, y)
    return {}


def loss_form_without_scale_loss(url: str, job: str) -> dict:
    model = linear()
    train = trainer(model)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
        lb.attach(model, weighting="loss")
        for x, y, _ in lb.loader(data()):
            train(x, y)
    return {}


def second_balancer_on_one_model(url: str, job: str) -> dict:
    """A new global batch on the same DDP model: refused at attach, and the first Balancer's hook stops."""
    model = linear()
    train = trainer(model)
    result: dict = {}
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-1") as first:
        first.attach(model)
        for (x, y, _), _ in zip(first.loader(data()), range(2)):
            train(x, y)
    with Balancer.from_env(2 * GLOBAL_BATCH, redis=url, job=f"{job}-2") as second:
        try:
            second.attach(model)
        except ConfigError as exc:
            result["attach"] = str(exc)
        result["weighting"] = second.weighting
        try:
            for x, y, _ in second.loader(data()):
                train(x, y)
        except LBBSPError as exc:  # raised by the first Balancer's hook, inside DDP's backward
            result["backward"] = str(exc)
    own = linear()  # a script's own hook (compression), registered first: its advice had been to drop it
    own.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-3") as third:
        try:
            third.attach(own)
        except ConfigError as exc:
            result["own_hook"] = str(exc)
        said: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("lbbsp.torch").addHandler(handler)
        try:  # a GAN's two models: the second's compute is not timed (rank 0 says so)
            third.attach(linear())
            third.attach(linear())
        finally:
            logging.getLogger("lbbsp.torch").removeHandler(handler)
        warned = [m for m in said if "a second DDP model is attached" in m]
        result["second_model"] = len(warned) == (1 if dist.get_rank() == 0 else 0)  # rank 0 warns, once
    # two Balancers at once: steps one after the other are fine; loaders zipped time each other's work (warned once)
    logging.getLogger("lbbsp.torch").addHandler(handler)
    try:
        with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-4") as lb_g, \
                Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-5") as lb_d:
            g, d = lb_g.attach(linear()), lb_d.attach(linear())
            train_g, train_d = trainer(g), trainer(d)
            batches_g, batches_d = iter(lb_g.loader(data())), iter(lb_d.loader(data()))
            for _ in range(2):  # each batch drawn just before its own step
                train_g(*next(batches_g)[:2])
                train_d(*next(batches_d)[:2])
            result["sequential_overlap"] = sum("another Balancer's step still computes" in m for m in said)
            for (xg, yg, _), (xd, yd, _) in zip(lb_g.loader(data()), lb_d.loader(data())):
                train_g(xg, yg)
                train_d(xd, yd)
            result["zipped_overlap"] = sum("another Balancer's step still computes" in m for m in said)
    finally:
        logging.getLogger("lbbsp.torch").removeHandler(handler)
    return result


def external_coordinator(url: str, job: str) -> dict:
    """`lbbsp coordinator --lag 1 --ttl 600` serves the job (started by the test before the ranks)."""
    result: dict = {}
    try:
        Balancer.from_env(2 * GLOBAL_BATCH, redis=url, job=job, coordinator=False)
    except ConfigError as exc:
        result["mismatch"] = str(exc)
    try:  # no Redis named: an embedded one would be a server the coordinator never sees
        Balancer.from_env(GLOBAL_BATCH, job=job, coordinator=False)
    except ConfigError as exc:
        result["no_redis"] = str(exc)
    try:  # no job named: the Redis is given, so the embedded server is beside the point (it had been said)
        Balancer.from_env(GLOBAL_BATCH, redis=url, coordinator=False)
    except ConfigError as exc:
        result["no_job"] = str(exc)
    try:  # a policy here would never run: the external coordinator's flags name its policy
        Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, coordinator=False, policy=BSPPolicy())
    except ConfigError as exc:
        result["policy"] = str(exc)
    try:  # as the policy: the coordinator's --lag
        Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, coordinator=False, lag=4)
    except ConfigError as exc:
        result["lag_refused"] = str(exc)
    try:  # and its --max-ahead
        Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, coordinator=False, max_ahead=1)
    except ConfigError as exc:
        result["max_ahead_refused"] = str(exc)
    model = linear()
    train = trainer(model)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, coordinator=False) as lb:
        lb.attach(model)
        result["assignments"] = []
        for x, y, _ in lb.loader(data()):
            train(x, y)
            result["assignments"].append([lb.step.assignment.policy, lb.step.assignment.fallback])
        result["lag"], result["ttl_s"] = lb.config.lag, lb.config.ttl_s
        result["redis_url_kept"] = lb.redis_url == url  # what `lbbsp status --redis` takes
    return result


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from torch.randn(SAMPLES, 5)


def settings(url: str, job: str) -> dict:
    result: dict = {}
    try:
        Balancer.from_env(1, redis=url, job=job)  # a global batch smaller than the world size
    except ConfigError as exc:
        result["global_batch"] = str(exc)
    try:
        Balancer.from_env(GLOBAL_BATCH, redis="redis://127.0.0.1:1/0", job=job)  # nothing listens there
    except StoreUnavailable as exc:
        result["unreachable"] = str(exc)
    # each refused on every rank (a policy had been checked on rank 0 only: rank 1 died in a collective), with
    # JobConfig's own words (True had been read as a global batch of 1, "8" as a sequence of one cap)
    # (a global batch of 0 had been told "or min_batch=0 to let some ranks sit steps out", which cannot help it)
    for name, kwargs in (("policy_name", {"policy": "bsp"}), ("bool_batch", {"global_batch": True}),
                         ("str_caps", {"max_batch": "8"}), ("zero_batch", {"global_batch": 0}),
                         ("str_coordinator", {"coordinator": "false"})):  # "false" had started one
        try:
            Balancer.from_env(**{"global_batch": GLOBAL_BATCH, "redis": url, "job": job, **kwargs})
        except ConfigError as exc:
            result[name] = str(exc)
    try:  # a rank of its own global batch had died of rank 0's mismatch error, which blamed a job name
        Balancer.from_env(GLOBAL_BATCH + dist.get_rank(), redis=url)
    except ConfigError as exc:
        result["differ"] = str(exc)
    try:  # rank 1's own Redis had been replaced by rank 0's unsaid (and its error blamed its own setting)
        Balancer.from_env(GLOBAL_BATCH, redis=url if dist.get_rank() == 0 else "redis://u:secret@127.0.0.1:9/0")
    except ConfigError as exc:
        result["redis_differ"] = str(exc)
    # the same settings written otherwise on each rank: an array of caps (whose == had raised), a default given
    caps = np.array([GLOBAL_BATCH] * 2) if dist.get_rank() == 0 else [GLOBAL_BATCH] * 2
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-alike", max_batch=caps,
                           lag=None if dist.get_rank() == 0 else 2) as alike:
        result["alike"] = alike.config.lag
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, lag=3) as lb:  # for steps shorter than a decision
        result["lag"] = lb.config.lag
        result["first"] = [lb.client.assignment(k).policy for k in range(3)]
        for name, call in (("iterable", lambda: lb.loader(Stream())),
                           ("persistent_workers", lambda: lb.loader(data(), num_workers=1, persistent_workers=False)),
                           ("without_workers", lambda: lb.loader(data(), persistent_workers=False))):
            try:
                call()
            except ConfigError as exc:
                result[name] = str(exc)
    return result


def mistakes(url: str, job: str) -> dict:
    """What users could get silently wrong with the torch adapter, each now caught or fixed."""
    result: dict = {}
    model = linear()
    train = trainer(model)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-1") as lb:
        sharded = fully_shard(torch.nn.Linear(5, 1), mesh=init_device_mesh("cpu", (2,)))
        for name, call in (("dataloader", lambda: lb.loader(DataLoader(data(), batch_size=4))),
                           ("shuffle", lambda: lb.loader(data(), shuffle="no")),  # "no" used to shuffle
                           # attach used to say "without DDP call all_reduce_gradients", which averaged DDP's mean
                           ("compiled", lambda: lb.attach(torch.compile(linear()))),
                           ("fsdp", lambda: lb.attach(sharded)),
                           ("fsdp_reduce", lambda: lb.all_reduce_gradients(sharded.parameters()))):
            try:
                call()
            except ConfigError as exc:
                result[name] = str(exc)
        lb.attach(model)
        loader = lb.loader(data(), num_workers=1)
        result["seen"] = []
        for i, (x, y, index) in enumerate(loader):
            if i == 3:
                loader.set_epoch(1)  # from the next epoch on: switching now repeated and skipped samples
            train(x, y)
            result["seen"] += index.tolist()
        result["epoch_then"] = loader.sampler.epoch
        next(iter(loader))  # the next epoch's first step (its loop left at once)
        result["epoch_next"] = loader.sampler.epoch
        steps = iter(loader)
        next(steps)
        loader.set_epoch(3)  # asked for during an iteration ...
        steps.close()
        loader.set_epoch(2)  # ... and superseded by one asked for between iterations
        next(iter(loader))
        result["epoch_last"] = loader.sampler.epoch
    result["children_after_close"] = len(multiprocessing.active_children())  # the loader's worker too
    try:
        next(iter(loader))
    except LBBSPError as exc:
        result["after_close"] = str(exc)

    model = linear()
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-2") as lb:
        lb.attach(model)
        try:
            for x, y, _ in lb.loader(data()):
                F.mse_loss(model.module(x), y).backward()  # around DDP: no gradient is ever averaged
        except ConfigError as exc:
            result["module"] = str(exc)


    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-3") as lb:  # no DDP, mixed dtypes
        torch.manual_seed(0)
        used, unused = torch.nn.Linear(5, 1).double(), torch.nn.Linear(5, 1)
        params = [*used.parameters(), *unused.parameters()]
        for x, y, _ in lb.loader(data()):
            loss = F.mse_loss(used(x.double()), y.double())
            if torch.distributed.get_rank() == 1:  # rank 0 has no gradient of its own for these: it gets rank 1's
                loss = loss + 0 * unused(x).sum()
            loss.backward()
            lb.all_reduce_gradients(params)  # a float32 parameter without a gradient got a float64 one
        result["grad_dtypes"] = [str(p.grad.dtype) for p in params]

    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-4") as lb:
        lb.attach(model, weighting="loss")
        for x, y, _ in lb.loader(data()):
            loss = lb.scale_loss(F.mse_loss(model(x), y))
            try:
                lb.scale_loss(loss)  # twice: gradients W * b_i / B too large, without a word, before
            except ConfigError as exc:
                result["scaled_twice"] = str(exc)
            try:  # a token count where a micro-batch's samples go: silently wrong (0.66 off) before
                lb.scale_loss(F.mse_loss(model(x), y), samples=len(y) + 1)
            except ConfigError as exc:
                result["more_samples"] = str(exc)
            result["tensor_samples"] = lb.scale_loss(F.mse_loss(model(x), y), samples=torch.tensor(len(y))).item()
            loss.backward()
            opt.step()
            opt.zero_grad()
    return result


def batches_outside_their_steps(url: str, job: str) -> dict:
    """Two loaders zipped, itertools.cycle over a loader, a Subset per rank (all silently
    wrong before), and the loader state after a loop left before its step's backward (it had skipped that step)."""
    result: dict = {}
    model = linear()
    train = trainer(model)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-1") as lb:
        lb.attach(model)
        loader = lb.loader(data())
        for i, (x, y, _) in enumerate(loader):
            if i == 3:
                break  # at the top of the body: step 3 was drawn, not trained
            train(x, y)
        result["left_before_backward"] = loader.state_dict()["step"]
        for i, (x, y, _) in enumerate(loader):
            train(x, y)
            if i == 5:
                break  # after the update: step 5 was trained
        result["left_after_update"] = loader.state_dict()["step"]
        try:  # paired data from two loaders: each took an iteration with its own split
            for (x, y, _), _other in zip(loader, lb.loader(data(), seed=1)):
                train(x, y)
        except ConfigError as exc:
            result["zip"] = str(exc)
    model = linear()
    train = trainer(model)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-2") as lb:
        lb.attach(model)
        batches = itertools.cycle(lb.loader(data()))  # replays the first epoch's batches outside any step
        try:
            for _ in range(SAMPLES // GLOBAL_BATCH + 1):
                x, y, _ = next(batches)
                train(x, y)
        except LBBSPError as exc:
            result["cycle"] = str(exc)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-3") as lb:
        rank = torch.distributed.get_rank()
        try:  # one shard per rank, of one size: half the data was never used
            next(iter(lb.loader(Subset(data(), range(rank, SAMPLES, 2)))))
        except ConfigError as exc:
            result["shard"] = str(exc)
    return result


def running_ahead(url: str, job: str) -> dict:
    """Rank 0's coordinator, slower than the steps (decisions of 60 ms), runs ahead by default, one decision
    covering several steps, and decides every step with max_ahead=1; a max_ahead out of range is refused on every
    rank before anything starts. The iterations each decision covers, by max_ahead."""
    result: dict = {}
    for wrong in (0, 1025, 2.0):
        try:
            Balancer.from_env(GLOBAL_BATCH, redis=url, job=f"{job}-wrong", max_ahead=wrong)  # type: ignore[arg-type]
        except ConfigError as exc:
            result.setdefault("refused", []).append(str(exc))
    for max_ahead in (None, 1):
        name = f"{job}-{max_ahead}"
        model = linear()
        train = trainer(model)
        with Balancer.from_env(GLOBAL_BATCH, redis=url, job=name, policy=DelayedPolicy(0.06, 1.0, seed=0),
                               max_ahead=max_ahead) as lb:
            lb.attach(model)
            fallbacks = 0
            for _ in range(5):
                for x, y, _ in lb.loader(data()):
                    train(x, y)
                    fallbacks += lb.step.assignment.fallback
            result[f"fallbacks {max_ahead}"] = fallbacks
        torch.distributed.barrier()  # rank 0's coordinator has stopped: the log is whole
        with Store.from_url(url, name) as store:
            decisions = [json.loads(d) for d in store.decisions(1000)]
        result[f"spans {max_ahead}"] = sorted({d["through"] - d["iteration"] + 1 for d in decisions})
        result[f"decisions {max_ahead}"] = len(decisions)
    return result


def agreement_group(url: str, job: str) -> dict:
    """The gloo group the vector is agreed over when the default group is NCCL's, made as it is there (the one thing
    stubbed: where the default group's collectives run): it must wait as long as the process group does, not gloo's
    default of 30 minutes, when a rank is gone."""
    with mock.patch.object(lbbsp_torch, "_collective_device", return_value=torch.device("cuda", 0)):
        group = lbbsp_torch.cpu_group()
    try:
        assert group is not None
        return {"timeout_s": group._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
                "backend": torch.distributed.get_backend(group), "size": torch.distributed.get_world_size(group)}
    finally:
        lbbsp_torch._CPU_GROUPS.clear()


SCENARIOS = {f.__name__: f for f in (abandoned_steps, no_sync_with_the_hook, without_attach,
                                     loss_form_without_scale_loss, second_balancer_on_one_model,
                                     external_coordinator, settings, mistakes, batches_outside_their_steps,
                                     running_ahead, agreement_group)}


def _scenarios(url: str, job: str) -> dict:
    results = {}
    for name, scenario in SCENARIOS.items():
        try:
            results[name] = scenario(url, f"{job}-{name}")
        except Exception as exc:  # noqa: BLE001  (recorded: each test then fails for its own scenario)
            results[name] = {"error": type(exc).__name__, "message": str(exc),
                             "iteration": getattr(exc, "iteration", None)}
    return results


def _worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    in_gloo_group(rank, world, init, out, lambda: _scenarios(url, job), timeout=GROUP_TIMEOUT)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory, redis_server: EmbeddedRedis) -> list[dict]:
    """One run of 2 gloo ranks through every scenario, beside a CLI coordinator with --lag 1 --ttl 600."""
    tmp = tmp_path_factory.mktemp("usage")
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    job = f"test-{uuid.uuid4().hex[:10]}"
    external = f"{job}-external_coordinator"
    coordinator = subprocess.Popen([sys.executable, "-m", "lbbsp.cli", "coordinator", "--redis", url, "--job",
                                    external, "--workers", "2", "--global-batch", str(GLOBAL_BATCH), "--lag", "1",
                                    "--ttl", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Store.from_url(url, external) as store:  # the coordinator is serving before the workers start
            deadline = time.monotonic() + 60
            while store.load_config() is None and coordinator.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert store.load_config() == JobConfig(external, 2, GLOBAL_BATCH, lag=1, ttl_s=600)
        spawn(_worker, (2, str(tmp / "rdv"), url, job, str(tmp)), nprocs=2, timeout_s=200)
    finally:
        coordinator.terminate()
        coordinator.wait(10)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def both(outcomes: list[dict], scenario: str) -> dict:
    """The scenario's outcome, the same on both ranks but for the rank number in error messages."""
    first, second = (json.dumps(r[scenario]).replace("worker=1", "worker=0") for r in outcomes)
    assert first == second, f"{scenario}: the ranks disagree"
    return outcomes[0][scenario]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_steps_left_early_are_harmless(outcomes: list[dict]) -> None:
    ranks = [r["abandoned_steps"] for r in outcomes]
    assert all("error" not in r for r in ranks), ranks
    assert [r["steps"] for r in ranks] == [3 + 8 + 16 + 4 + 8] * 2  # every step begun counts, on every rank
    # the evaluation epochs: said once; it had said nothing (an epoch with no gradient was checked only when
    # none had gone through the hook since the Balancer started)
    assert all([m for m in r["said"] if "evaluation pass?" in m] == r["said"] and len(r["said"]) == 1
               for r in ranks), ranks
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(SAMPLES))  # the last epoch, once each


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("scenario", "error", "words"), [
    ("no_sync_with_the_hook", "LBBSPError", "no_sync"),
    ("without_attach", "ConfigError", "lb.attach(ddp_model)"),
    ("loss_form_without_scale_loss", "ConfigError", "lb.scale_loss(loss)"),
])
def test_unweighted_gradients_are_refused_after_the_first_step(outcomes: list[dict], scenario: str, error: str,
                                                               words: str) -> None:
    result = both(outcomes, scenario)
    assert result.get("error") == error and words in result["message"], result
    assert result["iteration"] == 0  # raised when step 1 begins, about step 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_balancer_needs_a_new_ddp_wrapper(outcomes: list[dict]) -> None:
    result = both(outcomes, "second_balancer_on_one_model")
    assert "has lbbsp's already" in result["attach"] and "new DistributedDataParallel" in result["attach"]
    assert result["weighting"] is None  # a failed attach leaves the Balancer as it was
    assert "closed Balancer" in result["backward"]  # the first Balancer's hook no longer weights
    assert ("has a communication hook already (the script's own from register_comm_hook, a builtin one, or DDP's "
            "mixed_precision), and DDP takes one: pass a hook of your own to lb.attach(model, comm_hook=..., "
            "comm_state=...) instead") in result["own_hook"]
    assert result["second_model"] is True
    assert (result["sequential_overlap"], result["zipped_overlap"]) == (0, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_external_coordinators_lag_and_ttl_are_adopted(outcomes: list[dict]) -> None:
    result = both(outcomes, "external_coordinator")
    assert "global_batch=8" in result["mismatch"] and "global_batch=16" in result["mismatch"]
    assert "the URL of its Redis (redis= or $LBBSP_REDIS_URL)" in result["no_redis"]
    assert "an embedded server here would be one it cannot see" in result["no_redis"]
    assert result["no_job"] == ("with an external coordinator (coordinator=False), pass the job name it serves (job=): "
                                "the name its `lbbsp coordinator --job` was given")
    assert result["policy"].startswith("policy= is the coordinator's")
    assert "set its --lag" in result["lag_refused"]
    assert "set its --max-ahead" in result["max_ahead_refused"]
    assert (result["lag"], result["ttl_s"]) == (1, 600) and result["redis_url_kept"]
    assert [policy for policy, _ in result["assignments"][:1]] == ["initial"]
    assert all(policy != "initial" and not fallback for policy, fallback in result["assignments"][1:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_settings_errors_say_what_to_do(outcomes: list[dict]) -> None:
    result = both(outcomes, "settings")
    assert "min_batch=0" in result["global_batch"] and "at least 2" in result["global_batch"]
    assert "map-style dataset" in result["iterable"]
    assert "persistent_workers itself" in result["persistent_workers"] and "without_workers" not in result
    assert result["alike"] == 2
    assert result["differ"].startswith(f"Balancer.from_env was given other settings on other ranks (global_batch: "
                                       f"{GLOBAL_BATCH} on rank 0; {GLOBAL_BATCH + 1} on rank 1): the job has one "
                                       "global batch and one split a step, so every rank must pass the same")
    assert "on rank 0, 'redis://u:***@127.0.0.1:9/0' on rank 1" in result["redis_differ"], result["redis_differ"]
    assert "secret" not in result["redis_differ"] and "which take rank 0's" in result["redis_differ"]
    assert "127.0.0.1:1" in result["unreachable"] and "LBBSP_REDIS_URL" in result["unreachable"]
    assert "policy must be a Policy instance" in result["policy_name"]
    assert "global_batch must be an integer, got True (bool)" in result["bool_batch"]
    assert "global_batch must be an integer in [1, " in result["zero_batch"] and "min_batch" not in result["zero_batch"]
    assert "max_batch must be None, an integer or a sequence" in result["str_caps"]
    assert "coordinator must be True or False, got 'false' (str)" in result["str_coordinator"]
    assert result["lag"] == 3 and result["first"] == ["initial"] * 3, result["first"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_max_ahead_reaches_rank_0s_coordinator(outcomes: list[dict]) -> None:
    result = both(outcomes, "running_ahead")
    assert len(result["refused"]) == 3 and all("max_ahead must be an integer" in r for r in result["refused"]), result
    assert max(result["spans None"]) > 1, result  # one decision for several steps: the steps did not wait for each
    assert result["spans 1"] == [1] and result["decisions 1"] >= 5 * 8 - 2, result  # lag 2: steps 0 and 1 start
    assert result["fallbacks None"] == result["fallbacks 1"] == 0, result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_agreement_group_made_under_nccl_keeps_the_process_groups_timeout(outcomes: list[dict]) -> None:
    assert both(outcomes, "agreement_group") == {"timeout_s": GROUP_TIMEOUT.total_seconds(), "backend": "gloo",
                                                 "size": 2}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_likely_mistakes_are_caught(outcomes: list[dict]) -> None:
    ranks = [r["mistakes"] for r in outcomes]
    assert all("error" not in r for r in ranks), ranks
    result = ranks[0]
    assert "pass loader.dataset" in result["dataloader"]
    assert "shuffle must be True or False" in result["shuffle"]
    assert "attach the DDP model before compiling it: torch.compile(lb.attach(DDP(m)))" in result["compiled"]
    assert result["fsdp"].startswith("FSDP is not supported") and result["fsdp_reduce"] == result["fsdp"]
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(SAMPLES))  # once each, set_epoch or not
    assert [(r["epoch_then"], r["epoch_next"], r["epoch_last"]) for r in ranks] == [(0, 1, 2)] * 2
    assert [r["children_after_close"] for r in ranks] == [0, 0]
    assert "closed" in result["after_close"]
    assert "not ddp_model.module(x)" in result["module"]
    assert result["grad_dtypes"] == ["torch.float64"] * 2 + ["torch.float32"] * 2
    assert "through lb.scale_loss already" in result["scaled_twice"]
    assert "samples must be the samples of a micro-batch of this rank's slice" in result["more_samples"]
    assert "'Losses that are not a mean over samples' in docs/torch.md" in result["more_samples"]
    assert math.isfinite(result["tensor_samples"])  # a count as a tensor (mask.sum()) is taken


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_batches_drawn_outside_their_steps_are_refused_and_a_step_left_untrained_is_served_again(
        outcomes: list[dict]) -> None:
    result = both(outcomes, "batches_outside_their_steps")
    assert "error" not in result, result
    assert (result["left_before_backward"], result["left_after_update"]) == (3, 6)
    assert "two loaders iterated together (zip)" in result["zip"]
    assert "itertools.cycle" in result["cycle"]
    assert "subset indices" in result["shard"]


COLLECTIVE_TIMEOUT = timedelta(seconds=30)  # how long a rank waits in a collective that the other never joins


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
        deadline = time.monotonic() + 2 * COLLECTIVE_TIMEOUT.total_seconds()
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


def _scenario_worker(rank: int, world: int, init: str, url: str, job: str, out: str, scenario: str) -> None:
    """Run ``scenario`` as ``rank``; write what it returned, or what it raised, to out/rank{rank}.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
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
        spawn(_scenario_worker, (2, str(tmp / "rdv"), url, job, str(tmp), scenario), nprocs=2, timeout_s=150)
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


def samples(n: int = 200) -> TensorDataset:
    return TensorDataset(torch.randn(n, 10), torch.randint(0, 3, (n,)))


def stand_in(global_batch: int, world_size: int) -> SimpleNamespace:
    """A Balancer of ``world_size`` ranks as the loader reads one (its config and world size): what is checked
    here happens before any step, Redis or collective."""
    return SimpleNamespace(config=JobConfig("unit", world_size, global_batch), _loaders=set(), world_size=world_size)


def test_ddps_batch_size_given_to_the_loader_says_how_to_pick_the_global_batch() -> None:
    """DDP's batch_size is per rank: a porter on 2 ranks who set global_batch to their old batch_size of 16
    trained on half the batch; the error had said only that the loader sets batch_size itself."""
    with pytest.raises(ConfigError, match=r"global_batch = batch_size x world size \(here 16 x 2 = 32\).*"
                                          r"Balancer.from_env.*global batch is 16"):
        BalancedLoader(samples(), stand_in(16, 2), batch_size=16, num_workers=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"global_batch = batch_size x world size to Balancer.from_env"):
        BalancedLoader(samples(), stand_in(16, 2), batch_size=None)  # type: ignore[arg-type]


def test_a_global_batch_larger_than_the_dataset_warns_that_an_epoch_is_one_short_step(
        caplog: pytest.LogCaptureFixture) -> None:
    """global_batch=1000 on 200 samples had been taken without a word: each epoch one step of 200 samples."""
    with caplog.at_level(logging.WARNING, logger="lbbsp.torch"):
        loader = BalancedLoader(samples(), stand_in(1000, 2))  # type: ignore[arg-type]
    warned = [r.getMessage() for r in caplog.records if "larger than the dataset" in r.getMessage()]
    assert len(loader) == 1 and len(warned) == 1, warned
    assert "global batch 1000" in warned[0] and "one short step of 200 samples" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lbbsp.torch"):
        assert len(BalancedLoader(samples(), stand_in(200, 2))) == 1  # type: ignore[arg-type]  # one full step
        with pytest.raises(ConfigError, match="leaves no batch at all"):  # drop_last: refused, not warned about
            BalancedLoader(samples(), stand_in(1000, 2), drop_last=True)  # type: ignore[arg-type]
    assert not caplog.records, [r.getMessage() for r in caplog.records]
