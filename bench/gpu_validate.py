"""Validate memfit's CUDA estimates against real fine-tuning steps on a GPU.

For every case of a matrix (model × precision × gradient checkpointing × shape × attention, plus a
few eval steps) the parent process asks ``memfit.estimate.estimate(..., device="cuda")`` for the
peak, and a *fresh child process* runs the same step for real (``memfit.estimate.workload``: the
very functions the estimator traces), so the caching allocator and its peak statistics start clean:

1. before CUDA is touched: the device memory already used (nvidia-smi), i.e. other processes;
2. ``torch.cuda.init()``; the model built from its config (random weights) and moved to the GPU,
   the optimizer, ``WARMUP_STEPS`` warm-up steps (the optimizer state exists: steady state);
3. ``torch.cuda.reset_peak_memory_stats()``, one measured step, ``synchronize()``;
4. ``max_memory_allocated``, ``max_memory_reserved`` and the CUDA context:
   ``(total - free) - memory_reserved() - used before`` from ``mem_get_info`` at the end
   (nvidia-smi's per-process figure minus ``memory_reserved()`` is recorded beside it).

Measured total = ``max_memory_reserved + context``, which is what the estimate's ``total_bytes``
predicts. Errors are ``(estimated - measured) / measured`` in %, for the total, the reserved peak
and the allocated peak. One JSON file per run (``--out``, default ``bench/results``), rewritten
after every case so that an interrupted run still leaves its results.

Usage::

    python bench/gpu_validate.py                       # default matrix: 45 cases, sized for < 9 min on an H100
    python bench/gpu_validate.py --quick               # 6 cases
    python bench/gpu_validate.py --qlora               # QLoRA steps (needs bitsandbytes), 8 cases
    python bench/gpu_validate.py --new-knobs --out DIR --time-budget 170
        # 16 cases of the levers since the last GPU run: QLoRA nf4/int8, 8-bit and paged
        # optimizers, 16-bit bases and pure bf16, fused-linear cross-entropy (Liger on CUDA),
        # activation offloading (TRL) and optimizer offload (torchao), round-robin by kind
    python bench/gpu_validate.py --new-knobs --only 9,10 --memory-history DIR/history --out DIR
        # each case's CUDA caching-allocator history (torch.cuda.memory._snapshot, one pickle per
        # case) beside its row: memfit.estimate.device.CachingAllocator fed that history's
        # allocations and frees says whether a gap is the allocator model's or the step's
    python bench/gpu_validate.py --plans-only --out DIR --time-budget 60
        # no estimator cases: three plans (bert-base, gpt2, LoRA on SmolLM2-135M), made at once
        # in three processes, each run for real under set_per_process_memory_fraction(budget);
        # "fits" per plan
    python bench/gpu_validate.py --models gpt2 --precisions bf16 --limit 5
    python bench/gpu_validate.py --plan-check          # + memfit.plan against real runs under a budget
    python bench/gpu_validate.py --list                # print the cases, run nothing
    python bench/gpu_validate.py --smoke               # CPU-only self-test of every code path (CI)
    python bench/gpu_validate.py --smoke --new-knobs   # ... of the --new-knobs path (tiny configs)
    python bench/gpu_validate.py --smoke --plans-only  # ... of the --plans-only path (real planner)

Each case's child is started ``--prefetch`` cases ahead (default 3): it imports and builds its
model on the CPU, its random init skipped (the weights are drawn on the GPU after the move: the
same tensors, moved in the same order), then waits until the previous child has exited before it
touches the GPU. A quantized base is built on the GPU after that go (bitsandbytes quantizes on the
device it is moved to; LLM.int8 runs its matmul where its weight was quantized); its child only
imports ahead. After the measured step the child records the caching allocator's segments
(``measured.segments``: sizes, allocated bytes, free blocks, stream), and the parent the
estimator's replayed ones (``estimated.segments``), to tell where a reserved peak differs. Offloading and the fused loss
run what memfit train runs on CUDA: TRL's activation offloading context, torchao's
CPUOffloadOptimizer, Liger Kernel's fused linear cross-entropy (memfit's own where liger-kernel
does not import; the row's ``measured.implementations`` says which ran). A case that fails for an
optional library's reason says so (``measured.library_problem``) and the run goes on.

Only the standard library, torch, transformers, numpy and memfit (from this checkout's ``src/``)
are imported; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import importlib
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
if str(ROOT / "src") not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT / "src"))

SCHEMA_VERSION = 1
RUN_KIND = "memfit-gpu-validate"
RESULT_MARKER = "@@memfit-gpu-validate-result@@ "
KiB, MiB, GiB = 2**10, 2**20, 2**30
WARMUP_STEPS = 2
SEED = 0
DEFAULT_OUT = ROOT / "bench" / "results"
DEFAULT_TIMEOUT_S = 300.0  # per child process
# children preparing (imports, the model built on the CPU without its random init) while another
# measures: a child's preparation took 12-16 s of imports on the H200 host, three children's
# turns on the GPU about 18 s; four processes at once on its 16 cores
DEFAULT_PREFETCH = 3
DEFAULT_TIME_BUDGET_S = 500.0  # the whole run stays under 9 minutes even on a slow host
STDERR_TAIL_CHARS = 3000
# settings that change what the allocator or cuBLAS hold; memfit models the defaults, so the
# children run without them (the header records what the parent saw)
CHILD_ENV_REMOVED = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "PYTORCH_NO_CUDA_MEMORY_CACHING",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "CUDA_MODULE_LOADING",
)
ENV_RECORDED = (
    *CHILD_ENV_REMOVED,
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)
CHILD_ENV_SET = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}


# --- the matrix ---------------------------------------------------------------------------------------
CLS, LM, EMB = "classification", "causal-lm", "sentence-embedding"
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass(frozen=True)
class ModelEntry:
    """A model of the matrix and the (batch, seq) shapes it runs, smallest first."""

    name: str
    task: str
    shapes: tuple[tuple[int, int], ...]
    loss: str | None = None


MATRIX_MODELS: tuple[ModelEntry, ...] = (
    ModelEntry("bert-base-uncased", CLS, ((8, 128), (32, 128), (16, 512))),
    ModelEntry("bert-large-uncased", CLS, ((8, 128), (32, 128), (16, 512))),
    ModelEntry("gpt2", LM, ((4, 256), (8, 512), (16, 1024))),
    ModelEntry(MINILM, EMB, ((32, 128), (64, 256)), loss="mnrl"),
)
DEFAULT_PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Case:
    """One step to estimate and measure."""

    model: str  # registry name, or a local model folder (the smoke test's tiny configs)
    task: str
    batch_size: int
    seq_len: int
    precision: str = "fp32"
    gradient_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    mode: str = "train"
    optimizer: str = "adamw"
    loss: str | None = None  # None: the task's default
    num_labels: int = 2
    # LoRA adapters, and the base weights quantized by bitsandbytes under them (QLoRA)
    lora_rank: int = 0
    quantization: str = "none"
    double_quant: bool = False
    # the levers of "the job people run today" (memfit.job STEP_FIELDS): the dtype the weights are
    # held in (auto: the checkpoint's for a frozen base, fp32 for trained ones; bf16: pure bf16),
    # the token loss (fused-linear: Liger Kernel's on CUDA when liger-kernel imports), the saved
    # activations in host memory (TRL's context on CUDA) and the optimizer's state in host memory
    # (torchao's CPUOffloadOptimizer on CUDA)
    weights_dtype: str = "auto"
    cross_entropy: str = "standard"
    activation_offloading: bool = False
    optimizer_offload: str = "none"

    @property
    def label(self) -> str:
        """The model's last path component: the registry name's, or the local folder's."""
        return Path(self.model).name

    @property
    def id(self) -> str:
        gc = "gc" if self.gradient_checkpointing else "nogc"
        parts = [self.label, self.precision, self.attn_implementation, gc, self.mode]
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.loss:
            parts.append(self.loss)
        if self.lora_rank:
            parts.append(f"lora{self.lora_rank}")
        if self.quantization != "none":
            parts.append(self.quantization + ("-dq" if self.double_quant else ""))
        if self.weights_dtype != "auto":
            parts.append("weights-" + self.weights_dtype)
        if self.cross_entropy != "standard":
            parts.append(self.cross_entropy)
        if self.activation_offloading:
            parts.append("act-offload")
        if self.optimizer_offload != "none":
            parts.append("opt-offload-" + self.optimizer_offload)
        return "/".join([*parts, f"b{self.batch_size}s{self.seq_len}"])

    def knobs(self) -> dict[str, Any]:
        """Everything the estimate and the child need, as JSON."""
        return dataclasses.asdict(self)

    def estimate_kwargs(self) -> dict[str, Any]:
        knobs = self.knobs()
        del knobs["model"]
        return knobs


def build_cases(
    models: Sequence[ModelEntry] = MATRIX_MODELS, precisions: Sequence[str] = DEFAULT_PRECISIONS
) -> list[Case]:
    """The default matrix, ordered so that any prefix covers as many kinds of case as it can.

    Per model: every shape for every precision (sdpa, no checkpointing); checkpointing at the
    largest shape for every precision and at the middle shape for the last one; eager attention
    at the middle shape (first precision) and the largest (last precision, checkpointing); one
    eval step. The groups are interleaved round-robin: first one case of every group, then the
    second of every group, and so on, so that a run cut short still has some of everything.
    """
    first, last = precisions[0], precisions[-1]
    groups: list[list[Case]] = []
    for i, entry in enumerate(models):
        middle, largest = entry.shapes[len(entry.shapes) // 2], entry.shapes[-1]

        def case(
            shape: tuple[int, int], precision: str, *, entry: ModelEntry = entry, **knobs: Any
        ) -> Case:
            return Case(
                entry.name, entry.task, shape[0], shape[1], precision, loss=entry.loss, **knobs
            )

        for precision in precisions:
            groups.append([case(shape, precision) for shape in entry.shapes])
        checkpointed = [case(largest, p, gradient_checkpointing=True) for p in precisions]
        checkpointed.append(case(middle, last, gradient_checkpointing=True))
        groups.append(checkpointed)
        groups.append(
            [
                case(middle, first, attn_implementation="eager"),
                case(largest, last, attn_implementation="eager", gradient_checkpointing=True),
            ]
        )
        groups.append([case(largest, precisions[i % len(precisions)], mode="eval")])
    return _dedupe(_round_robin(groups))


# a handful of cases that touch every knob once (``--quick``; the GPU test runs it)
QUICK_CASES: tuple[Case, ...] = (
    Case("bert-base-uncased", CLS, 8, 128, "fp32"),
    Case("bert-base-uncased", CLS, 16, 512, "bf16", gradient_checkpointing=True),
    Case("gpt2", LM, 4, 256, "bf16"),
    Case("gpt2", LM, 4, 256, "fp32", attn_implementation="eager"),
    Case(MINILM, EMB, 32, 128, "fp32", loss="mnrl"),
    Case("bert-base-uncased", CLS, 32, 128, "bf16", mode="eval"),
)

# --qlora: LoRA rank 16 on 4-bit (and 8-bit) base weights, bf16 compute, as QLoRA trains; the
# child builds real bitsandbytes layers (memfit.estimate.workload.build_model) and moves them to the
# GPU, where bitsandbytes quantizes them
QLORA = {"lora_rank": 16, "quantization": "nf4", "double_quant": True}
QLORA_CASES: tuple[Case, ...] = (
    Case("meta-llama/Llama-3.2-1B", LM, 4, 512, "bf16", **QLORA),
    Case("meta-llama/Llama-3.2-1B", LM, 2, 2048, "bf16", gradient_checkpointing=True, **QLORA),
    Case("meta-llama/Llama-3.2-1B", LM, 4, 512, "bf16", optimizer="paged-adamw-8bit", **QLORA),
    Case(
        "meta-llama/Llama-3.2-1B",
        LM,
        4,
        512,
        "bf16",
        **{**QLORA, "quantization": "int8", "double_quant": False},
    ),
    Case("Qwen/Qwen2.5-0.5B", LM, 4, 512, "bf16", **QLORA),
    Case("Qwen/Qwen2.5-0.5B", LM, 4, 1024, "bf16", gradient_checkpointing=True, **QLORA),
    Case("Qwen/Qwen2.5-0.5B", LM, 4, 512, "bf16", **{**QLORA, "double_quant": False}),
    Case("Qwen/Qwen2.5-0.5B", LM, 8, 512, "bf16", mode="eval", **QLORA),
)

# --new-knobs: the estimator on what changed since the last GPU run, one group per kind of lever,
# interleaved round-robin (a run cut short still has some of each), the most informative case of
# each group first. Sized for an H100: small embedded models (SmolLM2-135M, Qwen2.5-0.5B, gpt2, one
# Llama-3.2-1B), short shapes. On the H200 host a child's turn on the GPU (its go to its exit: the
# move, 2 warm-up steps, 1 measured, the probe) took 2.5-8 s (16 s for Qwen's optimizer offload,
# now SmolLM2's), about 100 s for the 16 cases; its preparation (12-16 s of imports, the CPU build
# without its random init) overlaps the turns of the three before it. Qwen2.5-0.5B's, SmolLM2's
# and Llama-3.2's configs say bf16,
# so weights_dtype "auto" holds their frozen base in bf16 (LoRA adapters in fp32 over it); gpt2's
# says nothing: fp32
QWEN, SMOLLM, LLAMA = "Qwen/Qwen2.5-0.5B", "HuggingFaceTB/SmolLM2-135M", "meta-llama/Llama-3.2-1B"
LORA = {"lora_rank": 16}
NEW_KNOB_GROUPS: tuple[tuple[str, tuple[Case, ...]], ...] = (
    (
        "qlora",
        (
            Case(QWEN, LM, 4, 512, "bf16", **QLORA),
            Case(QWEN, LM, 4, 512, "bf16", **LORA, quantization="int8"),
            Case(QWEN, LM, 4, 512, "bf16", **LORA, quantization="nf4", double_quant=False),
        ),
    ),
    (
        "8-bit and paged optimizers",
        (
            Case(SMOLLM, LM, 4, 512, "bf16", optimizer="paged-adamw-8bit"),
            Case(SMOLLM, LM, 4, 512, "bf16", optimizer="adamw-8bit"),
            Case(SMOLLM, LM, 4, 512, "bf16", optimizer="paged-adamw-32bit"),
        ),
    ),
    (
        "16-bit weights",
        (
            # pure bf16 full fine-tuning: weights, gradients and AdamW state in bf16
            Case(SMOLLM, LM, 8, 512, "bf16", weights_dtype="bf16"),
            # LoRA over the checkpoint's bf16 base (auto), then everything bf16 (adapters too)
            Case(QWEN, LM, 4, 512, "bf16", **LORA),
            Case(QWEN, LM, 4, 512, "bf16", **LORA, weights_dtype="bf16"),
        ),
    ),
    (
        "fused-linear cross-entropy",
        (
            # the job people run today: LoRA on a bf16 base, checkpointing, the fused loss
            Case(
                QWEN,
                LM,
                4,
                1024,
                "bf16",
                gradient_checkpointing=True,
                **LORA,
                cross_entropy="fused-linear",
            ),
            Case(QWEN, LM, 4, 512, "bf16", **LORA, cross_entropy="fused-linear"),
            Case(
                LLAMA,
                LM,
                2,
                1024,
                "bf16",
                gradient_checkpointing=True,
                **LORA,
                cross_entropy="fused-linear",
            ),
        ),
    ),
    (
        "activation offloading",
        (
            Case(
                QWEN,
                LM,
                4,
                512,
                "bf16",
                gradient_checkpointing=True,
                **LORA,
                activation_offloading=True,
            ),
            Case(QWEN, LM, 4, 512, "bf16", **LORA, activation_offloading=True),
        ),
    ),
    (
        "optimizer offload",
        (
            # SmolLM2, not Qwen2.5-0.5B: the same bf16 mixed-precision offload, a quarter of the
            # host-side AdamW (Qwen's took 16 s after its go on the H200 host: pinned buffers for
            # 2 GB of fp32 master weights, three CPU AdamW steps)
            Case(SMOLLM, LM, 4, 512, "bf16", optimizer_offload="cpu"),
            Case("gpt2", LM, 4, 512, "fp32", optimizer_offload="cpu"),
        ),
    ),
)
# round-robin across the groups: the first case of every group, then the second, ...
NEW_KNOB_CASES: tuple[Case, ...] = tuple(
    cases[rank]
    for rank in range(max(len(cases) for _, cases in NEW_KNOB_GROUPS))
    for _, cases in NEW_KNOB_GROUPS
    if rank < len(cases)
)
# what no H100 or H200 can measure, said in the header of every CUDA run
NOT_MEASURABLE_HERE = (
    "T4-class (sm75) kernels cannot be measured on this GPU: without flash attention SDPA runs the "
    "memory-efficient kernel there (memfit's sdpa_sm=75 emulation), and cuBLAS/cuDNN pick other "
    "workspaces; an sm80+ GPU such as an H100 or H200 only measures the flash-attention path"
)

# --plan-check: (model, task, seq_len) × budgets, effective batch 64
PLAN_MODELS: tuple[tuple[str, str, int], ...] = (("bert-base-uncased", CLS, 256), ("gpt2", LM, 512))
PLAN_BUDGETS_GIB: tuple[int, ...] = (6, 10, 16)
PLAN_EFFECTIVE_BATCH = 64
PLAN_OPTIMIZER_STEPS = 3

# --plans-only: three plans under a hard cap, each run for real (PLAN_OPTIMIZER_STEPS optimizer
# steps) under set_per_process_memory_fraction(budget). A plan check is (model, task, seq_len,
# budget, the plan's keywords); the keywords pin what the plan need not search (offloading, the
# weights' dtype, the precision; the fused loss for the LoRA job) so that each plan traces a few
# knob sets (seconds, not the minutes of a full search on a small host CPU), and the budgets are
# below what micro-batch = effective batch needs, so that every plan changes something
# (micro-batch and accumulation, checkpointing)
PLAN_PINS: dict[str, Any] = {
    "precision": "bf16",
    "weights_dtype": "auto",
    "activation_offloading": False,
    "optimizer_offload": "none",
}
PLANS_ONLY: tuple[tuple[str, str, int, int, dict[str, Any]], ...] = (
    ("bert-base-uncased", CLS, 256, 4 * GiB, {"effective_batch_size": 64, **PLAN_PINS}),
    (
        "gpt2",
        LM,
        512,
        5 * GiB,
        {"effective_batch_size": 32, "cross_entropy": "standard", **PLAN_PINS},
    ),
    # LoRA with the fused loss on SmolLM2-135M (Qwen2.5-0.5B's plan took 22 s of a 2-core CPU,
    # SmolLM2's 15 s: the same levers, the same planner): micro-batch 32 needs about 17 GiB
    (
        SMOLLM,
        LM,
        512,
        2 * GiB,
        {"effective_batch_size": 32, "lora_rank": 16, "cross_entropy": "fused-linear", **PLAN_PINS},
    ),
)


def _round_robin(groups: Sequence[Sequence[Case]]) -> list[Case]:
    out: list[Case] = []
    for rank in range(max((len(g) for g in groups), default=0)):
        out.extend(g[rank] for g in groups if rank < len(g))
    return out


def _dedupe(cases: Sequence[Case]) -> list[Case]:
    out: list[Case] = []
    for case in cases:
        if case not in out:
            out.append(case)
    return out


def select_cases(args: argparse.Namespace) -> list[Case]:
    """The cases the flags ask for: the matrix or --quick, filtered by --models/--precisions, --limit."""
    models = _canonical_models(args.models)
    precisions = args.precisions or list(DEFAULT_PRECISIONS)
    if args.plans_only:
        cases = []
    elif args.new_knobs:
        cases = [c for c in NEW_KNOB_CASES if c.precision in precisions]
    elif args.qlora:
        cases = [c for c in QLORA_CASES if c.precision in precisions]
    elif args.quick:
        cases = [c for c in QUICK_CASES if c.precision in precisions]
    else:
        cases = build_cases(MATRIX_MODELS, precisions)
    if models is not None:
        cases = [c for c in cases if c.model in models]
    if args.only:
        # numbers as --list prints them, in the order given (a re-run of some cases)
        cases = [cases[i - 1] for i in args.only if 1 <= i <= len(cases)]
    return cases if args.limit is None else cases[: args.limit]


def _canonical_models(names: Sequence[str] | None) -> set[str] | None:
    if not names:
        return None
    from memfit.errors import UsageError
    from memfit.models import resolve_model

    known = (
        {m.name for m in MATRIX_MODELS}
        | {c.model for c in (*QLORA_CASES, *NEW_KNOB_CASES)}
        | {check[0] for check in PLANS_ONLY}
    )
    chosen: set[str] = set()
    for name in names:
        try:
            canonical = resolve_model(name).name
        except UsageError as exc:
            raise SystemExit(f"--models: {exc}") from None
        if canonical not in known:
            raise SystemExit(
                f"--models: {name!r} is not in the matrix; choose from {', '.join(sorted(known))}"
            )
        chosen.add(canonical)
    return chosen


# --- nvidia-smi and git, read without extra dependencies ----------------------------------------------
def _smi(*query: str) -> list[list[str]] | None:
    """Rows of an ``nvidia-smi --query-...`` in CSV, or None when nvidia-smi is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, *query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return [
        [cell.strip() for cell in line.split(",")]
        for line in done.stdout.splitlines()
        if line.strip()
    ]


def _mib(text: str) -> int | None:
    try:
        return int(float(text) * MiB)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def smi_gpus() -> list[dict[str, Any]] | None:
    rows = _smi("--query-gpu=index,uuid,name,memory.used,memory.total,driver_version")
    if rows is None:
        return None
    return [
        {
            "index": row[0],
            "uuid": row[1],
            "name": row[2],
            "used_bytes": _mib(row[3]),
            "total_bytes": _mib(row[4]),
            "driver_version": row[5],
        }
        for row in rows
        if len(row) >= 6
    ]


def smi_apps() -> list[dict[str, Any]] | None:
    rows = _smi("--query-compute-apps=pid,gpu_uuid,used_memory")
    if rows is None:
        return None
    apps = []
    for row in rows:
        if len(row) >= 3 and row[0].isdigit():
            apps.append({"pid": int(row[0]), "gpu_uuid": row[1], "used_bytes": _mib(row[2])})
    return apps


def _uuid_hex(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    text = str(value).lower().replace("gpu-", "")
    return re.sub(r"[^0-9a-f]", "", text)


def _this_gpu(gpus: list[dict[str, Any]] | None, torch_uuid: Any) -> dict[str, Any] | None:
    """The nvidia-smi row of the GPU torch uses as cuda:0 (by UUID, else the only one, else by index)."""
    if not gpus:
        return None
    wanted = _uuid_hex(torch_uuid) if torch_uuid is not None else ""
    for gpu in gpus:
        if wanted and _uuid_hex(gpu["uuid"]) == wanted:
            return gpu
    if len(gpus) == 1:
        return gpus[0]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return next((g for g in gpus if g["index"] == visible), None)


def git_commit(root: Path = ROOT) -> str | None:
    """The checked-out commit, read from ``.git`` (no git process; the checkout may have no .git)."""
    try:
        git = root / ".git"
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = (root / git.read_text().split(":", 1)[1].strip()).resolve()
        common = git
        if (git / "commondir").is_file():
            common = (git / (git / "commondir").read_text().strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head[4:].strip()
        for base in (git, common):
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    except (OSError, IndexError):
        return None
    return None


# --- the child: one case in a fresh process -----------------------------------------------------------
class DeviceProbe:
    """The memory figures of the device a child runs on; on the CPU (the smoke test) mostly zeros."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.cuda = device == "cuda"
        # before CUDA is initialised: what the device already holds (other processes)
        self.gpus_before = smi_gpus() if self.cuda else None
        self.apps_before = smi_apps() if self.cuda else None
        self.gpu: dict[str, Any] | None = None
        self.total = 0
        self.used_after_init = 0

    def init(self) -> None:
        if not self.cuda:
            return
        import torch

        torch.cuda.init()
        free, self.total = torch.cuda.mem_get_info()
        self.used_after_init = self.total - free
        self.gpu = _this_gpu(
            self.gpus_before, getattr(torch.cuda.get_device_properties(0), "uuid", None)
        )

    def synchronize(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def reset_peaks(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def peaks(self) -> dict[str, int]:
        if not self.cuda:
            return {"allocated_peak_bytes": 0, "reserved_peak_bytes": 0}
        import torch

        return {
            "allocated_peak_bytes": int(torch.cuda.max_memory_allocated()),
            "reserved_peak_bytes": int(torch.cuda.max_memory_reserved()),
        }

    def final(self) -> dict[str, Any]:
        """Peaks since the last reset, what is held now, and the CUDA context."""
        stats: dict[str, Any] = {**self.peaks(), "peak_rss_bytes": _peak_rss_bytes()}
        if not self.cuda:
            return {
                **stats,
                "allocated_end_bytes": 0,
                "reserved_end_bytes": 0,
                "context_bytes": 0,
                "context_method": "none (cpu)",
            }
        import torch

        free, total = torch.cuda.mem_get_info()
        reserved_end = int(torch.cuda.memory_reserved())
        used_end = total - free
        before = None if self.gpu is None else self.gpu.get("used_bytes")
        context = used_end - reserved_end - (before or 0)
        method = "mem_get_info - reserved - used before (nvidia-smi)"
        if before is None or context <= 0:
            context, method = used_end - reserved_end, "mem_get_info - reserved"
        apps = smi_apps()
        own = others = None
        if apps is not None:
            gpu_uuid = None if self.gpu is None else _uuid_hex(self.gpu["uuid"])
            same_gpu = [a for a in apps if gpu_uuid is None or _uuid_hex(a["gpu_uuid"]) == gpu_uuid]
            own = next((a["used_bytes"] for a in same_gpu if a["pid"] == os.getpid()), None)
            others = sum(a["used_bytes"] or 0 for a in same_gpu if a["pid"] != os.getpid())
        # another process that changed its device memory during this one's run (a child
        # started ahead that touched CUDA while preparing) makes the device-wide figure wrong:
        # nvidia-smi's own per-process figure is this process's alone
        others_before = None
        if self.apps_before is not None and apps is not None:
            gpu_uuid = None if self.gpu is None else _uuid_hex(self.gpu["uuid"])
            others_before = sum(
                a["used_bytes"] or 0
                for a in self.apps_before
                if a["pid"] != os.getpid()
                and (gpu_uuid is None or _uuid_hex(a["gpu_uuid"]) == gpu_uuid)
            )
        if (
            others_before is not None
            and others is not None
            and own is not None
            and abs(others - others_before) > 16 * MiB
        ):
            context, method = own - reserved_end, "nvidia-smi per process (others changed)"
        memory_stats = torch.cuda.memory_stats()
        return {
            **stats,
            "allocated_end_bytes": int(torch.cuda.memory_allocated()),
            "reserved_end_bytes": reserved_end,
            "context_bytes": int(context),
            "context_method": method,
            "context_smi_bytes": None if own is None else own - reserved_end,
            "smi_process_used_bytes": own,
            "smi_other_processes_bytes": others,
            "smi_other_processes_before_bytes": others_before,
            "device_total_bytes": int(total),
            "device_used_before_bytes": before,
            "device_used_after_init_bytes": self.used_after_init,
            "device_used_end_bytes": int(used_end),
            "alloc_retries": int(memory_stats.get("num_alloc_retries", 0)),
            "allocator_ooms": int(memory_stats.get("num_ooms", 0)),
        }


# the caching allocator's segments kept in a row (the largest; the rest are counted)
SEGMENTS_KEPT = 40
FREE_BLOCKS_KEPT = 8


def segment_summary(segments: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A compact account of a caching allocator's segments, measured or replayed: each segment
    (``total``, ``allocated`` bytes, ``free_blocks``: the sizes of its inactive blocks, ``stream``,
    ``pool``) in MiB, the ``SEGMENTS_KEPT`` largest listed (their largest free blocks first), the
    rest counted; totals per stream and pool. Where the reserved peak differs from the estimate,
    the two lists show which segments the replay lacks or holds too many of."""

    def mib(n: float) -> float:
        return round(n / MiB, 2)

    ordered = sorted(segments, key=lambda seg: (-int(seg["total"]), -int(seg["allocated"])))
    listed = []
    for seg in ordered[:SEGMENTS_KEPT]:
        free = sorted((int(b) for b in seg["free_blocks"] if b), reverse=True)
        listed.append(
            {
                "mib": mib(seg["total"]),
                "allocated_mib": mib(seg["allocated"]),
                "free_mib": [mib(b) for b in free[:FREE_BLOCKS_KEPT]],
                "free_blocks": len(free),
                "stream": seg["stream"],
                "pool": seg["pool"],
            }
        )
    rest = ordered[SEGMENTS_KEPT:]
    by_stream: dict[str, dict[str, float]] = {}
    by_pool: dict[str, dict[str, float]] = {}
    for seg in ordered:
        for table, key in ((by_stream, str(seg["stream"])), (by_pool, str(seg["pool"]))):
            entry = table.setdefault(key, {"segments": 0, "mib": 0.0, "allocated_mib": 0.0})
            entry["segments"] += 1
            entry["mib"] += seg["total"] / MiB
            entry["allocated_mib"] += seg["allocated"] / MiB
    for table in (by_stream, by_pool):
        for entry in table.values():
            entry["mib"], entry["allocated_mib"] = (
                round(entry["mib"], 2),
                round(entry["allocated_mib"], 2),
            )
    return {
        "segments": len(ordered),
        "reserved_mib": mib(sum(int(seg["total"]) for seg in ordered)),
        "allocated_mib": mib(sum(int(seg["allocated"]) for seg in ordered)),
        "largest_free_mib": mib(
            max((int(b) for seg in ordered for b in seg["free_blocks"]), default=0)
        ),
        "by_stream": by_stream,
        "by_pool": by_pool,
        "largest": listed,
        "rest": {
            "segments": len(rest),
            "mib": mib(sum(int(seg["total"]) for seg in rest)),
            "allocated_mib": mib(sum(int(seg["allocated"]) for seg in rest)),
        },
    }


def cuda_segments() -> dict[str, Any] | None:
    """The caching allocator's segments now (``torch.cuda.memory._snapshot()``), summarised by
    :func:`segment_summary`; None without CUDA, an ``error`` where the snapshot fails."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        snapshot = torch.cuda.memory._snapshot()
        device = torch.cuda.current_device()
        segments = [
            {
                "total": int(seg["total_size"]),
                "allocated": int(seg["allocated_size"]),
                "free_blocks": [
                    int(b["size"]) for b in seg.get("blocks", []) if b.get("state") == "inactive"
                ],
                "stream": int(seg.get("stream", 0)),
                "pool": str(seg.get("segment_type", "?")),
            }
            for seg in snapshot.get("segments", [])
            if int(seg.get("device", device)) == device
        ]
        return segment_summary(segments)
    except Exception as exc:  # a diagnostic: never the case's failure
        return {"error": f"{type(exc).__name__}: {exc}"}


def _peak_rss_bytes() -> int:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * KiB
    except (ImportError, OSError):
        return 0


def _spec_for(request: Mapping[str, Any]) -> Any:
    """The StepSpec the estimator builds for these knobs (same validation, same loss resolution)."""
    from memfit.errors import UsageError
    from memfit.estimate.api import step_job, validate

    # the job as memfit.estimate builds it from its keywords, checked the same way
    job = step_job(
        str(request.get("model", "")),
        batch_size=request["batch_size"],
        task=request["task"],
        seq_len=request["seq_len"],
        precision=request["precision"],
        optimizer=request["optimizer"],
        attn_implementation=request["attn_implementation"],
        device=request["device"],
        num_labels=request["num_labels"],
        loss=request.get("loss"),
        lora_rank=request.get("lora_rank") or None,
        quantization=request.get("quantization", "none"),
        double_quant=bool(request.get("double_quant", False)),
        weights_dtype=request.get("weights_dtype", "auto"),
        cross_entropy=request.get("cross_entropy", "standard"),
        activation_offloading=bool(request.get("activation_offloading", False)),
        optimizer_offload=request.get("optimizer_offload", "none"),
    )
    spec, problems = validate(job, mode=request["mode"])
    if problems:
        raise UsageError("; ".join(problems))
    return dataclasses.replace(spec, gradient_checkpointing=bool(request["gradient_checkpointing"]))


def child_main(request: dict[str, Any]) -> int:
    """Run one case (``--case``) and print its result as one JSON line after RESULT_MARKER."""
    try:
        result = _child_run(request)
    except Exception as exc:
        result = {
            "status": "error",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
        library = library_problem(exc)
        if library is not None:
            result["library_problem"] = library
    print(RESULT_MARKER + json.dumps(result), flush=True)
    return 0


# the optional packages a lever runs on CUDA (memfit's extras); a child that fails importing one, or
# refused by memfit for lacking one, failed for a library reason, not for the estimate
LEVER_PACKAGES = ("bitsandbytes", "liger_kernel", "trl", "torchao", "triton", "peft")


def library_problem(exc: BaseException) -> str | None:
    """A line saying which optional library a failure came from, or None for any other failure."""
    if isinstance(exc, ImportError):
        return f"import failed: {type(exc).__name__}: {exc}"
    text = str(exc)
    if type(exc).__name__ == "OffloadUnavailable" or "pip install" in text:
        return f"memfit refused a missing package: {text}"
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [
        package
        for package in LEVER_PACKAGES
        if frames and f"{os.sep}{package}{os.sep}" in frames[-1].filename
    ]
    if inside:
        return f"raised inside {inside[0]}: {type(exc).__name__}: {exc}"
    return None


def lever_implementations(spec: Any, device: str) -> dict[str, Any]:
    """What runs each lever of this step here, read before the step (the row records it): Liger's
    fused loss or memfit's own, TRL's offloading context, torchao's offloaded optimizer."""
    from memfit.step import linear_ce, offload

    out: dict[str, Any] = {}
    if spec.cross_entropy == "fused-linear":
        liger = linear_ce._liger_function() if device == "cuda" else None
        out["cross_entropy"] = (
            "liger-kernel"
            if liger is not None
            else "memfit torch implementation"
            + (
                f" (liger-kernel did not import: {_import_problem('liger_kernel.transformers.functional')})"
                if device == "cuda"
                else ""
            )
        )
    if spec.activation_offloading:
        out["activation_offloading"] = offload.implementation(device)
    if spec.optimizer_offload != "none":
        out["optimizer_offload"] = (
            "torchao CPUOffloadOptimizer" if device == "cuda" else "none (cpu device)"
        )
    return out


def _import_problem(module: str) -> str:
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "imports now"


def make_step_optimizer(spec: Any, model: Any, device: str) -> Any:
    """The optimizer memfit trains with: the estimator's workload's (torch's foreach AdamW,
    bitsandbytes' 8-bit and paged ones) and, for ``--optimizer-offload cpu`` on CUDA, memfit
    train's own torchao ``CPUOffloadOptimizer`` (the workload's is the estimator's stand-in)."""
    import torch

    from memfit.estimate import workload

    if spec.optimizer_offload == "cpu" and device == "cuda":
        from memfit.train.optim import make_optimizer

        return make_optimizer(
            spec.optimizer, model, 1e-5, 0.0, offload="cpu", device=torch.device(device)
        )
    return workload.make_optimizer(spec.optimizer, model, device, offload=spec.optimizer_offload)


def make_offload(spec: Any, model: Any, device: str) -> Callable[[], Any]:
    """The activation offloading context factory a training step enters (TRL's on CUDA, built
    once and entered for each micro-batch as memfit train does); a null context without it."""
    if not spec.activation_offloading or spec.mode != "train":
        return contextlib.nullcontext
    from memfit.step import offload

    context = offload.offload_context(model, device)
    return lambda: context


# torch.nn.init's random initialisers: the CPU build of a child skips them (a 16-bit model's random
# init took a Qwen2.5-0.5B build 30 s of CPU on the H200 host) and the weights are drawn on the
# device after the move instead (:func:`draw_weights`); the deterministic ones (ones, zeros,
# constants: norms, biases, buffers) still run, so the model is the one the estimator builds, tied
# weights included
RANDOM_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextlib.contextmanager
def random_init_skipped() -> Iterator[None]:
    """torch.nn.init's random initialisers (and transformers' own table of them, which its
    ``_init_weights`` calls) as no-ops while a model is built: its weights stay uninitialised
    until :func:`draw_weights` fills them on the device. Shapes, dtypes, ties and buffers are
    those of a normal build."""
    from torch.nn import init

    def skip(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    saved: list[tuple[Any, str, Any]] = []
    tables: list[Any] = [init]
    with contextlib.suppress(ImportError):
        # transformers 5 keeps the torch functions in a table its wrappers call
        table = getattr(
            importlib.import_module("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None
        )
        if isinstance(table, dict):
            tables.append(table)
    try:
        for owner in tables:
            for name in RANDOM_INITS:
                if isinstance(owner, dict) and name in owner:
                    saved.append((owner, name, owner[name]))
                    owner[name] = skip
                elif not isinstance(owner, dict) and hasattr(owner, name):
                    saved.append((owner, name, getattr(owner, name)))
                    setattr(owner, name, skip)
        yield
    finally:
        for owner, name, function in reversed(saved):
            if isinstance(owner, dict):
                owner[name] = function
            else:
                setattr(owner, name, function)


def draw_weights(model: Any) -> None:
    """The weights a skipped random init left empty, drawn in place where they now live (on the
    GPU: no allocation, milliseconds): N(0, 0.02) for every floating matrix and embedding, as
    transformers' init draws them; vectors (norms, biases) keep the deterministic values they were
    built with. Values never change what a step allocates here, but they must be finite."""
    import torch

    with torch.no_grad():
        for parameter in {id(p): p for p in model.parameters()}.values():
            if parameter.is_floating_point() and parameter.dim() >= 2:
                parameter.normal_(0.0, 0.02)


def build_step_model(config: Any, spec: Any, device: str, *, on_device: bool) -> Any:
    """The step's model as the estimator's workload builds it. ``on_device``: built on ``device``
    (a quantized base: bitsandbytes quantizes each weight on the device it is on, and LLM.int8's
    matmul runs where its weight was quantized), its random init drawn there; otherwise built on
    the CPU without its random init (the caller moves it and then calls :func:`draw_weights`)."""
    import torch

    from memfit.estimate import workload

    torch.manual_seed(SEED)
    if on_device:
        with torch.device(device):
            return workload.build_model(config, spec)
    with random_init_skipped():
        return workload.build_model(config, spec)


def warm_imports(config: Any, spec: Any) -> None:
    """What a build imports (transformers' model classes, peft, bitsandbytes), without building
    anything: the step's model on the meta device, the quantized layers emulated there. A child
    started ahead does this instead of building a model it must build on the device."""
    import torch

    from memfit.estimate import workload

    for module in ("peft", "bitsandbytes", "transformers.integrations.bitsandbytes"):
        with contextlib.suppress(Exception):
            importlib.import_module(module)
    with contextlib.suppress(Exception), torch.device("meta"):
        workload.build_model(config, spec)


def _child_run(request: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    device = request["device"]
    prepare_first = bool(request.get("prepare_first"))
    # nvidia-smi baseline before torch touches the GPU (a prepared child reads it after "go")
    probe = None if prepare_first else DeviceProbe(device)

    import torch

    from memfit.estimate import workload
    from memfit.models import resolve_model

    oom_error: type[BaseException] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    spec = _spec_for(request)
    config = resolve_model(request["model"]).config
    timings: dict[str, float] = {"import_s": time.perf_counter() - started}
    model = None
    # a quantized base is built on the device, after "go" (see build_step_model); a plan's
    # knobs come with its "go"
    on_device = spec.quantization != "none"
    if prepare_first:
        # started ahead while another child measures: import and build on the CPU (nothing on
        # the device), then wait for the parent's "go", sent once no other child holds the GPU
        t = time.perf_counter()
        if on_device or request["kind"] == "plan":
            warm_imports(config, spec)
        else:
            model = build_step_model(config, spec, device, on_device=False)
        timings["cpu_build_s"] = time.perf_counter() - t
        t = time.perf_counter()
        line = sys.stdin.readline().strip()
        if line.startswith("{"):
            # the go of a plan check carries the plan's knobs (planned while this child imported)
            request.update(json.loads(line))
            spec = _spec_for(request)
            on_device = spec.quantization != "none"
        elif line != "go":
            return {"status": "cancelled", "error": "the parent sent no go", "timings": timings}
        timings["waited_s"] = time.perf_counter() - t
        probe = DeviceProbe(device)
    assert probe is not None
    t = time.perf_counter()
    probe.init()
    timings["cuda_init_s"] = time.perf_counter() - t
    if request.get("memory_fraction") is not None and device == "cuda":
        torch.cuda.set_per_process_memory_fraction(float(request["memory_fraction"]))
    history = request.get("memory_history") if device == "cuda" else None
    if history:
        # every allocation, free and segment of the run, without stacks (small, and no overhead
        # from stack capture in the measured step)
        torch.cuda.memory._record_memory_history(
            max_entries=2_000_000, context=None, stacks="python"
        )
    timings["init_s"] = time.perf_counter() - started
    phase = "build"
    try:
        t = time.perf_counter()
        implementations = lever_implementations(spec, device)
        if model is None:
            model = build_step_model(config, spec, device, on_device=on_device)
        if on_device:
            # built there already (a no-op move, kept for any tensor a module put elsewhere)
            model = model.to(device)
            if device == "cuda":
                # the unquantized copies the build cast and quantized are freed: their cached
                # segments go, as a model loaded quantized never held them
                torch.cuda.empty_cache()
        else:
            # moved tensor by tensor, as the estimator's replay places the model; then its random
            # weights drawn in place
            model = model.to(device)
            torch.manual_seed(SEED)
            draw_weights(model)
        timings["move_s"] = time.perf_counter() - t
        optimizer = make_step_optimizer(spec, model, device) if spec.mode == "train" else None
        offload = make_offload(spec, model, device)
        autocast = workload.default_autocast(spec, device)
        scaler = workload.make_scaler(spec, device, fake=False)
        timings["build_s"] = time.perf_counter() - t
        batch_size, seq_len = int(request["batch_size"]), int(request["seq_len"])

        def step() -> None:
            # the batch is created inside the step: the estimator counts it as activations
            batch = workload.make_batch(config, spec, batch_size, seq_len, device=device)
            if optimizer is None:
                workload.eval_step(model, batch, spec, autocast=autocast)
            else:
                workload.training_step(
                    model, batch, spec, optimizer, scaler=scaler, autocast=autocast, offload=offload
                )
            del batch

        if request["kind"] == "plan":
            phase = "plan-run"
            t = time.perf_counter()
            assert optimizer is not None, "a plan check trains"
            _accumulated_steps(request, config, spec, model, optimizer, scaler, autocast, offload)
            probe.synchronize()
            timings["run_s"] = time.perf_counter() - t
            return {
                "status": "ok",
                "stats": probe.final(),
                "timings": timings,
                "implementations": implementations,
            }

        phase = "warmup"
        t = time.perf_counter()
        for _ in range(int(request.get("warmup", WARMUP_STEPS))):
            step()
        probe.synchronize()
        timings["warmup_s"] = time.perf_counter() - t
        warm = probe.peaks()
        probe.reset_peaks()
        phase = "measured-step"
        t = time.perf_counter()
        step()
        probe.synchronize()
        timings["step_s"] = time.perf_counter() - t
        # the segments the measured step left reserved (none are returned: they are its peak's)
        segments = cuda_segments() if device == "cuda" else None
        if history:
            import pickle

            with open(history, "wb") as handle:
                pickle.dump(torch.cuda.memory._snapshot(), handle)
            torch.cuda.memory._record_memory_history(enabled=None)
        stats = probe.final()
        stats["segments"] = segments
        stats["warmup_allocated_peak_bytes"] = warm["allocated_peak_bytes"]
        stats["warmup_reserved_peak_bytes"] = warm["reserved_peak_bytes"]
        return {
            "status": "ok",
            "stats": stats,
            "timings": timings,
            "implementations": implementations,
        }
    except oom_error as exc:
        return {
            "status": "oom",
            "oom_phase": phase,
            "error": str(exc).splitlines()[0][:500] if str(exc) else "out of memory",
            "stats": {**probe.peaks(), "context_bytes": None, "device_total_bytes": probe.total},
            "timings": timings,
        }


def _accumulated_steps(
    request: Mapping[str, Any],
    config: Any,
    spec: Any,
    model: Any,
    optimizer: Any,
    scaler: Any,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    offload: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """A plan's run: optimizer steps of ``accumulation_steps`` micro-batches each (each
    micro-batch's forward and backward inside the activation offloading context, as memfit
    train enters it)."""
    from memfit.estimate import workload

    device = request["device"]
    micro, seq_len = int(request["batch_size"]), int(request["seq_len"])
    accumulation = max(1, int(request.get("accumulation_steps", 1)))
    for _ in range(int(request.get("optimizer_steps", PLAN_OPTIMIZER_STEPS))):
        if accumulation == 1:
            batch = workload.make_batch(config, spec, micro, seq_len, device=device)
            workload.training_step(
                model, batch, spec, optimizer, scaler=scaler, autocast=autocast, offload=offload
            )
            del batch
            continue
        for _ in range(accumulation):
            batch = workload.make_batch(config, spec, micro, seq_len, device=device)
            with offload():
                with autocast():
                    loss = workload.compute_loss(model, batch, spec) / accumulation
                (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss, batch
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# --- the parent: run children, estimate, compare ------------------------------------------------------
def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_REMOVED}
    env.update(CHILD_ENV_SET)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    return env


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-STDERR_TAIL_CHARS:]


def run_child(request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one request in a fresh interpreter; always returns a result dict (never raises)."""
    command = [sys.executable, str(SCRIPT), "--case", json.dumps(request)]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=child_env(),
            cwd=str(ROOT),
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        return {
            "status": "timeout",
            "error": f"no result within {timeout_s:.0f} s",
            "stderr_tail": _tail(exc.stderr),
            "child_seconds": round(time.perf_counter() - started, 2),
        }
    result = _parse_child(done.stdout, done.stderr, done.returncode)
    result["child_seconds"] = round(time.perf_counter() - started, 2)
    return result


class ChildPool:
    """The cases' children, each started up to ``depth`` cases ahead of its turn: it imports
    torch, transformers and memfit and builds its model on the CPU (the 10-15 s a child spent
    before its first step on an H100), then waits for "go", which it gets only once the previous
    child has exited, so that one process at a time touches the GPU. ``depth`` 0: each child
    starts at its turn (as :func:`run_child`)."""

    def __init__(self, requests: Sequence[dict[str, Any]], depth: int) -> None:
        self.requests = [{**r, "prepare_first": depth > 0} for r in requests]
        self.depth = max(0, depth)
        self.children: dict[int, tuple[subprocess.Popen[str], Any, Any, float]] = {}
        self.folder = tempfile.TemporaryDirectory(prefix="memfit-gpu-validate-children-")

    def _start(self, index: int) -> None:
        if index in self.children or index >= len(self.requests):
            return
        out = open(Path(self.folder.name) / f"{index}.out", "w+", encoding="utf-8")  # noqa: SIM115
        err = open(Path(self.folder.name) / f"{index}.err", "w+", encoding="utf-8")  # noqa: SIM115
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--case", json.dumps(self.requests[index])],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            text=True,
            env=child_env(),
            cwd=str(ROOT),
            start_new_session=True,
        )
        self.children[index] = (process, out, err, time.perf_counter())

    def start_ahead(self, index: int) -> None:
        """Starts case ``index``'s child and, when preparing ahead, the next ``depth``."""
        for ahead in range(index, index + (self.depth + 1 if self.depth else 1)):
            self._start(ahead)

    def run(
        self, index: int, timeout_s: float, update: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Case ``index``'s result (never raises); starts the next ``depth`` children first.
        ``update``: knobs the go carries to a child started ahead (a plan's), as one JSON line;
        a child started now gets its whole request."""
        if update is not None and not self.depth:
            self.requests[index] = {**self.requests[index], **update}
        self.start_ahead(index)
        process, out, err, spawned = self.children.pop(index)
        started = time.perf_counter()
        try:
            if self.depth and process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.write("go\n" if update is None else json.dumps(update) + "\n")
                    process.stdin.flush()
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(process)
            out.seek(0), err.seek(0)
            result = {
                "status": "timeout",
                "error": f"no result within {timeout_s:.0f} s of its turn",
                "stderr_tail": _tail(err.read()),
            }
        else:
            out.seek(0), err.seek(0)
            result = _parse_child(out.read(), err.read(), process.returncode)
        finally:
            with contextlib.suppress(OSError):
                if process.stdin is not None:
                    process.stdin.close()
            out.close(), err.close()
        result["child_seconds"] = round(time.perf_counter() - started, 2)
        result["child_seconds_with_preparation"] = round(time.perf_counter() - spawned, 2)
        return result

    def close(self) -> None:
        """Stop the children started ahead that will not get their turn."""
        for process, out, err, _ in self.children.values():
            _kill(process)
            out.close(), err.close()
        self.children.clear()
        self.folder.cleanup()


def _kill(process: subprocess.Popen[str]) -> None:
    """Ends a child this script started, and what it started (its own process group)."""
    with contextlib.suppress(OSError):
        os.killpg(process.pid, 9)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)


def _parse_child(stdout: str, stderr: str, returncode: int | None) -> dict[str, Any]:
    result: dict[str, Any] | None = None
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            result = json.loads(line[len(RESULT_MARKER) :])
            break
    if result is None:
        result = {"status": "error", "error": f"the child exited with {returncode} and no result"}
    if result["status"] == "error":
        result["stderr_tail"] = _tail(stderr)
    return result


# the replayed caching allocators of the estimate running in this thread (record_replays)
_REPLAYS = threading.local()


def record_replays() -> None:
    """Make memfit's CUDA replay (``memfit.estimate.replay.CudaMemory``) note each caching
    allocator it creates in the thread that asked, so that an estimate's replayed segments can be
    set beside the measured ones. A wrapper in this bench, once per process; memfit unchanged."""
    from memfit.estimate import replay

    if getattr(replay.CudaMemory, "recorded_by_gpu_validate", False):
        return
    shipped = replay.CudaMemory

    class RecordedCudaMemory(shipped):  # type: ignore[misc, valid-type]
        recorded_by_gpu_validate = True

        def __init__(self) -> None:
            super().__init__()
            allocators = getattr(_REPLAYS, "allocators", None)
            if allocators is not None:
                allocators.append(self.allocator)

    replay.CudaMemory = RecordedCudaMemory  # type: ignore[misc]


def replayed_segments(allocators: Sequence[Any], reserved: int | None) -> dict[str, Any] | None:
    """The segments of the replay whose reserved peak is the estimate's (else the last replay),
    summarised as the child's measured ones (one stream: the replay models the default one)."""
    if not allocators:
        return None
    chosen = next((a for a in allocators if a.max_reserved == reserved), allocators[-1])
    try:
        from memfit.estimate import device as memfit_device

        segments = [
            seg
            | {
                "stream": 0,
                "pool": "small" if seg["total"] == memfit_device.K_SMALL_BUFFER else "large",
            }
            for seg in chosen.segments()
        ]
    except Exception as exc:  # memfit's allocator replay changed its insides: say so
        return {"error": f"{type(exc).__name__}: {exc}"}
    summary = segment_summary(segments)
    summary["replays"] = len(allocators)
    summary["matches_reserved_peak"] = chosen.max_reserved == reserved
    return summary


def estimate_case(case: Case, device: str) -> tuple[dict[str, Any] | None, str | None]:
    """memfit's estimate of a case as a JSON-able dict, or the error it raised."""
    _REPLAYS.allocators = []
    try:
        from memfit.estimate import estimate

        record_replays()
        est = estimate(case.model, device=device, **case.estimate_kwargs())
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    finally:
        allocators, _REPLAYS.allocators = _REPLAYS.allocators, None
    details = est.details
    return {
        "total_bytes": int(est.total_bytes),
        "allocated_peak_bytes": details.get("allocated_peak_bytes"),
        "reserved_peak_bytes": details.get("reserved_peak_bytes"),
        "context_bytes": details.get("context_bytes"),
        "breakdown": {k: int(v) for k, v in est.breakdown.items()},
        "peak_phase": est.peak_phase,
        "loss": est.spec.loss,
        "device_profile": details.get("device_profile"),
        "method": details.get("method"),
        "num_parameters": details.get("num_parameters"),
        "trace_seconds": details.get("trace_seconds"),
        "estimate_seconds": details.get("estimate_seconds"),
        # the levers' own details: what lives outside the device's total (paged optimizer state in
        # CUDA unified memory; offloaded activations and optimizer state in host memory), the
        # weights' dtypes and the fused loss's implementation and chunks
        "paged_optimizer_state_bytes": details.get("paged_optimizer_state_bytes"),
        "host": details.get("host"),
        "weights": details.get("weights"),
        "cross_entropy": details.get("cross_entropy"),
        # the replayed allocator's segments at the end of the steady step (None: no CUDA replay,
        # or the estimate came from a cache), beside the child's measured.segments
        "segments": replayed_segments(allocators, details.get("reserved_peak_bytes")),
    }, None


def error_pct(estimated: float | None, measured: float | None) -> float | None:
    """(estimated - measured) / measured in %, None when either side is missing or measured is 0."""
    if estimated is None or measured is None or measured <= 0:
        return None
    return round(100.0 * (estimated - measured) / measured, 2)


def make_row(
    index: int,
    case: Case,
    device: str,
    child: Mapping[str, Any],
    estimated: dict[str, Any] | None,
    estimate_error: str | None,
    device_total: int | None,
) -> dict[str, Any]:
    stats = dict(child.get("stats") or {})
    status = str(child["status"])
    measured: dict[str, Any] = {
        "status": status,
        "allocated_peak_bytes": stats.pop("allocated_peak_bytes", None),
        "reserved_peak_bytes": stats.pop("reserved_peak_bytes", None),
        "context_bytes": stats.pop("context_bytes", None),
        "total_bytes": None,
        **stats,
        "timings": child.get("timings", {}),
        "child_seconds": child.get("child_seconds"),
    }
    if status == "ok":
        measured["total_bytes"] = measured["reserved_peak_bytes"] + measured["context_bytes"]
    for key in ("oom_phase", "error", "traceback", "stderr_tail", "library_problem"):
        if child.get(key):
            measured[key] = child[key]
    # what ran each lever in the child (Liger or memfit's loss, TRL, torchao)
    measured["implementations"] = child.get("implementations", {})
    if estimated is not None:
        estimated = dict(estimated)
        estimated["fits_device"] = (
            None if not device_total else estimated["total_bytes"] <= device_total
        )
    knobs = case.knobs()
    if estimated is not None:
        knobs["loss"] = estimated["loss"]
    est = estimated or {}
    return {
        "index": index,
        "id": case.id,
        "case": {**knobs, "device": device},
        "status": status,
        "measured": measured,
        "estimated": estimated,
        "estimate_error": estimate_error,
        "error_pct": {
            "total": error_pct(est.get("total_bytes"), measured["total_bytes"]),
            "reserved": error_pct(est.get("reserved_peak_bytes"), measured["reserved_peak_bytes"]),
            "allocated": error_pct(
                est.get("allocated_peak_bytes"), measured["allocated_peak_bytes"]
            ),
        },
        # an OOM the estimate saw coming: it did not fit the device either
        "oom_predicted": None
        if status != "oom" or not estimated
        else estimated["fits_device"] is False,
    }


def summarize(rows: Sequence[Mapping[str, Any]], planned: int) -> dict[str, Any]:
    """Median and max |error| per quantity over the cases with both a measurement and an estimate."""
    summary: dict[str, Any] = {
        "cases_planned": planned,
        "cases_run": len(rows),
        "ok": sum(r["status"] == "ok" for r in rows),
        "oom": sum(r["status"] == "oom" for r in rows),
        "oom_predicted": sum(bool(r.get("oom_predicted")) for r in rows),
        "errors": sum(r["status"] in ("error", "timeout") for r in rows),
        "estimate_errors": sum(r["estimate_error"] is not None for r in rows),
        # failures of an optional library (liger-kernel, TRL, torchao, bitsandbytes), not memfit's
        "library_problems": sum(bool(r["measured"].get("library_problem")) for r in rows),
    }
    for quantity in ("total", "reserved", "allocated"):
        errors = [
            (r["error_pct"][quantity], r["id"])
            for r in rows
            if r["error_pct"][quantity] is not None
        ]
        stats: dict[str, Any] = {
            "n": len(errors),
            "median_abs": None,
            "max_abs": None,
            "worst": None,
        }
        if errors:
            worst = max(errors, key=lambda e: abs(e[0]))
            stats.update(
                median_abs=round(statistics.median(abs(e) for e, _ in errors), 2),
                max_abs=round(abs(worst[0]), 2),
                worst=worst[1],
                mean=round(statistics.fmean(e for e, _ in errors), 2),
                underestimates=sum(e < 0 for e, _ in errors),
                worst_underestimate=round(min(e for e, _ in errors), 2),
            )
        summary[f"{quantity}_error_pct"] = stats
    total = summary["total_error_pct"]
    # issue 35's targets for the total: median |error| ≤ 2 %, max ≤ 5 %, none more than 2 % under
    summary["targets"] = (
        None
        if not total["n"]
        else {
            "median_abs_le_2pct": total["median_abs"] <= 2.0,
            "max_abs_le_5pct": total["max_abs"] <= 5.0,
            "none_under_2pct": total["worst_underestimate"] >= -2.0,
            "under_2pct": sorted(
                r["id"]
                for r in rows
                if r["error_pct"]["total"] is not None and r["error_pct"]["total"] < -2.0
            ),
        }
    )
    contexts = [
        r["measured"]["context_bytes"]
        for r in rows
        if r["status"] == "ok" and r["measured"]["context_bytes"]
    ]
    summary["context_bytes_median"] = int(statistics.median(contexts)) if contexts else None
    return summary


class RunFile:
    """The run's JSON document, rewritten (atomically) after every case."""

    def __init__(self, path: Path, header: dict[str, Any], planned: int) -> None:
        self.path = path
        self.planned = planned
        self.doc: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "kind": RUN_KIND,
            "header": header,
            "rows": [],
            "plan_checks": [],
            "summary": summarize([], planned),
        }
        self.write()

    def add_row(self, row: dict[str, Any]) -> None:
        self.doc["rows"].append(row)
        self.doc["summary"] = summarize(self.doc["rows"], self.planned)
        self.write()

    def add_plan_check(self, check: dict[str, Any]) -> None:
        self.doc["plan_checks"].append(check)
        self.write()

    def finish(self, **extra: Any) -> None:
        self.doc["header"].update(extra)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_name(self.path.name + ".tmp")
        scratch.write_text(json.dumps(self.doc, indent=1, sort_keys=False) + "\n", encoding="utf-8")
        os.replace(scratch, self.path)


# --- printing -----------------------------------------------------------------------------------------
def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}"


TABLE_HEADER = (
    f"{'#':>3} {'case':<50} {'meas GiB':>8} {'est GiB':>8} {'Δtotal%':>8} {'Δresv%':>7} {'Δalloc%':>8} "
    f"{'ctx MiB':>7} {'s':>5}"
)


def format_row(row: Mapping[str, Any]) -> str:
    measured, est, err = row["measured"], row["estimated"] or {}, row["error_pct"]
    context = measured.get("context_bytes")
    text = (
        f"{row['index'] + 1:>3} {row['id']:<50} {_gib(measured['total_bytes']):>8} {_gib(est.get('total_bytes')):>8} "
        f"{_pct(err['total']):>8} {_pct(err['reserved']):>7} {_pct(err['allocated']):>8} "
        f"{'-' if context is None else f'{context / MiB:.0f}':>7} {measured.get('child_seconds') or 0:>5.1f}"
    )
    if row["status"] != "ok":
        text += f"  {row['status'].upper()}"
        if row["status"] == "oom":
            predicted = row.get("oom_predicted")
            text += f" at {measured.get('oom_phase')} (estimate {'predicted it' if predicted else 'said it fits'})"
        elif measured.get("library_problem"):
            text += f" (library): {measured['library_problem'][:160]}"
        elif measured.get("error"):
            text += f": {measured['error'][:160]}"
    if row["estimate_error"]:
        text += f"  ESTIMATE ERROR: {row['estimate_error'][:160]}"
    return text


def print_summary(summary: Mapping[str, Any], path: Path, reproduce: str) -> None:
    print()
    print(
        f"cases: {summary['cases_run']}/{summary['cases_planned']} run, {summary['ok']} ok, {summary['oom']} OOM "
        f"({summary['oom_predicted']} predicted), {summary['errors']} failed, {summary['estimate_errors']} estimate errors"
    )
    for quantity in ("total", "reserved", "allocated"):
        stats = summary[f"{quantity}_error_pct"]
        if stats["n"]:
            print(
                f"{quantity:>9} error over {stats['n']} cases: median |err| {stats['median_abs']:.2f} %, "
                f"max |err| {stats['max_abs']:.2f} % ({stats['worst']}), "
                f"{stats['underestimates']} under-estimates (worst {stats['worst_underestimate']:+.2f} %)"
            )
        elif quantity == "total":
            print("    total error: no case has both a CUDA measurement and an estimate")
    targets = summary.get("targets")
    if targets:
        print(
            "  targets: median ≤ 2 % "
            + ("met" if targets["median_abs_le_2pct"] else "MISSED")
            + ", max ≤ 5 % "
            + ("met" if targets["max_abs_le_5pct"] else "MISSED")
            + ", none more than 2 % under "
            + (
                "met"
                if targets["none_under_2pct"]
                else f"MISSED: {', '.join(targets['under_2pct'])}"
            )
        )
    if summary.get("library_problems"):
        print(f"  {summary['library_problems']} cases failed for an optional library's reason")
    if summary.get("context_bytes_median"):
        print(f"  measured CUDA context (median): {summary['context_bytes_median'] / MiB:.0f} MiB")
    print(f"results: {path}")
    print(f"reproduce: {reproduce}")


# --- header -------------------------------------------------------------------------------------------
def reproduce_command(argv: Sequence[str]) -> str:
    return (
        f"cd {shlex.quote(str(ROOT))} && python bench/gpu_validate.py {shlex.join(argv)}".rstrip()
    )


def collect_header(
    argv: Sequence[str], device: str, *, smoke: bool, cases: Sequence[Case]
) -> dict[str, Any]:
    import numpy
    import torch
    import transformers

    import memfit

    now = dt.datetime.now(dt.timezone.utc)
    gpu: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        smi = _this_gpu(smi_gpus(), getattr(props, "uuid", None))
        gpu = {
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "total_memory_bytes": int(props.total_memory),
            "multi_processor_count": int(props.multi_processor_count),
            "uuid": None if smi is None else smi["uuid"],
            "driver_version": None if smi is None else smi["driver_version"],
            "smi_total_bytes": None if smi is None else smi["total_bytes"],
            "smi_used_bytes_at_start": None if smi is None else smi["used_bytes"],
            "device_count": torch.cuda.device_count(),
        }
        from memfit import devices as memfit_devices

        profile = dataclasses.asdict(memfit_devices.cuda_profile((props.major, props.minor)))
    return {
        "timestamp": now.isoformat(timespec="seconds"),
        "timestamp_compact": now.strftime("%Y%m%dT%H%M%SZ"),
        "device": device,
        "smoke": smoke,
        "gpu": gpu,
        "memfit_profile": profile,
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
            "transformers": transformers.__version__,
            "numpy": numpy.__version__,
            "memfit": memfit.__version__,
            "platform": platform.platform(),
        },
        # the optional libraries the levers run on, as installed (read without importing them)
        "packages": package_versions(),
        "not_measurable": NOT_MEASURABLE_HERE,
        # the commit the caller names (bench/gpu_truth.py --commit: the device machine's copy of
        # the tree may carry another .git state), else the checkout's
        "git_commit": os.environ.get("MEMFIT_COMMIT") or git_commit(),
        "hostname": platform.node(),
        "command": [sys.executable, *sys.argv],
        "argv": list(argv),
        "reproduce": reproduce_command(argv),
        "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
        "child_env_removed": list(CHILD_ENV_REMOVED),
        "warmup_steps": WARMUP_STEPS,
        "cases_planned": [c.id for c in cases],
    }


HEADER_PACKAGES = (
    "peft",
    "accelerate",
    "bitsandbytes",
    "liger-kernel",
    "trl",
    "torchao",
    "triton",
    "datasets",
    "sentence-transformers",
)


def package_versions() -> dict[str, str | None]:
    """Installed versions of the optional packages (None: not installed)."""
    import importlib.metadata

    versions: dict[str, str | None] = {}
    for name in HEADER_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def run_path(out_dir: Path, header: Mapping[str, Any]) -> Path:
    gpu = header["gpu"]["name"] if header["gpu"] else ("cpu-smoke" if header["smoke"] else "cpu")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-") or "device"
    path = out_dir / f"{header['timestamp_compact']}_{slug}.json"
    n = 1
    while path.exists():  # two runs in the same second
        n += 1
        path = out_dir / f"{header['timestamp_compact']}_{slug}_{n}.json"
    return path


# --- the run ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def estimates_ahead(cases: Sequence[Case], device: str) -> Iterator[list[Future[Any]]]:
    """Estimate every case, in order, in one background thread while the children run.

    The main thread only waits on child processes, so the (Python-heavy) tracing overlaps with the
    GPU work; traces are cached per model and knobs, so the thread soon runs ahead.
    """
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-estimate")
    try:
        yield [pool.submit(estimate_case, case, device) for case in cases]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Deadline:
    """Start no more children once the next one would likely end past ``budget_s`` (0: no limit)."""

    budget_s: float = 0.0
    started: float = dataclasses.field(default_factory=time.perf_counter)
    children: int = 0

    def allows_another(self) -> bool:
        if not self.budget_s or not self.children:
            return True
        elapsed = time.perf_counter() - self.started
        return elapsed + elapsed / self.children <= self.budget_s

    def allows(self, expected_s: float) -> bool:
        """Whether something expected to take ``expected_s`` more ends within the budget."""
        left = self.left()
        return left is None or expected_s <= left

    def left(self) -> float | None:
        """Seconds left of the budget (None: no limit)."""
        if not self.budget_s:
            return None
        return self.budget_s - (time.perf_counter() - self.started)

    def tick(self) -> None:
        self.children += 1


def run_cases(
    cases: Sequence[Case],
    device: str,
    run: RunFile,
    *,
    timeout_s: float,
    device_total: int | None,
    deadline: Deadline | None = None,
    prefetch: int = 0,
    memory_history: Path | None = None,
) -> None:
    """Estimate and measure every case, printing a table row and rewriting the JSON after each.
    ``prefetch``: children started that many cases ahead (see :class:`ChildPool`).
    ``memory_history``: a folder where each child leaves the caching allocator's history of its
    whole run (``torch.cuda.memory._snapshot()``, pickled; CUDA only), to set beside the replay's."""
    deadline = deadline or Deadline()
    print(TABLE_HEADER, flush=True)
    requests = [
        {"kind": "step", **case.knobs(), "device": device, "warmup": WARMUP_STEPS} for case in cases
    ]
    if memory_history is not None:
        memory_history.mkdir(parents=True, exist_ok=True)
        for index, request in enumerate(requests):
            name = cases[index].id.replace("/", "_")
            request["memory_history"] = str(memory_history / f"{name}.pickle")
    pool = ChildPool(requests, prefetch)
    with contextlib.ExitStack() as stack:
        stack.callback(pool.close)
        futures = stack.enter_context(estimates_ahead(cases, device))
        if prefetch:
            # the first children prepare (CPU only) while the first estimate runs
            pool.start_ahead(0)
        if futures and device == "cuda":
            # the first estimate before the first child: whatever the parent's torch sets up on the
            # device exists before any child reads its baseline
            futures[0].result()
        for index, (case, future) in enumerate(zip(cases, futures, strict=True)):
            if not deadline.allows_another():
                left = [c.id for c in cases[index:]]
                print(
                    f"time budget of {deadline.budget_s:.0f} s reached: {len(left)} cases left out",
                    flush=True,
                )
                run.finish(cases_left_out=left)
                return
            child = pool.run(index, timeout_s)
            deadline.tick()
            estimated, estimate_error = future.result()
            row = make_row(index, case, device, child, estimated, estimate_error, device_total)
            run.add_row(row)
            print(format_row(row), flush=True)


# --- plan check ---------------------------------------------------------------------------------------
PLAN_FIELDS: dict[str, tuple[str, ...]] = {
    "batch_size": (
        "micro_batch_size",
        "per_device_train_batch_size",
        "per_device_batch_size",
        "batch_size",
    ),
    "accumulation_steps": (
        "gradient_accumulation_steps",
        "accumulation_steps",
        "grad_accumulation_steps",
    ),
    "precision": ("precision",),
    "gradient_checkpointing": ("gradient_checkpointing",),
    "optimizer": ("optimizer",),
    "attn_implementation": ("attn_implementation",),
    # the levers a plan may choose (memfit.plan's PINS and max_seq_len): run as it chose them
    "max_seq_len": ("max_seq_len",),
    "lora_rank": ("lora_rank",),
    "quantization": ("quantization",),
    "double_quant": ("double_quant",),
    "weights_dtype": ("weights_dtype",),
    "cross_entropy": ("cross_entropy",),
    "activation_offloading": ("activation_offloading",),
    "optimizer_offload": ("optimizer_offload",),
    "predicted_total_bytes": (
        "predicted_peak_bytes",
        "total_bytes",
        "predicted_total_bytes",
        "predicted_bytes",
        "peak_bytes",
    ),
}
PLAN_NESTED = (
    "config",
    "configuration",
    "best",
    "recommended",
    "chosen",
    "choice",
    "plan",
    "estimate",
)


def find_planner() -> tuple[Callable[..., Any] | None, str]:
    """``memfit.plan`` when it exists (a function, or a module with a ``plan`` function)."""
    try:
        import memfit

        candidate: Any = getattr(memfit, "plan", None)
        if candidate is None:
            candidate = importlib.import_module("memfit.plan")
    except ImportError as exc:
        return None, f"memfit.plan not available ({exc})"
    except Exception as exc:  # a half-written module must not stop the validation run
        return None, f"memfit.plan failed to import: {type(exc).__name__}: {exc}"
    if isinstance(candidate, types.ModuleType):
        candidate = getattr(candidate, "plan", None)
    if not callable(candidate):
        return None, "memfit.plan not available (not callable)"
    return candidate, "memfit.plan"


def _shallow(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, Mapping):
        return dict(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        with contextlib.suppress(Exception):
            value = to_dict()
            if isinstance(value, Mapping):
                return dict(value)
    if hasattr(obj, "__dict__"):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    return None


def plan_settings(plan: Any, effective_batch: int) -> tuple[dict[str, Any], list[str]]:
    """The configuration a plan chose, read tolerantly; returns it and the fields assumed."""
    layers: list[dict[str, Any]] = []
    queue = [plan]
    while queue and len(layers) < 8:
        found = _shallow(queue.pop(0))
        if found is None:
            continue
        layers.append(found)
        queue.extend(found[k] for k in PLAN_NESTED if found.get(k) is not None)
    settings: dict[str, Any] = {}
    for field_name, names in PLAN_FIELDS.items():
        for layer in layers:
            value = next((layer[n] for n in names if layer.get(n) is not None), None)
            if value is not None:
                settings[field_name] = value
                break
    if "batch_size" not in settings:
        raise ValueError(f"no micro-batch size in the plan: {_brief(plan)}")
    assumed: list[str] = []
    defaults = {
        "accumulation_steps": math.ceil(effective_batch / int(settings["batch_size"])),
        "precision": "fp32",
        "gradient_checkpointing": False,
        "optimizer": "adamw",
        "attn_implementation": "sdpa",
    }
    for key, value in defaults.items():
        if key not in settings:
            settings[key] = value
            assumed.append(key)
    settings["batch_size"] = int(settings["batch_size"])
    settings["accumulation_steps"] = int(settings["accumulation_steps"])
    settings["gradient_checkpointing"] = bool(settings["gradient_checkpointing"])
    # a lever the plan says nothing of (or None: not used) runs as a Case's default
    if "lora_rank" in settings:
        settings["lora_rank"] = int(settings["lora_rank"] or 0)
    for key in ("double_quant", "activation_offloading"):
        if key in settings:
            settings[key] = bool(settings[key])
    return settings, assumed


def _brief(obj: Any, limit: int = 400) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[:limit] + "…"


def plan_pool(workers: int) -> Any:
    """Where the plans are made: ``workers`` spawned processes (the planner is Python-heavy
    tracing, one GIL per process: on the 16 cores of the GPU hosts the three plans of
    --plans-only take the longest one's time, not their sum; a fork would inherit this process's
    CUDA), or one thread of this process when ``workers`` is 1 or processes cannot start."""
    if workers > 1:
        import multiprocessing

        with contextlib.suppress(Exception):
            return ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn")
            )
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-plan")


def _stop_pool(pool: Any) -> None:
    """Shut a plan pool down without waiting; a process still planning is ended (its plan is
    left out), so that the run does not wait for it at exit."""
    processes = list(getattr(pool, "_processes", None) or {})
    workers = dict(getattr(pool, "_processes", None) or {})
    pool.shutdown(wait=False, cancel_futures=True)
    for pid in processes:
        with contextlib.suppress(Exception):
            workers[pid].terminate()


def plan_base_request(
    model: str,
    task: str,
    seq_len: int,
    budget: int,
    options: Mapping[str, Any] | None,
    device: str,
    device_total: int | None,
    optimizer_steps: int,
) -> dict[str, Any]:
    """A plan check's child request before its plan is known: the pinned knobs (a child started
    ahead imports what they build), the budget and its cap; the plan's knobs come with the go."""
    pins = {k: v for k, v in (options or {}).items() if k in Case.__dataclass_fields__}
    return {
        "kind": "plan",
        **Case(model, task, 1, seq_len, **pins).knobs(),
        "device": device,
        "optimizer_steps": optimizer_steps,
        "budget_bytes": budget,
        # the allocator may reserve up to the budget (the CUDA context comes on top)
        "memory_fraction": None if not device_total else min(1.0, budget / device_total),
    }


def run_plan_checks(
    planner: Callable[..., Any],
    checks: Sequence[tuple[Any, ...]],
    device: str,
    run: RunFile,
    *,
    timeout_s: float,
    device_total: int | None,
    deadline: Deadline | None = None,
    optimizer_steps: int = PLAN_OPTIMIZER_STEPS,
    prefetch: int | None = None,
    plan_workers: int | None = None,
) -> None:
    """For each (model, task, seq_len, budget[, the plan's keywords]): plan, then run the plan
    for real (``optimizer_steps`` optimizer steps) under the budget.

    The plans are made at once in ``plan_workers`` processes (default: one per check) while the
    checks' children, started ``prefetch`` checks ahead (default: all at once; 0: each at its
    turn), import; a child gets its plan's knobs with its go, when the previous one has exited. A check starts only when its plan is made and the
    longest plan run so far still ends within the time budget."""
    deadline = deadline or Deadline()
    print(f"\nplan check ({optimizer_steps} optimizer steps of each plan):", flush=True)
    requests = [
        plan_base_request(
            model,
            task,
            seq_len,
            budget,
            more[0] if more else None,
            device,
            device_total,
            optimizer_steps,
        )
        for model, task, seq_len, budget, *more in checks
    ]
    depth = len(requests) if prefetch is None else prefetch
    children = ChildPool(requests, depth)
    pool = plan_pool(len(checks) if plan_workers is None else plan_workers)
    try:
        futures = [
            pool.submit(ask_plan, planner, model, task, seq_len, budget, more[0] if more else None)
            for model, task, seq_len, budget, *more in checks
        ]
        if depth:
            children.start_ahead(0)
        longest_run = 0.0
        for index, future in enumerate(futures):
            left = deadline.left()
            check = None
            try:
                check = future.result(timeout=None if left is None else max(left, 0.0))
            except FutureTimeout:
                pass
            except Exception as exc:  # a planning process that died (BrokenProcessPool)
                model, task, seq_len, budget, *more = checks[index]
                check = plan_record(model, task, seq_len, budget, more[0] if more else None)
                check.update(status="plan-error", error=f"{type(exc).__name__}: {exc}")
            if check is None or not deadline.allows(longest_run):
                print(
                    f"time budget of {deadline.budget_s:.0f} s reached: "
                    f"{len(futures) - index} plan checks left out",
                    flush=True,
                )
                run.finish(plan_checks_left_out=[list(c[:4]) for c in checks[index:]])
                return
            if check["status"] == "ok":
                run_plan(
                    check,
                    device,
                    timeout_s=timeout_s,
                    device_total=device_total,
                    optimizer_steps=optimizer_steps,
                    children=children if depth else None,
                    index=index,
                )
                longest_run = max(longest_run, float(check["measured"].get("child_seconds") or 0))
                deadline.tick()
            run.add_plan_check(check)
            print(format_plan_check(check), flush=True)
    finally:
        _stop_pool(pool)
        children.close()


def ask_plan(
    planner: Callable[..., Any],
    model: str,
    task: str,
    seq_len: int,
    budget: int,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A plan-check record with what the planner chose (status ok), or why there is no plan.
    ``options``: the plan's keywords (``effective_batch_size``, default PLAN_EFFECTIVE_BATCH,
    and pins such as ``lora_rank`` or ``precision``)."""
    from memfit.errors import NothingFitsError

    keywords = dict(options or {})
    effective = int(keywords.pop("effective_batch_size", PLAN_EFFECTIVE_BATCH))
    check = plan_record(model, task, seq_len, budget, options)
    started = time.perf_counter()
    try:
        plan = planner(
            model,
            task=task,
            seq_len=seq_len,
            effective_batch_size=effective,
            gpu_memory=budget,
            **keywords,
        )
        check["plan_seconds"] = round(time.perf_counter() - started, 2)
        as_dict = plan.to_dict() if callable(getattr(plan, "to_dict", None)) else plan
        if isinstance(as_dict, Mapping) and as_dict.get("fits") is False:
            # memfit.plan answers "nothing fits" with a plan object, not an exception
            check.update(status="nothing-fits", error="; ".join(as_dict.get("suggestions", [])))
            return check
        settings, check["assumed"] = plan_settings(as_dict, effective)
        check["plan"] = {**settings, "repr": _brief(plan)}
        check["plan_changed"] = plan_changes(settings, effective, keywords)
    except NothingFitsError as exc:
        check.update(status="nothing-fits", error=str(exc))
    except Exception as exc:
        check.update(status="plan-error", error=f"{type(exc).__name__}: {exc}")
    return check


def plan_record(
    model: str, task: str, seq_len: int, budget: int, options: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A plan check's record before its plan (status ok until something says otherwise)."""
    keywords = dict(options or {})
    effective = int(keywords.pop("effective_batch_size", PLAN_EFFECTIVE_BATCH))
    return {
        "model": model,
        "task": task,
        "seq_len": seq_len,
        "effective_batch_size": effective,
        "budget_bytes": budget,
        "pins": keywords,
        "plan": None,
        "assumed": [],
        "status": "ok",
        "fits": None,
        "measured": None,
        "error": None,
    }


def plan_changes(settings: Mapping[str, Any], effective: int, pins: Mapping[str, Any]) -> list[str]:
    """What the plan changed from the plain job (the whole batch in one micro-batch, no
    checkpointing, every lever the plan was free to choose at its default)."""
    changed = []
    if settings["batch_size"] < effective:
        changed.append(f"micro-batch {settings['batch_size']} of {effective}")
    if settings["gradient_checkpointing"]:
        changed.append("gradient checkpointing")
    for name, field in Case.__dataclass_fields__.items():
        if name in settings and name not in pins and name not in ("batch_size",):
            plain = field.default
            if (
                name
                in (
                    "lora_rank",
                    "quantization",
                    "double_quant",
                    "weights_dtype",
                    "cross_entropy",
                    "activation_offloading",
                    "optimizer_offload",
                    "optimizer",
                )
                and settings[name] != plain
            ):
                changed.append(f"{name} {settings[name]}")
    return changed


def run_plan(
    check: dict[str, Any],
    device: str,
    *,
    timeout_s: float,
    device_total: int | None,
    optimizer_steps: int = PLAN_OPTIMIZER_STEPS,
    children: ChildPool | None = None,
    index: int = 0,
) -> None:
    """Run a plan's configuration for real in a child, capped at the budget; fills ``measured``.
    ``children``: the checks' children started ahead (``index`` is this check's); without, a
    fresh child."""
    budget = int(check["budget_bytes"])
    plan = check["plan"]
    # the Case's knobs the plan chose, and its accumulation (not its prediction or repr)
    knobs = {
        k: v for k, v in plan.items() if k in Case.__dataclass_fields__ or k == "accumulation_steps"
    }
    # truncation the plan chose: the run's sequences are cut to it
    seq_len = min(int(check["seq_len"]), int(plan.get("max_seq_len") or check["seq_len"]))
    request = {
        "kind": "plan",
        **Case(check["model"], check["task"], 1, seq_len).knobs(),
        **knobs,
        "device": device,
        "optimizer_steps": optimizer_steps,
        "budget_bytes": budget,
        # the allocator may reserve up to the budget (the CUDA context comes on top)
        "memory_fraction": None if not device_total else min(1.0, budget / device_total),
    }
    if children is None:
        child = run_child(request, timeout_s)
    else:
        child = children.run(index, timeout_s, update=request)
    stats = dict(child.get("stats") or {})
    total = (
        stats["reserved_peak_bytes"] + stats["context_bytes"] if child["status"] == "ok" else None
    )
    check["status"] = child["status"]
    check["error"] = child.get("error")
    check["library_problem"] = child.get("library_problem")
    check["implementations"] = child.get("implementations", {})
    predicted = plan.get("predicted_total_bytes")
    # fits: ran under the cap without an OOM, and the device held no more than the budget (the
    # CPU has no cap: there it says nothing)
    check["fits"] = (
        None
        if device != "cuda"
        else child["status"] == "ok" and total is not None and total <= budget
    )
    check["measured"] = {
        **stats,
        "total_bytes": total,
        "fraction_of_budget": None if total is None else round(total / budget, 4),
        "within_budget": None if total is None else total <= budget,
        "predicted_error_pct": error_pct(predicted, total),
        "timings": child.get("timings", {}),
        "child_seconds": child.get("child_seconds"),
        "child_seconds_with_preparation": child.get("child_seconds_with_preparation"),
    }
    if child["status"] in ("error", "timeout"):
        check["measured"]["stderr_tail"] = child.get("stderr_tail")
        check["measured"]["traceback"] = child.get("traceback")


def format_plan_check(check: Mapping[str, Any]) -> str:
    head = f"  {Path(check['model']).name:<20} seq {check['seq_len']:>5}  budget {check['budget_bytes'] / GiB:>5.1f} GiB: "
    if check["plan"] is None:
        return head + f"{check['status']}: {check['error']}"
    plan = check["plan"]
    knobs = (
        f"micro {plan['batch_size']} × {plan['accumulation_steps']}, {plan['precision']}, "
        f"{'gc' if plan['gradient_checkpointing'] else 'no gc'}"
    )
    levers = [
        f"{name} {plan[name]}"
        for name, plain in (
            ("lora_rank", 0),
            ("quantization", "none"),
            ("weights_dtype", "auto"),
            ("cross_entropy", "standard"),
            ("activation_offloading", False),
            ("optimizer_offload", "none"),
        )
        if plan.get(name, plain) != plain
    ]
    if plan.get("max_seq_len") and int(plan["max_seq_len"]) < int(check["seq_len"]):
        levers.append(f"max_seq_len {plan['max_seq_len']}")
    knobs += "".join(", " + lever for lever in levers)
    measured = check["measured"] or {}
    if check["status"] == "ok":
        fits = (
            "cpu: no cap"
            if check.get("fits") is None
            else ("fits" if check["fits"] else "OVER BUDGET")
        )
        return (
            head
            + f"{knobs} → {_gib(measured['total_bytes'])} GiB = {measured['fraction_of_budget']:.0%} of the budget ({fits})"
        )
    return head + f"{knobs} → {check['status'].upper()} {check['error'] or ''}"


def plan_check_list(models: set[str] | None) -> list[tuple[str, str, int, int]]:
    return [
        (model, task, seq_len, budget * GiB)
        for budget in PLAN_BUDGETS_GIB
        for model, task, seq_len in PLAN_MODELS
        if models is None or model in models
    ]


# --- schema -------------------------------------------------------------------------------------------
HEADER_KEYS = (
    "timestamp",
    "device",
    "smoke",
    "gpu",
    "memfit_profile",
    "software",
    "git_commit",
    "command",
    "reproduce",
)
GPU_KEYS = ("name", "compute_capability", "total_memory_bytes", "driver_version")
SOFTWARE_KEYS = ("python", "torch", "cuda", "transformers", "numpy", "memfit")
CASE_KEYS = (
    "model",
    "task",
    "batch_size",
    "seq_len",
    "precision",
    "gradient_checkpointing",
    "attn_implementation",
    "mode",
    "optimizer",
    "loss",
    "num_labels",
    "lora_rank",
    "quantization",
    "double_quant",
    "weights_dtype",
    "cross_entropy",
    "activation_offloading",
    "optimizer_offload",
    "device",
)
ROW_KEYS = (
    "index",
    "id",
    "case",
    "status",
    "measured",
    "estimated",
    "estimate_error",
    "error_pct",
    "oom_predicted",
)
MEASURED_KEYS = (
    "status",
    "allocated_peak_bytes",
    "reserved_peak_bytes",
    "context_bytes",
    "total_bytes",
)
ESTIMATED_KEYS = (
    "total_bytes",
    "allocated_peak_bytes",
    "reserved_peak_bytes",
    "context_bytes",
    "breakdown",
    "peak_phase",
)
STATUSES = ("ok", "oom", "error", "timeout")
PLAN_CHECK_KEYS = (
    "model",
    "task",
    "seq_len",
    "budget_bytes",
    "plan",
    "status",
    "measured",
    "error",
)


def validate_run(doc: Mapping[str, Any]) -> list[str]:
    """Problems with a run document (empty when it follows the schema)."""
    from memfit.estimate import BREAKDOWN_KEYS

    problems: list[str] = []

    def need(obj: Any, keys: Sequence[str], where: str) -> bool:
        """Record what ``obj`` lacks; True when it is an object with every key (safe to look inside)."""
        if not isinstance(obj, Mapping):
            problems.append(f"{where}: expected an object, got {type(obj).__name__}")
            return False
        missing = [k for k in keys if k not in obj]
        problems.extend(f"{where}: missing {k!r}" for k in missing)
        return not missing

    def number(value: Any, where: str, *, optional: bool = True) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{where}: expected a number, got {value!r}")

    need(doc, ("schema_version", "kind", "header", "rows", "plan_checks", "summary"), "run")
    if doc.get("schema_version") != SCHEMA_VERSION or doc.get("kind") != RUN_KIND:
        problems.append(f"run: not a {RUN_KIND} v{SCHEMA_VERSION} document")
    header = doc.get("header", {})
    if need(header, HEADER_KEYS, "header"):
        need(header.get("software"), SOFTWARE_KEYS, "header.software")
        if header.get("device") == "cuda":
            need(header.get("gpu"), GPU_KEYS, "header.gpu")
    for i, row in enumerate(doc.get("rows", [])):
        where = f"rows[{i}]"
        if not need(row, ROW_KEYS, where):
            continue
        if row["status"] not in STATUSES:
            problems.append(f"{where}.status: unknown {row['status']!r}")
        need(row["case"], CASE_KEYS, f"{where}.case")
        if need(row["measured"], MEASURED_KEYS, f"{where}.measured"):
            for key in MEASURED_KEYS[1:]:
                number(row["measured"][key], f"{where}.measured.{key}")
            if row["status"] == "ok":
                number(
                    row["measured"]["total_bytes"], f"{where}.measured.total_bytes", optional=False
                )
        if row["estimated"] is None:
            if not row["estimate_error"]:
                problems.append(f"{where}: neither an estimate nor an estimate_error")
        elif need(row["estimated"], ESTIMATED_KEYS, f"{where}.estimated"):
            number(
                row["estimated"]["total_bytes"], f"{where}.estimated.total_bytes", optional=False
            )
            breakdown = row["estimated"]["breakdown"]
            if not isinstance(breakdown, Mapping) or set(breakdown) != set(BREAKDOWN_KEYS):
                problems.append(f"{where}.estimated.breakdown: keys are not {list(BREAKDOWN_KEYS)}")
            elif sum(breakdown.values()) != row["estimated"]["total_bytes"]:
                problems.append(f"{where}.estimated.breakdown: does not sum to total_bytes")
        if need(row["error_pct"], ("total", "reserved", "allocated"), f"{where}.error_pct"):
            for key in ("total", "reserved", "allocated"):
                number(row["error_pct"][key], f"{where}.error_pct.{key}")
    for i, check in enumerate(doc.get("plan_checks", [])):
        need(check, PLAN_CHECK_KEYS, f"plan_checks[{i}]")
    summary = doc.get("summary", {})
    if need(
        summary, ("cases_planned", "cases_run", "ok", "oom", "errors", "total_error_pct"), "summary"
    ):
        need(summary["total_error_pct"], ("n", "median_abs", "max_abs"), "summary.total_error_pct")
        if summary["cases_run"] != len(doc.get("rows", [])):
            problems.append("summary.cases_run: does not match the number of rows")
    return problems


# --- smoke: every code path on the CPU, in seconds ----------------------------------------------------
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-bert": (
        "bert",
        dict(
            vocab_size=512,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        ),
    ),
    "tiny-gpt2": (
        "gpt2",
        dict(
            vocab_size=512,
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    # a config that says bf16, as the embedded LLMs' do: weights_dtype "auto" is a bf16 base
    "tiny-llama-bf16": (
        "llama",
        dict(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=64,
            dtype="bfloat16",
        ),
    ),
    "tiny-llama": (
        "llama",
        dict(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=64,
        ),
    ),
}


def write_tiny_models(folder: Path) -> dict[str, str]:
    import transformers

    paths = {}
    for name, (model_type, kwargs) in TINY_CONFIGS.items():
        transformers.AutoConfig.for_model(model_type, **kwargs).save_pretrained(folder / name)
        paths[name] = str(folder / name)
    return paths


# the new knobs' non-default values, each of which --new-knobs must run at least once
NEW_KNOB_VALUES: dict[str, tuple[Any, ...]] = {
    "quantization": ("nf4", "int8"),
    "double_quant": (True, False),
    "optimizer": ("adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit"),
    "weights_dtype": ("auto", "bf16"),
    "cross_entropy": ("fused-linear",),
    "activation_offloading": (True,),
    "optimizer_offload": ("cpu",),
}


def case_problems(case: Case, device: str = "cuda") -> list[str]:
    """What memfit's own checks refuse in a case (those ``memfit estimate`` would name)."""
    try:
        _spec_for({**case.knobs(), "device": device})
    except Exception as exc:
        return [f"{case.id}: {type(exc).__name__}: {exc}"]
    return []


def check_case_lists() -> list[str]:
    """Every case list is well formed (the smoke test builds them, never runs them): ids unique,
    knobs memfit accepts, --new-knobs covering every new knob's values, --plans-only's models
    known and its pins the planner's."""
    from memfit import job as memfit_job
    from memfit.models import resolve_model
    from memfit.plan.planner import PINS

    problems = []
    cases = build_cases()
    if not 40 <= len(cases) <= 60:
        problems.append(f"the default matrix has {len(cases)} cases (expected 40-60)")
    for name, listed in (
        ("default", cases),
        ("quick", list(QUICK_CASES)),
        ("qlora", list(QLORA_CASES)),
        ("new-knobs", list(NEW_KNOB_CASES)),
    ):
        ids = [c.id for c in listed]
        if len(set(ids)) != len(ids):
            problems.append(f"the {name} matrix repeats a case")
        for c in listed:
            if (
                c.task not in memfit_job.TASKS
                or c.precision not in memfit_job.PRECISIONS
                or c.mode not in memfit_job.MODES
                or c.quantization not in memfit_job.QUANTIZATIONS
                or c.optimizer not in memfit_job.OPTIMIZERS
                or c.weights_dtype not in memfit_job.WEIGHTS_DTYPES
                or c.cross_entropy not in memfit_job.CROSS_ENTROPIES
                or c.optimizer_offload not in memfit_job.OPTIMIZER_OFFLOADS
            ):
                problems.append(f"{c.id}: unknown knob")
    for case in NEW_KNOB_CASES:
        problems += case_problems(case)
    for knob, values in NEW_KNOB_VALUES.items():
        ran = {getattr(c, knob) for c in NEW_KNOB_CASES}
        problems += [f"--new-knobs: no case with {knob}={v!r}" for v in values if v not in ran]
    if not any(c.weights_dtype == "auto" and c.lora_rank for c in NEW_KNOB_CASES):
        problems.append("--new-knobs: no LoRA case over the checkpoint's own (auto) base")
    for knob in ("activation_offloading", "cross_entropy"):
        plain = Case.__dataclass_fields__[knob].default
        checkpointing = {
            c.gradient_checkpointing for c in NEW_KNOB_CASES if getattr(c, knob) != plain
        }
        if checkpointing != {True, False}:
            problems.append(f"--new-knobs: {knob} not run both with and without checkpointing")
    # round-robin: the first cases cover every group
    first = set(NEW_KNOB_CASES[: len(NEW_KNOB_GROUPS)])
    problems += [
        f"--new-knobs: the group {name!r} has no case among the first {len(NEW_KNOB_GROUPS)}"
        for name, group in NEW_KNOB_GROUPS
        if not first & set(group)
    ]
    if len(PLANS_ONLY) != 3:
        problems.append(f"--plans-only has {len(PLANS_ONLY)} plans (the issue asks for three)")
    for model, task, _, budget, options in PLANS_ONLY:
        try:
            resolve_model(model)
        except Exception as exc:
            problems.append(f"--plans-only: {model}: {exc}")
        unknown = set(options) - {"effective_batch_size", "precision", *PINS}
        if unknown or task not in memfit_job.TASKS or budget <= 0:
            problems.append(f"--plans-only: {model}: bad check ({sorted(unknown)}, {task})")
    return problems


def smoke_new_knob_cases(models: Mapping[str, str]) -> list[Case]:
    """--new-knobs on tiny configs: every new knob in four children (the GPU run's sixteen
    cases would take minutes on a small CPU). ``tiny-llama-bf16``'s config says bf16, so its
    ``auto`` base is bf16 as the embedded LLMs' are."""
    llama, gpt2 = models["tiny-llama-bf16"], models["tiny-gpt2"]
    cases = [
        # pure bf16 full fine-tuning with the fused loss and checkpointing
        Case(
            llama,
            LM,
            2,
            32,
            "bf16",
            gradient_checkpointing=True,
            weights_dtype="bf16",
            cross_entropy="fused-linear",
        ),
        # LoRA over the bf16 base (auto), the saved activations offloaded
        Case(llama, LM, 2, 32, "bf16", lora_rank=16, activation_offloading=True),
        Case(gpt2, LM, 2, 32, "fp32", optimizer_offload="cpu"),
    ]
    if importlib.util.find_spec("bitsandbytes") is not None:
        # QLoRA and a paged optimizer: real bitsandbytes layers and optimizer (they run on the
        # CPU), nf4 and int8 bases built on the device after the go as on CUDA
        cases.insert(0, Case(llama, LM, 2, 32, "bf16", optimizer="paged-adamw-8bit", **QLORA))
        cases.insert(2, Case(llama, LM, 2, 32, "bf16", lora_rank=8, quantization="int8"))
    return cases


def smoke_plan_checks(models: Mapping[str, str]) -> list[tuple[str, str, int, int, dict[str, Any]]]:
    """--plans-only on tiny configs, the real planner, its plans run on the CPU (no cap there).
    Each budget lies between what micro-batch 1 and the whole batch need (memfit's CUDA
    estimates, the planner's 5 % margin taken off), so that every plan changes something."""
    from memfit.estimate import estimate

    effective, seq_len = 64, 32
    checks = []
    for name, task, options in (
        ("tiny-bert", CLS, {}),
        ("tiny-gpt2", LM, {"cross_entropy": "standard"}),
        ("tiny-llama-bf16", LM, {"lora_rank": 16, "cross_entropy": "fused-linear"}),
    ):
        knobs = {**PLAN_PINS, **options}
        need = [
            estimate(models[name], task=task, batch_size=b, seq_len=seq_len, **knobs).total_bytes
            for b in (1, effective)
        ]
        budget = int(sum(need) / 2 / 0.95)
        checks.append(
            (models[name], task, seq_len, budget, {"effective_batch_size": effective, **knobs})
        )
    return checks


def _stub_plan(model: str, **_: Any) -> dict[str, Any]:
    """The smoke test's plan for the default run's --plan-check path."""
    return {
        "config": {
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "precision": "fp32",
        }
    }


def run_smoke(args: argparse.Namespace, argv: Sequence[str]) -> int:
    started = time.perf_counter()
    problems = check_case_lists()
    print(
        f"smoke: default matrix {len(build_cases())} cases, quick {len(QUICK_CASES)}, "
        f"new knobs {len(NEW_KNOB_CASES)}, plan checks {len(plan_check_list(None))}, "
        f"plans only {len(PLANS_ONLY)}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="memfit-gpu-validate-smoke-") as tmp:
        models = write_tiny_models(Path(tmp))
        if args.plans_only:
            cases: list[Case] = []
        elif args.new_knobs:
            cases = smoke_new_knob_cases(models)
        else:
            cases = [
                Case(models["tiny-bert"], CLS, 4, 32, "fp32", gradient_checkpointing=True),
                Case(models["tiny-gpt2"], LM, 2, 32, "bf16", attn_implementation="eager"),
            ]
            if importlib.util.find_spec("bitsandbytes") is not None:
                # the --qlora path: real bitsandbytes layers in the child (they run on the CPU too)
                cases.append(Case(models["tiny-llama"], LM, 2, 32, "fp32", **QLORA))
        header = collect_header(argv, "cpu", smoke=True, cases=cases)
        path = run_path(Path(args.out) if args.out else Path(tmp) / "results", header)
        print(f"reproduce: {header['reproduce']}", flush=True)
        run = RunFile(path, header, len(cases))
        deadline = Deadline(args.time_budget)
        if cases:
            # one child prepared ahead: the GPU run's path (on 2 cores more would only contend)
            run_cases(
                cases,
                "cpu",
                run,
                timeout_s=args.timeout,
                device_total=None,
                deadline=deadline,
                prefetch=min(args.prefetch, 1),
            )

        planner, source = find_planner()
        if args.new_knobs:
            pass  # no plan check in this mode
        elif planner is None:
            problems.append(f"plan check skipped: {source}")
        elif args.plans_only:
            run_plan_checks(
                planner,
                smoke_plan_checks(models),
                "cpu",
                run,
                timeout_s=args.timeout,
                device_total=None,
                deadline=deadline,
                # one optimizer step of accumulated micro-batches: the GPU run's path, in seconds
                optimizer_steps=1,
                # the plans made in spawned processes and the children started ahead, as on the
                # GPU host (two planners, one child ahead: the smoke's 2 cores)
                plan_workers=2,
                prefetch=1,
            )
            print_plan_summary(run.doc["plan_checks"])
        else:
            print(
                "plan check: memfit.plan found; the smoke test runs the plan check with a stub plan",
                flush=True,
            )
            run_plan_checks(
                _stub_plan,
                [(models["tiny-bert"], CLS, 32, 1 * GiB)],
                "cpu",
                run,
                timeout_s=args.timeout,
                device_total=None,
            )
        run.finish(seconds=round(time.perf_counter() - started, 1))
        doc = json.loads(path.read_text(encoding="utf-8"))
        problems += validate_run(doc)
        problems += [
            f"{r['id']}: {r['status']} {r['measured'].get('error', '')}"
            for r in doc["rows"]
            if r["status"] != "ok"
        ]
        problems += [
            f"{r['id']}: estimate error {r['estimate_error']}"
            for r in doc["rows"]
            if r["estimate_error"]
        ]
        problems += [
            f"plan check: {c['status']} {c['error']}"
            for c in doc["plan_checks"]
            if c["status"] != "ok"
        ]
        if args.new_knobs:
            problems += smoke_knob_coverage(doc["rows"])
            problems += smoke_segments(doc["rows"], cases[-1])
        if args.plans_only and len(doc["plan_checks"]) != len(PLANS_ONLY):
            problems.append(f"plans only: {len(doc['plan_checks'])} plan checks ran")
        print_summary(doc["summary"], path, header["reproduce"])
    elapsed = time.perf_counter() - started
    if problems:
        print(f"smoke FAILED in {elapsed:.1f} s:", *problems, sep="\n  ", file=sys.stderr)
        return 1
    print(f"smoke ok in {elapsed:.1f} s")
    return 0


def smoke_segments(rows: Sequence[Mapping[str, Any]], case: Case) -> list[str]:
    """The segment diagnostics on the CPU: the measured side is None in every row (no CUDA), and
    the estimator's side, asked of a CUDA estimate of ``case`` (traced on the CPU), lists the
    replayed segments and adds up to its reserved peak."""
    problems = [
        f"{r['id']}: measured.segments on the CPU: {r['measured'].get('segments')!r}"
        for r in rows
        if r["measured"].get("segments") is not None
    ]
    estimated, error = estimate_case(case, "cuda")
    estimated = estimated or {}
    segments = estimated.get("segments")
    if error or not segments or "error" in segments:
        problems.append(f"estimated.segments of a CUDA estimate: {error or segments!r}")
    elif (
        not segments["largest"]
        or abs(segments["reserved_mib"] * MiB - (estimated["reserved_peak_bytes"] or 0)) > MiB
    ):
        problems.append(f"estimated.segments do not add up to the reserved peak: {segments!r}")
    return problems


def smoke_knob_coverage(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The --new-knobs smoke rows run every new lever (QLoRA only where bitsandbytes is)."""
    wanted = {
        "weights_dtype": "bf16",
        "cross_entropy": "fused-linear",
        "activation_offloading": True,
        "optimizer_offload": "cpu",
    }
    wanted_pairs = list(wanted.items())
    if importlib.util.find_spec("bitsandbytes") is not None:
        wanted_pairs += [
            ("quantization", "nf4"),
            ("quantization", "int8"),
            ("optimizer", "paged-adamw-8bit"),
        ]
    return [
        f"new knobs smoke: no row ran {knob}={value!r}"
        for knob, value in wanted_pairs
        if not any(r["case"].get(knob) == value and r["status"] == "ok" for r in rows)
    ]


# --- main ---------------------------------------------------------------------------------------------
def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/gpu_validate.py",
        description="Compare memfit's CUDA estimates with real steps on this GPU (one child process per case).",
    )
    parser.add_argument(
        "--models", type=_csv, action="extend", help="comma-separated models of the matrix"
    )
    parser.add_argument(
        "--precisions", type=_csv, action="extend", help="comma-separated, default fp32,bf16"
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"{len(QUICK_CASES)} cases instead of the matrix"
    )
    parser.add_argument(
        "--qlora",
        action="store_true",
        help=f"{len(QLORA_CASES)} QLoRA cases (LoRA on bitsandbytes 4-/8-bit base weights)",
    )
    parser.add_argument(
        "--new-knobs",
        action="store_true",
        help=f"{len(NEW_KNOB_CASES)} cases of the levers since the last GPU run (QLoRA, 8-bit and "
        "paged optimizers, 16-bit weights, fused-linear cross-entropy, activation and optimizer "
        "offloading)",
    )
    parser.add_argument(
        "--plans-only",
        action="store_true",
        help=f"no estimator cases: {len(PLANS_ONLY)} plans run for real under a hard cap "
        "(set_per_process_memory_fraction(budget))",
    )
    parser.add_argument("--limit", type=int, default=None, help="run only the first N cases")
    parser.add_argument(
        "--only",
        type=lambda text: [int(x) for x in text.split(",") if x.strip()],
        default=None,
        help="comma-separated case numbers as --list prints them, run in that order",
    )
    parser.add_argument(
        "--out",
        default=None,
        help=f"folder for the run's JSON (default {DEFAULT_OUT.relative_to(ROOT)})",
    )
    parser.add_argument(
        "--plan-check", action="store_true", help="also run memfit.plan's choices under budgets"
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per child process"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=DEFAULT_TIME_BUDGET_S,
        help="start no case that would likely end after S seconds (default %(default).0f, "
        "which keeps a run under 9 minutes; 0: no limit)",
    )
    parser.add_argument(
        "--prefetch",
        type=int,
        default=DEFAULT_PREFETCH,
        help="start each case's child this many cases ahead: it imports and builds on the CPU, "
        "then waits until the GPU is its own (default %(default)s; 0: one child at a time)",
    )
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument(
        "--memory-history",
        default=None,
        metavar="DIR",
        help="leave each case's CUDA caching-allocator history in DIR (one pickle per case, "
        "torch.cuda.memory._snapshot) to compare event by event with memfit's replay",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU-only self-test of every code path (CI)"
    )
    parser.add_argument(
        "--case", default=None, help=argparse.SUPPRESS
    )  # internal: run one case (child)
    args = parser.parse_args(argv)
    if args.precisions:
        bad = [p for p in args.precisions if p not in ("fp32", "fp16", "bf16")]
        if bad:
            parser.error(f"--precisions: unknown {', '.join(bad)}; choose from fp32, fp16, bf16")
    if args.limit is not None and args.limit < 0:
        parser.error("--limit: must be ≥ 0")
    chosen = [f for f in ("quick", "qlora", "new_knobs", "plans_only") if getattr(args, f)]
    if len(chosen) > 1:
        flags = " and ".join("--" + f.replace("_", "-") for f in chosen)
        parser.error(f"{flags}: choose one case set")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = parse_args(argv)
    if args.case is not None:
        return child_main(json.loads(args.case))
    if args.smoke:
        return run_smoke(args, argv)

    cases = select_cases(args)
    if args.list:
        for i, case in enumerate(cases):
            print(f"{i + 1:>3} {case.id}")
        if args.plans_only:
            for model, task, seq_len, budget, options in PLANS_ONLY:
                print(
                    f"  plan {model} {task} seq {seq_len} budget {budget / GiB:.0f} GiB {options}"
                )
        return 0

    import torch

    if not torch.cuda.is_available():
        print(
            "no CUDA device: run this on a GPU machine (or --smoke for the CPU self-test)",
            file=sys.stderr,
        )
        return 2
    header = collect_header(argv, "cuda", smoke=False, cases=cases)
    gpu = header["gpu"]
    print(f"reproduce: {header['reproduce']}")
    print(
        f"{gpu['name']} (sm {gpu['compute_capability']}, {gpu['total_memory_bytes'] / GiB:.1f} GiB, driver "
        f"{gpu['driver_version']}), torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
        f"{header['software']['transformers']}, memfit {header['software']['memfit']} @ {header['git_commit'] or '?'}"
    )
    print(
        f"{len(cases)} cases, each in a fresh process; memfit profile: {header['memfit_profile']}",
        flush=True,
    )
    path = run_path(Path(args.out) if args.out else DEFAULT_OUT, header)
    run = RunFile(path, header, len(cases))
    device_total = int(gpu["total_memory_bytes"])
    started = time.perf_counter()
    deadline = Deadline(args.time_budget)
    if args.plans_only:
        return run_plans_only(args, run, device_total, deadline, started)
    run_cases(
        cases,
        "cuda",
        run,
        timeout_s=args.timeout,
        device_total=device_total,
        deadline=deadline,
        prefetch=args.prefetch,
        memory_history=Path(args.memory_history) if args.memory_history else None,
    )
    if args.new_knobs:
        # the failures of a case are in its row (a library's reason said so): the run itself worked
        run.finish(seconds=round(time.perf_counter() - started, 1))
        print_summary(run.doc["summary"], path, header["reproduce"])
        return 0
    if args.plan_check:
        _run_planned(
            args, run, plan_check_list(_canonical_models(args.models)), device_total, deadline
        )
    run.finish(seconds=round(time.perf_counter() - started, 1))
    print_summary(run.doc["summary"], path, header["reproduce"])
    summary = run.doc["summary"]
    return 1 if summary["errors"] or summary["estimate_errors"] else 0


def _run_planned(
    args: argparse.Namespace,
    run: RunFile,
    checks: Sequence[Any],
    device_total: int,
    deadline: Deadline,
) -> None:
    """Run ``checks`` (plans under their caps) with the planner this checkout has, or say why not."""
    planner, source = find_planner()
    if planner is None:
        print(f"plan check skipped: {source}", flush=True)
        run.finish(plan_check="skipped: " + source)
        return
    run_plan_checks(
        planner,
        checks,
        "cuda",
        run,
        timeout_s=args.timeout,
        device_total=device_total,
        deadline=deadline,
    )


def run_plans_only(
    args: argparse.Namespace, run: RunFile, device_total: int, deadline: Deadline, started: float
) -> int:
    """``--plans-only``: the PLANS_ONLY checks under their caps; exit 0 whatever they found (each
    check's record says it)."""
    models = _canonical_models(args.models)
    checks = [c for c in PLANS_ONLY if models is None or c[0] in models]
    _run_planned(args, run, checks, device_total, deadline)
    run.finish(seconds=round(time.perf_counter() - started, 1))
    print_plan_summary(run.doc["plan_checks"])
    print_summary(run.doc["summary"], run.path, run.doc["header"]["reproduce"])
    return 0


def print_plan_summary(checks: Sequence[Mapping[str, Any]]) -> None:
    if not checks:
        return
    if all(c.get("fits") is None for c in checks):
        print(f"\nplans: {len(checks)} run (no cap on the CPU: nothing to fit)", flush=True)
        return
    fits = sum(bool(c.get("fits")) for c in checks)
    unchanged = [Path(c["model"]).name for c in checks if c["plan"] and not c.get("plan_changed")]
    print(f"\nplans: {fits} of {len(checks)} fit under their cap", flush=True)
    if unchanged:
        print(f"  plans that changed nothing (budget too large?): {', '.join(unchanged)}")


if __name__ == "__main__":
    sys.exit(main())
