"""`memfit train --cross-entropy trl-chunked`: TRL's SFTTrainer computes that loss, memfit train
does not; one line naming the flag, exit 2, nothing written to the output folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_run import run_cli
from tiny_models import save_tiny_llama, write_jsonl


def test_memfit_train_refuses_trls_head_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = "a short row of text"
    save_tiny_llama(tmp_path / "llama", [text])
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"text": text}] * 4)
    out = tmp_path / "run"
    code, _, err = run_cli(
        capsys,
        "train",
        "--model",
        str(tmp_path / "llama"),
        "--task",
        "causal-lm",
        "--train-file",
        str(rows),
        "--output-dir",
        str(out),
        "--effective-batch-size",
        "2",
        "--device",
        "cpu",
        "--cross-entropy",
        "trl-chunked",
    )
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith("memfit: error: --cross-entropy trl-chunked: TRL's SFTTrainer")
    assert not out.exists() or not any(out.iterdir())
