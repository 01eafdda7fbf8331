"""A new user's walk through the hardware query (``LoadBalanced(ask_hardware_s=...)``): a restarted server asked every
client it had measured again, and a node that never answered held the round without a word in the log."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from lbbsp.integrations.flower import ClientHistory, EmulatedLink, LoadBalanced, LocalRound, hardware_reply
from lbbsp.integrations.flower_local import LocalGrid
from test_flower_port import warnings_like


def make_app(asked: list[int], answer_after_s: float = 0.0, answer: str | None = "cuda") -> ClientApp:
    """A ClientApp that trains on "cuda" and answers the hardware query after ``answer_after_s`` with ``answer`` (None:
    ``hardware_reply``'s default device), noting each node asked in ``asked``."""
    app = ClientApp()
    lock = threading.Lock()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        local = LocalRound(msg, link=EmulatedLink(1e9, 1e9), device="cuda")
        for _ in local.batches():
            pass
        return local.reply(ArrayRecord([msg.content["arrays"].to_numpy_ndarrays()[0] + 1.0]))

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        with lock:
            asked.append(context.node_id)
        time.sleep(answer_after_s)
        return hardware_reply(msg) if answer is None else hardware_reply(msg, device=answer)

    return app


def start(history: ClientHistory, grid: LocalGrid, ask_hardware_s: float) -> None:
    strategy = LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2), history,
                            batch_size=8, ask_hardware_s=ask_hardware_s)
    strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(2)]), num_rounds=2, timeout=30.0)


@pytest.mark.timeout(60)
def test_a_restarted_server_does_not_ask_the_clients_it_measured_for_their_hardware(redis_url: str, job: str) -> None:
    """The stored history gives the new server each client's hardware, but it looked their indices up only at the
    round's plan, after the query: every client was asked again (a node gone quiet held round 1 ask_hardware_s, and a
    ClientApp without ``@app.query()`` logged a warning for each node at each restart)."""
    asked: list[int] = []
    grid = LocalGrid(make_app(asked), [{}, {}])
    with ClientHistory.from_url(redis_url, job) as history:
        start(history, grid, 5.0)
    assert sorted(asked) == [1, 2]
    asked.clear()
    with ClientHistory.from_url(redis_url, job) as history:  # the server restarts
        start(history, grid, 5.0)
    grid.close()
    assert asked == []


@pytest.mark.timeout(60)
def test_a_node_that_does_not_answer_in_time_is_logged_once_in_one_line(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """The docs say a node that does not answer in time is logged; the round waited ask_hardware_s for it and said
    nothing. The nodes that give no hardware for one reason share a line."""
    asked: list[int] = []
    grid = LocalGrid(make_app(asked, answer_after_s=2.0), [{}, {}])
    with ClientHistory.from_url(redis_url, job) as history:
        start(history, grid, 0.2)
    grid.close()
    logged = warnings_like(caplog, r"gave no hardware")
    assert logged == ["lbbsp round 1: nodes [1, 2] gave no hardware (no answer within ask_hardware_s=0.2 s; a "
                      "SuperNode that starts a ClientApp for each message needs its start-up too): planned as "
                      "typical clients"], logged


@pytest.mark.timeout(60)
def test_a_reply_on_other_hardware_than_the_query_answer_sets_the_clients_hardware(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """``hardware_reply(msg)`` says "cpu" unless told, and ``LocalRound(msg, device="cuda")`` trains on "cuda": the
    model kept the answer's hardware for the run (a worker's first), so these clients counted as "cpu" peers while the
    history stored "cuda". The replies' hardware counts, with a warning."""
    grid = LocalGrid(make_app([], answer=None), [{}, {}])  # the device forgotten in the query's answer
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2), history,
                                batch_size=8, ask_hardware_s=5.0)
        strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(2)]), num_rounds=2, timeout=30.0)
        stored = {history.reports(worker)[0].device for worker in history.workers().values()}
    grid.close()
    assert stored == {"cuda"}
    assert {device for device, _ in strategy.model.hardware_.values()} == {"cuda"}
    logged = warnings_like(caplog, r"answered the hardware query with other hardware")
    assert len(logged) == 1 and "nodes [1, 2]" in logged[0] and "device 'cpu'" in logged[0], logged
