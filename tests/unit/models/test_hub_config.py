"""A Hub id not in the registry: its config.json fetched from the Hub (a local stand-in here).

The stand-in (tests/hub_server.py) answers as the Hub does; ``HF_ENDPOINT`` points at it, the HF
cache is a fresh folder, and HF_HUB_OFFLINE (which conftest.py sets for every other test) is off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_run import run_cli
from hub_server import FakeHub, HubRepo, closed_port_url, serve_hub, use_hub
from memfit.errors import UsageError
from memfit.models import resolve_model
from tiny_models import gpt2_config

PUBLIC = "acme/Tiny-GPT-1B"
GATED = "acme/Gated-GPT-1B"
# what the gated repository's stand-in takes as a token with access
TOKEN = "hf_fake_token_with_access"
CLI_KNOBS = ("--task", "causal-lm", "--batch-size", "1", "--seq-len", "128", "--gpu", "t4")


def _config_bytes(positions: int = 128) -> bytes:
    config = gpt2_config(vocab_size=500, positions=positions, bos_token_id=0, eos_token_id=0)
    return config.to_json_string().encode()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    repos = {
        PUBLIC: HubRepo(
            {"config.json": _config_bytes(), "model.safetensors": b"weights: never fetched"},
            revisions={"v1": {"config.json": _config_bytes(positions=64)}},
        ),
        GATED: HubRepo({"config.json": _config_bytes()}, gated=True, token=TOKEN),
        "acme/gguf-only": HubRepo({"model.gguf": b"GGUF"}),
        "acme/broken": HubRepo({"config.json": b'{"model_type": "gpt2",\n  "n_embd": }\n'}),
    }
    with serve_hub(repos) as server:
        use_hub(monkeypatch, server.url, tmp_path / "hf-home")
        yield server


def test_a_public_repo_gives_its_config_and_only_it_is_fetched(
    hub: FakeHub, tmp_path: Path
) -> None:
    spec = resolve_model(PUBLIC)
    assert spec.source == "hub" and spec.name == PUBLIC and spec.max_positions == 128
    assert spec.path is not None and str(tmp_path / "hf-home" / "hub") in spec.path
    assert spec.config.to_dict() == resolve_model(_given(tmp_path)).config.to_dict()
    # only config.json was asked for, never the weights beside it
    assert hub.files_asked() and all(p.endswith("/config.json") for p in hub.files_asked())
    asked = len(hub.log)
    assert resolve_model(PUBLIC).source == "hub" and len(hub.log) == asked  # fetched once


@pytest.mark.slow  # one estimate traced (seconds), then answered from the trace
def test_a_hub_id_estimates_as_its_config_path_does(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memfit import estimate

    knobs = {"task": "causal-lm", "batch_size": 1, "seq_len": 128, "gpu": "t4"}
    by_id, by_path = estimate(PUBLIC, **knobs), estimate(_given(tmp_path), **knobs)
    assert by_id.total_bytes == by_path.total_bytes and by_id.breakdown == by_path.breakdown
    assert by_id.fits is True
    code, out, err = run_cli(capsys, "estimate", PUBLIC, *CLI_KNOBS)
    assert code == 0, err
    assert "Fits in a T4" in out


def _given(tmp_path: Path) -> str:
    """The public repository's config.json, given as a path."""
    given = tmp_path / "given" / "config.json"
    given.parent.mkdir(exist_ok=True)
    given.write_bytes(_config_bytes())
    return str(given)


def test_a_revision_after_the_at_sign(hub: FakeHub) -> None:
    assert resolve_model(f"{PUBLIC}@v1").max_positions == 64
    assert any("/resolve/v1/config.json" in p for p in hub.files_asked())
    with pytest.raises(UsageError, match=r"acme/Tiny-GPT-1B' has no revision 'v9'"):
        resolve_model(f"{PUBLIC}@v9")


def test_a_gated_repo_says_so_and_the_token_opens_it(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UsageError) as info:
        resolve_model(GATED)
    line = str(info.value)
    assert "\n" not in line and f"model '{GATED}' is a gated repository" in line
    assert f"accept its licence on {hub.url}/{GATED}" in line
    assert "`hf auth login`" in line and "HF_TOKEN" in line
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert resolve_model(GATED).source == "hub"
    assert (hub.log[-1][2] or "").endswith(TOKEN)  # the user's token went with the request


def test_a_missing_repo_is_one_line_with_the_family_and_a_path_that_works(hub: FakeHub) -> None:
    with pytest.raises(UsageError) as info:
        resolve_model("acme/Nothing-Here-7B")
    line = str(info.value)
    assert "\n" not in line and "unknown model 'acme/Nothing-Here-7B'" in line
    assert f"the Hugging Face Hub ({hub.url}) has no repository 'acme/Nothing-Here-7B'" in line
    assert "path to the model's config.json" in line


def test_a_repo_without_config_json(hub: FakeHub) -> None:
    with pytest.raises(UsageError, match=r"'acme/gguf-only' on the Hugging Face Hub has no config"):
        resolve_model("acme/gguf-only")


def test_a_broken_config_from_the_hub_names_the_file(hub: FakeHub) -> None:
    with pytest.raises(UsageError, match=r"model config .*config\.json is not valid JSON: line 2"):
        resolve_model("acme/broken")


def test_the_cli_refuses_gated_and_config_less_repos_in_one_line(
    hub: FakeHub, capsys: pytest.CaptureFixture[str]
) -> None:
    for model, said in ((GATED, "is a gated repository"), ("acme/gguf-only", "has no config.json")):
        code, out, err = run_cli(capsys, "estimate", model, *CLI_KNOBS)
        assert code == 2 and said in err and "Traceback" not in err and out == ""


def test_the_probe_is_asked_once_per_process(hub: FakeHub) -> None:
    from memfit.models.hub import hub_offline_reason

    assert hub_offline_reason() is None and hub_offline_reason() is None
    assert [p for _, p, _ in hub.log] == ["/"]


def test_offline_is_answered_at_once_and_says_what_to_do(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(UsageError) as info:
        resolve_model("Qwen/Qwen3-8B")
    assert time.perf_counter() - start < 10.0  # loose on a loaded runner: no request is the check
    line = str(info.value)
    assert "not fetched from the Hugging Face Hub (HF_HUB_OFFLINE=1 is set)" in line
    assert "path to its config.json" in line and "unset HF_HUB_OFFLINE" in line
    assert hub.log == []  # not even the probe


def test_an_endpoint_that_does_not_answer_costs_about_a_second(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    endpoint = closed_port_url()
    use_hub(monkeypatch, endpoint, tmp_path / "hf-home")
    start = time.perf_counter()
    with pytest.raises(UsageError) as info:
        resolve_model("mistralai/Mistral-Nemo-Base-2407")
    assert (
        time.perf_counter() - start < 10.0
    )  # the probe gives up after 1 s (loose on a loaded runner)
    line = str(info.value)
    assert f"(no answer from {endpoint} within 1 s" in line
    assert "retry where the Hub answers" in line and "path to its config.json" in line
    # the registry still answers, offline as before
    assert resolve_model("gpt2").source == "registry"


# the offline example of docs/models.md, run here (tests/unit/docs/test_docs_commands.py's RUN_BY)
DOCS_OFFLINE = (
    "HF_HUB_OFFLINE=1 memfit estimate Qwen/Qwen3-8B --task causal-lm --batch-size 1 --seq-len 128 "
    "--gpu t4"
)


def test_the_offline_line_docs_models_shows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    page = Path(__file__).resolve().parents[3] / "docs" / "models.md"
    lines = page.read_text(encoding="utf-8").splitlines()
    shown = lines[lines.index(f"$ {DOCS_OFFLINE}") + 1]
    variable, argv = DOCS_OFFLINE.split(" ", 1)
    monkeypatch.setenv(*variable.split("="))
    code, out, err = run_cli(capsys, *argv.split()[1:])
    assert code == 2 and out == "" and err.strip() == shown
