"""TRL SFTTrainer's fused LM head as memfit prices it (``--cross-entropy trl-chunked``): the
estimator's trace of it (two token tiles, TRL's own tile folds) allocates, at its peak, what a
real CPU step allocates, measured with the estimator's recorder on real tensors (live bytes above
the resident weights and optimizer state, ``bench/trace_vs_real.py``): memfit's own loss over
TRL's ``ChunkedLogProbFunction``, and the step TRL's SFTTrainer runs, the model patched with TRL's
``add_fused_lm_head`` and ``model(**inputs, fused_lm_head=True)``'s log-probabilities summed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

from memfit.estimate import workload
from memfit.estimate.workload import StepSpec
from trace_vs_real import real_step, traced_step


def _llama(vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """TRL's tiles made 16 tokens × 256 columns: a small step spans several of them."""
    from trl.kernels import chunked_logprob
    from trl.trainer import utils

    monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", 16)
    monkeypatch.setattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 256)
    yield


def _sft_trainer_loss(model: Any, batch: dict[str, Any], spec: StepSpec) -> Any:
    """trl 1.16's SFTTrainer: add_fused_lm_head once (its __init__), then compute_loss's lines."""
    from trl.trainer.utils import add_fused_lm_head

    if not getattr(model, "_memfit_fused_head", False):
        # a peft model's base model, as SFTTrainer patches it
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
        model._memfit_fused_head = True
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    outputs = model(**inputs, labels=batch["labels"], use_cache=False, fused_lm_head=True)
    per_token_loss = -outputs.log_probs
    units = batch["labels"].size(0) * max(batch["labels"].size(1) - 1, 1)
    return per_token_loss.sum() / units


CASES = [
    pytest.param(1000, {}, 2, 32, id="fp32-4-vocab-tiles"),
    pytest.param(300, {"lora_rank": 4, "lora_dropout": 0.0}, 3, 24, id="lora"),
    pytest.param(1000, {"optimizer": "sgd"}, 1, 17, id="a-1-token-last-tile"),
]


@pytest.mark.slow  # three real steps and a trace of a tiny Llama per case (5-10 s)
@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize(("vocab", "knobs", "batch", "length"), CASES)
def test_the_trace_peaks_where_trls_own_step_does(
    monkeypatch: pytest.MonkeyPatch, vocab: int, knobs: dict[str, Any], batch: int, length: int
) -> None:
    config = _llama(vocab)
    spec = StepSpec(task="causal-lm", device="cpu", cross_entropy="trl-chunked", **knobs)
    traced = traced_step(config, spec, batch, length)
    # memfit's loss over TRL's ChunkedLogProbFunction (every token tile: a real run)
    own = real_step(config, spec, batch, length)
    assert own.peak_bytes == traced.peak_bytes
    # the step TRL's SFTTrainer runs: add_fused_lm_head, model(..., fused_lm_head=True)
    monkeypatch.setattr(workload, "compute_loss", _sft_trainer_loss)
    sft = real_step(config, spec, batch, length)
    assert sft.peak_bytes == traced.peak_bytes


def test_without_trl_the_value_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from memfit.step import trl_head

    monkeypatch.setattr(trl_head, "_trl", lambda: None)
    problem = trl_head.trl_problem()
    assert problem is not None and "\n" not in problem
    assert problem.startswith("--cross-entropy trl-chunked:")
    assert "pip install 'memfit[trl]'" in problem


@pytest.mark.slow  # the CLI's estimate of a tiny Llama (its fit's traces: about 10 s)
def test_the_estimate_says_which_loss_it_priced(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from cli_run import run_cli

    _llama(300).save_pretrained(tmp_path)
    code, out, err = run_cli(capsys, "estimate", str(tmp_path), "--task", "causal-lm",
                             "--batch-size", "1", "--seq-len", "16", "--device", "cpu",
                             "--cross-entropy", "trl-chunked", "--json")  # fmt: skip
    assert code == 0, err
    info = json.loads(out)["details"]["cross_entropy"]
    assert info["kind"] == "trl-chunked" and info["token_tiles"] == 1
    assert "ChunkedLogProbFunction" in info["implementation"]


def test_without_trl_the_estimate_refuses_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cli_run import run_cli
    from memfit.levers import cross_entropy

    find_spec = cross_entropy.importlib.util.find_spec

    def no_trl(name: str, *args: Any) -> Any:
        return None if name == "trl" else find_spec(name, *args)

    monkeypatch.setattr(cross_entropy.importlib.util, "find_spec", no_trl)
    code, _, err = run_cli(capsys, "estimate", "gpt2", "--task", "causal-lm", "--batch-size",
                           "1", "--seq-len", "16", "--cross-entropy", "trl-chunked")  # fmt: skip
    assert code == 2
    assert "--cross-entropy trl-chunked:" in err and "pip install 'memfit[trl]'" in err
    assert "Traceback" not in err
