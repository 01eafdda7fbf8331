"""FedAvg with a fixed batch against the lbbsp plugin, on the same emulated heterogeneous Flower clients.
(Nine runs of emulated rounds in real time: about 16 minutes with the defaults; progress prints per round.)

    python experiments/bench_flower.py [--clients 12] [--rounds 15] [--target 0.88]

One run trains the flower_digits example nine times from the same start: standard FedAvg (every client
batch 32 x 5 local steps, weighted by client data size as FedAvg usually is), lbbsp weighting by samples
processed, and lbbsp weighting by data size; lbbsp weighting by data size, letting 10% of the clients (one
of 12) sit a round out (``sit_out``); then, weighting by data size, with emulated dropouts (``--dropout``: a
third of the clients never leave, a third leave a round after training with chance dropout / 2, a third with
chance dropout), lbbsp as is and with ``compensate_dropouts``. Last, with client 0 on a poor network (1 kB/s down,
0.5 kB/s up), FedAvg, lbbsp, and lbbsp with ``sit_out`` 0.1. Ratios are to the first FedAvg run; compare
the slow-link rows with each other too. It prints the mean round time, the time to reach
the target test accuracy, lbbsp / FedAvg ratios and, for lbbsp, the share of the nominal round total
(batch 32 x 5 steps x clients) that came back, and writes them to experiments/results/bench_flower.json
(or --out). For a quick look: --clients 4 --rounds 2 --out /tmp/bench_flower.json (about 2.5 minutes).

The clients are emulated (see examples/flower_digits/flower_digits/task.py): compute speed and link
bandwidths differ per client, and each client sleeps its emulated compute and transfer times, so the
times below are emulated times measured with a real clock. The rounds run on lbbsp's LocalGrid, which
drives Flower's Strategy.start and ClientApp in one process (Flower's simulation engine needs Ray; a real
SuperLink/SuperNode run spawns a process per client per round, whose start-up would swamp the emulated
times on this machine). The real deployment path is exercised by tests/test_flower_deployment.py.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "flower_digits"))

from _args import out_help, run_record, writing_results  # noqa: E402
from flower_digits import client_app, server_app  # noqa: E402

from lbbsp import EmbeddedRedis  # noqa: E402
from lbbsp.integrations.flower import ClientHistory  # noqa: E402
from lbbsp.integrations.flower_local import LocalGrid  # noqa: E402

OUT = ROOT / "experiments" / "results" / "bench_flower.json"
BATCH, STEPS = 32, 5
#: (name, mode, weight by, with dropouts, compensate dropouts, share of clients that may sit a round out,
#: clients on a poor network)
RUNS = (("fedavg (weight by data)", "fedavg", "data", False, False, 0.0, 0),
        ("lbbsp (weight by samples)", "lbbsp", "samples", False, False, 0.0, 0),
        ("lbbsp (weight by data)", "lbbsp", "data", False, False, 0.0, 0),
        ("lbbsp (weight by data), sit out", "lbbsp", "data", False, False, 0.1, 0),
        ("lbbsp, dropouts", "lbbsp", "data", True, False, 0.0, 0),
        ("lbbsp, dropouts, compensated", "lbbsp", "data", True, True, 0.0, 0),
        ("fedavg, 1 slow link", "fedavg", "data", False, False, 0.0, 1),
        ("lbbsp, 1 slow link", "lbbsp", "data", False, False, 0.0, 1),
        ("lbbsp, 1 slow link, sit out", "lbbsp", "data", False, False, 0.1, 1))


def run_one(mode: str, weight_by: str, clients: int, rounds: int, redis_url: str, dropout: float = 0.0,
            compensate: bool = False, sit_out: float = 0.0,
            slow_links: int = 0, on_round: Callable[[dict[str, float]], None] | None = None,
            ) -> tuple[list[dict[str, float]], float | None]:
    """The per-round accuracy and times, and (lbbsp) the mean share of the nominal round total that came back;
    ``on_round`` receives each round's row as it ends."""
    cfg: server_app.Config = {
        "num-server-rounds": rounds, "num-clients": clients, "mode": mode, "adapt": "batch", "batch-size": BATCH,
        "local-steps": STEPS, "min-size": 8, "weight-by": weight_by, "deadline-slack": 0.0, "lr": 0.5,
        "alpha": 0.5, "seed": 0, "emulate": True, "round-timeout": 120.0, "dropout": dropout,
        "compensate-dropouts": compensate, "sit-out": sit_out, "slow-links": slow_links}
    grid = LocalGrid(client_app.app, [{"partition-id": i, "num-partitions": clients} for i in range(clients)],
                     run_config=cfg)
    history = ClientHistory.from_url(redis_url, f"bench-{uuid.uuid4().hex[:8]}") if mode == "lbbsp" else None
    try:
        rows = server_app.run(grid, cfg, history, on_round)["rounds"]
        back = None
        if history is not None:  # the samples of every reply that came back, per round, from the client history
            per_round: dict[int, int] = {}
            for reports in history.rounds():
                for report in reports:
                    per_round[report.iteration] = per_round.get(report.iteration, 0) + report.samples
            back = float(np.mean(list(per_round.values()))) / (BATCH * STEPS * clients)
        return rows, back
    finally:
        grid.close()
        if history is not None:
            history.close()


def print_round(row: dict[str, float]) -> None:
    """One round's progress line, printed as the round ends (round 0, the starting model's accuracy, is not one)."""
    if row["round"] >= 1:
        print(f"   round {row['round']:3.0f}  accuracy {row['accuracy']:.3f}  elapsed {row['elapsed_s']:7.2f}s",
              flush=True)


class Summary(TypedDict):
    """One run's figures, as printed and written (with its rounds) to bench_flower.json."""

    mean_round_s: float
    time_to_target_s: float | None
    rounds_to_target: float | None
    final_accuracy: float
    samples_back: float | None


def summarise(rows: list[dict[str, float]], target: float, samples_back: float | None) -> Summary:
    elapsed = np.array([r["elapsed_s"] for r in rows])
    reached = [r["elapsed_s"] for r in rows if r["accuracy"] >= target]
    return {"mean_round_s": float(np.diff(elapsed).mean()), "time_to_target_s": reached[0] if reached else None,
            "rounds_to_target": next((r["round"] for r in rows if r["accuracy"] >= target), None),
            "final_accuracy": rows[-1]["accuracy"], "samples_back": samples_back}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=12,
                        help="emulated clients, each a node of the LocalGrid (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=15,
                        help="federated rounds of each of the nine runs (default: %(default)s; the defaults take "
                             "about 16 minutes)")
    parser.add_argument("--target", type=float, default=0.88,
                        help="the test accuracy whose time to reach is reported, in [0, 1] (default: %(default)s)")
    parser.add_argument("--dropout", type=float, default=0.4,
                        help="the most-dropping clients' chance per round (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help=out_help(OUT))
    args = parser.parse_args()
    if args.clients < 1 or args.rounds < 1:
        parser.error("--clients and --rounds must be at least 1")
    if not (0 <= args.dropout <= 1 and 0 <= args.target <= 1):  # NaN too
        parser.error("--dropout (a chance) and --target (an accuracy) must lie in [0, 1]")
    with writing_results(parser, args.out) as args.out:
        benchmark(args)


def benchmark(args: argparse.Namespace) -> None:
    """Every run of RUNS in turn, each round printed as it ends; then the table, and the JSON file."""
    summaries: dict[str, Summary] = {}
    results: dict[str, dict[str, object]] = {}  # the summaries with their rounds, for the JSON file
    flwr = logging.getLogger("flwr")
    level = flwr.level
    flwr.setLevel(logging.ERROR)  # the emulated dropouts would log a warning each
    try:
        with EmbeddedRedis() as redis:
            for name, mode, weight_by, dropouts, compensate, sit_out, slow_links in RUNS:
                print(f"-- {name}: {args.clients} emulated clients, {args.rounds} rounds", flush=True)
                rows, back = run_one(mode, weight_by, args.clients, args.rounds, redis.url,
                                     args.dropout if dropouts else 0.0, compensate, sit_out, slow_links, print_round)
                summaries[name] = summarise(rows, args.target, back)
                results[name] = {**summaries[name], "rounds": rows}
    finally:  # a caller's own Flower warnings stay (a test suite's later tests had seen none)
        flwr.setLevel(level)
    base = summaries["fedavg (weight by data)"]
    print(f"\nemulated times; target test accuracy {args.target}; dropout {args.dropout}")
    print(f"{'run':32s} {'mean round s':>12s} {'to target s':>12s} {'rounds':>7s} {'final acc':>9s}"
          f" {'round ratio':>11s} {'target ratio':>12s} {'samples back':>12s}")
    for name, res in summaries.items():
        ttt, base_ttt = res["time_to_target_s"], base["time_to_target_s"]
        ratio_t = f"{ttt / base_ttt:.3f}" if ttt is not None and base_ttt else "n/a"
        share_back = f"{res['samples_back']:.0%}" if res["samples_back"] is not None else "-"
        to_target = "not reached" if ttt is None else f"{ttt:.2f}"  # as the docs' table says
        rounds = "-" if res["rounds_to_target"] is None else f"{res['rounds_to_target']:.0f}"
        print(f"{name:32s} {res['mean_round_s']:12.2f} {to_target:>12s} {rounds:>7s} {res['final_accuracy']:9.3f} "
              f"{res['mean_round_s'] / base['mean_round_s']:11.3f} {ratio_t:>12s} {share_back:>12s}")
    args.out.write_text(json.dumps({"clients": args.clients, "rounds": args.rounds, "target": args.target,
                                    "dropout": args.dropout, "emulated": True, "runs": results,
                                    "run": run_record()}, indent=1,
                                   allow_nan=False))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
