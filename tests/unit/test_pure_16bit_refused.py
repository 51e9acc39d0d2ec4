"""Every verb refuses pure 16-bit training without loss scaling (``--weights-dtype fp16``, and
``--weights-dtype bf16`` under ``--precision fp16``): one line naming ``--weights-dtype``, exit 2,
before anything is estimated."""

from __future__ import annotations

import pytest

from cli_run import run_cli as _run


@pytest.mark.parametrize("verb", ["estimate", "plan"])
@pytest.mark.parametrize(
    ("knobs", "said"),
    [
        (["--weights-dtype", "fp16"], "--weights-dtype fp16: pure fp16 training"),
        (
            ["--weights-dtype", "bf16", "--precision", "fp16"],
            "--weights-dtype bf16 with --precision fp16:",
        ),
    ],
)
def test_every_verb_refuses_16_bit_training_without_loss_scaling(
    capsys: pytest.CaptureFixture[str], tiny_bert: str, verb: str, knobs: list[str], said: str
) -> None:
    base = [verb, tiny_bert, "--task", "classification", "--seq-len", "64"]
    if verb == "estimate":
        base += ["--batch-size", "2"]
    else:
        base += ["--effective-batch-size", "8", "--gpu-memory", "16GiB"]
    code, out, err = _run(capsys, *base, *knobs)
    assert code == 2 and out == "", err
    assert err.startswith("memfit: error:") and said in err and err.count("\n") == 1, err
