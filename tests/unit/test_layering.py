"""The packages' layering, read from the source: what each may import (also inside functions).

``memfit.job`` (the vocabulary), ``errors``, ``units``, ``paths`` and ``runtime`` are the floor;
``estimate`` models a step and must not reach up into what uses it (``plan``, ``train``,
``infer``, ...); ``infer`` runs saved models and must not need ``train``. A private name (leading
underscore) stays inside its package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "memfit"

# what every package may import: the floor (no memfit package of its own but these)
FLOOR = {
    "errors", "units", "paths", "progress", "_callable_module", "job", "runtime", "metrics", "extras",
}  # fmt: skip
# package (or top-level module) → the memfit packages it may import besides the floor; the
# README's package map says the same. The CLI's verbs (commands, cli, the package's own
# __init__ and __main__) stand on everything.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "job": set(),
    "runtime": set(),
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
