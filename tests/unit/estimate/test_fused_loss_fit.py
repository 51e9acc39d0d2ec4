"""The fused-linear loss's trace fits every shape: its chunks run as three slots whatever the rows
(``memfit.step.linear_ce.declared_chunks``), each allocation sized by a formula of the rows, so a
new (batch size, sequence length) is a replay of the fit, not a trace of its own; and the fit
says what an exact trace of that very shape says, byte for byte, and what a trace of every chunk
of the loop says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from memfit.step import linear_ce

LM = {"task": "causal-lm", "cross_entropy": "fused-linear"}


def _chunk_rows_of_the_loop(rows: int, vocab: int, hidden: int) -> list[int]:
    chunk = linear_ce.chunk_rows(rows, vocab, hidden)
    return [min(start + chunk, rows) - start for start in range(0, rows, chunk)]


@pytest.mark.parametrize(("vocab", "hidden"), [(64, 64), (100, 64), (200, 64), (2048, 64)])
def test_the_slots_are_the_first_the_second_and_the_last_chunk(vocab: int, hidden: int) -> None:
    # (1, 2, 4 and 32 rows of the head per hidden row: one chunk only, two, and many)
    counts = set()
    for rows in range(1, 600):
        chunks = _chunk_rows_of_the_loop(rows, vocab, hidden)
        counts.add(min(len(chunks), 4))
        slots = [linear_ce._slot_rows(rows, vocab, hidden, slot) for slot in range(3)]
        expected = [*chunks[:2], chunks[-1] if len(chunks) >= 3 else 0]
        assert slots == expected + [0] * (3 - len(expected)), rows
        # the declared bytes: a row's tensor follows the slot's rows, the head's is there or not
        assert linear_ce.slot_bytes(rows, vocab, hidden, 2, 4, 1, vocab) == 4 * slots[2] * vocab
        head = linear_ce.slot_bytes(rows, vocab, hidden, 1, 2, 0, vocab, hidden)
        assert head == (2 * vocab * hidden if slots[1] else 0)
    assert counts == ({1} if vocab <= hidden else {1, 2} if vocab <= 2 * hidden else {1, 2, 3, 4})


def _llama(vocab: int, **extra: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **extra,
    )


def _gemma2() -> Any:
    # Gemma 2's final_logit_softcapping: the soft-capped loss
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )


def _phi() -> Any:
    # Phi's head has a bias
    from transformers import PhiConfig

    return PhiConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )


def _model(tmp_path: Path, config: Any) -> Any:
    from memfit.models import resolve_model

    folder = tmp_path / "model"
    config.save_pretrained(folder)
    return resolve_model(str(folder))


def _same(fitted: Any, exact: Any) -> None:
    assert fitted.total_bytes == exact.total_bytes
    assert fitted.breakdown == exact.breakdown
    assert fitted.allocated_peak_bytes == exact.allocated_peak_bytes
    assert fitted.reserved_peak_bytes == exact.reserved_peak_bytes
    assert fitted.phase_peaks == exact.phase_peaks


# (batch, length) off every grid, for a head of 2048 rows per 64-wide hidden row (32 per row):
# 72 rows in chunks of 4 (all full), 67 in chunks of 4 (the last 3: one short of a chunk), 2 rows
# (two chunks of 1), 3 (three), 65 (the last chunk 1 row), a batch of one and misaligned lengths
SHAPES = [(3, 24), (1, 67), (1, 2), (1, 3), (5, 13), (2, 37), (7, 64), (1, 200)]


@pytest.mark.slow  # traces a tiny model's fit and eight shapes (tens of seconds)
@pytest.mark.parametrize(
    ("config", "knobs"),
    [
        (lambda: _llama(2048), {"sdpa_sm": 75, "lora_rank": 8}),
        (lambda: _llama(2048), {"precision": "bf16"}),
        (lambda: _llama(2048), {"precision": "fp16", "sdpa_sm": 75}),
        (lambda: _llama(2048), {"precision": "bf16", "mode": "eval"}),
        (lambda: _llama(2048), {"device": "cpu"}),
        (_gemma2, {"precision": "bf16"}),
        (_phi, {"precision": "bf16", "lora_rank": 8}),
        # one chunk whatever the rows (a head no wider than the hidden states), two at most
        (lambda: _llama(64), {"precision": "bf16"}),
        (lambda: _llama(100), {"sdpa_sm": 75, "lora_rank": 8}),
    ],
    ids=["lora-sm75", "bf16", "fp16-sm75", "eval", "cpu", "softcap", "bias", "one-chunk", "two"],
)
def test_the_fit_is_an_exact_trace_of_each_shape(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    config: Any,
    knobs: dict[str, Any],
) -> None:
    from memfit.estimate import traces
    from memfit.estimate.workload import StepSpec

    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    model = _model(tmp_path, config())
    traced = traces.traced(model, StepSpec(**LM, **knobs))
    assert traced.fitted is not None and traced.method == "fitted"
    for batch, length in SHAPES:
        fitted = traced.replay(batch, length)
        used = traced.used(batch, length)
        # a batch of one and a misaligned length have fits of their own: fitted too
        assert used.fitted is not None and used.method == "fitted", (batch, length)
        exact = used._exact_trace(batch, length)
        _same(fitted, exact.replay(batch, length))
    traces.clear_cache()


@pytest.mark.slow  # traces a tiny model at a dozen shapes
@pytest.mark.parametrize("vocab", [2048, 100])
def test_three_slots_are_a_trace_of_every_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vocab: int
) -> None:
    # the estimate of three slots (the third a copy of the second where the chunks divide the
    # rows; empty ones after the last chunk where there are fewer than three) is the estimate of
    # the loop's every chunk, nothing declared
    from memfit.estimate import traces
    from memfit.estimate.workload import StepSpec

    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    model = _model(tmp_path, _llama(vocab))
    spec = StepSpec(**LM, precision="bf16", sdpa_sm=75)
    shapes = [(3, 24), (1, 67), (1, 2), (1, 3), (2, 37)]
    slots = traces.traced(model, spec)
    declared = {shape: slots.replay(*shape) for shape in shapes}
    traces.clear_cache()

    def every_chunk(hidden: Any, rows: int, chunk: int) -> list[int]:
        return list(range(0, rows, chunk))

    monkeypatch.setattr(linear_ce, "_chunk_starts", every_chunk)
    everything = traces.traced(model, spec)
    assert everything.fitted is None  # the chunks of each shape, each shape traced
    for shape in shapes:
        _same(declared[shape], everything.replay(*shape))
    traces.clear_cache()


@pytest.mark.slow  # the 8B's trace (a minute on a loaded machine)
def test_the_fused_loss_of_an_8b_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    from memfit.estimate import traces
    from memfit.estimate.workload import StepSpec
    from memfit.models import resolve_model

    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")
    model = resolve_model("meta-llama/Llama-3.1-8B")
    traced = traces.traced(model, StepSpec(**LM, sdpa_sm=75, lora_rank=8))
    assert traced.fitted is not None and traced.method == "fitted"
    # 2048 rows: chunks of 64, all full; 1008: chunks of 32, the last of 16 rows
    for shape in [(2, 1024), (3, 336)]:
        _same(traced.replay(*shape), traced._exact_trace(*shape).replay(*shape))
    traces.clear_cache()
