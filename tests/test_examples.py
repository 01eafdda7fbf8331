"""The scripts in examples/, run as a user runs them: core_loop.py splits unevenly and matches single-process SGD;
core_loop.py, torch_digits.py and keras_digits.py refuse what they cannot run, or end on a worker that died, saying
why without a traceback."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from test_flower_deployment import EXAMPLES


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


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_example(script: str, *argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``python examples/<script> argv...``, as a user types it outside torchrun."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    return subprocess.run([sys.executable, str(EXAMPLES / script), *argv], capture_output=True, text=True,
                          timeout=timeout_s, check=False, env=env)


@pytest.mark.parametrize(("argv", "words"), [
    (["--epochs", "0"], "--epochs must be at least 1"),  # had printed "0 iterations ... matches single-process SGD"
    (["--epochs", "-1"], "--epochs must be at least 1"),  # had printed "-16 iterations ... matches"
    (["--global-batch", "1"], "--global-batch must be at least 2"),  # had been a ConfigError traceback
])
def test_the_core_loop_refuses_what_it_cannot_run(argv: list[str], words: str) -> None:
    done = run_example("core_loop.py", *argv)
    assert done.returncode == 2 and words in done.stderr, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_core_loop_ends_naming_a_worker_that_died_instead_of_waiting_for_it() -> None:
    """A worker killed mid-run had left the launcher waiting for its gradient for ever (still running 200 s later:
    its 120 s queue timeout, then the exit's join of the other worker, which waited for the launcher)."""
    launcher = subprocess.Popen([sys.executable, str(EXAMPLES / "core_loop.py"), "--epochs", "500"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert launcher.stdout is not None
        assert "iteration   0" in launcher.stdout.readline()  # the workers train
        spawned = sorted((c for c in psutil.Process(launcher.pid).children() if "spawn_main" in " ".join(c.cmdline())),
                         key=lambda c: c.create_time())  # the coordinator's process, then the two workers
        everything = psutil.Process(launcher.pid).children(recursive=True)
        spawned[-1].kill()
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            for child in psutil.Process(launcher.pid).children(recursive=True):
                child.kill()
            launcher.kill()
    assert launcher.returncode not in (0, None) and "exited" in out and "worker" in out, out[-2000:]
    _, alive = psutil.wait_procs(everything, timeout=10)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP])
def test_the_core_loops_workers_end_when_the_launcher_is_killed(how: signal.Signals) -> None:
    """The launcher killed mid-run (the OOM killer, kill, a dropped ssh session) had left both workers waiting for
    its weights for ever, each with the resource tracker it shares: still running 60 s later."""
    launcher = subprocess.Popen([sys.executable, str(EXAMPLES / "core_loop.py"), "--epochs", "500"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # noqa: PLW1509
    everything: list[psutil.Process] = []
    try:
        assert launcher.stdout is not None
        assert "iteration   0" in launcher.stdout.readline()  # the workers train
        everything = psutil.Process(launcher.pid).children(recursive=True)
        launcher.send_signal(how)
        assert launcher.wait(timeout=10) == -how
        _, alive = psutil.wait_procs(everything, timeout=15)
        assert not alive, f"left running: {[p.cmdline() for p in alive]}"
    finally:
        for child in everything:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        launcher.kill()
        launcher.communicate()


def test_the_torch_example_run_without_torchrun_says_how_to_run_it() -> None:
    """`python examples/torch_digits.py` had ended in 20 lines of traceback: "environment variable RANK expected"."""
    done = run_example("torch_digits.py", "--epochs", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "torchrun --nproc-per-node 2 examples/torch_digits.py" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(("argv", "words"), [
    (["--epochs", "0"], "--epochs"),  # had printed {"epochs": 0, ..., "test_accuracy": 0.0}, exit 0
    (["--checkpoint", "c.pt", "--checkpoint-every", "0"], "--checkpoint-every"),  # ZeroDivisionError mid-epoch
    (["--hidden", "0"], "--hidden"),  # had trained a net of no hidden unit to 0.1 accuracy
])
def test_the_torch_example_refuses_what_it_cannot_run(argv: list[str], words: str) -> None:
    done = run_example("torch_digits.py", *argv)
    assert done.returncode == 2 and f"{words} must be at least 1" in done.stderr, done.stdout + done.stderr


@pytest.mark.timeout(120)
def test_the_torch_example_with_a_bad_redis_url_says_why_without_a_traceback() -> None:
    """`--redis http://host` had ended each rank in 40 lines of traceback, the ConfigError that says why at the bottom."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                           str(EXAMPLES / "torch_digits.py"), "--redis", "http://localhost", "--epochs", "1"],
                          capture_output=True, text=True, timeout=110, check=False, env=env)
    assert done.returncode != 0
    assert "torch_digits.py: not a usable Redis URL: http://localhost" in done.stderr, done.stderr
    assert "[rank0]: Traceback" not in done.stderr, done.stderr


@pytest.mark.timeout(120)
def test_the_keras_example_with_a_bad_redis_url_says_why_without_a_traceback() -> None:
    """As the torch example's: a page of traceback, the ConfigError that says why at the bottom."""
    done = run_example("keras_digits.py", "--redis", "http://localhost", "--epochs", "1", timeout_s=110)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "keras_digits.py: not a usable Redis URL: http://localhost" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
