"""``memfit.estimate.prefetch``: knob sets traced side by side in worker processes, into the disk
cache; and which models the planner prefetches for (only those whose whole trace is deep)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memfit.estimate import depth
from memfit.estimate.api import estimate, is_traced
from memfit.estimate.prefetch import prefetch

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="prefetch needs two cores")


def _bert(folder: Path, layers: int) -> str:
    from transformers import BertConfig

    # a vocabulary no other test's model has: nothing of it is traced already (in memory either)
    config = BertConfig(
        vocab_size=1237,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    config.save_pretrained(folder)
    return str(folder)


def test_prefetch_traces_each_missing_knob_set_in_a_worker_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))  # the workers inherit it
    model = _bert(tmp_path / "bert", layers=2)
    calls = [
        dict(task="classification", batch_size=2, seq_len=16, device="cpu"),
        dict(task="classification", batch_size=2, seq_len=16, device="cpu", optimizer="sgd"),
    ]
    assert not any(is_traced(model, **call) for call in calls)
    assert prefetch(model, calls) == 2
    # on disk, written by the workers: this process answers from the cache
    assert all(is_traced(model, **call) for call in calls)
    assert list((tmp_path / "cache" / "traces").glob("*.json.z"))
    assert estimate(model, **calls[0]).total_bytes > 0
    assert prefetch(model, calls) == 0  # nothing left to trace
    # one missing set is left to the caller's own estimate: a worker would cost more
    assert prefetch(model, [dict(calls[0], batch_size=4, optimizer="adafactor")]) == 0


def test_only_a_whole_trace_deeper_than_a_shallow_one_is_worth_a_worker() -> None:
    from transformers import BertConfig

    def bert(layers: int) -> BertConfig:
        return BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=2)

    # 2 or 4 layers: traced whole, as cheap as the shallow traces of a deeper model
    assert depth.few_layers(bert(2)) and depth.few_layers(bert(4))
    # 12 layers: two shallow traces and the extrapolation (no whole trace to prefetch)
    assert depth.plan_depth(bert(12))[0] is not None and not depth.few_layers(bert(12))
    # 8 layers that repeat every 3 (ModernBERT's global attention): traced whole, all 8 of them
    from transformers import ModernBertConfig

    modern = ModernBertConfig(num_hidden_layers=8, global_attn_every_n_layers=3)
    assert depth.plan_depth(modern)[0] is None and not depth.few_layers(modern)
