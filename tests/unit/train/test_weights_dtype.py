"""``--weights-dtype`` and ``--cross-entropy`` in ``memfit train``'s setup and in the Trainer
integration (issue 32); whole runs: tests/e2e/test_train_weights_dtype.py.

- A model loads in the dtype the run asks for (:func:`memfit.train.recipes.loading.loaded_in`),
  fp32 otherwise; a LoRA base straight in its checkpoint's dtype, not loaded in fp32 and cast.
- The guard's split of a step gives the step's gradient over a bf16 base and with the fused-linear
  loss.
- ``GuardedTrainer(memfit_plan=...)`` plans the step the Trainer runs: the weights' dtypes the
  model holds, Liger's fused loss with ``use_liger_kernel``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from memfit.step import weights
from memfit.train import TrainConfig
from memfit.train.recipes import recipe_for
from memfit.train.recipes.causal_lm import CausalLMRecipe
from memfit.train.recipes.loading import checkpoint_config, loaded_in
from memfit.train.setup import RunSetup

WORDS = [f"w{i}" for i in range(40)]
TEXTS = [" ".join(WORDS[i : i + 4 + i % 7]) for i in range(0, 32, 3)]


def _llama(folder: Path, dtype: torch.dtype) -> str:
    from transformers import AutoModelForCausalLM

    from tiny_models import save_tiny_llama

    save_tiny_llama(folder, [" ".join(WORDS[i : i + 10]) for i in range(0, 40, 5)])
    if dtype != torch.float32:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dtype)
        model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _llama(tmp_path_factory.mktemp("llama-bf16"), torch.bfloat16)


@pytest.fixture(scope="module")
def llama_fp32(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _llama(tmp_path_factory.mktemp("llama-fp32"), torch.float32)


def _dtypes(model: torch.nn.Module, *, trained: bool) -> set[torch.dtype]:
    return {
        p.dtype
        for p in model.parameters()
        if p.requires_grad == trained and type(p).__name__ not in ("Params4bit", "Int8Params")
    }


def test_a_model_loads_in_the_dtype_the_run_asks_for(llama_bf16: str) -> None:
    recipe = CausalLMRecipe(llama_bf16, max_seq_len=16)
    recipe.build([])
    # outside a run's loading: fp32, whatever the checkpoint stores (the recipe's old default)
    assert _dtypes(recipe.model, trained=True) == {torch.float32}
    with loaded_in(torch.bfloat16):
        recipe.build([])
    assert _dtypes(recipe.model, trained=True) == {torch.bfloat16}
    config = checkpoint_config(llama_bf16)
    assert weights.checkpoint_dtype(config) == torch.bfloat16
    assert checkpoint_config(str(Path(llama_bf16) / "missing")) is None


def _setup(model: str, tmp_path: Path, **knobs: Any) -> tuple[RunSetup, list[dict[str, Any]]]:
    """A run's setup up to its loaded model (nothing written), and its rows."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    settings: dict[str, Any] = dict(
        task="causal-lm",
        model=model,
        train_file=str(data),
        output_dir=str(tmp_path / "out"),
        cache_dir=str(tmp_path / "cache"),
        device="cpu",
        quiet=True,
    )
    return _loaded(TrainConfig(**(settings | knobs)), data)


def _loaded(cfg: TrainConfig, data: Path) -> tuple[RunSetup, list[dict[str, Any]]]:
    """``cfg``'s run set up to its loaded model (nothing written), and the rows of ``data``."""
    recipe = recipe_for(cfg)
    rows = list(recipe.read(data))
    run = RunSetup(cfg, recipe, lock=None)
    run.join_ranks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.load_model(rows, None)
    return run, rows


def test_a_lora_base_loads_in_its_checkpoints_dtype(
    llama_bf16: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("peft")
    from memfit.train import setup

    # no casting after the load: what is bf16 was loaded so
    monkeypatch.setattr(setup.weights, "place_weights", lambda *a, **k: None)
    run, _ = _setup(llama_bf16, tmp_path, lora_rank=4)
    assert _dtypes(run.model, trained=False) == {torch.bfloat16}
    assert (run.frozen_dtype, run.trainable_dtype) == (torch.bfloat16, torch.float32)


def test_qlora_holds_its_unquantized_layers_in_the_frozen_dtype(
    llama_bf16: str, tmp_path: Path
) -> None:
    """peft's k-bit preparation upcasts them to fp32; the run holds them in bf16 again (before
    any plan: under autocast on a GPU nothing else would)."""
    pytest.importorskip("bitsandbytes")
    run, _ = _setup(llama_bf16, tmp_path, lora_rank=4, quantization="nf4")
    assert _dtypes(run.model, trained=False) == {torch.bfloat16}
    assert _dtypes(run.model, trained=True) == {torch.float32}


@pytest.mark.parametrize(
    ("given", "planned", "ran"),
    [
        (None, "fused-linear", "fused-linear"),  # the plan's choice, when the run names none
        ("standard", "fused-linear", "standard"),  # what the run names wins
        (None, None, "standard"),
    ],
)
def test_the_run_computes_the_loss_it_was_given_or_planned(
    llama_fp32: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    given: str | None,
    planned: str | None,
    ran: str,
) -> None:
    from memfit.train import setup

    chosen = {"cross_entropy": planned} if planned else {}
    monkeypatch.setattr(setup, "plan_knobs", lambda *a, **k: {"source": "test", "plan": chosen})
    run, _ = _setup(llama_fp32, tmp_path, cross_entropy=given)
    run.plan()
    assert run.recipe.cross_entropy == ran
    said = run.cross_entropy_ran()
    assert said is not None and said["kind"] == ran
    assert ("implementation" in said) == (ran == "fused-linear")


def _gradients(run: RunSetup, rows: list[dict[str, Any]], splits: list[int]) -> list[torch.Tensor]:
    """The gradients of the trained weights after the step's rows ran as chunks of ``splits``
    rows, each loss over the whole step's units (the guard's weighting)."""
    model, recipe = run.model, run.recipe
    model.zero_grad(set_to_none=True)
    units, start = recipe.units(rows), 0
    for size in splits:
        recipe.loss(rows[start : start + size], units).backward()
        start += size
    return [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize(
    ("model", "knobs", "rtol"),
    [
        # a bf16 base under fp32 adapters: the rows' bf16 activations do not depend on the
        # chunk, the adapters' gradients add up in fp32
        ("llama_bf16", {"lora_rank": 4}, 1e-2),
        ("llama_fp32", {"cross_entropy": "fused-linear"}, 1e-5),
    ],
)
def test_a_split_step_has_the_whole_steps_gradient(
    model: str,
    knobs: dict[str, Any],
    rtol: float,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    if knobs.get("lora_rank"):
        pytest.importorskip("peft")
    run, rows = _setup(request.getfixturevalue(model), tmp_path, **knobs)
    run.recipe.cross_entropy = knobs.get("cross_entropy", "standard")
    run.model.eval()  # no dropout: the same function of the rows either way
    rows = rows[:6]
    whole = _gradients(run, rows, [6])
    split = _gradients(run, rows, [1, 2, 3])
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(b, a, rtol=rtol, atol=rtol * float(a.abs().max()))


# --- the Trainer integration -----------------------------------------------------------------


def _args(tmp_path: Path, **fields: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **fields)


def test_the_trainers_step_knobs_are_read_from_the_model_and_its_arguments(
    llama_bf16: str, llama_fp32: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from memfit.integrations.trainer import step_knobs

    args = _args(tmp_path)
    bf16 = AutoModelForCausalLM.from_pretrained(llama_bf16, dtype=torch.bfloat16)
    # the Trainer trains a model loaded in bf16 in bf16: pure 16-bit training
    assert step_knobs(bf16, args) == {"weights_dtype": "bf16"}
    fp32 = AutoModelForCausalLM.from_pretrained(llama_bf16, dtype=torch.float32)
    assert step_knobs(fp32, args) == {"weights_dtype": "auto"}
    liger = _args(tmp_path, use_liger_kernel=True)
    assert step_knobs(fp32, liger) == {"weights_dtype": "auto", "cross_entropy": "fused-linear"}
    off = _args(
        tmp_path, use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": False}
    )
    assert "cross_entropy" not in step_knobs(fp32, off)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        classifier = AutoModelForSequenceClassification.from_pretrained(
            llama_fp32, num_labels=2, dtype=torch.float32
        )
    assert "cross_entropy" not in step_knobs(classifier, liger)  # Liger's loss is a causal LM's


def test_the_trainers_lora_base_is_auto_in_the_checkpoints_dtype_and_fp32_in_fp32(
    llama_bf16: str, llama_fp32: str, tmp_path: Path
) -> None:
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from memfit.integrations.trainer import step_knobs

    args = _args(tmp_path)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    # peft keeps the adapters in fp32 over a bf16 base
    base = AutoModelForCausalLM.from_pretrained(llama_bf16, dtype=torch.bfloat16)
    model = get_peft_model(base, lora)
    assert _dtypes(model, trained=True) == {torch.float32}
    assert step_knobs(model, args) == {"weights_dtype": "auto"}
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(llama_bf16, dtype=torch.float32), lora
    )
    assert step_knobs(model, args) == {"weights_dtype": "fp32"}
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(llama_fp32), lora)
    assert step_knobs(model, args) == {"weights_dtype": "auto"}


def test_memfit_plan_gets_the_trainers_step_knobs(
    llama_bf16: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    from memfit.integrations import trainer

    seen: dict[str, Any] = {}

    def plan(args: Any, model: Any, **options: Any) -> Any:
        seen.update(options)
        raise RuntimeError("planned")

    monkeypatch.setattr(trainer, "apply_plan", plan)
    model = AutoModelForCausalLM.from_pretrained(llama_bf16, dtype=torch.bfloat16)
    args = _args(tmp_path, use_liger_kernel=True)
    with pytest.raises(RuntimeError, match="planned"):
        trainer.plan_trainer_arguments((model, args), {}, {"seq_len": 64})
    assert seen == {"seq_len": 64, "weights_dtype": "bf16", "cross_entropy": "fused-linear"}
    # what the request names wins
    with pytest.raises(RuntimeError, match="planned"):
        trainer.plan_trainer_arguments((model, args), {}, {"seq_len": 64, "weights_dtype": "auto"})
    assert seen["weights_dtype"] == "auto"


@pytest.mark.slow  # builds a sentence-transformers folder and imports sentence-transformers
def test_a_sentence_transformer_loads_in_the_runs_dtype(
    bert_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sentence-transformers loads its Transformer module with ``model_kwargs``: a bf16 encoder
    loads in fp32 to be trained whole (auto), its base stays bf16 under LoRA with fp32 adapters,
    and a step runs over it."""
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("peft")
    from transformers import DistilBertConfig, DistilBertModel, DistilBertTokenizerFast

    from memfit.train import setup
    from tiny_models import save_sentence_transformer

    encoder = tmp_path / "encoder"
    DistilBertTokenizerFast.from_pretrained(bert_dir).save_pretrained(encoder)
    config = DistilBertConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=64
    )
    DistilBertModel(config).to(torch.bfloat16).save_pretrained(encoder)
    folder = tmp_path / "st"
    save_sentence_transformer(folder, encoder, max_seq_length=16)
    data = tmp_path / "pairs.jsonl"
    pairs = [("the cat sat", "a cat sat"), ("a dog", "the dog")]
    data.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n" for a, p in pairs))

    def load(**knobs: Any) -> tuple[RunSetup, list[dict[str, Any]]]:
        cfg = TrainConfig(
            task="sentence-embedding",
            model=str(folder),
            train_file=str(data),
            output_dir=str(tmp_path / "out"),
            cache_dir=str(tmp_path / "cache"),
            device="cpu",
            quiet=True,
            **knobs,
        )
        return _loaded(cfg, data)

    with monkeypatch.context() as patch:
        # no casting after the load: what is fp32 was loaded so (sentence-transformers alone
        # would load the checkpoint's bf16)
        patch.setattr(setup.weights, "place_weights", lambda *a, **k: None)
        run, _ = load()
        assert _dtypes(run.model, trained=True) == {torch.float32}
    run, rows = load(lora_rank=4)
    assert _dtypes(run.model, trained=False) == {torch.bfloat16}
    assert _dtypes(run.model, trained=True) == {torch.float32}
    run.recipe.loss(rows, len(rows)).backward()
    assert all(p.grad is not None for p in run.model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("given", "planned", "ran"), [("fused-linear", None, None), (None, "fused-linear", "standard")]
)
def test_a_head_the_fused_loss_cannot_compute_is_refused_when_given_and_left_when_planned(
    llama_fp32: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    given: str | None,
    planned: str | None,
    ran: str | None,
) -> None:
    """A head that scales its logits (Granite's logits_scaling): --cross-entropy fused-linear is
    one line before anything is written; the plan's own choice falls back to the standard loss."""
    from memfit.errors import UsageError
    from memfit.train import setup

    chosen = {"cross_entropy": planned} if planned else {}
    monkeypatch.setattr(setup, "plan_knobs", lambda *a, **k: {"source": "test", "plan": chosen})
    run, _ = _setup(llama_fp32, tmp_path, cross_entropy=given)
    run.model.config.logits_scaling = 4.0
    if ran is None:
        with pytest.raises(UsageError, match=r"--cross-entropy fused-linear.*logits_scaling"):
            run.plan()
        assert not (tmp_path / "out").exists()
    else:
        run.plan()
        assert run.recipe.cross_entropy == ran
