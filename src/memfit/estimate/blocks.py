"""The transformer blocks of a model: the units FSDP wraps, and their place in the layer stack.

The tracer marks each block's forward and backward (:mod:`memfit.estimate.trace`), depth
extrapolation matches blocks to layers (:mod:`memfit.estimate.depth`), and ``memfit train
--sharding fsdp`` wraps the same blocks.
"""

from __future__ import annotations

import torch


def fsdp_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP wraps one by one: the transformer blocks (the root wraps the rest).

    The classes a transformers model names in ``_no_split_modules`` (GPT2Block; BERT's
    BertEmbeddings and BertLayer, which transformers 5 collects when the model is built), as
    ``memfit train --sharding fsdp`` wraps them, searched in every submodule (a LoRA or
    bi-encoder wrapper names none itself); where none is named, the class of the repeated
    layers: the items of the longest ``nn.ModuleList`` whose items share one class. Blocks nested
    in a block are not separate units here (the outer one holds them).
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    if not names:
        longest: list[torch.nn.Module] = []
        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList) and len(module) > len(longest):
                kinds = {type(m) for m in module}
                if len(kinds) == 1 and any(True for _ in module[0].parameters()):
                    longest = list(module)
        names = {type(m).__name__ for m in longest}
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if type(module).__name__ in names and id(module) not in inside:
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    return blocks


def block_layers(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[int]:
    """Each block's index in the model's stack of repeated layers (the longest ``ModuleList``
    made of blocks), -1 for a block outside it (BERT's embeddings)."""
    index = {id(block): i for i, block in enumerate(blocks)}
    stack: list[torch.nn.Module] = []
    for module in model.modules():
        if (
            isinstance(module, torch.nn.ModuleList)
            and len(module) > len(stack)
            and all(id(m) in index for m in module)
        ):
            stack = list(module)
    layers = [-1] * len(blocks)
    for layer, module in enumerate(stack):
        layers[index[id(module)]] = layer
    return layers
