"""What a user runs into with the Flower plugin, on LocalGrid (real Strategy.start loop, real ClientApps): bounds and
arguments checked up front, plain Flower clients next to lbbsp ones, missing data sizes, a Redis outage (or one that
refuses writes), restarts that carry the round numbers on, MessageClock and skewed client clocks, a large model's
transfer estimates, and the logs."""
from __future__ import annotations

import logging
import math
import re
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg, Strategy

from lbbsp import ConfigError, EmbeddedRedis, Report, StoreUnavailable
from lbbsp.integrations.flower import ClientHistory, EmulatedLink, LoadBalanced, LocalRound, Workload
from lbbsp.integrations.flower_client import MessageClock
from lbbsp.integrations.flower_local import LocalGrid
from lbbsp.protocol import MAX_SECONDS
from test_flower_messages import HONEST, reply
from test_flower_port import SEEN

DOCS = Path(__file__).resolve().parents[1] / "docs" / "flower.md"
#: node -> how its ClientApp replies: "lbbsp" (LocalRound with a data size of 10 x node), "no-data" (LocalRound
#: without one) or "plain" (a plain Flower ClientApp: num-examples = 10 x node, no lbbsp metrics)
KIND: dict[int, str] = {}


def make_app() -> ClientApp:
    """Each node adds its id to every weight once per round: the aggregate shows who was weighted how."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node = context.node_id
        w = msg.content["arrays"].to_numpy_ndarrays()[0] + node
        if KIND.get(node, "lbbsp") == "plain":
            metrics = MetricRecord({"num-examples": 10 * node, "train-loss": 1.0})
            return Message(RecordDict({"arrays": ArrayRecord([w]), "metrics": metrics}), reply_to=msg)
        local = LocalRound(msg, data_size=10 * node if KIND.get(node, "lbbsp") == "lbbsp" else None)
        for batch_size in local.batches():
            time.sleep(batch_size * 0.0002 * node)
        return local.reply(ArrayRecord([w]), {"train-loss": 1.0})

    return app


def start(strategy: Strategy, nodes: int, rounds: int) -> tuple[np.ndarray | None, dict[int, dict[str, object]]]:
    """Run ``rounds`` rounds on ``nodes`` nodes from w = 0; the final weight and the aggregated train metrics."""
    grid = LocalGrid(make_app(), [{} for _ in range(nodes)])
    try:
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(1)]), num_rounds=rounds, timeout=30)
    finally:
        grid.close()
    w = result.arrays.to_numpy_ndarrays()[0] if len(result.arrays) else None
    return w, {r: dict(m) for r, m in result.train_metrics_clientapp.items()}


def fedavg(nodes: int) -> FedAvg:
    return FedAvg(fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes)


def messages(caplog: pytest.LogCaptureFixture, pattern: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if re.search(pattern, r.getMessage())]


@pytest.fixture(autouse=True)
def _clients() -> None:
    KIND.clear()


@pytest.mark.parametrize("kwargs", [
    {"min_size": 64}, {"max_size": 16}, {"adapt": "steps", "local_steps": 5, "min_size": 8},
    {"adapt": "steps", "local_steps": 5, "max_size": 3},
    {"min_size": 2.5}, {"min_size": True}, {"min_size": 0}, {"max_size": "40"},
    {"deadline_slack": float("nan")}, {"deadline_slack": math.inf}, {"deadline_slack": "2"}, {"deadline_slack": 0.5},
    {"compensate_dropouts": "no"}, {"weight_by": "size"}, {"strategy": None}, {"history": "redis://x:6379/0"},
])
def test_bad_arguments_are_config_errors(redis_url: str, job: str, kwargs: dict[str, object]) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        args = {"strategy": FedAvg(), "history": history, "batch_size": 32, **kwargs}
        with pytest.raises(ConfigError):
            LoadBalanced(**args)  # type: ignore[arg-type]


def test_compensation_and_the_equal_split_stay_within_max_size(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(), history, batch_size=32, max_size=40, compensate_dropouts=True)
        workers = [history.worker_index(n) for n in (1, 2, 3)]
        for _ in range(2):  # availability 0.64: 150 in total would bring the nominal 96 back, 120 is all it may
            strategy.model.record_outcomes(dict.fromkeys(workers, False))
        assert [w.batch_size for w in strategy.plan(1, [1, 2, 3]).values()] == [40, 40, 40]  # equal, not 3 x 50
        strategy.model.partial_fit([Report(job, w, 1, 96, 0.1 * (i + 1)) for i, w in enumerate(workers)])
        assert [w.batch_size for w in strategy.plan(2, [1, 2, 3]).values()] == [40, 40, 40]


def test_a_huge_deadline_slack_is_clamped(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(), history, batch_size=32, deadline_slack=1e12)
        strategy.model.partial_fit([Report(job, history.worker_index(n), 1, 32, 0.5) for n in (1, 2)])
        assert {w.deadline_s for w in strategy.plan(2, [1, 2]).values()} == {MAX_SECONDS}


@pytest.mark.timeout(120)
def test_plain_flower_clients_are_aggregated_and_not_failed(redis_url: str, job: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    KIND.update({1: "plain", 2: "plain", 3: "lbbsp"})
    with ClientHistory.from_url(redis_url, job) as history:
        w, metrics = start(LoadBalanced(fedavg(3), history, batch_size=4), nodes=3, rounds=2)
        assert {s.status for s in history.statuses().values()} == {"ok"}
    # each round adds (10 * 1 + 20 * 2 + 30 * 3) / 60: plain weights are their num-examples, node 3's its data size
    assert w is not None and w[0] == pytest.approx(2 * 140 / 60)
    assert len(messages(caplog, r"nodes \[1, 2\] reply without lbbsp's metrics")) == 1  # said once, not per round
    assert all(not key.startswith("lbbsp-") for m in metrics.values() for key in m)


@pytest.mark.timeout(120)
def test_replies_with_and_without_a_data_size_aggregate_together(redis_url: str, job: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    KIND.update({1: "lbbsp", 2: "no-data"})
    with ClientHistory.from_url(redis_url, job) as history:
        w, metrics = start(LoadBalanced(fedavg(2), history, batch_size=4), nodes=2, rounds=1)
    assert w is not None and w[0] == pytest.approx((10 * 1 + 4 * 2) / 14)  # node 2 weighted by its 4 samples
    assert sorted(metrics[1]) == ["train-loss"]
    assert len(messages(caplog, r"nodes \[2\] report no data size")) == 1


@pytest.mark.timeout(120)
def test_weight_by_data_without_data_sizes_still_trains(redis_url: str, job: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    KIND.update({1: "no-data", 2: "no-data"})
    with ClientHistory.from_url(redis_url, job) as history:
        w, _ = start(LoadBalanced(fedavg(2), history, batch_size=4, weight_by="data"), nodes=2, rounds=2)
    assert w is not None and w[0] > 2  # trained in both rounds, by samples processed
    warned = [r for r in caplog.records if "report no data size" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


@pytest.mark.timeout(120)
def test_a_redis_outage_does_not_stop_a_run_that_meets_new_clients(job: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    with EmbeddedRedis() as server, ClientHistory.from_url(server.url, job) as history:
        strategy = LoadBalanced(fedavg(4), history, batch_size=4)
        known = [history.worker_index(n) for n in (1, 2)]
        server.stop()
        w, _ = start(strategy, nodes=4, rounds=2)  # nodes 3 and 4 were never seen
        assert w is not None and w[0] == pytest.approx(2 * 3.0)  # weighted by data sizes 10 n: 300 / 100 a round
        assert len(messages(caplog, r"node [34] gets a temporary index")) == 2
        strategy.plan(3, [1, 2, 3, 4])
        assert messages(caplog, r"lbbsp round 3: .*predicted round")  # planned from round 1's measurements
        server.start()
        strategy.plan(4, [1, 2, 3, 4])
        assert sorted(history.workers().values()) == [*known, 2, 3]  # real indices once Redis is back


@pytest.mark.timeout(120)
def test_statuses_count_rounds_across_restarts_like_reports(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        start(LoadBalanced(fedavg(2), history, batch_size=4), nodes=2, rounds=2)
        start(LoadBalanced(fedavg(2), history, batch_size=4), nodes=2, rounds=1)
        assert {s.round for s in history.statuses().values()} == {3}
        assert [r.iteration for r in history.reports(0)] == [1, 2, 3]


@pytest.mark.timeout(120)
def test_the_plan_log_names_nodes_and_the_measured_round_time(redis_url: str, job: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        start(LoadBalanced(fedavg(3), history, batch_size=8, sit_out=0.1), nodes=3, rounds=2)
    assert messages(caplog, r"lbbsp round 1: equal split .*batch size by node \{1: 8, 2: 8, 3: 8\}$")
    assert messages(caplog, r"lbbsp round 2: took [0-9.e-]+s \(predicted [0-9.e-]+s\)")
    assert len(messages(caplog, r"sit_out=0.1 of 3 sampled clients rounds down to no client.*from 10 sampled")) == 1


def train_message(values: int, delivered_after_s: float) -> Message:
    """A train message of ``values`` float64 parameters, made ``delivered_after_s`` before it reaches the client."""
    LocalGrid(make_app(), [{}])  # sets Flower's task identity so that messages can be built here
    config = ConfigRecord({**Workload(4, 1).to_config(), "server-round": 1})
    msg = Message(RecordDict({"arrays": ArrayRecord([np.zeros(values)]), "config": config}), dst_node_id=1,
                  message_type=MessageType.TRAIN)
    msg.metadata.created_at = time.time() - delivered_after_s
    return msg


@pytest.mark.timeout(60)
def test_message_clock_reports_delivery_as_overhead_and_no_upload() -> None:
    local = LocalRound(train_message(1000, 0.5))  # delivered and started half a second after it was made
    list(local.batches())
    metrics = local.reply(ArrayRecord([np.zeros(1000)])).content["metrics"]
    assert 0.5 <= metrics["lbbsp-download-s"] < 5 and metrics["lbbsp-upload-s"] == 0.0


@pytest.mark.timeout(60)
def test_an_emulated_link_can_count_the_real_delivery_as_well() -> None:
    msg = train_message(10, 2.0)  # reached the ClientApp 2 s after the server made it
    assert EmulatedLink(1e6, 1e6).download(msg) < 0.5  # the 80 bytes' emulated transfer only
    assert 2.0 <= EmulatedLink(1e6, 1e6, count_delivery=True).download(msg) < 5.0


@pytest.mark.timeout(120)
def test_the_docs_recording_variant_runs(redis_url: str, job: str) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    snippet = next(b for b in blocks if "class Recording(LoadBalanced)" in b)
    namespace: dict[str, object] = {"LoadBalanced": LoadBalanced}
    exec(snippet, namespace)  # the docs page's own code
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = namespace["Recording"](fedavg(2), history, batch_size=4)  # type: ignore[operator]
        start(strategy, nodes=2, rounds=2)
    assert sorted(strategy.plans) == [1, 2]


def test_work_moves_between_clients_only_where_it_buys_round_time(redis_url: str, job: str) -> None:
    def planned(speeds: list[float], transfer_s: float) -> list[int]:
        with ClientHistory.from_url(redis_url, f"{job}-{transfer_s}") as history:
            strategy = LoadBalanced(fedavg(3), history, batch_size=32)
            workers = [history.worker_index(node) for node in (1, 2, 3)]
            strategy.model.partial_fit([Report(history.job, w, 1, 32, 32 / speed,
                                               features={"download_s": transfer_s / 2, "upload_s": transfer_s / 2})
                                        for w, speed in zip(workers, speeds)])
            return [w.batch_size for w in strategy.plan(2, [1, 2, 3]).values()]

    # 4 s of transfers and at most 32 ms of compute: balancing would gain under 1%, so the split stays equal
    assert planned([1000.0, 2000.0, 3000.0], 4.0) == [32, 32, 32]
    # compute sets the round: the faster a client, the more it gets
    sizes = planned([100.0, 200.0, 300.0], 0.01)
    assert sum(sizes) == 96 and sizes[0] < sizes[1] < sizes[2]


@pytest.mark.timeout(60)
def test_a_redis_that_refuses_writes_is_an_outage_the_rounds_go_on_through(job: str) -> None:
    with EmbeddedRedis() as server, ClientHistory.from_url(server.url, job) as history:
        grid = LocalGrid(ClientApp(), [{}, {}])
        strategy = LoadBalanced(FedAvg(min_available_nodes=2), history, batch_size=8, local_steps=5)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                             ConfigRecord(), grid)}
        config = server.command_name("CONFIG")  # the embedded server's secret name for CONFIG
        history.client.execute_command(config, "SET", "maxmemory-policy", "noeviction")
        history.client.execute_command(config, "SET", "maxmemory", "1")  # every write is refused: OOM
        arrays, _ = strategy.aggregate_train(1, [reply(sent[n], ArrayRecord([np.full(1, float(n))]), HONEST)
                                                 for n in (1, 2)])
        assert arrays is not None and arrays.to_numpy_ndarrays()[0][0] == 1.5
        assert len(list(strategy.configure_train(2, arrays, ConfigRecord(), grid))) == 2
        grid.close()


@pytest.mark.timeout(60)
def test_a_second_start_carries_the_round_numbers_on(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(min_available_nodes=2), history, batch_size=8, local_steps=5)
        for _ in range(2):  # as two start() calls do: each begins at server round 1
            grid = LocalGrid(ClientApp(), [{}, {}])
            for server_round in (1, 2):
                sent = list(strategy.configure_train(server_round, ArrayRecord([np.zeros(1)]), ConfigRecord(), grid))
                strategy.aggregate_train(server_round, [reply(m, ArrayRecord([np.zeros(1)]), HONEST) for m in sent])
            grid.close()
        iterations = [report.iteration for report in history.reports(history.worker_index(1))]
    assert iterations == [1, 2, 3, 4]  # the second run's rounds had been stored as 1 and 2 again


def test_a_skewed_client_clock_gives_a_download_time_a_report_can_carry() -> None:
    message = Message(RecordDict({"arrays": ArrayRecord([np.zeros(1)])}), dst_node_id=1, message_type="train",
                      group_id=str(uuid.uuid4()))
    message.metadata.created_at = time.time() - 2 * 86_400  # seen from a client whose clock runs two days ahead
    assert MessageClock().download(message) == MAX_SECONDS  # more would make the server refuse the whole reply
    message.metadata.created_at = time.time() + 3_600  # and one running behind
    assert MessageClock().download(message) == 0.0


@pytest.fixture(autouse=True)
def _seen() -> None:
    SEEN.clear()


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


def test_load_balanced_built_while_redis_is_down_says_it_needs_redis_then() -> None:
    """It had failed inside the constructor with "Redis unusable (ConnectionError): Error 111 ..." and no hint."""
    with ClientHistory.from_url("redis://127.0.0.1:1/0", "walkthrough", socket_timeout_s=1.0) as history:
        with pytest.raises(StoreUnavailable, match=r"LoadBalanced loads the stored client history when it is built, "
                                                   r"so Redis must answer then: check the URL and that redis-server "
                                                   r"runs there \(or use EmbeddedRedis\(\)\.url\)\. Redis unusable "
                                                   r"\(ConnectionError\): .*127\.0\.0\.1:1") as raised:
            LoadBalanced(FedAvg(), history)
    assert isinstance(raised.value.__cause__, StoreUnavailable) and raised.value.job == "walkthrough"


def _train_to_nothing(msg: Message, context: Context) -> Message:
    rnd = LocalRound(msg, link=EmulatedLink(1e9, 1e9))
    for _ in rnd.batches():
        pass
    return rnd.reply(ArrayRecord([np.zeros(1)]))


@pytest.mark.timeout(60)
def test_a_plan_override_that_sizes_the_nodes_itself_is_sent_and_recorded(redis_url: str, job: str) -> None:
    """plan() is an extension point: an override that never calls LoadBalanced.plan had no worker indices looked up
    for its nodes; they are looked up after it, and its workloads are what the clients train and report."""
    planned: list[int] = []

    class FixedPlan(LoadBalanced):
        def plan(self, server_round: int, nodes: list[int]) -> dict[int, Workload]:
            planned.extend(nodes)
            return {node: Workload(4 * node, 2) for node in nodes}

    app = ClientApp()
    app.train()(_train_to_nothing)
    grid = LocalGrid(app, [{}, {}])
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = FixedPlan(FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2), history)
        try:
            strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(1)]), num_rounds=1, timeout=30)
        finally:
            grid.close()
        reports = {node: history.reports(history.worker_index(node)) for node in (1, 2)}
        statuses = {node: history.statuses()[history.worker_index(node)].status for node in (1, 2)}
    assert sorted(planned) == [1, 2]
    assert {node: [r.samples for r in rs] for node, rs in reports.items()} == {1: [8], 2: [16]}  # 2 steps of 4 n
    assert statuses == {1: "ok", 2: "ok"}


@pytest.mark.timeout(60)
def test_a_query_answer_without_hardware_is_logged_and_the_nodes_still_train(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """An ``@app.query()`` of the user's own, which answers without lbbsp's hardware record, is no hardware: the nodes
    are planned as typical clients, in one line that says why, and their round goes on."""
    app = ClientApp()
    app.train()(_train_to_nothing)

    @app.query()
    def _query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"answer": MetricRecord({"free-disk-gb": 12})}), reply_to=msg)

    grid = LocalGrid(app, [{}, {}])
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2), history,
                                batch_size=8, ask_hardware_s=5.0)
        try:
            strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(1)]), num_rounds=1, timeout=30)
        finally:
            grid.close()
        assert {s.status for s in history.statuses().values()} == {"ok"}
    logged = [r.getMessage() for r in caplog.records if "gave no hardware" in r.getMessage()]
    assert logged == ["lbbsp round 1: nodes [1, 2] gave no hardware (lbbsp-hardware: is missing from the answer): "
                      "planned as typical clients"]
