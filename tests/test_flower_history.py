"""ClientHistory, what the Flower plugin keeps of each client in Redis: worker indices that stay unique when Redis
loses its data or holds foreign values, statuses checked where made and skipped where no lbbsp process wrote them,
stored rounds that leave a run room, two jobs on one Redis, and a state that stays bounded over a long run."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from lbbsp import client_history
from lbbsp.client_history import ClientHistory, ClientStatus
from lbbsp.errors import ProtocolError
from lbbsp.protocol import MAX_REASON_CHARS, Report

pytest.importorskip("flwr")
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from lbbsp import ConfigError, EmbeddedRedis
from lbbsp.integrations.flower import LoadBalanced
from lbbsp.integrations.flower_local import LocalGrid
from lbbsp.protocol import MAX_ITERATION, MAX_WORKERS
from test_flower_port import SEEN, app, fedavg, porting_app, start, start_rounds, trains, warnings_like


def test_the_client_history_stays_bounded_over_a_long_run(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job, max_reports=5, ttl_s=3600) as history:
        assert history.worker_indices(["a", "a", 7, "7", "b"]) == [0, 0, 1, 1, 2]  # one index per key, in one call
        for k in range(120):
            history.record([Report(job, w, k, 10, 0.1) for w in range(3)],
                           {w: ClientStatus(k, "ok") for w in range(3)})
        keys = history.client.keys(f"lbbsp:{job}:fl:*")
        assert [history.client.llen(history.key("reports", w)) for w in range(3)] == [5, 5, 5]
        assert all(0 < history.client.ttl(key) <= 3600 for key in keys)
        assert [r[0].iteration for r in history.rounds()] == list(range(115, 120))
        assert {w: s.round for w, s in history.statuses().items()} == {0: 119, 1: 119, 2: 119}


def test_the_rounds_are_read_in_batches_of_clients_each_client_once(redis_url: str, job: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A round trip per client had taken 3 s at a restart of a job that had seen 6,000 clients."""
    monkeypatch.setattr(client_history, "READ_BATCH", 2)
    with ClientHistory.from_url(redis_url, job) as history:
        history.worker_indices([f"c{w}" for w in range(5)])
        for k in range(3):
            history.record([Report(job, w, k, 10 + w, 0.1) for w in range(5) if (w + k) % 2 == 0], {})
        calls: list[str] = []
        call = history._call
        monkeypatch.setattr(history, "_call", lambda fn, *a, **k: calls.append(fn.__name__) or call(fn, *a, **k))
        rounds = history.rounds()
    assert calls == ["hgetall", "execute", "execute", "execute"]  # the index, then 5 clients 2 at a time
    assert [sorted((r.worker, r.samples) for r in reports) for reports in rounds] == [
        [(w, 10 + w) for w in range(5) if (w + k) % 2 == 0] for k in range(3)]


@pytest.mark.parametrize(("args", "field"), [((-1, "ok"), "round"), ((1, "done"), "status"), ((1, "ok", None), "reason"),
                                             ((1, "ok", "", float("nan")), "at"), ((1, "ok", "", -1.0), "at")])
def test_a_client_status_is_checked_where_it_is_made(args: tuple, field: str) -> None:
    """A bad status had been written over the client's good one, then skipped when read: now refused when made, with
    the field named, as when read; a long reason is still cut to its limit when written, and reads back."""
    with pytest.raises(ProtocolError) as caught:
        ClientStatus(*args)
    assert caught.value.field == field
    long = ClientStatus(2, "failed", "x" * 10_000, 5)
    assert long.at == 5.0 and isinstance(long.at, float)
    assert ClientStatus.from_json(long.to_json()) == ClientStatus(2, "failed", "x" * MAX_REASON_CHARS, 5.0)


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








@pytest.fixture(autouse=True)
def _seen() -> None:
    SEEN.clear()


@pytest.mark.timeout(60)
def test_two_jobs_on_one_redis_stay_apart_and_a_restart_carries_on_its_own_jobs_history(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    def serve(name: str, nodes: int, rounds: int) -> None:
        with ClientHistory.from_url(redis_url, name) as history:
            strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes)
            start_rounds(LoadBalanced(strategy, history, batch_size=4), porting_app(), nodes=nodes, rounds=rounds)

    servers = [threading.Thread(target=serve, args=(f"{job}-a", 2, 2)),
               threading.Thread(target=serve, args=(f"{job}-b", 3, 1))]
    for server in servers:
        server.start()
    for server in servers:
        server.join()
    with ClientHistory.from_url(redis_url, f"{job}-a") as a, ClientHistory.from_url(redis_url, f"{job}-b") as b:
        assert sorted(a.workers()) == ["1", "2"] and sorted(b.workers()) == ["1", "2", "3"]
        assert [r.iteration for r in a.reports(a.worker_index(1))] == [1, 2]
        assert [r.iteration for r in b.reports(b.worker_index(1))] == [1]
    caplog.clear()
    serve(f"{job}-a", 2, 1)  # job a restarted: its rounds and its model carry on, job b's history is untouched
    assert not [r for r in caplog.records if "no measurements yet" in r.getMessage()]
    with ClientHistory.from_url(redis_url, f"{job}-a") as a, ClientHistory.from_url(redis_url, f"{job}-b") as b:
        assert [r.iteration for r in a.reports(a.worker_index(1))] == [1, 2, 3]
        assert {s.round for s in b.statuses().values()} == {1}


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


def test_stored_statuses_no_lbbsp_process_wrote_are_skipped_and_the_good_ones_read(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """Each is refused where read, with the field named, as where made: the strategy's model then goes on from the
    clients' good statuses, never from a payload of another writer's."""
    good = ClientStatus(3, "ok", "", 5.0)
    with ClientHistory.from_url(redis_url, job) as history:
        history.client.hset(history.key("status"), mapping={
            "0": good.to_json(), "1": b"{",  # not JSON; then too large, and a reason longer than any written
            "2": json.dumps({"round": 3, "status": "ok", "reason": "x" * 5000, "at": 5.0}),
            "3": json.dumps({"round": 3, "status": "ok", "reason": "x" * (MAX_REASON_CHARS + 1), "at": 5.0})})
        with caplog.at_level("WARNING", logger="lbbsp.client_history"):
            assert history.statuses() == {0: good}
    said = sorted(r.getMessage() for r in caplog.records)
    assert len(said) == 3, said
    assert "payload: status is not valid JSON" in said[0] and "payload: status payload too large" in said[1], said
    assert "reason: must be a short string" in said[2], said


@pytest.mark.parametrize("key", ["", "k" * (client_history.MAX_CLIENT_KEY_CHARS + 1)], ids=["empty", "too long"])
def test_a_client_key_that_is_empty_or_too_long_is_refused_naming_the_bounds(redis_url: str, job: str,
                                                                             key: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        with pytest.raises(ProtocolError, match="client key must be 1 to 128 characters") as caught:
            history.worker_indices(["a", key])
        assert caught.value.field == "client"
        assert history.workers() == {}  # none indexed, "a" neither: the call is refused whole


def test_client_id_entries_no_lbbsp_process_wrote_are_skipped_and_the_others_listed(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        assert history.worker_indices(["a", "b"]) == [0, 1]
        history.client.hset(history.key("ids"), mapping={b"\xff": "3", "c": "not an index"})
        with caplog.at_level("WARNING", logger="lbbsp.client_history"):
            assert history.workers() == {"a": 0, "b": 1}
        assert caplog.text.count("skipping a bad client id entry") == 2


def test_the_federated_jobs_listed_leave_out_keys_whose_job_name_no_job_has(redis_url: str, job: str) -> None:
    """`lbbsp status` lists them by their keys: a foreign writer's key under lbbsp:*:fl: with no valid job name in it
    (not UTF-8, or a name lbbsp refuses) is no job."""
    foreign = [b"lbbsp:\xff\xfe:fl:ids", f"lbbsp:{job} bad\n:fl:ids".encode()]
    with ClientHistory.from_url(redis_url, job) as history:
        assert history.worker_indices(["a"]) == [0]
        history.client.set(foreign[0], 1)
        history.client.set(foreign[1], 1)
        try:
            jobs = client_history.flower_jobs(history.client)
        finally:
            history.client.delete(*foreign, *history.client.keys(f"lbbsp:{job}:*"))
    assert job in jobs and all(name.startswith(job) is (name == job) for name in jobs), jobs
