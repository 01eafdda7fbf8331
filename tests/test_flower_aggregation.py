"""Aggregation maths: FedNova against a hand-computed reference, and the plugin applying it to real replies, a
client's arrays paired with the model's by name; integer and bool arrays keep training, and weights, steps or counts
that do not fit are refused."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from lbbsp.errors import LBBSPError
from lbbsp.fedagg import fednova, fednova_scales, rescale_update, sample_weights, weighted_average
from lbbsp.integrations.flower import ClientHistory, LoadBalanced, LocalRound
from lbbsp.integrations.flower_local import LocalGrid
from test_flower_messages import HONEST, _arrays


def sgd_linear(w: np.ndarray, x: np.ndarray, y: float, lr: float, steps: int) -> np.ndarray:
    """Local SGD on the loss 0.5 * (w . x - y)^2 of one sample."""
    for _ in range(steps):
        w = w - lr * (w @ x - y) * x
    return w


# Two clients of a 2-weight linear model, from w = (0, 0), lr = 0.5, one sample per step (batch 1):
#   A: x = (1, 0), y = 2, 1 step:  w_A = (1, 0)                      1 sample processed
#   B: x = (0, 1), y = 4, 2 steps: (0, 2) then (0, 3) -> w_B = (0, 3)  2 samples processed
# p = (1/3, 2/3); tau_eff = 1/3 * 1 + 2/3 * 2 = 5/3; normalised updates d_A = (1, 0), d_B = (0, 1.5)
# FedNova: 5/3 * (1/3 * (1, 0) + 2/3 * (0, 1.5)) = (5/9, 5/3). Plain sample-weighted FedAvg: (1/3, 2).
W0 = np.zeros(2)
W_A = sgd_linear(W0, np.array([1.0, 0.0]), 2.0, 0.5, 1)
W_B = sgd_linear(W0, np.array([0.0, 1.0]), 4.0, 0.5, 2)
FEDNOVA = np.array([5 / 9, 5 / 3])


def test_local_models_match_the_hand_computation() -> None:
    np.testing.assert_allclose(W_A, [1.0, 0.0])
    np.testing.assert_allclose(W_B, [0.0, 3.0])


def test_fednova_matches_hand_computed_reference() -> None:
    out = fednova([W0], [[W_A], [W_B]], steps=[1, 2], weights=[1, 2])
    np.testing.assert_allclose(out[0], FEDNOVA, rtol=1e-12)
    np.testing.assert_allclose(weighted_average([[W_A], [W_B]], [1, 2])[0], [1 / 3, 2.0], rtol=1e-12)


def test_fednova_with_equal_steps_is_the_weighted_average() -> None:
    rng = np.random.default_rng(0)
    glob = [rng.normal(size=(3, 2)), rng.normal(size=2)]
    local = [[g + rng.normal(size=g.shape) for g in glob] for _ in range(3)]
    for got, want in zip(fednova(glob, local, [4, 4, 4], [5, 1, 2]), weighted_average(local, [5, 1, 2])):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(fednova_scales([4, 4, 4], [5, 1, 2]), 1.0)


@pytest.mark.parametrize("weights", [[-1, 2], [0, 0], [np.nan, 1], [], [True, False], [1e308, 1e308],
                                     [10**400, 1], 3.0])
def test_bad_weights_are_rejected(weights: list[float]) -> None:
    """[1e308, 1e308] summed beyond a float and gave weights of 0; 10**400 raised a bare OverflowError."""
    with pytest.raises(LBBSPError):
        sample_weights(weights)


@pytest.mark.parametrize("call", [
    lambda: weighted_average([[W_A], [W_B]], [1, 1, 2]),  # gave 2/3 of the average: weights summed to less than 1
    lambda: weighted_average([[W_A], [W_B], [W_B]], [1, 2]),  # dropped the third client
    lambda: weighted_average([], [1.0]),  # a bare IndexError
    lambda: fednova([W0], [[W_A], [W_B]], steps=[1, 2, 2], weights=[1, 2, 2]),
    lambda: fednova([W0], [[W_A], [W_B]], steps=[1, 2], weights=[1, 2, 2]),
    lambda: fednova_scales([True, 2], [1, 1]), lambda: fednova_scales([1.5, 2], [1, 1]),
])
def test_a_count_of_clients_weights_or_steps_that_does_not_match_is_refused(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LBBSPError):
        call()


def test_an_integer_array_is_rounded_not_truncated() -> None:
    """A counter such as BatchNorm's num_batches_tracked, stretched by FedNova: 100 + 0.7 * (97 - 100) = 97.9 was
    truncated to 97."""
    out = rescale_update([np.array([100, 100])], [np.array([105, 97])], 0.7)[0]
    assert out.dtype == np.int64 and out.tolist() == [104, 98]  # 103.5 and 97.9


def _reply(instruction: Message, w: np.ndarray, samples: int, steps: int) -> Message:
    metrics = MetricRecord({"num-examples": 999, "lbbsp-samples": samples, "lbbsp-steps": steps,
                            "lbbsp-compute-s": 0.1 * samples, "lbbsp-download-s": 0.01, "lbbsp-upload-s": 0.01})
    return Message(RecordDict({"arrays": ArrayRecord([w]), "metrics": metrics}), reply_to=instruction)


@pytest.mark.timeout(60)
def test_plugin_aggregate_is_fednova_on_replies(redis_url: str, job: str) -> None:
    grid = LocalGrid(client_app=None, node_configs=[{}, {}])  # type: ignore[arg-type]  # no ClientApp is called
    with ClientHistory.from_url(redis_url, job) as history:
        # both are sent 2 steps; A stops after 1 (as at a deadline), and may: fewer steps than assigned, not more
        strategy = LoadBalanced(FedAvg(min_available_nodes=2), history, batch_size=1, local_steps=2, adapt="steps")
        sent = list(strategy.configure_train(1, ArrayRecord([W0]), ConfigRecord(), grid))
        by_node = {m.metadata.dst_node_id: m for m in sent}
        replies = [_reply(by_node[1], W_A, samples=1, steps=1), _reply(by_node[2], W_B, samples=2, steps=2)]
        arrays, _ = strategy.aggregate_train(1, replies)
    grid.close()
    assert arrays is not None
    np.testing.assert_allclose(arrays.to_numpy_ndarrays()[0], FEDNOVA, rtol=1e-9)


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
