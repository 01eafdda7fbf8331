"""The learning task and the emulated clients, shared by the ClientApp, the ServerApp and the benchmark.

Data: scikit-learn's digits (1,797 8x8 images), read from the CSV that ships with scikit-learn (without
importing it: each Flower ClientApp is a fresh process and scikit-learn takes seconds to import). A fixed
20% is the server's test set; the rest is split across clients by a Dirichlet(alpha) draw per class, so
each client sees a skewed mix of digits (non-IID).

Model: softmax regression (64 x 10 weights + 10 biases, float64: 5,200 bytes), plain SGD.

Emulated heterogeneity (documented, deterministic in the seed): client i has a compute speed in samples/s
and a download and an upload bandwidth in bytes/s. One local step on b samples takes b / speed seconds
(the real numpy step, well under a millisecond, then a sleep for the rest); the model crosses each way in
bytes / bandwidth seconds (slept by :class:`~lbbsp.integrations.flower.EmulatedLink`). Every time the
client reports is therefore an emulated time, measured with a real clock. With run config ``dropout`` > 0,
some clients leave a round after training (an error reply, their samples lost): see :func:`drops_out`.
"""
from __future__ import annotations

import gzip
import importlib.util
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

NUM_CLASSES = 10
NUM_FEATURES = 64
TEST_FRACTION = 0.2


@lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Features scaled to [0, 1] and labels, from scikit-learn's bundled digits.csv.gz."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits data ship with scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as handle:
        data = np.loadtxt(handle, delimiter=",")
    return data[:, :-1] / 16.0, data[:, -1].astype(np.int64)


@lru_cache(maxsize=4)
def train_test_indices(seed: int) -> tuple[np.ndarray, np.ndarray]:
    _, y = load_digits()
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(len(y) * TEST_FRACTION)
    return order[cut:], order[:cut]


@lru_cache(maxsize=64)
def partitions(num_partitions: int, alpha: float, seed: int) -> tuple[np.ndarray, ...]:
    """Non-IID split of the training set: each class is divided among clients by a Dirichlet(alpha) draw. A client
    the draw left without a sample takes one from the largest part (at 500 clients, 28 of them had none, and each
    failed every round, drawing a batch from nothing)."""
    _, y = load_digits()
    train, _ = train_test_indices(seed)
    if num_partitions > len(train):
        raise ValueError(f"{num_partitions} clients are more than the {len(train)} training samples: each client needs "
                         "one at least")
    rng = np.random.default_rng(seed + 1)
    parts: list[list[int]] = [[] for _ in range(num_partitions)]
    for label in range(NUM_CLASSES):
        members = rng.permutation(train[y[train] == label])
        shares = rng.dirichlet([alpha] * num_partitions)
        cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
        for part, chunk in zip(parts, np.split(members, cuts)):
            part.extend(chunk.tolist())
    for part in parts:
        if not part:
            part.append(max(parts, key=len).pop())
    return tuple(np.array(sorted(p), dtype=np.int64) for p in parts)


def test_set(seed: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits()
    _, test = train_test_indices(seed)
    return x[test], y[test]


@dataclass(frozen=True)
class Profile:
    """One emulated client: compute speed (samples/s) and bandwidth each way (bytes/s)."""

    speed: float
    down_bps: float
    up_bps: float


#: The downlink of a client on a poor network (run config ``slow-links``), bytes/s; its uplink is half.
SLOW_LINK_DOWN_BPS = 1_000.0


def profile(partition_id: int, num_partitions: int, seed: int, slow_links: int = 0) -> Profile:
    """Heterogeneous clients: speeds spread 10x (log-uniform), a 4x-slower straggler every fifth client,
    downlinks of 4 to 40 kB/s and uplinks half as fast (phone-like asymmetry); clients 0 .. slow_links - 1
    are on a poor network instead (1 kB/s down: the 5,200-byte model takes about 16 s to cross both ways)."""
    rng = np.random.default_rng([seed, 7, num_partitions])
    speeds = 10 ** rng.uniform(np.log10(150), np.log10(1500), num_partitions)
    downs = 10 ** rng.uniform(np.log10(4_000), np.log10(40_000), num_partitions)
    speed = speeds[partition_id] / (4.0 if partition_id % 5 == 4 else 1.0)
    down = SLOW_LINK_DOWN_BPS if partition_id < slow_links else float(downs[partition_id])
    return Profile(float(speed), down, down / 2)


def drops_out(partition_id: int, server_round: int, dropout: float, seed: int) -> bool:
    """Whether the client leaves this round after training (its samples are lost): every third client never
    does, the next with chance ``dropout`` / 2, the next with chance ``dropout``."""
    chance = dropout * (partition_id % 3) / 2
    return bool(np.random.default_rng([seed, 11, partition_id, server_round]).random() < chance)


def init_params() -> list[np.ndarray]:
    return [np.zeros((NUM_FEATURES, NUM_CLASSES)), np.zeros(NUM_CLASSES)]


def sgd_step(params: list[np.ndarray], x: np.ndarray, y: np.ndarray, lr: float) -> tuple[list[np.ndarray], float]:
    """One SGD step on the mean cross-entropy of the batch; returns the new parameters and the loss."""
    w, b = params
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = float(-np.log(probs[np.arange(len(y)), y] + 1e-12).mean())
    probs[np.arange(len(y)), y] -= 1.0
    grad = probs / len(y)
    return [w - lr * (x.T @ grad), b - lr * grad.sum(axis=0)], loss


def accuracy(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    w, b = params
    return float(((x @ w + b).argmax(axis=1) == y).mean())


def draw_batch(indices: np.ndarray, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """``batch_size`` of the client's samples: without replacement when it has enough, else with."""
    return rng.choice(indices, size=batch_size, replace=batch_size > len(indices))


def emulate_compute(samples: int, speed: float, started: float) -> None:
    """Sleep until ``samples / speed`` seconds have passed since ``started`` (perf_counter)."""
    remaining = samples / speed - (time.perf_counter() - started)
    if remaining > 0:
        time.sleep(remaining)
