"""TRL SFTTrainer's fused LM head (``--cross-entropy trl-chunked``) fits every shape: its token
tiles run as two slots (the first, the last) whatever the tokens, each allocation sized by a
formula of them (``memfit.step.trl_head.tile_bytes``), so a new (batch size, sequence length) is a
replay of the fit; and the fit says what an exact trace of that very shape says. TRL's tiles are
made small (16 tokens × 256 vocabulary columns) so that small shapes span several of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from memfit.step import trl_head

LM = {"task": "causal-lm", "cross_entropy": "trl-chunked"}


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", 16)
    monkeypatch.setattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 256)
    monkeypatch.setenv("MEMFIT_NO_CACHE", "1")


def test_the_slots_are_the_first_and_the_last_tile() -> None:
    for rows in range(1, 200):
        tiles = [min(start + 16, rows) - start for start in range(0, rows, 16)]
        slots = [trl_head._slot_rows(rows, 16, slot) for slot in (0, 1)]
        assert slots == [tiles[0], tiles[-1] if len(tiles) > 1 else 0], rows
        assert trl_head.tile_bytes(rows, 16, 1, 4, 1, 256) == 4 * 256 * slots[1]
        assert trl_head.tile_bytes(rows, 16, 0, 2, 0, 256, 8) == 2 * 256 * 8


def _model(tmp_path: Path) -> Any:
    from transformers import LlamaConfig

    from memfit.models import resolve_model

    folder = tmp_path / "model"
    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                tie_word_embeddings=False).save_pretrained(folder)  # fmt: skip
    return resolve_model(str(folder))


# (batch, length): 1 token (one tile, empty last slot), 16 (one full tile), 17 (a 1-token last
# tile), many tiles with a full or a short last one, a batch of one
SHAPES = [(1, 2), (1, 17), (2, 9), (3, 24), (1, 67), (5, 13), (2, 37)]


@pytest.mark.slow  # traces a tiny model's fit and seven shapes
@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(
    "knobs",
    [{"device": "cpu"}, {"precision": "bf16"}, {"sdpa_sm": 75, "lora_rank": 8}],
    ids=["cpu", "cuda-bf16", "cuda-lora"],
)
def test_the_fit_is_an_exact_trace_of_each_shape(tmp_path: Path, knobs: dict[str, Any]) -> None:
    from memfit.estimate import traces
    from memfit.estimate.workload import StepSpec

    model = _model(tmp_path)
    traced = traces.traced(model, StepSpec(**LM, **knobs))
    assert traced.fitted is not None and traced.method == "fitted"
    for batch, length in SHAPES:
        fitted = traced.replay(batch, length)
        used = traced.used(batch, length)
        assert used.fitted is not None and used.method == "fitted", (batch, length)
        exact = used._exact_trace(batch, length).replay(batch, length)
        assert fitted.total_bytes == exact.total_bytes, (batch, length)
        assert fitted.breakdown == exact.breakdown, (batch, length)
        assert fitted.phase_peaks == exact.phase_peaks, (batch, length)
    traces.clear_cache()
