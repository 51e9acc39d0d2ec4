"""``memfit plan --train-file`` reads a sentence-embedding file as ``memfit train`` does: its
(anchor, positive) pairs, each counting its longer text; a column missing from every row is one
line, not one per row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli_run import run_cli
from memfit.data.columns import text_columns
from memfit.data.rows import SHOWN_PROBLEMS, DataError
from memfit.errors import UsageError
from memfit.plan.data_profile import DataProfile

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog"]
# [CLS] … [SEP]: each text is its words plus 2 special tokens; a pair counts its longer text
PAIRS = [("the cat", "a dog sat"), ("the cat sat on the mat", "a cat"), ("a", "the")]
LONGEST = [5, 8, 3]
ROWS = SHOWN_PROBLEMS + 10  # more rows than a refusal lists


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, bert_tokenizer: Any) -> str:
    """A WordPiece tokenizer (one token per word) next to a tiny BERT config: a model folder."""
    from transformers import BertConfig

    folder = tmp_path_factory.mktemp("tok")
    bert_tokenizer(folder, WORDS)
    BertConfig(
        vocab_size=len(WORDS) + 5,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    ).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def pairs_file(tmp_path: Path) -> Path:
    path = tmp_path / "pairs.jsonl"
    rows = [{"anchor": a, "positive": p} for a, p in PAIRS]
    rows += [{"anchor": "a cat", "positive": "a dog"}] * (ROWS - len(PAIRS))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_task_reads_the_columns_train_reads() -> None:
    assert text_columns("sentence-embedding") == ["anchor", "positive"]
    assert text_columns("sentence-embedding", anchor_column="q", positive_column="d") == ["q", "d"]
    assert text_columns("causal-lm") == ["text"]
    assert text_columns("classification", text_column="s1", text_pair_column="s2") == ["s1", "s2"]


def _profile_handed_to_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner replaced by one that refuses, naming the profile it was handed (the test
    is of what the command reads, not of the plan)."""
    import memfit.plan

    def plan(model: str, *, data_profile: DataProfile, **knobs: Any) -> None:
        columns = ",".join(data_profile.text_columns)
        lengths = ",".join(str(n) for n in data_profile.lengths[: len(PAIRS)])
        raise UsageError(f"profiled {columns}: {lengths} ({data_profile.rows} rows)")

    monkeypatch.setattr(memfit.plan, "plan", plan)


def test_plan_reads_sentence_pairs_as_train_does(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tokenizer_dir: str,
    pairs_file: Path,
) -> None:
    _profile_handed_to_plan(monkeypatch)
    code, _, err = run_cli(
        capsys, "plan", tokenizer_dir, "--task", "sentence-embedding", "--train-file",
        str(pairs_file), "--tokenizer", tokenizer_dir, "--effective-batch-size", "4",
        "--gpu-memory", "1GiB",
    )  # fmt: skip
    assert code == 2, err
    longest = ",".join(str(n) for n in LONGEST)
    assert f"profiled anchor,positive: {longest} ({ROWS} rows)" in err


def test_a_missing_column_is_one_line_not_one_per_row(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tokenizer_dir: str,
    pairs_file: Path,
) -> None:
    with pytest.raises(DataError) as caught:
        DataProfile.from_file(pairs_file, ["text"], tokenizer_dir)
    message = str(caught.value)
    assert message.count("\n") == 0, message
    assert f"line 1 and {ROWS - 1} more lines: no column 'text'" in message
    # the CLI, naming the column that is not there
    _profile_handed_to_plan(monkeypatch)
    code, out, err = run_cli(
        capsys, "plan", tokenizer_dir, "--task", "sentence-embedding", "--train-file",
        str(pairs_file), "--tokenizer", tokenizer_dir, "--text-column", "text",
        "--effective-batch-size", "4", "--gpu-memory", "1GiB",
    )  # fmt: skip
    assert code == 2 and out == ""
    assert err.count("no column 'text'") == 1, err
    assert err.startswith("memfit: error: --train-file: ") and err.count("\n") == 1


def test_a_few_rows_keep_a_line_each_in_order() -> None:
    from memfit.data.rows import SAME_REASON_LINES, Problem

    few = SAME_REASON_LINES
    problems = [Problem("--train-file", "x.jsonl", n, "column 'text' is empty") for n in range(few)]
    problems.insert(1, Problem("--train-file", "x.jsonl", 9, "no column 'text'"))
    assert str(DataError(problems)).splitlines() == [str(p) for p in problems]
    many = [Problem("--train-file", "y.jsonl", n, "column 'text' is empty") for n in range(few + 1)]
    assert str(DataError([*problems, *many])).splitlines() == [
        *(str(p) for p in problems),
        f"--train-file: y.jsonl line 0 and {few} more lines: column 'text' is empty",
    ]


# a causal LM's plan tries both losses (cross-entropy lever): over 10 s here
@pytest.mark.slow
def test_the_text_column_named_without_a_file_plans_as_before(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--text-column text`` is the default column: without ``--train-file`` it asks for nothing
    to be read, so the plan runs (it did before the columns followed the task); another column
    without a file is still refused."""
    job = ("gpt2", "--task", "causal-lm", "--seq-len", "64", "--effective-batch-size", "8")
    job += ("--gpu-memory", "4GiB")
    code, _, err = run_cli(capsys, "plan", *job, "--text-column", "text")
    assert code == 0, err
    code, _, err = run_cli(capsys, "plan", *job, "--text-column", "body")
    assert code == 2 and "--text-column and --tokenizer describe --train-file" in err
