"""The README is the front page: at most 200 lines, the title and one sentence first, then the two
set-up commands (the demo's, on the `demo` extra only; CI's, as `.ci/run` runs it), links that
lead somewhere; and the docs site builds with `mkdocs build --strict` (no broken link or anchor)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DEMO = 'python -m pip install -c constraints/cpu.txt -e ".[demo]" && memfit demo'
TESTS = 'python -m pip install -c constraints/cpu.txt -e ".[dev,all]" && python -m pytest -q'


def _lines() -> list[str]:
    return README.read_text(encoding="utf-8").splitlines()


def test_the_readme_is_at_most_200_lines() -> None:
    assert len(_lines()) <= 200, len(_lines())


def test_the_title_and_a_sentence_then_exactly_the_two_set_up_commands() -> None:
    lines = _lines()
    assert lines[0] == "# memfit"
    opening = next(i for i, x in enumerate(lines) if x.startswith("```"))
    assert opening <= 6, "the set-up block comes within the README's first lines"
    before = [x for x in lines[1:opening] if x.strip()]
    assert len(before) == 1 and before[0].rstrip().endswith("."), before  # one sentence
    assert lines[opening] == "```bash"
    end = lines.index("```", opening + 1)
    assert lines[opening + 1 : end] == [DEMO, TESTS]


def test_the_second_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    install, tests = TESTS.split(" && ")
    assert install.replace("pip install", "pip install -q") in ci
    assert re.search(rf"^{re.escape(tests)}$", ci, re.M)


def test_every_relative_link_of_the_readme_leads_to_a_file() -> None:
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [x for x in links if "://" not in x]
    assert local, "the README links to the docs"
    missing = [x for x in local if not (ROOT / x).exists()]
    assert not missing, missing


@pytest.mark.slow
def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed (the dev extra installs them)")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "index.html").exists()
