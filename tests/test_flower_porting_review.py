"""Porting a real Flower app (flwr 1.42, Message API) to lbbsp as docs/flower.md says, on LocalGrid: clients that
read their own config keys and collect more data, a client that raises, partial sampling with evaluation every k
rounds, a strategy wrapped twice (LoadBalanced around a DP wrapper), restarts and two jobs on one Redis, and a
model of several MB whose transfer times follow its real size."""
from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg, FedProx, Strategy

from lbbsp import ConfigError
from lbbsp.integrations.flower import ClientHistory, EmulatedLink, LoadBalanced, LocalRound
from lbbsp.integrations.flower_local import LocalGrid

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


def run(strategy: Strategy, client: ClientApp, nodes: int, rounds: int, **kwargs: object) -> object:
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
        result = run(LoadBalanced(dp(inner, 2), history, batch_size=4, local_steps=2), porting_app("n-samples"),
                     nodes=2, rounds=1)
    # weighted by the data sizes 10 and 20 (not the 8 samples each processed): (10 x 1 + 20 x 2) / 30
    assert result.arrays.to_numpy_ndarrays()[0][0] == pytest.approx(50 / 30)
    assert sorted(result.train_metrics_clientapp[1]) == ["train-acc", "train-loss"]
    assert {k for _, config in SEEN for k in config} == {"lr", "server-round", "lbbsp-batch-size",
                                                         "lbbsp-local-steps"}


@pytest.mark.timeout(60)
def test_a_wrapped_strategy_that_waits_for_more_nodes_than_a_local_grid_has_is_a_config_error(
        redis_url: str, job: str) -> None:
    inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=5, min_train_nodes=2)
    with ClientHistory.from_url(redis_url, job) as history:
        with pytest.raises(ConfigError, match=r"waits for 5 nodes .* this LocalGrid has 3"):
            run(LoadBalanced(dp(inner, 2), history, batch_size=4), porting_app(), nodes=3, rounds=1)


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
        result = run(strategy, porting_app(raises_in=2), nodes=6, rounds=4, evaluate_fn=every_second_round)
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
def test_two_jobs_on_one_redis_stay_apart_and_a_restart_carries_on_its_own_jobs_history(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    def serve(name: str, nodes: int, rounds: int) -> None:
        with ClientHistory.from_url(redis_url, name) as history:
            run(LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes), history,
                             batch_size=4), porting_app(), nodes=nodes, rounds=rounds)

    servers = [threading.Thread(target=serve, args=(f"{job}-a", 2, 2)),
               threading.Thread(target=serve, args=(f"{job}-b", 3, 1))]
    for server in servers:
        server.start()
    for server in servers:
        server.join()
    with ClientHistory.from_url(redis_url, f"{job}-a") as a, ClientHistory.from_url(redis_url, f"{job}-b") as b:
        assert sorted(a.workers()) == ["1", "2"] and sorted(b.workers()) == ["1", "2", "3"]
        assert [r.iteration for r in a.reports(a.worker_index(1))] == [1, 2]
        assert [r.iteration for r in b.reports(b.worker_index(1))] == [1]
    caplog.clear()
    serve(f"{job}-a", 2, 1)  # job a restarted: its rounds and its model carry on, job b's history is untouched
    assert not [r for r in caplog.records if "no measurements yet" in r.getMessage()]
    with ClientHistory.from_url(redis_url, f"{job}-a") as a, ClientHistory.from_url(redis_url, f"{job}-b") as b:
        assert [r.iteration for r in a.reports(a.worker_index(1))] == [1, 2, 3]
        assert {s.round for s in b.statuses().values()} == {1}


@pytest.mark.timeout(60)
def test_a_large_models_transfer_estimates_follow_its_real_size(redis_url: str, job: str) -> None:
    model = ArrayRecord([np.zeros((500, 1000), np.float32), np.zeros(1000, np.float32)])  # 2 MB
    nbytes = model.count_bytes()
    bandwidth = {1: 40e6, 2: 20e6}  # bytes/s each way: 0.05 s and 0.1 s per direction
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        rnd = LocalRound(msg, link=EmulatedLink(bandwidth[context.node_id], bandwidth[context.node_id]), data_size=10)
        for _ in rnd.batches():
            pass
        return rnd.reply(msg.content.array_records["arrays"], {"train-loss": 0.5})

    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2), history,
                                batch_size=4)
        grid = LocalGrid(app, [{}, {}])
        try:
            strategy.start(grid=grid, initial_arrays=model, num_rounds=1, timeout=30)
        finally:
            grid.close()
        for node, bps in bandwidth.items():
            (report,) = history.reports(history.worker_index(node))
            assert report.features["download_s"] == pytest.approx(nbytes / bps)
            assert report.features["upload_s"] == pytest.approx(nbytes / bps)
            assert strategy.model.transfer_s([history.worker_index(node)])[0] == pytest.approx(2 * nbytes / bps)
    assert 2_004_000 <= nbytes < 2_010_000  # the arrays' bytes, plus a small header each


@pytest.mark.timeout(60)
def test_a_round_a_wrapper_around_load_balanced_skips_is_logged_and_not_kept(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        inner = LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3), history,
                             batch_size=4)
        result = run(dp(inner, 3), porting_app(raises_in=2), nodes=3, rounds=3)  # DP skips a round with an error
        assert {s.round for s in history.statuses().values()} == {3}
    assert sorted(result.train_metrics_clientapp) == [1, 3]
    skipped = [r.getMessage() for r in caplog.records if "lbbsp round 2: no replies reached" in r.getMessage()]
    assert len(skipped) == 1 and "nothing of it is recorded" in skipped[0]
    assert not inner._pending  # round 2's arrays are not held for the rest of the run
