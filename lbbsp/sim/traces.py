"""Recorded CPU traces (experiments/record_cpu_trace.py): load them and serve them as per-iteration rows."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..protocol import FEATURE_RANGES

log = logging.getLogger(__name__)
#: The resource features a trace carries, in the order of :attr:`CPUTrace.features`.
TRACE_FEATURES = ("cpu_util", "proc_cpu", "colocated_load", "mem_util", "cores")
#: The shipped traces: experiments/traces in a checkout, which lbbsp/sim/recorded links to so that an
#: installed wheel carries them too.
DEFAULT_TRACE_DIR = (Path(__file__).parent / "recorded").resolve()
#: Fewest rows a contention level of a trace should have: a worker at a level replays that level's rows in turn, so
#: with fewer it replays the same handful over and over (the shipped traces have 303 or more at every level).
MIN_LEVEL_ROWS = 30


@dataclass(frozen=True)
class CPUTrace:
    """One recorded run: per-iteration throughput, the worker's features, and the true contention level."""

    name: str
    throughput: np.ndarray  # (iterations,)
    features: np.ndarray  # (iterations, len(TRACE_FEATURES))
    level: np.ndarray  # (iterations,) co-located busy loops at the end of each iteration (ground truth)
    max_level: int | None = None  # the most busy loops the recorder ran (its meta), where it says

    @classmethod
    def load(cls, path: str | Path) -> CPUTrace:
        """Read a trace (JSON only, nothing evaluated); a ConfigError naming the file if it is malformed or
        holds values a replay cannot use."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
            if not text.strip():
                raise ValueError("the file is empty")
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON ({exc})") from None
            if not isinstance(data, dict) or not isinstance(data.get("columns"), list) or not isinstance(
                    data.get("rows"), list):
                raise ValueError("a trace is an object with 'columns' (a list of names) and 'rows' (a list of rows)")
            if not all(isinstance(name, str) for name in data["columns"]) or len(set(data["columns"])) < len(
                    data["columns"]):
                raise ValueError(f"columns must be distinct names, got {data['columns']!r:.120}")
            columns = {name: i for i, name in enumerate(data["columns"])}
            if not data["rows"]:
                raise ValueError("rows is empty: a trace has a row per iteration")
            # the first row that is not one number per column, named (true is no throughput, null no level)
            wrong = next((i for i, row in enumerate(data["rows"]) if not isinstance(row, list) or len(row) != len(
                columns) or not all(type(v) in (int, float) for v in row)), None)
            if wrong is not None:
                raise ValueError(f"each row must be a list of {len(columns)} numbers, one per column: row {wrong} is "
                                 f"{data['rows'][wrong]!r:.100}")
            rows = np.asarray(data["rows"], dtype=float)
            missing = [name for name in ("throughput", "hog_level", *TRACE_FEATURES) if name not in columns]
            if missing:
                raise ValueError(f"no column {', '.join(missing)} (columns: {', '.join(columns)})")
            throughput, level = rows[:, columns["throughput"]], rows[:, columns["hog_level"]]
            features = rows[:, [columns[f] for f in TRACE_FEATURES]]
        except (OSError, ValueError, IndexError, TypeError, OverflowError) as exc:  # Overflow: an int beyond a float
            raise ConfigError(f"cannot read CPU trace {path}: {exc}") from None
        except RecursionError:
            raise ConfigError(f"cannot read CPU trace {path}: nested too deeply") from None
        # at most 1e12 samples/s: 1e308 passed as finite, and a level's median overflowed to NaN when built; at least
        # 0.1: a row of 1e-6 had made replayed times past a day, blamed on the scenario's options (and bench_models'
        # reports of 1,000 samples failed)
        wanted = {"throughput": ("in [0.1, 1e12] samples/s", (throughput >= 0.1) & (throughput <= 1e12)),
                  "hog_level": ("a whole number in [0, 2**53)", (level >= 0) & (level < 2**53) & (level == np.round(level))),
                  **{name: (f"in [{low}, {high}]", (features[:, j] >= low) & (features[:, j] <= high))  # NaN fails
                     for j, name in enumerate(TRACE_FEATURES) for low, high in [FEATURE_RANGES[name]]}}
        # replayed into reports, which refuse values out of range: the first bad row, and its column, named
        if bad := {name: np.flatnonzero(~fine) for name, (_, fine) in wanted.items() if not fine.all()}:
            name = min(bad, key=lambda n: (bad[n][0], columns[n]))
            row = int(bad[name][0])
            raise ConfigError(f"cannot read CPU trace {path}: {name} must be {wanted[name][0]}, row {row} has "
                              f"{rows[row, columns[name]]:g} ({bad[name].size} row{'s' * (bad[name].size > 1)} "
                              "out of range)")
        meta = data.get("meta")
        most = meta.get("max_level") if isinstance(meta, dict) else None
        # the recorder runs up to 4 per core; a bound keeps a corrupt meta from asking for a warning per level
        most = most if type(most) is int and 0 <= most <= 10_000 else None
        # rows above the recorder's most busy loops are another recording's, or edited: the warnings would name its
        # own levels as empty (0 rows at levels 0-2 for rows at level 7) and the replay would use the rows all the same
        if most is not None and (above := np.flatnonzero(level > most)).size:
            raise ConfigError(f"cannot read CPU trace {path}: hog_level must be at most meta's max_level {most}, row "
                              f"{above[0]} has {level[above[0]]:g} ({above.size} row{'s' * (above.size > 1)} "
                              "above max_level)")
        return cls(path.stem, throughput, features, level.astype(int), most)

    def steady_rows(self) -> np.ndarray:
        """Which rows a replay uses: those measured at one contention level, not those whose level differs from the
        row before. The recorder labels a row with the level at its end, so such a row ran partly at the level
        before (0.41 to 2.25 times its label's median): filed under one level, it would replay a switch at the
        recorder's rate (every 3 s, about one row in 45 to 90) where the simulation switches levels at its own. A
        level seen only across switches keeps those rows: they are all it has."""
        steady = np.r_[True, self.level[1:] == self.level[:-1]]
        for level in np.unique(self.level[~steady]):
            if not steady[self.level == level].any():
                steady |= self.level == level
        return steady

    def level_rows(self) -> dict[int, tuple[int, int]]:
        """Per contention level (each seen, and each the recorder ran where its meta says): the rows a replay
        uses (:meth:`steady_rows`) and the rows it leaves out, run partly at the level before."""
        steady = self.steady_rows()
        levels = sorted(set(self.level.tolist()).union(range(0 if self.max_level is None else self.max_level + 1)))
        return {level: (int((steady & (self.level == level)).sum()), int((~steady & (self.level == level)).sum()))
                for level in levels}


def load_traces(directory: str | Path = DEFAULT_TRACE_DIR) -> list[CPUTrace]:
    """Every ``*.json`` trace in ``directory``, sorted by name; a warning names each contention level of a trace with
    fewer than :data:`MIN_LEVEL_ROWS` rows, which a replay would repeat over and over."""
    # a path of no text ('' reads as the current folder) or not a path at all (a bare TypeError) says so too
    if not isinstance(directory, (str, Path)) or not str(directory) or not Path(directory).is_dir():
        shown = directory if isinstance(directory, (str, Path)) and str(directory) else repr(directory)
        raise ConfigError(f"{shown} is not a directory: traces are read from a directory of *.json files")
    paths = sorted(Path(directory).glob("*.json"))
    if not paths:  # a trace saved without .json, or in a subfolder, is not read: say what is there
        names = sorted(p.name + "/" * p.is_dir() for p in Path(directory).iterdir())
        holds = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ConfigError(f"no CPU traces in {directory}: no *.json files directly in it (it holds {holds or 'nothing'}); "
                          f"record one with experiments/record_cpu_trace.py --out {Path(directory) / 'NAME.json'}")
    traces = [CPUTrace.load(p) for p in paths]
    for path, trace in zip(paths, traces):  # replayed all the same, but said: its few rows come round again and again
        # a level the recorder ran but never measured at is said too: the scenario then never visits it (a short
        # recording with no row at levels 1 and 2 had made a cpu-contention run with no contention, unsaid); the rows
        # counted are those a replay uses (a level of 31 rows, 3 of them across a switch, replays 28)
        for level, (used, left_out) in trace.level_rows().items():
            if used < MIN_LEVEL_ROWS:
                log.warning("CPU trace %s (%s): level %d has %s, %s; record longer "
                            "(experiments/record_cpu_trace.py --seconds)", trace.name, path, level,
                            rows_said(used, left_out), thin_level_why(used))
    return traces


def rows_said(used: int, left_out: int) -> str:
    """A level's rows as a replay sees them: '28 rows a replay uses (3 more ran partly at the level before)'."""
    more = f" ({left_out} more ran partly at the level before)" if left_out else ""
    return f"{used} row{'s' * (used != 1)}{' a replay uses' if left_out else ''}{more}"


def thin_level_why(used: int) -> str:
    """Why a level with ``used`` rows (fewer than :data:`MIN_LEVEL_ROWS`) is worth recording longer."""
    if used:
        return f"where a replay wants at least {MIN_LEVEL_ROWS} (every worker at that level replays them in turn)"
    return "so a replay never visits it (workers switch among the levels with rows)"
