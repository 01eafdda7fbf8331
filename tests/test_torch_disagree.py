"""Ranks that run another lbbsp version, or another number of epochs, end every rank with a ConfigError naming the
difference, on 2 real gloo ranks: the first had died of a KeyError on one rank (or of a gloo abort at its first
loader), the second had left both ranks waiting in mismatched collectives until the process group's timeout."""
from __future__ import annotations

import functools
import json
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import lbbsp.integrations.torch as lbbsp_torch  # noqa: E402
from lbbsp import ConfigError, __version__  # noqa: E402
from lbbsp.integrations.torch import Balancer  # noqa: E402
from test_torch_exact import spawn  # noqa: E402

SAMPLES, GLOBAL_BATCH = 32, 8  # 4 steps per epoch
OTHER_VERSION = "0.0.0+other"


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, 5, generator=g), torch.randn(SAMPLES, 1, generator=g))


def _disagreeing_rank(rank: int, world: int, init: str, url: str, job: str, out: str, misuse: str) -> None:
    """Train one epoch (two on rank 0 where they differ in epochs); write the ConfigError's text, or "trained"."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    if misuse == "another lbbsp version on rank 1" and rank == 1:  # one that also compares a setting of its own
        lbbsp_torch.__version__ = OTHER_VERSION
        lbbsp_torch._same_on_every_rank = functools.partial(lbbsp_torch._same_on_every_rank, hedge=0.1)
    epochs = 2 if misuse == "an epoch more on rank 0" and rank == 0 else 1
    try:
        with Balancer.from_env(GLOBAL_BATCH, redis=url, job=job) as lb:
            torch.manual_seed(0)
            model = lb.attach(DDP(torch.nn.Linear(5, 1)))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = lb.loader(data())
            for epoch in range(epochs):
                loader.set_epoch(epoch)
                for x, y in loader:
                    F.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
        said = "trained"
    except ConfigError as exc:
        said = str(exc)
    Path(out, f"rank{rank}.json").write_text(json.dumps(said))
    dist.destroy_process_group()


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("misuse", "told"), [
    ("another lbbsp version on rank 1", [f"the ranks run different versions of lbbsp ({__version__} on "
                                         f"rank 0; {OTHER_VERSION} on rank 1): install one version"] * 2),
    ("an epoch more on rank 0", ["rank(s) [1] closed the Balancer as this rank began epoch 1 of lb.loader: every rank "
                                 "must run the same number of epochs",
                                 "rank(s) [0] began another epoch of lb.loader as this rank closed the Balancer: "
                                 "every rank must run the same number of epochs"]),
])
def test_ranks_that_disagree_all_stop_with_an_error_naming_it(tmp_path: Path, redis_url: str, misuse: str,
                                                              told: list[str]) -> None:
    """Each rank says what differs, within seconds, instead of a KeyError or a wait for the group's timeout."""
    spawn(_disagreeing_rank, (2, str(tmp_path / "rdv"), redis_url, f"test-{uuid.uuid4().hex[:10]}", str(tmp_path),
                              misuse), nprocs=2, timeout_s=120)
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(text.startswith(start) for text, start in zip(said, told)), said
