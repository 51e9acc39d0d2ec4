"""QLoRA's quantized base weights and the paged optimizers (memfit.estimate.quantized).

The estimator's emulated layers are checked against bitsandbytes itself on real CPU tensors
(what they hold, what a forward and a backward allocate, measured by the profiler's allocation
events), the model-level choices against transformers' quantizer and peft, and the paged state
against bitsandbytes' own optimizer.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from memfit.cli import main
from memfit.estimate import quantized, quantized_count, traces, workload
from memfit.estimate.quantized import Linear4bitModel, Linear8bitModel, PagedAdamStateModel
from memfit.estimate.step_trace import CATEGORIES
from memfit.estimate.workload import StepSpec


def llama_config(layers: int = 2, vocab: int = 512) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    llama_config().save_pretrained(folder)
    return str(folder / "config.json")


# --- measuring real CPU tensors --------------------------------------------------------------------
def allocations(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """``fn()``, the peak of the bytes it allocated (live above the start) and what it left."""
    from torch.profiler import ProfilerActivity, profile

    # the garbage collector would free earlier tests' tensors inside the profile (seen in the
    # whole suite: three foreign 6 KiB frees in one eval forward): it is held during the profile
    # (a collection before each profile took 0.2 s in a process holding torch and transformers,
    # 27 of the 31 s of the 16 layer comparisons, and frees nothing the profile could see)
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
    finally:
        gc.enable()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return out, peak, live


def storage_bytes(tensors: Iterable[Any]) -> int:
    """The bytes of the distinct storages of ``tensors`` (None and non-tensors skipped)."""
    seen = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if isinstance(t, torch.Tensor)
    }
    return sum(seen.values())


def bnb_held(layer: Any) -> int:
    """What a bitsandbytes layer holds: weight, quantization state, row scales, bias."""
    held = [layer.weight.data, layer.bias]
    state = getattr(layer.weight, "quant_state", None)
    if state is not None:
        held += [state.absmax, state.code, state.offset]
        if state.nested:
            held += [state.state2.absmax, state.state2.code]
    lt_state = getattr(layer, "state", None)
    if lt_state is not None:
        held += [lt_state.CB, lt_state.SCB, layer.weight.SCB]
    return storage_bytes(held)


def step_profile(
    layer: torch.nn.Module, dtype: torch.dtype, shape: tuple[int, int, int]
) -> list[int]:
    """Bytes a training forward and backward, then an eval forward, allocate (peak, left), after
    a warm-up step (bitsandbytes casts a bias and moves the int8 state at the first forward)."""
    batch, seq, features = shape
    torch.manual_seed(0)
    x = (torch.randn(batch, seq, layer.in_features) * 0.1).to(dtype).requires_grad_()
    grad = torch.randn(batch, seq, features).to(dtype)
    layer.train()
    layer(x).backward(grad)
    x.grad = None
    out, forward_peak, forward_left = allocations(lambda: layer(x))
    _, backward_peak, backward_left = allocations(lambda: out.backward(grad))
    layer.eval()
    with torch.no_grad():
        _, eval_peak, eval_left = allocations(lambda: layer(x.detach()))
    return [forward_peak, forward_left, backward_peak, backward_left, eval_peak, eval_left]


# --- the layers against bitsandbytes --------------------------------------------------------------
FOUR_BIT_CASES = list(
    itertools.product(("nf4", "fp4"), (False, True), (torch.float32, torch.bfloat16), (False, True))
)


@pytest.mark.parametrize(("quant_type", "double_quant", "compute", "bias"), FOUR_BIT_CASES)
def test_4bit_layer_holds_and_allocates_what_bitsandbytes_does(
    quant_type: str, double_quant: bool, compute: torch.dtype, bias: bool
) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    features_in, features_out = 128, 96
    real = bnb.nn.Linear4bit(
        features_in,
        features_out,
        bias=bias,
        compute_dtype=compute,
        compress_statistics=double_quant,
        quant_type=quant_type,
    )
    weight = torch.randn(features_out, features_in).to(compute)
    real.weight = bnb.nn.Params4bit(
        weight,
        requires_grad=False,
        quant_type=quant_type,
        compress_statistics=double_quant,
        module=real,
    )
    real = real.to("cpu")  # quantizes, as loading does
    # the AVX512-BF16 repacking for CPU inference is not modelled (see the module docstring)
    real.support_avx512bf16_for_cpu = False
    if bias:
        real.bias.requires_grad_(False)
    emulated = Linear4bitModel(
        features_in,
        features_out,
        bias,
        quant_type=quant_type,
        double_quant=double_quant,
        compute_dtype=compute,
        device_type="cpu",
    )
    # the input as prepare_model_for_kbit_training leaves it (fp32) and in the compute dtype
    for dtype in {torch.float32, compute}:
        shape = (2, 16, features_out)
        assert step_profile(emulated, dtype, shape) == step_profile(real, dtype, shape)
    # what both hold once a step has run (bitsandbytes casts the bias at the first forward)
    assert storage_bytes([*emulated.parameters(), *emulated.buffers()]) == bnb_held(real)


@pytest.mark.parametrize(
    ("dtype", "bias"),
    itertools.product((torch.float32, torch.bfloat16, torch.float16), (False, True)),
)
def test_int8_layer_holds_and_allocates_what_bitsandbytes_does(
    dtype: torch.dtype, bias: bool
) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # "inputs will be cast to fp16"
    features_in, features_out = 128, 96
    real = bnb.nn.Linear8bitLt(
        features_in,
        features_out,
        bias=bias,
        has_fp16_weights=False,
        threshold=quantized.INT8_THRESHOLD,
    )
    real.weight = bnb.nn.Int8Params(
        torch.randn(features_out, features_in), requires_grad=False, has_fp16_weights=False
    )
    real = real.to("cpu")
    if bias:
        real.bias.requires_grad_(False)
    emulated = Linear8bitModel(features_in, features_out, bias, device_type="cpu")
    shape = (2, 16, features_out)
    assert step_profile(emulated, dtype, shape) == step_profile(real, dtype, shape)
    assert storage_bytes([*emulated.parameters(), *emulated.buffers()]) == bnb_held(real)


def test_cuda_fallback_keeps_the_dequantized_scales_to_the_end() -> None:
    """Read from bitsandbytes' CUDA gemm_4bit fallback (no GPU here): with double quantization it
    keeps the fp32 scales (absmax_dq) beside their sum with the offset until the matmul ends,
    where the CPU's default kernel frees the first at once; the rest is the same."""
    peaks = {}
    for device_type in ("cpu", "cuda"):
        layer = Linear4bitModel(
            128,
            96,
            False,
            quant_type="nf4",
            double_quant=True,
            compute_dtype=torch.bfloat16,
            device_type=device_type,
        )
        peaks[device_type] = step_profile(layer, torch.bfloat16, (2, 16, 96))
    scales = Linear4bitModel(
        128, 96, False, quant_type="nf4", double_quant=True, compute_dtype=torch.bfloat16,
        device_type="cpu",
    ).absmax.numel() * 4  # fmt: skip
    # the forward's peak (training and eval) holds them; the backward dequantizes as the CPU does
    extra = [scales, 0, 0, 0, scales, 0]
    assert peaks["cuda"] == [a + b for a, b in zip(peaks["cpu"], extra, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_cuda_and_cpu_traces_hold_the_same_quantized_weights(scheme: str) -> None:
    held = {}
    for device in ("cuda", "cpu"):
        spec = StepSpec(
            task="causal-lm",
            precision="bf16",
            lora_rank=4,
            quantization=scheme,
            double_quant=scheme == "nf4",
            device=device,
            gradient_checkpointing=True,
        )
        trace, _ = traces.trace_model(llama_config(), spec, [(1, 16), (1, 16)], "full")
        held[device] = {
            category: sum(
                trace.resident_sizes[g]
                for g in trace.initial
                if CATEGORIES[trace.resident_categories[g]] == category
            )
            for category in ("parameters", "buffers")
        }
    assert held["cuda"] == held["cpu"]


# --- the model -------------------------------------------------------------------------------------
def gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=128)


def bert_config() -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
    )


MODEL_CASES = [
    (llama_config, "causal-lm", "nf4", True),
    (gpt2_config, "causal-lm", "fp4", False),  # Conv1D, transposed, tied head
    (bert_config, "classification", "int8", False),  # a classifier head kept whole
]


@pytest.mark.parametrize(("make_config", "task", "scheme", "double_quant"), MODEL_CASES)
def test_model_quantizes_what_bitsandbytes_loading_does(
    make_config: Callable[[], Any], task: str, scheme: str, double_quant: bool
) -> None:
    """The emulated model (meta device) and the real one (bitsandbytes through transformers'
    replace_with_bnb_linear) quantize the same layers, hold the same bytes, keep the same
    layers, and leave every other parameter as prepare_model_for_kbit_training does (fp32)."""
    bnb = pytest.importorskip("bitsandbytes")
    config = make_config()
    spec = StepSpec(
        task=task,
        precision="bf16",
        lora_rank=4,
        quantization=scheme,
        double_quant=double_quant,
        device="cpu",
    )
    real = workload.build_model(config, spec)
    with torch.no_grad():
        # bitsandbytes' 4-bit layers cast their bias to the compute dtype at the first forward
        real(**workload.make_batch(config, spec, 1, 8))
    with torch.device("meta"):
        emulated = workload.build_model(config, spec)
    real_kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    real_layers = {n: m for n, m in real.named_modules() if isinstance(m, real_kinds)}
    emulated_layers = {
        n: m
        for n, m in emulated.named_modules()
        if isinstance(m, Linear4bitModel | Linear8bitModel)
    }
    assert real_layers and set(real_layers) == set(emulated_layers)
    for name, layer in emulated_layers.items():
        held = [*layer.parameters(), *layer.buffers()]
        assert sum(t.numel() * t.element_size() for t in held) == bnb_held(real_layers[name])
    real_rest = {n: (p.dtype, p.requires_grad) for n, p in real.named_parameters()}
    emulated_rest = {n: (p.dtype, p.requires_grad) for n, p in emulated.named_parameters()}
    assert real_rest == emulated_rest
    # prepare_model_for_kbit_training's fp32, but for the biases a 4-bit layer casts back
    biases = {f"{name}.bias" for name in real_layers}
    rest = [d for n, (d, _) in real_rest.items() if "lora" not in n and n not in biases]
    assert rest and all(d == torch.float32 or not d.is_floating_point for d in rest)
    # peft's own LoRA layers for bitsandbytes on one side, the emulation of their forward on the other
    real_lora = {n for n, m in real.named_modules() if type(m).__module__.endswith("lora.bnb")}
    emulated_lora = {
        n for n, m in emulated.named_modules() if type(m).__name__ == "LoraLinearQuantizedModel"
    }
    assert real_lora and real_lora == emulated_lora


def test_kept_modules_are_transformers_choice_plus_the_trained_head() -> None:
    from transformers import AutoModelForSequenceClassification
    from transformers.quantizers.base import HfQuantizer

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(bert_config())
    kept = quantized.modules_to_not_convert(model, "classification")
    assert set(HfQuantizer.get_modules_to_not_convert(model)) <= set(kept)
    assert set(workload.lora_head_modules(model)) <= set(kept)


def test_summary_written_out_to_depth_equals_the_whole_model() -> None:
    config = llama_config(layers=8)
    spec = StepSpec(
        task="causal-lm", precision="bf16", lora_rank=4, quantization="nf4", double_quant=True
    )
    summary = quantized_count.quantization_summary(config, spec)
    parameters, stored, held, kept = quantized_count.count_quantized(config, spec)
    assert (summary.quantized_parameters, summary.stored_elements) == (parameters, stored)
    assert (summary.quantized_bytes, summary.kept_modules) == (held, kept)
    assert summary.details()["compute_dtype"] == "bfloat16"


# --- the estimate ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_estimate_counts_what_the_real_model_holds(tiny_llama: str) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    from memfit.estimate import estimate

    knobs = dict(task="causal-lm", batch_size=2, seq_len=32, precision="bf16", lora_rank=4)
    result = estimate(tiny_llama, **knobs, quantization="nf4", double_quant=True, device="cpu")
    plain = estimate(tiny_llama, **knobs, device="cpu")
    info = result.details["quantization"]
    assert set(info) == {
        "scheme",
        "double_quant",
        "compute_dtype",
        "quantized_parameters",
        "quantized_bytes",
        "kept_modules",
    }
    spec = StepSpec(
        task="causal-lm",
        precision="bf16",
        lora_rank=4,
        quantization="nf4",
        double_quant=True,
        device="cpu",
    )
    real = workload.build_model(llama_config(), spec)
    layers = [m for m in real.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert info["quantized_bytes"] == sum(bnb_held(m) for m in layers)
    assert info["quantized_parameters"] == sum(m.in_features * m.out_features for m in layers)
    assert info["kept_modules"] == ["lm_head"]
    # the whole model's parameters and buffers, quantization state included
    packed = storage_bytes(real.parameters())
    assert result.breakdown["parameters"] == packed
    assert result.breakdown["buffers"] == storage_bytes(real.buffers()) + sum(
        bnb_held(m) - storage_bytes([m.weight]) for m in layers
    )
    assert result.details["num_parameters"] == plain.details["num_parameters"]
    assert result.breakdown["parameters"] < plain.breakdown["parameters"]


# --- paged optimizers ------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "bits"), list(quantized.PAGED_OPTIMIZERS.items()))
def test_paged_state_is_what_bitsandbytes_keeps(name: str, bits: int) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    shapes = [(8,), (64, 64), (512, 256)]  # below 4096, 8-bit, and paged on CUDA (>= 1e5)

    def params() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]

    def state_bytes(optimizer: torch.optim.Optimizer, shared: set[int]) -> int:
        tensors = [t for s in optimizer.state.values() for t in s.values()]
        return storage_bytes(t for t in tensors if id(t) not in shared)

    real_params = params()
    cls = bnb.optim.PagedAdamW8bit if bits == 8 else bnb.optim.PagedAdamW32bit
    with pytest.warns(UserWarning, match="not supported on CPU"):
        real = cls(real_params, lr=1e-3)
        for p in real_params:
            p.grad = torch.randn_like(p)
        real.step()
    # the 8-bit quantization maps are two tensors shared by every parameter
    shared = {id(s[k]) for s in real.state.values() for k in ("qmap1", "qmap2") if k in s}
    on_cpu = PagedAdamStateModel(params(), bits=bits, paged=False)
    on_cuda = PagedAdamStateModel(params(), bits=bits, paged=True)
    for optimizer in (on_cpu, on_cuda):
        for p in optimizer.param_groups[0]["params"]:
            p.grad = torch.randn_like(p)
        optimizer.step()
    assert state_bytes(on_cpu, set()) == state_bytes(real, shared)
    in_device = storage_bytes(
        t
        for s in on_cuda.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and not t.is_meta
    )
    paged = quantized.paged_state_bytes(shapes, name)
    assert paged > 0 and in_device + paged == state_bytes(real, shared)


def test_paged_state_leaves_the_cuda_trace() -> None:
    # full fine-tuning (no quantization needed): the embeddings are paged on CUDA, not on the CPU
    config = llama_config(vocab=2048)
    trainable_shapes = None
    resident: dict[str, int] = {}
    for device in ("cuda", "cpu"):
        spec = StepSpec(task="causal-lm", optimizer="paged-adamw-8bit", device=device)
        trace, _ = traces.trace_model(config, spec, [(1, 16), (1, 16)], "full")
        resident[device] = sum(
            trace.resident_sizes[g]
            for g in trace.steady
            if CATEGORIES[trace.resident_categories[g]] == "optimizer_state"
        )
        trainable_shapes = [p.shape for p in trace.params if p.trainable]
    assert trainable_shapes is not None
    paged = quantized.paged_state_bytes(trainable_shapes, "paged-adamw-8bit")
    assert paged > 0 and resident["cuda"] + paged == resident["cpu"]


# --- the command line ------------------------------------------------------------------------------
def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--quantization", "nf4"], "--quantization"),
        (["--lora-rank", "4", "--quantization", "int8", "--double-quant"], "--double-quant"),
        (["--lora-rank", "4", "--quantization", "nf3"], "--quantization"),
    ],
)
def test_quantization_problems_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], tiny_llama: str, extra: list[str], flag: str
) -> None:
    base = ["estimate", tiny_llama, "--task", "causal-lm", "--batch-size", "1", "--seq-len", "16"]
    code, out, err = run(capsys, *base, *extra)
    assert code == 2 and out == ""
    assert err.startswith("memfit: error:") and flag in err and err.count("\n") == 1


@pytest.mark.slow
def test_estimate_prints_the_quantization_and_the_paged_state(
    capsys: pytest.CaptureFixture[str], tiny_llama: str
) -> None:
    argv = [
        "estimate", tiny_llama, "--task", "causal-lm", "--batch-size", "1", "--seq-len", "32",
        "--precision", "bf16", "--lora-rank", "4", "--quantization", "nf4", "--double-quant",
        "--optimizer", "paged-adamw-32bit", "--lora-target-modules", "all-linear",
    ]  # fmt: skip
    code, out, _ = run(capsys, *argv)
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("base weights:")]
    assert len(lines) == 1 and "nf4 with double quantization" in lines[0] and "lm_head" in lines[0]
    assert any("unified memory" in line for line in out.splitlines())
    code, out, _ = run(capsys, *argv, "--json")
    details = json.loads(out)["details"]
    assert details["quantization"]["scheme"] == "nf4" and details["quantization"]["double_quant"]
    assert details["paged_optimizer_state_bytes"] >= 0


def test_quantization_knobs_key_the_trace_cache() -> None:
    from memfit.estimate import cache

    specs = [
        StepSpec(task="causal-lm", lora_rank=4),
        StepSpec(task="causal-lm", lora_rank=4, quantization="nf4"),
        StepSpec(task="causal-lm", lora_rank=4, quantization="nf4", double_quant=True),
        StepSpec(task="causal-lm", lora_rank=4, quantization="fp4", double_quant=True),
    ]
    paths = [cache.path_for(("a model", spec, "auto")) for spec in specs]
    assert None not in paths and len(set(paths)) == len(specs)
