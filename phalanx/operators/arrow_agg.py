"""A group-by's and a global agg's per-rank steps in Arrow, where its answers are DuckDB's.

Why: one thread, 2M rows, sum + mean + count: 100 integer groups 22 ms in Arrow against 35
in DuckDB, 100k groups 60 against 101, 100 string groups 47 against 72; TPC-H Q1's partial
(2.9M rows, two string keys, six aggregations) 90 ms against 215 — DuckDB first copies Arrow's
strings into its own (docs/performance.md, "Group-bys and aggregates in Arrow").

What: the three steps of ``groupby.aggregate`` — the partials of each group from rows (before
the exchange), the combine of partials (after it), and the final values from rows (a frame
already placed by its keys) — for ``size``, ``count``, ``sum``, ``mean``, ``min`` and ``max``
over keys of integers, dates, booleans and strings, with the SQL of ``groupby._partial_sql`` /
``_final_sql``'s semantics: a sum of nothing is 0 in a final value and null in a partial, a
mean of nothing null, counts skip nulls (not NaN).  ``None`` where they could differ, and the
caller runs DuckDB: float keys (DuckDB groups -0.0 with 0.0 and every NaN together, Arrow by
bits), float min/max (NaN's order), other value types, and integer sums that could leave
int64 (DuckDB widens and fails loudly; Arrow would wrap).  The partials' types are DuckDB's —
int64 sums and counts, float64 float sums, min/max as the column — so ranks that chose
differently (one rank's sums could overflow) still exchange tables of one schema.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .kernels import exact_hash_type
from .membership import PROBE_ROWS, never_decreasing

if TYPE_CHECKING:
    from .groupby import Agg

__all__ = ["combine", "combine_all", "eligible", "final", "partial", "partial_all", "without_null_keys"]

_INT64_MAX = 2**63 - 1
_EMPTY_IS_NULL = pc.ScalarAggregateOptions(min_count=1)  # SUM(x): null for a group of nulls
_EMPTY_IS_ZERO = pc.ScalarAggregateOptions(min_count=0)  # COALESCE(SUM(x), 0)
_VALID_ONLY = pc.CountOptions(mode="only_valid")  # COUNT(DISTINCT x): nulls not counted


def _value_type(a: Agg, t: pa.DataType) -> bool:
    if a.func == "nunique":  # not floats: Arrow tells -0.0 from 0.0 and NaNs apart, pandas does not
        return exact_hash_type(t)
    if a.func in ("sum", "mean"):
        return pa.types.is_integer(t) or pa.types.is_float64(t)
    if a.func in ("min", "max"):  # floats: where no NaN (``_nan_in``)
        return pa.types.is_integer(t) or pa.types.is_date(t) or pa.types.is_float64(t)
    return a.func == "count"


def eligible(keys: Sequence[str], aggs: Sequence[Agg], schema: pa.Schema) -> bool:
    """Whether Arrow can run these steps over columns of these types (decided from the
    schema alone: the same on every rank); no keys: ``agg``'s one row (``partial_all``)."""
    if not all(exact_hash_type(schema.field(k).type) for k in keys):
        return False
    if not keys and any(a.func == "nunique" for a in aggs):  # agg's nunique: ``stats``
        return False
    return all(a.func == "size" or (a.column and _value_type(a, schema.field(a.column).type)) for a in aggs)


def _sums_fit(table: pa.Table, columns: Sequence[str]) -> bool:
    """Whether no sum of these integer columns can leave int64: the largest magnitude times
    the row count stays inside it."""
    for c in columns:
        col = table.column(c)
        if not pa.types.is_integer(col.type) or len(col) == col.null_count:
            continue
        bounds = pc.min_max(col)
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        if max(abs(lo), abs(hi)) * len(col) > _INT64_MAX:
            return False
    return True


def _group(
    table: pa.Table,
    keys: Sequence[str],
    specs: list[tuple[Any, str, Any]],
    threads: bool,
    runs_only: bool = False,
    mask: Any = None,
) -> list[pa.ChunkedArray] | None:
    """The key columns, then one column per spec (column, Arrow function, options); with
    ``runs_only``, None unless the rows are in runs of their key (``_group_runs``); with a
    ``mask``, of the rows it keeps (``_usable``)."""
    ascending = mask is not None and _sorted_first_key(table, keys)
    if ascending:  # runs beat a hash pass over all rows; the kept rows are still in key order
        table, mask = table.filter(mask), None
    in_runs = None if mask is not None else _group_runs(table, keys, specs, ascending)
    if in_runs is not None or runs_only:
        return in_runs
    coded = {}  # string keys of one byte a value, grouped as those bytes
    for k in keys:
        codes = _one_byte_codes(table.column(k))
        if codes is not None:
            coded[k] = table.schema.field(k).type
            table = table.set_column(table.schema.get_field_index(k), k, codes)
    if mask is not None:  # the rows masked out get a null key: one group, dropped after
        masked = min(keys, key=lambda k: table.schema.field(k).type.byte_width if _fixed(table, k) else 1 << 20)
        column = table.column(masked)
        nulled = pc.if_else(mask, column, pa.scalar(None, column.type))
        table = table.set_column(table.schema.get_field_index(masked), masked, nulled)
    unique, at = _distinct_specs(table, specs)
    out = table.group_by(list(keys), use_threads=threads).aggregate(
        [(c, fn) if opts is None else (c, fn, opts) for c, fn, opts in unique]
    )
    if mask is not None:
        out = out.filter(pc.is_valid(out.column(masked)))
    columns = out.columns
    # pyarrow puts the keys first (before 14: last); the aggregates keep the specs' order
    keys_first = out.column_names[: len(keys)] == list(keys)
    columns = columns if keys_first else columns[len(unique) :] + columns[: len(unique)]
    values = columns[len(keys) :]
    return [_from_codes(c, coded[k]) if k in coded else c for k, c in zip(keys, columns)] + [values[i] for i in at]


def _distinct_specs(table: pa.Table, specs: list[tuple[Any, str, Any]]) -> tuple[list[tuple[Any, str, Any]], list[int]]:
    """The specs Arrow computes, each once, and where each given spec's column is among them:
    a mean's sum is the sum's, and a count of a column with no null is the rows' count (TPC-H
    Q1's eleven specs are six; each costs Arrow about 5 ms over 3M rows)."""
    unique: list[tuple[Any, str, Any]] = []
    seen: dict[tuple[Any, str, int], int] = {}
    at = []
    for column, fn, opts in specs:
        if fn == "count" and opts is None and not table.column(column).null_count:
            column, fn = [], "count_all"
        key = (tuple(column) if isinstance(column, list) else column, fn, id(opts))
        if key not in seen:
            seen[key] = len(unique)
            unique.append((column, fn, opts))
        at.append(seen[key])
    return unique, at


def integer_or_date(kind: pa.DataType) -> bool:
    """A key type whose values order as integers (``ranges.rangeable``, runs, masked keys)."""
    return pa.types.is_integer(kind) or pa.types.is_date(kind)


def _fixed(table: pa.Table, key: str) -> bool:
    return integer_or_date(table.schema.field(key).type)


def _usable(table: pa.Table, keys: Sequence[str], dropna: bool, mask: Any) -> tuple[pa.Table, Any]:
    """The rows to group and a mask of those to keep (None: all).  Without a mask, rows with
    a null key are dropped here (``dropna``); with one (a filter not applied: the pipeline's
    ``run_deferring``), they are masked out instead — only under ``dropna``, where the
    group of rows masked out (a null key) is dropped as theirs is."""
    if mask is None:
        return (without_null_keys(table, keys) if dropna else table), None
    assert dropna, "a mask of rows needs dropna: the masked rows' null key would be a group"
    for k in keys:
        if table.column(k).null_count:
            mask = pc.and_(mask, pc.is_valid(table.column(k)))
    return table, mask


def _nan_in(table: pa.Table, columns: Sequence[str]) -> bool:
    """Whether a float column among these holds NaN: DuckDB's min/max order NaN above every
    number (max is NaN), Arrow's skip it — the rows go to DuckDB then (a rank's own choice:
    the partial columns' types are the same either way)."""
    for c in columns:
        col = table.column(c)
        if pa.types.is_floating(col.type) and len(col) > col.null_count and pc.any(pc.is_nan(col)).as_py():
            return True
    return False


def _one_byte_codes(column: pa.ChunkedArray) -> pa.ChunkedArray | None:
    """A string column whose every value is one byte long (a flag, a status: TPC-H Q1's two
    keys), as those bytes (uint8, no copy), or None.  Arrow's hash aggregation by two such keys
    over 3M rows: 43 ms as bytes, 70 as strings."""
    kind = column.type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)) or column.null_count:
        return None
    width = np.int64 if pa.types.is_large_string(kind) else np.int32
    chunks = []
    for chunk in column.chunks:
        offsets = np.frombuffer(chunk.buffers()[1], dtype=width)[chunk.offset : chunk.offset + len(chunk) + 1]
        if not len(chunk) or offsets[-1] - offsets[0] != len(chunk) or (np.diff(offsets) != 1).any():
            return None
        data = chunk.buffers()[2]
        chunks.append(pa.array(np.frombuffer(data, dtype=np.uint8)[offsets[0] : offsets[-1]]))
    return pa.chunked_array(chunks, pa.uint8())


def _from_codes(codes: pa.ChunkedArray, kind: pa.DataType) -> pa.ChunkedArray:
    """``_one_byte_codes`` undone: each byte a one-byte string of ``kind``."""
    values = codes.combine_chunks().to_numpy(zero_copy_only=False).astype(np.uint8)
    width = np.int64 if pa.types.is_large_string(kind) else np.int32
    offsets = np.arange(len(values) + 1, dtype=width)
    array = pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(offsets), pa.py_buffer(values.tobytes())])
    return pa.chunked_array([array], kind)


def _sorted_first_key(table: pa.Table, keys: Sequence[str]) -> bool:
    """Whether the first key is integer or date, without nulls, never decreasing down the rows
    (where ``_group_runs`` may apply)."""
    key = table.column(keys[0]) if keys else None
    if key is None or key.null_count or not _fixed(table, keys[0]) or table.num_rows < 2:
        return False
    return _ascending(key) is not None


def _ascending(key: pa.ChunkedArray) -> np.ndarray | None:
    """A key column without nulls as numpy values where they never decrease down the rows;
    None otherwise.  Its first rows are looked at first: an unsorted key is found out without
    converting all of them (2 ms of a 23 ms group-by of 2M rows in 100 groups)."""
    if not never_decreasing(_numbers(key.slice(0, PROBE_ROWS))):
        return None
    k = _numbers(key)
    return k if never_decreasing(k) else None


def _group_runs(
    table: pa.Table, keys: Sequence[str], specs: list[tuple[Any, str, Any]], ascending: bool = False
) -> list[Any] | None:
    """``_group``'s columns where the first key, integer or date without nulls, never decreases
    down the rows (a table sorted by it: TPC-H's lineitem by l_orderkey, time series by time)
    and any other key is constant in each of its runs: each group is a run of rows, reduced
    where it lies (numpy's ``reduceat``) with no hash table —
    750k groups of a rank's 3M lines 15 ms against 70 in Arrow's hash aggregation, 103 in
    DuckDB's.  None for another key, an unsorted one, or a spec it has no form for (a value
    type other than integer, float or date; min/max over nulls).  ``ascending``: the first key
    is known never to decrease (not checked again)."""
    if not keys or table.num_rows < 2:
        return None
    key = table.column(keys[0])
    kind = key.type
    if key.null_count or not integer_or_date(kind):
        return None
    k = _numbers(key) if ascending else _ascending(key)
    if k is None:
        return None
    change = k[1:] != k[:-1]
    if not all(_constant_in_runs(table.column(other), change) for other in keys[1:]):
        return None
    starts = np.concatenate(([0], np.flatnonzero(change) + 1))
    sizes = np.diff(np.append(starts, table.num_rows))
    at = pa.array(starts)
    out: list[Any] = [table.column(name).take(at) for name in keys]
    for column, fn, opts in specs:
        if fn == "count_all":
            out.append(pa.array(sizes, pa.int64()))
            continue
        values = table.column(column)
        vt = values.type
        if not (pa.types.is_integer(vt) or pa.types.is_floating(vt) or (pa.types.is_date(vt) and fn in ("min", "max"))):
            return None
        valid = None if not values.null_count else ~_numbers(pc.is_null(values))
        counts = sizes if valid is None else np.add.reduceat(valid.astype(np.int64), starts)
        if fn == "count":
            out.append(pa.array(counts, pa.int64()))
        elif fn == "sum":
            wide = (
                pa.float64()
                if pa.types.is_floating(vt)
                else pa.uint64()
                if pa.types.is_unsigned_integer(vt)
                else pa.int64()
            )
            x = _numbers((pc.fill_null(values, 0) if values.null_count else values).cast(wide))
            total = pa.array(np.add.reduceat(x, starts), wide)
            if opts is _EMPTY_IS_NULL and valid is not None:
                total = pc.if_else(pa.array(counts == 0), pa.scalar(None, wide), total)
            out.append(total)
        elif fn in ("min", "max") and valid is None and not pa.types.is_floating(vt):
            x = _numbers(values)
            reduce = np.minimum.reduceat if fn == "min" else np.maximum.reduceat
            out.append(pa.array(reduce(x, starts)).cast(vt))
        else:
            return None
    return out


def _constant_in_runs(column: pa.ChunkedArray, change: np.ndarray) -> bool:
    """Whether a column's value changes down the rows only where ``change`` (the first key's)
    does: then each run of the first key is one group of all the keys (a customer's name and
    address beside its key, TPC-H Q10).  Values compared as stored (a float's bits: NaN is
    itself, -0.0 not 0.0; nulls equal): where that differs from grouping, the check fails."""
    array = column.combine_chunks()
    if pa.types.is_floating(array.type):
        array = array.view({64: pa.int64(), 32: pa.int32(), 16: pa.int16()}[array.type.bit_width])
    after, before = array[1:], array[:-1]
    try:
        differs = pc.fill_null(pc.not_equal(after, before), True)
    except pa.ArrowNotImplementedError:
        return False
    if array.null_count:  # two nulls in a row are equal
        differs = pc.and_(differs, pc.invert(pc.and_(pc.is_null(after), pc.is_null(before))))
    return not bool((differs.to_numpy(zero_copy_only=False) & ~change).any())


def _numbers(column: Any) -> np.ndarray:
    """A column without nulls as numpy values (dates as their day numbers)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_date(array.type):
        array = array.cast(pa.int32() if pa.types.is_date32(array.type) else pa.int64())
    return array.to_numpy(zero_copy_only=False)


def without_null_keys(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """The rows whose keys are all set (``dropna=True``: pandas drops null-key groups)."""
    nulls = [k for k in keys if table.column(k).null_count]
    if not nulls:
        return table
    valid = pc.is_valid(table.column(nulls[0]))
    for k in nulls[1:]:
        valid = pc.and_(valid, pc.is_valid(table.column(k)))
    return table.filter(valid)


def _divide(total: pa.ChunkedArray, n: pa.ChunkedArray) -> pa.ChunkedArray:
    """CAST(total AS DOUBLE) / NULLIF(n, 0)."""
    n = pc.if_else(pc.equal(n, 0), pa.scalar(None, n.type), n)
    return pc.divide(total.cast(pa.float64(), safe=False), n.cast(pa.float64()))  # rounds, as DuckDB


def partial(
    table: pa.Table,
    keys: Sequence[str],
    aggs: Sequence[Agg],
    dropna: bool,
    p: Callable[[Agg, str], str],
    threads: bool,
    mask: Any = None,
) -> pa.Table | None:
    """Each group's partial columns from rows (those a ``mask`` keeps, if given), named
    ``p(agg, part)`` as in ``_partial_sql`` (``threads``: Arrow's pool, sized to the rank's
    share; worth it for few groups only)."""
    assert all(a.func != "nunique" for a in aggs), "a distinct count needs every row of a group"
    if not _sums_fit(table, [a.column for a in aggs if a.func in ("sum", "mean") and a.column]):
        return None
    if _nan_in(table, [a.column for a in aggs if a.func in ("min", "max") and a.column]):
        return None
    table, mask = _usable(table, keys, dropna, mask)
    specs: list[tuple[Any, str, Any]] = []
    names: list[str] = []
    for a in aggs:
        if a.func == "size":
            specs.append(([], "count_all", None))
            names.append(p(a, "n"))
        elif a.func == "count":
            specs.append((a.column, "count", None))
            names.append(p(a, "n"))
        elif a.func in ("sum", "mean"):
            specs.append((a.column, "sum", _EMPTY_IS_NULL))
            names.append(p(a, "sum"))
            if a.func == "mean":
                specs.append((a.column, "count", None))
                names.append(p(a, "n"))
        else:
            specs.append((a.column, a.func, None))
            names.append(p(a, "v"))
    columns = _group(table, keys, specs, threads, mask=mask)
    assert columns is not None
    values = [_as_duckdb_partial(c) for c in columns[len(keys) :]]
    return pa.table(columns[: len(keys)] + values, names=[*keys, *names])


def _as_duckdb_partial(column: pa.ChunkedArray) -> pa.ChunkedArray:
    t = column.type
    if pa.types.is_integer(t) and t != pa.int64():  # an unsigned or narrow sum
        return column.cast(pa.int64())
    return column


def combine(
    partials: pa.Table, keys: Sequence[str], aggs: Sequence[Agg], p: Callable[[Agg, str], str]
) -> pa.Table | None:
    """The final values from the partials of ``partial`` (or DuckDB's), as ``_final_sql``
    with ``raw=False``: the output columns after the keys."""
    sums = [p(a, "sum") for a in aggs if a.func in ("sum", "mean")]
    if not _sums_fit(partials, sums) or _nan_in(partials, [p(a, "v") for a in aggs if a.func in ("min", "max")]):
        return None
    specs: list[tuple[Any, str, Any]] = []
    for a in aggs:
        if a.func in ("size", "count"):
            specs.append((p(a, "n"), "sum", _EMPTY_IS_ZERO))
        elif a.func == "sum":
            specs.append((p(a, "sum"), "sum", _EMPTY_IS_ZERO))
        elif a.func == "mean":
            specs += [(p(a, "sum"), "sum", _EMPTY_IS_NULL), (p(a, "n"), "sum", _EMPTY_IS_ZERO)]
        else:
            specs.append((p(a, "v"), a.func, None))
    columns = _group(partials, keys, specs, False)
    assert columns is not None
    return _finish(columns, keys, aggs)


def final(
    table: pa.Table,
    keys: Sequence[str],
    aggs: Sequence[Agg],
    dropna: bool,
    runs_only: bool = False,
    mask: Any = None,
) -> pa.Table | None:
    """The final values from rows (those a ``mask`` keeps, if given), in one pass (a frame
    placed by its keys); with ``runs_only``, None unless the rows lie in runs of their one
    key (``_group_runs``)."""
    if not _sums_fit(table, [a.column for a in aggs if a.func in ("sum", "mean") and a.column]):
        return None
    if _nan_in(table, [a.column for a in aggs if a.func in ("min", "max") and a.column]):
        return None
    table, mask = _usable(table, keys, dropna, mask)
    specs: list[tuple[Any, str, Any]] = []
    for a in aggs:
        if a.func == "size":
            specs.append(([], "count_all", None))
        elif a.func == "count":
            specs.append((a.column, "count", None))
        elif a.func == "sum":
            specs.append((a.column, "sum", _EMPTY_IS_ZERO))
        elif a.func == "mean":
            specs += [(a.column, "sum", _EMPTY_IS_NULL), (a.column, "count", None)]
        elif a.func == "nunique":
            specs.append((a.column, "count_distinct", _VALID_ONLY))
        else:
            specs.append((a.column, a.func, None))
    columns = _group(table, keys, specs, False, runs_only, mask)
    return None if columns is None else _finish(columns, keys, aggs)


def _finish(columns: list[pa.ChunkedArray], keys: Sequence[str], aggs: Sequence[Agg]) -> pa.Table:
    out = list(columns[: len(keys)])
    rest = iter(columns[len(keys) :])
    for a in aggs:
        value = next(rest)
        if a.func == "mean":
            value = _divide(value, next(rest))
        elif a.func in ("size", "count", "sum"):
            value = _as_duckdb_partial(value)
        out.append(value)
    return pa.table(out, names=[*keys, *(a.out for a in aggs)])


# ---- no keys: a global ``agg``'s one row ----------------------------------------------------
def _one(value: pa.Scalar, kind: pa.DataType | None = None) -> pa.Array:
    kind = kind or value.type
    return pa.array([value.as_py()], kind) if value.type == kind else pa.array([value.as_py()]).cast(kind)


def partial_all(table: pa.Table, aggs: Sequence[Agg], p: Callable[[Agg, str], str]) -> pa.Table | None:
    """This rank's one row of partials, as ``SELECT <_partial_sql>, COUNT(*) AS __px_rows``."""
    if not _sums_fit(table, [a.column for a in aggs if a.func in ("sum", "mean") and a.column]):
        return None
    if _nan_in(table, [a.column for a in aggs if a.func in ("min", "max") and a.column]):
        return None
    n = pa.scalar(table.num_rows, pa.int64())
    columns: dict[str, pa.Array] = {}
    for a in aggs:
        if a.func == "size":
            columns[p(a, "n")] = _one(n)
            continue
        col = table.column(a.column)
        if a.func == "count":
            columns[p(a, "n")] = _one(pc.count(col), pa.int64())
        elif a.func in ("sum", "mean"):
            total = pc.sum(col, min_count=1)
            columns[p(a, "sum")] = _one(total, pa.int64() if pa.types.is_integer(col.type) else pa.float64())
            if a.func == "mean":
                columns[p(a, "n")] = _one(pc.count(col), pa.int64())
        else:
            columns[p(a, "v")] = _one(pc.min_max(col)[a.func], col.type)
    columns["__px_rows"] = _one(n)
    return pa.table(columns)


def combine_all(partials: pa.Table, aggs: Sequence[Agg], p: Callable[[Agg, str], str]) -> pa.Table | None:
    """The one row of final values from the ranks' partial rows (none: the types only)."""
    if not _sums_fit(partials, [p(a, "sum") for a in aggs if a.func in ("sum", "mean")]):
        return None
    if _nan_in(partials, [p(a, "v") for a in aggs if a.func in ("min", "max")]):
        return None
    columns: dict[str, pa.Array] = {}
    for a in aggs:
        if a.func in ("size", "count"):
            columns[a.out] = _one(pc.sum(partials.column(p(a, "n")), min_count=0), pa.int64())
        elif a.func == "sum":
            total = partials.column(p(a, "sum"))
            columns[a.out] = _one(pc.sum(total, min_count=0), total.type)
        elif a.func == "mean":
            total = pc.sum(partials.column(p(a, "sum")), min_count=1)
            count = pc.sum(partials.column(p(a, "n")), min_count=0)
            columns[a.out] = _divide(pa.chunked_array([_one(total)]), pa.chunked_array([_one(count, pa.int64())]))
        else:
            v = partials.column(p(a, "v"))
            columns[a.out] = _one(pc.min_max(v)[a.func], v.type)
    return pa.table(columns)
