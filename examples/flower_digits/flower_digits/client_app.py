"""ClientApp: train on the client's own non-IID slice with the workload the server assigned, timed by lbbsp."""
from __future__ import annotations

import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from lbbsp.integrations.flower import EmulatedLink, LocalRound, Workload, hardware_reply

from . import task

app = ClientApp()


def _server_round(msg: Message) -> int:
    """The round number the strategy put in the train config (Flower's strategies send an int)."""
    server_round = msg.content.config_records["config"]["server-round"]
    if not isinstance(server_round, int):
        raise TypeError(f"the train config's server-round should be an int, got {server_round!r}")
    return server_round


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg, node = context.run_config, context.node_config
    pid, parts, seed = int(node["partition-id"]), int(node["num-partitions"]), int(cfg["seed"])
    prof = task.profile(pid, parts, seed, int(cfg.get("slow-links", 0)))
    # the emulated transfers, plus the real delivery and ClientApp start-up, which a deployment adds every round
    link = EmulatedLink(prof.down_bps, prof.up_bps, count_delivery=True) if cfg["emulate"] else None
    mine = task.partitions(parts, float(cfg["alpha"]), seed)[pid]
    rnd = LocalRound(msg, link=link, default=Workload(int(cfg["batch-size"]), int(cfg["local-steps"])),
                     data_size=len(mine))
    x, y = task.load_digits()
    server_round = _server_round(msg)
    rng = np.random.default_rng([seed, pid, server_round])
    params = msg.content.array_records["arrays"].to_numpy_ndarrays()
    loss = 0.0
    for batch_size in rnd.batches():
        started = time.perf_counter()
        batch = task.draw_batch(mine, batch_size, rng)
        params, loss = task.sgd_step(params, x[batch], y[batch], float(cfg["lr"]))
        if cfg["emulate"]:
            task.emulate_compute(batch_size, prof.speed, started)
    if task.drops_out(pid, server_round, float(cfg.get("dropout", 0.0)), seed):
        raise RuntimeError("emulated dropout: the device left before replying")
    return rnd.reply(ArrayRecord(params), {"train-loss": loss})


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The hardware LoadBalanced asks a new node for (ask-hardware-s), so its first round follows its peers'."""
    return hardware_reply(msg)
