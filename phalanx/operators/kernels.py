"""Local (single-rank) kernels.  The one place that decides which engine runs what.

Measured on this machine (see docs/performance.md): polars is fastest for hash-partitioning
and sort and has rich group-by expressions; DuckDB joins 5M x 5M rows 1.6x faster than polars
on one thread (0.37 s vs 0.57 s) and its null-safe ``IS NOT DISTINCT FROM`` costs nothing.  Everything enters and leaves as Arrow; ``from_polars``
restores the caller's column types (polars hands strings back as large_string).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import polars as pl
import pyarrow as pa

HASH_SEED = 0x5EED  # fixed: equal keys must land on the same rank on every rank and run
# Names the hash function in stored partitioning: polars' row hash is stable only within one
# polars version, so a dataset is reused as hash-partitioned only by the same function.
HASH_ID = f"polars-{pl.__version__}-hash_rows-seed{HASH_SEED}-int64keys"


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


_JOIN_SQL = {"inner": "JOIN", "left": "LEFT JOIN", "right": "RIGHT JOIN", "outer": "FULL JOIN"}
_duckdb = None


def duckdb_connection():
    """One DuckDB connection per process, with this rank's thread budget."""
    global _duckdb
    if _duckdb is None:
        import os

        import duckdb

        _duckdb = duckdb.connect()
        threads = int(os.environ.get("PHALANX_THREADS", "0") or 0) or (os.cpu_count() or 1)
        _duckdb.execute(f"SET threads={threads}")
        _duckdb.execute("SET preserve_insertion_order=false")  # joins need no output order
    return _duckdb


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def run_sql(query: str, **tables: pa.Table) -> pa.Table:
    """Run ``query`` in this process's DuckDB over the given Arrow tables (by name)."""
    con = duckdb_connection()
    for name, table in tables.items():
        con.register(name, table)
    try:
        return con.sql(query).to_arrow_table()
    finally:
        for name in tables:
            con.unregister(name)


def join(left: pa.Table, right: pa.Table, left_on: Sequence[str], right_on: Sequence[str],
         how: str) -> pa.Table:
    """Equi-join where null keys match each other (pandas semantics), in DuckDB.

    Column names must already be disjoint except for keys shared by name, which appear once
    (coalesced for right/outer joins, as pandas does for ``on=``).  Columns come out in
    pandas' order: the left's, then the right's.
    """
    shared = {a for a, b in zip(left_on, right_on) if a == b}
    cond = " AND ".join(f"l.{quote_ident(a)} IS NOT DISTINCT FROM r.{quote_ident(b)}" for a, b in zip(left_on, right_on))
    cols = []
    for name in left.column_names:
        if name in shared and how in ("right", "outer"):
            cols.append(f"COALESCE(l.{quote_ident(name)}, r.{quote_ident(name)}) AS {quote_ident(name)}")
        else:
            cols.append(f"l.{quote_ident(name)}")
    cols += [f"r.{quote_ident(n)}" for n in right.column_names if n not in shared]
    out = run_sql(f"SELECT {', '.join(cols)} FROM __px_l l {_JOIN_SQL[how]} __px_r r ON {cond}",
                  __px_l=left, __px_r=right)
    like = pa.schema(list(left.schema) + [f for f in right.schema if f.name not in shared])
    return restore_types(out, like)
