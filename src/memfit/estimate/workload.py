"""One training (or eval) step, written once and run three ways.

The estimator runs these functions on fake tensors (no memory, no GPU), the CPU truth benchmark runs
them for real in a child process, and ``bench/gpu_validate.py`` runs them on a GPU. Sharing the code
means the estimate and the measurement always describe the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from memfit import quiet, step
from memfit.errors import UsageError
from memfit.estimate import quantized
from memfit.estimate.attention import config_attention
from memfit.estimate.optimizer_offload import HostSteppedOptimizer
from memfit.estimate.step_spec import PRECISION_DTYPES, StepSpec
from memfit.estimate.task_model import BiEncoder, lora_head_modules
from memfit.extras import require
from memfit.levers.lora import LORA_DROPOUT
from memfit.step import trl_head, weights

# sentence-transformers' MultipleNegativesRankingLoss default: cosine similarity times 20
MNRL_SCALE = 20.0
COSENT_SCALE = 20.0


def build_model(
    config: Any, spec: StepSpec, *, checkpoint_context_fn: Callable[[], Any] | None = None
) -> nn.Module:
    """Instantiate the task model from an architecture config (random weights, no download).

    ``checkpoint_context_fn``: passed to ``torch.utils.checkpoint`` as ``context_fn`` (the tracer
    uses it to recompute under the modes of the traced step); real runs leave it out.
    """
    # start-up: transformers takes a second or more to import; only building a model needs it
    import transformers

    checkpoint_config, config = config, _task_config(config, spec)
    if spec.task == "classification":
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    elif spec.task == "causal-lm":
        model = transformers.AutoModelForCausalLM.from_config(config)
    elif spec.task == "sentence-embedding":
        # sentence-transformers loads the plain AutoModel (BERT's pooler included, unused by mean pooling)
        transformer = transformers.AutoModel.from_config(config)
        model = BiEncoder(transformer, spec.num_labels, with_classifier=spec.loss == "softmax")
        # the loss's package is imported now, before any step is traced (see the function)
        _sentence_transformers()
    else:  # pragma: no cover - validated earlier
        raise ValueError(f"unknown task {spec.task!r}")
    if spec.quantization != "none":
        # QLoRA: the base weights as bitsandbytes holds them (emulated on the meta device), the
        # rest upcast to fp32 by peft's prepare_model_for_kbit_training (held in the frozen
        # dtype again below, as memfit train does)
        model = quantized.quantize_model(model, spec)
    if spec.gradient_checkpointing:
        target: Any = model.transformer if isinstance(model, BiEncoder) else model
        # non-reentrant checkpointing: what PyTorch recommends and what memfit train uses
        # (newer transformers renamed the method; older versions only have the first name)
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if checkpoint_context_fn is not None:
            kwargs["context_fn"] = checkpoint_context_fn
        if hasattr(target, "activation_checkpointing_enable"):
            target.activation_checkpointing_enable(  # type: ignore[operator]
                activation_checkpointing_kwargs=kwargs
            )
        else:
            target.gradient_checkpointing_enable(  # type: ignore[operator]
                gradient_checkpointing_kwargs=kwargs
            )
    if spec.lora_rank:
        # peft asks transformers' deprecated is_gradient_checkpointing (memfit.quiet drops it)
        with quiet.calls(), warnings.catch_warnings():
            # peft switches fan_in_fan_out on by itself for GPT-2's Conv1D, and says so (the
            # target modules are memfit's choice here)
            warnings.filterwarnings("ignore", message="fan_in_fan_out", category=UserWarning)
            model = with_lora(model, spec)
        if spec.quantization != "none":
            # peft's bitsandbytes LoRA layers' forward on the emulated quantized layers
            quantized.adopt_lora_layers(model)
    place_weights(model, checkpoint_config, spec)
    # what only the built model shows (the config's problems are refused before any build): a
    # head the fused loss cannot take, such as one LoRA adapts or a quantizer packs
    fused = spec.task == "causal-lm" and spec.cross_entropy == "fused-linear"
    if fused and (problem := step.fused_linear_problem(model)):
        raise UsageError(problem)
    model.train(spec.mode == "train")
    return model


def place_weights(model: nn.Module, config: Any, spec: StepSpec) -> None:
    """Hold the frozen and the trained weights in the dtypes of ``--weights-dtype``
    (:mod:`memfit.step.weights`, what memfit train does after LoRA and QLoRA's preparation):
    a frozen base in the checkpoint's dtype under ``auto``, LoRA adapters in fp32 over it, or
    all of it in 16 bits for pure 16-bit training."""
    frozen, trainable = weights.weight_dtypes(config, spec.weights_dtype)
    weights.place_weights(model, frozen, trainable, cast_inputs=spec.precision == "fp32")
    if spec.quantization != "none":
        # Linear4bit casts its bias to the compute dtype at its first forward, for good
        quantized.restore_bias_dtypes(model, spec)


LORA_TASK_TYPES = {
    "classification": "SEQ_CLS",
    "causal-lm": "CAUSAL_LM",
    "sentence-embedding": "FEATURE_EXTRACTION",
}

# Which modules get LoRA adapters, per architecture (``config.model_type``): module-name suffixes
# as peft matches them (a module whose path is the name or ends with "." + name). "attention" (the
# default) is every attention projection (query, key, value, output), not just peft's query and
# value: for the same rank, adapting all of them trains better (QLoRA's finding) and costs a few
# MB of adapters. "mlp" adds the feed-forward projections. BERT-style models name the attention
# output and the MLP output both ``output.dense``, so their "mlp" covers the attention output too.
# Architectures not listed fall back to peft's own defaults (attention only).
_BERT_STYLE: dict[str, tuple[str, ...]] = {
    "attention": ("query", "key", "value", "attention.output.dense"),
    "mlp": ("intermediate.dense", "output.dense"),
}
_LLAMA_STYLE: dict[str, tuple[str, ...]] = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
_NEOX_STYLE: dict[str, tuple[str, ...]] = {
    "attention": ("query_key_value", "attention.dense"),
    "mlp": ("dense_h_to_4h", "dense_4h_to_h"),
}
LORA_TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "bert": _BERT_STYLE,
    "roberta": _BERT_STYLE,
    "xlm-roberta": _BERT_STYLE,
    "camembert": _BERT_STYLE,
    "electra": _BERT_STYLE,
    "deberta-v2": {
        "attention": ("query_proj", "key_proj", "value_proj", "attention.output.dense"),
        "mlp": ("intermediate.dense", "output.dense"),
    },
    "distilbert": {"attention": ("q_lin", "k_lin", "v_lin", "out_lin"), "mlp": ("lin1", "lin2")},
    "mpnet": {
        "attention": ("attn.q", "attn.k", "attn.v", "attn.o"),
        "mlp": ("intermediate.dense", "output.dense"),
    },
    # GPT-2's query, key and value are one fused Conv1D (c_attn)
    "gpt2": {"attention": ("c_attn", "attn.c_proj"), "mlp": ("c_fc", "mlp.c_proj")},
    "llama": _LLAMA_STYLE,
    "mistral": _LLAMA_STYLE,
    "qwen2": _LLAMA_STYLE,
    "qwen3": _LLAMA_STYLE,
    "gemma": _LLAMA_STYLE,
    "gemma2": _LLAMA_STYLE,
    "opt": {"attention": ("q_proj", "k_proj", "v_proj", "out_proj"), "mlp": ("fc1", "fc2")},
    "gpt_neox": _NEOX_STYLE,
    "falcon": {"attention": ("query_key_value", "self_attention.dense"), "mlp": _NEOX_STYLE["mlp"]},
    "bloom": {"attention": ("query_key_value", "self_attention.dense"), "mlp": _NEOX_STYLE["mlp"]},
    "phi": {
        "attention": ("q_proj", "k_proj", "v_proj", "self_attn.dense"),
        "mlp": ("fc1", "fc2"),
    },
    # Phi-3 fuses query, key and value (qkv_proj) and the gate and up projections (gate_up_proj)
    "phi3": {"attention": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")},
    # ModernBERT: fused Wqkv and attn.Wo; its MLP's Wi holds the GLU's input and gate halves
    "modernbert": {"attention": ("Wqkv", "attn.Wo"), "mlp": ("mlp.Wi", "mlp.Wo")},
}
LORA_GROUPS = ("attention", "mlp")
# peft's own value: every linear layer but the output layer
ALL_LINEAR = "all-linear"
# what peft's SEQ_CLS task type keeps trainable and saves with the adapter by itself
PEFT_HEAD_NAMES = ("classifier", "score")


def _lora_name_matches(path: str, name: str) -> bool:
    """peft's rule: ``name`` targets the module at ``path`` if it is the path or ends it."""
    return path == name or path.endswith("." + name)


def _adaptable_modules(model: nn.Module, skip: Sequence[str] = ()) -> list[str]:
    """The paths of the layers LoRA can adapt (linear, GPT-2's Conv1D, embeddings), outside the
    ``skip`` modules (the classification head, which is trained whole)."""
    # start-up: transformers takes a second or more to import; only building a model needs it
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, nn.Embedding, Conv1D)
    return [
        path
        for path, module in model.named_modules()
        if isinstance(module, kinds)
        and path
        and not any(path == s or path.startswith(s + ".") for s in skip)
    ]


def lora_target_modules(
    model: nn.Module, task: str, requested: Sequence[str] = ()
) -> list[str] | str:
    """The target modules of the LoRA adapters on ``model``: one function for the estimator,
    the planner and ``memfit train``, so that all three count and train the same adapters.

    ``requested`` mixes groups ("attention", "mlp": the architecture's row of ``LORA_TARGETS``),
    module names as peft matches them, or ``all-linear``; empty means "attention". Every name
    must match a layer of the model: a UsageError names ``--lora-target-modules`` and lists the
    names the model has.
    """
    config: Any = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", "") or "")
    wanted = [str(x).strip() for x in requested if str(x).strip()] or ["attention"]
    if ALL_LINEAR in wanted:
        if len(wanted) > 1:
            raise UsageError(f"--lora-target-modules: {ALL_LINEAR} takes no other names with it")
        return ALL_LINEAR
    skip = lora_head_modules(model) if task == "classification" else []
    paths = _adaptable_modules(model, skip)
    names: list[str] = []
    problems: list[str] = []
    for item in wanted:
        if item in LORA_GROUPS:
            group = _lora_group(model_type, item)
            if group is None:
                problems.append(
                    f"memfit knows no {item} modules of {model_type or 'this model'}; name them"
                )
                continue
            found = [n for n in group if any(_lora_name_matches(p, n) for p in paths)]
            if not found:
                problems.append(
                    f"the {item} modules memfit expects of {model_type} ({', '.join(group)}) are "
                    "not in this model; name them"
                )
            names.extend(found)
        elif any(_lora_name_matches(p, item) for p in paths):
            names.append(item)
        else:
            problems.append(f"no layer of this model is named {item!r}")
    if problems:
        available = sorted({p.rsplit(".", 1)[-1] for p in paths})
        raise UsageError(
            f"--lora-target-modules: {'; '.join(problems)}. Its layers: {', '.join(available)}"
            f" (or the groups {', '.join(LORA_GROUPS)}, or {ALL_LINEAR})"
        )
    return list(dict.fromkeys(names))


def _lora_group(model_type: str, group: str) -> tuple[str, ...] | None:
    """A group of ``LORA_TARGETS`` for the architecture; peft's defaults for its attention."""
    row = LORA_TARGETS.get(model_type)
    if row is not None:
        return row.get(group)
    if group != "attention":
        return None
    try:
        # optional: peft (memfit[lora])
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    except ImportError:  # pragma: no cover - an old peft
        return None
    default = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    # a regular expression (peft's form for a few multimodal models) is not a list of names
    return tuple(default) if isinstance(default, (list, tuple)) else None


def lora_config(
    model: nn.Module,
    task: str,
    rank: int,
    targets: Sequence[str] = (),
    dropout: float = LORA_DROPOUT,
) -> Any:
    """The peft ``LoraConfig`` memfit trains and estimates: rank r, alpha = 2·r, ``dropout``
    (``--lora-dropout``; 0.1, the usual recipe, by default), the targets of
    :func:`lora_target_modules`; a classifier's head is trained whole and saved with the adapter
    (``modules_to_save``)."""
    from peft import LoraConfig  # optional: peft (memfit[lora])

    extra_heads = [
        h
        for h in (lora_head_modules(model) if task == "classification" else [])
        if not any(h.endswith(name) for name in PEFT_HEAD_NAMES)
    ]
    return LoraConfig(
        task_type=LORA_TASK_TYPES[task],
        r=rank,
        lora_alpha=2 * rank,
        # above 0 peft's nn.Dropout keeps a dropped copy of each adapted layer's input for
        # backward; at 0 its nn.Identity keeps none
        lora_dropout=dropout,
        target_modules=lora_target_modules(model, task, targets),
        # peft's SEQ_CLS adds "classifier" and "score" itself (and matches names by their end)
        modules_to_save=extra_heads or None,
    )


def with_lora(model: nn.Module, spec: StepSpec) -> nn.Module:
    """LoRA adapters via peft on :func:`lora_config`'s target modules; the base is frozen, a
    classification head stays trainable (saved with the adapter)."""
    get_peft_model = require("peft", "--lora-rank").get_peft_model
    if isinstance(model, BiEncoder):
        config = lora_config(
            model.transformer,
            "sentence-embedding",
            spec.lora_rank,
            spec.lora_targets,
            spec.lora_dropout,
        )
        model.transformer = get_peft_model(model.transformer, config)  # type: ignore[arg-type]
        if model.classifier is not None:
            model.classifier.requires_grad_(True)
        return model
    config = lora_config(model, spec.task, spec.lora_rank, spec.lora_targets, spec.lora_dropout)
    return get_peft_model(model, config)  # type: ignore[arg-type, return-value]


def _task_config(config: Any, spec: StepSpec) -> Any:
    """A copy of ``config`` for the task's model: the attention transformers runs for the spec's
    (:mod:`memfit.estimate.attention`), a classifier's labels and pad token, no key/value cache."""
    config = config.__class__.from_dict(config.to_dict())
    config._attn_implementation = config_attention(config, spec)
    # the dtype memfit train loads the model in (memfit.step.weights): a frozen base (LoRA,
    # QLoRA) in the frozen dtype (under auto the checkpoint's: config.dtype, bfloat16 for
    # today's decoders), a fully trained model in the trained dtype (fp32 master weights under
    # mixed precision, 16 bits for pure 16-bit training); transformers 5 builds it in config.dtype
    dtype = weights.load_dtype(
        config,
        spec.weights_dtype,
        frozen_base=bool(spec.lora_rank) or spec.quantization != "none",
    )
    for text in {
        id(config): config,
        id(config.get_text_config()): config.get_text_config(),
    }.values():
        text.dtype = dtype
    if spec.task == "classification":
        config.num_labels = spec.num_labels
        text = config.get_text_config()
        if getattr(text, "pad_token_id", None) is None:
            # a decoder classifier pools its last real token, found by the pad id; decoder LLMs
            # ship none, and a user sets the tokenizer's end-of-sequence token (pad = eos)
            eos = getattr(text, "eos_token_id", None)
            if isinstance(eos, list):  # several end tokens (Llama 3.1): the tokenizer's is first
                eos = eos[0] if eos else None
            text.pad_token_id = eos if eos is not None else 0
        if getattr(config, "problem_type", None) is None and spec.num_labels > 1:
            # integer labels of several classes: what BERT-style heads settle on at their first
            # forward (DeBERTa-v2's head would instead gather the labelled rows with nonzero(),
            # whose size fake tensors cannot know; the gathered rows are the batch's own)
            config.problem_type = "single_label_classification"
    if hasattr(config, "use_cache"):
        # training keeps no key/value cache (it would hold every layer's keys and values)
        config.use_cache = False
    return config


def make_batch(
    config: Any, spec: StepSpec, batch_size: int, seq_len: int, device: Any = "cpu"
) -> dict[str, Any]:
    """A batch of random tokens at the full length, with a single padding token (see ``mask``)."""
    vocab = int(config.vocab_size)

    def tokens() -> torch.Tensor:
        return torch.randint(0, vocab, (batch_size, seq_len), device=device)

    def mask() -> torch.Tensor:
        attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long, device=device)
        if seq_len > 1:
            # one padding token, as nearly every padded training batch has: transformers skips
            # building the attention mask for an all-ones mask on real tensors (it cannot tell on
            # fake ones), so the real run and the trace both build it
            attention_mask[-1, -1] = 0
        return attention_mask

    if spec.task == "classification":
        return {
            "input_ids": tokens(),
            "attention_mask": mask(),
            "labels": torch.randint(0, spec.num_labels, (batch_size,), device=device),
        }
    if spec.task == "causal-lm" and spec.packed:
        # padding-free packing (--packing-strategy bfd): two rows per sequence, their own
        # position ids and no padding mask, as memfit train feeds them. On SDPA and eager
        # attention transformers builds the block-diagonal (B, 1, T, T) mask from the positions
        # (on fake tensors it cannot tell one row from several and always builds it; a real
        # step of one row per sequence builds none). Flash attention's variable-length path
        # takes a single flattened row of B·T tokens, which allocates what its dense kernel does
        # on B rows of T (no padding to undo): the batch has no positions there, the dense path
        ids = tokens()
        packed: dict[str, Any] = {"input_ids": ids, "attention_mask": None, "labels": ids}
        if "flash" not in spec.attn_implementation:
            first = seq_len // 2
            positions = torch.cat(
                [torch.arange(first, device=device), torch.arange(seq_len - first, device=device)]
            )
            packed["position_ids"] = positions.expand(batch_size, -1).contiguous()
        return packed
    if spec.task == "causal-lm":
        ids = tokens()
        return {"input_ids": ids, "attention_mask": mask(), "labels": ids}
    if spec.loss == "cached-mnrl":
        # the whole batch, ``cached_chunks`` mini-batches of ``batch_size`` rows
        rows = batch_size * spec.cached_chunks
        return make_batch(config, dataclasses.replace(spec, loss="mnrl"), rows, seq_len, device)
    batch: dict[str, Any] = {
        "anchor": {"input_ids": tokens(), "attention_mask": mask()},
        "positive": {"input_ids": tokens(), "attention_mask": mask()},
    }
    if spec.loss in ("cosent", "cosine"):
        batch["labels"] = torch.rand(batch_size, device=device)
    elif spec.loss == "softmax":
        batch["labels"] = torch.randint(0, spec.num_labels, (batch_size,), device=device)
    return batch


class Int8AdamStateModel(torch.optim.Optimizer):
    """The memory of bitsandbytes' AdamW8bit, for tracing where bitsandbytes cannot run.

    bitsandbytes keeps two uint8 states per parameter with at least 4096 elements, plus one fp32
    absmax per 256-element block for each; smaller tensors keep fp32 states. Its update is one
    fused kernel that works in place, so the step itself allocates nothing.
    """

    BLOCK_SIZE = 256
    MIN_8BIT_SIZE = 4096

    def __init__(self, params: Any, lr: float = 1e-5) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    if p.numel() >= self.MIN_8BIT_SIZE:
                        blocks = -(-p.numel() // self.BLOCK_SIZE)
                        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                    else:
                        state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        state["state2"] = torch.zeros_like(p, dtype=torch.float32)
                # the fused 8-bit kernel updates states and weights in place
                p.add_(p.grad, alpha=-group["lr"])


def make_optimizer(
    name: str, model: nn.Module, device_type: str, *, lr: float = 1e-5, offload: str = "none"
) -> torch.optim.Optimizer:
    """The optimizer as the target device runs it by default.

    torch picks the foreach (multi-tensor) implementation on CUDA and the for-loop one on the CPU;
    their temporaries differ (foreach AdamW holds a square-root copy of every second moment at once).

    ``offload="cpu"`` on a GPU: the device side of torchao's ``CPUOffloadOptimizer``
    (:class:`memfit.estimate.optimizer_offload.HostSteppedOptimizer`): no state on the device but
    that of the parameters under 4096 elements, which torchao steps there; what lives in host
    memory is :func:`memfit.estimate.optimizer_offload.host_parts`. On the CPU device host and
    device are the same memory: the optimizer as without offloading.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    foreach = device_type == "cuda"
    if offload == "cpu" and device_type != "cpu":
        # torchao's on-device optimizer for the small parameters is the same class (its fused
        # AdamW there; traced as foreach: the temporaries of a few vectors are negligible)
        base = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
        return HostSteppedOptimizer(params, lambda kept: base(kept, lr=lr, foreach=foreach), lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=foreach)
    if name == "adafactor":
        # start-up: transformers takes a second or more to import; only Adafactor needs it here
        from transformers.optimization import Adafactor

        # the settings HF Trainer uses for optim="adafactor"
        return Adafactor(
            params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False
        )
    # real tensors: bitsandbytes' own optimizers where it is installed (it runs on the CPU too)
    real = _fake_mode_inactive() and not any(isinstance(p, FakeTensor) or p.is_meta for p in params)
    if name == "adamw-8bit":
        if real:
            try:
                # optional: bitsandbytes (memfit[quantization])
                import bitsandbytes as bnb  # type: ignore[import-not-found]

                return bnb.optim.AdamW8bit(params, lr=lr)  # type: ignore[no-any-return]
            except ImportError:
                pass
        return Int8AdamStateModel(params, lr=lr)
    if name in ("paged-adamw-8bit", "paged-adamw-32bit"):
        eight_bit = name == "paged-adamw-8bit"
        if real:
            try:
                import bitsandbytes as bnb  # optional: bitsandbytes (memfit[quantization])

                paged = bnb.optim.PagedAdamW8bit if eight_bit else bnb.optim.PagedAdamW32bit
                return paged(params, lr=lr)  # type: ignore[no-any-return]
            except ImportError:
                pass
        # on CUDA the big tensors' state is in unified memory, outside PyTorch's allocator
        return quantized.PagedAdamStateModel(
            params, bits=8 if eight_bit else 32, paged=device_type == "cuda", lr=lr
        )
    raise ValueError(f"unknown optimizer {name!r}")


def _fake_mode_inactive() -> bool:
    return not any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def compute_loss(model: nn.Module, batch: dict[str, Any], spec: StepSpec) -> torch.Tensor:
    """Forward with loss: the recipes' own loss functions (:mod:`memfit.step`), which ``memfit
    train`` runs, over the batch's units (a whole step in one micro-batch)."""
    if spec.task == "classification":
        inputs = {name: value for name, value in batch.items() if name != "labels"}
        labels = batch["labels"]
        return step.classification_loss(model, inputs, labels, units=labels.size(0))
    if spec.task == "causal-lm":
        labels = batch["labels"]
        # every token but each row's first is a target (the count only scales the loss)
        units = labels.size(0) * max(labels.size(1) - 1, 1)
        if spec.cross_entropy == "trl-chunked":
            # TRL SFTTrainer's fused LM head (memfit.step.trl_head): its own function on real
            # tensors, its loop over two token tiles on the estimator's fake ones
            return trl_head.trl_chunked_loss(
                model,
                batch["input_ids"],
                batch["attention_mask"],
                labels,
                units,
                position_ids=batch.get("position_ids"),
            )
        # fused-linear: memfit's chunked loss (on a CUDA target it stands for Liger's kernel,
        # which allocates the same chunks)
        return step.causal_lm_loss(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            labels,
            units=units,
            cross_entropy=spec.cross_entropy,
            # packed rows (spec.packed): each its own positions, no padding mask
            position_ids=batch.get("position_ids"),
        )
    loss = "mnrl" if spec.loss == "cached-mnrl" else spec.loss
    if loss in step.SENTENCE_LOSSES and _sentence_transformers():
        # sentence-transformers' own loss, as memfit train runs it, on the bi-encoder's embeddings
        module = step.sentence_loss_module(loss, SentenceFeatures(model))
        # the columns' own dicts: what the model adds to them is freed when the loss returns
        columns = [dict(batch["anchor"]), dict(batch["positive"])]
        rows = int(batch["anchor"]["input_ids"].size(0))
        return step.sentence_embedding_loss(module, columns, batch.get("labels"), rows, rows)
    # softmax (its classifier is the bi-encoder's), or no sentence-transformers: the same math
    anchor = model(**batch["anchor"])
    positive = model(**batch["positive"])
    return sentence_loss(model, anchor, positive, batch.get("labels"), loss)


class SentenceFeatures(nn.Module):
    """A bi-encoder as a sentence-transformers loss calls a SentenceTransformer: a column's
    features in, ``{"sentence_embedding": ...}`` out."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoder: Any = self.encoder
        return encoder.embed(features)  # type: ignore[no-any-return]


@functools.cache
def _sentence_transformers() -> bool:
    """Whether sentence-transformers (an optional package) is installed; imported once, when
    the bi-encoder is built, outside any trace: its import makes tensors (bitsandbytes' tables),
    which must be real CPU ones (neither meta nor fake), and its garbage must not be collected
    inside a traced step, where it would move the step's frees."""
    with _disable_current_modes(), torch.device("cpu"):
        try:
            step.sentence_losses()
        except ImportError:
            return False
    return True


def sentence_loss(
    model: nn.Module,
    anchor: torch.Tensor,
    positive: torch.Tensor,
    labels: torch.Tensor | None,
    loss: str,
) -> torch.Tensor:
    """The sentence-transformers losses on (anchor, positive) embeddings."""
    if loss == "mnrl":
        # every other positive in the batch is a negative for this anchor
        scores = _cos_sim(anchor, positive) * MNRL_SCALE
        targets = torch.arange(scores.size(0), device=scores.device)
        return nn.functional.cross_entropy(scores, targets)
    assert labels is not None
    if loss == "cosine":
        cos = nn.functional.cosine_similarity(anchor, positive)
        return nn.functional.mse_loss(cos, labels.to(cos.dtype))
    if loss == "cosent":
        cos = nn.functional.cosine_similarity(anchor, positive) * COSENT_SCALE
        diff = cos[:, None] - cos[None, :]
        diff = diff - (labels[:, None] < labels[None, :]).to(diff.dtype) * 1e12
        diff = torch.cat(
            (torch.zeros(1, device=diff.device, dtype=diff.dtype), diff.view(-1)), dim=0
        )
        return torch.logsumexp(diff, dim=0)
    if loss == "softmax":
        features = torch.cat([anchor, positive, (anchor - positive).abs()], dim=1)
        classifier: Any = model.classifier
        return nn.functional.cross_entropy(classifier(features), labels)
    raise ValueError(f"unknown loss {loss!r}")


def _cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a_norm = nn.functional.normalize(a, p=2, dim=1)
    b_norm = nn.functional.normalize(b, p=2, dim=1)
    return a_norm @ b_norm.transpose(0, 1)


def default_autocast(
    spec: StepSpec, device_type: str
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """Real autocast for the device the step runs on (fp32: no autocast)."""
    if spec.precision == "fp32":
        return contextlib.nullcontext
    dtype = PRECISION_DTYPES[spec.precision]
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


class LossScaler:
    """What GradScaler does to memory, without its data-dependent ``found_inf.item()``.

    A scale and an inverse-scale scalar, one found-inf flag, the scaled loss; unscaling multiplies
    the gradients in place. Used on fake tensors, where GradScaler's host sync cannot run.
    """

    def __init__(self, device: Any) -> None:
        self.scale_value = torch.full((), 65536.0, dtype=torch.float32, device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value.to(loss.dtype)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        inv_scale = self.scale_value.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=self.scale_value.device)
        with torch.no_grad():
            # unscale in place, as torch._amp_foreach_non_finite_check_and_unscale_ does
            torch._foreach_mul_(grads, inv_scale)
        del found_inf, inv_scale
        optimizer.step()

    def update(self) -> None:
        pass


def make_scaler(spec: StepSpec, device_type: str, *, fake: bool) -> Any:
    """A loss scaler for fp16 (None otherwise): GradScaler for real runs, LossScaler on fake tensors."""
    if spec.precision != "fp16" or spec.mode != "train":
        return None
    if fake:
        return LossScaler("cpu")
    return torch.amp.GradScaler(device_type)


@contextlib.contextmanager
def phase(recorder: Any, name: str) -> Iterator[None]:
    if recorder is not None:
        recorder.set_phase(name)
    yield


ModeFactory = Callable[[], contextlib.AbstractContextManager[Any]]


def forward_backward(
    model: nn.Module,
    batch: dict[str, Any],
    spec: StepSpec,
    *,
    scaler: Any = None,
    autocast: ModeFactory = contextlib.nullcontext,
    backward_modes: ModeFactory = contextlib.nullcontext,
    recorder: Any = None,
    offload: ModeFactory = contextlib.nullcontext,
) -> None:
    """Forward with loss, then backward: the gradients of one batch. ``offload``: the activation
    offloading context (:mod:`memfit.step.offload`) entered around both, as TRL enters its own
    around a training step (the forward's saves go to the host, the backward brings them back)."""
    with offload():
        if spec.loss == "cached-mnrl":
            _cached_mnrl_forward_backward(
                model,
                batch,
                spec,
                scaler=scaler,
                autocast=autocast,
                backward_modes=backward_modes,
                recorder=recorder,
            )
            return
        with phase(recorder, "forward"), autocast():
            loss = compute_loss(model, batch, spec)
        with phase(recorder, "backward"), backward_modes():
            (scaler.scale(loss) if scaler is not None else loss).backward()
            # free the graph's last reference before the optimizer runs, as a training loop does
            del loss


def _cached_mnrl_forward_backward(
    model: nn.Module,
    batch: dict[str, Any],
    spec: StepSpec,
    *,
    scaler: Any,
    autocast: ModeFactory,
    backward_modes: ModeFactory,
    recorder: Any,
) -> None:
    """MultipleNegativesRankingLoss with gradient caching (GradCache), as sentence-transformers'
    CachedMultipleNegativesRankingLoss runs it: the gradient of the whole batch's loss, with the
    activations of only one mini-batch alive at a time.

    1. embed every mini-batch without a graph; 2. the loss on the detached embeddings, one
    mini-batch of anchors against all positives at a time, caches d loss / d embedding;
    3. embed each mini-batch again with a graph and backpropagate the cached gradient into it.
    """
    columns = [batch["anchor"], batch["positive"]]
    rows = columns[0]["input_ids"].size(0)
    mini = max(1, -(-rows // spec.cached_chunks))

    def pieces(column: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids, masks = column["input_ids"].split(mini), column["attention_mask"].split(mini)
        return list(zip(ids, masks, strict=True))

    with phase(recorder, "forward"):
        reps: list[list[torch.Tensor]] = []
        for column in columns:
            with torch.no_grad(), autocast():
                embedded = [model(input_ids=i, attention_mask=m) for i, m in pieces(column)]
            reps.append([e.detach().requires_grad_() for e in embedded])
            del embedded
        anchors, positives = torch.cat(reps[0]), torch.cat(reps[1])
        targets = torch.arange(rows, device=anchors.device)
        with phase(recorder, "backward"), backward_modes():
            for start in range(0, rows, mini):
                with autocast():
                    scores = _cos_sim(anchors[start : start + mini], positives) * MNRL_SCALE
                    loss = nn.functional.cross_entropy(scores, targets[start : start + mini])
                    loss = loss * scores.size(0) / rows
                (scaler.scale(loss) if scaler is not None else loss).backward()
                del scores, loss
        del anchors, positives, targets
    cache = [[r.grad for r in column_reps] for column_reps in reps]
    del reps
    with phase(recorder, "backward"), backward_modes():
        for column, grads in zip(columns, cache, strict=True):
            for (ids, masks), grad in zip(pieces(column), grads, strict=True):
                assert grad is not None
                with autocast():
                    embedding = model(input_ids=ids, attention_mask=masks)
                surrogate = torch.dot(embedding.flatten(), grad.flatten().to(embedding.dtype))
                surrogate.backward()
                del embedding, surrogate
    del cache


def training_step(
    model: nn.Module,
    batch: dict[str, Any],
    spec: StepSpec,
    optimizer: torch.optim.Optimizer,
    *,
    scaler: Any = None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    recorder: Any = None,
    offload: ModeFactory = contextlib.nullcontext,
) -> None:
    """Forward with loss, backward, optimizer step, zero_grad: one steady-state training step
    (``offload``: see :func:`forward_backward`)."""
    forward_backward(
        model, batch, spec, scaler=scaler, autocast=autocast, recorder=recorder, offload=offload
    )
    with phase(recorder, "optimizer_step"):
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        # flush the gradients as soon as we can, no need for this memory anymore
        optimizer.zero_grad(set_to_none=True)


def eval_step(
    model: nn.Module,
    batch: dict[str, Any],
    spec: StepSpec,
    *,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    recorder: Any = None,
) -> None:
    """Forward with loss under no_grad: what an evaluation loop runs per batch."""
    with phase(recorder, "forward"), torch.no_grad(), autocast():
        loss = compute_loss(model, batch, spec)
        del loss
