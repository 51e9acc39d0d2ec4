"""The help pages read as one program: every verb's whole first sentence in `memfit --help`,
arguments named as click names them (MODEL, [RUN_DIR]), every default shown one way
(``[default: …]``), and `memfit train`'s flags with the defaults the run really takes."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main

from memfit.cli import VERBS, _summary, app, first_sentence, main
from memfit.data.sources import FORMATS

# the docs page that lists the inputs memfit train reads
DATA_DOCS = Path(__file__).resolve().parents[2] / "docs" / "data.md"


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    try:
        main([*argv, "--help"])
    except SystemExit as exc:
        assert not exc.code
    return capsys.readouterr().out


def _squeezed(text: str) -> str:
    """``text`` without whitespace: the same words however the help wrapped them."""
    return "".join(text.split())


def _commands() -> Iterator[tuple[str, Any, Any]]:
    """(name, command, its click context) of every verb and every command of a group verb."""
    group = typer.main.get_command(app)
    root = group.make_context("memfit", ["--help"], resilient_parsing=True)
    pending = [(f"memfit {verb}", group.get_command(root, verb), root) for verb in VERBS]
    while pending:
        name, command, parent = pending.pop()
        ctx = command.make_context(name, [], parent=parent, resilient_parsing=True)
        yield name, command, ctx
        for sub in getattr(command, "commands", {}):
            pending.append((f"{name} {sub}", command.get_command(ctx, sub), ctx))


def _rows(listing: str) -> dict[str, str]:
    """Each command's text in a Commands listing, its wrapped lines joined."""
    rows: dict[str, list[str]] = {}
    for line in listing.split("Commands:\n", 1)[1].splitlines():
        first = re.match(r"  (\S+)\s+(.*)", line)
        if first is not None:
            rows[first[1]] = [first[2]]
        elif line.strip() and rows:
            rows[list(rows)[-1]].append(line.strip())
    return {verb: " ".join(lines) for verb, lines in rows.items()}


def test_memfit_help_shows_each_verbs_whole_first_sentence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = _rows(_help(capsys))
    assert list(rows) == list(VERBS)
    for verb in VERBS:
        sentence = first_sentence(_summary(verb))
        assert sentence.endswith(".") and "..." not in sentence
        assert _squeezed(rows[verb]) == _squeezed(sentence), verb


def test_first_sentence() -> None:
    assert first_sentence("Write DIR/report.html here. Then more.\n\nDetails.") == (
        "Write DIR/report.html here."
    )
    assert first_sentence("One line,\nwrapped (e.g. this) in two.\n\nMore.") == (
        "One line, wrapped (e.g. this) in two."
    )


def test_arguments_are_named_in_capitals() -> None:
    seen = 0
    for _name, command, ctx in _commands():
        usage = command.get_usage(ctx)
        assert "{" not in usage and "}" not in usage, usage
        for param in command.params:
            if param.param_type_name != "argument":
                continue
            seen += 1
            metavar = param.name.upper()
            assert param.metavar == metavar
            assert (metavar if param.required else f"[{metavar}]") in usage.split(), usage
    assert seen >= 6  # estimate, plan, report, doctor, predict, embed, train, data profile


def test_every_default_is_shown_one_way() -> None:
    options = 0
    for name, command, ctx in _commands():
        for param in command.params:
            record = param.get_help_record(ctx)
            if record is None or param.param_type_name != "option":
                continue
            options += 1
            text = " ".join(record[1].split())
            # a default is "[default: …]" at the end, never "(default 32)" in the text, and a
            # default described in words is not put in parentheses (click's own rendering)
            prose = re.sub(r"\s*\[default: [^\]]+\]$", "", text)
            assert "default" not in prose.lower(), (name, text)
            assert "[default: (" not in text, (name, text)
    assert options > 100


def test_train_help_shows_the_run_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from memfit.commands.train import FLAG_FIELDS
    from memfit.train.config import SHOWN_DEFAULTS

    text = _squeezed(_help(capsys, "train"))
    checked = 0
    for f in FLAG_FIELDS:
        if f.name in SHOWN_DEFAULTS or f.default in (None, dataclasses.MISSING):
            continue
        if isinstance(f.default, bool):
            continue
        flag = "--" + f.name.replace("_", "-")
        entry = text.split(f"{flag}<", 1)[1].split("]--", 1)[0] + "]"
        assert entry.endswith(_squeezed(f"[default: {f.default}]")), (flag, entry)
        checked += 1
    assert checked >= 10


def test_train_help_lists_every_input_format_the_docs_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = _squeezed(_help(capsys, "train"))
    entry = text.split("--train-file<str>", 1)[1].split("--eval-file", 1)[0]
    for suffix in (*FORMATS, ".gz", "folder", "save_to_disk"):
        assert suffix in entry, suffix
    # the docs' list of inputs: the same formats (CSV … Parquet, .gz, folders, save_to_disk)
    docs = " ".join(DATA_DOCS.read_text(encoding="utf-8").split())
    inputs = docs.split("**Inputs.**", 1)[1].split("**Labels.**", 1)[0]
    for named in ("CSV", "TSV", "JSON Lines", "JSON", "Parquet", ".gz", "folder", "save_to_disk"):
        assert named in inputs, named
