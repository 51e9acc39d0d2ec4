"""``--sharding fsdp``: PyTorch FSDP2 under the guard (parameters, gradients, optimizer state sharded).

Every module whose class the model names in ``_no_split_modules`` (BertLayer, GPT2Block, …; see
:func:`memfit.estimate.blocks.fsdp_blocks`, which the estimator uses too) is wrapped with :func:`torch.distributed.fsdp.fully_shard`, then the root, as accelerate's FSDP2 path
and transformers do. (accelerate's FSDP plugin itself only switches on with GPUs: on the CPU its
``Accelerator`` falls back to DDP, so memfit calls ``fully_shard`` directly, on both.)

FSDP communicates *inside* forward and backward (an all-gather before each block, a reduce-scatter
after each block's backward), so an OOM on one rank would leave the others waiting in one of those
collectives. memfit gives FSDP its own all-gather and reduce-scatter (``set_custom_all_gather`` /
``set_custom_reduce_scatter``) that first meet the other ranks at a sync point
(:meth:`memfit.train.distributed.Ranks.check`); FSDP allocates their output buffers before it
calls them, so no allocation lies between the sync point and the collective, and a rank that ran
out of memory anywhere is always met at a sync point. After an OOM every FSDP module is resharded
and its state reset before the step is re-run.

Gradients are summed, not averaged (``set_gradient_divide_factor(1)``): each rank's loss is already
its share of the whole step's mean (see :mod:`memfit.train.distributed`). A rank with fewer
micro-batches than the others runs zero-weighted passes (:meth:`ShardedModel.pad_pass`), so every
rank makes the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from memfit.errors import UsageError
from memfit.estimate.blocks import fsdp_blocks


def _comm_classes(ranks: Any) -> tuple[Any, Any]:
    try:
        # optional: FSDP2's custom collectives, in torch ≥ 2.8 only
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:  # pragma: no cover - a torch without FSDP2's custom comms
        raise UsageError(
            "--sharding: fsdp needs PyTorch's FSDP2 with custom collectives (torch ≥ 2.8)"
        ) from None

    class AgreeingAllGather(DefaultAllGather):  # type: ignore[misc]
        """FSDP's all-gather, after a sync point (another rank's OOM is raised here)."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            ranks.check()
            return super().__call__(*args, **kwargs)

    class AgreeingReduceScatter(DefaultReduceScatter):  # type: ignore[misc]
        """FSDP's reduce-scatter, after a sync point."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            ranks.check()
            return super().__call__(*args, **kwargs)

    return AgreeingAllGather(), AgreeingReduceScatter()


class ShardedModel:
    """The FSDP modules of a sharded model, and what the loop needs of them."""

    def __init__(self, model: nn.Module, modules: Sequence[Any]) -> None:
        self.model = model
        self.modules = list(modules)

    def pad_pass(self, recipe: Any, rows: Sequence[Any]) -> Callable[[bool], None]:
        """A pass with no weight, for a rank that has no micro-batch left while others do: the
        same collectives, nothing added to the gradient (or to the eval metrics)."""
        row = rows[0]

        def run(train: bool) -> None:
            if train:
                # the loss times zero: every gradient it adds is zero
                (recipe.loss([row], 1) * 0.0).backward()
            else:
                recipe.eval_partial([row])

        return run

    def reset(self) -> None:
        """After an OOM: FSDP's own recovery (``reset_iter_state`` on the root: parameters
        resharded, pending collectives waited for, the failed step's reductions dropped), so the
        step can be re-run."""
        self.model.reset_iter_state()  # type: ignore[operator]
        # a backward that died between computing a block's unsharded gradients and
        # reduce-scattering them leaves them on the unsharded parameters, where the re-run's
        # backward would add to them: the failed step's gradients go too
        for module in self.modules:
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
                    fsdp_param.unsharded_accumulated_grad = None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights on the CPU, on every rank (a collective)."""
        # start-up time: torch's distributed checkpointing loads only for --sharding fsdp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights: dict[str, Any] = get_model_state_dict(self.model, options=options)
        # tied weights (GPT-2's lm_head and wte) come back as two copies: make them one tensor
        # again, so save_pretrained sees the tie and writes it once, as a one-process run does
        names: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        for group in names.values():
            for alias in group[1:]:
                if alias in weights and group[0] in weights:
                    weights[alias] = weights[group[0]]
        return weights

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state for the whole model (a collective), for a checkpoint."""
        # start-up time: torch's distributed checkpointing loads only for --sharding fsdp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, optimizer, options=options)

    def load(
        self,
        model_state: dict[str, Any],
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
    ) -> None:
        """Load whole-model weights and optimizer state into the shards (every rank)."""
        # start-up time: torch's distributed checkpointing loads only for --sharding fsdp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, model_state, options=options)
        if optimizer_state.get("state"):
            set_optimizer_state_dict(self.model, optimizer, optimizer_state, options=options)
            return
        # an optimizer without state (plain SGD): only the groups' settings come back (torch's
        # loader wants a state tensor to learn the device from)
        for group, saved in zip(
            optimizer.param_groups, optimizer_state["param_groups"], strict=True
        ):
            group.update({k: v for k, v in saved.items() if k != "params"})


def shard_model(
    model: nn.Module, ranks: Any, *, precision: str, device: torch.device
) -> ShardedModel:
    """Wrap ``model`` with FSDP2 in place: each transformer block, then the root."""
    # optional: FSDP2's public API is in torch ≥ 2.6 only (memfit takes torch ≥ 2.4)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (  # optional: FSDP2 (torch ≥ 2.6)
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
    )

    if ranks is None:
        raise UsageError(
            "--sharding: fsdp shards over several ranks; launch them with torchrun "
            "--nproc_per_node N -m memfit train … (or use --sharding none)"
        )
    mesh = init_device_mesh(device.type, (ranks.world_size,))
    if precision in ("bf16", "fp16"):
        # gathered and computed in 16 bits, the shards (master weights) and reductions in fp32
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    # the same units the estimator prices for --sharding fsdp
    blocks = [m for m in fsdp_blocks(model) if m is not model]
    if not blocks:
        raise UsageError(
            f"--sharding: fsdp does not know the blocks of {type(model).__name__} (it names no "
            "_no_split_modules); use --sharding none"
        )
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        all_gather, reduce_scatter = _comm_classes(ranks)
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)
        # sum, not mean: each rank's loss is its share of the whole step's mean already (and
        # SUM collectives: gloo has no pre-multiplied sum)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    if not hasattr(model, "reset_iter_state"):  # pragma: no cover - older torch
        raise UsageError(
            "--sharding: fsdp needs FSDP2's reset_iter_state (torch ≥ 2.13) to recover from OOM"
        )
    return ShardedModel(model, modules)
