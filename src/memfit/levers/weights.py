"""The weights' dtype: the frozen weights held in 16 bits (what the job is), and pure 16-bit
training of the trainable ones (a lever a plan uses only with ``--allow pure-16bit``).

``--weights-dtype`` says what the frozen weights (the base under LoRA or QLoRA, the layers QLoRA
keeps unquantized, frozen embeddings) are held in: ``auto`` as ``from_pretrained`` loads them, in
the checkpoint's dtype (bf16 for today's decoders, fp32 for BERT and GPT-2), or ``fp32``/``bf16``/
``fp16``. A frozen weight held in 16 bits costs nothing in quality (every 16-bit checkpoint is
one), and under autocast it needs no half-precision copy. That is the job, not a lever: a plan
keeps the job's value (:attr:`Lever.pins`).

``auto`` and ``fp32`` train the trainable weights in fp32 (master weights, as mixed precision
does); ``bf16`` trains them in bf16 too: weights, gradients and optimizer state in 16 bits, LoRA
adapters included (torchtune's default, LLaMA-Factory's ``pure_bf16``, and what the
Hugging Face Trainer does with a model loaded in bf16). That halves what the weights, their
gradients and AdamW's moments hold, but an update smaller than half a bf16 step of its weight
(bf16 keeps 8 significant bits: 0.2–0.4 % of the weight) rounds away, so long runs at small
learning rates lose updates. torchao's optimizers offer the known mitigation, stochastic rounding
of the fp32 update into the bf16 weight (``torchao.optim._AdamW(params,
bf16_stochastic_round=True)``, and the same flag on its ``AdamW8bit``/``AdamW4bit``).

What is refused (:meth:`PureSixteenBit.problems`, every verb): ``fp16``, pure fp16 training,
which has no loss scaling (torch's GradScaler refuses fp16 gradients, so small ones underflow;
a frozen fp16 base is ``auto`` over an fp16 checkpoint), and ``bf16`` under ``--precision
fp16`` (fp16 autocast over bf16 trained weights: memfit scales fp16 losses only over fp32 master
weights).

Its cost in time: none is charged. The matmuls run in 16 bits either way (autocast's copies of
fp32 weights, or the weights themselves); pure 16-bit saves autocast's casts and half of the
optimizer's memory traffic, which the cost model leaves out (it errs against the lever).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from memfit.knobs import AnyJob as Job
from memfit.knobs import knob
from memfit.levers.base import Chosen, Lever, Room
from memfit.levers.cure import Fix, Patient
from memfit.units import format_bytes

WEIGHTS_DTYPES = ("auto", "fp32", "bf16", "fp16")
SIXTEEN_BIT = ("bf16", "fp16")
# torch's names, as from_pretrained(dtype=...) and TRL's model_init_kwargs take them
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# the mitigation a well-kept library offers for pure bf16 (torchao/optim/README.md)
STOCHASTIC_ROUNDING = (
    "torchao's optimizers round the fp32 update into the bf16 weights stochastically "
    "(torchao.optim._AdamW(params, bf16_stochastic_round=True), or AdamW8bit with the same flag), "
    "so small updates add up on average instead of vanishing"
)


@dataclass(kw_only=True)
class WeightsKnobs:
    weights_dtype: str | None = knob(
        "auto | fp32 | bf16 | fp16: the dtype frozen weights are held in (auto: the "
        "checkpoint's); bf16 also trains the trainable weights in it (pure 16-bit); fp16 is "
        "refused (pure fp16 has no loss scaling).",
        choices=WEIGHTS_DTYPES,
        shown_default="auto",
    )
    """The weights' dtype: frozen weights held in it (``auto``: the checkpoint's); with ``bf16``
    the trainable weights, their gradients and optimizer state too (``fp16`` is refused)."""


def pure(values: Mapping[str, Any]) -> bool:
    """Whether ``values`` train the trainable weights in 16 bits (pure 16-bit training)."""
    return values.get("weights_dtype") in SIXTEEN_BIT


class PureSixteenBit(Lever):
    name: ClassVar[str] = "pure-16bit"
    knobs: ClassVar[type] = WeightsKnobs
    allow: ClassVar[bool] = True
    # after the optimizer swap (state quantized; the weights keep full precision), before
    # truncation and LoRA (which change the data or what can be learned)
    tier: ClassVar[int] = 2
    summary: ClassVar[str] = "pure bf16 training (weights, gradients and optimizer state in bf16)"
    # the job's own dtype is what the job is (a 16-bit base): a plan keeps it as given
    pins: ClassVar[tuple[str, ...]] = ("weights_dtype",)
    # the model's dtype is set where it is loaded: from_pretrained(dtype=...), or TRL's
    # model_init_kwargs when its trainer loads the model from a name
    in_training_arguments: ClassVar[bool] = False
    argument_fields: ClassVar[tuple[str, ...]] = ("model_init_kwargs",)
    outside_note: ClassVar[str] = (
        "the weights' dtype is from_pretrained's dtype=torch.bfloat16 (TRL's "
        "model_init_kwargs={'dtype': 'bfloat16'} when its trainer loads the model by name), which "
        "no TrainingArguments field sets"
    )

    def problems(self, job: Job) -> list[str]:
        # memfit train scales fp16 losses only over fp32 master weights (torch's GradScaler
        # refuses fp16 gradients; over 16-bit weights the run has no scaler), so 16-bit trained
        # weights under fp16 autocast, or in fp16 at all, would train with no loss scaling
        trained = (
            "the trainable weights (LoRA adapters too)"
            if job.lora_rank
            else ("the trainable weights")
        )
        if job.weights_dtype == "fp16":
            return [
                f"--weights-dtype fp16: pure fp16 training ({trained}, their gradients and "
                "optimizer state in fp16) has no loss scaling (torch's GradScaler refuses fp16 "
                "gradients), so small gradients underflow to zero; use --weights-dtype bf16 "
                "(pure bf16 needs no scaling), or --weights-dtype auto with --precision fp16 "
                "(fp32 master weights, scaled). A frozen fp16 base is --weights-dtype auto over "
                "an fp16 checkpoint"
            ]
        if job.weights_dtype == "bf16" and job.precision == "fp16":
            return [
                f"--weights-dtype bf16 with --precision fp16: {trained} would be bf16 under fp16 "
                "autocast with no loss scaling (memfit scales fp16 losses only over fp32 master "
                "weights), so small fp16 gradients underflow to zero; use --precision bf16 with "
                "--weights-dtype bf16, or --weights-dtype auto (fp32 master weights) with "
                "--precision fp16"
            ]
        return []

    def plan_options(self, room: Room) -> tuple[dict[str, Any], ...]:
        # the job's own dtype is kept; else the checkpoint's (auto), and pure bf16 beside it when
        # allowed on a GPU that has bf16, unless the job pins fp16 autocast (bf16 weights under
        # it would train without loss scaling: :meth:`problems`)
        own = room.job.weights_dtype
        if own is not None:
            return ({"weights_dtype": own},)
        if (
            self.name in room.allowed
            and room.mixed_precision == "bf16"
            and room.job.precision != "fp16"
        ):
            return ({"weights_dtype": "auto"}, {"weights_dtype": "bf16"})
        return ({"weights_dtype": "auto"},)

    def frugal(self, options: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
        # 16-bit weights, gradients and state always hold less than fp32 master weights
        return sorted(options, key=lambda o: not pure(o))

    def as_given(self, values: Mapping[str, Any]) -> dict[str, Any]:
        # the checkpoint's dtype is the default: no flag
        if values.get("weights_dtype") in (None, "auto"):
            return {"weights_dtype": None} if "weights_dtype" in values else {}
        return super().as_given(values)

    def hint(self, values: Mapping[str, Any], job: Job) -> str:
        return (
            f"pure {values.get('weights_dtype') or 'bf16'}: weights, gradients and optimizer state "
            "in 16 bits; updates below bf16's resolution round away"
        )

    def describe(self, values: Mapping[str, Any]) -> str | None:
        return f"pure {values['weights_dtype']}" if pure(values) else None

    def plan_lines(self, chosen: Chosen) -> list[str]:
        values, base = chosen.values, chosen.base
        if not pure(values):
            return []
        dtype = values["weights_dtype"]
        lora = bool(values.get("lora_rank"))
        what = "the frozen base and the LoRA adapters" if lora else "every weight"
        if values.get("weights_dtype") == base.get("weights_dtype"):
            return [
                f"Weights in {dtype} (as given): {what} in {dtype}, their gradients and optimizer "
                f"state too (pure 16-bit). Updates smaller than {dtype}'s resolution round away; "
                f"{STOCHASTIC_ROUNDING}."
            ]
        fp32 = {**values, "weights_dtype": base.get("weights_dtype") or "auto"}
        return [
            f"Pure {dtype} training (allowed): {what} in {dtype} with their gradients and "
            f"optimizer state, no fp32 master copy: {format_bytes(chosen.peak_bytes)} at "
            f"micro-batch {chosen.micro}, where fp32 master weights would need "
            f"{format_bytes(chosen.peak(fp32))}.",
            f"Quality: {dtype} keeps 8 significant bits, so an update smaller than 0.2–0.4 % of "
            "its weight rounds away: long runs at small learning rates lose updates (compare on "
            f"your eval set). Mitigation: {STOCHASTIC_ROUNDING}. Time: no slower (the matmuls run "
            f"in {dtype} either way; the cost model charges nothing).",
            f"Load the model in {dtype}: from_pretrained(..., dtype=torch.{TORCH_NAMES[dtype]}) "
            f"(TRL: SFTConfig(model_init_kwargs={{'dtype': '{TORCH_NAMES[dtype]}'}})).",
        ]

    def cure(self, patient: Patient) -> Fix | None:
        # frozen weights held in fp32 go to 16 bits (no quality cost); full fine-tuning in fp32
        # master weights goes to pure bf16 (its quality cost said), on a device with bf16
        job = patient.job
        if job is None or job.weights_dtype in SIXTEEN_BIT:
            return None
        own = job.weights_dtype or "auto"
        checkpoint = patient.checkpoint_dtype
        if job.lora_rank and own == "fp32" and checkpoint in SIXTEEN_BIT:
            settings: dict[str, Any] = {"weights_dtype": "auto"}
            return Fix(
                change=f"hold the frozen base in the checkpoint's {checkpoint}, as "
                "from_pretrained loads it (--weights-dtype auto; the adapters stay fp32)",
                saves_bytes=patient.price(settings),
                cost=f"none: the checkpoint is {checkpoint}, the frozen weights lose nothing",
                lever=self.name,
                settings=settings,
            )
        if job.lora_rank and own == "auto" and checkpoint != "fp32":
            # a 16-bit checkpoint is held in 16 bits already, and an unknown one may be (auto
            # holds it as stored): the adapters alone are small
            return None
        # bf16 weights on a GPU known to have bf16 only (memfit trains pure fp16 nowhere)
        if patient.on_cpu:
            patient.notes.append(
                "not proposed: pure-16bit — the job runs on the CPU; the doctor proposes bf16 "
                "weights for a GPU known to have bf16 (--weights-dtype bf16 runs on the CPU too)"
            )
            return None
        if patient.gpu_mixed_precision != "bf16":
            which = (
                f"the {patient.gpu_name} has no bf16"
                if patient.gpu_mixed_precision == "fp16"
                else "the GPU is not known, nor whether it has bf16"
            )
            patient.notes.append(
                f"not proposed: pure-16bit — {which}, and pure fp16 training has no loss scaling"
            )
            return None
        settings = {"weights_dtype": "bf16"}
        if job.precision == "fp16":
            settings["precision"] = "bf16"
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())
        if job.lora_rank:
            now = "it is in fp32 now" if own == "fp32" else "the checkpoint is fp32"
            return Fix(
                change=f"hold the frozen base in bf16 ({flags}): {now}; the LoRA "
                "adapters train in bf16 too",
                saves_bytes=patient.price(settings),
                cost="none for the frozen weights (every bf16 checkpoint is one); the adapters' "
                "updates below bf16's resolution round away (torchao's optimizers offer "
                "stochastic rounding)",
                lever=self.name,
                settings=settings,
            )
        return Fix(
            change=f"pure bf16 training ({flags}): weights, gradients and optimizer state in "
            "bf16, no fp32 master copy (memfit plan --allow pure-16bit plans it)",
            saves_bytes=patient.price(settings),
            cost="updates smaller than bf16's resolution (0.2–0.4 % of a weight) round away: "
            f"a quality risk on long runs; {STOCHASTIC_ROUNDING}",
            lever=self.name,
            settings=settings,
        )

    def estimate_lines(self, details: Mapping[str, Any]) -> list[str]:
        info = details.get("weights")
        if not isinstance(info, Mapping):
            return []
        frozen, trainable = info.get("frozen"), info.get("trainable")
        checkpoint = info.get("checkpoint")
        held = f"frozen in {frozen}, " if frozen else ""
        how = (
            "pure 16-bit: no fp32 master copy"
            if trainable in SIXTEEN_BIT
            else "fp32 master weights"
        )
        return [f"weights: {held}trainable in {trainable} ({how}); the checkpoint's: {checkpoint}"]

    def trainer_args(self, values: Mapping[str, Any]) -> dict[str, Any]:
        # only TRL's configs take it (their trainer loads a model given by name); apply_plan
        # merges it into what the arguments hold and says where else it goes
        dtype = values.get("weights_dtype")
        if dtype not in TORCH_NAMES:
            return {}
        return {"model_init_kwargs": {"dtype": TORCH_NAMES[dtype]}}


LEVER = PureSixteenBit()
