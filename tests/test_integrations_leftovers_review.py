"""Leftovers of the integrations' reviews, each seen failing before its fix: a policy that rank 0's coordinator
process refuses (kinds pinned outside the job, or one that cannot be pickled) must be refused on every rank, not
leave the others to a gloo error or a wait; ``lbbsp demo -v`` reaches the workers; an empty ``--load-schedule`` is
shown as no load; a SIGTERM while the demo's workers start stops them at once."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from lbbsp import ConfigError, JobConfig, LBBSPPolicy
from lbbsp.cli import main
from lbbsp.models import AutoCapacityModel
from lbbsp.policies import Policy
from test_cli_audit import _running

pytest.importorskip("torch")  # the demo's workers and the ranks of the policy checks train with it
TESTS = str(Path(__file__).parent)


class Locked(LBBSPPolicy):
    """A policy holding a lock: it cannot be pickled to the coordinator's child process."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()


def refused_policy(what: str) -> Policy:
    """A policy that rank 0's CoordinatorProcess refuses, in a job of 2 workers."""
    return LBBSPPolicy(AutoCapacityModel(kinds={5: "gpu"})) if what == "kinds" else Locked()


REFUSALS = {"kinds": "AutoCapacityModel's kinds pin worker(s) [5], outside the job's workers 0..1",
            "pickle": "policy Locked cannot be pickled to the coordinator's child process"}


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


@pytest.mark.parametrize("what", list(REFUSALS))
def test_a_policy_worker_0_refuses_is_refused_on_every_keras_worker(what: str, redis_url: str, job: str) -> None:
    """Worker 1's session started with it; worker 0's alone raised, and worker 1's fit then waited on a coordinator
    that never ran."""
    from lbbsp.integrations.keras import WorkerSession  # noqa: PLC0415

    with pytest.raises(ConfigError, match=re.escape(REFUSALS[what])):
        WorkerSession(JobConfig(job, num_workers=2, global_batch=10), 1, url=redis_url, policy=refused_policy(what))


# -- the demo's workers, started by its real launcher -----------------------------------------------------------
def probe_worker(rank: int, *args: Any) -> None:
    """The demo's worker with its training replaced: one INFO line, then an error event that ends the launcher."""
    from lbbsp.integrations import demo  # noqa: PLC0415

    def logs_at_info(rank: int, config: object, init: str, url: str, events: Any) -> None:
        logging.getLogger("lbbsp.probe").info("worker %d logs at INFO", rank)
        events.put(("error", rank, "the probe is done"))

    demo._train_both = logs_at_info
    demo._worker(rank, *args)


def launch_with_probe_workers(*argv: str) -> int:
    """``lbbsp *argv`` (a demo) whose workers are :func:`probe_worker`."""
    from lbbsp.integrations import demo  # noqa: PLC0415

    demo._worker = probe_worker
    return main(list(argv))


def launch_with_sigterm_at_start(*argv: str) -> int:
    """``lbbsp *argv`` (a demo), sent SIGTERM right after its first worker process starts; prints that one's pid."""
    import multiprocessing.process  # noqa: PLC0415

    start = multiprocessing.process.BaseProcess.start

    def start_then_sigterm(process: multiprocessing.process.BaseProcess) -> None:
        start(process)
        print(f"started {process.pid}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    multiprocessing.process.BaseProcess.start = start_then_sigterm  # type: ignore[method-assign]
    return main(list(argv))


def run_launcher(launch: str, *argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``launch(*argv)`` of this module in a fresh interpreter (the demo's workers import it by name)."""
    code = f"import sys; sys.path.insert(0, {TESTS!r}); import {__name__} as t; sys.exit(t.{launch}(*{argv!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          check=False)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("argv", [("demo", "-v"), ("-v", "demo")])
def test_verbose_reaches_the_demo_workers(argv: tuple[str, ...]) -> None:
    """The workers, spawned, logged nothing below WARNING whatever -v said: the launcher's logging never reached them."""
    launcher = run_launcher("launch_with_probe_workers", *argv, "--steps", "10", "--hidden", "8")
    assert launcher.returncode == 2 and "the probe is done" in launcher.stderr, launcher.stderr
    assert re.search(r"lbbsp\.probe INFO worker [01] logs at INFO", launcher.stderr), launcher.stderr


def test_an_empty_load_schedule_is_shown_as_no_load(capsys: pytest.CaptureFixture[str]) -> None:
    """``--load-schedule ""`` (no span: the load never goes on) was shown as "during  of each run"."""
    assert main(["demo", "--load-schedule", "", "--redis", "redis://127.0.0.1:1"]) == 2  # the header, then no Redis
    header = " ".join(capsys.readouterr().out.split())
    assert "during of each run" not in header
    assert "(worker 1) never switched on: --load-schedule is empty" in header, header
    assert main(["demo", "--load-schedule", " 0-0.5 , ", "--redis", "redis://127.0.0.1:1"]) == 2
    assert "(worker 1) during 0-0.5 of each run" in " ".join(capsys.readouterr().out.split())


@pytest.mark.timeout(90)
def test_a_sigterm_while_the_demos_workers_start_stops_them_at_once() -> None:
    """A SIGTERM between two workers' starts left the started ones out of the launcher's cleanup: it exited only once
    multiprocessing's exit had waited for each to start up and fail, printing a FileNotFoundError traceback (its
    queue's semaphore was gone)."""
    launcher = run_launcher("launch_with_sigterm_at_start", "demo", "--steps", "10", "--hidden", "8")
    started = [int(pid) for pid in re.findall(r"^started (\d+)$", launcher.stdout, re.MULTILINE)]
    assert launcher.returncode == 128 + signal.SIGTERM and len(started) == 1, launcher.stdout + launcher.stderr
    assert "Traceback" not in launcher.stderr, launcher.stderr
    assert not _running(started[0])
