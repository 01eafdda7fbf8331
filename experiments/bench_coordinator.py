"""What lbbsp adds to an iteration's critical path, and how long one decision takes at scale.

Critical path: N worker processes 'compute' (sleep --compute-ms), send their report, meet at a barrier
(standing in for the gradient all-reduce) and fetch the next assignment from a real local redis-server,
while the coordinator runs in this process. Added time = the report call plus the wait for the next vector
after the barrier, for the slowest worker of each iteration. With lag 2 (the default) the decision overlaps
the next iteration; with lag 1 it does not. The floor row does one plain Redis GET instead. Decision time:
the policy's prediction + allocation with each real capacity model in steady state, and the whole coordinator
step with Redis I/O and validation, up to the written split; beside them the learning the coordinator does
after the write (NARX's training, the margins' pooling), which no worker waits for. The critical-path rows
take turns in --rounds rounds, and the models take turns each iteration, so a drift in this machine's speed
hits all alike.

Steps shorter than a decision (--short-compute-ms, --short-workers): the same runs with lag 2, the workers
reporting the compute they measured, the coordinator running ahead (several iterations a decision, the default)
against one decision per iteration, side by side.

Status lines (--status-lines): the coordinator's whole cycle per decision with its workers' status lines for
`lbbsp status` written at every decision, as until 2026-12-02, against at most once a second, side by side.

Full garbage collections (--skip-heap leaves them out): the decision-time runs at the first --decision-workers,
this process's heap as its imports left it against frozen as the coordinator's own process freezes it, in turns;
the decision-time table after them runs frozen.

    python experiments/bench_coordinator.py [--iterations 100] [--rounds 3] [--workers 4 16 64] [--out F]

The defaults take many minutes on 2 cores (each table prints as it ends, and is written to --out then, with the
arguments and the run's record: an interrupted run keeps the tables it finished); the quickest figure, decision
time at 1,024 workers, is `--skip-critical-path --skip-heap --decision-workers 1024` (about a minute).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import signal
import time
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, cast

import numpy as np
from _args import out_help, run_record, writing_results

from lbbsp import Coordinator, EmbeddedRedis, JobConfig, LBBSPPolicy, Report, Store, WorkerClient
from lbbsp.coordinator import MAX_AHEAD
from lbbsp.coordinator_process import freeze_heap
from lbbsp.errors import ConfigError, StoreUnavailable
from lbbsp.models import AutoCapacityModel, BatchTimeCurve, CapacityModel, EWMAThroughput, FLClientModel, NARXThroughput
from lbbsp.policies import Decision, Policy
from lbbsp.protocol import MAX_WORKERS
from lbbsp.store import redacted

FORK = mp.get_context("fork")
WARM_UP = 5  # iterations of each critical-path run left out: process start, first connections
BARRIER_TIMEOUT_S = 60.0  # a worker that died leaves the others here; they fail instead of waiting for ever
GOAL_WORKERS, GOAL_MS = 1024, 5.0  # issue 4's goal: prediction + allocation under 5 ms (p50) at 1,024 workers
OUT = Path(__file__).resolve().parent / "results" / "bench_coordinator.json"
Row = dict[str, Any]  # a table's row as written to --out: its labels, and its figures in ms


def _worker(url: str, config_json: str, worker: int, iterations: int, compute_s: float, floor: bool, measured: bool,
            barrier: Barrier, times: MutableSequence[float]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it ends these (one traceback each, else)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's (interrupted_as_exit), which a fork copies
    config = JobConfig.from_json(config_json)
    client = WorkerClient(Store.from_url(url, config.job), config, worker)
    rng = np.random.default_rng(worker)
    speed = 1000.0 * (1 + worker % 4)
    sizes = client.assignment(0).sizes
    for k in range(iterations):
        computing = time.perf_counter()
        time.sleep(compute_s)  # the forward and backward pass of iteration k
        started = time.perf_counter()
        if not floor:  # the compute measured, or one of a worker that many samples at its speed would take
            seconds = started - computing if measured else sizes[worker] / speed * rng.uniform(0.9, 1.1)
            client.report(k, sizes[worker], seconds)
        reported = time.perf_counter()
        barrier.wait(BARRIER_TIMEOUT_S)  # the gradient all-reduce: BSP would go on from here
        released = time.perf_counter()
        if floor:  # what one Redis read costs here, with no lbbsp logic at all
            client.store.client.get(client.store.key("assign", 0))
        else:
            sizes = client.assignment(k + 1).sizes
        times[k * config.num_workers + worker] = (reported - started) + (time.perf_counter() - released)
    client.close()


def critical_path(url: str, workers: int, iterations: int, lag: int, compute_s: float, floor: bool = False,
                  max_ahead: int = MAX_AHEAD, pace: list[float] | None = None, measured: bool = False) -> np.ndarray:
    """The slowest worker's added time per iteration; the run's wall seconds per iteration appended to ``pace``.
    ``measured``: the workers report the compute they slept, else that of workers of 1-4x speeds, 64 ms at 1x."""
    config = JobConfig(f"bench-{workers}-{time.time_ns()}", workers, 64 * workers, assignment_timeout_s=10.0,
                       lag=lag)
    barrier = FORK.Barrier(workers)
    times = FORK.Array("d", [np.nan] * (iterations * workers), lock=False)
    with Store.from_url(url, config.job) as store:
        procs = [FORK.Process(target=_worker, args=(url, config.to_json(), i, iterations, compute_s, floor,
                                                    measured, barrier, times)) for i in range(workers)]
        coordinator = Coordinator(store, config, max_ahead=max_ahead).start()
        try:
            started = time.perf_counter()
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            if pace is not None:
                pace.append((time.perf_counter() - started) / iterations)
        except BaseException:  # Ctrl-C or SIGTERM: the workers ignore them, and would wait at the barrier
            for p in procs:  # SIGKILL: one just forked may still hold the parent's SIGTERM handler
                if p.pid is not None:
                    p.kill()
                    p.join()
            raise
        finally:
            coordinator.stop()
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    added = np.frombuffer(times, dtype=float).reshape(iterations, workers)
    if failed or np.isnan(added).any():
        raise SystemExit(f"critical path with {workers} workers: worker(s) {failed} failed (exit codes "
                         f"{[procs[i].exitcode for i in failed]}); see their tracebacks above")
    return added.max(axis=1)[WARM_UP:]  # the slowest worker's added time, per iteration


class _Timed(Policy):
    """Runs a policy and adds up the wall and CPU seconds its observe and decide take (prediction + allocation),
    and apart from them the seconds of its learning after the write."""

    def __init__(self, inner: Policy) -> None:
        self.inner, self.name = inner, inner.name
        self.seconds = self.cpu_seconds = self.learn_seconds = 0.0

    def _timed(self, call: Callable[[], Decision | None]) -> Decision | None:
        wall, cpu = time.perf_counter(), time.thread_time()
        out = call()
        self.seconds += time.perf_counter() - wall
        self.cpu_seconds += time.thread_time() - cpu
        return out

    def observe(self, reports: Sequence[Report]) -> None:
        self._timed(lambda: self.inner.observe(reports))

    def decide(self, iteration: int, current: Sequence[int], config: JobConfig) -> Decision:
        decision = self._timed(lambda: self.inner.decide(iteration, current, config))
        assert decision is not None
        return decision

    def learn(self) -> None:
        started = time.perf_counter()
        self.inner.learn()
        self.learn_seconds += time.perf_counter() - started


#: The real capacity models, each with the kind of worker it is made for ("mixed": half GPUs, half CPUs),
#: under LB-BSP with its default margins for forecast misses; one row without them shows what those cost.
MODELS: dict[str, tuple[Callable[[], CapacityModel], str, float | None]] = {
    "EWMA (baseline)": (EWMAThroughput, "cpu", 2.0),
    "NARX (cpu)": (NARXThroughput, "cpu", 2.0),
    "NARX (cpu), margins off": (NARXThroughput, "cpu", None),
    "batch-time curve (gpu)": (BatchTimeCurve, "gpu", 2.0),
    "FL client": (FLClientModel, "fl", 2.0),
    "FL client, 5% missed": (FLClientModel, "fl-missed", 2.0),  # availability learned: the split weighs dropouts
    "auto (half gpu, half cpu)": (AutoCapacityModel, "mixed", 2.0),
}


def _reports(job: str, kind: str, k: int, sizes: Sequence[int], speed: np.ndarray,
             rng: np.random.Generator) -> list[Report]:
    """One iteration's reports from workers of ``kind`` with drifting speeds, features as a worker sends them."""
    now = speed * rng.lognormal(0.0, 0.05, speed.size)
    out = []
    for i, (size, s) in enumerate(zip(sizes, now.tolist())):
        if kind == "gpu" or (kind == "mixed" and i % 2 == 0):
            out.append(Report(job, i, k, size, 0.01 + max(size, 32) / s, device="cuda:0",
                              features={"gpu_mem_used": 2e9 + 5e7 * size, "gpu_mem_free": 3e10 - 5e7 * size}))
        elif kind.startswith("fl"):
            out.append(Report(job, i, k, size, size / s, device="phone", features={"download_s": 1.0, "upload_s": 2.0}))
        else:
            out.append(Report(job, i, k, size, size / s, features={
                "cpu_util": 0.5, "proc_cpu": 0.9, "colocated_load": float(i % 3), "mem_util": 0.4, "cores": 8}))
    return out


def decision_times(url: str, workers: int, warmup: int, repeats: int, status_every: Sequence[float] = (),
                   models: Mapping[str, tuple[Callable[[], CapacityModel], str, float | None]] = MODELS,
                   progress: Callable[[str], None] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Per model: policy observe+decide (wall and CPU seconds), the whole coordinator step with Redis, and the
    whole decision's cycle (the step, the learning and the records written after it: the coordinator's pace), for
    ``repeats`` iterations after ``warmup`` iterations that fill the model's history (steady state, as in a
    long run). The models take turns within each iteration, in the reverse order every other one, so a drift in
    this machine's speed hits all alike. ``status_every``: one coordinator per model and value, writing its
    workers' status lines at most every that many seconds (0: at every decision), named "model @ value"; ``models``:
    a part of MODELS; ``progress`` gets a line at each quarter of the iterations (the rows come only at the end:
    minutes at 10,000 workers)."""
    rng, misses = np.random.default_rng(0), np.random.default_rng(1)
    speed = rng.uniform(500, 5000, workers)
    # per run: name, worker kind, job, store, timed policy, coordinator, times, the split of each iteration
    runs: list[tuple[str, str, JobConfig, Store, _Timed, Coordinator,
                     dict[str, list[float]], dict[int, tuple[int, ...]]]] = []
    with contextlib.ExitStack() as stack:
        for name, (model, kind, hedge) in models.items():
            for every in status_every or (None,):
                config = JobConfig(f"decide-{workers}-{len(runs)}-{time.time_ns()}", workers, 64 * workers)
                store = stack.enter_context(Store.from_url(url, config.job))
                timed = _Timed(LBBSPPolicy(model(), hedge=hedge))
                coordinator = Coordinator(store, config, timed)
                if every is not None:
                    coordinator.STATUS_EVERY_S = every
                runs.append((name if every is None else f"{name} @ {every:g}", kind, config, store, timed, coordinator,
                             {"policy": [], "policy_cpu": [], "step": [], "learn": [], "cycle": []}, {}))
        for k in range(warmup + repeats):
            for _name, kind, config, store, timed, coordinator, times, sizes in (runs if k % 2 == 0 else runs[::-1]):
                pipe = store.client.pipeline(transaction=False)
                # iteration k runs the split decided for it (lag iterations before), as the workers do
                for report in _reports(config.job, kind, k, sizes.pop(k, config.initial_sizes()), speed, rng):
                    pipe.hset(store.key("reports", k), str(report.worker), report.to_json())
                pipe.execute()
                if kind == "fl-missed":  # each client misses 5% of rounds, as its model is told (the Flower plugin
                    # does); they still report, as the row times the decision, and draw from a generator of their
                    # own, so that the other rows see the same reports as without this one
                    missed = misses.random(config.num_workers) < 0.05
                    fl_model = cast(FLClientModel, cast(LBBSPPolicy, timed.inner).model)
                    fl_model.record_outcomes({i: not bool(m) for i, m in enumerate(missed)})
                timed.seconds = timed.cpu_seconds = timed.learn_seconds = 0.0
                started = time.perf_counter()
                outcome = coordinator.decide(k)
                cycle = time.perf_counter() - started
                if k >= warmup:
                    times["cycle"].append(cycle)
                    times["policy"].append(timed.seconds)
                    times["policy_cpu"].append(timed.cpu_seconds)
                    times["learn"].append(timed.learn_seconds)
                    times["step"].append(outcome.decision_s)
                sizes[outcome.assignment.iteration] = outcome.assignment.sizes
            total = warmup + repeats
            if progress is not None and k + 1 < total and (k + 1) * 4 // total > k * 4 // total:
                progress(f"  {workers:,} workers: {k + 1}/{total} iterations of every model")
    return {name: {key: np.array(v) for key, v in times.items()} for name, _, _, _, _, _, times, _ in runs}


def status_line_costs(url: str, workers: int, warmup: int, repeats: int) -> list[Row]:
    """The coordinator's cycle per decision with its workers' status lines written at every decision (as until
    2026-12-02) and at most once a second (since), side by side decision by decision, one model's pair at a time
    (twelve coordinators in turn would space each one's decisions so far apart that most wrote them anyway); the
    table's rows."""
    print(f"\nthe coordinator's whole cycle per decision at {workers} workers, its workers' status lines for `lbbsp "
          "status` written at every decision (@ 0) against at most once a second (@ 1), the two taking turns "
          "decision by decision, one model at a time")
    print(f"{'model':<26} {'step p50 @0 / @1':>17} {'cycle p50 @0 / @1':>18} {'@1/@0':>6} {'cycle mean @0 / @1':>19} "
          f"{'@1/@0':>6}   (ms)")
    rows = []
    for name in MODELS:
        times = decision_times(url, workers, warmup, repeats, status_every=(0.0, 1.0), models={name: MODELS[name]})
        each, once = times[f"{name} @ 0"], times[f"{name} @ 1"]
        rows.append({"model": name, "workers": workers, **{
            f"{figure}_at_{every}_ms": value for every, t in (("0", each), ("1", once))
            for figure, value in (("step_p50", _q(t["step"], 50)), ("cycle_p50", _q(t["cycle"], 50)),
                                  ("cycle_mean", 1e3 * float(t["cycle"].mean())))}})
        print(f"{name:<26} {_ms(each['step'], 50):>8} {_ms(once['step'], 50):>8} {_ms(each['cycle'], 50):>9} "
              f"{_ms(once['cycle'], 50):>8} {np.median(once['cycle']) / np.median(each['cycle']):>6.2f} "
              f"{1e3 * each['cycle'].mean():>9.3f} {1e3 * once['cycle'].mean():>9.3f} "
              f"{once['cycle'].mean() / each['cycle'].mean():>6.2f}", flush=True)
    return rows


class _FullCollections:
    """The pauses of the garbage collector's full (generation 2) collections while it is entered."""

    def __init__(self) -> None:
        self.pauses_s: list[float] = []
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._started = time.perf_counter()
            else:
                self.pauses_s.append(time.perf_counter() - self._started)

    def __enter__(self) -> _FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def heap_pauses(url: str, workers: int, warmup: int, repeats: int, rounds: int) -> list[Row]:
    """The decision-time runs with this process's heap as its imports left it, and frozen as the coordinator's
    own process freezes it (``freeze_heap``), taking turns round by round: the full collections' pauses, which
    land inside decisions, and the whole step's p50, p99 and maximum over every model's decisions; the table's
    rows."""
    print(f"\nfull garbage collections in the coordinator's process at {workers} workers, the heap as imported "
          f"against frozen (freeze_heap, as CoordinatorProcess and `lbbsp coordinator` do); {rounds} rounds in turn")
    modes = ("imported", "frozen")
    pauses: dict[str, list[float]] = {mode: [] for mode in modes}
    steps: dict[str, list[np.ndarray]] = {mode: [] for mode in modes}
    for r in range(rounds):
        for mode in modes:
            if mode == "frozen":
                freeze_heap()
            with _FullCollections() as collections:
                times = decision_times(url, workers, warmup, repeats)
            gc.unfreeze()
            pauses[mode] += collections.pauses_s
            steps[mode] += [t["step"] for t in times.values()]
        print(f"  round {r + 1}/{rounds} done", flush=True)
    print(f"{'heap':>9} {'full collections':>17} {'pause p50 ms':>13} {'pause max ms':>13} {'step p50':>9} "
          f"{'step p99':>9} {'step max':>9}   (step: every model's decisions pooled, ms)")
    rows = []
    for mode in modes:
        p, pooled = np.array(pauses[mode] or [np.nan]), np.concatenate(steps[mode])
        print(f"{mode:>9} {len(pauses[mode]):>17} {1e3 * np.median(p):>13.2f} {1e3 * np.max(p):>13.2f} "
              f"{_ms(pooled, 50):>9} {_ms(pooled, 99):>9} {_ms(pooled, 100):>9}", flush=True)
        rows.append({"heap": mode, "workers": workers, "full_collections": len(pauses[mode]),  # pauses null if none
                     **{f"pause_{name}_ms": 1e3 * float(f(p)) if pauses[mode] else None
                        for name, f in (("p50", np.median), ("max", np.max))},
                     "step_p50_ms": _q(pooled, 50), "step_p99_ms": _q(pooled, 99), "step_max_ms": _q(pooled, 100)})
    return rows


def goal_verdict(policy_p50_ms: Mapping[str, float]) -> str:
    """One line on the decision-time goal from each model's policy p50 at GOAL_WORKERS: met by every model, or
    which models missed it and by how much, so a run's outcome does not have to be read off the table."""
    over = _over_goal(policy_p50_ms)
    slowest = max(policy_p50_ms, key=policy_p50_ms.__getitem__)
    head = f"goal: policy p50 under {GOAL_MS:g} ms at {GOAL_WORKERS:,} workers:"
    if not over:
        return f"{head} met by every model (slowest: {slowest.strip()}, {policy_p50_ms[slowest]:.2f} ms)"
    missed = ", ".join(f"{name.strip()} {ms:.2f} ms" for name, ms in over.items())
    return f"{head} missed by {len(over)} of {len(policy_p50_ms)} models ({missed})"


def _over_goal(policy_p50_ms: Mapping[str, float]) -> dict[str, float]:
    """The models whose policy p50 missed the goal (NaN too), with it."""
    return {name: ms for name, ms in policy_p50_ms.items() if not ms < GOAL_MS}


def machine_speed_ms(repeats: int = 5) -> float:
    """Median ms of a fixed pure-Python and numpy workload; on a shared VM it drifts by 2x within minutes, so
    decision times are only comparable between runs at similar figures."""
    rng = np.random.default_rng(0)
    a = rng.random((256, 256))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sum(i * i for i in range(100_000))
        for _ in range(20):
            a = np.tanh(a @ a.T / 256)
        times.append(time.perf_counter() - started)
    return 1e3 * float(np.median(times))


def _q(values: np.ndarray, q: float) -> float:
    """The ``q``-th percentile of ``values`` (seconds), in ms."""
    return float(np.percentile(values, q) * 1e3)


def _ms(values: np.ndarray, q: float) -> str:
    return f"{_q(values, q):8.3f}"


def short_steps(url: str, args: argparse.Namespace) -> list[Row]:
    """Steps shorter than a decision, lag 2: the coordinator running ahead (the default) against one decision per
    iteration (``max_ahead=1``), the two taking turns round by round; wall time per iteration and added time (the
    table's rows). The workers report the compute they measured, as an integration does, which is what the
    coordinator compares its own time with."""
    print(f"\nsteps of {args.short_compute_ms:g} ms, shorter than a decision: the coordinator running ahead (default, "
          f"up to {MAX_AHEAD} iterations a decision) against one decision per iteration (max_ahead=1)")
    modes = (("ahead", MAX_AHEAD), ("one", 1))
    pace: dict[tuple[str, int], list[float]] = {(mode, n): [] for mode, _ in modes for n in args.short_workers}
    added: dict[tuple[str, int], list[np.ndarray]] = {key: [] for key in pace}
    for r in range(args.rounds):
        for n in args.short_workers:
            for mode, max_ahead in modes:
                added[mode, n].append(critical_path(url, n, args.iterations, 2, args.short_compute_ms / 1e3,
                                                    max_ahead=max_ahead, pace=pace[mode, n], measured=True))
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    print(f"{'mode':>6} {'workers':>8} {'ms/iteration':>13} {'added p50':>10} {'added p99':>10} "
          f"{'ahead/one':>10}   (ms/iteration: median over the rounds; ahead/one: that ratio, per round: median (range))")
    rows: list[Row] = []
    for (mode, n), seconds in pace.items():
        pooled = np.concatenate(added[mode, n])
        ratios = np.array(pace["ahead", n]) / np.array(pace["one", n])
        ratio = f"{np.median(ratios):.2f} ({ratios.min():.2f}-{ratios.max():.2f})" if mode == "ahead" else ""
        print(f"{mode:>6} {n:>8} {1e3 * float(np.median(seconds)):>13.2f} {_ms(pooled, 50):>10} {_ms(pooled, 99):>10} "
              f"{ratio:>10}", flush=True)
        rows.append({"mode": mode, "workers": n, "ms_per_iteration": 1e3 * float(np.median(seconds)),
                     "added_p50_ms": _q(pooled, 50), "added_p99_ms": _q(pooled, 99),
                     "ahead_over_one": {"median": float(np.median(ratios)), "min": float(ratios.min()),
                                        "max": float(ratios.max())} if mode == "ahead" else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=100,
                        help=f"iterations of each critical-path run, the first {WARM_UP} left out (default: 100)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="critical-path runs per row, the rows taking turns round by round; also the rounds of the "
                             "heap comparison (--skip-heap) (default: 3)")
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 16, 64],
                        help="worker processes of the critical-path runs, one row each (default: 4 16 64)")
    parser.add_argument("--compute-ms", type=float, default=20.0, help="emulated compute per iteration (default: 20)")
    parser.add_argument("--short-compute-ms", type=float, default=1.0,
                        help="emulated compute per iteration of the runs with steps shorter than a decision (default: 1)")
    parser.add_argument("--short-workers", type=int, nargs="+", default=[1, 2, 4],
                        help="workers of those runs, few: on 2 cores more processes keep the cores busy, whatever "
                             "the coordinator does (default: 1 2 4)")
    parser.add_argument("--decision-workers", type=int, nargs="+", default=[1024, 10_000],
                        help="simulated workers whose decisions are timed; the goal: under 5 ms at 1,024 "
                             "(default: 1024 10000)")
    parser.add_argument("--warmup", type=int, default=30, help="iterations that fill each model's history first (default: 30)")
    parser.add_argument("--repeats", type=int, default=100,
                        help="timed decisions per model and size (default: 100, a p99 that is not just the maximum)")
    parser.add_argument("--skip-critical-path", action="store_true", help="only time the decisions")
    parser.add_argument("--skip-heap", action="store_true",
                        help="skip the runs with the heap as imported against frozen (the garbage collector's pauses)")
    parser.add_argument("--status-lines", action="store_true",
                        help="also compare, at the first --decision-workers, the coordinator's cycle with its workers' "
                             "status lines written at every decision against once a second (about 5 minutes)")
    parser.add_argument("--redis", help="Redis URL (default: an embedded redis-server)")
    parser.add_argument("--out", type=Path, default=OUT, help=out_help(OUT))
    args = parser.parse_args()
    if args.iterations <= WARM_UP or args.rounds < 1:
        parser.error(f"--iterations must be more than {WARM_UP} (the warm-up left out) and --rounds at least 1")
    for flag, sizes in (("--workers", args.workers), ("--decision-workers", args.decision_workers),
                        ("--short-workers", args.short_workers)):
        if bad := [n for n in sizes if not 1 <= n <= MAX_WORKERS]:  # JobConfig's bound had failed as its traceback
            parser.error(f"{flag} must be at least 1 and at most {MAX_WORKERS:,} (lbbsp.protocol.MAX_WORKERS, the "
                         f"most a job takes), got {' '.join(map(str, bad))}")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")
    if not (0 <= args.compute_ms < 1e6 and 0 <= args.short_compute_ms < 1e6):  # NaN too
        parser.error("--compute-ms and --short-compute-ms must be numbers of milliseconds, at least 0")
    if args.redis:
        try:
            with Store.from_url(args.redis, "bench-coordinator") as store:
                store.ping()
        except (ConfigError, StoreUnavailable) as exc:
            parser.error(f"--redis: {exc}")
    # Ctrl-C, or SIGTERM: the workers and the redis-server are stopped; the tables written by then stay in --out
    with writing_results(parser, args.out) as out:
        run(args, out)


def run(args: argparse.Namespace, out: Path) -> None:
    """Every table asked for, each written to ``out`` (with what came before it) as it ends."""
    results: dict[str, Any] = {"args": {**vars(args), "redis": redacted(args.redis) if args.redis else None,
                                        "out": str(out)}}
    record = run_record()  # the run's start, and git asked once, not at every table

    def write(complete: bool = False) -> None:
        out.write_text(json.dumps({**results, "complete": complete, "run": record}, indent=1) + "\n")

    server = None if args.redis else EmbeddedRedis()
    url = server.url if server is not None else args.redis
    try:
        if not args.skip_critical_path:
            print("critical path added per iteration (report call + fetch of the next vector after the barrier; "
                  "slowest worker)")
            print("(floor: each worker only does one plain Redis GET, the least any coordination could cost here)")
            print(f"({args.rounds} rounds; in each, every row runs {args.iterations} iterations in turn)")
            rows = [(label, lag, floor, n) for n in args.workers
                    for label, lag, floor in (("floor", 2, True), ("2", 2, False), ("1", 1, False))]
            added: dict[tuple[str, int], list[np.ndarray]] = {(label, n): [] for label, _, _, n in rows}
            for r in range(args.rounds):
                for label, lag, floor, n in rows:
                    added[label, n].append(critical_path(url, n, args.iterations, lag, args.compute_ms / 1e3, floor))
                print(f"  round {r + 1}/{args.rounds} done", flush=True)
            print(f"{'lag':>5} {'workers':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
            results["critical_path"] = []
            for label, lag, floor, n in rows:
                pooled = np.concatenate(added[label, n])
                print(f"{label:>5} {n:>8} {_ms(pooled, 50)} {_ms(pooled, 99)} {_ms(pooled, 100)}", flush=True)
                results["critical_path"].append({"lag": lag, "floor": floor, "workers": n, "p50_ms": _q(pooled, 50),
                                                 "p99_ms": _q(pooled, 99), "max_ms": _q(pooled, 100)})
            write()
            results["short_steps"] = short_steps(url, args)
            write()
        if not args.skip_heap:
            results["heap"] = heap_pauses(url, args.decision_workers[0], args.warmup, args.repeats, args.rounds)
            write()
        freeze_heap()  # as the coordinator's own process does once it is set up
        if args.status_lines:
            results["status_lines"] = status_line_costs(url, args.decision_workers[0], args.warmup, args.repeats)
            write()
        print(f"\ndecision time in steady state (after {args.warmup} iterations), LB-BSP with each real model; "
              "the models take turns each iteration; this process's heap frozen, as the coordinator's")
        print(f"{'model':<26} {'workers':>8} {'policy p50':>11} {'policy p99':>11} {'cpu p50':>8} {'step p50':>9} "
              f"{'step p99':>9} {'learn p50':>10} {'cycle p50':>10}   (ms; policy = prediction + allocation, wall "
              "clock; cpu = its CPU time; step = + validation + Redis I/O + write; learn = after the write, off the "
              "decision's path; cycle = step + learn + the decision log and status lines: the coordinator's pace)")
        results["decision_time"] = []
        for n in args.decision_workers:
            speed_ms = machine_speed_ms()
            print(f"(this machine's speed just before: reference workload {speed_ms:.1f} ms)")
            p50_ms, table = {}, []
            for name, times in decision_times(url, n, args.warmup, args.repeats,
                                              progress=lambda line: print(line, flush=True)).items():
                print(f"{name:<26} {n:>8} {_ms(times['policy'], 50):>11} {_ms(times['policy'], 99):>11} "
                      f"{_ms(times['policy_cpu'], 50):>8} {_ms(times['step'], 50):>9} {_ms(times['step'], 99):>9} "
                      f"{_ms(times['learn'], 50):>10} {_ms(times['cycle'], 50):>10}", flush=True)
                p50_ms[name] = _q(times["policy"], 50)
                table.append({"model": name, "workers": n, **{f"{key}_p{q}_ms": _q(times[key], q) for key, q in (
                    ("policy", 50), ("policy", 99), ("policy_cpu", 50), ("step", 50), ("step", 99), ("learn", 50),
                    ("cycle", 50))}})
            results["decision_time"].append({"workers": n, "machine_speed_ms": speed_ms, "rows": table})
            if n == GOAL_WORKERS:
                verdict = goal_verdict(p50_ms)
                print(verdict, flush=True)
                results["goal"] = {"workers": GOAL_WORKERS, "policy_p50_under_ms": GOAL_MS,
                                   "met": not _over_goal(p50_ms), "verdict": verdict}
            write()
        write(complete=True)
        print(f"\nwritten to {out}")
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
