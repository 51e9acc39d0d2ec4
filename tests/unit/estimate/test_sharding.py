"""Sharded estimates: each scheme's per-rank model states, its buffers, and where the peak goes."""

from __future__ import annotations

import math

import pytest

from memfit.errors import UsageError
from memfit.estimate import estimate
from memfit.estimate.sharding import (
    DEEPSPEED_SCHEMES,
    deepspeed_zero_config,
    shard_rows,
)
from memfit.estimate.step_trace import BLOCK

WORLDS = (1, 2, 4, 8)


def _bert(tiny_bert: str, **knobs):
    args = dict(task="classification", batch_size=4, seq_len=64, device="cpu") | knobs
    return estimate(tiny_bert, **args)


def _tiny_bert_model():
    """The tiny BERT of the fixture, built for real, to count its parameters independently."""
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
    return BertForSequenceClassification(config)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scheme", DEEPSPEED_SCHEMES)
def test_zero_model_states_are_the_papers_mixed_precision_adam(
    tiny_bert: str, scheme: str, world: int
) -> None:
    est = _bert(tiny_bert, precision="bf16", world_size=world, sharding=scheme)
    state = est.details["model_state"]
    P = est.details["num_parameters"]
    paper = {"zero1": 4 * P + 12 * P // world, "zero2": 2 * P + 14 * P // world}.get(
        scheme, 16 * P // world
    )
    assert state["paper_formula_bytes"] == paper
    # the paper's categories exactly, up to what it leaves out: AdamW's 4-byte step counter per
    # tensor and rounding each tensor's partition up to whole elements (≤ 16 bytes per tensor)
    tensors = sum(1 for _ in _tiny_bert_model().parameters())
    assert 0 <= state["by_paper_categories_bytes"] - paper <= 20 * tensors
    assert state["parameters_bytes"] == (2 * P if scheme != "zero3" else 2 * -(-P // world))
    assert state["gradients_bytes"] == (2 * P if scheme == "zero1" else 2 * -(-P // world))
    # DeepSpeed's fp32 gradient partition: counted in the total, reported apart
    assert state["implementation_bytes"]["fp32_gradient_partition"] == 4 * -(-P // world)
    assert state["total_bytes"] == state["by_paper_categories_bytes"] + sum(
        state["implementation_bytes"].values()
    )
    if scheme == "zero2":
        # DeepSpeed's estimator: 2P + 18P/W, which is memfit's total (up to the step counters)
        assert state["deepspeed_formula_bytes"] == 2 * P + int(18 * P / world)
        assert 0 <= state["total_bytes"] - state["deepspeed_formula_bytes"] <= 20 * tensors


@pytest.mark.parametrize("scheme", DEEPSPEED_SCHEMES)
def test_zero_in_fp32_keeps_a_32_bit_module_and_deepspeeds_own_fp32_partition(
    tiny_bert: str, scheme: str
) -> None:
    est = _bert(tiny_bert, precision="fp32", world_size=4, sharding=scheme)
    state = est.details["model_state"]
    P = est.details["num_parameters"]
    assert state["paper_formula_bytes"] is None  # the paper's figures are for mixed precision
    stage = int(scheme[-1])
    assert state["parameters_bytes"] == 4 * (P if stage < 3 else -(-P // 4))
    assert state["gradients_bytes"] == 4 * (P if stage == 1 else -(-P // 4))
    # fp32 master partition (DeepSpeed clones it even in fp32) + AdamW's two moments, sharded
    tensors = sum(1 for _ in _tiny_bert_model().parameters())
    assert 0 <= state["optimizer_state_bytes"] - 12 * P // 4 <= 20 * tensors


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fsdp_shards_every_tensor_on_dim_0_padded(
    tiny_bert: str, world: int, precision: str
) -> None:
    est = _bert(tiny_bert, precision=precision, world_size=world, sharding="fsdp")
    state = est.details["model_state"]
    params = list(_tiny_bert_model().parameters())
    rows = sum(-(-p.shape[0] // world) * math.prod(p.shape[1:]) for p in params)
    # fp32 shards (the master weights) and fp32 gradient shards, whatever the compute precision
    assert state["parameters_bytes"] == 4 * rows
    assert state["gradients_bytes"] == 4 * rows
    step_counters = 4 * len(params)
    moments = sum(2 * 4 * -(-p.shape[0] // world) * math.prod(p.shape[1:]) for p in params)
    assert state["optimizer_state_bytes"] == moments + step_counters
    P = sum(p.numel() for p in params)
    if world == 8:
        # the 2-row classifier pads to 8 rows: one row each; more than P/W in all
        assert rows > P / world
    if precision == "bf16":
        assert state["paper_formula_bytes"] == 16 * P // world  # ZeRO-3's, the same sharding
    assert shard_rows((2, 64), 8) == 64 and shard_rows((), 8) == 1


def test_lora_base_is_sharded_by_zero3_and_fsdp_only(tiny_gpt2: str) -> None:
    kw = dict(task="causal-lm", batch_size=2, seq_len=32, device="cpu", precision="bf16")
    kw |= dict(lora_rank=4, world_size=4)
    by = {s: estimate(tiny_gpt2, sharding=s, **kw).details for s in ("zero2", "zero3", "fsdp")}
    P, Pt = by["zero2"]["num_parameters"], by["zero2"]["trainable_parameters"]
    assert 0 < Pt < P / 10
    zero2, zero3 = by["zero2"]["model_state"], by["zero3"]["model_state"]
    # frozen parameters: whole 16-bit module under ZeRO-2, partitioned under ZeRO-3
    assert zero2["parameters_bytes"] == 2 * P
    assert zero3["parameters_bytes"] == 2 * -(-P // 4)
    # only the trainable ones have gradients, a master copy and optimizer state
    for state in (zero2, zero3):
        assert state["gradients_bytes"] == 2 * -(-Pt // 4)
        assert state["optimizer_state_bytes"] < 16 * Pt
        assert state["paper_formula_bytes"] is None  # the paper trains every weight
    fsdp = by["fsdp"]["model_state"]
    assert fsdp["parameters_bytes"] < 4 * P / 3  # frozen ones sharded too
    assert fsdp["gradients_bytes"] < 4 * Pt  # trainable ones only, sharded


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("scheme", ["zero3", "fsdp"])
def test_the_peak_never_grows_with_more_gpus(tiny_gpt2: str, scheme: str, device: str) -> None:
    kw = dict(task="causal-lm", batch_size=4, seq_len=64, device=device, precision="bf16")
    peaks = [estimate(tiny_gpt2, world_size=w, sharding=scheme, **kw).total_bytes for w in WORLDS]
    if device == "cpu":
        assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]
    else:
        # W = 1 has no NCCL buffers; from 2 GPUs on, more GPUs never cost more
        assert peaks[1:] == sorted(peaks[1:], reverse=True)


def test_no_sharding_is_one_gpus_memory_without_ddp_buckets(tiny_bert: str) -> None:
    one = _bert(tiny_bert, precision="bf16")
    two = _bert(tiny_bert, precision="bf16", world_size=2)
    # memfit's data parallelism all-reduces each gradient in place: no bucket copy
    assert two.total_bytes == one.total_bytes and two.breakdown == one.breakdown
    # what torch DDP's reducer would add is reported, not counted
    assert two.details["ddp_bucket_bytes"] == 4 * two.details["trainable_parameters"]
    assert two.details["sharding"] == "none" and two.details["world_size"] == 2
    cuda = [_bert(tiny_bert, device="cuda", world_size=w) for w in (1, 2)]
    from memfit.devices.profiles import cuda_profile

    # on CUDA only NCCL's communicator buffers are added
    assert cuda[1].total_bytes - cuda[0].total_bytes == cuda_profile().nccl_bytes


def test_sharded_16_bit_modules_have_no_autocast_weight_copies(tiny_gpt2: str) -> None:
    from memfit.estimate import traces
    from memfit.estimate.sharding import layout
    from memfit.estimate.workload import StepSpec
    from memfit.models import resolve_model

    kw = dict(task="causal-lm", batch_size=2, seq_len=32, precision="bf16")
    estimate(tiny_gpt2, **kw)  # traces it
    spec = StepSpec(task="causal-lm", precision="bf16", device="cuda")
    traced = traces.traced(resolve_model(tiny_gpt2), spec)
    fb = traced.fitted.template
    casts = [j for j, op in enumerate(fb.ops) if op == "weight_cast"]
    # the CUDA emulation's weight cache: one cast per weight used under autocast
    assert casts and all(fb.params[j] >= 0 for j in casts)
    # the trace marks each transformer block's forward and backward
    assert any(kind == BLOCK for kind, _ in fb.events)
    for scheme in ("zero2", "zero3", "fsdp"):
        shard = layout(traced.trace, spec, scheme, 2, hidden_size=64)
        sizes = shard.segment_sizes(fb, list(fb.sizes))
        assert all(sizes[j] == 0 for j in casts)
    # under plain data parallelism autocast still casts (fp32 master weights in the module)
    assert all(fb.sizes[j] > 0 for j in casts)


def test_zero3_gathers_and_fsdp_reshards_show_in_the_breakdown(tiny_gpt2: str) -> None:
    kw = dict(task="causal-lm", batch_size=2, seq_len=32, device="cpu", precision="bf16")
    zero3 = estimate(tiny_gpt2, world_size=8, sharding="zero3", **kw).details
    gather = zero3["gather"]
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_gpt2))
    # parameters under stage3_param_persistence_threshold (10 × hidden) stay whole; DeepSpeed's
    # default max_reuse_distance (1e9) keeps all the others of a small model gathered until
    # backward uses them again
    partitioned = sum(p.numel() for p in model.parameters() if p.numel() >= 640)
    assert gather["kept_gathered_parameters"] == partitioned
    assert gather["largest_layer_parameters"] == 5000 * 64  # the tied embedding / head
    # those kept are every partitioned parameter: the largest layer and the prefetch are among
    # them, not on top
    assert gather["gathered_parameter_bytes"] == 2 * partitioned
    assert gather["reduce_bucket_bytes"] == 2 * 64 * 64  # one contiguous bucket, kept
    fsdp = estimate(tiny_gpt2, world_size=8, sharding="fsdp", **kw).details["gather"]
    assert fsdp["blocks"] == 2 and fsdp["root_parameters"] > fsdp["largest_block_parameters"]


def test_deepspeed_settings_are_accelerates_auto_values() -> None:
    config = deepspeed_zero_config("zero3", 768)
    assert config["stage"] == 3
    assert config["reduce_bucket_size"] == 768 * 768
    assert config["stage3_prefetch_bucket_size"] == int(0.9 * 768 * 768)
    assert config["stage3_param_persistence_threshold"] == 7680
    assert config["stage3_max_reuse_distance"] == 10**9
    assert "stage3_prefetch_bucket_size" not in deepspeed_zero_config("zero2", 768)
    with pytest.raises(ValueError, match="fsdp"):
        deepspeed_zero_config("fsdp", 768)


def test_one_gpu_sharding_is_allowed_and_says_it_divides_nothing(tiny_bert: str) -> None:
    est = _bert(tiny_bert, sharding="fsdp")
    assert "divides nothing" in est.details["sharding_note"]
    assert est.total_bytes >= _bert(tiny_bert).total_bytes  # only its buffers are added


def test_unknown_scheme_names_the_flag(tiny_bert: str) -> None:
    with pytest.raises(UsageError, match=r"--sharding: unknown value 'zero4'.*fsdp"):
        _bert(tiny_bert, sharding="zero4")


def test_sharding_reuses_the_trace(tiny_bert: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from memfit.estimate import traces

    _bert(tiny_bert, precision="fp16")  # traced once (or read from the disk cache)
    traced: list[object] = []
    real = traces._run_trace
    monkeypatch.setattr(traces, "_run_trace", lambda *a, **k: traced.append(a) or real(*a, **k))
    peaks = {
        _bert(tiny_bert, precision="fp16", sharding=scheme, world_size=world).total_bytes
        for scheme in ("zero1", "zero2", "zero3", "fsdp")
        for world in WORLDS
    }
    # every scheme and world size is a replay of the same trace: nothing traced again
    assert traced == [] and len(peaks) > 8


@pytest.mark.parametrize("world", WORLDS)
def test_deepspeeds_own_estimators_agree(world: int) -> None:
    """memfit's model states, counted as DeepSpeed counts them, against DeepSpeed's functions.

    DeepSpeed is not in CI's install (its build wants a CUDA torch): run this with a Python that
    has it, e.g. ``/tmp/dsvenv/bin/python -m pytest tests/unit/estimate/test_sharding.py -k
    deepspeed``.
    """
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    kw = dict(task="classification", batch_size=2, seq_len=128, precision="bf16", device="cpu")
    zero2 = estimate("bert-base-uncased", world_size=world, sharding="zero2", **kw).details
    zero3 = estimate("bert-base-uncased", world_size=world, sharding="zero3", **kw).details
    P = zero2["num_parameters"]
    _, gpu2 = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=world, cpu_offload=False)
    largest = zero3["gather"]["largest_layer_parameters"]
    assert largest == 30522 * 768  # the word embeddings
    _, gpu3, largest_bytes = estimate_zero3_model_states_mem_needs(
        P, largest, num_gpus_per_node=world, cpu_offload=False, cpu_offload_params=False
    )
    tensors = 201
    state2 = zero2["model_state"]
    # ZeRO-2: 2P + 18P/W; memfit's total adds only AdamW's step counters and partition rounding
    assert 0 <= state2["total_bytes"] - gpu2 <= 20 * tensors
    assert state2["deepspeed_formula_bytes"] == gpu2
    # ZeRO-3: DeepSpeed counts 18P/W for the partitioned states plus 4 bytes per largest-layer
    # parameter (the 16-bit parameters and gradients of that layer, which memfit's gather
    # buffers hold). memfit counts 2P/W more: the 16-bit parameter partition itself, which
    # ZeRO-3 keeps on every rank and DeepSpeed's ZeRO-3 formula leaves out (its 18 is ZeRO-2's
    # "2 grads 16-bit + 4 grads 32-bit + 4 params 32-bit + 8 optimizer states")
    state3 = zero3["model_state"]
    partitioned = state3["total_bytes"] - state3["implementation_bytes"]["persistent_parameters"]
    parameter_partition = 2 * -(-P // world)
    assert 0 <= partitioned + largest_bytes - gpu3 - parameter_partition <= 20 * tensors
    assert state3["deepspeed_formula_bytes"] == gpu3


def test_zero12_partition_buffer_holds_every_overlapping_parameter_whole() -> None:
    from memfit.estimate.sharding import zero12_partitions

    # group 0: 16 elements, two partitions of 8; the 10-element tensor straddles the boundary
    # and counts whole on both ranks. group 1: 3 elements padded to 4 (2·W), partitions of 2
    overlap, pieces, largest = zero12_partitions([[10, 4, 2], [3]], 2)
    assert overlap == [10 + 3, 10 + 4 + 2 + 3]
    assert pieces == [8, 4]  # rank 0's slice of the 10; rank 1's whole 4
    assert largest == 8
    # one rank: everything, once
    assert zero12_partitions([[10, 4, 2], [3]], 1) == ([19], [10], 16)


@pytest.mark.parametrize("world", (2, 3, 8))
def test_zero12_partition_buffer_is_deepspeeds(tiny_bert: str, world: int) -> None:
    """The partition buffer's size, against DeepSpeed's own partitioning of memfit train's
    optimizer groups (``get_partition_info``, ``copy_grads_in_partition``'s total_size)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from memfit.train.optim import make_optimizer

    model = _tiny_bert_model()
    groups = [g["params"] for g in make_optimizer("adamw", model, 1e-3, 0.0).param_groups]
    per_rank = [0] * world
    for params in groups:
        total = sum(p.numel() for p in params)
        size = -(-total // (2 * world)) * 2 * world // world  # the flat buffer, aligned
        for rank in range(world):
            inside, _, _ = DeepSpeedZeroOptimizer.get_partition_info(None, params, size, rank)
            per_rank[rank] += sum(p.numel() for p in inside)
    worst = max(per_rank)
    est = _bert(tiny_bert, precision="fp32", world_size=world, sharding="zero2")
    gather = est.details["gather"]
    assert gather["gradient_partition_parameters"] == worst
    assert gather["gradient_partition_bytes"] == 4 * worst
    # the embedding straddles a boundary: more than an even share of the parameters
    assert worst > est.details["trainable_parameters"] / world
    # each gradient is whole for a moment, the largest one (the word embeddings) included
    assert gather["unreduced_gradient_bytes"] == 4 * 1000 * 64
