"""A Flower user's walkthrough of docs/flower.md and examples/flower_digits (flwr 1.42, Message API): a ported
client under an unwrapped strategy is told how it is weighted, a LoadBalanced built while Redis is down says why
it needs Redis then, the example's launcher shows each round as it comes and passes a run config through, and
the benchmark's table says "not reached" where it had printed None."""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from flwr.serverapp.strategy import FedAvg

from lbbsp import StoreUnavailable
from lbbsp.integrations import flower_client
from lbbsp.integrations.flower import ClientHistory, LoadBalanced
from test_examples_user_review import flower_launcher, launch_ends_with
from test_experiments import _experiment
from test_flower_port import app, fedavg, start, trains, warnings_like

NO_WORKLOAD = (r"no lbbsp workload in the train config \(is the server's strategy wrapped in LoadBalanced\?\).*"
               r"weighted by the samples they processed.*weighted_by_key=\"lbbsp-data-size\"")


@pytest.mark.timeout(60)
def test_a_ported_client_under_a_plain_strategy_is_told_once_how_it_is_weighted(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a plain FedAvg, LocalRound(default=..., data_size=...) had been weighted by samples processed (the
    same for every client), not by its data size, and nothing said so."""
    monkeypatch.setattr(flower_client, "_told", set())  # once per process: this test's process may have said it
    start(fedavg(), app(trains), rounds=2)  # two nodes, two rounds: four LocalRounds fall back to the default
    assert len(warnings_like(caplog, NO_WORKLOAD)) == 1
    caplog.clear()
    monkeypatch.setattr(flower_client, "_told", set())
    with ClientHistory.from_url(redis_url, job) as history:
        start(LoadBalanced(fedavg(), history, batch_size=4, local_steps=2), app(trains))
    assert not warnings_like(caplog, "no lbbsp workload")  # the workload came from the server


def test_load_balanced_built_while_redis_is_down_says_it_needs_redis_then() -> None:
    """It had failed inside the constructor with "Redis unusable (ConnectionError): Error 111 ..." and no hint."""
    with ClientHistory.from_url("redis://127.0.0.1:1/0", "walkthrough", socket_timeout_s=1.0) as history:
        with pytest.raises(StoreUnavailable, match=r"LoadBalanced loads the stored client history when it is built, "
                                                   r"so Redis must answer then: check the URL and that redis-server "
                                                   r"runs there \(or use EmbeddedRedis\(\)\.url\)\. Redis unusable "
                                                   r"\(ConnectionError\): .*127\.0\.0\.1:1") as raised:
            LoadBalanced(FedAvg(), history)
    assert isinstance(raised.value.__cause__, StoreUnavailable) and raised.value.job == "walkthrough"


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


def test_the_flower_benchmark_table_says_not_reached_instead_of_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The rows whose run never reached the target had printed None under "to target s" and "rounds". The benchmark
    quietens Flower's warnings while it runs, and gives the "flwr" logger its level back: it had left it at ERROR, and
    the later tests that check Flower's warnings found none."""
    bench = _experiment("bench_flower")

    def run_one(mode: str, *args: object) -> tuple[list[dict[str, float]], float | None]:
        best = 0.9 if mode == "fedavg" else 0.5  # lbbsp's runs never reach the target here
        return [{"round": r, "accuracy": best * r / 2, "elapsed_s": 1.5 * r} for r in range(3)], \
            None if mode == "fedavg" else 1.0

    monkeypatch.setattr(bench, "run_one", run_one)
    monkeypatch.setattr(sys, "argv", ["bench_flower.py", "--rounds", "2", "--out", str(tmp_path / "b.json")])
    level = logging.getLogger("flwr").level
    bench.main()
    assert logging.getLogger("flwr").level == level
    table = capsys.readouterr().out.split("emulated times", 1)[1]
    assert "None" not in table
    fedavg_row = next(line for line in table.splitlines() if line.startswith("fedavg (weight by data)"))
    lbbsp_row = next(line for line in table.splitlines() if line.startswith("lbbsp (weight by data) "))
    assert fedavg_row.split()[4:7] == ["1.50", "3.00", "2"]
    assert re.search(r"1\.50 +not reached +- +0\.500", lbbsp_row), lbbsp_row
