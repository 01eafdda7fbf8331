"""The Flower plugin's plan weighs dropouts as LB-BSP does (lbbsp.dropouts, tests/test_dropouts_s59.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from flwr.serverapp.strategy import FedAvg

from lbbsp import Report
from lbbsp.integrations.flower import ClientHistory, LoadBalanced


@pytest.mark.parametrize("compensate", [False, True])
def test_the_flower_plan_caps_a_share_it_would_lose(redis_url: str, job: str, compensate: bool) -> None:
    """The Flower plugin's plan weighs the availability its model learns from the round outcomes, as LB-BSP does; also
    where it raises the round total to make up for dropouts (that split had left the cap out: 315 of 400)."""
    nodes = list(range(101, 117))
    with ClientHistory.from_url(redis_url, job) as history:
        strategy = LoadBalanced(FedAvg(), history, batch_size=20, local_steps=1, compensate_dropouts=compensate)
        strategy.plan(1, nodes)  # equal: nothing measured yet; numbers the nodes
        index = {int(node): i for node, i in history.workers().items()}
        strategy.model.partial_fit([
            Report(job, index[node], 1, 20, 20 / (500.0 if node == 101 else 10.0), device="phone",
                   features={"download_s": 0.5, "upload_s": 9.5 if node == 116 else 0.5}) for node in nodes])
        before = strategy.plan(2, nodes)
        strategy.model.record_outcomes({index[102]: False, index[103]: False})
        after = strategy.plan(3, nodes)
    total = sum(w.batch_size for w in after.values())
    assert before[101].batch_size > 0.7 * 320 and after[101].batch_size < 0.2 * total
    assert sum(w.batch_size for w in before.values()) == 320 and (total > 320 if compensate else total == 320)
