"""What a client or server app can get wrong, caught where it happens: a plain reply's weight that is not a
finite positive number, a ClientApp that returns no Message, a LocalGrid smaller than the strategy (or a wrapped
one) waits for, a second loop over a round's batches, arguments and settings that could never work (ConfigErrors up
front, by name), and rounds too large to balance. Real Strategy.start loop on LocalGrid, real ClientApps, real Redis."""
from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    FedXgbBagging,
    FedXgbCyclic,
)
from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod

from lbbsp import ConfigError, EmbeddedRedis, EWMAThroughput, ProtocolError, Report, StoreUnavailable
from lbbsp.integrations.flower import ClientHistory, ClientResult, EmulatedLink, LoadBalanced, LocalRound, Workload
from lbbsp.integrations.flower_client import MAX_LOCAL_STEPS
from lbbsp.integrations.flower_local import LocalGrid
from lbbsp.protocol import MAX_BATCH
from test_flower import _train_message
from test_flower_port import SEEN, a_train_message, dp, porting_app, start_rounds, warnings_like


def three_nodes(plain_weight: float | None) -> ClientApp:
    """Nodes 1 and 2 train with LocalRound (w + 1 a step); node 3 replies as a plain Flower ClientApp with weight
    ``plain_weight`` and w + 100, or returns None when ``plain_weight`` is None (a train function without
    ``return``)."""
    client = ClientApp()

    @client.train()
    def _train(msg: Message, context: Context) -> Message | None:
        w = msg.content.array_records["arrays"].to_numpy_ndarrays()[0]
        if context.node_id == 3:
            if plain_weight is None:
                return None
            return Message(RecordDict({"arrays": ArrayRecord([w + 100.0]),
                                       "metrics": MetricRecord({"train-loss": 1.0, "num-examples": plain_weight})}),
                           reply_to=msg)
        rnd = LocalRound(msg)
        for _ in rnd.batches():
            w = w + 1.0
        return rnd.reply(ArrayRecord([w]), {"train-loss": 1.0})

    return client


def run(client: ClientApp, history: ClientHistory, nodes: int = 3) -> np.ndarray:
    strategy = LoadBalanced(FedAvg(fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes), history,
                            batch_size=4, local_steps=2)
    grid = LocalGrid(client, [{}] * nodes)
    try:
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(1)]), num_rounds=2, timeout=30)
    finally:
        grid.close()
    return result.arrays.to_numpy_ndarrays()[0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("weight", [math.nan, math.inf, -202.0, -5, 0])
def test_a_plain_reply_whose_weight_is_not_a_finite_positive_number_is_left_out(
        redis_url: str, job: str, weight: float, caplog: pytest.LogCaptureFixture) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        final = run(three_nodes(weight), history)
        assert history.statuses()[history.worker_index(3)].status == "failed"
    np.testing.assert_allclose(final, [4.0])  # two rounds of 2 steps by nodes 1 and 2 only: no NaN, no 100
    assert len(warnings_like(caplog, r"node 3 failed and is left out: bad reply: num-examples: a reply without "
                                     r"lbbsp's metrics must give its weight as a finite number above 0")) == 2


@pytest.mark.timeout(90)
def test_a_client_app_that_returns_no_message_is_an_error_reply_not_a_crash(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        np.testing.assert_allclose(run(three_nodes(None), history), [4.0])
        assert history.statuses()[history.worker_index(3)].status == "failed"
    assert len(warnings_like(caplog, r"node 3 failed and is left out: TypeError: the ClientApp returned NoneType, "
                                     r"not a Message \(a train function ends with `return rnd\.reply")) == 2


@pytest.mark.timeout(60)
def test_a_local_grid_with_fewer_nodes_than_the_strategy_waits_for_is_an_error_not_a_wait(redis_url: str,
                                                                                          job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        grid = LocalGrid(three_nodes(1.0), [{}])
        with pytest.raises(ConfigError, match=r"waits for 2 nodes.*this LocalGrid has 1.*min_train_nodes of at most 1"):
            LoadBalanced(FedAvg(fraction_evaluate=0.0), history, batch_size=4, local_steps=2).start(
                grid=grid, initial_arrays=ArrayRecord([np.zeros(1)]), num_rounds=1, timeout=5)
        grid.close()


def test_a_second_loop_over_the_batches_is_refused_on_the_client() -> None:
    rnd = LocalRound(a_train_message())
    for epoch in range(2):
        if epoch == 1:
            with pytest.raises(ConfigError, match=r"batches\(\) was called twice.*2 local steps"):
                rnd.batches()
        else:
            assert list(rnd.batches()) == [4, 4]


@pytest.mark.parametrize(("call", "match"), [
    (lambda msg: LocalRound(msg, link="x"), r"link must be a Link.*got 'x'"),
    (lambda msg: LocalRound(msg, weighted_by_key=""), r"weighted_by_key must be"),
    (lambda msg: LocalRound(msg, config_key=3), r"config_key must be None or the name"),
    (lambda msg: LocalRound(msg).reply(ArrayRecord([np.zeros(1)]), [("loss", 1.0)]), r"metrics must be None or a "
                                                                                      r"mapping"),
    (lambda msg: LocalRound(msg).reply(ArrayRecord([np.zeros(1)]), "loss"), r"metrics must be None or a mapping"),
    (lambda msg: EmulatedLink(1e3, 1e3, count_delivery="no"), r"count_delivery must be True or False, got 'no'"),
    (lambda msg: ClientHistory.from_url(None, job="j"), r"a Redis URL must be a string, got None"),
])
def test_client_side_arguments_are_checked_by_name(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        call(a_train_message())


def test_a_fractional_step_count_is_named_as_the_steps() -> None:
    with pytest.raises(ProtocolError, match=r"lbbsp-steps: must be a whole number under 2\*\*63, got 2\.5"):
        ClientResult.from_metrics(MetricRecord({"lbbsp-samples": 8, "lbbsp-steps": 2.5, "lbbsp-compute-s": 1.0,
                                                "lbbsp-download-s": 0.0, "lbbsp-upload-s": 0.0}))


def test_a_data_size_a_float_holds_but_an_int_metric_could_not_is_refused() -> None:
    """An int metric is refused from 2**63 up, and a whole float was taken to any size: two clients' 1e308 summed past
    a float in the FedNova weights, and the ServerApp stopped with 'sample counts sum beyond a float'."""
    metrics = {"lbbsp-samples": 8, "lbbsp-steps": 2, "lbbsp-compute-s": 1.0, "lbbsp-download-s": 0.0,
               "lbbsp-upload-s": 0.0}
    for size in (1e308, 2.0**63):
        with pytest.raises(ProtocolError, match=r"lbbsp-data-size: must be a whole number under 2\*\*63"):
            ClientResult.from_metrics(MetricRecord({**metrics, "lbbsp-data-size": size}))
    assert ClientResult.from_metrics(MetricRecord({**metrics, "lbbsp-data-size": 2.0**62})).data_size == 2**62


@pytest.mark.parametrize(("adapt", "batch_size", "local_steps", "clients"), [
    ("batch", 4_000_000, 2, 3),    # 12M samples a round in total: more than one allocation balances
    ("steps", 1, 400_000, 3),      # a fast client would be given more than MAX_LOCAL_STEPS
])
def test_large_rounds_plan_within_the_limits_instead_of_failing_at_round_two(
        redis_url: str, job: str, adapt: str, batch_size: int, local_steps: int, clients: int,
        caplog: pytest.LogCaptureFixture) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(), history, batch_size=batch_size, local_steps=local_steps, adapt=adapt)
        workers = history.worker_indices([1, 2, 3])
        samples = batch_size * local_steps
        strategy.model.partial_fit([Report(job, w, 1, samples, samples / speed) for w, speed in
                                    zip(workers, (1e6, 1e4, 1e4))])
        plan = strategy.plan(2, [1, 2, 3])
    unit = [w.batch_size if adapt == "batch" else w.local_steps for w in plan.values()]
    assert sum(unit) == (batch_size if adapt == "batch" else local_steps) * clients
    assert all(w.samples <= MAX_BATCH and w.local_steps <= MAX_LOCAL_STEPS for w in plan.values())
    if adapt == "batch":
        assert unit == [batch_size] * clients
        assert len(warnings_like(caplog, r"round total over 10,000,000 \(here 12,000,000\) is split equally")) == 1
    else:
        assert max(unit) == MAX_LOCAL_STEPS  # the fast client gets the most it may take, not an error


def test_an_equal_split_plan_logs_its_own_predicted_round(redis_url: str, job: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(), history, batch_size=100, local_steps=1)
        workers = history.worker_indices([1, 2])
        strategy.model.partial_fit([Report(job, w, 1, 100, seconds) for w, seconds in zip(workers, (1.0, 1.01))])
        strategy.plan(2, [1, 2])
    logged = [r.getMessage() for r in caplog.records if "lbbsp round 2: equal split (balancing gains" in r.getMessage()]
    assert len(logged) == 1 and "predicted round 1.01s" in logged[0]


@pytest.mark.timeout(60)
def test_a_stalled_redis_holds_a_history_call_seconds_not_a_quarter_minute(tmp_path: Path) -> None:
    """With the store's 5 s socket timeout and two retries, one call to a stopped Redis took 15 s, and a round's
    three calls held it 45 s (past its own 30 s timeout) before the warning."""
    with pytest.raises(ConfigError, match=r"socket_timeout_s must be seconds in \(0, 60\]"):
        ClientHistory.from_url("redis://unused", "j", socket_timeout_s=0)
    with EmbeddedRedis(tmp_path / "r") as server, ClientHistory.from_url(server.url, "stall") as history:
        history.worker_indices([1, 2])
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                history.worker_indices([3])
            assert time.monotonic() - started < 9  # 3 x 2 s and the backoff
        finally:
            os.kill(server.pid, signal.SIGCONT)


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


@pytest.fixture(autouse=True)
def _seen() -> None:
    SEEN.clear()


@pytest.mark.timeout(60)
def test_a_wrapped_strategy_that_waits_for_more_nodes_than_a_local_grid_has_is_a_config_error(
        redis_url: str, job: str) -> None:
    inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=5, min_train_nodes=2)
    with ClientHistory.from_url(redis_url, job) as history:
        with pytest.raises(ConfigError, match=r"waits for 5 nodes .* this LocalGrid has 3"):
            start_rounds(LoadBalanced(dp(inner, 2), history, batch_size=4), porting_app(), nodes=3, rounds=1)


@pytest.mark.timeout(60)
def test_a_fraction_over_one_or_an_evaluate_count_a_local_grid_cannot_meet_is_refused_before_any_round(
        redis_url: str, job: str) -> None:
    """FedAvg samples int(nodes x fraction) and waits for that many: 1.5 of 3 nodes had waited forever. Evaluation's
    counts are checked with the first train round, not after it trained."""
    with ClientHistory.from_url(redis_url, job) as history:
        too_many = FedAvg(fraction_train=1.5, fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2)
        with pytest.raises(ConfigError, match=r"waits for 4 nodes .*fraction_train 1.5.* this LocalGrid has 3"):
            start_rounds(LoadBalanced(too_many, history, batch_size=4), porting_app(), nodes=3, rounds=1)
        evaluates = FedAvg(min_available_nodes=2, min_train_nodes=2, min_evaluate_nodes=4)
        with pytest.raises(ConfigError, match=r"waits for 4 nodes \(min_available_nodes, min_evaluate_nodes"):
            start_rounds(LoadBalanced(evaluates, history, batch_size=4), porting_app(), nodes=3, rounds=1)
        assert SEEN == [] and history.rounds() == []


def test_tree_strategies_and_client_side_clipping_that_rescaling_would_break_are_refused(
        redis_url: str, job: str) -> None:
    """FedNova's rescaling stretches an update of fewer steps than the mean: past the clipping norm where the
    clients clipped (1.68x in a run of 4). Where every client takes local_steps nothing is rescaled."""
    with ClientHistory.from_url(redis_url, job) as history:
        for trees in (FedXgbBagging(), FedXgbCyclic()):
            with pytest.raises(ConfigError, match="train trees, with neither batches nor steps"):
                LoadBalanced(trees, history)
        for wrapper in (DifferentialPrivacyClientSideFixedClipping(FedAvg(), 0.0, 0.05, 3),
                        DifferentialPrivacyClientSideAdaptiveClipping(FedAvg(), 0.0, 3)):
            for refused in ({"adapt": "steps"}, {"deadline_slack": 1.5}):
                with pytest.raises(ConfigError, match=f"{type(wrapper).__name__} has each client clip its update"):
                    LoadBalanced(wrapper, history, **refused)  # type: ignore[arg-type]
            LoadBalanced(wrapper, history, adapt="batch")


@pytest.mark.timeout(60)
def test_an_update_a_client_clipped_is_never_stretched_where_it_took_fewer_steps(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """With adapt="batch" and no deadline a client whose data ran out (last_batch) takes fewer steps,
    and FedNova's rescaling had stretched its clipped update to 3.8x the clipping norm."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        rnd = LocalRound(msg, data_size=10)
        w = msg.content.array_records["arrays"].to_numpy_ndarrays()[0]
        for _ in rnd.batches():
            w = w + 1.0
            if context.node_id == 2:  # its data ran out in the first step: the round's last
                rnd.last_batch(1)
        return rnd.reply(ArrayRecord([w]), {})

    inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2)
    clipped = DifferentialPrivacyClientSideFixedClipping(inner, noise_multiplier=0.0, clipping_norm=100.0,
                                                         num_sampled_clients=2)
    with ClientHistory.from_url(redis_url, job) as history:
        result = start_rounds(LoadBalanced(clipped, history, batch_size=4, local_steps=4), app, nodes=2, rounds=1)
    # equal data sizes: the mean of the updates as the clients sent them, 4 and 1 (FedNova: 0.625 x 4 and 2.5 x 1)
    assert result.arrays.to_numpy_ndarrays()[0][0] == pytest.approx(2.5)  # type: ignore[attr-defined]
    assert warnings_like(caplog, r"nodes \[2\] took fewer local steps than the others; under client-side clipping "
                                 r"the round's updates are averaged as the clients clipped them") != []


@pytest.mark.timeout(60)
def test_a_client_that_sends_another_weight_key_than_the_strategys_is_warned_about(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    inner = FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2, weighted_by_key="n-samples")
    with ClientHistory.from_url(redis_url, job) as history:
        start_rounds(LoadBalanced(inner, history, batch_size=4), porting_app("num-examples"), nodes=2, rounds=2)
    assert warnings_like(caplog, r"nodes \[1, 2\] sent no 'n-samples', the strategy's weight key: give their "
                                 r"LocalRound weighted_by_key='n-samples'") != []
    assert len(warnings_like(caplog, "the strategy's weight key")) == 1  # once a client


class _CountingAccountant:
    """A PrivacyAccountant (Flower's protocol) that counts releases: Flower's own needs dp_accounting."""

    def __init__(self) -> None:
        self.config = PrivacyConfig(1e-5, 100, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION)
        self.num_releases = 0

    def compose(self, event: object, count: int = 1) -> None:
        self.num_releases += count


def test_a_dp_accountant_inside_is_refused_where_the_weights_cannot_be_equal(redis_url: str, job: str) -> None:
    """Flower's accounted aggregation refuses unequal client weights: with weight_by="samples" the round had raised
    "Accounted aggregation requires equal client weights" out of the ServerApp's start, in its first balanced
    round."""
    wrapped = DifferentialPrivacyServerSideFixedClipping(FedAvg(), noise_multiplier=1.0, clipping_norm=1.0,
                                                         num_sampled_clients=3, accountant=_CountingAccountant())
    with ClientHistory.from_url(redis_url, job) as history:
        for refused in ({"weight_by": "samples"}, {"sit_out": 0.2}):
            with pytest.raises(ConfigError, match="the DP wrapper's accountant needs equal client weights"):
                LoadBalanced(wrapped, history, **refused)  # type: ignore[arg-type]
        LoadBalanced(wrapped, history, weight_by="data")  # equal data sizes give equal weights
        LoadBalanced(DifferentialPrivacyServerSideFixedClipping(FedAvg(), noise_multiplier=1.0, clipping_norm=1.0,
                                                                num_sampled_clients=3), history, weight_by="samples")


def test_a_step_count_past_the_most_a_round_can_take_is_named_as_the_steps() -> None:
    """A claim of more local steps than any workload may give is refused while the metrics are read, before the
    workload check: the only check a reply to a round LoadBalanced did not send gets."""
    metrics: dict[str, int | float | list[int] | list[float]] = {
        "lbbsp-samples": 8, "lbbsp-steps": MAX_LOCAL_STEPS, "lbbsp-compute-s": 1.0, "lbbsp-download-s": 0.0,
        "lbbsp-upload-s": 0.0}
    assert ClientResult.from_metrics(MetricRecord(metrics)).steps == MAX_LOCAL_STEPS
    with pytest.raises(ProtocolError, match=rf"lbbsp-steps: must be at most {MAX_LOCAL_STEPS}$") as refused:
        ClientResult.from_metrics(MetricRecord({**metrics, "lbbsp-steps": MAX_LOCAL_STEPS + 1}))
    assert refused.value.field == "lbbsp-steps"


def test_an_unknown_adapt_or_weight_by_is_a_config_error_by_name(redis_url: str, job: str) -> None:
    with ClientHistory.from_url(redis_url, job) as history:
        with pytest.raises(ConfigError, match=r"adapt must be 'batch' or 'steps', got 'batches'"):
            LoadBalanced(FedAvg(), history, adapt="batches")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"weight_by must be 'auto', 'samples' or 'data', got 'examples'"):
            LoadBalanced(FedAvg(), history, weight_by="examples")  # type: ignore[arg-type]


def test_a_closed_local_grid_refuses_new_messages() -> None:
    """A grid used after close() (a second start() on it) says so, rather than start threads no one joins."""
    grid = LocalGrid(ClientApp(), [{}])
    grid.close()
    with pytest.raises(RuntimeError, match="LocalGrid is closed"):
        grid.push_messages([a_train_message()])
