"""Optional dependencies: whether one is installed, and the error that names the extra to install.

``pip install phalanx`` brings what dataframe stages need; training stages, the ``gloo``
communicator and each resource manager's client come with an extra (``phalanx[torch]``...).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from .errors import MissingDependencyError


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (torch takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a half-installed module
        return False


def install_hint(extra: str) -> str:
    """How to get the extra ``extra``."""
    return f"pip install 'phalanx[{extra}]'"


def missing(what: str, module: str, extra: str) -> str:
    """The message for ``what`` needing ``module`` from the extra ``extra``."""
    return f"{what} needs {module}, which is not installed here: {install_hint(extra)}"


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module``, or raise MissingDependencyError naming the extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name and module.split(".")[0] != exc.name.split(".")[0]:
            raise  # the module is there but one of its own imports failed: show that as it is
        raise MissingDependencyError(missing(what, module, extra)) from exc
