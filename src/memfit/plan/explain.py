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
from memfit.plan.data_profile import DataProfile
from memfit.plan.planner import LORA_RANK, Candidate, Levers, Plan, Search, Space, _divisors
from memfit.units import format_bytes

SCHEME_WORDS = {
    "fsdp": "PyTorch FSDP shards parameters, gradients and optimizer state, and gathers each "
    "block's parameters again in backward; memfit train runs it",
    "zero1": "DeepSpeed ZeRO-1 shards the optimizer state; it needs DeepSpeed, which memfit "
    "train does not run yet",
    "zero2": "DeepSpeed ZeRO-2 shards optimizer state and gradients; it needs DeepSpeed, which "
    "memfit train does not run yet",
    "zero3": "DeepSpeed ZeRO-3 shards parameters, gradients and optimizer state; it needs "
    "DeepSpeed, which memfit train does not run yet",
}


def _gib(n: float) -> str:
    return format_bytes(int(n))


def explain(job: Search, result: Plan, profile: DataProfile | None) -> list[str]:
    """Why the chosen configuration, lever by lever, with the re-check command; or how far the
    least configuration is over the budget."""
    c = result.chosen
    if c is None:
        return [
            f"Nothing fits in {_gib(job.usable)} ({_gib(result.budget_bytes)} less the safety "
            f"margin): the least any allowed configuration needs is "
            f"{_gib(result.min_required_bytes)}."
        ]
    k = c.knobs
    lines = _batch_lines(job, result, c)
    lines += _parallel_lines(job, c)
    lines += _precision_lines(job, result, c)
    lines += _harmful_lever_lines(job, k, profile)
    lines.append(
        f"Predicted throughput {c.predicted_samples_per_second:.1f} samples/s "
        f"(cost model: 6·params·tokens FLOPs plus recompute, on the {job.gpu.name}'s "
        f"{job.gpu.flops_per_second(k.precision) / 1e12:.0f} TFLOP/s {k.precision} peak)."
    )
    command = result.estimate_command()
    if command:
        lines.append(f"Re-check: {command}")
    return lines


def _batch_lines(job: Search, result: Plan, c: Candidate) -> list[str]:
    """How the effective batch is split, and why the next larger micro-batch was not taken."""
    lines: list[str] = []
    if job.in_batch_negatives:
        if c.mini_batch_size:
            lines.append(
                f"{c.loss} with mini-batch {c.mini_batch_size}: the whole batch of {c.micro_batch_size} "
                f"per GPU is one step, embedded {c.mini_batch_size} rows at a time: "
                f"{_gib(c.predicted_peak_bytes)} of {_gib(result.budget_bytes)}."
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
                f"{_gib(c.predicted_peak_bytes)} of {_gib(result.budget_bytes)}."
            )
    else:
        lines.append(
            f"micro-batch {c.micro_batch_size} × accumulate {c.gradient_accumulation_steps}"
            + (f" × {c.world_size} GPUs" if c.world_size > 1 else "")
            + f" = {job.per_rank * job.world_size}: {_gib(c.predicted_peak_bytes)} of "
            f"{_gib(result.budget_bytes)} ({_gib(job.usable)} after the {result.safety_margin:.0%} margin)."
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
    larger = [m for m in _divisors(job.per_rank) if m > micro]
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
    if k.optimizer != job.base_optimizer:
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
            f"LoRA rank {k.lora_rank} (allowed): only the adapters"
            + (" and the head" if job.task == "classification" else "")
            + " train; the base model stays frozen."
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

    def least(optimizer_names: Sequence[str], length: int, rank: int) -> str:
        # at the precision that needed least without the lever (one trace per lever, not two)
        need = min(
            job.peak(Levers(job.frugal_precision, True, o, length, rank), 1)
            for o in optimizer_names
        )
        verdict = "fits" if need <= job.usable else "still over"
        return f"{format_bytes(need)} ({verdict})"

    if "optimizer" not in allowed:
        out.append(
            "--allow optimizer (Adafactor or 8-bit AdamW): the least configuration would need "
            + least(["adafactor"], min(lengths), max(ranks))
            + "."
        )
    if "lora" not in allowed:
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
