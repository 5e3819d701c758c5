"""The rank side of ``@task.phalanx``: call the decorated function with its inputs (no Airflow here:
ranks never import it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class TaskFlowApp:
    """``fn(env, **arguments)`` on every rank: arguments that name store datasets arrive as
    ``px.DataFrame`` (``env.input(name)``), the others as they were given.  What ``fn``
    returns is sealed: a ``{name: frame}`` dict as any stage app's, or one frame as the
    stage's only output; ``None`` when the function sealed its outputs itself."""

    def __init__(self, fn: Callable[..., Any], datasets: list[str], values: dict[str, Any], outputs: list[str]):
        self.fn, self.datasets, self.values, self.outputs = fn, list(datasets), dict(values), list(outputs)
        self.__name__ = getattr(fn, "__name__", "app")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, env: Any) -> Any:
        kwargs = {**self.values, **{name: env.input(name) for name in self.datasets}}
        result = self.fn(env, **kwargs)
        if result is None or isinstance(result, dict):
            return result
        if len(self.outputs) == 1:
            return {self.outputs[0]: result}
        raise TypeError(
            f"{self.__qualname__} returned a {type(result).__name__}; with outputs {self.outputs} "
            "return a dict {output: frame}"
        )

    def __repr__(self) -> str:
        return f"<phalanx task {self.__qualname__}>"
