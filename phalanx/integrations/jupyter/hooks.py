"""What ``px.Gang`` and ``RunHandle`` ask of the notebook (``phalanx/__init__`` injects this
module into them): their HTML and text views, and — inside a Jupyter kernel only, from its main
thread — rank output grouped by rank and live views of runs.

Gangs and runs that other threads drive (a workflow's stages) get no live view: the run's own
stage table shows them.  Nothing here imports IPython unless a kernel runs this process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from . import kernel, settings
from .html import gang_html, gang_text, handle_html, handle_text

log = logging.getLogger("phalanx.jupyter")
__all__ = [
    "ViewOptions",
    "echo",
    "gang_html",
    "gang_text",
    "handle_html",
    "handle_text",
    "handle_view",
    "live_runs",
    "run_view",
    "view_options",
]


@dataclass
class ViewOptions:
    """How the next ``gang.run`` of this context is shown."""

    mode: str = "run"  # "run": the view renders itself at the end; "px": the %%px magic does
    title: str | None = None
    quiet: bool = False  # no view at all (a frame preview fetching rows)
    view: Any = None  # the view made for the run (read by the magic)


_options: ContextVar[ViewOptions | None] = ContextVar("phalanx_view_options", default=None)


@contextmanager
def view_options(**options: Any) -> Iterator[ViewOptions]:
    opts = ViewOptions(**options)
    token = _options.set(opts)
    try:
        yield opts
    finally:
        _options.reset(token)


def echo(gang: Any) -> Any:
    """A gang made in a kernel's cell: its rank lines go to the run shown (grouped by rank), or
    as in a terminal between runs; the kernel closes it at shutdown or once nothing refers to it."""
    if not kernel.main_thread_of_kernel():
        return None
    try:
        from .view import RankRouter

        kernel.adopt(gang)
        return RankRouter()
    except Exception as exc:  # the notebook's extras must never stop a gang
        log.warning("phalanx: no notebook view of gang output: %s", exc)
        return None


def run_view(gang: Any, app: Any) -> Any:
    """A live per-rank view of one ``gang.run`` (a context manager with ``.app``, the app to send)."""
    opts = _options.get() or ViewOptions()
    if opts.quiet or not settings.live or not kernel.main_thread_of_kernel():
        return None
    try:
        from .view import RankRouter, RunView

        router = gang.echo if isinstance(gang.echo, RankRouter) else None
        return RunView(gang, app, opts, router)
    except Exception as exc:
        log.warning("phalanx: no live view of this run: %s", exc)
        return None


def live_runs() -> bool:
    """Whether run handles made now get a live stage table."""
    return settings.live and kernel.main_thread_of_kernel()


def handle_view(handle: Any) -> Any:
    """A stage table of a run that updates while it runs and ends with its timeline."""
    if not live_runs():
        return None
    try:
        from .view import HandleView

        return HandleView(handle)
    except Exception as exc:
        log.warning("phalanx: no live view of run %s: %s", getattr(handle, "run_id", "?"), exc)
        return None
