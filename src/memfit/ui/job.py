"""The page's job: the model, the card and every knob of the estimate, as the page holds them, as
its link carries them and as the CLI spells them.

A :class:`PageJob` is what ``memfit estimate`` takes (and, for the plan button, what ``memfit plan``
takes): the knobs are :class:`memfit.job.Job`'s fields, with their choices, bounds, flags and help
lines from there (:func:`knob_widget`), never listed again here. The link (:func:`to_query`,
:func:`from_query`) names each knob by its flag without ``--``, so a link reads like the command
line it stands for (:func:`estimate_argv`, :func:`plan_argv`). Nothing here imports torch or Gradio.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import shlex
import typing
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from memfit import levers
from memfit.errors import UsageError
from memfit.job import (
    DEFAULT_LOSS,
    LOSSES,
    MODES,
    STEP_DEFAULTS,
    STEP_FIELDS,
    TASKS,
    Job,
    choice_problem,
    flag_of,
    whole_problem,
)

_FIELDS = {f.name: f for f in dataclasses.fields(Job)}
_HINTS = typing.get_type_hints(Job)

# the knobs with inputs of their own on the page (the task, and the two sliders)
OWN_INPUTS = ("task", "seq_len", "micro_batch_size")
# the other knobs of a step: the page's accordions, the link's keys beside its own
KNOB_FIELDS = tuple(name for name in STEP_FIELDS if name not in OWN_INPUTS)

# memfit estimate's own spelling: the step's micro-batch is its --batch-size
ESTIMATE_FLAGS = {"micro_batch_size": "--batch-size"}

# the knobs ``memfit plan`` takes as flags (the job's own, and the pins each lever keeps as given:
# memfit.plan.PINS); the rest (the micro-batch, checkpointing, the optimizer, the attention
# kernel, ...) are what the plan chooses itself (memfit.commands.plan.PLANNED)
PLAN_FIELDS = tuple(
    name
    for name in KNOB_FIELDS
    if name in ("num_labels", "loss", "world_size", "sharding", "precision")
    or any(name in lever.pins for lever in levers.LEVERS)
)

# what the page groups the knobs under (every knob of KNOB_FIELDS in exactly one group)
KNOB_GROUPS: dict[str, tuple[str, ...]] = {
    "Task and data": ("num_labels", "loss", "max_seq_len", "packing", "packing_strategy"),
    "Batch": ("gradient_accumulation_steps", "mini_batch_size"),
    "Precision and weights": ("precision", "weights_dtype", "optimizer"),
    "LoRA and quantization": (
        "lora_rank",
        "lora_target_modules",
        "lora_dropout",
        "quantization",
        "double_quant",
    ),
    "Memory levers": (
        "gradient_checkpointing",
        "attn_implementation",
        "cross_entropy",
        "optimizer_offload",
        "activation_offloading",
    ),
    "Ranks and sharding": ("world_size", "sharding"),
    "Device": ("device",),
}


def _kind(name: str) -> str:
    """The kind of input a knob needs: choice, bool, int, float or text (a list of names)."""
    f = _FIELDS[name]
    if f.metadata.get("choices") is not None:
        return "choice"
    hint = str(_HINTS[name])
    if "bool" in hint:
        return "bool"
    if "int" in hint:
        return "int"
    if "float" in hint:
        return "float"
    return "text"


def _default(name: str) -> Any:
    """The value the estimate takes for a knob not given (its ``None``): memfit.job's
    STEP_DEFAULTS, the field's own default, else what the help line shows as the default."""
    if name in STEP_DEFAULTS:
        return STEP_DEFAULTS[name]
    f = _FIELDS[name]
    if f.default is not None and f.default is not dataclasses.MISSING:
        return f.default
    kind = _kind(name)
    if kind == "bool":
        return False  # a switch not given is off
    choices = f.metadata.get("choices")
    shown = f.metadata.get("shown_default")
    if choices is not None:
        # quantization's plain value is "none"; weights_dtype's "auto", cross_entropy's "standard"
        return shown if shown in choices else ("none" if "none" in choices else None)
    if name == "lora_rank":
        return 0  # 0: full fine-tuning, as not given
    if kind == "float" and shown is not None:
        return float(shown)  # lora_dropout: peft's 0.1
    return None


# the estimate's value of each knob not given; a page's knob at this value is not given
KNOB_DEFAULTS: dict[str, Any] = {name: _default(name) for name in KNOB_FIELDS}


@dataclass(frozen=True)
class KnobWidget:
    """The input a knob needs on the page, from its field of :class:`memfit.job.Job`."""

    name: str  # the Job field
    kind: str  # "choice" | "bool" | "int" | "float" | "text" (comma-separated names)
    flag: str  # --lora-rank (memfit estimate's spelling)
    label: str  # the flag, as the page shows it
    help: str  # the CLI's help line
    default: Any  # the estimate's value when not given (None: empty, not given)
    choices: tuple[str, ...] | None = None
    minimum: int | None = None

    @property
    def elem_id(self) -> str:
        """The page element's id: the flag without ``--`` (as the link's key)."""
        return self.flag.removeprefix("--")


def knob_widget(name: str) -> KnobWidget:
    """What input the knob ``name`` (a field of :class:`memfit.job.Job`) needs on the page: its
    kind, flag, help line, default and choices or bound, from the field's metadata. The loss's
    choices are every task's (the estimate refuses one that is not its task's, as the CLI does)."""
    if name not in _FIELDS:
        raise KeyError(f"{name!r} is no knob of memfit.job.Job")
    f = _FIELDS[name]
    flag = ESTIMATE_FLAGS.get(name) or flag_of(f)
    choices = f.metadata.get("choices")
    if name == "loss":
        choices = tuple(dict.fromkeys(loss for task in TASKS for loss in LOSSES[task]))
    return KnobWidget(
        name=name,
        kind="choice" if name == "loss" else _kind(name),
        flag=flag,
        label=flag,
        help=f.metadata["help"],
        default=KNOB_DEFAULTS.get(name, STEP_DEFAULTS.get(name)),
        choices=tuple(choices) if choices is not None else None,
        minimum=f.metadata.get("minimum"),
    )


# --- values -----------------------------------------------------------------------------------------
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_value(name: str, raw: Any, *, said: str | None = None) -> Any:
    """The value of knob ``name`` from what the page or a link gives (text, a number, a bool);
    None or empty text: not given. A value that is not one raises :class:`UsageError`, one line
    naming ``said`` (default: the knob's flag), as the CLI says it."""
    widget = knob_widget(name)
    said = said or widget.flag
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    text = raw.strip() if isinstance(raw, str) else raw
    if widget.kind == "bool":
        if isinstance(text, bool):
            return text
        if str(text).lower() in _TRUE:
            return True
        if str(text).lower() in _FALSE:
            return False
        raise UsageError(f"{said}: must be true or false, got {raw!r}")
    if widget.kind == "int":
        return _whole(said, raw, widget.minimum if widget.minimum is not None else 1)
    if widget.kind == "float":
        return _fraction(said, raw)
    if widget.kind == "text":
        names = [x.strip() for x in str(text).split(",") if x.strip()]
        return tuple(names) or None
    text = str(text)
    assert widget.choices is not None
    if name == "loss":
        text = text.lower()
    if problem := choice_problem(said, text, widget.choices):
        raise UsageError(problem)
    return text


def _whole(said: str, raw: Any, minimum: int) -> int:
    """A whole number ≥ ``minimum`` from text or a number (a slider's float 16.0 is 16)."""
    value: Any = raw
    if isinstance(raw, str):
        try:
            value = int(raw.strip())
        except ValueError:
            value = raw
    elif isinstance(raw, float) and raw.is_integer():
        value = int(raw)
    if problem := whole_problem(said, value, minimum):
        raise UsageError(problem)
    return int(value)


def _fraction(said: str, raw: Any) -> float:
    """A number in [0, 1) from text or a number."""
    value: Any = raw
    if isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            value = raw
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise UsageError(f"{said}: must be a number in [0, 1), got {raw!r}")
    return float(value)


def given_knobs(knobs: Mapping[str, Any], task: str | None = None) -> dict[str, Any]:
    """``knobs`` as a job holds them: only the knobs given (a value other than the estimate's own
    when not given, :data:`KNOB_DEFAULTS`; ``task``'s own loss is not given either), lists as
    tuples, in the job's order. A name that is no knob of the page is a TypeError (a bug)."""
    out: dict[str, Any] = {}
    for name in knobs:
        if name not in KNOB_FIELDS:
            raise TypeError(f"PageJob got an unexpected knob {name!r}")
    for name in KNOB_FIELDS:
        value = knobs.get(name)
        if isinstance(value, list | tuple):
            value = tuple(str(x) for x in value) or None
        elif isinstance(value, str) and "list[" in str(_HINTS[name]):
            value = tuple(x.strip() for x in value.split(",") if x.strip()) or None
        if value is None or value == KNOB_DEFAULTS[name]:
            continue
        if name == "loss" and task is not None and value == DEFAULT_LOSS.get(task):
            continue
        out[name] = value
    return out


# --- the job ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PageJob:
    """The page's job: what ``memfit estimate`` takes, and the plan's own few settings.

    ``knobs`` holds only the knobs given (:func:`given_knobs`: a value other than the estimate's
    when not given, :data:`KNOB_DEFAULTS`); a knob at its default is left to the estimate, and
    to the plan to choose. The plan pins the knobs given among :data:`PLAN_FIELDS`.
    """

    model: str = "bert-base-uncased"  # registry name / Hub id / path; ignored with config_json
    config_json: str | None = None  # the text of an uploaded config.json (the link carries it)
    task: str = "classification"
    gpu: str | None = "t4"  # a catalog id (memfit gpus), or None
    gpu_memory: str | None = None  # a size, e.g. "16GiB"; with gpu: the budget on that card
    batch_size: int = 8  # the estimate's --batch-size (the micro-batch)
    seq_len: int = 128
    knobs: Mapping[str, Any] = field(default_factory=dict)
    mode: str = "train"
    safety_margin: float = 0.05
    effective_batch_size: int | None = None  # the plan's; None: batch × accumulation steps
    allow: tuple[str, ...] = ()  # the plan's --allow levers

    def __post_init__(self) -> None:
        object.__setattr__(self, "knobs", given_knobs(self.knobs, self.task))
        object.__setattr__(self, "allow", tuple(self.allow))

    def knob(self, name: str) -> Any:
        """The value of knob ``name`` in this job (its default when not given)."""
        return self.knobs.get(name, KNOB_DEFAULTS[name])

    @property
    def plan_batch(self) -> int:
        """The plan's effective batch: as given, else the micro-batch times its accumulation."""
        if self.effective_batch_size is not None:
            return self.effective_batch_size
        return self.batch_size * int(self.knob("gradient_accumulation_steps") or 1)

    def key(self) -> tuple[Any, ...]:
        """A hashable key of the whole job (a memo's)."""
        return (
            self.model if self.config_json is None else None,
            self.config_json,
            self.task,
            self.gpu,
            self.gpu_memory,
            self.batch_size,
            self.seq_len,
            tuple(sorted(self.knobs.items())),
            self.mode,
            self.safety_margin,
            self.effective_batch_size,
            self.allow,
        )


# --- the link ---------------------------------------------------------------------------------------
DEFAULT = PageJob()
# the link's keys of the job's own settings (the knobs' are their flags without "--")
OWN_KEYS = (
    "model",
    "config",
    "task",
    "gpu",
    "gpu-memory",
    "batch-size",
    "seq-len",
    "mode",
    "safety-margin",
    "effective-batch-size",
    "allow",
)
KNOB_KEYS = {knob_widget(name).elem_id: name for name in KNOB_FIELDS}


def to_query(job: PageJob) -> str:
    """The link's query of ``job`` (no ``?``): the model (or the uploaded config, compressed),
    the task, the card and the shape always; then each knob given, by its flag without ``--``;
    the plan's settings where not the default. ``from_query`` reads it back to the same job."""
    pairs: list[tuple[str, str]] = []
    if job.config_json is None or job.model != DEFAULT.model:
        pairs.append(("model", job.model))
    if job.config_json is not None:
        pairs.append(("config", encode_config(job.config_json)))
    pairs += [
        ("task", job.task),
        ("gpu", job.gpu if job.gpu is not None else "none"),
    ]
    if job.gpu_memory is not None:
        pairs.append(("gpu-memory", job.gpu_memory))
    pairs += [("batch-size", str(job.batch_size)), ("seq-len", str(job.seq_len))]
    for name, value in job.knobs.items():
        pairs.append((knob_widget(name).elem_id, _text(value)))
    if job.mode != DEFAULT.mode:
        pairs.append(("mode", job.mode))
    if job.safety_margin != DEFAULT.safety_margin:
        pairs.append(("safety-margin", repr(job.safety_margin)))
    if job.effective_batch_size is not None:
        pairs.append(("effective-batch-size", str(job.effective_batch_size)))
    if job.allow:
        pairs.append(("allow", ",".join(job.allow)))
    return urlencode(pairs, quote_via=quote, safe=",")


def _text(value: Any) -> str:
    """A knob's value as the CLI and the link write it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return ",".join(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def from_query(params: Mapping[str, str]) -> PageJob:
    """The job a link's query carries (``params``: its keys and values, as a web framework gives
    them; keys starting with ``_`` are the framework's, not the job's). A key that is none of the
    job's, or a value that is not one, raises :class:`UsageError`: one line, ``link: KEY: ...``."""
    values: dict[str, Any] = {}
    knobs: dict[str, Any] = {}
    for key, raw in params.items():
        if key.startswith("_"):
            continue
        said = f"link: {key}"
        if key in KNOB_KEYS:
            knobs[KNOB_KEYS[key]] = parse_value(KNOB_KEYS[key], raw, said=said)
        elif key == "model":
            if not raw.strip():
                raise UsageError(f"{said}: give a registry name, a Hub id or a path")
            values["model"] = raw.strip()
        elif key == "config":
            values["config_json"] = decode_config(raw, said)
        elif key == "task":
            if problem := choice_problem(said, raw, TASKS):
                raise UsageError(problem)
            values["task"] = raw
        elif key == "gpu":
            values["gpu"] = None if raw.strip().lower() in ("", "none") else raw.strip()
        elif key == "gpu-memory":
            values["gpu_memory"] = raw.strip() or None
        elif key in ("batch-size", "seq-len", "effective-batch-size"):
            values[key.replace("-", "_")] = _whole(said, raw, 1)
        elif key == "mode":
            if problem := choice_problem(said, raw, MODES):
                raise UsageError(problem)
            values["mode"] = raw
        elif key == "safety-margin":
            values["safety_margin"] = _fraction(said, raw)
        elif key == "allow":
            values["allow"] = parse_allow(raw, said)
        else:
            raise UsageError(
                f"{said}: unknown key; the keys are {', '.join((*OWN_KEYS, *KNOB_KEYS))}"
            )
    return PageJob(**values, knobs=knobs)


def parse_query(query: str) -> PageJob:
    """:func:`from_query` of a query string (``a=1&b=2``, with or without its ``?``); a key given
    twice is refused."""
    pairs = parse_qsl(query.removeprefix("?"), keep_blank_values=True)
    params: dict[str, str] = {}
    for key, value in pairs:
        if key in params:
            raise UsageError(f"link: {key}: given twice")
        params[key] = value
    return from_query(params)


def parse_allow(raw: str | Iterable[str], said: str = "--allow") -> tuple[str, ...]:
    """The plan's ``--allow`` levers, each one memfit plan knows (:data:`memfit.levers.ALLOWABLE`)."""
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    names = tuple(dict.fromkeys(x.strip().lower() for x in items if x.strip()))
    for name in names:
        if name not in levers.ALLOWABLE:
            raise UsageError(
                f"{said}: unknown lever {name!r}; choose from {', '.join(levers.ALLOWABLE)}"
            )
    return names


def encode_config(text: str) -> str:
    """An uploaded config.json as the link carries it: zlib-compressed, base64url, unpadded."""
    packed = zlib.compress(text.encode("utf-8"), 9)
    return base64.urlsafe_b64encode(packed).decode("ascii").rstrip("=")


# the most a link's config.json may unpack to (a model's config is a few KiB): a link is anyone's,
# and a few KiB of zlib unpack to gigabytes
MAX_CONFIG = 2**20


def decode_config(raw: str, said: str = "link: config") -> str:
    """The config.json text of a link's ``config`` (:func:`encode_config`); one that unpacks to
    more than :data:`MAX_CONFIG` is refused before it is all unpacked."""
    data = raw.strip()
    try:
        packed = base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))
        unpacking = zlib.decompressobj()
        text = unpacking.decompress(packed, MAX_CONFIG)
        if unpacking.unconsumed_tail:
            raise UsageError(f"{said}: larger than 1 MiB")
        if not unpacking.eof:
            raise zlib.error("incomplete or truncated stream")  # (as zlib.decompress says it)
        return text.decode("utf-8")
    except (binascii.Error, ValueError, zlib.error) as exc:
        raise UsageError(f"{said}: not a config.json this page encoded ({exc})") from None


# --- the CLI lines ----------------------------------------------------------------------------------
def _flags(knobs: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """The flags of the knobs given among ``names``, as memfit estimate and plan spell them."""
    out: list[str] = []
    for name in names:
        if name not in knobs:
            continue
        value, flag = knobs[name], knob_widget(name).flag
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag.removeprefix("--"))
        else:
            out += [flag, _text(value)]
    return out


def _budget(job: PageJob) -> list[str]:
    return [
        *(["--gpu", job.gpu] if job.gpu is not None else []),
        *(["--gpu-memory", job.gpu_memory] if job.gpu_memory is not None else []),
    ]


def estimate_argv(job: PageJob, model_arg: str) -> list[str]:
    """``memfit estimate``'s arguments for ``job`` (``model_arg``: what :func:`resolve` gave):
    the CLI answers them with the page's numbers."""
    argv = ["estimate", model_arg, "--task", job.task]
    argv += ["--batch-size", str(job.batch_size), "--seq-len", str(job.seq_len)]
    argv += _budget(job)
    argv += _flags(job.knobs, KNOB_FIELDS)
    if job.mode != DEFAULT.mode:
        argv += ["--mode", job.mode]
    if job.safety_margin != DEFAULT.safety_margin:
        argv += ["--safety-margin", repr(job.safety_margin)]
    return argv


def plan_argv(job: PageJob, model_arg: str) -> list[str]:
    """``memfit plan``'s arguments for ``job``: its length, effective batch (:attr:`PageJob.
    plan_batch`) and budget, the levers it may add, and the knobs it pins (those given among
    :data:`PLAN_FIELDS`; the others are the plan's to choose)."""
    argv = ["plan", model_arg, "--task", job.task, "--seq-len", str(job.seq_len)]
    argv += ["--effective-batch-size", str(job.plan_batch)]
    argv += _budget(job)
    if job.allow:
        argv += ["--allow", ",".join(job.allow)]
    argv += _flags(job.knobs, PLAN_FIELDS)
    if job.safety_margin != DEFAULT.safety_margin:
        argv += ["--safety-margin", repr(job.safety_margin)]
    return argv


def command_line(argv: list[str]) -> str:
    """The command a user types: ``memfit `` and the arguments, quoted for a POSIX shell."""
    return "memfit " + shlex.join(argv)


__all__ = [
    "ESTIMATE_FLAGS",
    "KNOB_DEFAULTS",
    "KNOB_FIELDS",
    "KNOB_GROUPS",
    "KNOB_KEYS",
    "OWN_INPUTS",
    "OWN_KEYS",
    "PLAN_FIELDS",
    "KnobWidget",
    "PageJob",
    "command_line",
    "decode_config",
    "encode_config",
    "estimate_argv",
    "from_query",
    "given_knobs",
    "knob_widget",
    "parse_allow",
    "parse_query",
    "parse_value",
    "plan_argv",
    "to_query",
]
