"""The lbbsp command in general, `lbbsp coordinator` and `lbbsp forget`: a coordinator process serves workers and
status shows them; flags are checked and a wrong one named; signals stop a coordinator cleanly; a second coordinator
of a served job is refused; a finished job's keys are forgotten on demand; errors are clear, and output into a
reader gone ends quietly."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

import lbbsp
from emulated import worker_clients
from lbbsp import (
    Assignment,
    BSPPolicy,
    Coordinator,
    EmbeddedRedis,
    EWMAThroughput,
    JobConfig,
    Store,
    WorkerClient,
)
from lbbsp.cli import (
    STOP_GRACE_S,
    _model_said,
    _policy,
    _redis_flag,
    _setting,
    _StopSignals,
    batch_caps,
    build_parser,
    main,
)
from lbbsp.embedded import ipv6_available
from lbbsp.models import AutoCapacityModel
from lbbsp.store import UNKNOWN_CLAIM, redacted

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
                                                        (["--model", "time-weighted"], "lbbsp", (7, 23)),
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


def test_a_bad_job_name_is_quoted_as_typed_and_cut(capsys: pytest.CaptureFixture[str]) -> None:
    """The flags replaced the settings' names inside the value too: --job 'lag x' was quoted as '--lag x'; and a
    name of 100,000 characters was echoed whole."""
    assert main(["coordinator", "--workers", "2", "--global-batch", "8", "--job", "lag x"]) == 2
    assert capsys.readouterr().err.strip().endswith("--job must match [A-Za-z0-9_.-]{1,128}, got 'lag x'")
    assert main(["coordinator", "--workers", "2", "--global-batch", "8", "--job", "lag " + "x" * 100_000]) == 2
    said = capsys.readouterr().err
    assert len(said) < 250 and "got 'lag xxx" in said and "--lag" not in said


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


@pytest.mark.parametrize(("argv", "says"), [
    (["coordinator", "--workers", "0", "--global-batch", "8"], "argument --workers: must be at least 1"),
    (["coordinator", "--workers", "2", "--global-batch", "8", "--timeout", "-1"], "argument --timeout"),
    (["coordinator", "--workers", "2", "--global-batch", "8", "--timeout", "ten"],
     "argument --timeout: expected a number of seconds, got 'ten'"),
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


@pytest.mark.parametrize("argv", [["coordinator", "--workers", "2", "--global-batch", "8", "--max-decisions", "-1"],
                                  ["coordinator", "--workers", "2", "--global-batch", "8", "--max-decisions", "0"],
                                  ["status", "--redis", "unix:///nowhere.sock", "--decisions", "-3"]])
def test_a_negative_count_is_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """--max-decisions -1 started a coordinator (and an embedded Redis) that exited at once with status 0, and
    --decisions -3 was taken as 1."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "must be at least" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "value"), [(["--kind", "-1=gpu"], "-1=gpu"), (["--kind=-1=gpu"], "-1=gpu"),
                                              (["--kind", "\u0661=gpu"], "\u0661=gpu"),
                                              (["--kind", "\u00b2=gpu"], "\u00b2=gpu")])
def test_a_bad_worker_of_kind_gets_the_flags_own_message(given: list[str], value: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`--kind -1=gpu` got argparse's "expected one argument" (it took -1=gpu for an option), where `--kind=-1=gpu`
    said what WORKER=KIND takes. A digit that is not ASCII was taken as a worker id (an Arabic-Indic one as worker 1) or
    got "invalid kind_pin value" (a superscript, which int refuses)."""
    with pytest.raises(SystemExit):
        main(["coordinator", "--workers", "2", "--global-batch", "8", *given])
    err = capsys.readouterr().err
    assert "argument --kind: expected WORKER=KIND with WORKER a worker id (0 and up)" in err and repr(value) in err, err


def test_joining_kinds_values_leaves_the_other_flags_as_they_were(capsys: pytest.CaptureFixture[str]) -> None:
    """Only a value of --kind that starts as a negative number is joined: a flag after --kind is still a flag, and
    another flag's negative number is still that flag's."""
    for flags, error in ((["--kind", "--verbose"], "argument --kind: expected one argument"),
                         (["--max-decisions", "-1"], "argument --max-decisions: must be at least 1, got -1")):
        with pytest.raises(SystemExit):
            main(["coordinator", "--workers", "2", "--global-batch", "8", *flags])
        assert error in capsys.readouterr().err


#: A coordinator whose final clean-up (closing its embedded server) gets a SIGTERM, 0.3 s after the first: later
#: than the repeat of one stop (_SAME_SIGNAL_S), sent by the process itself so that it comes exactly there.
_LATE_SIGTERM = textwrap.dedent("""
    import os, signal, sys, time
    from lbbsp.cli import main
    from lbbsp.embedded import EmbeddedRedis

    close = EmbeddedRedis.close

    def late_sigterm(self):
        print("closing", self.directory, flush=True)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)
        close(self)

    EmbeddedRedis.close = late_sigterm
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.timeout(60)
def test_a_sigterm_during_the_final_exit_ends_the_coordinator_as_the_first_did(job: str) -> None:
    """A second SIGTERM after the stop signals' handlers were put back, as the command closed its embedded server,
    killed it: -15, and the server's files left behind (its claim on the job was released by then)."""
    env = {k: v for k, v in os.environ.items() if k != "LBBSP_REDIS_URL"}
    coordinator = subprocess.Popen([sys.executable, "-c", _LATE_SIGTERM, "coordinator", "--job", job, "--workers",
                                    "2", "--global-batch", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env)
    try:
        assert coordinator.stdout is not None
        started = coordinator.stdout.readline()
        assert started.startswith("started an embedded redis-server"), started
        serving = coordinator.stdout.readline()
        assert serving.startswith(f"coordinating job '{job}'"), serving
        coordinator.send_signal(signal.SIGTERM)
        out, err = coordinator.communicate(timeout=30)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 0, (out, err)  # as a SIGTERM alone ends it
    closing, stopped = out.splitlines()
    assert f"stopped serving job '{job}' after 0 decisions (SIGTERM)" in stopped and "Traceback" not in err, err
    assert not Path(closing.split(maxsplit=1)[1]).exists()  # the embedded server's directory is gone


def _reset_signals() -> None:
    """In the child: SIGINT and SIGHUP at their defaults, whatever the test runner had (nohup ignores SIGHUP)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _serving(url: str, job: str, preexec: Callable[[], object] = _reset_signals) -> subprocess.Popen[str]:
    """An `lbbsp coordinator` of ``job`` on ``url``, returned once it has claimed the job."""
    process = subprocess.Popen([*LBBSP, "coordinator", "--redis", url, "--job", job, "--workers", "2",
                                "--global-batch", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=preexec)  # noqa: PLW1509  (signals as a service manager sets them)
    with Store.from_url(url, job) as store:
        deadline = time.monotonic() + 20
        while store.coordinator() is None:
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
    return process


def _pause(server: EmbeddedRedis, sig: signal.Signals = signal.SIGSTOP) -> None:
    """Stop the redis-server process (SIGSTOP: it stops answering, as a partitioned one does), or continue it."""
    assert server.pid is not None
    os.kill(server.pid, sig)




def _ended(process: subprocess.Popen[str], within_s: float) -> tuple[str, str, float]:
    """Its stdout, stderr and the seconds it took to exit; killed, and the test failed, if it takes longer."""
    started = time.monotonic()
    try:
        out, err = process.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"still running {within_s}s after it was stopped")
    return out, err, time.monotonic() - started


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_stops_the_coordinator_cleanly_says_so_and_releases_its_claim(redis_url: str, job: str,
                                                                              sig: signal.Signals) -> None:
    """SIGHUP (a closed terminal, systemd's reload) killed it: exit -1, its claim left for 5 s, not a word. SIGTERM and
    SIGINT stopped it with code 0 and no line in the log: a stop and a crash read the same."""
    coordinator = _serving(redis_url, job)
    try:
        coordinator.send_signal(sig)
        out, err, _ = _ended(coordinator, 10)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 0, err
    assert f"stopped serving job '{job}' after 0 decisions ({sig.name})" in out, out + err
    assert "Traceback" not in err, err
    with Store.from_url(redis_url, job) as store:
        assert store.coordinator() is None  # a replacement is not taken for a second coordinator
        store.forget()


@pytest.mark.timeout(60)
def test_a_sigterm_as_soon_as_it_says_it_serves_is_a_clean_stop_too(redis_url: str, job: str) -> None:
    """The handler came after the "coordinating job" line and the heap's freeze: a SIGTERM at that line killed it
    (-15, no word), and as a container's PID 1, which the kernel spares signals it has no handler for, was ignored."""
    coordinator = subprocess.Popen([*LBBSP, "coordinator", "--redis", redis_url, "--job", job, "--workers", "2",
                                    "--global-batch", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert coordinator.stdout is not None
        assert coordinator.stdout.readline().startswith(f"coordinating job '{job}'")
        coordinator.terminate()
        out, err, _ = _ended(coordinator, 10)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 0 and f"stopped serving job '{job}'" in out, err
    with Store.from_url(redis_url, job) as store:
        store.forget()


@pytest.mark.timeout(60)
def test_under_nohup_sighup_leaves_the_coordinator_serving(redis_url: str, job: str) -> None:
    """The fix above must not undo nohup, which ignores SIGHUP so that a closed terminal leaves the command running."""
    coordinator = _serving(redis_url, job, preexec=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        coordinator.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert coordinator.poll() is None
        coordinator.terminate()
        out, _, _ = _ended(coordinator, 10)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 0 and "(SIGTERM)" in out, out
    with Store.from_url(redis_url, job) as store:
        store.forget()


@pytest.mark.timeout(60)
def test_a_stop_while_redis_does_not_answer_ends_within_seconds(stalled_redis: EmbeddedRedis, job: str) -> None:
    """With Redis stalled (a partition, a paused server), SIGTERM took 29 s to end the coordinator (a 5 s socket
    timeout, three tries, for its step and each call of its clean-up): docker stop kills at 10 s."""
    coordinator = _serving(stalled_redis.url, job)
    try:
        _pause(stalled_redis)
        coordinator.terminate()
        _, err, took = _ended(coordinator, 8)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 128 + signal.SIGTERM, err
    assert took < 6, took  # 3 s of grace; it had taken 29
    assert f"job '{job}': stopped 3 s after SIGTERM, without releasing the coordinator's claim" in err, err


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_ends_a_stopping_coordinator_at_once(stalled_redis: EmbeddedRedis, job: str) -> None:
    """A second Ctrl-C while the clean-up waited on a stalled Redis ended it with code 0 and no word, as if it had
    stopped cleanly."""
    coordinator = _serving(stalled_redis.url, job)
    try:
        _pause(stalled_redis)
        coordinator.send_signal(signal.SIGINT)
        time.sleep(0.5)
        coordinator.send_signal(signal.SIGINT)
        _, err, took = _ended(coordinator, 8)
    finally:
        coordinator.kill()
    assert coordinator.returncode == 128 + signal.SIGINT, err
    assert took < 1.5, took
    assert f"job '{job}': stopped at a second SIGINT" in err and "Traceback" not in err, err


SERVING = "host.example:4242:abcd"  # the identity a live coordinator claims the job with (host:pid:tag)


def _finished(url: str, job: str, workers: int = 2) -> None:
    """What a finished run of ``job`` leaves in Redis: its settings and a decision, with no coordinator's claim."""
    with Store.from_url(url, job) as store:
        store.register(JobConfig(job, workers, 30))
        store.record_decision('{"iteration": 0, "sizes": [15, 15], "policy": "lbbsp", "written_by_coordinator": true, '
                              '"reason": "kept", "rejected": []}')


def _keys(url: str, job: str) -> list[bytes]:
    with Store.from_url(url, job) as store:
        return list(set(store.client.scan_iter(match=f"lbbsp:{job}:*")))  # SCAN may give a key twice (a resize)


def test_forget_deletes_a_finished_jobs_keys_so_a_rerun_with_other_settings_starts(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun of a finished job with other settings failed until its keys expired (ttl_s, an hour by default), and
    the way out was to delete them by hand with redis-cli; the error said nothing of why nor how."""
    _finished(redis_url, job)
    rerun = ["coordinator", "--redis", redis_url, "--job", job, "--workers", "3", "--global-batch", "30"]
    assert main(rerun) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    # the command to run names the Redis typed after --redis: `lbbsp forget --job J` alone had no Redis to read
    assert err == (f"lbbsp: error: job {job!r} was started with --workers 2 (not 3); its keys are left by an earlier "
                   f"run, whose coordinator has stopped: `lbbsp forget --job {job} --redis {redacted(redis_url)}` "
                   "clears them once that run is over, or use another job name\n"), err
    monkeypatch.setenv("LBBSP_REDIS_URL", redis_url)  # found as `lbbsp status` and `lbbsp coordinator` find it
    assert main(rerun[:1] + rerun[3:]) == 2  # the variable's URL: read again by forget, so not repeated
    assert f"`lbbsp forget --job {job}` clears them" in capsys.readouterr().err
    assert main(["forget", "--job", job]) == 0
    assert capsys.readouterr().out == f"forgot job {job!r}: deleted its 2 keys from this Redis\n"
    assert _keys(redis_url, job) == []
    assert main(["forget", "--job", job]) == 0  # nothing left: said so, and no error (the state asked for is there)
    out = capsys.readouterr().out
    assert out.startswith(f"no job {job!r} on this Redis (it never started, or its keys expired)"), out


@pytest.mark.timeout(60)
def test_a_job_with_a_cap_per_worker_is_served_with_the_caps_comma_separated(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """JobConfig(max_batch=(20, 12)) could not be served by the command: --max-batch took one whole number, and the
    mismatch error asked for "--max-batch (20, 12)", which it refused. The faster worker 1 is held at its cap."""
    config = JobConfig(job, 2, 30, max_batch=(20, 12))
    with worker_clients(redis_url, config) as clients:
        assert main(["coordinator", "--redis", redis_url, "--job", job, "--workers", "2", "--global-batch", "30",
                     "--max-batch", "20"]) == 2
        assert "already runs with --max-batch 20,12 (not 20)" in capsys.readouterr().err
        coordinator = subprocess.Popen([*LBBSP, "coordinator", "--redis", redis_url, "--job", job, "--workers", "2",
                                        "--global-batch", "30", "--max-decisions", "2", "--max-batch", "20, 12"],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert two_iterations(clients).sizes == (18, 12)
        out, _ = coordinator.communicate(timeout=30)
    assert coordinator.returncode == 0, out


def test_max_batch_takes_one_cap_or_one_per_worker_and_names_a_bad_list() -> None:
    """A one-worker job's caps (40,) had been shown as "40", which parses to the cap of every worker: the mismatch
    error named a value that could not match; an empty part had said "expected a whole number, got ''"."""
    assert [batch_caps(text) for text in ("48", "48,16", " 20, 12 ", "40,")] == [48, (48, 16), (20, 12), (40,)]
    assert _setting((40,)) == "40," and _setting((20, 12)) == "20,12"
    for text in ("1,,2", ",", "", "x", "1,-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected one cap|expected a whole number|at least 0"):
            batch_caps(text)


def test_forget_refuses_a_job_a_coordinator_serves_and_the_mismatch_error_says_so(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Deleting the keys under a live coordinator would take its settings and decisions from it and its workers:
    refused, naming the coordinator; and while one serves the job, the mismatch error does not offer to forget it."""
    _finished(redis_url, job)
    with Store.from_url(redis_url, job) as store:
        store.claim_coordinator(SERVING, 5)
        keys = sorted(_keys(redis_url, job))
        assert main(["forget", "--redis", redis_url, "--job", job]) == 2
        err = capsys.readouterr().err
        assert err == (f"lbbsp: error: job {job!r} is served by the coordinator {SERVING}: stop that coordinator "
                       "first (its workers would lose their settings and splits), then forget the job\n"), err
        assert sorted(_keys(redis_url, job)) == keys
        assert main(["coordinator", "--redis", redis_url, "--job", job, "--workers", "3", "--global-batch", "30"]) == 2
        err = capsys.readouterr().err
        assert "--workers 2 (not 3)" in err and "forget" not in err, err
        store.forget()


@pytest.mark.timeout(60)
def test_a_claim_without_expiry_is_named_with_its_key_by_forget_and_by_a_coordinator_not_waited_on(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A claim no lbbsp coordinator writes (no TTL) had locked the job out for good: `forget` told to stop a coordinator
    that does not exist, and a coordinator waited 5 s to say its claim was "renewed within the last 5 s"."""
    _finished(redis_url, job)
    with Store.from_url(redis_url, job) as store:
        store.client.set(store.key("coordinator"), "leftover")
        said = (f"the claim on this job at Redis key {store.key('coordinator')} ({UNKNOWN_CLAIM}) has no expiry, which "
                "no lbbsp coordinator writes (something else wrote it, or removed its TTL): if no coordinator serves "
                "the job, delete that key\n")
        assert main(["forget", "--redis", redis_url, "--job", job]) == 2
        assert capsys.readouterr().err == f"lbbsp: error: {said}"
        started = time.monotonic()
        assert main(["coordinator", "--redis", redis_url, "--job", job, "--workers", "2", "--global-batch", "30"]) == 2
        out, err = capsys.readouterr()
        assert time.monotonic() - started < 4 and "waiting" not in out, out
        assert err == f"lbbsp: error: job {job!r}: {said}", err
        store.client.delete(store.key("coordinator"))
        assert main(["forget", "--redis", redis_url, "--job", job]) == 0
        capsys.readouterr()


def test_forget_without_a_redis_or_with_a_bad_job_name_is_a_one_line_error(
        redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LBBSP_REDIS_URL", raising=False)
    assert main(["forget", "--job", "alpha"]) == 2
    assert "pass --redis URL or set LBBSP_REDIS_URL" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["forget", "--redis", redis_url])  # no --job: it forgets one job, never every one
    assert "the following arguments are required: --job" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["status", "forget", "coordinator"])
def test_every_subcommand_names_the_flag_of_a_bad_job_name(sub: str, redis_url: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`lbbsp status --job 'a b'` said "job name must match ...", `lbbsp coordinator` "--job must match ..."."""
    extra = ["--workers", "2", "--global-batch", "8"] if sub == "coordinator" else []
    assert main([sub, "--redis", redis_url, "--job", "a b", *extra]) == 2
    assert capsys.readouterr().err == "lbbsp: error: --job must match [A-Za-z0-9_.-]{1,128}, got 'a b'\n"


def test_version_and_the_commands_help_in_plain_words(capsys: pytest.CaptureFixture[str]) -> None:
    """There was no --version, and `lbbsp --help` showed the module's docstring, reStructuredText and all."""
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"lbbsp {lbbsp.__version__}\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and "--version" in text


def test_help_status_and_forget_do_not_import_scikit_learn_or_a_framework(redis_url: str, job: str) -> None:
    """`lbbsp --help` took 2-3 s and each `lbbsp status` error 3-5 s: importing lbbsp imported scikit-learn."""
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        from lbbsp.cli import main
        for argv in (["--help"], ["status", "--help"], ["forget", "--help"],
                     ["status", "--redis", {redis_url!r}], ["status", "--redis", {redis_url!r}, "--job", {job!r}],
                     ["forget", "--redis", {redis_url!r}, "--job", {job!r}], ["-v", "status"]):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    main(argv)
                except SystemExit:
                    pass
        print(sorted(m for m in ("sklearn", "torch", "tensorflow", "flwr") if m in sys.modules))
        """)
    _finished(redis_url, job)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n", result.stdout
    assert _keys(redis_url, job) == []  # the forget above ran


CRASHED = "host.example:4242:dead"  # the identity a coordinator that crashed left its claim under (host:pid:tag)


def _flags(url: str, job: str) -> list[str]:
    return ["coordinator", "--redis", url, "--job", job, "--workers", "2", "--global-batch", "30", "--policy", "bsp"]


def _decided_at(url: str, config: JobConfig) -> float:
    """Both workers run iterations 0 and 1; the time.monotonic() at which the coordinator's split of 2 came."""
    with worker_clients(url, config) as clients:
        for k in range(2):
            for i, client in enumerate(clients):
                client.report(k, client.assignment(k).sizes[i], 0.1)
        assignment = clients[0].assignment(2)
        assert not assignment.fallback, "no coordinator decided iteration 2 within the workers' timeout"
        return time.monotonic()


@pytest.mark.timeout(60)
def test_a_second_coordinator_of_a_served_job_is_refused_naming_the_one_that_serves_it(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It had started, said the job had decisions and resumed it, and a second later both coordinators warned of
    each other and kept deciding, each learning from half the iterations."""
    config = JobConfig(job, 2, 30)
    with Store.from_url(redis_url, job) as store:
        live = Coordinator(store, config, BSPPolicy()).start()
        try:
            deadline = time.monotonic() + 10
            while (serving := store.coordinator()) is None:
                assert time.monotonic() < deadline, "the live coordinator never claimed the job"
                time.sleep(0.02)
            started = time.monotonic()
            status = main([*_flags(redis_url, job), "--max-decisions", "1"])
            took = time.monotonic() - started
            assert store.coordinator() == serving, "the refused coordinator touched the live one's claim"
        finally:
            live.stop()
    out, err = capsys.readouterr()
    assert "crash" not in out and "stopped without releasing it) or be renewed" in out, out  # it had said that the
    # live coordinator stopped without releasing its claim, a second before refusing to start because it serves
    assert status == 2, err
    assert err == (f"lbbsp: error: job {job!r} is served by the coordinator {serving} (its claim renewed within the "
                   "last 5 s): stop it first, or use another --job\n"), err
    assert took < 4, f"refused only after {took:.1f} s: its renewals, every second, went unseen until 5 s had passed"


@pytest.mark.timeout(60)
def test_a_coordinator_that_claims_the_job_after_the_check_is_not_served_beside(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two commands started together had both found no claim at the check, and served the job side by side: the
    claim is made in one step with a second check, before serving."""
    original = Store.coordinator

    def claimed_after_the_check(store: Store) -> str | None:
        found = original(store)
        store.claim_coordinator(SERVING, 5)  # the other command's first heartbeat, right after this one's check
        return found

    monkeypatch.setattr(Store, "coordinator", claimed_after_the_check)
    status = main([*_flags(redis_url, job), "--max-decisions", "1"])
    out, err = capsys.readouterr()
    assert status == 2, (out, err)
    assert err == (f"lbbsp: error: job {job!r} is served by the coordinator {SERVING}, which started beside this "
                   "one: stop it first, or use another --job\n"), err
    assert "coordinating job" not in out, out
    with Store.from_url(redis_url, job) as store:
        assert original(store) == SERVING, "the refused coordinator touched the other one's claim"


@pytest.mark.timeout(60)
def test_the_claim_a_crashed_coordinator_left_is_waited_out_then_the_job_served(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A restart right after a crash finds the dead coordinator's claim (up to 5 s left, never renewed): it says it
    waits, serves as soon as the claim lapses, not 5 s later, and never before."""
    config = JobConfig(job, 2, 30)
    with Store.from_url(redis_url, job) as store:
        store.claim_coordinator(CRASHED, 3)
        lapses = time.monotonic() + 3
        with ThreadPoolExecutor(1) as pool:
            decided = pool.submit(_decided_at, redis_url, config)
            status = main([*_flags(redis_url, job), "--max-decisions", "2"])
            at = decided.result(timeout=30)
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.startswith(f"job {job!r}: coordinator {CRASHED} holds a claim on this job: waiting up to 5 s for it "
                          "to lapse (a coordinator that stopped without releasing it) or be renewed (one that serves "
                          "the job)\n"), out
    assert f"coordinating job {job!r}" in out, out
    assert lapses - 0.1 < at < lapses + 1.5, f"decided {at - lapses:+.1f} s after the claim lapsed"


@pytest.mark.timeout(60)
def test_a_job_no_coordinator_claims_is_served_at_once(
        redis_url: str, job: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = JobConfig(job, 2, 30)
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        decided = pool.submit(_decided_at, redis_url, config)
        status = main([*_flags(redis_url, job), "--max-decisions", "2"])
        at = decided.result(timeout=30)
    out = capsys.readouterr().out
    assert status == 0 and "waiting" not in out, out
    assert at - started < 3, f"decided {at - started:.1f} s after the start"


@pytest.mark.timeout(60)
def test_a_signal_while_waiting_for_a_claim_to_lapse_stops_the_command_at_once(redis_url: str, job: str) -> None:
    """Not 3 s later, with a hint to check Redis (the stop's grace period ran out during the wait)."""
    with Store.from_url(redis_url, job) as store:
        store.claim_coordinator(CRASHED, 30)  # set by hand, never renewed: it would be waited on for 5 s
        process = subprocess.Popen([*LBBSP, *_flags(redis_url, job)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line.startswith(f"job {job!r}: coordinator {CRASHED} holds a claim on this job: "
                                   "waiting up to 5 s"), line
            process.send_signal(signal.SIGTERM)
            started = time.monotonic()
            out, err = process.communicate(timeout=10)
            took = time.monotonic() - started
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        assert store.coordinator() == CRASHED
    assert process.returncode == 0 and err == "", (out, err)
    assert out.endswith(f"stopped serving job {job!r} after 0 decisions (SIGTERM)\n"), out
    assert took < 1.5, f"stopped {took:.1f} s after SIGTERM"


DOC = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()




@pytest.mark.timeout(60)
@pytest.mark.parametrize("view", [[], ["--brief"], ["--json"], ["--decisions", "2"]])
def test_output_into_a_reader_gone_ends_quietly_with_141(redis_url: str, decided: str, view: list[str]) -> None:
    """`lbbsp status | head -1`: the reader closes the pipe, and the next write fails. That had ended --json and
    --brief with "lbbsp: error: cannot reach Redis ([Errno 32] Broken pipe)" and 2, and the table with rich's exit
    1, which --check means for a job unserved. Now every view ends with 141, as a tool that SIGPIPE ends, silent."""
    proc = subprocess.Popen([*LBBSP, "status", "--redis", redis_url, "--job", decided, *view],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()  # before the command writes: its first write fails
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (141, ""), err
    assert "end quietly with 141" in DOC


@pytest.mark.timeout(60)
def test_the_doc_quotes_the_coordinators_first_line_which_status_takes(job: str) -> None:
    """Without --redis, `lbbsp status` and `forget` need the embedded server's URL, which the coordinator prints as
    its first line; the doc's Output paragraph had named only the job's line and the last one."""
    env = {"PATH": "", "COLUMNS": "200"}  # no $LBBSP_REDIS_URL: an embedded server of its own
    coordinator = subprocess.Popen([*LBBSP, "coordinator", "--job", job, "--workers", "2", "--global-batch", "4",
                                    "--max-decisions", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env)
    try:
        assert coordinator.stdout is not None
        first = coordinator.stdout.readline()
        url = re.fullmatch(r"started an embedded redis-server: --redis (unix://\S+)\n", first)
        assert url, first
        assert "`started an embedded redis-server: --redis unix:///dev/shm/lbbsp-redis-.../redis.sock`" in DOC
        coordinator.stdout.readline()  # "coordinating job ...": it serves the job now
        status = subprocess.run([*LBBSP, "status", "--redis", url[1], "--brief"], capture_output=True, text=True,
                                env=env, timeout=30, check=False)
        assert status.returncode == 0 and status.stdout.startswith(f"{job}: 2 workers, served by"), status
    finally:
        coordinator.terminate()
        coordinator.communicate(timeout=30)


@pytest.mark.parametrize(("url", "flag"), [("redis://h:6379/0", "--redis redis://h:6379/0"),
                                           ("redis://h/0?a=1&b=2", "--redis 'redis://h/0?a=1&b=2'"),
                                           ("redis://:secret@h:6379/0", "--redis URL")])
def test_the_forget_command_offered_can_be_pasted(url: str, flag: str) -> None:
    """It had quoted the URL as errors show it: a password as ***, which then failed, and a query's & unquoted, which
    a shell splits."""
    assert _redis_flag(url, "--redis") == flag
    assert _redis_flag(url, "$LBBSP_REDIS_URL") == ""  # read again from the variable


def test_a_stop_signals_repeat_at_once_neither_cuts_short_nor_shortens_the_grace() -> None:
    """The handler itself, called as the signals would call it: the subprocess test below cannot tell where its second
    SIGTERM lands (a -15 exit, the handlers gone, passes too). GNU timeout's repeat of the first stop, microseconds
    later, is that stop: no _CutShort, and the grace before the clean-up is cut stays STOP_GRACE_S."""
    with _StopSignals() as stops:
        stops._stop(signal.SIGTERM, None)
        stops._stop(signal.SIGTERM, None)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
    assert stops.received == "SIGTERM" and stops._cut is None
    assert STOP_GRACE_S - 1.0 < left <= STOP_GRACE_S, left  # a second stop had set it to 0.25 s


@pytest.mark.timeout(90)
@pytest.mark.parametrize("attempt", range(3))  # a race: 3 of 4 runs had lost it
def test_one_stop_signal_sent_twice_at_once_is_a_clean_stop(redis_url: str, job: str, attempt: int) -> None:
    """GNU timeout signals the coordinator and then its process group: runs ended "at a second SIGTERM", exit 143,
    the claim left for 5 s."""
    coordinator = subprocess.Popen([sys.executable, "-m", "lbbsp.cli", "coordinator", "--redis", redis_url, "--job",
                                    job, "--workers", "2", "--global-batch", "30"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert coordinator.stdout is not None
        assert coordinator.stdout.readline().startswith(f"coordinating job '{job}'")
        coordinator.send_signal(signal.SIGTERM)
        time.sleep(0.01)  # after the first one's handler ran: sent at once, the two are one pending signal
        coordinator.send_signal(signal.SIGTERM)
        out, err = coordinator.communicate(timeout=15)
    finally:
        coordinator.kill()
    assert "second" not in err and coordinator.returncode in (0, -signal.SIGTERM), err  # -15: at exit, handlers gone
    with Store.from_url(redis_url, job) as store:
        assert store.coordinator() is None  # released
        store.forget()


@pytest.mark.timeout(30)
def test_the_coordinator_gives_up_soon_on_a_redis_that_never_answers(stalled_redis: EmbeddedRedis,
                                                                      job: str, capsys: pytest.CaptureFixture[str]) \
        -> None:
    """A redis-server under SIGSTOP: `lbbsp coordinator` waited 16 s in silence (three 5 s socket timeouts) before
    its error, where `lbbsp status` gives up within a few seconds."""
    _pause(stalled_redis, signal.SIGSTOP)
    started = time.monotonic()
    code = main(["coordinator", "--redis", stalled_redis.url, "--job", job, "--workers", "2", "--global-batch", "30"])
    took = time.monotonic() - started
    assert code == 2 and "cannot reach Redis" in capsys.readouterr().err
    assert took < 6.0, f"gave up after {took:.1f}s"


def test_a_settings_clash_names_the_flags_that_differ(redis_url: str, job: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The clash named JobConfig's fields (`JobConfig(... global_batch=256 ...)`) to a user who sets flags."""
    with Store.from_url(redis_url, job) as store:
        store.register(JobConfig(job, 2, 256, assignment_timeout_s=5.0))
        code = main(["coordinator", "--redis", redis_url, "--job", job, "--workers", "4", "--global-batch", "256",
                     "--timeout", "5", "--max-decisions", "1"])
        store.forget()
    err = capsys.readouterr().err
    assert code == 2 and "JobConfig(" not in err, err
    assert f"job '{job}' already runs with --workers 2 (not 4):" in err, err
    assert "--global-batch" not in err and "--timeout" not in err, err  # only what differs


@pytest.mark.parametrize(("flags", "said"), [
    ([], " with the auto model"),
    (["--model", "ewma"], " with the ewma model"),
    (["--kind", "3=gpu", "--kind-model", "cpu=ewma"], " with the auto model (--kind 3=gpu, --kind-model cpu=ewma)"),
    (["--policy", "per-epoch"], " with its own slow EWMA"),
    (["--policy", "static-proportional"], ""),
    (["--policy", "bsp"], ""),
])
def test_the_coordinators_start_line_names_the_model_and_what_routes_it(flags: list[str], said: str) -> None:
    """`lbbsp coordinator` said the model only where --model was given, and never the kinds pinned."""
    args = build_parser().parse_args(["coordinator", "--job", "j", "--workers", "4", "--global-batch", "64", *flags])
    assert _model_said(args, _policy(args)) == said


def _decided(store: Store, **fields: object) -> None:
    """A decision record as a coordinator writes one (iteration 0, two workers), with ``fields`` in place of its
    defaults."""
    store.record_decision(json.dumps({
        "iteration": 0, "through": 0, "sizes": [15, 15], "policy": "bsp", "reason": "equal split",
        "written_by_coordinator": True, "rejected": [], "rejected_more": 0, "time": time.time(), **fields}))


def _store_keys(store: Store) -> list[bytes]:
    return sorted(set(store.client.scan_iter(match=f"{store.prefix}*")))  # SCAN may give a key twice (a resize)




def test_the_command_offers_no_forget_for_a_job_no_coordinator_has_decided_yet(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Settings its workers stored before any coordinator decided: no earlier run's, and not to be forgotten (it had
    said an earlier run left them, since no coordinator claimed the job)."""
    job = store.job
    store.register(JobConfig(job, 2, 30))
    assert main(["coordinator", "--redis", redis_url, "--job", job, "--workers", "3", "--global-batch", "30"]) == 2
    err = capsys.readouterr().err
    assert err == (f"lbbsp: error: job {job!r} already runs with --workers 2 (not 3): give the job's settings, or "
                   "another --job\n"), err


@pytest.mark.timeout(60)
def test_lbbsp_forget_refuses_a_job_a_coordinator_claims_while_it_runs(
        store: Store, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """It checked that no coordinator held the claim, then listed the keys and deleted them: a coordinator that claimed
    the job in between lost its settings and decisions (and its claim stayed, on a job with no settings)."""
    store.register(JobConfig(store.job, 2, 30))
    _decided(store)
    kept = _store_keys(store)
    scan_iter = redis.Redis.scan_iter

    def listed_then_claimed(self: redis.Redis, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        """The job's keys, as Redis lists them; a coordinator claims the job once they are listed."""
        keys = list(scan_iter(self, *args, **kwargs))
        if self is not store.client and kwargs.get("match", "").startswith(store.prefix):
            store.claim_coordinator(SERVING, 5)
        yield from keys

    monkeypatch.setattr(redis.Redis, "scan_iter", listed_then_claimed)
    assert main(["forget", "--redis", redis_url, "--job", store.job]) == 2
    err = capsys.readouterr().err
    assert err == (f"lbbsp: error: job {store.job!r} is served by the coordinator {SERVING}: stop that coordinator "
                   "first (its workers would lose their settings and splits), then forget the job\n"), err
    assert _store_keys(store) == sorted([*kept, store.key("coordinator").encode()])


@pytest.mark.timeout(60)
def test_output_closed_or_into_a_full_disk_is_told_as_such_not_as_redis(redis_url: str, decided: str) -> None:
    """`lbbsp status >&-` (a cron job, a service without a stdout): Python has no sys.stdout, and the flush at the end
    ended a job's status, printed to nowhere, with an AttributeError traceback and 1, which --check means for a job
    unserved. `lbbsp status --json > /dev/full` said "cannot reach Redis ([Errno 28] No space left on device)"."""
    command = [*LBBSP, "status", "--redis", redis_url, "--job", decided]
    closed = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *command, "--brief"], capture_output=True,
                            text=True, timeout=30, check=False)
    assert (closed.returncode, closed.stderr) == (0, ""), closed.stderr
    with open("/dev/full", "w") as full:
        result = subprocess.run([*command, "--json"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=30,
                                check=False)
    assert result.returncode == 2
    assert "cannot write to the output" in result.stderr and "No space left on device" in result.stderr, result.stderr
    assert "Redis" not in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_status_to_an_ascii_stdout_replaces_what_it_cannot_encode(redis_url: str, decided: str) -> None:
    """Under PYTHONIOENCODING=ascii (or a Latin-1 locale), a cell rich cut to fit 40 columns ("…") ended the command
    in a UnicodeEncodeError traceback, exit 1: what --check means by a job unserved."""
    status = subprocess.run([*LBBSP, "status", "--redis", redis_url, "--job", decided], capture_output=True,
                            timeout=30, check=False, env={**os.environ, "PYTHONIOENCODING": "ascii", "COLUMNS": "40"})
    assert (status.returncode, status.stderr) == (0, b""), status.stderr.decode()
    assert decided.encode() in status.stdout
