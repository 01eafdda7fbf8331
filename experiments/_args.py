"""What the experiment scripts share of their command lines."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def results_file(parser: argparse.ArgumentParser, out: Path) -> Path:
    """The file ``--out`` names (a folder, or a name without a suffix, which becomes a folder as ``lbbsp simulate
    --out`` does: the default file's name in it), checked before a run of minutes: its folder is made and must
    take a file. Otherwise ``parser.error`` names ``--out``, where a bad one had cost the whole run (and its
    figures) to a traceback at the end."""
    path = out / Path(parser.get_default("out")).name if out.is_dir() or not out.suffix else out
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as exc:
        parser.error(f"--out {out}: cannot write results there ({exc.strerror or exc})")
    return path
