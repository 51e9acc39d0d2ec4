"""Let ``memfit.estimate(...)`` and ``memfit.plan(...)`` be both a package and a function.

Importing a subpackage binds it as an attribute of its parent, so after ``import
memfit.estimate`` the name ``memfit.estimate`` is the package, not the function of the same name.
The package's module object is given a class whose ``__call__`` runs that function.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    __entry__: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.__entry__)(*args, **kwargs)


def make_callable(module_name: str, entry: str) -> None:
    """Calling the module ``module_name`` calls its attribute ``entry``."""
    module = sys.modules[module_name]
    module.__class__ = _CallableModule
    module.__entry__ = entry  # type: ignore[attr-defined]
