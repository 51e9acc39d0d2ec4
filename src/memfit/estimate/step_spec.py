"""The knobs of one step that change what it allocates (:class:`StepSpec`), in a module of its
own: the step (:mod:`memfit.estimate.workload`, which imports it from here), the quantizer and
the attention check all name it, and the step imports the quantizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.levers.lora import LORA_DROPOUT

PRECISION_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class StepSpec:
    """The knobs of one step that change what is allocated (shape-independent)."""

    task: str
    precision: str = "fp32"
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    mode: str = "train"
    device: str = "cuda"
    num_labels: int = 2
    loss: str = "cross-entropy"
    # LoRA adapters (peft) of this rank; 0: full fine-tuning
    lora_rank: int = 0
    # which modules get them (see ``lora_target_modules``); empty: the architecture's default
    lora_targets: tuple[str, ...] = ()
    # peft's dropout on each adapted layer's input: above 0 an nn.Dropout whose output (and mask)
    # backward keeps, at 0 an nn.Identity that keeps nothing
    lora_dropout: float = LORA_DROPOUT
    # the frozen base weights as bitsandbytes holds them ("none", "nf4", "fp4", "int8"; only with
    # LoRA) and, for 4-bit, whether the block scales are quantized again
    quantization: str = "none"
    double_quant: bool = False
    # cached-mnrl only: the batch holds this many mini-batches of ``batch_size`` rows each (the
    # estimator traces two and adds the rest exactly; real runs use the true count)
    cached_chunks: int = 2
    # the dtype frozen weights are held in ("auto": the checkpoint's; "fp32", "bf16", "fp16"); with
    # "bf16"/"fp16" the trainable weights too (pure 16-bit training: weights, gradients, state)
    weights_dtype: str = "auto"
    # the causal-LM token loss: "standard" (full logits) or "fused-linear" (chunked from the last
    # hidden states and the head's weight, the logits never whole)
    cross_entropy: str = "standard"
    # the tensors saved for backward wait in host memory (the device keeps what the offloading
    # implementation keeps: small tensors, the head's, the copies in flight)
    activation_offloading: bool = False
    # where the optimizer's state lives and steps: "none" (the device) or "cpu" (host memory)
    optimizer_offload: str = "none"
    # causal LM: rows packed into each sequence (the job's --packing and --packing-strategy); see
    # ``packed``
    packing: bool = False
    packing_strategy: str = "bfd"
    # CUDA only: the SM version whose SDPA kernels the estimate emulates (75 for a T4). 80 stands
    # for every sm80+ GPU (flash and memory-efficient attention); below it there is no flash
    # attention, below 50 no memory-efficient attention either (see memfit.estimate.sdpa_emulation)
    sdpa_sm: int = 80

    @property
    def packed(self) -> bool:
        """Whether the step's sequences hold rows packed padding-free (``--packing`` with the
        ``bfd`` strategy, causal LM): each row its own position ids, no padding mask, so
        transformers keeps the rows apart (a block-diagonal mask on SDPA and eager attention,
        flash attention's variable-length path). ``wrapped`` blocks are plain full sequences."""
        return self.task == "causal-lm" and self.packing and self.packing_strategy == "bfd"
