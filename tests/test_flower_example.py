"""The flower_digits example as `flwr run` starts it (its own ServerApp main, its pyproject run config), on
LocalGrid instead of a SuperLink."""
from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict

from lbbsp.integrations.flower import ClientHistory
from lbbsp.integrations.flower_local import LocalGrid

APP = Path(__file__).resolve().parents[1] / "examples" / "flower_digits"
sys.path.insert(0, str(APP))

from flower_digits import client_app, server_app, task  # noqa: E402


def run_config(**overrides: object) -> dict[str, int | float | str | bool]:
    """The example's pyproject run config, as `flwr run` sends it, with ``overrides``."""
    with open(APP / "pyproject.toml", "rb") as handle:
        config = tomllib.load(handle)["tool"]["flwr"]["app"]["config"]
    return {**config, **overrides}  # type: ignore[dict-item]


def grid(cfg: dict[str, int | float | str | bool]) -> LocalGrid:
    clients = int(cfg["num-clients"])
    return LocalGrid(client_app.app, [{"partition-id": i, "num-partitions": clients} for i in range(clients)],
                     run_config=cfg)


@pytest.mark.timeout(180)
def test_the_default_run_config_balances_local_steps_too(redis_url: str, job: str) -> None:
    cfg = run_config(**{"adapt": "steps", "num-clients": 4, "num-server-rounds": 2})
    nodes = grid(cfg)
    with ClientHistory.from_url(redis_url, job) as history:
        try:
            server_app.run(nodes, cfg, history)
        finally:
            nodes.close()
        by_round = {reports[0].iteration: sorted(r.samples for r in reports) for reports in history.rounds()}
    assert by_round[1] == [160] * 4
    assert len(set(by_round[2])) > 1 and sum(by_round[2]) == 4 * 160  # step counts differ, their total stays


@pytest.mark.timeout(180)
def test_the_server_app_starts_its_own_redis_when_the_url_is_empty(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    cfg = run_config(**{"num-clients": 3, "num-server-rounds": 2, "emulate": False, "out": str(out)})
    assert cfg["redis-url"] == ""
    nodes = grid(cfg)
    try:
        server_app.main(nodes, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=cfg))
    finally:
        nodes.close()
    result = json.loads(out.read_text())
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2] and rounds[-1]["accuracy"] > rounds[0]["accuracy"]
    assert any(line.startswith("lbbsp round 2: took") for line in result["plans"])  # the measured time of round 2


@pytest.mark.parametrize(("clients", "alpha"), [(500, 0.5), (10, 0.1), (1438, 0.5)])
def test_every_client_has_data_and_every_training_sample_one_client(clients: int, alpha: float) -> None:
    """The Dirichlet draw had left some clients without a sample (28 of 500 at the default alpha, one of 10 at
    alpha 0.1), and each of them failed every round, drawing a batch from nothing."""
    parts = task.partitions(clients, alpha, 0)
    train, _ = task.train_test_indices(0)
    assert len(parts) == clients and min(len(p) for p in parts) >= 1
    assert sorted(np.concatenate(parts).tolist()) == sorted(train.tolist())
    with pytest.raises(ValueError, match="1439 clients are more than the 1438 training samples"):
        task.partitions(len(train) + 1, alpha, 0)


@pytest.mark.timeout(240)
def test_the_deployments_processes_end_when_its_launcher_is_killed() -> None:
    """run.py killed (SIGKILL, the OOM killer) had left the SuperLink, the SuperNodes, their SuperExecs and the
    ServerApp running for good, each in a session of its own: still there 60 s later."""
    import subprocess  # noqa: PLC0415
    import time  # noqa: PLC0415

    import psutil  # noqa: PLC0415

    launcher = subprocess.Popen([sys.executable, str(APP / "run.py"), "--clients", "2", "--rounds", "100"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started: list[psutil.Process] = []
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            if "submitted run" in line:
                break
        time.sleep(5)  # the SuperExecs and the ServerApp start
        started = psutil.Process(launcher.pid).children(recursive=True)
        assert any("flwr-serverapp" in " ".join(p.cmdline()) for p in started)
        launcher.kill()
        launcher.wait()
        _, alive = psutil.wait_procs(started, timeout=30)
        left = []
        for process in alive:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:  # a zombie waits on its parent, left above
                    left.append(" ".join(process.cmdline())[:120])
            except psutil.NoSuchProcess:
                pass
        assert not left, left
    finally:
        for process in started:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        if launcher.poll() is None:
            launcher.kill()
