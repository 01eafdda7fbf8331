"""``lbbsp simulate``: compare balancing policies on a simulated cluster; print, write JSON and a PNG."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..embedded import EmbeddedRedis
from ..errors import ConfigError, printable
from ..policies import PER_EPOCH_ITERATIONS
from ..protocol import MAX_WORKERS
from ..store import PROBE_TIMEOUT_S, answering, redacted, redis_url
from .engine import PolicyRun, compare
from .scenarios import LOOKAHEAD, MAX_CELLS, MEAN_DWELL, SCENARIOS, FLClients, Scenario
from .traces import DEFAULT_TRACE_DIR, load_traces

DEFAULT_OUT = Path("experiments") / "results"
#: The largest --seed (2**64 - 1, what numpy's generators are usually seeded with).
MAX_SEED = 2**64 - 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``lbbsp simulate``'s flags to ``parser`` (the command imports this module only when it is asked for)."""
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), required=True,
                        help="cpu-contention: recorded CPU traces under co-located jobs; gpu-mix: GPU generations with "
                             "nonlinear curves and memory caps; fl-clients: federated clients; mixed: gpu-mix's GPUs and "
                             "cpu-contention's CPU workers in one job (docs/simulator.md)")
    parser.add_argument("--workers", type=int, default=16,
                        help=f"number of simulated workers, at most {MAX_WORKERS:,} (a job's most, "
                             "lbbsp.protocol.MAX_WORKERS); at least 2, 4 on mixed")
    parser.add_argument("--iterations", type=int, default=200,
                        help="barriers to simulate per policy; the first --lag of them run the equal split in every "
                             "policy, so give well more than --lag")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scenario (same trace for every policy)")
    parser.add_argument("--lag", type=int, default=2,
                        help="iterations a decision runs ahead, as JobConfig.lag (default: 2, as in production)")
    parser.add_argument("--mean-dwell", type=float, default=None,
                        help=f"cpu-contention and mixed only: mean iterations between contention-level draws (default "
                             f"{MEAN_DWELL:g}; a draw may keep the level, so with 3 levels it changes every 1.5x that "
                             "on average; inf: never)")
    parser.add_argument("--traces", type=Path, default=None,
                        help="cpu-contention and mixed only: directory of recorded traces to replay (default: the shipped "
                             "experiments/traces; record your own with experiments/record_cpu_trace.py)")
    parser.add_argument("--no-noise", action="store_true",
                        help="cpu-contention and mixed only: replay each level's median throughput instead of the recorded "
                             "per-iteration noise")
    fl = parser.add_argument_group("fl-clients only (defaults: FLClients's, docs/simulator.md)")
    for flag, (kind, what) in FL_FLAGS.items():
        fl.add_argument(f"--{flag}", type=kind, default=None, help=f"{what} (default {_fl_default(flag):g})")
    parser.add_argument("--redis", nargs="?", const="", default=None, metavar="URL",
                        help="run every policy through Redis as in a job (reports posted, a real Coordinator "
                             "deciding, sizes read back) and check each decides exactly as in-process: on the Redis "
                             "at URL, else $LBBSP_REDIS_URL where set, else an embedded redis-server; without "
                             "--redis the policies run in-process only, whatever $LBBSP_REDIS_URL says")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"directory for the JSON and PNG results (default: {DEFAULT_OUT})")


def _same_folder(one: Path, other: Path) -> bool:
    """Whether two paths name one folder; False where either cannot be resolved (a symlink loop: the checks that
    follow refuse it with their own message)."""
    try:
        return one.resolve() == other.resolve()
    except (OSError, RuntimeError):
        return False


def run(args: argparse.Namespace) -> int:
    """Run ``lbbsp simulate``: check the flags, simulate every policy on one scenario, print the table and write
    the JSON and PNG under ``--out``; 0 when done."""
    started = time.perf_counter()
    kind: type[Scenario] = SCENARIOS[args.scenario]
    if args.workers < kind.min_workers:  # backup workers drop one: two at least (a mixed cluster, two of each kind)
        raise ConfigError(f"--workers must be at least {kind.min_workers} for --scenario {args.scenario}, got "
                          f"{args.workers}")
    if args.iterations < 1:
        raise ConfigError(f"--iterations must be at least 1, got {args.iterations}")
    if not 0 <= args.seed <= MAX_SEED:  # the seed is in the result files' names: 300 digits made one too long to write
        raise ConfigError(f"--seed must be in [0, {MAX_SEED}], got {printable(str(args.seed), 40)}")
    if not 1 <= args.lag <= 8:  # JobConfig's range, named by its flag and before the scenario is built
        raise ConfigError(f"--lag must be in [1, 8], got {args.lag}")
    if args.mean_dwell is not None and not args.mean_dwell >= 1:
        raise ConfigError(f"--mean-dwell must be at least 1 iteration (inf: never), got {args.mean_dwell}")
    if args.workers > MAX_WORKERS:  # JobConfig's limit, named by its flag before the product of the two
        raise ConfigError(f"--workers must be at most {MAX_WORKERS:,} (lbbsp.protocol.MAX_WORKERS, the most a job "
                          f"may have), got {args.workers:,}")
    # each scenario holds a few arrays of workers x (iterations + LOOKAHEAD) floats: a short run counts as LOOKAHEAD
    if args.workers * max(args.iterations, LOOKAHEAD) > MAX_CELLS:
        raise ConfigError(f"--workers x --iterations is at most {MAX_CELLS:,} (a few GiB of trace; fewer than "
                          f"{LOOKAHEAD} iterations count as {LOOKAHEAD}, the look-ahead every scenario generates), got "
                          f"{args.workers:,} x {args.iterations:,}")
    # before the traces are read: the results of a run that wrote them there had been read as traces by the next
    # by any scenario: gpu-mix's results written among the shipped traces had broken every later cpu-contention run
    if _same_folder(args.out, args.traces or DEFAULT_TRACE_DIR):
        raise ConfigError(f"--out {args.out} is the folder the CPU traces are read from: the next cpu-contention or "
                          "mixed run would read the results there as traces; give another folder")
    options, suffix = _scenario_options(args)
    redis = redis_for(args.redis)
    if redis is not None and redis[0]:  # a given Redis is reached before the scenario is built and the in-process pass
        url, source = redis
        # a Redis that answers, or an error naming --redis within seconds
        answering(url, "lbbsp-simulate", source=source, socket_timeout_s=PROBE_TIMEOUT_S).close()
    with _output_folder(args.out):  # the last check: a refused or stopped run leaves no folder of its own behind
        return _simulate(args, options, suffix, started, redis)


def redis_for(given: str | None) -> tuple[str, str] | None:
    """``--redis`` as the run uses it: None without the flag (in-process only, whatever $LBBSP_REDIS_URL says); else
    the URL given, or $LBBSP_REDIS_URL's where the flag has none, or "" for an embedded redis-server (an empty
    variable counts as unset, as in the other commands), with where it came from."""
    if given is None:
        return None
    url, source = redis_url(given)
    return (url, source) if url is not None else ("", "--redis")


def _simulate(args: argparse.Namespace, options: dict[str, object], suffix: str, started: float,
              redis: tuple[str, str] | None) -> int:
    """The checked run: build the scenario, simulate every policy (again through ``redis``'s URL and source, if
    any), print the table and write the results."""
    print(f"building {args.scenario} with {args.workers} workers, {args.iterations} iterations, seed {args.seed}",
          flush=True)
    scenario = SCENARIOS[args.scenario](args.workers, args.iterations, args.seed, **options)
    if args.lag != scenario.config.lag:  # not the production default: name it, keep the default's results
        scenario.config = dataclasses.replace(scenario.config, lag=args.lag)
        suffix += f"_lag{args.lag}"
    stem = args.out / f"simulate_{args.scenario}_{args.workers}w_{args.iterations}it_seed{args.seed}{suffix}"
    try:
        runs = compare(scenario, args.iterations, progress=lambda line: print(line, flush=True))
    except ConfigError as exc:  # fl-clients' options that give a worker no measurable time: named as their flags
        if args.scenario != "fl-clients":
            raise
        names = [flag.replace("-", "_") for flag in FL_FLAGS]
        raise ConfigError(_as_flags(exc.message, names), job=exc.job) from None
    check = None
    if redis is not None:
        url, source = redis
        runs, check = _through_redis(scenario, args.iterations, url, runs, source=source)
    summary = summarise(runs)
    print(table(scenario, summary))
    if args.iterations <= scenario.config.lag:  # no decision took effect: every ratio is the equal split's
        print(f"warning: --iterations {args.iterations} is at most --lag {scenario.config.lag}: the first "
              f"{scenario.config.lag} iterations of every policy, the oracle's too, run the equal split\n  (a decision "
              "takes effect --lag iterations after the reports it reads), so no policy balanced here (backup workers "
              "differ\n  only by the workers they drop): ratios to the oracle need --iterations well above --lag "
              "(docs/simulator.md uses 150)")
    elif "per-epoch" in runs and args.iterations <= PER_EPOCH_ITERATIONS:
        print(f"note: per-epoch resizes at each epoch's start, every {PER_EPOCH_ITERATIONS} iterations, first at iteration "
              f"{PER_EPOCH_ITERATIONS} (counting from 0): with --iterations {args.iterations} it ran the equal split "
              "throughout, as bsp")
    result = {"scenario": args.scenario, "workers": args.workers, "iterations": args.iterations, "seed": args.seed,
              "lag": scenario.config.lag, "global_batch": scenario.config.global_batch, "notes": scenario.notes,
              "lbbsp_version": __version__, "policies": summary,
              "iteration_s": {name: r.iteration_s for name, r in runs.items()}}
    if args.scenario in TRACED:  # which recorded traces the CPU workers replayed, and which bytes they held
        traces = (args.traces or DEFAULT_TRACE_DIR).resolve()
        result["traces"] = {"folder": str(traces), "sha256_6": _digest(traces)}
    if check is not None:
        result["redis_check"] = check
        print(redis_check_line(check))
    with _writing(args.out):
        _write_pair(stem, json.dumps(_finite(result), indent=1, default=_plain),
                    lambda png: plot(scenario, runs, summary, png))
    print(f"wrote {stem}.json and {stem}.png ({time.perf_counter() - started:.0f}s)")
    return 0


@contextlib.contextmanager
def _output_folder(out: Path) -> Iterator[None]:
    """Create ``out`` and check that it takes files, as a ConfigError about ``--out``; a run that then fails or is
    stopped (Ctrl-C) removes the folders it made that are still empty, and leaves those that were there alone."""
    made: list[Path] = []
    try:
        with _writing(out):  # before simulating, so that a bad --out costs no run
            nearest = next(folder for folder in (out, *out.parents) if folder.exists())  # "." or "/" at the latest
            if not nearest.is_dir():  # mkdir's "[Errno 17] File exists" (20 under a file) had named no file
                raise ConfigError(f"--out {out}: {nearest} is a file, not a folder; give a folder for the results "
                                  "(made if missing)")
            made = [folder for folder in (out, *out.parents) if not folder.exists()]  # deepest first
            out.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=out).close()  # an existing folder may still refuse files
        yield
    except BaseException:
        for folder in made:
            with contextlib.suppress(OSError):  # not empty (results, or someone else's files): kept
                folder.rmdir()
        raise


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[None]:
    """File errors under ``out`` as a ConfigError about ``--out`` (the CLI would take an OSError for Redis's)."""
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"--out {out} is not a folder results can be written to: {exc}") from None


def _write_pair(stem: Path, text: str, draw: Callable[[Path], None]) -> None:
    """Write ``stem``.json holding ``text`` and ``stem``.png as ``draw`` draws it, each to a hidden file first and
    then renamed over the last run's: stopped part-way (Ctrl-C, a failure), the last run's pair stays whole."""
    # not stem.with_suffix: the name's last dot (_dwell2.5, a --traces folder's) is no suffix, and it cut the name there
    json_path, png_path = (stem.with_name(f"{stem.name}.{kind}") for kind in ("json", "png"))
    hidden = [stem.with_name(f".{stem.name}.{os.getpid()}.part.{kind}") for kind in ("json", "png")]  # plot reads .png
    try:
        hidden[0].write_text(text, encoding="utf-8")
        draw(hidden[1])
        os.replace(hidden[0], json_path)
        os.replace(hidden[1], png_path)
    finally:
        for path in hidden:
            path.unlink(missing_ok=True)


def redis_check_line(check: dict[str, Any]) -> str:
    """What ``--redis`` found, in words: whether every policy decided through Redis the sizes it decided in-process
    in every iteration, and a line for each policy that did not (in the order they ran)."""
    differ = [name for name, same in check["identical"].items() if not same]
    return (f"through Redis ({check['redis']}): {'not every' if differ else 'every'} policy decided the same sizes as "
            f"in-process in all {check['iterations']} iterations" + "".join(f"\n  {name} differs" for name in differ))


def _through_redis(scenario: Scenario, iterations: int, url: str, in_process: dict[str, PolicyRun], *,
                   source: str = "--redis") -> tuple[dict[str, PolicyRun], dict[str, Any]]:
    """Every policy again, through Redis (embedded when ``url`` is empty; ``source`` names where a URL came from);
    the runs, and whether each one decided exactly the sizes of its in-process run."""
    label = redacted(url) if url else "embedded redis-server"  # printed and saved: no password
    where = f"{label}, from {source}" if source != "--redis" else label
    print(f"again through Redis ({where}): reports posted, a Coordinator deciding", flush=True)
    with contextlib.ExitStack() as stack:
        if not url:
            url = stack.enter_context(EmbeddedRedis()).url
        runs = compare(scenario, iterations, progress=lambda line: print(line, flush=True), redis_url=url)
    identical = {name: runs[name].sizes == in_process[name].sizes for name in in_process}
    return runs, {"redis": label, "iterations": iterations, "identical": identical}


#: The scenarios whose CPU workers replay recorded traces (--traces, --mean-dwell and --no-noise apply to them).
TRACED = ("cpu-contention", "mixed")
#: fl-clients' flags: FLClients's argument of the same name (dashes as underscores), its type, and meaning; the
#: defaults are read from FLClients itself (_fl_default).
FL_FLAGS: dict[str, tuple[type, str]] = {
    "dropout": (float, "each client's chance of dropping out of a round, in [0, 1)"),
    "compute-spread": (float, "sigma of the lognormal ms per sample across clients"),
    "link-spread": (float, "sigma of the lognormal down and up kbps across clients"),
    "local-steps": (int, "local steps per round, fixed; the batch per step is what is balanced"),
    "batch-per-client": (int, "samples per client and step, on average: the global batch over the clients"),
}


def _fl_default(flag: str) -> float:
    """FLClients's default for ``flag``."""
    return float(inspect.signature(FLClients).parameters[flag.replace("-", "_")].default)


def _exact(value: float) -> str:
    """``value`` for a file name: :g where that is exact (it named 1e6 and 1e6 + 1 alike), else repr."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def _scenario_options(args: argparse.Namespace) -> tuple[dict[str, object], str]:
    """The scenario's options given on the command line (the CPU workers' on cpu-contention and mixed, the clients' on
    fl-clients), and a file-name suffix that names them (so such a run never overwrites the default scenario's
    results)."""
    options: dict[str, object] = {}
    if args.mean_dwell is not None:
        options["mean_dwell"] = args.mean_dwell
    if args.no_noise:
        options["noise"] = False
    if (options or args.traces is not None) and args.scenario not in TRACED:
        raise ConfigError("--mean-dwell, --traces and --no-noise apply to --scenario cpu-contention and mixed only")
    suffix = ""
    if args.traces is not None:
        options["traces"] = load_traces(args.traces)
        if args.traces.resolve() != DEFAULT_TRACE_DIR:
            # the folder's name cut to 40 characters (the digest tells folders apart): a long one had made the result
            # files' names too long to write, after the whole run
            suffix += f"_{args.traces.resolve().name[:40]}-{_digest(args.traces)}"
    if args.mean_dwell is not None and args.mean_dwell != MEAN_DWELL:
        suffix += f"_dwell{_exact(args.mean_dwell)}"
    suffix += "_nonoise" if args.no_noise else ""
    given = {flag: getattr(args, flag.replace("-", "_")) for flag in FL_FLAGS}
    given = {flag: value for flag, value in given.items() if value is not None}
    if given and args.scenario != "fl-clients":
        raise ConfigError(f"{', '.join('--' + flag for flag in given)} "
                          f"{'applies' if len(given) == 1 else 'apply'} to --scenario fl-clients only")
    clients = {flag.replace("-", "_"): value for flag, value in given.items()}
    try:  # checked by FLClients itself for one iteration, before the run is built, and named as the flag
        if clients:
            FLClients(args.workers, 1, 0, **clients)
    except ConfigError as exc:  # FLClients's argument names in its message, as the flags that gave them
        raise ConfigError(_as_flags(exc.message, clients)) from None
    options |= clients
    for flag, value in given.items():
        if value != _fl_default(flag):  # the flag and its value in the file names: other settings, other results
            suffix += f"_{flag.replace('-', '')}{_exact(value)}"
    return options, suffix


def _as_flags(message: str, names: Iterable[str]) -> str:
    """``message`` with each of the scenario's argument ``names`` written as the flag that sets it (``local_steps``:
    ``--local-steps``): a command-line user has no ``local_steps=`` to give."""
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda name: "--" + name.group(1).replace("_", "-"), message)


def _digest(directory: Path) -> str:
    """Six hex digits of the SHA-256 of the traces in ``directory`` (names and bytes): two folders of one name
    get files of their own, and the same traces keep theirs."""
    sha = hashlib.sha256()
    for path in sorted(directory.glob("*.json")):
        sha.update(path.name.encode() + b"\0" + path.read_bytes())
    return sha.hexdigest()[:6]


def summarise(runs: dict[str, PolicyRun]) -> dict[str, dict[str, float]]:
    """Each policy's figures, relative to the oracle's mean iteration time."""
    oracle = float(np.mean(runs["oracle"].iteration_s))
    return {name: r.summary(oracle) for name, r in runs.items()}


def table(scenario: Scenario, summary: dict[str, dict[str, float]]) -> str:
    """The printed comparison: one line per policy, fastest first (those that overfilled a GPU's memory last)."""
    lines = [f"{scenario.name}: {scenario.config.num_workers} workers, global batch {scenario.config.global_batch}",
             f"{'policy':<24} {'s/iteration':>12} {'/ oracle':>9} {'idle':>7} {'decide ms':>10} {'over mem':>9}"]
    ranked = sorted(summary, key=lambda name: _rank(summary[name]))
    for name in ranked:
        s = summary[name]
        lines.append(f"{name:<24} {s['mean_iteration_s']:>12.4g} {s['vs_oracle']:>9.3f} "
                     f"{s['idle_fraction']:>6.1%} {s['decision_ms_mean']:>10.2f} {s['over_memory_iterations']:>9d}")
    if over := [name for name in ranked if summary[name]["over_memory_iterations"]]:  # in the table's order
        lines.append(f"listed last, whatever their time: {', '.join(over)} gave some GPU more than its memory "
                     f"holds ('over mem' iterations),\n  where a real job fails (out of memory)")
    if failed := {name: s.get("failed_decisions", 0) for name, s in summary.items() if s.get("failed_decisions")}:
        lines.append("decisions that failed or broke the job's rules and kept the split in force (logged): " +
                     ", ".join(f"{name} {count}" for name, count in sorted(failed.items())))
    if "oracle-level" in summary:
        lines.append(f"references, not policies: oracle-level knows each worker's speed without its per-iteration "
                     f"noise for the coming iteration;\n  oracle-level-late knows the same, but only as of the "
                     f"latest reports ({scenario.config.lag} iteration{'s' * (scenario.config.lag != 1)} late, as "
                     f"LB-BSP);\n  oracle-level-late-hedged plans that with LB-BSP's margins: what a perfect "
                     f"forecast of the levels could give LB-BSP\n  (no bound where the noise persists for a few iterations, which the "
                     f"last reports carry and a level does not)")
    if "oracle-sit-out" in summary:
        lines.append("reference, not a policy: oracle-sit-out knows every client's true speed and transfer for the "
                     "coming round and lets as many sit out as lbbsp-sit-out may (and backup drops)")
    if scenario.notes.get("dropout"):
        lines.append("the oracle does not know who will drop out (a round is charged B / the samples that came back), so "
                     "a policy may come out under 1;\n  lbbsp weighs the availability its model learns "
                     "(docs/simulator.md, fl-clients)")
    return "\n".join(lines)


def _rank(figures: dict[str, float]) -> tuple[bool, float]:
    """Order of the table and the bars: splits a job could run first, then by time / oracle."""
    return bool(figures["over_memory_iterations"]), figures["vs_oracle"]


def plot(scenario: Scenario, runs: dict[str, PolicyRun], summary: dict[str, dict[str, float]], path: Path) -> None:
    """Left: each policy's mean iteration time / oracle (references grey, LB-BSP blue, the others orange).
    Right: iteration time / oracle over the run, as a rolling mean so that a dozen policies stay readable."""
    import matplotlib  # noqa: PLC0415  (plotting only here)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter  # noqa: PLC0415

    def colour(name: str) -> str:
        return "tab:gray" if name.startswith("oracle") else "tab:blue" if name.startswith("lbbsp") else "tab:orange"

    names = sorted(summary, key=lambda n: _rank(summary[n]))
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.25]})
    bars.barh(names, [summary[n]["vs_oracle"] for n in names], color=[colour(n) for n in names],
              hatch=["//" if summary[n]["over_memory_iterations"] else "" for n in names])
    bars.axvline(1.0, color="black", linewidth=0.8)
    bars.invert_yaxis()
    bars.set_xlabel("mean iteration time / oracle")
    legend = [Patch(color="tab:blue", label="LB-BSP"), Patch(color="tab:orange", label="other policies"),
              Patch(color="tab:gray", label="references (know more)")]
    if any(summary[n]["over_memory_iterations"] for n in names):
        legend.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="over GPU memory (a job fails)"))
    # below the axis label: inside the axes it covered a bar's label (the top one, with 2 workers)
    bars.legend(handles=legend, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    bars.set_xlim(0, 1.45 * max(summary[n]["vs_oracle"] for n in names))  # room for the labels (1.3x: cut off)
    for i, n in enumerate(names):  # a label starts right of the oracle's line: a shorter bar's had been drawn across it
        over = summary[n]["over_memory_iterations"]
        bars.text(max(summary[n]["vs_oracle"], 1.0), i, f" {summary[n]['vs_oracle']:.3f}, idle {summary[n]['idle_fraction']:.0%}"
                  + (f", {over} over memory" if over else ""), va="center", fontsize=8)
    oracle = np.asarray(runs["oracle"].iteration_s)
    window = max(1, oracle.size // 20)
    line_colours = _line_colours(names, colour)
    for n in [n for n in names if n != "oracle"]:  # the oracle is the line at 1
        ratio = np.asarray(runs[n].iteration_s) / oracle
        smooth = np.convolve(ratio, np.ones(window) / window, mode="valid")
        line_colour = line_colours[n]
        over = bool(summary[n]["over_memory_iterations"])
        lines.plot(np.arange(smooth.size) + window - 1, smooth, label=n + (" (over GPU memory)" if over else ""),
                   color=line_colour, linewidth=1.8 if n == "lbbsp" else 1,
                   # dotted: a reference; dashed: a policy that overfilled a GPU (hatched among the bars)
                   linestyle=":" if n.startswith("oracle") else "--" if over else "-",
                   marker="o" if smooth.size == 1 else None)  # one iteration: a line of one point draws nothing
    lines.axhline(1.0, color="black", linewidth=0.8)
    lines.set_yscale("log")
    low, high = lines.get_ylim()
    lines.yaxis.set_major_locator(FixedLocator(_ratio_ticks(low, high)))  # the log axis' own ticks had left 1-2
    lines.yaxis.set_minor_locator(NullLocator())  # (where these ratios mostly are) with no label
    lines.yaxis.set_major_formatter(ScalarFormatter())
    lines.set_xlabel("iteration")
    smoothed = f"rolling mean of {window} iterations, " if window > 1 else ""  # "of 1" had read as a mistake
    # on two lines: on one, the label ran into the figure's title
    lines.set_ylabel(f"iteration time / oracle\n({smoothed}log scale)")
    lines.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"{scenario.name}, {scenario.config.num_workers} workers, B = {scenario.config.global_batch}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _line_colours(names: Iterable[str], colour: Callable[[str], str]) -> dict[str, str]:
    """Each policy's line colour, a shade of its bar's ``colour``, handed out by name: by rank, a policy's line had
    changed colour from one run to the next (bsp pink in one, olive in the other)."""
    shades = {"tab:blue": iter(["tab:cyan", "navy"]), "tab:gray": iter(["dimgray", "darkgray", "black"]),
              "tab:orange": iter(["tab:orange", "tab:red", "tab:brown", "tab:pink", "tab:olive", "tab:purple"])}
    return {n: "tab:blue" if n == "lbbsp" else next(shades[colour(n)], "tab:green")
            for n in sorted(names) if n != "oracle"}


def _ratio_ticks(low: float, high: float) -> list[float]:
    """Round values of time / oracle from ``low`` to ``high``, about evenly spaced on a log axis (at most 9
    gaps), always 1 where it is in range: 0.9, 1, 1.02, 1.05, 1.1, 1.2, 1.5, 2, 3, 5, ..."""
    candidates = ([0.1 * n for n in range(1, 10)] + [0.95, 0.98, 0.99, 1.0, 1.01, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5]
                  + [step * 10.0 ** power for power in range(4) for step in (2.0, 3.0, 5.0, 7.0, 10.0)])
    inside = sorted({round(value, 6) for value in candidates if low <= value <= high})
    if not inside:
        return [low, high]
    gap = (high / low) ** (1 / 9)  # the least ratio between neighbouring ticks
    start = 1.0 if 1.0 in inside else inside[0]
    up = [start]
    for value in inside:
        if value >= up[-1] * gap:
            up.append(value)
    down = [start]
    for value in reversed(inside):
        if value <= down[-1] / gap:
            down.append(value)
    return down[:0:-1] + up


def _finite(value: object) -> object:
    """``value`` with every infinite or NaN float written as a string ("inf"): strict JSON has no Infinity."""
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _plain(value: object) -> object:
    """What json writes for a value it has no form of: numpy's arrays and numbers as lists and numbers (a numpy
    integer had been written as a string), anything else as its str."""
    return value.tolist() if isinstance(value, (np.ndarray, np.generic)) else str(value)
