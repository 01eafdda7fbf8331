"""A fault walkthrough of LoadBalanced's messages: a reply whose timing makes no Report is named by the metric the
client sent and by its node alone, and a client whose data size leaps (the weight FedAvg gives its update, which
cannot be checked) is warned about once."""
from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from lbbsp.integrations.flower import ClientHistory, LoadBalanced, Workload
from lbbsp.integrations.flower_local import LocalGrid
from test_flower_port import fedavg, warnings_like

HONEST = {"lbbsp-samples": 40, "lbbsp-steps": 5, "lbbsp-compute-s": 0.1, "lbbsp-download-s": 0.01,
          "lbbsp-upload-s": 0.01}


def _reply(sent: Message, value: float, **metrics: float) -> Message:
    """An lbbsp reply to ``sent`` that did all the work it was given, the model's one array set to ``value``."""
    workload = Workload.from_config(sent.content.config_records["config"])
    samples = workload.batch_size * workload.local_steps
    honest = {**HONEST, "lbbsp-samples": samples, "lbbsp-steps": workload.local_steps, "num-examples": samples}
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
