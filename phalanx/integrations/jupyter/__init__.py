"""phalanx in Jupyter: ``%load_ext phalanx``, then ``%px_gang 4`` and ``%%px`` cells; ``px.Gang``
and run handles render in the notebook, ``gang.run`` shows each rank's progress and output live,
``px.run`` / ``px.submit`` a stage table and, at the end, the run's timeline.  See docs/jupyter.md.

Importing this package imports neither IPython nor ipywidgets (ranks import ``.ranks`` from it);
the modules that need them (``view``, ``magics``, ``kernel``) are imported inside a kernel only.

- ``settings``: knobs of the live views (``settings.widgets = False`` for HTML without
  ipywidgets; ``settings.show_after`` seconds before a run's live view appears...);
- ``progress(done, total, label)``: called by an app on a rank, a progress bar for that rank;
- ``frame(name, gang=None)``: a ``px.DataFrame`` that ``%%px`` cells made, seen from the driver
  (``.head()``, ``.collect(limit=...)`` → pandas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .ranks import progress


@dataclass
class Settings:
    """How the notebook views behave; change them on ``phalanx.integrations.jupyter.settings``."""

    live: bool = True  # show live views at all (False: gang.run prints as in a terminal)
    widgets: bool | None = None  # ipywidgets for live views; None: when installed
    show_after: float = 0.5  # seconds a run must take before its live view appears
    refresh_s: float = 0.25  # how often live views update
    drain_s: float = 3.0  # after a run, how long to wait for the ranks' last output lines
    fail_grace: float = 3.0  # %%px: after a rank raised, how long the others may take to finish
    preview_rows: int = 10  # rows of a DataFrame preview
    max_lines: int = 2000  # output lines kept per rank and run (all of them are in the logs)


settings = Settings()


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext phalanx`` (or ``%load_ext phalanx.integrations.jupyter``)."""
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .magics import unload

    unload(ipython)


def frame(name: str, gang: Any = None):
    """The ``px.DataFrame`` that ``%%px`` cells named ``name`` on ``gang`` (default: the current
    ``%px_gang``), seen from the driver: ``.head(n)``, ``.collect(limit=...)``, ``.num_rows``."""
    from .frames import RemoteFrame
    from .kernel import named

    return RemoteFrame(gang if gang is not None else named(), name)


__all__ = ["Settings", "frame", "load_ipython_extension", "progress", "settings", "unload_ipython_extension"]
