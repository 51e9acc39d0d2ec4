"""--optimizer-offload cpu in the estimate: the state leaves the GPU, host memory holds what the
implementation allocates there (torchao's CPUOffloadOptimizer; DeepSpeed ZeRO-Offload)."""

from __future__ import annotations

import pytest
import torch

from memfit.estimate import estimate
from memfit.estimate.optimizer_offload import (
    TORCHAO_MINIMAL_SIZE,
    host_parts,
    pinned_bytes,
    zero_partition_sizes,
)
from memfit.estimate.step_spec import StepSpec


def _tiny_bert_parameters() -> list[torch.nn.Parameter]:
    """The tiny BERT of the fixture, built for real (its trainable parameters)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=2,
    )
    return [p for p in BertForSequenceClassification(config).parameters() if p.requires_grad]


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_torchao_host_parts_are_the_allocations_of_its_host_side() -> None:
    """torchao's host side, allocated for real on the CPU as ``CPUOffloadOptimizer.__init__``
    does (torchao/optim/cpu_offload.py: ``p_host = torch.empty_like(p_device, device="cpu",
    pin_memory=True)``, ``p_host.grad = torch.empty_like(p_host, pin_memory=True)``, one
    ``AdamW(fused=True)`` per offloaded parameter; pinning needs CUDA, the bytes do not), then
    stepped once so the fused AdamW makes its state."""
    params = _tiny_bert_parameters()
    hosts, grads, state = [], [], []
    for p in params:
        if p.numel() < TORCHAO_MINIMAL_SIZE:
            continue  # torchao keeps it on the device, with an on-device optimizer
        host = torch.empty_like(p, device="cpu").copy_(p.detach())
        host.grad = torch.randn_like(host)
        optimizer = torch.optim.AdamW([host], lr=1e-3, fused=True)
        optimizer.step()
        hosts.append(host)
        grads.append(host.grad)
        state += [v for v in optimizer.state[host].values() if isinstance(v, torch.Tensor)]
    numels = [p.numel() for p in params]
    spec = StepSpec(task="classification", optimizer_offload="cpu", device="cpu")
    parts = host_parts(
        spec,
        trainable_parameters=sum(numels),
        trainable_dtype_bytes=4,
        parameter_numels=numels,
    )
    assert parts["master_weights"] == _storage_bytes(hosts)
    assert parts["gradients"] == _storage_bytes(grads)
    assert parts["optimizer_state"] == _storage_bytes(state)
    assert parts["pinned_rounding"] == 0  # nothing is pinned on the CPU device
    # on a GPU the two pinned copies of each come from the caching host allocator, each rounded
    # up to a power of two
    on_gpu = host_parts(
        StepSpec(task="classification", optimizer_offload="cpu", device="cuda"),
        trainable_parameters=sum(numels),
        trainable_dtype_bytes=4,
        parameter_numels=numels,
    )
    rounding = sum(2 * (pinned_bytes(h.nbytes) - h.nbytes) for h in hosts)
    assert on_gpu["pinned_rounding"] == rounding > 0
    assert pinned_bytes(3 * 2**20) == 4 * 2**20 and pinned_bytes(2**20) == 2**20


def test_nothing_in_host_memory_without_offload_or_in_evaluation() -> None:
    kw = dict(trainable_parameters=10**6, trainable_dtype_bytes=4)
    assert host_parts(StepSpec(task="causal-lm"), **kw) == {}
    assert host_parts(StepSpec(task="causal-lm", optimizer_offload="cpu", mode="eval"), **kw) == {}


def test_the_gpu_keeps_only_the_state_of_the_parameters_torchao_keeps(tiny_bert: str) -> None:
    kw = dict(task="classification", batch_size=4, seq_len=64, device="cuda")
    on_gpu = estimate(tiny_bert, **kw)
    offloaded = estimate(tiny_bert, optimizer_offload="cpu", **kw)
    params = _tiny_bert_parameters()
    small = [p.numel() for p in params if p.numel() < TORCHAO_MINIMAL_SIZE]
    P = sum(p.numel() for p in params)
    assert on_gpu.breakdown["optimizer_state"] >= 8 * P
    # AdamW's two fp32 moments of the parameters under 4096 elements (torchao's on-device
    # optimizer), plus at most a 4-byte step counter each
    kept = offloaded.breakdown["optimizer_state"]
    assert 8 * sum(small) <= kept <= 8 * sum(small) + 4 * len(small)
    # the gradients stay on the GPU (offload_gradients=False)
    assert offloaded.breakdown["gradients"] == on_gpu.breakdown["gradients"]


def test_zero2_offload_agrees_with_deepspeeds_estimator(tiny_bert: str) -> None:
    """2 ranks, ZeRO-2, bf16 AdamW: per rank, the GPU's model states and the host's are those
    of DeepSpeed's estimate_zero2_model_states_mem_needs(cpu_offload=True) (its 1.5 buffer
    factor left out: it is a margin, not an allocation)."""
    deepspeed_estimator = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    est = estimate(
        tiny_bert,
        task="classification",
        batch_size=4,
        seq_len=64,
        device="cpu",
        precision="bf16",
        world_size=2,
        sharding="zero2",
        optimizer_offload="cpu",
    )
    P = est.details["num_parameters"]
    cpu_mem, gpu_mem = deepspeed_estimator.estimate_zero2_model_states_mem_needs(
        P, num_gpus_per_node=2, cpu_offload=True, additional_buffer_factor=1.0
    )
    state = est.details["model_state"]
    assert state["by_paper_categories_bytes"] == gpu_mem  # the 16-bit module, nothing else
    assert state["gradients_bytes"] == state["optimizer_state_bytes"] == 0
    host = state["host"]
    assert host["total_bytes"] * 2 == cpu_mem
    assert state["deepspeed_offload_formula_bytes"] == {"gpu": gpu_mem, "host": cpu_mem // 2}
    # the host parts: the same categories per rank (DeepSpeed pads each flat group to 2·W)
    sizes = zero_partition_sizes([[P]], 2)
    parts = host_parts(
        StepSpec(task="classification", precision="bf16", optimizer_offload="cpu", device="cpu"),
        trainable_parameters=P,
        trainable_dtype_bytes=4,
        world_size=2,
        sharding="zero2",
    )
    assert parts["master_weights"] == parts["gradients"] == 4 * sizes[0]
    assert parts["optimizer_state"] == 8 * sizes[0]
    assert (
        abs(
            parts["master_weights"]
            + parts["gradients"]
            + parts["optimizer_state"]
            - host["total_bytes"]
        )
        <= 16
    )


def test_zero_offload_moves_the_master_and_state_off_the_gpu_peak(tiny_bert: str) -> None:
    kw = dict(task="classification", batch_size=4, seq_len=64, device="cuda", precision="bf16")
    kw |= dict(world_size=2)
    for scheme in ("zero1", "zero2", "zero3"):
        plain = estimate(tiny_bert, sharding=scheme, **kw)
        offloaded = estimate(tiny_bert, sharding=scheme, optimizer_offload="cpu", **kw)
        assert offloaded.breakdown["optimizer_state"] == 0, scheme
        # the tensors at the peak (a tiny model's total is the CUDA runtime and whole segments)
        assert _tensors(offloaded.breakdown) < _tensors(plain.breakdown), scheme


def _tensors(breakdown: dict[str, int]) -> int:
    overheads = ("allocator_overhead", "runtime_overhead")
    return sum(v for k, v in breakdown.items() if k not in overheads)


def test_on_cpu_ranks_the_host_parts_are_in_the_peak(tiny_bert: str) -> None:
    """The CPU's host is its device: ZeRO-Offload's master weights, state and gradient
    partitions are held beside the module, not reported apart."""
    kw = dict(task="classification", batch_size=4, seq_len=64, device="cpu", precision="bf16")
    est = estimate(tiny_bert, world_size=2, sharding="zero2", optimizer_offload="cpu", **kw)
    host = est.details["model_state"]["host"]
    assert (
        est.breakdown["optimizer_state"]
        >= host["master_weights_bytes"] + host["optimizer_state_bytes"]
    )
    assert est.breakdown["gradients"] >= host["gradients_bytes"]


def test_zero_offload_host_parts_by_stage() -> None:
    spec = StepSpec(task="causal-lm", precision="bf16", optimizer_offload="cpu", device="cuda")
    groups = [[4096 * 4096, 4096 * 1024], [4096, 4096]]
    kw = dict(trainable_parameters=sum(map(sum, groups)), trainable_dtype_bytes=4)
    zero2 = host_parts(spec, **kw, world_size=4, sharding="zero2", parameter_groups=groups)
    sizes = zero_partition_sizes(groups, 4)
    assert zero2["master_weights"] == zero2["gradients"] == 4 * sum(sizes)
    assert zero2["optimizer_state"] == 8 * sum(sizes)
    assert zero2["bit16_partition_buffer"] == 2 * sum(sizes)
    assert zero2["gradient_staging_buffer"] == 2 * 4096 * 4096
    # every parameter overlapping a rank's partitions keeps a whole gradient there: on the last
    # rank the end of the large matrix, the second matrix and the second group's last vector
    assert zero2["gradient_accumulation_buffers"] == 2 * (4096 * 4096 + 4096 * 1024 + 4096)
    assert zero2["pinned_rounding"] >= 0
    zero3 = host_parts(spec, **kw, world_size=4, sharding="zero3", parameter_groups=groups)
    partitions = [sum(-(-n // 4) for n in g) for g in groups]
    assert zero3["master_weights"] == 4 * sum(partitions)
    assert zero3["reduced_gradient_partitions"] == 2 * sum(partitions)
    assert "bit16_partition_buffer" not in zero3


def test_the_host_budget_bounds_every_rank_of_the_node(tiny_bert: str) -> None:
    """ZeRO-2 on 8 GPUs: each rank keeps its own partitions in host memory, so the node holds
    8 times the per-rank figure; a budget that one rank's fits but the node's does not is not
    enough."""
    kw = dict(task="classification", batch_size=4, seq_len=64, device="cuda", precision="bf16")
    kw |= dict(world_size=8, sharding="zero2", optimizer_offload="cpu")
    host = estimate(tiny_bert, host_memory=2**40, **kw).details["host"]
    per_rank = host["total_bytes"]
    assert host["per"] == "rank" and host["ranks_per_node"] == 8
    assert host["fits"]
    assert not estimate(tiny_bert, host_memory=8 * per_rank - 1, **kw).details["host"]["fits"]
    assert estimate(tiny_bert, host_memory=8 * per_rank, **kw).details["host"]["fits"]
    # one rank (no sharding): the node holds the one copy
    one = estimate(tiny_bert, host_memory=2**40, **{**kw, "world_size": 1, "sharding": "none"})
    assert one.details["host"]["ranks_per_node"] == 1
