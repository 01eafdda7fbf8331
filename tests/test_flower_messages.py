"""The Flower plugin's messages: every reply checked against the workload and model it was sent (one that does not fit
is left out, not the round), error replies for ClientApps that raise, exit or never return, each client's own copy
of its message, what a reply or error says named and escaped in the log, and a data size that leaps warned of."""
from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from io import BytesIO

import numpy as np
import pytest

pytest.importorskip("flwr")
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message
from flwr.serverapp.strategy import FedAvg

from lbbsp.fedagg import fednova
from lbbsp.integrations.flower import ClientHistory, LoadBalanced, LocalRound, Workload
from lbbsp.integrations.flower_local import LocalGrid
from lbbsp.integrations.flower_server import MAX_CLIENT_REASON_CHARS
from test_flower_history import error_reply_round
from test_flower_port import fedavg, warnings_like

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
def test_a_superlinks_node_unavailable_errors_are_each_the_failure_of_the_node_they_were_sent_to(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """A SuperLink answers for a node that died with an error from its own node id, 1: lbbsp had logged "node 1
    failed", recorded the dead node as one that sent no reply in time, and dropped a second such error as node 1's
    second reply (the wrapped FedAvg counted 1 failure of 2)."""
    with ClientHistory.from_url(redis_url, job) as history:
        grid = LocalGrid(ClientApp(), [{}, {}, {}])
        strategy = LoadBalanced(FedAvg(min_available_nodes=3), history, batch_size=8, local_steps=5)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                              ConfigRecord(), grid)}
        for node, message in sent.items():  # as Flower's grid does when it sends them
            message.metadata.__dict__["_message_id"] = f"sent-to-{node}"
        replies = [reply(sent[1], ArrayRecord([np.ones(1)]), HONEST)]
        replies += [create_message_error_unavailable_res_message(sent[n].metadata, "node_unavail") for n in (2, 3)]
        assert {r.metadata.src_node_id for r in replies} == {1}
        arrays, _ = strategy.aggregate_train(1, replies)
        grid.close()
        statuses = {node: history.statuses()[history.worker_index(node)] for node in (1, 2, 3)}
    assert arrays is not None and arrays.to_numpy_ndarrays()[0][0] == 1.0
    assert [statuses[n].status for n in (1, 2, 3)] == ["ok", "failed", "failed"]
    assert "Node Unavailable" in statuses[3].reason
    assert len(warnings_like(caplog, r"node [23] failed and is left out: Error: Node Unavailable")) == 2
    assert not warnings_like(caplog, "sent no reply in time|replied more than once|node 1 failed")


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


FORGED = "oom\n\x1b[32mINFO\x1b[0m :      lbbsp round 1: all 2 nodes ok\r\u2028"




@pytest.mark.timeout(60)
def test_a_client_error_reason_is_logged_and_stored_escaped_and_clipped(redis_url: str, job: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A reason with a newline and ESC sequences had been logged as sent, by LoadBalanced and by the wrapped
    FedAvg, forging a log line ("INFO : lbbsp round 1: all 2 nodes ok"), and stored so in the history."""
    caplog.set_level(logging.INFO)
    arrays, stored = error_reply_round(redis_url, job, FORGED + "A" * 10_000)
    assert arrays is not None  # the good reply is aggregated
    escaped = r"oom\n\x1b[32mINFO\x1b[0m :      lbbsp round 1: all 2 nodes ok\r\u2028AAA"
    assert stored.startswith(escaped) and len(stored) == MAX_CLIENT_REASON_CHARS and stored.endswith("\u2026")
    logged = [r.getMessage() for r in caplog.records if "oom" in r.getMessage()]
    assert len(logged) == 2  # LoadBalanced's warning and FedAvg's own line
    assert all(escaped in m and not re.search(r"[\x00-\x1f\x7f\u2028]", m.replace("\t> ", "")) for m in logged)


@pytest.mark.timeout(60)
def test_a_bad_reply_quoting_the_senders_dtype_label_is_logged_and_stored_escaped(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """A reply's array dtype is the sender's label: "dtype <label>, the model's is float64" had carried its newline
    and ESC sequences into the log and the history as they were."""
    grid = LocalGrid(client_app=None, node_configs=[{}, {}])  # type: ignore[arg-type]  # no ClientApp is called
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(fedavg(), history, batch_size=8, local_steps=5)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                             ConfigRecord(), grid)}
        plain = Array(np.ones(1))
        labelled = Array(dtype="float64" + FORGED, shape=plain.shape, stype=plain.stype, data=plain.data)
        replies = [Message(RecordDict({"arrays": ArrayRecord({"0": array}),
                                       "metrics": MetricRecord({"num-examples": 10})}), reply_to=sent[node])
                   for node, array in ((1, plain), (2, labelled))]
        strategy.aggregate_train(1, replies)
        stored = history.statuses()[history.worker_index(2)].reason
    grid.close()
    escaped = r"float64oom\n\x1b[32mINFO"
    assert stored.startswith("bad reply: ") and escaped in stored and "\x1b" not in stored
    assert [m for m in warnings_like(caplog, "node 2 failed") if escaped in m and "\n" not in m and "\x1b" not in m]


HONEST_WITHOUT_EXAMPLES = {"lbbsp-samples": 40, "lbbsp-steps": 5, "lbbsp-compute-s": 0.1, "lbbsp-download-s": 0.01,
          "lbbsp-upload-s": 0.01}


def _reply(sent: Message, value: float, **metrics: float) -> Message:
    """An lbbsp reply to ``sent`` that did all the work it was given, the model's one array set to ``value``."""
    workload = Workload.from_config(sent.content.config_records["config"])
    samples = workload.batch_size * workload.local_steps
    honest = {**HONEST_WITHOUT_EXAMPLES, "lbbsp-samples": samples, "lbbsp-steps": workload.local_steps,
              "num-examples": samples}
    return Message(RecordDict({"arrays": ArrayRecord([np.full(1, value)]),
                               "metrics": MetricRecord({**honest, **metrics})}), reply_to=sent)


@pytest.mark.timeout(60)
def test_a_reply_whose_compute_time_makes_no_report_names_the_node_once_and_the_metric_it_sent(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """It had read "node 2 failed and is left out: bad reply: compute_s: must be in [0.0, 86400.0], got 1e+300
    [job=..., worker=1, iteration=1]": the node under a second name, and a Report field no client sends."""
    grid = LocalGrid(client_app=None, node_configs=[{}, {}])  # type: ignore[arg-type]  # no ClientApp is called
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(fedavg(), history, batch_size=8, local_steps=5)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                             ConfigRecord(), grid)}
        arrays, _ = strategy.aggregate_train(1, [_reply(sent[1], 1.0),
                                                 _reply(sent[2], 2.0, **{"lbbsp-compute-s": 1e300})])
        stored = history.statuses()[history.worker_index(2)]
    grid.close()
    assert arrays is not None and arrays.to_numpy_ndarrays()[0].tolist() == [1.0]  # node 1's alone
    assert stored.status == "failed"
    assert stored.reason == "bad reply: lbbsp-compute-s: must be in [0.0, 86400.0], got 1e+300"
    logged = warnings_like(caplog, "failed and is left out")
    assert logged == ["lbbsp round 1: node 2 failed and is left out: bad reply: lbbsp-compute-s: must be in "
                      "[0.0, 86400.0], got 1e+300"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("metric", "value", "says"), [
    ("lbbsp-compute-s", 1e-12, "must be 0 (nothing measured) or at least"),
    ("lbbsp-download-s", 1e6, "must be in [0.0, 86400.0], got 1000000.0"),
    ("lbbsp-upload-s", 1e6, "must be in [0.0, 86400.0], got 1000000.0"),
], ids=["compute-tiny", "download", "upload"])
def test_each_timing_that_makes_no_report_is_named_as_the_client_sent_it(
        redis_url: str, job: str, metric: str, value: float, says: str) -> None:
    """The transfer times had been named features.download_s and features.upload_s, fields of lbbsp's Report."""
    grid = LocalGrid(client_app=None, node_configs=[{}, {}])  # type: ignore[arg-type]  # no ClientApp is called
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(fedavg(), history, batch_size=8, local_steps=5)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                             ConfigRecord(), grid)}
        strategy.aggregate_train(1, [_reply(sent[1], 1.0), _reply(sent[2], 2.0, **{metric: value})])
        reason = history.statuses()[history.worker_index(2)].reason
    grid.close()
    assert reason.startswith(f"bad reply: {metric}: {says}") and "[" not in reason.split(says)[1], reason


DATA_SIZE_WARNING = r"node \d+ reports a data size of"


def _round(strategy: LoadBalanced, grid: LocalGrid, server_round: int,
           data_sizes: dict[int, int]) -> ArrayRecord | None:
    """One round in which node n replies with the value n and the data size ``data_sizes[n]``."""
    sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(server_round, ArrayRecord([np.zeros(1)]),
                                                                         ConfigRecord(), grid)}
    replies = [_reply(sent[node], float(node), **{"lbbsp-data-size": size}) for node, size in data_sizes.items()]
    arrays, _ = strategy.aggregate_train(server_round, replies)
    return arrays


@pytest.mark.timeout(60)
def test_a_client_whose_data_size_leaps_is_warned_about_once_and_still_weighs_what_it_claims(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """A client claiming lbbsp-data-size=10**9 had been aggregated with weight 1e9, and nothing said so."""
    caplog.set_level(logging.INFO)
    grid = LocalGrid(client_app=None, node_configs=[{}, {}, {}])  # type: ignore[arg-type]  # no ClientApp is called
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3), history,
                                batch_size=8, local_steps=5)
        _round(strategy, grid, 1, {1: 500, 2: 600, 3: 550})
        assert not warnings_like(caplog, DATA_SIZE_WARNING)
        arrays = _round(strategy, grid, 2, {1: 520, 2: 580, 3: 10**9})
        assert arrays is not None  # the aggregation stays as documented: weighted by the claimed data size
        want = (520 * 1 + 580 * 2 + 10**9 * 3) / (520 + 580 + 10**9)
        np.testing.assert_allclose(arrays.to_numpy_ndarrays()[0], [want], rtol=1e-12)
        _round(strategy, grid, 3, {1: 510, 2: 590, 3: 10**9})
    grid.close()
    warned = warnings_like(caplog, DATA_SIZE_WARNING)
    assert warned == ["lbbsp round 2: node 3 reports a data size of 1,000,000,000: 1,818,182x its own previous "
                      "report (550) and 1,818,182x the median (550) of the round's other 2 clients; FedAvg weights "
                      "its update by it (weight_by='auto'), and lbbsp cannot check it: if it is wrong, the model "
                      "leans toward this client's data"], warned


@pytest.mark.timeout(60)
@pytest.mark.parametrize("weight_by", ["data", "samples"])
def test_a_data_size_leap_against_the_clients_own_report_alone_is_warned_about(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture, weight_by: str) -> None:
    """Two clients that both grow 200x: neither stands out in the round, each against its own report does; weighted
    by samples, a data size weighs nothing and is not warned about."""
    grid = LocalGrid(client_app=None, node_configs=[{}, {}])  # type: ignore[arg-type]  # no ClientApp is called
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(fedavg(), history, batch_size=8, local_steps=5, weight_by=weight_by)  # type: ignore[arg-type]
        _round(strategy, grid, 1, {1: 100, 2: 100})
        _round(strategy, grid, 2, {1: 20_000, 2: 20_000})
    grid.close()
    warned = warnings_like(caplog, DATA_SIZE_WARNING)
    assert warned == ([] if weight_by == "samples" else [
        f"lbbsp round 2: node {node} reports a data size of 20,000: 200x its own previous report (100); FedAvg "
        f"weights its update by it (weight_by='data'), and lbbsp cannot check it: if it is wrong, the model leans "
        f"toward this client's data" for node in (1, 2)]), warned


def _round_1(history: ClientHistory, grid: LocalGrid, **kwargs: object) -> tuple[LoadBalanced, dict[int, Message]]:
    strategy = LoadBalanced(FedAvg(**kwargs), history, batch_size=8, local_steps=5)  # type: ignore[arg-type]
    sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                         ConfigRecord(), grid)}
    return strategy, sent


def _node_reply(to: Message, node: int, **metrics: float) -> Message:
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
        first, again = (_node_reply(sent[2], 2, **HONEST, **{"lbbsp-data-size": 10}) for _ in range(2))
        arrays, _ = strategy.aggregate_train(1, [_node_reply(sent[1], 1, **HONEST, **{"lbbsp-data-size": 10}), first,
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
        replies = [_node_reply(sent[node], node, **{"num-examples": 10}) for node in asked]
        arrays, _ = strategy.aggregate_train(1, [*replies, _node_reply(other, stranger, **{"num-examples": 10**6})])
    grid.close()
    assert arrays is not None
    assert arrays.to_numpy_ndarrays()[0].tolist() == [sum(asked) / 2]


def _failed_round(redis_url: str, job: str, reason: str, caplog: pytest.LogCaptureFixture) -> tuple[str, str]:
    """Node 2's error reply with ``reason`` beside node 1's good one: the warning LoadBalanced logs for node 2, and
    the reason the history stores."""
    caplog.set_level(logging.INFO)
    _, stored = error_reply_round(redis_url, job, reason)
    (logged,) = [r.getMessage() for r in caplog.records if "node 2 failed" in r.getMessage()]
    return logged, stored


@pytest.mark.timeout(60)
def test_a_client_error_of_lbbsp_keeps_its_fix(redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """Cut at 200 characters, "... passed as LocalRound(data_size=...); pas" had lost "pass yours there"."""
    reason = "ConfigError: " + "x" * 300 + "; pass yours there and leave these keys out"
    logged, stored = _failed_round(redis_url, job, reason, caplog)
    assert logged.endswith(reason) and stored == reason


@pytest.mark.timeout(60)
def test_a_legacy_client_s_key_error_says_to_move_to_the_message_api(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    logged, _ = _failed_round(redis_url, job, "KeyError: 'fitins.parameters'", caplog)
    assert logged.endswith("KeyError: 'fitins.parameters' (a legacy NumPyClient or client_fn ClientApp: LoadBalanced "
                           "sends Message API rounds; move the ClientApp to @app.train() with LocalRound, "
                           "docs/flower.md)"), logged


@pytest.mark.timeout(60)
def test_local_grid_logs_a_raising_client_apps_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A SuperNode logs it; LocalGrid had left only the server's one line, which says what, not where."""
    client = ClientApp()

    @client.train()
    def _train(msg: Message, context: object) -> Message:
        raise ValueError("the client's data is gone")

    with caplog.at_level(logging.ERROR, logger="flwr"):
        replies, _ = send_one(client, timeout=30)
    assert replies[0].has_error()
    (logged,) = [r.getMessage() for r in caplog.records if "LocalGrid: the ClientApp of node" in r.getMessage()]
    assert "Traceback (most recent call last)" in logged and "in _train" in logged, logged
    assert logged.endswith("ValueError: the client's data is gone"), logged


@pytest.mark.timeout(60)
@pytest.mark.parametrize("weight_by", ["auto", "data"])
def test_a_data_size_of_0_that_would_weigh_the_reply_is_refused_and_the_others_aggregated(
        redis_url: str, job: str, weight_by: str) -> None:
    """A reply weighted by its data size weighs nothing at 0: averaged in, it would count as trained but change
    nothing (and a round of such replies would divide by 0)."""
    grid = LocalGrid(client_app=None, node_configs=[{}, {}])  # type: ignore[arg-type]  # no ClientApp is called
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(fedavg(), history, batch_size=8, local_steps=5,
                                weight_by=weight_by)  # type: ignore[arg-type]
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                             ConfigRecord(), grid)}
        arrays, _ = strategy.aggregate_train(1, [_reply(sent[1], 1.0, **{"lbbsp-data-size": 10}),
                                                 _reply(sent[2], 2.0, **{"lbbsp-data-size": 0})])
        statuses = {node: history.statuses()[history.worker_index(node)] for node in (1, 2)}
    grid.close()
    assert arrays is not None and arrays.to_numpy_ndarrays()[0].tolist() == [1.0]  # node 1's alone
    assert statuses[1].status == "ok" and statuses[2].status == "failed"
    assert statuses[2].reason == (f"bad reply: lbbsp-data-size: is 0, and with weight_by={weight_by!r} the reply "
                                  "would weigh nothing")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("record", "says"), [
    (MetricRecord({"loss": 1.0}), "metrics: must hold one MetricRecord, holds 2"),
    (ArrayRecord([np.ones(1)]), "arrays: must hold one ArrayRecord, holds 2"),
], ids=["metrics", "arrays"])
def test_replies_that_all_carry_a_second_record_are_each_refused_by_name(
        redis_url: str, job: str, record: MetricRecord | ArrayRecord, says: str) -> None:
    """Alike, they pass the check for a reply unlike the others; FedAvg would refuse them (one ArrayRecord and one
    MetricRecord a reply): each is left out, named, and recorded as failed, and the model is kept."""
    grid = LocalGrid(client_app=None, node_configs=[{}, {}])  # type: ignore[arg-type]  # no ClientApp is called
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(fedavg(), history, batch_size=8, local_steps=5)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                             ConfigRecord(), grid)}
        replies = [_reply(sent[node], float(node)) for node in (1, 2)]
        for message in replies:
            message.content["extra"] = record
        arrays, _ = strategy.aggregate_train(1, replies)
        reasons = {history.statuses()[history.worker_index(node)].reason for node in (1, 2)}
    grid.close()
    assert arrays is None
    assert reasons == {f"bad reply: {says}"}


@pytest.mark.timeout(60)
def test_a_round_aggregated_a_second_time_is_not_recorded_again(redis_url: str, job: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """aggregate_train of a round LoadBalanced has no workload for (aggregated already, or never configured) passes the
    replies on to the wrapped strategy, and records nothing: a round's samples are counted in the history once. It
    says so: such replies are not checked against a plan (a NaN one had been averaged in silence)."""
    grid = LocalGrid(client_app=None, node_configs=[{}, {}])  # type: ignore[arg-type]  # no ClientApp is called
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(fedavg(), history, batch_size=8, local_steps=5)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                             ConfigRecord(), grid)}
        for _ in range(2):
            arrays, _ = strategy.aggregate_train(1, [_reply(sent[1], 1.0), _reply(sent[2], 3.0)])
            assert arrays is not None and arrays.to_numpy_ndarrays()[0].tolist() == [2.0]
        reports = {node: history.reports(history.worker_index(node)) for node in (1, 2)}
    grid.close()
    assert {node: [r.iteration for r in rs] for node, rs in reports.items()} == {1: [1], 2: [1]}
    assert len(warnings_like(caplog, r"lbbsp round 1: LoadBalanced sent no workload for this round")) == 1
