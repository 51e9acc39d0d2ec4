"""The suite's own scheduling (``tests/ranks_group.py``): a module that starts several ranks is
found without being listed, and a test outside the group that starts torchrun anyway fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import ranks_group
from ranks_group import RANKS_GROUP, launches_ranks

# the launchers' names, spelled so that this file's own source names no launch (it is no
# multi-rank module)
LAUNCHER = "torch." + "distributed" + ".run"
TORCHRUN = "torch" + "run"
SPAWN = "torch." + "multiprocessing"


def test_launch_commands_are_recognised() -> None:
    python = sys.executable
    assert launches_ranks([python, "-m", LAUNCHER, "--nproc_per_node=2", "-m", "memfit"])
    assert launches_ranks([f"/usr/bin/{TORCHRUN}", "--standalone", "script.py"])
    assert launches_ranks(["accelerate", "lau" + "nch", "--multi_gpu", "-m", "memfit"])
    assert launches_ranks(f"{python} -m {LAUNCHER} x.py")  # a shell string
    assert not launches_ranks([python, "-m", "memfit", "train", "--world-size", "2"])
    assert not launches_ranks(["accelerate", "env"])


def test_a_module_naming_a_launch_or_importing_a_helper_that_does_is_grouped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    helper = tmp_path / "launch_helper.py"
    helper.write_text(f"COMMAND = ['python', '-m', '{LAUNCHER}']\n")
    direct = tmp_path / "test_direct.py"
    direct.write_text(f"import subprocess\nsubprocess.run(['python', '-m', '{LAUNCHER}'])\n")
    spawns = tmp_path / "test_spawns.py"
    spawns.write_text(f"import {SPAWN} as mp\nmp.{'spawn'}(print, nprocs=2)\n")
    indirect = tmp_path / "test_indirect.py"
    indirect.write_text("from launch_helper import COMMAND\n")
    # helpers that import each other (and no launch): scanned once each
    (tmp_path / "helper_a.py").write_text("import helper_b\n")
    (tmp_path / "helper_b.py").write_text("import helper_a\n")
    circle = tmp_path / "test_circle.py"
    circle.write_text("import helper_a\n")
    accelerate = tmp_path / "test_accelerate.py"
    accelerate.write_text(f'COMMAND = ["accelerate", "{"lau" + "nch"}", "-m", "memfit"]\n')
    prose = tmp_path / "test_prose.py"
    prose.write_text(f'"""Like {TORCHRUN} would."""\n# {LAUNCHER}\nimport json\n')
    plain = tmp_path / "test_plain.py"
    plain.write_text("import subprocess\nimport json\nsubprocess.run(['python', '-V'])\n")
    monkeypatch.setattr(ranks_group, "HELPER_ROOTS", (tmp_path,))
    ranks_group._starts_ranks.cache_clear()
    try:
        assert ranks_group._starts_ranks(direct)
        assert ranks_group._starts_ranks(spawns)
        assert ranks_group._starts_ranks(indirect)  # through the helper it imports
        assert ranks_group._starts_ranks(accelerate)
        assert not ranks_group._starts_ranks(plain)
        assert not ranks_group._starts_ranks(circle)
        assert not ranks_group._starts_ranks(prose)  # a docstring or comment starts nothing
    finally:
        ranks_group._starts_ranks.cache_clear()


def test_the_suites_multi_rank_modules_are_one_unit_of_work_first(
    request: pytest.FixtureRequest,
) -> None:
    tests = Path(__file__).resolve().parents[1]
    for module in ("e2e/test_train_distributed.py", "unit/train/test_distributed.py"):
        assert ranks_group.in_group(tests / module), module
    assert not ranks_group.in_group(Path(__file__))
    assert not ranks_group.in_group(tests / "e2e" / "test_bad_data.py")
    # the session's order: the group's tests, then the others
    grouped = [ranks_group.in_group(item.path) for item in request.session.items]
    assert grouped == sorted(grouped, reverse=True)


def test_the_scheduler_makes_one_unit_of_the_group_and_one_of_each_module(
    request: pytest.FixtureRequest,
) -> None:
    root = request.config.rootpath
    unit = ranks_group.unit_of
    assert unit("tests/e2e/test_train_distributed.py::test_x[zero3]", root) == RANKS_GROUP
    assert unit("tests/unit/train/test_distributed.py::test_y", root) == RANKS_GROUP
    module = "tests/unit/test_ranks_group.py"
    assert unit(f"{module}::test_z[a::b]", root) == module


def test_a_launch_the_scan_did_not_see_fails_the_test() -> None:
    with pytest.raises(pytest.fail.Exception, match="starts several ranks"):
        subprocess.Popen([sys.executable, "-m", LAUNCHER, "--help"])
