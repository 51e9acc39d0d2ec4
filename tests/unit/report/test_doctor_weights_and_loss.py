"""memfit doctor's cures for the weights' dtype and the causal-LM loss: a fused linear
cross-entropy for a causal LM on the standard loss (no quality cost), frozen weights held in 16
bits, pure bf16 for full fine-tuning with its quality cost said. Priced by a stand-in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memfit.levers import BY_NAME
from memfit.levers.cure import Patient
from memfit.report.doctor import failed_job
from memfit.report.doctor_cures import checkpoint_dtype, cures, patient
from memfit.report.oom_message import parse_oom

CE = BY_NAME["cross-entropy"]
PURE = BY_NAME["pure-16bit"]
T4_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
    "capacity of 14.56 GiB of which 8.00 MiB is free. Of the allocated memory 14.20 GiB is "
    "allocated by PyTorch, and 40.00 MiB is reserved by PyTorch but unallocated."
)


class Prices:
    """Every change saves 1 GiB; records what was priced."""

    def __init__(self) -> None:
        self.priced: list[dict[str, Any]] = []

    def __call__(self, settings: Mapping[str, Any]) -> int:
        self.priced.append(dict(settings))
        return 1 << 30


def _patient(job: Any, **known: Any) -> Patient:
    return Patient(job=job, price=Prices(), notes=[], **known)


def test_fused_linear_for_a_causal_lm_on_the_standard_loss() -> None:
    job = failed_job(model="m", task="causal-lm", batch_size=8, seq_len=1024)
    fix = CE.cure(_patient(job))
    assert fix is not None and fix.settings == {"cross_entropy": "fused-linear"}
    assert "--cross-entropy fused-linear" in fix.change and "use_liger_kernel" in fix.change
    assert fix.cost.startswith("none") and fix.saves_bytes == 1 << 30
    fused = failed_job(model="m", task="causal-lm", batch_size=8, seq_len=1024,
                       cross_entropy="fused-linear")  # fmt: skip
    assert CE.cure(_patient(fused)) is None
    classifier = failed_job(model="m", task="classification", batch_size=8, seq_len=128)
    assert CE.cure(_patient(classifier)) is None


def test_the_doctor_offers_it_in_the_plans_order() -> None:
    job = failed_job(model="m", task="causal-lm", batch_size=8, seq_len=1024, precision="fp16")
    report = parse_oom(T4_OOM)
    assert report is not None
    levers = [f.lever for f in cures(job, Prices(), report, [])]
    assert "cross-entropy" in levers
    assert levers.index("gradient_checkpointing") < levers.index("cross-entropy")
    assert levers.index("cross-entropy") < levers.index("optimizer")


def test_frozen_fp32_weights_go_to_the_checkpoints_16_bits() -> None:
    job = failed_job(model="m", task="causal-lm", batch_size=2, seq_len=512, lora_rank=8,
                     weights_dtype="fp32", precision="bf16")  # fmt: skip
    fix = PURE.cure(_patient(job, checkpoint_dtype="bf16", gpu_mixed_precision="bf16"))
    assert fix is not None and fix.settings == {"weights_dtype": "auto"}
    assert fix.cost.startswith("none") and "--weights-dtype auto" in fix.change


def test_an_fp32_checkpoint_under_lora_goes_to_bf16_with_the_adapters_cost_said() -> None:
    job = failed_job(model="m", task="causal-lm", batch_size=2, seq_len=512, lora_rank=8,
                     precision="bf16")  # fmt: skip
    fix = PURE.cure(_patient(job, checkpoint_dtype="fp32", gpu_mixed_precision="bf16"))
    assert fix is not None and fix.settings == {"weights_dtype": "bf16"}
    assert "adapters" in fix.cost and "round away" in fix.cost
    # a bf16 checkpoint is held in bf16 already (auto): nothing to propose
    assert PURE.cure(_patient(job, checkpoint_dtype="bf16", gpu_mixed_precision="bf16")) is None


def test_pure_bf16_for_full_fine_tuning_on_a_bf16_gpu_only() -> None:
    job = failed_job(model="m", task="classification", batch_size=8, seq_len=128,
                     precision="fp16")  # fmt: skip
    fix = PURE.cure(_patient(job, gpu_mixed_precision="bf16", gpu_name="A100"))
    assert fix is not None
    # bf16 weights under bf16 autocast: the fp16 loss scaler goes with the fp16 precision
    assert fix.settings == {"weights_dtype": "bf16", "precision": "bf16"}
    assert "bf16_stochastic_round=True" in fix.cost
    # a T4 has no bf16: said, not proposed
    notes: list[str] = []
    t4 = Patient(job=job, price=Prices(), notes=notes, gpu_mixed_precision="fp16", gpu_name="T4")
    assert PURE.cure(t4) is None and notes[0].startswith("not proposed: pure-16bit")
    pure = failed_job(model="m", task="classification", batch_size=8, seq_len=128,
                      weights_dtype="bf16")  # fmt: skip
    assert PURE.cure(_patient(pure, gpu_mixed_precision="bf16")) is None


def test_the_doctor_reads_the_checkpoints_dtype() -> None:
    assert checkpoint_dtype("gpt2") == "fp32"  # GPT-2's config names none
    assert checkpoint_dtype("meta-llama/Llama-3.1-8B") == "bf16"
    assert checkpoint_dtype("no/such-model-anywhere") is None
    report = parse_oom(T4_OOM)
    assert report is not None
    job = failed_job(model="meta-llama/Llama-3.1-8B", task="causal-lm", batch_size=1, seq_len=64)
    assert patient(job, Prices(), report, []).checkpoint_dtype == "bf16"


def test_an_unknown_checkpoint_under_lora_is_not_said_to_be_fp32() -> None:
    # auto holds the base as the checkpoint stores it: unknown here, maybe 16 bits already
    job = failed_job(model="m", task="causal-lm", batch_size=2, seq_len=512, lora_rank=8,
                     precision="bf16")  # fmt: skip
    notes: list[str] = []
    unknown = Patient(job=job, price=Prices(), notes=notes, gpu_mixed_precision="bf16")
    assert PURE.cure(unknown) is None and notes == []
    # what is known is said: an fp32 checkpoint, or a base pinned to fp32
    fix = PURE.cure(_patient(job, checkpoint_dtype="fp32", gpu_mixed_precision="bf16"))
    assert fix is not None and "the checkpoint is fp32" in fix.change
    pinned = failed_job(model="m", task="causal-lm", batch_size=2, seq_len=512, lora_rank=8,
                        weights_dtype="fp32", precision="bf16")  # fmt: skip
    fix = PURE.cure(_patient(pinned, gpu_mixed_precision="bf16"))
    assert fix is not None and "it is in fp32 now" in fix.change


def test_pure_bf16_only_on_a_gpu_known_to_have_bf16() -> None:
    job = failed_job(model="m", task="classification", batch_size=8, seq_len=128)
    notes: list[str] = []
    # the capacity named no catalog GPU: whether it has bf16 is not known
    unknown = Patient(job=job, price=Prices(), notes=notes)
    assert PURE.cure(unknown) is None
    assert notes[-1].startswith("not proposed: pure-16bit — the GPU is not known")
    cpu = Patient(job=job, price=Prices(), notes=notes, on_cpu=True)
    assert PURE.cure(cpu) is None
    assert notes[-1].startswith("not proposed: pure-16bit — the job runs on the CPU")
    # the same for a LoRA base over an fp32 checkpoint
    lora = failed_job(model="m", task="causal-lm", batch_size=2, seq_len=512, lora_rank=8)
    unknown_lora = Patient(job=lora, price=Prices(), notes=notes, checkpoint_dtype="fp32")
    assert PURE.cure(unknown_lora) is None
