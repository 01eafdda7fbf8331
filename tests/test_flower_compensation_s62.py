"""compensate_dropouts asks the smallest total whose samples expected back make the nominal total (brute force)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.serverapp.strategy import FedAvg

from lbbsp import Report
from lbbsp.dropouts import weighed_dropout
from lbbsp.integrations.flower import ClientHistory, LoadBalanced


def _compensation_is_smallest(redis_url: str, job: str, rng: np.random.Generator, max_size: int | None) -> bool | None:
    """Whether one random draw (3-16 clients, one or two fast, some unreliable) compensates with the smallest total
    that a scan of every total finds sufficing (the largest where none does); None where no compensation is due."""
    count, batch = int(rng.integers(3, 17)), int(rng.integers(3, 25))
    nodes = list(range(101, 101 + count))
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(), history, batch_size=batch, local_steps=1, compensate_dropouts=True,
                                max_size=max_size)
        strategy.plan(1, nodes)  # equal: nothing measured yet; numbers the nodes
        index = {int(node): i for node, i in history.workers().items()}
        speeds = rng.uniform(5, 20, count)
        speeds[:int(rng.integers(1, 3))] = rng.uniform(100, 600)
        strategy.model.partial_fit([
            Report(job, index[node], 1, batch, batch / speed, device="phone",
                   features={"download_s": 0.5, "upload_s": float(rng.uniform(0.2, 5))})
            for node, speed in zip(nodes, speeds)])
        available = np.where(rng.random(count) < 0.4, rng.uniform(0.1, 0.95, count), 1.0)
        workers = strategy._worker_indices(nodes)
        time_model, stay = strategy._time_model(workers), strategy.rounds_out.due(workers)
        dropout, total = weighed_dropout(available), batch * count

        def back(candidate: int) -> float:
            return float(available @ strategy._split(time_model, candidate, stay, dropout)[0])

        if back(total) >= total:
            return None
        chosen = int(strategy._compensated(time_model, total, available, stay, dropout)[0].sum())
        high = min(2 * total, strategy._largest(2 * total) * count)
        enough = back(chosen) >= total
        smallest = next((t for t in range(total, chosen if enough else high + 1) if back(t) >= total), chosen)
        return chosen == smallest and (enough or chosen == high)


def test_compensation_asks_the_smallest_total_that_suffices(redis_url: str, job: str) -> None:
    """Over random draws, with and without ``max_size``, the total chosen is the smallest that brings the nominal
    total back, and never one that falls short where another suffices: the bisection alone had asked 2-8 over the
    smallest in 4 of these draws (156 where 148 sufficed)."""
    rng = np.random.default_rng(7)
    outcomes = [_compensation_is_smallest(redis_url, f"{job}-{draw}", rng, [None, 40, 25][draw % 3])
                for draw in range(26)]
    assert [draw for draw, smallest in enumerate(outcomes) if smallest is False] == []
    assert sum(smallest is not None for smallest in outcomes) >= 20
