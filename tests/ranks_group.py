"""How the suite shares two cores under pytest-xdist (``-n auto``; the scheduler is this module's).

Each test module is one unit of work (its module-scoped fixtures are built once, on one worker),
except the modules that start several ranks (torchrun, ``accelerate launch``,
``torch.multiprocessing`` spawns): a 2-rank job takes both cores, and two at once would each take
twice as long and crowd their timeouts. Those modules are one unit, :data:`RANKS_GROUP`, which
one worker runs first, one test after another, while the other worker runs the rest
(:func:`make_scheduler`).

A module is in the group when its code (comments and docstrings aside), or the code of a helper
module of the tests it imports, names a launch (:data:`LAUNCHES`): a new test file that launches
torchrun is grouped without anyone listing it. ``tests/conftest.py`` also fails a test outside
the group that starts torchrun anyway (through something the scan did not read).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re
import subprocess
from collections.abc import Iterator
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


_SCANNING: set[Path] = set()  # the modules being scanned (helpers that import each other)


@functools.cache
def _starts_ranks(path: Path) -> bool:
    """Whether the module at ``path``, or a helper module of the tests it imports, names a
    launch of several ranks."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if LAUNCHES.search(_code(tree)):
        return True
    _SCANNING.add(path)
    try:
        for name in _imported(tree):
            for root in (path.parent, *HELPER_ROOTS):
                helper = (root / (name.replace(".", "/") + ".py")).resolve()
                if not helper.is_file():
                    continue
                # (this module names the launches it looks for, and starts none)
                if helper not in _SCANNING and helper != SCANNER and _starts_ranks(helper):
                    return True
                break
    finally:
        _SCANNING.discard(path)
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


def in_group(path: Path | str) -> bool:
    """Whether the test module at ``path`` is in the ranks group."""
    module = Path(path).resolve()
    return module.suffix == ".py" and module.is_file() and _starts_ranks(module)


def order_for_workers(items: list[pytest.Item]) -> None:
    """Put the ranks group first: it is the longest unit of work, so one worker starts it at
    once (the others take the modules in their order)."""
    items.sort(key=lambda item: not in_group(item.path))  # stable: each part keeps its order


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduler for this suite: one unit of work per module, and one for every
    module of the ranks group together. (Not xdist's ``xdist_group`` marks: pytest-xdist 3.8
    groups by setting each test's ``_nodeid``, which pytest 9.2 no longer reads, its node ids
    come from ``_id``: there every ``--dist loadgroup`` test ran on any worker.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndRanks(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid, config.rootpath)

    return ModulesAndRanks(config, log)


def unit_of(nodeid: str, root: Path) -> str:
    """The unit of work of the test ``nodeid`` (relative to ``root``): the ranks group, or its
    module."""
    module = nodeid.split("::", 1)[0]
    return RANKS_GROUP if in_group(root / module) else module


# --- the safety net: a launch the scan missed ----------------------------------------------------
_RUNNING: list[pytest.Item] = []


@contextlib.contextmanager
def running(item: pytest.Item) -> Iterator[None]:
    """``item`` is the test running (its fixtures included) until the block ends."""
    _RUNNING.append(item)
    try:
        yield
    finally:
        _RUNNING.remove(item)


def guard_launches() -> None:
    """From now on, a test outside the ranks group (or a fixture it set up) that starts torchrun
    or ``accelerate launch`` fails, saying so. Processes started outside a test are not checked."""
    start = subprocess.Popen.__init__
    if getattr(start, "checks_rank_launches", False):
        return

    def checked(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        if _RUNNING and not in_group(_RUNNING[-1].path) and launches_ranks(args):
            pytest.fail(
                f"{_RUNNING[-1].nodeid} starts several ranks ({args!r}), but its module is not "
                "in the ranks group: tests/ranks_group.py finds a module by the launch commands "
                "its code (or a helper module of the tests it imports) names"
            )
        start(self, args, *rest, **kwargs)

    checked.checks_rank_launches = True  # type: ignore[attr-defined]
    subprocess.Popen.__init__ = checked  # type: ignore[method-assign]
