"""The optimizer-offload lever: what it combines with, what a plan tries, its cost in time, its
cure and how it is run outside memfit (an optimizer object or a DeepSpeed config)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memfit.devices.catalog import find_gpu
from memfit.job import Job
from memfit.levers.base import Room
from memfit.levers.cure import Patient
from memfit.levers.optimizer_offload import HOST_MEMORY_BYTES_PER_SECOND, LEVER


def _job(**knobs: object) -> Job:
    return Job(**({"model": "gpt2", "task": "causal-lm"} | knobs))


@pytest.mark.parametrize(
    ("knobs", "says"),
    [
        ({"optimizer": "adamw-8bit"}, "--optimizer adamw-8bit is bitsandbytes' 8-bit state"),
        ({"optimizer": "paged-adamw-32bit"}, "--optimizer paged-adamw-32bit pages its own state"),
        ({"optimizer": "adafactor"}, "--optimizer adafactor is not priced in host memory"),
        ({"sharding": "fsdp"}, "not with --sharding fsdp"),
        (
            {"sharding": "zero2", "optimizer": "sgd"},
            "steps DeepSpeedCPUAdam (AdamW), not --optimizer sgd",
        ),
    ],
)
def test_what_it_does_not_combine_with_is_one_line_naming_the_flag(knobs: dict, says: str) -> None:
    problems = LEVER.problems(_job(optimizer_offload="cpu", **knobs))
    assert len(problems) == 1 and problems[0].startswith("--optimizer-offload cpu: ")
    assert says in problems[0], problems
    assert LEVER.problems(_job(**knobs)) == []  # only when offloading


def test_adamw_and_sgd_offload_with_one_process_ddp_or_zero() -> None:
    assert LEVER.problems(_job(optimizer_offload="cpu")) == []
    assert LEVER.problems(_job(optimizer_offload="cpu", optimizer="sgd")) == []
    assert LEVER.problems(_job(optimizer_offload="cpu", sharding="zero3")) == []


def test_a_plan_tries_it_where_it_runs_and_keeps_a_given_value() -> None:
    assert LEVER.plan_options(Room(job=_job())) == (
        {"optimizer_offload": "none"},
        {"optimizer_offload": "cpu"},
    )
    assert LEVER.plan_options(Room(job=_job(optimizer="adamw-8bit"))) == ({},)
    assert LEVER.plan_options(Room(job=_job(optimizer_offload="none"))) == (
        {"optimizer_offload": "none"},
    )
    options = LEVER.plan_options(Room(job=_job()))
    assert LEVER.frugal(options) == [{"optimizer_offload": "cpu"}, {"optimizer_offload": "none"}]
    # its time cost is not in the memory: only when nothing else of tier 0 fits
    assert LEVER.last_resort({"optimizer_offload": "cpu"}, {"optimizer_offload": "none"})
    assert not LEVER.last_resort({"optimizer_offload": "cpu"}, {"optimizer_offload": "cpu"})
    assert LEVER.as_given({"optimizer_offload": "none"}) == {"optimizer_offload": None}


def test_the_step_costs_the_cpus_adamw_and_the_host_link() -> None:
    shape = SimpleNamespace(trainable=lambda rank: 10**9 if rank is None else 10**7)
    gpu = SimpleNamespace(host_link_gbps=25.0)
    full = LEVER.step_seconds({"optimizer_offload": "cpu", "optimizer": "adamw"}, shape, gpu)
    # fp32 AdamW: 7 values of 4 bytes streamed by the CPU; one 4-byte copy each way over the link
    cpu = 10**9 * 28 / HOST_MEMORY_BYTES_PER_SECOND
    link = 2 * 10**9 * 4 / 25e9
    assert full == pytest.approx(cpu + link)
    lora = LEVER.step_seconds({"optimizer_offload": "cpu", "lora_rank": 8}, shape, gpu)
    assert lora == pytest.approx(full / 100)
    # ZeRO-Offload: each rank its partition, the 16-bit module's copies over the link
    zero = {"optimizer_offload": "cpu", "sharding": "zero2", "world_size": 4, "precision": "bf16"}
    part = 10**9 // 4
    expected = part * 28 / HOST_MEMORY_BYTES_PER_SECOND + 2 * part * 2 / 25e9
    assert LEVER.step_seconds(zero, shape, gpu) == pytest.approx(expected)
    # the catalog's card: its own link (an H100's PCIe 5.0 x16)
    h100 = find_gpu("H100")
    on_h100 = LEVER.step_seconds({"optimizer_offload": "cpu"}, shape, h100)
    assert on_h100 == pytest.approx(cpu + 2 * 10**9 * 4 / (h100.host_link_gbps * 1e9))
    # no card: no link to charge, the CPU's update only
    assert LEVER.step_seconds({"optimizer_offload": "cpu"}, shape, None) == pytest.approx(cpu)
    assert LEVER.step_seconds({"optimizer_offload": "none"}, shape, gpu) == 0.0


def test_it_is_set_outside_training_arguments_and_says_where() -> None:
    assert LEVER.in_training_arguments is False
    assert LEVER.trainer_args({"optimizer_offload": "cpu"}) == {}
    assert "CPUOffloadOptimizer" in LEVER.outside_note
    assert "offload_optimizer" in LEVER.outside_note


def test_the_cure_offloads_where_it_combines() -> None:
    notes: list[str] = []
    patient = Patient(job=_job(), price=lambda settings: 123, notes=notes)
    fix = LEVER.cure(patient)
    assert fix is not None and fix.settings == {"optimizer_offload": "cpu"}
    assert "--optimizer-offload cpu" in fix.change and fix.saves_bytes == 123
    eight_bit = Patient(job=_job(optimizer="adamw-8bit"), price=lambda s: 1, notes=notes)
    assert LEVER.cure(eight_bit) is None
    assert notes and notes[0].startswith("not proposed: optimizer-offload")
    cpu = Patient(job=_job(), price=lambda s: 1, notes=[], on_cpu=True)
    assert LEVER.cure(cpu) is None  # host and device are the same memory


def test_the_estimate_says_what_is_in_host_memory() -> None:
    details = {
        "sharding": "none",
        "host": {
            "parts": {"master_weights": 4 << 20, "gradients": 4 << 20, "optimizer_state": 8 << 20}
        },
    }
    [line] = LEVER.estimate_lines(details)
    assert line.startswith("optimizer offload (torchao's CPUOffloadOptimizer): 16.00 MiB in host")
    assert "the GPU keeps the gradients" in line
    assert LEVER.estimate_lines({"host": {"parts": {"activations": 10}}}) == []
    assert LEVER.estimate_lines({}) == []
