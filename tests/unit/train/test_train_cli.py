"""`memfit train` flags: bad input is one line, exit 2, and nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.cli import main


def _train(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    data = tmp_path / "train.csv"
    data.write_text("text,label\nhello there,1\ngood bye,0\n")
    out = tmp_path / "out"
    args = ["train", "--task", "classification", "--model", str(tmp_path / "no-model")]
    args += ["--train-file", str(data), "--output-dir", str(out), *extra]
    with pytest.raises(SystemExit) as done:
        main(args)
    return int(done.value.code or 0), out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--optimizer", "lion"], "--optimizer: unknown value 'lion'"),
        (["--lr-scheduler", "step"], "--lr-scheduler: unknown value 'step'"),
        (["--effective-batch-size", "0"], "--effective-batch-size: must be ≥ 1"),
        (["--eval-file", "missing.csv"], "--eval-file: missing.csv: no such file"),
        (["--world-size", "2"], "--world-size: 2 ranks asked for, but this is one process"),
        (["--sharding", "zero4"], "--sharding: unknown value 'zero4'"),
        (["--sharding", "zero3", "--device", "cpu"], "--sharding: zero3 (DeepSpeed ZeRO) shards"),
        (["--sharding", "zero1"], "--sharding: zero1"),
    ],
)
def test_bad_flags_exit_2_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code, out = _train(tmp_path, *extra)
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_zero_refuses_optimizers_whose_state_flat_partitions_would_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _train(tmp_path, "--sharding", "zero2", "--optimizer", "adafactor")
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    # with the one-process line: every problem at once, one line each
    assert any(x.startswith("memfit: error: --optimizer adafactor: with DeepSpeed") for x in lines)


def test_a_model_that_cannot_be_had_offline_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _train(tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and "--model" in err and "no-model" in err
    assert not out.exists()


def test_an_unknown_config_setting_names_the_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "model: x\ntask: classification\nseq_len: 64\nmicro_batch_size: 4\n"
        "gradient_accumulation_steps: 2\nlearning_rate: 0.1\n"
    )
    with pytest.raises(SystemExit) as done:
        main(
            ["train", str(config), "--train-file", str(config), "--output-dir", str(tmp_path / "o")]
        )
    err = capsys.readouterr().err
    assert done.value.code == 2 and "line 6" in err and "learning_rate" in err
