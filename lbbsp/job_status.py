"""What `lbbsp status` reads of a job and how it shows it: a sentence and a table, one line, or JSON. What is read
is checked, not trusted: an entry no coordinator wrote is left out, a value of the wrong type shown as "-" or null."""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from .client_history import _index
from .config import JobConfig
from .errors import ConfigError, LBBSPError, printable
from .store import PROBE_TIMEOUT_S, Store

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text


@dataclass
class JobStatus:
    """What `lbbsp status` read of one job: its settings (None if they expired meanwhile), the coordinator serving
    it, and the decision records (newest first) and workers' statuses (by index) that a coordinator wrote."""

    job: str
    config: JobConfig | None
    serving: str | None
    decisions: list[dict[str, Any]]
    statuses: dict[int, dict[str, Any]]


def read_job(url: str, job: str, decisions_shown: int, *, named: bool) -> JobStatus | None:
    """What `lbbsp status` shows of ``job``, with its latest ``decisions_shown`` records (one at least); None, with a
    warning, for a job whose keys cannot be read where every job is listed (an error where the job was ``named``)."""
    with Store.from_url(url, job, socket_timeout_s=PROBE_TIMEOUT_S) as store:
        try:
            config = store.load_config()
            if config is None and named:
                raise LBBSPError(f"no job {job!r} on this Redis (it never started, or its keys expired); "
                                 "`lbbsp status` without --job lists the jobs there")
            stored_decisions = store.decisions(max(decisions_shown, 1))
            stored_statuses = store.worker_statuses()
            serving = store.coordinator()
        except (ConfigError, redis.ResponseError) as exc:  # a broken key of the job's: settings, or a WRONGTYPE
            if named:
                raise
            logging.getLogger("lbbsp.cli").warning("skipped job %r: %s", job, exc)  # not hiding the others
            return None
    decisions, statuses, skipped = _entries(stored_decisions, stored_statuses)
    if skipped:  # one line, however many: a line each had let a hash of foreign fields flood the output
        logging.getLogger("lbbsp.cli").warning("job %s: skipped %d entr%s not lbbsp's (no coordinator writes "
                                               "such); the first: %.80r", job, len(skipped),
                                               "y" if len(skipped) == 1 else "ies", skipped[0])
    return JobStatus(job, config, serving, decisions, statuses)


def print_status(status: JobStatus, decisions_shown: int) -> None:
    """The job's sentence, its workers' table and, for ``decisions_shown``, its latest decisions."""
    from rich.table import Table  # noqa: PLC0415  (only this view draws tables)
    from rich.text import Text  # noqa: PLC0415

    console = piped_console()
    job, config, serving, decisions, statuses = (status.job, status.config, status.serving, status.decisions,
                                                 status.statuses)
    last = decisions[0] if decisions else {}
    title = f"job {job}" + (f": {_workers(config)}, global batch {config.global_batch}" if config else "")
    when = _decided_at(last)
    decided = "no decision yet" if not last else f"last decision (iteration {last['iteration']})" + (
        f" was {_ago(when)} ago" if when is not None else "")
    console.print(f"job {job}: " + (f"served by the coordinator {printable(serving)}; {decided}" if serving else
                  f"no coordinator serves it (none renewed its claim in the last 5 s); {decided}: while its "
                  "workers run, they keep the split before (after one wait of assignment_timeout_s), so start one "
                  "(lbbsp coordinator) unless the job is over"),
                  soft_wrap=True, markup=False, highlight=False)
    caption = _shown(f"iteration {last['iteration']}: {last['reason']}" if last else "no decision yet")
    rows_of = max((s["iteration"] for s in statuses.values()), default=None)
    if rows_of is not None and rows_of != last.get("iteration"):  # the coordinator writes them once a second
        caption += f"\nthe workers' rows are of iteration {rows_of}"
    table = Table(title=title, caption=caption)
    kinds = any(isinstance(s.get("kind"), str) for s in statuses.values())  # the automatic model's routing
    for column in ("worker", "size", "predicted /s", "measured /s", "compute s", "wait s") + ("kind",) * kinds:
        table.add_column(column, justify="right")
    for worker in sorted(statuses):
        s = statuses[worker]
        kind = (_shown(str(s.get("kind") or "-")[:8]),) * kinds
        predicted = "no model" if _predicts(s) is False else _fmt(s["predicted_throughput"])
        # in a narrow terminal (under 70 columns) a number folds onto a second line where rich had cut it: "1…"
        numbers = (str(worker), str(s["size"]), predicted, *map(_fmt, (s["measured_throughput"], s["compute_s"],
                                                                         s["wait_s"])))
        table.add_row(*(Text(number, overflow="fold") for number in numbers), *kind)
    console.print(table)
    if decisions_shown and not decisions:
        console.print(f"no decisions yet for job {job}", soft_wrap=True, markup=False, highlight=False)
    elif decisions_shown:
        console.print(_decision_log(console, job, decisions))


def piped_console() -> Console:
    """A rich Console whose reader closing the pipe (``lbbsp status | head``) raises BrokenPipeError, which
    :func:`main` ends on as for every command's output; rich's own exit, 1, is what ``--check`` means by a job
    unserved (and what `lbbsp demo` means by parameters that differ)."""
    from rich.console import Console  # noqa: PLC0415

    class _PipedConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    return _PipedConsole()


#: Under this many columns, a decision log too wide for the terminal is folded (:func:`_decision_log`).
_FOLD_BELOW = 100


def _decision_log(console: Console, job: str, decisions: list[dict[str, Any]]) -> Table:
    """The table of `lbbsp status --decisions`: a column each for the iteration, sizes, policy, writer, reason and
    rejected reports; folded, where that is wider than a terminal of under :data:`_FOLD_BELOW` columns, into two:
    the iteration, and a cell of lines (sizes with policy and writer; reason; rejected). At 80 columns the six
    columns had left the reason 10-20 characters, a word a line."""
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    title = (f"last {len(decisions)} decisions of job {job}, newest first" if len(decisions) > 1 else
             f"last decision of job {job}")
    rows: list[tuple[str, str, str, str, str, str]] = []
    for d in decisions:
        sizes = " ".join(map(str, d["sizes"][:16])) + (" ..." if len(d["sizes"]) > 16 else "")
        errors = [f"worker {r.get('worker')}: {r.get('error')}" for r in _rejections(d)]
        if more := _count(d.get("rejected_more")):
            errors.append(f"and {more} more rejected" if errors else f"{more} rejected")
        rows.append((_iterations(d), sizes, d["policy"], _written_by(d), d["reason"], "; ".join(errors)))
    log = Table(title=title)
    for column in ("iteration", "sizes", "policy", "by", "reason", "rejected"):
        log.add_column(column)
    for iteration, sizes, policy, by, reason, rejected in rows:
        log.add_row(iteration, _shown(sizes), _shown(policy), by, _shown(reason), _shown(rejected))
    unbounded = console.options.update_width(1 << 16)  # its natural width: measured at the console's, it fits
    if console.width >= _FOLD_BELOW or console.measure(log, options=unbounded).maximum <= console.width:
        return log
    folded = Table(title=title, show_lines=True)
    folded.add_column("iteration")
    folded.add_column("sizes (policy, by), reason, rejected")
    for iteration, sizes, policy, by, reason, rejected in rows:
        lines = [_shown(f"{sizes} ({policy}, by {by})"), _shown(reason)]
        lines += [_shown(f"rejected: {rejected}")] * bool(rejected)
        folded.add_row(iteration, Text("\n").join(lines))
    return folded


def brief_status(status: JobStatus) -> str:
    """The job in one line (`lbbsp status --brief`): its workers, who serves it, and how long ago it last decided."""
    workers = "settings gone" if status.config is None else _workers(status.config)
    served = f"served by {printable(status.serving)}" if status.serving else "no coordinator"
    when = _decided_at(status.decisions[0]) if status.decisions else None
    decided = "no decision yet" if not status.decisions else (
        f"last decision {_ago(when)} ago" if when is not None else "last decision at a time not stored")
    rejected = _rejected_count(status.decisions[0]) if status.decisions else 0
    if rejected:
        decided += f" ({rejected} report{'s' * (rejected != 1)} rejected)"
    return f"{status.job}: {workers}, {served}, {decided}"


def _workers(config: JobConfig) -> str:
    """"1 worker", "4 workers": the job's workers as the table's title and --brief say them."""
    return f"{config.num_workers} worker{'s' * (config.num_workers != 1)}"


def json_status(status: JobStatus, decisions_shown: int) -> dict[str, Any]:
    """The job as `lbbsp status --json` gives it: what the table shows, each value checked as the table checks it
    (null where it shows "-", or for a number that no double holds), the text as stored, for JSON to escape."""
    config, last = status.config, (status.decisions[0] if status.decisions else None)
    when = _decided_at(last) if last is not None else None
    shown: dict[str, Any] = {
        "name": status.job,
        "num_workers": config.num_workers if config else None,
        "global_batch": config.global_batch if config else None,
        "served_by": status.serving,
        "last_decision": None if last is None else {
            "iteration": _whole(last["iteration"]), "time": when,
            "seconds_ago": None if when is None else round(max(time.time() - when, 0.0), 3),
            "policy": last["policy"], "reason": last["reason"]},
        "workers": [{"index": worker, "iteration": _whole(s["iteration"]), "size": _whole(s["size"]),
                     **{name: _finite(s[name]) for name in ("predicted_throughput", "measured_throughput", "compute_s",
                                                            "wait_s")}, "predicts": _predicts(s),
                     "kind": _text(s.get("kind")) or None}
                    for worker, s in sorted(status.statuses.items())],
    }
    if decisions_shown:
        shown["decisions"] = [
            {"iteration": _whole(d["iteration"]), "through": _whole(d.get("through")),
             "sizes": [_whole(size) for size in d["sizes"]], "policy": d["policy"], "written_by": _written_by(d),
             "reason": d["reason"],
             "rejected": [{"worker": _text(r.get("worker")), "error": _text(r.get("error"))} for r in _rejections(d)],
             "rejected_more": _count(d.get("rejected_more"))}
            for d in status.decisions]
    return shown


def _ago(when: float) -> str:
    """How long ago the Unix time ``when`` was, in the unit that reads best."""
    seconds = max(time.time() - when, 0.0)
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _decided_at(decision: dict[str, Any]) -> float | None:
    """The Unix time a decision record was written at (the coordinator's time.time()), None if it holds no finite
    one."""
    when = decision.get("time")
    return when if isinstance(when, float) and math.isfinite(when) else None


def _written_by(decision: dict) -> str:
    """Who wrote the split a decision record shows: this decision, a worker's fallback that came first, or an
    earlier decision of a coordinator running ahead, which had covered the iteration already."""
    if decision["written_by_coordinator"]:
        return "coordinator"
    return "fallback" if decision.get("fallback") is True else "earlier decision"


#: What ``lbbsp status`` needs of a decision record and of a worker's status; entries without it (written by
#: something other than a coordinator) are left out rather than stopping the table.
_Fields = dict[str, type | tuple[type, ...]]
_NUMBER = (int, float, type(None))
_DECISION: _Fields = {"iteration": int, "sizes": list, "policy": str, "written_by_coordinator": bool, "reason": str,
             "rejected": list}
_WORKER_STATUS: _Fields = {"iteration": int, "size": int, "predicted_throughput": _NUMBER,
                           "measured_throughput": _NUMBER, "compute_s": _NUMBER, "wait_s": _NUMBER}


def _entries(stored_decisions: list[bytes], stored_statuses: dict[bytes, bytes]
             ) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]], list[bytes]]:
    """The decision records and the workers' statuses (by worker index) a coordinator wrote, and the entries
    (a field, or a value) that none wrote: left out, so that one of those does not stop the listing."""
    decisions: list[dict[str, Any]] = []
    statuses: dict[int, dict[str, Any]] = {}
    skipped: list[bytes] = []
    for raw in stored_decisions:
        if (decision := _readable(raw, _DECISION)) is not None:
            decisions.append(decision)
        else:
            skipped.append(raw)
    for field, raw in stored_statuses.items():
        try:  # as other readers take a worker index: int() takes "-1" and "1_000", and fails on 5,000 digits
            worker = _index(field)
        except ValueError:
            skipped.append(field)
            continue
        if worker not in statuses and (status := _readable(raw, _WORKER_STATUS)) is not None:
            statuses[worker] = status
        else:
            skipped.append(raw)
    return decisions, statuses, skipped


def _readable(raw: bytes, fields: _Fields) -> dict[str, Any] | None:
    """``raw`` as a JSON object holding ``fields`` with those types, or None if it is not one."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if isinstance(obj, dict) and all(isinstance(obj.get(name), kind) for name, kind in fields.items()):
        return obj
    return None


def _iterations(decision: dict[str, Any]) -> str:
    """The iteration a decision is for, or the first and last where it covers several (a coordinator behind)."""
    through = decision.get("through")
    if isinstance(through, int) and through > decision["iteration"]:
        return f"{decision['iteration']}-{through}"
    return str(decision["iteration"])


def _shown(text: str) -> Text:
    """:func:`~lbbsp.errors.printable` text for a table, not read as console markup (a rejected report's error
    quotes the report's field names, and "[/x]" had ended `lbbsp status` in a MarkupError)."""
    from rich.text import Text  # noqa: PLC0415  (only the status subcommand draws tables)

    return Text(printable(text))


def _finite(value: object) -> float | None:
    """A stored throughput or time as a float; None for none, and for what is no finite float (10**400, NaN),
    which a coordinator writes as null."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return number if math.isfinite(number) else None


def _fmt(value: object) -> str:
    """A stored throughput or time, in 4 digits; "-" where :func:`_finite` finds none."""
    number = _finite(value)
    return "-" if number is None else f"{number:.4g}"


def _whole(value: object) -> int | None:
    """A stored iteration or size for JSON: an int (no bool) that a double holds exactly, as JSON readers take
    numbers; None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 2**53:
        return value
    return None


def _count(value: object) -> int | None:
    """A stored count (``rejected_more``) as an int of 0 to 2**53; None for anything else (a bool, a negative, a
    fraction, text), which no coordinator writes: ignored, as the other stored values are."""
    number = _whole(value)
    return number if number is not None and number >= 0 else None


def _rejections(decision: dict[str, Any]) -> list[dict[str, Any]]:
    """The rejected reports a decision record lists (each a worker and its error); entries of another shape left
    out."""
    return [r for r in decision["rejected"] if isinstance(r, dict)]


def _rejected_count(decision: dict[str, Any]) -> int:
    """How many reports a decision rejected: those its record lists, and those beyond (``rejected_more``: a
    coordinator records 20 at most)."""
    return len(_rejections(decision)) + (_count(decision.get("rejected_more")) or 0)


def _predicts(status: dict[str, Any]) -> bool | None:
    """Whether a worker's status says its coordinator's policy predicts speeds (False: it has no model, as BSP);
    None where it does not say (a coordinator before the field)."""
    predicts = status.get("predicts")
    return predicts if isinstance(predicts, bool) else None


def _text(value: object) -> str | None:
    """A stored value that should be text, for JSON (which escapes its control characters); None if it is none."""
    return value if isinstance(value, str) else None
