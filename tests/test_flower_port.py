"""Porting a standard Flower app to lbbsp, on LocalGrid (real Strategy.start loop, real ClientApps): the mistakes a
port makes on the way are errors or warnings that say what to do, and the built-in strategies docs/flower.md
names as tested train under LoadBalanced."""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.serverapp.strategy import FedAdam, FedAvg, FedProx, Strategy

from lbbsp import ConfigError
from lbbsp.integrations.flower import ClientHistory, LoadBalanced, LocalRound, Workload
from lbbsp.integrations.flower_local import LocalGrid

DATA_SIZE = 50


def app(train: Callable[[Message, LocalRound], Message]) -> ClientApp:
    """A ClientApp whose train step is ``train(msg, rnd)``, given its LocalRound (a default workload of 4 x 2)."""
    client = ClientApp()

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        return train(msg, LocalRound(msg, default=Workload(4, 2), data_size=DATA_SIZE))

    return client


def trains(msg: Message, rnd: LocalRound) -> Message:
    """What a ported client does: one step per batch size, then the reply."""
    w = msg.content.array_records["arrays"].to_numpy_ndarrays()[0]
    for batch_size in rnd.batches():
        w = w + 0.01 * batch_size
    return rnd.reply(ArrayRecord([w]), {"train-loss": 1.0})


def start(strategy: Strategy, client: ClientApp, rounds: int = 1) -> np.ndarray | None:
    """Run ``rounds`` rounds on two nodes from w = 0; the final weight, None if no round aggregated."""
    grid = LocalGrid(client, [{}, {}])
    try:
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(1)]), num_rounds=rounds, timeout=30,
                                train_config=ConfigRecord({"lr": 0.1}))
    finally:
        grid.close()
    return result.arrays.to_numpy_ndarrays()[0] if len(result.arrays) else None


def fedavg() -> FedAvg:
    return FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2)


def warnings_like(caplog: pytest.LogCaptureFixture, pattern: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and re.search(pattern, r.getMessage())]


def a_train_message() -> Message:
    LocalGrid(ClientApp(), [{}])  # sets Flower's task identity so that messages can be built here
    config = ConfigRecord(Workload(4, 2).to_config())
    return Message(RecordDict({"arrays": ArrayRecord([np.zeros(1)]), "config": config}), dst_node_id=1,
                   message_type=MessageType.TRAIN)


@pytest.mark.timeout(60)
def test_a_client_that_trains_outside_the_batches_loop_is_told_how_to_count_its_steps(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    def keeps_its_own_loop(msg: Message, rnd: LocalRound) -> Message:  # its old epoch loop, only the reply ported
        return rnd.reply(ArrayRecord([msg.content.array_records["arrays"].to_numpy_ndarrays()[0] + 1.0]))

    with ClientHistory.from_url(redis_url, job) as history:
        assert start(LoadBalanced(fedavg(), history, batch_size=4, local_steps=2), app(keeps_its_own_loop)) is None
        assert {s.status for s in history.statuses().values()} == {"failed"}  # not available: its share is made up
    assert len(warnings_like(caplog, r"node [12] failed and is left out: bad reply: lbbsp-samples: processed no "
                                     r"sample.*rnd\.batches\(\)")) == 2


@pytest.mark.timeout(60)
def test_a_client_that_sets_its_own_weight_is_failed_with_the_fix(redis_url: str, job: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    def sends_num_examples(msg: Message, rnd: LocalRound) -> Message:  # as a plain Flower ClientApp does
        for _ in rnd.batches():
            pass
        return rnd.reply(ArrayRecord(msg.content.array_records["arrays"].to_numpy_ndarrays()), {"num-examples": DATA_SIZE})

    with ClientHistory.from_url(redis_url, job) as history:
        start(LoadBalanced(fedavg(), history, batch_size=4, local_steps=2), app(sends_num_examples))
        assert {s.status for s in history.statuses().values()} == {"failed"}
    assert len(warnings_like(caplog, r"failed and is left out: ConfigError: metrics must not set \['num-examples'\]"
                                     r".*LocalRound\(data_size=\.\.\.\)")) == 2


@pytest.mark.timeout(60)
def test_a_plain_strategy_without_a_default_workload_says_how_to_send_one(caplog: pytest.LogCaptureFixture) -> None:
    def reads_a_workload(msg: Message, context: Context) -> Message:
        return trains(msg, LocalRound(msg))  # no default, and the server's strategy is not LoadBalanced

    client = ClientApp()
    client.train()(reads_a_workload)
    assert start(fedavg(), client) is None
    errors = [r.getMessage() for r in caplog.records if "lbbsp-batch-size: is missing" in r.getMessage()]
    assert errors and all("LoadBalanced" in e and "default=Workload(" in e for e in errors)


def test_local_round_refuses_a_context_or_bare_arrays_with_the_fix() -> None:
    msg = a_train_message()
    with pytest.raises(ConfigError, match=r"train\(msg, context\), got Context"):
        LocalRound(Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}))  # type: ignore[arg-type]
    rnd = LocalRound(msg)
    for _ in rnd.batches():
        pass
    with pytest.raises(ConfigError, match=r"ArrayRecord\(list_of_ndarrays\).*got list"):
        rnd.reply([np.zeros(1)])  # type: ignore[arg-type]
    assert rnd.reply(ArrayRecord([np.zeros(1)]), {"train-loss": 1.0}).content["metrics"]["num-examples"] == 8


@pytest.mark.parametrize(("strategy", "hint"), [
    (LegacyFedAvg(), r"legacy strategy \(flwr\.server\.strategy\).*flwr\.serverapp\.strategy.*@app\.train\(\)"),
    (FedAvg, r"pass an instance, FedAvg\(\.\.\.\), not the class"),
])
def test_a_legacy_strategy_or_a_class_is_a_config_error_that_says_what_to_pass(redis_url: str, job: str,
                                                                               strategy: object, hint: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        with pytest.raises(ConfigError, match=hint):
            LoadBalanced(strategy, history)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", [
    FedProx(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2, proximal_mu=0.1),
    FedAdam(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2),
], ids=["FedProx", "FedAdam"])
def test_other_built_in_strategies_train_under_load_balanced(redis_url: str, job: str, strategy: Strategy) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        w = start(LoadBalanced(strategy, history, batch_size=4, local_steps=2), app(trains), rounds=2)
        assert {s.status for s in history.statuses().values()} == {"ok"}
    assert w is not None and w[0] > 0  # both rounds moved the model
