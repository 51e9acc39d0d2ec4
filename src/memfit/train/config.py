"""``memfit train``'s settings: the job's knobs (:class:`memfit.job.Job`) plus the run's own, and
every check on them, made at once before anything is loaded or written.

A field's metadata (:func:`memfit.job.knob`) is what the CLI shows and takes. Beyond ``help``,
``flag``, ``choices``, ``minimum`` and ``cli`` (see :func:`~memfit.job.knob`), the run's own
fields use these keys, for the CLI generator:

- ``negatable``: a boolean flag given as ``--name/--no-name`` (True), or as ``--name`` alone,
  off by default (False);
- ``size``: the flag takes a size (``16GiB``), parsed with :func:`memfit.units.parse_size`;
- ``comma_list``: the flag takes a comma-separated list (``--labels neg,pos``), items stripped;
- ``zero_is_none``: a flag value of 0 means "off" (None);
- ``finite``: a float that must be a finite number (checked by :func:`config_problems`).

The job's own fields are flags of ``memfit train`` too, with the help lines of
:data:`INHERITED_HELP` (None: not a flag of ``memfit train``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from memfit.data.instructions import flag_problems
from memfit.errors import UsageError
from memfit.extras import problems as missing_packages
from memfit.job import JOB_FIELDS, Job
from memfit.knobs import finite_problem, flag_of, knob, whole_problem
from memfit.levers.cross_entropy import TRAIN_REFUSAL, TRL_CHUNKED
from memfit.levers.lora import LORA_DROPOUT
from memfit.levers.optimizer import OPTIMIZER_TABLE
from memfit.levers.packing import (
    DEFAULT_PACKING_STRATEGY,
    PACKING_STRATEGIES,
    packing_strategy,
)
from memfit.levers.sharding import DEEPSPEED_SCHEMES
from memfit.runtime import launched_world_size
from memfit.train.loggers import report_problems
from memfit.train.runfolder import folder_problems, run_config

SCHEDULERS = ("linear", "cosine", "constant")
PADDINGS = ("longest", "max_length")

# the job's knobs as ``memfit train`` shows them: its own help line, None where a knob is not
# one of its flags; a knob not named here is a flag with the job's help line (memfit.job)
INHERITED_HELP: dict[str, str | None] = {
    "model": "A model folder (sentence-transformers' too), or a Hub id: from the Hugging Face "
    "cache, else downloaded where the Hub answers.",
    "task": "classification | causal-lm | sentence-embedding",
    "num_labels": "classification: labels are the integers 0…N-1.",
    "loss": "sentence-embedding: mnrl | cached-mnrl",
    "seq_len": None,
    "max_seq_len": "Plan key: truncate to this many tokens.",
    "effective_batch_size": "Samples per optimizer step, over all ranks.",
    "micro_batch_size": "Plan key: samples per micro-batch.",
    "gradient_accumulation_steps": "Plan key (follows from the micro-batch).",
    "mini_batch_size": "Plan key: cached-mnrl mini-batch.",
    "max_tokens_per_micro_batch": (
        "Plan key: tokens per micro-batch, padding included (token-budget batches)."
    ),
    "world_size": "Plan key: data-parallel ranks; must match what torchrun/accelerate launched.",
    "sharding": "Plan key: none | fsdp (PyTorch FSDP2) | zero1 | zero2 | zero3 (DeepSpeed).",
    "precision": "Plan key: fp32 | fp16 | bf16.",
    "gradient_checkpointing": "Plan key: recompute activations.",
    "attn_implementation": None,
    "lora_rank": "Train peft LoRA adapters of this rank (the base stays frozen).",
    "lora_target_modules": (
        "LoRA targets, comma-separated: attention, mlp, module names, or all-linear."
    ),
    "device": "cuda | cpu",
}
# the default memfit train's help shows ([default: …]) where a field's own is None: decided when
# the run starts; a field not named here shows its default (when it has one)
SHOWN_DEFAULTS: dict[str, str] = {
    "effective_batch_size": "micro-batch × accumulation steps × ranks when the micro-batch "
    f"is given, else {Job.effective_batch_size}",
    "loss": "mnrl",
    "lora_target_modules": "attention",
    "lora_dropout": str(LORA_DROPOUT),
    "device": "cuda if present",
    "cache_dir": "the datasets cache",
    "packing_strategy": "bfd",
}


@dataclass(kw_only=True)
class TrainConfig(Job):
    """Every knob of a run; ``memfit train`` flags and the config file map onto these names.

    The job's knobs (model, task, the batch, precision, ...) come from :class:`~memfit.job.Job`;
    None there means "planned before step 0, or the default". The fields below are the run's.
    """

    train_file: str = knob(
        "Training data: .csv/.tsv/.jsonl/.json/.parquet (.gz for text), a folder of them, or a "
        "datasets save_to_disk folder.",
        required=True,
    )
    """The training rows: a file or a folder of them."""
    output_dir: str = knob("The run folder.", required=True)
    """The run folder: model/, checkpoints/, metrics.jsonl, events.jsonl, run.json."""
    eval_file: str | None = knob("Eval data, same columns.")
    text_column: str = knob("Text column (classification, causal-lm).", default="text")
    label_column: str = knob("Label column (classification).", default="label")
    text_pair_column: str | None = knob("Second text column of sentence pairs (classification).")
    """Classification: a second text (sentence pairs)."""
    anchor_column: str = knob("Anchor column (sentence-embedding).", default="anchor")
    positive_column: str = knob("Positive column (sentence-embedding).", default="positive")
    prompt_column: str | None = knob(
        "causal-lm: prompt column of prompt/completion rows (loss on the completion only)."
    )
    completion_column: str | None = knob(
        "causal-lm: completion column of prompt/completion rows (with --prompt-column)."
    )
    messages_column: str | None = knob(
        "causal-lm: column of chat messages ([{role, content}, ...]) rendered with the "
        "tokenizer's chat template; loss on the assistant turns only."
    )
    packing: bool = knob(
        "causal-lm: pack rows into sequences of up to --max-seq-len tokens (see "
        "--packing-strategy).",
        negatable=True,
        default=False,
    )
    """Pack rows into sequences of up to ``max_seq_len`` tokens; how: ``packing_strategy``
    (``bfd``, padding-free, when not given; ``wrapped``, blocks across documents)."""
    epochs: int = knob("Passes over the data.", minimum=1, default=1)
    max_steps: int | None = knob("Optimizer steps (instead of --epochs).", minimum=1)
    lr: float = knob("Peak learning rate.", finite=True, default=5e-5)
    weight_decay: float = knob("AdamW weight decay.", finite=True, default=0.0)
    warmup_ratio: float = knob("Share of steps warming up.", finite=True, default=0.0)
    lr_scheduler: str = knob("linear | cosine | constant", choices=SCHEDULERS, default="linear")
    max_grad_norm: float | None = knob(
        "Clip the whole step's gradient (0: off).",
        finite=True,
        zero_is_none=True,
        default=1.0,
    )
    seed: int = knob("Random seed.", default=42)
    gpu_memory: int | None = knob("Plan for this budget, e.g. 16GiB.", size=True)
    """The plan's budget in bytes (None: the GPU's free memory)."""
    deepspeed: str | None = knob(
        "A DeepSpeed config (JSON) for --sharding zero1|zero2|zero3; its stage sets --sharding."
    )
    """A user's DeepSpeed config: its ZeRO settings ("auto" filled as accelerate fills them);
    memfit keeps the batch, the optimizer and the boundary (see memfit.train.zero)."""
    memory_cap: int | None = knob("Behave as if the device had only this much memory.", size=True)
    """A cap in bytes on the device's memory: every OOM path for real, on any machine."""
    save_every: int | None = knob("Checkpoint every N optimizer steps.", minimum=1)
    save_total_limit: int | None = knob("Keep the newest K checkpoints.", minimum=1)
    eval_every: int | None = knob("Evaluate every N optimizer steps (and at the end).", minimum=1)
    resume: bool = knob(
        "Continue from the newest complete checkpoint.", negatable=True, default=False
    )
    grow_after: int = knob(
        "Clean steps before the guard tries a larger micro-batch.", minimum=1, default=50, cli=False
    )
    quiet: bool = knob("No progress lines.", default=False, cli=False)
    """No progress lines (the API's callers that print their own)."""
    merge_lora: bool = knob(
        "Save DIR/model as the merged model (loads without peft), not the adapter folder.",
        negatable=False,
        default=False,
    )
    """LoRA: DIR/model is the merged model, not the adapter folder (see memfit.train.lora)."""
    labels: list[str] | None = knob(  # noqa: RUF009 (a field, default None)
        "classification: the label set in id order, comma-separated (neg,pos).", comma_list=True
    )
    """Classification: the label set, in id order."""
    skip_bad_rows: bool = knob(
        "Skip bad rows (listed in DIR/skipped_rows.jsonl) instead of refusing the data.",
        negatable=False,
        default=False,
    )
    """Skip bad rows (listed in DIR/skipped_rows.jsonl) rather than refuse the data."""
    cache_dir: str | None = knob("Where tokenized data is cached.")
    """Tokenized data; default: the Hugging Face datasets cache."""
    group_by_length: bool = knob(
        "Steps of similar-length samples: less padding.", negatable=True, default=False
    )
    probe: bool = knob(
        "Run one step on the longest samples first (undone), so OOM comes at step 0.",
        negatable=True,
        default=True,
    )
    """One step on the longest samples before step 1, undone afterwards."""
    padding: str = knob(
        "longest (dynamic) | max_length (pad to --max-seq-len).",
        choices=PADDINGS,
        default="longest",
    )
    """longest (dynamic padding) | max_length (every row to max_seq_len)."""
    memory_snapshot: bool = knob(
        "CUDA: dump the allocator's history at each OOM (DIR/memory-snapshots/).",
        negatable=False,
        default=False,
    )
    """CUDA: record the allocator's history and dump a snapshot (DIR/memory-snapshots/) at each
    caught OOM, for PyTorch's memory viewer (https://pytorch.org/memory_viz)."""
    report_to: str = knob(
        "tensorboard | wandb | none: step, memory and guard figures there too.",
        default="none",
    )
    """The step, eval and guard figures also to tensorboard and/or wandb (comma-separated; rank 0
    only); see memfit.train.loggers."""

    def __post_init__(self) -> None:
        # the packing strategy is said in run.json and each checkpoint, so that a resume goes on
        # with it: bfd when --packing gives none, a resumed run's own (see resumed_strategy)
        if self.packing and self.packing_strategy is None:
            self.packing_strategy = resumed_strategy(self) or DEFAULT_PACKING_STRATEGY


def resumed_strategy(cfg: TrainConfig) -> str | None:
    """With --resume, the packing strategy of the run in the folder (None: no run there, or it
    did not pack): its run.json's; a run.json of a memfit before --packing-strategy records
    packing and no strategy, and packed wrapped blocks, the only packing there was."""
    if not cfg.resume:
        return None
    saved = run_config(Path(cfg.output_dir))
    if not isinstance(saved, dict) or not saved.get("packing"):
        return None
    strategy = saved.get("packing_strategy", "wrapped")
    return strategy if strategy in PACKING_STRATEGIES else None


# the run's own fields (those of TrainConfig that are not the job's)
RUN_FIELDS = tuple(f for f in dataclasses.fields(TrainConfig) if f.name not in JOB_FIELDS)


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    samples_seen: int
    final_loss: float | None
    eval_metrics: dict[str, float]
    stopped: str  # "done" | "signal" | "finished" (a --resume of a run that had finished)


# --- validation -----------------------------------------------------------------------------------
def check_config(cfg: TrainConfig) -> None:
    """Every problem with the flags, at once (one line each), before anything is written."""
    problems = config_problems(cfg)
    if problems:
        raise UsageError("\n".join(problems))


def config_problems(cfg: TrainConfig) -> list[str]:
    """The problems with the flags (and the files' existence), one message each: the job's
    (:meth:`Job.problems`), then the run's."""
    offload: list[str] = []
    if cfg.deepspeed is not None:
        # its offload_optimizer is the run's --optimizer-offload (checked, priced); imported here
        # for the CLI's start-up time (memfit.train.zero loads torch)
        from memfit.train.zero import resolve_optimizer_offload

        offload = resolve_optimizer_offload(cfg)
    problems = cfg.problems(typed=True)
    problems.extend(x for x in offload if x not in problems)

    def add(found: list[str]) -> None:
        # a check the job makes too (LoRA's, say) says it once
        problems.extend(x for x in found if x not in problems)

    if cfg.lr_scheduler not in SCHEDULERS:
        problems.append(
            f"--lr-scheduler: unknown value {cfg.lr_scheduler!r}; one of {', '.join(SCHEDULERS)}"
        )
    for f in RUN_FIELDS:
        value, flag = getattr(cfg, f.name), flag_of(f)
        found = None
        if value is not None and f.metadata.get("minimum") is not None:
            found = whole_problem(flag, value, f.metadata["minimum"], typed=True)
        elif f.metadata.get("finite"):
            # NaN passes every comparison that would refuse it, and inf trains a model of NaNs
            found = finite_problem(flag, value)
        if found is not None:
            problems.append(found)
    if cfg.task == "sentence-embedding" and _whole(cfg.effective_batch_size):
        # here, not at the top, for the CLI's start-up time: the recipe loads torch, transformers
        from memfit.train.recipes.sentence_embedding import batch_problems

        # in-batch negatives: one pair per step has none (a loss of 0)
        problems.extend(batch_problems(cfg.loss or "mnrl", int(cfg.effective_batch_size)))
    if cfg.task == "sentence-embedding":
        # the recipe trains a SentenceTransformer with sentence-transformers' losses
        problems.extend(missing_packages([("sentence_transformers", "--task sentence-embedding")]))
    # prompt/completion and chat rows: causal-lm only, the two columns together, no wrapped
    # blocks (bfd packing keeps their loss masks)
    problems.extend(
        flag_problems(
            task=cfg.task,
            prompt_column=cfg.prompt_column,
            completion_column=cfg.completion_column,
            messages_column=cfg.messages_column,
            packing=packing_strategy(cfg),
            text_column=cfg.text_column,
        )
    )
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or not 0 <= cfg.seed < 2**32:
        problems.append(f"--seed: must be a whole number from 0 to {2**32 - 1}, got {cfg.seed}")
    if cfg.lr <= 0:
        problems.append(f"--lr: must be > 0, got {cfg.lr}")
    if not 0 <= cfg.warmup_ratio < 1:
        problems.append(f"--warmup-ratio: must be in [0, 1), got {cfg.warmup_ratio}")
    add(_distributed_problems(cfg))
    if cfg.cross_entropy == TRL_CHUNKED:
        # TRL SFTTrainer's own head: estimate and plan price it, memfit train does not run it
        problems.append(TRAIN_REFUSAL)
    # what memfit train's runner cannot run (DeepSpeed ZeRO or FSDP with LoRA, ...): the levers'
    # one table, which a plan and the doctor consult too, so that none proposes what train refuses
    # (the job's own problems, above, are said once)
    for job in _run_jobs(cfg):
        add(job.problems(typed=True, run=True))
    if cfg.device == "cuda" and not _cuda_available():
        problems.append("--device: cuda was asked for but no CUDA GPU is visible")
    # here, not at the top, for the CLI's start-up time: memfit.train.lora loads torch
    from memfit.train.lora import lora_problems

    add(lora_problems(cfg))
    problems.extend(report_problems(cfg.report_to))
    for flag, path in (("--train-file", cfg.train_file), ("--eval-file", cfg.eval_file)):
        if path is not None and not Path(path).exists():
            problems.append(f"{flag}: {path}: no such file or folder")
    if cfg.memory_snapshot and not _cuda_available():
        problems.append("--memory-snapshot: needs a CUDA GPU (it records the CUDA allocator)")
    if cfg.padding not in PADDINGS:
        problems.append(f"--padding: unknown value {cfg.padding!r}; longest or max_length")
    if cfg.max_grad_norm is not None and cfg.max_grad_norm < 0:
        problems.append(f"--max-grad-norm: must be ≥ 0, got {cfg.max_grad_norm}")
    if cfg.weight_decay < 0:
        problems.append(f"--weight-decay: must be ≥ 0, got {cfg.weight_decay}")
    if cfg.task != "classification" and (cfg.labels or cfg.num_labels):
        problems.append("--labels/--num-labels: only for --task classification")
    if cfg.labels is not None and not [x for x in cfg.labels if str(x).strip()]:
        problems.append("--labels: give the label names, comma-separated (--labels neg,pos)")
    if cfg.labels is not None and cfg.num_labels is not None and len(cfg.labels) != cfg.num_labels:
        problems.append(
            f"--labels names {len(cfg.labels)} labels but --num-labels is {cfg.num_labels}; "
            "give one of them"
        )
    problems.extend(_optimizer_problems(cfg.optimizer))
    # rank 0 takes the folder's lock: the other ranks must not take it for another run's
    problems.extend(
        folder_problems(
            Path(cfg.output_dir),
            resume=cfg.resume,
            check_lock=os.environ.get("RANK", "0") in ("", "0"),
        )
    )
    return problems


def _optimizer_problems(name: str) -> list[str]:
    """The optimizer's package, where it needs one that does not import here."""
    optimizer = OPTIMIZER_TABLE.get(name)
    if optimizer is None or optimizer.needs is None:
        return []
    # here, not at the top, for the CLI's start-up time: memfit.train.quantization loads torch
    from memfit.train.quantization import package_problem

    problem = package_problem(optimizer.needs, f"--optimizer {name}")
    return [f"{problem}; or use adamw or adafactor"] if problem else []


def _distributed_problems(cfg: TrainConfig) -> list[str]:
    """What cannot run with the ranks launched and the sharding asked for, before anything
    starts (DeepSpeed on the CPU, a plan for 4 ranks in 1 process, ...): the environment's part.
    A --world-size or --sharding that is no value at all is the job's problem
    (:meth:`Job.problems`), a sharding that does not combine with the other levers the levers'
    (:func:`_run_jobs`)."""
    problems: list[str] = []
    launched = launched_world_size()
    wanted = cfg.world_size
    if wanted is not None and _whole(wanted) and wanted != launched:
        if launched == 1:
            problems.append(
                f"--world-size: {wanted} ranks asked for, but this is one process; launch them: "
                f"torchrun --nproc_per_node {wanted} -m memfit train … (or accelerate launch "
                f"--num_processes {wanted} -m memfit train …)"
            )
        else:
            problems.append(
                f"--world-size: {wanted} ranks asked for, but {launched} were launched; make them "
                "agree (or leave --world-size out)"
            )
    if cfg.deepspeed is not None:
        # here, not at the top, for the CLI's start-up time: memfit.train.zero loads torch
        from memfit.train.zero import config_problems as deepspeed_problems

        problems.extend(deepspeed_problems(cfg.deepspeed, cfg.sharding, cfg.precision))
    if cfg.sharding in DEEPSPEED_SCHEMES or cfg.deepspeed is not None:
        scheme = cfg.sharding if cfg.sharding in DEEPSPEED_SCHEMES else "zero1|zero2|zero3"
        problems.extend(missing_packages([("deepspeed", f"--sharding {scheme}")]))
        if launched == 1:
            problems.append(
                f"--sharding: {scheme} (DeepSpeed ZeRO) shards over several ranks; launch them: "
                "torchrun --nproc_per_node N -m memfit train … (or use --sharding none)"
            )
    return problems


def _run_jobs(cfg: TrainConfig) -> list[Job]:
    """The jobs whose levers' run problems (:meth:`Job.problems` with ``run``) hold for ``cfg``:
    a --deepspeed file runs DeepSpeed ZeRO whatever --sharding says (its stage is the run's
    sharding), so the table's ZeRO rows, which name no stage, hold for it too; first, as the
    DeepSpeed checks come before the FSDP ones."""
    if cfg.deepspeed is not None and cfg.sharding not in DEEPSPEED_SCHEMES:
        return [dataclasses.replace(cfg, sharding=DEEPSPEED_SCHEMES[0]), cfg]
    return [cfg]


def _whole(value: object) -> bool:
    """A whole number ≥ 1 (a count the job's checks passed)."""
    return whole_problem("", value) is None


def _cuda_available() -> bool:
    # the CLI builds its options from TrainConfig first: torch is imported here, not at the top,
    # for its start-up time
    import torch

    return bool(torch.cuda.is_available())
