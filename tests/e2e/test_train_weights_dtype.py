"""`memfit train` with ``--weights-dtype`` and ``--cross-entropy`` on the CPU (issue 32): a tiny
Llama whose checkpoint is stored in bf16, as today's decoders are.

- ``--weights-dtype bf16``: pure bf16 full fine-tuning: the weights, their gradients and AdamW's
  state in bf16, the checkpoints and the saved model in bf16; a killed run resumes from them to
  the weights of the run that was not killed.
- ``--lora-rank`` under ``auto``: the frozen base held in bf16 (the checkpoint's dtype), the
  adapters trained in fp32 (and saved so); a classifier's fresh head over the bf16 body trains in
  fp32 too (its inputs cast to it: no autocast on the CPU).
- QLoRA NF4 under ``auto``: the layers bitsandbytes leaves unquantized are held in bf16, not in
  the fp32 peft's preparation upcasts them to.
- ``--cross-entropy fused-linear``: the same losses (training and eval) as the standard loss, from
  the same seed and data.

Each run's run.json says what ran (``resolved.weights``, ``resolved.cross_entropy``), read from
the model and the recipe.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from memfit.train import TrainConfig, train

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out
pytest.importorskip("peft")

WORDS = [f"w{i}" for i in range(40)]


def _save_llama(folder: Path, dtype: torch.dtype) -> str:
    """The tiny Llama of tests/tiny_models.py, its checkpoint stored in ``dtype``."""
    from transformers import AutoModelForCausalLM

    from tiny_models import save_tiny_llama

    sentences = [" ".join(WORDS[i : i + 10]) for i in range(0, len(WORDS), 5)]
    save_tiny_llama(folder, sentences, chat_template=None)
    if dtype != torch.float32:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dtype)
        model.save_pretrained(folder)  # its config's dtype follows the weights'
    return str(folder)


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = _save_llama(tmp_path_factory.mktemp("llama-bf16"), torch.bfloat16)
    assert json.loads((Path(folder) / "config.json").read_text())["dtype"] == "bfloat16"
    return folder


@pytest.fixture(scope="module")
def llama_fp32(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _save_llama(tmp_path_factory.mktemp("llama-fp32"), torch.float32)


def _texts(path: Path, rows: int, *, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = [
        json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20)))})
        for _ in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(model: str, data: Path, out: Path, **knobs: Any) -> dict[str, Any]:
    defaults: dict[str, Any] = dict(
        task="causal-lm",
        model=model,
        train_file=str(data),
        output_dir=str(out),
        cache_dir=str(out.parent / "cache"),
        effective_batch_size=4,
        max_steps=2,
        optimizer="adamw",
        lr=1e-2,
        seed=3,
        device="cpu",
        quiet=True,
        probe=False,
    )
    result = train(TrainConfig(**(defaults | knobs)))
    return {
        "result": result,
        "out": out,
        "resolved": json.loads((out / "run.json").read_text())["resolved"],
        "metrics": [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()],
    }


def test_pure_bf16_full_fine_tuning_holds_and_resumes_everything_in_bf16(
    llama_bf16: str, tmp_path: Path
) -> None:
    data = _texts(tmp_path / "train.jsonl", 12)
    whole = _run(llama_bf16, data, tmp_path / "whole", weights_dtype="bf16", save_every=1)
    assert whole["resolved"]["weights"] == {
        "frozen": None,
        "trainable": "bf16",
        "checkpoint": "bf16",
    }
    assert whole["resolved"]["precision"] == "fp32"  # the CPU: no autocast, bf16 matmuls
    step = whole["out"] / "checkpoints" / "step-1"
    held = load_file(str(step / "model.safetensors"))
    assert held and {t.dtype for t in held.values()} == {torch.bfloat16}
    state = torch.load(step / "optimizer.pt", weights_only=True)["state"]
    moments = [s[k] for s in state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}
    saved = whole["out"] / "model"
    assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(saved / "model.safetensors")).values()} == {
        torch.bfloat16
    }
    # a kill after step 1: its checkpoint, no model, run.json unfinished; resumed, the same
    killed = tmp_path / "killed"
    shutil.copytree(whole["out"], killed)
    shutil.rmtree(killed / "checkpoints" / "step-2")
    shutil.rmtree(killed / "model")
    run_json = json.loads((killed / "run.json").read_text())
    run_json.pop("result")
    (killed / "run.json").write_text(json.dumps(run_json))
    resumed = _run(llama_bf16, data, killed, weights_dtype="bf16", save_every=1, resume=True)
    assert resumed["resolved"]["weights"]["trainable"] == "bf16"
    a = load_file(str(whole["out"] / "model" / "model.safetensors"))
    b = load_file(str(killed / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_under_auto_holds_the_base_in_the_checkpoints_dtype(
    llama_bf16: str, tmp_path: Path
) -> None:
    from memfit.cli import main

    data = _texts(tmp_path / "train.jsonl", 8)
    out = tmp_path / "out"
    flags = ["--task", "causal-lm", "--model", llama_bf16, "--train-file", str(data)]
    flags += ["--output-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"]
    flags += ["--lora-rank", "4", "--weights-dtype", "auto", "--cross-entropy", "standard"]
    flags += ["--max-steps", "2", "--save-every", "2", "--effective-batch-size", "4"]
    try:
        main(["train", *flags])
    except SystemExit as done:  # a success may end so too
        assert not done.code
    run = {
        "out": out,
        "resolved": json.loads((out / "run.json").read_text())["resolved"],
        "metrics": [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()],
    }
    assert run["resolved"]["cross_entropy"] == {"kind": "standard"}
    assert run["resolved"]["weights"] == {
        "frozen": "bf16",
        "trainable": "fp32",
        "checkpoint": "bf16",
    }
    adapters = load_file(str(run["out"] / "model" / "adapter_model.safetensors"))
    assert adapters and {t.dtype for t in adapters.values()} == {torch.float32}
    held = load_file(str(run["out"] / "checkpoints" / "step-2" / "model.safetensors"))
    assert {t.dtype for k, t in held.items() if "lora_" in k} == {torch.float32}
    assert {t.dtype for k, t in held.items() if "lora_" not in k} == {torch.bfloat16}
    assert all(m["loss"] == m["loss"] for m in run["metrics"])  # finite, not NaN


def test_a_classifier_head_trains_in_fp32_over_a_bf16_body(llama_bf16: str, tmp_path: Path) -> None:
    """LoRA on a sequence classifier: its fresh head is trained whole (fp32), the body frozen in
    bf16; without autocast the head's input is cast to fp32 (else its matmul meets two dtypes)."""
    data = tmp_path / "train.csv"
    rows = [f"{' '.join(WORDS[i : i + 6])},{i % 2}" for i in range(8)]
    data.write_text("text,label\n" + "\n".join(rows) + "\n")
    run = _run(llama_bf16, data, tmp_path / "out", task="classification", lora_rank=4)
    assert run["resolved"]["weights"] == {
        "frozen": "bf16",
        "trainable": "fp32",
        "checkpoint": "bf16",
    }
    assert run["resolved"]["cross_entropy"] is None  # a causal-LM knob only
    assert len(run["metrics"]) == 2


def test_qlora_holds_the_unquantized_layers_in_bf16(llama_bf16: str, tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    data = _texts(tmp_path / "train.jsonl", 8)
    run = _run(llama_bf16, data, tmp_path / "out", lora_rank=4, quantization="nf4")
    # the embeddings, norms and LM head: bf16 (peft's preparation had upcast them to fp32)
    assert run["resolved"]["weights"] == {
        "frozen": "bf16",
        "trainable": "fp32",
        "checkpoint": "bf16",
    }
    assert len(run["metrics"]) == 2


def test_fused_linear_cross_entropy_trains_and_evaluates_to_the_standard_losses(
    llama_fp32: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memfit import step

    # which passes computed the loss chunk by chunk (with and without gradients: steps, evals)
    calls: list[bool] = []
    original = step.linear_cross_entropy

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(step, "linear_cross_entropy", counted)
    data = _texts(tmp_path / "train.jsonl", 8)
    common = dict(eval_file=str(data), eval_every=2, micro_batch_size=2)
    standard = _run(llama_fp32, data, tmp_path / "standard", **common)
    assert calls == []
    fused = _run(llama_fp32, data, tmp_path / "fused", cross_entropy="fused-linear", **common)
    # 2 steps of 2 micro-batches, then an eval of the 8 rows
    assert calls.count(True) == 4 and calls.count(False) >= 1
    assert standard["resolved"]["cross_entropy"] == {"kind": "standard"}
    ran = fused["resolved"]["cross_entropy"]
    assert ran["kind"] == "fused-linear" and ran["implementation"]
    pairs = [(a, b) for a, b in zip(standard["metrics"], fused["metrics"], strict=True)]
    losses = [(a["loss"], b["loss"]) for a, b in pairs if "loss" in a]
    evals = [(a["eval_loss"], b["eval_loss"]) for a, b in pairs if "eval_loss" in a]
    assert len(losses) == 2 and len(evals) == 1
    for a, b in losses + evals:
        assert b == pytest.approx(a, rel=1e-5)
