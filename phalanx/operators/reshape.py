"""Reshaping: ``concat`` (a union of frames), ``value_counts`` and ``pivot``.

- ``concat``: purely local, no rows move: each rank's partition is its partitions of the inputs,
  in input order.  Columns are matched by name, in order of first appearance; a column some
  frames lack is null in their rows (as pandas).  Types are unified as a ``merge`` unifies keys:
  ints widen (int32 + int64 → int64), ints and floats give floats, timestamps take the finer unit;
  anything else (a number and a string, say) is a TypeError naming the frame and column.  The
  result stays partitioned when every input is partitioned by the same keys of unchanged types.
- ``value_counts``: a group-by ``size`` (pre-aggregated before its one shuffle when keys repeat);
  ``sort=True`` then sorts globally (``sort_values``: a sample sort of the counted rows, rank 0
  holding the most frequent), by count (descending unless ``ascending``), ties by the values
  ascending; ``sort=False`` leaves the counts partitioned by the values.
- ``pivot``: the distinct values of ``columns`` are found collectively first (each rank's
  distinct values, one allgather; more than ``PIVOT_LIMIT`` is refused before any row moves).
  Then a group-by of (index, columns) aggregates, its result is hash-shuffled by ``index``
  (skipped when already partitioned by it or a subset of it) and every rank spreads its rows into
  one column per (value, distinct) in one DuckDB pass.  ``fill_value`` then replaces every missing
  cell as pandas' ``fillna`` does: no rows, a null aggregate, or NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from . import kernels
from .common import as_list, check_columns
from .exchange import allgather_tables
from .exchange import concat as concat_tables
from .join import _key_type

if TYPE_CHECKING:
    from .dataframe import DataFrame

PIVOT_LIMIT = 1000  # distinct values of `columns` a pivot accepts (one output column each)
PIVOT_FUNCS = ("sum", "mean", "count", "min", "max", "first", "last", "std", "var", "median", "nunique")
_CODE = "__px_pivot_code"


# ---- concat ------------------------------------------------------------------------------------
def concat(frames: Sequence[DataFrame]) -> DataFrame:
    """``px.concat([a, b, ...])``: the union of the frames' rows (collective; no rows move)."""
    if isinstance(frames, (str, bytes)) or not isinstance(frames, Sequence):
        raise TypeError(f"concat: needs a list of DataFrames, e.g. px.concat([a, b]), got {type(frames).__name__}")
    return concat_frames(list(frames))


def _unified_schema(frames: list[DataFrame]) -> pa.Schema:
    """Every name once, in order of first appearance, with the type all frames agree on."""
    types: dict[str, pa.DataType] = {}
    seen_in: dict[str, int] = {}
    for i, f in enumerate(frames):
        for field in f.schema:
            if field.name not in types or pa.types.is_null(types[field.name]):
                types[field.name], seen_in[field.name] = field.type, i
                continue
            if pa.types.is_null(field.type):
                continue
            try:
                types[field.name] = _key_type(types[field.name], field.type, field.name)
            except (TypeError, pa.ArrowTypeError, pa.ArrowInvalid):
                raise TypeError(
                    f"concat: column {field.name!r} is {types[field.name]} in frame {seen_in[field.name]} but "
                    f"{field.type} in frame {i}; cast one of them first"
                ) from None
    return pa.schema([pa.field(n, t) for n, t in types.items()])


def concat_frames(frames: list[DataFrame]) -> DataFrame:
    from .dataframe import DataFrame

    if not frames or not all(isinstance(f, DataFrame) for f in frames):
        got = [type(f).__name__ for f in frames]
        raise TypeError(f"concat: needs a list of one or more phalanx DataFrames, got {got}")
    env = frames[0].env
    for i, f in enumerate(frames):
        if f.env is not env:
            raise ValueError(f"concat: frame {i} belongs to another gang (env) than frame 0; concat frames of one gang")
    schema = _unified_schema(frames)
    keys = frames[0].partitioned_by
    kept = (
        keys
        if keys
        and all(
            f.partitioned_by == keys and all(f.schema.field(k).type == schema.field(k).type for k in keys)
            for f in frames
        )
        else None
    )

    def run() -> pa.Table:
        parts = [_conform(f.to_arrow(), schema) for f in frames]
        return concat_tables(parts, schema)

    table, op = frames[0]._run(f"Concat {len(frames)} frames (no exchange)", run, *frames[1:])
    return frames[0]._new(table, kept, op, *frames[1:])


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    columns = [
        table[f.name].cast(f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


# ---- value_counts ------------------------------------------------------------------------------
def value_counts(
    df: DataFrame, subset: str | Sequence[str] | None, normalize: bool, sort: bool, ascending: bool, dropna: bool
) -> DataFrame:
    """Rows per distinct ``subset`` (every column by default) as ``subset + [count]`` (or
    ``proportion``: the count over the counted rows, nulls excluded unless ``dropna=False``)."""
    cols = as_list(subset) or df.columns
    check_columns(df.schema, cols, "value_counts")
    out = "proportion" if normalize else "count"
    if out in cols:
        raise ValueError(f"value_counts: a counted column is named {out!r}; rename it first")
    counts = df.groupby(cols, dropna=dropna).agg(None, **{out: (None, "size")})
    if normalize:
        total = counts.agg(n=(out, "sum")).collect()
        n = int(total[0][0].as_py() or 0) if total is not None and total.num_rows else 0
        counts = counts.assign(**{out: pc.divide(pc.field(out).cast(pa.float64()), float(n or 1))})
    if not sort:
        return counts
    return counts.sort_values([out, *cols], ascending=[ascending] + [True] * len(cols))


# ---- pivot -------------------------------------------------------------------------------------
def _fill(fill_value: Any, t: pa.DataType, value: str, aggfunc: str) -> pa.Scalar | None:
    """``fill_value`` as a scalar of the cells' type (the same TypeError on every rank, before
    the pivot's shuffle, when it does not fit it exactly: 0.5 into integer counts, say)."""
    if fill_value is None:
        return None
    try:
        return pa.scalar(fill_value).cast(t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as exc:
        raise TypeError(
            f"pivot: fill_value={fill_value!r} does not fit the cells of {aggfunc}({value!r}), which are {t}: {exc}"
        ) from None


def _pivot_names(values: list[str], distinct: list[Any], index: list[str]) -> list[str]:
    labels = [str(d) for d in distinct]
    names = labels if len(values) == 1 else [f"{v}_{lab}" for v in values for lab in labels]
    clash = sorted({n for n in names if n in index or names.count(n) > 1})
    if clash:
        raise ValueError(f"pivot: output column(s) {clash} clash with the index or each other; rename first")
    return names


def _distinct(df: DataFrame, column: str, index: list[str]) -> pa.Array:
    """The sorted distinct non-null values of ``column`` in rows with a non-null index, over all
    ranks (one allgather of each rank's, at most ``PIVOT_LIMIT + 1`` of them); a ValueError on
    every rank beyond the limit."""
    table = df.to_arrow().select([*index, column])
    for k in index:
        if table[k].null_count:
            table = table.filter(pc.is_valid(table[k]))
    local = pc.unique(table[column]).drop_null()
    local = local.slice(0, PIVOT_LIMIT + 1)
    piece = pa.table({column: local})
    every = concat_tables(allgather_tables(df.env.comm, piece), piece.schema)[column]
    values = pc.unique(every)
    if len(values) > PIVOT_LIMIT:
        raise ValueError(
            f"pivot: column {column!r} has more than {PIVOT_LIMIT} distinct values (one output column each); "
            "pivot a column with fewer, or use groupby(index + [columns]) for a long result"
        )
    return values.take(pc.sort_indices(values))


def pivot(
    df: DataFrame,
    index: str | Sequence[str],
    columns: str,
    values: str | Sequence[str],
    aggfunc: str = "sum",
    fill_value: Any = None,
) -> DataFrame:
    """One row per ``index``, one column per distinct ``columns`` value (and ``values`` column:
    ``{value}_{distinct}`` with several, the distinct value alone with one), holding
    ``aggfunc`` of that value's rows; null where no row has that (index, distinct) pair, or
    ``fill_value`` there and wherever the aggregate is null or NaN (pandas' pivot_table).  Rows
    whose index or ``columns`` is null are left out (as pandas' pivot_table).  Partitioned by index."""
    keys, vals = as_list(index), as_list(values)
    if not isinstance(columns, str):
        raise TypeError(f"pivot: columns must be one column name, got {columns!r}")
    if not keys or not vals:
        raise ValueError("pivot: give index and values (column names)")
    if aggfunc not in PIVOT_FUNCS:
        raise ValueError(f"pivot: aggfunc must be one of {PIVOT_FUNCS}, got {aggfunc!r}")
    check_columns(df.schema, [*keys, columns, *vals], "pivot")
    if columns in keys or set(vals) & {*keys, columns}:
        raise ValueError(f"pivot: index {keys}, columns {columns!r} and values {vals} must be distinct columns")
    distinct = _distinct(df, columns, keys)
    names = _pivot_names(vals, distinct.to_pylist(), keys)
    parts = [f"__px_pivot_{i}" for i in range(len(vals))]
    grouped = df.groupby([*keys, columns]).agg(None, **{p: (v, aggfunc) for p, v in zip(parts, vals)})
    fills = [_fill(fill_value, grouped.schema.field(p).type, v, aggfunc) for p, v in zip(parts, vals)]
    placed = grouped.partitioned_by is not None and set(grouped.partitioned_by) <= set(keys)
    by_index = grouped if placed else grouped.shuffle(keys)
    q = kernels.quote_ident
    cells = [
        f"FIRST({q(p)}) FILTER (WHERE {q(_CODE)} = {j}) AS __px_cell_{i}_{j}"  # renamed after: names may be ''"
        for i, p in enumerate(parts)
        for j in range(len(distinct))
    ]
    keys_sql = ", ".join(q(k) for k in keys)
    query = f"SELECT {keys_sql}{''.join(', ' + c for c in cells)} FROM __px_t GROUP BY {keys_sql}"
    types = [by_index.schema.field(p).type for p in parts]
    like = pa.schema(
        [by_index.schema.field(k) for k in keys]
        + [pa.field(names[i * len(distinct) + j], types[i]) for i in range(len(vals)) for j in range(len(distinct))]
    )

    def spread(table: pa.Table) -> pa.Table:
        code = pc.index_in(table[columns], value_set=distinct)
        out = kernels.run_sql(query, __px_t=table.append_column(_CODE, code))
        out = kernels.restore_types(out.rename_columns(like.names), like)
        if fill_value is None:
            return out
        filled = out.columns[: len(keys)]
        for i, column in enumerate(out.columns[len(keys) :]):
            fill = fills[i // len(distinct)]
            if pa.types.is_floating(column.type):
                column = pc.if_else(pc.is_nan(column), fill, column)
            filled.append(pc.fill_null(column, fill))
        return pa.Table.from_arrays(filled, schema=out.schema)

    what = f"Pivot {columns!r} ({len(distinct)} distinct values) x {vals} into columns, by {keys} (no exchange)"
    table, op = by_index._run(what, lambda: spread(by_index.to_arrow()))
    return by_index._new(table, by_index.partitioned_by, op)
