"""Turning what the driver sent into a callable, and failures into reports."""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
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
    return RankFailure(
        rank=rank,
        exc_type=type(exc).__name__,
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )
