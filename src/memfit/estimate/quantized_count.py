"""How many weights the quantizer quantizes and what they hold, counted on the model the step
builds (:func:`memfit.estimate.workload.build_model`, with :mod:`memfit.estimate.quantized`'s
layers): above both, so that neither the step nor the quantizer imports the other."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from memfit.estimate import depth as depth_
from memfit.estimate import quantized, workload
from memfit.estimate.step_spec import StepSpec
from memfit.estimate.task_model import BiEncoder


def quantization_summary(config: Any, spec: StepSpec) -> quantized.QuantizationSummary:
    """How many weights ``spec`` quantizes, the bytes they hold and the layers kept.

    Counted on two shallow copies of the model and written out to its depth where its layers
    repeat (milliseconds), else on the whole model."""
    plan, _ = depth_.plan_depth(config)
    if plan is not None:
        shallow_a, shallow_b = plan.traced
        a = count_quantized(depth_.shallow_config(config, plan, shallow_a), spec)
        b = count_quantized(depth_.shallow_config(config, plan, shallow_b), spec)
        if a[3] == b[3]:
            periods = (plan.depth - shallow_a) // plan.period
            parameters, stored, held = (
                x + (y - x) * periods for x, y in zip(a[:3], b[:3], strict=True)
            )
            return quantized.QuantizationSummary(spec, parameters, stored, held, a[3])
    return quantized.QuantizationSummary(spec, *count_quantized(config, spec))


def count_quantized(config: Any, spec: StepSpec) -> tuple[int, int, int, tuple[str, ...]]:
    """Quantized weights, their stored elements, the bytes they hold, and the layers kept."""
    # the quantized model without adapters (they are no kept layer) nor checkpointing
    bare = dataclasses.replace(spec, lora_rank=0, gradient_checkpointing=False)
    with torch.device("meta"):
        model = workload.build_model(config, bare)
    parameters = stored = held = 0
    for module in model.modules():
        if isinstance(module, quantized.Linear4bitModel | quantized.Linear8bitModel):
            parameters += module.in_features * module.out_features
            stored += module.weight.numel()
            held += sum(t.numel() * t.element_size() for t in _quant_tensors(module))
    inner = model.transformer if isinstance(model, BiEncoder) else model
    return parameters, stored, held, tuple(_kept_layers(inner))


def _quant_tensors(module: nn.Linear) -> list[torch.Tensor]:
    """What a quantized layer holds for its weight: the packed weight and its state."""
    return [module.weight, *module.buffers(recurse=False)]


def _kept_layers(model: nn.Module) -> list[str]:
    # start-up time: transformers loads on first use (the estimator imports this module)
    from transformers.pytorch_utils import Conv1D

    return [
        name
        for name, module in model.named_modules()
        if name
        and isinstance(module, nn.Linear | Conv1D)
        and not isinstance(module, quantized.Linear4bitModel | quantized.Linear8bitModel)
    ]
