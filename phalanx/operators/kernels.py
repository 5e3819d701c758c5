"""Local (single-rank) kernels.  The one place that decides which engine runs what.

Measured on this machine (10M rows, see docs/performance.md): polars is fastest for
hash-partitioning and sort, and keeps null-safe joins and rich group-by expressions;
DuckDB is faster at large joins.  Everything enters and leaves as Arrow; ``from_polars``
restores the caller's column types (polars hands strings back as large_string).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import polars as pl
import pyarrow as pa

HASH_SEED = 0x5EED  # fixed: equal keys must land on the same rank on every rank and run


def to_polars(table: pa.Table) -> pl.DataFrame:
    return pl.from_arrow(table, rechunk=False)  # type: ignore[return-value]


def from_polars(df: pl.DataFrame, like: pa.Schema | None = None) -> pa.Table:
    table = df.to_arrow()
    if like is None:
        return table
    return restore_types(table, like)


def restore_types(table: pa.Table, like: pa.Schema) -> pa.Table:
    """Cast columns that ``like`` also has back to ``like``'s type (string stays string)."""
    fields = []
    changed = False
    for f in table.schema:
        idx = like.get_field_index(f.name)
        if idx >= 0 and like.field(idx).type != f.type:
            fields.append(pa.field(f.name, like.field(idx).type))
            changed = True
        else:
            fields.append(f)
    return table.cast(pa.schema(fields)) if changed else table


def normalize_keys(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Give key columns canonical types so equal values hash equally on every side."""
    for k in keys:
        t = table.schema.field(k).type
        target = None
        if pa.types.is_integer(t) and t != pa.int64():
            target = pa.int64()
        elif pa.types.is_floating(t) and t != pa.float64():
            target = pa.float64()
        elif pa.types.is_dictionary(t):
            target = t.value_type
        if target is not None:
            table = table.set_column(table.schema.get_field_index(k), k, table[k].cast(target))
    return table


def partition_ids(table: pa.Table, keys: Sequence[str], nparts: int) -> np.ndarray:
    """The hash partition (0..nparts-1) of every row, from the key columns only."""
    hashed = to_polars(normalize_keys(table.select(list(keys)), keys)).hash_rows(seed=HASH_SEED)
    return (hashed % nparts).cast(pl.UInt32).to_numpy()


def hash_partition(table: pa.Table, keys: Sequence[str], nparts: int) -> list[pa.Table]:
    """Split rows by hash of ``keys`` into ``nparts`` tables (row order kept within each)."""
    if nparts == 1:
        return [table]
    if table.num_rows == 0:
        return [table] * nparts
    pid = "__px_pid"
    df = to_polars(table).with_columns(pl.Series(pid, partition_ids(table, keys, nparts)))
    groups = df.partition_by(
        pid, as_dict=True, include_key=False, maintain_order=True)
    empty = table.schema.empty_table()
    return [from_polars(groups[(i,)], table.schema) if (i,) in groups else empty
            for i in range(nparts)]


def sort(table: pa.Table, by: Sequence[str], descending: Sequence[bool]) -> pa.Table:
    """Stable sort, nulls last in every column (pandas' na_position='last')."""
    if table.num_rows <= 1:
        return table
    df = to_polars(table).sort(list(by), descending=list(descending), nulls_last=True,
                               maintain_order=True)
    return from_polars(df, table.schema)


_HOW = {"inner": "inner", "left": "left", "right": "right", "outer": "full"}


def join(left: pa.Table, right: pa.Table, left_on: Sequence[str], right_on: Sequence[str],
         how: str) -> pa.Table:
    """Equi-join where null keys match each other (pandas semantics).

    Column names must already be disjoint except for keys shared by name, which appear once
    (coalesced, as pandas does for ``on=``).
    """
    coalesce = list(left_on) == list(right_on)
    out = to_polars(left).join(
        to_polars(right), left_on=list(left_on), right_on=list(right_on), how=_HOW[how],
        nulls_equal=True, coalesce=coalesce)
    like = pa.schema(list(left.schema) + [f for f in right.schema if f.name not in left.schema.names])
    columns = [n for n in like.names if n in out.columns]
    return from_polars(out.select(columns), like)
