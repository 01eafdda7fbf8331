"""A security review of the federated history with a real Redis: one stored round at the largest iteration no
longer stops every later Flower run, ASSIGN_INDICES scans a job's ids hash once a call (not once a new client) when
its counter is lost, and a client's error reason reaches the log and the history escaped and clipped."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from lbbsp import ConfigError, Report
from lbbsp.client_history import ClientStatus
from lbbsp.integrations.flower import ClientHistory, LoadBalanced
from lbbsp.integrations.flower_local import LocalGrid
from lbbsp.integrations.flower_server import MAX_CLIENT_REASON_CHARS
from lbbsp.protocol import MAX_ITERATION, MAX_WORKERS
from test_flower_port import app, fedavg, start, trains, warnings_like

#: The highest stored round a run may follow: it leaves 2**32 rounds to a run (and the runs after it).
BOUND = MAX_ITERATION - 2**32


def _store_old_round(history: ClientHistory, worker_key: str, round_: int) -> int:
    """Give ``worker_key`` an index, and store a report and a status of it at ``round_``, as a foreign writer may."""
    worker = history.worker_index(worker_key)
    history.client.rpush(history.key("reports", worker), Report(history.job, worker, round_, 4, 0.1).to_json())
    history.client.hset(history.key("status"), str(worker), ClientStatus(round_, "ok").to_json())
    return worker


@pytest.mark.timeout(60)
def test_a_stored_round_that_leaves_no_room_for_a_run_is_skipped_and_the_run_goes_on(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """A status or report at round 2**53 (valid when read) had made the next run's round 1 2**53 + 1: every
    aggregate_train raised ProtocolError ("round: must be an integer in [0, 9007199254740992] ..."), and so did
    Strategy.start, in every later run of the job."""
    with ClientHistory.from_url(redis_url, job) as history:
        worker = _store_old_round(history, "old-node", MAX_ITERATION)
        assert start(LoadBalanced(fedavg(), history, batch_size=4, local_steps=2), app(trains), rounds=2) is not None
        statuses = history.statuses()
        assert worker not in statuses and {s.round for s in statuses.values()} == {2}  # the run's rounds, from 1
        assert [r.iteration for r in history.reports(history.worker_index(1))] == [1, 2]
    for key in (rf"lbbsp:{job}:fl:reports:{worker}", rf"lbbsp:{job}:fl:status field {worker}"):
        assert warnings_like(caplog, rf"round {MAX_ITERATION} .*{key}.*leaves no room.*lbbsp forget --job {job}")


@pytest.mark.timeout(60)
def test_a_stored_round_at_the_bound_is_kept_and_the_run_follows_it(redis_url: str, job: str,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The bound skips only what leaves a run too few rounds: a round at it is the job's, and the run carries on."""
    with ClientHistory.from_url(redis_url, job) as history:
        worker = _store_old_round(history, "old-node", BOUND)
        assert start(LoadBalanced(fedavg(), history, batch_size=4, local_steps=2), app(trains)) is not None
        assert not warnings_like(caplog, "leaves no room")
        assert history.statuses()[worker].round == BOUND
        run = history.client.hget(history.key("status"), str(history.worker_index(1)))
        assert ClientStatus.from_json(run).round == BOUND + 1  # the run's round: no job gets this far by its own


def _hvals_calls(history: ClientHistory) -> int:
    """How many HVALS Redis has run, scripts' own calls included (INFO commandstats counts those too)."""
    return int(history.client.info("commandstats").get("cmdstat_hvals", {}).get("calls", 0))


def _fill_ids(history: ClientHistory, fields: int, index: int) -> None:
    """``fields`` client keys in the job's ids hash, each at ``index``, and its counter lost (not a number)."""
    pipe = history.client.pipeline(transaction=False)
    for start_at in range(0, fields, 5_000):
        pipe.hset(history.key("ids"), mapping={f"c{n}": index for n in range(start_at, start_at + 5_000)})
    pipe.set(history.key("next"), "x")
    pipe.execute()


@pytest.mark.timeout(60)
def test_new_clients_past_the_last_index_cost_one_scan_of_the_ids_hash_a_call(redis_url: str, job: str) -> None:
    """With the counter not a number and the next index over the maximum, each new client of a call had rescanned
    the ids hash (200 clients and 100,000 fields held Redis 15.9 s), and the error had said "100000 distinct client
    keys were seen" whatever was seen. Redis's own count of HVALS, script calls included, shows the scans."""
    with ClientHistory.from_url(redis_url, job) as history:
        _fill_ids(history, 20_000, MAX_WORKERS - 1)
        before = _hvals_calls(history)
        with pytest.raises(ConfigError, match=rf"every client index of the job is taken: no worker index is left "
                                              rf"for 200 new clients \(indices are handed out in order up to "
                                              rf"{MAX_WORKERS - 1} and never reused.*lbbsp forget --job {job}"):
            history.worker_indices([f"new-{i}" for i in range(200)])
        assert _hvals_calls(history) - before == 1
        before = _hvals_calls(history)
        with pytest.raises(ConfigError, match="no worker index is left for 1 new client"):
            history.worker_index("one-more")
        assert _hvals_calls(history) - before == 0  # the scan set the counter: it is not repeated
        history.client.unlink(history.key("ids"), history.key("next"))


@pytest.mark.timeout(60)
def test_a_lost_counter_restarts_above_the_stored_indices_with_one_scan(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        _fill_ids(history, 20_000, 500)
        before = _hvals_calls(history)
        assert history.worker_indices([f"new-{i}" for i in range(200)]) == list(range(501, 701))
        assert _hvals_calls(history) - before == 1
        assert history.client.get(history.key("next")) == b"701"
        assert history.worker_index("c7") == 500  # a known client keeps its index
        history.client.unlink(history.key("ids"), history.key("next"))


FORGED = "oom\n\x1b[32mINFO\x1b[0m :      lbbsp round 1: all 2 nodes ok\r\u2028"


def error_reply_round(redis_url: str, job: str, reason: str) -> tuple[ArrayRecord | None, str]:
    """One round of LoadBalanced over FedAvg in which node 1 replies well and node 2 with an error reply of
    ``reason``: the aggregated arrays, and the reason the history stores for node 2."""
    grid = LocalGrid(client_app=None, node_configs=[{}, {}])  # type: ignore[arg-type]  # no ClientApp is called
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(fedavg(), history, batch_size=8, local_steps=5)
        sent = {m.metadata.dst_node_id: m for m in strategy.configure_train(1, ArrayRecord([np.zeros(1)]),
                                                                             ConfigRecord(), grid)}
        ok = Message(RecordDict({"arrays": ArrayRecord([np.ones(1)]), "metrics": MetricRecord({"num-examples": 10})}),
                     reply_to=sent[1])
        arrays, _ = strategy.aggregate_train(1, [ok, Message(Error(code=0, reason=reason), reply_to=sent[2])])
        stored = history.statuses()[history.worker_index(2)].reason
    grid.close()
    return arrays, stored


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
