"""Run the flower_digits app as a real Flower deployment on loopback: one SuperLink, N SuperNodes, `flwr run`.

    python examples/flower_digits/run.py --clients 10 --rounds 5 --mode lbbsp

Starts an embedded Redis for lbbsp's client history, `flower-superlink` and one `flower-supernode` per
client (``partition-id`` = its index) on free local ports, submits the app with `flwr run`, prints each round's
progress from the ServerApp's log as it comes (`flwr log RUN_ID local`), then the per-round results the ServerApp
writes, and stops every process it started. ``--run-config "sit-out=0.1 min-size=8"`` sets any other key of the
app's run config (pyproject.toml).

It shows the plugin on a real deployment, not a speed-up: every round starts a fresh ClientApp process per
client, and on one machine those start-ups set the round (seconds), which no batch size changes. The clients
report them (``count_delivery=True``), so lbbsp's plans mostly keep the equal split; see docs/flower.md.
"""
from __future__ import annotations

import argparse
import ctypes
import difflib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import click
from flwr.common.config import parse_config_args

from lbbsp import EmbeddedRedis
from lbbsp.signals import term_and_hangup_as_exit

APP_DIR = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
#: The ServerApp's log lines that show a run's progress: each round's start, lbbsp's plan and measured time, and
#: the central evaluation's accuracy.
PROGRESS = re.compile(r"\[ROUND \d+/\d+\]|lbbsp round \d+:|MetricRecord: \{'accuracy'")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Keys of the run config that run.py sets itself, and the flag that sets each.
OWN_KEYS = {"num-clients": "use --clients", "num-server-rounds": "use --rounds", "mode": "use --mode",
            "weight-by": "use --weight-by", "out": "run.py reads the ServerApp's result from a file of its own"}
#: What `flwr run` answers while the SuperLink is not listening yet: the one refusal worth submitting again.
NOT_LISTENING = "Connection to the SuperLink is unavailable"


def app_config_keys() -> list[str]:
    """The keys of the app's run config, as its pyproject.toml declares them: `flwr run` refuses any other."""
    with open(APP_DIR / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["tool"]["flwr"]["app"]["config"])


def unknown_key_message(key: str, known: list[str]) -> str:
    """Why ``key`` cannot be set, with the nearest known key ('min_size' is 'min-size')."""
    near = difflib.get_close_matches(key.replace("_", "-"), known, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}? " if near else ""
    settable = ", ".join(k for k in known if k not in OWN_KEYS)
    return f"--run-config: the app has no key {key!r}: {hint}its keys are {settable}"


def flower_command(name: str) -> str:
    """Flower's command ``name``: beside this Python (its environment's bin), else on PATH (``pip install --user``
    puts it in ~/.local/bin)."""
    found = shutil.which(name, path=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
    if found is None:
        raise FileNotFoundError(f"{name} is neither beside {sys.executable} nor on PATH: install Flower in this "
                                "environment, pip install 'lbbsp[flower]'")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def flwr_json(flwr: str, args: list[str], env: Mapping[str, str]) -> dict[str, object]:
    """``flwr args --format json``'s answer; ``success`` False with flwr's output where it printed no JSON."""
    done = subprocess.run([flwr, *args, "--format", "json"], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    try:
        answer = json.loads(done.stdout)
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        return {"success": False, "error-message": f"{done.stdout[-2000:]}{done.stderr[-2000:]}"}
    return answer


def _check_run(flwr: str, run_id: str, env: Mapping[str, str], out: Path) -> None:
    """Raise, with the ServerApp's error and the tail of its log, if run ``run_id`` ended without writing ``out``
    (a ServerApp that raised had left the launcher waiting out its whole timeout)."""
    listed = flwr_json(flwr, ["ls", "local", "--run-id", run_id], env)
    runs = listed.get("runs")
    run = runs[0] if isinstance(runs, list) and runs and isinstance(runs[0], dict) else {}
    status = str(run.get("status", ""))
    if not status.startswith("finished") or out.exists():
        return
    log = subprocess.run([flwr, "log", run_id, "local", "--show"], env=env, capture_output=True, text=True,
                         timeout=120, check=False).stdout
    raise RuntimeError(f"the ServerApp's run {run_id} ended {status} without a result: "
                       f"{run.get('status-details', '')}\n{log[-3000:]}")


def _stop_with_launcher() -> None:
    """In each Flower process, before exec: SIGKILL once the launcher is gone (their SuperExecs follow them: they
    watch their --parent-pid). Killed (SIGKILL, the OOM killer), it had left the SuperLink, the SuperNodes, their
    SuperExecs and the ServerApp serving for good, in sessions of their own; SIGTERM left the SuperLink waiting on the
    ServerApp."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LogFollower:
    """Streams a run's log (`flwr log RUN_ID local`, which ends when the run does) and prints its progress lines as
    they come, from a thread: one process waiting on the SuperLink's stream, not one started per poll."""

    def __init__(self, flwr: str, run_id: str, env: Mapping[str, str]) -> None:
        self.process = subprocess.Popen([flwr, "log", run_id, "local"], env=env, stdout=subprocess.PIPE,
                                        preexec_fn=_stop_with_launcher,  # noqa: PLW1509
                                        stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
                                        errors="replace", start_new_session=True)
        self._thread = threading.Thread(target=self._echo, args=(self.process.stdout or (),), daemon=True)
        self._thread.start()

    @staticmethod
    def _echo(lines: Iterable[str]) -> None:
        for line in lines:
            if PROGRESS.search(line):
                print(f"  {ANSI.sub('', line).strip()}", flush=True)

    def ended(self) -> bool:
        """Whether the stream has ended: the run has, or the stream broke."""
        return self.process.poll() is not None

    def join(self) -> None:
        """Wait for the thread to print what the stream gave before it ended (its process ended or was stopped), then
        close the stream (each run of a notebook had left a pipe open)."""
        self._thread.join(timeout=5)
        if self.process.stdout is not None and not self._thread.is_alive():  # (never under a thread still reading)
            self.process.stdout.close()


def run_deployment(clients: int, run_config: Mapping[str, object], *, timeout_s: float = 600,
                   workdir: Path | None = None, redis_url: str | None = None) -> dict[str, object]:
    """Run the app on a fresh SuperLink with ``clients`` SuperNodes; returns the ServerApp's results."""
    with term_and_hangup_as_exit():
        return _deploy(clients, run_config, timeout_s, workdir, redis_url)


def _deploy(clients: int, run_config: Mapping[str, object], timeout_s: float, workdir: Path | None,
            redis_url: str | None) -> dict[str, object]:
    """:func:`run_deployment`'s work: start, submit, follow, and stop every process started, however it ends."""
    superlink, supernode, flwr = (flower_command(name) for name in ("flower-superlink", "flower-supernode", "flwr"))
    work = Path(workdir or tempfile.mkdtemp(prefix="lbbsp-flower-"))
    home = work / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = work / "result.json"
    processes: list[subprocess.Popen[bytes] | subprocess.Popen[str]] = []
    follower: LogFollower | None = None
    redis = EmbeddedRedis() if redis_url is None else None

    def start(args: list[str], log_name: str) -> None:
        with open(work / log_name, "wb") as log_file:
            processes.append(subprocess.Popen(args, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True,
                                              preexec_fn=_stop_with_launcher))  # noqa: PLW1509

    try:
        start([superlink, "--insecure", "--port", str(port),
               "--disable-runtime-dependency-installation"], "superlink.log")
        for i in range(clients):
            start([supernode, "--insecure", "--superlink", f"127.0.0.1:{port}",
                   "--port", str(free_port()), "--node-config", f"partition-id={i} num-partitions={clients}"],
                  f"supernode-{i}.log")
        config = {**run_config, "num-clients": clients, "out": str(out),
                  "redis-url": redis_url or (redis.url if redis else "")}
        overrides = " ".join(f"{k}={_toml_value(v)}" for k, v in config.items())
        deadline = time.monotonic() + timeout_s
        while True:  # the SuperLink takes a few seconds to listen
            submit = flwr_json(flwr, ["run", str(APP_DIR), "local", "--run-config", overrides], env)
            if submit.get("success") is True:
                break
            if processes[0].poll() is not None:  # the SuperLink will never listen: say why, not flwr's refusal
                log = (work / "superlink.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"flower-superlink exited with code {processes[0].returncode}: {log}")
            # only a SuperLink not listening yet is worth waiting for: a refused run (a run-config key the app does
            # not have) had been submitted every 2 s until the deadline, silently
            if NOT_LISTENING not in str(submit.get("error-message", "")) or time.monotonic() > deadline:
                break
            time.sleep(2)
        if submit.get("success") is not True:
            raise RuntimeError(f"flwr run failed: {submit.get('error-message', submit)}")
        run_id = str(submit["run-id"])
        print(f"submitted run {run_id} to SuperLink 127.0.0.1:{port} with {clients} SuperNodes; logs in {work}",
              flush=True)
        follower = LogFollower(flwr, run_id, env)
        processes.append(follower.process)
        while not out.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result after {timeout_s}s; logs in {work}")
            time.sleep(2)
            if follower.ended():  # the log's stream ends with the run (or broke): ask how the run ended
                _check_run(flwr, run_id, env, out)
        time.sleep(0.5)  # the ServerApp writes the file in one call; let it close
        return json.loads(out.read_text())
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if follower is not None:
            follower.join()
        if redis is not None:
            redis.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mode", choices=["lbbsp", "fedavg"], default="lbbsp")
    parser.add_argument("--weight-by", choices=["data", "auto", "samples"], default="data")
    parser.add_argument("--run-config", default="",
                        help="other keys of the app's run config (pyproject.toml), as flwr run --run-config takes "
                             "them, e.g. 'sit-out=0.1 min-size=8 adapt=\"steps\"'; with "
                             "'redis-url=\"redis://HOST:6379/0\"' the client history outlasts the run")
    args = parser.parse_args()
    if args.clients < 1 or args.rounds < 1:  # 0 clients had "trained" every round at the initial accuracy
        parser.error(f"--clients and --rounds must be at least 1, got {args.clients} and {args.rounds}")
    try:
        extra = parse_config_args([args.run_config])
    except click.ClickException as exc:
        parser.error(f"--run-config {args.run_config!r}: {exc.format_message()}")
    for key in sorted(OWN_KEYS.keys() & extra.keys()):
        parser.error(f"--run-config must not set {key}: {OWN_KEYS[key]}")
    known = app_config_keys()
    for key in sorted(extra.keys() - set(known)):
        parser.error(unknown_key_message(key, known))
    redis_url = extra.pop("redis-url", None) or None
    result = run_deployment(args.clients, {"num-server-rounds": args.rounds, "mode": args.mode,
                                           "weight-by": args.weight_by, **extra}, redis_url=redis_url)
    rounds = result["rounds"]
    if not isinstance(rounds, list):
        raise TypeError(f"the ServerApp's result should list its rounds, got {rounds!r}")
    for row in rounds:
        print(f"round {row['round']:3d}  accuracy {row['accuracy']:.3f}  elapsed {row['elapsed_s']:7.2f}s")
    plans = result.get("plans") or []
    if isinstance(plans, list) and plans:
        print("lbbsp's plans, from the ServerApp's log:")
        for line in plans:
            print(f"  {line}")


if __name__ == "__main__":
    main()
