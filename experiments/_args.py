"""What the experiment scripts share of their command lines."""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def out_help(default: Path) -> str:
    """``--out``'s help, its ``default`` named from the repository's root, as the docs quote it (two benchmarks
    had shown this checkout's absolute path, the others no path at all)."""
    return (f"the JSON file to write (a name with a suffix, such as x.json), or a folder to write {default.name} in "
            f"(any other name; made if missing) (default: {default.resolve().relative_to(ROOT)})")


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
    """Around a benchmark's run: Ctrl-C (or a SIGTERM raised as it) ends it with one line and exit status 130, not a
    traceback from whatever it was running."""
    try:
        yield
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130) from None


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
