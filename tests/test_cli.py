"""The lbbsp command: a coordinator process serves workers, status shows them, errors are clear."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from emulated import worker_clients
from lbbsp import Assignment, JobConfig, WorkerClient
from lbbsp.cli import _policy, build_parser, main
from lbbsp.embedded import ipv6_available
from lbbsp.models import AutoCapacityModel, EWMAThroughput

LBBSP = [sys.executable, "-m", "lbbsp.cli"]


def two_iterations(clients: list[WorkerClient]) -> Assignment:
    """Both workers report iterations 0 and 1 at their agreed sizes, worker 0 three times as fast; the vector of 2."""
    for k in range(2):
        for i, client in enumerate(clients):
            size = client.assignment(k).sizes[i]
            client.report(k, size, size / (100.0 * (1 + 2 * i)))
    return clients[0].assignment(2)


@pytest.mark.timeout(60)
def test_coordinator_process_and_status_table(redis_url: str, job: str) -> None:
    coordinator = subprocess.Popen([*LBBSP, "coordinator", "--redis", redis_url, "--job", job, "--workers", "2",
                                    "--global-batch", "30", "--max-decisions", "2"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    config = JobConfig(job, 2, 30)
    with worker_clients(redis_url, config) as clients:
        assert two_iterations(clients).sizes == (7, 23)
        out, _ = coordinator.communicate(timeout=30)
        assert coordinator.returncode == 0, out
        assert f"coordinating job '{job}'" in out
        status = subprocess.run([*LBBSP, "status", "--redis", redis_url, "--job", job, "--decisions", "2"],
                                capture_output=True, text=True, env={"COLUMNS": "160", "PATH": ""}, timeout=30,
                                check=False)
        assert status.returncode == 0, status.stderr
        assert "rebalanced" in status.stdout or "kept" in status.stdout
        assert " 23 " in status.stdout
        assert "7 23" in status.stdout and "coordinator" in status.stdout  # the decision log, with who wrote it
        rows = [line for line in status.stdout.splitlines() if "kind" in line or " 23 " in line]
        assert "kind" in rows[0] and rows[1].rstrip(" │|").endswith("cpu"), rows  # how the automatic model routes each


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "policy", "third"), [(["--policy", "bsp"], "bsp", (15, 15)),
                                                        (["--model", "ewma"], "lbbsp", (7, 23)),
                                                        (["--max-ahead", "1"], "lbbsp", (7, 23)),
                                                        (["--policy", "per-epoch"], "per-epoch", (15, 15)),
                                                        (["--policy", "per-epoch", "--epoch-iterations", "1"],
                                                         "per-epoch", (7, 23)),
                                                        (["--kind", "1=gpu", "--kind-model", "cpu=ewma"], "lbbsp",
                                                         (7, 23))])
def test_the_coordinator_runs_the_policy_and_model_its_flags_name(redis_url: str, job: str, flags: list[str],
                                                                   policy: str, third: tuple[int, int]) -> None:
    coordinator = subprocess.Popen([*LBBSP, "coordinator", "--redis", redis_url, "--job", job, "--workers", "2",
                                    "--global-batch", "30", "--max-decisions", "2", *flags],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with worker_clients(redis_url, JobConfig(job, 2, 30)) as clients:
        assignment = two_iterations(clients)
        assert (assignment.sizes, assignment.policy) == (third, policy)
        out, _ = coordinator.communicate(timeout=30)
    assert coordinator.returncode == 0 and f"policy {policy}" in out, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("listen", ["127.0.0.1", "::1"])
def test_the_coordinator_serves_workers_on_other_machines_with_listen(job: str, listen: str) -> None:
    if ":" in listen and not ipv6_available():
        pytest.skip("this machine cannot listen on IPv6")
    env = {k: v for k, v in os.environ.items() if k != "LBBSP_REDIS_URL"}
    # stopped by SIGTERM once the workers have their vector, not by --max-decisions: its embedded server goes with
    # it, and the last decision's exit could close it before the test read that decision (one CI run)
    coordinator = subprocess.Popen([*LBBSP, "coordinator", "--listen", listen, "--job", job, "--workers", "2",
                                    "--global-batch", "30"],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert coordinator.stdout is not None
    printed = [coordinator.stdout.readline(), coordinator.stdout.readline()]
    assert printed[1].startswith("workers on other machines: --redis redis://:"), printed
    url = printed[1].split()[-1]
    assert f"@{listen}:" in url or f"@[{listen}]:" in url
    with worker_clients(url, JobConfig(job, 2, 30)) as clients:  # over TCP, with the printed password
        assert two_iterations(clients).sizes == (7, 23)
        coordinator.send_signal(signal.SIGTERM)
        out, _ = coordinator.communicate(timeout=30)
    assert coordinator.returncode == 0 and "(SIGTERM)" in out, "".join(printed) + out
    assert main(["coordinator", "--workers", "2", "--global-batch", "8", "--listen", "0.0.0.0", "--redis",
                 url]) == 2  # --listen is the embedded server's


def test_a_model_for_a_policy_without_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["coordinator", "--workers", "2", "--global-batch", "8", "--policy", "bsp", "--model", "narx"]) == 2
    assert "--policy bsp uses no capacity model" in capsys.readouterr().err
    assert main(["coordinator", "--workers", "2", "--global-batch", "8", "--epoch-iterations", "5"]) == 2
    assert "--epoch-iterations is per-epoch's; --policy lbbsp decides every iteration" in capsys.readouterr().err


def test_local_steps_reach_the_client_model_and_are_refused_where_there_is_none(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The fl-client model was always built with local_steps=1: clients running 5 steps had their compute weighed
    a fifth of what it is against their transfers."""
    job = ["coordinator", "--workers", "4", "--global-batch", "8", "--local-steps", "5"]
    assert _policy(build_parser().parse_args([*job, "--model", "fl-client"])).model.local_steps == 5  # type: ignore[attr-defined]
    for flags in ([], ["--kind-model", "cpu=ewma"]):  # the auto model's client model, also beside other kinds' own
        model = _policy(build_parser().parse_args([*job, *flags])).model  # type: ignore[attr-defined]
        assert model.models["fl"].local_steps == 5
    for flags, error in ((["--model", "narx"], "with --model narx has none"),
                         (["--kind-model", "fl=ewma"], "with --kind-model fl=ewma has none"),
                         (["--policy", "bsp"], "--policy bsp has none"),
                         (["--policy", "per-epoch"], "--policy per-epoch has none")):  # its own average, no model
        assert main([*job, *flags]) == 2
        assert "--local-steps is the fl-client model's" in (err := capsys.readouterr().err) and error in err
    with pytest.raises(SystemExit):  # argparse's own exit, naming the flag
        main([*job[:-1], "0"])
    assert "--local-steps: must be in [1, 1000000], got 0" in capsys.readouterr().err


def test_kind_flags_are_checked_and_build_the_auto_model_they_name(capsys: pytest.CaptureFixture[str]) -> None:
    job = ["coordinator", "--workers", "4", "--global-batch", "8"]
    policy = _policy(build_parser().parse_args([*job, "--kind", "3=gpu", "--kind", "0=fl", "--kind-model", "cpu=ewma",
                                           "--lag", "1"]))
    model = policy.model  # type: ignore[attr-defined]
    assert isinstance(model, AutoCapacityModel) and model.kinds == {3: "gpu", 0: "fl"} and model.horizon == 1
    assert isinstance(model.models["cpu"], EWMAThroughput)  # type: ignore[index]
    per_epoch = _policy(build_parser().parse_args([*job, "--policy", "per-epoch", "--kind", "1=gpu"]))
    assert isinstance(per_epoch.model, AutoCapacityModel)  # type: ignore[attr-defined]
    twice = _policy(build_parser().parse_args([*job, "--kind", "1=gpu", "--kind", "1=gpu"]))
    assert twice.model.kinds == {1: "gpu"}  # type: ignore[attr-defined]
    for flags, error in ((["--kind", "4=gpu"], "--kind: worker(s) [4] outside the job's workers 0..3"),
                         (["--policy", "bsp", "--kind", "1=gpu"], "--kind 1=gpu: only the auto model routes"),
                         (["--model", "narx", "--kind-model", "gpu=ewma"], "with --model narx does not"),
                         # the last of two no longer wins silently; the same value twice is no contradiction
                         (["--kind", "3=gpu", "--kind", "3=cpu"], "--kind 3=gpu and --kind 3=cpu contradict"),
                         (["--kind-model", "cpu=ewma", "--kind", "1=gpu", "--kind-model", "cpu=narx"],
                          "--kind-model cpu=ewma and --kind-model cpu=narx contradict each other: give cpu one")):
        assert main([*job, *flags]) == 2
        assert error in capsys.readouterr().err
    for flag, value in (("--kind", "gpu=1"), ("--kind", "1=GPU"), ("--kind-model", "gpu=auto"),
                        ("--kind-model", "tpu=ewma")):
        with pytest.raises(SystemExit):
            main([*job, flag, value])
        assert f"argument {flag}: expected" in capsys.readouterr().err


@pytest.mark.parametrize("max_ahead", ["0", "1025", "x"])
def test_a_max_ahead_out_of_range_is_refused_before_a_server_starts(max_ahead: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["coordinator", "--workers", "2", "--global-batch", "8", "--max-ahead", max_ahead])
    err = capsys.readouterr().err
    assert "--max-ahead" in err and ("must be in [1, 1024]" in err or "expected a whole number" in err), err


def test_unreachable_redis_is_reported_plainly(tmp_path) -> None:
    result = subprocess.run([*LBBSP, "status", "--redis", f"unix://{tmp_path}/none.sock"], capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 2
    assert "cannot reach Redis" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("url", ["localhost:6379", "http://localhost:6379"])
def test_a_malformed_redis_url_is_reported_plainly(url: str) -> None:
    result = subprocess.run([*LBBSP, "status", "--redis", url], capture_output=True, text=True, timeout=30,
                            check=False)
    assert result.returncode == 2
    assert "not a usable Redis URL" in result.stderr and "Traceback" not in result.stderr


def test_status_of_an_unknown_job_and_the_global_verbose_flag(redis_url: str, job: str) -> None:
    result = subprocess.run([*LBBSP, "status", "--redis", redis_url, "--job", job], capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 2 and f"no job '{job}'" in result.stderr
    verbose = subprocess.run([*LBBSP, "-v", "simulate", "--help"], capture_output=True, text=True, timeout=60,
                             check=False)
    assert verbose.returncode == 0 and "--scenario" in verbose.stdout


def test_the_demos_progress_line_shows_one_step_of_every_worker() -> None:
    from lbbsp.integrations.demo import DemoConfig, _View  # noqa: PLC0415  (imports torch)

    view = _View(DemoConfig(steps=20), cores=[0, 1])
    events = [("step", "LB-BSP", 1, 1, 200, 0.02, False), ("step", "LB-BSP", 1, 2, 150, 0.02, False),
              ("step", "LB-BSP", 0, 1, 312, 0.02, True), ("step", "LB-BSP", 0, 2, 362, 0.02, True)]
    lines = []
    for event in events:
        view.update(event)
        if (line := view.progress_line(event)) is not None:
            lines.append(line)
    assert len(lines) == 1 and "step    2/20" in lines[0] and "load ON" in lines[0]
    assert "w0: 312" in lines[0] and "w1: 200" in lines[0]  # step 2 of both workers: 312 + 200 = 512


def test_help_shows_each_flags_default_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "number of simulated workers, at most 100,000" in text and "4 on mixed (default: 16)" in text
    assert "(default: 0)" in text
    assert "(default: None)" not in text and text.count("experiments/results") == 1


def test_ctrl_c_is_a_short_message_not_a_traceback(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C in a long simulate printed a KeyboardInterrupt traceback."""
    from lbbsp.sim import cli as sim_cli  # noqa: PLC0415

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(sim_cli, "run", interrupted)
    try:
        code = main(["simulate", "--scenario", "gpu-mix"])
    except KeyboardInterrupt:  # escaping, it would stop the whole test session
        pytest.fail("Ctrl-C escaped lbbsp's main as a KeyboardInterrupt")
    assert code == 130
    assert capsys.readouterr().err.strip() == "lbbsp: interrupted"
