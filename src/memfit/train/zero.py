"""``--sharding zero1|zero2|zero3``: DeepSpeed ZeRO under the guard.

DeepSpeed's engine holds the partitions (optimizer state; gradients from stage 2; parameters at
stage 3) and communicates inside forward and backward: ZeRO-2/3 reduce gradient buckets from
their backward hooks, ZeRO-3 gathers each module's parameters before its forward and backward.
All of it goes through ``deepspeed.comm``, whose collectives memfit wraps (:class:`CommGuard`):
each one first meets the other ranks at a sync point (:meth:`memfit.train.distributed.Ranks.check`),
so a rank that ran out of memory anywhere is met at a sync point, never inside a collective (the
invariant of :mod:`memfit.train.distributed`). The wrapper calls the collective straight after the
sync point: DeepSpeed has allocated the collective's buffers before it calls it.

The guard owns gradient accumulation: the engine runs with ``managed_gradient_accumulation:
false`` (DeepSpeed's caller-owned boundary), every micro-batch's ``engine.backward`` accumulates
(ZeRO-1 locally, ZeRO-2/3 into the reduced partitions), and ``engine.step()`` is the step's
boundary (ZeRO-1 reduces there). Each rank's loss is its share of the whole step's mean times the
number of ranks, because DeepSpeed averages gradients over the ranks where memfit's own data
parallelism sums them: the update equals a one-process step over the same samples.

After an OOM the failed attempt's gradients are dropped everywhere DeepSpeed keeps them
(:meth:`ZeroModel.reset`): the parameters' gradients, the partially filled reduce buckets and the
"already reduced" marks, the partitions accumulated so far, the micro-step counter, the backward
hook state and, at stage 3, every gathered parameter (released, the prefetch trace reset). The
re-run then accumulates the step from scratch, as DeepSpeed's own overflow skip starts the next
step. Checked by re-running a step after an OOM injected in forward, in backward and in another
rank: the weights are bit-identical to a run without the OOM (stages 1, 2 and 3).

Checkpoints are whole-model files in memfit's format (fp32 master weights, the optimizer state
per parameter, gathered with DeepSpeed's ``safe_get_full_*``), the same as ``--sharding none``
and ``fsdp`` write, so a run resumes on any number of ranks, with or without DeepSpeed.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memfit.errors import UsageError
from memfit.estimate.sharding import deepspeed_zero_config
from memfit.extras import is_installed, missing_line
from memfit.levers.optimizer_offload import offload_problems
from memfit.runtime import quiet_deepspeed

# the collectives of deepspeed.comm's backend object (deepspeed/comm/torch.py TorchBackend) that
# ZeRO uses in a training step; each is wrapped with a sync point
_COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "inference_all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_base",
    "all_gather_coalesced",
    "broadcast",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
)

# what memfit owns, whatever a --deepspeed file says: the batch (the guard splits it), the
# boundary (engine.step() ends a step), the optimizer and its schedule (--optimizer, --lr, ...)
_OWNED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
)


def read_config(path: str) -> dict[str, Any]:
    """A ``--deepspeed`` file as a dict; a file that is not a JSON object is exit 2."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--deepspeed: {path}: {exc.strerror or exc}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"--deepspeed: {path}: line {exc.lineno}: not valid JSON ({exc.msg})"
        ) from None
    if not isinstance(config, dict):
        raise UsageError(f"--deepspeed: {path}: a DeepSpeed config is a JSON object")
    return config


def config_problems(path: str | None, sharding: str, precision: str | None = None) -> list[str]:
    """What is wrong with a ``--deepspeed`` file, before anything starts (one line each)."""
    if path is None:
        return []
    try:
        config = read_config(path)
    except UsageError as exc:
        return [str(exc)]
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        return [f"--deepspeed: {path}: zero_optimization must be a JSON object"]
    named = sharding in ("zero1", "zero2", "zero3")
    stage = zero.get("stage")
    if stage is None and not named:
        return [
            f"--deepspeed: {path}: no zero_optimization.stage; name the stage in the file or "
            "with --sharding zero1|zero2|zero3"
        ]
    # (a JSON true is not stage 1)
    if stage is not None and (isinstance(stage, bool) or stage not in (1, 2, 3, "auto")):
        return [
            f"--deepspeed: {path}: zero_optimization.stage is {json.dumps(stage)}; memfit train "
            "runs ZeRO stage 1, 2 or 3"
        ]
    wanted = f"zero{stage}" if stage in (1, 2, 3) else None
    if stage == "auto" and not named:
        return [
            f'--deepspeed: {path}: zero_optimization.stage is "auto"; name the stage with '
            "--sharding zero1|zero2|zero3"
        ]
    if sharding != "none" and wanted is not None and sharding != wanted:
        return [
            f"--deepspeed: {path} says ZeRO stage {stage} but --sharding is {sharding}; make "
            "them agree (or leave --sharding out)"
        ]
    problems = _offload_problems(zero, path)
    if precision is not None:
        problems.extend(_precision_problems(config, path, precision))
    if not problems:
        # DeepSpeed's own checks, now: at the engine's start they are a traceback on every rank
        verdict = deepspeed_verdict(path, wanted or sharding, precision)
        if verdict is not None:
            problems.append(verdict)
    return problems


def _offload_device(section: Any) -> str | None:
    """The ``device`` of an ``offload_optimizer``/``offload_param`` section (None: no section,
    or ``"none"``: nothing offloaded)."""
    if not section:
        return None
    device = section.get("device", "none") if isinstance(section, dict) else section
    return None if device in (None, "none") else str(device)


def _offload_problems(zero: dict[str, Any], path: str) -> list[str]:
    """The offload sections memfit train does not run: parameters offloaded (ZeRO-3's
    ``offload_param``, which memfit's estimate does not price) and NVMe; the optimizer offloaded
    to the CPU runs (ZeRO-Offload, as ``--optimizer-offload cpu``)."""
    problems = []
    if _offload_device(zero.get("offload_param")) is not None:
        problems.append(
            f"--deepspeed: {path}: zero_optimization.offload_param (ZeRO-3 parameter offload) is "
            "not run by memfit train (its estimate does not price the parameters in host "
            "memory); remove it (the optimizer's offload_optimizer to cpu runs)"
        )
    device = _offload_device(zero.get("offload_optimizer"))
    if device is not None and device != "cpu":
        problems.append(
            f"--deepspeed: {path}: zero_optimization.offload_optimizer.device is "
            f'{json.dumps(device)}; memfit train offloads the optimizer to "cpu" only'
        )
    return problems


def _file_offload(path: str | None) -> str | None:
    """What a ``--deepspeed`` file says of the optimizer's offload: ``"cpu"``, ``"none"`` (a
    section whose device is none), None (no section, or no file it can read: config_problems
    says that). Another device is config_problems' (:func:`_offload_problems`)."""
    if not path:
        return None
    try:
        zero = read_config(path).get("zero_optimization", {})
    except UsageError:
        return None
    if not isinstance(zero, dict) or not zero.get("offload_optimizer"):
        return None
    device = _offload_device(zero.get("offload_optimizer"))
    return "none" if device is None else device


def resolve_optimizer_offload(cfg: Any) -> list[str]:
    """The ``--deepspeed`` file's ``offload_optimizer`` made the run's ``cfg.optimizer_offload``
    before the config's problems are looked for, so that the run prices (memfit's plan and
    estimate) and builds (DeepSpeedCPUAdam) what the file runs. Returns the problems, one line
    each: a file that offloads with an optimizer offload does not run (named as the file's), and
    an ``--optimizer-offload`` the file contradicts (then nothing is changed)."""
    path = getattr(cfg, "deepspeed", None)
    found = _file_offload(path)
    if found not in ("cpu", "none"):
        return []
    flag = getattr(cfg, "optimizer_offload", None)
    if flag is not None and flag != found:
        return [
            f"--optimizer-offload {flag} but --deepspeed {path}: "
            f'zero_optimization.offload_optimizer.device is "{found}"; make them agree (or '
            "leave --optimizer-offload out)"
        ]
    if found == "cpu":
        sharding = cfg.sharding if cfg.sharding in ("zero1", "zero2", "zero3") else "zero1"
        problems = offload_problems(cfg.optimizer, sharding, getattr(cfg, "mode", None))
        if problems:
            said = f"--deepspeed {path}: zero_optimization.offload_optimizer cpu:"
            return [x.replace("--optimizer-offload cpu:", said, 1) for x in problems]
    cfg.optimizer_offload = found
    return []


def optimizer_offload_of(cfg: Any) -> str | None:
    """``--optimizer-offload``, or what the ``--deepspeed`` file says where the run's config did
    not take it in already (:func:`resolve_optimizer_offload`)."""
    flag = getattr(cfg, "optimizer_offload", None)
    if flag is not None:
        return str(flag)
    found = _file_offload(getattr(cfg, "deepspeed", None))
    return "cpu" if found == "cpu" else None


def _precision_problems(config: dict[str, Any], path: str, precision: str) -> list[str]:
    """A file that turns on a 16-bit mode other than the run's precision (one line)."""
    for key in _enabled_modes(config):
        if key != precision:
            return [
                f"--deepspeed: {path} enables {key} but the run's precision is {precision}; make "
                f'them agree (--precision {key}, or "enabled": false in the file)'
            ]
    return []


def _enabled_modes(config: dict[str, Any]) -> list[str]:
    """The 16-bit modes (bf16, fp16) a DeepSpeed config turns on ("auto": not by itself)."""
    return [
        key
        for key in ("bf16", "fp16")
        if isinstance(section := config.get(key), dict)
        and section.get("enabled") not in (None, "auto", False)
    ]


def deepspeed_verdict(path: str, sharding: str, precision: str | None) -> str | None:
    """What DeepSpeed's own config model (``DeepSpeedConfig``: pydantic models per section, then
    its checks) rejects in the config memfit would run from the ``--deepspeed`` file: one line
    naming the file and the field (None: it passes, or DeepSpeed is not installed, which
    :mod:`memfit.extras` reports)."""
    try:
        # optional: deepspeed (memfit[deepspeed], --sharding zero1|zero2|zero3)
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        return None
    if precision is None:
        # to be planned: the 16-bit mode the file turns on (checked against the plan's later)
        enabled = _enabled_modes(read_config(path))
        if len(enabled) > 1:
            return f"--deepspeed: {path}: enables both bf16 and fp16; DeepSpeed runs one of them"
        precision = enabled[0] if enabled else "fp32"
    # the file as memfit runs it: its "auto" values filled, the batch and the optimizer memfit's
    # (any micro-batch and width do: they are not what a file can get wrong)
    run_config, _ = build_config(
        SimpleNamespace(deepspeed=path, max_grad_norm=None),
        stage=int(sharding[-1]),
        hidden_size=768,
        precision=precision,
        micro=1,
    )
    try:
        DeepSpeedConfig(run_config)
    except Exception as exc:  # pydantic's ValidationError (a ValueError), asserts, ValueErrors
        return f"--deepspeed: {path}: {_rejection(exc, run_config)}"
    return None


def _rejection(exc: Exception, config: dict[str, Any]) -> str:
    """DeepSpeed's reason, with the field it is about (``zero_optimization.reduce_bucket_size:
    Input should be greater than 0, got -5``)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
        except (TypeError, IndexError, ValueError):
            first = None
        if isinstance(first, dict):
            loc = [str(x) for x in first.get("loc", ())]
            where = _field_path(config, loc, first.get("input"))
            if where is None:  # a field the file does not have (a required one)
                where = ".".join([str(getattr(exc, "title", "")), *loc]).strip(".")
            got = "" if first.get("type") == "missing" else f", got {first.get('input')!r}"
            # (pydantic prefixes a validator's own ValueError)
            message = str(first.get("msg", exc)).removeprefix("Value error, ")
            return f"{where}: {message}{got} (DeepSpeed's config check)"
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return f"DeepSpeed rejects it: {line}"


def _field_path(config: dict[str, Any], loc: list[str], value: Any) -> str | None:
    """Where in ``config`` the field that a section's model rejected is: its location inside
    the section (``loc``) under some section key, holding the rejected value if one does."""
    found = [path for path, held in _located(config, loc, ()) if held == value]
    found = found or [path for path, _ in _located(config, loc, ())]
    return ".".join(found[0]) if found else None


def _located(
    config: Any, loc: list[str], prefix: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every ``(path, value)`` in ``config`` whose path ends with ``loc``."""
    if not isinstance(config, dict) or not loc:
        return
    here: Any = config
    for key in loc:
        if not isinstance(here, dict) or key not in here:
            break
        here = here[key]
    else:
        yield (*prefix, *loc), here
    for key, section in config.items():
        yield from _located(section, loc, (*prefix, str(key)))


def stage_of(cfg: Any) -> int | None:
    """The ZeRO stage a run asked for: --sharding zeroN, else its --deepspeed file's stage."""
    if cfg.sharding in ("zero1", "zero2", "zero3"):
        return int(cfg.sharding[-1])
    if cfg.deepspeed is None:
        return None
    stage = read_config(cfg.deepspeed).get("zero_optimization", {}).get("stage")
    return int(stage) if stage in (1, 2, 3) else None


def build_config(
    cfg: Any, *, stage: int, hidden_size: int, precision: str, micro: int
) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed config memfit runs, and notes on what it changed in a ``--deepspeed`` file.

    Without a file: the ``zero_optimization`` section memfit's estimate assumes
    (:func:`memfit.estimate.sharding.deepspeed_zero_config`). With one: the file, its ``"auto"``
    values filled from the same section, as accelerate fills them.
    """
    notes: list[str] = []
    assumed = deepspeed_zero_config(f"zero{stage}", hidden_size)
    if cfg.deepspeed:
        config = read_config(cfg.deepspeed)
        zero = dict(config.get("zero_optimization", {}))
        for key, value in list(zero.items()):
            if value == "auto":
                zero[key] = assumed.get(key, stage if key == "stage" else None)
                if zero[key] is None:
                    del zero[key]
        zero["stage"] = stage
        config["zero_optimization"] = zero
        dropped = [k for k in ("optimizer", "scheduler") if k in config]
        for key in dropped:
            del config[key]
        if dropped:
            notes.append(
                f"--deepspeed: the file's {' and '.join(dropped)} section"
                f"{'s are' if len(dropped) > 1 else ' is'} left out: memfit builds them from "
                "--optimizer, --lr, --weight-decay, --lr-scheduler and --warmup-steps"
            )
        changed = [
            k for k in (*_OWNED_KEYS, "gradient_clipping") if config.get(k) not in (None, "auto")
        ]
        if changed:
            notes.append(
                f"--deepspeed: {', '.join(changed)} left to memfit (its guard splits each step "
                "of --effective-batch-size into micro-batches; --max-grad-norm clips)"
            )
        # (checked before anything starts where --precision is given; here for a planned one)
        for problem in _precision_problems(config, cfg.deepspeed, precision):
            raise UsageError(problem)
    else:
        config = {"zero_optimization": dict(assumed)}
    if getattr(cfg, "optimizer_offload", None) == "cpu":
        # ZeRO-Offload: master weights, gradients and optimizer state in pinned host memory,
        # the update on the CPU (DeepSpeedCPUAdam: memfit.train.optim); a file's own section wins
        config["zero_optimization"].setdefault(
            "offload_optimizer", {"device": "cpu", "pin_memory": True}
        )
    for key in _OWNED_KEYS:
        config.pop(key, None)
    config["train_micro_batch_size_per_gpu"] = int(micro)
    config["gradient_accumulation_steps"] = 1
    # the guard owns the boundary: every engine.backward accumulates, engine.step() ends a step
    config["managed_gradient_accumulation"] = False
    config["gradient_clipping"] = float(cfg.max_grad_norm or 0.0)
    # memfit's optimizers (8-bit AdamW, Adafactor, SGD) are not on DeepSpeed's tested list
    config["zero_allow_untested_optimizer"] = True
    config.setdefault("steps_per_print", 2**31 - 1)
    config.setdefault("wall_clock_breakdown", False)
    for key in ("bf16", "fp16"):
        section = dict(config.get(key) or {})
        section["enabled"] = precision == key
        config[key] = section
    return config, notes


class CommGuard:
    """Wraps ``deepspeed.comm``'s collectives: each first meets the other ranks at a sync point
    (another rank's OOM is raised there, as :class:`memfit.guard.guard.PeerOutOfMemory`)."""

    def __init__(self, ranks: Any) -> None:
        self.ranks = ranks
        self.armed = False
        self._originals: dict[str, Callable[..., Any]] = {}
        # optional: deepspeed (memfit[deepspeed], --sharding zero1|zero2|zero3)
        from deepspeed.comm import comm as ds_comm

        backend = ds_comm.cdb
        if backend is None:  # pragma: no cover - initialize() sets it up first
            raise RuntimeError("deepspeed.comm is not initialized")
        self._backend = backend
        for name in _COLLECTIVES:
            original = getattr(backend, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(backend, name, self._wrap(original))

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                # no allocation between this sync point and the collective
                self.ranks.check()
            return original(*args, **kwargs)

        return collective

    @contextlib.contextmanager
    def disarmed(self) -> Iterator[None]:
        """Collectives every rank makes together with nothing that can fail in between
        (DeepSpeed's own start-up, gathering a checkpoint)."""
        armed, self.armed = self.armed, False
        try:
            yield
        finally:
            self.armed = armed

    def close(self) -> None:
        for name, original in self._originals.items():
            setattr(self._backend, name, original)
        self._originals.clear()


class ZeroModel:
    """The DeepSpeed engine of a ZeRO run, and what the loop and the guard need of it (the same
    interface as :class:`memfit.train.fsdp.ShardedModel`)."""

    def __init__(self, engine: Any, model: nn.Module, comm: CommGuard, stage: int) -> None:
        self.engine = engine
        self.model = model
        self.comm = comm
        self.stage = stage
        self.optimizer = engine.optimizer  # DeepSpeed's ZeRO optimizer (the partitions)
        self.world = int(comm.ranks.world_size)
        self._hooks = [model.register_forward_pre_hook(self._before_forward)]

    # -- the step ------------------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        # what engine.forward does before the module's own hooks: the backward-phase marks of
        # the last backward are cleared (ZeRO-3 counts its micro-steps here)
        self.optimizer.clear_backward_seen_flag()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's loss as DeepSpeed's averaging needs it (times the ranks; see the module
        docstring), with DeepSpeed's fp16 loss scale."""
        return loss * self.world

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward through the engine (its hooks reduce ZeRO-2/3 buckets)."""
        engine = self.engine
        # the prologue engine.forward would attach to the outputs: the backward-depth marks and
        # the post-backward callback
        engine._backward_prologue()
        engine.backward(self.scale(loss), scale_wrt_gas=False)

    def step(self) -> float | None:
        """The step's boundary: ZeRO-1 reduces, DeepSpeed clips (gradient_clipping) and
        updates; returns the gradient norm DeepSpeed measured (None where it measured none)."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    def skipped(self) -> bool:
        """Whether DeepSpeed skipped the last update (a gradient that was not finite)."""
        return not bool(getattr(self.engine, "_step_applied", True))

    def pad_pass(self, recipe: Any, rows: Sequence[Any]) -> Callable[[bool], None]:
        """A pass with no weight for a rank without a micro-batch left: the same collectives
        (ZeRO-3 gathers, ZeRO-2 buckets), nothing added to the gradient or the eval metrics."""
        row = rows[0]

        def run(train: bool) -> None:
            if train:
                self.backward(recipe.loss([row], 1) * 0.0)
            else:
                recipe.eval_partial([row])

        return run

    def reset(self) -> None:
        """After an OOM: drop the failed attempt's gradients wherever DeepSpeed keeps them, so
        the step's re-run accumulates from scratch (see the module docstring)."""
        opt = self.optimizer
        if torch.cuda.is_available():
            # reductions still running on DeepSpeed's side stream (overlap_comm) end first
            torch.cuda.synchronize()
        if self.stage in (1, 2):
            # optional: deepspeed (memfit[deepspeed], --sharding zero1|zero2|zero3)
            from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

            opt.zero_grad(set_to_none=True)
            for table in (opt.averaged_gradients, opt.all_grad_tensors):
                for key in list(table):
                    table[key] = None
            for bucket in opt.ipg_buckets.values():
                bucket.params.clear()
                bucket.grads.clear()
                bucket.elements = 0
                bucket.index = 0
                bucket.has_moe_params = False
            reduced = opt.params_already_reduced
            for key in range(len(reduced)) if isinstance(reduced, list) else list(reduced):
                reduced[key] = False
            opt.extra_large_param_to_reduce = {}
            opt._release_ipg_buffers()
            if hasattr(opt, "_clear_previous_reduced_grads"):
                opt._clear_previous_reduced_grads()
            if opt.partition_gradients:
                opt.reset_partition_gradient_structures()
            if opt.cpu_offload:
                # ZeRO-Offload: the host copies in flight end first; the failed attempt's marks
                # are dropped (which parameters reached the host, their norms, an overflow). Its
                # host gradient buffers are overwritten, not added to, by the re-run's first
                # backward (it starts the step's accumulation: micro_step_id below)
                opt._wait_for_offload_copies()
                opt._offload_accumulated_param_ids = set()
                opt.norm_for_param_grads = {}
                opt.local_overflow = False
            # as after an update: the next backward starts the step's accumulation
            opt.micro_step_id = INITIAL_MICRO_STEP_ID
        else:
            for group in opt.fp16_groups:
                for param in group:
                    param.grad = None
            opt.micro_step_id = 0
            opt._epilogue_ran_this_backward = False
            for bucket in opt.ipg_buckets.values():
                bucket.clear_params()
            for key in list(opt.params_already_reduced):
                opt.params_already_reduced[key] = False
            self._release_gathered()
        opt.clear_backward_seen_flag()
        opt._backward_hook_state.backward_active_depth = 0

    def _release_gathered(self) -> None:
        """ZeRO-3 after an OOM: every parameter the failed attempt gathered (or was gathering)
        goes back to its partition, and the prefetch trace, which holds a partial forward, is
        recorded anew by the re-run."""
        # optional: deepspeed (memfit[deepspeed], --sharding zero1|zero2|zero3)
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        coordinator = self.optimizer.parameter_offload.get_param_coordinator()
        # prefetches in flight: waited for (every rank issued them) and released
        coordinator._clean_inflight_param_registry()
        for param in self.model.parameters():
            if getattr(param, "ds_status", None) == ZeroParamStatus.INFLIGHT:
                # a gather whose collective another rank's OOM stopped at its sync point: its
                # buffer is dropped as a gathered parameter's is
                setattr(param, "ds_status", ZeroParamStatus.AVAILABLE)  # noqa: B010
        if not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()
        coordinator.release_and_reset_all(self.model)

    def held_tensors(self) -> list[torch.Tensor]:
        """What DeepSpeed holds between steps (partitions, master weights, flat buffers,
        optimizer state), for a memory cap that starts after the engine."""
        opt = self.optimizer
        found: list[torch.Tensor] = []
        for name in (
            "bit16_groups_flat",
            "single_partition_of_fp32_groups",
            "fp16_partitioned_groups_flat",
            "fp32_partitioned_groups_flat",
        ):
            value = getattr(opt, name, None)
            if isinstance(value, list):
                found.extend(t for t in value if isinstance(t, torch.Tensor))
        for attr in ("grad_partitions_flat_buffer", "grads_in_partition"):
            value = getattr(opt, attr, None)
            if isinstance(value, torch.Tensor):
                found.append(value)
        # the gradient reduce buckets: ZeRO-3 allocates its (reduce_bucket_size elements) at
        # start and keeps it for reuse; ZeRO-1/2 hold a list of them once a backward has run
        for bucket in getattr(opt, "ipg_buckets", {}).values():
            buffers = getattr(bucket, "buffer", None)
            buffers = buffers if isinstance(buffers, list) else [buffers]
            found.extend(t for t in buffers if isinstance(t, torch.Tensor))
        for param in self.model.parameters():
            partition = getattr(param, "ds_tensor", None)
            if isinstance(partition, torch.Tensor):
                found.append(partition)
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            for state in inner.state.values():
                found.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return found

    # -- checkpoints ---------------------------------------------------------------------------
    def _groups(self) -> list[list[nn.Parameter]]:
        opt = self.optimizer
        groups = getattr(opt, "bit16_groups", None) or opt.fp16_groups
        return [list(g) for g in groups]

    def _trained(self) -> list[nn.Parameter]:
        return [p for group in self._groups() for p in group]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's fp32 weights on the CPU, on every rank (collectives)."""
        # optional: deepspeed (memfit[deepspeed], --sharding zero1|zero2|zero3)
        from deepspeed.utils import safe_get_full_fp32_param

        with self.comm.disarmed():
            trained = {id(p) for p in self._trained()}
            gathered: dict[int, torch.Tensor] = {}
            full: dict[str, torch.Tensor] = {}
            # the state dict's names: persistent buffers only, tied weights under each name
            for name, tensor in self.model.state_dict(keep_vars=True).items():
                key = id(tensor)
                if key not in gathered:
                    if id(tensor) in trained:
                        value = safe_get_full_fp32_param(tensor)
                    elif isinstance(tensor, nn.Parameter):
                        value = self._frozen(tensor)
                    else:
                        value = tensor
                    gathered[key] = value.detach().to("cpu", copy=True)
                # one tensor for tied names: save_pretrained sees the tie, as without ZeRO
                full[name] = gathered[key]
        return full

    def _frozen(self, param: nn.Parameter) -> torch.Tensor:
        if self.stage == 3 and hasattr(param, "ds_id"):
            # optional: deepspeed (memfit[deepspeed], --sharding zero1|zero2|zero3)
            from deepspeed import zero

            with zero.GatheredParameters([param]):
                return param.detach().to("cpu", torch.float32, copy=True)
        return param.detach().to("cpu", copy=True)

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state per parameter, whole, in torch's ``state_dict`` layout (the
        parameters numbered in group order, as ``--sharding none`` saves them)."""
        # optional: deepspeed (memfit[deepspeed], --sharding zero1|zero2|zero3)
        from deepspeed.utils import safe_get_full_optimizer_state

        inner = self.optimizer.optimizer
        self._link_state()
        keys = sorted(
            {k for state in inner.state.values() for k, v in state.items() if _per_element(v)}
        )
        scalars = {
            k: v for state in inner.state.values() for k, v in state.items() if not _per_element(v)
        }
        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        index = 0
        with self.comm.disarmed():
            for group, settings in zip(self._groups(), optimizer.param_groups, strict=True):
                numbers = []
                for param in group:
                    entry = {
                        k: safe_get_full_optimizer_state(param, k).detach().to("cpu", copy=True)
                        for k in keys
                    }
                    if entry:
                        entry.update({k: _copy(v) for k, v in scalars.items()})
                        state[index] = entry
                    numbers.append(index)
                    index += 1
                groups.append({**{k: v for k, v in settings.items() if k != "params"}})
                groups[-1]["params"] = numbers
        return {"state": state, "param_groups": groups}

    def load(
        self,
        model_state: dict[str, Any],
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
    ) -> None:
        """Whole-model weights and optimizer state into this rank's partitions (every rank)."""
        # optional: deepspeed (memfit[deepspeed], --sharding zero1|zero2|zero3)
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        trained = self._trained()
        names = {id(p): n for n, p in self.model.named_parameters()}
        saved_state = optimizer_state.get("state", {})
        inner = self.optimizer.optimizer
        self._make_state(saved_state)
        with self.comm.disarmed():
            for index, param in enumerate(trained):
                weights = model_state[names[id(param)]]
                safe_set_full_fp32_param(param, weights.to(torch.float32))
                entry = saved_state.get(index, saved_state.get(str(index), {}))
                for key, value in entry.items():
                    if _per_element(value):
                        safe_set_full_optimizer_state(param, value.to(torch.float32), key)
            scalars = {
                k: v
                for entry in saved_state.values()
                for k, v in entry.items()
                if not _per_element(v)
            }
            for state in inner.state.values():
                for key, value in scalars.items():
                    state[key] = _copy(value)
            self._weights_from_master()
        for group, saved in zip(
            optimizer.param_groups, optimizer_state["param_groups"], strict=True
        ):
            group.update({k: v for k, v in saved.items() if k != "params"})

    def _make_state(self, saved_state: dict[Any, dict[str, Any]]) -> None:
        """A fresh engine's optimizer has no state yet (DeepSpeed's optimizer makes it at the
        first step): zeros of each saved key on every flat master partition, which the loaded
        values then fill (``safe_set_full_optimizer_state`` writes into them)."""
        opt, inner = self.optimizer, self.optimizer.optimizer
        keys = sorted(
            {k for entry in saved_state.values() for k, v in entry.items() if _per_element(v)}
        )
        if not keys or inner.state:
            return
        flats = (
            opt.fp32_partitioned_groups_flat
            if self.stage == 3
            else opt.single_partition_of_fp32_groups
        )
        for flat in flats:
            inner.state[flat] = {key: torch.zeros_like(flat) for key in keys}
        self._link_state()

    def _link_state(self) -> None:
        """ZeRO-1/2: each parameter's fragment of the flat partition linked to the optimizer's
        state (DeepSpeed links it once, and before the first step's state exists)."""
        opt = self.optimizer
        if self.stage in (1, 2):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def _weights_from_master(self) -> None:
        """The module's (16-bit or fp32) weights from the fp32 master partitions just loaded, as
        DeepSpeed's update does after a step (``safe_set_full_fp32_param`` sets the masters
        only)."""
        opt = self.optimizer
        if self.stage in (1, 2):
            opt.update_lp_params()
            return
        with torch.no_grad():
            for group in range(len(opt.fp16_groups)):
                opt._reassign_or_swap_out_partitioned_parameters(group)
        persistent = opt.persistent_parameters
        if persistent:
            # the small parameters every rank keeps whole: gathered again from the partitions
            persistent[0].all_gather(persistent)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.comm.close()


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def start_engine(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ranks: Any,
    config: dict[str, Any],
) -> ZeroModel:
    """DeepSpeed's engine over ``model`` (partitioned in place) and ``optimizer`` (wrapped), on
    the process group memfit joined, with every collective guarded from then on."""
    if ranks is None:
        raise UsageError(
            "--sharding: ZeRO shards over several ranks; launch them with torchrun "
            "--nproc_per_node N -m memfit train … (or use --sharding none)"
        )
    deepspeed = _import_deepspeed()
    if not torch.cuda.is_available():
        # on CPU ranks DeepSpeed would compile a shared-memory all-reduce (a C++ extension,
        # built with ninja at the first start); memfit's ranks talk over gloo
        # (the module itself: ``deepspeed.comm``'s attribute ``torch`` is PyTorch)
        backend_module = importlib.import_module("deepspeed.comm.torch")
        setattr(backend_module, "build_shm_op", lambda: None)  # noqa: B010
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    # DeepSpeed 0.19 calls torch's all_gather_into_tensor / reduce_scatter_tensor, which warn
    # (FutureWarning) at each of the thousands of calls a run makes: DeepSpeed's to change
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    comm = CommGuard(ranks)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if _offload_device(config["zero_optimization"].get("offload_optimizer")) == "cpu":
        # ZeRO-Offload keeps each fp32 gradient partition (a pinned host buffer) as the .grad of
        # the partitions DeepSpeed pointed the client optimizer's groups at, for the whole run:
        # the loop's zero_grad of that optimizer would drop them. It clears the module's
        # gradients instead, through DeepSpeed's own optimizer (as engine.zero_grad does)
        zero_optimizer = engine.optimizer

        def zero_grad(set_to_none: bool = True) -> None:
            zero_optimizer.zero_grad(set_to_none=set_to_none)

        setattr(optimizer, "zero_grad", zero_grad)  # noqa: B010
    comm.armed = True
    return ZeroModel(engine, model, comm, int(config["zero_optimization"]["stage"]))


def _import_deepspeed() -> Any:
    if not is_installed("deepspeed"):
        raise UsageError(missing_line("deepspeed", "--sharding zero1|zero2|zero3"))
    quiet_deepspeed()
    with contextlib.redirect_stdout(io.StringIO()):
        # optional: deepspeed (memfit[deepspeed], --sharding zero1|zero2|zero3)
        import deepspeed
    return deepspeed
