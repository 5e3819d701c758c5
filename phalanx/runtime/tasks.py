"""Turning what the driver sent into a callable, and failures into reports."""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import RankFailure


def resolve_app(app: object) -> Callable[..., Any]:
    """A callable as is, or ``"package.module:function"`` imported on this rank."""
    if callable(app):
        return app
    if not isinstance(app, str) or ":" not in app:
        raise TypeError(f"app must be a callable or 'package.module:function', got {app!r}")
    module_name, _, attr = app.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"app {app!r}: cannot import module {module_name!r}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"app {app!r}: module {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise TypeError(f"app {app!r} is not callable")
    return obj


def check_app(app: Any) -> None:
    """Driver-side check, so a non-callable app fails before any rank is bothered."""
    if callable(app):
        return
    if isinstance(app, str) and ":" in app:
        return
    raise TypeError(f"app must be a callable or 'package.module:function', got {app!r}")


def failure_from_exception(rank: int, exc: BaseException) -> RankFailure:
    from .gpu import annotate_oom

    note = annotate_oom(rank, exc)  # a CUDA out-of-memory names the rank, its device and memory
    message = f"{note}: {exc}" if note else str(exc)
    return RankFailure(rank=rank, exc_type=type(exc).__name__, message=message, traceback=format_exception(exc))


# phalanx's own frames around an app (file, function): the rank's loop that calls it, a
# workflow stage's and a Parsl app's wrappers, the notebook's that follows it.  A rank's
# traceback starts at the app.
_WRAPPERS = {
    (os.path.join("phalanx", "runtime", "worker.py"), "_serve"),
    (os.path.join("phalanx", "orchestrator", "stage.py"), "run_stage"),
    (os.path.join("phalanx", "observe", "tracing.py"), "traced_app"),  # a traced attempt's ranks
    (os.path.join("phalanx", "integrations", "parsl", "_rank.py"), "__call__"),
    (os.path.join("phalanx", "integrations", "jupyter", "ranks.py"), "__call__"),
}


def is_wrapper(frame: traceback.FrameSummary) -> bool:
    return any(frame.name == name and frame.filename.endswith(path) for path, name in _WRAPPERS)


def format_exception(exc: BaseException, hidden: Callable[[traceback.FrameSummary], bool] = is_wrapper) -> str:
    """The traceback of ``exc`` (and of its causes) as Python prints it, without the frames
    ``hidden`` picks: phalanx's wrappers of the app."""
    te = traceback.TracebackException.from_exception(exc)
    for t in _chain(te):
        t.stack = traceback.StackSummary.from_list([f for f in t.stack if not hidden(f)])
    return "".join(te.format())


def _chain(first: traceback.TracebackException) -> Iterator[traceback.TracebackException]:
    seen = set()
    te: traceback.TracebackException | None = first
    while te is not None and id(te) not in seen:
        seen.add(id(te))
        yield te
        te = te.__cause__ or te.__context__
