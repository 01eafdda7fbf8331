"""One rank of a job on two torchrun "nodes" of one process each (both on this machine, so LOCAL_WORLD_SIZE is 1
and WORLD_SIZE 2; rank 1 takes another host name): no Redis URL is given, so rank 0 serves its embedded Redis
over TCP as well. Trains as
test_torch_exact's hook mode does and writes what it saw to OUT/rank<r>.json, with how the rank reached Redis.

    python -m torch.distributed.run --nnodes 2 --node-rank R --nproc-per-node 1 --master-addr 127.0.0.1 \\
        --master-port P tests/torch_two_nodes.py OUT
"""
from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lbbsp.integrations.torch import Balancer
from test_torch_exact import _train, destroy_group


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:  # a machine of its own (else it would take rank 0's unix socket)
        socket.gethostname = lambda: "node-1"
    reached: list[str] = []
    joined = Balancer.from_env

    def joined_recording(*args, **kwargs) -> Balancer:  # type: ignore[no-untyped-def]
        balancer = joined(*args, **kwargs)
        where = balancer.client.store.client.connection_pool.connection_kwargs
        reached.append(f"unix {where['path']}" if "path" in where else f"tcp {where['host']}:{where['port']}")
        return balancer

    Balancer.from_env = joined_recording  # type: ignore[method-assign]
    result = _train("hook", dist.get_rank(), None, "two-nodes")  # type: ignore[arg-type]
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps({**result, "reached": reached}))
    destroy_group()


if __name__ == "__main__":
    main(sys.argv[1])
