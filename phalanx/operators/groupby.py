"""Distributed ``groupby(...).agg(...)``: partial aggregates, shuffle by key, combine.

Every aggregation is written as partial columns plus a combine step, so the same final step
serves both plans: pre-aggregating locally (few distinct keys: the shuffle shrinks) and
shuffling raw rows (mostly unique keys: a local pass would not shrink anything).  ``first``/
``last`` follow the frame's row order across ranks through a global row id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from . import kernels
from .common import ROWID, check_columns, with_rowid
from .exchange import gather_tables
from .shuffle import shuffle_table

if TYPE_CHECKING:
    from .dataframe import DataFrame

FUNCS = ("sum", "count", "mean", "min", "max", "first", "last", "size")
_SAMPLE_ROWS = 100_000
_UNIQUE_RATIO_FOR_RAW = 0.5  # above this share of distinct keys, pre-aggregation is skipped


@dataclass(frozen=True)
class Agg:
    out: str
    column: str | None  # None for size
    func: str


def parse_spec(spec: Mapping[str, Any] | None, named: Mapping[str, Any]) -> list[Agg]:
    """{"v": "sum", "w": ["min", "max"]} and/or out=("v", "sum") → a list of Agg."""
    aggs: list[Agg] = []
    for col, funcs in (spec or {}).items():
        if isinstance(funcs, str):
            aggs.append(Agg(col, col, funcs))
        else:
            aggs.extend(Agg(f"{col}_{f}", col, f) for f in funcs)
    for out, pair in named.items():
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"agg: named aggregation {out}= needs a (column, function) tuple, got {pair!r}")
        aggs.append(Agg(out, pair[0], pair[1]))
    if not aggs:
        raise ValueError("agg: no aggregations given")
    for a in aggs:
        if a.func not in FUNCS:
            raise ValueError(f"agg: unknown function {a.func!r} for column {a.column!r}; supported: {', '.join(FUNCS)}")
    return [Agg(a.out, None if a.func == "size" else a.column, a.func) for a in aggs]


class GroupBy:
    def __init__(self, df: DataFrame, keys: list[str], dropna: bool = True, combine: bool | None = None):
        if not keys:
            raise ValueError("groupby: give at least one key column")
        check_columns(df.schema, keys, "groupby")
        self.df, self.keys, self.dropna, self.combine = df, keys, dropna, combine

    def agg(self, spec: Mapping[str, Any] | None = None, **named: Any) -> DataFrame:
        aggs = parse_spec(spec, named)
        check_columns(self.df.schema, [a.column for a in aggs if a.column], "groupby.agg")
        check_outputs(aggs, self.keys, "groupby.agg")
        return self.df._new(aggregate(self.df, self.keys, aggs, self.dropna, self.combine), self.keys)

    def _all(self, func: str, numeric_only: bool) -> DataFrame:
        cols = [
            f.name
            for f in self.df.schema
            if f.name not in self.keys
            and (
                not numeric_only
                or pa.types.is_integer(f.type)
                or pa.types.is_floating(f.type)
                or pa.types.is_boolean(f.type)
            )
        ]
        return self.agg({c: func for c in cols})

    def sum(self) -> DataFrame:
        return self._all("sum", True)

    def mean(self) -> DataFrame:
        return self._all("mean", True)

    def min(self) -> DataFrame:
        return self._all("min", False)

    def max(self) -> DataFrame:
        return self._all("max", False)

    def count(self) -> DataFrame:
        return self._all("count", False)

    def first(self) -> DataFrame:
        return self._all("first", False)

    def last(self) -> DataFrame:
        return self._all("last", False)

    def size(self) -> DataFrame:
        return self.agg(size=(None, "size"))


def _p(a: Agg, part: str) -> str:
    return f"__px_{a.out}__{part}"


def _row_partial_sql(a: Agg, src: pa.Schema) -> list[str]:
    """The partial columns of one aggregation for every row, as DuckDB SQL: what the combine
    step aggregates when raw rows are shuffled (or aggregated where they are)."""
    q = kernels.quote_ident
    c = q(a.column) if a.column else ""
    name = lambda part: q(_p(a, part))  # noqa: E731
    present = f"CAST({c} IS NOT NULL AS BIGINT)"
    if a.func == "size":
        return [f"CAST(1 AS BIGINT) AS {name('n')}"]
    if a.func in ("sum", "mean"):
        value = f"CAST({c} AS BIGINT)" if pa.types.is_boolean(src.field(a.column).type) else c
        return [f"{value} AS {name('sum')}"] + ([f"{present} AS {name('n')}"] if a.func == "mean" else [])
    if a.func == "count":
        return [f"{present} AS {name('n')}"]
    if a.func in ("min", "max"):
        return [f"{c} AS {name('v')}"]
    # first / last: the value and the row id it came from, skipping nulls like pandas
    return [f"{c} AS {name('v')}", f"CASE WHEN {c} IS NOT NULL THEN {q(ROWID)} END AS {name('rid')}"]


def _final_sql(a: Agg, src: pa.Schema) -> str:
    """The combine step of one aggregation as DuckDB SQL over the partial columns."""
    q = kernels.quote_ident
    col = lambda part: q(_p(a, part))  # noqa: E731
    if a.func in ("size", "count"):
        expr = f"CAST(COALESCE(SUM({col('n')}), 0) AS BIGINT)"
    elif a.func == "sum":
        t = src.field(a.column).type
        if pa.types.is_integer(t) or pa.types.is_boolean(t):
            expr = f"CAST(COALESCE(SUM(CAST({col('sum')} AS BIGINT)), 0) AS BIGINT)"
        else:
            expr = f"COALESCE(SUM({col('sum')}), 0)"
    elif a.func == "mean":
        expr = f"CAST(SUM({col('sum')}) AS DOUBLE) / NULLIF(SUM({col('n')}), 0)"
    elif a.func in ("min", "max"):
        expr = f"{a.func.upper()}({col('v')})"
    else:  # first / last: the value with the smallest / largest global row id
        pick = "arg_min" if a.func == "first" else "arg_max"
        expr = f"{pick}({col('v')}, {col('rid')}) FILTER (WHERE {col('rid')} IS NOT NULL)"
    return f"{expr} AS {q(a.out)}"


def _output_schema(keys: list[str], aggs: list[Agg], src: pa.Schema) -> pa.Schema:
    """Keys and min/max/first/last keep their column's type (DuckDB returns its own)."""
    fields = [src.field(k) for k in keys]
    fields += [pa.field(a.out, src.field(a.column).type) for a in aggs if a.func in ("min", "max", "first", "last")]
    return pa.schema(fields)


def check_outputs(aggs: list[Agg], keys: Sequence[str], op: str) -> None:
    outs = [a.out for a in aggs]
    clash = sorted({o for o in outs if o in keys or outs.count(o) > 1})
    if clash:
        raise ValueError(
            f"{op}: output column(s) {clash} clash with a group key or "
            "each other; name them, e.g. agg(v_min=('v', 'min'))"
        )


def aggregate_all(df: DataFrame, aggs: list[Agg]) -> pa.Table:
    """Aggregates over the whole frame (no keys): one row, on rank 0; other ranks hold none.

    Each rank reduces its partition to one row of partials; rank 0 receives the P rows and
    combines them with the same final step a group-by uses (so sum of nothing is 0, min of
    nothing is null, as pandas and SQL give)."""
    comm = df.env.comm
    table = df.to_arrow()
    needed = list(dict.fromkeys(a.column for a in aggs if a.column)) or table.column_names[:1]
    if not needed:
        raise ValueError("agg: the frame has no columns")
    table = table.select(needed)
    if any(a.func in ("first", "last") for a in aggs):
        table = with_rowid(table, comm.rank)
    partial = kernels.run_sql(
        f"SELECT {', '.join(e for a in aggs for e in _partial_sql(a, table.schema))} FROM __px_t", __px_t=table
    )
    partials = gather_tables(comm, partial, root=0)
    query = f"SELECT {', '.join(_final_sql(a, table.schema) for a in aggs)} FROM __px_partial"
    # rank > 0: the same query over no rows, for the result's types
    final = kernels.run_sql(query, __px_partial=partial.slice(0, 0) if partials is None else partials)
    final = kernels.restore_types(final, _output_schema([], aggs, table.schema))
    return final if comm.rank == 0 else final.slice(0, 0)


def _use_combine(comm, table: pa.Table, keys: Sequence[str]) -> bool:
    """Pre-aggregate unless samples say keys are mostly distinct (nothing to combine).  Every
    rank votes from its own sample and all follow the majority: the partials' shape must be
    the same on every rank."""
    n = table.num_rows
    sample = table.slice(0, _SAMPLE_ROWS).select(list(keys)) if n else None
    local = sample is None or kernels.to_polars(sample).n_unique() / sample.num_rows < _UNIQUE_RATIO_FOR_RAW
    votes = comm.allreduce(np.array([int(local)], dtype=np.int64))
    return 2 * int(votes[0]) >= comm.world_size


def _partial_sql(a: Agg, src: pa.Schema) -> list[str]:
    """The per-group partial columns of one aggregation as DuckDB SQL (DuckDB aggregates Arrow in
    place; polars would first convert strings: TPC-H Q1's partial 0.22 s → see docs/performance.md)."""
    q = kernels.quote_ident
    c = q(a.column) if a.column else ""
    name = lambda part: q(_p(a, part))  # noqa: E731
    if a.func == "size":
        return [f"COUNT(*) AS {name('n')}"]
    if a.func in ("sum", "mean"):
        t = src.field(a.column).type
        whole = pa.types.is_integer(t) or pa.types.is_boolean(t)
        total = f"CAST(SUM(CAST({c} AS BIGINT)) AS BIGINT)" if whole else f"SUM({c})"
        return [f"{total} AS {name('sum')}"] + ([f"COUNT({c}) AS {name('n')}"] if a.func == "mean" else [])
    if a.func == "count":
        return [f"COUNT({c}) AS {name('n')}"]
    if a.func in ("min", "max"):
        return [f"{a.func.upper()}({c}) AS {name('v')}"]
    pick, edge = ("arg_min", "MIN") if a.func == "first" else ("arg_max", "MAX")
    nn = f"FILTER (WHERE {c} IS NOT NULL)"
    return [f"{pick}({c}, {q(ROWID)}) {nn} AS {name('v')}", f"{edge}({q(ROWID)}) {nn} AS {name('rid')}"]


def aggregate(df: DataFrame, keys: list[str], aggs: list[Agg], dropna: bool, combine: bool | None) -> pa.Table:
    comm = df.env.comm
    table = df.to_arrow()
    needed = list(dict.fromkeys(keys + [a.column for a in aggs if a.column]))
    table = table.select(needed)
    if any(a.func in ("first", "last") for a in aggs):
        table = with_rowid(table, comm.rank)
    keys_sql = ", ".join(kernels.quote_ident(k) for k in keys)
    where = " WHERE " + " AND ".join(f"{kernels.quote_ident(k)} IS NOT NULL" for k in keys) if dropna else ""
    rows = (
        f"SELECT {keys_sql}, {', '.join(e for a in aggs for e in _row_partial_sql(a, table.schema))} "
        f"FROM __px_t{where}"
    )  # pandas drops groups whose key is null unless dropna=False
    finals = ", ".join(_final_sql(a, table.schema) for a in aggs)
    # Already partitioned by these keys (world of one; after a merge on them): no shuffle, and
    # one DuckDB pass — the per-row partials are a projection it fuses into the aggregation.
    if comm.world_size == 1 or df.partitioned_by == tuple(keys):
        final = kernels.run_sql(f"SELECT {keys_sql}, {finals} FROM ({rows}) GROUP BY {keys_sql}", __px_t=table)
        return kernels.restore_types(final, _output_schema(keys, aggs, table.schema))
    if combine is None:
        combine = _use_combine(comm, table, keys)
    if combine:  # few groups: aggregate before the shuffle, which then moves one row per group
        parts = ", ".join(e for a in aggs for e in _partial_sql(a, table.schema))
        partial = kernels.run_sql(f"SELECT {keys_sql}, {parts} FROM __px_t{where} GROUP BY {keys_sql}", __px_t=table)
    else:  # mostly distinct keys: a local pass would not shrink anything
        partial = kernels.run_sql(rows, __px_t=table)
    partial = shuffle_table(comm, kernels.restore_types(partial, table.schema), keys)  # keys' types as given
    final = kernels.run_sql(f"SELECT {keys_sql}, {finals} FROM __px_partial GROUP BY {keys_sql}", __px_partial=partial)
    return kernels.restore_types(final, _output_schema(keys, aggs, table.schema))
