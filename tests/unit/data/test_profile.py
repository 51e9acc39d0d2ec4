"""The data profile: token lengths by hand on a tiny WordPiece tokenizer, the ``memfit data
profile`` JSON contract, every input kind memfit reads, and ``memfit plan --train-file`` taking its
sequence length from the data."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from memfit.cli import main
from memfit.config import load_config
from memfit.plan.data_profile import DataProfile

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog"]
# [CLS] … [SEP]: each text is its words plus 2 special tokens
TEXTS = ["the cat", "the cat sat on the mat", "a dog", "the"]
LENGTHS = [4, 8, 4, 3]  # sum 19


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, bert_tokenizer: Any) -> str:
    """A WordPiece tokenizer (one token per word) next to a tiny BERT config with 16 positions."""
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


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in TEXTS])


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == 2 and out == ""
    assert err.startswith("memfit: error: ") and err.count("\n") == 1
    for needle in needles:
        assert needle in err


# --- numbers by hand -----------------------------------------------------------------------------
def test_lengths_and_shares_by_hand(tokenizer_dir: str, data_file: Path) -> None:
    profile = DataProfile.from_file(data_file, ["text"], tokenizer_dir, flag="FILE")
    assert profile.lengths.tolist() == LENGTHS
    assert profile.rows == 4 and profile.max_length == 8
    # numpy's linear percentile of [3, 4, 4, 8]: p90 at index 2.7 = 6.8 → 7; p99 at 2.97 = 7.88 → 8
    assert [profile.percentile(q) for q in (50, 90, 99)] == [4, 7, 8]
    # truncating to 4 cuts the 4 tokens over 4 of the 8-token row: 4 / 19
    assert profile.truncated_token_share(4) == pytest.approx(4 / 19)
    assert profile.truncated_token_share(None) == 0.0
    assert profile.truncated_token_share(8) == 0.0
    # padded to 4: real tokens 4 + 4 + 4 + 3 = 15 of 16; to the max 8: 19 of 32
    assert profile.padding_share_fixed(4) == pytest.approx(1 / 16)
    assert profile.padding_share_fixed() == pytest.approx(13 / 32)
    assert profile.samples_truncated(4) == pytest.approx(1 / 4)
    # the planner's view: of the tokens a run at 8 sees (19), truncation to 4 cuts 4
    assert profile.tokens_lost(4, 8) == pytest.approx(4 / 19)


def test_to_dict_contract(tokenizer_dir: str, data_file: Path) -> None:
    profile = DataProfile.from_file(data_file, ["text"], tokenizer_dir)
    d = profile.to_dict(max_seq_len=4)
    assert d["rows"] == 4
    assert d["tokens"] == {"p50": 4, "p90": 7, "p99": 8, "max": 8, "mean": 4.75}
    assert d["truncated_token_share"] == pytest.approx(4 / 19, abs=1e-6)
    assert d["padding_share_fixed"] == pytest.approx(1 / 16)
    assert d["max_seq_len"] == 4 and d["total_tokens"] == 19 and d["truncated_row_share"] == 0.25
    without = profile.to_dict()
    assert without["truncated_token_share"] == 0.0
    assert without["padding_share_fixed"] == pytest.approx(13 / 32)
    assert without["padded_len"] == 8


def test_sentence_pairs_count_the_longest_text(tokenizer_dir: str, tmp_path: Path) -> None:
    rows = [
        {"anchor": "the cat", "positive": "a dog sat on the mat"},  # 4 vs 8
        {"anchor": "the cat sat on the mat", "positive": "the"},  # 8 vs 3
        {"anchor": "a", "positive": "dog"},  # 3 vs 3
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    profile = DataProfile.from_file(path, ["anchor", "positive"], tokenizer_dir)
    assert profile.lengths.tolist() == [8, 8, 3]
    assert profile.text_columns == ("anchor", "positive")


def test_many_batches_keep_row_order(
    tokenizer_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import memfit.plan.data_profile as data_profile

    monkeypatch.setattr(data_profile, "TOKENIZE_BATCH", 3)
    texts = [" ".join(["cat"] * n) for n in range(1, 11)]
    path = write_jsonl(tmp_path / "many.jsonl", [{"text": t} for t in texts])
    profile = DataProfile.from_file(path, ["text"], tokenizer_dir)
    assert profile.lengths.tolist() == [n + 2 for n in range(1, 11)]


def test_bare_lengths_keep_the_planner_api() -> None:
    profile = DataProfile(tuple([20] * 90 + [120] * 10))
    assert len(profile.lengths) == 100 and profile.percentile(95) == 120
    assert profile.to_dict()["tokens"]["mean"] == 30.0
    with pytest.raises(Exception, match="no samples"):
        DataProfile(())


# --- the command line ------------------------------------------------------------------------------
def test_cli_json_keys_and_values(
    capsys: pytest.CaptureFixture[str], tokenizer_dir: str, data_file: Path
) -> None:
    code, out, err = run(
        capsys, "data", "profile", str(data_file), "--tokenizer", tokenizer_dir,
        "--max-seq-len", "4", "--json",
    )  # fmt: skip
    assert code == 0, err
    d = json.loads(out)
    assert {"rows", "tokens", "truncated_token_share", "padding_share_fixed"} <= set(d)
    assert set(d["tokens"]) == {"p50", "p90", "p99", "max", "mean"}
    assert d["rows"] == 4 and d["tokens"]["max"] == 8 and d["tokens"]["mean"] == 4.75
    assert d["truncated_token_share"] == pytest.approx(4 / 19, abs=1e-6)
    assert d["padding_share_fixed"] == pytest.approx(0.0625)
    assert d["source"] == str(data_file) and d["text_columns"] == ["text"]


def test_cli_model_folder_and_readable_table(
    capsys: pytest.CaptureFixture[str], tokenizer_dir: str, data_file: Path
) -> None:
    code, out, err = run(
        capsys, "data", "profile", str(data_file), "--model", tokenizer_dir, "--max-seq-len", "4"
    )
    assert code == 0, err
    assert "rows          4" in out
    assert "p50 4  p90 7  p99 8  max 8  mean 4.75" in out
    assert "cuts 21.05% of the tokens (1 row longer)" in out
    assert "padded to 4: 6.25% of a batch is padding" in out


def test_cli_registry_name_without_tokenizer_exits_2(
    capsys: pytest.CaptureFixture[str],
    data_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from huggingface_hub import constants

    # an empty Hugging Face cache: whatever this machine has cached does not count
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = run(capsys, "data", "profile", str(data_file), "--model", "bert-base-uncased")
    assert_one_line_error(code, out, err, "bert-base-uncased", "--tokenizer", "not a local folder")


def test_cli_model_folder_without_tokenizer_exits_2(
    capsys: pytest.CaptureFixture[str], data_file: Path, tiny_bert: str
) -> None:
    code, out, err = run(capsys, "data", "profile", str(data_file), "--model", tiny_bert)
    assert_one_line_error(code, out, err, tiny_bert, "no tokenizer files", "--tokenizer")


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["MISSING", "--tokenizer", "TOK"], ["FILE: ", "missing.jsonl: no such file or folder"]),
        (["DATA"], ["--tokenizer"]),  # neither --model nor --tokenizer
        (["DATA", "--tokenizer", "TOK", "--max-seq-len", "0"], ["--max-seq-len"]),
        (["DATA", "--tokenizer", "TOK", "--model", "TOK"], ["--model", "--tokenizer"]),
        (["DATA", "--tokenizer", "TOK", "--text-column", "body"], ["FILE: ", "line 1", "'body'"]),
    ],
)
def test_cli_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str],
    tokenizer_dir: str,
    data_file: Path,
    argv: list[str],
    needles: list[str],
) -> None:
    names = {"MISSING": str(data_file.with_name("missing.jsonl")), "DATA": str(data_file)}
    names["TOK"] = tokenizer_dir
    argv = [names.get(a, a) for a in argv]
    code, out, err = run(capsys, "data", "profile", *argv)
    assert code == 2 and out == ""
    assert err.startswith("memfit: error: ")
    for needle in needles:
        assert needle in err
    if "body" not in argv:
        assert err.count("\n") == 1


def test_bad_rows_are_refused_with_their_lines(
    capsys: pytest.CaptureFixture[str], tokenizer_dir: str, tmp_path: Path
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text('text\nthe cat\n""\nthe dog\n   \n')
    code, out, err = run(capsys, "data", "profile", str(path), "--tokenizer", tokenizer_dir)
    assert code == 2 and out == ""
    assert f"FILE: {path} line 3" in err and f"FILE: {path} line 5" in err
    assert "line 2" not in err and "line 4" not in err


# --- every input kind ------------------------------------------------------------------------------
def test_parquet_input(
    capsys: pytest.CaptureFixture[str], tokenizer_dir: str, tmp_path: Path
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"text": TEXTS, "label": [0, 1, 0, 1]}), path)
    code, out, err = run(
        capsys, "data", "profile", str(path), "--tokenizer", tokenizer_dir, "--json"
    )
    assert code == 0, err
    d = json.loads(out)
    assert d["rows"] == 4 and d["tokens"]["max"] == 8 and d["tokens"]["mean"] == 4.75
    assert d["padding_share_fixed"] == pytest.approx(13 / 32)


def test_folder_of_files_is_read_in_name_order(tokenizer_dir: str, tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.csv").write_text("text\nthe cat\nthe cat sat on the mat\n")
    with gzip.open(folder / "b.jsonl.gz", "wt") as handle:
        handle.write("".join(json.dumps({"text": t}) + "\n" for t in ["a dog", "the", "cat"]))
    profile = DataProfile.from_file(folder, ["text"], tokenizer_dir, flag="FILE")
    assert profile.lengths.tolist() == [*LENGTHS, 3]
    assert profile.to_dict()["rows"] == 5


def test_saved_dataset_dict_profiles_the_train_split(tokenizer_dir: str, tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    folder = tmp_path / "saved"
    DatasetDict(
        {
            "train": Dataset.from_dict({"text": TEXTS}),
            "validation": Dataset.from_dict({"text": ["the cat sat"]}),
        }
    ).save_to_disk(str(folder))
    profile = DataProfile.from_file(folder, ["text"], tokenizer_dir, flag="FILE")
    assert profile.lengths.tolist() == LENGTHS


# --- memfit plan --train-file ----------------------------------------------------------------------
PLAN = ["--task", "classification", "--effective-batch-size", "4", "--gpu-memory", "80GiB"]


def test_plan_takes_seq_len_from_the_data(
    capsys: pytest.CaptureFixture[str], tokenizer_dir: str, tmp_path: Path
) -> None:
    # 21 tokens at most: rounded up to 24, capped at the model's 16 positions
    texts = [" ".join(["cat"] * n) for n in (1, 5, 19)]
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": t} for t in texts])
    config = tmp_path / "run.yaml"
    code, out, err = run(
        capsys, "plan", tokenizer_dir, *PLAN, "--precision", "fp32", "--train-file", str(path),
        "--json", "--write-config", str(config),
    )  # fmt: skip
    assert code == 0, err
    d = json.loads(out)
    assert d["fits"] and d["plan"]["micro_batch_size"] == 4
    assert d["plan"]["max_tokens_per_micro_batch"] == 4 * 16
    first = d["explanation"][0]
    assert first.startswith("--seq-len 16: the longest sample")
    assert "has 21 tokens" in first and "capped at the model's 16 positions" in first
    loaded = load_config(config)
    assert loaded["seq_len"] == 16 and loaded["tokenizer"] == tokenizer_dir
    assert loaded["text_column"] == "text" and loaded["train_file"] == str(path)


def test_plan_rounds_the_longest_sample_up_to_8(
    capsys: pytest.CaptureFixture[str], tokenizer_dir: str, tmp_path: Path
) -> None:
    # 13 tokens at most: rounded up to 16 (the length of the test above: its traces are cached)
    texts = ["cat", " ".join(["cat"] * 11)]
    path = write_jsonl(tmp_path / "short.jsonl", [{"text": t} for t in texts])
    code, out, err = run(
        capsys, "plan", tokenizer_dir, *PLAN, "--precision", "fp32", "--train-file", str(path),
        "--json",
    )  # fmt: skip
    assert code == 0, err
    d = json.loads(out)
    assert d["plan"]["max_tokens_per_micro_batch"] == 4 * 16
    assert d["explanation"][0] == (
        f"--seq-len 16: the longest sample of {path} has 13 tokens (p99 13), "
        "rounded up to a multiple of 8"
    )


def test_plan_without_seq_len_or_train_file_exits_2(
    capsys: pytest.CaptureFixture[str], tiny_bert: str
) -> None:
    code, out, err = run(capsys, "plan", tiny_bert, *PLAN)
    assert_one_line_error(code, out, err, "--seq-len", "--train-file")


def test_plan_train_file_with_a_registry_name_needs_a_tokenizer(
    capsys: pytest.CaptureFixture[str],
    data_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, out, err = run(
        capsys, "plan", "distilbert-base-uncased", *PLAN, "--train-file", str(data_file)
    )
    assert_one_line_error(code, out, err, "--tokenizer", "distilbert-base-uncased")
