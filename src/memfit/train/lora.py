"""LoRA in ``memfit train``: the adapters the estimator counts, saved as a peft adapter folder.

Which modules get adapters is decided in one place, :func:`memfit.estimate.workload.lora_config`
(a table per architecture, ``--lora-target-modules`` to override), so ``memfit estimate
--lora-rank``, the planner's ``lora`` lever and the training run describe the same adapters.

``DIR/model`` (and ``DIR/best``) is a peft adapter folder by default: ``adapter_config.json`` and
``adapter_model.safetensors`` (the adapters, plus a classifier's head, which starts random and is
trained whole) beside the tokenizer. It loads with ``peft.AutoPeftModelFor…`` or
``PeftModel.from_pretrained(base, folder)``; a sentence-transformers folder loads with
``SentenceTransformer(folder)``. ``--merge-lora`` saves the merged model instead: a plain folder
that loads without peft (and that ``memfit predict`` reads).

QLoRA (``--quantization``) puts the same adapters on a base that bitsandbytes holds quantized;
what differs (loading, checkpoints, ``--merge-lora`` into an unquantized copy of the base) is in
:mod:`memfit.train.quantization`.
"""

from __future__ import annotations

import copy
import importlib.metadata
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import transformers
from packaging.version import InvalidVersion, Version
from torch import nn

from memfit.errors import UsageError
from memfit.estimate.workload import StepSpec, lora_config, with_lora
from memfit.extras import require
from memfit.levers.lora import LORA_DROPOUT
from memfit.train.quantization import (
    holds_quantized_weights,
    merged_unquantized,
    quantization_problems,
)


def lora_problems(cfg: Any) -> list[str]:
    """What is wrong with the LoRA flags, before anything is loaded."""
    problems: list[str] = []
    if cfg.lora_rank is not None and (
        isinstance(cfg.lora_rank, bool) or not isinstance(cfg.lora_rank, int) or cfg.lora_rank < 0
    ):
        problems.append(f"--lora-rank: must be a whole number ≥ 0, got {cfg.lora_rank!r}")
    elif not cfg.lora_rank:
        if cfg.lora_target_modules:
            problems.append("--lora-target-modules: only with --lora-rank R (LoRA adapters)")
        if cfg.merge_lora:
            problems.append("--merge-lora: only with --lora-rank R (LoRA adapters)")
    elif cfg.task == "sentence-embedding":
        problem = peft_integration_problem()
        if problem:
            problems.append(problem)
    # QLoRA's own (the package, the task); its need of --lora-rank is the job's check
    problems.extend(quantization_problems(cfg))
    return problems


def peft_integration_problem() -> str | None:
    """Why transformers' own PEFT integration would refuse the installed peft, or None.

    LoRA on a sentence-transformers model goes through it (``add_adapter``, and loading the
    adapter folder back), and transformers raises a bare ValueError there when peft is older than
    its ``MIN_PEFT_VERSION`` (transformers 5.24 wants peft 0.22): said up front instead.
    """
    try:
        installed = importlib.metadata.version("peft")
        # optional: a transformers without the constant has no such check
        from transformers.integrations.peft import MIN_PEFT_VERSION
    except (importlib.metadata.PackageNotFoundError, ImportError):
        return None  # no peft: the extra's own line; no such constant: no such check
    try:
        too_old = Version(installed) < Version(str(MIN_PEFT_VERSION))
    except InvalidVersion:
        return None
    if not too_old:
        return None
    return (
        f"--lora-rank: LoRA on a sentence-transformers model goes through transformers' PEFT "
        f"integration, and transformers {transformers.__version__} accepts peft "
        f"{MIN_PEFT_VERSION} or newer, not the installed {installed}: pip install -U "
        f"'peft>={MIN_PEFT_VERSION}', or a transformers release that accepts peft {installed}"
    )


@contextmanager
def _quiet_peft() -> Iterator[None]:
    with warnings.catch_warnings():
        # peft asks transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        # peft switches fan_in_fan_out on by itself for GPT-2's Conv1D, and says so
        warnings.filterwarnings("ignore", message="fan_in_fan_out", category=UserWarning)
        yield


def add_lora(recipe: Any, cfg: Any) -> None:
    """Put LoRA adapters of rank ``cfg.lora_rank`` on the recipe's model (before it moves to its
    device): the base is frozen, only the adapters (and a classifier's head) train."""
    require("peft", "--lora-rank")
    targets = tuple(cfg.lora_target_modules or ())
    # --lora-dropout, else peft's usual 0.1: the estimator traces the same dropout modules
    dropout = LORA_DROPOUT if cfg.lora_dropout is None else cfg.lora_dropout
    with _quiet_peft():
        if cfg.task == "sentence-embedding":
            # sentence-transformers' own peft integration: the adapters go into its transformer
            # in place, and SentenceTransformer(folder) loads the saved adapter folder back
            model = recipe.model
            inner = _sentence_transformer_backbone(model)
            config = lora_config(inner, "sentence-embedding", cfg.lora_rank, targets, dropout)
            config.task_type = None  # the transformers integration takes the bare LoRA config
            model.add_adapter(config)
            peft_config: Any = inner.peft_config
        else:
            # the estimator's own function: the same adapters it counts
            recipe.model = with_lora(
                recipe.model,
                StepSpec(
                    task=cfg.task,
                    lora_rank=cfg.lora_rank,
                    lora_targets=targets,
                    lora_dropout=dropout,
                ),
            )
            peft_config = recipe.model.peft_config
    base = Path(str(cfg.model)).expanduser()
    if base.is_dir():
        # peft writes the base model's path into adapter_config.json as it was given; a relative
        # one would only load from the folder the run started in
        for entry in peft_config.values():
            entry.base_model_name_or_path = str(base.resolve())


def _sentence_transformer_backbone(model: Any) -> nn.Module:
    """The transformers model inside a SentenceTransformer, where its adapters go."""
    if not hasattr(model, "add_adapter"):
        raise UsageError(
            "--lora-rank: LoRA on a sentence-transformers model needs sentence-transformers ≥ 3.3 "
            "(its peft integration)"
        )
    inner = getattr(model, "transformers_model", None)
    if inner is None:
        first = model[0]
        inner = getattr(first, "auto_model", None) or getattr(first, "model", None)
    if not isinstance(inner, nn.Module):
        raise UsageError(
            "--lora-rank: this sentence-transformers model has no transformers backbone to adapt"
        )
    return inner


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def is_lora(model: Any) -> bool:
    """Whether the model carries LoRA adapters (a PeftModel, or peft layers injected in place)."""
    if hasattr(model, "merge_and_unload"):
        return True
    try:
        from peft.tuners.lora import LoraLayer  # optional: peft (memfit[lora])
    except ImportError:
        return False
    return isinstance(model, nn.Module) and any(isinstance(m, LoraLayer) for m in model.modules())


def save_lora(recipe: Any, folder: Path, *, merge: bool) -> None:
    """Write the LoRA model into ``folder``: the adapter folder (the model's own
    ``save_pretrained``, which peft limits to the adapters and the head), or with ``merge`` the
    merged model, from a copy (training goes on with the adapters)."""
    if not merge:
        with _quiet_peft():
            recipe.save(folder)
        return
    model = recipe.model
    with _quiet_peft():
        if holds_quantized_weights(model):
            # QLoRA: merged into an unquantized copy of the base, read again from --model (the
            # decision and its cost: memfit.train.quantization)
            merged = merged_unquantized(model, recipe.model_name)
        elif hasattr(model, "merge_and_unload"):
            merged = copy.deepcopy(model).merge_and_unload()
        else:
            merged = copy.deepcopy(model)
            _merge_injected(merged)
    recipe.model = merged
    try:
        recipe.save(folder)
    finally:
        recipe.model = model


def _merge_injected(model: nn.Module) -> None:
    """Merge adapters that were injected in place (transformers' and sentence-transformers'
    ``add_adapter``) and put the plain layers back, so the model saves as a full model."""
    from peft.tuners.lora import LoraLayer  # optional: peft (memfit[lora])

    for path, module in list(model.named_modules()):
        if not isinstance(module, LoraLayer):
            continue
        module.merge()
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, module.get_base_layer())
    for sub in model.modules():
        # transformers saves only the adapter while this flag is up
        if getattr(sub, "_hf_peft_config_loaded", False):
            sub._hf_peft_config_loaded = False  # type: ignore[assignment]
            if hasattr(sub, "peft_config"):
                del sub.peft_config
