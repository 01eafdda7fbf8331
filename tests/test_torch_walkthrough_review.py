"""What a PyTorch DDP user porting a script by docs/torch.md met: DDP's per-rank batch_size given to the loader, a
global batch larger than the dataset, the warning at torch.compile's recompile (every worker slowed at once),
the policy example's imports, and the loader's prefetch= missing from Balancer.loader's signature."""
from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import TensorDataset  # noqa: E402

from lbbsp import ConfigError, Coordinator, JobConfig, Report, Store  # noqa: E402
from lbbsp.integrations.torch import BalancedLoader, Balancer  # noqa: E402
from lbbsp.models import EWMAThroughput  # noqa: E402
from lbbsp.policies import LBBSPPolicy  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs" / "torch.md"


def samples(n: int = 200) -> TensorDataset:
    return TensorDataset(torch.randn(n, 10), torch.randint(0, 3, (n,)))


def stand_in(global_batch: int, world_size: int) -> SimpleNamespace:
    """A Balancer of ``world_size`` ranks as the loader reads one (its config and world size): what is checked
    here happens before any step, Redis or collective."""
    return SimpleNamespace(config=JobConfig("unit", world_size, global_batch), _loaders=set(), world_size=world_size)


def test_ddps_batch_size_given_to_the_loader_says_how_to_pick_the_global_batch() -> None:
    """DDP's batch_size is per rank: a porter on 2 ranks who set global_batch to their old batch_size of 16
    trained on half the batch; the error had said only that the loader sets batch_size itself."""
    with pytest.raises(ConfigError, match=r"global_batch = batch_size x world size \(here 16 x 2 = 32\).*"
                                          r"Balancer.from_env.*global batch is 16"):
        BalancedLoader(samples(), stand_in(16, 2), batch_size=16, num_workers=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"global_batch = batch_size x world size to Balancer.from_env"):
        BalancedLoader(samples(), stand_in(16, 2), batch_size=None)  # type: ignore[arg-type]


def test_a_global_batch_larger_than_the_dataset_warns_that_an_epoch_is_one_short_step(
        caplog: pytest.LogCaptureFixture) -> None:
    """global_batch=1000 on 200 samples had been taken without a word: each epoch one step of 200 samples."""
    with caplog.at_level(logging.WARNING, logger="lbbsp.torch"):
        loader = BalancedLoader(samples(), stand_in(1000, 2))  # type: ignore[arg-type]
    warned = [r.getMessage() for r in caplog.records if "larger than the dataset" in r.getMessage()]
    assert len(loader) == 1 and len(warned) == 1, warned
    assert "global batch 1000" in warned[0] and "one short step of 200 samples" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lbbsp.torch"):
        assert len(BalancedLoader(samples(), stand_in(200, 2))) == 1  # type: ignore[arg-type]  # one full step
        with pytest.raises(ConfigError, match="leaves no batch at all"):  # drop_last: refused, not warned about
            BalancedLoader(samples(), stand_in(1000, 2), drop_last=True)  # type: ignore[arg-type]
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_the_loaders_prefetch_is_a_parameter_of_balancer_loader_and_passed_on() -> None:
    """docs/torch.md lists prefetch= in lb.loader's signature; it went through **dataloader_kwargs, unseen by
    inspect.signature and by an editor's completion."""
    for function in (Balancer.loader, BalancedLoader.__init__):
        parameter = inspect.signature(function).parameters["prefetch"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None
    with pytest.raises(ConfigError, match="prefetch=True needs DataLoader worker processes"):
        Balancer.loader(stand_in(8, 1), samples(), prefetch=True)  # type: ignore[arg-type]
    assert Balancer.loader(stand_in(8, 1), samples(), prefetch=False, num_workers=1).prefetch is False  # type: ignore[arg-type]


def test_the_policy_example_of_the_redis_table_runs_with_the_imports_it_shows() -> None:
    """`from lbbsp import AutoCapacityModel` fails (it lives in lbbsp.models), and the example showed no import."""
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `policy=` |"))
    spans = re.findall(r"`([^`]+)`", row)
    imports = [span for span in spans if span.startswith("from ")]
    example = next(span for span in spans if span.startswith("LBBSPPolicy(AutoCapacityModel("))
    namespace: dict = {"lag": 2}
    exec("\n".join(imports), namespace)  # the docs' own import lines
    policy = eval(example, namespace)
    assert isinstance(policy, LBBSPPolicy) and policy.model.kinds == {3: "gpu"}


def test_every_worker_slowed_at_once_is_named_as_a_pause_of_the_whole_job(
        redis_url: str, job: str, caplog: pytest.LogCaptureFixture) -> None:
    """torch.compile recompiles on every rank when the slice size first changes: the warning had called each rank
    a stalled worker that 'the model gives few samples', where the split hardly moves (their speeds keep their
    ratio)."""
    speeds = (4500.0, 8000.0)
    coordinator = Coordinator(Store.from_url(redis_url, job), JobConfig(job, 2, 32, lag=1),
                              LBBSPPolicy(EWMAThroughput()))
    with caplog.at_level(logging.WARNING, logger="lbbsp.coordinator"):
        for k in range(6):
            sizes = coordinator._in_force(k).sizes
            for worker, size in enumerate(sizes):
                seconds = {0: 1.0, 1: 0.5}[worker] if k == 4 else size / speeds[worker]  # both paused at once
                coordinator.store.post_report(Report(job, worker, k, size, seconds), 2)
            coordinator.decide(k)
    warned = [r.getMessage() for r in caplog.records if "previous measurement" in r.getMessage()]
    assert len(warned) == 1, warned
    assert re.search(r"iteration 4: worker 0: [\d.e+]+ samples/s, after 4\.5e\+03; worker 1: ", warned[0]), warned
    assert "every worker at once" in warned[0] and "recompile" in warned[0], warned
    assert "gives such a worker few samples" not in warned[0], warned
    assert coordinator._in_force(5).sizes == (11, 21)  # the split kept its ratio
