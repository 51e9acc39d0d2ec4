"""Token-budget chunks and the length-grouped order: exact by construction, checked by hand."""

from __future__ import annotations

import pytest

from memfit.data.batching import (
    length_grouped_order,
    padded_tokens,
    padded_width,
    split_into_chunks,
)


def test_padded_width_and_tokens() -> None:
    assert padded_width(13, 8) == 16 and padded_width(16, 8) == 16 and padded_width(13, 1) == 13
    assert padded_tokens([3, 13, 5], 8) == 3 * 16
    assert padded_tokens([], 8) == 0


def test_rows_only_sorts_longest_first_and_keeps_every_row_once() -> None:
    lengths = [5, 40, 7, 40, 1, 12]
    chunks = split_into_chunks(lengths, max_rows=2)
    assert chunks == [[1, 3], [5, 2], [0, 4]]  # stable among the two 40s
    assert sorted(i for c in chunks for i in c) == list(range(6))


def test_token_budget_packs_short_rows_many_and_long_rows_few() -> None:
    lengths = [100, 10, 12, 9, 11, 95, 10, 8]
    chunks = split_into_chunks(lengths, max_rows=8, max_tokens=200)
    widths = [max(lengths[i] for i in c) for c in chunks]
    assert chunks[0] == [0, 5]  # 2 × 100 = 200 tokens: the budget exactly
    assert all(len(c) * w <= 200 for c, w in zip(chunks, widths, strict=True))
    assert len(chunks) == 2 and len(chunks[1]) == 6  # the six short rows share one chunk
    # against fixed padding to 100: 800 tokens fed, here 200 + 6 × 12
    fed = sum(len(c) * w for c, w in zip(chunks, widths, strict=True))
    assert fed == 200 + 72


def test_a_row_over_the_budget_goes_alone_and_the_multiple_counts() -> None:
    chunks = split_into_chunks([300, 20, 20], max_rows=4, max_tokens=64, pad_multiple=8)
    assert chunks == [[0], [1, 2]]  # 2 × 24 = 48 ≤ 64
    # 3 × 24 = 72 > 64: two micro-batches, however the three are shared out
    chunks = split_into_chunks([20, 20, 20], max_rows=4, max_tokens=64, pad_multiple=8)
    assert sorted(len(c) for c in chunks) == [1, 2]


def test_the_cut_is_the_fewest_micro_batches_then_the_least_padding() -> None:
    # a greedy cut fills the first micro-batch with the 512 and seven short rows padded to it
    lengths = [512, 150, 100] + [60] * 29
    chunks = split_into_chunks(lengths, max_rows=32, max_tokens=4096)
    fed = sum(len(c) * max(lengths[i] for i in c) for c in chunks)
    assert len(chunks) == 2
    assert chunks[0] == [0, 1, 2] and fed == 3 * 512 + 29 * 60
    greedy = 8 * 512 + 24 * 60
    assert fed < greedy
    # without a token budget: ceil(7 / 3) = 3 micro-batches, the long rows kept together
    lengths = [30, 1, 29, 2, 28, 3, 4]
    chunks = split_into_chunks(lengths, max_rows=3)
    assert [sorted(lengths[i] for i in c) for c in chunks] == [[28, 29, 30], [3, 4], [1, 2]]


def test_max_rows_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_rows"):
        split_into_chunks([1], max_rows=0)


def test_length_grouped_order_is_a_deterministic_permutation_of_similar_lengths() -> None:
    lengths = [(i * 37) % 101 + 1 for i in range(1000)]
    order = length_grouped_order(lengths, 10, seed=1, epoch=0)
    assert sorted(order) == list(range(1000))
    assert order == length_grouped_order(lengths, 10, seed=1, epoch=0)  # resumable
    assert order != length_grouped_order(lengths, 10, seed=1, epoch=1)
    # steps hold similar lengths: padding to each step's longest wastes far less than random steps
    import random

    def waste(o: list[int]) -> int:
        steps = [o[s : s + 10] for s in range(0, len(o), 10)]
        return sum(
            padded_tokens([lengths[i] for i in st]) - sum(lengths[i] for i in st) for st in steps
        )

    shuffled = list(range(1000))
    random.Random(0).shuffle(shuffled)
    assert waste(order) < waste(shuffled) / 5
