"""The run's optimizer and learning-rate schedule, and the out-of-memory catch of the update."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from transformers import get_scheduler
from transformers.optimization import Adafactor

from memfit.errors import UsageError
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


def make_optimizer(
    name: str,
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    *,
    offload: str | None = None,
    zero: bool = False,
    device: torch.device | None = None,
) -> Any:
    """``--optimizer`` over the trainable parameters; no weight decay on biases and norms.

    ``offload="cpu"`` (``--optimizer-offload``; :func:`offload_implementation` says which runs):
    under DeepSpeed ZeRO (``zero``) DeepSpeedCPUAdam, which ZeRO-Offload steps on the host
    partitions; on CUDA torchao's ``CPUOffloadOptimizer`` around torch's AdamW (or SGD); on the
    CPU device torch's fused CPU AdamW, the update torchao runs on its host copies (torchao
    itself needs CUDA or XPU; on the CPU the state is in host memory already)."""
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
    if offload == "cpu":
        return _offloaded(name, groups, lr, zero=zero, device=device)
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


def offload_implementation(offload: str | None, *, zero: bool, device: torch.device) -> str | None:
    """What runs ``--optimizer-offload cpu`` (run.json's ``resolved.optimizer_offload``); None:
    no offload was asked for."""
    if offload != "cpu":
        return None
    if zero:
        return "DeepSpeed ZeRO-Offload (offload_optimizer to cpu, DeepSpeedCPUAdam)"
    if device.type == "cuda":
        return "torchao CPUOffloadOptimizer (offload_gradients=False)"
    return (
        "none: on the CPU device the state is in host memory already; torch.optim fused CPU "
        "step, as torchao's CPUOffloadOptimizer runs on its host copies (torchao itself needs "
        "CUDA or XPU)"
    )


def _offloaded(
    name: str, groups: list[dict[str, Any]], lr: float, *, zero: bool, device: torch.device | None
) -> Any:
    """The optimizer of ``--optimizer-offload cpu`` (see :func:`make_optimizer`)."""
    if zero:
        # DeepSpeed's ZeRO-Offload refuses a client optimizer other than its own CPU Adam
        # (engine.py, zero_force_ds_cpu_optimizer); adamw_mode: decoupled weight decay, AdamW.
        # Its C++ op is built with ninja at the first use (minutes) and cached after
        # optional: deepspeed (memfit[deepspeed], --sharding zero1|zero2|zero3)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, adamw_mode=True)
    base: type[torch.optim.Optimizer] = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    if device is not None and device.type == "cuda":
        try:
            # optional: torchao (pip install torchao; --optimizer-offload cpu on CUDA)
            from torchao.optim import CPUOffloadOptimizer
        except ImportError:
            raise UsageError(
                "--optimizer-offload cpu: on CUDA memfit train runs torchao's "
                "CPUOffloadOptimizer; torchao is not installed (pip install 'memfit[torchao]')"
            ) from None

        return _resynced(CPUOffloadOptimizer)(groups, base, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    # the host-side update torchao's CPUOffloadOptimizer runs (its AdamW default is fused)
    return torch.optim.AdamW(groups, lr=lr, fused=True)


class _OffloadedState(Mapping[Any, dict[str, Any]]):
    """``optimizer.state`` of torchao's ``CPUOffloadOptimizer``, which never calls
    ``Optimizer.__init__`` and so has none: its inner optimizers' states merged, each keyed by
    the model's parameter (the host copy's state under its device parameter), the on-device
    optimizer's (parameters under ``minimal_size``) as they are. ``clear()`` clears them all."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner

    def _items(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        owner = self._owner
        if owner.d_opt is not None:
            yield from owner.d_opt.state.items()
        for p_device, inner in owner.optim_dict.items():
            p_host = owner.param_d2h_map[p_device]
            if p_host in inner.state:
                yield p_device, inner.state[p_host]

    def __getitem__(self, key: Any) -> dict[str, Any]:
        for param, state in self._items():
            if param is key:
                return state
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        return (param for param, _ in self._items())

    def __len__(self) -> int:
        return sum(1 for _ in self._items())

    def clear(self) -> None:
        owner = self._owner
        if owner.d_opt is not None:
            owner.d_opt.state.clear()
        for inner in owner.optim_dict.values():
            inner.state.clear()


def state_format(optimizer: Any) -> str:
    """How ``optimizer.state_dict()`` is laid out (a checkpoint's ``optimizer_format``): torchao's
    ``CPUOffloadOptimizer`` keeps one state dict per offloaded parameter ("offloaded", "on-device"),
    every other optimizer torch's ("state", "param_groups"). A resume needs the same layout."""
    return "torchao-cpu-offload" if hasattr(optimizer, "param_d2h_map") else "torch"


def _resynced(cls: type) -> type:
    """torchao's ``CPUOffloadOptimizer`` (torchao/optim/cpu_offload.py, torchao 0.18/0.19) made to
    fit memfit's loop:

    - its step first copies every gradient to the host again. torchao copies a gradient out as
      backward makes it; memfit's loop changes them after that (summed over ranks,
      fp16-unscaled, clipped by --max-grad-norm), so the host copies the update reads are taken
      anew, after all of it, on torchao's own stream; the queue holds this step's only;
    - ``state``: torchao's class has none (no ``Optimizer.__init__``); the probe, the memory cap
      and the trace read it, the probe clears it (:class:`_OffloadedState`);
    - ``sync_host_weights()``: torchao steps its pinned host copies and copies them to the
      device; weights written to the device otherwise (the probe's undo, a resumed checkpoint)
      must reach the host copies too, or the next step writes the old ones back."""

    class Resynced(cls):  # type: ignore[misc, valid-type]
        @property
        def state(self) -> _OffloadedState:
            return _OffloadedState(self)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            backend = getattr(torch, self.device)  # torch.cuda (or torch.xpu), as torchao does
            self.stream.wait_stream(backend.current_stream())
            self.queue.clear()  # a gradient a backward hook queued and zero_grad dropped since
            for p_device, p_host in self.param_d2h_map.items():
                if p_device.grad is None:
                    continue
                with backend.stream(self.stream):
                    p_host.grad.copy_(p_device.grad, non_blocking=True)
                self.queue[p_device] = self.stream.record_event()
            return super().step(closure)

        @torch.no_grad()
        def sync_host_weights(self) -> None:
            """The device weights copied to torchao's host copies (its next step updates those
            and writes them back); no queued gradient is left over."""
            self.stream.synchronize()
            for p_device, p_host in self.param_d2h_map.items():
                p_host.copy_(p_device.detach())
            self.queue.clear()

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            if "offloaded" not in state_dict or len(state_dict["offloaded"]) != len(
                self.optim_dict
            ):
                raise ValueError(
                    "the optimizer state is not one of torchao's CPUOffloadOptimizer over this "
                    "model (written without --optimizer-offload cpu, or for another model)"
                )
            super().load_state_dict(state_dict)

    Resynced.__name__ = Resynced.__qualname__ = cls.__name__
    return Resynced


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
