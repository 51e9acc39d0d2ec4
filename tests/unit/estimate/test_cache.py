"""The disk cache of traces holds data only: what it reads back is what was written, and a file
planted in its folder is never run."""

from __future__ import annotations

import json
import pickle
import zlib
from pathlib import Path
from typing import Any

import pytest

from memfit.estimate import api, cache, traces
from memfit.models import resolve_model

KNOBS: dict[str, Any] = dict(
    task="causal-lm", batch_size=2, seq_len=40, precision="bf16", gradient_checkpointing=True
)


@pytest.fixture(scope="module")
def gpt2_7(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Seven layers: traced at 3 and 4 and written out (the trace a cache mostly holds)."""
    from transformers import GPT2Config

    folder = tmp_path_factory.mktemp("gpt2-7")
    GPT2Config(vocab_size=5000, n_embd=64, n_layer=7, n_head=4, n_positions=128).save_pretrained(
        folder
    )
    return str(folder)


def _same(a: Any, b: Any) -> bool:
    timing = ("estimate_seconds",)
    return (a.total_bytes, a.breakdown, a.peak_phase) == (
        b.total_bytes,
        b.breakdown,
        b.peak_phase,
    ) and {k: v for k, v in a.details.items() if k not in timing} == {
        k: v for k, v in b.details.items() if k not in timing
    }


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEMFIT_NO_CACHE", raising=False)
    traces.clear_cache()
    yield tmp_path
    traces.clear_cache()


def _trace_file(model: str, **knobs: Any) -> Path:
    """Where the trace of ``estimate(model, **knobs)`` is kept (after one estimate)."""
    (key,) = [k for k in traces._CACHE if k[0] == resolve_model(model).cache_key()]
    path = cache.path_for(key)
    assert path is not None
    return path


def test_a_trace_reads_back_as_written(cache_dir: Path, gpt2_7: str) -> None:
    first = api.estimate(gpt2_7, **KNOBS)
    assert first.details["trace_depth"]["mode"] == "extrapolated"
    one = api.estimate(gpt2_7, **{**KNOBS, "batch_size": 1, "seq_len": 37})  # a variant
    path = _trace_file(gpt2_7)
    assert path.suffix == ".z" and path.is_file()
    traces.clear_cache()
    again = api.estimate(gpt2_7, **KNOBS)
    assert again.details["trace_seconds"] == first.details["trace_seconds"]  # not traced again
    assert _same(again, first)
    assert _same(api.estimate(gpt2_7, **{**KNOBS, "batch_size": 1, "seq_len": 37}), one)
    # every size formula of the CUDA emulation survives (they are stored by name)
    data = json.loads(zlib.decompress(path.read_bytes()))
    names = {
        f[0]
        for step in data["trace"]["steps"]
        for seg in step[1:]
        if seg
        for f in seg["formulas"]
        if f
    }
    assert names and names <= cache.FORMULAS


def test_a_planted_pickle_is_not_run(cache_dir: Path, tiny_gpt2: str) -> None:
    first = api.estimate(tiny_gpt2, **KNOBS)
    path = _trace_file(tiny_gpt2)
    marker = cache_dir / "planted-code-ran"

    class Planted:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    path.write_bytes(pickle.dumps(Planted()))
    traces.clear_cache()
    again = api.estimate(tiny_gpt2, **KNOBS)
    assert not marker.exists()
    assert again.total_bytes == first.total_bytes  # traced again instead
    # and the file is memfit's own again
    assert json.loads(zlib.decompress(path.read_bytes()))["format"] == cache.FORMAT


def test_a_file_naming_other_code_is_ignored(cache_dir: Path, tiny_gpt2: str) -> None:
    api.estimate(tiny_gpt2, **KNOBS)
    path = _trace_file(tiny_gpt2)
    data = json.loads(zlib.decompress(path.read_bytes()))
    seg = next(s for step in data["trace"]["steps"] for s in step[1:] if s and any(s["formulas"]))
    index = next(i for i, f in enumerate(seg["formulas"]) if f)
    seg["formulas"][index] = ["system", ["touch /tmp/x"], {}]  # os.system by another name
    path.write_bytes(zlib.compress(json.dumps(data).encode()))
    key = next(iter(traces._CACHE))
    assert cache.read(path, key, None, traces.Traced) is None
    path.write_bytes(b"not even compressed")
    assert cache.read(path, key, None, traces.Traced) is None
    path.write_bytes(zlib.compress(b"[" * 100_000))  # nested past the recursion limit
    assert cache.read(path, key, None, traces.Traced) is None


def test_a_trace_of_other_knobs_is_not_taken(cache_dir: Path, tiny_gpt2: str) -> None:
    """A file copied (or renamed) to another key's name is refused: its key is inside it."""
    bf16 = api.estimate(tiny_gpt2, **KNOBS)
    source = _trace_file(tiny_gpt2)
    traces.clear_cache()
    fp32 = api.estimate(tiny_gpt2, **{**KNOBS, "precision": "fp32"})
    (fp32_key,) = [k for k in traces._CACHE if k[1].precision == "fp32"]
    target = cache.path_for(fp32_key)
    assert target is not None and target != source
    target.write_bytes(source.read_bytes())
    traces.clear_cache()
    again = api.estimate(tiny_gpt2, **{**KNOBS, "precision": "fp32"})
    assert again.total_bytes == fp32.total_bytes != bf16.total_bytes


def test_an_unwritable_cache_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_gpt2: str
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(blocker))
    traces.clear_cache()
    assert api.estimate(tiny_gpt2, **KNOBS).total_bytes > 0
    traces.clear_cache()


@pytest.mark.parametrize("name", ["step/__init__.py", "levers/quantization.py", "knobs.py"])
def test_the_trace_key_changes_with_the_code_outside_the_estimator_that_shapes_a_step(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The traced loss is memfit.step's and the bitsandbytes settings the quantization lever's:
    an edit there must not leave stale traces behind."""

    cache._source_digest.cache_clear()
    before = cache._source_digest()
    read = Path.read_bytes

    def edited(path: Path) -> bytes:
        return read(path) + (b"# edited" if path.as_posix().endswith("/" + name) else b"")

    monkeypatch.setattr(Path, "read_bytes", edited)
    cache._source_digest.cache_clear()
    try:
        assert cache._source_digest() != before
    finally:
        monkeypatch.undo()
        cache._source_digest.cache_clear()
