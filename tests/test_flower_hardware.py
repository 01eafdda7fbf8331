"""Flower clients' hardware: LoadBalanced's query and the clients' answers (or none in time), the device and cores a
reply carries into its report, and a new client's first workload following clients on the same hardware."""
from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from lbbsp import ConfigError, ProtocolError
from lbbsp.integrations.flower import (
    ClientHardware,
    ClientHistory,
    EmulatedLink,
    LoadBalanced,
    LocalRound,
    Workload,
    hardware_reply,
)
from lbbsp.integrations.flower_local import LocalGrid
from lbbsp.models.base import hardware_of
from lbbsp.telemetry import available_cores
from test_flower_deployment import load_launcher
from test_flower_port import warnings_like

FAST, SLOW = 0.0001, 0.001  # seconds a sample: the "cuda" clients are 10x the "cpu" ones


GOOD = {"lbbsp-samples": 2, "lbbsp-steps": 1, "lbbsp-compute-s": 0.1, "lbbsp-download-s": 0.0,
        "lbbsp-upload-s": 0.0, "num-examples": 2}


def make_app() -> ClientApp:
    """A ClientApp whose node_config says its device; it answers LoadBalanced's hardware query."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        device = str(context.node_config["device"])
        local = LocalRound(msg, link=EmulatedLink(1e9, 1e9), device=device)
        for batch_size in local.batches():
            time.sleep(batch_size * (FAST if device == "cuda" else SLOW))
        return local.reply(ArrayRecord([msg.content["arrays"].to_numpy_ndarrays()[0] + 1.0]))

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return hardware_reply(msg, device=str(context.node_config["device"]))

    return app


class GrowingGrid(LocalGrid):
    """A LocalGrid whose nodes connect over time: only the first ``visible`` of them are there."""

    visible = 4

    def get_node_ids(self) -> list[int]:
        return list(super().get_node_ids())[:self.visible]


class Recording(LoadBalanced):
    """Keeps every round's plan."""

    plans: dict[int, dict[int, Workload]]

    def plan(self, server_round: int, nodes: list[int]) -> dict[int, Workload]:
        self.plans = getattr(self, "plans", {})
        self.plans[server_round] = super().plan(server_round, nodes)
        return self.plans[server_round]


def run(history: ClientHistory, grid: LocalGrid, rounds: int, **kwargs: object) -> Recording:
    nodes = len(list(grid.get_node_ids()))
    strategy = Recording(FedAvg(fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes), history,
                         batch_size=40, local_steps=1, **kwargs)  # type: ignore[arg-type]
    strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(2)]), num_rounds=rounds, timeout=30.0)
    return strategy


@pytest.mark.timeout(60)
def test_a_reply_carries_the_clients_device_and_cores_into_its_report(redis_url: str, job: str) -> None:
    grid = LocalGrid(make_app(), [{"device": "cuda"}, {"device": "Pixel 8"}])
    with ClientHistory.from_url(redis_url, job) as history:
        run(history, grid, rounds=1)
        index = {int(node): i for node, i in history.workers().items()}
        reports = {node: history.reports(index[node])[0] for node in (1, 2)}
    grid.close()
    assert hardware_of(reports[1]) == ("cuda", available_cores())
    assert hardware_of(reports[2]) == ("pixel 8", available_cores())


@pytest.mark.timeout(120)
def test_a_new_client_starts_at_the_share_of_clients_on_its_hardware(redis_url: str, job: str) -> None:
    """Two fast "cuda" and two slow "cpu" clients train two rounds; then a fifth, "cpu", connects. Asked for its
    hardware before its first round, it starts near the other "cpu" clients' share; planned at the median of all
    clients, as before, it got about 5x that."""
    plans = {}
    for ask in (5.0, None):
        grid = GrowingGrid(make_app(), [{"device": d} for d in ("cuda", "cuda", "cpu", "cpu", "cpu")])
        with ClientHistory.from_url(redis_url, f"{job}-{ask}") as history:
            strategy = Recording(FedAvg(fraction_evaluate=0.0, min_available_nodes=4, min_train_nodes=4), history,
                                 batch_size=40, local_steps=1, ask_hardware_s=ask)
            strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(2)]), num_rounds=2, timeout=30.0)
            grid.visible = 5
            strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(2)]), num_rounds=1, timeout=30.0)
        grid.close()
        plans[ask] = {node: w.batch_size for node, w in strategy.plans[1].items()}
    asked = plans[5.0]
    assert min(asked[1], asked[2]) > 3 * max(asked[3], asked[4]), asked  # measured: 10x apart
    assert asked[5] <= 1.5 * max(asked[3], asked[4]), asked  # its peers' share, not the typical client's
    assert plans[None][5] > 2 * asked[5], plans  # without its hardware: the median of all four


@pytest.mark.parametrize(("record", "field", "says"), [
    ({"device": 5, "cores": 4}, "lbbsp-hardware.device", "printable name"),
    ({"device": "x" * 65, "cores": 4}, "lbbsp-hardware.device", "1 to 64 characters"),
    ({"device": "cpu\x1b[2J", "cores": 4}, "lbbsp-hardware.device", "printable name"),
    ({"device": " \t", "cores": 4}, "lbbsp-hardware.device", "not all blank"),
    ({"device": "cpu", "cores": 10**9}, "lbbsp-hardware.cores", "[1, 100000]"),
    ({"device": "cpu", "cores": 2.5}, "lbbsp-hardware.cores", "must be an integer"),
    ({"device": "cpu", "cores": True}, "lbbsp-hardware.cores", "must be an integer"),
    ({"device": "cpu"}, "lbbsp-hardware.cores", "is missing"),
    ({"device": "cpu", "cores": 4, "gpu": "A100"}, "lbbsp-hardware", "unknown key"),
])
def test_a_bad_hardware_record_is_refused_naming_its_field(record: dict[str, object], field: str, says: str) -> None:
    with pytest.raises(ProtocolError, match=f"^{field}: .*{says}".replace("[", r"\[")) as caught:
        ClientHardware.from_content(RecordDict({"lbbsp-hardware": ConfigRecord(record)}))  # type: ignore[arg-type]
    assert caught.value.field == field


def hostile_round(redis_url: str, job: str,
                  hardware: dict[int, ConfigRecord | None]) -> tuple[ArrayRecord | None, ClientHistory, LoadBalanced]:
    """One round of two nodes whose replies (good metrics, each node's arrays all its id) carry ``hardware``."""
    grid = LocalGrid(make_app(), [{}, {}])
    history = ClientHistory.from_url(redis_url, job)
    strategy = LoadBalanced(FedAvg(min_available_nodes=2), history, batch_size=2, local_steps=1)
    sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                         ConfigRecord(), grid)}
    replies = []
    for node, record in hardware.items():
        content = RecordDict({"arrays": ArrayRecord([np.ones(1) * node]), "metrics": MetricRecord(dict(GOOD))})
        if record is not None:
            content["lbbsp-hardware"] = record
        replies.append(Message(content, reply_to=sent[node]))
    arrays, _ = strategy.aggregate_train(1, replies)
    grid.close()
    return arrays, history, strategy


@pytest.mark.timeout(60)
def test_a_reply_with_a_bad_hardware_record_is_left_out_and_the_round_goes_on(redis_url: str, job: str) -> None:
    arrays, history, _ = hostile_round(redis_url, job, {1: ConfigRecord({"device": "cuda", "cores": 8}),
                                                        2: ConfigRecord({"device": "cpu", "cores": 10**9})})
    with history:
        assert arrays is not None and arrays.to_numpy_ndarrays()[0][0] == 1.0  # node 2 left out
        status = history.statuses()[history.worker_index(2)]
        assert status.status == "failed" and "lbbsp-hardware.cores" in status.reason
        assert history.statuses()[history.worker_index(1)].status == "ok"


@pytest.mark.timeout(60)
def test_a_reply_without_hardware_still_counts_beside_one_with_it(redis_url: str, job: str) -> None:
    """A client from before hardware was sent is aggregated and measured, on the default hardware key."""
    arrays, history, strategy = hostile_round(redis_url, job, {1: ConfigRecord({"device": "cuda:1", "cores": 8}),
                                                               2: None})
    with history:
        assert arrays is not None and arrays.to_numpy_ndarrays()[0][0] == 1.5  # both, equally weighted
        index = {node: history.worker_index(node) for node in (1, 2)}
        assert hardware_of(history.reports(index[1])[0]) == ("cuda", 8)
        assert hardware_of(history.reports(index[2])[0]) == ("cpu", 0)
    assert strategy.model.hardware_ == {index[1]: ("cuda", 8), index[2]: ("cpu", 0)}


@pytest.mark.timeout(60)
def test_a_client_that_cannot_answer_the_hardware_query_still_trains(redis_url: str, job: str) -> None:
    """A ClientApp without ``@app.query()`` answers the query with an error: logged, and its round goes on."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        local = LocalRound(msg, link=EmulatedLink(1e9, 1e9))
        for _ in local.batches():
            pass
        return local.reply(ArrayRecord([np.zeros(2)]))

    grid = LocalGrid(app, [{}, {}])
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = run(history, grid, rounds=2, ask_hardware_s=5.0)
        assert {s.status for s in history.statuses().values()} == {"ok"}
    grid.close()
    assert set(strategy.plans[2]) == {1, 2}


@pytest.mark.parametrize("device", ["", "   ", "x" * 65, 5])
def test_a_bad_device_name_is_a_config_error_on_the_client(device: object) -> None:
    LocalGrid(make_app(), [{}])  # sets Flower's task identity so that messages can be built here
    content = RecordDict({"arrays": ArrayRecord([np.zeros(2)]), "config": ConfigRecord(Workload(2, 1).to_config())})
    msg = Message(content, dst_node_id=1, message_type="train")
    with pytest.raises(ConfigError, match="device must be a printable name"):
        LocalRound(msg, device=device)  # type: ignore[arg-type]


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan"), True, "5"])
def test_a_bad_query_wait_is_a_config_error(redis_url: str, job: str, seconds: object) -> None:
    with ClientHistory.from_url(redis_url, job) as history, pytest.raises(ConfigError, match="ask_hardware_s must"):
        LoadBalanced(FedAvg(), history, ask_hardware_s=seconds)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None,
                    reason="flower-superlink is not installed next to this Python")
def test_the_example_answers_the_hardware_query_on_a_real_deployment(redis_url: str, job: str,
                                                                      tmp_path: Path) -> None:
    """examples/flower_digits answers LoadBalanced's query with its ClientApp's ``@app.query()``, through a real
    SuperLink and SuperNodes (each query starts a ClientApp process, which 5 s did not cover on this VM)."""
    result = load_launcher().run_deployment(
        2, {"num-server-rounds": 1, "mode": "lbbsp", "job": job, "round-timeout": 120.0, "ask-hardware-s": 120.0},
        timeout_s=280, workdir=tmp_path, redis_url=redis_url)
    plans = result["plans"]
    assert isinstance(plans, list) and plans and not [line for line in plans if "gave no hardware" in line], plans
    with ClientHistory.from_url(redis_url, job) as history:
        devices = {hardware_of(history.reports(worker)[0]) for worker in history.workers().values()}
    assert devices == {("cpu", available_cores())}


def make_app_noting_asks(asked: list[int], answer_after_s: float = 0.0, answer: str | None = "cuda") -> ClientApp:
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
    grid = LocalGrid(make_app_noting_asks(asked), [{}, {}])
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
    grid = LocalGrid(make_app_noting_asks(asked, answer_after_s=2.0), [{}, {}])
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
    grid = LocalGrid(make_app_noting_asks([], answer=None), [{}, {}])  # the device forgotten in the query's answer
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
