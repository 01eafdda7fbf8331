"""The public surface as a user meets it in ``help()``, ``dir()`` and an IDE's hover: every module says what it is,
every public class, function and method has a docstring and complete type hints, every ``__all__`` name exists and
resolves (the lazily imported ones too), the names the docs' API tables present as importable are exported, and
docs/models.md gives each policy hook with the arguments the policy calls it with."""
from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

import lbbsp
import lbbsp.integrations
from lbbsp import LBBSPPolicy

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _modules(package: ModuleType) -> list[str]:
    return [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


CORE = _modules(lbbsp)
# The integrations import torch, tensorflow or flwr; walked in tests of their own so that the core's stay fast.
INTEGRATIONS = _modules(lbbsp.integrations)
#: What the integrations import; lbbsp[test] alone installs none of them.
FRAMEWORKS = frozenset({"torch", "tensorflow", "keras", "tf_keras", "flwr"})


@contextlib.contextmanager
def _framework_or_skip(name: str) -> Iterator[None]:
    """Skips the test where module ``name`` (or a name it serves lazily) imports a framework this install lacks."""
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in FRAMEWORKS:
            pytest.skip(f"{name} imports {exc.name}, which is not installed")
        raise


def _module(name: str) -> ModuleType:
    """Module ``name``; the test is skipped where it imports a framework this install lacks."""
    with _framework_or_skip(name):
        return importlib.import_module(name)


def public_names(module: ModuleType) -> list[str]:
    """``__all__`` where the module has one, else the classes and functions it defines without a leading ``_``."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [name for name, value in vars(module).items()
            if not name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
            and value.__module__ == module.__name__]


def _hint_gaps(function: Callable[..., object], label: str, *, bound: bool) -> Iterator[str]:
    """The parameters (``*args`` and ``**kwargs`` included; a method's first left out) and return without a hint."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a text signature: nothing to read
        return
    parameters = list(signature.parameters.values())[1 if bound else 0:]
    missing = [p.name for p in parameters if p.annotation is inspect.Parameter.empty]
    if missing:
        yield f"{label}: no type hint for {', '.join(missing)}"
    if signature.return_annotation is inspect.Signature.empty:
        yield f"{label}: no return type hint"


def _own_class_doc(cls: type) -> str:
    """The class's own docstring, not a base's, nor the ``Name(field, ...)`` a dataclass or NamedTuple makes up."""
    doc = (cls.__dict__.get("__doc__") or "").strip()
    return "" if re.fullmatch(rf"{re.escape(cls.__name__)}\(.*\)", doc, re.DOTALL) else doc


def _class_gaps(cls: type, label: str) -> Iterator[str]:
    if not _own_class_doc(cls):
        yield f"{label}: no class docstring"
    # The methods it and its private bases in lbbsp define (public through it; a public base is walked itself), not
    # object's, scikit-learn's or a framework's. A method without a docstring may inherit its base's, as in help().
    for owner in cls.__mro__:
        if owner is not cls and not (owner.__module__.startswith("lbbsp") and owner.__name__.startswith("_")):
            continue
        for name, raw in vars(owner).items():
            if name.startswith("_") and name != "__init__":
                continue
            function: Callable[..., object] | None
            if isinstance(raw, staticmethod):
                function, bound = raw.__func__, False
            elif isinstance(raw, classmethod):
                function, bound = raw.__func__, True
            elif isinstance(raw, property):
                function, bound = raw.fget, True
            elif inspect.isfunction(raw):
                function, bound = raw, True
            else:  # a class attribute, a nested class, a cached value
                continue
            if function is None or function.__qualname__ != f"{owner.__qualname__}.{name}":
                continue  # not written in the class body (typing.Protocol's own __init__, say)
            where = f"{label}.{name}" if owner is cls else f"{label}.{name} (from {owner.__qualname__})"
            if name != "__init__" and not inspect.getdoc(raw if isinstance(raw, property) else getattr(owner, name)):
                yield f"{where}: no docstring"
            yield from _hint_gaps(function, where, bound=bound)


def api_gaps(module_name: str) -> list[str]:
    """What ``help()`` and type checkers would find missing in one module's public surface."""
    module = _module(module_name)
    gaps = [] if (module.__doc__ or "").strip() else [f"{module_name}: no module docstring"]
    names = public_names(module)
    if len(set(names)) != len(names):
        gaps.append(f"{module_name}.__all__ lists a name twice: {sorted(n for n in names if names.count(n) > 1)}")
    for name in names:
        label = f"{module_name}.{name}"
        try:
            with _framework_or_skip(module_name):  # LBBSPCallback imports Keras as it is first read
                value = getattr(module, name)
        except AttributeError:
            gaps.append(f"{label}: in __all__ but not in the module")
            continue
        if inspect.isclass(value):
            gaps.extend(_class_gaps(value, label))
        elif inspect.isfunction(value):
            if not (value.__doc__ or "").strip():
                gaps.append(f"{label}: no docstring")
            gaps.extend(_hint_gaps(value, label, bound=False))
        # anything else (a constant such as KINDS) carries no docstring of its own
    return gaps


@pytest.mark.parametrize("module_name", CORE)
def test_core_public_names_have_docstrings_and_type_hints(module_name: str) -> None:
    assert api_gaps(module_name) == []


@pytest.mark.parametrize("module_name", INTEGRATIONS)
def test_integration_public_names_have_docstrings_and_type_hints(module_name: str) -> None:
    assert api_gaps(module_name) == []


def test_the_walk_sees_the_surface_the_docs_present() -> None:
    # A walk that found nothing would pass everything: the names the user guides start from must be in it.
    assert {"lbbsp.integrations.torch", "lbbsp.integrations.keras", "lbbsp.integrations.flower"} <= set(INTEGRATIONS)
    assert {"lbbsp.models", "lbbsp.policies", "lbbsp.sim.engine", "lbbsp.sim.scenarios"} <= set(CORE)
    assert {"compare", "standard_policies"} <= set(public_names(importlib.import_module("lbbsp.sim.engine")))


def test_the_check_catches_a_missing_docstring_or_hint() -> None:
    class Undocumented:
        def run(self, steps):  # a user's slip: no docstring, no hints
            return steps

    Undocumented.__module__ = "lbbsp.fake"
    assert sorted(_class_gaps(Undocumented, "Undocumented")) == [
        "Undocumented.run: no docstring", "Undocumented.run: no return type hint",
        "Undocumented.run: no type hint for steps", "Undocumented: no class docstring"]


def test_the_check_catches_a_bare_module_function_and_a_stale_all(monkeypatch: pytest.MonkeyPatch) -> None:
    module = ModuleType("lbbsp.fake")

    def helper(x, *rest: int):  # a user's slip: no docstring, hints on part of it
        return x

    module.helper, module.__all__ = helper, ["helper", "gone"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lbbsp.fake", module)
    assert api_gaps("lbbsp.fake") == [
        "lbbsp.fake: no module docstring", "lbbsp.fake.helper: no docstring",
        "lbbsp.fake.helper: no type hint for x", "lbbsp.fake.helper: no return type hint",
        "lbbsp.fake.gone: in __all__ but not in the module"]


def _top_level_spans(cell: str) -> list[str]:
    """The backticked spans of a table cell, leaving out those in a parenthesised remark."""
    spans, depth, i = [], 0, 0
    while i < len(cell):
        if cell[i] == "`":
            end = cell.index("`", i + 1)
            if depth == 0:
                spans.append(cell[i + 1:end])
            i = end
        elif cell[i] == "(":
            depth += 1
        elif cell[i] == ")":
            depth -= 1
        i += 1
    return spans


def table_names(doc: str, header: str) -> list[str]:
    """The names in the first column of the first table in ``docs/{doc}`` whose first header cell is ``header``."""
    names: list[str] = []
    lines = (DOCS / doc).read_text().splitlines()
    for start, line in enumerate(lines):
        if line.startswith("|") and line.strip("|").split("|")[0].strip() == header:
            for row in lines[start + 2:]:
                if not row.startswith("|"):
                    break
                for span in _top_level_spans(row.split("|")[1]):
                    match = re.match(r"[A-Za-z_]\w*", span)
                    if match:
                        names.append(match.group())
            break
    assert names, f"no table headed {header!r} with names in docs/{doc}: the test reads the wrong table"
    return names


@pytest.mark.parametrize(("doc", "header", "module_name"), [
    ("core.md", "object", "lbbsp"),
    ("models.md", "model", "lbbsp.models"),
    ("models.md", "policy", "lbbsp.policies"),
])
def test_the_docs_api_tables_name_only_exported_names(doc: str, header: str, module_name: str) -> None:
    exported = set(importlib.import_module(module_name).__all__)
    assert [name for name in table_names(doc, header) if name not in exported] == []


@pytest.mark.parametrize("module_name", ["lbbsp", "lbbsp.models", "lbbsp.hedging", "lbbsp.policies",
                                         "lbbsp.integrations.torch", "lbbsp.integrations.keras",
                                         "lbbsp.integrations.flower"])
def test_every_exported_name_is_named_in_the_docs(module_name: str) -> None:
    """An export no page names is one a user finds only by dir(): equal_split, scale_split, hardware_of,
    BalancedLoader, agree_with_rank0, ClientStatus and five more had been."""
    text = "\n".join(page.read_text() for page in [*DOCS.glob("*.md"), DOCS.parent / "README.md"])
    names = _module(module_name).__all__
    assert [name for name in names if not re.search(rf"\b{re.escape(name)}\b", text)] == []


def test_every_name_the_package_exports_resolves() -> None:
    """The exports that import scikit-learn are resolved on first use (PEP 562): each still imports, as an attribute
    and with `from lbbsp import ...`, and is the object its module defines."""
    code = textwrap.dedent("""
        import sys
        import lbbsp
        assert "sklearn" not in sys.modules, "import lbbsp imported scikit-learn"
        for name in lbbsp.__all__:
            value = getattr(lbbsp, name)
            assert getattr(sys.modules[value.__module__], name) is value, name  # its module's own object
            assert name in dir(lbbsp), name
        namespace = {}
        exec("from lbbsp import *", namespace)
        assert set(lbbsp.__all__) <= set(namespace), set(lbbsp.__all__) - set(namespace)
        from lbbsp import Coordinator, EWMAThroughput, LBBSPPolicy
        from lbbsp.coordinator import Coordinator as C
        assert Coordinator is C and EWMAThroughput.__name__ == "EWMAThroughput" and LBBSPPolicy.name == "lbbsp"
        try:
            lbbsp.NoSuchName
        except AttributeError as exc:
            assert "NoSuchName" in str(exc), exc
        else:
            raise AssertionError("lbbsp.NoSuchName resolved")
        print("ok", len(lbbsp.__all__))
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok "), result.stdout


ROOT = Path(__file__).resolve().parent.parent


#: LBBSPPolicy's hooks, which a variant overrides
HOOK_NAMES = ("bounds", "propose", "dropout")


def test_models_md_gives_each_hook_as_the_policy_calls_it() -> None:
    page = (ROOT / "docs" / "models.md").read_text()
    for hook in HOOK_NAMES:
        shown = re.findall(rf"`{hook}\(([^`)]*)\)`", page)
        assert shown, f"docs/models.md gives no signature of the hook {hook}"
        named = [part.strip().partition("=")[0] for part in shown[0].split(",")]
        parameters = list(inspect.signature(getattr(LBBSPPolicy, hook)).parameters)[1:]  # without self
        assert named == parameters, (hook, named, parameters)
