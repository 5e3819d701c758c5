"""Distributed ``groupby(...).agg(...)``: partial aggregates, shuffle by key, combine.

Every decomposable aggregation is written as partial columns plus a combine step, so the same
final step serves both plans: pre-aggregating locally (few distinct keys: the shuffle shrinks)
and shuffling raw rows (mostly unique keys: a local pass would not shrink anything).  ``first``/
``last`` follow the frame's row order across ranks through a global row id.  Holistic ones
(median, quantile, nunique: ``phalanx.operators.stats``) need a group's every row on one rank:
with any of them the raw rows are shuffled, once, for every aggregation of the call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import arrow_agg, kernels, stats
from .common import ROWID, check_columns, with_rowid
from .exchange import concat, exchange_tables, gather_tables
from .plan import note
from .ranges import rangeable
from .shuffle import shuffle_table

if TYPE_CHECKING:
    from .dataframe import DataFrame

FUNCS = ("sum", "count", "mean", "min", "max", "first", "last", "size") + stats.FUNCS
# the larger sample of the keys: counted by Arrow (at most 20k rows), not a DuckDB call over
# 100k rows (~10 ms of a 100k-group, 2M-row group-by a rank); Chao's estimate from it is within
# ~20% near the 50%-distinct line (2M rows, 800k groups: 0.445 for 0.367; 1M: 0.518 for 0.432),
# where pre-aggregating or not costs about the same
_SAMPLE_ROWS = 16_384
_QUICK_SAMPLE_ROWS = 2_000  # tried first (_use_combine)
_SPREAD_MIN_ROWS = 100_000  # a rank's raw rows from which one key's hash may do (_spread_by)
_UNIQUE_RATIO_FOR_RAW = 0.5  # above this share of distinct keys, pre-aggregation is skipped


@dataclass(frozen=True)
class Agg:
    out: str
    column: str | None  # None for size
    func: str
    other: str | None = None  # corr / cov: the second column
    q: float | None = None  # quantile (median: 0.5)
    ddof: int = 1  # std / var: divide the sum of squared deviations by n - ddof (pandas)

    @property
    def columns(self) -> list[str]:
        return [c for c in (self.column, self.other) if c is not None]

    def __str__(self) -> str:  # as the user wrote it, for error messages
        column = (self.column, self.other) if self.other else self.column
        extra = f", {self.q!r}" if self.func in stats.WITH_Q else f", {self.ddof!r}" if self.ddof != 1 else ""
        return f"{self.out}=({column!r}, {self.func!r}{extra})"


def parse_spec(spec: Mapping[str, Any] | None, named: Mapping[str, Any]) -> list[Agg]:
    """{"v": "sum", "w": ["min", "max"]} and/or out=("v", "sum") → a list of Agg.

    A quantile other than the median is a named 3-tuple, ``p90=("v", "quantile", 0.9)`` (a bare
    "quantile" is q=0.5, as in pandas; ``"quantile_approx"`` likewise); std and var take pandas'
    ``ddof`` the same way, ``s0=("v", "std", 0)`` (default 1); corr and cov name two columns,
    ``r=(("x", "y"), "corr")``."""
    aggs: list[Agg] = []
    for col, funcs in (spec or {}).items():
        if not isinstance(col, str):
            raise TypeError(
                f"agg: the keys of a dict spec are column names, got {col!r}; "
                "corr and cov of two columns are named: agg(r=(('x', 'y'), 'corr'))"
            )
        if isinstance(funcs, str):
            aggs.append(_agg(col, col, funcs))
        else:
            aggs.extend(_agg(f"{col}_{f}", col, f) for f in funcs)
    for out, value in named.items():
        if not (isinstance(value, tuple) and len(value) in (2, 3)):
            raise TypeError(
                f"agg: named aggregation {out}= needs a (column, function) tuple "
                f"(or (column, 'quantile', q), (column, 'std', ddof)), got {value!r}"
            )
        aggs.append(_agg(out, *value))
    if not aggs:
        raise ValueError("agg: no aggregations given")
    return aggs


def _agg(out: str, column: Any, func: Any, *q: Any) -> Agg:
    shown = (column, func, *q)
    if func not in FUNCS:
        raise ValueError(f"agg: unknown function {func!r} for column {column!r}; supported: {', '.join(FUNCS)}")
    if q and func not in (*stats.WITH_Q, *stats.WITH_DDOF):
        raise TypeError(
            f"agg: {out}={shown!r}: only 'quantile'/'quantile_approx' (its q) and 'std'/'var' (ddof) "
            "take a third element"
        )
    if func in stats.PAIRS:
        if not (isinstance(column, tuple) and len(column) == 2 and all(isinstance(c, str) for c in column)):
            raise TypeError(f"agg: {func} needs two columns, e.g. {out}=(('x', 'y'), {func!r}); got {column!r}")
        return Agg(out, column[0], func, other=column[1])
    if isinstance(column, tuple):
        raise TypeError(f"agg: {out}={shown!r}: only corr and cov take two columns")
    if func == "size":
        return Agg(out, None, func)
    if not isinstance(column, str):
        raise TypeError(f"agg: {out}={shown!r}: {func} needs a column name")
    if func in stats.QUANTILES:
        return Agg(out, column, func, q=_quantile_q(out, shown, q[0] if q else 0.5))
    if func in stats.WITH_DDOF and q:
        return Agg(out, column, func, ddof=_ddof(out, shown, q[0]))
    return Agg(out, column, func)


def _ddof(out: str, shown: tuple, ddof: Any) -> int:
    if isinstance(ddof, bool) or not isinstance(ddof, (int, np.integer)) or ddof < 0:
        raise ValueError(f"agg: {out}={shown!r}: ddof must be an integer >= 0, got {ddof!r}")
    return int(ddof)


def _quantile_q(out: str, shown: tuple, q: Any) -> float:
    if isinstance(q, bool) or not isinstance(q, (int, float, np.integer, np.floating)) or not 0 <= q <= 1:
        raise ValueError(f"agg: {out}={shown!r}: the quantile q must be a number in [0, 1], got {q!r}")
    return float(q)


def check_aggs(aggs: list[Agg], schema: pa.Schema, keys: Sequence[str], op: str) -> None:
    """Columns present, of a type the function takes, outputs distinct (the same error on
    every rank: the schema is agreed), before any communication."""
    check_columns(schema, [c for a in aggs for c in a.columns], op)
    for a in aggs:
        for c in a.columns:
            t = schema.field(c).type
            if a.func in stats.NUMERIC and not stats.is_numeric(t):
                raise TypeError(f"{op}: {a.func} needs a numeric column, but {c!r} of {a} is {t}")
            if a.func in stats.BOOLEAN and not pa.types.is_boolean(t):
                raise TypeError(f"{op}: {a.func} needs a boolean column, but {c!r} of {a} is {t}")
    check_outputs(aggs, keys, op)


class GroupBy:
    def __init__(self, df: DataFrame, keys: list[str], dropna: bool = True, combine: bool | None = None):
        if not keys:
            raise ValueError("groupby: give at least one key column")
        check_columns(df.schema, keys, "groupby")
        self.df, self.keys, self.dropna, self.combine = df, keys, dropna, combine

    def agg(self, spec: Mapping[str, Any] | None = None, **named: Any) -> DataFrame:
        """``agg({"v": ["sum", "std"]}, p90=("v", "quantile", 0.9), r=(("v", "w"), "corr"))``.

        Functions: sum, count, mean, min, max, first, last, size; std and var (ddof=1 unless
        given as a third element, as pandas), quantile_approx (merged per-rank sketches, error
        bound in ``stats.finish_sketches``), corr and cov (of the rows where both columns are set), any and all (boolean
        columns); median, quantile (DuckDB's ``quantile_cont``, pandas' 'linear') and nunique
        (nulls not counted) are holistic: with any of them raw rows are shuffled by key."""
        aggs = parse_spec(spec, named)
        check_aggs(aggs, self.df.schema, self.keys, "groupby.agg")
        holistic = [str(a) for a in aggs if a.func in stats.HOLISTIC]
        if self.combine is True and holistic:
            raise ValueError(
                f"groupby.agg: combine=True cannot pre-aggregate {', '.join(holistic)}: median, "
                "quantile and nunique need every row of a group; leave combine unset (or False)"
            )
        df = self.df
        placed = df._placed_by(self.keys)
        label = f"GroupBy {self.keys}: " + ", ".join(str(a) for a in aggs)
        if placed and df.env.comm.world_size > 1:
            label += f"\nno exchange: already partitioned by {list(placed)}"
        (table, result_placed), op = df._run(
            label, lambda: aggregate(df, self.keys, aggs, self.dropna, self.combine), fuses=True
        )
        return df._new(table, result_placed, op)

    def _all(self, func: str, numeric_only: bool, *arg: Any) -> DataFrame:
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
        return self.agg(None, **{c: (c, func, *arg) for c in cols}) if arg else self.agg({c: func for c in cols})

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

    def std(self, ddof: int = 1) -> DataFrame:
        """Every numeric column's standard deviation, divided by n - ``ddof`` (pandas)."""
        return self._all("std", True, *([ddof] if ddof != 1 else []))

    def var(self, ddof: int = 1) -> DataFrame:
        """Every numeric column's variance, divided by n - ``ddof`` (pandas)."""
        return self._all("var", True, *([ddof] if ddof != 1 else []))

    def median(self) -> DataFrame:
        return self._all("median", True)

    def nunique(self) -> DataFrame:
        return self._all("nunique", False)


def _p(a: Agg, part: str) -> str:
    return f"__px_{a.out}__{part}"


def _name(a: Agg):
    return lambda part: kernels.quote_ident(_p(a, part))


def _row_partial_sql(a: Agg, src: pa.Schema) -> list[str]:
    """The partial columns of one aggregation for every row, as DuckDB SQL: what the combine
    step aggregates when raw rows are shuffled (or aggregated where they are)."""
    q = kernels.quote_ident
    c = q(a.column) if a.column else ""
    name = _name(a)
    present = f"CAST({c} IS NOT NULL AS BIGINT)"
    if a.func in stats.FUNCS:
        return stats.row_partial_sql(a, name)
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


def _final_sql(a: Agg, src: pa.Schema, raw: bool) -> str:
    """The combine step of one aggregation as DuckDB SQL over the partial columns: the per-row
    ones (``raw``: ``_row_partial_sql``) or the per-group ones (``_partial_sql``)."""
    q = kernels.quote_ident
    col = _name(a)
    if a.func in stats.FUNCS:
        expr = stats.raw_sql(a, col) if raw else stats.combine_sql(a, col)
    elif a.func in ("size", "count"):
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


def _combine_source(aggs: list[Agg], keys: Sequence[str], table: str) -> str:
    """The partial rows to combine, with the group means Chan's formula centres on (var, std,
    cov, corr: a window over each group's partials) when any aggregation needs them."""
    over = f"(PARTITION BY {', '.join(kernels.quote_ident(k) for k in keys)})" if keys else "()"
    means = [w for a in aggs for w in stats.window_sql(a, _name(a), over)]
    return f"(SELECT *, {', '.join(means)} FROM {table})" if means else table


def _output_schema(keys: list[str], aggs: list[Agg], src: pa.Schema) -> pa.Schema:
    """Keys and min/max/first/last keep their column's type (DuckDB returns its own)."""
    fields = [src.field(k) for k in keys]
    fields += [pa.field(a.out, src.field(a.column).type) for a in aggs if a.func in ("min", "max", "first", "last")]
    fields += [pa.field(a.out, stats.output_type(a)) for a in aggs if a.func in stats.FUNCS]
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
    nothing is null, as pandas and SQL give).  nunique's partial is the count of the distinct
    values hashed to the rank (``stats.distinct_counts``: one exchange of distinct values),
    summed; median and quantile come from a radix selection (``stats.global_quantiles``)."""
    comm = df.env.comm
    check_aggs(aggs, df.schema, [], "agg")
    needed = list(dict.fromkeys(c for a in aggs for c in a.columns)) or df.columns[:1]
    if not needed:
        raise ValueError("agg: the frame has no columns")
    quantiles = [a for a in aggs if a.func in stats.QUANTILES]
    uniques = [a for a in aggs if a.func == "nunique"]
    plain = [a for a in aggs if a.func not in stats.HOLISTIC and a not in quantiles]
    # only plain aggregations read the rows in SQL alone: they can fuse the pending pipeline,
    # unless Arrow's kernels take them all (they read rows; see aggregate)
    in_arrow = len(plain) == len(aggs) and arrow_agg.eligible([], aggs, df.schema)
    fuse = len(plain) == len(aggs) and not in_arrow
    rows, src = _input(df, needed, any(a.func in ("first", "last") for a in aggs), fuse=fuse)
    partial = arrow_agg.partial_all(rows, aggs, _p) if in_arrow else None
    if partial is None:
        exprs = [e for a in plain for e in _partial_sql(a, src)] + ['COUNT(*) AS "__px_rows"']
        partial = kernels.run_sql(f"SELECT {', '.join(exprs)} FROM __px_t", __px_t=rows)
    table = rows  # a table wherever a holistic aggregation reads it (then nothing was fused)
    if uniques:
        counts = stats.distinct_counts(comm, table, list(dict.fromkeys(a.column or "" for a in uniques)))
        by_column = dict(zip(dict.fromkeys(a.column for a in uniques), counts))
        for a in uniques:
            partial = partial.append_column(_p(a, "n"), pa.array([by_column[a.column]], pa.int64()))
    values = stats.global_quantiles(comm, table, quantiles) if quantiles else []
    partials = gather_tables(comm, partial, root=0)
    # nunique's partials are counts of disjoint sets of values: summed as count's are
    combined = [replace(a, func="count") if a.func == "nunique" else a for a in aggs if a not in quantiles]
    finals = [_final_sql(a, src, raw=False) for a in combined] + ['COUNT(*) AS "__px_rows"']
    query = f"SELECT {', '.join(finals)} FROM {_combine_source(combined, [], '__px_partial')}"
    # rank > 0: the same step over no rows, for the result's types
    received = partial.slice(0, 0) if partials is None else partials
    final = arrow_agg.combine_all(received, combined, _p) if in_arrow else None
    if final is None:
        final = kernels.run_sql(query, __px_partial=received)
    for a, value in zip(quantiles, values):
        final = final.append_column(a.out, pa.array([value], pa.float64()))
    final = kernels.restore_types(final.select([a.out for a in aggs]), _output_schema([], aggs, src))
    return final if comm.rank == 0 else final.slice(0, 0)


def _use_combine(comm, table: pa.Table, keys: Sequence[str]) -> bool:
    """Pre-aggregate unless samples say keys are mostly distinct (nothing to combine).  Every
    rank votes from its own sample and all follow the majority: the partials' shape must be
    the same on every rank."""
    n = table.num_rows
    # a small sample first: where its keys repeat so often that even Chao's correction leaves
    # the groups a small share of the rows, the larger sample could not change the answer
    # (100 groups over 2M rows: 2 ms where the 100k-row sample took 11 ms).  A share of no
    # more rows than the small sample pre-aggregates unasked: counting its keys would cost as
    # much as combining them for nothing (a DuckDB call of ~1 ms either way)
    local = n <= _QUICK_SAMPLE_ROWS
    if not local:
        share = kernels.estimate_distinct(table, keys, _QUICK_SAMPLE_ROWS) / n
        local = share < _UNIQUE_RATIO_FOR_RAW / 10
        # the larger sample at most a sixteenth of the rows: counting a sample's keys costs
        # about what pre-aggregating as many rows does (TPC-H Q10's 7 keys, 115k rows a rank:
        # a 100k-row sample cost 55 ms, the whole group-by pre-aggregated 56-75, raw 91-110;
        # a 7k-row sample ~6 ms, its estimate within 10%)
        rows = min(_SAMPLE_ROWS, n // 16)
        if not local and rows > _QUICK_SAMPLE_ROWS:
            share = kernels.estimate_distinct(table, keys, rows) / n
        local = local or share < _UNIQUE_RATIO_FOR_RAW
    votes = comm.allreduce(np.array([int(local)], dtype=np.int64))
    return 2 * int(votes[0]) >= comm.world_size


def _partial_sql(a: Agg, src: pa.Schema) -> list[str]:
    """The per-group partial columns of one aggregation as DuckDB SQL (DuckDB aggregates Arrow in
    place; polars would first convert strings: TPC-H Q1's partial 0.22 s → see docs/performance.md)."""
    q = kernels.quote_ident
    c = q(a.column) if a.column else ""
    name = _name(a)
    if a.func in stats.FUNCS:
        return stats.partial_sql(a, name)
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


def _input(df: DataFrame, needed: list[str], rowid: bool, fuse: bool = True) -> tuple[Any, pa.Schema]:
    """The rows an aggregation's first query reads: the frame's pending pipeline fused into
    that query (``plan_sql``) where it can be (``fuse``, no row ids), else its rows (with a
    global row id column when ``rowid``); and their schema."""
    lazy = df._sql_input(needed) if fuse and not rowid else None
    if lazy is not None:
        df._fused()
        return lazy, lazy.schema
    table = df._rows_of(needed)
    if rowid:
        table = with_rowid(table, df.env.comm.rank)
    return table, table.schema


def _key_sample(df: DataFrame, rows: Any, keys: list[str]) -> pa.Table:
    """The key columns to estimate the number of groups from: for a fused pipeline the
    source's columns when the keys pass through unchanged (before its filters: an estimate),
    else the keys computed by DuckDB."""
    if isinstance(rows, pa.Table):
        return rows
    carried = [df._carried(k) for k in keys]
    if all(carried):
        return rows.source.select(carried).rename_columns(keys)
    return kernels.run_sql(f"SELECT {', '.join(kernels.quote_ident(k) for k in keys)} FROM __px_t", __px_t=rows)


def aggregate(
    df: DataFrame, keys: list[str], aggs: list[Agg], dropna: bool, combine: bool | None
) -> tuple[pa.Table, tuple[str, ...] | None]:
    """This rank's groups, and the keys the result is hash-placed by (None: each group is on
    one rank, by ranges)."""
    comm = df.env.comm
    needed = list(dict.fromkeys(keys + [c for a in aggs for c in a.columns]))
    # Arrow's hash aggregation where its answers are DuckDB's (decided from the schema: alike on
    # every rank, so the exchanged tables are); it reads rows, so the pipeline runs apart rather
    # than fused into SQL.  A rank with several threads keeps DuckDB where there may be many
    # groups (Arrow's threads merge their tables slowly: 4M groups 1.0 s against DuckDB's 0.78);
    # where a rank's steps differ (threads, a sum that could leave int64) the tables it sends
    # have the same schema
    in_arrow = arrow_agg.eligible(keys, aggs, df.schema)
    threads = kernels.rank_threads()
    placed = df._placed_by(keys)
    one_pass_in_duckdb = threads > 1 and (comm.world_size == 1 or bool(placed))  # fuse into it
    # a filter keeping most rows comes as a mask to Arrow's pass instead of a copy of the rows
    if in_arrow and threads == 1 and dropna:
        table, mask = df._rows_masked(needed)
        src = table.schema
    else:
        table, src = _input(
            df, needed, any(a.func in ("first", "last") for a in aggs), not in_arrow or one_pass_in_duckdb
        )
        mask = None

    kept_rows: list[pa.Table] = []

    def unmasked() -> Any:  # the rows the mask keeps, for the steps that do not take a mask
        if mask is None:
            return table
        if not kept_rows:
            kept_rows.append(table.filter(mask))
        return kept_rows[0]

    keys_sql = ", ".join(kernels.quote_ident(k) for k in keys)
    where = " WHERE " + " AND ".join(f"{kernels.quote_ident(k)} IS NOT NULL" for k in keys) if dropna else ""
    row_partials = ", ".join(e for a in aggs for e in _row_partial_sql(a, src))

    def rows_from(relation: str) -> str:  # pandas drops groups whose key is null unless dropna=False
        return f"SELECT {keys_sql}, {row_partials} FROM {relation}{where}"

    rows = rows_from("__px_t")
    schema = _output_schema(keys, aggs, src)
    raw_finals = ", ".join(_final_sql(a, src, raw=True) for a in aggs)
    # Already partitioned by these keys (world of one; after a merge on them), or each rank's
    # key range apart from the others' (data split by a sorted key): no shuffle, and one pass
    # (Arrow's, or DuckDB's, where the per-row partials are a projection fused into it).
    # (the ranges of rows a mask drops too: wider, so "apart" holds for the rows it keeps)
    ranged = None if placed or comm.world_size == 1 else _apart(df, table, keys, dropna, unmasked)
    if comm.world_size == 1 or placed or ranged is not None:
        inputs: dict[str, Any] = {"__px_t": table}  # the mask's rows, for the query below
        if ranged is not None and ranged[1:] != (None, None):  # edge keys moved: drop ours, add theirs
            key = ranged[0]
            relation, edge = _with_edges(*ranged[1:], kernels.quote_ident(key), src.field(key).type)
            rows = rows_from(relation)
            inputs.update(edge)
        final = None
        if threads == 1 and isinstance(table, pa.Table):
            # Arrow's aggregation; where it is not DuckDB's (a float key) or edge keys moved,
            # only where the rows lie in runs of the keys (else DuckDB)
            moved = ranged is not None and ranged[1:] != (None, None)
            mine = table
            if ranged is not None and moved:
                mine = _with_edge_rows(unmasked(), *ranged)
            runs_only = not in_arrow or moved
            final = _noted(arrow_agg.final(mine, keys, aggs, dropna, runs_only, None if moved else mask), mine)
        if final is None:
            inputs["__px_t"] = unmasked()
            final = kernels.run_sql(f"SELECT {keys_sql}, {raw_finals} FROM ({rows}) GROUP BY {keys_sql}", **inputs)
        return kernels.restore_types(final, schema), (None if ranged is not None else placed or tuple(keys))
    if combine is None:  # holistic aggregations (median, quantile, nunique) need the raw rows
        combine = not any(a.func in stats.HOLISTIC for a in aggs) and _use_combine(
            comm, _key_sample(df, table, keys), keys
        )
    note("pre-aggregated before the exchange" if combine else "raw rows exchanged (no pre-aggregation)")
    final = None
    placed_by = keys
    if combine:  # few groups: aggregate before the shuffle, which then moves one row per group
        partial = arrow_agg.partial(table, keys, aggs, dropna, _p, threads > 1, mask) if in_arrow else None
        partial = _noted(partial, table)
        if partial is None:
            parts = ", ".join(e for a in aggs for e in _partial_sql(a, src))
            query = f"SELECT {keys_sql}, {parts} FROM __px_t{where} GROUP BY {keys_sql}"
            partial = kernels.run_sql(query, __px_t=unmasked())
        partial = shuffle_table(comm, kernels.restore_types(partial, src), keys)  # keys' types as given
        final = arrow_agg.combine(partial, keys, aggs, _p) if in_arrow else None
        if final is None:
            finals = ", ".join(_final_sql(a, src, raw=False) for a in aggs)
            source = _combine_source(aggs, keys, "__px_partial")
            final = kernels.run_sql(
                f"SELECT {keys_sql}, {finals} FROM {source} GROUP BY {keys_sql}", __px_partial=partial
            )
            final = stats.finish_sketches(final, aggs)
    elif in_arrow:  # raw rows move as they are (no per-row partials), whatever a rank's threads
        kept = unmasked()
        placed_by = _spread_by(comm, kept, keys)
        rows_in = shuffle_table(comm, arrow_agg.without_null_keys(kept, keys) if dropna else kept, placed_by)
        final = _noted(arrow_agg.final(rows_in, keys, aggs, dropna), rows_in) if threads == 1 else None
        if final is None:
            final = kernels.run_sql(
                f"SELECT {keys_sql}, {raw_finals} FROM ({rows}) GROUP BY {keys_sql}", __px_t=rows_in
            )
    else:  # mostly distinct keys, or a holistic aggregation: a local pass would not help
        partial = shuffle_table(comm, kernels.restore_types(kernels.run_sql(rows, __px_t=table), src), keys)
        final = kernels.run_sql(
            f"SELECT {keys_sql}, {raw_finals} FROM __px_partial GROUP BY {keys_sql}", __px_partial=partial
        )
    return kernels.restore_types(final, schema), tuple(placed_by)


def _spread_by(comm: Any, table: pa.Table, keys: list[str]) -> list[str]:
    """The keys the raw rows are placed by: one of them alone where, on every rank's sample,
    it tells apart about as many groups as all of them (``kernels.spreading_keys``): equal
    keys still meet (equal keys, equal first key), and the rows' hash reads one column.
    Every rank votes; the first key all ranks name is taken."""
    if len(keys) == 1:
        return keys
    # few rows: all keys' hash costs less than the sample (~1.3 ms; TPC-H Q16's 60k a rank)
    mine = kernels.spreading_keys(table, keys) if table.num_rows >= _SPREAD_MIN_ROWS else [False] * len(keys)
    votes = comm.allreduce(np.array(mine, dtype=np.int64))
    return next(([k] for k, v in zip(keys, votes.tolist()) if v == comm.world_size), keys)


def _noted(result: pa.Table | None, rows: pa.Table) -> pa.Table | None:
    """An Arrow step's result, noted in the plan's explain where it ran."""
    if result is not None:
        note(f"per-rank aggregation (Arrow): {rows.num_rows} rows -> {result.num_rows} groups")
    return result


def _apart(
    df: DataFrame, rows: Any, keys: list[str], dropna: bool, kept: Callable[[], Any] | None = None
) -> tuple[str, Any, pa.Table | None] | None:
    """Whether equal keys are (nearly) on one rank already because each rank's values of the
    first integer or date key lie in a range no other rank's overlaps — a table split by row
    groups of a sorted key (TPC-H's lineitem by l_orderkey; Q10's rows of customers, grouped
    by the customer's key and six columns more); if so, (that key, the key value whose rows
    this rank gives away, the rows it received): a key two ranges share at their edge (a row
    group boundary in the middle of an order's lines) goes to the rank whose range starts
    lower, a few rows moved where the rest stay in place.  None when
    the ranges overlap more, or a null key sits on more than one rank and counts
    (dropna=False).  One allgather of (min, max) per rank; one small exchange for edge keys."""
    key = next((k for k in keys if rangeable(df.schema.field(k).type)), None)
    if key is None:
        return None  # decided alike on every rank (the schema is agreed): no round trip
    kind = df.schema.field(key).type
    if isinstance(rows, pa.Table):
        column = rows.column(key)
    else:  # a fused pipeline: the source's range holds the filtered one
        carried = df._carried(key)
        if carried is None:
            return None  # the same plan on every rank
        column = rows.source.column(carried)
    lo = hi = None
    if len(column) > column.null_count:
        bounds = pc.min_max(column)
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()  # ints or dates: ordered alike
    seen = df.env.comm.allgather_obj((lo, hi, bool(column.null_count)))
    if not dropna and sum(n for *_, n in seen) > 1:
        return None
    spans = sorted((a, b, r) for r, (a, b, _) in enumerate(seen) if a is not None)
    if not all(p[1] <= q[0] for p, q in zip(spans, spans[1:])):
        return None
    # a range starting at the value the range before it ends with: that key's rows move down
    owner: dict[int, int] = {}
    for p, q in zip(spans, spans[1:]):
        if p[1] == q[0]:
            owner[q[2]] = owner.get(p[2], p[2]) if p[0] == p[1] else p[2]
    note("no exchange: each rank's key range is apart from the others'" + (" (edge keys moved)" if owner else ""))
    comm = df.env.comm
    if not owner:
        return key, None, None
    key_sql = kernels.quote_ident(key)
    drop = lo if comm.rank in owner else None
    parts = [rows.schema.empty_table() for _ in range(comm.world_size)]
    if drop is not None:  # this rank's rows of its lowest key belong to the rank below
        edge_rows = kept() if kept is not None else rows  # not the rows a mask drops
        edge = kernels.run_sql(f"SELECT * FROM __px_t WHERE {key_sql} = {_key_literal(drop, kind)}", __px_t=edge_rows)
        parts[owner[comm.rank]] = kernels.restore_types(edge, parts[0].schema)
    received = concat(exchange_tables(comm, parts, parts[0].schema), parts[0].schema)
    return key, drop, received if received.num_rows else None


def _with_edges(drop: Any, received: pa.Table | None, key: str, kind: pa.DataType) -> tuple[str, dict]:
    """This rank's rows without the edge key it gave away, with the edge rows it received: a
    relation over ``__px_t`` (and ``__px_edge``), and the extra input."""
    selects = ["SELECT * FROM __px_t" + ("" if drop is None else f" WHERE {key} <> {_key_literal(drop, kind)}")]
    if received is None:
        return f"({selects[0]})", {}
    return f"({selects[0]} UNION ALL SELECT * FROM __px_edge)", {"__px_edge": received}


def _with_edge_rows(table: pa.Table, key: str, drop: Any, received: pa.Table | None) -> pa.Table:
    """``_with_edges`` over Arrow: this rank's rows without the edge key it gave away (its
    first rows, where the key is sorted), then the edge rows it received (its last key's)."""
    if drop is not None:
        kept = pc.fill_null(pc.not_equal(table.column(key), pa.scalar(drop, table.schema.field(key).type)), True)
        table = table.filter(kept)
    return table if received is None else pa.concat_tables([table, received])


def _key_literal(value: Any, kind: pa.DataType) -> str:
    return f"DATE '{value.isoformat()}'" if pa.types.is_date(kind) else str(int(value))
