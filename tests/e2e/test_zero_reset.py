"""After an OOM inside DeepSpeed's forward or backward, ZeRO's state is reset so the step's re-run
gives the gradient of a run without the OOM (memfit.train.zero.ZeroModel.reset).

Two CPU ranks (torchrun, gloo; one launch runs every stage) run 5 SGD steps of a small MLP under the guard over DeepSpeed,
with real ``torch.OutOfMemoryError`` raised at chosen points (a forward on rank 1, a backward on
rank 0 after a gradient bucket may have been reduced, the last backward on rank 1); each time
both ranks back off and re-run the step. The final weights are compared with plain full-batch
SGD in one process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
    ),
]

RANK_SCRIPT = Path(__file__).with_name("_zero_reset_rank.py")


STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every stage, one after another, in one 2-rank launch (DeepSpeed starts once)."""
    folder = tmp_path_factory.mktemp("zero-reset")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(RANK_SCRIPT), str(folder), *map(str, STAGES)]
    run = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,  # three stages, one after another
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return folder


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_rerun_after_injected_ooms_gives_the_unbroken_gradient(
    launched: Path, stage: int
) -> None:
    out = launched / f"stage{stage}.json"
    result = json.loads(out.read_text())
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]
    assert all(r["left"] == 0 for r in ranks)  # every injected OOM fired
    assert ranks[0]["events"].count("oom") == 1 and ranks[1]["events"].count("oom") == 2
    # every OOM made both ranks back off: three back-offs on each
    assert all(r["events"].count("backoff") == 3 for r in ranks), ranks
    assert result["difference"] <= 1e-6, result
