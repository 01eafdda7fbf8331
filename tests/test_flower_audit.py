"""Flower plugin, from a read-and-probe audit: one odd reply never costs the round, arrays are checked on their
bytes, a refusing Redis is an outage like any other, and settings that could never work fail up front."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from io import BytesIO

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from lbbsp import EmbeddedRedis, EWMAThroughput, Report
from lbbsp.errors import ConfigError
from lbbsp.integrations.flower import ClientHistory, LoadBalanced, LocalRound, Workload
from lbbsp.integrations.flower_client import EmulatedLink, MessageClock
from lbbsp.integrations.flower_local import LocalGrid
from lbbsp.protocol import MAX_BATCH, MAX_SECONDS

#: An honest reply to a workload of 5 steps of batch 8.
HONEST = {"lbbsp-samples": 40, "lbbsp-steps": 5, "lbbsp-compute-s": 0.1, "lbbsp-download-s": 0.01,
          "lbbsp-upload-s": 0.01, "num-examples": 40}
Reply = Callable[[Message, ArrayRecord], Message]


def reply(sent: Message, arrays: ArrayRecord, metrics: dict[str, float] | None = None, *, arrays_key: str = "arrays",
          metrics_key: str = "metrics") -> Message:
    content: dict[str, ArrayRecord | MetricRecord] = {arrays_key: arrays}
    if metrics is not None:
        content[metrics_key] = MetricRecord(metrics)
    return Message(RecordDict(content), reply_to=sent)


def three_clients(history: ClientHistory, model: ArrayRecord, node_3: Reply) -> tuple[ArrayRecord | None, str]:
    """Round 1 of 3 clients sent 5 steps of batch 8: nodes 1 and 2 reply honestly with arrays full of 1 and 2,
    node 3 as ``node_3`` makes it. The aggregate, and node 3's recorded status."""
    grid = LocalGrid(ClientApp(), [{}, {}, {}])
    strategy = LoadBalanced(FedAvg(min_available_nodes=3), history, batch_size=8, local_steps=5, weight_by="samples")
    sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, model, ConfigRecord(), grid)}
    like = {name: array.numpy() for name, array in model.items()}
    replies = [reply(sent[n], ArrayRecord({k: Array(np.full_like(v, n)) for k, v in like.items()}), HONEST)
               for n in (1, 2)]
    replies.append(node_3(sent[3], ArrayRecord({k: Array(np.full_like(v, 3)) for k, v in like.items()})))
    arrays, _ = strategy.aggregate_train(1, replies)
    grid.close()
    return arrays, history.statuses()[history.worker_index(3)].status


@pytest.mark.timeout(60)
@pytest.mark.parametrize("odd", [
    lambda m, a: reply(m, a, HONEST, arrays_key="model"),  # its arrays under another record name
    lambda m, a: reply(m, a, HONEST, metrics_key="train"),  # its metrics under another record name
    reply,  # a plain reply without a MetricRecord
    lambda m, a: reply(m, a, {**HONEST, "loss": 0.5}),  # a metric the others do not send
    lambda m, a: reply(m, a, {"loss": 0.5}),  # a plain reply without its weight
], ids=["arrays-name", "metrics-name", "no-metrics", "extra-metric", "no-weight"])
def test_one_reply_laid_out_unlike_the_others_is_left_out_not_the_round(redis_url: str, job: str,
                                                                          odd: Reply) -> None:
    # FedAvg raises InconsistentMessageReplies for the whole round on any of these, which ends the ServerApp
    with ClientHistory.from_url(redis_url, job) as history:
        arrays, status = three_clients(history, ArrayRecord([np.zeros(1)]), odd)
    assert arrays is not None and arrays.to_numpy_ndarrays()[0][0] == 1.5 and status == "failed"


def npy(values: np.ndarray) -> bytes:
    out = BytesIO()
    np.save(out, values, allow_pickle=False)
    return out.getvalue()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data, stype", [
    (npy(np.array([100.0])), "numpy.ndarray"),  # one value: FedAvg would broadcast it over the model's three
    (npy(np.ones((3, 3))), "numpy.ndarray"),
    (npy(np.full(3, 7, np.float32)), "numpy.ndarray"),
    (b"garbage", "numpy.ndarray"),
    (npy(np.ones(3)), "torch.raw"),
], ids=["fewer-values", "more-values", "float32", "garbage", "other-stype"])
def test_arrays_are_checked_on_their_bytes_not_their_labels(redis_url: str, job: str, data: bytes,
                                                            stype: str) -> None:
    labelled_like_the_model = Array(dtype="float64", shape=(3,), stype=stype, data=data)
    with ClientHistory.from_url(redis_url, job) as history:
        arrays, status = three_clients(history, ArrayRecord({"w": Array(np.zeros(3))}),
                                       lambda m, a: reply(m, ArrayRecord({"w": labelled_like_the_model}), HONEST))
    assert arrays is not None and arrays["w"].numpy().tolist() == [1.5] * 3 and status == "failed"


@pytest.mark.timeout(60)
def test_a_metric_too_large_for_a_float_leaves_the_reply_out(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        arrays, status = three_clients(history, ArrayRecord([np.zeros(1)]),
                                       lambda m, a: reply(m, a, {**HONEST, "lbbsp-data-size": 10**400}))
    assert arrays is not None and arrays.to_numpy_ndarrays()[0][0] == 1.5 and status == "failed"


@pytest.mark.timeout(60)
def test_a_redis_that_refuses_writes_is_an_outage_the_rounds_go_on_through(job: str) -> None:
    with EmbeddedRedis() as server, ClientHistory.from_url(server.url, job) as history:
        grid = LocalGrid(ClientApp(), [{}, {}])
        strategy = LoadBalanced(FedAvg(min_available_nodes=2), history, batch_size=8, local_steps=5)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                             ConfigRecord(), grid)}
        history.client.config_set("maxmemory-policy", "noeviction")
        history.client.config_set("maxmemory", "1")  # every write is refused: OOM
        arrays, _ = strategy.aggregate_train(1, [reply(sent[n], ArrayRecord([np.full(1, float(n))]), HONEST)
                                                 for n in (1, 2)])
        assert arrays is not None and arrays.to_numpy_ndarrays()[0][0] == 1.5
        assert len(list(strategy.configure_train(2, arrays, ConfigRecord(), grid))) == 2
        grid.close()


def test_settings_that_could_never_work_are_config_errors_up_front(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        with pytest.raises(ConfigError, match="at most 10,000,000 samples"):  # a Report carries no more
            LoadBalanced(FedAvg(), history, batch_size=20_000, local_steps=1_000)
        with pytest.raises(ConfigError, match="FLClientModel"):  # it has no transfer times or availability
            LoadBalanced(FedAvg(), history, model=EWMAThroughput())  # type: ignore[arg-type]
    for settings in ({"ttl_s": 0}, {"ttl_s": -1}, {"ttl_s": 3600.5}, {"max_reports": 0}):
        with pytest.raises(ConfigError, match=next(iter(settings))):  # 0 deleted each write; 0 reports kept all
            ClientHistory.from_url(redis_url, job, **settings)
    for bps in (0, -5.0, float("nan"), float("inf"), "1e6", True):
        with pytest.raises(ConfigError, match="down_bps"):
            EmulatedLink(bps, 1e6)


@pytest.mark.timeout(60)
def test_no_client_is_planned_more_samples_than_a_report_carries(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        steps = 10_000
        strategy = LoadBalanced(FedAvg(), history, batch_size=600, local_steps=steps)
        fast, slow = history.worker_indices([1, 2])
        strategy.model.partial_fit([Report(job, fast, 1, 600 * steps, 1.0), Report(job, slow, 1, 600 * steps, 100.0)])
        plan = strategy.plan(2, [1, 2])
    assert plan[1].samples <= MAX_BATCH and plan[1].batch_size > plan[2].batch_size


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


@pytest.mark.timeout(60)
def test_the_client_finds_its_workload_under_the_strategys_config_key(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        grid = LocalGrid(ClientApp(), [{}, {}])
        strategy = LoadBalanced(FedAvg(min_available_nodes=2, configrecord_key="cfg"), history, batch_size=8,
                                local_steps=5)
        sent = next(iter(strategy.configure_train(1, ArrayRecord([np.zeros(1)]), ConfigRecord(), grid)))
        grid.close()
    assert LocalRound(sent, default=Workload(32, 1)).workload == Workload(8, 5)  # not the default


def test_a_skewed_client_clock_gives_a_download_time_a_report_can_carry() -> None:
    message = Message(RecordDict({"arrays": ArrayRecord([np.zeros(1)])}), dst_node_id=1, message_type="train",
                      group_id=str(uuid.uuid4()))
    message.metadata.created_at = time.time() - 2 * 86_400  # seen from a client whose clock runs two days ahead
    assert MessageClock().download(message) == MAX_SECONDS  # more would make the server refuse the whole reply
    message.metadata.created_at = time.time() + 3_600  # and one running behind
    assert MessageClock().download(message) == 0.0
