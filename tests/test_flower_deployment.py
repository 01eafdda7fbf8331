"""A real Flower deployment on loopback (flower-superlink, 3 flower-supernode, `flwr run`) with the plugin, and
examples/flower_digits's launcher: it finds Flower's commands or says what to install, passes a run config through
and refuses a key the app lacks, prints each round as it ends, and stops at once, with what it started, when the
SuperLink exits or refuses the run, the ServerApp fails, or it is sent SIGTERM."""
from __future__ import annotations

import importlib.util
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import psutil
import pytest

pytest.importorskip("flwr")


from lbbsp.integrations.flower import ClientHistory

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_digits" / "run.py"


def load_launcher():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("flower_digits_run", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None,
                    reason="flower-superlink is not installed next to this Python")
def test_three_rounds_on_superlink_and_supernodes(redis_url: str, job: str, tmp_path: Path) -> None:
    result = load_launcher().run_deployment(
        3, {"num-server-rounds": 3, "mode": "lbbsp", "job": job, "round-timeout": 120.0}, timeout_s=280,
        workdir=tmp_path, redis_url=redis_url)
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert rounds[-1]["accuracy"] > rounds[0]["accuracy"] + 0.2
    assert sorted(result["train_metrics"]) == ["1", "2", "3"]
    with ClientHistory.from_url(redis_url, job) as history:
        workers = sorted(history.workers().values())
        assert workers == [0, 1, 2]
        assert all([r.iteration for r in history.reports(w)] == [1, 2, 3] for w in workers)
        assert {s.status for s in history.statuses().values()} == {"ok"}


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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
                             str(tmp_path / "work"), redis_url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


FOLLOWED_FLWR = """case "$1" in
  run) echo '{"success": true, "run-id": "42", "fab-id": "lbbsp/flower-digits"}' ;;
  ls) echo '{"success": true, "runs": [{"run-id": "42", "status": "finished:failed", "status-details": "stopped"}]}' ;;
  log) if [ "$3" = local ] && [ -z "$4" ]; then
         printf 'INFO :      [ROUND 1/2]\\nINFO :      lbbsp round 1: equal split\\nINFO :      noise\\n'
         printf 'INFO :      \\t\\342\\224\\224\\342\\224\\200\\342\\224\\200> MetricRecord: {'"'"'accuracy'"'"': 0.5}\\n'
       fi ;;
esac"""


@pytest.mark.timeout(90)
def test_the_flower_launcher_prints_each_round_as_the_server_app_logs_it(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """After "submitted run ..." it had printed nothing until the run ended, then every round at once."""
    launch_ends_with(tmp_path, monkeypatch, redis_url, "exec sleep 60", FOLLOWED_FLWR, r"run 42 ended finished:failed")
    printed = capsys.readouterr().out
    assert re.search(r"(?s)\[ROUND 1/2\].*lbbsp round 1: equal split.*MetricRecord: \{'accuracy': 0\.5\}", printed)
    assert "noise" not in printed


def test_the_flower_launcher_passes_a_run_config_through(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The docs name run-config knobs (sit-out, min-size, ...) that run.py had no way to take."""
    launcher = flower_launcher()
    calls = []

    def deployment(clients: int, run_config: dict[str, object], **kwargs: object) -> dict[str, object]:
        calls.append((clients, run_config, kwargs))
        return {"rounds": [{"round": 0, "accuracy": 0.1, "elapsed_s": 0.0}], "plans": []}

    monkeypatch.setattr(launcher, "run_deployment", deployment)
    monkeypatch.setattr(sys, "argv", ["run.py", "--clients", "3", "--run-config",
                                      'sit-out=0.1 min-size=8 adapt="steps" redis-url="redis://h:6379/0"'])
    launcher.main()
    clients, run_config, kwargs = calls[0]
    assert clients == 3 and kwargs == {"redis_url": "redis://h:6379/0"}
    assert run_config == {"num-server-rounds": 5, "mode": "lbbsp", "weight-by": "data", "sit-out": 0.1,
                          "min-size": 8, "adapt": "steps"}
    monkeypatch.setattr(sys, "argv", ["run.py", "--run-config", "num-clients=3"])
    with pytest.raises(SystemExit):
        launcher.main()
    assert "--run-config must not set num-clients: use --clients" in capsys.readouterr().err
