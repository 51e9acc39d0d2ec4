"""The cures ``memfit doctor`` offers for an out-of-memory error: memfit plan's levers, in its
order, each only where the planner would take it for the failed job's loss, data and device, and
priced by the caller's ``saving`` (the estimate at the job's shapes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from memfit.devices.catalog import Gpu, catalog
from memfit.job import (
    CACHED_LOSSES,
    DEFAULT_MINI_BATCH_SIZE,
    IN_BATCH_NEGATIVE_LOSSES,
    OPTIMIZER_TABLE,
    SEQ_LEN_MULTIPLE,
    SWAP_OPTIMIZERS,
    Job,
    resolve_loss,
    round_seq_len,
)
from memfit.plan.configuration import LORA_RANK, QLORA
from memfit.report.oom_message import OomReport


@dataclass
class Fix:
    """One change that cures (or helps cure) the OOM: what to change, what it saves, its price."""

    change: str
    saves_bytes: int | None
    cost: str
    lever: str  # a stable name: expandable_segments, micro_batch, precision, …

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def loss_of(job: Job) -> str:
    """The job's loss by its canonical name (the task's default when not given)."""
    return resolve_loss(job.task, job.loss, [])


def rows_at_once(job: Job) -> int:
    """The rows one forward holds: the cached loss's mini-batch, else the micro-batch."""
    batch = job.micro_batch_size or 1
    if loss_of(job) == "cached-mnrl":
        return min(job.mini_batch_size or DEFAULT_MINI_BATCH_SIZE, batch)
    return batch


def cures(
    knobs: Job | None, saving: Callable[..., int | None], report: OomReport, notes: list[str]
) -> list[Fix]:
    """memfit plan's cures, in its order, that this job does not use yet and that the planner
    would take for its loss, data and device; ``saving(**changes)`` prices each (None: unknown).
    Why a cure is left out goes to ``notes``."""
    job = knobs
    candidates = [
        _batch_cure(job, saving, notes),
        _precision_cure(job, saving, report, notes),
        None
        if job is not None and job.gradient_checkpointing
        else Fix(
            change="gradient checkpointing (recompute activations in backward; "
            "--gradient-checkpointing)",
            saves_bytes=saving(gradient_checkpointing=True),
            cost="about 33 % more compute per step",
            lever="gradient_checkpointing",
        ),
        _truncation_cure(job, saving, notes),
    ]
    if job is None or _swap_saves(job.optimizer):
        own = "AdamW" if job is None or job.optimizer == "adamw" else job.optimizer
        candidates.append(
            Fix(
                change=f"8-bit AdamW (bitsandbytes) or Adafactor instead of {own} "
                f"(--optimizer {SWAP_OPTIMIZERS[0]} or --optimizer adafactor)",
                saves_bytes=saving(optimizer=SWAP_OPTIMIZERS[0]),
                cost="changes the optimizer: state is quantized (8-bit AdamW) or factored "
                "(Adafactor); usually close in quality",
                lever="optimizer",
            )
        )
    if job is None or not job.lora_rank:
        candidates.append(
            Fix(
                change=f"LoRA adapters (peft, rank {LORA_RANK}) instead of full fine-tuning "
                f"(--lora-rank {LORA_RANK})",
                saves_bytes=saving(lora_rank=LORA_RANK),
                cost="trains adapters, not all weights: quality can differ from full fine-tuning",
                lever="lora",
            )
        )
    cures = [fix for fix in candidates if fix is not None]
    qlora = _qlora_fix(job, saving, cures) if job and _could_quantize(job) else None
    if qlora is not None:
        cures.append(qlora)
    return cures


def _batch_cure(job: Job | None, saving: Callable[..., int | None], notes: list[str]) -> Fix | None:
    """Fewer rows at once with the gradient kept: micro-batch × accumulation, or for an
    in-batch-negatives loss the GradCache mini-batch (memfit plan's first lever)."""
    if job is not None and loss_of(job) in IN_BATCH_NEGATIVE_LOSSES:
        return _mini_batch_cure(job, saving, notes)
    batch = job.micro_batch_size if job else None
    if batch is not None and batch <= 1:
        return None
    if job is None or batch is None:
        return Fix(
            change="halve the micro-batch and double gradient accumulation (effective batch "
            "kept); for an in-batch-negatives loss (MNRL) lower the GradCache mini-batch "
            "instead (--mini-batch-size)",
            saves_bytes=None,
            cost="some throughput (smaller kernels, more steps per update); the recipe is unchanged",
            lever="micro_batch",
        )
    accumulation = job.gradient_accumulation_steps or 1
    return Fix(
        change=f"halve the micro-batch ({batch} → {batch // 2}) and double gradient accumulation "
        f"({accumulation} → {2 * accumulation}; --micro-batch-size {batch // 2}): the effective "
        "batch and the gradient stay the same",
        saves_bytes=saving(batch_size=batch // 2, gradient_accumulation_steps=2 * accumulation),
        cost="some throughput (smaller kernels, more steps per update); the recipe is unchanged",
        lever="micro_batch",
    )


def _mini_batch_cure(job: Job, saving: Callable[..., int | None], notes: list[str]) -> Fix | None:
    """The in-batch-negatives loss's cure, as memfit plan makes it: the whole batch stays one
    step and the cached (GradCache) loss embeds it a mini-batch at a time."""
    loss, batch, mini = loss_of(job), job.micro_batch_size or 1, rows_at_once(job)
    notes.append(
        f"not proposed: a smaller micro-batch with gradient accumulation — {loss} takes each "
        "pair's negatives from the rest of its batch, so a smaller batch means fewer negatives "
        "and a different loss and gradient"
    )
    if mini <= 1:
        notes.append("not proposed: a smaller GradCache mini-batch — it is already 1 row")
        return None
    lower = mini // 2
    cached = CACHED_LOSSES.get(loss, loss)
    return Fix(
        change=f"lower the GradCache mini-batch ({mini} → {lower} rows embedded at a time; "
        f"--loss {cached} --mini-batch-size {lower}): the batch of {batch} stays one step, so "
        "the in-batch negatives, the loss and its gradient stay the same",
        saves_bytes=saving(
            batch_size=batch, gradient_accumulation_steps=1, loss=cached, mini_batch_size=lower
        ),
        cost="one more forward pass per step (GradCache embeds the batch without a graph, then "
        "again a mini-batch at a time with one): about a third more compute",
        lever="mini_batch",
    )


def _precision_cure(
    job: Job | None, saving: Callable[..., int | None], report: OomReport, notes: list[str]
) -> Fix | None:
    """Mixed precision in the dtype the GPU has (bf16, else fp16), as memfit plan picks it; none
    on the CPU, where memfit train runs fp32."""
    if job is not None and (job.precision or "fp32") != "fp32":
        return None
    on_cpu = job.device == "cpu" if job is not None else report.kind in ("cpu", "memfit-cap")
    if on_cpu:
        notes.append(
            "not proposed: mixed precision — memfit train runs fp32 on the CPU (no autocast there)"
        )
        return None
    card = gpu_of(report)
    if card is None:
        return Fix(
            change="mixed precision: bf16 autocast (fp16 with loss scaling on GPUs without "
            "bf16, before Ampere)",
            saves_bytes=saving(precision="bf16"),
            cost="none on Ampere or newer (usually faster); fp16 needs a GradScaler",
            lever="precision",
        )
    mixed = card.mixed_precision()
    if mixed == "bf16":
        change = f"mixed precision: bf16 autocast (--precision bf16; the {card.name} has bf16)"
        cost = "none measurable on this GPU (usually faster)"
    else:
        change = (
            f"mixed precision: fp16 autocast with loss scaling (--precision fp16; the "
            f"{card.name} has no bf16)"
        )
        cost = "a GradScaler (memfit train adds one); fp16's narrow range can overflow"
    return Fix(change=change, saves_bytes=saving(precision=mixed), cost=cost, lever="precision")


def _truncation_cure(
    job: Job | None, saving: Callable[..., int | None], notes: list[str]
) -> Fix | None:
    """Truncation to half the run's widest micro-batch (memfit plan's shortest try without a data
    profile), only where the data has rows longer than that, priced as the plan prices it."""
    cost = (
        "tokens past the limit are cut: check the data's lengths first "
        "(memfit plan --train-file reports the share cut)"
    )
    if job is None or job.seq_len is None:
        return Fix(change="truncate sequences", saves_bytes=None, cost=cost, lever="truncation")
    seq, longest = job.seq_len, getattr(job, "longest_tokens", None)
    # as memfit plan rounds its tries: up to a multiple of 8, at least 8, shorter than seq_len
    shorter = max(SEQ_LEN_MULTIPLE, round_seq_len(seq // 2))
    if shorter >= seq:
        return None
    if longest is not None and longest <= shorter:
        notes.append(
            f"not proposed: truncation to {shorter} tokens — the data's longest row has "
            f"{longest} tokens, nothing would be cut"
        )
        return None
    change = f"truncate sequences ({seq} → {shorter} tokens, --max-seq-len {shorter})"
    if longest is not None:
        change += f": rows longer than {shorter} tokens lose their end (the longest has {longest})"
        cost = "the cut tokens are not learnt from; memfit plan --train-file reports the share cut"
    return Fix(
        change=change, saves_bytes=saving(max_seq_len=shorter), cost=cost, lever="truncation"
    )


def gpu_of(report: OomReport) -> Gpu | None:
    """The catalog GPU whose memory, as CUDA reports it, is the message's capacity (printed with
    two decimals); None when none is, or when several are."""
    capacity = report.capacity_bytes
    if capacity is None or report.kind not in ("cuda-new", "cuda-old"):
        return None
    # the message rounds to a hundredth of its unit: within half of it (GiB for these sizes)
    close = [g for g in catalog().values() if abs(g.memory_bytes - capacity) <= (1 << 30) // 200]
    # several cards of one size (a 3060 12GB, a 3080 12GB, a 4070): none named
    return close[0] if len(close) == 1 else None


def _could_quantize(job: Job) -> bool:
    """A decoder on a GPU with plain base weights: memfit plan's quantization lever (QLoRA) fits
    it. The estimate decides whether it is big enough to gain (a small model's upcast
    embeddings can outweigh the 4-bit weights)."""
    return (
        job.task == "causal-lm"
        and job.quantization in (None, "none")
        and (job.device or "cuda") == "cuda"
    )


def _qlora_fix(job: Job, saving: Callable[..., int | None], cures: list[Fix]) -> Fix | None:
    """QLoRA as memfit plan's quantization lever makes it: the job's LoRA rank (else rank 8)
    on NF4 base weights with double quantization. For a full fine-tuning job it must save more
    than the LoRA fix alone (None: it does not)."""
    quantization, double_quant = QLORA
    rank = job.lora_rank or LORA_RANK
    saves = saving(lora_rank=rank, quantization=quantization, double_quant=double_quant)
    flags = f"--quantization {quantization}" + (" --double-quant" if double_quant else "")
    if job.lora_rank:
        change = (
            f"QLoRA: the frozen base weights in {quantization} with double quantization under "
            f"the rank-{rank} adapters ({flags}; memfit plan --lora-rank {rank} --allow "
            "quantization plans it)"
        )
    else:
        change = (
            f"QLoRA: LoRA adapters (rank {rank}) on {quantization} base weights with double "
            f"quantization (--lora-rank {rank} {flags}; memfit plan --allow lora,quantization "
            "plans it)"
        )
        lora = next((f.saves_bytes for f in cures if f.lever == "lora"), None)
        if saves is not None and lora is not None and saves <= lora:
            return None  # more harm than LoRA for no more memory
    return Fix(
        change=change,
        saves_bytes=saves,
        cost="slower steps: every forward and backward dequantizes the base weights (memfit "
        "plan prices it); QLoRA (Dettmers et al. 2023) matched 16-bit LoRA on its benchmarks, "
        "a small quality risk remains; needs bitsandbytes and a CUDA GPU",
        lever="quantization",
    )


def _swap_saves(optimizer: str) -> bool:
    """A memory-saving optimizer would hold less state than ``optimizer`` (AdamW's)."""
    own = OPTIMIZER_TABLE.get(optimizer)
    swap = OPTIMIZER_TABLE[SWAP_OPTIMIZERS[0]]
    return own is not None and own.bytes_per_parameter > swap.bytes_per_parameter
