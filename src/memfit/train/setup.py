"""What a run sets up before its first step: the recipe and both files' rows (every problem at
once), the plan of the knobs left open, the model, the run folder, the optimizer, the logs and the
guard (:class:`RunSetup`, the first phases of :class:`memfit.train.loop.TrainingRun`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

import memfit
from memfit.data.rows import Row, RowTable, all_lengths, write_skipped
from memfit.errors import NothingFitsError, UsageError
from memfit.guard import Guard
from memfit.job import round_seq_len
from memfit.levers.quantization import LEVER as QUANTIZATION
from memfit.plan import plan
from memfit.runtime import JsonlLog, NoLog, autocast, launched_world_size, resolve_device
from memfit.step import fused_linear_problem, linear_ce, offload, weights
from memfit.train import checkpoint as ck
from memfit.train import runfolder
from memfit.train.config import TrainConfig, config_problems
from memfit.train.console import describe, say
from memfit.train.distributed import init_ranks
from memfit.train.fsdp import shard_model
from memfit.train.loggers import open_reporters
from memfit.train.lora import add_lora
from memfit.train.optim import make_optimizer, make_scheduler
from memfit.train.quantization import prepare as prepare_quantized
from memfit.train.quantization import quantized, quantized_loading
from memfit.train.recipes import RECIPES, recipe_for
from memfit.train.recipes.loading import checkpoint_config, loaded_in
from memfit.train.resume import step_settings
from memfit.train.zero import build_config, optimizer_offload_of, stage_of, start_engine


def checked_inputs(cfg: TrainConfig) -> tuple[Any, Sequence[Row], Sequence[Row] | None]:
    """The recipe and the training and eval rows; every problem with the flags and every bad row
    of both files at once (a UsageError), before anything is loaded or written."""
    problems = config_problems(cfg)
    if cfg.activation_offloading:
        # on CUDA TRL's context or nothing (what the estimate prices): refused before loading
        problem = offload.missing(resolve_device(cfg.device).type)
        if problem is not None:
            problems.append(problem)
    recipe: Any = None
    try:
        # an unknown --task is the job's problem, said once
        recipe = recipe_for(cfg) if cfg.task in RECIPES else None
    except UsageError as exc:
        problems.extend(x for x in str(exc).splitlines() if x not in problems)
    train_rows: Sequence[Row] | None = None
    eval_rows: Sequence[Row] | None = None
    if recipe is not None:
        train_rows, eval_rows, data_problems = _read_data(recipe, cfg)
        problems.extend(x for x in data_problems if x not in problems)
    if problems:
        raise UsageError("\n".join(problems))
    assert train_rows is not None
    return recipe, train_rows, eval_rows


def _read_data(
    recipe: Any, cfg: TrainConfig
) -> tuple[Sequence[Row] | None, Sequence[Row] | None, list[str]]:
    """The training and eval rows, checked: every problem of both files (one message per bad
    row), or the bad rows skipped. A file that does not exist is left to ``config_problems``."""
    messages: list[str] = []
    train_rows: Sequence[Row] | None = None
    eval_rows: Sequence[Row] | None = None
    if Path(cfg.train_file).exists():
        try:
            train_rows = recipe.read(Path(cfg.train_file))
        except UsageError as exc:
            messages.extend(str(exc).splitlines())
    if cfg.eval_file and Path(cfg.eval_file).exists():
        try:
            eval_rows = recipe.read(Path(cfg.eval_file), "--eval-file")
        except UsageError as exc:
            messages.extend(str(exc).splitlines())
    return train_rows, eval_rows, messages


@contextlib.contextmanager
def main_first(ranks: Any) -> Iterator[None]:
    """Rank 0 runs the block first (it writes caches), the other ranks after it (they read them)."""
    if ranks is None:
        yield
        return
    if not ranks.is_main:
        ranks.barrier()
    yield
    if ranks.is_main:
        ranks.barrier()


def free_memory(device: torch.device) -> int | None:
    """The device's free bytes (CUDA), or None."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def plan_knobs(
    cfg: TrainConfig,
    device: torch.device,
    *,
    longest: int | None = None,
    world: int = 1,
    free_bytes: int | None = None,
) -> dict[str, Any]:
    """Fill the knobs the user left open: a memfit plan for the GPU (or --gpu-memory), at the
    data's longest sample (``longest`` tokens, already truncated to --max-seq-len); with several
    ranks, per rank (``free_bytes``: the smallest free memory of their GPUs)."""
    if cfg.micro_batch_size is not None:
        return {"source": "given"}
    budget = cfg.gpu_memory
    if budget is None and free_bytes is not None:
        budget = free_bytes
    elif budget is None and device.type == "cuda":
        budget = free_memory(device)
    if budget is None:
        # the CPU without a budget: no plan; the guard backs off if the machine runs short
        return {"source": "default (no GPU and no --gpu-memory: the whole batch, guarded)"}
    seq_len = cfg.max_seq_len or cfg.seq_len or (128 if cfg.task != "causal-lm" else 512)
    if longest:
        # a multiple of 8 (aligned shapes), never past the length the rows were cut to
        seq_len = min(round_seq_len(longest), max(seq_len, longest))
    plan_options: dict[str, Any] = {}
    if world > 1:
        plan_options["world_size"] = world
    # a --deepspeed file's stage is the run's sharding (the plan prices it)
    stage = stage_of(cfg)
    sharding = f"zero{stage}" if stage is not None else cfg.sharding
    if sharding != "none":
        plan_options["sharding"] = sharding
    if cfg.lora_rank:
        # a LoRA run holds no base gradients or optimizer state: let the plan count adapters
        # where full fine-tuning would not fit (it prefers full fine-tuning's knobs otherwise,
        # which only err on the safe side)
        plan_options["allow"] = ("lora",)
    if quantized(cfg):
        # QLoRA: the plan counts the run's own adapters on its quantized base weights
        plan_options.update(
            lora_rank=cfg.lora_rank, lora_dropout=cfg.lora_dropout, **QUANTIZATION.values(cfg)
        )
    # the run's weights and token loss, as given (the plan may choose the loss when not)
    for name in ("weights_dtype", "cross_entropy"):
        if getattr(cfg, name) is not None:
            plan_options[name] = getattr(cfg, name)
    try:
        result = plan(
            cfg.model,
            task=cfg.task,
            seq_len=seq_len,
            # the plan splits its effective batch evenly over the ranks: the nearest multiple
            effective_batch_size=max(world, cfg.effective_batch_size // world * world),
            gpu_memory=budget,
            **plan_options,
            loss=cfg.loss if cfg.task == "sentence-embedding" else None,
            precision=cfg.precision if device.type == "cuda" else "fp32",
            optimizer=cfg.optimizer,
        )
    except UsageError as exc:
        return {"source": f"not planned: {exc}"}
    if not result.fits:
        raise NothingFitsError(
            f"memfit plan: nothing fits {budget / 2**30:.1f} GiB for {cfg.model} at "
            f"{seq_len} tokens; " + "; ".join(result.suggestions[:3])
        )
    chosen = result.plan or {}
    return {
        "source": "memfit plan",
        "plan": chosen,
        "predicted_peak_bytes": result.predicted_peak_bytes,
    }


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Gradient checkpointing on ``model`` (a UsageError where the model has none)."""
    targets = [m for m in model.modules() if hasattr(m, "gradient_checkpointing_enable")]
    if not targets:
        raise UsageError("--gradient-checkpointing: this model does not support it")
    target: Any = targets[0]
    # non-reentrant, as the estimator traces it (newer transformers renamed the method)
    kwargs = {"use_reentrant": False}
    if hasattr(target, "activation_checkpointing_enable"):
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def next_cure(model: torch.nn.Module, checkpointing: bool) -> str | None:
    """What the plan allows after micro-batch 1: gradient checkpointing, once."""
    if checkpointing:
        return None
    try:
        enable_checkpointing(model)
    except UsageError:
        return None
    return "gradient checkpointing"


def versions() -> dict[str, str]:
    """The versions run.json records."""
    out = {
        "memfit": memfit.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    with contextlib.suppress(ImportError):
        import sentence_transformers  # optional (memfit[sentence-transformers])

        out["sentence_transformers"] = sentence_transformers.__version__
    return out


class RunSetup:
    """A run's state and the phases that set it up, before its first step (the steps are
    :class:`memfit.train.loop.TrainingRun`'s). Every rank holds its own."""

    # where the run is: the next step's samples are perm(epoch)[position:position + per_step]
    step: int = 0
    epoch: int = 0
    position: int = 0
    samples_seen: int = 0
    best: float | None = None  # the best eval metric so far (DIR/best/ holds its model)
    loss_value: float | None = None  # the last step's loss (summed over the ranks)
    stopped: str = "done"
    quantized: bool = False  # --quantization: bitsandbytes holds the frozen base quantized
    sharded: Any = None  # the FSDP wrapping (--sharding fsdp) or DeepSpeed's engine (zeroN)
    zero_stage: int | None = None  # --sharding zero1|zero2|zero3 (or a --deepspeed file's)
    ranks: Any = None  # the other ranks (torchrun, accelerate launch), or None
    resumed_at: int | None = None  # the step of the checkpoint a resume went on from
    previous_result: dict[str, Any] | None = None  # run.json's result of a finished run resumed

    def __init__(self, cfg: TrainConfig, recipe: Any, lock: Any) -> None:
        self.cfg, self.recipe, self.lock = cfg, recipe, lock
        self.out = Path(cfg.output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.skipped = list(recipe.data_options.skipped)
        self.last_eval: dict[str, float] = {}

    # --- setup ----------------------------------------------------------------------------------
    def join_ranks(self) -> None:
        """The device, and the other ranks where a launcher started several."""
        cfg = self.cfg
        device = resolve_device(cfg.device)
        if device.type == "cpu" and cfg.precision not in (None, "fp32"):
            raise UsageError(
                f"--precision {cfg.precision} (--{cfg.precision}): mixed precision needs a CUDA "
                "GPU; use fp32 on the CPU"
            )
        if launched_world_size() > 1:
            # torchrun / accelerate launch started several ranks: join them (gloo on the CPU, NCCL
            # on GPUs); each rank then has its own GPU
            self.ranks = init_ranks(device.type)
            device = self.ranks.device
        self.device = device
        self.world = self.ranks.world_size if self.ranks is not None else 1
        self.rank = self.ranks.rank if self.ranks is not None else 0
        self.main = self.rank == 0
        self.tag = {"rank": self.rank} if self.ranks is not None else {}

    def load_model(self, train_rows: Sequence[Row], eval_rows: Sequence[Row] | None) -> None:
        """The model (with LoRA adapters if asked), and both files tokenized."""
        cfg, recipe, ranks = self.cfg, self.recipe, self.ranks
        # the model loads before anything is written: a model that cannot be had leaves no folder
        torch.manual_seed(cfg.seed)
        # --weights-dtype: the frozen weights (a LoRA or QLoRA base) in the checkpoint's dtype
        # under auto, the trained ones in fp32 (master weights) or, pure 16-bit, in 16 bits; the
        # model loads in the dtype of the weights it mostly holds (memfit.step.weights)
        config = checkpoint_config(cfg.model)
        self.frozen_dtype, self.trainable_dtype = weights.weight_dtypes(config, cfg.weights_dtype)
        self.checkpoint_dtype = weights.checkpoint_dtype(config)
        dtype = weights.load_dtype(config, cfg.weights_dtype, frozen_base=bool(cfg.lora_rank))
        # --quantization: the base loads quantized by bitsandbytes, straight onto the device
        with loaded_in(dtype), quantized_loading(cfg, self.device, self.frozen_dtype):
            recipe.build(train_rows)
        self.quantized = quantized(cfg)
        if self.quantized:
            # frozen, its half-precision leftovers in fp32, then the adapters as for any LoRA run
            recipe.model = prepare_quantized(recipe.model, cfg)
        if cfg.lora_rank:
            # the adapters the estimator counts (its own function picks the targets), alpha 2r,
            # --lora-dropout (0.1 by default); a target name the model lacks is exit 2 here,
            # before anything is written
            add_lora(recipe, cfg)
        # each weight in its dtype: peft's k-bit preparation upcast the frozen leftovers to fp32,
        # peft keeps adapters as it likes, a classifier's fresh head loaded with the frozen base
        # (inputs are cast once the precision is known: :meth:`plan`)
        weights.place_weights(
            recipe.model, self.frozen_dtype, self.trainable_dtype, cast_inputs=False
        )
        self.model = recipe.model
        # what the checkpoints' weights fit (recorded in them, checked by a resume): taken before
        # any sharding, so the same on any number of ranks
        self.model_signature = ck.model_signature(self.model, cfg.model)
        # in-batch negatives span the ranks: the recipe gathers its embeddings across them
        recipe.ranks = ranks
        if ranks is not None:
            # a dropout stream per rank (the weights are made equal below, on the device)
            torch.manual_seed(cfg.seed + self.rank)
        # tokenized once, cached in --cache-dir (a second run with the same data reads it back);
        # rank 0 writes the cache, the other ranks read it back
        with main_first(ranks):
            train_rows = recipe.prepare(train_rows)
            if eval_rows is not None:
                eval_rows = recipe.prepare(eval_rows)
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self.rows_n = len(train_rows)
        self.lengths = all_lengths(train_rows, recipe.lengths)
        # each rank evaluates every world-th eval row; the metrics are reduced over all of them
        self.local_eval = (
            take(eval_rows, range(self.rank, len(eval_rows), self.world))
            if eval_rows is not None and ranks is not None
            else eval_rows
        )

    def plan(self) -> None:
        """The knobs left open, planned for the data's longest sample (before the model takes any
        GPU memory); with several ranks rank 0 plans for the smallest free memory and every rank
        takes its plan."""
        cfg, device, ranks, lengths = self.cfg, self.device, self.ranks, self.lengths
        if ranks is None:
            planned = plan_knobs(cfg, device, longest=max(lengths) if lengths else None)
        else:
            free = free_memory(device)
            smallest = (
                ranks.least(free if free is not None else -1)[0] if device.type == "cuda" else None
            )
            planned = ranks.broadcast_object(
                plan_knobs(
                    cfg,
                    device,
                    longest=max(lengths) if lengths else None,
                    world=self.world,
                    free_bytes=smallest if smallest and smallest > 0 else None,
                )
                if self.main
                else None
            )
        self.planned = planned
        chosen = planned.get("plan", {})
        per_step = self.per_step = cfg.effective_batch_size
        micro = int(cfg.micro_batch_size or chosen.get("micro_batch_size") or per_step)
        if chosen.get("loss") == "cached-mnrl" and cfg.mini_batch_size is None:
            micro = int(chosen.get("mini_batch_size") or micro)
        if cfg.mini_batch_size is not None and cfg.task == "sentence-embedding":
            micro = cfg.mini_batch_size
        micro = min(micro, per_step)
        # a token budget per micro-batch (padding included): given, or the plan's micro-batch at
        # its sequence length; then short rows go many to a micro-batch and long rows few
        max_tokens = cfg.max_tokens_per_micro_batch or chosen.get("max_tokens_per_micro_batch")
        if max_tokens and cfg.micro_batch_size is None and self.recipe.splittable:
            micro = per_step  # the budget bounds the micro-batch, not a row count
        if not self.recipe.splittable:
            max_tokens = None
        self.micro, self.max_tokens = micro, max_tokens
        precision = cfg.precision or chosen.get("precision") or "fp32"
        if device.type == "cpu" and precision != "fp32":
            precision = "fp32"  # a plan for --gpu-memory on a CPU run: the CPU trains in fp32
        self.precision = precision
        if precision == "fp32":
            # no autocast: a trained module over a frozen base of another dtype (a classifier's
            # head in fp32 over a bf16 body) casts its inputs to its own (peft's adapters do so
            # themselves)
            weights.place_weights(
                self.model, self.frozen_dtype, self.trainable_dtype, cast_inputs=True
            )
        # causal LM: the token loss, given or planned (fused-linear never builds the logits)
        self.cross_entropy = cfg.cross_entropy or chosen.get("cross_entropy") or "standard"
        problem = fused_linear_problem(self.model) if self.cross_entropy != "standard" else None
        if problem is not None and cfg.cross_entropy is None:
            # the plan's choice, for a head it cannot compute: the standard loss, as planned
            # for every other model
            self.cross_entropy = "standard"
        elif problem is not None:
            # before the run folder is written
            raise UsageError(problem)
        if hasattr(self.recipe, "cross_entropy"):
            self.recipe.cross_entropy = self.cross_entropy
        self.checkpointing = bool(
            cfg.gradient_checkpointing
            if cfg.gradient_checkpointing is not None
            else chosen.get("gradient_checkpointing", False)
        )

    def open_folder(self) -> None:
        """The model on its device, the same on every rank; the run folder made and locked."""
        cfg, ranks = self.cfg, self.ranks
        if self.quantized:
            # loaded onto its device (bitsandbytes quantizes as it places the weights): not moved
            self.recipe.device = self.device
        else:
            self.recipe.to(self.device)
        if ranks is not None:
            # rank 0's weights everywhere (a fresh classifier head is random), over the device's
            # own backend (NCCL moves GPU tensors, gloo CPU ones)
            ranks.broadcast_parameters(self.model)
        if self.main:
            # the folder is made and locked (refused if another run holds it, or it is not
            # memfit's)
            self.lock.acquire(resume=cfg.resume)
            if cfg.skip_bad_rows:
                write_skipped(self.out / "skipped_rows.jsonl", self.skipped)
                if self.skipped and not cfg.quiet:
                    say(
                        f"memfit: skipped {len(self.skipped)} bad row(s); each is listed in "
                        f"{self.out / 'skipped_rows.jsonl'}"
                    )
            ck.clean_temporaries(self.ckpt_dir)
            runfolder.clean_temporaries(self.out)
        if ranks is not None:
            # the folder exists before any rank writes to it
            ranks.barrier()

    def build_optimizer(self) -> None:
        """Checkpointing, FSDP shards, the optimizer, the schedule and the fp16 loss scaler."""
        cfg, model, device = self.cfg, self.model, self.device
        if self.checkpointing:
            enable_checkpointing(model)
        model.train()
        if cfg.sharding == "fsdp":
            # FSDP2 per transformer block, then the root; the optimizer is built on the shards
            self.sharded = shard_model(model, self.ranks, precision=self.precision, device=device)
        stage = stage_of(cfg)
        self.optimizer = make_optimizer(
            cfg.optimizer,
            model,
            cfg.lr,
            cfg.weight_decay,
            offload=optimizer_offload_of(cfg),
            zero=stage is not None,
            device=device,
        )
        if stage is not None:
            self.start_zero(stage)
        paged = cfg.optimizer.startswith("paged-")
        if paged and device.type != "cuda" and self.main and not cfg.quiet:
            say(
                f"memfit: --optimizer {cfg.optimizer}: bitsandbytes pages optimizer state "
                "between a CUDA GPU and the host; on the CPU it runs unpaged"
            )
        self.steps_per_epoch = math.ceil(self.rows_n / self.per_step)
        self.total_steps = cfg.max_steps or self.steps_per_epoch * cfg.epochs
        self.scheduler = make_scheduler(cfg, self.optimizer, self.total_steps)
        zero = self.zero_stage is not None
        # fp16 loss scaling unscales into fp32 gradients: torch's scaler refuses fp16 ones, so it
        # runs over fp32 master weights only (16-bit trained weights under fp16 are refused by
        # the job's checks: memfit.levers.weights)
        self.scaler = (
            torch.amp.GradScaler("cuda")
            if self.precision == "fp16"
            and device.type == "cuda"
            and not zero
            and self.trainable_dtype == torch.float32
            else None
        )
        # DeepSpeed casts the module to 16 bits itself (and scales fp16 losses)
        self.autocast = autocast(device, "fp32" if zero else self.precision)
        # --activation-offloading: the saved activations wait in host memory between each
        # micro-batch's forward and backward; built once (TRL's hooks the model's output head),
        # entered per micro-batch attempt (the guard's autocast and backward, make_guard)
        self.offload = (
            offload.PerMicroBatch(offload.offload_context(self.model, device.type))
            if cfg.activation_offloading
            else None
        )
        self.params = [p for p in model.parameters() if p.requires_grad]

    def held_weights(self) -> dict[str, Any]:
        """run.json's ``weights``: the dtypes the model holds its frozen and its trained weights
        in (``frozen`` None when nothing is frozen; bitsandbytes' quantized weights left out) and
        the checkpoint's, by the names of ``--weights-dtype``."""

        def names(trained: bool) -> str | None:
            found = sorted(
                {
                    weights.dtype_name(p.dtype)
                    for p in self.model.parameters()
                    if p.is_floating_point()
                    and p.requires_grad == trained
                    and type(p).__name__ not in weights.QUANTIZED_PARAMETERS
                }
            )
            return "+".join(found) or None

        return {
            "frozen": names(False),
            "trainable": names(True),
            "checkpoint": weights.dtype_name(self.checkpoint_dtype),
        }

    def activation_offloading_ran(self) -> str | None:
        """run.json's ``activation_offloading``: the implementation that offloaded the saved
        activations (:func:`memfit.step.offload.implementation`), None when off."""
        if getattr(self, "offload", None) is None:
            return None
        return offload.implementation(self.device.type)

    def cross_entropy_ran(self) -> dict[str, Any] | None:
        """run.json's ``cross_entropy``: the causal-LM token loss that ran and, fused-linear,
        which implementation computes it on the run's device (None: a task without one)."""
        kind = getattr(self.recipe, "cross_entropy", None)
        if kind is None:
            return None
        out: dict[str, Any] = {"kind": kind}
        if kind == "fused-linear":
            out["implementation"] = linear_ce.implementation(self.device.type)
        return out

    def start_zero(self, stage: int) -> None:
        """DeepSpeed's engine over the model and the optimizer (``--sharding zeroN``)."""
        cfg, model = self.cfg, self.model
        config_of = model.config
        hidden = getattr(config_of, "hidden_size", None) or getattr(config_of, "n_embd", None)
        config, notes = build_config(
            cfg,
            stage=stage,
            hidden_size=int(hidden or 768),
            precision=self.precision,
            micro=self.micro,
        )
        if self.main and not cfg.quiet:
            for note in notes:
                say(f"memfit: {note}")
            # DeepSpeed's import and engine take seconds (its optimizers' modules compile-load)
            say(f"memfit: starting DeepSpeed ZeRO-{stage} over {self.world} ranks")
        self.zero_stage = stage
        self.sharded = start_engine(model, self.optimizer, self.ranks, config)

    def open_logs(self, closers: contextlib.ExitStack) -> None:
        """metrics.jsonl (rank 0: one line per step) and events.jsonl (every rank appends its
        own, with its rank), closed when the run ends, however it ends."""
        self.metrics: Any = JsonlLog(self.out / "metrics.jsonl") if self.main else NoLog()
        self.events: Any = JsonlLog(self.out / "events.jsonl")
        # closed when the run ends, however it ends (a stopped run leaves no file open)
        closers.callback(lambda: (self.metrics.close(), self.events.close()))
        if self.main:
            # --report-to: the same lines to TensorBoard / W&B too (rank 0: the whole step's
            # figures)
            self.metrics, self.events = open_reporters(
                self.cfg.report_to,
                self.out,
                dataclasses.asdict(self.cfg),
                self.metrics,
                self.events,
            )

    def on_event(self, event: dict[str, Any]) -> None:
        """An event to events.jsonl (stamped, with the rank); the guard's also to the terminal."""
        self.events.write({"time": round(time.time(), 3), **self.tag, **event})
        if (
            event["type"] in ("oom", "backoff", "grow")
            and not self.cfg.quiet
            and (self.main or event["type"] == "oom")
        ):
            say(f"memfit guard: {'' if self.main else f'rank {self.rank}: '}{describe(event)}")

    def make_guard(self) -> None:
        """The guard that runs each step as micro-batches, and the step settings a checkpoint
        records (what decides which samples each step holds: a resume must find them unchanged)."""
        ranks, sharded = self.ranks, self.sharded
        if ranks is not None:
            # what the sync points write into: allocated now, before any memory cap
            ranks.prepare(self.params)
            if sharded is not None:
                ranks.reduces_in_backward = True
        backward = sharded.backward if self.zero_stage is not None else None
        self.guard = Guard(
            self.micro,
            target_micro_batch_size=self.micro,
            grow_after=self.cfg.grow_after,
            on_event=self.on_event,
            device=self.device,
            max_tokens=self.max_tokens,
            ranks=ranks,
            pad_pass=(
                sharded.pad_pass(self.recipe, take(self.train_rows, [0]))
                if sharded is not None
                else None
            ),
            on_recover=sharded.reset if sharded is not None else None,
            backward=self.offload.backward(backward) if self.offload is not None else backward,
        )
        self.settings = step_settings(self.cfg, self.rows_n, self.lengths)
        if self.lock.note is not None:
            self.on_event({"type": "lock", "note": self.lock.note})


def take(rows: Sequence[Row], indices: Sequence[int]) -> list[Row]:
    """Rows by index: one read of an Arrow table, or list items."""
    if isinstance(rows, RowTable):
        return rows.rows(indices)
    return [rows[i] for i in indices]
