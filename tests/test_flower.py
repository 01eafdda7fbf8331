"""The Flower plugin end to end on LocalGrid: real Strategy.start loop, real ClientApp, in one process. LoadBalanced
plans each client's workload and LocalRound trains exactly on it, through clients that sit rounds out for a slow
link, fail or vanish, local deadlines, a short last batch, hostile metrics, and a Redis restart under the history."""
from __future__ import annotations

import threading
import time
from collections import defaultdict

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from lbbsp import EmbeddedRedis, ProtocolError, Report
from lbbsp.integrations.flower import (
    ClientHistory,
    ClientResult,
    ClientStatus,
    EmulatedLink,
    LoadBalanced,
    LocalRound,
    Workload,
)
from lbbsp.integrations.flower_local import LocalGrid

SECONDS_PER_SAMPLE = {1: 0.0002, 2: 0.0006, 3: 0.0018}  # emulated client speeds: 5,000 to 556 samples/s
trained: dict[tuple[int, int], list[int]] = defaultdict(list)  # (round, node) -> batch size of each step
lock = threading.Lock()
behaviour: dict[tuple[int, int], str] = {}  # (round, node) -> "raise" | "hang"
slow_links: set[int] = set()  # nodes whose model transfers take about 0.5 s each way


def make_app() -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node, rnd = context.node_id, int(msg.content["config"]["server-round"])
        if behaviour.get((rnd, node)) == "raise":
            raise RuntimeError("device went away")
        if behaviour.get((rnd, node)) == "hang":
            time.sleep(4)
        bps = 32.0 if node in slow_links else 1e7  # the 16-byte model
        local = LocalRound(msg, link=EmulatedLink(bps, bps))
        w = msg.content["arrays"].to_numpy_ndarrays()[0]
        for batch_size in local.batches():
            with lock:
                trained[(rnd, node)].append(batch_size)
            time.sleep(batch_size * SECONDS_PER_SAMPLE[node])
            w = w + 0.01 * batch_size
        return local.reply(ArrayRecord([w]))

    return app


class RecordingStrategy(LoadBalanced):
    """Keeps every plan and every message sent, to compare with what the clients did."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.plans: dict[int, dict[int, Workload]] = {}
        self.sent: dict[int, list[Message]] = {}

    def plan(self, server_round: int, nodes: list[int]) -> dict[int, Workload]:
        self.plans[server_round] = super().plan(server_round, nodes)
        return self.plans[server_round]

    def configure_train(self, server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
        self.sent[server_round] = list(super().configure_train(server_round, arrays, config, grid))
        return self.sent[server_round]


def run(history: ClientHistory, rounds: int, timeout: float = 30.0, **kwargs: object) -> RecordingStrategy:
    grid = LocalGrid(make_app(), [{}, {}, {}])
    strategy = RecordingStrategy(FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3), history,
                                 batch_size=40, local_steps=3, **kwargs)  # type: ignore[arg-type]
    strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(2)]), num_rounds=rounds, timeout=timeout)
    grid.close()
    return strategy


@pytest.mark.timeout(120)
def test_each_client_gets_its_own_config_and_trains_exactly_on_it(redis_url: str, job: str) -> None:
    trained.clear()
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = run(history, rounds=3)
    for rnd in (1, 2, 3):
        messages = strategy.sent[rnd]
        configs = [m.content["config"] for m in messages]
        assert len({id(c) for c in configs}) == 3, "one ConfigRecord object shared by several clients"
        assert all(c["server-round"] == rnd for c in configs)
        for message in messages:
            node, work = message.metadata.dst_node_id, strategy.plans[rnd][message.metadata.dst_node_id]
            assert message.content["config"]["lbbsp-batch-size"] == work.batch_size
            assert trained[(rnd, node)] == [work.batch_size] * work.local_steps
        assert sum(w.batch_size for w in strategy.plans[rnd].values()) == 120
    later = strategy.plans[3]
    assert len({w.batch_size for w in later.values()}) == 3, "measured speeds differ 9x, so must the batches"
    assert later[1].batch_size > later[2].batch_size > later[3].batch_size


@pytest.mark.timeout(120)
def test_a_client_with_a_slow_link_sits_rounds_out_and_the_others_share_its_samples(redis_url: str,
                                                                                    job: str) -> None:
    trained.clear()
    slow_links.add(2)
    try:
        with ClientHistory.from_url(redis_url, job) as history:
            strategy = run(history, rounds=4, sit_out=0.34, rejoin_after=2)  # one of three may sit out, twice
            statuses = history.statuses()
            index = {int(node): i for node, i in history.workers().items()}
    finally:
        slow_links.clear()
    assert set(strategy.plans[1]) == {1, 2, 3}  # no measurements yet: everyone is asked
    for rnd in (2, 3):  # node 2's 1 s of transfers outlast the others' rounds: it is not even sent the round
        assert set(strategy.plans[rnd]) == {1, 3}
        assert {m.metadata.dst_node_id for m in strategy.sent[rnd]} == {1, 3}
        assert (rnd, 2) not in trained
        assert sum(w.batch_size for w in strategy.plans[rnd].values()) == 120  # the round total stays
    assert strategy.model.availability([index[2]]).tolist() == [1.0]  # sitting out is no failure
    # out two rounds in a row, it is asked in round 4 (which renews its estimate), and trains on its data
    assert set(strategy.plans[4]) == {1, 2, 3} and (4, 2) in trained
    assert statuses[index[2]].round == 4 and statuses[index[2]].status == "ok"
    # with every link fast, sitting out would only slow the round: all three are asked
    with ClientHistory.from_url(redis_url, job + "-fast") as history:
        fast = run(history, rounds=2, sit_out=0.34)
    assert set(fast.plans[2]) == {1, 2, 3}


@pytest.mark.timeout(120)
def test_failed_and_vanished_clients_do_not_stall_the_round_and_keep_history(redis_url: str, job: str) -> None:
    behaviour.clear()
    behaviour[(2, 3)] = "raise"
    behaviour[(3, 2)] = "hang"
    with ClientHistory.from_url(redis_url, job) as history:
        started = time.monotonic()
        strategy = run(history, rounds=3, timeout=1.5)
        assert time.monotonic() - started < 12, "a vanished client held the round past its timeout"
        statuses = history.statuses()
        workers = history.workers()
        index = {int(node): i for node, i in workers.items()}
        # availability, from "available" (1) by 0.2 per round: 3 failed round 2, 2 missed round 3
        available = strategy.model.availability([index[1], index[2], index[3]])
        np.testing.assert_allclose(available, [1.0, 0.8, 0.2 + 0.8 * 0.8])
        assert statuses[index[3]].status == "ok" and statuses[index[3]].round == 3
        assert statuses[index[2]] == ClientStatus(3, "missed", "no reply before the timeout", statuses[index[2]].at)
        assert [r.iteration for r in history.reports(index[2])] == [1, 2]  # kept after it vanished
        assert [r.iteration for r in history.reports(index[3])] == [1, 3]  # the failed round 2 left out
        # A restarted server learns from the stored history before its first round.
        restarted = LoadBalanced(FedAvg(), history, batch_size=40, local_steps=3)
        assert set(np.flatnonzero(np.isfinite(restarted.model.speed_)).tolist()) == set(index.values())
        assert restarted.model.availability([index[1], index[2], index[3]]).tolist() == [1.0, 0.8, 1.0]
        plan = restarted.plan(1, [1, 2, 3])
        assert plan[1].batch_size > plan[3].batch_size
        assert sum(w.batch_size for w in plan.values()) == 120
        # compensating dropouts: a larger total, whose samples expected back make the nominal 120
        compensating = LoadBalanced(FedAvg(), history, batch_size=40, local_steps=3, compensate_dropouts=True)
        raised = compensating.plan(1, [1, 2, 3])
        sizes = np.array([raised[n].batch_size for n in (1, 2, 3)])
        expected_back = float(compensating.model.availability([index[n] for n in (1, 2, 3)]) @ sizes)
        assert sizes.sum() > 120 and 120 <= expected_back < 122  # the smallest such total, not just any
    behaviour.clear()


@pytest.mark.timeout(60)
def test_deadline_stops_local_steps_early() -> None:
    LocalGrid(make_app(), [{}])  # sets Flower's task identity so that messages can be built here
    config = ConfigRecord({**Workload(4, 50, deadline_s=0.5).to_config(), "server-round": 1})
    msg = Message(RecordDict({"arrays": ArrayRecord([np.zeros(2)]), "config": config}), dst_node_id=1,
                  message_type=MessageType.TRAIN)
    local = LocalRound(msg, link=EmulatedLink(1e9, 1e9))
    steps = []
    for _ in local.batches():
        started = time.perf_counter()
        time.sleep(0.05)
        steps.append(time.perf_counter() - started)
    assert 2 <= local.steps == len(steps) < 50  # ~10 steps of 50: it stopped before the deadline would pass
    metrics = local.reply(ArrayRecord([np.zeros(2)])).content["metrics"]
    assert metrics["lbbsp-samples"] == metrics["num-examples"] == 4 * local.steps
    # a step runs only if the mean so far says it fits, so only the last step can overrun (a loaded machine's
    # wake-ups vary: the bound is the slowest step seen, not a fixed margin)
    assert metrics["lbbsp-compute-s"] <= 0.5 + max(steps)


@pytest.mark.parametrize("config", [{"lbbsp-batch-size": 0, "lbbsp-local-steps": 1},
                                    {"lbbsp-batch-size": 3.5, "lbbsp-local-steps": 1},
                                    {"lbbsp-batch-size": 8},
                                    {"lbbsp-batch-size": 8, "lbbsp-local-steps": 1, "lbbsp-deadline-s": -1.0}])
def test_bad_workloads_are_rejected(config: dict[str, float]) -> None:
    with pytest.raises(ProtocolError):
        Workload.from_config(config)


@pytest.mark.timeout(60)
def test_hostile_reply_metrics_are_partitioned_out(redis_url: str, job: str) -> None:
    grid = LocalGrid(make_app(), [{}, {}])
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(min_available_nodes=2), history, batch_size=2, local_steps=1)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                             ConfigRecord(), grid)}
        good = {"lbbsp-samples": 2, "lbbsp-steps": 1, "lbbsp-compute-s": 0.1, "lbbsp-download-s": 0.0,
                "lbbsp-upload-s": 0.0, "num-examples": 2}
        replies = [Message(RecordDict({"arrays": ArrayRecord([np.ones(1) * node]),
                                       "metrics": MetricRecord({**good, "lbbsp-compute-s": value})}),
                           reply_to=sent[node]) for node, value in ((1, 0.1), (2, float("nan")))]
        arrays, _ = strategy.aggregate_train(1, replies)
        assert arrays is not None and arrays.to_numpy_ndarrays()[0][0] == 1.0  # node 2 left out
        assert history.statuses()[history.worker_index(2)].status == "failed"
    grid.close()


def test_history_validates_what_it_reads_and_survives_a_redis_restart(job: str) -> None:
    with EmbeddedRedis() as server:
        with ClientHistory.from_url(server.url, job) as history:
            worker = history.worker_index(123456789)
            assert history.worker_index("123456789") == worker
            history.record([Report(job, worker, 1, 64, 0.5, features={"download_s": 0.1, "upload_s": 0.2})],
                           {worker: ClientStatus(1, "ok", "", time.time())})
            history.client.rpush(history.key("reports", worker), b'{"v":1,"job":"x"}', b"\xff" * 10)
            history.client.hset(history.key("status"), "7", b'{"round": "pickle"}')
        server.restart()
        with ClientHistory.from_url(server.url, job) as history:
            assert [r.samples for r in history.reports(worker)] == [64]
            assert list(history.statuses()) == [worker]
            assert history.rounds()[0][0].features["upload_s"] == 0.2


def _train_message(workload: Workload) -> Message:
    LocalGrid(ClientApp(), [{}])  # sets Flower's task identity so that messages can be built here
    return Message(RecordDict({"arrays": ArrayRecord([np.zeros(1)]), "config": ConfigRecord(workload.to_config())}),
                   dst_node_id=1, message_type=MessageType.TRAIN)


@pytest.mark.parametrize(("data", "workload", "steps"), [(37, Workload(8, 5), 5), (10, Workload(32, 3), 1),
                                                         (40, Workload(8, 7), 5)])
def test_a_short_last_batch_is_counted_as_short_and_ends_the_round(data: int, workload: Workload, steps: int) -> None:
    """A client drawing without replacement (zip(rnd.batches(), loader), as the docs show) whose data ran out within a
    step had it counted as a full batch: 40 samples claimed for 37, 32 for 10 (its throughput read 3.2x too high)."""
    rnd = LocalRound(_train_message(workload))
    x = np.arange(data)
    seen = []
    for batch_size, start in zip(rnd.batches(), range(0, data, workload.batch_size)):
        batch = x[start:start + batch_size]
        if len(batch) < batch_size:
            rnd.last_batch(len(batch))
        seen += batch.tolist()
    metrics = rnd.reply(ArrayRecord([np.zeros(1)])).content.metric_records["metrics"]
    assert seen == list(range(data)) and (metrics["lbbsp-samples"], metrics["lbbsp-steps"]) == (data, steps)
    ClientResult.from_metrics(metrics).check(workload)  # the server takes it: only the last batch is short


def test_plan_called_directly_still_numbers_the_nodes(redis_url: str, job: str) -> None:
    """plan() on its own asks Redis for the nodes' indices, as before: a node it meets first is indexed."""
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(), history, batch_size=8, local_steps=1)
        plan = strategy.plan(1, [7, 9])
        assert {n: w.batch_size for n, w in plan.items()} == {7: 8, 9: 8}
        assert sorted(int(node) for node in history.workers()) == [7, 9]
        assert strategy.plan(2, []) == {}


def test_a_history_and_its_strategy_refuse_copies_with_lbbsps_error(redis_url: str, job: str) -> None:
    """deepcopy or pickle of a ClientHistory, or of a LoadBalanced holding one, is lbbsp's ConfigError, not pickle's
    "cannot pickle '_thread.lock' object" from inside the Redis connection."""
    import copy  # noqa: PLC0415
    import pickle  # noqa: PLC0415

    from lbbsp import ConfigError  # noqa: PLC0415

    history = ClientHistory.from_url(redis_url, job)
    strategy = LoadBalanced(FedAvg(fraction_evaluate=0.0), history, batch_size=8, local_steps=2)
    for what in (history, strategy):
        for how in (copy.deepcopy, pickle.dumps):
            with pytest.raises(ConfigError, match="ClientHistory .* cannot be copied or pickled"):
                how(what)
    history.close()
