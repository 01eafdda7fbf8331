"""Porting a standard Flower app to lbbsp, on LocalGrid (real Strategy.start loop, real ClientApps): the mistakes a
port makes on the way are errors or warnings that say what to do, the workload is found under the innermost
strategy's config key, a ported app with partial sampling, FedProx, evaluation every k rounds and a client that
raises trains, and the built-in strategies docs/flower.md names as tested train under LoadBalanced."""
from __future__ import annotations

import re
import threading
from collections.abc import Callable

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAdam, FedAvg, FedProx, Strategy

from lbbsp import ConfigError
from lbbsp.integrations import flower_client
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


@pytest.mark.timeout(60)
def test_the_client_finds_its_workload_under_the_strategys_config_key(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        grid = LocalGrid(ClientApp(), [{}, {}])
        strategy = LoadBalanced(FedAvg(min_available_nodes=2, configrecord_key="cfg"), history, batch_size=8,
                                local_steps=5)
        sent = next(iter(strategy.configure_train(1, ArrayRecord([np.zeros(1)]), ConfigRecord(), grid)))
        grid.close()
    assert LocalRound(sent, default=Workload(32, 1)).workload == Workload(8, 5)  # not the default


#: (node, the train ConfigRecord it received) for every train message a ClientApp of ``porting_app`` ran
SEEN: list[tuple[int, dict[str, object]]] = []


def porting_app(weight_key: str = "num-examples", raises_in: int | None = None) -> ClientApp:
    """A ported ClientApp: reads its own ``lr`` from the train config, adds ``node x lr`` to the weight, returns
    extra metrics, and collects 10 x node more samples every round (its data size). In round ``raises_in`` the
    first node to start raises."""
    app = ClientApp()
    raised: list[int] = []
    lock = threading.Lock()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node, config = context.node_id, next(iter(msg.content.config_records.values()))
        SEEN.append((node, dict(config)))
        server_round = int(config["server-round"])
        with lock:
            raises = server_round == raises_in and not raised
            if raises:
                raised.append(node)
        if raises:
            raise RuntimeError("the disk is full")
        rnd = LocalRound(msg, data_size=10 * node * server_round, weighted_by_key=weight_key)
        w = msg.content.array_records["arrays"].to_numpy_ndarrays()[0]
        for _ in rnd.batches():
            pass
        return rnd.reply(ArrayRecord([w + node * float(config["lr"])]), {"train-loss": 0.5, "train-acc": 0.9})

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        metrics = MetricRecord({"eval-loss": 1.0, weight_key: 10})
        return Message(RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def start_rounds(strategy: Strategy, client: ClientApp, nodes: int, rounds: int, **kwargs: object) -> object:
    """``strategy.start`` from w = 0 on ``nodes`` LocalGrid nodes, with ``lr`` = 1 in the train config."""
    grid = LocalGrid(client, [{} for _ in range(nodes)])
    try:
        return strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(1)]), num_rounds=rounds, timeout=30,
                              train_config=ConfigRecord({"lr": 1.0}), **kwargs)
    finally:
        grid.close()


@pytest.fixture(autouse=True)
def _seen() -> None:
    SEEN.clear()


def dp(strategy: Strategy, clients: int) -> DifferentialPrivacyServerSideFixedClipping:
    """Flower's server-side DP wrapper, without noise and with a norm no update reaches: the average shows through."""
    return DifferentialPrivacyServerSideFixedClipping(strategy, noise_multiplier=0.0, clipping_norm=1e6,
                                                      num_sampled_clients=clients)


@pytest.mark.timeout(60)
def test_a_wrapped_strategys_weight_and_config_keys_are_the_innermost_strategys(redis_url: str, job: str) -> None:
    inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2, weighted_by_key="n-samples",
                   configrecord_key="cfg")
    with ClientHistory.from_url(redis_url, job) as history:
        result = start_rounds(LoadBalanced(dp(inner, 2), history, batch_size=4, local_steps=2),
                              porting_app("n-samples"), nodes=2, rounds=1)
    # weighted by the data sizes 10 and 20 (not the 8 samples each processed): (10 x 1 + 20 x 2) / 30
    assert result.arrays.to_numpy_ndarrays()[0][0] == pytest.approx(50 / 30)
    assert sorted(result.train_metrics_clientapp[1]) == ["train-acc", "train-loss"]
    assert {k for _, config in SEEN for k in config} == {"lr", "server-round", "lbbsp-batch-size",
                                                         "lbbsp-local-steps"}


class Recording(LoadBalanced):
    """docs/flower.md's variant: records each round's plan, and the nodes the wrapped strategy sampled."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.plans: dict[int, dict[int, int]] = {}
        self.sampled: dict[int, list[int]] = {}

    def plan(self, server_round: int, nodes: list[int]) -> dict:  # type: ignore[type-arg]
        self.sampled[server_round] = sorted(nodes)
        plan = super().plan(server_round, nodes)
        self.plans[server_round] = {n: w.batch_size for n, w in plan.items()}
        return plan


@pytest.mark.timeout(60)
def test_a_ported_app_with_sampling_fedprox_evaluation_every_k_rounds_and_a_client_that_raises(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    inner = FedProx(fraction_train=0.5, min_available_nodes=6, min_train_nodes=2, fraction_evaluate=0.5,
                    min_evaluate_nodes=2, proximal_mu=0.1)
    evaluated: list[int] = []

    def every_second_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        evaluated.append(server_round)
        return MetricRecord({"acc": 0.5}) if server_round % 2 == 0 else None

    with ClientHistory.from_url(redis_url, job) as history:
        strategy = Recording(inner, history, batch_size=8, local_steps=2)
        result = start_rounds(strategy, porting_app(raises_in=2), nodes=6, rounds=4, evaluate_fn=every_second_round)
        statuses = {node: history.statuses()[history.worker_index(node)] for node in strategy.plans[4]}
    raised = [r.getMessage() for r in caplog.records if "the disk is full" in r.getMessage() and "lbbsp" in
              r.getMessage()]
    assert len(raised) == 1 and "lbbsp round 2: node" in raised[0] and "failed and is left out" in raised[0]
    failed = int(raised[0].split("node ")[1].split()[0])
    # only the 3 sampled nodes are planned, each round, and they share the round total
    assert all(len(nodes) == 3 and sorted(strategy.plans[r]) == nodes for r, nodes in strategy.sampled.items())
    assert all(sum(plan.values()) == 24 for plan in strategy.plans.values())
    assert {k for _, config in SEEN for k in config} == {"lr", "proximal-mu", "server-round", "lbbsp-batch-size",
                                                         "lbbsp-local-steps"}
    # each round adds the replies' data-weighted mean of their node ids (data size 10 x node x round)
    expected = sum(sum(n * n for n in nodes if (r, n) != (2, failed)) / sum(n for n in nodes if (r, n) != (2, failed))
                   for r, nodes in strategy.sampled.items())
    assert result.arrays.to_numpy_ndarrays()[0][0] == pytest.approx(expected)
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3, 4]
    assert all(sorted(m) == ["train-acc", "train-loss"] for m in result.train_metrics_clientapp.values())
    assert evaluated == [0, 1, 2, 3, 4] and sorted(result.evaluate_metrics_serverapp) == [0, 2, 4]
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2, 3, 4]
    assert {s.status for s in statuses.values()} == {"ok"} and {s.round for s in statuses.values()} == {4}


@pytest.mark.timeout(60)
def test_a_round_a_wrapper_around_load_balanced_skips_is_logged_and_not_kept(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        inner = LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3), history,
                             batch_size=4)
        # DP skips a round with an error
        result = start_rounds(dp(inner, 3), porting_app(raises_in=2), nodes=3, rounds=3)
        assert {s.round for s in history.statuses().values()} == {3}
    assert sorted(result.train_metrics_clientapp) == [1, 3]
    skipped = [r.getMessage() for r in caplog.records if "lbbsp round 2: no replies reached" in r.getMessage()]
    assert len(skipped) == 1 and "nothing of it is recorded" in skipped[0]
    assert not inner._pending  # round 2's arrays are not held for the rest of the start_rounds


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


def _message(config_key: str = "config", **others: ConfigRecord) -> Message:
    LocalGrid(ClientApp(), [{}])  # sets Flower's task identity so that messages can be built here
    records = {"arrays": ArrayRecord([np.zeros(1)]), config_key: ConfigRecord(Workload(4, 2).to_config()), **others}
    return Message(RecordDict(records), dst_node_id=1, message_type=MessageType.TRAIN)


def test_a_load_balanced_strategy_is_not_wrapped_again(redis_url: str, job: str) -> None:
    """The outer one had planned "equal split (no measurements yet)" every round and warned that the clients replied
    without lbbsp's metrics."""
    with ClientHistory.from_url(redis_url, job) as history:
        inner = LoadBalanced(fedavg(), history, batch_size=8)
        with pytest.raises(ConfigError, match=r"strategy is a LoadBalanced already: wrap the Flower strategy itself"):
            LoadBalanced(inner, history, batch_size=8)


@pytest.mark.parametrize("default", [None, Workload(2, 1)])
def test_a_config_key_naming_another_record_says_where_the_workload_is(default: Workload | None) -> None:
    """It had said "is missing from the train config: wrap the server's strategy in LoadBalanced" (it was wrapped),
    or, with a default, run the default workload."""
    msg = _message("config", **{"train-config": ConfigRecord({"lr": 0.1})})
    with pytest.raises(ConfigError, match=r"config_key 'train-config' names no ConfigRecord .* lbbsp's workload is in "
                                          r"ConfigRecord 'config': pass config_key='config', or leave it None"):
        LocalRound(msg, config_key="train-config", default=default)
    with pytest.raises(ConfigError, match=r"config_key 'nope' .* lbbsp's workload is in ConfigRecord 'config'"):
        LocalRound(msg, config_key="nope", default=default)
    assert LocalRound(msg, config_key="config").workload == Workload(4, 2)  # the right name, given or found
    assert LocalRound(msg).workload == Workload(4, 2)


def test_a_config_key_of_no_record_under_a_plain_strategy_lists_the_records() -> None:
    LocalGrid(ClientApp(), [{}])
    msg = Message(RecordDict({"arrays": ArrayRecord([np.zeros(1)]), "config": ConfigRecord({"lr": 0.1})}),
                  dst_node_id=1, message_type=MessageType.TRAIN)
    with pytest.raises(ConfigError, match=r"config_key 'cfg' .*: the message's ConfigRecords are \['config'\]"):
        LocalRound(msg, config_key="cfg", default=Workload(2, 1))
    # the user's own record, named, under a plain strategy: its default runs, as before
    assert LocalRound(msg, config_key="config", default=Workload(2, 1)).workload == Workload(2, 1)


def test_an_lbbsp_metric_in_the_reply_is_told_apart_from_the_weight_key() -> None:
    """Both had been told to pass their data size as LocalRound(data_size=...), which fits num-examples only."""
    rnd = LocalRound(_message())
    for _ in rnd.batches():
        pass
    with pytest.raises(ConfigError, match=r"metrics must not set \['lbbsp-samples'\]: keys that start with 'lbbsp-' "
                                          r"are lbbsp's own .*; rename yours$") as own:
        rnd.reply(ArrayRecord([np.zeros(1)]), {"lbbsp-samples": 3})
    assert "data_size" not in str(own.value)
    with pytest.raises(ConfigError, match=r"metrics must not set \['num-examples'\]: .*LocalRound\(data_size=\.\.\.\)"):
        rnd.reply(ArrayRecord([np.zeros(1)]), {"num-examples": 3})
