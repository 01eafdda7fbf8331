"""Ranks on two machines with no Redis given: rank 0's embedded server is reached over TCP, behind its password,
and training is exact. Two torchrun "nodes" on this machine stand in for the machines (LOCAL_WORLD_SIZE 1 of 2)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
from lbbsp import EmbeddedRedis, StoreUnavailable, embedded
from lbbsp.embedded import _free_port
from lbbsp.integrations.torch import Balancer
from test_embedded import _global_ipv6
from test_torch_exact import digits, in_gloo_group, single_process_params, spawn

SCRIPT = Path(__file__).with_name("torch_two_nodes.py")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_machines_reach_rank0s_embedded_redis_and_train_exactly(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LBBSP_REDIS_URL"}
    port = str(_free_port("127.0.0.1"))
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                               str(SCRIPT), str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for node in (0, 1)]
    try:
        printed = [node.communicate(timeout=200)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(p[-3000:] for p in printed)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["reached"][0].startswith("unix ")  # rank 0 keeps its own socket
    assert ranks[1]["reached"][0].startswith("tcp ")
    splits = ranks[0]["splits"]
    assert ranks[1]["splits"] == splits and len({tuple(s) for s in splits}) > len(splits) // 2
    for epoch in range(2):
        assert sorted(i for r in ranks for i in r["seen"][epoch]) == list(range(len(digits())))
    for rank in ranks:
        for got, want in zip(rank["params"], single_process_params()):
            np.testing.assert_allclose(np.array(got), want.numpy(), rtol=1e-6, atol=1e-9)


def _fail_to_serve(rank: int, init: str, out: str, failure: str) -> None:
    """Rank 1 says it runs on another machine. ``failure`` "reach": rank 0 offers an address nothing answers at,
    as behind a firewall; "start": rank 0's redis-server cannot start."""
    os.environ.pop("LBBSP_REDIS_URL", None)
    if rank == 1:
        socket.gethostname = lambda: "another-machine"
    elif failure == "reach":
        EmbeddedRedis.peer_urls = lambda self, toward=None: ["redis://127.0.0.1:1/0"]  # type: ignore[method-assign]
    else:
        embedded.redis_server_binary = lambda: "/bin/false"

    def work() -> dict:  # type: ignore[type-arg]
        try:
            Balancer.from_env(8).close()
        except StoreUnavailable as exc:
            return {"error": str(exc)}
        return {"error": None}

    in_gloo_group(rank, 2, init, out, work)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_cannot_reach_rank0s_redis_stops_every_rank(tmp_path: Path) -> None:
    """Rank 0 has its server and would go on into the first collective step, waiting for ever on a rank that gave
    up: every rank raises instead, naming the one that failed."""
    spawn(_fail_to_serve, (str(tmp_path / "rdv"), str(tmp_path), "reach"), nprocs=2, timeout_s=100)
    for rank in (0, 1):
        error = json.loads((tmp_path / f"rank{rank}.json").read_text())["error"]
        assert error.startswith("rank 1 (1 of 2 ranks) cannot reach rank 0's embedded Redis: no address") and \
            "redis://127.0.0.1:1/0 (ConnectionError)" in error, error


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_that_cannot_start_on_rank0_stops_every_rank(tmp_path: Path) -> None:
    """The other ranks would wait in the next collective for a rank 0 that raised: they hear of it instead."""
    spawn(_fail_to_serve, (str(tmp_path / "rdv"), str(tmp_path), "start"), nprocs=2, timeout_s=100)
    errors = [json.loads((tmp_path / f"rank{rank}.json").read_text())["error"] for rank in (0, 1)]
    assert "redis-server" in errors[0], errors
    assert errors[1].startswith("rank 0 could not start the embedded Redis: StoreUnavailable: "), errors


def _join_from_another_host(rank: int, init: str, out: str, master_addr: str | None = None) -> None:
    """Rank 1 says it runs on another machine by its host name alone (a launcher that sets no LOCAL_WORLD_SIZE)."""
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    os.environ.pop("LBBSP_REDIS_URL", None)
    if master_addr is not None:
        os.environ["MASTER_ADDR"] = master_addr
    if rank == 1:
        socket.gethostname = lambda: "another-machine"  # type: ignore[assignment]

    def work() -> dict:  # type: ignore[type-arg]
        lb = Balancer.from_env(8)
        where = lb.client.store.client.connection_pool.connection_kwargs
        lb.close()
        return {"reached": "unix" if "path" in where else "tcp", "host": where.get("host")}

    in_gloo_group(rank, 2, init, out, work)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_on_hosts_of_other_names_reach_rank0_over_tcp(tmp_path: Path) -> None:
    spawn(_join_from_another_host, (str(tmp_path / "rdv"), str(tmp_path)), nprocs=2, timeout_s=100)
    reached = [json.loads((tmp_path / f"rank{rank}.json").read_text())["reached"] for rank in (0, 1)]
    assert reached == ["unix", "tcp"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_on_an_ipv6_network_a_rank_reaches_rank0_by_its_ipv6_address(tmp_path: Path) -> None:
    """MASTER_ADDR is an IPv6 address (an IPv6-only cluster): rank 0's server listens there too, and rank 1 reaches
    it by the address its route to MASTER_ADDR leaves from."""
    address = _global_ipv6()
    spawn(_join_from_another_host, (str(tmp_path / "rdv"), str(tmp_path), address), nprocs=2, timeout_s=100)
    reached = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["reached"] for r in reached] == ["unix", "tcp"] and reached[1]["host"] == address
