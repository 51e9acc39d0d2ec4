"""A trace-cache file whose figures were edited (sizes negated, zeroed, 10^30; a fit or a device
profile blown up) is not trusted: the model is traced again and the estimate is the untampered
one."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cli_run import run_cli
from memfit.estimate import api, cache, traces
from memfit.models import resolve_model

KNOBS: dict[str, Any] = dict(task="causal-lm", batch_size=2, seq_len=40, precision="bf16")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEMFIT_NO_CACHE", raising=False)
    traces.clear_cache()
    yield tmp_path
    traces.clear_cache()


def _segments(traced: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every segment of a trace file's traced object, its exact traces' and its variants'."""
    for _, fb, opt in traced["trace"]["steps"]:
        yield fb
        if opt:
            yield opt
    if traced["fitted"]:
        yield traced["fitted"]["template"]
    for _, nested in traced["exact"] + traced["variants"]:
        yield from _segments(nested)


def _all_sizes(change: Callable[[int], int]) -> Callable[[dict[str, Any]], None]:
    def edit(traced: dict[str, Any]) -> None:
        traced["trace"]["resident_sizes"] = [change(s) for s in traced["trace"]["resident_sizes"]]
        for seg in _segments(traced):
            seg["sizes"] = [change(s) for s in seg["sizes"]]

    return edit


def _largest_optimizer_size(traced: dict[str, Any]) -> None:
    """One allocation, the largest of the optimizer step, made 10^30 bytes."""
    opt = next(step[2] for step in traced["trace"]["steps"] if step[2])
    largest = max(range(len(opt["sizes"])), key=opt["sizes"].__getitem__)
    opt["sizes"][largest] = 10**30


def _fit(traced: dict[str, Any]) -> None:
    def scale(values: Any) -> Any:
        return [scale(v) for v in values] if isinstance(values, list) else values * 1e10

    traced["fitted"]["coefficients"] = scale(traced["fitted"]["coefficients"])


def _profile(traced: dict[str, Any]) -> None:
    traced["profile"]["context_bytes"] = 10**30


TAMPERED = {
    "negated": _all_sizes(lambda s: -s),
    "zeroed": _all_sizes(lambda s: 0),
    "10^30": _all_sizes(lambda s: 10**30 if s else 0),
    "one size 10^30": _largest_optimizer_size,
    "fit scaled": _fit,
    "profile 10^30": _profile,
}


def _trace_path(model: str) -> Path:
    (key,) = [k for k in traces._CACHE if k[0] == resolve_model(model).cache_key()]
    path = cache.path_for(key)
    assert path is not None and path.is_file()
    return path


def _tamper(path: Path, how: str) -> None:
    data = json.loads(zlib.decompress(path.read_bytes()))
    TAMPERED[how](data)
    path.write_bytes(zlib.compress(json.dumps(data).encode()))


@pytest.fixture(scope="module")
def honest_file(tiny_gpt2: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Any]:
    """An honest trace file (CUDA knobs: its device profile is used) and its key, traced once."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMFIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        patch.delenv("MEMFIT_NO_CACHE", raising=False)
        traces.clear_cache()
        api.estimate(tiny_gpt2, **{**KNOBS, "device": "cuda"})
        key = next(iter(traces._CACHE))
        data = _trace_path(tiny_gpt2).read_bytes()
        traces.clear_cache()
    return data, key


@pytest.mark.parametrize("how", list(TAMPERED))
def test_a_tampered_trace_file_is_not_read(
    tmp_path: Path, honest_file: tuple[bytes, Any], how: str
) -> None:
    data, key = honest_file
    path = tmp_path / "trace.json.z"
    path.write_bytes(data)
    assert cache.read(path, key, None, traces.Traced) is not None  # the honest file is read
    _tamper(path, how)
    assert cache.read(path, key, None, traces.Traced) is None


@pytest.mark.parametrize(
    "how", ["negated", *(pytest.param(h, marks=pytest.mark.slow) for h in ("zeroed", "10^30"))]
)
def test_the_estimate_from_a_tampered_cache_is_the_honest_one(
    cache_dir: Path, tiny_gpt2: str, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`memfit estimate` with a tampered cache: the model is traced again, the verdict is the
    untampered one, no traceback; and the file is an honest one again."""
    argv = ["estimate", tiny_gpt2, "--task", "causal-lm", "--batch-size", "2", "--seq-len", "40"]
    argv += ["--precision", "bf16", "--json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0
    honest = json.loads(out)
    path = _trace_path(tiny_gpt2)
    _tamper(path, how)
    tampered = path.read_bytes()
    traces.clear_cache()
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and "Traceback" not in err
    again = json.loads(out)
    assert again["total_bytes"] == honest["total_bytes"]
    assert again["breakdown"] == honest["breakdown"]
    # traced again and written out again (trace_seconds, rounded to ms, can repeat by chance)
    assert path.read_bytes() != tampered
    key = next(iter(traces._CACHE))
    assert cache.read(path, key, None, traces.Traced) is not None
