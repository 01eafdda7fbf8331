"""Prediction benchmark: MAPE of NARX, EWMA and LastValue on the recorded CPU traces, 1 and 2 iterations ahead.

Each model is fed a trace one iteration at a time (as a coordinator would). At horizon h the forecast of
iteration k is the one the model gives after the report of k - h: h = 2 is what production uses
(``JobConfig.lag`` = 2: the vector of iteration k is decided from the reports of k - 2), h = 1 is the
one-step-ahead figure. NARX is built with ``horizon=h``; EWMA and LastValue forecast a flat line. "NARX
no-feat" is the same network without the resource features (``exog_lags=0``), to show what they add. The
first ``--skip`` iterations (warm-up) are not scored: each table gives a trace's rows and the iterations scored.
The tables' figures go to --out at the end, with the arguments and the run's record. The decision time of LB-BSP
with each real model is printed by experiments/bench_coordinator.py.

    python experiments/bench_models.py [--traces experiments/traces] [--out F]
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _args import empty_folders_removed_on_failure, interrupted_as_exit, out_help, results_file, run_record

from lbbsp import Report
from lbbsp.errors import ConfigError
from lbbsp.models import CapacityModel, EWMAThroughput, LastValue, NARXThroughput
from lbbsp.sim.traces import DEFAULT_TRACE_DIR, TRACE_FEATURES, CPUTrace, load_traces

#: Each model for a forecast horizon (iterations ahead).
MODELS: dict[str, Callable[[int], CapacityModel]] = {
    "NARX": lambda horizon: NARXThroughput(horizon=horizon),
    "NARX no-feat": lambda horizon: NARXThroughput(horizon=horizon, exog_lags=0),  # ablation: no resource features
    "EWMA": lambda horizon: EWMAThroughput(),
    "LastValue": lambda horizon: LastValue(),
}
HORIZONS = (2, 1)
#: The offline ceiling's inputs: log-throughput lags and feature rows as of k - horizon.
CEILING_LAGS, CEILING_EXOG_LAGS = 8, 2
GOAL_LOWER = 0.2  # NARX's goal: a mean MAPE at least 20% lower than the best baseline's
OUT = Path(__file__).resolve().parent / "results" / "bench_models.json"


def errors(model: CapacityModel, trace: CPUTrace, horizon: int = 2) -> np.ndarray:
    """Each iteration's absolute percentage error of the forecast made ``horizon`` iterations before it
    (NaN for the first ``horizon``, which have none)."""
    out = np.full(trace.throughput.size, np.nan)
    forecasts: dict[int, float] = {}
    for k, (throughput, features) in enumerate(zip(trace.throughput, trace.features)):
        if k >= horizon:  # the model has seen the reports up to k - horizon
            out[k] = 100.0 * abs(forecasts[k - horizon] - throughput) / throughput
        report = Report("bench", 0, k, 1000, 1000.0 / throughput, features=dict(zip(TRACE_FEATURES, features)))
        model.partial_fit([report])
        forecasts[k] = model.predict([0])[0]
    return out


def offline_ceiling(trace: CPUTrace, horizon: int, lags: int = CEILING_LAGS,
                    exog_lags: int = CEILING_EXOG_LAGS) -> np.ndarray:
    """Errors (as :func:`errors`) on the trace's second half of gradient boosting fit offline on its first
    half, knowing the answers: the same kind of inputs as NARX, more of them (``lags`` log-throughputs and
    ``exog_lags`` feature rows as of k - horizon), no online constraint. What these inputs can tell at best."""
    from sklearn.ensemble import GradientBoostingRegressor  # noqa: PLC0415  (this reference only)

    y, n = np.log(trace.throughput), trace.throughput.size
    first = lags + exog_lags + horizon
    rows = np.array([np.concatenate([y[k - horizon - lags + 1:k - horizon + 1] - y[k - horizon],
                                     trace.features[k - horizon - exog_lags + 1:k - horizon + 1].ravel()])
                     for k in range(first, n)])
    target = y[first:] - y[first - horizon:n - horizon]  # log-ratio to the last value seen, as NARX
    half = n // 2 - first
    model = GradientBoostingRegressor(loss="absolute_error", max_depth=3, n_estimators=200, random_state=0)
    model.fit(rows[:half], target[:half])
    out = np.full(n, np.nan)
    out[n // 2:] = 100.0 * np.abs(np.exp(model.predict(rows[half:]) - target[half:]) - 1.0)
    return out


def references(trace: CPUTrace, skip: int, window: int = 4) -> dict[str, float]:
    """MAPE of two references that are not forecasts (they see the whole trace), to set beside the models' (no floor:
    the noise persists for some iterations, so forecasts from the last reports can beat the first):
    ``level oracle``, the median throughput of the iteration's true contention level; ``smoother``, the
    median of the ``window`` iterations either side in the same run at one level (the scored one left out;
    a run of a single iteration is not scored)."""
    y, log_y, n = trace.throughput, np.log(trace.throughput), trace.throughput.size
    run = np.concatenate([[0], np.cumsum(np.diff(trace.level) != 0)])  # id of each uninterrupted level run
    level_median = {lv: np.median(y[trace.level == lv]) for lv in np.unique(trace.level)}
    oracle = np.array([level_median[lv] for lv in trace.level])
    smooth = np.array([np.exp(np.median([log_y[j] for j in range(k - window, k + window + 1)
                                         if j != k and 0 <= j < n and run[j] == run[k]] or [np.nan]))
                       for k in range(n)])
    return {name: 100.0 * float(np.nanmean(np.abs(p[skip:] - y[skip:]) / y[skip:]))
            for name, p in (("level oracle", oracle), ("smoother", smooth))}


def _lower_pct(value: float, reference: float) -> float:
    """How many percent ``value`` lies below ``reference`` (negative: above)."""
    return 100 * (1 - value / reference)


def _relative(value: float, reference: float) -> str:
    """How far ``value`` lies below or above ``reference``, in words: "11.6% lower", "3.1% higher"."""
    change = _lower_pct(value, reference)
    return f"{abs(change):.1f}% {'lower' if change >= 0 else 'higher'}"


def main() -> int:
    """The benchmark, with Ctrl-C as one line and exit status 130 (it had printed the traceback of a model's fit)."""
    with interrupted_as_exit():
        return benchmark()


def benchmark() -> int:
    """Parse the command line, score every model on every trace, print the tables and write their figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default=str(DEFAULT_TRACE_DIR),
                        help="folder of recorded CPU traces to score on (default: the shipped ones)")
    parser.add_argument("--skip", type=int, default=50, help="warm-up iterations not scored (default: 50)")
    parser.add_argument("--out", type=Path, default=OUT, help=out_help(OUT))
    args = parser.parse_args()
    if args.skip < 0:
        parser.error("--skip must be at least 0")
    try:
        traces = load_traces(args.traces)
    except ConfigError as exc:
        parser.error(str(exc))
    # the offline ceiling needs rows past its lags on both halves; shorter traces would score NaN
    shortest = max(args.skip, 2 * (CEILING_LAGS + CEILING_EXOG_LAGS + max(HORIZONS)) + 1)
    if short := [t.name for t in traces if t.throughput.size <= shortest]:
        parser.error(f"traces {', '.join(short)} have no more than {shortest} iterations (--skip {args.skip}, "
                     "and the offline ceiling's lags): nothing to score")
    with empty_folders_removed_on_failure(args.out):
        out = results_file(parser, args.out)
        horizons = [horizon_table(traces, horizon, args.skip) for horizon in HORIZONS]
        refs = {trace.name: references(trace, args.skip) for trace in traces}
        print("\nreferences that see the whole trace (not forecasts, any horizon; no floor: the models can beat them)")
        written: dict[str, dict[str, Any]] = {}
        for name in ("level oracle", "smoother"):
            values = [r[name] for r in refs.values()]
            print(f"  {name:<13} " + " ".join(f"{t} {v:.2f}" for t, v in zip(refs, values))
                  + f"   mean {np.mean(values):.2f}")
            written[name] = {"per_trace": {t: r[name] for t, r in refs.items()}, "mean": float(np.mean(values))}
        out.write_text(json.dumps({"args": {**vars(args), "out": str(out)}, "horizons": horizons,
                                   "references_mape_pct": written, "run": run_record()}, indent=1) + "\n")
        print(f"\nwritten to {out}")
    return 0


def horizon_table(traces: list[CPUTrace], horizon: int, skip: int) -> dict[str, Any]:
    """Every model scored on every trace ``horizon`` iterations ahead: the table printed, its figures returned."""
    width = max([16, *(len(t.name) for t in traces)])  # a longer name had pushed its row out of line
    print(f"\n{horizon} iteration{'s' * (horizon > 1)} ahead"
          + (" (production: JobConfig.lag = 2)" if horizon == 2 else ""))
    print(f"{'trace':<{width}} {'rows':>6} {'scored':>6} " + " ".join(f"{name + ' MAPE%':>18}" for name in MODELS))
    scores: dict[str, list[float]] = {name: [] for name in MODELS}
    halves: dict[str, list[float]] = {name: [] for name in (*MODELS, "offline ceiling")}
    rows = []
    for trace in traces:
        row, half = [], trace.throughput.size // 2
        for name, factory in MODELS.items():
            e = errors(factory(horizon), trace, horizon)
            scores[name].append(float(np.mean(e[max(skip, horizon):])))
            halves[name].append(float(np.mean(e[half:])))
            row.append(f"{scores[name][-1]:>18.2f}")
        halves["offline ceiling"].append(float(np.mean(offline_ceiling(trace, horizon)[half:])))
        scored = trace.throughput.size - max(skip, horizon)  # the iterations each model's MAPE is over
        print(f"{trace.name:<{width}} {trace.throughput.size:>6} {scored:>6} " + " ".join(row), flush=True)
        rows.append({"trace": trace.name, "rows": int(trace.throughput.size), "scored": int(scored),
                     "mape_pct": {name: v[-1] for name, v in scores.items()}})
    mean = {name: float(np.mean(v)) for name, v in scores.items()}
    best_baseline = min(mean["EWMA"], mean["LastValue"])
    print(f"{'mean':<{width}} {'':>13} " + " ".join(f"{mean[n]:>18.2f}" for n in MODELS))
    print(f"NARX vs best baseline: MAPE {_relative(mean['NARX'], best_baseline)} "
          f"(goal: >= {GOAL_LOWER:.0%} lower, i.e. NARX mean <= {(1 - GOAL_LOWER) * best_baseline:.2f}); "
          f"without the resource features {_relative(mean['NARX no-feat'], best_baseline)}")
    second_half = {name: float(np.mean(v)) for name, v in halves.items()}
    print("  second half of each trace, mean MAPE%: " + ", ".join(f"{name} {v:.2f}" for name, v in second_half.items())
          + "\n  (offline ceiling: gradient boosting fit on the first half, answers known, 8 throughput lags;"
          " --skip does not apply here: every figure on this line scores the same second half)")
    return {"horizon": horizon, "traces": rows, "mean_mape_pct": mean,
            "narx_vs_best_baseline": {"best_baseline_mape_pct": best_baseline,
                                      "narx_lower_pct": _lower_pct(mean["NARX"], best_baseline),
                                      "narx_no_feat_lower_pct": _lower_pct(mean["NARX no-feat"], best_baseline),
                                      "goal_lower_pct": 100 * GOAL_LOWER,
                                      "goal_met": mean["NARX"] <= (1 - GOAL_LOWER) * best_baseline},
            "second_half_mean_mape_pct": second_half}


if __name__ == "__main__":
    raise SystemExit(main())
