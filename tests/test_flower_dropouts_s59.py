"""The Flower plugin's plan weighs dropouts as LB-BSP does (lbbsp.dropouts, tests/test_dropouts_s59.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from flwr.serverapp.strategy import FedAvg

from lbbsp import Report
from lbbsp.integrations.flower import ClientHistory, LoadBalanced


def test_the_flower_plan_caps_a_share_it_would_lose(redis_url: str, job: str) -> None:
    """The Flower plugin's plan weighs the availability its model learns from the round outcomes, as LB-BSP does."""
    nodes = list(range(101, 117))
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(), history, batch_size=20, local_steps=1)
        strategy.plan(1, nodes)  # equal: nothing measured yet; numbers the nodes
        index = {int(node): i for node, i in history.workers().items()}
        strategy.model.partial_fit([
            Report(job, index[node], 1, 20, 20 / (500.0 if node == 101 else 10.0), device="phone",
                   features={"download_s": 0.5, "upload_s": 9.5 if node == 116 else 0.5}) for node in nodes])
        before = strategy.plan(2, nodes)
        strategy.model.record_outcomes({index[102]: False, index[103]: False})
        after = strategy.plan(3, nodes)
    assert before[101].batch_size > 0.7 * 320 and after[101].batch_size < before[101].batch_size
    assert sum(w.batch_size for w in after.values()) == sum(w.batch_size for w in before.values()) == 320
