"""Review fixes in the Flower plugin: integer and boolean arrays through Flower's float average and FedNova, a node
that replies twice or was never asked, and stored statuses under keys no lbbsp process wrote."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from lbbsp.client_history import ClientStatus
from lbbsp.fedagg import rescale_update
from lbbsp.integrations.flower import ClientHistory, LoadBalanced, LocalRound
from lbbsp.integrations.flower_local import LocalGrid

#: An honest reply to a workload of 5 steps of batch 8.
HONEST = {"lbbsp-samples": 40, "lbbsp-steps": 5, "lbbsp-compute-s": 0.1, "lbbsp-download-s": 0.01,
          "lbbsp-upload-s": 0.01, "num-examples": 40}


def _arrays(**named: np.ndarray) -> ArrayRecord:
    return ArrayRecord({name: Array(value) for name, value in named.items()})


def counting_app(steps_by_node: dict[int, int]) -> ClientApp:
    """A ClientApp whose model holds a float weight (+1 per step), an int64 counter (+1 per step, as BatchNorm's
    num_batches_tracked: torch loads the average into its int64 buffer and returns it as one) and a bool mask,
    returned in the dtypes the client keeps them in. A node in ``steps_by_node`` runs out of data after that many
    steps."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        rnd = LocalRound(msg, data_size=10)
        arrays = msg.content["arrays"]
        w = arrays["w"].numpy().copy()
        count = arrays["count"].numpy().astype(np.int64)
        mask = arrays["mask"].numpy().astype(bool)
        for _, _ in zip(rnd.batches(), range(steps_by_node.get(context.node_id, 10**6))):
            w, count = w + 1.0, count + 1
        return rnd.reply(_arrays(w=w, count=count, mask=mask))

    return app


def run_counting(history: ClientHistory, steps_by_node: dict[int, int], rounds: int) -> ArrayRecord:
    grid = LocalGrid(counting_app(steps_by_node), [{}, {}])
    strategy = LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=2), history, batch_size=4,
                            local_steps=2)
    model = _arrays(w=np.zeros(2), count=np.zeros(1, dtype=np.int64), mask=np.array([True, False]))
    try:
        result = strategy.start(grid=grid, initial_arrays=model, num_rounds=rounds, timeout=30)
    finally:
        grid.close()
    return result.arrays


@pytest.mark.timeout(120)
def test_an_integer_array_that_flowers_average_made_float_is_still_accepted(redis_url: str, job: str) -> None:
    """FedAvg averages an int64 (or bool) array into a float64 one, so from round 2 the model sent holds float64
    where the clients return int64: every reply was left out as 'dtype int64, the model's is float64', and the model
    stopped training after round 1 (w stayed at 2)."""
    with ClientHistory.from_url(redis_url, job) as history:
        arrays = run_counting(history, {}, rounds=3)
        statuses = history.statuses()
    assert {s.status for s in statuses.values()} == {"ok"}, statuses
    assert arrays["w"].numpy().tolist() == [6.0, 6.0]  # 2 steps a round, 3 rounds
    assert arrays["count"].numpy().tolist() == [6.0]


@pytest.mark.timeout(120)
def test_fednova_rescales_a_models_bool_array_without_stopping_the_run(redis_url: str, job: str) -> None:
    """Node 2 runs out of data after 1 of its 2 steps, so FedNova rescales its update in round 1, while the model's
    mask is still bool: numpy refuses `bool - bool`, and the TypeError ended Strategy.start."""
    with ClientHistory.from_url(redis_url, job) as history:
        arrays = run_counting(history, {2: 1}, rounds=2)
        statuses = history.statuses()
    assert {s.status for s in statuses.values()} == {"ok"}, statuses
    assert arrays["mask"].numpy().tolist() == [1.0, 0.0]


def test_rescale_update_neither_wraps_unsigned_integers_nor_refuses_bools() -> None:
    """5 + 0.5 * (3 - 5) is 4, not 132 (3 - 5 wrapped to 254 in uint8); a bool array raised a TypeError."""
    assert rescale_update([np.array([5], dtype=np.uint8)], [np.array([3], dtype=np.uint8)], 0.5)[0].tolist() == [4]
    out = rescale_update([np.array([False, True])], [np.array([True, True])], 2.0)[0]
    assert out.dtype == bool and out.tolist() == [True, True]


def _round_1(history: ClientHistory, grid: LocalGrid, **kwargs: object) -> tuple[LoadBalanced, dict[int, Message]]:
    strategy = LoadBalanced(FedAvg(**kwargs), history, batch_size=8, local_steps=5)  # type: ignore[arg-type]
    sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                         ConfigRecord(), grid)}
    return strategy, sent


def _reply(to: Message, node: int, **metrics: float) -> Message:
    """Node ``node``'s reply to ``to``: its model is w = node."""
    return Message(RecordDict({"arrays": ArrayRecord([np.full(1, float(node))]),
                               "metrics": MetricRecord(metrics)}), reply_to=to)


@pytest.mark.timeout(60)
def test_a_node_that_replies_twice_counts_once(redis_url: str, job: str) -> None:
    """A second reply of node 2 (a grid that delivers it twice) was aggregated as well, under the samples it
    processed (40) instead of its data size (10): w was (1*10 + 2*40 + 2*10) / 60 = 1.83, not 1.5."""
    grid = LocalGrid(ClientApp(), [{}, {}])
    with ClientHistory.from_url(redis_url, job) as history:
        strategy, sent = _round_1(history, grid, min_available_nodes=2)
        first, again = (_reply(sent[2], 2, **HONEST, **{"lbbsp-data-size": 10}) for _ in range(2))
        arrays, _ = strategy.aggregate_train(1, [_reply(sent[1], 1, **HONEST, **{"lbbsp-data-size": 10}), first,
                                                 again])
        reports = history.reports(history.worker_index(2))
        status = history.statuses()[history.worker_index(2)].status
    grid.close()
    assert arrays is not None and arrays.to_numpy_ndarrays()[0].tolist() == [1.5]
    assert (len(reports), status) == (1, "ok")


@pytest.mark.timeout(60)
def test_a_plain_reply_from_a_node_that_was_not_asked_is_left_out(redis_url: str, job: str) -> None:
    """FedAvg samples 2 of 3 nodes; a plain Flower reply from the third (never sent the round) was averaged into
    the model with the weight it claimed, while an lbbsp reply from it was refused."""
    grid = LocalGrid(ClientApp(), [{}, {}, {}])
    with ClientHistory.from_url(redis_url, job) as history:
        strategy, sent = _round_1(history, grid, fraction_train=0.5, min_available_nodes=3, min_train_nodes=2)
        asked = sorted(sent)
        (stranger,) = {1, 2, 3} - set(asked)
        other = Message(RecordDict(), stranger, MessageType.TRAIN, group_id="1")
        replies = [_reply(sent[node], node, **{"num-examples": 10}) for node in asked]
        arrays, _ = strategy.aggregate_train(1, [*replies, _reply(other, stranger, **{"num-examples": 10**6})])
    grid.close()
    assert arrays is not None
    assert arrays.to_numpy_ndarrays()[0].tolist() == [sum(asked) / 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", ["-1", "12345678901234567890"])
def test_a_stored_status_under_a_key_no_lbbsp_process_wrote_is_skipped(redis_url: str, job: str, key: str) -> None:
    """A status hash field that is no worker index (negative, or beyond any) was handed to the model, and
    LoadBalanced could not be built on the job ('worker ids must be >= 0', or an overflow)."""
    with ClientHistory.from_url(redis_url, job) as history:
        history.record([], {3: ClientStatus(1, "ok")})
        history.client.hset(history.key("status"), key, ClientStatus(2, "failed").to_json())
        assert set(history.statuses()) == {3}
        LoadBalanced(FedAvg(), history)


@pytest.mark.timeout(60)
def test_a_new_client_after_the_index_map_is_lost_gets_no_index_with_a_stored_history(redis_url: str,
                                                                                     job: str) -> None:
    """Redis evicts the index map (``ids`` and ``next``) but keeps the outcomes; a restarted server (a new
    ClientHistory) gave the next new client index 0, and with it node 7's stored outcome and reports."""
    with ClientHistory.from_url(redis_url, job) as history:
        old = history.worker_index(7)
        history.record([], {old: ClientStatus(1, "failed", "device went away")})
        history.client.delete(history.key("ids"), history.key("next"))
    with ClientHistory.from_url(redis_url, job) as restarted:
        assert restarted.worker_index(8) not in restarted.statuses()
