"""The weights' dtype of a model object, as ``--weights-dtype`` says it: read by
:func:`memfit.integrations.apply_plan` and by the guarded Trainer's plan
(:func:`memfit.integrations.trainer.step_knobs`) alike.

- Trained weights all in one 16-bit dtype are pure 16-bit training (the Trainer trains a model
  loaded in bf16 so: ``"bf16"``).
- Otherwise (fp32 trained weights) a frozen base held in the checkpoint's dtype is ``"auto"``
  (a bf16 base under fp32 LoRA adapters), one held in fp32 ``"fp32"``, and nothing frozen is
  ``"auto"`` (fp32 master weights). A frozen base in 16 bits over an fp32 checkpoint has no knob
  of its own: ``"auto"``, said in the log (the estimate then holds it as the checkpoint stores
  it: more, not less).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from memfit.step import weights

logger = logging.getLogger("memfit.integrations")


def model_weights_dtype(model: Any) -> str | None:
    """``--weights-dtype`` of the dtypes ``model`` holds its weights in (see the module); None
    for a name or a folder (the checkpoint decides: the plan's own) or a model without weights.
    bitsandbytes' quantized weights are left out (packed integers, not the dtype of a weight)."""
    parameters = getattr(model, "parameters", None)
    if isinstance(model, str | Path) or not callable(parameters):
        return None
    floating = [
        p
        for p in parameters()
        if p.is_floating_point() and type(p).__name__ not in weights.QUANTIZED_PARAMETERS
    ]
    if not floating:
        return None
    trained = {p.dtype for p in floating if p.requires_grad}
    frozen = {p.dtype for p in floating if not p.requires_grad}
    if len(trained) == 1 and next(iter(trained)) != torch.float32:
        return weights.dtype_name(next(iter(trained)))
    if not frozen:
        return "auto"  # nothing frozen: fp32 master weights, as under fp32
    checkpoint = weights.checkpoint_dtype(checkpoint_config(model))
    if frozen == {checkpoint}:
        return "auto"
    if frozen == {torch.float32}:
        return "fp32"
    logger.warning(
        "memfit: the model holds its frozen weights in %s, its checkpoint stores them in %s: "
        "the plan holds them as the checkpoint does (weights_dtype auto)",
        "+".join(sorted(weights.dtype_name(d) for d in frozen)),
        weights.dtype_name(checkpoint),
    )
    return "auto"


def checkpoint_config(model: Any) -> Any:
    """The config of the checkpoint ``model`` was loaded from (its folder's config.json, which the
    plan reads), else its own."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    source = str(getattr(config, "_name_or_path", "") or "")
    if source and (Path(source) / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(source)
        except (OSError, ValueError):
            return config
    return config
