"""The plan's words: why the chosen configuration, what each lever costs, and what would help
when nothing fits (a bigger GPU, more GPUs and a sharding scheme, a lever not yet allowed).

The search (:mod:`memfit.plan.planner`) decides; this module only says. The numbers it quotes
come from the search's estimates (:meth:`~memfit.plan.planner.Search.peak`) and its cost model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from memfit.devices.catalog import catalog
from memfit.estimate.sharding import SCHEME_ORDER
from memfit.plan import cost
from memfit.plan.data_profile import DataProfile
from memfit.plan.planner import (
    LEVERS,
    LORA_RANK,
    QLORA,
    Candidate,
    Levers,
    Plan,
    Search,
    Space,
)
from memfit.units import format_bytes

SCHEME_WORDS = {
    "fsdp": "PyTorch FSDP shards parameters, gradients and optimizer state, and gathers each "
    "block's parameters again in backward; memfit train runs it",
    "zero1": "DeepSpeed ZeRO-1 shards the optimizer state; memfit train runs it through "
    "DeepSpeed (pip install 'memfit[deepspeed]')",
    "zero2": "DeepSpeed ZeRO-2 shards optimizer state and gradients; memfit train runs it "
    "through DeepSpeed (pip install 'memfit[deepspeed]')",
    "zero3": "DeepSpeed ZeRO-3 shards parameters, gradients and optimizer state; memfit train "
    "runs it through DeepSpeed (pip install 'memfit[deepspeed]')",
}


def _gib(n: float) -> str:
    return format_bytes(int(n))


def _rate(samples_per_second: float) -> str:
    """A throughput: one decimal, or two significant digits below one sample per second."""
    if samples_per_second >= 1:
        return f"{samples_per_second:.1f}"
    return f"{samples_per_second:.2g}"


def explain(job: Search, result: Plan, profile: DataProfile | None) -> list[str]:
    """Why the chosen configuration, lever by lever, with the re-check command; or how far the
    least configuration is over the budget."""
    c = result.chosen
    if c is None:
        return [
            f"Nothing fits in {_gib(job.usable)} ({result.budget_words()} less the safety "
            f"margin): the least any allowed configuration needs is "
            f"{_gib(result.min_required_bytes)}."
        ]
    k = c.knobs
    lines = _batch_lines(job, result, c)
    lines += _parallel_lines(job, c)
    lines += _precision_lines(job, result, c)
    lines += _harmful_lever_lines(job, k, profile)
    lines += _quantization_lines(job, result, c)
    lines.append(
        f"Predicted throughput {_rate(c.predicted_samples_per_second)} samples/s "
        f"(cost model: 6·params·tokens FLOPs plus recompute"
        + (", plus dequantizing the base weights on every pass" if k.quantization != "none" else "")
        + (", plus paging the optimizer state" if cost.is_paged(k.optimizer) else "")
        + f", on the {job.gpu.name}'s "
        f"{job.gpu.flops_per_second(k.precision) / 1e12:.0f} TFLOP/s {k.precision} peak)."
    )
    command = result.estimate_command()
    if command:
        lines.append(f"Re-check: {command}")
    train = result.train_command()
    if train:
        lines.append(f"Train: {train}")
    return lines


def _batch_lines(job: Search, result: Plan, c: Candidate) -> list[str]:
    """How the effective batch is split, and why the next larger micro-batch was not taken."""
    lines: list[str] = []
    if job.in_batch_negatives:
        if c.mini_batch_size:
            lines.append(
                f"{c.loss} with mini-batch {c.mini_batch_size}: the whole batch of {c.micro_batch_size} "
                f"per GPU is one step, embedded {c.mini_batch_size} rows at a time: "
                f"{_gib(c.predicted_peak_bytes)} of {result.budget_words()}."
            )
            lines.append(
                f"{job.loss} compares every sample with the rest of its batch, so gradient "
                "accumulation would shrink the batch each comparison sees and change the objective; "
                "the cached (GradCache) loss keeps the full batch at one mini-batch's memory, for "
                "one more forward pass."
            )
        else:
            lines.append(
                f"The whole batch of {c.micro_batch_size} per GPU fits at once: "
                f"{_gib(c.predicted_peak_bytes)} of {result.budget_words()}."
            )
    else:
        lines.append(
            f"micro-batch {c.micro_batch_size} × accumulate {c.gradient_accumulation_steps}"
            + (f" × {c.world_size} GPUs" if c.world_size > 1 else "")
            + f" = {job.per_rank * job.world_size}: {_gib(c.predicted_peak_bytes)} of "
            f"{result.budget_words()} ({_gib(job.usable)} after the {result.safety_margin:.0%} margin)."
        )
    return lines


def _parallel_lines(job: Search, c: Candidate) -> list[str]:
    """What each GPU holds under the sharding scheme or plain data parallelism."""
    k = c.knobs
    micro = c.mini_batch_size or c.micro_batch_size
    lines: list[str] = []
    if job.sharding != "none":
        lines.append(
            f"--sharding {job.sharding} over {job.world_size} GPU"
            + ("s" if job.world_size > 1 else "")
            + f": each holds {_gib(job.model_state(k, micro))} of parameters, gradients and "
            "optimizer state (with the scheme's own buffers); "
            + (
                SCHEME_WORDS[job.sharding]
                if job.world_size > 1
                else "on one GPU it divides nothing and only adds its buffers"
            )
            + ". The throughput counts compute only."
        )
    elif job.world_size > 1:
        lines.append(
            f"Data parallelism over {job.world_size} GPUs: each holds the whole model, its "
            f"gradients and optimizer state ({_gib(job.model_state(k, micro))}); gradients are "
            "all-reduced in place after the step's micro-batches."
        )
    larger = [m for m in job.micro_batches() if m > micro]
    if larger and not (job.in_batch_negatives and not c.mini_batch_size):
        nxt = larger[0]
        peak = job.peak(k, nxt)
        lines.append(
            f"The next larger {'mini' if job.in_batch_negatives else 'micro'}-batch, {nxt}, "
            f"would need {_gib(peak)}: over the budget."
        )
    return lines


def _precision_lines(job: Search, result: Plan, c: Candidate) -> list[str]:
    """What mixed precision buys and what checkpointing costs (or would cost)."""
    k = c.knobs
    micro = c.mini_batch_size or c.micro_batch_size
    lines: list[str] = []
    base = job.speed(k, micro)
    mixed = job.gpu.mixed_precision()
    if k.precision == "fp32" and result.pinned_precision is None:
        # the plan tries the GPU's mixed precision first: say why it is not the one
        need = job.peak(dataclasses.replace(k, precision=mixed), micro)
        if need > job.usable:
            faster = job.speed(dataclasses.replace(k, precision=mixed), micro) / base
            lines.append(
                f"fp32, not {mixed} mixed precision: {mixed} would need {_gib(need)} at this "
                f"{'mini' if c.mini_batch_size else 'micro'}-batch, over the budget (autocast "
                f"keeps {mixed} copies beside fp32 tensors); it would be about {faster:.1f}× "
                "faster."
            )
    if k.precision != "fp32":
        fp32 = job.speed(dataclasses.replace(k, precision="fp32"), micro)
        lines.append(
            f"{k.precision} mixed precision (fp32 master weights"
            + (", loss scaling" if k.precision == "fp16" else "")
            + f"): about {base / fp32:.1f}× the throughput of fp32 on the {job.gpu.name}."
        )
    if k.gradient_checkpointing:
        no_ckpt = [
            e
            for e in result.alternatives
            if e.knobs == dataclasses.replace(k, gradient_checkpointing=False)
        ]
        if no_ckpt:
            alt = no_ckpt[0]
            lines.append(
                f"Gradient checkpointing is on: it lets micro-batch {micro} fit and "
                f"recomputes the forward (about a third more compute), which still beats micro-batch "
                f"{alt.mini_batch_size or alt.micro_batch_size} without it "
                f"({c.predicted_samples_per_second:.1f} vs {alt.predicted_samples_per_second:.1f} samples/s)."
            )
        else:
            lines.append(
                "Gradient checkpointing is on: without it not even the smallest micro-batch fits."
            )
    else:
        with_ckpt = job.speed(dataclasses.replace(k, gradient_checkpointing=True), micro)
        lines.append(
            f"Checkpointing not needed; at this micro-batch it would cost "
            f"{(1 - with_ckpt / base) * 100:.0f} % throughput."
        )
    return lines


def _harmful_lever_lines(job: Search, k: Levers, profile: DataProfile | None) -> list[str]:
    """The allowed levers the plan used, and what each changes in what is learned."""
    lines: list[str] = []
    if k.paged_swap(job.base_optimizer):
        lines.append(_paged_line(job, k))
    elif k.optimizer != job.base_optimizer:
        lines.append(
            f"Optimizer {k.optimizer} instead of {job.base_optimizer} (allowed): its state is smaller; "
            "updates differ slightly from full-precision AdamW."
        )
    if k.max_seq_len < job.seq_len:
        if profile is not None:
            lost = profile.tokens_lost(k.max_seq_len, job.seq_len)
            share = profile.samples_truncated(k.max_seq_len)
            lines.append(
                f"Truncation to {k.max_seq_len} tokens (allowed) cuts {lost:.1%} of the training "
                f"tokens and shortens {share:.1%} of the samples (from {profile.source})."
            )
        else:
            lines.append(
                f"Truncation to {k.max_seq_len} tokens (allowed): give --train-file to learn how "
                "many tokens it cuts."
            )
    if k.lora_rank:
        lines.append(
            f"LoRA rank {k.lora_rank} ({'as given' if k.lora_rank == job.base_rank else 'allowed'}):"
            " only the adapters"
            + (" and the head" if job.task == "classification" else "")
            + " train; the base model stays frozen."
        )
    return lines


def _paged_line(job: Search, k: Levers) -> str:
    """What a paged optimizer saves and what its paging may cost per optimizer step."""
    twin, state_bytes = cost.PAGED_OPTIMIZERS[k.optimizer]
    state = job.shape.trainable(k.lora_rank) * state_bytes
    paging = cost.optimizer_seconds(job.shape, job.gpu, k.optimizer, k.lora_rank)
    paging -= cost.optimizer_seconds(job.shape, job.gpu, twin, k.lora_rank)
    return (
        f"Optimizer {k.optimizer} instead of {job.base_optimizer} (allowed): bitsandbytes keeps "
        f"its state ({_gib(state)}) in CUDA unified memory, outside PyTorch's allocator; the "
        "driver evicts it to host memory while forward and backward need the GPU and pages it "
        "back for the update. Chosen only because no configuration of this tier fits without a "
        f"paged optimizer: paging costs up to {paging:.2f} s per optimizer step over the host link "
        f"(counted in the throughput; nothing when the state stays resident). Updates are "
        + ("8-bit AdamW's" if twin != "adamw" else "AdamW's")
        + "."
    )


def _quantization_lines(job: Search, result: Plan, c: Candidate) -> list[str]:
    """Quantized base weights (QLoRA): what they save, what they cost per step, what QLoRA
    found about quality, and why the plan needed them."""
    k = c.knobs
    if k.quantization == "none":
        return []
    micro = c.mini_batch_size or c.micro_batch_size
    plain = dataclasses.replace(k, quantization="none", double_quant=False)
    how = "as given" if k.quantization == job.base_quantization else "allowed"
    name = k.quantization + (" with double quantization" if k.double_quant else "")
    slower = job.speed(plain, micro) / job.speed(k, micro) - 1
    step = job.per_rank * job.world_size / job.speed(k, micro)
    per_pass = cost.dequantization_seconds(job.shape, job.gpu, k.quantization, k.double_quant)
    lines = [
        f"Quantized base weights, {name} ({how}; QLoRA): bitsandbytes holds the "
        f"{job.shape.quantizable_parameters / 1e9:.2f} B frozen matmul weights in "
        + ("4" if k.quantization != "int8" else "8")
        + f" bits, the LoRA adapters train on top: {_gib(c.predicted_peak_bytes)} at micro-batch "
        f"{micro}, where unquantized weights would need {_gib(job.peak(plain, micro))}.",
        f"Time: every forward and backward (and recomputed forward) dequantizes those weights, "
        f"{per_pass * 1e3:.0f} ms per pass on the {job.gpu.name}: about {slower:.0%} more time "
        f"per step ({step:.1f} s per optimizer step; cost model: "
        f"{cost.DEQUANT_BYTES_PER_PARAMETER:g}"
        + (f" + {cost.DOUBLE_QUANT_BYTES_PER_PARAMETER:g}" if k.double_quant else "")
        + " bytes per weight per pass at the GPU's memory bandwidth, fitted to LitGPT's LoRA "
        "vs bnb.nf4-dq timings on an A100).",
        "Quality: the QLoRA paper (Dettmers et al. 2023, arXiv:2305.14314) found LoRA on NF4 "
        "weights with double quantization matches 16-bit LoRA and 16-bit full fine-tuning on "
        "GLUE, Super-NaturalInstructions and MMLU; a small risk remains for other models and "
        "tasks (compare on your eval set). Needs bitsandbytes (pip install 'memfit[quantization]')"
        " and a CUDA GPU; embeddings and the output head stay unquantized.",
    ]
    if how == "allowed":
        unquantized = [
            peak for f, peak in job.least.items() if f.quantization == job.base_quantization
        ]
        lines.append(
            "Quantization is the last lever tried: nothing allowed fits without it (the least "
            f"configuration on unquantized weights needs {_gib(min(unquantized))} of "
            f"{_gib(job.usable)})."
        )
    return lines


def suggest(job: Search, result: Plan, space: Space) -> list[str]:
    """What would make the job fit (nothing does): a bigger GPU, more GPUs with each sharding
    scheme, and each lever not allowed yet, with the least configuration's memory under each."""
    allowed = result.allow
    optimizers, lengths, ranks = space.optimizers, space.lengths, space.ranks
    out: list[str] = []
    need = result.min_required_bytes
    margin = result.safety_margin
    bigger = [
        g
        for g in catalog().values()
        if g.memory_bytes * (1 - margin) >= need and g.memory_bytes > result.budget_bytes
    ]
    if bigger:
        g = bigger[0]
        out.append(
            f"A GPU with more memory: the {g.name} ({format_bytes(g.memory_bytes)}, --gpu {g.id}) "
            f"holds the least configuration, {format_bytes(need)}."
        )
    else:
        out.append(f"No GPU in the catalog holds {format_bytes(need)} on its own.")
    out.extend(_scale_out_lines(job, result))
    if job.in_batch_negatives:
        out.append(
            "More GPUs (--world-size) split the batch, but each GPU then sees fewer in-batch "
            "negatives unless embeddings are gathered across GPUs."
        )

    weights = (job.base_quantization, bool(result.double_quant))

    def least(
        optimizer_names: Sequence[str],
        length: int,
        rank: int,
        quantized: tuple[str, bool] = weights,
        precisions: Sequence[str] = (job.frugal_precision,),
    ) -> str:
        # at the precision that needed least without the lever (one trace per lever, not two),
        # unless told to try each
        need = min(
            job.peak(Levers(p, True, o, length, rank, *quantized), 1)
            for o in optimizer_names
            for p in precisions
        )
        verdict = "fits" if need <= job.usable else "still over"
        return f"{format_bytes(need)} ({verdict})"

    if "optimizer" not in allowed:
        out.append(
            "--allow optimizer (Adafactor or 8-bit AdamW): the least configuration would need "
            + least(["adafactor"], min(lengths), max(ranks))
            + "."
        )
    if "lora" not in allowed and not job.base_rank:
        out.append(
            f"--allow lora (rank {LORA_RANK} adapters, base frozen): the least configuration "
            "would need " + least(optimizers, min(lengths), LORA_RANK) + "."
        )
    if "truncation" not in allowed:
        short = max(8, job.seq_len // 2 // 8 * 8)
        if short < job.seq_len:
            out.append(
                f"--allow truncation (e.g. to {short} tokens): the least configuration would "
                "need " + least(optimizers, short, max(ranks)) + "."
            )
    if "quantization" not in allowed and job.base_quantization == "none":
        # quantization needs LoRA: the suggestion allows both (a LoRA rank of the job's own stays)
        levers = set(allowed) | {"quantization"} | (set() if job.base_rank else {"lora"})
        flag = ",".join(sorted(levers, key=LEVERS.index))
        rank = job.base_rank or LORA_RANK
        out.append(
            f"--allow {flag} (QLoRA: rank {rank} adapters on {QLORA[0]} base weights with double "
            "quantization; each pass dequantizes them, slower steps): the least configuration "
            "would need " + least(optimizers, min(lengths), rank, QLORA, space.precisions) + "."
            # each precision: mixed precision's copies can outweigh 4-bit weights' saving
        )
    return out


def _scale_out_lines(job: Search, result: Plan) -> list[str]:
    """Scale-out suggestions with their numbers: per world size, each scheme's least memory."""
    rows = result.scale_out
    if not rows:
        return [
            "More GPUs: the effective batch does not split evenly over 2, 4 or 8 times the "
            "GPUs; choose an effective batch size they divide to price scaling out."
        ]
    lines = []
    for world in sorted({r["world_size"] for r in rows}):
        parts = [
            f"{r['sharding']} {format_bytes(r['predicted_peak_bytes'])}"
            + (" (fits)" if r["fits"] else "")
            for r in rows
            if r["world_size"] == world
        ]
        lines.append(
            f"On {world} GPUs the least configuration needs per GPU: " + ", ".join(parts) + "."
        )
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        best = min(fitting, key=lambda r: (r["world_size"], SCHEME_ORDER[r["sharding"]]))
        lines.append(
            f"Fewest GPUs that fit: {best['world_size']} with --sharding {best['sharding']} "
            f"({format_bytes(best['predicted_peak_bytes'])} per GPU; "
            + (
                "plain data parallelism, a smaller batch per GPU"
                if best["sharding"] == "none"
                else SCHEME_WORDS[best["sharding"]]
            )
            + f"): {result.plan_command(best['world_size'], best['sharding'])}"
        )
    else:
        largest = max(r["world_size"] for r in rows)
        lines.append(f"Not even {largest} GPUs with any sharding hold the least configuration.")
    return lines
