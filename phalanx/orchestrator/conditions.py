"""``when:`` conditions: a small, safe subset of Python expressions over a stage's params and
the small results of upstream stages, evaluated by the driver when the stage is ready.

    when: "params.mode == 'full'"
    when: "len(suspicious) > 0 and max(metrics.accuracy) < 0.9"

Names: ``params`` (the stage's, an instance's item merged in), and datasets sealed by stages of
the workflow (a column is a list of its values, ``len(x)`` its rows); ``dataset("odd-name")``
reaches a dataset whose name is no Python identifier.  Allowed: literals, arithmetic,
comparisons, ``and``/``or``/``not``, ``x if c else y``, indexing, attributes (no ``_names``),
and the functions below.  Anything else (imports, lambdas, comprehensions, dunders) is refused
when the workflow is loaded, so a condition can neither run code nor surprise at run time.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from typing import Any

MAX_ROWS = 10_000  # a condition reads small results, never a whole table into the driver

FUNCTIONS: dict[str, Callable[..., Any]] = {
    f.__name__: f for f in (len, min, max, sum, abs, any, all, round, sorted, str, int, float, bool)
}
_ALLOWED = (
    ast.Expression,
    ast.BoolOp,
    ast.BinOp,
    ast.UnaryOp,
    ast.Compare,
    ast.IfExp,
    ast.Call,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Attribute,
    ast.Subscript,
    ast.Slice,
    ast.List,
    ast.Tuple,
    ast.operator,
    ast.boolop,
    ast.unaryop,
    ast.cmpop,
)


def parse_condition(text: str) -> ast.Expression:
    """The parsed condition, or ValueError saying what is not allowed in one."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an expression: {exc.msg} (column {exc.offset})") from None
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ValueError(f"{type(node).__name__} is not allowed in a condition")
        if isinstance(node, (ast.Pow, ast.LShift)):  # 10**10**10: a driver busy for good
            raise ValueError(f"{type(node).__name__} is not allowed in a condition")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise ValueError(f"attribute {node.attr!r} is not allowed in a condition")
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in (*FUNCTIONS, "dataset"):
                allowed = ", ".join([*FUNCTIONS, "dataset"])
                raise ValueError(f"a condition may call only {allowed}")
            if node.keywords:
                raise ValueError("keyword arguments are not allowed in a condition")
        if isinstance(node, ast.Name) and node.id.startswith("_"):
            raise ValueError(f"name {node.id!r} is not allowed in a condition")
    return tree


def datasets_named(text: str) -> set[str]:
    """Datasets a condition reads: its free names other than ``params`` and the functions, and
    the literal argument of every ``dataset("...")``."""
    tree = parse_condition(text)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id not in FUNCTIONS and node.id not in ("params", "dataset"):
            names.add(node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dataset":
            if (
                len(node.args) != 1
                or not isinstance(node.args[0], ast.Constant)
                or not isinstance(node.args[0].value, str)
            ):
                raise ValueError('dataset() takes one name in quotes: dataset("my-data")')
            names.add(node.args[0].value)
    return names


class Record:
    """A mapping seen with attributes too (``params.lr`` as ``params["lr"]``), nested ones alike."""

    def __init__(self, data: Mapping[str, Any], what: str):
        self._data, self._what = data, what

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        return self[key]

    def __getitem__(self, key: str) -> Any:
        if key not in self._data:
            raise KeyError(f"{self._what} has no {key!r} (it has: {', '.join(map(str, self._data)) or 'nothing'})")
        value = self._data[key]
        return Record(value, f"{self._what}.{key}") if isinstance(value, Mapping) else value

    def __len__(self) -> int:
        return self._rows if hasattr(self, "_rows") else len(self._data)

    def __repr__(self) -> str:
        return f"<{self._what}>"


class Result(Record):
    """A small dataset in a condition: each column a list of its values; ``len()`` its rows."""

    def __init__(self, table: Any, name: str):
        super().__init__({c: table.column(c).to_pylist() for c in table.column_names}, f"dataset {name!r}")
        self._rows = table.num_rows


def evaluate(text: str, params: Mapping[str, Any], read: Callable[[str], Any]) -> bool:
    """Whether the condition holds.  ``read(name)``: the sealed dataset as an Arrow table (at
    most ``MAX_ROWS`` rows).  Raises ValueError/KeyError/TypeError... saying what went wrong."""
    tree = parse_condition(text)
    results: dict[str, Result] = {}

    def dataset(name: str) -> Result:
        if name not in results:
            table = read(name)
            if table.num_rows > MAX_ROWS:
                raise ValueError(
                    f"dataset {name!r} has {table.num_rows:,} rows; a condition reads small results "
                    f"(at most {MAX_ROWS:,} rows): reduce it in a stage first"
                )
            results[name] = Result(table, name)
        return results[name]

    scope: dict[str, Any] = {"params": Record(params, "params"), "dataset": dataset, **FUNCTIONS}
    for name in datasets_named(text):
        if name.isidentifier() and name not in scope:
            scope[name] = _Lazy(dataset, name)
    code = compile(tree, "<when>", "eval")
    value = eval(code, {"__builtins__": {}}, _Scope(scope))  # only what parse_condition allows
    return bool(value)


class _Lazy:
    """A dataset name in a condition, read only when the expression gets to it (``a or b``)."""

    def __init__(self, load: Callable[[str], Result], name: str):
        self.load, self.name = load, name


class _Scope(dict):
    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        return value.load(value.name) if isinstance(value, _Lazy) else value
