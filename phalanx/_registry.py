"""String-keyed registries of pluggable backends with lazy imports.

A site file names a backend (``communicator: mpi``); the registry maps that name to
``"module:attribute"`` and imports it only when asked, so ``import phalanx`` never pulls in
mpi4py, redis, ray and friends.  A missing optional dependency becomes an error that names
the extra to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import MissingDependencyError, PhalanxError


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, tuple[str, str | None]] = {}

    def register(self, name: str, target: str, extra: str | None = None) -> None:
        """Register ``name`` → ``"package.module:Attr"``; ``extra`` is the pip extra it needs."""
        self._entries[name] = (target, extra)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def load(self, name: str) -> Any:
        try:
            target, extra = self._entries[name]
        except KeyError:
            raise PhalanxError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
            ) from None
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f"pip install 'phalanx[{extra}]'" if extra else "check your installation"
            raise MissingDependencyError(
                f"{self.kind} {name!r} needs a package that is not installed "
                f"({exc.name or exc}); install it with: {hint}"
            ) from exc
        return getattr(module, attr)
