"""Loading ``--model`` (a local folder or a Hub id) without ever training random weights.

Every recipe loads through :func:`load_pretrained`, so a model that cannot be found is one plain
line naming ``--model``, and ``HF_HUB_OFFLINE=1`` means the cache only (no network attempt). A local
folder is checked first (:mod:`memfit.models.folder`): a config that is not JSON or names an
architecture transformers does not know, no weights (training would start from random weights),
weights cut short, no tokenizer files (transformers would fall back to an empty vocabulary), and
weights whose shapes no longer fit the config are each one line naming ``--model`` and the file.
Once loaded, a model whose body the weights did not fill (transformers starts the rest at random
and only logs it) is refused too; a new task head (a classifier on a base model) is what a run
trains, and passes. So are weights that only an unsafe unpickling would read, and a folder whose
code transformers would have to run (``trust_remote_code``).

A run that loads its model otherwise (QLoRA: quantized by bitsandbytes, straight onto its device)
wraps the recipe's ``build`` in :func:`model_options`: every model (not tokenizer, not config)
loaded inside takes those keywords too, so the recipes need not know of it. The dtype the weights
load in (``--weights-dtype``, :mod:`memfit.step.weights`) is set the same way, by
:func:`loaded_in`: a transformers model takes it as ``dtype``, a SentenceTransformer in its
``model_kwargs``; outside of it a model loads in fp32.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import torch

from memfit import progress
from memfit.errors import UsageError
from memfit.models.folder import (
    check_for_loader,
    hub_ids,
    hub_off,
    is_hub_id,
    load_checked,
    model_config,
    unreachable_line,
)
from memfit.models.hub import LOOKUP, hub_offline_reason

T = TypeVar("T")

FLAG = "--model"

# the keywords every model load takes while :func:`model_options` is active
_MODEL_OPTIONS: ContextVar[dict[str, Any] | None] = ContextVar("memfit_model_options", default=None)
# the dtype every model loads in while :func:`loaded_in` is active: fp32 otherwise (master weights
# under mixed precision; transformers 5 alone would load a checkpoint in its stored dtype)
_LOAD_DTYPE: ContextVar[torch.dtype] = ContextVar("memfit_load_dtype", default=torch.float32)


@contextmanager
def model_options(options: dict[str, Any]) -> Iterator[None]:
    """While active, :func:`load_pretrained` passes ``options`` to every model's
    ``from_pretrained`` (an ``AutoModelFor…`` or a model class), and to nothing else."""
    token = _MODEL_OPTIONS.set(dict(options))
    try:
        yield
    finally:
        _MODEL_OPTIONS.reset(token)


@contextmanager
def loaded_in(dtype: torch.dtype) -> Iterator[None]:
    """While active, :func:`load_pretrained` loads every model's weights in ``dtype`` (a
    transformers model's ``dtype``, a SentenceTransformer's ``model_kwargs``), unless the call or
    :func:`model_options` names another."""
    token = _LOAD_DTYPE.set(dtype)
    try:
        yield
    finally:
        _LOAD_DTYPE.reset(token)


def _loads_a_sentence_transformer(loader: Callable[..., Any]) -> bool:
    """Whether ``loader`` is sentence-transformers' ``SentenceTransformer`` (named: the package is
    optional)."""
    return isinstance(loader, type) and any(
        k.__name__ == "SentenceTransformer" and k.__module__.startswith("sentence_transformers")
        for k in loader.__mro__
    )


def _loads_a_model(loader: Callable[..., Any]) -> bool:
    """Whether ``loader`` is the ``from_pretrained`` of a transformers model class."""
    owner = getattr(loader, "__self__", None)
    if not isinstance(owner, type):
        return False
    # start-up: transformers' model classes are loaded when a run loads a model
    from transformers import PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return issubclass(owner, (PreTrainedModel, _BaseAutoModelClass))


def offline() -> bool:
    """Whether the Hub is off limits (``HF_HUB_OFFLINE=1``): load from the local cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def check_folder(loader: Callable[..., Any], folder: Path) -> None:
    """The checks of a local ``--model`` folder that ``loader`` is about to read."""
    check_for_loader(loader, folder, FLAG, without="training would start from random weights")


def load_pretrained(loader: Callable[..., T], model: str, **kwargs: Any) -> T:
    """``loader(model, **kwargs)`` (a ``from_pretrained`` or ``SentenceTransformer``), with a
    local folder checked first and the not-found case turned into a UsageError instead of a
    traceback. A Hub id loads from the local Hugging Face cache where it is there, else is
    downloaded where the Hub answers, else is one line at once (:func:`_by_name`)."""
    # transformers logs a page of hints before raising; the one line below says it all
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if offline():
        kwargs.setdefault("local_files_only", True)
    options = _MODEL_OPTIONS.get()
    if _loads_a_model(loader):
        # the run's (:func:`loaded_in`), fp32 by default: transformers 5 would load a checkpoint
        # in its stored dtype, bfloat16 for today's decoders, whatever the run trains in
        kwargs.setdefault("dtype", _LOAD_DTYPE.get())
        if options:
            kwargs = {**kwargs, **options}
    elif _loads_a_sentence_transformer(loader):
        # its Transformer module passes model_kwargs to from_pretrained (its other modules
        # follow the first one's dtype)
        model_kwargs = dict(kwargs.get("model_kwargs") or {})
        model_kwargs.setdefault("dtype", _LOAD_DTYPE.get())
        kwargs["model_kwargs"] = model_kwargs
    local = Path(model).expanduser().is_dir()
    if local:
        check_folder(loader, Path(model).expanduser())
    # a new task head is what the run trains; missing weights of the body are refused
    return load_checked(
        (lambda: loader(model, **kwargs)) if local else (lambda: _by_name(loader, model, kwargs)),
        model,
        FLAG,
        without="training would start them from random weights",
        # not a folder: transformers/huggingface_hub raise OSError subclasses for "not found"
        not_found=None if local else functools.partial(_not_found, model),
    )


def _by_name(loader: Callable[..., T], model: str, kwargs: dict[str, Any]) -> T:
    """``loader`` on Hub id ``model`` (not a folder): from the local Hugging Face cache where its
    files are there (under the name given, or a registry name's current Hub id: no request to
    the Hub), else downloaded by ``loader`` where the Hub answers (a status line says so), else
    a UsageError at once: why, and what to give instead (:func:`memfit.models.folder.
    unreachable_line`: the installed folder of all-MiniLM-L6-v2)."""
    if not is_hub_id(model):
        # a path that is not there ("./runs/x", "/data/m"): no Hub would have it
        raise UsageError(f"{FLAG}: cannot load {model!r}: no such folder, and not a Hub id")
    ids = hub_ids(model)
    for repo in ids:
        try:
            with hub_off():
                return loader(repo, **{**kwargs, "local_files_only": True})
        except OSError:
            continue  # not (wholly) in the cache: the Hub, if it answers
    reason = hub_offline_reason()
    if reason is None and kwargs.get("local_files_only"):
        reason = "local_files_only=True"
    if reason is not None:
        raise UsageError(unreachable_line(model, FLAG, reason))
    repo = ids[-1]
    # the files may take minutes: a command's status line says why it waits
    downloading = f"downloading {repo} from the Hugging Face Hub"
    with progress.status(downloading) if progress.is_open() else nullcontext():
        return loader(repo, **kwargs)


def checkpoint_config(model: str) -> Any | None:
    """The transformers config of ``--model`` (a folder's, a sentence-transformers folder's
    Transformer module's, or a Hub id's in the cache), read before the model loads, for the
    dtype its checkpoint is stored in (:func:`memfit.step.weights.checkpoint_dtype`); None where
    none can be read (the model's load then says why)."""
    folder = Path(model).expanduser()
    try:
        if folder.is_dir():
            return model_config(folder, FLAG)[1]
        # start-up: transformers' Auto classes are loaded when a run builds a model
        from transformers import AutoConfig

        return load_pretrained(AutoConfig.from_pretrained, model)
    except (UsageError, OSError, ValueError):
        return None


def _not_found(model: str, exc: OSError) -> str:
    """The line for a ``--model`` that is no folder and that the Hub, which answered, could not
    give (no such repository, a gated one, a file it lacks): what it said."""
    text = str(exc).strip()
    said = text.splitlines()[0] if text else type(exc).__name__
    registry = ""
    if model.strip().lower() in LOOKUP:
        registry = (
            " (memfit's registry knows its architecture, for estimate and plan, but holds no "
            "weights)"
        )
    return (
        f"{FLAG}: cannot load {model!r}{registry}: not a local folder, and the Hugging Face Hub "
        f"did not give it: {said}"
    )
