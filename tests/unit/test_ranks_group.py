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
        assert not ranks_group._starts_ranks(prose)  # a docstring or comment starts nothing
    finally:
        ranks_group._starts_ranks.cache_clear()


def test_the_suites_multi_rank_modules_are_in_the_group(request: pytest.FixtureRequest) -> None:
    grouped = {
        Path(str(item.path)).name
        for item in request.session.items
        if RANKS_GROUP in [m.args[0] for m in item.iter_markers("xdist_group") if m.args]
    }
    # every module of this session that starts ranks (those selected in this run)
    selected = {Path(str(item.path)).name for item in request.session.items}
    for name in ("test_train_distributed.py", "test_distributed.py", "test_zero_reset.py"):
        assert (name in grouped) == (name in selected), name
    assert "test_ranks_group.py" not in grouped


def test_a_launch_the_scan_did_not_see_fails_the_test() -> None:
    with pytest.raises(pytest.fail.Exception, match="starts several ranks"):
        subprocess.Popen([sys.executable, "-m", LAUNCHER, "--help"])
