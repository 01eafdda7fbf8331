"""ServerApp: FedAvg, wrapped in lbbsp's LoadBalanced unless mode = "fedavg"; central test accuracy per round."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from logging import INFO
from typing import TypedDict

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, Strategy

from lbbsp import EmbeddedRedis
from lbbsp.integrations.flower import ClientHistory, LoadBalanced

from . import task

app = ServerApp()
Config = Mapping[str, int | float | str | bool]


class Summary(TypedDict):
    """What :func:`run` returns and ``main`` writes to ``out``."""

    mode: str
    rounds: list[dict[str, float]]  # round, accuracy (central test set) and elapsed_s after each round
    plans: list[str]  # lbbsp's log lines: each round's plan and its predicted and measured time (lbbsp mode)
    # the aggregated ClientApp train metrics per round (values as in a MetricRecord)
    train_metrics: dict[int, dict[str, int | float | list[int] | list[float]]]


def build_strategy(cfg: Config, history: ClientHistory | None) -> Strategy:
    """FedAvg over all clients (no client-side evaluation); LoadBalanced around it when history is given.

    Both weight replies by client data size (weight-by = "data" or "auto"), or both by samples processed
    (weight-by = "samples"). FedAvg waits for num-clients nodes, so it must not exceed the SuperNodes.
    """
    clients, weight_by = int(cfg["num-clients"]), str(cfg["weight-by"])
    by_data = weight_by != "samples" and history is None  # the plain baseline reads the data size itself
    base = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients, min_available_nodes=clients,
                  weighted_by_key="lbbsp-data-size" if by_data else "num-examples")
    if history is None:
        return base
    slack = float(cfg["deadline-slack"])
    return LoadBalanced(base, history, batch_size=int(cfg["batch-size"]), local_steps=int(cfg["local-steps"]),
                        adapt=str(cfg["adapt"]),  # type: ignore[arg-type]
                        min_size=int(cfg["min-size"]), deadline_slack=slack if slack > 0 else None,
                        weight_by=weight_by,  # type: ignore[arg-type]
                        compensate_dropouts=bool(cfg.get("compensate-dropouts", False)),
                        sit_out=float(cfg.get("sit-out", 0.0)),
                        ask_hardware_s=float(cfg.get("ask-hardware-s", 0.0)) or None)


def run(grid: Grid, cfg: Config, history: ClientHistory | None,
        on_round: Callable[[dict[str, float]], None] | None = None) -> Summary:
    """Train for num-server-rounds; returns the accuracy and wall time after every round. ``on_round``, if given,
    receives each round's row as soon as the round is evaluated (experiments/bench_flower.py prints progress there)."""
    x_test, y_test = task.test_set(int(cfg["seed"]))
    rounds: list[dict[str, float]] = []
    started = time.perf_counter()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        acc = task.accuracy(arrays.to_numpy_ndarrays(), x_test, y_test)
        rounds.append({"round": server_round, "accuracy": acc, "elapsed_s": time.perf_counter() - started})
        if on_round is not None:
            on_round(rounds[-1])
        return MetricRecord({"accuracy": acc})

    plans = _PlanLog()
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(plans)
    try:
        result = build_strategy(cfg, history).start(
            grid=grid, initial_arrays=ArrayRecord(task.init_params()), num_rounds=int(cfg["num-server-rounds"]),
            timeout=float(cfg["round-timeout"]), evaluate_fn=evaluate)
    finally:
        flwr_logger.removeHandler(plans)
    train = {r: dict(m) for r, m in result.train_metrics_clientapp.items()}
    return {"mode": "lbbsp" if history is not None else "fedavg", "rounds": rounds, "plans": plans.lines,
            "train_metrics": train}


class _PlanLog(logging.Handler):
    """Keeps lbbsp's "lbbsp round N: ..." lines, which a deployment's ServerApp logs where no file has them,
    for the result that ``out`` receives (run.py prints them)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("lbbsp round"):
            self.lines.append(message)


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    with ExitStack() as stack:
        history = None
        if cfg["mode"] == "lbbsp":
            url = str(cfg["redis-url"])
            if not url:
                url = stack.enter_context(EmbeddedRedis()).url
                log(INFO, "redis-url is empty: lbbsp's client history is in an embedded Redis, for this run only")
            history = stack.enter_context(ClientHistory.from_url(url, str(cfg["job"])))
        summary = run(grid, cfg, history)
    if cfg["out"]:
        with open(str(cfg["out"]), "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=1)
