"""How the suite shares two cores under pytest-xdist (``-n auto --dist loadgroup``).

Each test module is one unit of work (its module-scoped fixtures are built once, on one worker),
except the modules that start several ranks (torchrun, ``accelerate launch``,
``torch.multiprocessing`` spawns): a 2-rank job takes both cores, and two at once would each take
twice as long and crowd their timeouts. Those modules are one group, :data:`RANKS_GROUP`, which
one worker runs first, one test after another, while the other worker runs the rest.

A module is in the group when its code (comments and docstrings aside), or the code of a helper
module of the tests it imports, names a launch (:data:`LAUNCHES`): a new test file that launches
torchrun is grouped without anyone listing it. ``tests/conftest.py`` also fails a test outside
the group that starts torchrun anyway (through something the scan did not read).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any

import pytest

RANKS_GROUP = "ranks"
# what starts several ranks, as the tests' sources name it
LAUNCHES = re.compile(
    r"torch\.distributed\.run|\btorchrun\b|['\"]accelerate['\"],\s*['\"]launch['\"]|"
    r"torch\.multiprocessing|\bmp\.spawn\b|\bstart_processes\b"
)
SCANNER = Path(__file__).resolve()
TESTS = SCANNER.parent
# where the tests import their helpers from (pytest puts the test folders on sys.path; the
# bench folder is in pyproject's pythonpath)
HELPER_ROOTS = (TESTS, TESTS / "e2e", TESTS.parent / "bench")


def launches_ranks(args: Any) -> bool:
    """Whether a ``subprocess.Popen`` command line starts several ranks."""
    words = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    names = [Path(w).name for w in words]
    return (
        "torch.distributed.run" in words
        or "torchrun" in names
        or ("accelerate" in names and "launch" in words)
    )


@functools.cache
def _starts_ranks(path: Path) -> bool:
    """Whether the module at ``path``, or a helper module of the tests it imports, names a
    launch of several ranks."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if LAUNCHES.search(_code(tree)):
        return True
    for name in _imported(tree):
        for root in (path.parent, *HELPER_ROOTS):
            helper = root / (name.replace(".", "/") + ".py")
            # (this module names the launches it looks for, and starts none)
            if helper.is_file() and helper.resolve() not in (path.resolve(), SCANNER):
                if _starts_ranks(helper.resolve()):
                    return True
                break
    return False


def _code(tree: ast.Module) -> str:
    """The module's code without its comments and docstrings (prose may name a launch)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def _imported(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def order_for_workers(items: list[pytest.Item]) -> None:
    """Mark each item with its unit of work (the ranks group or its module) and put the ranks
    group first: it is the longest unit, so it starts at once on one worker."""
    grouped: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    for item in items:
        path = Path(str(item.path)).resolve()
        if _starts_ranks(path):
            item.add_marker(pytest.mark.xdist_group(RANKS_GROUP))
            grouped.append(item)
        else:
            item.add_marker(pytest.mark.xdist_group(str(path.relative_to(TESTS.parent))))
            rest.append(item)
    items[:] = grouped + rest
