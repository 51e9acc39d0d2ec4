"""QLoRA's quantized base weights and bitsandbytes' paged optimizers, as a step allocates them.

``--quantization nf4|fp4|int8`` loads the frozen base weights as transformers' bitsandbytes
quantizer does (``BitsAndBytesConfig``): every ``nn.Linear`` (and GPT-2's ``Conv1D``, transposed)
except the modules it keeps (:func:`modules_to_not_convert`: the output embeddings, tied weights,
the last module, the model's fp32 modules; and a classifier's head, which memfit trains whole)
becomes a ``bnb.nn.Linear4bit`` (``compress_statistics`` = ``--double-quant``) or a
``bnb.nn.Linear8bitLt`` (``has_fp16_weights=False``, ``threshold=6.0``). The rest is loaded in the
compute dtype (``bnb_4bit_compute_dtype``: bf16, fp16, or fp32 for ``--precision fp32``) and peft's
``prepare_model_for_kbit_training`` upcasts it to fp32; LoRA adapters (peft) go on top, in fp32.
Then the unquantized frozen weights are held in the frozen dtype of ``--weights-dtype`` (the
checkpoint's under ``auto``: bf16 for today's decoders; fp32 keeps peft's upcast), as memfit
train casts them back after peft's preparation (:func:`memfit.estimate.workload.place_weights`);
the dequantized weights are still computed in the compute dtype.

A real run (bitsandbytes installed, real tensors) gets the real modules. The estimator never
imports bitsandbytes: its trace (fake CPU tensors) gets :class:`Linear4bitModel` and
:class:`Linear8bitModel`, which hold exactly what bitsandbytes 0.50.2 holds and allocate, op for
op, what its autograd functions and kernels allocate (``bitsandbytes/autograd/_functions.py``,
``nn/modules.py``, ``backends/{cuda,cpu,default}/ops.py``):

* **4-bit** holds the packed weight (``Params4bit``: two values per byte, shape ``(n/2, 1)``),
  its own 16-value NF4/FP4 code (fp32) and an fp32 absmax per block of 64 values; with double
  quantization the absmax is uint8 plus, per 256 blocks, an fp32 scale, an fp32 offset and a
  copy of the 256-value 8-bit code. The forward casts the input to the compute dtype, dequantizes
  the weight into a full compute-dtype copy and runs ``F.linear``; it saves nothing (the weight is
  frozen). The backward dequantizes again for the input's gradient. Device differences: with
  double quantization CUDA's fallback keeps the fp32 scales alive until the matmul ends, the
  CPU's default kernel frees them at once. On CUDA, bitsandbytes runs a fused kernel without the
  dequantized copy for some small micro-batches (at most 512 or 1536 tokens, by GPU and layer
  shape): the estimate keeps the copy (exact above 1536 tokens, one layer's copy too high below).
* **int8** holds the int8 weight and one fp32 scale (SCB) per output row. Training on the CPU
  runs ``MatMul8bitFp`` (dequantize to the input's dtype, ``F.linear``, and it keeps the input
  for backward, checkpointed or not); on CUDA (and in eval) ``MatMul8bitLt``: the input cast to
  fp16 and quantized row-wise (int8 plus row scales), an int32 product, an fp16 dequantized
  output cast to the input's dtype; it keeps the input too. Activation outliers above the
  threshold are data-dependent: the estimate assumes none (their columns would add a few small
  fp16 copies). bitsandbytes casts an int8 layer's bias to its input's dtype once, in place; the
  trace cannot swap a resident storage mid-step, so where the dtypes differ (mixed precision, a
  layer fed a 16-bit input) it keeps the fp32 bias and casts a copy per forward.

Peft's bitsandbytes LoRA layers differ from its plain ``Linear``: under autocast they do not cast
the input to the adapters' fp32, and the 4-bit one clones the base output
(:func:`adopt_lora_layers`).

**Paged optimizers** (``paged-adamw-8bit``, ``paged-adamw-32bit``): bitsandbytes keeps the state
of every tensor of at least 100,000 elements in CUDA unified memory (``cudaMallocManaged``),
outside PyTorch's caching allocator, and the driver evicts it to host memory under pressure. On
CUDA that state is left out of the trace (:class:`PagedAdamStateModel` keeps it on the meta
device) and reported apart (:func:`paged_state_bytes`); smaller tensors and the 8-bit absmax are
ordinary CUDA tensors. On the CPU bitsandbytes allocates ordinary tensors: optimizer state.

Not modelled: the CPU eval of a 4-bit model on a CPU with AVX512-BF16, where bitsandbytes repacks
the weights for its fused CPU kernel at the first forward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from memfit.errors import UsageError
from memfit.estimate.step_spec import PRECISION_DTYPES, StepSpec
from memfit.estimate.task_model import BiEncoder, lora_head_modules
from memfit.levers.quantization import INT8_THRESHOLD
from memfit.levers.quantization import LEVER as QUANTIZATION

# Params4bit's block (transformers' BitsAndBytesConfig and bitsandbytes both default to 64)
BLOCKSIZE = 64
# double quantization: the absmax quantized again, blockwise, with the 256-value 8-bit code
NESTED_BLOCKSIZE = 256
NESTED_CODE_VALUES = 256
# get_4bit_type: every quantized weight gets its own 16-value fp32 lookup table
FOUR_BIT_CODE_VALUES = 16
# bitsandbytes' optimizers: tensors below this many elements keep fp32 state (min_8bit_size),
# 8-bit state is scaled per block of 256, and only tensors of at least 1e5 elements are paged
MIN_8BIT_SIZE = 4096
OPTIMIZER_BLOCKSIZE = 256
PAGED_MIN_NUMEL = 100_000
# the paged optimizers and the bits of their state
PAGED_OPTIMIZERS = {"paged-adamw-8bit": 8, "paged-adamw-32bit": 32}

__all__ = [
    "INT8_THRESHOLD",
    "PAGED_OPTIMIZERS",
    "Linear4bitModel",
    "Linear8bitModel",
    "PagedAdamStateModel",
    "QuantizationSummary",
    "adopt_lora_layers",
    "bitsandbytes_config",
    "compute_dtype",
    "modules_to_not_convert",
    "paged_state_bytes",
    "quantize_model",
    "restore_bias_dtypes",
]


def compute_dtype(precision: str) -> torch.dtype:
    """``bnb_4bit_compute_dtype`` for ``--precision`` (fp32 and none: float32)."""
    return PRECISION_DTYPES.get(precision, torch.float32)


def _blocks(n: int, size: int) -> int:
    return -(-n // size)


# --- the emulated layers ---------------------------------------------------------------------------
class Linear4bitModel(nn.Linear):
    """``bnb.nn.Linear4bit`` for the trace: its storage and its allocations, no bitsandbytes.

    The packed weight is the module's (frozen) parameter; the quantization state, which
    bitsandbytes keeps on the parameter, is held as buffers.
    """

    absmax: torch.Tensor
    offset: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        quant_type: str,
        double_quant: bool,
        compute_dtype: torch.dtype,
        device_type: str,
        device: Any = None,
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.quant_type, self.double_quant = quant_type, double_quant
        self.compute_dtype, self.device_type = compute_dtype, device_type
        n = in_features * out_features
        blocks = _blocks(n, BLOCKSIZE)

        def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        # Params4bit: two 4-bit values per byte, in one column
        self.weight = nn.Parameter(empty((n + 1) // 2, 1, dtype=torch.uint8), requires_grad=False)
        self.register_buffer("code", empty(FOUR_BIT_CODE_VALUES, dtype=torch.float32), False)
        if double_quant:
            # the block scales as uint8, with an fp32 scale per 256 of them, an fp32 offset (their
            # mean) and a copy of the 8-bit code (quantize_blockwise copies it into every state)
            self.register_buffer("absmax", empty(blocks, dtype=torch.uint8), False)
            nested = _blocks(blocks, NESTED_BLOCKSIZE)
            self.register_buffer("nested_absmax", empty(nested, dtype=torch.float32), False)
            self.register_buffer(
                "nested_code", empty(NESTED_CODE_VALUES, dtype=torch.float32), False
            )
            self.register_buffer("offset", empty(dtype=torch.float32), False)
        else:
            self.register_buffer("absmax", empty(blocks, dtype=torch.float32), False)
        if bias:
            # the first forward casts the bias to the compute dtype (bias.data = ...): held so
            self.bias = nn.Parameter(empty(out_features, dtype=compute_dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        # Linear4bit.forward: the input in the compute dtype, the bias too (once, in place)
        x = x.to(self.compute_dtype)
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias.data = bias.data.to(x.dtype)
        # matmul_4bit: the autograd function only where a gradient can flow through
        if torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad)
        ):
            out = _MatMul4bit.apply(x, bias, self)
        else:
            out = self.gemm(x, bias)
        return out.to(inp_dtype)

    def _scales(self) -> torch.Tensor:
        """dequantize_blockwise of the uint8 absmax: a new fp32 tensor of one value per block."""
        return torch.empty_like(self.absmax, dtype=torch.float32)

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``bitsandbytes::gemm_4bit``: the weight dequantized into the input's dtype, then F.linear."""
        scales: list[torch.Tensor] = []
        if self.double_quant:
            if self.device_type == "cuda":
                # _dequant_linear_fallback: absmax_dq and absmax both live to the end
                dequantized = self._scales()
                scales += [dequantized, dequantized + self.offset]
            else:
                # the default kernel: dequantize_blockwise(...) + offset, the first freed at once
                scales.append(self._scales() + self.offset)
        # a full copy of the weight in the input's dtype, freed when the matmul is done
        weight = torch.empty((self.out_features, self.in_features), dtype=x.dtype, device=x.device)
        out = nn.functional.linear(x, weight, bias)
        del weight, scales
        return out

    def dequantize(self) -> torch.Tensor:
        """``F.dequantize_4bit`` (the backward's): the weight in the dtype it was quantized from."""
        absmax = None
        if self.double_quant:
            absmax = self._scales()
            absmax += self.offset
        weight = torch.empty(
            (self.out_features, self.in_features),
            dtype=self.compute_dtype,
            device=self.weight.device,
        )
        del absmax
        return weight


class _MatMul4bit(torch.autograd.Function):
    """``MatMul4Bit``: saves nothing (the packed weight already exists); the backward
    dequantizes the weight again for the input's gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, layer: Linear4bitModel
    ) -> torch.Tensor:
        ctx.layer = layer
        ctx.bias_dtype = None if bias is None else bias.dtype
        return layer.gemm(x, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:  # type: ignore[override]
        needs_x, needs_bias, _ = ctx.needs_input_grad
        grad_x = grad_bias = None
        if needs_bias:
            grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype)
        if needs_x:
            weight = ctx.layer.dequantize().to(grad_output.dtype)
            grad_x = torch.matmul(grad_output, weight)
        return grad_x, grad_bias, None


class Linear8bitModel(nn.Linear):
    """``bnb.nn.Linear8bitLt`` (``has_fp16_weights=False``) for the trace: the int8 weight
    (the parameter) and its fp32 row scales (SCB, a buffer)."""

    SCB: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        device_type: str,
        bias_dtype: torch.dtype = torch.float32,
        device: Any = None,
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.device_type = device_type
        self.threshold = INT8_THRESHOLD
        weight = torch.empty((out_features, in_features), dtype=torch.int8, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        scb = torch.empty(out_features, dtype=torch.float32, device=device)
        self.register_buffer("SCB", scb, persistent=False)
        if bias:
            empty = torch.empty(out_features, dtype=bias_dtype, device=device)
            self.bias = nn.Parameter(empty, requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the weights stay int8; the bias is cast to the input's dtype, once, in place
        bias: torch.Tensor | None = self.bias
        if bias is not None and bias.dtype != x.dtype:
            if isinstance(bias, FakeTensor):
                # the trace cannot swap a resident storage mid-step: it keeps the bias and casts
                # a copy per forward (a few bytes per output feature more than bitsandbytes)
                bias = bias.to(x.dtype)
            else:
                bias.data = bias.data.to(x.dtype)
        # bnb.matmul: training on the CPU dequantizes and runs F.linear (MatMul8bitFp)
        if self.training and self.device_type == "cpu":
            return _MatMul8bitFp.apply(x, bias, self)  # type: ignore[no-any-return]
        return _MatMul8bitLt.apply(x, bias, self)  # type: ignore[no-any-return]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``CB.to(dtype).mul_(SCB.unsqueeze(1).mul(1 / 127))``: the weight in ``dtype``."""
        return self.weight.to(dtype, copy=True).mul_(self.SCB.unsqueeze(1).mul(1.0 / 127.0))

    def vectorwise_quant(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``int8_vectorwise_quant`` of the fp16 input (threshold 6): int8 rows, fp32 row scales
        and the outlier columns (none: activation outliers are data-dependent)."""
        rows = a.numel() // a.shape[-1]
        if self.device_type == "cuda":
            row_stats = torch.empty(rows, dtype=torch.float32, device=a.device)
            out_row = torch.empty(a.shape, dtype=torch.int8, device=a.device)
            outliers = a.abs() >= self.threshold
            outliers.any()
            outlier_columns = torch.empty(0, dtype=torch.int64, device=a.device)
        else:  # the default kernel
            outliers = a.abs() >= self.threshold
            outliers.any()
            outlier_columns = torch.empty(0, dtype=torch.int64, device=a.device)
            row_stats = torch.max(a.abs(), dim=1).values.float()
            out_row = torch.round(a * (127.0 / row_stats.unsqueeze(-1))).to(torch.int8)
        if rows > 1:
            out_row[:, outlier_columns] = 0
        del outliers
        return out_row, row_stats, outlier_columns

    def scaled_mm(
        self,
        a: torch.Tensor,
        row_stats: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``int8_scaled_mm``: the int32 product, dequantized (fp16 on CUDA, fp32 on the CPU) and
        cast to the input's dtype."""
        # the int32 product lives until the dequantized output is cast
        if self.device_type == "cuda":
            product = torch.empty(
                (a.shape[0], self.out_features), dtype=torch.int32, device=a.device
            )
            out = torch.empty_like(product, dtype=torch.float16)
            if bias is not None and bias.dtype != torch.float16:
                out.add_(bias)
        else:
            if torch.backends.cpu.get_cpu_capability() == "AVX512":
                product = torch._int_mm(a, self.weight.t())
            else:
                product = torch.matmul(a.float(), self.weight.float().t()).to(torch.int32)
            out = product * (row_stats.unsqueeze(-1) * self.SCB.unsqueeze(0)) * 6.200124e-05
            if bias is not None:
                out += bias
        result = out.to(dtype)
        del product, out
        return result


class _MatMul8bitFp(torch.autograd.Function):
    """``MatMul8bitFp`` (CPU training): dequantize, ``F.linear``; keeps the input on ``ctx``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, a: torch.Tensor, bias: torch.Tensor | None, layer: Linear8bitModel
    ) -> torch.Tensor:
        weight = layer.dequantize(a.dtype)
        output = nn.functional.linear(a, weight, bias)
        del weight
        ctx.layer, ctx.a, ctx.dtype_a, ctx.grad_shape = layer, a, a.dtype, a.shape
        ctx.dtype_bias = None if bias is None else bias.dtype
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:  # type: ignore[override]
        return _int8_backward(ctx, grad_output)


class _MatMul8bitLt(torch.autograd.Function):
    """``MatMul8bitLt`` (CUDA; the CPU in eval): the fp16 input quantized row-wise, an int8
    matmul, the output dequantized; keeps the input for backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, a: torch.Tensor, bias: torch.Tensor | None, layer: Linear8bitModel
    ) -> torch.Tensor:
        input_shape = a.shape
        if a.dim() == 3:
            a = a.reshape(-1, a.shape[-1])
        quantized, row_stats, outlier_columns = layer.vectorwise_quant(a.to(torch.float16))
        # int8_mixed_scaled_mm without outliers: an empty subA, kept for backward
        sub_a = torch.empty(0, device=a.device, dtype=a.dtype)
        output = layer.scaled_mm(quantized, row_stats, bias, a.dtype)
        # MatmulLtState.idx keeps the outlier columns to the next forward: none, 0 bytes (the
        # trace does not carry them from step to step)
        del quantized, row_stats, outlier_columns
        ctx.layer, ctx.dtype_a, ctx.grad_shape = layer, a.dtype, input_shape
        ctx.dtype_bias = None if bias is None else bias.dtype
        ctx.tensors = (None, sub_a, a) if ctx.needs_input_grad[0] else (None, None, None)
        if len(input_shape) == 3:
            return output.reshape(*input_shape[:-1], layer.out_features)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:  # type: ignore[override]
        return _int8_backward(ctx, grad_output)


def _int8_backward(ctx: Any, grad_output: torch.Tensor) -> Any:
    """Both int8 functions' backward: the input's gradient through a dequantized weight."""
    needs_a, needs_bias, _ = ctx.needs_input_grad
    grad_a = grad_bias = None
    if needs_bias:
        grad_bias = grad_output.sum(0, dtype=ctx.dtype_bias)
    if grad_output.dim() == 3:
        grad_output = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
    if needs_a:
        weight = ctx.layer.dequantize(ctx.dtype_a)
        grad_a = torch.matmul(grad_output.to(ctx.dtype_a), weight).view(ctx.grad_shape)
    return grad_a, grad_bias, None


# --- LoRA on the emulated layers -------------------------------------------------------------------
def adopt_lora_layers(model: nn.Module) -> None:
    """Give peft's LoRA layers on emulated quantized layers the forward of peft's bitsandbytes
    LoRA layers (peft dispatched its plain ``Linear`` to them: they are ``nn.Linear``)."""
    quantized_lora = _quantized_lora_class()
    (lora_linear,) = quantized_lora.__bases__
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if type(module) is lora_linear and isinstance(base, Linear4bitModel | Linear8bitModel):
            module.__class__ = quantized_lora


@functools.cache
def _quantized_lora_class() -> type[nn.Module]:
    """peft's ``lora.Linear`` with the forward of ``lora.bnb.Linear4bit`` / ``Linear8bitLt``
    (peft/tuners/lora/bnb.py), for the plain LoRA path training runs: the base output (cloned,
    for 4-bit), then each adapter on the input, cast to the adapters' dtype only where autocast
    is off."""
    from peft.tuners.lora.layer import Linear  # optional: peft (memfit[lora])

    return type("LoraLinearQuantizedModel", (Linear,), {"forward": _quantized_lora_forward})


def _quantized_lora_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    plain = not (self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None)
    if not plain or any(a in self.lora_variant for a in self.active_adapters):
        # not the training path (merged, mixed batches, variants): peft's own Linear
        return super(type(self), self).forward(x, *args, **kwargs)  # type: ignore[no-any-return]
    self._check_forward_args(x, *args, **kwargs)
    kwargs.pop("alora_offsets", None)  # peft's variant keywords, never the base layer's
    result = self.base_layer(x, *args, **kwargs)
    if isinstance(self.base_layer, Linear4bitModel):
        # "As per Tim Dettmers, for 4bit, we need to defensively clone here."
        result = result.clone()
    for active_adapter in self.active_adapters:
        if active_adapter not in self.lora_A:
            continue
        lora_a, lora_b = self.lora_A[active_adapter], self.lora_B[active_adapter]
        dropout, scaling = self.lora_dropout[active_adapter], self.scaling[active_adapter]
        # peft asks CUDA's autocast (torch.is_autocast_enabled() with no device)
        requires_conversion = not torch.is_autocast_enabled()
        if requires_conversion:
            expected_dtype = result.dtype
            x = self._cast_input_dtype(x, lora_a.weight.dtype)
        output = lora_b(lora_a(dropout(x))) * scaling
        if requires_conversion:
            output = output.to(expected_dtype)
        result = result + output
    return result  # type: ignore[no-any-return]


# --- the model -------------------------------------------------------------------------------------
def modules_to_not_convert(model: nn.Module, task: str) -> list[str]:
    """What transformers' bitsandbytes quantizer leaves unquantized (its default keys: output
    embeddings, tied weights, the last module; and the model's fp32 modules), plus, for
    classification, the head memfit trains whole. ``memfit train`` passes the same list as
    ``llm_int8_skip_modules``, which replaces the defaults, so it holds them too."""
    # start-up time: transformers loads on first use (the estimator imports this module)
    from transformers.quantizers.base import HfQuantizer

    heads = lora_head_modules(model) if task == "classification" else []
    keep = getattr(model, "_keep_in_fp32_modules", None)
    kept = HfQuantizer.get_modules_to_not_convert(
        model,  # type: ignore[arg-type]
        heads or None,
        list(keep) if keep else None,
        add_default_skips=True,
    )
    return sorted(kept)


def _convertible(model: nn.Module, kept: Sequence[str]) -> list[tuple[str, int, int, bool]]:
    """``replace_with_bnb_linear``'s choice: (path, in, out, bias) of every plain ``nn.Linear``
    and ``Conv1D`` not kept."""
    # start-up time: transformers loads on first use (the estimator imports this module)
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.quantizers_utils import (  # start-up time, as the line above
        should_convert_module,
    )

    found = []
    for name, module in model.named_modules():
        if not name or not should_convert_module(name, list(kept)):
            continue
        if isinstance(module, Conv1D):
            in_features, out_features = module.weight.shape
        elif type(module) is nn.Linear:
            in_features, out_features = module.in_features, module.out_features
        else:
            continue
        found.append((name, int(in_features), int(out_features), module.bias is not None))
    return found


def quantize_model(model: nn.Module, spec: StepSpec) -> nn.Module:
    """The task model as ``from_pretrained(quantization_config=...)`` then peft's
    ``prepare_model_for_kbit_training`` leave it (checkpointing is enabled by the caller, with the
    kwargs memfit train passes). On the meta device (the trace), the emulated layers; otherwise
    bitsandbytes' own."""
    from peft import prepare_model_for_kbit_training  # optional: memfit[quantization]

    inner = model.transformer if isinstance(model, BiEncoder) else model
    assert isinstance(inner, nn.Module)
    kept = modules_to_not_convert(inner, spec.task)
    dtype = compute_dtype(spec.precision)
    # from_pretrained(dtype=compute dtype): what is not quantized is loaded in it
    for parameter in inner.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)
    layers = _convertible(inner, kept)
    if any(p.device.type == "meta" for p in inner.parameters()):
        _replace_with_models(inner, layers, spec)
    else:
        _replace_with_bitsandbytes(inner, layers, kept, spec)
    four_bit = spec.quantization != "int8"
    # what transformers' quantizer marks the model with (peft reads them)
    for name, value in (
        ("is_loaded_in_4bit", four_bit),
        ("is_loaded_in_8bit", not four_bit),
        ("is_quantized", True),
        ("quantization_method", "bitsandbytes"),
    ):
        setattr(inner, name, value)
    # freezes the base, upcasts every fp16/bf16 parameter that is not 4-bit to fp32 (the
    # caller then holds the frozen ones in the frozen dtype: memfit.step.weights.place_weights)
    prepare_model_for_kbit_training(inner, use_gradient_checkpointing=False)
    restore_bias_dtypes(model, spec)
    return model


def restore_bias_dtypes(model: nn.Module, spec: StepSpec) -> None:
    """Linear4bit's first forward casts its bias to the compute dtype, in place, for good: the
    steady-state step holds it so, whatever dtype peft's preparation or the frozen weights'
    placement gave it (the trace cannot swap a resident storage mid-step)."""
    dtype = compute_dtype(spec.precision)
    for module in model.modules():
        if isinstance(module, Linear4bitModel) and module.bias is not None:
            module.bias.data = module.bias.data.to(dtype)


def _replace_with_models(
    model: nn.Module, layers: list[tuple[str, int, int, bool]], spec: StepSpec
) -> None:
    device = next(model.parameters()).device
    for name, in_features, out_features, bias in layers:
        new: nn.Module
        if spec.quantization == "int8":
            new = Linear8bitModel(
                in_features,
                out_features,
                bias,
                device_type=spec.device,
                bias_dtype=compute_dtype(spec.precision),
                device=device,
            )
        else:
            new = Linear4bitModel(
                in_features,
                out_features,
                bias,
                quant_type=spec.quantization,
                double_quant=spec.double_quant,
                compute_dtype=compute_dtype(spec.precision),
                device_type=spec.device,
                device=device,
            )
        model.set_submodule(name, new)


def bitsandbytes_config(spec: StepSpec, kept: Sequence[str]) -> Any:
    """The ``BitsAndBytesConfig`` of ``spec`` (what memfit train loads the model with)."""
    # start-up time: transformers loads on first use (the estimator imports this module)
    from transformers import BitsAndBytesConfig

    # the lever's settings, those memfit train loads the model with (memfit.train.quantization)
    settings = QUANTIZATION.bnb_settings(
        QUANTIZATION.values(spec), compute_dtype(spec.precision), list(kept)
    )
    return BitsAndBytesConfig(**settings)


def _replace_with_bitsandbytes(
    model: nn.Module, layers: list[tuple[str, int, int, bool]], kept: Sequence[str], spec: StepSpec
) -> None:
    """A real run: transformers' ``replace_with_bnb_linear``, then each weight quantized as
    transformers' Bnb4bitQuantize / Bnb8bitQuantize do it (on the weight's device)."""
    try:
        # optional: bitsandbytes (memfit[quantization])
        import bitsandbytes as bnb  # type: ignore[import-not-found]
    except ImportError as exc:
        raise UsageError(
            f"--quantization {spec.quantization}: needs bitsandbytes: pip install 'memfit[quantization]'"
        ) from exc
    # start-up time: transformers loads on first use (the estimator imports this module)
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.pytorch_utils import Conv1D  # start-up time, as the line above

    old = {name: model.get_submodule(name) for name, *_ in layers}
    replace_with_bnb_linear(
        model,
        modules_to_not_convert=list(kept),
        quantization_config=bitsandbytes_config(spec, kept),
    )
    for name, source in old.items():
        module: Any = model.get_submodule(name)
        weight: torch.Tensor = source.weight.detach()  # type: ignore[operator]
        if isinstance(source, Conv1D):
            weight = weight.t().contiguous()
        kwargs = dict(module.weight.__dict__)
        param: Any
        if spec.quantization == "int8":
            kwargs.pop("SCB", None)
            param = bnb.nn.Int8Params(weight.to("cpu"), requires_grad=False, **kwargs)
        else:
            param = bnb.nn.Params4bit(weight, requires_grad=False, **kwargs)
        module.weight = param.to(weight.device)
        bias: Any = source.bias
        if bias is not None:
            module.bias = nn.Parameter(bias.detach(), requires_grad=False)


# --- what the estimate reports ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantizationSummary:
    """What the quantized layers of a model hold, counted on the meta device."""

    spec: StepSpec
    quantized_parameters: int  # the weights quantized (in × out of every quantized layer)
    stored_elements: int  # the elements of their stored weights (4-bit: two values per byte)
    quantized_bytes: int  # the packed weights and their quantization state
    kept_modules: tuple[str, ...]  # the linear layers left unquantized

    def details(self) -> dict[str, Any]:
        """``details["quantization"]``."""
        return {
            "scheme": self.spec.quantization,
            "double_quant": self.spec.double_quant,
            "compute_dtype": str(compute_dtype(self.spec.precision)).removeprefix("torch."),
            "quantized_parameters": self.quantized_parameters,
            "quantized_bytes": self.quantized_bytes,
            "kept_modules": list(self.kept_modules),
        }


# --- paged optimizers ------------------------------------------------------------------------------
def _state_layout(
    shape: Sequence[int], bits: int, paged: bool
) -> list[tuple[str, torch.dtype, tuple[int, ...], bool]]:
    """bitsandbytes' ``Optimizer2State.init_state``: (name, dtype, shape, in unified memory)."""
    numel = 1
    for d in shape:
        numel *= int(d)
    unified = paged and numel >= PAGED_MIN_NUMEL
    if bits == 8 and numel >= MIN_8BIT_SIZE:
        blocks = (_blocks(numel, OPTIMIZER_BLOCKSIZE),)
        return [
            ("state1", torch.uint8, tuple(shape), unified),
            ("state2", torch.uint8, tuple(shape), unified),
            # plain torch.zeros, never paged
            ("absmax1", torch.float32, blocks, False),
            ("absmax2", torch.float32, blocks, False),
        ]
    return [
        ("state1", torch.float32, tuple(shape), unified),
        ("state2", torch.float32, tuple(shape), unified),
    ]


def paged_state_bytes(shapes: Iterable[Sequence[int]], optimizer: str) -> int:
    """The bytes of a paged optimizer's state that live in CUDA unified memory, for trainable
    tensors of ``shapes`` (0 for another optimizer)."""
    bits = PAGED_OPTIMIZERS.get(optimizer)
    if bits is None:
        return 0
    total = 0
    for shape in shapes:
        for _name, dtype, state_shape, unified in _state_layout(shape, bits, paged=True):
            if unified:
                numel = 1
                for d in state_shape:
                    numel *= d
                total += numel * dtype.itemsize
    return total


class PagedAdamStateModel(torch.optim.Optimizer):
    """The memory of bitsandbytes' ``PagedAdamW8bit`` / ``PagedAdamW32bit``, for tracing.

    ``paged`` (CUDA): the state of tensors of at least 1e5 elements is in unified memory, outside
    PyTorch's allocator: kept on the meta device, so the trace does not count it. The update is
    one fused kernel working in place: the step allocates nothing.
    """

    def __init__(self, params: Any, *, bits: int, paged: bool, lr: float = 1e-5) -> None:
        super().__init__(params, {"lr": lr})
        self.bits, self.paged = bits, paged

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    for name, dtype, shape, unified in _state_layout(
                        p.shape, self.bits, self.paged
                    ):
                        state[name] = (
                            _unified_memory(shape, dtype)
                            if unified
                            else torch.zeros(shape, dtype=dtype, device=p.device)
                        )
                state["step"] += 1
                # the fused update changes states and weights in place
                p.add_(p.grad, alpha=-group["lr"])


def _unified_memory(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor no dispatch mode sees (the trace's recorder included): unified memory."""
    with _disable_current_modes():
        return torch.zeros(shape, dtype=dtype, device="meta")
