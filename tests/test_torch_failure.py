"""An exception on one rank ends every rank with an error, also when the Balancer is closed on the way out
(``with``, ``finally``): closing then skips the barrier that the other rank, inside DDP's all-reduce, never joins.
A policy that rank 0's coordinator process refuses is refused on every rank, with the same ConfigError."""
from __future__ import annotations

import json
import time
import uuid
from contextlib import suppress
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from lbbsp import EmbeddedRedis  # noqa: E402
from lbbsp.integrations.torch import Balancer  # noqa: E402
from refused_policies import REFUSALS, refused_policy  # noqa: E402
from test_torch_usage import GLOBAL_BATCH, SAMPLES, data, linear, trainer  # noqa: E402

FAILING_RANK, FAILING_STEP = 1, 2


def _train(lb: Balancer, rank: int) -> None:
    model = linear()
    train = trainer(model)
    lb.attach(model)
    for step, (x, y, _) in enumerate(lb.loader(data())):
        if rank == FAILING_RANK and step == FAILING_STEP:
            raise ValueError("a bug in the training loop of one rank")
        train(x, y)  # the other rank waits in DDP's all-reduce for a gradient that never comes


def _worker(rank: int, world: int, init: str, url: str, job: str, form: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        if form == "with":
            with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
                _train(lb, rank)
        else:
            lb = Balancer.from_env(GLOBAL_BATCH, redis=url, job=job)
            try:
                _train(lb, rank)
            finally:
                lb.close()
    except Exception as exc:
        Path(out, f"rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["with", "finally"])
def test_an_exception_on_one_rank_ends_every_rank(tmp_path: Path, redis_server: EmbeddedRedis, form: str) -> None:
    url = redis_server.url
    args = (2, str(tmp_path / "rdv"), url, f"test-{uuid.uuid4().hex[:10]}", form, str(tmp_path))
    context = mp.start_processes(_worker, args=args, nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 60  # start-up included; without the fix both ranks wait for 30 minutes
    try:
        while any(p.is_alive() for p in context.processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        codes = [p.exitcode for p in context.processes]
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
    assert None not in codes, "a rank was still running after 60 s: a hang"
    assert all(code != 0 for code in codes), codes
    errors = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert errors[FAILING_RANK].startswith("ValueError: a bug in the training loop")
    assert errors[1 - FAILING_RANK], "the other rank ended without an error"


# -- a policy refused on every rank -----------------------------------------------------------------------------
def _join_with(rank: int, init: str, url: str, job: str, out: str, what: str) -> None:
    """Join a 2-rank gloo group and build a Balancer with a policy rank 0 refuses; write what from_env raised."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from lbbsp.integrations.torch import Balancer  # noqa: PLC0415
    from test_torch_exact import destroy_group  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    try:
        Balancer.from_env(10, redis=url, job=job, policy=refused_policy(what))
        raised = "nothing"  # left as it is: a step or close() here would wait on rank 0, which has gone
    except Exception as exc:  # noqa: BLE001  (recorded: the test names what it should have been)
        raised = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(raised))
    if raised != "nothing":
        destroy_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", list(REFUSALS))
def test_a_policy_rank_0_refuses_is_refused_on_every_rank(what: str, tmp_path: Path, redis_url: str) -> None:
    """Rank 0 alone raised the ConfigError; rank 1's from_env returned, and its first step failed with gloo's
    "Connection closed by peer" once rank 0's process ended (or waited out the group's timeout while it lived)."""
    from torch.multiprocessing import ProcessRaisedException  # noqa: PLC0415

    from test_torch_exact import spawn  # noqa: PLC0415

    job = f"test-{uuid.uuid4().hex[:10]}"
    with suppress(ProcessRaisedException):
        spawn(_join_with, (str(tmp_path / "rdv"), redis_url, job, str(tmp_path), what), nprocs=2, timeout_s=90)
    raised = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert raised[0] == raised[1] and raised[0].startswith(f"ConfigError: {REFUSALS[what]}"), raised


# -- a Redis that goes away between two ranks' reads ------------------------------------------------------------
OUTAGE_AT, TIMEOUT_S = 4, 2.0  # the step whose vector rank 0 reads just before Redis goes, and assignment_timeout_s


def _wait_for(path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.02)


def _outage_worker(rank: int, init: str, url: str, job: str, folder: str) -> None:
    """Train one epoch; Redis goes away after rank 0 has read the vector of step OUTAGE_AT, before rank 1 does.
    Writes how long each step's batch took to draw (its wait for the vector, agreed)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    out = Path(folder)
    lb = Balancer.from_env(GLOBAL_BATCH, redis=url, job=job, assignment_timeout_s=TIMEOUT_S)
    if rank == 0:
        fetch = lb.client._fetch

        def fetch_then_outage(iteration: int, deadline: float) -> object:
            found = fetch(iteration, deadline)
            if iteration == OUTAGE_AT:
                (out / "read").touch()  # the test stops Redis now
                _wait_for(out / "gone")
            return found
        lb.client._fetch = fetch_then_outage  # type: ignore[method-assign]
    model = linear()
    train = trainer(model)
    lb.attach(model)
    waits = []
    batches = iter(lb.loader(data()))
    for step in range(SAMPLES // GLOBAL_BATCH):
        if rank == 1 and step == OUTAGE_AT:
            _wait_for(out / "gone")
        started = time.monotonic()
        x, y, _ = next(batches)
        waits.append(time.monotonic() - started)
        train(x, y)
    (out / f"rank{rank}.json").write_text(json.dumps(waits))
    _wait_for(out / "back")
    lb.close()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_redis_gone_between_two_ranks_reads_costs_the_job_one_wait(tmp_path: Path) -> None:
    """Rank 1 waited assignment_timeout_s at the step whose vector rank 0 had read just before, and fell back; rank 0
    found Redis gone a step later and waited the whole timeout again: two stalls of the job (about 21 s at the default
    10 s, found porting a DDP script). Now the rank that waited tells the others through the process group's store."""
    job = f"test-{uuid.uuid4().hex[:10]}"
    with EmbeddedRedis() as server:
        context = mp.start_processes(_outage_worker, args=(str(tmp_path / "rdv"), server.url, job, str(tmp_path)),
                                     nprocs=2, join=False, start_method="spawn")
        try:
            _wait_for(tmp_path / "read")
            server.stop()
            (tmp_path / "gone").touch()
            for rank in range(2):
                _wait_for(tmp_path / f"rank{rank}.json")
            server.start()
            (tmp_path / "back").touch()
            context.join(60)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
    waits = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert waits[1][OUTAGE_AT] >= TIMEOUT_S  # rank 1's wait for Redis, rank 0's for rank 1 in the agreement
    later = [wait for rank_waits in waits for wait in rank_waits[OUTAGE_AT + 1:]]
    assert max(later) < TIMEOUT_S / 2, waits
