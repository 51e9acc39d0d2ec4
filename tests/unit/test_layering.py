"""The packages' layering, read from the source: what each may import (also inside functions).

``memfit.job`` (the vocabulary), ``errors``, ``units``, ``paths`` and ``runtime`` are the floor;
``estimate`` models a step and must not reach up into what uses it (``plan``, ``train``,
``infer``, ...); ``infer`` runs saved models and must not need ``train``. A private name (leading
underscore) stays inside its package.

No module imports itself through others: the import graph of ``src/memfit`` (imports inside
functions included) has no circle. An ``if TYPE_CHECKING:`` block is left out of that graph, as it
never runs (today none of memfit's modules needs one to avoid a circle). An import
inside a function is there only for an optional package or for start-up time, and a comment on its
line or the line above says which (``optional`` or ``start-up``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "memfit"

# what every package may import: the floor (no memfit package of its own but these)
FLOOR = {
    "errors", "units", "paths", "progress", "_callable_module", "job", "runtime", "metrics", "extras",
    "knobs", "levers",
    # the filter of third-party lines that say nothing to the user (every entry point installs it)
    "quiet",
    # each recipe's loss: memfit train runs it, the estimator traces it (so both stand on it)
    "step",
}  # fmt: skip
# package (or top-level module) → the memfit packages it may import besides the floor; the
# package map of CONTRIBUTING.md says the same. The CLI's verbs (commands, cli, the package's own
# __init__ and __main__) stand on everything.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "knobs": set(),
    "step": set(),
    # the job inherits the levers' knobs: a lever never imports it (not even as a type)
    "levers": {"knobs", "errors", "units"},
    "job": {"knobs", "levers"},
    "runtime": set(),
    "quiet": set(),
    "metrics": set(),
    "progress": set(),
    "_callable_module": set(),
    "units": {"errors"},
    "extras": {"errors"},
    "paths": {"errors"},
    "devices": {"errors"},
    "models": {"errors"},
    "data": {"errors", "units"},
    "config": {"errors", "job", "paths"},
    "estimate": FLOOR | {"devices", "models"},
    "measure": FLOOR | {"estimate", "models"},
    "_measure_child": FLOOR | {"estimate", "models"},
    "guard": FLOOR | {"data"},
    "plan": FLOOR | {"estimate", "devices", "models", "data", "config"},
    "report": FLOOR | {"estimate", "plan", "devices", "models"},
    "infer": FLOOR | {"estimate", "guard", "data", "models", "devices"},
    "train": FLOOR | {"estimate", "plan", "guard", "data", "models", "devices", "config"},
    "integrations": FLOOR | {"guard", "plan", "estimate", "models", "devices", "data"},
    # memfit ui's page: the estimate and the plan, their lines (report), the card, the model
    "ui": FLOOR | {"estimate", "plan", "report", "devices", "models"},
}
TOP = {"commands", "cli", "__init__", "__main__"}


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported memfit module, names imported from it) for every import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "memfit" or node.module.startswith("memfit."):
                names = [a.name for a in node.names]
                if node.module == "memfit":  # from memfit import plan: the submodule is the name
                    found.extend((node.lineno, f"memfit.{n}", []) for n in names)
                else:
                    found.append((node.lineno, node.module, names))
        elif isinstance(node, ast.Import):
            found.extend(
                (node.lineno, a.name, []) for a in node.names if a.name.startswith("memfit.")
            )
    return found


def _package(module: str) -> str:
    """memfit.estimate.api → estimate; memfit.job → job; memfit → __init__."""
    return module.split(".")[1] if module.count(".") >= 1 else "__init__"


def _sources() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def test_the_sources_are_found() -> None:
    modules = dict(_sources())
    assert "memfit.estimate.workload" in modules and "memfit.job" in modules
    assert any(m for _, p in _sources() for m in _imports(p)), "no memfit import read at all"


def _violations() -> list[str]:
    problems = []
    for module, path in _sources():
        package = _package(module)
        if package not in ALLOWED and package not in TOP:
            problems.append(f"{path.relative_to(SRC.parent)}: {package} is not in the map")
            continue
        for line, imported, names in _imports(path):
            target = _package(imported)
            where = f"{path.relative_to(SRC.parent)}:{line}"
            if package in ALLOWED and target != package and target not in ALLOWED[package]:
                problems.append(f"{where}: {package} imports {imported}")
            if target != package:
                private = [n for n in names if n.startswith("_")]
                problems.extend(
                    f"{where}: private {imported}.{n} used by {package}" for n in private
                )
    return problems


def test_packages_import_only_below_them_and_no_private_name_crosses() -> None:
    assert _violations() == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from memfit.plan import catalog\n", "estimate imports memfit.plan"),
        ("import memfit.infer.run\n", "estimate imports memfit.infer.run"),
        ("from memfit.train.recipes.causal_lm import x\n", "estimate imports memfit.train"),
        ("from memfit.guard.guard import _release\n", "private memfit.guard.guard._release"),
    ],
)
def test_the_check_catches_what_it_forbids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, expected: str
) -> None:
    """A planted bad import in an estimate module is reported (the check can fail)."""
    planted = tmp_path / "memfit" / "estimate" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("def f():\n    " + source, encoding="utf-8")
    monkeypatch.setattr(__import__(__name__, fromlist=["SRC"]), "SRC", tmp_path / "memfit")
    assert any(expected in p for p in _violations())


# --- circles ---------------------------------------------------------------------------------------
def _runs(tree: ast.Module) -> list[ast.stmt]:
    """The statements of ``tree`` that can run: every one but those under ``if TYPE_CHECKING:``."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.stmt):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    """memfit module → the memfit modules it imports (at the top or in a function). A package's
    ``__init__`` is no target: ``from memfit.estimate import workload`` imports workload."""
    sources = dict(_sources())
    packages = {m for m, p in sources.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for module, path in sources.items():
        package = module if module in packages else module.rpartition(".")[0]
        for node in _runs(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            graph[module].update(
                t for t in targets if t in sources and t != module and t not in packages
            )
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return circles


def test_no_import_circle() -> None:
    circles = [" ↔ ".join(c) for c in _circles(_graph())]
    assert circles == [], "import circles: " + "; ".join(circles)


def test_the_circle_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A circle closed by an import inside a function is found; one closed only under
    ``TYPE_CHECKING`` (which never runs) is not."""
    package = tmp_path / "memfit" / "estimate"
    package.mkdir(parents=True)
    (tmp_path / "memfit" / "__init__.py").write_text("", encoding="utf-8")
    (package / "__init__.py").write_text("from memfit.estimate import a\n", encoding="utf-8")
    (package / "a.py").write_text("from memfit.estimate import b\n", encoding="utf-8")
    (package / "b.py").write_text("def f():\n    from . import c\n", encoding="utf-8")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from memfit.estimate import b\n"
        "import memfit.estimate.a\n",
        encoding="utf-8",
    )
    (package / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from memfit.estimate import a\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(__import__(__name__, fromlist=["SRC"]), "SRC", tmp_path / "memfit")
    graph = _graph()
    assert graph["memfit.estimate.c"] == {"memfit.estimate.a"}
    assert graph["memfit.estimate.d"] == set()
    assert _circles(graph) == [["memfit.estimate.a", "memfit.estimate.b", "memfit.estimate.c"]]


# --- imports inside functions ----------------------------------------------------------------------
REASONS = ("optional", "start-up")


def _comment(line: str) -> str:
    return line.partition("#")[2].lower()


def _unexplained_imports(path: Path) -> list[str]:
    """``path:line: module`` for each import inside a function (of memfit or of a third-party
    package: the standard library is left out) with no comment saying ``optional`` or
    ``start-up`` on its lines or the line above; a comment above a run of imports covers the run."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)
    imports: dict[int, ast.Import | ast.ImportFrom] = {}  # last line → statement
    inside: list[ast.Import | ast.ImportFrom] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            imports[node.end_lineno or node.lineno] = node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inside.extend(n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom))

    def explained(node: ast.Import | ast.ImportFrom, own: bool = True) -> bool:
        if own:  # a comment at the end of the statement's lines explains that statement
            statement = lines[node.lineno - 1 : node.end_lineno]
            if any(r in _comment(line) for line in statement for r in REASONS):
                return True
        above = node.lineno - 1
        if above in imports:  # the run of imports above it, with the comment line above it
            return explained(imports[above], own=False)
        return above >= 1 and any(r in _comment(lines[above - 1]) for r in REASONS)

    found = []
    for node in sorted(inside, key=lambda n: n.lineno):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            names = ["." * node.level + (node.module or "")]
        top = names[0].split(".")[0]
        if top in sys.stdlib_module_names or top == "__future__":
            continue
        if not explained(node):
            found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {names[0]}")
    return found


def test_an_import_inside_a_function_says_why() -> None:
    """Each import inside a function is there for an optional package or for start-up time,
    and its comment says which (else it belongs at the top of the module)."""
    unexplained = [line for _, path in _sources() for line in _unexplained_imports(path)]
    assert unexplained == [], "imports inside functions with no optional/start-up comment:\n" + (
        "\n".join(unexplained)
    )


def test_the_import_comment_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "memfit" / "m.py"
    source.parent.mkdir()
    monkeypatch.setattr(__import__(__name__, fromlist=["SRC"]), "SRC", tmp_path / "memfit")
    source.write_text(
        "import torch\n"  # at the top: no comment needed
        "def f():\n"
        "    import json\n"  # the standard library: left out
        "    from memfit.estimate import api\n"  # 4: no comment
        "    # start-up: transformers takes seconds to import\n"
        "    import transformers\n"
        "    import torch.nn\n"  # 7: covered by the comment above the run
        "    x = 1\n"
        "    import peft  # optional: the lora extra\n"
        "    import safetensors  # only here\n",  # 10: no reason named
        encoding="utf-8",
    )
    assert [line.rsplit(":", 1)[0].rsplit(":", 1)[1] for line in _unexplained_imports(source)] == [
        "4",
        "10",
    ]
