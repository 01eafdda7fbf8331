"""Balancing benchmark over seeds: every policy's mean iteration time / oracle on each scenario and size, for
several seeds, and in how many of them LB-BSP was ahead of each other policy in the same run.

``lbbsp simulate`` runs one seed, one draw of a scenario's cluster: whether LB-BSP leads a policy by a percent
or trails it by one can be that draw's luck. Here each seed is a separate ``lbbsp simulate`` run (the same
scenarios, policies and engine, in process); the table gives the mean over seeds with the range, and
"lbbsp ahead" counts the seeds in which ``lbbsp`` (the default policy) had the shorter mean iteration time, or
in which the other policy gave some GPU more than its memory holds (where a real job fails: "over mem" counts
those seeds) and ``lbbsp`` did not. References (``oracle*``) know the future and are shown, not counted.

    python experiments/bench_policies.py [--seeds 5] [--workers 16 256 1024] [--scenarios cpu-contention gpu-mix]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from _args import empty_folders_removed_on_failure, interrupted_as_exit, out_help, results_file, run_record

from lbbsp.errors import ConfigError
from lbbsp.sim.cli import summarise
from lbbsp.sim.engine import compare
from lbbsp.sim.scenarios import LOOKAHEAD, MAX_CELLS, SCENARIOS

OUT = Path(__file__).resolve().parent / "results" / "bench_policies.json"


Figures = dict[str, dict[str, list[float]]]  # policy -> {"vs_oracle": per seed, "over_memory": per seed}


def run(scenario: str, workers: int, iterations: int, seeds: range) -> Figures:
    """Each policy's mean iteration time / oracle and its iterations over some GPU's memory, one entry per seed."""
    figures: Figures = {}
    for seed in seeds:
        started = time.perf_counter()
        summary = summarise(compare(SCENARIOS[scenario](workers, iterations, seed), iterations))
        for name, s in summary.items():
            entry = figures.setdefault(name, {"vs_oracle": [], "over_memory": []})
            entry["vs_oracle"].append(s["vs_oracle"])
            entry["over_memory"].append(s["over_memory_iterations"])
        print(f"  {scenario} {workers} workers seed {seed}: lbbsp {summary['lbbsp']['vs_oracle']:.3f} x oracle "
              f"({time.perf_counter() - started:.0f}s)", flush=True)
    return figures


def table(figures: Figures) -> str:
    """Policies by mean / oracle; for each non-reference policy, the seeds in which lbbsp was ahead of it."""
    ours = np.asarray(figures["lbbsp"]["vs_oracle"])
    ours_failed = np.asarray(figures["lbbsp"]["over_memory"]) > 0  # a seed lbbsp ran out of memory in is not a win
    lines = [f"  {'policy':<26}{'mean / oracle':>14}{'range':>17}{'over mem':>10}{'lbbsp ahead':>13}"]
    for name, entry in sorted(figures.items(), key=lambda item: float(np.mean(item[1]["vs_oracle"]))):
        v, over = np.asarray(entry["vs_oracle"]), np.asarray(entry["over_memory"]) > 0
        wins = ~ours_failed & ((ours < v) | over)
        ahead = "" if name == "lbbsp" or name.startswith("oracle") else f"{int(wins.sum())} of {v.size}"
        lines.append(f"  {name:<26}{v.mean():>14.3f}{f'{v.min():.3f}-{v.max():.3f}':>17}"
                     f"{f'{int(over.sum())} of {v.size}':>10}{ahead:>13}")
    return "\n".join(lines)


def check_sizes(parser: argparse.ArgumentParser, scenarios: list[str], workers: list[int], iterations: int) -> None:
    """``parser.error`` for a size a scenario cannot take, before any run: a size refused late (mixed: 4 workers at
    least; workers x iterations past a scenario's MAX_CELLS) had ended the run in a traceback."""
    for n in workers:
        for scenario in scenarios:
            try:
                SCENARIOS[scenario](n, 1, 0)  # one iteration: quick to build; the iterations are counted below
            except ConfigError as exc:
                parser.error(f"--workers {n} with --scenarios {scenario}: {exc}")
        if n * max(iterations, LOOKAHEAD) > MAX_CELLS:  # as the scenarios count it
            parser.error(f"--workers x --iterations must be at most {MAX_CELLS:,} (a few GiB of trace; fewer than "
                         f"{LOOKAHEAD} iterations count as {LOOKAHEAD}), got {n} x {iterations}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 of each scenario (default: 5)")
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 256, 1024],
                        help="cluster sizes, each run on every scenario (default: 16 256 1024)")
    parser.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=sorted(SCENARIOS),
                        help="(default: all)")
    parser.add_argument("--iterations", type=int, default=150,
                        help="per run (default: 150, as the committed lbbsp simulate results)")
    parser.add_argument("--out", type=Path, default=OUT, help=out_help(OUT))
    args = parser.parse_args()
    if args.seeds < 1 or args.iterations < 1 or min(args.workers) < 2:
        parser.error("--seeds and --iterations must be at least 1, --workers at least 2")
    with interrupted_as_exit(), empty_folders_removed_on_failure(args.out):
        check_sizes(parser, args.scenarios, args.workers, args.iterations)
        out = results_file(parser, args.out)
        results: dict[str, dict[str, Figures]] = {}
        for scenario in args.scenarios:
            for workers in args.workers:
                print(f"{scenario}, {workers} workers, {args.iterations} iterations, seeds 0-{args.seeds - 1}",
                      flush=True)
                figures = run(scenario, workers, args.iterations, range(args.seeds))
                results.setdefault(scenario, {})[str(workers)] = figures
                print(table(figures), flush=True)
        kept = _kept(out, args.iterations, args.seeds)
        for scenario, sizes in results.items():  # a subset run replaces its own figures and keeps the file's others
            kept.setdefault(scenario, {}).update(sizes)
        out.write_text(json.dumps({"iterations": args.iterations, "seeds": args.seeds, "policies": kept,
                                   "run": run_record()}, indent=1))
        print(f"wrote {out}")


def _kept(out: Path, iterations: int, seeds: int) -> dict[str, dict[str, Figures]]:
    """The figures ``out`` holds of runs of the same length and seeds, which a run of other scenarios or sizes keeps
    (one of a subset had overwritten the committed file with its own part); none where they differ or it is none."""
    try:
        stored = json.loads(out.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(stored, dict) or (stored.get("iterations"), stored.get("seeds")) != (iterations, seeds):
        return {}
    policies = stored.get("policies")
    return policies if isinstance(policies, dict) else {}


if __name__ == "__main__":
    main()
