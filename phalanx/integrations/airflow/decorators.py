"""``@task.phalanx``: a TaskFlow function that runs on every rank of a gang.

::

    from airflow.sdk import dag, task

    @task.phalanx(ranks=2, outputs=["totals"])
    def totals(env, tx):                  # tx: an upstream task's dataset, as a px.DataFrame
        return tx.groupby("user_id").agg({"amount": "sum"})

    totals(tx=generate.output["transactions"])   # or tx=<a manifest>, tx="SESSION/NAME"

The function is called as ``fn(env, **arguments)`` on every rank.  Arguments that name store
datasets (an upstream task's manifest or output entry, ``{"dataset": ..., "by": [...]}``)
arrive as ``px.DataFrame`` read through ``env.input``; any other argument arrives as it was
given.  A returned frame is sealed as the task's only output (``outputs``, default the
function's name); a ``{name: frame}`` dict seals each.  The function travels to the ranks by
value (DAG files are not importable there).  Options as ``PhalanxStageOperator`` (ranks, site,
stage_params, deferrable, poll_interval, cancel_on_kill, ...).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

try:
    from airflow.sdk.bases.decorator import DecoratedOperator, task_decorator_factory
except ImportError as exc:  # pragma: no cover - without the extra
    from ...errors import MissingDependencyError

    raise MissingDependencyError("the Airflow provider needs apache-airflow 3: pip install 'phalanx[airflow]'") from exc

from ._rank import TaskFlowApp
from .operators import PhalanxStageOperator, is_dataset


def _arguments_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in with ``fn``'s signature less its first parameter (``env``: given on the
    ranks), against which Airflow checks the call's arguments."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise TypeError(
            f"@task.phalanx function {fn.__qualname__} must take the rank's env first: def {fn.__name__}(env, ...)"
        )

    def stand_in(*args: Any, **kwargs: Any) -> Any:  # never called: only its signature is read
        raise RuntimeError("runs on the ranks")

    stand_in.__signature__ = sig.replace(parameters=params[1:])  # type: ignore[attr-defined]  # read by inspect.signature; not in a function's type
    stand_in.__name__, stand_in.__qualname__ = fn.__name__, fn.__qualname__
    stand_in.__module__, stand_in.__doc__ = fn.__module__, fn.__doc__
    stand_in.__wrapped__ = fn  # type: ignore[attr-defined]  # its source for the UI; not in a function's type
    return stand_in


class _PhalanxDecoratedOperator(DecoratedOperator, PhalanxStageOperator):
    custom_operator_name = "@task.phalanx"
    template_fields: Sequence[str] = (*DecoratedOperator.template_fields, *PhalanxStageOperator.template_fields)
    template_fields_renderers = {
        **DecoratedOperator.template_fields_renderers,
        **PhalanxStageOperator.template_fields_renderers,
    }

    def __init__(self, *, python_callable: Callable[..., Any], outputs: Sequence[str] | None = None, **kwargs: Any):
        self.rank_function = python_callable
        super().__init__(
            python_callable=_arguments_only(python_callable),
            outputs=list(outputs) if outputs is not None else [python_callable.__name__],
            **kwargs,
        )

    def _stage_spec(self, context: Any, session: str) -> tuple[dict[str, Any], Any]:
        bound = inspect.signature(self.python_callable).bind(*self.op_args, **self.op_kwargs)
        datasets = {k: v for k, v in bound.arguments.items() if is_dataset(v)}
        values = {k: v for k, v in bound.arguments.items() if k not in datasets}
        self.app = f"{self.rank_function.__module__}:{self.rank_function.__qualname__}"
        self.inputs = dict(datasets)
        spec, _ = super()._stage_spec(context, session)
        return spec, TaskFlowApp(self.rank_function, list(datasets), values, list(self.outputs or []))


def phalanx_task(
    python_callable: Callable[..., Any] | None = None, multiple_outputs: bool | None = None, **kwargs: Any
):
    """``@task.phalanx(ranks=4, outputs=[...], site=..., stage_params={...}, deferrable=...)``."""
    # the task returns one manifest: never unrolled into XComs per key (a "-> dict" annotation would)
    return task_decorator_factory(
        python_callable=python_callable,
        multiple_outputs=False if multiple_outputs is None else multiple_outputs,
        decorated_operator_class=_PhalanxDecoratedOperator,
        **kwargs,
    )
