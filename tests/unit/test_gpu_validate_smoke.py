"""``bench/gpu_validate.py`` must not rot: its CPU smoke run, its case list, its JSON schema.

The GPU validation itself runs only on a machine with CUDA (``@pytest.mark.gpu``, ``--quick``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_validate.py"


@pytest.fixture(scope="module")
def gv() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_validate"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def _only_json(folder: Path) -> dict[str, Any]:
    files = sorted(folder.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text(encoding="utf-8"))


def test_default_matrix_is_well_formed(gv: ModuleType) -> None:
    cases = gv.build_cases()
    assert 40 <= len(cases) <= 60
    assert len({c.id for c in cases}) == len(cases)
    assert gv.check_case_lists() == []
    # round-robin order: the first cases already cover every model, both precisions, eager and eval
    head = cases[:20]
    assert {c.model for c in head} == {m.name for m in gv.MATRIX_MODELS}
    assert {c.precision for c in head} == {"fp32", "bf16"}
    assert any(c.attn_implementation == "eager" for c in head)
    assert any(c.mode == "eval" for c in head)
    assert any(c.gradient_checkpointing for c in head)


def test_error_pct_and_summary(gv: ModuleType) -> None:
    assert gv.error_pct(110, 100) == 10.0
    assert gv.error_pct(90, 100) == -10.0
    assert gv.error_pct(None, 100) is None
    assert gv.error_pct(100, 0) is None
    rows = [
        {"id": "a", "status": "ok", "estimate_error": None, "measured": {"context_bytes": 5},
         "error_pct": {"total": 2.0, "reserved": -4.0, "allocated": None}},
        {"id": "b", "status": "ok", "estimate_error": None, "measured": {"context_bytes": 7},
         "error_pct": {"total": -6.0, "reserved": 1.0, "allocated": None}},
        {"id": "c", "status": "oom", "estimate_error": None, "oom_predicted": True, "measured": {"context_bytes": None},
         "error_pct": {"total": None, "reserved": None, "allocated": None}},
    ]  # fmt: skip
    summary = gv.summarize(rows, planned=4)
    assert summary["total_error_pct"]["median_abs"] == 4.0
    assert summary["total_error_pct"]["max_abs"] == 6.0
    assert summary["total_error_pct"]["worst"] == "b"
    assert summary["total_error_pct"]["underestimates"] == 1
    assert summary["allocated_error_pct"]["n"] == 0
    assert (summary["oom"], summary["oom_predicted"], summary["cases_run"]) == (1, 1, 3)


def test_plan_settings_reads_nested_plans(gv: ModuleType) -> None:
    settings, assumed = gv.plan_settings(
        {"config": {"micro_batch_size": 8, "precision": "bf16"}}, 64
    )
    assert settings["batch_size"] == 8
    assert settings["accumulation_steps"] == 8  # inferred from the effective batch
    assert settings["precision"] == "bf16"
    assert "accumulation_steps" in assumed and "precision" not in assumed
    with pytest.raises(ValueError):
        gv.plan_settings({"nothing": 1}, 64)


@pytest.mark.slow
def test_smoke_runs_end_to_end(gv: ModuleType, tmp_path: Path) -> None:
    done = _run("--smoke", "--out", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "smoke ok" in done.stdout
    doc = _only_json(tmp_path)
    assert gv.validate_run(doc) == []
    assert set(doc) == {"schema_version", "kind", "header", "rows", "plan_checks", "summary"}
    assert doc["header"]["device"] == "cpu" and doc["header"]["smoke"] is True
    assert {"timestamp", "software", "git_commit", "command", "reproduce", "gpu"} <= set(
        doc["header"]
    )
    # the QLoRA case runs where bitsandbytes is installed (it runs on the CPU)
    qlora = importlib.util.find_spec("bitsandbytes") is not None
    assert len(doc["rows"]) == 2 + qlora
    assert any("nf4" in row["id"] for row in doc["rows"]) == qlora
    for row in doc["rows"]:
        assert row["status"] == "ok"
        assert {
            "index",
            "id",
            "case",
            "measured",
            "estimated",
            "estimate_error",
            "error_pct",
        } <= set(row)
        assert {"total", "reserved", "allocated"} == set(row["error_pct"])
        assert row["estimated"]["total_bytes"] > 0
        assert {
            "allocated_peak_bytes",
            "reserved_peak_bytes",
            "context_bytes",
            "total_bytes",
        } <= set(row["measured"])
    assert len(doc["plan_checks"]) == 1 and doc["plan_checks"][0]["status"] == "ok"


def test_new_knob_cases_are_well_formed(gv: ModuleType) -> None:
    cases = list(gv.NEW_KNOB_CASES)
    assert 14 <= len(cases) <= 18
    assert len({c.id for c in cases}) == len(cases)
    # memfit's own checks accept every case (as memfit estimate would), every new knob's values run
    assert [p for c in cases for p in gv.case_problems(c)] == []
    for knob, values in gv.NEW_KNOB_VALUES.items():
        assert set(values) <= {getattr(c, knob) for c in cases}, knob
    # round-robin: the first six cases are one of each kind of lever
    assert {c for c in cases[: len(gv.NEW_KNOB_GROUPS)]} == {
        group[0] for _, group in gv.NEW_KNOB_GROUPS
    }
    # the ids say the new knobs (a row is readable without its case)
    ids = " ".join(c.id for c in cases)
    for word in ("weights-bf16", "fused-linear", "act-offload", "opt-offload-cpu", "int8"):
        assert word in ids
    # the case's knobs reach the estimate and the child's step spec alike
    fused = next(c for c in cases if c.cross_entropy == "fused-linear")
    spec = gv._spec_for({**fused.knobs(), "device": "cuda"})
    assert (spec.cross_entropy, spec.lora_rank, spec.precision) == ("fused-linear", 16, "bf16")
    assert fused.estimate_kwargs()["cross_entropy"] == "fused-linear"
    offloaded = next(c for c in cases if c.activation_offloading and c.optimizer_offload == "none")
    assert gv._spec_for({**offloaded.knobs(), "device": "cuda"}).activation_offloading is True


def test_plans_only_checks_are_well_formed(gv: ModuleType) -> None:
    assert len(gv.PLANS_ONLY) == 3
    assert gv.check_case_lists() == []
    models = [check[0] for check in gv.PLANS_ONLY]
    assert len(set(models)) == 3
    # one of them a LoRA causal LM
    assert any(check[4].get("lora_rank") for check in gv.PLANS_ONLY)


def test_plan_settings_reads_the_levers(gv: ModuleType) -> None:
    plan = {
        "fits": True,
        "plan": {
            "micro_batch_size": 8,
            "gradient_accumulation_steps": 4,
            "precision": "bf16",
            "gradient_checkpointing": True,
            "lora_rank": None,
            "cross_entropy": "fused-linear",
            "optimizer_offload": "cpu",
            "max_seq_len": 256,
        },
    }
    settings, _ = gv.plan_settings(plan, 32)
    assert settings["cross_entropy"] == "fused-linear"
    assert settings["optimizer_offload"] == "cpu"
    assert "lora_rank" not in settings  # None: not used, the Case's default
    changed = gv.plan_changes(settings, 32, {"cross_entropy": "fused-linear"})
    assert changed == ["micro-batch 8 of 32", "gradient checkpointing", "optimizer_offload cpu"]


def test_library_problem(gv: ModuleType) -> None:
    assert gv.library_problem(ImportError("No module named 'liger_kernel'")).startswith(
        "import failed"
    )
    assert "pip install" in gv.library_problem(RuntimeError("needs it: pip install 'memfit[trl]'"))
    assert gv.library_problem(ValueError("a shape")) is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--new-knobs", "--plans-only"])
def test_smoke_of_the_new_modes(gv: ModuleType, tmp_path: Path, mode: str) -> None:
    done = _run("--smoke", mode, "--out", str(tmp_path), "--time-budget", "300", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "smoke ok" in done.stdout
    doc = _only_json(tmp_path)
    assert gv.validate_run(doc) == []
    assert doc["header"]["not_measurable"].startswith("T4-class")
    assert "liger-kernel" in doc["header"]["packages"]
    if mode == "--plans-only":
        assert doc["rows"] == []
        checks = doc["plan_checks"]
        assert len(checks) == 3 and all(c["status"] == "ok" for c in checks)
        # each tiny budget lies between micro-batch 1 and the whole batch: each plan changes it
        assert all(c["plan_changed"] for c in checks)
        assert any(c["plan"]["accumulation_steps"] > 1 for c in checks)
        assert any(c["plan"].get("cross_entropy") == "fused-linear" for c in checks)
        # each plan's child was started ahead and got its plan's knobs with its go
        assert all("waited_s" in c["measured"]["timings"] for c in checks)
        return
    rows = doc["rows"]
    assert rows and all(r["status"] == "ok" for r in rows)
    cases = [r["case"] for r in rows]
    assert any(c["weights_dtype"] == "bf16" for c in cases)
    assert any(c["cross_entropy"] == "fused-linear" for c in cases)
    assert any(c["activation_offloading"] for c in cases)
    assert any(c["optimizer_offload"] == "cpu" for c in cases)
    if importlib.util.find_spec("bitsandbytes") is not None:
        assert any(
            c["quantization"] == "nf4" and c["optimizer"] == "paged-adamw-8bit" for c in cases
        )
        # a quantized base is built after the go (on the device): its child only imported ahead
        int8 = next(r for r in rows if r["case"]["quantization"] == "int8")
        assert int8["measured"]["timings"]["cpu_build_s"] < 30
    # no CUDA: no segments on either side (a CPU estimate replays no caching allocator)
    assert all(r["measured"]["segments"] is None for r in rows)
    assert all(r["estimated"]["segments"] is None for r in rows)
    # what ran each lever is in the row (the CPU: memfit's fused loss, save_on_cpu)
    fused = next(r for r in rows if r["case"]["cross_entropy"] == "fused-linear")
    assert fused["measured"]["implementations"]["cross_entropy"].startswith("memfit")
    # the children were prepared ahead (imports and build on the CPU, then "go")
    assert all("cpu_build_s" in r["measured"]["timings"] for r in rows)


def test_validate_run_reports_problems(gv: ModuleType) -> None:
    problems = gv.validate_run({"schema_version": 0, "rows": [{"id": "x"}]})
    assert any("header" in p for p in problems)
    assert any("rows[0]" in p for p in problems)


FAKE_UUID = "GPU-12345678-abcd-4321-8765-0123456789ab"


def test_device_probe_context_with_fake_nvidia_smi(
    gv: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA bookkeeping of a child, with torch.cuda and nvidia-smi faked (no GPU needed)."""
    import os

    mib = 2**20
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f'  --query-gpu=*) echo "0, {FAKE_UUID}, NVIDIA H100 80GB HBM3, 1024, 81559, 570.86.15" ;;\n'
        f'  --query-compute-apps=*) echo "{os.getpid()}, {FAKE_UUID}, 2100"; echo "1, {FAKE_UUID}, 1024" ;;\n'
        "esac\n"
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    total = 80 * 1024 * mib
    used = {"now": 1024 * mib}  # other processes, before this one touches the device
    reserved = 1000 * mib

    def mem_get_info() -> tuple[int, int]:
        return total - used["now"], total

    class Props:
        uuid = FAKE_UUID.removeprefix("GPU-")

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "init", lambda: used.update(now=used["now"] + 500 * mib))
    monkeypatch.setattr(cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(cuda, "get_device_properties", lambda device=None: Props())
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda: 900 * mib)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda: reserved)
    monkeypatch.setattr(cuda, "memory_reserved", lambda: reserved)
    monkeypatch.setattr(cuda, "memory_allocated", lambda: 400 * mib)
    monkeypatch.setattr(cuda, "memory_stats", lambda: {"num_alloc_retries": 0, "num_ooms": 0})

    probe = gv.DeviceProbe("cuda")
    assert probe.gpus_before[0]["used_bytes"] == 1024 * mib
    probe.init()
    assert probe.gpu is not None and probe.gpu["uuid"] == FAKE_UUID
    used["now"] += (
        100 * mib + reserved
    )  # kernels loaded by the first steps, and the allocator's pool
    stats = probe.final()
    assert stats["context_bytes"] == 600 * mib
    assert stats["context_method"].startswith("mem_get_info - reserved - used before")
    assert stats["smi_process_used_bytes"] == 2100 * mib
    assert stats["context_smi_bytes"] == 1100 * mib
    assert stats["smi_other_processes_bytes"] == 1024 * mib
    assert (stats["reserved_peak_bytes"], stats["allocated_peak_bytes"]) == (reserved, 900 * mib)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_on_gpu(gv: ModuleType, tmp_path: Path) -> None:
    done = _run("--quick", "--out", str(tmp_path), timeout=900)
    doc = _only_json(tmp_path)
    assert gv.validate_run(doc) == [], done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert doc["header"]["gpu"]["total_memory_bytes"] > 0
    for row in doc["rows"]:
        assert row["status"] in ("ok", "oom"), row
        if row["status"] == "ok":
            assert row["measured"]["reserved_peak_bytes"] > 0
            assert row["measured"]["context_bytes"] > 0
            assert row["error_pct"]["total"] is not None


def test_segment_summary(gv: ModuleType) -> None:
    mib = 2**20
    segments = [
        {"total": (i + 1) * 2 * mib, "allocated": mib, "free_blocks": [mib // 2, mib // 2, 0],
         "stream": i % 2, "pool": "large"}
        for i in range(gv.SEGMENTS_KEPT + 10)
    ]  # fmt: skip
    summary = gv.segment_summary(segments)
    assert summary["segments"] == gv.SEGMENTS_KEPT + 10
    assert len(summary["largest"]) == gv.SEGMENTS_KEPT
    assert summary["rest"]["segments"] == 10
    # largest first, their free blocks in MiB, largest first, zero-sized ones left out
    assert summary["largest"][0]["mib"] == 2 * (gv.SEGMENTS_KEPT + 10)
    assert summary["largest"][0]["free_mib"] == [0.5, 0.5]
    total = sum(s["total"] for s in segments) / mib
    assert summary["reserved_mib"] == total
    assert summary["by_stream"]["0"]["mib"] + summary["by_stream"]["1"]["mib"] == total
    assert gv.segment_summary([])["segments"] == 0


def test_a_build_without_random_init_is_the_same_model(gv: ModuleType, tmp_path: Path) -> None:
    """The child's CPU build skips the random init: the same parameters (ties included), buffers
    and deterministic vectors as the estimator's build; draw_weights then fills the matrices."""
    import transformers

    from memfit.estimate import workload
    from memfit.models import resolve_model

    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "tied")
    case = gv.Case(str(tmp_path / "tied"), gv.LM, 2, 16, "fp32", lora_rank=4)
    spec = gv._spec_for({**case.knobs(), "device": "cpu"})
    config = resolve_model(case.model).config
    torch.manual_seed(0)
    plain = workload.build_model(config, spec)
    built = gv.build_step_model(config, spec, "cpu", on_device=False)
    ours, theirs = dict(built.named_parameters()), dict(plain.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(ours[k].shape == theirs[k].shape and ours[k].dtype == theirs[k].dtype for k in ours)
    assert len({id(p) for p in built.parameters()}) == len({id(p) for p in plain.parameters()})
    assert all(torch.equal(ours[k], theirs[k]) for k in ours if ours[k].dim() < 2)
    buffers = dict(plain.named_buffers())
    assert all(torch.equal(b, buffers[k]) for k, b in built.named_buffers())
    # torch.nn.init is itself again
    assert torch.nn.init.normal_.__module__ == "torch.nn.init"
    gv.draw_weights(built)
    matrices = [p for p in built.parameters() if p.dim() >= 2]
    assert all(bool(torch.isfinite(p).all()) for p in matrices)
    assert 0.01 < float(torch.cat([p.detach().flatten() for p in matrices]).std()) < 0.03
