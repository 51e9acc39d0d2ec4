"""The CPU measurement method itself: a known allocation, repeatability, error surfacing."""

from __future__ import annotations

import os
import sys

import pytest

from memfit.measure import (
    MALLOC_ENV,
    CpuMeasurement,
    CpuSample,
    MeasurementError,
    child_environment,
    measure_cpu_step,
    run_measurement,
)

MiB = 2**20

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.exists("/proc/self/clear_refs"),
    reason="the measurement reads /proc/<pid>/clear_refs (Linux)",
)


def test_probe_measures_a_known_allocation_within_one_percent() -> None:
    # 100 MiB allocated and written inside the window, freed before "done"
    m = run_measurement({"kind": "probe", "bytes": 100 * MiB}, repeats=3, threads=1)
    assert len(m.samples) == 3
    for sample in m.samples:
        assert abs(sample - 100 * MiB) <= 0.01 * 100 * MiB, [s / MiB for s in m.samples]
    assert abs(m.above_baseline_bytes - 100 * MiB) <= 0.01 * 100 * MiB
    # the tensor was freed: nothing of it stays resident after the step
    assert m.max_residual_bytes < 1 * MiB
    assert m.baseline_rss_bytes > 0
    assert m.threads == 1


def test_probe_scales_with_size() -> None:
    small = run_measurement({"kind": "probe", "bytes": 20 * MiB}, repeats=2, threads=1)
    assert abs(small.above_baseline_bytes - 20 * MiB) <= 0.02 * 20 * MiB


def test_failure_in_the_step_surfaces_with_the_child_stderr() -> None:
    with pytest.raises(MeasurementError) as info:
        run_measurement({"kind": "probe", "bytes": 1, "fail": True}, repeats=2, threads=1)
    message = str(info.value)
    assert "exited with code 1" in message
    assert "RuntimeError: probe failure requested" in message


def test_unknown_model_surfaces_as_measurement_error() -> None:
    with pytest.raises(MeasurementError, match="no-such-model-xyz"):
        measure_cpu_step(
            "no-such-model-xyz", task="classification", batch_size=1, seq_len=8, repeats=1
        )


def test_repeats_must_be_positive() -> None:
    with pytest.raises(ValueError, match="repeats"):
        run_measurement({"kind": "probe", "bytes": 1}, repeats=0)


def test_child_environment_fixes_malloc_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libjemalloc.so")
    env = child_environment(3)
    for key, value in MALLOC_ENV.items():
        assert env[key] == value
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) <= 65536
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert "LD_PRELOAD" not in env


def test_measurement_summary_properties() -> None:
    details = [CpuSample(1000, 1000 + n, 1000, 0.1) for n in (100, 101, 99)]
    m = CpuMeasurement(
        above_baseline_bytes=100, samples=[100, 101, 99], baseline_rss_bytes=1000, details=details
    )
    assert m.spread == pytest.approx(0.02)
    assert m.max_residual_bytes == 0
    assert m.step_seconds == pytest.approx(0.1)


@pytest.mark.slow
def test_real_step_repeats_agree_within_one_percent(tmp_path: object) -> None:
    from pathlib import Path

    from transformers import BertConfig

    folder = Path(str(tmp_path)) / "bert-tiny"
    BertConfig(
        vocab_size=2000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        max_position_embeddings=256,
    ).save_pretrained(folder)
    m = measure_cpu_step(str(folder), task="classification", batch_size=16, seq_len=128, repeats=3)
    samples_mib = [s / MiB for s in m.samples]
    # big enough that the kernel's approximate RSS counters (a few hundred KiB) do not matter
    assert m.above_baseline_bytes > 20 * MiB, samples_mib
    assert m.spread <= 0.01, samples_mib
    assert m.max_residual_bytes < 0.05 * m.above_baseline_bytes
