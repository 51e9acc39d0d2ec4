"""QLoRA in ``memfit train``: LoRA adapters trained on a base whose frozen weights bitsandbytes
holds quantized (``--quantization nf4|fp4|int8``, ``--double-quant``), and bitsandbytes'
optimizers (``--optimizer adamw-8bit|paged-adamw-8bit|paged-adamw-32bit``).

The base loads through transformers' ``BitsAndBytesConfig`` (4-bit NF4/FP4 blocks, their scales
quantized again with ``--double-quant``; or LLM.int8(): the settings the estimate traces, from
:meth:`memfit.levers.quantization.Quantization.bnb_settings`), straight onto the run's device (CUDA,
else the CPU: bitsandbytes 0.50 runs 4-bit and 8-bit layers there). The matmuls dequantize to
the compute dtype, which is ``--precision`` (bf16/fp16; fp32 when not given, and always on the CPU, where
memfit trains in fp32 without autocast, as every CPU run does). The layers left unquantized (the
embeddings, norms, the LM head) are frozen weights: they load in the frozen dtype of
``--weights-dtype`` (:mod:`memfit.step.weights`; under ``auto`` the checkpoint's, bf16 for today's
decoders). peft's ``prepare_model_for_kbit_training`` then freezes the base and upcasts what is left
in half precision to fp32, :func:`memfit.train.lora.add_lora` puts the same adapters on it as on
an unquantized base, and the run holds the frozen weights in the frozen dtype again and the
trained ones (adapters, a classifier's head) in the trained dtype
(:meth:`memfit.train.setup.RunSetup.load_model`).

What a QLoRA run writes:

- ``DIR/model``: the peft adapter folder (adapters only; the quantized base is never saved). It
  loads with ``PeftModel.from_pretrained(base, folder)`` on the original (unquantized) base folder,
  or on the same base loaded quantized again.
- ``--merge-lora``: the adapters merged into an **unquantized** copy of the base, read again from
  ``--model`` (in the dtype the run loaded its unquantized layers in), on the CPU: a plain folder
  that loads without peft or bitsandbytes. It is the model that QLoRA's adapters are meant to be
  deployed on (the original weights plus the update); merging into the 4-bit weights instead
  would quantize the update away, and a 4-bit folder needs bitsandbytes to load. The copy costs
  host memory of the unquantized model at each save of ``DIR/model`` (and ``DIR/best``).
- checkpoints: the trained parameters only (adapters, and a classifier's head) with the optimizer
  state; a resume loads the quantized base from ``--model`` again and puts them on it
  (:mod:`memfit.train.checkpoint`).

Without bitsandbytes, ``--quantization`` and bitsandbytes' optimizers are one line naming the flag
and the install line (exit 2), before anything is loaded or written.
"""

from __future__ import annotations

import copy
import importlib
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import BitsAndBytesConfig

from memfit import quiet
from memfit.errors import UsageError
from memfit.estimate.workload import PEFT_HEAD_NAMES, lora_head_modules
from memfit.levers.quantization import LEVER as QUANTIZATION
from memfit.levers.quantization import QUANTIZATIONS
from memfit.step.weights import QUANTIZED_PARAMETERS
from memfit.train.recipes.loading import load_pretrained, model_options

# the extra that installs a package memfit needs for a flag
INSTALL = {"bitsandbytes": "pip install 'memfit[quantization]'"}
# bitsandbytes' quantized layers
QUANTIZED_LAYERS = ("Linear4bit", "Linear8bitLt", "LinearNF4", "LinearFP4")
# the tasks whose models load through transformers' from_pretrained (sentence-transformers loads
# its own modules)
QUANTIZABLE_TASKS = ("causal-lm", "classification")
# the names of sequence classifiers' heads (BERT's and RoBERTa's classifier, GPT-2's and Llama's
# score, DistilBERT's pre_classifier), left unquantized
CLASSIFIER_HEADS = (*PEFT_HEAD_NAMES, "pre_classifier")
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def quantized(cfg: Any) -> bool:
    """Whether the run quantizes its base (``--quantization`` other than none)."""
    return cfg.quantization not in (None, "none")


def import_quietly(package: str) -> Any:
    """``import package``, without the lines its import logs that say nothing to the user
    (:mod:`memfit.quiet`: bitsandbytes says on CPUs with AVX512-BF16 that an optional faster
    kernel package is missing); anything else it logs shows."""
    quiet.install()
    return importlib.import_module(package)


def package_problem(package: str, what: str) -> str | None:
    """The one line for ``what`` (a flag and its value) when ``package`` does not import here."""
    try:
        import_quietly(package)
    except Exception:
        install = INSTALL.get(package, f"pip install {package}")
        return f"{what} needs {package}, which does not import here: {install}"
    return None


def quantization_problems(cfg: Any) -> list[str]:
    """What keeps ``--quantization`` from running here, before anything is loaded or written (a
    value not in the list and the LoRA/4-bit checks are the job's, :meth:`memfit.job.Job.problems`)."""
    if not quantized(cfg) or cfg.quantization not in QUANTIZATIONS:
        return []
    problems: list[str] = []
    if cfg.task not in QUANTIZABLE_TASKS and cfg.task is not None:
        problems.append(
            f"--quantization: QLoRA is built for {' and '.join(QUANTIZABLE_TASKS)}; "
            f"{cfg.task} trains its LoRA adapters on the unquantized model (leave "
            "--quantization out)"
        )
    missing = package_problem("bitsandbytes", f"--quantization {cfg.quantization}")
    if missing is not None:
        problems.append(missing)
    return problems


def compute_dtype(cfg: Any) -> torch.dtype:
    """The dtype the quantized matmuls compute in and the unquantized layers load in: --precision
    (bf16/fp16), fp32 when not given."""
    return COMPUTE_DTYPES[cfg.precision or "fp32"]


def load_options(
    cfg: Any, device: torch.device, weights_dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """``from_pretrained``'s keywords for the quantized base of ``cfg`` on ``device``; the layers
    left unquantized load in ``weights_dtype`` (the frozen dtype; None: the compute dtype)."""
    assert cfg.quantization in QUANTIZATIONS and quantized(cfg), cfg.quantization
    dtype = compute_dtype(cfg)
    # transformers keeps a causal LM's output head unquantized by itself; a classifier's head is
    # trained whole (it starts random), so it must stay unquantized too (checked in prepare)
    skip = list(CLASSIFIER_HEADS) if cfg.task == "classification" else None
    # the settings the estimate traces the quantized model with (memfit.estimate.quantized)
    settings = BitsAndBytesConfig(
        **QUANTIZATION.bnb_settings(QUANTIZATION.values(cfg), dtype, skip)
    )
    if device.type == "cuda":
        place: Any = device.index if device.index is not None else torch.cuda.current_device()
    else:
        place = device.type
    # quantized as the weights load, straight onto the run's device: the unquantized base never
    # takes the device's memory (a quantized model is not moved afterwards)
    return {
        "quantization_config": settings,
        "dtype": weights_dtype or dtype,
        "device_map": {"": place},
    }


@contextmanager
def quantized_loading(
    cfg: Any, device: torch.device, weights_dtype: torch.dtype | None = None
) -> Iterator[None]:
    """While active, the recipe's model loads quantized (nothing when ``cfg`` does not ask), its
    unquantized layers in ``weights_dtype`` (None: the compute dtype)."""
    if not quantized(cfg):
        yield
        return
    import_quietly("bitsandbytes")
    with model_options(load_options(cfg, device, weights_dtype)):
        yield


def prepare(model: nn.Module, cfg: Any) -> nn.Module:
    """peft's preparation of a quantized model for training: the base frozen, its half-precision
    leftovers in fp32, gradient checkpointing (non-reentrant, as memfit's own) if asked."""
    from peft import prepare_model_for_kbit_training  # optional: memfit[quantization]

    if cfg.task == "classification":
        held = [
            name
            for name in lora_head_modules(model)
            if has_quantized_layers(model.get_submodule(name))
        ]
        if held:
            raise UsageError(
                f"--quantization: this model's classification head ({', '.join(held)}) is not "
                f"one QLoRA keeps unquantized ({', '.join(CLASSIFIER_HEADS)}), and a head is "
                "trained whole; train it without --quantization"
            )
    with warnings.catch_warnings():
        # transformers 5 renamed gradient checkpointing; peft still calls the old names
        warnings.simplefilter("ignore", FutureWarning)
        prepared: nn.Module = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=bool(cfg.gradient_checkpointing),
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    for module in prepared.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            # on a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit layer's weights in place
            # for its inference kernel the first time the layer runs in eval mode without
            # gradients (a run's evals); that kernel has no backward, so the steps after an
            # eval would lose the gradient through the base, and it computes in bf16 (and fails
            # on layers narrower than a block): a training run keeps the layout it trains with
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010 (not typed)
    # LLM.int8() on the CPU casts fp32 inputs to fp16 and warns at every matmul: it is the method
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")
    return prepared


def holds_quantized_weights(model: nn.Module) -> bool:
    """Whether bitsandbytes holds some of the model's weights quantized."""
    return any(type(p).__name__ in QUANTIZED_PARAMETERS for p in model.parameters())


def has_quantized_layers(module: nn.Module) -> bool:
    """Whether ``module`` holds bitsandbytes layers (a head new to the checkpoint is one with
    weights left unquantized, which cannot run)."""
    return any(type(m).__name__ in QUANTIZED_LAYERS for m in module.modules())


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters a QLoRA run trains (adapters, a classifier's head), by their names in the
    model's state dict: what its checkpoints hold."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_trained_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put a checkpoint's trained parameters (:func:`trained_state`) back into ``model``; a
    checkpoint that lacks one of them or holds others is an error (a damaged or foreign one)."""
    wanted = set(trained_state(model))
    missing, extra = sorted(wanted - state.keys()), sorted(state.keys() - wanted)
    if missing or extra:
        raise ValueError(
            f"the checkpoint's trained parameters are not this run's (missing {missing[:3]}, "
            f"unexpected {extra[:3]})"
        )
    with torch.no_grad():
        named = dict(model.named_parameters())
        for name, tensor in state.items():
            named[name].copy_(tensor)


def merged_unquantized(model: Any, base: str) -> nn.Module:
    """The adapters of the peft model ``model`` merged into an unquantized copy of the base in
    folder (or Hub id) ``base``, on the CPU (see the module docstring: the --merge-lora decision)."""
    from peft import PeftModel  # optional: memfit[quantization]

    inner = model.get_base_model()
    # the run's config (a classifier's labels included), without what made it load quantized
    config = copy.deepcopy(inner.config)
    for key in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, key):
            delattr(config, key)
    dtype = getattr(config, "dtype", None) or torch.float32
    with tempfile.TemporaryDirectory(prefix="memfit-adapter-") as adapter:
        # the adapter folder as it is saved, read back by peft onto the unquantized base
        model.save_pretrained(adapter)
        plain = load_pretrained(
            type(inner).from_pretrained,
            base,
            config=config,
            dtype=dtype,
            # a classifier whose head the run replaced: the trained head comes with the adapters
            ignore_mismatched_sizes=True,
        )
        merged: nn.Module = PeftModel.from_pretrained(plain, adapter).merge_and_unload()
    return merged
