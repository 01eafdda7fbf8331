"""The public core as a user calls it directly, with the mistakes a new user makes: each is an error that names
the argument (and what to pass) at the call, not a bare TypeError from deep inside or a job that silently
degrades to the equal split."""
from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lbbsp import (
    AllocationError,
    Assignment,
    BSPPolicy,
    ConfigError,
    Coordinator,
    CoordinatorProcess,
    EWMAThroughput,
    GlobalBatchSampler,
    JobConfig,
    LBBSPPolicy,
    LinearTime,
    ProtocolError,
    Report,
    ResourceMonitor,
    Store,
    StoreUnavailable,
    WorkerClient,
    allocate,
    equal_split,
    scale_split,
)
from lbbsp.cli import main
from lbbsp.models import AutoCapacityModel, NARXThroughput


def test_an_assignment_gives_offsets_of_its_own_workers_only() -> None:
    assignment = Assignment("j", 0, (3, 5), "p")
    assert [assignment.offset(w) for w in (0, 1, np.int64(1))] == [0, 3, 3]
    for worker in (2, -1, 1.5, "a", True):
        with pytest.raises(ProtocolError, match=r"worker: .*\[0, 1\]"):
            assignment.offset(worker)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="sizes: must be a sequence"):
        Assignment("j", 0, None, "p")  # type: ignore[arg-type]


def test_the_equal_split_checks_its_arguments() -> None:
    assert equal_split(9, 2) == (5, 4) and equal_split(np.int64(3), np.int64(3)) == (1, 1, 1)
    for batch, workers, name in ((8, 0, "num_workers"), (8, -2, "num_workers"), (-8, 2, "global_batch"),
                                 (8.5, 2, "global_batch"), ("8", 2, "global_batch")):
        with pytest.raises(ConfigError, match=name):
            equal_split(batch, workers)  # type: ignore[arg-type]


def test_linear_time_takes_lists_and_refuses_negative_or_misshapen_speeds() -> None:
    assert allocate(LinearTime([1, 2]), 9, [0, 0], [9, 9]).tolist() == [3, 6]  # a list, as the docs' signature reads
    with pytest.raises(ConfigError, match="speed must be one number >= 0"):
        LinearTime(np.array([1.0, -2.0]))
    with pytest.raises(ConfigError, match="speed"):
        LinearTime(np.array([1.0, np.nan]))
    with pytest.raises(ConfigError, match="overhead must be"):
        LinearTime([1.0, 2.0], overhead=-1.0)
    with pytest.raises(ConfigError, match="overhead must be"):
        LinearTime([1.0, 2.0], overhead=[0.1, 0.2, 0.3])
    with pytest.raises(AllocationError, match="sizes of 2 workers"):
        allocate(LinearTime([1.0, 2.0, 3.0]), 8, [0, 0], [8, 8])
    with pytest.raises(AllocationError, match="must have a method time"):
        allocate(None, 8, [0, 0], [8, 8])  # type: ignore[arg-type]

    class Short:
        def time(self, sizes: np.ndarray) -> np.ndarray:
            return np.ones(1)

    with pytest.raises(AllocationError, match="gave 1 times for 2 workers"):
        allocate(Short(), 8, [0, 0], [8, 8])


def test_sizes_must_be_a_sequence_and_an_assignment_is_named() -> None:
    sampler = GlobalBatchSampler(100, 8)
    with pytest.raises(ConfigError, match=r"got Assignment: pass the assignment's \.sizes"):
        sampler.worker_indices(0, Assignment("j", 0, (4, 4), "p"), 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="got NoneType"):
        sampler.split_for(0, None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="got NoneType"):
        scale_split(None, 2)  # type: ignore[arg-type]
    for payload in (None, 5):
        with pytest.raises(ProtocolError, match="payload: report must be JSON as bytes or str"):
            Report.from_json(payload)  # type: ignore[arg-type]


def test_a_job_config_refuses_a_ttl_below_its_timeout_and_a_timeout_no_decision_can_meet() -> None:
    with pytest.raises(ConfigError, match=r"ttl_s \(10\) must be at least assignment_timeout_s \(100\)"):
        JobConfig("j", 2, 8, ttl_s=10, assignment_timeout_s=100)
    with pytest.raises(ConfigError, match=r"assignment_timeout_s must be a number of seconds in \[0.001"):
        JobConfig("j", 2, 8, assignment_timeout_s=1e-9)
    assert JobConfig("j", 2, 8, ttl_s=10, assignment_timeout_s=10).ttl_s == 10


def test_a_model_with_a_bad_parameter_fails_where_the_policy_is_made() -> None:
    """EWMAThroughput(alpha=5) had been accepted: every decision of the running job then failed, was logged, and
    kept the equal split, so the job ran as plain BSP."""
    with pytest.raises(ConfigError, match="alpha"):
        LBBSPPolicy(EWMAThroughput(alpha=5))


def test_a_model_nested_in_the_auto_model_is_checked_where_the_policy_is_made() -> None:
    """It had been checked at its kind's first report: then every decision of the running job failed."""
    with pytest.raises(ConfigError, match=r"models\['gpu'\]: alpha must be in \(0, 1\], got 5"):
        LBBSPPolicy(AutoCapacityModel(models={"gpu": EWMAThroughput(alpha=5)}))


def test_a_coordinator_refuses_kinds_pinned_outside_the_job_and_warns_of_a_horizon_not_its_lag(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    config = JobConfig(job, 4, 64, lag=1)
    with Store.from_url(redis_url, job) as store:
        with pytest.raises(ConfigError, match=r"kinds pin worker\(s\) \[4, 99\], outside the job's workers 0..3"):
            Coordinator(store, config, LBBSPPolicy(AutoCapacityModel(kinds={0: "gpu", 4: "gpu", 99: "cpu"}, horizon=1)))
        with pytest.raises(ConfigError, match="outside the job's workers"):  # before a child process is spawned
            CoordinatorProcess(redis_url, config, LBBSPPolicy(AutoCapacityModel(kinds={4: "gpu"}, horizon=1)))
        with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
            Coordinator(store, config, LBBSPPolicy(AutoCapacityModel(kinds={3: "gpu"}, horizon=1)))
            assert not caplog.records
            Coordinator(store, config, LBBSPPolicy(NARXThroughput()))
        assert "forecasts 2 iteration(s) ahead (horizon=2), but each split is decided 1 ahead (lag=1): give it " \
               "horizon=1" in caplog.text


def test_a_coordinator_refuses_a_policy_that_is_not_a_policy_instance(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8)
    with Store.from_url(redis_url, job) as store:
        with pytest.raises(ConfigError, match=r"got the class LBBSPPolicy: pass LBBSPPolicy\(\)"):
            Coordinator(store, config, LBBSPPolicy)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="a name such as 'lbbsp'"):
            Coordinator(store, config, "lbbsp")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="Policy instance"):  # before a child process is spawned
            CoordinatorProcess(redis_url, config, "x")  # type: ignore[arg-type]
        coordinator = Coordinator(store, config, BSPPolicy())
        with pytest.raises(ConfigError, match="timeout_s"):
            coordinator.step(timeout_s=-1)
        with pytest.raises(ConfigError, match="max_decisions"):
            coordinator.run(max_decisions=-1)


def test_a_worker_client_checks_what_it_is_given(redis_url: str, job: str) -> None:
    config = JobConfig(job, 2, 8)
    with Store.from_url(redis_url, job) as store:
        with pytest.raises(ConfigError, match=r"store must be a Store \(for a URL: Store.from_url"):
            WorkerClient(redis_url, config, 0)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="config must be a JobConfig"):
            WorkerClient(store, {"job": job}, 0)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="agree must be None or a function"):
            WorkerClient(store, config, 0, agree="x")  # type: ignore[arg-type]
        for device in (123, "x" * 100):
            with pytest.raises(ConfigError, match="device must be a string of at most 64"):
                WorkerClient(store, config, 0, device=device)  # type: ignore[arg-type]


def test_a_store_refuses_reports_and_assignments_that_are_not_its_jobs(redis_url: str, job: str) -> None:
    with pytest.raises(ConfigError, match="job name"):
        Store.from_url(redis_url, "a b")
    with pytest.raises(ConfigError, match="job name"):
        Store.from_url(redis_url, None)  # type: ignore[arg-type]
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 8))
        with pytest.raises(ProtocolError, match="worker: worker 5 is not one of the job's 2 workers"):
            store.post_report(Report(job, 5, 0, 4, 0.1), 2)
        with pytest.raises(ProtocolError, match="job: report of job 'other'"):
            store.post_report(Report("other", 0, 0, 4, 0.1), 2)
        for workers in (0, -1):
            with pytest.raises(ConfigError, match="num_workers"):
                store.post_report(Report(job, 0, 0, 4, 0.1), workers)
        assert store.report_count(0) == 0
        with pytest.raises(ProtocolError, match="job: assignment of job 'other'"):
            store.publish(Assignment("other", 3, (4, 4), "p"))
        assert store.get_assignment(3) is None  # nothing written, for good, under this job's key
        assert store.post_report(Report(job, 1, 0, 4, 0.1), 2)


def test_a_resource_monitor_checks_its_gpu_index_and_says_when_it_cannot_read_the_gpu(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    for index in (-1, "a", 1.0, True):
        with pytest.raises(ConfigError, match="gpu_index"):
            ResourceMonitor(gpu_index=index)  # type: ignore[arg-type]
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # as where nvidia-ml-py is not installed
    with caplog.at_level(logging.WARNING, logger="lbbsp.telemetry"):
        features = ResourceMonitor(gpu_index=0).sample()
    assert "gpu_mem_used" not in features and "cpu_util" in features
    assert "pynvml is not installed (pip install 'lbbsp[gpu]'" in caplog.text


@pytest.mark.parametrize(("argv", "says"), [
    (["coordinator", "--workers", "0", "--global-batch", "8"], "argument --workers: must be at least 1"),
    (["coordinator", "--workers", "2", "--global-batch", "8", "--timeout", "-1"], "argument --timeout"),
    (["coordinator", "--workers", "2", "--global-batch", "8", "--ttl", "5"], "argument --ttl: must be at least 10"),
    (["coordinator", "--workers", "2", "--global-batch", "8", "--ttl", "10", "--timeout", "20"],
     r"--ttl \(10\) must be at least --timeout \(20\)"),
    (["coordinator", "--workers", "2", "--global-batch", "8", "--job", "a b"], "--job must match"),
    (["demo", "--steps", "5"], "argument --steps: must be at least 10"),
    (["demo", "--load-procs", "-1"], "argument --load-procs: must be at least 0"),
])
def test_the_command_line_names_the_flag_that_is_wrong(argv: list[str], says: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(says, err), err
    assert "num_workers" not in err and "assignment_timeout_s" not in err and "ttl_s" not in err


def test_verbose_is_taken_after_the_subcommand_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["coordinator", "-v", "--workers", "0", "--global-batch", "8"])
    assert exc.value.code == 2 and "unrecognized arguments" not in capsys.readouterr().err


def test_status_of_a_job_whose_key_holds_another_type_names_the_key(redis_url: str, job: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with Store.from_url(redis_url, job) as store:
        store.client.rpush(store.key("config"), "x")
        try:
            assert main(["status", "--redis", redis_url, "--job", job]) == 2
        finally:
            store.forget()
    err = capsys.readouterr().err
    assert f"Redis key lbbsp:{job}:config holds a value of another type" in err, err


def test_the_framework_free_example_splits_unevenly_and_matches_single_process_sgd() -> None:
    """examples/core_loop.py, the loop docs/core.md shows, run whole: two real worker processes, an embedded
    redis-server and a coordinator process; the launcher sums the workers' gradients as an all-reduce would. A global
    batch of 100 leaves each epoch a short final batch of 48 (its reference had crashed on one)."""
    example = Path(__file__).resolve().parents[1] / "examples" / "core_loop.py"
    done = subprocess.run([sys.executable, str(example), "--epochs", "2", "--global-batch", "100"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "matches single-process SGD" in done.stdout
    splits = [tuple(map(int, m)) for m in re.findall(r"split \((\d+), (\d+)\)", done.stdout)]
    assert splits[0] == (50, 50) and splits[-1][0] > splits[-1][1]  # the slower worker 1 ends with fewer samples


def test_a_url_that_reaches_another_service_is_store_unavailable_naming_it() -> None:
    """An HTTP server on the port had given 30 lines of redis-py traceback ending in InvalidResponse, on every rank."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def answer_as_http() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"<html>not redis</html>\r\n")

        threading.Thread(target=answer_as_http, daemon=True).start()
        with Store.from_url(f"redis://127.0.0.1:{port}/0", "j") as store, \
                pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port} does not answer as Redis does.*check redis="):
            store.ping(hint="check redis= or $LBBSP_REDIS_URL")


def test_status_says_whether_a_coordinator_serves_the_job(redis_url: str, job: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A coordinator killed for good had left `lbbsp status` showing the last decision and nothing else."""
    with Store.from_url(redis_url, job) as store:
        coordinator = Coordinator(store, JobConfig(job, 2, 8), BSPPolicy()).start()
        try:
            deadline = time.monotonic() + 10
            while store.coordinator() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert main(["status", "--redis", redis_url, "--job", job]) == 0
            assert f"job {job}: served by the coordinator {store.coordinator()}" in capsys.readouterr().out
        finally:
            coordinator.stop()
        assert store.coordinator() is None  # a coordinator that stops releases its claim
        assert main(["status", "--redis", redis_url, "--job", job]) == 0
        assert f"job {job}: no coordinator serves it" in capsys.readouterr().out
        store.forget()
