"""The examples as a new user runs them from the README and docs, and misuses them in the obvious ways: each
misuse ends at once with a message that says what to do, never a traceback from deep inside, nor a wait."""
from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import psutil
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
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


def flower_launcher() -> ModuleType:
    """examples/flower_digits/run.py, imported as a module."""
    spec = importlib.util.spec_from_file_location("flower_digits_run_review", EXAMPLES / "flower_digits" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flower_launcher_without_flower_says_what_to_install(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Flower's commands it had raised FileNotFoundError: '.../bin/flower-superlink', after starting Redis."""
    launcher = flower_launcher()
    monkeypatch.setattr(launcher, "BIN", tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"flower-superlink .*pip install 'lbbsp\[flower\]'"):
        launcher.run_deployment(1, {"num-server-rounds": 1}, workdir=tmp_path / "work", redis_url="redis://unused")


def test_the_flower_launcher_finds_flowers_commands_on_the_path_too(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install --user` puts them in ~/.local/bin, not beside /usr/bin/python3, where run.py alone had looked."""
    launcher = flower_launcher()
    installed = tmp_path / "user-bin" / "flower-superlink"
    installed.parent.mkdir()
    installed.write_text("#!/bin/sh\n")
    installed.chmod(installed.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(launcher, "BIN", tmp_path / "python-bin")
    monkeypatch.setenv("PATH", str(installed.parent))
    assert launcher.flower_command("flower-superlink") == str(installed)


def fake_command(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.timeout(90)
def test_the_flower_launcher_stops_at_once_when_the_superlink_exits(tmp_path: Path, redis_url: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A SuperLink that refused its flags (a Flower without --disable-runtime-dependency-installation) had left run.py
    submitting `flwr run` every 2 s until its 600 s deadline, then showing flwr's "connection refused", not why."""
    superlink = ('echo "flower-superlink: error: unrecognized arguments: --disable-runtime-dependency-installation"'
                 " >&2; exit 2")
    not_listening = 'echo "Connection to the SuperLink is unavailable."; exit 1'  # flwr 1.42's words
    launch_ends_with(tmp_path, monkeypatch, redis_url, superlink, not_listening,
                     r"flower-superlink exited with code 2.*unrecognized arguments")


@pytest.mark.timeout(90)
def test_the_flower_launcher_stops_at_once_when_the_superlink_refuses_the_run(tmp_path: Path, redis_url: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A run the SuperLink refused (a run-config key the app lacks) had been submitted every 2 s until the 600 s
    deadline, printing nothing; only a SuperLink not listening yet is waited for."""
    refused = ("echo '{\"success\": false, \"error-message\": \"Could not start run: Key min_size is not present\"}'")
    launch_ends_with(tmp_path, monkeypatch, redis_url, "exec sleep 60", refused,
                     r"flwr run failed: Could not start run: Key min_size is not present")


def test_the_flower_launcher_refuses_a_key_the_app_does_not_have(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--run-config min_size=8 (the key is min-size) is refused before anything starts, naming the key meant."""
    launcher = flower_launcher()
    monkeypatch.setattr(launcher, "run_deployment", lambda *a, **k: pytest.fail("a deployment started"))
    monkeypatch.setattr(sys, "argv", ["run.py", "--run-config", "min_size=8"])
    with pytest.raises(SystemExit) as raised:
        launcher.main()
    error = capsys.readouterr().err
    assert raised.value.code == 2 and "the app has no key 'min_size': did you mean min-size?" in error, error
    assert "sit-out" in error and "num-clients" not in error, error


def launch_ends_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_url: str, superlink: str, flwr: str,
                     error: str) -> None:
    """run.py on stand-ins for Flower's commands (the SuperNodes sleep) raises a RuntimeError matching ``error``
    within 20 s."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_command(bin_dir, "flower-superlink", superlink)
    fake_command(bin_dir, "flower-supernode", "exec sleep 60")
    fake_command(bin_dir, "flwr", flwr)
    launcher = flower_launcher()
    monkeypatch.setattr(launcher, "BIN", bin_dir)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=error):
        launcher.run_deployment(1, {"num-server-rounds": 1}, timeout_s=60, workdir=tmp_path / "work",
                                redis_url=redis_url)
    assert time.monotonic() - started < 20


FAKE_FLWR = """case "$1" in
  run) echo '{"success": true, "run-id": "42", "fab-id": "lbbsp/flower-digits"}' ;;
  ls) echo '{"success": true, "runs": [{"run-id": "42", "status": "finished:failed", "status-details": '\\
'"ServerApp failed with exception: weight_by must be auto"}]}' ;;
  log) echo 'Traceback (most recent call last):'; echo 'lbbsp.errors.ConfigError: weight_by must be auto' ;;
esac"""


@pytest.mark.timeout(90)
def test_the_flower_launcher_stops_at_once_when_the_server_app_fails(tmp_path: Path, redis_url: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A ServerApp that raised (a bad run config) had left run.py waiting for its result until the 600 s deadline,
    then saying only "no result". `flwr ls` tells the run ended failed (the JSON as Flower 1.42 prints it)."""
    launch_ends_with(tmp_path, monkeypatch, redis_url, "exec sleep 60", FAKE_FLWR,
                     r"(?s)run 42 ended finished:failed.*weight_by must be auto.*Traceback")


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


LAUNCH = """import sys, importlib.util
from pathlib import Path
spec = importlib.util.spec_from_file_location("launcher", sys.argv[1])
launcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launcher)
launcher.BIN = Path(sys.argv[2])
launcher.run_deployment(2, {"num-server-rounds": 1}, timeout_s=60, workdir=Path(sys.argv[3]), redis_url=sys.argv[4])
"""


@pytest.mark.timeout(90)
def test_the_flower_launcher_stops_what_it_started_when_it_is_sent_sigterm(tmp_path: Path, redis_url: str) -> None:
    """`timeout 600 python run.py` (or a CI job's cancel) ended run.py alone: the SuperLink and SuperNodes, in
    sessions of their own, ran on (three such sets were found hours later on a developer's machine)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("flower-superlink", "flower-supernode"):
        fake_command(bin_dir, name, "sleep 60")  # a shell running its script by its path: found by that path
    fake_command(bin_dir, "flwr", 'echo "Connection to the SuperLink is unavailable."; exit 1')  # never listening

    def stand_ins() -> list[psutil.Process]:
        started = str(bin_dir / "flower-super")
        return [p for p in psutil.process_iter(["cmdline"]) if started in " ".join(p.info["cmdline"] or [])]

    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(EXAMPLES / "flower_digits" / "run.py"), str(bin_dir),
                             str(tmp_path / "work"), redis_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while len(stand_ins()) < 3 and time.monotonic() < deadline:  # the SuperLink and both SuperNodes
            time.sleep(0.1)
        assert len(stand_ins()) == 3, "the stand-ins did not start"
        proc.terminate()
        assert proc.wait(timeout=30) == 128 + 15
    finally:
        proc.kill()
    deadline = time.monotonic() + 10
    while stand_ins() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = stand_ins()
    for process in left:  # not to leave them to the rest of the suite where this fails
        process.kill()
    assert not left
