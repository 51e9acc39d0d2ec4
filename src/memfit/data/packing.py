"""Padding-free packing: rows packed whole into sequences of at most a token budget, best fit
decreasing (TRL's ``packing_strategy="bfd"``), and what it saves.

:func:`best_fit_decreasing` decides which rows share a sequence: the rows longest first (ties in
the data's order), each into the fullest sequence it still fits in (the one with the least room
left that is enough; ties: the sequence opened first), a new sequence when none has room. It is
a pure function of the lengths and the budget, so a resumed run packs the same sequences. A row
is never split: rows are truncated to the budget before they are packed (as unpacked rows are to
``--max-seq-len``), so each fits a sequence of its own.

:func:`packed_positions` gives the position ids of a packed sequence: each row's restart at 0,
and the padding after the last row, if any, counts from 0 again. transformers
(``masking_utils.find_packed_sequence_indices``) starts a new row wherever a position is not its
predecessor's plus one, so the padding is a row of its own and attends to no real row (the real
rows' outputs are those of the rows unpacked); flash attention's variable-length path takes the
rows' boundaries from the positions that are 0 (``prepare_fa_kwargs_from_position_ids``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


def best_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices into ``lengths``, packed into sequences of at most ``budget`` tokens each (every
    length must be in 1..budget), best fit decreasing: each sequence's rows longest first, the
    sequences in the order they were opened. Deterministic (ties keep the data's order)."""
    if budget < 1:
        raise ValueError(f"budget must be at least 1 token, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    # the open sequences by room left: room -> a heap of their numbers (oldest first)
    by_room: list[list[int]] = [[] for _ in range(budget + 1)]
    # a segment tree over rooms 0..budget (leaves at ``size + room``): whether some sequence has
    # that much room, so that the least room ≥ a length is found in O(log budget)
    size = 1
    while size < budget + 1:
        size *= 2
    present = [False] * (2 * size)

    def mark(room: int, on: bool) -> None:
        node = size + room
        present[node] = on
        node //= 2
        while node and present[node] != (present[2 * node] or present[2 * node + 1]):
            present[node] = not present[node]
            node //= 2

    def least_room_at_least(length: int) -> int | None:
        node = size + length
        if present[node]:
            return length
        # up until a right sibling holds a room (every leaf right of ``node`` is larger) ...
        while node > 1:
            if node % 2 == 0 and present[node + 1]:
                node += 1
                break
            node //= 2
        else:
            return None
        # ... then down to its leftmost room
        while node < size:
            node = 2 * node if present[2 * node] else 2 * node + 1
        return node - size

    for i in order:
        length = int(lengths[i])
        if not 1 <= length <= budget:
            raise ValueError(f"row {i} has {length} tokens, not 1 to {budget}")
        room = least_room_at_least(length)
        if room is None:
            number, room = len(bins), budget
            bins.append([])
        else:
            number = heapq.heappop(by_room[room])
            if not by_room[room]:
                mark(room, False)
        bins[number].append(i)
        left = room - length
        if left > 0:
            heapq.heappush(by_room[left], number)
            mark(left, True)
    return bins


def packed_positions(lengths: Sequence[int], width: int) -> list[int]:
    """The position ids of a packed sequence of rows of ``lengths`` fed ``width`` tokens wide:
    ``0..n-1`` per row, then ``0..`` again over the padding (a row of its own, see the module's
    docstring)."""
    positions = [p for n in lengths for p in range(int(n))]
    return positions + list(range(width - len(positions)))


@dataclass(frozen=True)
class PackingFigures:
    """What packing rows of these lengths into sequences of ``budget`` tokens gives, against
    padding every row to ``budget`` (rows truncated to it either way)."""

    rows: int
    sequences: int
    budget: int
    tokens: int  # the rows' tokens, truncated to the budget

    @property
    def rows_per_sequence(self) -> float:
        return self.rows / self.sequences

    @property
    def padding_share(self) -> float:
        """Share of the packed sequences' ``sequences × budget`` tokens that is padding."""
        return 1.0 - self.tokens / (self.sequences * self.budget)

    @property
    def padded_share(self) -> float:
        """Share of ``rows × budget`` tokens that is padding, each row padded to the budget."""
        return 1.0 - self.tokens / (self.rows * self.budget)

    @property
    def padding_removed(self) -> float:
        """Share of the padding of rows padded to the budget that packing removes."""
        padded = self.rows * self.budget - self.tokens
        packed = self.sequences * self.budget - self.tokens
        return 1.0 if padded == 0 and packed == 0 else 1.0 - packed / padded

    def summary_line(self) -> str:
        """What ``memfit data profile --packing`` prints."""
        return (
            f"packing       bfd into sequences of {self.budget} tokens: "
            f"{self.rows_per_sequence:.2f} rows per sequence ({self.rows:,} rows in "
            f"{self.sequences:,}); {self.padding_share:.2%} of them is padding, against "
            f"{self.padded_share:.2%} with every row padded to {self.budget}: "
            f"{self.padding_removed:.2%} of the padding removed"
        )

    def plan_line(self, micro_batch_size: int | None) -> str:
        """What ``memfit plan --train-file --packing`` says of the packed steps."""
        rows = f"{self.rows_per_sequence:.2f} rows per sequence"
        if micro_batch_size:
            rows += (
                f", {self.rows_per_sequence * micro_batch_size:.1f} per micro-batch of "
                f"{micro_batch_size}"
            )
        return (
            f"Packing (bfd): sequences of {self.budget} tokens hold {rows} on average; "
            f"{self.padding_share:.1%} of their tokens is padding, against "
            f"{self.padded_share:.1%} with every row padded to {self.budget} "
            f"({self.padding_removed:.1%} of that padding removed; without packing memfit train "
            "pads each micro-batch to its longest row, which pads less)."
        )

    def to_dict(self) -> dict[str, float | int]:
        return {
            "budget": self.budget,
            "sequences": self.sequences,
            "rows_per_sequence": round(self.rows_per_sequence, 4),
            "padding_share": round(self.padding_share, 6),
            "padding_removed": round(self.padding_removed, 6),
        }


def packing_figures(lengths: Sequence[int], budget: int) -> PackingFigures:
    """:class:`PackingFigures` of ``lengths`` (rows of 0 tokens left out) packed into ``budget``."""
    kept = [min(int(n), budget) for n in lengths if int(n) > 0]
    sequences = len(best_fit_decreasing(kept, budget)) if kept else 0
    return PackingFigures(
        rows=len(kept), sequences=max(sequences, 1), budget=budget, tokens=sum(kept)
    )
