"""The run's optimizer and learning-rate schedule, and the out-of-memory catch of the update."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from transformers import get_scheduler
from transformers.optimization import Adafactor

from memfit.train.config import TrainConfig
from memfit.train.quantization import import_quietly

# --optimizer names and bitsandbytes' classes: AdamW with 8-bit state (block-wise quantized), and
# the paged ones, whose state lives in CUDA unified memory that the driver pages out to the host
# under pressure (8-bit or 32-bit state)
BITSANDBYTES_OPTIMIZERS = {
    "adamw-8bit": "AdamW8bit",
    "paged-adamw-8bit": "PagedAdamW8bit",
    "paged-adamw-32bit": "PagedAdamW32bit",
}


def make_optimizer(name: str, model: torch.nn.Module, lr: float, weight_decay: float) -> Any:
    """``--optimizer`` over the trainable parameters; no weight decay on biases and norms."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in pname.lower() else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "adafactor":
        return Adafactor(
            groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False
        )
    if name in BITSANDBYTES_OPTIMIZERS:
        bnb = import_quietly("bitsandbytes")
        # bitsandbytes warns at the first step on the CPU that it does not page there; the run
        # says so once (memfit.train.setup)
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        return getattr(bnb.optim, BITSANDBYTES_OPTIMIZERS[name])(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr)


def make_scheduler(cfg: TrainConfig, optimizer: Any, total_steps: int) -> Any:
    """``--lr-scheduler`` over ``total_steps``, warming up for ``--warmup-ratio`` of them."""
    return get_scheduler(
        cfg.lr_scheduler,
        optimizer,
        num_warmup_steps=int(cfg.warmup_ratio * total_steps),
        num_training_steps=total_steps,
    )


def rescale_lr(optimizer: Any, scheduler: Any, lr: float) -> float | None:
    """A resume's --lr over the checkpoint's schedule (a run stopped at a NaN, lowered): every
    group's rate scaled by the new peak over the old. Returns the old peak, or None if equal."""
    bases = list(getattr(scheduler, "base_lrs", []))
    if not bases or all(math.isclose(b, lr) for b in bases):
        return None
    for i, (group, base) in enumerate(zip(optimizer.param_groups, bases, strict=True)):
        group["lr"] *= lr / base
        group["initial_lr"] = lr
        scheduler.base_lrs[i] = lr
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return float(bases[0])
