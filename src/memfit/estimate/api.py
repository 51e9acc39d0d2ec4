"""``memfit.estimate``: the peak memory of one steady-state training (or eval) step.

The public API: :func:`estimate` checks its knobs (:func:`validate`), takes the traces of the model
and knobs (:mod:`memfit.estimate.traces`: traced once, kept in memory and on disk), replays them at
the shape asked (:mod:`memfit.estimate.replay`) and reports the peak as an :class:`Estimate`.
"""

from __future__ import annotations

import dataclasses
import os
import time
import typing
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from memfit import step
from memfit.devices.catalog import Gpu, find_gpu
from memfit.devices.profiles import CudaProfile, cuda_profile, sdpa_sm
from memfit.errors import UsageError
from memfit.estimate import quantized, quantized_count, traces
from memfit.estimate.attention import attention_run
from memfit.estimate.flash_attention_emulation import flash_attention_gpu_problem
from memfit.estimate.replay import Peak
from memfit.estimate.sharding import ddp_bucket_sizes, none_details
from memfit.estimate.sharding import layout as sharding_layout
from memfit.estimate.step_trace import CATEGORIES
from memfit.estimate.traces import NotTraced, Traced, hidden_size
from memfit.estimate.workload import StepSpec
from memfit.extras import problems as missing_packages
from memfit.job import (
    DEFAULT_LOSS,
    DEFAULT_MINI_BATCH_SIZE,
    JOB_FIELDS,
    MODES,
    STEP_DEFAULTS,
    STEP_FIELDS,
    TRACE_DEPTHS,
    Job,
    choice_problem,
    parse_target_modules,
    positions_problem,
    resolve_loss,
    whole,
)
from memfit.levers.activation_offloading import mode_problem as offloading_mode_problem
from memfit.models import resolve_model
from memfit.step import linear_ce, offload, trl_head, weights
from memfit.units import parse_size

BREAKDOWN_KEYS = (*CATEGORIES, "allocator_overhead", "runtime_overhead")


@dataclass(frozen=True)
class Estimate:
    """The predicted peak of one step, and what is alive at that moment.

    ``breakdown`` sums to ``total_bytes``. On CUDA ``total_bytes`` is what ``max_memory_reserved``
    plus the CUDA context would show; on the CPU, the process's peak memory for tensors.

    ``fits``: the step fits every budget it has: ``total_bytes`` within ``budget_bytes`` (the
    GPU's), and, where it offloads to host memory, ``details["host"]["fits"]`` (the host's); False
    when either does not, None when there is no GPU budget and no host one that fails.
    """

    total_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    budget_bytes: int | None
    fits: bool | None
    model: str
    spec: StepSpec
    batch_size: int
    seq_len: int
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def biggest_part(self) -> str:
        return max(self.breakdown, key=lambda k: self.breakdown[k])

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` contract (plus a ``details`` object)."""
        return {
            "total_bytes": self.total_bytes,
            "breakdown": dict(self.breakdown),
            "peak_phase": self.peak_phase,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "details": dict(self.details),
        }


# StepSpec's names for the job's knobs that it spells otherwise
_SPEC_NAMES = {"lora_target_modules": "lora_targets"}
_SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(StepSpec))
# the job's fields estimate() takes as keywords (the micro-batch is its ``batch_size``)
_KEYWORDS = frozenset(STEP_FIELDS) - {"micro_batch_size"}
_SPEC_DEFAULTS = frozenset(
    f.name for f in dataclasses.fields(StepSpec) if f.default is not dataclasses.MISSING
)
# the knobs that are lists of names
_LIST_FIELDS = frozenset(
    name for name, hint in typing.get_type_hints(Job).items() if "list[" in str(hint)
)


def step_job(model: str, *, batch_size: Any, **knobs: Any) -> Job:
    """The :class:`Job` of :func:`estimate`'s keywords: ``batch_size`` is its micro-batch,
    ``knobs`` its other fields (:data:`~memfit.job.STEP_FIELDS`); a knob not given (or None, as
    in a :class:`Job`) is the step's default (:data:`~memfit.job.STEP_DEFAULTS`). A keyword that
    is no knob of a step is a TypeError, as a function's unknown keyword is."""
    given = {name: value for name, value in knobs.items() if value is not None}
    for name in knobs:
        # a knob of the job a step does not take is welcome only as None (not given)
        if name not in JOB_FIELDS or (name in given and name not in _KEYWORDS):
            raise TypeError(f"estimate() got an unexpected keyword argument {name!r}")
    values = {**STEP_DEFAULTS, **given, "micro_batch_size": batch_size}
    for name, value in values.items():
        if name in _LIST_FIELDS and isinstance(value, str | list | tuple):
            # "attention,mlp" or a sequence of names, as memfit train takes them
            values[name] = parse_target_modules(value)
    world: Any = values.get("world_size")
    # an estimate has no effective batch: the ranks' whole one splits evenly by definition
    return Job(model=model, effective_batch_size=world if whole(world) else 1, **values)


def validate(job: Job, *, mode: str = "train") -> tuple[StepSpec, list[str]]:
    """Check every knob of ``job`` at once; return the step's spec and the list of problems
    (empty when fine).

    The checks are the job's (:meth:`memfit.job.Job.problems`), with the flags as ``memfit
    estimate`` spells them; ``--mode`` is the estimate's own. No loss given is the task's
    default here (an estimate is of one definite step).
    """
    checked = job
    if job.loss is None and job.task in DEFAULT_LOSS:
        checked = dataclasses.replace(job, loss=DEFAULT_LOSS[job.task])
    problems = checked.problems(
        flags={"micro_batch_size": "--batch-size"},
        required=("micro_batch_size", "seq_len", "num_labels", *_REQUIRED),
    )
    if problem := choice_problem("--mode", mode, MODES):
        problems.append(problem)
    offloads = {"activation_offloading": job.activation_offloading}
    if problem := offloading_mode_problem(offloads, mode):
        problems.append(problem)
    return step_spec(job, mode), problems


# the named choices a step cannot leave unset: those with a default (the step's or the job's)
_REQUIRED = tuple(
    f.name
    for f in dataclasses.fields(Job)
    if f.metadata.get("choices") is not None and (f.name in STEP_DEFAULTS or f.default is not None)
)


def step_spec(job: Job, mode: str = "train") -> StepSpec:
    """The step the estimator traces (and :mod:`memfit._measure_child` runs) for ``job``: each
    field of :class:`StepSpec` that is a knob of the job takes the job's value (None, or a value
    the checks refuse: the step's default), the loss resolved (the task's default when none)."""
    values: dict[str, Any] = {}
    for name in STEP_FIELDS:
        field_name = _SPEC_NAMES.get(name, name)
        value = getattr(job, name)
        if field_name not in _SPEC_FIELDS or value is None:
            continue
        f = Job.__dataclass_fields__[name]
        refused = (
            f.metadata.get("choices") is not None and value not in f.metadata["choices"]
        ) or (f.metadata.get("minimum") is not None and not whole(value, f.metadata["minimum"]))
        if refused and field_name in _SPEC_DEFAULTS:
            continue
        values[field_name] = tuple(value) if isinstance(value, list) else value
    values["loss"] = resolve_loss(job.task, job.loss, [])
    return StepSpec(**values, mode=mode)


def estimate(
    model: str,
    *,
    task: str,
    batch_size: int,
    seq_len: int,
    mode: str = "train",
    gpu_memory: int | str | None = None,
    gpu: str | None = None,
    trace_depth: str = "auto",
    host_memory: int | str | None = None,
    **knobs: Any,
) -> Estimate:
    """Predict the peak memory of one steady-state step (optimizer state already exists).

    Traces the real transformers model code on fake tensors the first time a model and set of
    knobs is seen (seconds), then answers other batch sizes and sequence lengths in milliseconds.

    ``knobs`` are the job's (:class:`memfit.job.Job`'s fields, :data:`~memfit.job.STEP_FIELDS`;
    ``memfit estimate --help`` lists them), each the step's default when not given
    (:data:`~memfit.job.STEP_DEFAULTS`: fp32, AdamW, SDPA, CUDA, one rank, ...); ``batch_size``
    is the step's micro-batch. The knobs a plan chooses are all among them: ``loss="cached-mnrl"``
    with ``mini_batch_size`` (the gradient-cached in-batch-negatives loss; ``batch_size`` is then
    the whole batch), ``lora_rank`` (LoRA adapters via peft; 0 or None: full fine-tuning),
    ``max_seq_len`` (truncation: sequences are cut to it) and ``world_size`` with ``sharding``
    (the memory of one of ``world_size`` ranks; ``sharding`` none | zero1 | zero2 | zero3 | fsdp
    says how they divide parameters, gradients and optimizer state: see
    :mod:`memfit.estimate.sharding`; none is memfit's data parallelism, gradients all-reduced in
    place). ``lora_target_modules``: the adapters' targets as ``memfit train
    --lora-target-modules`` takes them (groups attention/mlp, module names, all-linear; default
    attention). ``gradient_accumulation_steps`` > 1: the micro-batches after the first run
    forward and backward while the gradients of the earlier ones are alive (and add theirs in
    place). ``quantization`` nf4 | fp4 | int8 (with ``lora_rank``: QLoRA) holds the frozen base
    weights as bitsandbytes does (4-bit ones with their block scales optionally quantized again),
    computing in the ``precision``'s dtype (see :mod:`memfit.estimate.quantized`;
    ``details["quantization"]``). The paged optimizers' state in CUDA unified memory is not in a
    CUDA estimate's total: ``details["paged_optimizer_state_bytes"]``.

    The estimate's own keywords: ``mode`` train | eval; ``gpu`` names a catalog GPU (see
    ``memfit plan --gpu``): its generation's cuBLAS workspace, and its memory as the budget
    unless ``gpu_memory`` is given. ``trace_depth``: ``auto`` traces two shallow copies of the
    model (3 and 4 layers, or more where layers alternate) and writes out the trace of every
    layer exactly (see :mod:`memfit.estimate.depth`; ``details["trace_depth"]`` says what was
    done), falling back to the whole model where the layers do not repeat; ``full`` always
    traces every layer.

    Offloading (``activation_offloading``, ``optimizer_offload="cpu"``) on a GPU moves bytes to
    host memory: ``breakdown`` and ``total_bytes`` are the GPU's without them, and
    ``details["host"]`` holds the host's (``total_bytes``, ``parts``, ``budget_bytes``: the
    ``host_memory`` keyword, else this machine's total memory; ``fits``, which the estimate's
    ``fits`` includes; ``activation_offloading``: the implementation whose rules the activations'
    part follows, ``"trl"`` on CUDA: ``memfit train`` runs TRL's context there and refuses to run
    without it, so the estimate emulates TRL's rules whatever is installed here). On the CPU
    device host and device are one memory: the copies are in the total, and there is no
    ``details["host"]``.
    """
    job = step_job(model, batch_size=batch_size, task=task, seq_len=seq_len, **knobs)
    checked = _checked(
        job,
        mode=mode,
        gpu_memory=gpu_memory,
        gpu=gpu,
        trace_depth=trace_depth,
        host_memory=host_memory,
    )
    model_spec, seq_len, spec = checked.model_spec, checked.seq_len, checked.spec
    accumulation = job.gradient_accumulation_steps or 1  # checked: a whole number
    accumulate = accumulation > 1 and spec.mode == "train"
    card = checked.card
    if card is not None and spec.device == "cuda":
        # the attention kernels of the GPU's generation: no flash attention before sm80
        spec = dataclasses.replace(spec, sdpa_sm=sdpa_sm(card.compute_capability))
    # the attention transformers runs: eager where the architecture has no SDPA (Gemma-2,
    # DeBERTa-v2, MPNet); a UsageError where it has no FlashAttention or no head for the task
    spec = dataclasses.replace(spec, attn_implementation=attention_run(model_spec.config, spec))

    started = time.perf_counter()
    spec, traced_batch, extra_rows = _cached_loss_split(spec, batch_size, job.mini_batch_size)
    traced = traces.traced(model_spec, spec, trace_depth, (traced_batch, seq_len))
    world = job.world_size or 1
    peak = traced.replay(
        traced_batch,
        seq_len,
        world_size=world,
        profile=checked.profile,
        accumulate=accumulate,
        sharding=job.sharding,
    )
    if extra_rows and peak.phase != "optimizer_step":
        peak = _with_cached_rows(peak, extra_rows, model_spec.config, spec)
    details = _details(
        traced,
        peak,
        (traced_batch, seq_len),
        world_size=world,
        gradient_accumulation_steps=accumulation if spec.mode == "train" else 1,
        profile=checked.profile,
        started=started,
    )
    details |= _quantization_details(traced, model_spec.cache_key())
    if spec.attn_implementation != job.attn_implementation:
        details["attn_implementation_run"] = spec.attn_implementation
    if traced.changed():
        traces.save_traces()
    details |= _sharding_details(traced, job.sharding, world)
    host = _host_details(traced, peak, job.sharding, world, checked.host_budget)
    if host is not None:
        details["host"] = host
    if card is not None:
        details["gpu"] = _gpu_details(card, checked.budget_from_gpu)
    total, budget = peak.total_bytes, checked.budget
    fits = None if budget is None else total <= budget
    if host is not None and not host["fits"]:
        # the host memory the offloaded bytes need is a budget too
        fits = False
    return Estimate(
        total_bytes=total,
        breakdown=peak.breakdown,
        peak_phase=peak.phase,
        budget_bytes=budget,
        fits=fits,
        model=model_spec.name,
        spec=spec,
        batch_size=batch_size,
        seq_len=seq_len,
        details=details,
    )


class _Checked(NamedTuple):
    """What :func:`_checked` found: the step, the model, the budget and the GPU generation."""

    spec: StepSpec
    model_spec: Any  # memfit.models.ModelSpec
    budget: int | None
    profile: CudaProfile | None
    seq_len: int  # cut to max_seq_len
    card: Gpu | None = None  # the --gpu card
    budget_from_gpu: bool = False  # the budget is the card's memory (no --gpu-memory)
    host_budget: int | None = None  # --host-memory (None: the machine's, where needed)


def _checked(
    job: Job,
    *,
    mode: str,
    gpu_memory: int | str | None,
    gpu: str | None,
    trace_depth: str,
    host_memory: int | str | None = None,
) -> _Checked:
    """Check ``job`` and the estimate's own keywords at once; one :class:`UsageError` lists
    every problem."""
    spec, problems = validate(job, mode=mode)
    accumulation = job.gradient_accumulation_steps
    if not whole(accumulation):
        # the estimate's own message for it, where it has always been (below)
        problems = [p for p in problems if not p.startswith("--gradient-accumulation-steps:")]
    seq_len, max_seq_len = job.seq_len, job.max_seq_len
    budget = None
    if gpu_memory is not None:
        try:
            budget = parse_size(gpu_memory, name="--gpu-memory")
        except UsageError as exc:
            problems.append(str(exc))
    host_budget = None
    if host_memory is not None:
        try:
            host_budget = parse_size(host_memory, name="--host-memory")
        except UsageError as exc:
            problems.append(str(exc))
    profile, card, budget_from_gpu = None, None, False
    if gpu is not None:
        try:
            card = find_gpu(gpu)
            profile = cuda_profile(card.compute_capability)
            attention = job.attn_implementation
            if problem := flash_attention_gpu_problem(attention, gpu, card.compute_capability):
                problems.append(problem)
            if job.device == "cuda" and (problem := card.precision_problem(job.precision or "")):
                problems.append(problem)
            if budget is None:
                budget, budget_from_gpu = card.memory_bytes, True
        except UsageError as exc:
            problems.append(str(exc))
    model_spec = None
    try:
        model_spec = resolve_model(job.model)
    except UsageError as exc:
        problems.append(str(exc))
    if isinstance(seq_len, int) and isinstance(max_seq_len, int):
        seq_len = min(seq_len, max_seq_len)
    if model_spec is not None:
        problem = positions_problem("--seq-len", seq_len, model_spec.max_positions, model_spec.name)
        if problem:
            problems.append(problem)
        # a head the fused loss does not model (Granite's logits_scaling, Cohere's
        # logit_scale): refused before anything is traced
        fused = job.task == "causal-lm" and job.cross_entropy == "fused-linear"
        if fused and (problem := step.fused_linear_config_problem(model_spec.config)):
            problems.append(problem)
    if not whole(accumulation):
        problems.append(
            f"--gradient-accumulation-steps: expected a whole number ≥ 1, got {accumulation!r}"
        )
    if problem := choice_problem("--trace-depth", trace_depth, TRACE_DEPTHS):
        problems.append(problem)
    if job.lora_rank:
        # the adapters are peft's: the estimate puts them on the model as a run does
        problems.extend(missing_packages([("peft", "--lora-rank")]))
    if problems:
        raise UsageError("; ".join(problems))
    assert model_spec is not None and seq_len is not None
    return _Checked(spec, model_spec, budget, profile, seq_len, card, budget_from_gpu, host_budget)


def machine_memory_bytes() -> int:
    """This machine's total memory: the host budget of an offloading estimate by default."""
    try:
        # optional: psutil comes with accelerate and deepspeed, not with memfit itself
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil is present wherever accelerate is
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _optimizer_host_parts(traced: Traced, sharding: str, world_size: int) -> dict[str, int]:
    """The host parts of an offloaded optimizer (:mod:`memfit.estimate.optimizer_offload`)."""
    if traced.spec.optimizer_offload != "cpu":
        return {}
    # start-up: the optimizer offload's module is only needed when it is on
    from memfit.estimate import optimizer_offload

    parts: dict[str, int] = optimizer_offload.host_parts_of_trace(
        traced.trace, traced.spec, world_size=world_size, sharding=sharding
    )
    return parts


def _host_details(
    traced: Traced, peak: Peak, sharding: str, world_size: int, budget: int | None
) -> dict[str, Any] | None:
    """``details["host"]``: what an offloading GPU step holds in host memory, by part, against
    the host budget (``budget``, else this machine's memory); None when nothing is offloaded or
    the step runs on the CPU (its host is its device: the copies are in the total).

    ``activations``: the most offloaded activations held at once (their host copies, each a
    pinned block rounded up to a power of two, as CUDA's caching host allocator keeps them:
    :func:`memfit.estimate.replay.pinned_block_bytes`), from the replay of the trace."""
    spec = traced.spec
    if spec.device == "cpu" or spec.mode != "train":
        return None
    parts: dict[str, int] = {}
    if spec.activation_offloading:
        parts["activations"] = peak.host_peak_bytes
    for name, size in _optimizer_host_parts(traced, sharding, world_size).items():
        parts[name] = parts.get(name, 0) + int(size)
    if not parts:
        return None
    total = sum(parts.values())
    if budget is None:
        budget = machine_memory_bytes()
    # total_bytes and parts are one rank's: every rank holds its own (DDP a whole copy, ZeRO its
    # partitions); the job names no nodes, so its --world-size ranks share one node's memory,
    # and the budget bounds them together
    ranks_per_node = max(1, world_size)
    return {
        "total_bytes": total,
        "parts": parts,
        "per": "rank",
        "ranks_per_node": ranks_per_node,
        "budget_bytes": budget,
        "fits": total * ranks_per_node <= budget,
        # which implementation's rules the activations' part follows (None: none offloaded):
        # "trl" on CUDA, what memfit train runs there (it refuses to run without TRL)
        "activation_offloading": offload.implementation(spec.device)
        if spec.activation_offloading
        else None,
    }


def _gpu_details(card: Gpu, budget_from_gpu: bool) -> dict[str, Any]:
    """``details["gpu"]``: the ``--gpu`` card, the attention kernels its generation runs, and
    whether the budget is its memory (the verdict then names it)."""
    return {
        "id": card.id,
        "name": card.short_name,
        "possessive": card.possessive,
        "memory_bytes": card.memory_bytes,
        "compute_capability": ".".join(str(x) for x in card.compute_capability),
        "attention_kernels": list(card.attention_kernels),
        "budget_is_gpu_memory": budget_from_gpu,
        "support_note": card.support_note or None,
    }


def _cached_loss_split(
    spec: StepSpec, batch_size: int, mini_batch_size: int | None
) -> tuple[StepSpec, int, int]:
    """The spec and batch traced, and the rows left out of the trace (added exactly after).

    The cached loss is traced with two mini-batches (one when the batch is one): the embeddings
    and cached gradients of the other rows are added by :func:`_with_cached_rows`.
    """
    if spec.loss != "cached-mnrl":
        return spec, batch_size, 0
    mini = min(mini_batch_size or DEFAULT_MINI_BATCH_SIZE, batch_size)
    chunks = -(-batch_size // mini)
    spec = dataclasses.replace(spec, cached_chunks=min(chunks, 2))
    return spec, mini, batch_size - mini * spec.cached_chunks


def _details(
    traced: Traced,
    peak: Peak,
    shape: tuple[int, int],
    *,
    world_size: int,
    gradient_accumulation_steps: int,
    profile: CudaProfile | None,
    started: float,
) -> dict[str, Any]:
    """``Estimate.details`` but for the sharding scheme's: how the peak was found, and its parts."""
    spec = traced.spec
    details: dict[str, Any] = {
        "num_parameters": traced.trace.num_parameters,
        "trainable_parameters": traced.trace.trainable_parameters,
        "effective_seq_len": shape[1],
        "world_size": world_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "allocated_peak_bytes": peak.allocated_peak_bytes,
        "phase_peak_bytes": dict(peak.phase_peaks),
        "reserved_peak_bytes": peak.reserved_peak_bytes,
        "context_bytes": peak.context_bytes,
        "device_profile": (profile or traced.profile).name if spec.device == "cuda" else "cpu",
        "method": traced._variant(*shape).method,
        "trace_depth": dict(traced.used(*shape).depth),
        "trace_seconds": round(traced.trace_seconds, 3),
        "estimate_seconds": round(time.perf_counter() - started, 4),
    }
    if spec.loss == "cached-mnrl":
        details["mini_batch_size"] = shape[0]
    if spec.lora_rank:
        details["lora_rank"] = spec.lora_rank
        # the dropout traced on each adapted layer's input (0: none, nothing kept for backward)
        details["lora_dropout"] = spec.lora_dropout
    details["weights"] = _weights_details(traced)
    if spec.task == "causal-lm" and spec.cross_entropy == "fused-linear":
        details["cross_entropy"] = _cross_entropy_details(traced.config, spec, shape)
    if spec.task == "causal-lm" and spec.cross_entropy == "trl-chunked":
        details["cross_entropy"] = _trl_head_details(spec, shape)
    return details


def _trl_head_details(spec: StepSpec, shape: tuple[int, int]) -> dict[str, Any]:
    """``details["cross_entropy"]`` for TRL SFTTrainer's fused LM head: its tiles and how many
    token tiles the micro-batch's target positions (every row's but the last) make."""
    token_tile, vocab_tile = trl_head.tiles()
    rows = shape[0] * max(shape[1] - 1, 1)
    return {
        "kind": "trl-chunked",
        "implementation": trl_head.implementation(spec.device),
        "token_tile": token_tile,
        "vocab_tile": vocab_tile,
        "token_tiles": -(-rows // token_tile),
    }


def _cross_entropy_details(config: Any, spec: StepSpec, shape: tuple[int, int]) -> dict[str, Any]:
    """``details["cross_entropy"]``: which fused-linear implementation the target device runs
    and how it cuts the micro-batch's tokens (every position of every row: the labels are
    shifted, not the hidden states) into chunks of logits."""
    text = config.get_text_config()
    rows = shape[0] * shape[1]
    chunk = linear_ce.chunk_rows(rows, int(text.vocab_size), hidden_size(text))
    return {
        "kind": "fused-linear",
        "implementation": linear_ce.implementation(spec.device),
        "chunk_rows": chunk,
        "chunks": -(-rows // chunk),
    }


def _weights_details(traced: Traced) -> dict[str, Any]:
    """``details["weights"]``: the dtypes the step holds its frozen weights in (None when it
    freezes none; bitsandbytes' packed weights aside), its trained ones in, and the checkpoint's."""
    frozen, trainable = weights.weight_dtypes(traced.config, traced.spec.weights_dtype)
    params = traced.trace.params
    return {
        "frozen": weights.dtype_name(frozen) if any(not p.trainable for p in params) else None,
        "trainable": weights.dtype_name(trainable),
        "checkpoint": weights.dtype_name(weights.checkpoint_dtype(traced.config)),
    }


_QUANTIZATION_SUMMARIES: dict[tuple[Any, StepSpec], Any] = {}


def _quantization_details(traced: Traced, model_key: Any) -> dict[str, Any]:
    """What bitsandbytes holds (``details["quantization"]``, counted once per model and knobs in
    this process; ``num_parameters`` then counts the quantized weights, not their packed bytes)
    and, for a paged optimizer, its state in CUDA unified memory (outside the total on CUDA; on
    the CPU nothing is paged and it is optimizer state: 0)."""
    spec, details = traced.spec, {}
    if spec.quantization != "none":
        key = (model_key, spec)
        if key not in _QUANTIZATION_SUMMARIES:
            _QUANTIZATION_SUMMARIES[key] = quantized_count.quantization_summary(traced.config, spec)
        summary = _QUANTIZATION_SUMMARIES[key]
        details["quantization"] = summary.details()
        details["num_parameters"] = (
            traced.trace.num_parameters - summary.stored_elements + summary.quantized_parameters
        )
    if spec.optimizer in quantized.PAGED_OPTIMIZERS and spec.mode == "train":
        shapes = [p.shape for p in traced.trace.params if p.trainable]
        paged = quantized.paged_state_bytes(shapes, spec.optimizer)
        details["paged_optimizer_state_bytes"] = paged if spec.device == "cuda" else 0
    return details


def _sharding_details(traced: Traced, sharding: str, world_size: int) -> dict[str, Any]:
    """What the scheme divides and what it adds, by the paper's categories and DeepSpeed's."""
    trace, spec = traced.trace, traced.spec
    details: dict[str, Any] = {"sharding": sharding}
    if sharding == "none":
        details |= none_details(trace, spec, world_size)
        if spec.mode == "train":
            # torch DDP's reducer would keep every gradient a second time, in flat buckets
            # (bucket_cap_mb=25, the first 1 MiB); memfit's data parallelism does not
            details["ddp_bucket_bytes"] = sum(ddp_bucket_sizes(trace.trainable_gradient_bytes))
    else:
        shard = sharding_layout(
            trace, spec, sharding, world_size, hidden_size=hidden_size(traced.config)
        )
        details |= shard.details
        if world_size == 1:
            details["sharding_note"] = (
                f"--sharding {sharding} on one GPU divides nothing: it only adds its buffers; "
                "give --world-size"
            )
    return details


def _with_cached_rows(peak: Peak, rows: int, config: Any, spec: StepSpec) -> Peak:
    """Add (or take away) the cached-loss rows the trace did not hold.

    Each row of each column keeps its float32 embedding and that embedding's cached gradient
    (hidden size × 4 bytes each) from the first pass to the end of backward.
    """
    extra = rows * 2 * 2 * int(config.hidden_size) * 4
    breakdown = dict(peak.breakdown)
    breakdown["activations"] += extra
    return dataclasses.replace(
        peak,
        total_bytes=peak.total_bytes + extra,
        breakdown=breakdown,
        allocated_peak_bytes=peak.allocated_peak_bytes + extra,
        reserved_peak_bytes=None
        if peak.reserved_peak_bytes is None
        else peak.reserved_peak_bytes + extra,
        # the rows live from the first pass to the end of backward
        phase_peaks={
            k: v + extra if k != "optimizer_step" else v for k, v in peak.phase_peaks.items()
        },
    )


def is_traced(model: str, **knobs: Any) -> bool:
    """Whether ``estimate(model, **knobs)`` would answer from a trace in memory or on disk."""
    with traces.only_cached():
        try:
            estimate(model, **knobs)
        except NotTraced:
            return False
    return True


__all__ = [
    "BREAKDOWN_KEYS",
    "Estimate",
    "estimate",
    "is_traced",
    "validate",
]
