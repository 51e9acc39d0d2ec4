"""Resolve a model name or path to its architecture config, without weights.

memfit only needs the architecture (a ``transformers`` config) to trace a training step on fake
tensors, so it ships the published ``config.json`` of common models in ``configs/`` and reads
folders, config files and the local Hugging Face cache. Only a Hub id found in none of them is
asked of the Hub, and then only its ``config.json`` (:mod:`memfit.models.hub`), when the Hub
answers: never weights, never ``trust_remote_code``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

try:
    from transformers.initialization import no_init_weights
except ImportError:  # transformers 4
    from transformers.modeling_utils import no_init_weights  # type: ignore[attr-defined,no-redef]

from memfit.errors import UsageError

# where a config.json is (on disk, in the registry, on the Hub) is found without transformers, in
# memfit.models.hub; the registry's names live in memfit.models.names, where `memfit models` reads
# them without importing transformers
from memfit.models.hub import Located, locate_config
from memfit.models.names import REGISTRY as _REGISTRY
from memfit.models.names import config_text

# Entries whose checkpoint holds another class than their config's ``architectures`` names:
# sentence-transformers saves the bare transformer but keeps the config of the model it was
# fine-tuned from (all-mpnet-base-v2's says MPNetForMaskedLM; its weights have no LM head).
_CHECKPOINT_CLASS: dict[str, str] = {
    "sentence-transformers/all-mpnet-base-v2": "MPNetModel",
}
# architectures whose position ids start after the padding index (fairseq convention)
_PAD_OFFSET_TYPES = frozenset(
    {"roberta", "xlm-roberta", "camembert", "mpnet", "longformer", "data2vec-text", "xmod"}
)
# for configs that name no position limit (relative or rotary positions only)
NO_POSITION_LIMIT = 1 << 30


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: its architecture config and where it came from."""

    name: str
    config: PretrainedConfig = field(hash=False)  # configs are mutable, hence unhashable
    source: str  # "registry" | "local-folder" | "config-file" | "hf-cache" | "hub"
    path: str | None
    max_positions: int

    def cache_key(self) -> str:
        """Stable hash of the config's JSON, for caching traces of this architecture."""
        return hashlib.sha256(self.config.to_json_string().encode()).hexdigest()[:16]


def registry_names() -> list[str]:
    """Canonical names of the models in memfit's offline registry (aliases left out)."""
    return list(_REGISTRY)


def usable_positions(config: PretrainedConfig) -> int:
    """The longest sequence (in tokens) that the model's position embeddings can take."""
    if config.model_type in _PAD_OFFSET_TYPES:
        # RoBERTa-style models number positions from pad_token_id + 1 (rows 0..pad_token_id of the
        # table are never used), so roberta-base's 514 rows hold 512 usable positions.
        return int(config.max_position_embeddings) - int(config.pad_token_id or 0) - 1
    # GPT-2 calls it n_positions (n_ctx is a legacy duplicate); BERT, DistilBERT and most others
    # max_position_embeddings, one row per position.
    for attr in ("n_positions", "max_position_embeddings"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return NO_POSITION_LIMIT


def resolve_model(model: str) -> ModelSpec:
    """Resolve ``model`` to a :class:`ModelSpec`: its architecture config, never its weights.

    Tried in order: a local folder holding ``config.json`` (a Hugging Face model folder or a
    sentence-transformers folder), a path to a ``config.json`` file, a name or alias in memfit's
    registry (case-insensitive), a Hub id already in the local Hugging Face cache (``owner/name``,
    or ``owner/name@revision``). None of these touches the network.

    Only then, for a Hub id, the Hub: when it answers (:func:`memfit.models.hub.hub_offline_reason`:
    not with ``HF_HUB_OFFLINE=1``, and only if it answers within a second) the id's
    ``config.json`` alone is fetched into the Hugging Face cache, with the user's token
    (source ``"hub"``). Offline, nothing more is tried and the answer comes in under a second.
    Raises :class:`UsageError` (one line: a gated, missing or config-less repository, an unknown
    name with the registry's nearest entries, a config that is not valid) when none matches.
    """
    found = locate_config(model)
    config = _cached_config(found)
    return _spec(
        found.name, config, found.source, None if found.path is None else found.path.parent
    )


def parameter_count(model: ModelSpec | PretrainedConfig) -> int:
    """How many parameters the checkpoint of ``model`` holds, counted from its config alone.

    Builds the class the checkpoint was saved from on the meta device (shapes only: no memory,
    no weight initialisation) and counts each parameter once, a tied weight (an output head
    sharing the input embeddings) included once, as the checkpoint stores it. The class is the
    config's ``architectures[0]`` when transformers has it, else the bare model of its
    ``model_type``; a sentence-transformers model is always the bare model, which is what that
    library saves.
    """
    spec = model if isinstance(model, ModelSpec) else None
    # building may record choices in the config (the attention implementation): count on a copy
    config = copy.deepcopy(model.config if isinstance(model, ModelSpec) else model)
    model_class = _checkpoint_class(config, spec)
    # skipping the initialisers (no-ops on meta tensors, yet most of the time spent building)
    # also skips the tying of weights, done below
    with torch.device("meta"), no_init_weights():
        if model_class is None:
            module = transformers.AutoModel.from_config(config)
        else:
            module = model_class(config)
    module.tie_weights()
    # parameters() yields a parameter shared by two modules once
    return sum(p.numel() for p in module.parameters())


def _checkpoint_class(config: PretrainedConfig, spec: ModelSpec | None) -> Any:
    """The transformers class a checkpoint was saved from; None for the bare AutoModel."""
    if spec is not None and spec.source == "registry" and spec.name in _CHECKPOINT_CLASS:
        name: str | None = _CHECKPOINT_CLASS[spec.name]
    elif spec is not None and _in_sentence_transformers_folder(spec):
        return None
    else:
        name = (getattr(config, "architectures", None) or [None])[0]
    if not name:
        return None
    try:
        found = getattr(transformers, name)
    except (AttributeError, ImportError):  # a class of remote code, or of a newer transformers
        return None
    is_model = isinstance(found, type) and issubclass(found, transformers.PreTrainedModel)
    return found if is_model else None


def _in_sentence_transformers_folder(spec: ModelSpec) -> bool:
    """The config is a sentence-transformers folder's, or its Transformer module subfolder's."""
    if spec.path is None:
        return False
    folder = Path(spec.path)
    return (folder / "modules.json").is_file() or (folder.parent / "modules.json").is_file()


def _spec(name: str, config: PretrainedConfig, source: str, path: Path | None) -> ModelSpec:
    return ModelSpec(
        name=name,
        config=config,
        source=source,
        path=None if path is None else str(path),
        max_positions=usable_positions(config),
    )


# Configs built so far, by where they came from: building one (transformers' from_dict, with its
# validation) takes about a millisecond, and `estimate` resolves its model on every call (`memfit
# ui` asks ~15 shapes per slider move). A config is mutable and callers may change theirs (a
# model built from it records choices in it), so each caller gets its own deep copy of the one
# built (about 30 times cheaper than building it again, and equal to it). A file is known by its
# path with its modification time and size, so an edited config.json is read again.
_CONFIGS: dict[tuple[Any, ...], PretrainedConfig] = {}
_CONFIGS_KEPT = 64  # the most kept (a long session editing one file makes a new key per edit)
_CONFIGS_LOCK = threading.Lock()  # `memfit ui` answers from several threads


def _cached_config(found: Located) -> PretrainedConfig:
    """The config ``found`` names, built once (:data:`_CONFIGS`); a copy of it for the caller."""
    key = _config_key(found)
    config = None if key is None else _CONFIGS.get(key)
    if config is None:
        path = found.path
        config = _registry_config(found.name) if path is None else _load_config(path)
        # kept only where the file did not change while it was read
        if key is not None and key == _config_key(found):
            with _CONFIGS_LOCK:
                if len(_CONFIGS) >= _CONFIGS_KEPT:
                    _CONFIGS.pop(next(iter(_CONFIGS)), None)
                _CONFIGS[key] = config
            config = copy.deepcopy(config)
        return config
    return copy.deepcopy(config)


def _config_key(found: Located) -> tuple[Any, ...] | None:
    """What identifies ``found``'s config: a registry entry's name, a file's path, modification
    time and size; None where the file cannot be read (building it says why)."""
    if found.path is None:
        return (found.source, found.name)
    try:
        stat = found.path.stat()
    except OSError:
        return None
    return (found.source, found.name, str(found.path), stat.st_mtime_ns, stat.st_size)


def _registry_config(name: str) -> PretrainedConfig:
    return _build_config(json.loads(config_text(name)), f"registry entry {name}")


def _load_config(path: Path) -> PretrainedConfig:
    """Read and validate a config.json; errors name the file (and line, for bad JSON)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read model config {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"model config {path} is not valid JSON: line {exc.lineno}: {exc.msg}"
        ) from None
    return _build_config(data, f"model config {path}")


def _build_config(data: Any, where: str) -> PretrainedConfig:
    if not isinstance(data, dict):
        raise UsageError(f"{where} is not a JSON object")
    model_type = data.get("model_type")
    if not model_type:
        raise UsageError(f"{where} has no model_type, so memfit cannot tell the architecture")
    if model_type not in CONFIG_MAPPING:
        raise UsageError(
            f"{where} has model_type {model_type!r}, which transformers does not know "
            "(memfit never runs remote code; a newer transformers may know it)"
        )
    try:
        return CONFIG_MAPPING[model_type].from_dict(data)
    except Exception as exc:
        raise UsageError(f"{where} does not build a {model_type} config: {exc}") from None


__all__ = [
    "NO_POSITION_LIMIT",
    "ModelSpec",
    "parameter_count",
    "registry_names",
    "resolve_model",
    "usable_positions",
]
