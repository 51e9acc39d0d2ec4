"""`memfit train` meets the user's tools: LoRA adapter folders that peft loads, a LoRA run's memory
against the estimate, a SageMaker-style job, and TensorBoard logs with the memory figures.

Tiny models built offline; each run is a few optimizer steps on the CPU.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.train import TrainConfig, train
from tiny_models import save_bert

pytestmark = pytest.mark.slow  # end to end: `pytest -m "not slow"` leaves it out

ROOT = Path(__file__).resolve().parents[2]
WORDS = [f"w{i}" for i in range(60)]
LABELS = ["neg", "neutral", "pos"]
MiB = 2**20


def _classification_data(path: Path, rows: int, *, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = ["text,label"]
    for i in range(rows):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        lines.append(f"{' '.join(words)},{LABELS[i % 3]}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _texts(path: Path, rows: int, *, seed: int = 0) -> Path:
    rng = random.Random(seed)
    sentences = ["the cat sat on the mat", "the dog ran in the park", "how do i reset my password"]
    records = [{"text": " ".join(rng.sample(sentences, 2))} for _ in range(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _run(model: str, data: Path, out: Path, **knobs: Any) -> Any:
    defaults: dict[str, Any] = dict(
        task="classification",
        model=model,
        train_file=str(data),
        output_dir=str(out),
        effective_batch_size=8,
        lora_rank=4,
        lr=5e-2,
        seed=3,
        device="cpu",
        quiet=True,
    )
    return train(TrainConfig(**(defaults | knobs)))


def _metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


# --- LoRA: the adapter folder loads with peft and gives the trained model's outputs -------------
def test_classification_adapter_loads_with_peft_and_matches_the_merged_model(
    tiny_classifier: str, tmp_path: Path
) -> None:
    from peft import AutoPeftModelForSequenceClassification, PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    data = _classification_data(tmp_path / "train.csv", 24)
    # the same seeded run twice: once saved as the adapter folder, once merged
    _run(tiny_classifier, data, tmp_path / "adapter", max_steps=3)
    _run(tiny_classifier, data, tmp_path / "merged", max_steps=3, merge_lora=True)
    adapter = tmp_path / "adapter" / "model"
    files = {p.name for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "model.safetensors" not in files and "config.json" not in files
    config = json.loads((adapter / "adapter_config.json").read_text())
    # the architecture's attention projections (the shared table), the head saved whole
    assert set(config["target_modules"]) == {"query", "key", "value", "attention.output.dense"}
    assert "classifier" in config["modules_to_save"]
    assert config["base_model_name_or_path"] == str(Path(tiny_classifier).resolve())

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    batch = tokenizer(["w7 w1 w2", "w13 w7 w9 w3", "w4 w5"], padding=True, return_tensors="pt")
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged" / "model")
    assert merged.config.id2label == dict(enumerate(LABELS))
    with torch.no_grad():
        expected = merged.eval()(**batch).logits
        auto = AutoPeftModelForSequenceClassification.from_pretrained(adapter, num_labels=3)
        got = auto.eval()(**batch).logits
        base = AutoModelForSequenceClassification.from_pretrained(tiny_classifier, num_labels=3)
        explicit = PeftModel.from_pretrained(base, adapter).eval()(**batch).logits
    # trained: the head and the adapters moved away from their starting point
    assert float(expected.abs().max()) > 0
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(explicit, expected, atol=1e-5, rtol=1e-4)


def test_causal_lm_adapter_loads_with_peft(gpt2_dir: str, tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = _texts(tmp_path / "train.jsonl", 16)
    knobs: dict[str, Any] = dict(
        task="causal-lm", max_steps=2, lora_target_modules=["attention", "mlp"]
    )
    _run(gpt2_dir, data, tmp_path / "adapter", **knobs)
    _run(gpt2_dir, data, tmp_path / "merged", merge_lora=True, **knobs)
    adapter = tmp_path / "adapter" / "model"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {"c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"}
    ids = AutoTokenizer.from_pretrained(adapter)(["the cat sat"], return_tensors="pt").input_ids
    with torch.no_grad():
        got = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()(ids).logits
        expected = (
            AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / "model").eval()(ids).logits
        )
        base = AutoModelForCausalLM.from_pretrained(gpt2_dir).eval()(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert float((got - base).abs().max()) > 1e-4  # the adapters changed the model


def test_sentence_embedding_adapter_loads_with_sentence_transformers(
    tiny_classifier: str, tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    rng = random.Random(1)
    pairs = []
    for _ in range(16):
        words = rng.sample(WORDS, 6)
        pairs.append({"anchor": " ".join(words[:4]), "positive": " ".join(words[2:])})
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    knobs: dict[str, Any] = dict(task="sentence-embedding", max_steps=2)
    _run(tiny_classifier, data, tmp_path / "adapter", **knobs)
    _run(tiny_classifier, data, tmp_path / "merged", merge_lora=True, **knobs)
    adapter = tmp_path / "adapter" / "model"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "modules.json").is_file()
    assert not (tmp_path / "merged" / "model" / "adapter_config.json").exists()
    texts = ["w1 w2 w3", "w7 w13 w40 w41"]
    got = SentenceTransformer(str(adapter), device="cpu").encode(texts, convert_to_tensor=True)
    merged = SentenceTransformer(str(tmp_path / "merged" / "model"), device="cpu")
    expected = merged.encode(texts, convert_to_tensor=True)
    base = SentenceTransformer(tiny_classifier, device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert float((got - base).abs().max()) > 1e-5


# --- LoRA: the run's memory is what memfit.estimate(..., lora_rank=R) predicts -------------------
@pytest.fixture(scope="module")
def medium_classifier(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer BERT of hidden size 256 (the truth benchmark's bert-l4-h256, with the tests'
    60-word vocabulary): big enough that a step's memory is activations, not constant costs."""
    folder = tmp_path_factory.mktemp("medium-classifier")
    wide = dict(hidden_size=256, num_attention_heads=4, intermediate_size=1024)
    save_bert(folder, WORDS, layers=4, positions=512, dropout=True, **wide)
    return str(folder)


def test_lora_run_peak_matches_the_cpu_estimate(medium_classifier: str, tmp_path: Path) -> None:
    """The estimator's CPU target (5 %, tests/e2e/test_estimate_cpu_truth.py) for a real LoRA run.

    The run's step peak is counted by the memory cap (set far above the need, so it only counts):
    the bytes of every live tensor storage, weights and optimizer state included. The CPU
    estimate's total is the same quantity (its runtime overhead is 0 on the CPU). Every row is
    padded to 128 tokens so that each micro-batch has the estimate's shape. The estimate's own
    accuracy against RSS measured from outside is the truth test's ``bert-lora`` case.
    """
    import memfit

    data = _classification_data(tmp_path / "train.csv", 32)
    batch, seq_len, rank = 8, 128, 8
    out = tmp_path / "run"
    _run(
        medium_classifier,
        data,
        out,
        lora_rank=rank,
        effective_batch_size=batch,
        micro_batch_size=batch,
        max_seq_len=seq_len,
        padding="max_length",
        max_steps=3,
        probe=False,
        # the estimator's step has no clipping
        max_grad_norm=None,
        memory_cap=2**40,
    )
    # steps 2 and later: the steady state (step 1 creates AdamW's state), as the estimate
    peaks = [m["peak_bytes"] for m in _metrics(out) if m["step"] >= 2]
    assert len(set(peaks)) == 1, peaks
    measured = peaks[0]
    est = memfit.estimate(
        medium_classifier,
        task="classification",
        batch_size=batch,
        seq_len=seq_len,
        num_labels=len(LABELS),
        device="cpu",
        lora_rank=rank,
    )
    predicted = est.total_bytes - est.breakdown.get("runtime_overhead", 0)
    error = (predicted - measured) / measured
    summary = (
        f"estimated {predicted / MiB:.2f} MiB, measured {measured / MiB:.2f} MiB, "
        f"error {100 * error:+.2f} %"
    )
    print(summary)
    assert abs(error) <= 0.05, summary
    # the same adapters: what the estimate trains is what the run saved (adapters and head)
    from safetensors.torch import load_file

    saved = load_file(str(out / "model" / "adapter_model.safetensors"))
    assert sum(t.numel() for t in saved.values()) == est.details["trainable_parameters"]


# --- SageMaker: the example entry point, with the job's environment faked -------------------------
def test_sagemaker_entry_point_trains_from_the_environment(
    tiny_classifier: str, tmp_path: Path
) -> None:
    from memfit.train.sagemaker import CHECKPOINT_DIR

    if CHECKPOINT_DIR.exists():
        pytest.skip(f"{CHECKPOINT_DIR} exists here: the run would go there")
    channel = tmp_path / "input" / "data" / "train"
    channel.mkdir(parents=True)
    _classification_data(channel / "part-0.csv", 12, seed=1)
    _classification_data(channel / "part-1.csv", 12, seed=2)
    model_dir, output = tmp_path / "model", tmp_path / "output" / "data"
    model_dir.mkdir()
    output.mkdir(parents=True)
    # as the SageMaker SDK sends them: every value a JSON string
    hyperparameters = {
        "task": json.dumps("classification"),
        "model_name_or_path": json.dumps(tiny_classifier),
        "max_steps": "2",
        "effective_batch_size": "8",
        "learning_rate": "0.05",
        "device": json.dumps("cpu"),
        "lora_rank": "4",
        "merge_lora": "true",
        "sagemaker_program": json.dumps("train_entry.py"),
    }
    env = dict(
        os.environ,
        SM_CHANNEL_TRAIN=str(channel),
        SM_MODEL_DIR=str(model_dir),
        SM_OUTPUT_DATA_DIR=str(output),
        SM_HPS=json.dumps(hyperparameters),
        SM_HP_SEED="5",
        SM_HOSTS=json.dumps(["algo-1"]),
        SM_CURRENT_HOST="algo-1",
        SM_NUM_GPUS="0",
    )
    # SageMaker also appends the hyperparameters as arguments; the entry point leaves them out
    entry = ROOT / "examples" / "sagemaker" / "train_entry.py"
    done = subprocess.run(
        [sys.executable, str(entry), "--max_steps", "2", "--learning_rate", "0.05"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"model copied to {model_dir.resolve()}" in done.stdout
    # the deployable model in SM_MODEL_DIR (merged: loads without peft), the run in the output
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    assert model.config.num_labels == 3
    run = json.loads((output / "run.json").read_text())
    assert run["config"]["seed"] == 5 and run["config"]["lr"] == 0.05
    assert run["config"]["train_file"] == str(channel)
    assert run["resolved"]["train_rows"] == 24  # both files of the channel
    assert [m["step"] for m in _metrics(output)] == [1, 2]


def test_sagemaker_bad_hyperparameter_exits_2_naming_it(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        SM_MODEL_DIR=str(tmp_path / "model"),
        SM_OUTPUT_DATA_DIR=str(tmp_path / "out"),
        SM_HPS=json.dumps({"epochs": '"three"', "warmup_steps": "10"}),
    )
    entry = ROOT / "examples" / "sagemaker" / "train_entry.py"
    done = subprocess.run(
        [sys.executable, str(entry)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2
    assert "warmup_steps" in done.stderr and "'epochs'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


# --- --report-to tensorboard: the memory figures beside the loss, and the guard's events ----------
def test_tensorboard_holds_loss_memory_and_oom_events(tiny_classifier: str, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = _classification_data(tmp_path / "train.csv", 16)
    out = tmp_path / "run"
    # a cap between what micro-batch 2 and the whole batch of 8 hold: the first step backs off
    _run(
        tiny_classifier,
        data,
        out,
        lora_rank=None,
        optimizer="sgd",
        max_steps=2,
        memory_cap=400 * 1024,
        probe=False,
        report_to="tensorboard",
    )
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert any(e["type"] == "oom" for e in events)
    accumulator = EventAccumulator(str(out / "tensorboard"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    for tag in (
        "train/loss",
        "train/lr",
        "train/samples_per_second",
        "memory/peak_bytes",
        "memory/forward_peak_bytes",
        "memory/backward_peak_bytes",
        "memory/optimizer_peak_bytes",
        "guard/oom_count",
        "guard/micro_batch_size",
    ):
        assert tag in tags, (tag, sorted(tags))
    metrics = _metrics(out)
    peaks = [(e.step, e.value) for e in accumulator.Scalars("memory/peak_bytes")]
    assert peaks == [(m["step"], pytest.approx(m["peak_bytes"], rel=1e-6)) for m in metrics]
    assert accumulator.Scalars("guard/oom_count")[-1].value >= 1
    # the events themselves, as text at their step
    texts = accumulator.Tags()["tensors"]
    assert any(t.startswith("guard/oom") for t in texts), texts
    assert any(t.startswith("guard/backoff") for t in texts), texts
