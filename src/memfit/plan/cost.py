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

Costs in time no FLOP count shows:

* **What a lever adds to each pass over the weights**, each lever's own model
  (:meth:`memfit.levers.base.Lever.pass_seconds`, added up): 4-bit base weights (QLoRA) are
  dequantized on every pass, memory-bound and whatever the tokens; the quantization lever states
  the model and its fit (:mod:`memfit.levers.quantization`).
* **What a lever adds to each micro-batch by its tokens**
  (:meth:`memfit.levers.base.Lever.micro_seconds`): a fused linear cross-entropy reads the head's
  weight once per chunk of tokens (:mod:`memfit.levers.cross_entropy` states the model); saved
  activations offloaded to host memory cross the host link and back where the compute does not
  hide them (:mod:`memfit.levers.activation_offloading`).
* **What a lever adds to each optimizer step** (:meth:`memfit.levers.base.Lever.step_seconds`,
  once per effective batch): optimizer state in host memory is updated by the CPU, and the
  gradients and weights cross the host link (:mod:`memfit.levers.optimizer_offload`). The host
  link's rate is the catalog's (:attr:`memfit.devices.catalog.Gpu.host_link_gbps`).
* **Paged optimizers** (bitsandbytes' paged AdamW): their state lives in CUDA unified memory,
  outside PyTorch's allocator, and the driver evicts it to host memory when the GPU runs short.
  Resident, an update streams what its unpaged twin does; a plan only needs a paged optimizer
  where its twin does not fit, so the state is assumed to be evicted during forward and backward
  and paged back for the update: ``2 × state bytes`` over the host link per optimizer step, at
  :func:`host_link_bytes_per_second` (a worst case: what stays resident moves nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers.pytorch_utils import Conv1D
from transformers.quantizers.quantizers_utils import should_convert_module

from memfit.devices.catalog import Gpu
from memfit.estimate import quantized, workload
from memfit.levers import LEVERS
from memfit.levers.optimizer import OPTIMIZER_TABLE
from memfit.step import linear_ce, weights

E_MAX = 0.6  # the share of peak FLOP/s large transformer matmuls reach
T_HALF = 1024  # tokens per micro-batch at which half of E_MAX is reached
LAUNCH_SECONDS_PER_LAYER = 0.25e-3  # kernel launches and Python per layer, forward + backward
# the paged optimizers: the unpaged twin whose update they run once resident, and the bytes of
# state per trainable parameter that page (two 8-bit moments, or two fp32 moments)
PAGED_OPTIMIZERS: dict[str, tuple[str, int]] = {
    "paged-adamw-8bit": ("adamw-8bit", 2),
    "paged-adamw-32bit": ("adamw", 8),
}
# bytes read and written per trainable parameter by one optimizer step (fp32 master weights):
# AdamW reads weight, gradient, two moments and writes weight and moments. A paged optimizer's
# update moves what its twin's does (the table's figure for it counts only what stays on the GPU)
OPTIMIZER_BYTES_PER_PARAMETER = {o.name: o.bytes_per_parameter for o in OPTIMIZER_TABLE.values()}
OPTIMIZER_BYTES_PER_PARAMETER |= {
    name: OPTIMIZER_BYTES_PER_PARAMETER[twin] for name, (twin, _state) in PAGED_OPTIMIZERS.items()
}


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs from a model."""

    matmul_parameters: int  # weights of every Linear/Conv1D, the output head included
    trainable_parameters: int
    layers: int
    hidden: int
    # the matmul weights bitsandbytes would quantize: all but those the quantizer keeps (see
    # memfit.estimate.quantized.modules_to_not_convert: output embeddings, tied weights, ...)
    quantizable_parameters: int = 0
    # trainable parameters under LoRA of rank r: ``lora_fixed + r × lora_per_rank`` (adapters,
    # plus what trains beside them, such as a classification head)
    lora_fixed: int = 0
    lora_per_rank: int = 0
    # a language model's vocabulary (its output head's rows); 0: no token head (a fused loss
    # chunks that head: :meth:`memfit.levers.cross_entropy.CrossEntropy.micro_seconds`)
    vocab: int = 0
    # bytes per weight of the checkpoint's dtype: what ``--weights-dtype auto`` holds a frozen
    # base (and a frozen head, which the fused loss reads) in
    checkpoint_bytes: int = 4

    def loss_chunks(self, tokens: int) -> int:
        """The chunks a fused linear cross-entropy cuts ``tokens`` rows into over this model's
        head (:func:`memfit.step.linear_ce.chunk_rows`, Liger's rule: the step's one copy of
        it, which the levers cannot import)."""
        return -(-tokens // linear_ce.chunk_rows(tokens, self.vocab, self.hidden))

    def trainable(self, lora_rank: int | None) -> int:
        """Parameters the optimizer updates: all, or under LoRA the adapters' (and the head's)."""
        if not lora_rank or not self.lora_per_rank:
            return self.trainable_parameters
        return self.lora_fixed + lora_rank * self.lora_per_rank


def is_paged(optimizer: str) -> bool:
    """A paged optimizer: state in CUDA unified memory, evicted to the host under pressure."""
    return optimizer in PAGED_OPTIMIZERS


def host_link_bytes_per_second(gpu: Gpu) -> float:
    """The host link's usable copy rate for ``gpu``, one direction (the catalog's
    ``host_link_gbps``: its PCIe generation and width, or NVLink-C2C, at the share pinned
    copies reach)."""
    return gpu.host_link_gbps * 1e9


def optimizer_seconds(
    shape: ModelShape, gpu: Gpu, optimizer: str, lora_rank: int | None = None
) -> float:
    """Seconds one optimizer step takes (on the LoRA adapters of ``lora_rank``, if given): its
    memory traffic, plus, for a paged optimizer, its state paged in and out over the host link."""
    trainable = shape.trainable(lora_rank)
    seconds = (
        trainable
        * OPTIMIZER_BYTES_PER_PARAMETER.get(optimizer, 28)
        / (gpu.memory_bandwidth_gbps * 1e9)
    )
    if is_paged(optimizer):
        state = trainable * PAGED_OPTIMIZERS[optimizer][1]
        seconds += 2 * state / host_link_bytes_per_second(gpu)
    return seconds


def model_shape(config: Any, spec: Any, *, lora: bool = False) -> ModelShape:
    """Count a model's matmul weights on the meta device (no memory, well under a second); with
    ``lora``, build it once more with rank-1 adapters (peft, a second or two) to count them."""
    with torch.device("meta"):
        model = workload.build_model(config, spec)
        adapted = (
            workload.build_model(config, dataclasses.replace(spec, lora_rank=1)) if lora else None
        )
    lora_fixed = per_rank = 0
    if adapted is not None:
        # peft's adapters are ``lora_A``/``lora_B`` (linear in the rank); the rest that trains
        # beside them (a classification head) does not depend on it
        for name, parameter in adapted.named_parameters():
            if parameter.requires_grad:
                if "lora_" in name:
                    per_rank += parameter.numel()
                else:
                    lora_fixed += parameter.numel()
    matmul = quantizable = 0
    # the transformers model (a sentence-transformers bi-encoder wraps it): the quantizer's
    # names are its own
    inner = model.transformer if isinstance(model, workload.BiEncoder) else model
    kept = quantized.modules_to_not_convert(inner, spec.task)
    for name, module in inner.named_modules():
        if isinstance(module, torch.nn.Linear | Conv1D) and should_convert_module(name, kept):
            quantizable += module.weight.numel()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear | Conv1D):
            matmul += module.weight.numel()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = int(
        getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 1
    )
    hidden = int(getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 1)
    vocab = int(getattr(config, "vocab_size", 0) or 0) if spec.task == "causal-lm" else 0
    return ModelShape(
        matmul,
        trainable,
        layers,
        hidden,
        quantizable,
        lora_fixed,
        per_rank,
        vocab=vocab,
        checkpoint_bytes=weights.checkpoint_dtype(config).itemsize,
    )


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
    lora_rank: int | None = None,
    values: Mapping[str, Any] | None = None,
) -> float:
    """Predicted training samples per second over all ranks (communication not counted).

    ``lora_rank``: the optimizer steps only the adapters of that rank (with ``lora``; None: it
    is charged for every parameter). ``values``: the levers' values (field → value), each
    lever charging what it adds to a pass over the weights (4-bit base weights, dequantized on
    every pass: :meth:`~memfit.levers.base.Lever.pass_seconds`)."""
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
    # what the levers add to each pass (forward, backward, recomputed or cached forward): 4-bit
    # weights are dequantized on every one
    per_pass = sum(lever.pass_seconds(values or {}, shape, gpu) for lever in LEVERS)
    micro_seconds += chunks * columns * passes * per_pass
    # and what they add to each micro-batch by its tokens (a loss computed in chunks)
    tokens = rows_at_once * seq_len * columns
    micro_seconds += chunks * sum(
        lever.micro_seconds(values or {}, shape, gpu, tokens) for lever in LEVERS
    )
    step_seconds = accumulation_steps * micro_seconds + optimizer_seconds(
        shape, gpu, optimizer, lora_rank if lora else None
    )
    # and what they add to each optimizer step (an update on the CPU, over the host link)
    step_seconds += sum(lever.step_seconds(values or {}, shape, gpu) for lever in LEVERS)
    return world_size * micro_batch_size * accumulation_steps / step_seconds
