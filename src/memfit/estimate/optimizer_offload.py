"""What optimizer offloading (``--optimizer-offload cpu``) keeps in host memory, per rank.

Two implementations, each counted from its own allocations:

torchao's ``CPUOffloadOptimizer`` (one process or DDP; torchao 0.18, ``torchao/optim/cpu_offload.py``)
    For every trainable parameter of at least ``minimal_size`` (4096) elements it allocates a
    pinned host copy of the parameter and a pinned host gradient, both ``empty_like`` the device
    parameter (its dtype), and one base optimizer over the host copy (``__init__``: ``p_host =
    torch.empty_like(p_device, device="cpu", pin_memory=True)``; ``p_host.grad =
    torch.empty_like(p_host, pin_memory=True)``; ``self.optim_dict[p_device] =
    optimizer_class(...)``). AdamW there is torch's fused CPU AdamW (``fused=True`` is its
    default for AdamW): ``exp_avg`` and ``exp_avg_sq`` ``zeros_like`` the host parameter, and a
    float32 ``step`` scalar per parameter (fused optimizers keep the step as a tensor). Smaller
    parameters stay on the device with their own optimizer (``d_opt``): their state is GPU memory,
    which the traced step holds (:func:`memfit.estimate.workload.make_optimizer`). The device
    keeps every gradient (``offload_gradients=False``, the default: the device gradient is copied
    out after each backward and freed only by ``zero_grad``).

DeepSpeed ZeRO-Offload (``zero_optimization.offload_optimizer = {"device": "cpu", "pin_memory":
true}``; DeepSpeed 0.19.8), with P_r the elements of this rank's flat partition
    ZeRO-1/2 (``runtime/zero/stage_1_and_2.py``): the fp32 master partition, pinned (``__init__``,
    ``weights_partition ... pin_memory``); a pinned 16-bit (the module's dtype) buffer of the same
    size that the updated partition is cast into before it goes back to the GPU
    (``param_buffer_of_bit16_for_cpu_offload_groups``); the fp32 gradient partition, pinned
    (``initialize_optimizer_states``: ``single_partition_of_fp32_groups[i].grad``); a pinned
    staging buffer of the largest parameter in the module's dtype
    (``temp_grad_buffer_for_cpu_offload``); and DeepSpeedCPUAdam's ``exp_avg``/``exp_avg_sq``
    (``ops/adam/cpu_adam.py``: fp32, ``zeros_like`` the master partition, not pinned); and, for
    every parameter overlapping the partition, a pinned buffer of its whole gradient in the
    module's dtype (``accumulated_grads_in_cpu``: made at a backward that is not the boundary,
    which under memfit train's caller-owned boundary is every backward).
    ZeRO-3 (``runtime/zero/stage3.py``): the fp32 master partition (a plain CPU copy,
    ``_create_fp32_partitions``), the fp32 gradient of each sub-group, pinned
    (``_setup_for_real_optimizer``: ``subgroup_gradient_buffer``), the reduced gradient partitions
    in the module's dtype, pinned (``grad_partitions_flat_buffer``, on the CPU when the optimizer
    is offloaded) and DeepSpeedCPUAdam's two fp32 moments.
    The model states agree with DeepSpeed's own ``estimate_zero2_model_states_mem_needs(...,
    cpu_offload=True)``: 16 bytes per parameter over the ranks in host memory (4 master + 4
    gradient + 8 moments), with its ``additional_buffer_factor`` (1.5) left out; the pinned
    16-bit buffer and the staging buffer are DeepSpeed's implementation beyond its formula.

Pinned host memory comes from PyTorch's caching host allocator, which rounds every allocation up
to a power of two before ``cudaHostAlloc`` (``ATen/core/CachingHostAllocator.h``: ``roundSize =
c10::llvm::PowerOf2Ceil(size)``); the rounding is its own part, ``pinned_rounding``. On the CPU
device nothing is pinned (host and device are the same memory).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# torchao's CPUOffloadOptimizer(minimal_size=4096): smaller parameters stay on the device
TORCHAO_MINIMAL_SIZE = 4096
ZERO_SCHEMES = ("zero1", "zero2", "zero3")
# optimizers whose state the offloaded step keeps, bytes per element of the host parameter:
# AdamW's two moments (in the parameter's dtype under torchao, fp32 under DeepSpeedCPUAdam), SGD
# without momentum none
_STATE_TENSORS = {"adamw": 2, "sgd": 0}
# torch's fused AdamW keeps its step count as a float32 tensor per parameter
_FUSED_STEP_BYTES = 4


def pinned_bytes(size: int, *, pinned: bool = True) -> int:
    """What an allocation of ``size`` bytes takes from PyTorch's caching host allocator: the block
    it gives a pinned tensor, rounded up to a power of two (``CachingHostAllocator.h``:
    ``PowerOf2Ceil``, below ``pinned_max_round_threshold``, unbounded by default), kept cached
    when freed (unpinned: ``size``). The replay's activation copies use it too
    (``memfit.estimate.replay.pinned_block_bytes``)."""
    if not pinned or size <= 0:
        return max(0, size)
    return 1 << (size - 1).bit_length()


def torchao_split(parameter_numels: Sequence[int]) -> tuple[list[int], list[int]]:
    """The trainable parameters torchao offloads (at least ``minimal_size`` elements) and those
    it keeps on the device with an on-device optimizer, by element count."""
    offloaded = [n for n in parameter_numels if n >= TORCHAO_MINIMAL_SIZE]
    kept = [n for n in parameter_numels if n < TORCHAO_MINIMAL_SIZE]
    return offloaded, kept


def host_parts(
    spec: Any,
    *,
    trainable_parameters: int,
    trainable_dtype_bytes: int,
    world_size: int = 1,
    sharding: str = "none",
    parameter_numels: Sequence[int] | None = None,
    parameter_groups: Sequence[Sequence[int]] | None = None,
    largest_parameter: int = 0,
) -> dict[str, int]:
    """Host-memory bytes of one rank by part, for ``spec.optimizer_offload == "cpu"`` in
    training ({} otherwise): ``master_weights`` (the host copy the CPU step updates),
    ``gradients`` (the host copies of the gradients it reads), ``optimizer_state`` and the
    implementation's own buffers (see the module docstring), ``pinned_rounding`` last.

    ``parameter_numels``: each trainable parameter's elements (torchao offloads only those of at
    least 4096 elements and keeps a step counter per parameter; None: one parameter of
    ``trainable_parameters``). ``parameter_groups``: DeepSpeed's parameter groups, each a list of
    element counts (each group is flattened and partitioned on its own; None: one group).
    ``largest_parameter``: the largest trainable parameter's elements (ZeRO-1/2's staging
    buffer; 0: the largest of ``parameter_numels``)."""
    if getattr(spec, "optimizer_offload", "none") != "cpu" or getattr(spec, "mode", "train") != (
        "train"
    ):
        return {}
    pinned = getattr(spec, "device", "cuda") != "cpu"
    if parameter_numels is not None:
        numels = list(parameter_numels)
    elif parameter_groups:
        numels = [n for group in parameter_groups for n in group]
    else:
        numels = [trainable_parameters]
    if sharding in ZERO_SCHEMES:
        groups = [list(g) for g in parameter_groups] if parameter_groups else [numels]
        largest = largest_parameter or max(numels, default=0)
        return _zero_offload_parts(spec, sharding, groups, max(1, world_size), largest, pinned)
    return _torchao_parts(spec, numels, trainable_dtype_bytes, pinned)


def _torchao_parts(spec: Any, numels: list[int], dtype_bytes: int, pinned: bool) -> dict[str, int]:
    offloaded, _kept = torchao_split(numels)
    copies = [n * dtype_bytes for n in offloaded]
    state_tensors = _STATE_TENSORS.get(getattr(spec, "optimizer", "adamw"), 2)
    state = sum(state_tensors * c for c in copies)
    if state_tensors:
        state += _FUSED_STEP_BYTES * len(offloaded)
    exact = 2 * sum(copies)
    held = 2 * sum(pinned_bytes(c, pinned=pinned) for c in copies)
    return {
        "master_weights": sum(copies),
        "gradients": sum(copies),
        "optimizer_state": state,
        "pinned_rounding": held - exact,
    }


def zero_partition_sizes(groups: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """Elements of one rank's flat partition of each parameter group (ZeRO-1/2: the group padded
    to a multiple of 2·W elements, then divided by W: ``stage_1_and_2.py``)."""
    sizes = []
    for numels in groups:
        alignment = 2 * world_size
        sizes.append(-(-sum(numels) // alignment) * alignment // world_size)
    return sizes


def _worst_rank_overlap(groups: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """The element counts of the parameters that overlap one rank's ZeRO-1/2 partitions (each
    group's), on the rank where they add up to most."""
    sizes = zero_partition_sizes(groups, world_size)
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    for numels, size in zip(groups, sizes, strict=True):
        index = 0
        for n in numels:
            if n > 0 and size > 0:
                first, last = index // size, min(world_size - 1, (index + n - 1) // size)
                for rank in range(first, last + 1):
                    per_rank[rank].append(n)
            index += n
    return max(per_rank, key=sum)


def _zero_offload_parts(
    spec: Any,
    sharding: str,
    groups: list[list[int]],
    world_size: int,
    largest: int,
    pinned: bool,
) -> dict[str, int]:
    # the module's bytes per element (16-bit under mixed precision, the gradients' too)
    b = 4 if getattr(spec, "precision", "fp32") == "fp32" else 2
    moments = _STATE_TENSORS.get(getattr(spec, "optimizer", "adamw"), 2)
    rounding = 0

    def pin(size: int) -> int:
        nonlocal rounding
        rounding += pinned_bytes(size, pinned=pinned) - size
        return size

    if sharding == "zero3":
        # one flat partition per sub-group (sub_group_size 10^9 elements: a group each), each
        # parameter's partition ceil(numel / W)
        partitions = [sum(-(-n // world_size) for n in g) for g in groups]
        master = sum(4 * p for p in partitions)  # a plain CPU copy, not pinned
        gradients = sum(pin(4 * p) for p in partitions)
        reduced = pin(b * sum(partitions))  # grad_partitions_flat_buffer, one for all
        parts = {
            "master_weights": master,
            "gradients": gradients,
            "optimizer_state": sum(moments * 4 * p for p in partitions),
            "reduced_gradient_partitions": reduced,
        }
    else:
        partitions = zero_partition_sizes(groups, world_size)
        parts = {
            "master_weights": sum(pin(4 * p) for p in partitions),
            "gradients": sum(pin(4 * p) for p in partitions),
            "optimizer_state": sum(moments * 4 * p for p in partitions),
            # the updated partition cast to the module's dtype before its copy to the GPU
            "bit16_partition_buffer": sum(pin(b * p) for p in partitions),
            # each gradient's way to the host goes through one buffer of the largest parameter
            "gradient_staging_buffer": pin(b * largest),
            # every parameter overlapping the partition accumulates its whole gradient in a
            # pinned host buffer of its own (accumulated_grads_in_cpu), made at its first
            # backward and kept: memfit train's caller-owned boundary (and any step of several
            # micro-batches) takes that path at every backward
            "gradient_accumulation_buffers": sum(
                pin(b * n) for n in _worst_rank_overlap(groups, world_size)
            ),
        }
    parts["pinned_rounding"] = rounding
    return parts


def host_parts_of_trace(
    trace: Any, spec: Any, *, world_size: int = 1, sharding: str = "none"
) -> dict[str, int]:
    """:func:`host_parts` from a step's trace (:class:`memfit.estimate.step_trace.StepTrace`):
    the trainable parameters' element counts, dtype and DeepSpeed's parameter groups read off
    its parameters."""
    trainable = [p for p in trace.params if p.trainable]
    if not trainable:
        return {}
    numels = [p.numel for p in trainable]
    # DeepSpeed's groups as memfit train and the Trainer build them: decayed matrices, then the
    # vectors (memfit.estimate.sharding.deepspeed_param_groups)
    decay = [p.numel for p in trainable if len(p.shape) >= 2]
    no_decay = [p.numel for p in trainable if len(p.shape) < 2]
    return host_parts(
        spec,
        trainable_parameters=sum(numels),
        trainable_dtype_bytes=max(p.itemsize for p in trainable),
        world_size=world_size,
        sharding=sharding,
        parameter_numels=numels,
        parameter_groups=[g for g in (decay, no_decay) if g],
        largest_parameter=max(numels),
    )


class HostSteppedOptimizer(torch.optim.Optimizer):
    """The device side of an optimizer offloaded to host memory, as the estimator traces it:
    torchao's ``CPUOffloadOptimizer`` allocates no state on the device for the parameters it
    offloads (their update runs on the host copies, then ``p_device.copy_(p_host)`` writes them
    back in place), keeps the gradients until ``zero_grad`` and steps the parameters under
    ``minimal_size`` elements with an optimizer on the device (``device_optimizer``). Its
    ``state`` is that optimizer's, so the trace counts it as optimizer state."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        make_device_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        *,
        lr: float,
    ) -> None:
        params = list(params)
        super().__init__(params, {"lr": lr})
        kept = [p for p in params if p.numel() < TORCHAO_MINIMAL_SIZE]
        self.device_optimizer = make_device_optimizer(kept) if kept else None
        if self.device_optimizer is not None:
            self.state = self.device_optimizer.state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        # the offloaded parameters' update allocates nothing on the device
        if self.device_optimizer is not None:
            self.device_optimizer.step()
        return None


__all__ = [
    "TORCHAO_MINIMAL_SIZE",
    "HostSteppedOptimizer",
    "host_parts",
    "host_parts_of_trace",
    "pinned_bytes",
    "torchao_split",
    "zero_partition_sizes",
]
