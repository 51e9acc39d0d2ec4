"""Padding-free packing's pieces: best fit decreasing (worked by hand), the position ids that keep
packed rows apart under transformers' rule, and ``memfit data profile --packing``'s figures on a
small file (worked by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.data.packing import best_fit_decreasing, packed_positions, packing_figures


def test_best_fit_decreasing_by_hand() -> None:
    # longest first: 6 opens a sequence (room 2), 5 another (room 3), 4 a third (room 4); 3 fits
    # the one with room 3 exactly, 2 the one with room 2, 1 the last (room 4)
    assert best_fit_decreasing([5, 3, 4, 2, 6, 1], 8) == [[4, 3], [0, 1], [2, 5]]
    # ties: the data's order, and among equally full sequences the one opened first
    assert best_fit_decreasing([4, 4, 2, 2], 6) == [[0, 2], [1, 3]]
    # a row of the whole budget fills a sequence of its own
    assert best_fit_decreasing([8, 1, 8], 8) == [[0], [2], [1]]
    assert best_fit_decreasing([], 8) == []
    with pytest.raises(ValueError, match="row 1 has 9 tokens"):
        best_fit_decreasing([2, 9], 8)


def test_positions_keep_the_rows_and_the_padding_apart() -> None:
    from transformers.masking_utils import find_packed_sequence_indices

    assert packed_positions([3, 2], 7) == [0, 1, 2, 0, 1, 0, 1]
    # transformers starts a row wherever a position is not its predecessor's plus one: the
    # padding is a row of its own, even after a row of one token
    cases = [([3, 2], 7, [0, 0, 0, 1, 1, 2, 2]), ([1], 3, [0, 1, 1]), ([2, 1, 1], 4, [0, 0, 1, 2])]
    for lengths, width, rows in cases:
        positions = torch.tensor([packed_positions(lengths, width)])
        assert find_packed_sequence_indices(positions)[0].tolist() == rows


def test_packing_figures_by_hand() -> None:
    # lengths 8, 5, 5, 8, 5, 4 into 12: [8, 4], [8], [5, 5], [5]
    figures = packing_figures([8, 5, 5, 8, 5, 4], 12)
    assert (figures.rows, figures.sequences, figures.tokens) == (6, 4, 35)
    assert figures.rows_per_sequence == 1.5
    assert figures.padding_share == pytest.approx(13 / 48)  # 4 × 12 - 35 padding tokens
    assert figures.padded_share == pytest.approx(37 / 72)  # 6 × 12 - 35
    assert figures.padding_removed == pytest.approx(1 - 13 / 37)
    # rows longer than the budget are counted truncated, as memfit train truncates them
    assert packing_figures([20, 4], 12).tokens == 16


def test_data_profile_packing_on_a_small_file(
    bert_tokenizer: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memfit.cli import main

    texts = [
        "the cat sat on the mat",
        "the dog ran",
        "a good movie",
        "how do i reset my password",
        "steps to update",
        "the cat",
    ]
    (tmp_path / "tok").mkdir()
    bert_tokenizer(tmp_path / "tok", sorted({w for t in texts for w in t.split()}))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")

    def run(*flags: str) -> tuple[int, str, str]:
        try:
            main(["data", "profile", str(data), "--tokenizer", str(tmp_path / "tok"), *flags])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = run("--max-seq-len", "12", "--packing", "--json")
    assert code == 0
    report = json.loads(out)
    # one token a word, [CLS] and [SEP]: 8, 5, 5, 8, 5, 4 tokens, packed as in the test above
    assert report["total_tokens"] == 35
    assert report["packing"] == {
        "strategy": "bfd",
        "budget": 12,
        "sequences": 4,
        "rows_per_sequence": 1.5,
        "padding_share": round(13 / 48, 6),
        "padding_removed": round(1 - 13 / 37, 6),
        "padding_removed_against": "max_length",
    }
    code, out, _ = run("--max-seq-len", "12", "--packing")
    assert code == 0
    # 48 - 35 = 13 of the 4 × 12 packed tokens are padding; 72 - 35 = 37 of 6 rows × 12; the
    # default padding (each micro-batch to its longest row) is no baseline given as a number:
    # it depends on the micro-batch size and the order, at micro-batch 1 it pads nothing
    assert out.splitlines()[-1] == (
        "packing       bfd into sequences of 12 tokens: 1.50 rows per sequence (6 rows in 4); "
        "27.08% of them is padding. Unpacked, with every row padded to 12 (--padding "
        "max_length), 51.39% is padding, 64.86% of which packing removes; memfit train's "
        "default (--padding longest) pads each micro-batch only to its longest row, less than "
        "that (none at micro-batch 1), by how much depends on the micro-batch size and the "
        "order (--group-by-length), so the gain over it is smaller"
    )
    assert "with every row padded to 12: 64.86% of the padding removed" not in out
    code, _, err = run("--packing")
    assert code == 2
    assert [x for x in err.splitlines() if x.startswith("memfit:")] == [
        "memfit: error: --packing: give --max-seq-len, the tokens of a packed sequence "
        "(memfit train's)"
    ]
