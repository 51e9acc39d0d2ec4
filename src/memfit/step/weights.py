"""The dtype each weight of the step is held in (``--weights-dtype``), decided once for the
estimator's traced step and for ``memfit train``.

transformers 5 loads a checkpoint in its own dtype (``config.dtype``: bf16 for today's decoders,
fp32 for BERT and GPT-2). A frozen weight (the base under LoRA or QLoRA, the layers QLoRA keeps
unquantized) is held in that dtype, or the one ``--weights-dtype`` names: nothing is trained in
it, so 16 bits cost no quality. A trained weight keeps an fp32 master copy under mixed precision
(``auto``, ``fp32``), or is trained in 16 bits itself (``bf16``/``fp16``: weights, gradients and
optimizer state, pure 16-bit training).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
# a dtype as ``config.dtype`` (or the older ``torch_dtype``) may spell it
_SPELLINGS: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    **DTYPES,
}
# bitsandbytes' quantized parameters: packed integers with their own state, never cast
QUANTIZED_PARAMETERS = ("Params4bit", "Int8Params")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bf16"`` (the names of ``--weights-dtype`` and ``--precision``)."""
    for name, known in DTYPES.items():
        if known == dtype:
            return name
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint of ``config`` is stored in, which ``from_pretrained`` loads it in:
    the config's ``dtype`` (``torch_dtype`` in older configs), its text config's for a
    multimodal one; fp32 when it names none (BERT, GPT-2: their checkpoints are fp32)."""
    texts = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        texts.insert(0, get_text())
    for text in texts:
        for attribute in ("dtype", "torch_dtype"):
            # read without calling a property: transformers 5's torch_dtype is one, an alias
            # of dtype that logs a deprecation each process (older configs hold it as a field)
            value = inspect.getattr_static(text, attribute, None)
            if isinstance(value, torch.dtype) and value.is_floating_point:
                return value
            if isinstance(value, str) and value.removeprefix("torch.") in _SPELLINGS:
                return _SPELLINGS[value.removeprefix("torch.")]
    return torch.float32


def weight_dtypes(config: Any, weights_dtype: str | None) -> tuple[torch.dtype, torch.dtype]:
    """(frozen, trainable): the dtypes the step holds its frozen and its trained weights in.

    ``auto`` (or None): frozen weights as the checkpoint stores them, trained ones in fp32 (the
    master weights of mixed precision); ``fp32``: both in fp32 (the recipe before 16-bit bases);
    ``bf16``/``fp16``: both in 16 bits (pure 16-bit training; LoRA adapters too).
    """
    if weights_dtype in (None, "auto"):
        return checkpoint_dtype(config), torch.float32
    dtype = DTYPES[weights_dtype]
    return dtype, dtype


def load_dtype(config: Any, weights_dtype: str | None, *, frozen_base: bool) -> torch.dtype:
    """The dtype to build or load the model in: the frozen dtype when its base will be frozen
    (LoRA, QLoRA: the adapters are added after), else the trained dtype (full fine-tuning: every
    weight is trained, none is first loaded in another dtype and cast)."""
    frozen, trainable = weight_dtypes(config, weights_dtype)
    return frozen if frozen_base else trainable


def place_weights(
    model: nn.Module, frozen: torch.dtype, trainable: torch.dtype, *, cast_inputs: bool
) -> None:
    """Hold every floating parameter of ``model`` in ``trainable`` or ``frozen`` dtype by
    whether it requires a gradient; bitsandbytes' quantized parameters are left as they are.

    peft keeps LoRA adapters in fp32 over a 16-bit base and casts their input itself; a trained
    module that is not an adapter (a classifier head trained whole, over a bf16 body) does not.
    ``cast_inputs`` (no autocast, ``--precision fp32``): such a module gets a forward pre-hook
    that casts its floating inputs to its own dtype, so that its matmul does not meet two dtypes.
    Under autocast nothing is hooked: autocast casts the matmul's operands already.
    """
    # a model with nothing frozen (full fine-tuning) is one dtype throughout: nothing to cast
    cast_inputs = (
        cast_inputs
        and trainable != frozen
        and any(p.is_floating_point() and not p.requires_grad for p in model.parameters())
    )
    hooked: set[int] = set()
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            if not parameter.is_floating_point():
                continue
            if type(parameter).__name__ in QUANTIZED_PARAMETERS:
                continue
            want = trainable if parameter.requires_grad else frozen
            if parameter.dtype != want:
                # .data keeps the Parameter object (an optimizer, a tied weight share it)
                parameter.data = parameter.data.to(want)
            if cast_inputs and parameter.requires_grad and id(module) not in hooked:
                hooked.add(id(module))
                module.register_forward_pre_hook(_cast_inputs(trainable), with_kwargs=True)


def _cast_inputs(dtype: torch.dtype) -> Any:
    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        def cast(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(dtype)
            return value

        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook


__all__ = [
    "DTYPES",
    "QUANTIZED_PARAMETERS",
    "checkpoint_dtype",
    "dtype_name",
    "load_dtype",
    "place_weights",
    "weight_dtypes",
]
