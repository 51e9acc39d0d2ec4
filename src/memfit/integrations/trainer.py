"""``GuardedTrainer``: a ``transformers.Trainer`` that survives out-of-memory with the same gradient.

The one-line change to an existing script::

    from transformers import Trainer                      # before
    from memfit.integrations import GuardedTrainer as Trainer   # after

Everything else stays: the arguments, the data collator, callbacks, a ``compute_loss`` override.
Extra keywords: ``memory_cap`` (make the device behave as if it had that much memory: on the CPU
a real ``torch.OutOfMemoryError`` past the cap, on CUDA the allocator's fraction), ``grow_after``
(clean optimizer steps before the guard tries a larger micro-batch again) and ``memfit_plan``
(apply memfit's plan to the ``TrainingArguments`` first, see :func:`memfit.integrations.apply_plan`).
How the gradient stays exact: :mod:`memfit.integrations._guard`. Under ``torchrun`` (DDP) an
OOM on one rank is every rank's: they back off to the same size and re-run the step, and the
guard averages the gradients itself (:mod:`memfit.integrations._ranks`).
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import Trainer

from memfit import quiet
from memfit.errors import UsageError
from memfit.integrations._guard import TrainerGuardMixin
from memfit.integrations._weights import model_weights_dtype
from memfit.integrations.plan import PlannedArguments, apply_plan, own_cross_entropy
from memfit.step import offload

logger = logging.getLogger("memfit.integrations")


def plan_trainer_arguments(
    positional: tuple[Any, ...],
    keywords: dict[str, Any],
    request: dict[str, Any] | bool,
    **defaults: Any,
) -> tuple[tuple[Any, ...], dict[str, Any], PlannedArguments]:
    """The Trainer's constructor arguments with ``args`` replaced by the planned ones.

    ``request`` is ``apply_plan``'s keywords (``{"seq_len": 128, "gpu_memory": "16GiB"}``), or
    True for no keywords (then the budget is this machine's GPU; ``seq_len`` is still needed).
    """
    model = positional[0] if positional else keywords.get("model")
    args = positional[1] if len(positional) > 1 else keywords.get("args")
    # the step the Trainer will run: the weights as the model holds them, Liger's loss if asked
    # (what the request names wins)
    found = step_knobs(model, args) if model is not None and args is not None else {}
    options = found | dict(defaults) | ({} if request is True else dict(request or {}))
    if "seq_len" not in options:
        raise UsageError(
            "memfit_plan: seq_len: the plan needs the longest sequence a batch holds, e.g. "
            "memfit_plan={'seq_len': 128, 'gpu_memory': '16GiB'}"
        )
    if model is None or args is None:
        raise UsageError(
            "memfit_plan: needs the model and its TrainingArguments: pass model= and args="
        )
    planned = apply_plan(args, model, **options)
    logger.warning("%s", planned)
    if len(positional) > 1:
        positional = (positional[0], planned.args, *positional[2:])
    else:
        keywords = {**keywords, "args": planned.args}
    return positional, keywords, planned


def step_knobs(model: Any, args: Any) -> dict[str, str]:
    """The job knobs of the step a Trainer runs on ``model`` with ``args`` that the model and the
    arguments say, not the job's defaults: ``weights_dtype`` from the dtypes the model holds,
    ``cross_entropy`` from ``use_liger_kernel``.

    - Weights: :func:`memfit.integrations._weights.model_weights_dtype` (trained weights all in
      16 bits are pure 16-bit training: the Trainer trains a model loaded in bf16 so).
    - Loss: ``use_liger_kernel`` patches a causal LM with Liger's fused linear cross-entropy
      unless ``liger_kernel_config`` turns ``fused_linear_cross_entropy`` off (on by default)
      or Liger has no patch for the model's type (GPT-2: the Trainer then runs the standard
      loss; :func:`memfit.integrations.plan.own_cross_entropy`).
    """
    found: dict[str, str] = {}
    dtype = model_weights_dtype(model)
    if dtype is not None:
        found["weights_dtype"] = dtype
    if getattr(args, "use_liger_kernel", False) and _causal_lm(model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if own_cross_entropy(args, getattr(base, "config", None)) == "fused-linear":
            found["cross_entropy"] = "fused-linear"
    return found


def _causal_lm(model: Any) -> bool:
    """Whether ``model`` is a causal LM (Liger's fused loss patches those only)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(base).__name__.endswith(("ForCausalLM", "LMHeadModel"))


class _OffloadPerCall:
    """The activation offloading context around each stock ``training_step`` call (one
    micro-batch's forward and backward) when the arguments say ``activation_offloading`` (TRL's
    ``SFTConfig``): the context TRL's SFTTrainer enters around its training step
    (:func:`memfit.step.offload.offload_context`), so that arguments a plan set it in run what
    the plan priced. Below the guard in the method order: each chunk and each re-run after an OOM
    enters it anew (TRL's ``__enter__`` drops what a failed attempt left)."""

    args: Any
    model: Any
    _memfit_offload: Any

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        step = super().training_step  # type: ignore[misc]
        if not getattr(self.args, "activation_offloading", False):
            return step(*args, **kwargs)
        if self._memfit_offload is None:
            # built once: TRL's hooks the model's output head
            model = self.model
            assert model is not None  # a Trainer trains a model
            self._memfit_offload = offload.offload_context(model, self.args.device.type)
        with self._memfit_offload:
            return step(*args, **kwargs)


class GuardedTrainer(TrainerGuardMixin, _OffloadPerCall, Trainer):
    """``transformers.Trainer`` whose ``training_step`` survives OOM with the same gradient.

    On an out-of-memory error inside a micro-batch's forward or backward, the guard drops the
    step's gradients, halves the rows it runs at once and re-runs the step's micro-batches so
    far, each as chunks whose losses are weighted so that they add up to the micro-batch's: the
    effective batch, the optimizer steps and (with dropout off) the weights are those of a run
    without OOM. No restart, no lost steps. Events go to ``OUTPUT_DIR/memfit_events.jsonl``.

    Args (besides the Trainer's):
        memory_cap: a size (``"300MiB"``, bytes as int): run ``train``/``evaluate``/``predict``
            under :func:`memfit.guard.memory_cap`, so that OOM is real on a CPU machine (tests,
            demos) or a GPU behaves as a smaller one. ``guard_cap.peak_bytes`` is then the CPU
            peak. Default: the environment variable ``MEMFIT_MEMORY_CAP`` (unset: no cap).
        grow_after: clean optimizer steps before the guard tries twice the chunk size again.
        memfit_plan: keywords for :func:`~memfit.integrations.apply_plan` (``seq_len`` is
            required; ``gpu_memory``/``gpu`` the budget): the plan's micro-batch, accumulation,
            precision and checkpointing are written into ``args`` before the Trainer reads them.
            The plan prices the step this Trainer runs: the model's weights in the dtypes it
            holds them in, Liger's fused loss with ``use_liger_kernel`` (:func:`step_knobs`).
            The result is ``self.memfit_plan``.
    Not guarded: an OOM in the optimizer step (it holds weights, gradients and optimizer state
    whatever the micro-batch) and multi-process training (one rank's OOM would have to become
    every rank's decision).
    """

    def __init__(
        self,
        *args: Any,
        memory_cap: int | str | None = None,
        grow_after: int = 50,
        memfit_plan: dict[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> None:
        quiet.install()  # the library lines that say nothing (memfit.quiet)
        self._guard_init(memory_cap=memory_cap, grow_after=grow_after)
        self._memfit_offload = None  # TRL's activation offloading context, once built
        self.memfit_plan: PlannedArguments | None = None
        if memfit_plan:
            args, kwargs, self.memfit_plan = plan_trainer_arguments(args, kwargs, memfit_plan)
        arguments: Any = args[1] if len(args) > 1 else kwargs.get("args")
        if getattr(arguments, "activation_offloading", False):
            # on CUDA TRL's context or nothing (what the plan and the estimate price): refused
            # before the Trainer places the model
            problem = offload.missing(arguments.device.type)
            if problem is not None:
                raise UsageError(problem)
        super().__init__(*args, **kwargs)
        self._guard_check_arguments()
