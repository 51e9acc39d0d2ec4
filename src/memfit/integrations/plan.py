"""``apply_plan``: memfit's plan written into a ``TrainingArguments``, effective batch kept.

The plan (:func:`memfit.plan`) chooses the micro-batch, gradient accumulation, mixed precision and
gradient checkpointing that fit a memory budget while ``per_device_train_batch_size ×
gradient_accumulation_steps × world_size`` stays what the arguments say. ``apply_plan`` returns a
copy of the arguments with those four set (``dataclasses.replace``, so everything the
arguments derive from them, such as ``mixed_precision``, is derived again) and says what changed.
LoRA and truncation live in the model and the tokenizer, not in ``TrainingArguments``: plan them
with ``memfit plan --allow lora,truncation`` and apply them yourself. So do quantized base
weights (QLoRA): bitsandbytes' ``BitsAndBytesConfig`` is the ``quantization_config`` of
``from_pretrained``, which no ``TrainingArguments`` field sets; plan them with ``memfit plan
--allow lora,quantization`` and load the model with it yourself. The paged optimizers are
``TrainingArguments.optim`` values (``paged_adamw_8bit``, ``paged_adamw_32bit``) and are applied.
TRL's ``SFTConfig`` is priced with SFTTrainer's own chunked LM head (``trl-chunked``) and never
gets Liger's fused loss, which SFTTrainer refuses. Elsewhere a causal LM's fused linear
cross-entropy is Liger Kernel's, through ``use_liger_kernel`` with a
``liger_kernel_config`` that patches only the loss (the step memfit estimated), planned only where
it runs (liger-kernel installed, a CUDA GPU, a model type Liger patches); pure bf16 weights are
the model's dtype, which TRL's configs set through ``model_init_kwargs`` when their trainer loads
the model by name, and which is otherwise said, for the caller to load a loaded model so.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit import levers
from memfit.errors import NothingFitsError, UsageError
from memfit.job import TASKS
from memfit.levers import weights
from memfit.levers.optimizer import OPTIMIZER_TABLE
from memfit.units import format_bytes

# TrainingArguments.optim → the memfit optimizer it is (any other value: AdamW)
_OPTIMIZERS = {hf: o.name for o in OPTIMIZER_TABLE.values() for hf in o.hf_names}
_UNSET = object()


@dataclass
class PlannedArguments:
    """What :func:`apply_plan` did: the new arguments, the plan, and each change in words."""

    args: Any  # a TrainingArguments (or subclass) with the plan applied
    plan: Any  # memfit.plan.Plan
    changes: list[str] = field(default_factory=list)
    # sentence embeddings with in-batch negatives: the GradCache loss and its mini-batch
    loss: str | None = None
    mini_batch_size: int | None = None

    def __str__(self) -> str:
        what = ", ".join(self.changes) if self.changes else "nothing to change"
        peak = self.plan.predicted_peak_bytes
        fit = (
            f" (predicted peak {format_bytes(peak)} of {format_bytes(self.plan.budget_bytes)})"
            if peak is not None
            else ""
        )
        return f"memfit plan applied: {what}{fit}"


def _api_names(message: str) -> str:
    """memfit.plan's messages name CLI flags; here they are keyword arguments."""
    return re.sub(r"--([a-z][a-z-]*)", lambda m: m.group(1).replace("-", "_"), message)


def _task_of(class_name: str) -> str | None:
    """The memfit task of a model class name (``BertForSequenceClassification``…)."""
    name = class_name
    if name.endswith("ForSequenceClassification"):
        return "classification"
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal-lm"
    if name == "SentenceTransformer":
        return "sentence-embedding"
    return None


def _hf_config(model: Any) -> Any:
    """The transformers config behind a model (a SentenceTransformer's first module's)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        return config
    try:
        first = model[0]
    except (TypeError, IndexError, KeyError):
        return None
    inner = getattr(first, "auto_model", None) or getattr(first, "model", None)
    return getattr(inner, "config", None)


def _model_reference(model: Any, folder: Path) -> str:
    """A name memfit.plan can resolve: the string given, the folder the model came from, or
    its config written into ``folder``."""
    if isinstance(model, str | Path):
        return str(model)
    config = _hf_config(model)
    if config is None:
        raise UsageError(
            f"apply_plan: model: cannot find the transformers config of a {type(model).__name__}; "
            "pass the model's folder or registry name instead"
        )
    source = getattr(config, "_name_or_path", "") or ""
    if source and (Path(source) / "config.json").is_file():
        return source
    # a model built in memory: its architecture numbers are all the plan needs
    config.to_json_file(str(folder / "config.json"))
    return str(folder)


def _model_config(reference: str) -> Any:
    """The config of the model ``reference`` names (None: unknown here; the plan says why)."""
    # the model registry imports transformers, which importing memfit.integrations must not:
    # here for start-up time
    from memfit.models import resolve_model

    try:
        return resolve_model(reference).config
    except UsageError:
        return None


def _guess_task(model: Any, reference: str) -> str | None:
    task = _task_of(type(model).__name__) if not isinstance(model, str | Path) else None
    if task is not None:
        return task
    path = Path(reference)
    config = path / "config.json" if path.is_dir() else path
    if config.is_file() and config.suffix == ".json":
        try:
            architectures = json.loads(config.read_text()).get("architectures") or []
        except (OSError, ValueError):
            architectures = []
        for name in architectures:
            task = _task_of(str(name))
            if task is not None:
                return task
    if path.is_dir() and (path / "modules.json").is_file():
        return "sentence-embedding"
    return None


def _own_offloading(args: Any, names: set[str]) -> bool | None:
    """The arguments' activation offloading as the plan must take it: TRL's SFTConfig has the
    field (its SFTTrainer offloads when it is on), so on is kept and off leaves the plan free to
    choose it; arguments without the field (plain TrainingArguments) are planned without it,
    since their trainer would not offload what the plan moved to the host."""
    if "activation_offloading" not in names:
        return False
    return True if getattr(args, "activation_offloading", False) else None


def _sft_task(args: Any) -> str | None:
    """TRL's ``SFTConfig`` (or a subclass) configures a causal LM's training: its task."""
    return "causal-lm" if any(c.__name__ == "SFTConfig" for c in type(args).__mro__) else None


def _own_seq_len(args: Any, names: set[str]) -> int:
    """The sequence length TRL's ``SFTConfig`` truncates to (``max_length``), for a plan given
    no ``seq_len``; a clear error without one."""
    length = getattr(args, "max_length", None) if "max_length" in names else None
    if isinstance(length, int) and not isinstance(length, bool) and length > 0:
        return length
    where = (
        "these arguments' max_length is None"
        if "max_length" in names
        else f"{type(args).__name__} says no sequence length"
    )
    raise UsageError(
        f"apply_plan: seq_len: the plan needs the longest sequence a batch holds and {where}; "
        "pass seq_len=, e.g. seq_len=1024"
    )


# TRL's SFTConfig.packing_strategy → memfit's packing strategy (bfd_split splits what bfd
# truncates: the same packed shapes)
_PACKING_STRATEGIES = {"bfd": "bfd", "bfd_split": "bfd", "wrapped": "wrapped"}


def _own_packing(args: Any, names: set[str]) -> dict[str, Any]:
    """The job's packing as TRL's ``SFTConfig`` says it, pinned for the plan: ``packing`` with its
    ``packing_strategy``; ``padding_free`` alone (each micro-batch's rows laid end to end, no
    padding) is priced as ``bfd``, whose micro-batches TRL lays out so. {} for arguments
    without these fields or with both off."""
    if "packing" in names and getattr(args, "packing", False):
        strategy = _PACKING_STRATEGIES.get(str(getattr(args, "packing_strategy", "bfd")), "bfd")
        return {"packing": True, "packing_strategy": strategy}
    if "padding_free" in names and getattr(args, "padding_free", False):
        return {"packing": True, "packing_strategy": "bfd"}
    return {}


def _wanted(
    args: Any, settings: dict[str, Any], own: dict[str, Any], per_rank: int
) -> dict[str, Any]:
    """The ``TrainingArguments`` fields the plan's ``settings`` set (``own``: the job's own
    values the arguments and the model already say; ``per_rank``: samples per device per
    optimizer step)."""
    names = {f.name for f in dataclasses.fields(args)}
    # every lever's names in the Hugging Face vocabulary; what the arguments already say (their
    # own optimizer, however spelled; their own Liger setup; the model's own dtype) is left as
    # it is
    kept = levers.trainer_args(own)
    wanted = {
        name: value
        for name, value in levers.trainer_args(settings).items()
        if name in names and kept.get(name, _UNSET) != value
    }
    if isinstance(wanted.get("model_init_kwargs"), dict):
        # TRL's keywords for from_pretrained: the plan's dtype joins what the arguments hold
        wanted["model_init_kwargs"] = {
            **(getattr(args, "model_init_kwargs", None) or {}),
            **wanted["model_init_kwargs"],
        }
    # transformers 5.2x renamed gradient_checkpointing (now a deprecated alias, overwritten by the
    # new name when the arguments are copied) to activation_checkpointing
    if "activation_checkpointing" in names and "gradient_checkpointing" in wanted:
        wanted["activation_checkpointing"] = wanted.pop("gradient_checkpointing")
    if settings.get("loss") == "cached-mnrl":
        # GradCache takes the whole batch at once: no accumulation, the loss splits internally
        wanted["per_device_train_batch_size"] = per_rank
        wanted["gradient_accumulation_steps"] = 1
    return wanted


# the model types whose causal LM Liger Kernel patches with its fused linear cross-entropy (the
# keys of liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN, read at
# liger-kernel 0.8.2, the text models): the Trainer's use_liger_kernel patches nothing else
# (GPT-2, BERT: Liger logs that it has no kernels for the type, and the standard loss runs). The
# installed liger-kernel's own table is read when there is one.
LIGER_MODEL_TYPES = frozenset(
    {
        "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3", "gemma3_text",
        "gemma4", "gemma4_text", "glm4", "gpt_oss", "granite", "hunyuan_v1_dense",
        "hunyuan_v1_moe", "llama", "llama4", "llama4_text", "ministral", "mistral", "mixtral",
        "nemotron", "olmo2", "olmo3", "phi3", "qwen2", "qwen3", "qwen3_moe", "qwen3_next",
        "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "smollm3",
    }
)  # fmt: skip


def liger_model_types() -> frozenset[str]:
    """The model types Liger Kernel patches: the installed liger-kernel's table, else
    :data:`LIGER_MODEL_TYPES`."""
    if not _liger_installed():
        return LIGER_MODEL_TYPES
    try:
        # optional: the liger extra (imports Triton); its table is the truth for its version
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # a broken install: what memfit knows instead
        return LIGER_MODEL_TYPES
    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def own_cross_entropy(args: Any, config: Any) -> str | None:
    """The causal-LM loss the Trainer runs with ``args`` on a model of ``config``, where the plan
    may not choose it; None: the plan chooses (Liger's fused linear cross-entropy would run).

    - ``use_liger_kernel`` given: Liger's fused loss when ``liger_kernel_config`` leaves
      ``fused_linear_cross_entropy`` on (the default) and Liger patches the model's type;
      otherwise the standard loss (the Trainer applies no fused loss to a type Liger lacks).
    - Not given: ``standard`` where the fused loss would not run: liger-kernel not installed,
      arguments on the CPU (Liger's kernels need CUDA), or a model type Liger does not patch.
    - TRL's ``SFTConfig`` (its ``SFTTrainer``): TRL's own loss, whatever ``use_liger_kernel``
      says (:func:`trl_loss`); SFTTrainer raises on Liger's fused loss and turns it off.
    """
    if _sft_task(args) is not None:
        # TRL's SFTTrainer computes its own loss (trl_loss) and refuses Liger's fused one
        return trl_loss()
    patched = getattr(config, "model_type", None) in liger_model_types()
    if getattr(args, "use_liger_kernel", False):
        liger = getattr(args, "liger_kernel_config", None) or {}
        fused = liger.get("fused_linear_cross_entropy", True)
        return "fused-linear" if fused and patched else "standard"
    if not (_liger_installed() and _on_cuda(args) and patched):
        return "standard"
    return None


def trl_loss() -> str:
    """The loss TRL's ``SFTTrainer`` computes, as a memfit ``cross_entropy``. trl 1.16's
    ``SFTTrainer.__init__`` adds a fused LM head (``trl.trainer.utils.add_fused_lm_head``) and its
    ``compute_loss`` calls ``model(**inputs, fused_lm_head=True)``: per-token log-probabilities
    in tiles, never the full logits, and never Liger's fused loss (its ``__init__`` raises
    ValueError on ``liger_kernel_config={"fused_linear_cross_entropy": True}``): ``trl-chunked``
    (:mod:`memfit.step.trl_head`). A TRL without ``add_fused_lm_head`` (before its fused head)
    computes the standard loss over the full logits: ``standard``."""
    # start-up: the head's module imports torch, which importing memfit.integrations must not
    from memfit.step.trl_head import trl_problem

    return "trl-chunked" if trl_problem() is None else "standard"


def _on_cuda(args: Any) -> bool:
    """Whether the arguments train on a CUDA GPU (where Liger's Triton kernels run)."""
    return not getattr(args, "use_cpu", False) and args.device.type == "cuda"


def _liger_installed() -> bool:
    """Whether liger-kernel is installed (the Trainer's ``use_liger_kernel`` imports it)."""
    return importlib.util.find_spec("liger_kernel") is not None


def apply_plan(
    args: Any,
    model: Any,
    *,
    seq_len: int | None = None,
    task: str | None = None,
    gpu_memory: int | str | None = None,
    gpu: str | None = None,
    num_labels: int | None = None,
    loss: str | None = None,
    allow: Iterable[str] = (),
    precision: str | None = None,
    weights_dtype: str | None = None,
    cross_entropy: str | None = None,
    safety_margin: float = 0.05,
) -> PlannedArguments:
    """Plan the job for a memory budget and write the plan into a copy of ``args``.

    ``model`` is a registry name, a model folder, or the model object (its folder, or its config
    when it was built in memory); ``task`` is guessed from the model class when not given.
    The budget is ``gpu_memory`` (``"16GiB"``), else the catalog ``gpu``'s memory (``"a10g"``),
    else the free memory of this machine's GPU. ``precision`` pins ``fp32``/``bf16``/``fp16``;
    when the arguments run on the CPU it defaults to ``fp32`` (the plan would otherwise pick the
    budget GPU's mixed precision). ``allow`` may hold ``"optimizer"`` (8-bit AdamW, a paged AdamW
    or Adafactor through ``optim``) and ``"pure-16bit"`` (pure bf16 weights: for a
    ``model`` given by name TRL's ``model_init_kwargs``, refused for arguments without them; for
    a loaded model said in ``changes``, for you to load it so); ``"lora"``, ``"truncation"`` and
    ``"quantization"`` are refused (they are not ``TrainingArguments``).

    ``weights_dtype`` pins the weights' dtype (``auto``: the checkpoint's; ``fp32``; ``bf16``/
    ``fp16``: pure 16-bit); not given, a model object's own (its weights all in one dtype) is
    kept. ``cross_entropy`` pins a causal LM's loss (``standard``, ``fused-linear`` or
    ``trl-chunked``); for TRL's ``SFTConfig`` it is TRL's own chunked LM head (``trl-chunked``,
    :func:`trl_loss`; ``fused-linear`` refused: SFTTrainer raises on Liger's fused loss); not given,
    arguments with ``use_liger_kernel`` keep their own, and the plan keeps the standard loss where
    Liger's would not run (liger-kernel not installed, arguments on the CPU, a model type Liger
    does not patch: :func:`own_cross_entropy`); else the plan may choose Liger's fused linear
    cross-entropy (``use_liger_kernel`` and a ``liger_kernel_config`` that patches only the
    loss). Activation offloading is planned only for arguments that have TRL's
    ``activation_offloading`` field (``SFTConfig``: its trainer offloads when it is set; set
    already, it is kept): plain ``TrainingArguments`` are planned without it. TRL's
    ``SFTConfig`` also says the job's sequence length (``max_length``, the default of
    ``seq_len``) and its packing (``packing`` with its ``packing_strategy``, or
    ``padding_free``: priced as the padding-free ``bfd`` packing), which the plan keeps. Raises
    :class:`~memfit.errors.UsageError` for bad input (no budget on a
    machine without a GPU, an unknown model) and :class:`~memfit.errors.NothingFitsError` when
    no configuration fits, with what would help.
    """
    # memfit.plan loads torch and the estimator, which importing memfit.integrations (for
    # PlannedArguments) must not: here for start-up time
    from memfit.plan import plan as make_plan

    allowed = [a.strip().lower() for a in allow if a.strip()]
    # the arguments' fields, for a lever some of them set (TRL's model_init_kwargs); the refusal
    # comes before anything else of the arguments is read
    names = {f.name for f in dataclasses.fields(args)} if dataclasses.is_dataclass(args) else set()
    if seq_len is None:
        seq_len = _own_seq_len(args, names)
    # pure 16-bit weights are the model's dtype: a model given by name loads in it through TRL's
    # model_init_kwargs (refused without them); a loaded model is the caller's to load so, which
    # the plan says in its changes, whatever the arguments
    loaded = not isinstance(model, str | Path)
    outside = [
        levers.BY_NAME[a]
        for a in allowed
        if a in levers.BY_NAME
        and not levers.BY_NAME[a].in_training_arguments
        and not (names & set(levers.BY_NAME[a].argument_fields))
        and not (loaded and levers.BY_NAME[a] is weights.LEVER)
    ]
    if outside:
        elsewhere = [lever.name for lever in outside]
        where = "; ".join(lever.outside_note for lever in outside if lever.outside_note)
        raise UsageError(
            f"apply_plan: allow: {', '.join(elsewhere)} change the model or the tokenizer, not "
            "TrainingArguments"
            + (f" ({where})" if where else "")
            + f"; plan them with `memfit plan --allow {','.join(elsewhere)}` and apply them "
            "yourself, or leave them out"
        )
    optim = str(getattr(args.optim, "value", args.optim))
    base_optimizer = _OPTIMIZERS.get(optim, "adamw")
    world_size = max(1, int(getattr(args, "world_size", 1)))
    effective = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)
    effective *= world_size
    if precision is None and args.device.type == "cpu":
        precision = "fp32"  # the CPU has no fp16 loss scaling; bf16 autocast on it is slow
    notes: list[str] = []
    if weights_dtype is None:
        # the reader imports torch and transformers, which importing memfit.integrations must
        # not: here for start-up time
        from memfit.integrations._weights import model_weights_dtype

        weights_dtype = model_weights_dtype(model)
    with tempfile.TemporaryDirectory(prefix="memfit-plan-") as scratch:
        reference = _model_reference(model, Path(scratch))
        # messages name what the user passed, not the scratch folder of an in-memory config
        shown = f"the {type(model).__name__}" if reference == scratch else reference
        resolved_task = task or _guess_task(model, reference) or _sft_task(args)
        if resolved_task is None:
            raise UsageError(
                f"apply_plan: task: cannot tell the task of {type(model).__name__}; pass "
                f"task= one of {', '.join(TASKS)}"
            )
        config = _hf_config(model) if loaded else None
        if num_labels is None:
            num_labels = int(getattr(config, "num_labels", 2) or 2)
        sft = _sft_task(args) is not None
        if sft and resolved_task == "causal-lm" and cross_entropy == "fused-linear":
            raise UsageError(
                "apply_plan: cross_entropy: fused-linear is Liger Kernel's fused loss, which "
                "TRL's SFTTrainer refuses (it computes its own chunked loss from the hidden "
                "states); leave cross_entropy out"
            )
        if cross_entropy is None and resolved_task == "causal-lm":
            # the loss the Trainer would run: Liger's fused loss only where it patches the model
            if config is None:
                config = _model_config(reference)
            cross_entropy = own_cross_entropy(args, config)
        try:
            result = make_plan(
                reference,
                task=resolved_task,
                seq_len=seq_len,
                effective_batch_size=effective,
                gpu_memory=gpu_memory,
                gpu=gpu,
                loss=loss,
                world_size=world_size,
                allow=allowed,
                precision=precision,
                safety_margin=safety_margin,
                num_labels=num_labels,
                optimizer=base_optimizer,
                weights_dtype=weights_dtype,
                # the loss pin is a causal LM's (the plan refuses it for other tasks)
                cross_entropy=cross_entropy if resolved_task == "causal-lm" else None,
                activation_offloading=_own_offloading(args, names),
                **_own_packing(args, names),
            )
        except UsageError as exc:
            text = str(exc)
            if text.startswith("no GPU on this machine"):
                raise UsageError(
                    "apply_plan: no GPU on this machine to read a budget from: pass "
                    "gpu_memory='16GiB' (a size) or gpu='a10g' (a catalog GPU; `memfit gpus` "
                    "lists them)"
                ) from None
            raise UsageError(f"apply_plan: {_api_names(text.replace(scratch, shown))}") from None
    if not result.fits or result.chosen is None:
        hints = " ".join(_api_names(s) for s in result.suggestions)
        raise NothingFitsError(
            f"apply_plan: nothing fits in {format_bytes(result.budget_bytes)} (the least any "
            f"configuration needs is {format_bytes(result.min_required_bytes)}). {hints}".strip()
        )
    settings = result.chosen.settings()
    own = {
        "optimizer": base_optimizer,
        "weights_dtype": weights_dtype,
        "cross_entropy": cross_entropy,
    }
    wanted = _wanted(args, settings, own, effective // world_size)
    if sft:
        # never Liger's fused loss onto an SFTConfig: SFTTrainer.__init__ raises ValueError on
        # liger_kernel_config={"fused_linear_cross_entropy": True} (trl 1.16, sft_trainer.py)
        wanted.pop("use_liger_kernel", None)
        wanted.pop("liger_kernel_config", None)
    chosen_dtype = settings.get("weights_dtype")
    if chosen_dtype not in (None, "auto", weights_dtype):
        # the model's dtype is where it is loaded: TRL's trainer loads a model given by name
        # with model_init_kwargs; a model loaded already is the caller's to convert
        torch_name = weights.TORCH_NAMES[chosen_dtype]
        if "model_init_kwargs" in wanted and isinstance(model, str | Path):
            notes.append(
                f"the weights in {chosen_dtype} (pure 16-bit, allowed): model_init_kwargs "
                f"dtype {torch_name} loads them so"
            )
        else:
            wanted.pop("model_init_kwargs", None)
            notes.append(
                f"load the model in {chosen_dtype} yourself (pure 16-bit, allowed): "
                f"from_pretrained(..., dtype=torch.{torch_name}) or model.to(torch.{torch_name}); "
                "no field of these arguments sets it"
            )
    else:
        wanted.pop("model_init_kwargs", None)
    mini_batch_size = settings.get("mini_batch_size")
    changes: dict[str, Any] = {}
    described: list[str] = []
    for name, value in wanted.items():
        old = getattr(args, name)
        old_plain = getattr(old, "value", old)
        if old_plain != value:
            changes[name] = value
            described.append(f"{name} {old_plain} → {value}")
    if settings.get("loss") == "cached-mnrl":
        described.append(f"loss → cached MNRL with mini_batch_size {mini_batch_size}")
    if "use_liger_kernel" in changes:
        described.append(
            "Liger Kernel's fused linear cross-entropy only (needs liger-kernel and a CUDA GPU)"
        )
    described += notes
    new_args = dataclasses.replace(args, **changes) if changes else args
    return PlannedArguments(
        args=new_args,
        plan=result,
        changes=described,
        loss=settings.get("loss"),
        mini_batch_size=mini_batch_size if settings.get("loss") == "cached-mnrl" else None,
    )
