"""Audit fixes in the Flower plugin: replies checked against the workload sent, arrays paired by name, LocalGrid
threads that hold no exit, worker indices that stay unique after Redis loses its data, delivery time counted."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from lbbsp import EmbeddedRedis
from lbbsp.client_history import ClientStatus
from lbbsp.errors import ConfigError, LBBSPError, ProtocolError
from lbbsp.fedagg import fednova, rescale_update, weighted_average
from lbbsp.integrations.flower import ClientHistory, LoadBalanced
from lbbsp.integrations.flower_local import LocalGrid
from lbbsp.protocol import MAX_WORKERS

#: An honest reply to a workload of 5 steps of batch 8.
HONEST = {"lbbsp-samples": 40, "lbbsp-steps": 5, "lbbsp-compute-s": 0.1, "lbbsp-download-s": 0.01,
          "lbbsp-upload-s": 0.01, "num-examples": 40}


def one_round(history: ClientHistory, node_3: dict[str, float], weight_by: str = "samples") -> tuple[float, str]:
    """Round 1 of 3 clients sent 5 steps of batch 8: nodes 1 and 2 reply honestly with w = 1 and 2, node 3 with
    w = 3 and ``node_3`` over the honest metrics. The aggregate, and node 3's recorded status."""
    grid = LocalGrid(ClientApp(), [{}, {}, {}])  # no ClientApp is called: it sets Flower's task identity
    strategy = LoadBalanced(FedAvg(min_available_nodes=3), history, batch_size=8, local_steps=5,
                            weight_by=weight_by)  # type: ignore[arg-type]
    sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                         ConfigRecord(), grid)}
    replies = [Message(RecordDict({"arrays": ArrayRecord([np.full(1, float(node))]),
                                   "metrics": MetricRecord({**HONEST, **(node_3 if node == 3 else {})})}),
                       reply_to=sent[node]) for node in (1, 2, 3)]
    arrays, _ = strategy.aggregate_train(1, replies)
    grid.close()
    assert arrays is not None
    return float(arrays.to_numpy_ndarrays()[0][0]), history.statuses()[history.worker_index(3)].status


@pytest.mark.timeout(60)
@pytest.mark.parametrize("claim", [
    {"lbbsp-steps": 1},  # did 5 steps, claims 1: FedNova would stretch its update 5x (the samples give it away)
    {"lbbsp-steps": 6, "lbbsp-samples": 48},  # more steps than it was sent
    {"lbbsp-samples": 10**9, "num-examples": 10**9},  # weight by samples: would outweigh the others 10^7 to 1
    {"lbbsp-samples": 32},  # 5 steps, but no more samples than 4 batches: not a short last batch
    {"lbbsp-download-s": 1e9},  # consistent with the workload, but no valid Report: its timings fail validation
])
def test_a_reply_claiming_more_than_it_was_sent_is_left_out_as_failed(redis_url: str, job: str,
                                                                      claim: dict[str, float]) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        w, status = one_round(history, claim)
    assert (w, status) == (1.5, "failed")  # nodes 1 and 2 only, equally weighted


@pytest.mark.timeout(60)
@pytest.mark.parametrize("claim, steps, samples", [
    ({"lbbsp-samples": 37, "num-examples": 37}, 5, 37),  # a short last batch: what was left of its data
    ({"lbbsp-steps": 3, "lbbsp-samples": 24, "num-examples": 24}, 3, 24),  # stopped early (a deadline)
])
def test_fewer_steps_and_a_short_last_batch_are_accepted(redis_url: str, job: str, claim: dict[str, float],
                                                         steps: int, samples: int) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        w, status = one_round(history, claim)
    want = fednova([np.zeros(1)], [[np.ones(1)], [np.full(1, 2.0)], [np.full(1, 3.0)]], [5, 5, steps],
                   [40, 40, samples])
    assert status == "ok" and w == pytest.approx(want[0][0], rel=1e-12)


def _arrays(**named: np.ndarray) -> ArrayRecord:
    return ArrayRecord({name: Array(value) for name, value in named.items()})


@pytest.mark.timeout(60)
def test_fednova_pairs_a_clients_arrays_with_the_models_by_name(redis_url: str, job: str) -> None:
    grid = LocalGrid(ClientApp(), [{}, {}])
    model = _arrays(a=np.zeros(2), b=np.zeros(3))
    a1, b1, a2, b2 = np.ones(2), np.full(3, 2.0), np.full(2, 3.0), np.full(3, 4.0)
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(min_available_nodes=2), history, batch_size=1, local_steps=2, adapt="steps")
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, model, ConfigRecord(), grid)}

        def reply(node: int, arrays: ArrayRecord, steps: int) -> Message:
            metrics = {**HONEST, "lbbsp-samples": steps, "lbbsp-steps": steps, "num-examples": steps}
            return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}), reply_to=sent[node])

        # node 2 names its arrays in the other order (as a state dict may)
        arrays, _ = strategy.aggregate_train(1, [reply(1, _arrays(a=a1, b=b1), 1), reply(2, _arrays(b=b2, a=a2), 2)])
    grid.close()
    assert arrays is not None
    want = fednova([np.zeros(2), np.zeros(3)], [[a1, b1], [a2, b2]], [1, 2], [1, 2])
    np.testing.assert_allclose(arrays["a"].numpy(), want[0], rtol=1e-12)
    np.testing.assert_allclose(arrays["b"].numpy(), want[1], rtol=1e-12)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("steps", [1, 2])  # node 2's update rescaled (steps differ) or not
@pytest.mark.parametrize("bad", [
    {"a": np.ones(2)}, {"a": np.ones(2), "b": np.ones(4)}, {"a": np.ones(2), "c": np.ones(3)},
    # the model's names and shapes, but values no average can take: they passed, and the model became NaN,
    # turned complex, or the run stopped in the aggregation
    {"a": np.array([np.nan, 1.0]), "b": np.ones(3)}, {"a": np.array([np.inf, 1.0]), "b": np.ones(3)},
    {"a": np.ones(2, dtype=complex), "b": np.ones(3)}, {"a": np.array(["x", "y"]), "b": np.ones(3)},
    {"a": np.ones(2, dtype=np.float32), "b": np.ones(3)},
], ids=["missing", "shape", "name", "nan", "inf", "complex", "string", "float32"])
def test_a_reply_whose_arrays_are_not_the_models_is_left_out_as_failed(redis_url: str, job: str, steps: int,
                                                                       bad: dict[str, np.ndarray]) -> None:
    grid = LocalGrid(ClientApp(), [{}, {}])
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(min_available_nodes=2), history, batch_size=1, local_steps=2, adapt="steps")
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(
            1, _arrays(a=np.zeros(2), b=np.zeros(3)), ConfigRecord(), grid)}
        replies = [Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(
            {**HONEST, "lbbsp-samples": n_steps, "lbbsp-steps": n_steps, "num-examples": n_steps})}),
            reply_to=sent[node]) for node, arrays, n_steps in ((1, _arrays(a=np.ones(2), b=np.ones(3)), 2),
                                                                 (2, _arrays(**bad), steps))]
        arrays, _ = strategy.aggregate_train(1, replies)
        assert history.statuses()[history.worker_index(2)].status == "failed"
    grid.close()
    assert arrays is not None and arrays["b"].numpy().tolist() == [1.0, 1.0, 1.0]  # node 1's alone


def test_the_aggregation_maths_refuse_arrays_of_other_shapes() -> None:
    with pytest.raises(LBBSPError, match="shape"):
        rescale_update([np.zeros(3)], [np.ones(1)], 2.0)  # numpy would broadcast the (1,) silently
    with pytest.raises(LBBSPError, match="shape"):
        rescale_update([np.zeros((2, 3))], [np.ones(3)], 2.0)
    with pytest.raises(LBBSPError, match="shapes"):
        weighted_average([[np.zeros(3)], [np.ones(1)]], [1, 1])


@pytest.mark.timeout(60)
def test_a_client_app_that_never_returns_does_not_hold_the_next_round() -> None:
    release = threading.Event()
    calls = []
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        calls.append(msg)
        if len(calls) == 1:
            release.wait(60)  # the first round's ClientApp hangs
        return Message(RecordDict({"metrics": MetricRecord({"n": len(calls)})}), reply_to=msg)

    grid = LocalGrid(app, [{}])
    try:
        for expected in ([], [2]):
            message = grid.create_message(RecordDict({"config": ConfigRecord()}), MessageType.TRAIN, 1, "g")
            replies = list(grid.send_and_receive([message], timeout=1.0))
            assert [r.content["metrics"]["n"] for r in replies] == expected
    finally:
        release.set()
        grid.close()


@pytest.mark.timeout(90)
def test_a_client_app_that_never_returns_does_not_hold_the_exit() -> None:
    script = textwrap.dedent("""
        import time
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict
        from flwr.clientapp import ClientApp
        from lbbsp.integrations.flower_local import LocalGrid
        app = ClientApp()
        @app.train()
        def train(msg, context):
            time.sleep(600)
        grid = LocalGrid(app, [{}])
        message = grid.create_message(RecordDict({"config": ConfigRecord()}), MessageType.TRAIN, 1, "g")
        assert list(grid.send_and_receive([message], timeout=0.2)) == []
        grid.close()
        grid.close()
        print("closed", flush=True)
    """)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=45, check=True)
    assert done.stdout.strip() == "closed" and time.monotonic() - started < 45


def test_worker_indices_stay_unique_after_redis_loses_its_data(job: str) -> None:
    with EmbeddedRedis() as server, ClientHistory.from_url(server.url, job) as history:
        assert [history.worker_index("a"), history.worker_index("b")] == [0, 1]
        history.client.flushall()  # a restart without persistence
        c, a = history.worker_index("c"), history.worker_index("a")
        assert len({c, a, 1}) == 3  # b, unasked since, still has 1 in this process's model
        assert history.workers() == {"c": c, "a": a} and history.known_index("a") == a
        assert history.worker_indices(["a", "c", "b"]) == [a, c, history.worker_index("b")]
        assert len(set(history.workers().values())) == 3



@pytest.mark.parametrize("stored", ["1.5", "250000", "-3", "x", "1e0"])
def test_a_stored_index_no_lbbsp_process_wrote_is_replaced_not_used(redis_url: str, job: str, stored: str) -> None:
    """The assignment script used any number it found ("1.5" gave the second client 1, which "b" has; "250000"
    is outside the index space; "-3" raised 'more than 100000 clients'), while workers() skipped it."""
    with ClientHistory.from_url(redis_url, job) as history:
        assert history.worker_indices(["a", "b"]) == [0, 1]
        history.client.hset(history.key("ids"), "c", stored)
        assert history.worker_index("c") == 2 and history.workers() == {"a": 0, "b": 1, "c": 2}
        assert history.worker_index("d") == 3


@pytest.mark.parametrize("counter", ["abc", "1.5", "-2"])
def test_a_counter_no_lbbsp_process_wrote_restarts_above_the_stored_indices(redis_url: str, job: str,
                                                                            counter: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        assert history.worker_indices(["a", "b", "c"]) == [0, 1, 2]
        history.client.set(history.key("next"), counter)
        with ClientHistory.from_url(redis_url, job) as restarted:  # a new server: nothing handed out in memory
            assert restarted.worker_index("d") == 3


def test_a_full_index_space_is_a_clear_error_not_an_outage(redis_url: str, job: str) -> None:
    """It raised StoreUnavailable, which LoadBalanced takes for Redis down: it then gave a 'temporary' index
    counting down from 99,999, which Redis had given to a stored client."""
    with ClientHistory.from_url(redis_url, job) as history:
        assert history.worker_index("a") == 0
        history.client.set(history.key("next"), str(MAX_WORKERS))
        with pytest.raises(ConfigError, match="every client index of the job is taken"):
            history.worker_index("new")
        assert history.worker_index("a") == 0


def test_a_stored_status_beyond_any_round_is_skipped(redis_url: str, job: str) -> None:
    """A round of 2**60 was taken: LoadBalanced then numbered its rounds past what a report may carry, refused
    every reply, and stored the failures with the same round."""
    with pytest.raises(ProtocolError, match="round"):
        ClientStatus.from_json('{"round": 1152921504606846976, "status": "ok", "reason": "", "at": 0}')
    with ClientHistory.from_url(redis_url, job) as history:
        history.record([], {0: ClientStatus(3, "ok"), 1: ClientStatus(4, "missed")})
        history.client.hset(history.key("status"), "2", json.dumps({"round": 2**60, "status": "ok", "reason": "",
                                                                    "at": 0}))
        assert {w: s.round for w, s in history.statuses().items()} == {0: 3, 1: 4}

@pytest.mark.timeout(60)
@pytest.mark.parametrize("reply_content", ["plain, other shape", "two metric records"])
def test_every_reply_is_checked_not_only_lbbsps(redis_url: str, job: str, reply_content: str) -> None:
    """A reply without lbbsp's metrics skipped the array checks: a (1,) array where the model holds (2,) was
    broadcast into the average ([51.25, 51.25]) and its client recorded ok. A second MetricRecord made the
    wrapped FedAvg refuse the whole round."""
    grid = LocalGrid(ClientApp(), [{}, {}])
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(min_available_nodes=2), history, batch_size=1, local_steps=2)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, _arrays(a=np.zeros(2)), ConfigRecord(),
                                                                           grid)}
        good = {**HONEST, "lbbsp-samples": 2, "lbbsp-steps": 2, "num-examples": 2}
        if reply_content.startswith("plain"):
            content = {"arrays": _arrays(a=np.full(1, 300.0)), "metrics": MetricRecord({"num-examples": 2})}
        else:
            content = {"arrays": _arrays(a=np.full(2, 300.0)), "metrics": MetricRecord(good),
                       "more": MetricRecord({"loss": 1.0})}
        replies = [Message(RecordDict({"arrays": _arrays(a=np.ones(2)), "metrics": MetricRecord(good)}),
                           reply_to=sent[1]),
                   Message(RecordDict(content), reply_to=sent[2])]
        arrays, _ = strategy.aggregate_train(1, replies)
        assert history.statuses()[history.worker_index(2)].status == "failed"
    grid.close()
    assert arrays is not None and arrays["a"].numpy().tolist() == [1.0, 1.0]  # node 1's alone


def test_wrong_usage_is_a_config_error_up_front(redis_url: str) -> None:
    """An empty job name was taken and every reply then refused ('job: must not be empty'), as if the clients
    were at fault; a model name for a model, a tuple for a Workload and a fractional data size failed later or
    were truncated."""
    from lbbsp.errors import ConfigError  # noqa: PLC0415
    from lbbsp.integrations.flower import LocalRound, Workload  # noqa: PLC0415

    with pytest.raises(ConfigError, match="job name"):
        ClientHistory.from_url(redis_url, "")
    with ClientHistory.from_url(redis_url, "usage") as history, pytest.raises(ConfigError, match="model"):
        LoadBalanced(FedAvg(), history, model="fl")  # type: ignore[arg-type]
    msg = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=1, message_type=MessageType.TRAIN)
    for kwargs in ({"default": (32, 5)}, {"default": Workload(32, 5), "data_size": 1.7},
                   {"default": Workload(32, 5), "data_size": -5}):
        with pytest.raises(ConfigError, match="default|data_size"):
            LocalRound(msg, **kwargs)  # type: ignore[arg-type]


def test_a_workload_takes_numpy_numbers_and_refuses_a_bool_deadline(redis_url: str, job: str) -> None:
    """Workload(8, 2, True) was a 1 s deadline, and np.int64(32) was refused as 'not an integer' (so was
    LoadBalanced(batch_size=np.int64(32)))."""
    from lbbsp.integrations.flower import Workload  # noqa: PLC0415

    assert Workload(np.int64(32), np.int32(5), np.float32(1.5)) == Workload(32, 5, 1.5)
    assert type(Workload(np.int64(32), 5).batch_size) is int
    with pytest.raises(ConfigError, match="deadline_s"):
        Workload(8, 2, True)
    with ClientHistory.from_url(redis_url, job) as history:
        assert LoadBalanced(FedAvg(), history, batch_size=np.int64(32), local_steps=np.int64(2)).batch_size == 32
