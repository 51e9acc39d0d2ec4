"""The plan's words: why the chosen configuration, what each lever costs, and what would help
when nothing fits (a bigger GPU, more GPUs and a sharding scheme, a lever not yet allowed).

The search (:mod:`memfit.plan.planner`) decides; this module only says. The numbers it quotes
come from the search's estimates (:meth:`~memfit.plan.search.Search.peak`) and its cost model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memfit.devices.catalog import catalog
from memfit.estimate.sharding import SCHEME_ORDER
from memfit.levers import ALLOWABLE, LEVERS, weights
from memfit.levers.base import Chosen
from memfit.levers.cross_entropy import TRL_CHUNKED
from memfit.plan import cost
from memfit.plan.configuration import Candidate, Levers, Plan
from memfit.plan.data_profile import DataProfile
from memfit.plan.search import Search, Space
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


def _percent(share: float) -> str:
    """A share as the plan says it: ``5 %``, ``2.5 %``."""
    return f"{share * 100:.4g} %"


def usable_bytes(result: Plan) -> int:
    """The budget less the safety margin: what every configuration is checked against (the
    planner's ``Search.usable``, the same sum)."""
    return int(result.budget_bytes * (1 - result.safety_margin))


def budget_with_margin(result: Plan) -> str:
    """The budget the plan fits into, margin named: ``a T4's 14.56 GiB less the 5 % safety
    margin, 13.83 GiB``; ``a T4's 14.56 GiB`` with ``--safety-margin 0``."""
    if not result.safety_margin:
        return result.budget_words()
    return (
        f"{result.budget_words()} less the {_percent(result.safety_margin)} safety margin, "
        f"{_gib(usable_bytes(result))}"
    )


def over_budget(result: Plan, need: int, *, nested: bool = False) -> str:
    """Which budget ``need`` is over, and whether ``--safety-margin 0`` would take it in: ``over
    the 13.83 GiB budget (a T4's 14.56 GiB less the 5 % safety margin; --safety-margin 0 to use
    it all)`` (``nested``: inside parentheses already, a comma for the inner ones). memfit
    estimate's verdict on the same step is against the whole budget: this says why the plan
    does not take a step the estimate says fits."""
    words, margin = result.budget_words(), result.safety_margin
    if not margin:
        return f"over the budget, {words}"
    usable = usable_bytes(result)
    why = f"{words} less the {_percent(margin)} safety margin; " + (
        "--safety-margin 0 to use it all"
        if need <= result.budget_bytes
        else f"over the whole {_gib(result.budget_bytes)} too"
    )
    return f"over the {_gib(usable)} budget" + (f", {why}" if nested else f" ({why})")


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
        need = result.min_required_bytes
        line = (
            f"Nothing fits in {_gib(job.usable)} ({result.budget_words()} less the "
            f"{_percent(result.safety_margin)} safety margin): the least any allowed "
            f"configuration needs is {_gib(need)}"
        )
        if not result.safety_margin:
            line = (
                f"Nothing fits in {result.budget_words()}: the least any allowed configuration "
                f"needs is {_gib(need)}"
            )
        elif need <= result.budget_bytes:
            # within the whole budget: only the margin keeps it out
            line += (
                f", within the whole {_gib(result.budget_bytes)}: --safety-margin 0 lets a plan "
                "use it all"
            )
        return [line + "."]
    k = c.knobs
    lines = _batch_lines(job, result, c)
    lines += _parallel_lines(job, result, c)
    lines += _precision_lines(job, result, c)
    lines += _harmful_lever_lines(job, k, profile)
    chosen = _chosen(job, c)
    for lever in LEVERS:
        lines += lever.plan_lines(chosen)
    lines += _host_lines(job, result)
    lines.append(
        f"Predicted throughput {_rate(c.predicted_samples_per_second)} samples/s "
        f"(cost model: 6·params·tokens FLOPs plus recompute"
        + "".join(f", plus {words}" for lever in LEVERS if (words := lever.time_words(k.values)))
        + (", plus paging the optimizer state" if cost.is_paged(k.optimizer) else "")
        + f", on the {job.gpu.name}'s "
        f"{job.gpu.flops_per_second(k.precision) / 1e12:.0f} TFLOP/s {k.precision} peak)."
    )
    command = result.estimate_command()
    if command:
        lines.append(f"Re-check: {command}")
    train = result.train_command()
    # TRL's chunked head is SFTTrainer's loss: memfit train refuses it (the lever's plan line
    # says to run SFTTrainer), so no memfit train command is printed for it
    if train and k.values.get("cross_entropy") != TRL_CHUNKED:
        lines.append(f"Train: {train}")
    return lines


def _host_lines(job: Search, result: Plan) -> list[str]:
    """What the chosen configuration keeps in host memory, against the host budget."""
    host = result.predicted_host_bytes
    if host is None or job.host_budget is None:
        return []
    c = result.chosen
    ranks = 1 if c is None else job.host_ranks(c.knobs, c.mini_batch_size or c.micro_batch_size)
    held = _gib(host)
    if job.world_size > 1:
        held += " per rank" + (
            f" ({_gib(host * ranks)} for the node's {ranks} ranks)" if ranks > 1 else ""
        )
    return [
        f"Host memory: {held} of the {_gib(job.host_budget)} host budget (--host-memory; "
        "default this machine's memory) for what is offloaded there, pinned; the host's own "
        "needs (the data loader, the Python process) come on top."
    ]


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
            f"{result.budget_words()}"
            + (
                f" ({_gib(job.usable)} after the {_percent(result.safety_margin)} safety margin, "
                "--safety-margin)."
                if result.safety_margin
                else " (no safety margin kept)."
            )
        )
    return lines


def _parallel_lines(job: Search, result: Plan, c: Candidate) -> list[str]:
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
            f"would need {_gib(peak)}: {over_budget(result, peak)}."
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
                f"{'mini' if c.mini_batch_size else 'micro'}-batch (autocast keeps {mixed} "
                f"copies beside fp32 tensors), {over_budget(result, need)}; it would be about "
                f"{faster:.1f}× faster."
            )
    if k.precision != "fp32":
        fp32 = job.speed(dataclasses.replace(k, precision="fp32"), micro)
        # pure 16-bit training (the weights lever) keeps no fp32 master copy
        dtype = k.values.get("weights_dtype")
        masters = f"{dtype} weights" if weights.pure(k.values) else "fp32 master weights"
        lines.append(
            f"{k.precision} mixed precision ({masters}"
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


def _chosen(job: Search, c: Candidate) -> Chosen:
    """The chosen configuration as the levers' own explanations see it
    (:meth:`~memfit.levers.base.Lever.plan_lines`), priced by this search."""
    micro = c.mini_batch_size or c.micro_batch_size
    return Chosen(
        values=c.knobs.values,
        base=job.space.base,
        micro=micro,
        peak_bytes=c.predicted_peak_bytes,
        usable=job.usable,
        samples_per_step=job.per_rank * job.world_size,
        shape=job.shape,
        gpu=job.gpu,
        peak=lambda values: job.peak(Levers.of(values), micro),
        speed=lambda values: job.speed(Levers.of(values), micro),
        least=[(k.values, peak) for k, peak in job.least.items()],
    )


def suggest(job: Search, result: Plan, space: Space) -> list[str]:
    """What would make the job fit (nothing does): a bigger GPU, more GPUs with each sharding
    scheme, and each lever not allowed yet, with the least configuration's memory under each."""
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
    out.extend(_lever_hints(job, result, space))
    return out


def _lever_hints(job: Search, result: Plan, space: Space) -> list[str]:
    """For each lever not allowed yet (that a plan would vary if allowed), the least
    configuration with it allowed too (and the levers it needs), priced with everything
    already allowed or pinned, on the ranks and sharding asked: what ``--allow`` would give."""
    out: list[str] = []
    for lever in LEVERS:
        if not lever.allow or lever.name in result.allow:
            continue
        wider = space.allowing(lever.name, *lever.allow_with(space.room.job))
        if wider.of_lever(lever) == space.of_lever(lever):
            continue  # the job pins it, or it has nothing to try here
        least = job.least_of(job.frugal(wider))
        if least is None:
            continue  # memfit train runs none of its configurations here
        need, knobs = least
        verdict = (
            "fits" if need <= job.usable else f"still {over_budget(result, need, nested=True)}"
        )
        flag = ",".join(sorted(wider.room.allowed, key=ALLOWABLE.index))
        hint = lever.hint(knobs.values, space.room.job)
        out.append(
            f"--allow {flag} ({hint}): the least configuration would need "
            f"{format_bytes(need)} ({verdict})."
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
        here = [r for r in rows if r["world_size"] == world]
        # memfit train runs adapters with plain data parallelism only: where the schemes' least
        # configurations differ in form, each says which it is
        mixed = len({(r.get("lora_rank"), r.get("quantization")) for r in here}) > 1
        parts = [
            f"{r['sharding']} {format_bytes(r['predicted_peak_bytes'])}"
            + (f" {_form(r)}" if mixed else "")
            + (" (fits)" if r["fits"] else "")
            for r in here
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


def _form(row: dict[str, Any]) -> str:
    """A scale-out row's configuration in a few words: full fine-tuning, LoRA or QLoRA."""
    if not row.get("lora_rank"):
        return "full fine-tuning"
    quantization = row.get("quantization")
    return "LoRA" if quantization in (None, "none") else f"QLoRA {quantization}"
