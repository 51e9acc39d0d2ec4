"""How fast a configuration trains: a stated cost model, good for ranking, not a benchmark.

Per sample of S tokens, the matmuls of a transformer with N matmul weights cost ``2·N·S`` FLOPs
forward, plus ``4·L·S²·d`` for attention's two S×S products (L layers of width d). Backward costs
twice the forward (gradients of activations and of weights), or once the forward when the base
weights are frozen (LoRA: activation gradients only). Gradient checkpointing recomputes the forward
once more; the cached in-batch-negatives loss embeds every sample once more without a graph.
This is the familiar ``6·params·tokens`` rule (``8·`` with checkpointing).

Time per micro-batch = FLOPs / (peak rate × efficiency) + a fixed launch cost per layer, where
the efficiency rises with the tokens in the micro-batch and saturates:
``efficiency = E_MAX · t / (t + T_HALF)`` (half of ``E_MAX`` at ``T_HALF`` tokens). Each optimizer
step also streams the optimizer's bytes per trainable parameter through memory once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.devices.catalog import Gpu
from memfit.job import OPTIMIZER_TABLE

E_MAX = 0.6  # the share of peak FLOP/s large transformer matmuls reach
T_HALF = 1024  # tokens per micro-batch at which half of E_MAX is reached
LAUNCH_SECONDS_PER_LAYER = 0.25e-3  # kernel launches and Python per layer, forward + backward
# bytes read and written per trainable parameter by one optimizer step (fp32 master weights):
# AdamW reads weight, gradient, two moments and writes weight and moments
OPTIMIZER_BYTES_PER_PARAMETER = {o.name: o.bytes_per_parameter for o in OPTIMIZER_TABLE.values()}


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs from a model."""

    matmul_parameters: int  # weights of every Linear/Conv1D, the output head included
    trainable_parameters: int
    layers: int
    hidden: int


def model_shape(config: Any, spec: Any) -> ModelShape:
    """Count a model's matmul weights on the meta device (no memory, well under a second)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    from memfit.estimate import workload

    with torch.device("meta"):
        model = workload.build_model(config, spec)
    matmul = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear | Conv1D):
            matmul += module.weight.numel()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = int(
        getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1
    )
    hidden = int(getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 1)
    return ModelShape(matmul, trainable, layers, hidden)


def flops_per_sample(
    shape: ModelShape,
    seq_len: int,
    *,
    gradient_checkpointing: bool,
    lora: bool,
    cached_loss: bool,
    columns: int = 1,
) -> float:
    """Training FLOPs of one sample (``columns`` sequences per sample: 2 for sentence pairs)."""
    forward = (
        2.0 * shape.matmul_parameters * seq_len + 4.0 * shape.layers * seq_len**2 * shape.hidden
    )
    backward = (1.0 if lora else 2.0) * forward
    extra = (forward if gradient_checkpointing else 0.0) + (forward if cached_loss else 0.0)
    return columns * (forward + backward + extra)


def efficiency(tokens: int) -> float:
    return E_MAX * tokens / (tokens + T_HALF)


def samples_per_second(
    shape: ModelShape,
    gpu: Gpu,
    *,
    precision: str,
    micro_batch_size: int,
    accumulation_steps: int,
    seq_len: int,
    gradient_checkpointing: bool,
    optimizer: str,
    lora: bool,
    cached_loss: bool,
    world_size: int = 1,
    columns: int = 1,
    mini_batch_size: int | None = None,
) -> float:
    """Predicted training samples per second over all ranks (communication not counted)."""
    per_sample = flops_per_sample(
        shape,
        seq_len,
        gradient_checkpointing=gradient_checkpointing,
        lora=lora,
        cached_loss=cached_loss,
        columns=columns,
    )
    # the GPU works on ``mini_batch_size`` rows at a time under the cached loss
    rows_at_once = mini_batch_size if cached_loss and mini_batch_size else micro_batch_size
    chunks = -(-micro_batch_size // rows_at_once)
    passes = (3 if cached_loss else 2) + (1 if gradient_checkpointing else 0)
    rate = gpu.flops_per_second(precision) * efficiency(rows_at_once * seq_len * columns)
    micro_seconds = micro_batch_size * per_sample / rate
    micro_seconds += chunks * columns * passes / 3 * shape.layers * LAUNCH_SECONDS_PER_LAYER
    optimizer_seconds = (
        shape.trainable_parameters
        * OPTIMIZER_BYTES_PER_PARAMETER.get(optimizer, 28)
        / (gpu.memory_bandwidth_gbps * 1e9)
    )
    step_seconds = accumulation_steps * micro_seconds + optimizer_seconds
    return world_size * micro_batch_size * accumulation_steps / step_seconds
