"""String-keyed registries of pluggable backends with lazy imports.

A site file names a backend (``communicator: mpi``); the registry maps that name to
``"module:attribute"`` and imports it only when asked, so ``import phalanx`` never pulls in
mpi4py, redis, ray and friends.  A missing optional dependency becomes an error that names
the extra to install.

Third-party packages add backends without touching phalanx, as dask's comm backends and
fsspec's filesystems do: an entry point in the registry's group (``phalanx.executors``,
``phalanx.communicators``, ``phalanx.tiers``...) named after the backend, whose value is the
``"module:Attr"`` target.  Built-in names win over entry points of the same name.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import MissingDependencyError, PhalanxError
from .extras import install_hint


class Registry:
    def __init__(self, kind: str, group: str | None = None):
        """``group``: the entry-point group third-party backends register under."""
        self.kind = kind
        self.group = group
        self._entries: dict[str, tuple[str, str | None]] = {}
        self._extras: dict[str, dict[str, str]] = {}  # name → other targets (its config model...)
        self._plugins_loaded = group is None

    def register(self, name: str, target: str, extra: str | None = None, **targets: str) -> None:
        """Register ``name`` → ``"package.module:Attr"``; ``extra`` is the pip extra it needs;
        ``targets``: further named targets that import without that extra (``config=...``)."""
        self._entries[name] = (target, extra)
        self._extras[name] = dict(targets)

    def _plugins(self) -> None:
        if self._plugins_loaded or self.group is None:
            return
        self._plugins_loaded = True
        from importlib.metadata import entry_points

        for ep in entry_points(group=self.group):
            self._entries.setdefault(ep.name, (ep.value, None))
            self._extras.setdefault(ep.name, {})

    def names(self) -> list[str]:
        self._plugins()
        return sorted(self._entries)

    def load(self, name: str, what: str | None = None) -> Any:
        """The target of ``name`` (``what``: one of its further targets, e.g. "config")."""
        if name not in self._entries:  # built-ins need no scan of installed distributions (a rank's start)
            self._plugins()
        try:
            target, extra = self._entries[name]
        except KeyError:
            raise PhalanxError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None
        if what is not None:
            if what not in self._extras[name]:
                return None
            target, extra = self._extras[name][what], None
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = install_hint(extra) if extra else "check your installation"
            raise MissingDependencyError(
                f"{self.kind} {name!r} needs a package that is not installed "
                f"({exc.name or exc}); install it with: {hint}"
            ) from exc
        return getattr(module, attr)
