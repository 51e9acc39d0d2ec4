"""bench/gpu_reestimate.py: past GPU measurements re-estimated with this checkout (the cheap parts:
which rows it takes, the measured GPU's profile, bad input)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench/results/gpu_truth_20261128_H200/after_workspace_fix"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_gpu_reestimate", ROOT / "bench" / "gpu_reestimate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_it_takes_the_measured_rows_and_the_gpus_profile(bench: ModuleType) -> None:
    (path,) = RESULTS.glob("*NVIDIA-H200.json")
    rows = bench.rows_of([path], [])
    assert len(rows) == 16
    assert len(bench.rows_of([path], ["act-offload", "paged"])) == 4
    header, row = rows[0]
    assert row["measured"]["total_bytes"] > 0
    profile = bench.gpu_profile(header)
    # an H200 under torch 2.11: 32 MiB cuBLAS workspaces and cuBLASLt's own 1 MiB
    assert profile.name == "sm90"
    assert (profile.cublas_workspace_bytes, profile.cublaslt_workspace_bytes) == (2**25, 2**20)


@pytest.mark.parametrize("text", ["not json", json.dumps({"rows": []}), json.dumps([1, 2])])
def test_a_file_that_is_no_results_file_is_a_one_line_exit_2(
    bench: ModuleType, tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        bench.main([str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err
