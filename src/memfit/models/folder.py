"""Checking a model folder before transformers loads it: one plain line instead of a traceback.

transformers loads what it finds and falls back where it finds nothing: a folder without tokenizer
files gets a tokenizer of the architecture's class with an empty vocabulary (5 tokens for BERT,
every word ``[UNK]``), a truncated ``model.safetensors`` raises a ``SafetensorError``, a config whose
sizes no longer match the weights a ``RuntimeError`` that points to a logged report. These checks
read only ``config.json``, file names, safetensors headers and zip directories (no weights), and
every problem is a :class:`~memfit.errors.UsageError` naming ``flag`` and the folder or file.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from transformers import PretrainedConfig

from memfit.errors import UsageError
from memfit.models.registry import _folder_config, _load_config

# what transformers' from_pretrained reads weights from (single files, then sharded indexes)
SAFETENSORS = "model.safetensors"
PYTORCH_BIN = "pytorch_model.bin"
WEIGHT_INDEXES = (SAFETENSORS + ".index.json", PYTORCH_BIN + ".index.json")
# a peft adapter folder names its base model; transformers loads the base from there
ADAPTER_CONFIG = "adapter_config.json"
# any of these makes a tokenizer (tokenizers' JSON, a config naming the class, WordPiece, BPE,
# sentencepiece, tiktoken)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "tiktoken.model",
)


def model_config(folder: Path, flag: str) -> tuple[Path, PretrainedConfig]:
    """The folder that holds the model's ``config.json`` (a sentence-transformers folder's
    Transformer module) and the config, checked: present, JSON, an architecture transformers
    knows."""
    found = _folder_config(folder)
    if found is None:
        raise UsageError(f"{flag}: {folder} holds no model: no config.json or modules.json")
    try:
        return found.parent, _load_config(found)
    except UsageError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def check_tokenizer(folder: Path, flag: str) -> None:
    """A tokenizer file in ``folder`` (or its Transformer module): without one transformers would
    build an empty-vocabulary tokenizer and every word would be the same unknown token."""
    module, _ = model_config(folder, flag)
    if not any((d / name).is_file() for d in {folder, module} for name in TOKENIZER_FILES):
        raise UsageError(
            f"{flag}: {folder} holds no tokenizer (no tokenizer.json, tokenizer_config.json, "
            "vocab.txt, vocab.json or sentencepiece model): save the model's tokenizer into it "
            "(tokenizer.save_pretrained(FOLDER))"
        )


def check_weights(folder: Path, flag: str, *, without: str) -> None:
    """Weights in ``folder`` (or its Transformer module), intact as far as their headers tell:
    a safetensors header that covers the file, a ``.bin`` zip archive with its directory.
    ``without``: what would happen with no weights (the reason to refuse)."""
    module, _ = model_config(folder, flag)
    if (folder / ADAPTER_CONFIG).is_file() or (module / ADAPTER_CONFIG).is_file():
        return  # a LoRA adapter folder: its base model's weights are elsewhere
    files: list[Path] = []
    for index_name in WEIGHT_INDEXES:
        index = module / index_name
        if index.is_file():
            files = [module / shard for shard in _shards(index, flag)]
            break
    else:
        files = [p for p in (module / SAFETENSORS, module / PYTORCH_BIN) if p.is_file()][:1]
    if not files:
        raise UsageError(
            f"{flag}: {folder} holds no weights ({SAFETENSORS} or {PYTORCH_BIN}): {without}"
        )
    for path in files:
        problem = _weights_problem(path)
        if problem:
            raise UsageError(f"{flag}: {path} is truncated or corrupt: {problem}")


def loads(loader: Callable[..., Any]) -> tuple[bool, bool]:
    """Whether ``loader`` reads (a tokenizer, weights): ``AutoTokenizer.from_pretrained`` the
    first, ``AutoModelFor….from_pretrained`` the second, ``SentenceTransformer`` both."""
    owner = getattr(loader, "__self__", loader)
    name = getattr(owner, "__name__", type(owner).__name__)
    if "Tokenizer" in name:
        return True, False
    if name == "SentenceTransformer":
        return True, True
    return False, True


def check_for_loader(loader: Callable[..., Any], folder: Path, flag: str, *, without: str) -> None:
    """The checks of a local model folder that ``loader`` is about to read: its config, and the
    tokenizer or weights (``without``: why weights are required) that ``loader`` reads."""
    tokenizer, weights = loads(loader)
    model_config(folder, flag)
    if tokenizer:
        check_tokenizer(folder, flag)
    if weights:
        check_weights(folder, flag, without=without)


def _shards(index: Path, flag: str) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted({str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"{flag}: {index} is not a weight index ({exc})") from None


def _weights_problem(path: Path) -> str | None:
    """What is wrong with a weights file (None where its header reads), without its tensors."""
    if not path.is_file():
        return "the file is missing"
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as weights:
                weights.keys()
        except Exception as exc:  # SafetensorError: a header that does not cover the file
            return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return None
    # torch.save writes a zip archive; its directory is at the end, so a cut file has none
    try:
        with zipfile.ZipFile(path) as archive:
            archive.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        if zipfile.is_zipfile(path) or path.read_bytes()[:2] == b"PK":
            return str(exc) or type(exc).__name__
        return None  # the legacy pickle format (torch < 1.6): left to torch
    return None


def mismatch_message(exc: BaseException, folder: str, flag: str) -> str | None:
    """The line for a load that failed because the weights do not fit the config's sizes (None
    when ``exc`` is not that): the first tensors whose shapes differ."""
    text = str(exc)
    if "size mismatch" not in text and "ignore_mismatched_sizes" not in text:
        return None
    details = _mismatched_keys(exc.__traceback__)
    if details:
        shown = "; ".join(
            f"{key} is {_shape(saved)} in the weights, {_shape(wanted)} by the config"
            for key, saved, wanted in details[:2]
        )
        more = f" (and {len(details) - 2} more)" if len(details) > 2 else ""
    else:  # transformers 4: "size mismatch for KEY: copying a param with shape ..."
        lines = [x.strip() for x in text.splitlines() if "size mismatch for" in x]
        shown, more = (lines[0] if lines else "tensor shapes differ"), ""
    return (
        f"{flag}: the weights in {folder} do not fit its config.json: {shown}{more} (was "
        "config.json edited after the weights were saved?)"
    )


def _mismatched_keys(tb: TracebackType | None) -> list[tuple[str, Any, Any]]:
    """transformers 5 logs the mismatched tensors and raises without them; they are in the
    ``loading_info`` of the frame that raised."""
    found: list[tuple[str, Any, Any]] = []
    while tb is not None:
        info = tb.tb_frame.f_locals.get("loading_info")
        keys = getattr(info, "mismatched_keys", None)
        if keys:
            try:
                found = [(str(k), s, w) for k, s, w in keys]
            except (TypeError, ValueError):
                found = []
        tb = tb.tb_next
    return sorted(found)


def _shape(shape: Any) -> str:
    try:
        return "×".join(str(int(n)) for n in shape)
    except (TypeError, ValueError):
        return str(shape)


__all__ = [
    "check_for_loader",
    "check_tokenizer",
    "check_weights",
    "loads",
    "mismatch_message",
    "model_config",
]
