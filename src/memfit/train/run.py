"""``memfit train``: a fine-tuning run under the guard, with checkpoints, logs and resume.

The loop is plain PyTorch on purpose: each optimizer step is a fixed set of samples drawn from a
seeded permutation before any split; the guard runs them as micro-batches (and survives OOM with
the same gradient); the loop then clips the whole step's gradient, steps the optimizer and the
scheduler, logs one line, and checkpoints at step boundaries. The run folder is a contract:

    DIR/model/            the final model (loads with Auto* classes or SentenceTransformer)
    DIR/best/             the best model by the eval metric (with --eval-file)
    DIR/metrics.jsonl     one line per optimizer step, plus eval lines (``eval_`` keys)
    DIR/events.jsonl      oom, backoff, grow, checkpoint, resume, eval, stop
    DIR/checkpoints/step-N/  atomic: weights, optimizer, scheduler, RNG, sampler, micro-batch
    DIR/run.json          resolved config, plan, versions
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.data.batching import length_grouped_order
from memfit.data.rows import DataOptions, Row, RowTable, all_lengths, write_skipped
from memfit.errors import NothingFitsError, TrainingStoppedError, UsageError
from memfit.train.distributed import shard_rows

TASKS = ("classification", "causal-lm", "sentence-embedding")
OPTIMIZERS = ("adamw", "sgd", "adamw-8bit", "adafactor")
SCHEDULERS = ("linear", "cosine", "constant")
PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass
class TrainConfig:
    """Every knob of a run; ``memfit train`` flags and the config file map onto these names."""

    task: str
    model: str
    train_file: str
    output_dir: str
    eval_file: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    text_pair_column: str | None = None  # classification: a second text (sentence pairs)
    anchor_column: str = "anchor"
    positive_column: str = "positive"
    loss: str | None = None
    packing: bool = False
    effective_batch_size: int = 32
    epochs: int = 1
    max_steps: int | None = None
    lr: float = 5e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0
    lr_scheduler: str = "linear"
    max_grad_norm: float | None = 1.0
    optimizer: str = "adamw"
    seed: int = 42
    gpu_memory: int | None = None
    memory_cap: int | None = None
    save_every: int | None = None
    save_total_limit: int | None = None
    eval_every: int | None = None
    resume: bool = False
    device: str | None = None
    grow_after: int = 50
    quiet: bool = False  # no progress lines (the API's callers that print their own)
    # the plan's keys (None: planned before step 0, or the defaults)
    micro_batch_size: int | None = None  # per rank
    gradient_accumulation_steps: int | None = None
    # data-parallel ranks: None takes what the launcher (torchrun, accelerate launch) started; a
    # number (a plan's) must match it
    world_size: int | None = None
    # how the ranks divide the model: none (each holds all of it, gradients all-reduced),
    # fsdp (PyTorch FSDP2), zero1|zero2|zero3 (DeepSpeed ZeRO, CUDA only)
    sharding: str = "none"
    precision: str | None = None
    gradient_checkpointing: bool | None = None
    max_seq_len: int | None = None
    mini_batch_size: int | None = None
    max_tokens_per_micro_batch: int | None = None
    lora_rank: int | None = None
    # LoRA (issue 8): --lora-target-modules (groups attention/mlp, module names, or all-linear;
    # default: the architecture's attention projections), --merge-lora (DIR/model is the merged
    # model, not the adapter folder); see memfit.train.lora
    lora_target_modules: list[str] | None = None
    merge_lora: bool = False
    seq_len: int | None = None
    attn_implementation: str | None = None
    # data (issue 5): the label set, bad rows, the cache, batching, the probe
    labels: list[str] | None = None  # --labels a,b,c: the label set, in id order
    num_labels: int | None = None  # --num-labels N: labels are 0…N-1
    skip_bad_rows: bool = False  # skip bad rows (listed in DIR/skipped_rows.jsonl), not refuse
    cache_dir: str | None = None  # tokenized data; default: the HF datasets cache
    group_by_length: bool = False  # steps of similar-length samples (less padding)
    probe: bool = True  # one step on the longest samples before step 1, undone afterwards
    padding: str = "longest"  # longest (dynamic padding) | max_length (every row to max_seq_len)
    # CUDA: record the allocator's history and dump a snapshot (DIR/memory-snapshots/) at each
    # caught OOM, for PyTorch's memory viewer (https://pytorch.org/memory_viz)
    memory_snapshot: bool = False
    # --report-to: the step, eval and guard figures also to tensorboard and/or wandb
    # (comma-separated; rank 0 only); see memfit.train.loggers
    report_to: str = "none"


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
    """The problems with the flags (and the files' existence), one message each."""
    problems: list[str] = []
    if cfg.task not in TASKS:
        problems.append(f"--task: unknown value {cfg.task!r}; one of {', '.join(TASKS)}")
    if cfg.optimizer not in OPTIMIZERS:
        problems.append(
            f"--optimizer: unknown value {cfg.optimizer!r}; one of {', '.join(OPTIMIZERS)}"
        )
    if cfg.lr_scheduler not in SCHEDULERS:
        problems.append(
            f"--lr-scheduler: unknown value {cfg.lr_scheduler!r}; one of {', '.join(SCHEDULERS)}"
        )
    if cfg.precision is not None and cfg.precision not in PRECISIONS:
        problems.append(
            f"--precision: unknown value {cfg.precision!r}; one of {', '.join(PRECISIONS)}"
        )
    for name in ("effective_batch_size", "epochs"):
        if int(getattr(cfg, name)) < 1:
            problems.append(f"--{name.replace('_', '-')}: must be ≥ 1, got {getattr(cfg, name)}")
    if cfg.task == "sentence-embedding" and int(cfg.effective_batch_size) >= 1:
        from memfit.train.recipes.sentence_embedding import batch_problems

        # in-batch negatives: one pair per step has none (a loss of 0)
        problems.extend(batch_problems(cfg.loss or "mnrl", int(cfg.effective_batch_size)))
    for name in (
        "max_steps",
        "micro_batch_size",
        "save_every",
        "save_total_limit",
        "eval_every",
        "max_tokens_per_micro_batch",
        "max_seq_len",
        "mini_batch_size",
        "num_labels",
    ):
        value = getattr(cfg, name)
        if value is not None and int(value) < 1:
            problems.append(f"--{name.replace('_', '-')}: must be ≥ 1, got {value}")
    # NaN passes every comparison that would refuse it, and inf trains a model of NaNs
    for name in ("lr", "weight_decay", "max_grad_norm", "warmup_ratio"):
        value = getattr(cfg, name)
        if isinstance(value, int | float) and not math.isfinite(value):
            problems.append(f"--{name.replace('_', '-')}: must be a finite number, got {value}")
    if not isinstance(cfg.seed, int) or isinstance(cfg.seed, bool) or not 0 <= cfg.seed < 2**32:
        problems.append(f"--seed: must be a whole number from 0 to {2**32 - 1}, got {cfg.seed}")
    if cfg.lr <= 0:
        problems.append(f"--lr: must be > 0, got {cfg.lr}")
    if not 0 <= cfg.warmup_ratio < 1:
        problems.append(f"--warmup-ratio: must be in [0, 1), got {cfg.warmup_ratio}")
    problems.extend(_distributed_problems(cfg))
    if cfg.device not in (None, "cpu", "cuda"):
        problems.append(f"--device: unknown value {cfg.device!r}; cuda or cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        problems.append("--device: cuda was asked for but no CUDA GPU is visible")
    from memfit.train.loggers import report_problems
    from memfit.train.lora import lora_problems

    problems.extend(lora_problems(cfg))
    problems.extend(report_problems(cfg.report_to))
    for flag, path in (("--train-file", cfg.train_file), ("--eval-file", cfg.eval_file)):
        if path is not None and not Path(path).exists():
            problems.append(f"{flag}: {path}: no such file or folder")
    if cfg.memory_snapshot and not torch.cuda.is_available():
        problems.append("--memory-snapshot: needs a CUDA GPU (it records the CUDA allocator)")
    if cfg.padding not in ("longest", "max_length"):
        problems.append(f"--padding: unknown value {cfg.padding!r}; longest or max_length")
    if cfg.max_grad_norm is not None and cfg.max_grad_norm < 0:
        problems.append(f"--max-grad-norm: must be ≥ 0, got {cfg.max_grad_norm}")
    if cfg.weight_decay < 0:
        problems.append(f"--weight-decay: must be ≥ 0, got {cfg.weight_decay}")
    if cfg.grow_after < 1:
        problems.append(f"--grow-after: must be ≥ 1, got {cfg.grow_after}")
    if cfg.task != "classification" and (cfg.labels or cfg.num_labels):
        problems.append("--labels/--num-labels: only for --task classification")
    if cfg.labels is not None and not [x for x in cfg.labels if str(x).strip()]:
        problems.append("--labels: give the label names, comma-separated (--labels neg,pos)")
    if cfg.labels is not None and cfg.num_labels is not None and len(cfg.labels) != cfg.num_labels:
        problems.append(
            f"--labels names {len(cfg.labels)} labels but --num-labels is {cfg.num_labels}; "
            "give one of them"
        )
    if cfg.optimizer == "adamw-8bit":
        try:
            import bitsandbytes  # noqa: F401
        except Exception:
            problems.append(
                "--optimizer: adamw-8bit needs a working bitsandbytes (pip install bitsandbytes, "
                "on a CUDA machine); use adamw or adafactor here"
            )
    from memfit.train.runfolder import folder_problems

    # rank 0 takes the folder's lock: the other ranks must not take it for another run's
    problems.extend(
        folder_problems(
            Path(cfg.output_dir),
            resume=cfg.resume,
            check_lock=os.environ.get("RANK", "0") in ("", "0"),
        )
    )
    return problems


def _distributed_problems(cfg: TrainConfig) -> list[str]:
    """What cannot run with the ranks launched and the sharding asked for, before anything
    starts (DeepSpeed on the CPU, a plan for 4 ranks in 1 process, ...)."""
    from memfit.train.distributed import DEEPSPEED_SHARDINGS, SHARDINGS, launched_world_size

    problems: list[str] = []
    launched = launched_world_size()
    wanted = cfg.world_size
    if wanted is not None and (
        isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1
    ):
        problems.append(f"--world-size: must be a whole number ≥ 1, got {wanted!r}")
    elif wanted is not None and wanted != launched:
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
    if cfg.sharding not in SHARDINGS:
        problems.append(
            f"--sharding: unknown value {cfg.sharding!r}; one of {', '.join(SHARDINGS)}"
        )
    elif cfg.sharding in DEEPSPEED_SHARDINGS:
        on_cpu = cfg.device == "cpu" or not torch.cuda.is_available()
        if on_cpu:
            problems.append(
                f"--sharding: {cfg.sharding} is DeepSpeed ZeRO, which memfit runs on CUDA GPUs "
                "only; on the CPU use --sharding fsdp (PyTorch FSDP2: parameters, gradients and "
                "optimizer state sharded, as ZeRO-3) or --sharding none"
            )
        else:
            problems.append(
                f"--sharding: {cfg.sharding} (DeepSpeed ZeRO) is estimated and planned by memfit "
                "but not yet run by memfit train, whose guard cannot yet agree an OOM inside "
                "DeepSpeed's hooks; use --sharding fsdp (the same sharding as ZeRO-3, with an "
                "OOM-safe guard) or --sharding none"
            )
    if launched > 1 and cfg.task == "sentence-embedding":
        problems.append(
            "--task: sentence-embedding on several ranks is not built yet: each rank's in-batch "
            "negatives would be only its share of the batch, so the loss would change with the "
            "number of ranks; run it as one process (the cached loss, --loss cached-mnrl, fits "
            "any batch into memory)"
        )
    if cfg.sharding == "fsdp" and cfg.task == "sentence-embedding":
        problems.append(
            "--sharding: fsdp is built for classification and causal-lm; sentence-embedding runs "
            "with --sharding none"
        )
    if cfg.sharding == "fsdp" and cfg.lora_rank:
        problems.append("--sharding: fsdp with --lora-rank is not supported; use --sharding none")
    return problems


# --- the run ----------------------------------------------------------------------------------------
class _Log:
    """Append-only JSON Lines files, flushed line by line (a killed run keeps what it logged).

    The file is opened at the first line: a resume cuts the killed run's last lines from it
    (replacing the file) after the log object exists but before it writes.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = None

    def write(self, record: dict[str, Any]) -> None:
        if self._handle is None:
            self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class _NoLog:
    """Where a rank other than 0 writes the metrics: nowhere (rank 0 logs the whole step)."""

    def write(self, record: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume: drop the lines the killed run logged after its checkpoint (they are redone)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line a kill cut in half
        if int(record.get("step", 0)) <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    os.replace(tmp, path)


def _make_recipe(cfg: TrainConfig) -> Any:
    from memfit.train.recipes import make_recipe

    max_len = cfg.max_seq_len or cfg.seq_len
    options: dict[str, Any]
    if cfg.task == "classification":
        options = dict(
            text_column=cfg.text_column,
            label_column=cfg.label_column,
            attn_implementation=cfg.attn_implementation,
            max_seq_len=max_len or 128,
            labels=cfg.labels,
            num_labels=cfg.num_labels,
            text_pair_column=cfg.text_pair_column,
        )
    elif cfg.task == "causal-lm":
        options = dict(
            text_column=cfg.text_column,
            packing=cfg.packing,
            attn_implementation=cfg.attn_implementation,
            max_seq_len=max_len or 512,
        )
    else:
        options = dict(
            anchor_column=cfg.anchor_column,
            positive_column=cfg.positive_column,
            loss=cfg.loss or "mnrl",
            max_seq_len=max_len or 128,
        )
    recipe = make_recipe(cfg.task, model=cfg.model, **options)
    recipe.data_options = DataOptions(skip_bad_rows=cfg.skip_bad_rows, cache_dir=cfg.cache_dir)
    recipe.padding = cfg.padding
    # a length the user asked for is refused past the model's positions (a default is lowered)
    recipe.max_seq_len_given = bool(cfg.max_seq_len or cfg.seq_len)
    return recipe


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


def _resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device:
        return torch.device(cfg.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def _main_first(ranks: Any) -> Any:
    """Rank 0 runs the block first (it writes caches), the other ranks after it (they read them)."""
    if ranks is None:
        yield
        return
    if not ranks.is_main:
        ranks.barrier()
    yield
    if ranks.is_main:
        ranks.barrier()


def _free_memory(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def _plan_knobs(
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
        budget = _free_memory(device)
    if budget is None:
        # the CPU without a budget: no plan; the guard backs off if the machine runs short
        return {"source": "default (no GPU and no --gpu-memory: the whole batch, guarded)"}
    from memfit.plan import plan

    seq_len = cfg.max_seq_len or cfg.seq_len or (128 if cfg.task != "causal-lm" else 512)
    if longest:
        # a multiple of 8 (aligned shapes), never past the length the rows were cut to
        seq_len = min(-(-longest // 8) * 8, max(seq_len, longest))
    plan_options: dict[str, Any] = {}
    if world > 1:
        plan_options["world_size"] = world
    if cfg.sharding != "none":
        plan_options["sharding"] = cfg.sharding
    if cfg.lora_rank:
        # a LoRA run holds no base gradients or optimizer state: let the plan count adapters
        # where full fine-tuning would not fit (it prefers full fine-tuning's knobs otherwise,
        # which only err on the safe side)
        plan_options["allow"] = ("lora",)
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


class _PeakMemory:
    """Peak memory of one step, and of its phases (forward, backward, optimizer) where that is
    cheap: on CUDA (the allocator's own counters) and under the CPU memory cap. Without a cap the
    CPU reports the process's peak resident memory for the whole step only (each reset walks the
    page tables)."""

    PHASES = ("forward", "backward", "optimizer")
    # the extra keys of record(), in a fixed order (several ranks gather them as one vector)
    RECORD_KEYS = (*(f"{name}_peak_bytes" for name in PHASES), "reserved_bytes")

    def __init__(self, device: torch.device, cap: Any) -> None:
        self.device, self.cap = device, cap
        self._proc = Path("/proc/self/clear_refs").exists()
        self.phased = device.type == "cuda" or cap is not None
        self._phase: str | None = None
        self.phase_peaks: dict[str, int] = {}
        self._step_peak = 0
        self._reserved = 0

    def reset(self) -> None:
        """At a step's start: forget the last step's peaks."""
        self._phase, self.phase_peaks, self._step_peak, self._reserved = None, {}, 0, 0
        self._reset()

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.cap is not None:
            self.cap.reset_peak()
        elif self._proc:
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS

    def phase(self, name: str | None) -> None:
        """The phase ``name`` starts (None: no phase): the one before ends and keeps its peak."""
        if not self.phased:
            return
        current = self._current()
        if current is not None:
            self._step_peak = max(self._step_peak, current)
            if self._phase is not None:
                self.phase_peaks[self._phase] = max(self.phase_peaks.get(self._phase, 0), current)
        if self.device.type == "cuda":
            self._reserved = max(self._reserved, int(torch.cuda.max_memory_reserved(self.device)))
        self._phase = name
        self._reset()

    def _current(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.cap is not None:
            return int(self.cap.peak_bytes)
        if self._proc:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return None

    def read(self) -> int | None:
        """The step's peak: allocated bytes (CUDA), live tensor bytes (cap), or peak RSS."""
        self.phase(None)
        current = self._current()
        if current is None:
            return None
        return max(self._step_peak, current)

    def record(self) -> dict[str, int]:
        """The step's extra keys for metrics.jsonl: per-phase peaks, CUDA's reserved peak."""
        out = {
            f"{name}_peak_bytes": self.phase_peaks[name]
            for name in self.PHASES
            if name in self.phase_peaks
        }
        if self.device.type == "cuda":
            out["reserved_bytes"] = max(
                self._reserved, int(torch.cuda.max_memory_reserved(self.device))
            )
        return out


def _optimizer(name: str, model: torch.nn.Module, lr: float, weight_decay: float) -> Any:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for pname, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in pname.lower() else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(
            groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False
        )
    if name == "adamw-8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr)


def _enable_checkpointing(model: torch.nn.Module) -> None:
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


def _autocast(device: torch.device, precision: str) -> Callable[[], Any]:
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)


class _Stop:
    """SIGTERM/SIGINT: finish the step in hand, write a checkpoint, exit 0 (spot instances)."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Stop:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _versions() -> dict[str, str]:
    import transformers

    import memfit

    out = {
        "memfit": memfit.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    with contextlib.suppress(ImportError):
        import sentence_transformers

        out["sentence_transformers"] = sentence_transformers.__version__
    return out


def _save_folder(
    recipe: Any,
    folder: Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    *,
    merge_lora: bool = False,
) -> None:
    """The recipe's saved model, written beside and renamed into place.

    A LoRA model is saved as a peft adapter folder, or with ``merge_lora`` merged (from a copy:
    training goes on with the adapters) into a plain folder (``memfit.train.lora.save_lora``).
    ``state_dict``: the whole model's weights gathered from FSDP shards.
    """
    from memfit.train.lora import is_lora, save_lora

    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    from memfit.train.runfolder import removed_on_failure

    # a full disk half-way: the folder in place (if any) stays, the half-written one goes
    with removed_on_failure(tmp):
        if is_lora(recipe.model):
            save_lora(recipe, tmp, merge=merge_lora)
        elif state_dict is not None:
            recipe.save(tmp, state_dict=state_dict)
        else:
            recipe.save(tmp)
    old = folder.with_name(f".old-{folder.name}-{os.getpid()}")
    if folder.exists():
        os.rename(folder, old)
    os.rename(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def train(config: TrainConfig | None = None, /, **knobs: Any) -> TrainResult:
    """Fine-tune under the guard. ``memfit.train(task=..., model=..., train_file=..., output_dir=...)``."""
    cfg = config or TrainConfig(**knobs)
    if config is not None and knobs:
        cfg = dataclasses.replace(config, **knobs)
    from memfit.train.runfolder import RunLock

    # the output folder's lock, taken once the model is loaded, held until the run ends
    lock = RunLock(Path(cfg.output_dir))
    try:
        with contextlib.ExitStack() as closers:
            return _train(cfg, lock, closers)
    except OSError as exc:
        if exc.errno not in _DISK_ERRNOS or not _in_run_folders(cfg, exc):
            raise
        raise UsageError(_disk_message(cfg, exc)) from None
    finally:
        lock.release()


# what a user's disk or folder can do to a run: full, over quota, read-only, taken away
_DISK_ERRNOS = frozenset(
    {
        errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT,
        errno.ENOTDIR, errno.EISDIR,
    }
)  # fmt: skip


def _in_run_folders(cfg: TrainConfig, exc: OSError) -> bool:
    """A full, over-quota or read-only disk is the user's wherever it is; a missing file or a
    permission only where the run writes (elsewhere it may be a bug: a traceback)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) or not exc.filename:
        return True
    where = Path(str(exc.filename))
    return _inside(where, Path(cfg.output_dir)) or bool(
        cfg.cache_dir and _inside(where, Path(cfg.cache_dir))
    )


def _disk_message(cfg: TrainConfig, exc: OSError) -> str:
    """One line for a write the disk refused: which flag's folder, why, and what is kept."""
    from memfit.train import checkpoint as ck

    out = Path(cfg.output_dir)
    where = Path(str(exc.filename)) if exc.filename else out
    flag = "--output-dir"
    if cfg.cache_dir and _inside(where, Path(cfg.cache_dir)):
        flag = "--cache-dir"
    elif not _inside(where, out):
        flag = ""
    steps = ck.completed_steps(out / "checkpoints")
    kept = (
        f"; the newest checkpoint, {out / 'checkpoints' / f'step-{steps[-1]}'}, is whole: make "
        "room and run again with --resume"
        if steps
        else "; no checkpoint was written"
        + ("" if cfg.save_every else " (--save-every N keeps one every N steps)")
        if (out / "run.json").exists()
        else ""  # before the first step: nothing of the run was lost
    )
    return f"{flag + ': ' if flag else ''}{where}: {exc.strerror or exc}{kept}"


def _inside(path: Path, folder: Path) -> bool:
    try:
        Path(os.path.abspath(path)).relative_to(os.path.abspath(folder))
    except ValueError:
        return False
    return True


def _train(cfg: TrainConfig, lock: Any, closers: contextlib.ExitStack) -> TrainResult:
    from transformers.utils import logging as hf_logging

    from memfit.guard import Guard, StepTooLarge, memory_cap

    hf_logging.disable_progress_bar()  # the run has its own progress line

    # every problem with the flags and every bad row of both files, at once, before anything is
    # loaded or written
    problems = config_problems(cfg)
    recipe: Any = None
    try:
        recipe = _make_recipe(cfg)
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
    from memfit.train import runfolder

    done = runfolder.finished(Path(cfg.output_dir)) if cfg.resume else None
    if done is not None:
        changed = _changed_settings(runfolder.run_config(Path(cfg.output_dir)), _step_settings(cfg))
        if changed:
            raise UsageError(
                f"--resume: the run in {cfg.output_dir} finished with other settings that decide "
                f"which samples each step holds: {'; '.join(changed)}. Start a new run in "
                "another folder (--model on its model/ to train it further)"
            )
        if _longer(runfolder.run_config(Path(cfg.output_dir)), cfg):
            done = None  # more epochs or steps: train on from the newest checkpoint
    if done is not None:
        # nothing to redo: retraining would replace the finished model/ with the same steps
        steps_done = int(done.get("steps", 0))
        if not cfg.quiet:
            _say(
                f"memfit: the run in {cfg.output_dir} already finished ({steps_done} steps; its "
                f"model is in {Path(cfg.output_dir) / 'model'}): nothing to resume. To train it "
                "further, start a new run with --model on that folder"
            )
        return TrainResult(
            Path(cfg.output_dir),
            steps_done,
            int(done.get("samples_seen", 0)),
            done.get("final_loss"),
            dict(done.get("eval_metrics") or {}),
            "finished",
        )
    skipped = list(recipe.data_options.skipped)
    device = _resolve_device(cfg)
    if device.type == "cpu" and cfg.precision not in (None, "fp32"):
        raise UsageError(
            f"--precision: {cfg.precision} mixed precision needs a CUDA GPU; use fp32 on the CPU"
        )
    ranks = None
    from memfit.train.distributed import init_ranks, launched_world_size

    if launched_world_size() > 1:
        # torchrun / accelerate launch started several ranks: join them (gloo on the CPU, NCCL on
        # GPUs); each rank then has its own GPU
        ranks = init_ranks(device.type)
        device = ranks.device
    world = ranks.world_size if ranks is not None else 1
    rank = ranks.rank if ranks is not None else 0
    main = rank == 0

    # the model loads before anything is written: a model that cannot be had leaves no folder
    torch.manual_seed(cfg.seed)
    recipe.build(train_rows)
    if cfg.lora_rank:
        from memfit.train.lora import add_lora

        # the adapters the estimator counts (its own function picks the targets), alpha 2r,
        # dropout 0.1; a target name the model lacks is exit 2 here, before anything is written
        add_lora(recipe, cfg)
    model = recipe.model
    if ranks is not None:
        # a dropout stream per rank (the weights are made equal below, on the device)
        torch.manual_seed(cfg.seed + rank)
    # tokenized once, cached in --cache-dir (a second run with the same data reads it back);
    # rank 0 writes the cache, the other ranks read it back
    with _main_first(ranks):
        train_rows = recipe.prepare(train_rows)
        if eval_rows is not None:
            eval_rows = recipe.prepare(eval_rows)
    lengths = all_lengths(train_rows, recipe.lengths)

    # planned for the data's longest sample (before the model takes any GPU memory); with
    # several ranks rank 0 plans for the smallest free memory and every rank takes its plan
    if ranks is None:
        planned = _plan_knobs(cfg, device, longest=max(lengths) if lengths else None)
    else:
        free = _free_memory(device)
        smallest = (
            ranks.least(free if free is not None else -1)[0] if device.type == "cuda" else None
        )
        planned = ranks.broadcast_object(
            _plan_knobs(
                cfg,
                device,
                longest=max(lengths) if lengths else None,
                world=world,
                free_bytes=smallest if smallest and smallest > 0 else None,
            )
            if main
            else None
        )
    chosen = planned.get("plan", {})
    per_step = cfg.effective_batch_size
    micro = int(cfg.micro_batch_size or chosen.get("micro_batch_size") or per_step)
    if chosen.get("loss") == "cached-mnrl" and cfg.mini_batch_size is None:
        micro = int(chosen.get("mini_batch_size") or micro)
    if cfg.mini_batch_size is not None and cfg.task == "sentence-embedding":
        micro = cfg.mini_batch_size
    micro = min(micro, per_step)
    # a token budget per micro-batch (padding included): given, or the plan's micro-batch at
    # its sequence length; then short rows go many to a micro-batch and long rows few
    max_tokens = cfg.max_tokens_per_micro_batch or chosen.get("max_tokens_per_micro_batch")
    if max_tokens and cfg.micro_batch_size is None and recipe.splittable:
        micro = per_step  # the budget bounds the micro-batch, not a row count
    if not recipe.splittable:
        max_tokens = None
    precision = cfg.precision or chosen.get("precision") or "fp32"
    if device.type == "cpu" and precision != "fp32":
        precision = "fp32"  # a plan for --gpu-memory on a CPU run: the CPU trains in fp32
    checkpointing = bool(
        cfg.gradient_checkpointing
        if cfg.gradient_checkpointing is not None
        else chosen.get("gradient_checkpointing", False)
    )
    recipe.to(device)
    if ranks is not None:
        # rank 0's weights everywhere (a fresh classifier head is random), over the device's own
        # backend (NCCL moves GPU tensors, gloo CPU ones)
        ranks.broadcast_parameters(model)

    out = Path(cfg.output_dir)
    ckpt_dir = out / "checkpoints"
    from memfit.train import checkpoint as ck

    if main:
        # the folder is made and locked (refused if another run holds it, or it is not memfit's)
        lock.acquire(resume=cfg.resume)
        if cfg.skip_bad_rows:
            write_skipped(out / "skipped_rows.jsonl", skipped)
            if skipped and not cfg.quiet:
                _say(
                    f"memfit: skipped {len(skipped)} bad row(s); each is listed in "
                    f"{out / 'skipped_rows.jsonl'}"
                )
        ck.clean_temporaries(ckpt_dir)
        runfolder.clean_temporaries(out)
    if ranks is not None:
        # the folder exists before any rank writes to it
        ranks.barrier()
    if checkpointing:
        _enable_checkpointing(model)
    model.train()
    sharded = None
    if cfg.sharding == "fsdp":
        from memfit.train.fsdp import shard_model

        # FSDP2 per transformer block, then the root; the optimizer is built on the shards
        sharded = shard_model(model, ranks, precision=precision, device=device)
    optimizer = _optimizer(cfg.optimizer, model, cfg.lr, cfg.weight_decay)
    rows_n = len(train_rows)
    steps_per_epoch = math.ceil(rows_n / per_step)
    total_steps = cfg.max_steps or steps_per_epoch * cfg.epochs
    from transformers import get_scheduler

    scheduler = get_scheduler(
        cfg.lr_scheduler,
        optimizer,
        num_warmup_steps=int(cfg.warmup_ratio * total_steps),
        num_training_steps=total_steps,
    )
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" and device.type == "cuda" else None
    autocast = _autocast(device, precision)
    params = [p for p in model.parameters() if p.requires_grad]

    # one metrics line per step, from rank 0; every rank appends its own events (with its rank)
    metrics: Any = _Log(out / "metrics.jsonl") if main else _NoLog()
    events: Any = _Log(out / "events.jsonl")
    # closed when the run ends, however it ends (a stopped run leaves no file open)
    closers.callback(lambda: (metrics.close(), events.close()))
    if main:
        from memfit.train.loggers import open_reporters

        # --report-to: the same lines to TensorBoard / W&B too (rank 0: the whole step's figures)
        metrics, events = open_reporters(
            cfg.report_to, out, dataclasses.asdict(cfg), metrics, events
        )
    tag = {"rank": rank} if ranks is not None else {}

    def on_event(event: dict[str, Any]) -> None:
        events.write({"time": round(time.time(), 3), **tag, **event})
        if (
            event["type"] in ("oom", "backoff", "grow")
            and not cfg.quiet
            and (main or event["type"] == "oom")
        ):
            _say(f"memfit guard: {'' if main else f'rank {rank}: '}{_describe(event)}")

    if ranks is not None:
        # what the sync points write into: allocated now, before any memory cap
        ranks.prepare(params)
        if sharded is not None:
            ranks.reduces_in_backward = True
    guard = Guard(
        micro,
        target_micro_batch_size=micro,
        grow_after=cfg.grow_after,
        on_event=on_event,
        device=device,
        max_tokens=max_tokens,
        ranks=ranks,
        pad_pass=sharded.pad_pass(recipe, _take(train_rows, [0])) if sharded is not None else None,
        on_recover=sharded.reset if sharded is not None else None,
    )
    step, epoch, position, samples_seen = 0, 0, 0, 0
    best: float | None = None
    last_eval: dict[str, float] = {}
    # what decides which samples each step holds: a resume must find them unchanged
    settings = _step_settings(cfg, rows_n, lengths)
    if lock.note is not None:
        on_event({"type": "lock", "note": lock.note})

    def load(path: Path) -> dict[str, Any]:
        """Check the checkpoint's settings against this run's, then load it."""
        changed = _changed_settings(ck.read_state(path).get("settings"), settings)
        if changed:
            raise UsageError(
                f"--resume: {path} was written by a run with other settings that decide which "
                f"samples each step holds: {'; '.join(changed)}. Resume with the run's settings, "
                "or start a new run in another folder"
            )
        state = ck.read_checkpoint(
            path,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            device=device,
            rank=rank,
            world_size=world,
            sharded=sharded,
        )
        guard.load_state_dict(state["guard"])
        bases = list(getattr(scheduler, "base_lrs", []))
        if bases and any(not math.isclose(b, cfg.lr) for b in bases):
            # --lr of this resume (a run stopped at a NaN, lower it): the schedule, scaled
            for i, (group, base) in enumerate(zip(optimizer.param_groups, bases, strict=True)):
                group["lr"] *= cfg.lr / base
                group["initial_lr"] = cfg.lr
                scheduler.base_lrs[i] = cfg.lr
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
            on_event({"type": "lr", "step": state["step"], "from": bases[0], "to": cfg.lr})
        return state

    def skip(path: Path, problem: str) -> None:
        # moved out of the checkpoints a resume or --save-total-limit counts (kept to look at)
        aside = ck.set_aside(path)
        on_event(
            {
                "type": "checkpoint_skipped",
                "checkpoint": str(path),
                "reason": problem,
                "moved_to": str(aside),
            }
        )
        if main and not cfg.quiet:
            _say(
                f"memfit: checkpoint {path} skipped: {problem} (moved to {aside.name}); trying "
                "the one before it"
            )

    picked: tuple[Path, dict[str, Any]] | None = None
    if cfg.resume and ranks is None:
        picked = _pick_checkpoint(ckpt_dir, load, skip)
    elif cfg.resume and ranks is not None:
        # rank 0 verifies the checkpoints; every rank loads the one it picked
        found = _pick_checkpoint(ckpt_dir, None, skip) if main else None
        chosen = ranks.broadcast_object(found[0] if found is not None else None)
        picked = (chosen, load(chosen)) if chosen is not None else None
    if picked is not None:
        resume_from, state = picked
        step, epoch, position = state["step"], state["epoch"], state["position"]
        samples_seen, best = state["samples_seen"], state.get("best")
        on_event(
            {
                "type": "resume",
                "step": step,
                "checkpoint": str(resume_from),
                "micro_batch_size": guard.micro_batch_size,
            }
        )
    elif cfg.resume:
        on_event(
            {
                "type": "resume",
                "step": 0,
                "checkpoint": None,
                "note": "no checkpoint yet: from the start"
                if not ck.completed_steps(ckpt_dir)
                else "no checkpoint could be read: from the start",
            }
        )
    if cfg.resume and main:
        # the killed run's lines after its checkpoint are redone: drop them before appending
        _truncate_metrics(out / "metrics.jsonl", step)

    run_json = {
        "config": dataclasses.asdict(cfg),
        "resolved": {
            "device": str(device),
            "micro_batch_size": micro,
            "precision": precision,
            "gradient_checkpointing": checkpointing,
            "steps": total_steps,
            "steps_per_epoch": steps_per_epoch,
            "train_rows": rows_n,
            "eval_rows": len(eval_rows) if eval_rows is not None else 0,
            "skipped_rows": len(skipped),
            "max_tokens_per_micro_batch": max_tokens,
            "pad_to_multiple_of": recipe.pad_multiple,
            "group_by_length": cfg.group_by_length,
            "world_size": world,
            "sharding": cfg.sharding,
            "backend": ranks.backend if ranks is not None else None,
            # a fine-tuned classifier's head: kept (same labels) or replaced (said on stderr)
            "classifier_head": getattr(recipe, "head_note", None),
        },
        "plan": planned,
        "versions": _versions(),
    }
    if main:
        runfolder.write_json(out / "run.json", run_json)

    def permutation(ep: int) -> list[int]:
        # a pure function of (seed, epoch): a resumed run recomputes it and goes on at position
        if cfg.group_by_length and lengths is not None:
            return length_grouped_order(lengths, per_step, seed=cfg.seed, epoch=ep)
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + ep)
        return torch.randperm(rows_n, generator=g).tolist()

    def save(reason: str) -> None:
        state = {
            "epoch": epoch,
            "position": position,
            "samples_seen": samples_seen,
            "best": best,
            "guard": guard.state_dict(),
            "reason": reason,
            "settings": settings,
        }
        path = ck.write_checkpoint(
            ckpt_dir,
            step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            state=state,
            keep=cfg.save_total_limit,
            ranks=ranks,
            sharded=sharded,
        )
        if main:
            on_event({"type": "checkpoint", "step": step, "path": str(path), "reason": reason})

    # each rank evaluates every world-th eval row; the metrics are reduced over all of them
    local_eval = (
        _take(eval_rows, range(rank, len(eval_rows), world))
        if eval_rows is not None and ranks is not None
        else eval_rows
    )

    def evaluate() -> dict[str, float]:
        nonlocal best
        assert local_eval is not None
        model.eval()
        try:
            result = guard.evaluate(local_eval, recipe, autocast=autocast)
        finally:
            model.train()
        record = {
            "step": step,
            "samples_seen": samples_seen,
            **{f"eval_{k}": v for k, v in result.items()},
        }
        metrics.write(record)
        if main:
            on_event({"type": "eval", "step": step, **{f"eval_{k}": v for k, v in result.items()}})
        value = result.get(recipe.metric)
        if value is not None and (
            best is None or (value > best if recipe.greater_is_better else value < best)
        ):
            best = value
            save_model(out / "best")
        return result

    def save_model(folder: Path) -> None:
        """The model folder (rank 0 writes it; under FSDP every rank gathers the weights)."""
        weights = sharded.full_state_dict() if sharded is not None else None
        if main:
            _save_folder(recipe, folder, state_dict=weights, merge_lora=cfg.merge_lora)

    def guarded_step(rows: list[Row], number: int) -> float:
        """One step's forward and backward under the guard (this rank's share of ``rows``); after
        micro-batch 1 fails, the next cure (gradient checkpointing), else stop with a checkpoint
        (exit 3). Returns the step's loss (this rank's part of it with several ranks)."""
        nonlocal checkpointing
        total_units = recipe.units(rows) if recipe.splittable else len(rows)
        if ranks is not None:
            rows = shard_rows(rows, recipe.lengths(rows) if rows else None, rank, world)
        while True:
            try:
                return guard.step(
                    rows,
                    recipe,
                    params=params,
                    autocast=autocast,
                    scale=(scaler.scale if scaler is not None else _identity),
                    step=number,
                    total_units=total_units,
                )
            except StepTooLarge as exc:
                # every rank gets here together (the guard agreed on it) and decides alike
                cure = _next_cure(model, checkpointing)
                if cure is None:
                    save("nothing fits")
                    on_event(
                        {
                            "type": "stop",
                            "step": step,
                            "reason": "even micro-batch 1 does not fit",
                            "error": str(exc),
                        }
                    )
                    raise NothingFitsError(
                        f"step {number}: even micro-batch 1 runs out of memory "
                        f"({exc}); a checkpoint is in {ckpt_dir}. Try --gradient-checkpointing, "
                        "--precision bf16 on a GPU, --max-seq-len, or a larger --memory-cap/GPU"
                    ) from None
                checkpointing = True
                on_event({"type": "backoff", "step": number, "cure": cure})
                # one row per micro-batch (a budget of one token leaves each row alone)
                guard.micro_batch_size = 1
                if guard.max_tokens is not None:
                    guard.max_tokens = 1

    def update(number: int, *, loss: float | None = None, probe: bool = False) -> float | None:
        """Clip the whole step's gradient and step the optimizer; the returned gradient norm is
        None without clipping. No micro-batch changes what this phase holds (weights, gradients,
        optimizer state), so an OOM here is the end: exit 3 with what would help (on every rank:
        they agree on it). A loss or gradient that is not finite stops the run before the update
        (exit 4), unless the fp16 loss scaler is on: it skips such a step itself (and says so)."""
        grad_norm, norm = None, None
        with _oom_caught() as caught:
            if scaler is not None and not probe:
                scaler.unscale_(optimizer)
            if cfg.max_grad_norm:
                grad_norm = norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            elif scaler is None and not probe:
                # the norm alone (a factor of 1 on every gradient), for the finite check
                norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf))
        agree_oom(number, caught.error)
        if scaler is None and not probe:
            values = {"loss": loss, "gradient norm": norm}
            bad = [
                f"the {k} is {v}"
                for k, v in values.items()
                if v is not None and not math.isfinite(v)
            ]
            if ranks is not None and ranks.anyone(bool(bad)) and not bad:
                bad = ["another rank's loss or gradient is not finite"]
            if bad:
                stop_not_finite(number, bad)
        with _oom_caught() as caught:
            if scaler is not None and not probe:
                scale = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
                if scaler.get_scale() < scale:
                    on_event(
                        {
                            "type": "skip",
                            "step": number,
                            "reason": "fp16 loss scaler: the gradient is not finite; the update "
                            f"is skipped and the scale lowered from {scale:g} to "
                            f"{scaler.get_scale():g}",
                        }
                    )
            else:
                optimizer.step()
        agree_oom(number, caught.error)
        return grad_norm

    def agree_oom(number: int, error: str | None) -> None:
        """Every rank learns whether any ran out of memory in the update: then all stop."""
        if ranks is not None and ranks.anyone(error is not None) and error is None:
            error = "another rank ran out of memory in its optimizer step"
        if error is None:
            return
        on_event({"type": "oom", "step": number, "phase": "optimizer", "error": error})
        on_event({"type": "stop", "step": step, "reason": "the optimizer step does not fit"})
        raise NothingFitsError(
            f"step {number}: the optimizer step runs out of memory ({error}). It holds the "
            "weights, their gradients and the optimizer state whatever the micro-batch: try "
            "--optimizer adafactor (or adamw-8bit on CUDA), --lora-rank 8, "
            + ("--sharding fsdp, " if ranks is not None and sharded is None else "")
            + "or more memory"
        )

    def stop_not_finite(number: int, bad: list[str]) -> None:
        """Stop before an update that would write NaN or inf into the weights. The weights are
        still those of the step before: they are checkpointed when they are finite (a run whose
        weights already went bad keeps its older checkpoints and adds none)."""
        optimizer.zero_grad(set_to_none=True)
        on_event({"type": "not_finite", "step": number, "problems": bad})
        weights_ok = all(bool(torch.isfinite(p.detach()).all()) for p in params)
        if ranks is not None:
            weights_ok = not ranks.anyone(not weights_ok)
        if weights_ok:
            save("not finite")
            kept = f"the weights of step {step} are in {ckpt_dir / f'step-{step}'}"
        else:
            steps_kept = ck.completed_steps(ckpt_dir)
            kept = "the weights were already not finite" + (
                f"; the newest checkpoint is {ckpt_dir / f'step-{steps_kept[-1]}'}"
                if steps_kept
                else " and there is no checkpoint"
            )
        on_event({"type": "stop", "step": step, "reason": "loss or gradient not finite"})
        raise TrainingStoppedError(
            f"step {number}: {' and '.join(bad)}; stopped before the update ({kept}). Lower "
            f"--lr{'' if cfg.max_grad_norm else ' or set --max-grad-norm'}, check the data, then "
            "run again with --resume"
        )

    def probe() -> None:
        """Step 0: the longest rows of the data as one step, so that an OOM the data holds for
        later comes now and the micro-batch (token budget) is corrected before step 1. Then
        everything it changed is put back: weights, optimizer state, gradients, RNG."""
        assert snapshot is not None and lengths is not None
        longest = sorted(range(rows_n), key=lambda i: -lengths[i])[:per_step]
        rows = _take(train_rows, longest)
        rng = _rng_state(device)
        fresh = not optimizer.state
        before = (guard.micro_batch_size, guard.max_tokens)
        ooms = [0]

        def count(event: dict[str, Any]) -> None:
            ooms[0] += event["type"] == "oom"
            on_event(event)

        guard.on_event = count
        try:
            guarded_step(rows, 0)
            if fresh:
                # a fresh optimizer allocates its state in its first step: part of the peak
                update(0, probe=True)
        finally:
            guard.on_event = on_event
            optimizer.zero_grad(set_to_none=True)
            if fresh:
                # the state the probe created goes; step 1 creates it anew, as without a probe
                optimizer.state.clear()
            with torch.no_grad():
                for param, saved in zip(params, snapshot, strict=True):
                    param.copy_(saved)
            _set_rng_state(device, rng)
        # the plan is corrected: a later grow never goes past what the longest rows allowed
        guard.target_micro_batch_size = guard.micro_batch_size
        guard.target_max_tokens = guard.max_tokens
        guard.clean_steps = 0
        on_event(
            {
                "type": "probe",
                "step": 0,
                "rows": len(rows),
                "longest_tokens": lengths[longest[0]] if longest else 0,
                "ooms": ooms[0],
                "micro_batch_size": guard.micro_batch_size,
                "max_tokens_per_micro_batch": guard.max_tokens,
                "changed": (guard.micro_batch_size, guard.max_tokens) != before,
            }
        )

    # a copy of the trained weights (on the CPU, outside the memory cap) that the probe puts
    # back; frozen ones (LoRA's base model) are never changed by an optimizer step
    snapshot = (
        [p.detach().to("cpu", copy=True) for p in params]
        if cfg.probe and lengths is not None and step < total_steps
        else None
    )
    peak = None
    stopped = "done"
    loss_value: float | None = None
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        cap = stack.enter_context(memory_cap(cfg.memory_cap, device))
        if cap is not None:
            cap.track(model, optimizer)
            if ranks is not None:
                # written in place at every sync point: held already, never a new allocation
                cap.track(*ranks.buffers())
        peak = _PeakMemory(device, cap)
        guard.on_phase = peak.phase
        if cfg.memory_snapshot and device.type == "cuda":
            guard.on_oom = _snapshot_writer(out / "memory-snapshots", on_event)
        stop = stack.enter_context(_Stop())
        if snapshot is not None:
            probe()
            snapshot = None
        perm = permutation(epoch)
        progress = _Progress(total_steps, step, quiet=cfg.quiet or not main)
        while step < total_steps:
            if position >= rows_n:
                epoch, position = epoch + 1, 0
                perm = permutation(epoch)
            indices = perm[position : position + per_step]
            # the whole step's rows on every rank; guarded_step keeps this rank's share
            rows = _take(train_rows, indices)
            peak.reset()
            t0 = time.perf_counter()
            loss_value = guarded_step(rows, step + 1)
            peak.phase("optimizer")  # clipping, the update and zero_grad
            grad_norm = update(step + 1, loss=loss_value)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            position += len(rows)
            samples_seen += len(rows)
            step_peak = peak.read()
            phase_peaks = peak.record()
            tokens = guard.last_step.get("tokens") if recipe.splittable else None
            padded = guard.last_step.get("padded_tokens") if recipe.splittable else None
            rank_peaks: list[int | None] | None = None
            if ranks is not None:
                # the step's loss and tokens are sums over the ranks, its peak their largest
                keys = ["loss", "tokens", "padded", "peak", *_PeakMemory.RECORD_KEYS]
                local = [
                    loss_value,
                    tokens,
                    padded,
                    step_peak,
                    *(phase_peaks.get(k) for k in keys[4:]),
                ]
                gathered = ranks.gather_floats(local)
                columns = list(zip(*gathered, strict=True))
                loss_value = _sum_or_none(columns[0])
                tokens, padded = (
                    _int_or_none(_sum_or_none(columns[1])),
                    _int_or_none(_sum_or_none(columns[2])),
                )
                rank_peaks = [_int_or_none(x) for x in columns[3]]
                step_peak = _int_or_none(_max_or_none(columns[3]))
                phase_peaks = {
                    key: int(value)
                    for key, column in zip(keys[4:], columns[4:], strict=True)
                    if (value := _max_or_none(column)) is not None
                }
            seconds = time.perf_counter() - t0
            record = {
                "step": step,
                "epoch": epoch,
                "loss": loss_value,
                "samples_seen": samples_seen,
                "micro_batch_size": guard.micro_batch_size,
                "gradient_accumulation_steps": guard.last_step.get("chunks", 1)
                if recipe.splittable
                else 1,
                "max_tokens_per_micro_batch": guard.max_tokens,
                "tokens": tokens,
                "padded_tokens": padded,
                "peak_bytes": step_peak,
                **phase_peaks,
                "lr": lr,
                "grad_norm": grad_norm,
                "seconds": round(seconds, 4),
                "samples_per_second": round(len(rows) / seconds, 2) if seconds > 0 else None,
            }
            if ranks is not None:
                record["world_size"] = world
                record["rank_peak_bytes"] = rank_peaks
            metrics.write(record)
            progress.update(record)
            if (
                eval_rows is not None
                and cfg.eval_every
                and step % cfg.eval_every == 0
                and step < total_steps
            ):
                last_eval = evaluate()
            if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
                save("every")
            # a signal reaches every rank (the launcher forwards it), but maybe not between
            # the same two steps: the ranks agree to stop after the same one
            signalled = stop.signal is not None
            if ranks is not None:
                signalled = ranks.anyone(signalled)
            if signalled:
                reason = f"signal {stop.signal}" if stop.signal is not None else "signal"
                save(reason)
                on_event({"type": "stop", "step": step, "reason": reason})
                stopped = "signal"
                break
        progress.close()
        if stopped == "done":
            if eval_rows is not None:
                last_eval = evaluate()
            if cfg.save_every:
                # first: a disk that fills up at the model's save loses no step (--resume then
                # finds the last step done and only writes the model)
                save("end")
            save_model(out / "model")
            if main:
                on_event(
                    {
                        "type": "stop",
                        "step": step,
                        "reason": "done",
                        "seconds": round(time.perf_counter() - started, 2),
                    }
                )
                # a --resume of this folder now has nothing to do (and says so)
                run_json["result"] = {
                    "stopped": "done",
                    "steps": step,
                    "samples_seen": samples_seen,
                    "final_loss": loss_value,
                    "eval_metrics": last_eval,
                }
                runfolder.write_json(out / "run.json", run_json)
    if ranks is not None:
        # every rank is done writing before any leaves (rank 0's model folder included)
        ranks.barrier()
        ranks.close()
    return TrainResult(out, step, samples_seen, loss_value, last_eval, stopped)


class _Caught:
    error: str | None = None


@contextlib.contextmanager
def _oom_caught() -> Any:
    """Catch an out-of-memory error (its first line lands in ``.error``); others propagate."""
    from memfit.guard import is_oom

    caught = _Caught()
    try:
        yield caught
    except Exception as exc:
        if not is_oom(exc):
            raise
        text = str(exc).strip()
        caught.error = text.splitlines()[0] if text else type(exc).__name__


def _pick_checkpoint(
    folder: Path,
    load: Callable[[Path], dict[str, Any]] | None,
    skip: Callable[[Path, str], None],
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies (and loads, with ``load``): its path and state.

    Each one passed over is handed to ``skip`` with the reason. A refused resume (UsageError:
    changed settings) and an out-of-memory error are not a damaged checkpoint: they propagate.
    """
    from memfit.guard import is_oom
    from memfit.train import checkpoint as ck

    for number in reversed(ck.completed_steps(folder)):
        path = folder / f"step-{number}"
        problem = ck.verify(path)
        if problem is None:
            try:
                return path, (load(path) if load is not None else ck.read_state(path))
            except UsageError:
                raise
            except Exception as exc:
                if is_oom(exc):
                    raise
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                problem = f"unreadable ({type(exc).__name__}{': ' + first[:200] if first else ''})"
        skip(path, problem)
    return None


# what decides which samples each step holds, and the flag that sets it
_STEP_FLAGS = {
    "effective_batch_size": "--effective-batch-size",
    "seed": "--seed",
    "group_by_length": "--group-by-length",
    "packing": "--packing",
    "max_seq_len": "--max-seq-len",
}


def _step_settings(
    cfg: TrainConfig, rows: int | None = None, lengths: Sequence[int] | None = None
) -> dict[str, Any]:
    """The settings a checkpoint records so that a resume can check them: the flags that decide
    which samples each step holds, the number of training rows and a digest of their lengths in
    tokens (a changed file almost always changes one)."""
    import array
    import hashlib

    digest = (
        hashlib.sha256(array.array("q", lengths).tobytes()).hexdigest()[:16]
        if lengths is not None
        else None
    )
    return {
        **{key: getattr(cfg, key) for key in _STEP_FLAGS},
        "train_rows": rows,
        "train_lengths": digest,
    }


def _longer(saved: Any, cfg: TrainConfig) -> bool:
    """Whether this run asks for another length than the finished run in the folder had (its
    epochs or steps): then it trains on from the newest checkpoint."""
    if not isinstance(saved, dict):
        return False
    return (saved.get("epochs"), saved.get("max_steps")) != (cfg.epochs, cfg.max_steps)


def _changed_settings(saved: Any, now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's settings and this run's, one phrase each (none for a
    checkpoint of a memfit version that recorded no settings)."""
    if not isinstance(saved, dict):
        return []
    changed = [
        f"{flag} {saved[key]} then, {now[key]} now"
        for key, flag in _STEP_FLAGS.items()
        if key in saved and saved[key] != now[key]
    ]
    if now["train_rows"] is None:
        pass  # a run's config (before its data is read): the flags only
    elif saved.get("train_rows") is not None and saved["train_rows"] != now["train_rows"]:
        changed.append(f"--train-file {saved['train_rows']} rows then, {now['train_rows']} now")
    elif saved.get("train_lengths") is not None and saved["train_lengths"] != now["train_lengths"]:
        changed.append("--train-file: its rows are not the ones trained on (their lengths differ)")
    return changed


def _sum_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _max_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


# at most this many snapshots a run (each is tens of MB)
MAX_SNAPSHOTS = 3


def _snapshot_writer(
    folder: Path, on_event: Callable[[dict[str, Any]], None]
) -> Callable[[BaseException], None]:
    """Start recording the CUDA allocator's history; the returned hook dumps a snapshot of it
    when the guard catches an OOM (before the failed graph is released, so the snapshot shows
    what filled the memory)."""
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    written: list[Path] = []

    def dump(exc: BaseException) -> None:
        if len(written) >= MAX_SNAPSHOTS:
            return
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"oom-{len(written) + 1}.pickle"
        tmp = path.with_name(f".{path.name}.tmp")
        torch.cuda.memory._dump_snapshot(str(tmp))
        os.replace(tmp, path)
        written.append(path)
        on_event({"type": "memory_snapshot", "path": str(path), "error": str(exc)[:200]})

    return dump


def _take(rows: Sequence[Row], indices: Sequence[int]) -> list[Row]:
    """Rows by index: one read of an Arrow table, or list items."""
    if isinstance(rows, RowTable):
        return rows.rows(indices)
    return [rows[i] for i in indices]


def _rng_state(device: torch.device) -> dict[str, Any]:
    import random

    import numpy as np

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(device: torch.device, state: dict[str, Any]) -> None:
    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _next_cure(model: torch.nn.Module, checkpointing: bool) -> str | None:
    """What the plan allows after micro-batch 1: gradient checkpointing, once."""
    if checkpointing:
        return None
    try:
        _enable_checkpointing(model)
    except UsageError:
        return None
    return "gradient checkpointing"


def _describe(event: dict[str, Any]) -> str:
    step = event.get("step")
    if event["type"] == "oom":
        if event.get("phase") == "optimizer":
            return f"out of memory in the optimizer step of step {step}"
        where = f"micro-batch {event.get('micro_batch_size')}"
        if event.get("max_tokens") is not None:
            where += f" ({event.get('padded_tokens')} tokens, budget {event['max_tokens']})"
        return f"out of memory at step {step} with {where}"
    if event["type"] == "backoff":
        if event.get("cure"):
            return f"step {step}: {event['cure']} on, micro-batch 1, step re-run from its start"
        if "max_tokens_to" in event:
            return (
                f"step {step}: token budget {event['max_tokens_from']} → "
                f"{event['max_tokens_to']}, step re-run from its start"
            )
        return f"step {step}: micro-batch {event.get('from')} → {event.get('to')}, step re-run from its start"
    if "max_tokens_to" in event:
        return f"step {step}: trying a token budget of {event['max_tokens_to']}"
    return f"step {step}: trying micro-batch {event.get('to')}"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class _Progress:
    """A rich progress bar on a terminal; a plain line every ~5 % of the run otherwise."""

    def __init__(self, total: int, done: int, *, quiet: bool = False) -> None:
        self.total = total
        self.every = max(1, total // 20)
        self.quiet = quiet
        self._bar: Any = None
        if sys.stderr.isatty() and not quiet:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=total, completed=done, info="")

    def update(self, record: dict[str, Any]) -> None:
        peak = record.get("peak_bytes")
        info = (
            f"loss {record['loss']:.4f}  {record.get('samples_per_second') or 0:.1f} samples/s  "
            f"micro {record['micro_batch_size']}"
            + (f"  peak {peak / 2**20:.0f} MiB" if peak else "")
        )
        if self._bar is not None:
            self._bar.update(self._task, completed=record["step"], info=info)
        elif not self.quiet and (record["step"] % self.every == 0 or record["step"] == self.total):
            _say(f"step {record['step']}/{self.total}  {info}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
