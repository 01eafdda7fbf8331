"""What the experiment scripts share: their command lines' --out, the run record their results carry, and how a run
ends at Ctrl-C."""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from lbbsp.signals import ctrl_c_ignored, signals_held

ROOT = Path(__file__).resolve().parents[1]
_PR_SET_PDEATHSIG = 1  # prctl's option: the signal a process gets when its parent ends
#: The packages whose versions a run record gives, those of them the run had imported
RECORDED_PACKAGES = ("lbbsp", "numpy", "torch", "tensorflow", "tf_keras", "flwr", "sklearn", "redis")


def out_help(default: Path) -> str:
    """``--out``'s help, its ``default`` named from the repository's root, as the docs quote it (two benchmarks
    had shown this checkout's absolute path, the others no path at all)."""
    return (f"the JSON file to write (a name with a suffix, such as x.json), or a folder to write {default.name} in "
            f"(any other name; made if missing) (default: {default.resolve().relative_to(ROOT)} in this checkout, "
            f"whatever the current folder)")


def results_file(parser: argparse.ArgumentParser, out: Path) -> Path:
    """The file ``--out`` names (a folder, or a name without a suffix, which becomes a folder as ``lbbsp simulate
    --out`` does: the default file's name in it), checked before a run of minutes: its folder is made and must
    take a file. Otherwise ``parser.error`` names ``--out``, where a bad one had cost the whole run (and its
    figures) to a traceback at the end."""
    path = out / Path(parser.get_default("out")).name if out.is_dir() or not out.suffix else out
    _refuse_a_file_as_folder(parser, out, path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as exc:
        parser.error(f"--out {out}: cannot write results there ({exc.strerror or exc})")
    return path


def run_record(root: Path = ROOT) -> dict[str, Any]:
    """Where a results file's figures came from, to write beside them: the commit checked out at ``root`` and whether
    tracked files differed from it (null without git or outside a checkout), the UTC time, and the machine."""
    commit, dirty = _checkout(root)
    return {"commit": commit, "dirty": dirty, "utc": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                        "cpu_model": _cpu_model(),
                        "packages": {name: getattr(sys.modules[name], "__version__", None)
                                     for name in RECORDED_PACKAGES if name in sys.modules}}}


def _checkout(root: Path) -> tuple[str | None, bool | None]:
    """The commit checked out at ``root`` and whether tracked files (the results aside) differ from it; (None, None)
    where git is missing or fails, or ``root`` is not the top of a checkout (the code installed elsewhere, in another
    repository say)."""
    try:
        top, commit = _git(root, "rev-parse", "--show-toplevel", "HEAD").splitlines()
        if Path(top).resolve() != root.resolve():
            return None, None
        # results files left out: an earlier run's rewritten results would mark every later run dirty
        return commit, bool(_git(root, "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 ":(exclude)experiments/results"))
    except (OSError, subprocess.SubprocessError, ValueError):  # no git; not a checkout; not two lines
        return None, None


def _git(root: Path, *args: str) -> str:
    """``git args``'s output in ``root``, without the optional locks (a status beside the user's own git)."""
    return subprocess.run(["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True, text=True,
                          check=True, timeout=30).stdout


def _cpu_model() -> str | None:
    """The CPU's model name as /proc/cpuinfo gives it; None where it gives none (not Linux, some ARM machines)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:
        return None


def _refuse_a_file_as_folder(parser: argparse.ArgumentParser, out: Path, folder: Path) -> None:
    """``parser.error`` naming the file where ``--out`` needs ``folder`` (``out`` itself, or a folder above it): the
    write's own error had said only 'File exists' or 'Not a directory'."""
    try:
        nearest = next(path for path in (folder, *folder.parents) if path.exists())  # "." or "/" at the latest
    except OSError:  # a folder that may not be read, say: the write's error names it
        return
    if not nearest.is_dir():
        parser.error(f"--out {out}: cannot write results there ({nearest} is a file, not a folder; a name without a "
                     f"suffix is a folder to write {Path(parser.get_default('out')).name} in, a file to write is "
                     "named with one, such as x.json)")


@contextlib.contextmanager
def interrupted_as_exit() -> Iterator[None]:
    """Around a benchmark's run: Ctrl-C, or a SIGTERM (a plain `kill`, timeout(1)) taken as one, ends it with one line
    and exit status 130, not a traceback from whatever it was running, and the run's own cleanup stops what it
    started. At its default a SIGTERM had ended the script alone: its ranks printed tracebacks as they lost Redis,
    and the --out folder made for the run stayed."""
    main_thread = threading.current_thread() is threading.main_thread()  # only the main thread may set a handler
    previous = signal.signal(signal.SIGTERM, _as_ctrl_c) if main_thread else None
    try:
        yield
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _as_ctrl_c(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def empty_folders_removed_on_failure(out: Path) -> Iterator[None]:
    """Around a run that writes ``out`` last: when it ends otherwise (Ctrl-C, ``parser.error``, an error), the folders
    of ``out`` that did not exist before are removed again if they are empty, deepest first (a refused or
    interrupted run had left an empty results folder of its own making behind)."""
    try:
        new = [path for path in (out, *out.parents) if not path.exists()]
    except OSError:  # a folder that may not be read: results_file refuses it
        new = []
    try:
        yield
    except BaseException:
        for folder in new:
            try:
                folder.rmdir()
            except FileNotFoundError:  # never made (a file's name, or a run that stopped early)
                continue
            except OSError:  # not empty, or not a folder: neither it nor those above are this run's to remove
                break
        raise


@contextlib.contextmanager
def writing_results(parser: argparse.ArgumentParser, out: Path) -> Iterator[Path]:
    """Around a benchmark's run, the file it writes (:func:`results_file`): Ctrl-C or a SIGTERM ends the run with one
    line and exit status 130 (:func:`interrupted_as_exit`), and a run that ends otherwise than by writing it removes
    the folders made for it (:func:`empty_folders_removed_on_failure`)."""
    with interrupted_as_exit(), empty_folders_removed_on_failure(out):
        yield results_file(parser, out)


def spawn_ranks(fn: Callable[..., None], args: tuple[object, ...], nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with Ctrl-C left to this process: the ranks ignore it, and
    however the wait for them ends (Ctrl-C, a rank's failure) none of them, nor a process one started, outlives it
    (at Ctrl-C, the ranks' own tracebacks had come with this process's)."""
    import torch.multiprocessing as mp  # noqa: PLC0415  (the torch benchmarks' alone)

    ranks = None
    try:
        # a SIGTERM that arrives meanwhile waits until every rank is started whole, then stops them all
        with ctrl_c_ignored(), signals_held():
            ranks = mp.start_processes(_rank, args=(os.getpid(), fn, *args), nprocs=nprocs, join=False,
                                       start_method="spawn")
        while not ranks.join():
            pass
    finally:
        if ranks is not None:
            stop_process_trees([rank.pid for rank in ranks.processes if rank.is_alive()])
            for rank in ranks.processes:
                rank.join()


def _rank(index: int, parent: int, fn: Callable[..., None], *args: object) -> None:
    """Rank ``index`` of :func:`spawn_ranks`: ``fn(index, *args)``, in a process killed when its parent ends. torch
    sends a rank SIGINT then, which it now ignores: a killed or SIGTERMed benchmark would have left its ranks
    training on."""
    signal.signal(signal.SIGTERM, _exit_quietly)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # Linux, as the benchmarks' pinning
    if os.getppid() != parent:  # it ended before the line above
        return
    fn(index, *args)


def _exit_quietly(signum: int, frame: object) -> None:
    """A rank's SIGTERM (:func:`stop_process_trees`) as SystemExit, so that its cleanup runs: killed outright, rank 0
    left its coordinator process's semaphores to the resource tracker, which warned of them under "interrupted". Its
    stderr goes quiet first: a peer stopped at the same moment can make gloo abort it mid-collective."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    raise SystemExit(128 + signum)


def stop_process_trees(pids: Iterable[int], grace_s: float = 5.0) -> None:
    """SIGTERM to the processes ``pids`` still running, SIGKILL to those left after ``grace_s``; then SIGKILL to the
    processes they had started (a rank's DataLoader workers noticed it gone only within 5 s, as orphans). Ctrl-C
    is ignored meanwhile, so that a second one does not cut the stop short. The processes are left to their owners
    to reap (a ``Popen`` or ``multiprocessing.Process`` whose exit status this took away would not know it ended)."""
    with ctrl_c_ignored():
        tops, below = [], []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                top = psutil.Process(pid)
                below += top.children(recursive=True)
                top.terminate()
                tops.append(top)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not all(map(_ended, tops)):
            time.sleep(0.05)
        for process in [*tops, *below]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(below, timeout=grace_s)  # orphans by now: init reaps them


def _ended(process: psutil.Process) -> bool:
    """Whether ``process`` has ended (a zombie waits for its owner to reap it)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
