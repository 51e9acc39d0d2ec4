"""memfit doctor: PyTorch's out-of-memory messages, in every form they have taken, into bytes.

Every unit in these messages is binary (PyTorch's format_size divides by 1024, also where the MPS
allocator writes "MB"/"GB"), printed with two decimals: a printed value is int(round(v * unit)).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.errors import UsageError
from memfit.report.doctor import diagnose, failed_job, from_run_dir
from memfit.report.oom_message import parse_oom
from memfit.units import size_arg

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def b(value: float, unit: int) -> int:
    return round(value * unit)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


# the new form, as memfit's issue 6 quotes it (c10/cuda/CUDACachingAllocator.cpp, PyTorch ≥ 2.1)
CUDA_NEW = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 15.77 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process "
    "has 14.69 GiB memory in use. Of the allocated memory 10.25 GiB is allocated by PyTorch, and "
    "4.02 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
    "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
# the old form (PyTorch 1.x / 2.0), as issue 6 quotes it
CUDA_OLD = (
    "RuntimeError: CUDA out of memory. Tried to allocate 256.00 MiB (GPU 0; 11.17 GiB total "
    "capacity; 10.21 GiB already allocated; 117.81 MiB free; 10.45 GiB reserved in total by PyTorch)"
)


def test_cuda_new_form() -> None:
    r = parse_oom(CUDA_NEW)
    assert r is not None and r.kind == "cuda-new" and r.gpu == 0
    assert r.requested_bytes == 2 * GiB
    assert r.capacity_bytes == b(15.77, GiB)
    assert r.free_bytes == b(1.06, GiB)
    assert r.allocated_bytes == b(10.25, GiB)
    assert r.reserved_unallocated_bytes == b(4.02, GiB)
    # reserved is not printed: it is allocated + reserved-but-unallocated, and says so
    assert r.reserved_bytes == b(10.25, GiB) + b(4.02, GiB)
    assert r.derived == ["reserved_bytes"]
    assert r.process_bytes == b(14.69, GiB)


def test_cuda_new_form_with_two_processes_and_the_2_1_typo() -> None:
    # PyTorch 2.1 printed "capacty"; "Process N has X memory in use" per process (an H100 OOM
    # quoted in a public issue write-up about a LoRA run with flash-attn)
    text = (
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 448.00 MiB. GPU 1 has "
        "a total capacty of 79.10 GiB of which 364.31 MiB is free. Process 175080 has 1.46 GiB "
        "memory in use. Process 175356 has 77.26 GiB memory in use. Of the allocated memory "
        "72.12 GiB is allocated by PyTorch, and 3.78 GiB is reserved by PyTorch but unallocated. "
        "If reserved but unallocated memory is large try setting max_split_size_mb to avoid "
        "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
    )
    r = parse_oom(text)
    assert r is not None and r.kind == "cuda-new" and r.gpu == 1
    assert r.requested_bytes == b(448, MiB)
    assert r.capacity_bytes == b(79.10, GiB)
    assert r.free_bytes == b(364.31, MiB)
    assert r.allocated_bytes == b(72.12, GiB)
    assert r.reserved_unallocated_bytes == b(3.78, GiB)
    assert r.process_bytes == b(77.26, GiB)
    assert r.other_processes_bytes == b(1.46, GiB)


def test_cuda_new_form_with_zero_bytes_free_wrapped_over_lines() -> None:
    # a T4/4060 log quoted in a public write-up: "0 bytes is free" (format_size below 1 KiB
    # prints bytes), the message wrapped over lines and no "this process" clause
    text = (
        "Skipping batch 1 due to error: CUDA out of memory. Tried to allocate 730.00 MiB.\n"
        "GPU 0 has a total capacity of 8.00 GiB of which 0 bytes is free.\n"
        "Of the allocated memory 6.52 GiB is allocated by PyTorch,\n"
        "and 666.27 MiB is reserved by PyTorch but unallocated.\n"
    )
    r = parse_oom(text)
    assert r is not None and r.kind == "cuda-new"
    assert r.requested_bytes == b(730, MiB)
    assert r.capacity_bytes == 8 * GiB
    assert r.free_bytes == 0
    assert r.allocated_bytes == b(6.52, GiB)
    assert r.reserved_unallocated_bytes == b(666.27, MiB)
    assert r.process_bytes is None


def test_cuda_old_form() -> None:
    r = parse_oom(CUDA_OLD)
    assert r is not None and r.kind == "cuda-old" and r.gpu == 0
    assert r.requested_bytes == 256 * MiB
    assert r.capacity_bytes == b(11.17, GiB)
    assert r.allocated_bytes == b(10.21, GiB)
    assert r.free_bytes == b(117.81, MiB)
    assert r.reserved_bytes == b(10.45, GiB)
    assert r.reserved_unallocated_bytes == b(10.45, GiB) - b(10.21, GiB)
    assert r.derived == ["reserved_unallocated_bytes"]


def test_cuda_old_form_from_a_repository_comment() -> None:
    # inha15/Camera_YOLOv5-HJ, E2E_Camera/scripts/clean_cache.py (a comment, wrapped at "already")
    text = (
        "# RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total "
        "capacity; 130.35 MiB already\n# allocated; 47.06 MiB free; 188.00 MiB reserved in total "
        "by PyTorch) If reserved memory is >> allocated memory try\n# setting max_split_size_mb"
    )
    r = parse_oom(text)
    assert r is not None and r.kind == "cuda-old"
    assert r.requested_bytes == 36 * MiB
    assert r.capacity_bytes == b(7.93, GiB)
    assert r.free_bytes == b(47.06, MiB)
    assert r.reserved_bytes == 188 * MiB
    # "already\n# allocated": the comment marker breaks the phrase, so allocated is unknown
    assert r.allocated_bytes is None and r.reserved_unallocated_bytes is None


def test_cuda_old_form_before_1_4_says_cached() -> None:
    # PyTorch ≤ 1.3 (pytorch/pytorch issue threads of 2019): "cached" instead of "reserved"
    text = (
        "RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total "
        "capacity; 8.57 MiB already allocated; 9.28 GiB free; 4.68 MiB cached)"
    )
    r = parse_oom(text)
    assert r is not None and r.kind == "cuda-old"
    assert r.requested_bytes == b(12.5, MiB)
    assert r.free_bytes == b(9.28, GiB)
    assert r.reserved_bytes == b(4.68, MiB)
    # clamped to 0: the old "cached" could be below "already allocated"
    assert r.reserved_unallocated_bytes == 0


def test_cuda_bare_runtime_error() -> None:
    # the CUDA runtime's own error string (cudaErrorMemoryAllocation), as torch re-raises it
    text = (
        'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
        "RuntimeError: CUDA error: out of memory\nCUDA kernel errors might be asynchronously "
        "reported at some other API call, so the stacktrace below might be incorrect.\n"
    )
    r = parse_oom(text)
    assert r is not None and r.kind == "cuda-bare"
    assert all(v is None for v in r.numbers().values())


@pytest.mark.parametrize(
    ("text", "requested"),
    [
        # mxfold/mxfold2 issue 20 (c10/core/impl/alloc_cpu.cpp, POSIX)
        (
            "RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: "
            "can't allocate memory: you tried to allocate 132426121216 bytes. Error code 12 "
            "(Cannot allocate memory)",
            132_426_121_216,
        ),
        # MaximeVandegar/Papers-in-100-Lines-of-Code issue 10 (the Windows branch)
        (
            "RuntimeError: [enforce fail at C:\\b\\abs_bao0hdcrdh\\croot\\pytorch_1675190257512"
            "\\work\\c10\\core\\impl\\alloc_cpu.cpp:81] data. DefaultCPUAllocator: not enough "
            "memory: you tried to allocate 1981808640 bytes.",
            1_981_808_640,
        ),
    ],
)
def test_cpu_allocator(text: str, requested: int) -> None:
    r = parse_oom(text)
    assert r is not None and r.kind == "cpu"
    assert r.requested_bytes == requested
    assert r.capacity_bytes is None and r.free_bytes is None


@pytest.mark.parametrize(
    ("text", "allocated", "other", "limit", "requested"),
    [
        # aten/src/ATen/mps/MPSAllocator.mm's format_size writes "MB"/"GB" for 2^20/2^30
        # (a comment in a public training script)
        (
            "MPS backend out of memory (MPS allocated: 3.11 GB, other allocations: 5.42 GB, max "
            "allowed: 9.07 GB). Tried to allocate 720.00 MB on private pool. Use "
            "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations "
            "(may cause system failure).",
            b(3.11, GiB),
            b(5.42, GiB),
            b(9.07, GiB),
            720 * MiB,
        ),
        # newer PyTorch writes GiB/KiB (a public server log)
        (
            "MPS backend out of memory (MPS allocated: 20.14 GiB, other allocations: 384.00 KiB, "
            "max allowed: 20.13 GiB). \nTried to allocate 6.00 KiB on private pool.",
            b(20.14, GiB),
            384 * KiB,
            b(20.13, GiB),
            6 * KiB,
        ),
    ],
)
def test_mps(text: str, allocated: int, other: int, limit: int, requested: int) -> None:
    r = parse_oom(text)
    assert r is not None and r.kind == "mps"
    assert (r.allocated_bytes, r.other_bytes, r.capacity_bytes, r.requested_bytes) == (
        allocated,
        other,
        limit,
        requested,
    )
    assert r.free_bytes == max(0, limit - allocated - other)


def test_memfit_cap_message_raised_for_real() -> None:
    from memfit.guard.cap import CpuMemoryCap

    with pytest.raises(torch.OutOfMemoryError) as info, CpuMemoryCap(1 * MiB):
        torch.ones(512 * 1024)  # 2 MiB of float32
    r = parse_oom(f"torch.OutOfMemoryError: {info.value}")
    assert r is not None and r.kind == "memfit-cap"
    assert r.capacity_bytes == 1 * MiB
    assert r.allocated_bytes == 2 * MiB


def test_no_message_is_none_and_the_last_message_wins() -> None:
    assert parse_oom("loss 0.31 at step 10\nall good") is None
    log = "step 1: " + CUDA_OLD + "\n\nretrying\nTraceback (most recent call last):\n" + CUDA_NEW
    r = parse_oom(log)
    assert r is not None and r.kind == "cuda-new"


def test_fragmentation_ranks_expandable_segments_first() -> None:
    r = parse_oom(CUDA_NEW)
    assert r is not None
    d = diagnose(r).to_dict()
    assert d["fixes"][0]["change"].startswith(
        "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    assert d["fixes"][0]["saves_bytes"] == b(4.02, GiB)
    assert any(line.startswith("fragmentation") for line in d["diagnosis"])
    # without fragmentation (2 % of the reserve, less than the request) it is not proposed, and
    # the cheapest cure comes first
    old = parse_oom(CUDA_OLD)
    assert old is not None
    fixes = diagnose(old).to_dict()["fixes"]
    assert [f["lever"] for f in fixes][:3] == ["micro_batch", "precision", "gradient_checkpointing"]
    assert (
        fixes[-1]["lever"] == "plan"
        and f"--gpu-memory {size_arg(b(11.17, GiB))}" in fixes[-1]["change"]
    )


def test_non_pytorch_memory_is_named() -> None:
    r = parse_oom(CUDA_NEW)
    assert r is not None
    outside = b(15.77, GiB) - b(1.06, GiB) - (b(10.25, GiB) + b(4.02, GiB))
    from memfit.units import format_bytes

    assert any(
        line.startswith(f"{format_bytes(outside)} of the device is outside PyTorch's cache")
        for line in diagnose(r).diagnosis
    )


KEYS = {
    "requested_bytes",
    "capacity_bytes",
    "free_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "reserved_unallocated_bytes",
    "diagnosis",
    "fixes",
}


def test_cli_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "doctor", "--message", CUDA_OLD, "--json")
    assert code == 0
    d = json.loads(out)
    assert set(d) >= KEYS
    assert d["requested_bytes"] == 256 * MiB and d["kind"] == "cuda-old"
    for fix in d["fixes"]:
        assert set(fix) >= {"change", "saves_bytes", "cost"} and fix["saves_bytes"] is None
    # a bare CUDA error: every number null, still diagnosed
    code, out, _ = run(capsys, "doctor", "--message", "CUDA error: out of memory", "--json")
    d = json.loads(out)
    assert code == 0 and all(d[k] is None for k in KEYS - {"diagnosis", "fixes"})


def test_cli_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "doctor", "--message", CUDA_NEW)
    assert code == 0
    assert "requested                   2.00 GiB" in out
    assert "1. export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out


def test_cli_file_takes_the_last_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    log = tmp_path / "train.log"
    log.write_text(
        f'epoch 1\n{CUDA_OLD}\n\nTraceback (most recent call last):\n  File "x.py"\n'
        "RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't "
        "allocate memory: you tried to allocate 1024 bytes. Error code 12 (Cannot allocate memory)\n",
        encoding="utf-8",
    )
    code, out, _ = run(capsys, "doctor", "--file", str(log), "--json")
    assert code == 0
    d = json.loads(out)
    assert d["kind"] == "cpu" and d["requested_bytes"] == 1024


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--message", "step 3 loss 0.1"], "--message: no out-of-memory message found in the text"),
        ([], "give exactly one of --message TEXT, --file LOG or RUN_DIR"),
        (["--message", CUDA_OLD, "--file", "x.log"], "(got --message, --file)"),
        (["--file", "/nonexistent/x.log"], "--file: /nonexistent/x.log does not exist"),
        (["/nonexistent/run"], "RUN_DIR: /nonexistent/run is not a folder"),
        (
            ["--message", CUDA_OLD, "--model", "bert-base-uncased"],
            "--task, --batch-size, --seq-len",
        ),
        # knobs of no job: accepted and ignored (rc 0) before; the flags the doctor took
        # before issue 31 stay accepted without --model, the newer ones are refused
        (
            ["--message", CUDA_OLD, "--world-size", "4", "--sharding", "zero3"],
            "--world-size, --sharding: only with --model",
        ),
        (
            ["--message", CUDA_OLD, "--batch-size", "8", "--attn-implementation", "eager"],
            "--attn-implementation: only with --model",
        ),
    ],
)
def test_cli_bad_input_exits_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    code, out, err = run(capsys, "doctor", *argv)
    assert code == 2 and out == ""
    assert err.startswith("memfit: error: ") and expected in err
    assert len(err.strip().splitlines()) == 1


def test_cli_old_knob_flags_stay_accepted_without_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """memfit doctor took these flags before its flags came from the job's fields, and ignored
    them without --model: scripts that pass them keep working."""
    argv = ["--batch-size", "8", "--precision", "bf16", "--gradient-checkpointing"]
    code, out, err = run(capsys, "doctor", "--message", CUDA_OLD, *argv)
    assert code == 0 and err == "" and "fixes" in out


def test_cli_every_knob_flag_says_with_model() -> None:
    """`memfit doctor --help` read "classification | causal-lm | sentence-embedding With
    --model." (no period), and the newer knob flags did not say they need --model at all."""
    import typing

    from memfit.commands.doctor import doctor_command
    from memfit.job import STEP_FIELDS

    params = inspect.signature(doctor_command).parameters
    for name in STEP_FIELDS:
        option = typing.get_args(params[name].annotation)[1]
        assert "with --model" in option.help.lower(), (name, option.help)
        # each sentence ends with its period
        assert ". With --model" in option.help or "(with --model)." in option.help, option.help
    assert (
        params["task"].annotation.__metadata__[0].help.endswith("sentence-embedding. With --model.")
    )


def _run_folder(tmp_path: Path, model: str) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    error = CUDA_NEW.split("torch.OutOfMemoryError: ", 1)[1]
    events = [
        {"type": "probe", "step": 0, "rows": 16, "ooms": 0, "micro_batch_size": 8},
        {"type": "oom", "step": 3, "micro_batch_size": 8, "error": error},
        {"type": "backoff", "step": 3, "from": 8, "to": 4},
        {"type": "oom", "step": 7, "micro_batch_size": 4, "error": CUDA_OLD},
        {"type": "backoff", "step": 7, "from": 4, "to": 2},
    ]
    (folder / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in events), encoding="utf-8"
    )
    run_json = {
        "config": {
            "task": "classification",
            "model": model,
            "effective_batch_size": 16,
            "max_seq_len": 64,
            "precision": None,
            "gradient_checkpointing": None,
            "optimizer": "adamw",
            "world_size": 1,
        },
        "resolved": {
            "device": "cuda",
            "micro_batch_size": 8,
            "precision": "fp32",
            "gradient_checkpointing": False,
        },
        "plan": None,
    }
    (folder / "run.json").write_text(json.dumps(run_json), encoding="utf-8")
    return folder


def test_run_folder_unknown_model_leaves_savings_null(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path, str(tmp_path / "no-such-model"))
    d = from_run_dir(str(folder)).to_dict()
    # the LAST oom is diagnosed: the old-form message of step 7
    assert d["kind"] == "cuda-old" and d["requested_bytes"] == 256 * MiB
    text = "\n".join(d["diagnosis"])
    assert "2 out-of-memory events" in text
    assert "the last at step 7 with micro-batch 4" in text
    assert "step 3: the guard backed off from micro-batch 8 to 4" in text
    assert "step 7: the guard backed off from micro-batch 4 to 2" in text
    assert "saves_bytes unknown: the estimator cannot model this job" in text
    assert all(f["saves_bytes"] is None for f in d["fixes"])


def test_run_folder_without_oom_exits_2(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text('{"type": "checkpoint", "step": 5}\n', encoding="utf-8")
    with pytest.raises(UsageError, match="no out-of-memory message found"):
        from_run_dir(str(tmp_path))


@pytest.mark.slow
def test_run_folder_prices_the_fixes_with_the_estimator(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_bert: str
) -> None:
    folder = _run_folder(tmp_path, tiny_bert)
    code, out, _ = run(capsys, "doctor", str(folder), "--json")
    assert code == 0
    d = json.loads(out)
    assert d["knobs"]["batch_size"] == 4  # the micro-batch that failed last
    assert d["knobs"]["gradient_accumulation_steps"] == 4  # 16 samples per step in 4s
    saves = {f["lever"]: f["saves_bytes"] for f in d["fixes"]}
    assert saves["micro_batch"] > 0 and saves["gradient_checkpointing"] > 0
    assert "--effective-batch-size 16 --seq-len 64" in d["fixes"][-1]["change"]


@pytest.mark.slow
def test_message_with_model_matches_estimate_differences(tiny_bert: str) -> None:
    from memfit.estimate import estimate

    r = parse_oom(CUDA_OLD)
    assert r is not None
    knobs = failed_job(model=tiny_bert, task="classification", batch_size=32, seq_len=128)
    d = diagnose(r, knobs=knobs)
    base = estimate(tiny_bert, task="classification", batch_size=32, seq_len=128).total_bytes
    halved = estimate(
        tiny_bert, task="classification", batch_size=16, seq_len=128, gradient_accumulation_steps=2
    ).total_bytes
    fix = next(f for f in d.fixes if f.lever == "micro_batch")
    assert fix.saves_bytes == base - halved > 0
    assert fix.change.startswith("halve the micro-batch (32 → 16)")
