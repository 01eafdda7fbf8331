"""Review fixes on the Flower plugin's client side (LocalGrid): an exception in a ClientApp comes back with Flower's
error code, a ClientApp that exits is an error reply at once instead of a wait for the round's timeout, and each
ClientApp gets its own copy of its message, as a SuperNode's deserialised one, so editing it changes nothing the
server or the other clients hold. Real ClientApps, real Strategy.start loop, real Redis."""
from __future__ import annotations

import sys
import time

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import FedAvg

from lbbsp.errors import ConfigError
from lbbsp.integrations.flower import ClientHistory, ClientResult, LoadBalanced, LocalRound, Workload
from lbbsp.integrations.flower_local import LocalGrid


def send_one(client: ClientApp, timeout: float) -> tuple[list[Message], float]:
    """Send one train message to a one-node LocalGrid running ``client``: the replies and the seconds taken."""
    grid = LocalGrid(client, [{}])
    content = RecordDict({"arrays": ArrayRecord([np.zeros(1)]), "config": ConfigRecord(Workload(4, 2).to_config())})
    msg = grid.create_message(content, MessageType.TRAIN, 1, "1")
    started = time.monotonic()
    try:
        replies = list(grid.send_and_receive([msg], timeout=timeout))
    finally:
        grid.close()
    return replies, time.monotonic() - started


@pytest.mark.timeout(60)
def test_a_client_app_that_raises_is_an_error_reply_with_flowers_code() -> None:
    """LocalGrid gave code 0 (Flower's UNKNOWN); a SuperNode gives CLIENT_APP_RAISED_EXCEPTION (2)."""
    client = ClientApp()

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        raise ValueError("the client's data is gone")

    replies, _ = send_one(client, timeout=30)
    assert len(replies) == 1 and replies[0].has_error()
    assert replies[0].error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "ValueError: the client's data is gone" in replies[0].error.reason


@pytest.mark.timeout(60)
def test_a_client_app_that_exits_is_an_error_reply_not_a_wait_for_the_timeout() -> None:
    """sys.exit() in a ClientApp (SystemExit, no Exception) ended its thread without a reply, silently: the round
    waited out its whole timeout (Strategy.start's default is an hour; with none, forever). A SuperNode replies
    CLIENT_APP_CRASHED for a ClientApp process that is gone."""
    client = ClientApp()

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        sys.exit(1)

    replies, seconds = send_one(client, timeout=20)
    assert seconds < 10
    assert len(replies) == 1 and replies[0].has_error()
    assert replies[0].error.code == ErrorCode.CLIENT_APP_CRASHED
    assert "SystemExit" in replies[0].error.reason


def edits_what_it_received() -> ClientApp:
    """A ClientApp that trains w + 1 a step and returns the ArrayRecord it received, its entry replaced."""
    client = ClientApp()

    @client.train()
    def _train(msg: Message, context: Context) -> Message:
        rnd = LocalRound(msg, data_size=10)
        arrays = msg.content.array_records["arrays"]
        w = arrays["w"].numpy()
        for _ in rnd.batches():
            w = w + 1.0
        arrays["w"] = Array(w)
        return rnd.reply(arrays)

    return client


@pytest.mark.timeout(120)
def test_a_client_that_edits_the_message_it_received_changes_nothing_the_others_hold(redis_url: str,
                                                                                      job: str) -> None:
    """Every ClientApp had been handed the server's own Message, whose ArrayRecord is the global model itself, shared
    by all the round's messages: a client that replaced an entry in it changed the model the other clients started
    from and the one the server aggregated against (w = 8 after 2 rounds of 2 steps, where a deployment gives 4)."""
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2), history,
                                batch_size=4, local_steps=2)
        grid = LocalGrid(edits_what_it_received(), [{}, {}])
        initial = ArrayRecord({"w": Array(np.zeros(1))})
        try:
            result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=2, timeout=30)
        finally:
            grid.close()
        statuses = history.statuses()
    assert {s.status for s in statuses.values()} == {"ok"}, statuses
    assert result.arrays["w"].numpy().tolist() == [4.0]
    assert initial["w"].numpy().tolist() == [0.0]  # the caller's initial model is left as it was


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


def test_last_batch_is_for_the_step_in_progress_once() -> None:
    rnd = LocalRound(_train_message(Workload(8, 3)))
    with pytest.raises(ConfigError, match="inside `for batch_size in rnd.batches"):
        rnd.last_batch(3)  # before the loop
    for _ in rnd.batches():
        with pytest.raises(ConfigError, match="last_batch's samples"):
            rnd.last_batch(9)  # more than the batch size
        rnd.last_batch(3)
        with pytest.raises(ConfigError, match="once"):
            rnd.last_batch(2)
    assert (rnd.steps, rnd.samples) == (1, 3)
    with pytest.raises(ConfigError, match="inside `for batch_size in rnd.batches"):
        rnd.last_batch(3)  # after the loop
