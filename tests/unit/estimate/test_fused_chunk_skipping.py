"""The estimator's trace of the fused-linear loss runs the first two chunks and the last one
(``memfit.step.linear_ce._chunk_starts`` on fake tensors): its estimate equals the trace of every
chunk, where the chunks carry state (autocast's cached 16-bit copy of the fp32 head, made by the
first chunk's gradient matmul, beside the uncached copy each chunk's ``weight.t()`` makes)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.slow
def test_a_trace_of_three_chunks_is_the_trace_of_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memfit.estimate import api, traces
    from memfit.step import linear_ce

    # full fine-tuning of a tied 151936-token head under bf16 autocast: the peak is inside the
    # loss, in the forward (a trace of the first chunk and the last alone is 0.3 GiB low here)
    knobs = dict(task="causal-lm", batch_size=8, seq_len=1024, precision="bf16", gpu="rtx4090")
    rows, vocab, hidden = 8 * 1024, 151936, 896
    chunk = linear_ce.chunk_rows(rows, vocab, hidden)
    assert rows // chunk > 3

    def estimate(tag: str) -> tuple[int, dict[str, int]]:
        traces.clear_cache()
        monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / tag))
        result = api.estimate("Qwen/Qwen2.5-0.5B", cross_entropy="fused-linear", **knobs)
        return result.total_bytes, dict(result.breakdown)

    skipped = estimate("skipped")
    ran: list[int] = []
    three = linear_ce._chunk_starts

    def all_chunks(hidden: object, rows: int, chunk: int) -> list[int]:
        ran.append(len(three(hidden, rows, chunk)))  # type: ignore[arg-type]
        return list(range(0, rows, chunk))

    monkeypatch.setattr(linear_ce, "_chunk_starts", all_chunks)
    whole = estimate("whole")
    traces.clear_cache()
    assert ran and max(ran) <= 3
    assert skipped == whole
