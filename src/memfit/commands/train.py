"""``memfit train``: fine-tuning under the OOM guard (:func:`memfit.train.train`). Its flags are
:class:`~memfit.train.TrainConfig`'s fields (type, default and help line from the field), merged
over a run config file and the managed service's environment."""

from __future__ import annotations

import dataclasses
import inspect
import os
import signal
import threading
import typing
from typing import Annotated, Any

import typer

from memfit import progress
from memfit.commands._options import field_parameter, train_setup_status, with_parameters
from memfit.config import load_config
from memfit.errors import UsageError
from memfit.job import JOB_FIELDS, flag_of, parse_target_modules
from memfit.levers import BY_NAME
from memfit.models.folder import by_name_problem
from memfit.paths import check_writable_dir
from memfit.runtime import launched_world_size
from memfit.train.config import INHERITED_HELP, SHOWN_DEFAULTS, TrainConfig
from memfit.train.peers import RankLostError
from memfit.train.sagemaker import environment_settings, publish_model
from memfit.units import parse_size

# the order memfit train --help lists its flags in: a field, or a lever (memfit.levers) for its
# fields in order (a field placed already keeps its place); a flag not named here follows, in
# field order
FLAG_ORDER = (
    "task", "model", "train_file", "eval_file", "output_dir", "text_column", "label_column",
    "text_pair_column", "anchor_column", "positive_column", "loss", "packing",
    "effective_batch_size", "epochs", "max_steps", "lr", "weight_decay", "warmup_ratio",
    "lr_scheduler", "max_grad_norm", "optimizer", "seed", "gpu_memory", "memory_cap",
    "save_every", "save_total_limit", "eval_every", "resume", "device", "batch", "sharding",
    "precision", "checkpointing", "truncation", "mini-batch", "labels", "num_labels",
    "skip_bad_rows", "cache_dir", "group_by_length", "probe", "padding", "memory_snapshot",
    "lora", "quantization", "merge_lora", "report_to",
)  # fmt: skip
# a planned config's keys that describe the plan, not the run
PLAN_ONLY_KEYS = ("gpu", "budget_bytes", "safety_margin", "predicted_peak_bytes", "tokenizer")

ConfigFile = Annotated[
    str | None,
    typer.Argument(help="A run config (memfit plan --write-config); flags override it."),
]


def _flag_fields() -> list[dataclasses.Field[Any]]:
    """TrainConfig's fields that are flags of memfit train, in :data:`FLAG_ORDER`."""
    fields = [
        f
        for f in dataclasses.fields(TrainConfig)
        if (_job_help(f) if f.name in JOB_FIELDS else f.metadata.get("cli", True))
    ]
    rank: dict[str, int] = {}
    for name in FLAG_ORDER:
        lever = BY_NAME.get(name)
        for field in lever.fields if lever is not None else (name,):
            rank.setdefault(field, len(rank))
    return sorted(fields, key=lambda f: rank.get(f.name, len(rank)))


def _job_help(f: dataclasses.Field[Any]) -> str | None:
    """A job knob's help line in memfit train (None: not one of its flags)."""
    return INHERITED_HELP.get(f.name, f.metadata["help"])


FLAG_FIELDS = _flag_fields()
# the job's knobs that are lists of names: "a,b" on the command line (and in a config file)
_LIST_KNOBS = tuple(
    name
    for name, hint in typing.get_type_hints(TrainConfig).items()
    if name in JOB_FIELDS and "list[" in str(hint)
)


def _switch(f: dataclasses.Field[Any]) -> bool:
    """A boolean flag given alone (``--merge-lora``), off by default."""
    return f.metadata.get("negatable") is False


def _shown_default(f: dataclasses.Field[Any]) -> str | None:
    """The default memfit train's help shows for field ``f``: the run's (the flag's own is None,
    so that a config file's value stands); None: none to show."""
    if f.name in SHOWN_DEFAULTS:
        return SHOWN_DEFAULTS[f.name]
    if f.default is None or f.default is dataclasses.MISSING or _switch(f):
        return None
    if isinstance(f.default, bool):  # --packing/--no-packing: the one that holds, as click shows
        name = flag_of(f).removeprefix("--")
        return name if f.default else f"no-{name}"
    return str(f.default)


def _help(f: dataclasses.Field[Any]) -> str | None:
    """Field ``f``'s help line in memfit train (None: the field's own), its aliases named."""
    help = _job_help(f) if f.name in JOB_FIELDS else None
    aliases = [alias for alias, name in HF_ALIASES.items() if name == f.name]
    aliases += list(PRECISION_SWITCHES) if f.name == "precision" else []
    if not aliases:
        return help
    label = "Alias" if len(aliases) == 1 else "Aliases"
    return f"{help or f.metadata['help']} {label}: {', '.join(aliases)}."


def _parameter(f: dataclasses.Field[Any], hint: Any) -> inspect.Parameter:
    """The flag of field ``f``: None (not given) by default, so that a config file's value
    stands; a switch is False, and --resume (this invocation's, not the file's) shows it."""
    help = _help(f)
    if _switch(f) or f.name == "resume":
        return field_parameter(f, bool, help=help, default=False)
    kinds = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    kind = kinds[0] if len(kinds) == 1 else hint
    if f.metadata.get("size") or typing.get_origin(kind) is list:
        kind = str  # 16GiB; a, b (comma-separated)
    return field_parameter(f, kind | None, help=help, default=None, shown_default=_shown_default(f))


# Hugging Face TrainingArguments' spellings of memfit train's flags, typed from habit: alias →
# field. --gradient-accumulation-steps is spelled the same; --bf16/--fp16 set --precision.
HF_ALIASES: dict[str, str] = {
    "--learning-rate": "lr",
    "--num-train-epochs": "epochs",
    "--per-device-train-batch-size": "micro_batch_size",
    "--save-steps": "save_every",
    "--eval-steps": "eval_every",
}
PRECISION_SWITCHES: dict[str, str] = {"--bf16": "bf16", "--fp16": "fp16"}


def _alias_name(alias: str) -> str:
    """The keyword an alias flag reaches train_command under (``--save-steps``: alias_save_steps)."""
    return "alias_" + alias.removeprefix("--").replace("-", "_")


def _alias_parameters() -> list[inspect.Parameter]:
    """The aliases as flags of their own, left out of the help (the flag's help names them)."""
    parameters: list[tuple[str, Any, bool | None]] = []
    for alias, name in HF_ALIASES.items():
        hint = _HINTS[name]
        kind = float if float in (hint, *typing.get_args(hint)) else int
        option = typer.Option(alias, hidden=True, show_default=False)
        parameters.append((_alias_name(alias), Annotated[kind | None, option], None))
    for switch in PRECISION_SWITCHES:
        option = typer.Option(switch, hidden=True, show_default=False)
        parameters.append((_alias_name(switch), Annotated[bool, option], False))
    return [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d)
        for n, a, d in parameters
    ]


def _with_aliases(knobs: dict[str, Any], given: dict[str, Any]) -> None:
    """Fold the aliases given into ``given`` (field → value); an alias and its flag (or two
    precision switches) that disagree are refused, naming both."""
    by_name = {f.name: f for f in FLAG_FIELDS}
    for alias, name in HF_ALIASES.items():
        value = knobs.get(_alias_name(alias))
        if value is None:
            continue
        flag = flag_of(by_name[name])
        if name in given and given[name] != value:
            raise UsageError(
                f"{alias} {value} and {flag} {given[name]} disagree ({alias} is another name "
                f"for {flag}): give one of them"
            )
        given[name] = value
    switches = [s for s in PRECISION_SWITCHES if knobs.get(_alias_name(s))]
    if len(switches) > 1:
        raise UsageError(f"{' and '.join(switches)} disagree: give one of them (or --precision)")
    if switches:
        precision = PRECISION_SWITCHES[switches[0]]
        if given.get("precision", precision) != precision:
            raise UsageError(
                f"{switches[0]} and --precision {given['precision']} disagree ({switches[0]} is "
                f"--precision {precision}): give one of them"
            )
        given["precision"] = precision


def _given(knobs: dict[str, Any]) -> dict[str, Any]:
    """The flags given on the command line (aliases folded in), as TrainConfig's values (sizes
    in bytes, lists)."""
    given: dict[str, Any] = {}
    for f in FLAG_FIELDS:
        value = knobs[f.name]
        if value is None or (value is False and _switch(f)) or f.name == "resume":
            continue
        if f.name in _LIST_KNOBS:
            value = parse_target_modules(value)
        elif f.metadata.get("comma_list"):
            value = [x.strip() for x in value.split(",")]
        given[f.name] = value
    _with_aliases(knobs, given)
    for f in FLAG_FIELDS:
        if f.metadata.get("size") and f.name in given:
            given[f.name] = parse_size(given[f.name], name=flag_of(f))
    return given


# the seeds memfit train accepts: numpy's legacy seeding takes < 2**32, torch < 2**64 (and the
# run seeds its data order with seed × 1,000,003 + epoch, which must stay below 2**64 too)
MAX_SEED = 2**32 - 1


def _batch_settings(settings: dict[str, Any], default_effective: int) -> None:
    """Settle the batch keys in ``settings`` (flags, config file and environment merged): the
    micro-batch, the accumulation steps and the effective batch must agree where all are given
    (micro × accumulation × ranks = effective); a missing one follows from the others (the
    effective batch, else ``default_effective``). The accumulation steps then leave ``settings``:
    the run derives them from the other two."""
    micro = settings.get("micro_batch_size")
    steps = settings.pop("gradient_accumulation_steps", None)
    effective = settings.get("effective_batch_size")
    world = settings.get("world_size") or launched_world_size()
    if steps is None:
        if effective is None and micro:
            # a planned config names the micro-batch; the effective batch follows from it
            settings["effective_batch_size"] = int(micro) * int(world)
        return
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise UsageError(f"--gradient-accumulation-steps: must be ≥ 1, got {steps}")
    if not all(isinstance(x, int) for x in (micro or 0, effective or 0, world)):
        return  # a setting of the wrong kind: the run's own checks name it
    ranks = f" × {world} ranks (--world-size)" if world > 1 else ""
    if micro is None:
        # the accumulation steps pin the micro-batch: the effective batch ÷ (steps × ranks)
        total = effective if effective is not None else default_effective
        per_step = steps * world
        if total % per_step:
            raise UsageError(
                f"--gradient-accumulation-steps {steps}{ranks} does not divide "
                f"--effective-batch-size {total}; give an effective batch that is a multiple "
                f"of {per_step}, or leave --gradient-accumulation-steps out"
            )
        settings["micro_batch_size"] = total // per_step
        return
    product = micro * steps * world
    if effective is None:
        settings["effective_batch_size"] = product
    elif effective != product:
        raise UsageError(
            f"--micro-batch-size {micro} × --gradient-accumulation-steps {steps}{ranks} = "
            f"{product}, but --effective-batch-size is {effective}; make them agree, or leave "
            "one of the three out (it follows from the other two)"
        )


def _settings(config: str | None, knobs: dict[str, Any]) -> dict[str, Any]:
    """TrainConfig's keyword arguments: the managed service's environment, then the config
    file, then the flags given, each over the one before."""
    # on SageMaker-style services the job's channels, folders and hyperparameters are the
    # defaults; the config file and the flags below win over them
    settings: dict[str, Any] = environment_settings(os.environ, TrainConfig)
    if config is not None:
        loaded = load_config(config)
        for key in (*PLAN_ONLY_KEYS, "num_labels"):
            loaded.pop(key, None)
        for name in _LIST_KNOBS:
            if isinstance(loaded.get(name), str):
                # "attention,mlp" in the file, as on the command line
                loaded[name] = parse_target_modules(loaded[name])
        settings.update(loaded)
    given = _given(knobs)
    if "gradient_accumulation_steps" not in given and any(
        k in given for k in ("micro_batch_size", "effective_batch_size", "world_size")
    ):
        # a flag that changes the batch overrides a planned config's accumulation steps (they
        # follow from the batch again); only steps given as a flag must agree with it
        settings.pop("gradient_accumulation_steps", None)
    settings.update(given)
    for f in FLAG_FIELDS:
        if f.metadata.get("zero_is_none") and settings.get(f.name) == 0:
            settings[f.name] = None
    # (a dataclass field's default is its class attribute)
    _batch_settings(settings, TrainConfig.effective_batch_size)
    return settings


def train_command(config: str | None = None, **knobs: Any) -> None:
    """Fine-tune under the OOM guard: same gradient, no restart, no lost sample."""
    # flags that are wrong whatever the config file says: refused before the run's setup
    seed, steps, cache_dir = knobs["seed"], knobs["gradient_accumulation_steps"], knobs["cache_dir"]
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise UsageError(f"--seed: must be a whole number from 0 to {MAX_SEED}, got {seed}")
    if steps is not None and steps < 1:
        raise UsageError(f"--gradient-accumulation-steps: must be ≥ 1, got {steps}")
    if cache_dir is not None:
        check_writable_dir(cache_dir, "--cache-dir")
    # the model, tokenizing and the plan take seconds to minutes before step 1
    model = knobs["model"]
    with train_setup_status(
        "loading torch and transformers", subject=f"memfit train {model or config or ''}".strip()
    ):
        settings = _settings(config, knobs)
        if settings.get("cache_dir") and cache_dir is None:
            # from the config file or the environment: checked before the model loads too
            check_writable_dir(settings["cache_dir"], "--cache-dir")
        missing = [
            f"--{k.replace('_', '-')}"
            for k in ("task", "model", "train_file", "output_dir")
            if not settings.get(k)
        ]
        if missing:
            raise UsageError(
                f"memfit train needs {', '.join(missing)} (as flags or in the config file)"
            )
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(k for k in settings if k not in known)
        if unknown:
            raise UsageError(f"{config}: settings memfit train does not take: {', '.join(unknown)}")
        # --resume, or the environment's (a restarted managed job finds its run folder)
        resume = knobs["resume"] or bool(settings.pop("resume", False))
        # a Hub id whose weights are in no cache while the Hub does not answer: one line now,
        # before torch and transformers take their seconds to load
        if problem := by_name_problem(str(settings["model"]), "--model"):
            raise UsageError(problem)
        progress.report(
            f"loading {settings['model']}, tokenizing {settings['train_file']}, "
            "planning the micro-batch"
        )
        # start-up: the run itself loads torch and transformers, under the status line
        from memfit.train.run import train

        try:
            result = train(TrainConfig(**settings, resume=resume))
        except RankLostError:
            # another rank is gone: on one host torchrun's agent now stops this one (SIGTERM);
            # it is ending anyway, and says why first
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise
    if os.environ.get("RANK", "0") not in ("", "0"):
        return  # several ranks: rank 0 reports the run
    if result.stopped in ("done", "finished"):
        # "finished": a --resume of a done run (a managed job started again) publishes it too
        published = publish_model(result.output_dir, os.environ)
        if published is not None:
            typer.echo(f"model copied to {published} (SM_MODEL_DIR)")
    if result.stopped == "signal":
        typer.echo(
            f"stopped by a signal after step {result.steps}; a checkpoint is in {result.output_dir}/checkpoints (memfit train ... --resume continues)"
        )
    else:
        metrics = "  ".join(f"{k} {v:.4g}" for k, v in result.eval_metrics.items())
        typer.echo(
            f"done: {result.steps} steps, {result.samples_seen} samples; model in {result.output_dir}/model"
            + (f"; eval: {metrics}" if metrics else "")
        )


_HINTS = typing.get_type_hints(TrainConfig)
with_parameters(
    train_command,
    [
        inspect.Parameter(
            "config", inspect.Parameter.KEYWORD_ONLY, annotation=ConfigFile, default=None
        ),
        *(_parameter(f, _HINTS[f.name]) for f in FLAG_FIELDS),
        *_alias_parameters(),
    ],
)
