"""Who coordinates a job: a coordinator that outlives its run, two at once, one paused while another takes over."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

import lbbsp.coordinator
from lbbsp import Assignment, BSPPolicy, Coordinator, JobConfig, Store, WorkerClient
from lbbsp.policies import Decision


class SlowBSP(BSPPolicy):
    """BSP that takes ``delay_s`` per decision: slower than the workers' steps, so the coordinator runs ahead."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        time.sleep(self.delay_s)
        return super().decide(iteration, current, config)


def train(url: str, config: JobConfig, iterations: range, step_s: float = 0.002,
          hook: Callable[[int], None] | None = None) -> list[list[Assignment]]:
    """Every worker of ``config`` in a thread of its own, fetching, 'computing' and reporting ``iterations`` (worker 0
    calls ``hook`` before each); the vectors each used, by worker, the same for all. No thread may hang."""
    used: list[list[Assignment]] = [[] for _ in range(config.num_workers)]

    def work(worker: int) -> None:
        with Store.from_url(url, config.job) as store, WorkerClient(store, config, worker) as client:
            for k in iterations:
                if hook is not None and worker == 0:
                    hook(k)
                assignment = client.assignment(k)
                used[worker].append(assignment)
                time.sleep(step_s)
                client.report(k, assignment.sizes[worker], step_s)
            client.flush()

    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in range(config.num_workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(len(iterations) * (config.assignment_timeout_s + 0.5))
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    assert all(len(vectors) == len(iterations) for vectors in used)
    assert all(vectors == used[0] for vectors in used), "two workers used different vectors for one iteration"
    return used


@pytest.mark.timeout(120)
def test_a_coordinator_that_outlives_its_run_serves_the_next_run_under_the_name_as_it_did_the_first(
        redis_url: str, job: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An `lbbsp coordinator` left serving a job name that a new run (or one resumed from an early checkpoint)
    reuses: it had kept the iterations it wrote and deleted in the first run, so in the second each decision wrote
    only its own iteration (no running ahead: the workers waited for every decision, twice as long) and deleted no
    old iteration's keys until the run passed the first one's last iteration."""
    monkeypatch.setattr(lbbsp.coordinator, "ITERATIONS_KEPT", 20)  # so that two short runs show it
    config = JobConfig(job, 2, 20, assignment_timeout_s=0.3, lag=2)
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, config, SlowBSP(0.02)).start()
        try:
            train(redis_url, config, range(80))  # its last 20 iterations' keys stay, above the next run's
            time.sleep(0.2)  # its last decisions, from the reports of the last iterations
            started = time.time()
            with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
                train(redis_url, config, range(45))
        finally:
            coordinator.stop()
        second = [d for d in map(json.loads, store.decisions(100)) if d["time"] >= started]
        assert any(d["through"] > d["iteration"] for d in second), "the second run's decisions never ran ahead"
        assert not store.client.exists(store.key("reports", 5)), "the second run's old reports were not deleted"
    assert re.search(f"job {job}: the workers' iterations went back from 7[0-9] to [0-9] .*a new run under this job "
                     "name", caplog.text)


def serve_cli(url: str, config: JobConfig, log_path: Path, kept: int) -> subprocess.Popen[bytes]:
    """`lbbsp coordinator` for ``config`` in a process of its own, keeping ``kept`` iterations' keys, its log in
    ``log_path``; once it has claimed the job."""
    flags = ["coordinator", "--redis", url, "--job", config.job, "--workers", str(config.num_workers), "--global-batch",
             str(config.global_batch), "--timeout", str(config.assignment_timeout_s), "--ttl", str(config.ttl_s)]
    code = f"import lbbsp.coordinator, lbbsp.cli; lbbsp.coordinator.ITERATIONS_KEPT = {kept}; lbbsp.cli.main({flags!r})"
    with log_path.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)
    return process


@pytest.mark.timeout(120)
def test_a_coordinator_paused_while_another_took_over_keeps_one_split_and_both_say_what_happened(
        redis_url: str, job: str, tmp_path: Path) -> None:
    """`lbbsp coordinator` stopped (SIGSTOP) past the workers' timeout: they fall back; a second one started meanwhile
    decides on, and deletes old iterations' keys; the first, continued (SIGCONT), had taken an iteration off the ready
    list while stopped. Every worker uses one vector per iteration, each coordinator names the other, and the first
    does not say that no worker ran the iteration it held: they had, and its keys had gone meanwhile (it had said so
    in about one run in two, and had named no other coordinator in one in three)."""
    config = JobConfig(job, 3, 60, assignment_timeout_s=0.3, ttl_s=10)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    coordinators = [serve_cli(redis_url, config, logs[0], kept=10)]
    with Store.from_url(redis_url, job) as store:
        try:
            deadline = time.monotonic() + 60
            while store.coordinator() is None and time.monotonic() < deadline:
                time.sleep(0.05)

            def hook(k: int) -> None:
                if k == 10:
                    coordinators[0].send_signal(signal.SIGSTOP)
                elif k == 15:
                    coordinators.append(serve_cli(redis_url, config, logs[1], kept=10))
                elif k == 70:
                    coordinators[0].send_signal(signal.SIGCONT)

            used = train(redis_url, config, range(100), hook=hook)[0]
            time.sleep(3.0)  # each heartbeat, once a second, finds the other's claim; the second time it warns
        finally:
            for process in coordinators:
                process.send_signal(signal.SIGCONT)
                process.terminate()
                process.wait(10)
    assert sum(a.fallback for a in used) >= 5, "the workers did not fall back while no coordinator served them"
    first, second = (path.read_text() for path in logs)
    assert f":{coordinators[1].pid}:" in first and f":{coordinators[0].pid}:" in second, (first, second)
    assert f"is serving job {job} too" in first and "no worker ran" not in first, first


def test_a_coordinator_whose_heartbeats_come_at_half_the_others_rate_is_warned_about(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """The other's claim, found again at any later heartbeat, is a live coordinator's, not only at the next one: a
    coordinator busy deciding heartbeats less often, and found at every other heartbeat (its own claim between)
    had never been warned about."""
    config = JobConfig(job, 2, 10)
    with Store.from_url(redis_url, job) as store:
        fast, slow = Coordinator(store, config), Coordinator(store, config)
        with caplog.at_level("WARNING", logger="lbbsp.coordinator"):
            for beats in (slow, fast, fast, slow, fast, fast, slow, fast):
                beats._next_heartbeat = 0.0
                beats._heartbeat()
        assert caplog.text.count(f"another coordinator ({slow._identity}) is serving job {job} too") == 1


CHILD_LOGS = """
import logging, sys
from lbbsp import CoordinatorProcess, JobConfig, LBBSPPolicy
from lbbsp.models import NARXThroughput
logging.basicConfig(format="PARENT-FORMAT %(levelname)s %(name)s: %(message)s", level=logging.INFO)
if __name__ == "__main__":
    process = CoordinatorProcess(sys.argv[1], JobConfig(sys.argv[2], 2, 10, lag=2), LBBSPPolicy(NARXThroughput(horizon=1)))
    process.stop()
"""


@pytest.mark.timeout(120)
def test_the_coordinator_process_logs_as_its_parent_does(redis_url: str, job: str, tmp_path: Path) -> None:
    """The child, spawned, started with no logging: its warning about the model's horizon came bare (Python's last
    resort), not in the format the training script had set, and its INFO lines not at all."""
    script = tmp_path / "train.py"
    script.write_text(CHILD_LOGS)
    done = subprocess.run([sys.executable, str(script), redis_url, job], capture_output=True, text=True, timeout=100,
                          check=True)
    assert re.search(r"^PARENT-FORMAT WARNING lbbsp\.coordinator: job \S+: the model forecasts 1 iteration", done.stderr,
                     re.MULTILINE), done.stderr
