"""Every command the README and the docs show is run by a test, or says that it is not.

A ```bash or ```console block of README.md, CONTRIBUTING.md or docs/*.md is a command block. Each
one is either marked ``<!-- not run -->`` on the line before it, or every command in it is one
that a test runs: this module runs the cheap ones itself (``RUN_HERE``) and checks that the output
the page shows for them is what they print; ``RUN_BY`` names the test that runs each of the others
(and a string of that test's file that shows it does). A block with neither fails.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli_run import run_cli

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "<!-- not run -->"
FENCE = re.compile(r"^```(\w*)\s*$")

# commands this module runs (in this process, as `memfit ARGV`), with the output their page shows
RUN_HERE = {
    "memfit models",
    "memfit gpus",
    "memfit estimate bert-base-uncased --task classification --batch-size 32 --seq-len 128 "
    "--gpu-memory 16GiB",
    'memfit doctor --message "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total '
    "capacity of 15.77 GiB of which 1.12 GiB is free. Of the allocated memory 13.90 GiB is "
    'allocated by PyTorch, and 310.00 MiB is reserved by PyTorch but unallocated." --model gpt2 '
    "--task causal-lm --batch-size 8 --seq-len 1024",
}
# the ones that trace a model (a few seconds cold): CI runs them, the quick loop does not
SLOW = {c for c in RUN_HERE if "--model" in c or c.startswith("memfit estimate")}

# commands another test runs: the test file, and a string of it that shows it runs that command
RUN_BY = {
    # memfit demo's training run (its estimate and plan are the commands of RUN_HERE and
    # test_demo's own); the install: .ci/run installs ".[dev,all]", a superset of ".[demo]", and
    # tests/unit/test_core_install.py checks that the demo extra holds what `memfit demo` imports
    'python -m pip install -c constraints/cpu.txt -e ".[demo]" && memfit demo': (
        "tests/e2e/test_demo.py",
        "demo_training()",
    ),
    # what CI runs
    'python -m pip install -c constraints/cpu.txt -e ".[dev,all]" && python -m pytest -q': (
        ".ci/run",
        'python -m pip install -q -c constraints/cpu.txt -e ".[dev,all]"',
    ),
    # the Trainer example under the cap the README names (the test reads it from the README)
    "MEMFIT_MEMORY_CAP=560MiB python examples/trainer_after.py": (
        "tests/e2e/test_trainer_example_cap.py",
        "MEMFIT_MEMORY_CAP=(\\S+) python examples/trainer_after\\.py",
    ),
    # TRL's example under its cap (the test checks docs/trl.md names the cap the docstring does)
    "MEMFIT_MEMORY_CAP=14MiB python examples/sft_after.py": (
        "tests/e2e/test_sft_example_cap.py",
        'f"MEMFIT_MEMORY_CAP={docstring_cap()} python examples/sft_after.py" in page',
    ),
    # docs/ui.md: the browser test serves the page with it (on a free --port, --no-open)
    "memfit ui": (
        "tests/e2e/test_ui_browser.py",
        '[sys.executable, "-m", "memfit", "ui", "--port", str(port), "--no-open"]',
    ),
    # docs/models.md's offline line: run, and its output compared, by the hub test
    "HF_HUB_OFFLINE=1 memfit estimate Qwen/Qwen3-8B --task causal-lm --batch-size 1 --seq-len 128 "
    "--gpu t4": (
        "tests/unit/models/test_hub_config.py",
        "HF_HUB_OFFLINE=1 memfit estimate Qwen/Qwen3-8B --task causal-lm --batch-size 1 --seq-len 128 ",
    ),
}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    kind: str
    marked: bool  # `<!-- not run -->` on the line before
    body: list[str]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)} line {self.line}"

    def commands(self) -> list[str]:
        """The commands of the block: a console block's `$ ` lines, a bash block's lines that are
        not comments (continued lines joined), each without its trailing comment."""
        if self.kind == "console":
            lines = [x[2:] for x in self.body if x.startswith("$ ")]
        else:
            lines = [x for x in self.body if x.strip() and not x.lstrip().startswith("#")]
        joined: list[str] = []
        for line in lines:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
            else:
                joined.append(line.strip())
        return [_without_comment(c) for c in joined]

    def output_of(self, command: str) -> list[str]:
        """A console block's lines between ``$ command`` and the next ``$ `` line."""
        out: list[str] | None = None
        for line in self.body:
            if line.startswith("$ "):
                if out is not None:
                    break
                if _without_comment(line[2:]) == command:
                    out = []
            elif out is not None:
                out.append(line)
        return out or []


def _without_comment(command: str) -> str:
    """``command`` without a trailing `` # …`` (a ``#`` inside quotes, or inside a word, is kept)."""
    quote = ""
    for i, ch in enumerate(command):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command.strip()


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if opening.group(1) in ("bash", "console"):
            found.append(
                Block(page, i + 1, opening.group(1), before.strip() == NOT_RUN, lines[i + 1 : end])
            )
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def _squeezed(text: str) -> str:
    return "".join(text.split())


def test_the_pages_have_command_blocks() -> None:
    # the walk finds the README's set-up block and the docs' blocks (a parser that finds nothing
    # would pass every check below)
    assert all(p.exists() for p in PAGES[:2])
    assert ALL[0].page.name == "README.md" and ALL[0].line < 10
    assert len({b.page for b in ALL}) >= 8


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_every_command_block_is_run_by_a_test_or_marked_not_run(block: Block) -> None:
    if block.marked:
        return
    commands = block.commands()
    assert commands, f"{block.where}: a command block without a command"
    unknown = [c for c in commands if c not in RUN_HERE and c not in RUN_BY]
    assert not unknown, (
        f"{block.where}: no test runs {unknown}: run it in a test (RUN_HERE, RUN_BY in "
        f"{Path(__file__).name}) or mark the block with {NOT_RUN} on the line before it"
    )


@pytest.mark.parametrize("command", sorted(RUN_BY))
def test_the_registered_tests_run_their_commands(command: str) -> None:
    path, needle = RUN_BY[command]
    assert needle in (ROOT / path).read_text(encoding="utf-8"), (command, path)
    # every registered command is still shown somewhere (a stale entry would vouch for nothing)
    assert any(command in b.commands() for b in ALL), command


def _run_here_params() -> list[object]:
    shown = {c for b in ALL if not b.marked for c in b.commands()}
    return [
        pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else [])
        for c in sorted(RUN_HERE)
        if c in shown
    ]


@pytest.mark.parametrize("command", _run_here_params())
def test_cheap_commands_print_what_the_pages_show(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = shlex.split(command)
    assert argv[0] == "memfit"
    code, out, err = run_cli(capsys, *argv[1:])
    assert code == 0, err
    real = _squeezed(out)
    for block in ALL:
        if block.marked or command not in block.commands() or block.kind != "console":
            continue
        # each shown line (an honest `…` stands for lines left out) is what the command prints
        for line in block.output_of(command):
            if line.strip() in ("", "…"):
                continue
            for part in line.split("…"):
                assert _squeezed(part) in real, (
                    f"{block.where}: `{command}` no longer prints\n{line}\nIt prints:\n{out}"
                )
