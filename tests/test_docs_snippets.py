"""The code that README.md and docs/*.md show still works as shown (docs/decision_time_log.md, a log of past
runs, aside), so that the docs a user copies from cannot rot silently.

The rules, each explicit so that a page's author knows what is checked:
- every ```python block parses, and its imports resolve (most blocks are fragments of a training script);
- a block marked with ``<!-- snippet: runs alone -->`` on the line before its fence runs whole, in a fresh
  interpreter (mark only blocks that need no cluster, GPU or long training);
- every ``--flag`` written after ``lbbsp <subcommand>`` or ``python <script>.py``, in one code span or one line
  of a code block, is a flag of that command, and the script exists;
- each framework benchmark's page gives a quick run ("For a quick look, ...") with ``--out``, in flags its script
  takes;
- the ``policy=`` example in docs/torch.md's table runs with the imports its row shows.
"""
from __future__ import annotations

import ast
import contextlib
import io
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from lbbsp import cli

torch = pytest.importorskip("torch")
from lbbsp.policies import LBBSPPolicy  # noqa: E402
from test_bench_cli import DOCS_DIR, _parser  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "decision_time_log.md")]
RUNS_ALONE = "<!-- snippet: runs alone -->"
#: a fenced block, at any indent (a block inside a list item is indented with it)
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
#: a command whose flags are checked: an lbbsp subcommand, or a script of this repository run by python
COMMAND = re.compile(r"\blbbsp (?P<sub>coordinator|status|forget|demo|simulate)\b|\bpython (?P<script>[\w/.-]+\.py)\b")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class Snippet:
    """One ```python block of a page: where it starts, its code (dedented) and whether it is marked to run alone."""

    page: Path
    line: int
    code: str
    runs_alone: bool

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_snippets(page: Path) -> list[Snippet]:
    """The ```python blocks of ``page``, in order."""
    text = page.read_text()
    snippets = []
    for match in FENCE.finditer(text):
        if match["lang"] != "python":
            continue
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        snippets.append(Snippet(page, text.count("\n", 0, match.start()) + 1, textwrap.dedent(match["body"]),
                                before == RUNS_ALONE))
    return snippets


SNIPPETS = [snippet for page in DOCS for snippet in python_snippets(page)]


def run_python(code: str, cwd: Path, timeout_s: float = 120.0) -> None:
    """Run ``code`` in a fresh interpreter, as a user's script; fail with its output unless it exits with 0."""
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_every_python_snippet_parses_and_its_imports_resolve(tmp_path: Path) -> None:
    for extra in ("torch", "tensorflow", "flwr"):  # the pages' imports need lbbsp[all]
        pytest.importorskip(extra)
    imports: list[str] = []
    for snippet in SNIPPETS:
        tree = ast.parse(snippet.code, filename=str(snippet))  # a SyntaxError names the page and the block's line
        imports += [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert len(SNIPPETS) >= 10 and imports, "the pages' ```python blocks were not found"
    run_python("\n".join(dict.fromkeys(imports)), tmp_path)


def test_every_marker_stands_before_a_python_block() -> None:
    """A marker that no longer stands right before a ```python fence would leave its block unchecked."""
    markers = sum(page.read_text().count(RUNS_ALONE) for page in DOCS)
    marked = [str(s) for s in SNIPPETS if s.runs_alone]
    assert markers == len(marked) and marked, f"{markers} markers, before the blocks {marked}"


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if s.runs_alone], ids=str)
def test_a_snippet_marked_to_run_alone_runs(snippet: Snippet, tmp_path: Path) -> None:
    for extra in ("torch", "tensorflow", "flwr"):  # the snippets of the framework pages need lbbsp[all]
        pytest.importorskip(extra)
    run_python(snippet.code, tmp_path)  # in an empty folder: whatever it writes stays out of the repository


def command_lines(text: str) -> list[str]:
    """Each code span of a page and each line of its code blocks, where a command line is written, without the
    shell comment that may follow the command."""
    blocks = [line for match in FENCE.finditer(text) for line in match["body"].splitlines()]
    spans = [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", FENCE.sub("", text))]
    return [line.split(" #")[0] for line in blocks + spans]


def lbbsp_flags(sub: str) -> set[str]:
    """The flags ``lbbsp <sub>`` takes, read from its own --help."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([sub, "--help"])
    return set(FLAG.findall(out.getvalue()))


def test_every_flag_written_after_a_command_is_one_it_takes() -> None:
    subcommands = {sub: lbbsp_flags(sub) for sub in ("coordinator", "status", "forget", "demo", "simulate")}
    checked, wrong = 0, []
    for page in DOCS:
        for line in command_lines(page.read_text()):
            found = list(COMMAND.finditer(line))
            for match, end in zip(found, [m.start() for m in found[1:]] + [len(line)]):  # its flags: up to the next
                written = FLAG.findall(line[match.end():end])
                if match["sub"]:
                    known = subcommands[match["sub"]]
                else:
                    script = ROOT / match["script"]
                    if not script.is_file():
                        wrong.append(f"{page.name}: {match['script']} does not exist")
                        continue
                    known = {flag for flag in written if f'"{flag}"' in script.read_text()} | {"--help"}
                checked += 1
                wrong += [f"{page.name}: {match[0]} has no {flag}" for flag in written if flag not in known]
    assert checked >= 30, f"only {checked} commands found in the pages"
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("page", "script"), [("torch.md", "bench_torch"), ("torch.md", "bench_torch_loading"),
                                              ("keras.md", "bench_keras"), ("flower.md", "bench_flower")])
def test_each_benchmark_page_gives_a_quick_run_its_script_takes(page: str, script: str) -> None:
    """A quick run with --out for every framework benchmark (bench_torch_loading and bench_flower had none: their
    defaults take minutes), in flags the script accepts."""
    text = " ".join((DOCS_DIR / page).read_text().split())
    start = text.index(f"For a quick look, `python experiments/{script}.py ")
    command = text[start:].split("`")[1].split()[2:]
    assert "--out" in command, command
    parser = _parser(script)
    args = parser.parse_args(command)
    assert str(args.out).startswith("/tmp/"), args.out


TORCH_DOC = Path(__file__).resolve().parent.parent / "docs" / "torch.md"


def test_the_policy_example_of_the_redis_table_runs_with_the_imports_it_shows() -> None:
    """`from lbbsp import AutoCapacityModel` fails (it lives in lbbsp.models), and the example showed no import."""
    row = next(line for line in TORCH_DOC.read_text().splitlines() if line.startswith("| `policy=` |"))
    spans = re.findall(r"`([^`]+)`", row)
    imports = [span for span in spans if span.startswith("from ")]
    example = next(span for span in spans if span.startswith("LBBSPPolicy(AutoCapacityModel("))
    namespace: dict = {"lag": 2}
    exec("\n".join(imports), namespace)  # the docs' own import lines
    policy = eval(example, namespace)
    assert isinstance(policy, LBBSPPolicy) and policy.model.kinds == {3: "gpu"}
