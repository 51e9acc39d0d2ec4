"""QLoRA's pieces in `memfit train`: the flags, the missing package as one line, the quantized
load, the adapters-only checkpoint, bitsandbytes' optimizers and --merge-lora into an
unquantized copy of the base (the whole run: tests/e2e/test_train_qlora.py)."""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.cli import main
from memfit.train.config import TrainConfig, config_problems

pytest.importorskip("peft")
WORDS = [f"w{i}" for i in range(40)]
SENTENCES = [" ".join(WORDS[i : i + 8]) for i in range(0, 32, 4)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import save_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(folder, SENTENCES, chat_template=None)
    return str(folder)


def _config(model: str, tmp_path: Path, **knobs: Any) -> TrainConfig:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"text": "{s}"}}\n' for s in SENTENCES))
    settings: dict[str, Any] = dict(
        task="causal-lm",
        model=model,
        train_file=str(data),
        output_dir=str(tmp_path / "out"),
        lora_rank=8,
        quantization="nf4",
        device="cpu",
    )
    return TrainConfig(**(settings | knobs))


def _train_cli(model: str, tmp_path: Path, *extra: str) -> tuple[int, Path]:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"text": "{s}"}}\n' for s in SENTENCES))
    out = tmp_path / "out"
    args = ["train", "--task", "causal-lm", "--model", model, "--train-file", str(data)]
    args += ["--output-dir", str(out), "--device", "cpu", *extra]
    with pytest.raises(SystemExit) as done:
        main(args)
    return int(done.value.code or 0), out


def test_train_help_lists_the_quantization_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with contextlib.suppress(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--quantization" in text and "nf4" in text and "--double-quant" in text


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--lora-rank", "8", "--quantization", "nf4"], "--quantization nf4"),
        (["--lora-rank", "8", "--quantization", "int8"], "--quantization int8"),
        (["--optimizer", "adamw-8bit"], "--optimizer adamw-8bit"),
        (["--optimizer", "paged-adamw-8bit"], "--optimizer paged-adamw-8bit"),
        (["--optimizer", "paged-adamw-32bit"], "--optimizer paged-adamw-32bit"),
    ],
)
def test_without_bitsandbytes_one_line_and_nothing_written(
    llama: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    flag: str,
) -> None:
    # the package missing: `import bitsandbytes` raises ImportError, as where it is not installed
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    code, out = _train_cli(llama, tmp_path, *extra)
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err and "pip install 'memfit[quantization]'" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_quantization_needs_lora_and_a_task_it_runs(llama: str, tmp_path: Path) -> None:
    problems = config_problems(_config(llama, tmp_path, lora_rank=None))
    assert any(p.startswith("--quantization nf4: only with --lora-rank") for p in problems)
    problems = config_problems(_config(llama, tmp_path, task="sentence-embedding"))
    assert any("QLoRA is built for causal-lm and classification" in p for p in problems)
    problems = config_problems(_config(llama, tmp_path, quantization="int8", double_quant=True))
    assert any(
        p.startswith("--double-quant: only with --quantization nf4 or fp4") for p in problems
    )
    assert config_problems(_config(llama, tmp_path, double_quant=True)) == []


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        (
            {"quantization": "nf4", "double_quant": True},
            {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
        ),
        (
            {"quantization": "fp4", "precision": "bf16"},
            {
                "load_in_4bit": True,
                "bnb_4bit_quant_type": "fp4",
                "bnb_4bit_use_double_quant": False,
            },
        ),
        ({"quantization": "int8"}, {"load_in_8bit": True, "load_in_4bit": False}),
    ],
)
def test_load_options_follow_the_flags(
    llama: str, tmp_path: Path, knobs: dict[str, Any], expected: dict[str, Any]
) -> None:
    pytest.importorskip("bitsandbytes")
    from memfit.train.quantization import load_options

    options = load_options(_config(llama, tmp_path, **knobs), torch.device("cpu"))
    settings = options["quantization_config"]
    for key, value in expected.items():
        assert getattr(settings, key) == value, key
    # the compute dtype is --precision's, fp32 when none; the unquantized layers load in it too
    dtype = torch.bfloat16 if knobs.get("precision") == "bf16" else torch.float32
    assert options["dtype"] == dtype
    if settings.load_in_4bit:
        assert settings.bnb_4bit_compute_dtype == dtype
    assert options["device_map"] == {"": "cpu"}


def test_model_options_reach_model_loads_only(llama: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from memfit.train.recipes.loading import _loads_a_model, load_pretrained, model_options

    assert _loads_a_model(AutoModelForCausalLM.from_pretrained)
    assert _loads_a_model(LlamaForCausalLM.from_pretrained)
    assert not _loads_a_model(AutoTokenizer.from_pretrained)
    assert not _loads_a_model(AutoConfig.from_pretrained)
    with model_options({"dtype": torch.float64}):
        model = load_pretrained(AutoModelForCausalLM.from_pretrained, llama)
        tokenizer = load_pretrained(AutoTokenizer.from_pretrained, llama)
    assert next(model.parameters()).dtype == torch.float64
    assert tokenizer("w1 w2")["input_ids"]
    after = load_pretrained(AutoModelForCausalLM.from_pretrained, llama)
    assert next(after.parameters()).dtype == torch.float32  # the options end with the block


def _qlora_model(llama: str, tmp_path: Path, **knobs: Any) -> Any:
    """The tiny Llama loaded as a QLoRA run loads it: quantized, prepared, with adapters."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from memfit.estimate.workload import StepSpec, with_lora
    from memfit.train.quantization import prepare, quantized_loading
    from memfit.train.recipes.loading import load_pretrained

    cfg = _config(llama, tmp_path, **knobs)
    with quantized_loading(cfg, torch.device("cpu")):
        model = load_pretrained(AutoModelForCausalLM.from_pretrained, llama)
    torch.manual_seed(0)
    return with_lora(prepare(model, cfg), StepSpec(task="causal-lm", lora_rank=8))


@pytest.mark.parametrize("quantization", ["nf4", "fp4", "int8"])
def test_the_base_loads_quantized_and_only_adapters_train(
    llama: str, tmp_path: Path, quantization: str
) -> None:
    from memfit.train.quantization import holds_quantized_weights

    model = _qlora_model(llama, tmp_path, quantization=quantization)
    assert holds_quantized_weights(model)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name for name in trained)
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_checkpoint_holds_the_adapters_and_resumes_them(llama: str, tmp_path: Path) -> None:
    from safetensors import safe_open

    from memfit.train import checkpoint as ck
    from memfit.train.optim import make_optimizer
    from memfit.train.quantization import trained_state

    model = _qlora_model(llama, tmp_path)
    optimizer = make_optimizer("paged-adamw-8bit", model, 1e-2, 0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in trained_state(model).items()}
    moments = copy.deepcopy(optimizer.state_dict()["state"])
    path = ck.write_checkpoint(
        tmp_path / "ckpt", 1, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None,
        state={"epoch": 0},
    )  # fmt: skip
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        # the adapters only: the quantized base is reloaded from --model on resume
        assert set(handle.keys()) == set(saved)
        assert handle.metadata()[ck.WEIGHTS_KIND] == ck.TRAINED_ONLY

    fresh = _qlora_model(llama, tmp_path)
    fresh_optimizer = make_optimizer("paged-adamw-8bit", fresh, 1e-2, 0.0)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda step: 1.0)
    ck.read_checkpoint(
        path, model=fresh, optimizer=fresh_optimizer, scheduler=fresh_scheduler, scaler=None,
        device=torch.device("cpu"),
    )  # fmt: skip
    for name, tensor in trained_state(fresh).items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    # bitsandbytes' state (its quantized moments and their scales), as it was
    torch.testing.assert_close(fresh_optimizer.state_dict()["state"], moments, rtol=0, atol=0)


def test_a_checkpoint_of_other_adapters_is_refused(llama: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from memfit.train import checkpoint as ck
    from memfit.train.quantization import load_trained_state, trained_state

    model = _qlora_model(llama, tmp_path)
    state = trained_state(model)
    name = next(iter(state))
    with pytest.raises(ValueError, match="not this run's"):
        load_trained_state(model, {k: v for k, v in state.items() if k != name})
    file = tmp_path / "model.safetensors"
    save_file({"other.weight": torch.zeros(2)}, str(file), metadata={ck.WEIGHTS_KIND: "trained"})
    with pytest.raises(ValueError, match="unexpected"):
        ck._load_weights(model, file, torch.device("cpu"))


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("adamw-8bit", "AdamW8bit"),
        ("paged-adamw-8bit", "PagedAdamW8bit"),
        ("paged-adamw-32bit", "PagedAdamW32bit"),
    ],
)
def test_bitsandbytes_optimizers_step_on_the_cpu(name: str, cls: str) -> None:
    pytest.importorskip("bitsandbytes")
    from memfit.train.optim import make_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.LayerNorm(64))
    optimizer = make_optimizer(name, model, 1e-2, 0.1)
    assert type(optimizer).__name__ == cls
    # no weight decay on biases and norms, as for every optimizer
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    before = model[0].weight.detach().clone()
    model(torch.randn(4, 128)).pow(2).sum().backward()
    optimizer.step()
    assert not torch.equal(before, model[0].weight.detach())


def test_merge_lora_of_a_quantized_base_merges_into_the_unquantized_weights(
    llama: str, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from memfit.train.quantization import holds_quantized_weights, merged_unquantized

    model = _qlora_model(llama, tmp_path)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # trained adapters: B is no longer zero
    merged = merged_unquantized(model, llama)
    assert not holds_quantized_weights(merged)
    assert getattr(merged.config, "quantization_config", None) is None
    base = load_file(str(Path(llama) / "model.safetensors"))
    adapters = dict(model.named_parameters())
    scaling = 2.0  # memfit's alpha is 2·r
    merged_state = merged.state_dict()
    targets = [k for k in merged_state if k.endswith(("q_proj.weight", "v_proj.weight"))]
    assert targets
    for key in targets:
        prefix = "base_model.model." + key.removesuffix(".weight")
        a = adapters[f"{prefix}.lora_A.default.weight"].detach()
        b = adapters[f"{prefix}.lora_B.default.weight"].detach()
        # the original weights plus the update, not the 4-bit ones
        torch.testing.assert_close(merged_state[key], base[key] + scaling * b @ a)
    untouched = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(merged_state[untouched], base[untouched], rtol=0, atol=0)


def test_an_eval_between_steps_keeps_the_gradient_through_the_base(
    llama: str, tmp_path: Path
) -> None:
    # bitsandbytes repacks 4-bit weights for a CPU inference kernel without a backward at the
    # first eval-mode forward (on CPUs with AVX512-BF16); a QLoRA run must train on after evals
    model = _qlora_model(llama, tmp_path)
    model.train()
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same LoRA dropout masks
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    before = gradients()
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    after = gradients()
    assert before.keys() == after.keys()
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad, rtol=0, atol=0)


def test_a_classifier_keeps_its_head_unquantized(bert_dir: str, tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForSequenceClassification

    from memfit.train.quantization import holds_quantized_weights, prepare, quantized_loading
    from memfit.train.recipes.loading import load_pretrained

    cfg = _config(bert_dir, tmp_path, task="classification")
    with quantized_loading(cfg, torch.device("cpu")):
        model = load_pretrained(
            AutoModelForSequenceClassification.from_pretrained, bert_dir, num_labels=2
        )
    # the encoder's layers are 4-bit; the head, trained whole from random, is not
    assert holds_quantized_weights(model.bert.encoder)
    assert not holds_quantized_weights(model.classifier)
    prepare(model, cfg)


def test_a_classifier_head_that_would_be_quantized_is_refused(
    bert_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForSequenceClassification

    from memfit.errors import UsageError
    from memfit.train import quantization
    from memfit.train.recipes.loading import load_pretrained

    # a head under a name QLoRA does not know: quantized with the rest
    monkeypatch.setattr(quantization, "CLASSIFIER_HEADS", ("unknown_head",))
    cfg = _config(bert_dir, tmp_path, task="classification")
    with quantization.quantized_loading(cfg, torch.device("cpu")):
        model = load_pretrained(
            AutoModelForSequenceClassification.from_pretrained, bert_dir, num_labels=2
        )
    with pytest.raises(UsageError, match=r"^--quantization: this model's classification head"):
        quantization.prepare(model, cfg)


def test_the_plan_counts_the_quantized_base(
    llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memfit.errors import UsageError
    from memfit.train import setup
    from memfit.train.setup import plan_knobs

    asked: dict[str, Any] = {}

    def plan(model: str, **options: Any) -> Any:
        asked.update(options)
        raise UsageError("stop here")

    monkeypatch.setattr(setup, "plan", plan)
    cfg = _config(llama, tmp_path, quantization="fp4", double_quant=True, gpu_memory=1 << 30)
    assert plan_knobs(cfg, torch.device("cpu"))["source"] == "not planned: stop here"
    assert (asked["lora_rank"], asked["quantization"], asked["double_quant"]) == (8, "fp4", True)
