"""memfit's caching-allocator model against a GPU's own allocation histories (bench/allocator_history.py).

The histories are the H200's (``bench/results/gpu_truth_20261128_H200/allocator_history``): fed
each one's allocations and frees, :class:`memfit.estimate.device.CachingAllocator` must reserve
what the GPU reserved, to the byte. A change to the allocator model that breaks this is wrong.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
HISTORIES = sorted((ROOT / "bench/results/gpu_truth_20261128_H200/allocator_history").glob("*.gz"))


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_allocator_history", ROOT / "bench" / "allocator_history.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_histories_are_committed() -> None:
    assert len(HISTORIES) == 6


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.name.split(".pickle")[0])
def test_the_replay_reserves_what_the_gpu_reserved(bench: ModuleType, path: Path) -> None:
    row = bench.check(path)
    assert row["gpu_reserved_peak_mib"] > 1000
    # one pool per stream, emptied where the GPU emptied its cache: exactly the GPU's peak
    assert row["per_stream_mib"] == row["gpu_reserved_peak_mib"]
    if row["streams"] == 1:
        assert row["one_pool_mib"] == row["gpu_reserved_peak_mib"]
    else:
        # activation offloading's side stream: one pool (memfit's replay) within 1 %
        assert row["one_pool_mib"] == pytest.approx(row["gpu_reserved_peak_mib"], rel=0.01)


def test_no_history_is_a_one_line_error(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main([str(tmp_path)])
    assert exit_info.value.code == 2
    assert "no allocator history" in capsys.readouterr().err
