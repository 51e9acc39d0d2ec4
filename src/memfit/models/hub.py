"""Where a model's ``config.json`` is, without transformers: on disk, in the registry, on the Hub.

:func:`locate_config` finds it for :func:`memfit.models.resolve_model` (which then builds the
config with transformers) and for a verb that wants a bad name refused before torch is imported.
Folders, config files, memfit's registry and the local Hugging Face cache are read without any
network access. Only a Hub id found in none of them is asked of the Hub, and then only its
``config.json`` (a few kB), with ``huggingface_hub.hf_hub_download``: the user's token
(``HF_TOKEN`` or ``hf auth login``) opens gated repositories, the file lands in (and is read from)
the Hugging Face cache, a revision is ``owner/name@revision``, and ``HF_ENDPOINT`` points it at a
mirror. Whether the Hub answers is asked first, once per process and endpoint, with a short
timeout (:func:`hub_offline_reason`): unanswered, ``huggingface_hub`` would wait and retry for
long, and memfit must answer from its registry in under a second.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from memfit.errors import UsageError
from memfit.models.names import REGISTRY, stored_rows

# the answer of each endpoint asked in this process: None (it answered) or why it did not
_ANSWERS: dict[str, str | None] = {}
_ANSWERS_LOCK = threading.Lock()
# the config.json each Hub id fetched in this process came to: asked again (the verb first, then
# the estimator), the id is still said to come from the Hub, not from the cache it was put in
_FETCHED: dict[tuple[str, str], Path] = {}
_TRUE = ("1", "true", "yes", "on")


def hub_endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT`` as set now, else huggingface_hub's (huggingface.co)."""
    endpoint = os.environ.get("HF_ENDPOINT", "").strip()
    if endpoint:
        return endpoint.rstrip("/")
    # optional: huggingface_hub (which transformers installs)
    from huggingface_hub import constants

    return str(constants.ENDPOINT).rstrip("/")


def _offline_variable() -> str | None:
    """The variable that turns the Hub off (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``), if set.

    Read from the environment now, not only from huggingface_hub's constants, which it reads
    once, when it is first imported."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(variable, "").strip().lower() in _TRUE:
            return variable
    return None


def hub_offline_reason(timeout: float = 1.0) -> str | None:
    """None when the Hub answers within ``timeout`` seconds, else a short reason why not.

    "HF_HUB_OFFLINE=1 is set" (or ``TRANSFORMERS_OFFLINE``) costs nothing; otherwise one HEAD
    request goes to the endpoint (:func:`hub_endpoint`) through huggingface_hub's HTTP session
    (its proxies and client factory), and any HTTP answer, whatever its status, counts as an
    answer. The request runs in a daemon thread given ``timeout`` seconds in all, so that a name
    lookup that hangs (which no socket timeout bounds) cannot hold the caller longer. The answer is
    kept for the rest of the process, per endpoint.
    """
    variable = _offline_variable()
    if variable is not None:
        return f"{variable}=1 is set"
    try:
        # optional: huggingface_hub (which transformers installs)
        from huggingface_hub import constants
    except ImportError:
        return "huggingface_hub is not installed"
    if constants.is_offline_mode():  # set in this process (huggingface_hub read it at import)
        return "HF_HUB_OFFLINE=1 is set"
    endpoint = hub_endpoint()
    with _ANSWERS_LOCK:
        if endpoint in _ANSWERS:
            return _ANSWERS[endpoint]
    reason = _ask(endpoint, timeout)
    with _ANSWERS_LOCK:
        _ANSWERS[endpoint] = reason
    return reason


def _ask(endpoint: str, timeout: float) -> str | None:
    """One HEAD request to ``endpoint``; None when any HTTP answer comes within ``timeout``."""
    # optional: huggingface_hub (which transformers installs)
    from huggingface_hub.utils import get_session

    outcome: list[str | None] = []

    def request() -> None:
        try:
            get_session().head(endpoint, timeout=timeout, follow_redirects=False)
            outcome.append(None)
        except Exception as exc:  # refused, unresolvable, timed out, a proxy error: no answer
            outcome.append(str(exc) or type(exc).__name__)

    worker = threading.Thread(target=request, name="memfit-hub-probe", daemon=True)
    worker.start()
    worker.join(timeout)
    seconds = f"{timeout:g} s"
    if not outcome:
        return f"no answer from {endpoint} within {seconds}"
    if outcome[0] is None:
        return None
    return f"no answer from {endpoint} within {seconds}: {_short(outcome[0])}"


def _short(detail: str, limit: int = 80) -> str:
    detail = " ".join(detail.split())
    return detail if len(detail) <= limit else detail[: limit - 1] + "…"


def forget_answers() -> None:
    """Forget every endpoint's answer and every config fetched (for a process that changes
    ``HF_ENDPOINT``, or that goes on- or offline, as tests do)."""
    with _ANSWERS_LOCK:
        _ANSWERS.clear()
    _FETCHED.clear()


def fetch_config(model: str) -> Path | None:
    """Download Hub id ``model``'s ``config.json`` (only it) into the Hugging Face cache; its path.

    ``model`` is ``owner/name``, or ``owner/name@revision`` (a branch, tag or commit). Call it
    once :func:`hub_offline_reason` said the Hub answers. None when the Hub has no such
    repository (or none the user's token can see): the caller names what it looked for. Raises
    :class:`UsageError`, one line, for a gated repository, a revision or ``config.json`` the
    repository lacks, a token the Hub refuses, and a download that fails.
    """
    # optional: huggingface_hub (which transformers installs)
    from huggingface_hub import hf_hub_download
    from huggingface_hub import utils as hub_utils
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, _, revision = model.partition("@")
    endpoint = hub_endpoint()
    page = f"{endpoint}/{repo}"
    # no download bar for a file of a few kB: on a terminal it would cross memfit's status line
    silent = getattr(hub_utils, "silent_tqdm", None)
    quiet = {"tqdm_class": silent} if silent is not None else {}
    try:
        found = hf_hub_download(
            repo, "config.json", revision=revision or None, endpoint=endpoint, **quiet
        )
    # a GatedRepoError is a RepositoryNotFoundError, and every one of them an HfHubHTTPError: the
    # most specific first
    except GatedRepoError:
        raise UsageError(
            f"model {repo!r} is a gated repository on the Hugging Face Hub: accept its licence on "
            f"{page} and log in with that account (`hf auth login`, or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        return None
    except RevisionNotFoundError:
        raise UsageError(f"model {repo!r} has no revision {revision!r} on {page}") from None
    except RemoteEntryNotFoundError:
        raise UsageError(
            f"model {repo!r} on the Hugging Face Hub has no config.json, so memfit cannot tell its "
            "architecture (GGUF or other files transformers does not read?): pass a folder or a "
            "config.json path instead"
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status == 401:  # what the Hub answers a token it does not accept
            raise UsageError(
                f"the Hugging Face Hub refused your token for model {repo!r} (HTTP 401): log in "
                "again (`hf auth login`) or set HF_TOKEN to a valid token"
            ) from None
        raise UsageError(
            f"cannot fetch config.json of model {repo!r} from {endpoint}: HTTP {status}"
        ) from None
    except LocalEntryNotFoundError as exc:  # the Hub stopped answering, or answered as no Hub
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise UsageError(
            f"cannot fetch config.json of model {repo!r} from {endpoint}: {_short(str(cause))}"
        ) from None
    except (OSError, ValueError) as exc:  # a proxy error, an unwritable cache, a bad revision
        raise UsageError(
            f"cannot fetch config.json of model {repo!r} from {endpoint}: {_short(str(exc))}"
        ) from None
    return Path(found)


# every accepted registry name, lower-cased -> canonical name
LOOKUP: dict[str, str] = {
    alias.lower(): name for name, aliases in REGISTRY.items() for alias in (name, *aliases)
}


@dataclass(frozen=True)
class Located:
    """Where a model's config is: a file (``path``), or the registry (``path`` None)."""

    name: str  # the canonical name of a registry entry; else the model as given
    source: str  # "registry" | "local-folder" | "config-file" | "hf-cache" | "hub"
    path: Path | None  # the config.json; None for a registry entry (its config ships in memfit)


def locate_config(model: str) -> Located:
    """Find ``model``'s config.json: tried in order, a local folder holding it (a Hugging Face
    model folder or a sentence-transformers folder), a path to it, a name or alias in memfit's
    registry (case-insensitive), a Hub id in the local Hugging Face cache (all without network);
    then, for a Hub id, the Hub, if it answers (:func:`hub_offline_reason`).

    Raises :class:`UsageError`, one line, when none has it: where memfit looked, the registry's
    entries nearest to it, what to do; or what the Hub said (a gated repository, no config.json).
    """
    local = Path(model).expanduser()
    folder_config = folder_config_file(local) if local.is_dir() else None
    if folder_config is not None:
        return Located(str(local), "local-folder", folder_config)
    if local.is_file():
        return Located(str(local), "config-file", local)
    name = model.strip()
    canonical = LOOKUP.get(name.lower())
    if canonical is not None:
        return Located(canonical, "registry", None)
    fetched = _FETCHED.get((hub_endpoint(), name)) if _FETCHED else None
    if fetched is not None and fetched.is_file():
        return Located(name, "hub", fetched)
    cached = _hf_cache_config(name)
    if cached is not None:
        return Located(name, "hf-cache", cached)
    if not _is_hub_id(name):
        raise UsageError(unknown_model_message(model, local.is_dir(), None))
    reason = hub_offline_reason()
    if reason is not None:
        raise UsageError(unknown_model_message(model, local.is_dir(), reason))
    fetched = fetch_config(name)
    if fetched is None:  # no repository of that id (or none the user's token can see)
        raise UsageError(unknown_model_message(model, local.is_dir(), None, missing_on_hub=True))
    _FETCHED[hub_endpoint(), name] = fetched
    return Located(name, "hub", fetched)


def folder_config_file(folder: Path) -> Path | None:
    """config.json of a model folder; for sentence-transformers, of its Transformer module."""
    if (folder / "config.json").is_file():
        return folder / "config.json"
    # sentence-transformers: modules.json names the Transformer module's folder (0_Transformer)
    try:
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
        subdirs = [m["path"] for m in modules if str(m.get("type", "")).endswith("Transformer")]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        subdirs = []
    candidates = [folder / d / "config.json" for d in subdirs]
    candidates += sorted(folder.glob("*_Transformer/config.json"))
    return next((c for c in candidates if c.is_file()), None)


def _hf_cache_config(model: str) -> Path | None:
    """config.json of Hub id ``model`` (``owner/name[@revision]``) in the local Hugging Face
    cache; never downloads."""
    repo_id, _, revision = model.partition("@")
    try:
        # optional: huggingface_hub (which transformers installs); without it, no cache to read
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json", revision=revision or None)
    except Exception:  # an invalid repo id, no huggingface_hub, an unreadable cache
        return None
    return Path(found) if isinstance(found, str) else None


def _is_hub_id(model: str) -> bool:
    """Whether ``model`` can be a Hub id (``name`` or ``owner/name``, ``@revision`` allowed);
    a path that exists on no disk (``./runs/x``, ``/data/m``, ``config.json``) is not."""
    repo_id, at, revision = model.partition("@")
    if repo_id.endswith(".json") or (at and not revision):
        return False
    try:
        # optional: huggingface_hub (which transformers installs)
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(repo_id)
    except Exception:  # HFValidationError: a path, or a name the Hub does not allow
        return False
    return True


def unknown_model_message(
    model: str, is_dir: bool, offline: str | None, *, missing_on_hub: bool = False
) -> str:
    """The one line for a model found nowhere: where memfit looked, what it suggests, what to do.

    ``offline`` is why the Hub was not asked (None: it was, or ``model`` is no Hub id);
    ``missing_on_hub``: it was asked and has no such repository."""
    folder = "a folder without config.json" if is_dir else "not a folder with config.json"
    where = (
        f"unknown model {model!r}: {folder}, not a config.json file, not in memfit's offline "
        "registry, not in the local Hugging Face cache"
    )
    if missing_on_hub:
        repo = model.strip().partition("@")[0]
        where += (
            f", and the Hugging Face Hub ({hub_endpoint()}) has no repository {repo!r} (or it is "
            "private and your token, HF_TOKEN or `hf auth login`, cannot see it)"
        )
    elif offline is not None:
        where += f", and not fetched from the Hugging Face Hub ({offline})"
    suggestions = suggested_entries(model)
    hint = f" Did you mean: {', '.join(suggestions)}?" if suggestions else ""
    if offline is not None and offline.endswith("=1 is set"):
        todo = (
            " Pass the model's folder or a path to its config.json, or unset "
            f"{offline.split('=')[0]} to fetch its config.json from the Hub."
        )
    elif offline is not None:
        todo = (
            " Pass the model's folder or a path to its config.json, or retry where the Hub "
            "answers (memfit then fetches its config.json)."
        )
    else:
        todo = " A path to the model's config.json (or its folder) works too."
    return f"{where}.{hint}{todo} Known models: `memfit models` lists them."


# a size in a model id: "8B", "0.5B", "135M", "8x7B" (experts × size each), not "v0.3" or "2407"
_SIZE = re.compile(r"(?<![A-Za-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)([BbMm])(?![A-Za-z0-9])")
# how many registry entries an unknown model's line suggests
_SUGGESTED = 3


def size_in_name(model: str) -> float | None:
    """The parameter count a model id names ("Qwen3-8B" → 8e9, "8x7B" → 56e9), None if none."""
    found = _SIZE.findall(model.partition("@")[0].rpartition("/")[2])
    if not found:
        return None
    experts, number, unit = found[-1]
    return float(experts or 1) * float(number) * (1e9 if unit in "Bb" else 1e6)


def _name_words(name: str) -> list[str]:
    """The words of a model id's name, lower-cased, version digits cut off each
    ("Meta-Llama-3-8B" → meta, llama; "Qwen2.5-7B" → qwen; "e5-base-v2" → e5, base)."""
    base = name.partition("@")[0].rpartition("/")[2].lower()
    words = []
    for word in re.split(r"[-_. ]", base):
        if not re.match("[a-z]", word):  # "3", "8b", "2407": a version or a size
            continue
        cut = re.sub(r"\d+$", "", word)
        words.append(cut if len(cut) >= 2 else word)  # "e5" is a name, not "e" and a version
    return words


def family_entries(model: str) -> list[str]:
    """The registry's entries of ``model``'s family, in registry order: those whose canonical
    name begins with the first word of ``model``'s name that begins one ("Mistral-Nemo-Base" →
    mistral, "Meta-Llama-3-8B" → llama), else those of the same owner (as canonical name or
    alias); [] when none is."""
    families: dict[str, list[str]] = {}
    for canonical in REGISTRY:
        words = _name_words(canonical)
        if words:
            families.setdefault(words[0], []).append(canonical)
    for word in _name_words(model.strip()):
        if word in families:
            return families[word]
    owner = model.strip().partition("@")[0].rpartition("/")[0].lower()
    if not owner:
        return []
    return [
        canonical
        for canonical, aliases in REGISTRY.items()
        if any(alias.rpartition("/")[0].lower() == owner for alias in (canonical, *aliases))
    ]


def suggested_entries(model: str) -> list[str]:
    """Registry entries to suggest for an unknown model, each with its parameter count.

    Its family (:func:`family_entries`), nearest first to the size its id names (the counts of
    the registry's stored listing, ``memfit models``'s: nothing is built), or, when it names none,
    the most alike in spelling first; when no entry is of its family, the names most alike in
    spelling, as ``difflib`` finds them."""
    counts = {name: row.get("parameters") for name, row in stored_rows().items()}
    family = family_entries(model)
    size = size_in_name(model)
    lowered = model.strip().lower()
    if family and size is not None:

        def distance(name: str) -> float:
            # on a log scale: 7B is nearer 8B than 1.5B is, and 70B as far from 8B as 0.9B
            count = counts.get(name)
            return abs(math.log(count / size)) if isinstance(count, int) and count > 0 else math.inf

        chosen = sorted(family, key=distance)[:_SUGGESTED]
    elif family:
        likeness = {
            name: max(
                difflib.SequenceMatcher(None, lowered, alias.lower()).ratio()
                for alias in (name, *REGISTRY[name])
            )
            for name in family
        }
        chosen = sorted(family, key=lambda name: -likeness[name])[:_SUGGESTED]
    else:
        close = difflib.get_close_matches(lowered, list(LOOKUP), n=5, cutoff=0.6)
        chosen = list(dict.fromkeys(LOOKUP[c] for c in close))[:_SUGGESTED]
    return [_with_count(name, counts.get(name)) for name in chosen]


def _with_count(name: str, count: object) -> str:
    """``Qwen/Qwen2.5-7B (7.6B)``: a registry name and its parameter count, as ids write sizes."""
    if not isinstance(count, int) or count <= 0:
        return name
    if count >= 1e9:
        return f"{name} ({count / 1e9:.1f}B)"
    return f"{name} ({count / 1e6:.0f}M)"


__all__ = [
    "LOOKUP",
    "Located",
    "family_entries",
    "fetch_config",
    "folder_config_file",
    "forget_answers",
    "hub_endpoint",
    "hub_offline_reason",
    "locate_config",
    "size_in_name",
    "suggested_entries",
    "unknown_model_message",
]
