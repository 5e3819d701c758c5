"""A rank's pending local pipeline as DuckDB SQL, fused into the next operator's query.

A group-by (or a whole-frame ``agg``) runs its per-rank aggregation in DuckDB.  When the frame
it reads still has pending filters and projections, running them first materializes a full
copy of the surviving rows (TPC-H Q1: 98% of 3M rows, 77-94 ms per rank) only for DuckDB to scan
them again.  Instead the steps become a ``WITH`` clause of the aggregation's own query: DuckDB
filters and computes inside its scan, and nothing is copied.

The steps are rebuilt from the Arrow expression trees (``exprtree``) with Arrow's meaning:
Kleene logic is SQL's, a NaN compares as IEEE 754 says (DuckDB orders NaN above numbers),
``is_in`` of a null is true or false, ``if_else`` on a null condition is null, LIKE keeps its
backslash escape.  Integer arithmetic that Arrow wraps on overflow (``pc.add``...) and integer
division are left out (DuckDB fails on overflow and divides integers as floats); the checked
variants (what ``+ - *`` on expressions make) fail on overflow in both.  Anything else raises
``Untranslatable`` and the pipeline runs as before.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .exprtree import Node, Untranslatable, plain_type, tree
from .kernels import quote_ident as _quote_ident

__all__ = ["SqlInput", "Untranslatable", "pipeline_sql"]


@dataclass
class SqlInput:
    """Rows to read in a DuckDB query: ``source`` (an Arrow table, registered as ``<name>__src``)
    through ``select`` (SQL over ``{src}``, and over ``{j0}``, ``{j1}``... the tables of its
    joins, ``joined``), whose result has ``schema``'s columns."""

    source: pa.Table
    select: str
    schema: pa.Schema
    joined: tuple[pa.Table, ...] = ()

    def with_clause(self, name: str) -> tuple[str, dict[str, pa.Table]]:
        """(``name AS (...)``, the tables it reads by the names it gives them)."""
        tables = {f"{name}__src": self.source, **{f"{name}__j{i}": t for i, t in enumerate(self.joined)}}
        # the placeholders by a pattern, not str.format: a string literal may hold braces
        names = {"src": _quote_ident(f"{name}__src")}
        names.update({f"j{i}": _quote_ident(f"{name}__j{i}") for i in range(len(self.joined))})
        return f"{_quote_ident(name)} AS ({self.select.format(**names)})", tables


def quote_ident(name: str) -> str:
    """An identifier inside a template (``pipeline_sql``'s result, filled by ``str.format``):
    braces in a column's name are doubled, so they stay text."""
    return _brace(_quote_ident(name))


def _brace(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


_JOINS = {"inner": "JOIN", "left": "LEFT JOIN", "semi": "SEMI JOIN", "anti": "ANTI JOIN"}


def pipeline_sql(source_schema: pa.Schema, steps: Sequence[Any], wanted: Sequence[str]) -> str:
    """The steps (``plan.Filter`` / ``plan.Project`` / ``plan.Join``) over a relation ``{src}``
    of ``source_schema``'s columns as one SELECT of ``wanted``; ``Untranslatable`` otherwise.
    The k-th join reads its table as ``{jk}``."""
    from .plan import Filter, Join

    schema, relation, joins = source_schema, "{src}", 0
    for step in steps:
        if isinstance(step, Filter):
            relation = f"(SELECT * FROM {relation} WHERE {_sql(tree(step.expr), schema)})"
            continue
        if isinstance(step, Join):
            cond = " AND ".join(
                f"l.{quote_ident(a)} IS NOT DISTINCT FROM r.{quote_ident(b)}"
                for a, b in zip(step.left_on, step.right_on)
            )
            cols = [f"l.{quote_ident(c)}" for c in step.left_out] + [f"r.{quote_ident(c)}" for c in step.right_out]
            table = "{j%d}" % joins
            relation = f"(SELECT {', '.join(cols) or 'NULL AS __px_none'} FROM {relation} l {_JOINS[step.how]} {table} r ON {cond})"
            schema = step.output_schema(schema)
            joins += 1
            continue
        cols, fields = [], []
        for o in step.outputs:
            if o.passes is not None:
                cols.append(f"{quote_ident(o.passes)} AS {quote_ident(o.name)}")
                fields.append(schema.field(o.passes).with_name(o.name))
            else:
                cols.append(f"{_sql(tree(o.expr), schema)} AS {quote_ident(o.name)}")
                fields.append(pa.field(o.name, _arrow_type(o.expr, schema)))
        relation = f"(SELECT {', '.join(cols) or 'NULL AS __px_none'} FROM {relation})"
        schema = pa.schema(fields)
    return f"SELECT {', '.join(quote_ident(c) for c in wanted)} FROM {relation}"


def _arrow_type(expr: Any, schema: pa.Schema) -> pa.DataType:
    from .plan import evaluate

    return evaluate(schema.empty_table(), expr).type


_SQL_TYPES = {
    pa.int8(): "TINYINT",
    pa.int16(): "SMALLINT",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.uint8(): "UTINYINT",
    pa.uint16(): "USMALLINT",
    pa.uint32(): "UINTEGER",
    pa.uint64(): "UBIGINT",
    pa.float32(): "FLOAT",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
    pa.string(): "VARCHAR",
    pa.large_string(): "VARCHAR",
    pa.date32(): "DATE",
}


def _string(s: str) -> str:
    """A string literal inside a template (braces doubled: a user's '{j0}' stays text)."""
    return _brace("'" + s.replace("'", "''") + "'")


def _literal(s: pa.Scalar) -> str:
    kind = _SQL_TYPES.get(s.type)
    if kind is None:
        raise Untranslatable(f"a literal of type {s.type}")
    v = s.as_py()
    if v is None:
        return f"CAST(NULL AS {kind})"
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, float):
        text = repr(v) if math.isfinite(v) else {"nan": "nan", "inf": "inf", "-inf": "-inf"}[repr(v)]
        return f"CAST({_string(text)} AS {kind})"
    if isinstance(v, int):
        return f"CAST({v} AS {kind})"
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, dt.date):
        return f"DATE {_string(v.isoformat())}"
    raise Untranslatable(f"a literal {v!r}")


_COMPARE = {"equal": "=", "not_equal": "<>", "less": "<", "less_equal": "<=", "greater": ">", "greater_equal": ">="}
_CHECKED = {"add_checked": "+", "subtract_checked": "-", "multiply_checked": "*"}
_FLOAT_ONLY = {"add": "+", "subtract": "-", "multiply": "*", "divide": "/", "divide_checked": "/"}


def _sql(n: Node, schema: pa.Schema) -> str:
    """One tree as a DuckDB SQL expression over ``schema``'s columns."""
    from .plan_polars import is_float  # types of subtrees, asked of Polars on no rows

    if n.kind == "field":
        if n.name not in schema.names or not plain_type(schema.field(n.name).type):
            raise Untranslatable(f"column {n.name!r}")
        return quote_ident(n.name)
    if n.kind == "literal":
        return _literal(n.value)
    args = [_sql(a, schema) for a in n.args]
    name, o = n.name, n.value
    if name in _COMPARE and len(args) == 2:
        a, b = args
        out = f"({a} {_COMPARE[name]} {b})"
        nan = [f"isnan({x})" for x, side in zip(args, n.args) if is_float(side, schema)]
        if not nan:
            return out
        verdict = "TRUE" if name == "not_equal" else "FALSE"
        return f"(CASE WHEN {a} IS NULL OR {b} IS NULL THEN NULL WHEN {' OR '.join(nan)} THEN {verdict} ELSE {out} END)"
    if name in ("and_kleene", "or_kleene") and len(args) == 2:
        return f"({args[0]} {'AND' if name == 'and_kleene' else 'OR'} {args[1]})"
    if name == "invert" and len(args) == 1:
        return f"(NOT {args[0]})"
    if name in _CHECKED and len(args) == 2:
        return f"({args[0]} {_CHECKED[name]} {args[1]})"
    if name in _FLOAT_ONLY and len(args) == 2 and is_float(n, schema):  # a float side: as in Arrow
        return f"({args[0]} {_FLOAT_ONLY[name]} {args[1]})"
    if name == "negate" and len(args) == 1:
        return f"(-{args[0]})"
    if name == "abs" and len(args) == 1:
        return f"abs({args[0]})"
    if name in ("is_null", "is_valid") and len(args) == 1:
        return f"({args[0]} IS {'NOT ' if name == 'is_valid' else ''}NULL)"
    if name in ("year", "month", "day") and len(args) == 1:
        return f"CAST({name}({args[0]}) AS BIGINT)"
    if name == "if_else" and len(args) == 3:
        c, a, b = args
        return f"(CASE WHEN {c} THEN {a} WHEN NOT {c} THEN {b} END)"
    if name in ("coalesce", "fill_null") and args:
        return f"COALESCE({', '.join(args)})"
    if o is not None and len(args) == 1:
        return _with_options(name, args[0], o)
    raise Untranslatable(f"function {name!r}")


def _with_options(name: str, a: str, o: Any) -> str:
    fields = {f.name for f in o.type}
    if name in ("match_like", "starts_with", "ends_with", "match_substring"):
        pattern, ignore_case = o["pattern"].as_py(), o["ignore_case"].as_py()
        if name == "match_like":
            return f"({a} {'ILIKE' if ignore_case else 'LIKE'} {_string(pattern)} ESCAPE '\\')"
        if ignore_case:
            raise Untranslatable("a case-insensitive match")
        fn = {"starts_with": "starts_with", "ends_with": "suffix", "match_substring": "contains"}[name]
        return f"{fn}({a}, {_string(pattern)})"
    if name == "is_in" and "null_matching_behavior" in fields:
        values = o["value_set"]
        kind = values.type.value_type
        if o["null_matching_behavior"].as_py() != 0 or not plain_type(kind) or pa.types.is_floating(kind):
            raise Untranslatable("is_in of floats (NaN), or other than null_matching_behavior=MATCH")
        items = values.values
        has_null = "TRUE" if items.null_count else "FALSE"
        kept = [_literal(v) for v in items.drop_null()]
        inside = f"{a} IN ({', '.join(kept)})" if kept else "FALSE"
        return f"(CASE WHEN {a} IS NULL THEN {has_null} ELSE {inside} END)"
    if name == "utf8_slice_codeunits":
        start, stop, step = (o[k].as_py() for k in ("start", "stop", "step"))
        if step != 1 or start < 0 or stop < start:
            raise Untranslatable("utf8_slice_codeunits with a negative start or a step")
        return f"substring({a}, {start + 1}, {stop - start})"
    if name == "cast":
        to = o["to_type"].type
        if not pa.types.is_floating(to):
            raise Untranslatable("a cast to a type other than floating point")
        return f"CAST({a} AS {_SQL_TYPES[to]})"
    raise Untranslatable(f"function {name!r}")
