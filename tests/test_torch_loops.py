"""An earlier loop over a loader, left unfinished and closed while a later loop over it runs, on 2 real gloo ranks:
its clean-up leaves the later loop alone. It had ended the later loop's open step (its backward then raised an
LBBSPError) and put the loader's checkpoint position back at the earlier loop's step. In the same run, a rank that
reads another vector than rank 0's for a step cuts that step by rank 0's."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.multiprocessing import ProcessRaisedException  # noqa: E402

from lbbsp import Assignment, EmbeddedRedis  # noqa: E402
from lbbsp.integrations.torch import Balancer  # noqa: E402
from lbbsp.integrations.torch_data import BalancedLoader  # noqa: E402
from test_torch_exact import destroy_group, spawn  # noqa: E402
from test_torch_usage import COLLECTIVE_TIMEOUT as GROUP_TIMEOUT  # noqa: E402
from test_torch_usage import GLOBAL_BATCH, SAMPLES, data, linear, trainer  # noqa: E402

STOP_AT = 3  # the global batch at which the later loop is left, before its backward


def _first_steps(loader: BalancedLoader, train: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """Train a first batch drawn by hand (kept in ``batches``), then the epoch from its start, left with ``break``
    at global batch STOP_AT, before its backward: ``batches`` is collected as this returns."""
    batches = iter(loader)
    x, y, _ = next(batches)
    train(x, y)
    for step, (x, y, _) in enumerate(loader):
        if step == STOP_AT:
            break
        train(x, y)


class Stream:
    """A user's stream of batches that holds a loop over the loader and, through a bound method, itself: once
    dropped, it is freed only when the cyclic garbage collector runs."""

    def __init__(self, loader: BalancedLoader) -> None:
        self.batches = iter(loader)
        self.callbacks = [self.draw]

    def draw(self) -> tuple[torch.Tensor, ...]:
        return next(self.batches)


def _checkpoint_after_break(url: str, job: str) -> dict:
    """Where the loader says to resume once _first_steps returns."""
    model = linear()
    train = trainer(model)
    with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
        lb.attach(model)
        loader = lb.loader(data())
        _first_steps(loader, train)
        return loader.state_dict()


def _collected_mid_step(url: str, job: str) -> dict:
    """A Stream trains one batch and is dropped; a loop over the loader trains the epoch, and the collector runs
    (here, by gc.collect, at a moment of its choosing otherwise) between its second batch and that batch's backward."""
    model = linear()
    train = trainer(model)
    gc.disable()  # the Stream is collected where this says, not earlier
    try:
        with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
            lb.attach(model)
            loader = lb.loader(data())
            stream = Stream(loader)
            x, y, _ = stream.draw()
            train(x, y)
            del stream
            seen: list[int] = []
            for step, (x, y, index) in enumerate(loader):
                if step == 1:
                    gc.collect()
                train(x, y)
                seen += index.tolist()
            return {"seen": seen, "state": loader.state_dict()}
    finally:
        gc.enable()


OTHER_AT = 3  # the iteration at which rank 1 reads another vector than rank 0's; at OTHER_AT + 1 it has fallen back


def _another_vector_on_rank_1(url: str, job: str) -> dict:
    """Train one epoch; rank 1's reads of iterations OTHER_AT (another vector) and OTHER_AT + 1 (a fallback of its
    own, as where Redis failed this rank alone) differ from what rank 0 reads. Returns each step's split and what the
    rank's Assignment said, the samples it trained on and what the adapter logged."""
    said: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = (  # type: ignore[method-assign]
        lambda record: said.append(f"{record.levelname} {record.getMessage()}"))
    logger = logging.getLogger("lbbsp.torch")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    model = linear()
    train = trainer(model)
    try:
        with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
            if lb.rank == 1:
                fetch = lb.client._fetch

                def fetch_another(iteration: int, deadline: float) -> Assignment:
                    found = fetch(iteration, deadline)
                    if iteration not in (OTHER_AT, OTHER_AT + 1):
                        return found
                    a, b = found.sizes
                    other = (a + 1, b - 1) if b > 1 else (a - 1, b + 1)
                    return dataclasses.replace(found, sizes=other, fallback=iteration == OTHER_AT + 1)
                lb.client._fetch = fetch_another  # type: ignore[method-assign]
            lb.attach(model)
            steps, seen = [], []
            for x, y, index in lb.loader(data()):
                train(x, y)
                assert lb.step is not None
                steps.append([lb.step.iteration, list(lb.step.split), lb.step.assignment.reason])
                seen += index.tolist()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {"steps": steps, "seen": seen, "said": said}


def _worker(rank: int, world: int, init: str, url: str, job: str, out: str) -> None:
    """Run each scenario as ``rank`` under its own job; write what each returned, or raised, to out/rank{rank}.json."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=GROUP_TIMEOUT)
    results: dict = {}
    for name, scenario in (("checkpoint", _checkpoint_after_break), ("collected", _collected_mid_step),
                           ("another_vector", _another_vector_on_rank_1)):
        try:
            results[name] = scenario(url, f"{job}-{name}")
        except Exception as exc:  # noqa: BLE001  (recorded: the tests name what it should have been)
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    destroy_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, redis_server: EmbeddedRedis) -> list[dict]:
    """Both ranks' results of both scenarios, from one run of 2 gloo ranks."""
    tmp = tmp_path_factory.mktemp("loops")
    url = os.environ.get("LBBSP_TEST_REDIS_URL", redis_server.url)
    job = f"test-{uuid.uuid4().hex[:10]}"
    with contextlib.suppress(ProcessRaisedException):  # a rank that raised: its file says what, if it got that far
        spawn(_worker, (2, str(tmp / "rdv"), url, job, str(tmp)), nprocs=2, timeout_s=150)
    return [json.loads(f.read_text()) if (f := tmp / f"rank{r}.json").exists() else {} for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_earlier_loop_collected_after_a_later_loop_is_left_keeps_the_later_checkpoint_position(
        ranks: list[dict]) -> None:
    for result in ranks:
        state = result["checkpoint"]
        assert "error" not in state, state
        assert (state["epoch"], state["step"]) == (0, STOP_AT), state  # it had said 0: steps 0-2 trained again


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_earlier_loop_collected_mid_step_leaves_the_later_loops_step_open(ranks: list[dict]) -> None:
    for result in ranks:
        assert "error" not in result["collected"], result["collected"]  # an LBBSPError at the backward, had been
    assert sorted(ranks[0]["collected"]["seen"] + ranks[1]["collected"]["seen"]) == list(range(SAMPLES))
    for result in ranks:
        state = result["collected"]["state"]
        assert (state["epoch"], state["step"]) == (0, SAMPLES // GLOBAL_BATCH), state  # the epoch served whole


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_reads_another_vector_than_rank_0s_cuts_the_step_by_rank_0s(ranks: list[dict]) -> None:
    """Every rank must cut a step's global batch by one vector, or samples are used twice and others never: where a
    rank's read differs from rank 0's (a fallback of its own in an outage, a key rewritten between reads), the
    process group's agreement gives it rank 0's, and says so (a warning; an info line after its own fallback)."""
    results = [result["another_vector"] for result in ranks]
    assert all("error" not in result for result in results), results
    assert [s[:2] for s in results[0]["steps"]] == [s[:2] for s in results[1]["steps"]], "cut by other vectors"
    assert sorted(results[0]["seen"] + results[1]["seen"]) == list(range(SAMPLES))
    agreed = "rank 0's vector, agreed over the process group"
    assert [s[0] for s in results[1]["steps"] if s[2] == agreed] == [OTHER_AT, OTHER_AT + 1], results[1]["steps"]
    assert not any(s[2] == agreed for s in results[0]["steps"]) and not results[0]["said"], results[0]
    split = {s[0]: re.escape(str(tuple(s[1]))) for s in results[0]["steps"]}
    said = "\n".join(results[1]["said"])
    assert re.search(rf"^WARNING rank 1 read \(\d+, \d+\) for iteration {OTHER_AT}; using rank 0's {split[OTHER_AT]}$",
                     said, re.MULTILINE), said
    assert re.search(rf"^INFO rank 1 fell back to \(\d+, \d+\) for iteration {OTHER_AT + 1}; using rank 0's "
                     rf"{split[OTHER_AT + 1]}$", said, re.MULTILINE), said
