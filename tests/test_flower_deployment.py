"""A real Flower deployment on loopback (flower-superlink, 3 flower-supernode, `flwr run`) with the plugin."""
from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from lbbsp.integrations.flower import ClientHistory

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_digits" / "run.py"


def load_launcher():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("flower_digits_run", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None,
                    reason="flower-superlink is not installed next to this Python")
def test_three_rounds_on_superlink_and_supernodes(redis_url: str, job: str, tmp_path: Path) -> None:
    result = load_launcher().run_deployment(
        3, {"num-server-rounds": 3, "mode": "lbbsp", "job": job, "round-timeout": 120.0}, timeout_s=280,
        workdir=tmp_path, redis_url=redis_url)
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert rounds[-1]["accuracy"] > rounds[0]["accuracy"] + 0.2
    assert sorted(result["train_metrics"]) == ["1", "2", "3"]
    with ClientHistory.from_url(redis_url, job) as history:
        workers = sorted(history.workers().values())
        assert workers == [0, 1, 2]
        assert all([r.iteration for r in history.reports(w)] == [1, 2, 3] for w in workers)
        assert {s.status for s in history.statuses().values()} == {"ok"}
