"""`memfit train --lora-rank 8 --quantization nf4` end to end on the CPU (bitsandbytes runs 4-bit
layers there): a tiny Llama (random weights) trains LoRA adapters on its 4-bit base. Under a memory
cap that only a split micro-batch fits the guard backs off and ends with the adapters of the run
without the cap; the adapter folder loads with peft on the original base and on the 4-bit one (and
reproduces the run's eval loss there); --merge-lora merges into the unquantized base; a resume from
a checkpoint (adapters and bitsandbytes' optimizer state, the base reloaded) ends where the
uninterrupted run ends."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from memfit.train import TrainConfig, train

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out
pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

WORDS = [f"w{i}" for i in range(40)]
ADAPTERS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Llama (32 wide, seeded random weights) whose tokenizer knows the words."""
    from tiny_models import save_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    sentences = [" ".join(WORDS[i : i + 10]) for i in range(0, len(WORDS), 5)]
    save_tiny_llama(folder, sentences, chat_template=None)
    return str(folder)


@pytest.fixture
def no_lora_dropout(monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA's dropout off. A step split into micro-batches draws other dropout masks than the
    whole step does, so the guard's 'same weights' holds for deterministic steps only, as the
    other end-to-end tests turn their tiny models' dropout off."""
    from memfit.estimate import workload

    original = workload.lora_config

    def without_dropout(*args: Any, **kwargs: Any) -> Any:
        config = original(*args, **kwargs)
        config.lora_dropout = 0.0
        return config

    monkeypatch.setattr(workload, "lora_config", without_dropout)


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _write_rows(path: Path, rows: int, *, seed: int = 0, instructions: bool = False) -> Path:
    """``rows`` JSON lines: a ``text`` each, or with ``instructions`` a ``prompt`` and its
    ``completion`` (which starts with the space that joins them)."""
    rng = random.Random(seed)
    lines = [
        json.dumps(
            {"prompt": _words(rng, 6, 16), "completion": " " + _words(rng, 2, 6)}
            if instructions
            else {"text": _words(rng, 6, 24)}
        )
        for _ in range(rows)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# the flags (and TrainConfig's fields) of prompt/completion rows
INSTRUCTION_KNOBS = {"prompt_column": "prompt", "completion_column": "completion"}


def _run(model: str, data: Path, out: Path, **knobs: Any) -> dict[str, Any]:
    defaults: dict[str, Any] = dict(
        task="causal-lm",
        model=model,
        train_file=str(data),
        output_dir=str(out),
        cache_dir=str(out.parent / "cache"),
        lora_rank=8,
        quantization="nf4",
        effective_batch_size=8,
        optimizer="adamw",
        lr=1e-2,
        seed=3,
        device="cpu",
        quiet=True,
        # the guard's recovery inside a step is under test; the probe has its own tests
        probe=False,
    )
    started = time.perf_counter()
    result = train(TrainConfig(**(defaults | knobs)))
    seconds = time.perf_counter() - started
    return {
        "result": result,
        "seconds": seconds,
        "out": out,
        "metrics": [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()],
        "events": [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()],
    }


def _adapters(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / ADAPTERS))


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_a_qlora_step_that_does_not_fit_backs_off_to_the_same_adapters(
    llama: str, tmp_path: Path, no_lora_dropout: None
) -> None:
    # prompt/completion rows: each micro-batch weighs by its completion tokens
    data = _write_rows(tmp_path / "train.jsonl", 32, instructions=True)
    plain = _run(llama, data, tmp_path / "plain", **INSTRUCTION_KNOBS)
    # live tensor bytes of a step at micro-batch 8 and at 1, read through a cap that never bites
    whole = _run(llama, data, tmp_path / "p8", memory_cap=1 << 40, **INSTRUCTION_KNOBS)
    single = _run(
        llama, data, tmp_path / "p1", memory_cap=1 << 40, micro_batch_size=1, **INSTRUCTION_KNOBS
    )
    need8 = whole["metrics"][0]["peak_bytes"]
    need1 = max(m["peak_bytes"] for m in single["metrics"])
    assert need1 < need8
    cap = (need1 + need8) // 2
    capped = _run(llama, data, tmp_path / "capped", memory_cap=cap, **INSTRUCTION_KNOBS)
    ooms = [e for e in capped["events"] if e["type"] == "oom"]
    assert ooms and ooms[0]["step"] == 1
    assert any(e["type"] == "backoff" for e in capped["events"])
    assert capped["metrics"][0]["micro_batch_size"] < 8
    assert capped["result"].samples_seen == plain["result"].samples_seen == 32
    steps = [m["step"] for m in capped["metrics"]]
    assert steps == list(range(1, len(steps) + 1))  # no step repeated or skipped
    # the same adapters as the run that never met the cap
    assert _max_difference(_adapters(plain["out"]), _adapters(capped["out"])) <= 1e-5
    assert _max_difference(_adapters(plain["out"]), _adapters(tmp_path / "p8")) == 0
    print(
        f"\nQLoRA nf4 on the CPU: {len(steps)} steps, uncapped {plain['seconds']:.1f} s, capped "
        f"{capped['seconds']:.1f} s; peak {need8} B at micro-batch 8, {need1} B at 1, cap "
        f"{cap} B; {len(ooms)} OOM(s), micro-batch "
        f"{capped['metrics'][0]['micro_batch_size']} after the back-off"
    )


@pytest.fixture(scope="module")
def adapter_run(llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A QLoRA run from the command line (nf4, --double-quant, prompt/completion rows, an eval
    file)."""
    root = tmp_path_factory.mktemp("qlora-cli")
    data = _write_rows(root / "train.jsonl", 24, seed=1, instructions=True)
    held_out = _write_rows(root / "eval.jsonl", 8, seed=2, instructions=True)
    out = root / "out"
    command = [sys.executable, "-m", "memfit", "train", "--task", "causal-lm", "--model", llama]
    command += ["--train-file", str(data), "--eval-file", str(held_out), "--output-dir", str(out)]
    command += ["--lora-rank", "8", "--quantization", "nf4", "--double-quant", "--device", "cpu"]
    command += ["--effective-batch-size", "8", "--optimizer", "adamw", "--lr", "1e-2"]
    command += ["--seed", "3", "--cache-dir", str(root / "cache")]
    command += ["--prompt-column", "prompt", "--completion-column", "completion"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return {"root": root, "data": data, "eval": held_out, "out": out, "command": command}


def _eval_loss(model: Any, tokenizer: Any, path: Path, *, completions_only: bool) -> float:
    """Token cross-entropy over the prompt/completion rows of ``path``: each row the text prompt
    + completion tokenized, then EOS; over the completion's tokens and the EOS, or over all."""
    summed, tokens = 0.0, 0
    with torch.no_grad():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            ids = tokenizer(row["prompt"] + row["completion"])["input_ids"] + [
                tokenizer.eos_token_id
            ]
            prompt = tokenizer(row["prompt"])["input_ids"]
            assert ids[: len(prompt)] == prompt  # the completion starts at a token boundary
            start = len(prompt) if completions_only else 1
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            # position t predicts token t + 1
            targets = torch.tensor(ids[start:])
            summed += float(F.cross_entropy(logits[start - 1 : -1], targets, reduction="sum"))
            tokens += len(targets)
    return summed / tokens


def test_the_adapter_folder_loads_on_the_original_and_the_4bit_base(
    llama: str, adapter_run: dict[str, Any]
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    folder = adapter_run["out"] / "model"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(llama).resolve())
    saved = _adapters(adapter_run["out"])
    assert saved and all("lora_" in k for k in saved)  # the adapters only, no base weights
    assert any(float(t.abs().max()) > 0 for k, t in saved.items() if "lora_B" in k)  # trained

    # the original (unquantized) base folder
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama), folder)
    loaded = {k: v for k, v in plain.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved)

    # the base loaded in 4 bits again, as the run held it: the run's own eval loss comes back
    settings = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    base = AutoModelForCausalLM.from_pretrained(
        llama, quantization_config=settings, dtype=torch.float32, device_map="cpu"
    )
    for module in base.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            # bitsandbytes' CPU inference layout fails on layers narrower than its 64-wide blocks
            module.support_avx512bf16_for_cpu = False
    quantized = PeftModel.from_pretrained(base, folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    metrics = [
        json.loads(x) for x in (adapter_run["out"] / "metrics.jsonl").read_text().splitlines()
    ]
    run_loss = [m["eval_loss"] for m in metrics if "eval_loss" in m][-1]
    # ... over the completions' tokens only (the prompts are no targets)
    held_out = adapter_run["eval"]
    assert _eval_loss(quantized, tokenizer, held_out, completions_only=True) == pytest.approx(
        run_loss, rel=1e-4
    )
    everything = _eval_loss(quantized, tokenizer, held_out, completions_only=False)
    assert everything != pytest.approx(run_loss, rel=1e-3)
    # the unquantized base is another model: close, not the same
    unquantized_loss = _eval_loss(plain.eval(), tokenizer, held_out, completions_only=True)
    assert unquantized_loss != pytest.approx(run_loss, rel=1e-6)
    assert unquantized_loss == pytest.approx(run_loss, rel=0.05)


def test_merge_lora_writes_the_adapters_merged_into_the_unquantized_base(
    llama: str, adapter_run: dict[str, Any]
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged_out = adapter_run["root"] / "merged"
    command = [*adapter_run["command"], "--output-dir", str(merged_out), "--merge-lora"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    config = json.loads((merged_out / "model" / "config.json").read_text())
    assert "quantization_config" not in config  # a plain folder: no bitsandbytes to load it
    merged = AutoModelForCausalLM.from_pretrained(merged_out / "model")
    # what peft gives from the adapter folder of the same run on the original base
    expected = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(llama), adapter_run["out"] / "model"
    ).merge_and_unload()
    want = expected.state_dict()
    got = merged.state_dict()
    assert got.keys() == want.keys()
    assert max(float((got[k] - want[k]).abs().max()) for k in got) <= 1e-6
    base = load_file(str(Path(llama) / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert float((got[key] - base[key]).abs().max()) > 0  # the update is in


def test_a_killed_qlora_run_resumes_to_the_same_adapters(llama: str, tmp_path: Path) -> None:
    data = _write_rows(tmp_path / "train.jsonl", 32, seed=4)
    knobs: dict[str, Any] = dict(save_every=1, optimizer="paged-adamw-8bit")
    whole = _run(llama, data, tmp_path / "whole", **knobs)
    assert whole["result"].steps == 4
    # the folder a kill after step 2 leaves: checkpoints 1 and 2, no model, run.json unfinished
    killed = tmp_path / "killed"
    shutil.copytree(whole["out"], killed)
    for name in ("step-3", "step-4"):
        shutil.rmtree(killed / "checkpoints" / name)
    shutil.rmtree(killed / "model")
    run_json = json.loads((killed / "run.json").read_text())
    run_json.pop("result")
    (killed / "run.json").write_text(json.dumps(run_json))
    weights = load_file(str(killed / "checkpoints" / "step-2" / "model.safetensors"))
    assert weights and all("lora_" in k for k in weights)  # the adapters, not the 4-bit base
    resumed = _run(llama, data, killed, resume=True, **knobs)
    (resume,) = [e for e in resumed["events"] if e["type"] == "resume"]
    assert resume["step"] == 2
    assert [m["step"] for m in resumed["metrics"]] == [1, 2, 3, 4]
    assert _max_difference(_adapters(whole["out"]), _adapters(killed)) <= 1e-6
