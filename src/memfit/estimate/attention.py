"""Which attention transformers runs for a task's model, and what the trace's config names.

transformers (5.23, ``modeling_utils.get_correct_attn_implementation``) runs ``sdpa`` by default
and falls back to eager where the architecture has none; it refuses FlashAttention on an
architecture without it. The estimate follows: :func:`attention_run`. The trace cannot run the
flash-attn package (CUDA-only, absent here): :func:`config_attention` names memfit's stand-in
instead (:mod:`memfit.estimate.flash_attention_emulation`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit.errors import UsageError
from memfit.estimate import flash_attention_emulation

if TYPE_CHECKING:
    from memfit.estimate.step_spec import StepSpec

__all__ = ["attention_run", "config_attention", "task_model_class"]

# the transformers auto mapping of each task's model class, and what its head is called
_TASK_MAPPINGS = {
    "classification": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING", "sequence-classification"),
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING", "causal-LM"),
    "sentence-embedding": ("MODEL_MAPPING", "base"),
}


def task_model_class(config: Any, task: str) -> Any:
    """The transformers class the task builds; a UsageError when the architecture has no head
    for it (an encoder has no causal-LM head)."""
    # start-up: transformers takes a second or more to import; only tracing a model needs it
    from transformers.models.auto import modeling_auto

    mapping_name, head = _TASK_MAPPINGS[task]
    try:
        return getattr(modeling_auto, mapping_name)[type(config)]
    except KeyError:
        raise UsageError(
            f"--task {task}: transformers has no {head} model for {config.model_type}"
        ) from None


def attention_run(config: Any, spec: StepSpec) -> str:
    """The attention transformers runs for ``spec.attn_implementation`` on the task's model.

    ``sdpa`` on an architecture without it (Gemma-2: soft-capping; DeBERTa-v2, MPNet: their own
    attention) runs eager: transformers' default, which a run that names no attention gets.
    ``flash_attention_2`` on one without FlashAttention is a UsageError, as transformers
    refuses it.
    """
    model_class = task_model_class(config, spec.task)
    requested = spec.attn_implementation
    sdpa = bool(getattr(model_class, "_supports_sdpa", False))
    if requested == "sdpa" and not sdpa:
        return "eager"
    flash = flash_attention_emulation.FLASH_ATTENTION_2
    if requested == flash and not getattr(model_class, "_supports_flash_attn", False):
        others = "sdpa or eager" if sdpa else "eager"
        raise UsageError(
            f"--attn-implementation {requested}: transformers has no FlashAttention for "
            f"{config.model_type} ({model_class.__name__}); use {others}"
        )
    return requested


def config_attention(config: Any, spec: StepSpec) -> str:
    """``config._attn_implementation`` for the task's model: :func:`attention_run`, with
    ``flash_attention_2`` run by memfit's stand-in for the flash-attn package."""
    attention = attention_run(config, spec)
    if attention == flash_attention_emulation.FLASH_ATTENTION_2:
        flash_attention_emulation.register()
        return flash_attention_emulation.TRACE_NAME
    return attention
