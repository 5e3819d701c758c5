"""Global sort by sample sort with weighted, tie-broken splitters.

1. Sort locally (stable, nulls last).  2. Every rank sends evenly spaced samples of its sort
keys, each tagged with (rank, index) and weighted by how many rows it stands for.  3. All
ranks pick the same splitters at the weighted quantiles.  4. Binary search places each
splitter in the local sorted run (a few dozen comparisons, no per-row Python), the run is cut
into zero-copy slices and exchanged.  5. Each rank sorts what it received.

Because the (rank, index) tag breaks ties, rows with one heavily repeated key are spread over
several ranks in order instead of all landing on one: skew does not overload a rank.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pyarrow as pa

from . import kernels
from .common import check_columns
from .exchange import allgather_tables, concat, exchange_tables

if TYPE_CHECKING:
    from .dataframe import DataFrame

OVERSAMPLE = 32  # samples per destination rank from every rank
_SRC, _IDX, _W = "__px_src", "__px_idx", "__px_weight"


def sort_values(df: "DataFrame", by: list[str], ascending: bool | Sequence[bool]) -> pa.Table:
    if not by:
        raise ValueError("sort_values: give at least one column")
    check_columns(df.schema, by, "sort_values")
    asc = [ascending] * len(by) if isinstance(ascending, bool) else list(ascending)
    if len(asc) != len(by):
        raise ValueError(f"sort_values: {len(by)} columns but {len(asc)} ascending flags")
    desc = [not a for a in asc]
    comm = df.env.comm
    local = kernels.sort(df.to_arrow(), by, desc)
    if comm.world_size == 1:
        return local
    splitters = _splitters(comm, local, by, desc)
    if not splitters:  # no rank has a row
        return local
    cuts = [0] + [_upper_bound(local, by, desc, comm.rank, s) for s in splitters] + [local.num_rows]
    parts = [local.slice(cuts[i], cuts[i + 1] - cuts[i]) for i in range(comm.world_size)]
    received = concat(exchange_tables(comm, parts, local.schema), local.schema)
    return kernels.sort(received, by, desc)  # stable: ties keep source-rank order


def _splitters(comm, local: pa.Table, by: list[str], desc: list[bool]) -> list[tuple]:
    n = local.num_rows
    k = min(n, OVERSAMPLE * comm.world_size)
    idx = (np.arange(k, dtype=np.int64) * n) // k if k else np.zeros(0, dtype=np.int64)
    sample = local.select(by).take(pa.array(idx))
    sample = (sample.append_column(_SRC, pa.array(np.full(k, comm.rank, dtype=np.int64)))
                    .append_column(_IDX, pa.array(idx))
                    .append_column(_W, pa.array(np.full(k, n / k if k else 0.0))))
    every = concat(allgather_tables(comm, sample), sample.schema)
    if every.num_rows == 0:
        return []
    every = kernels.sort(every, by + [_SRC, _IDX], desc + [False, False])
    weights = np.cumsum(every[_W].to_numpy())
    total = weights[-1]
    rows = every.to_pylist()
    out = []
    for i in range(1, comm.world_size):
        pos = min(int(np.searchsorted(weights, total * i / comm.world_size)), len(rows) - 1)
        r = rows[pos]
        out.append((tuple(r[c] for c in by), r[_SRC], r[_IDX]))
    return out


def _key(value: Any, descending: bool) -> tuple:
    """Sort key of one value: nulls last in both directions, NaN above numbers (as polars)."""
    if value is None:
        return (1, 0, 0)
    nan = isinstance(value, float) and math.isnan(value)
    if nan:
        return (0, 0 if descending else 1, 0)
    return (0, 1 if descending else 0, _Desc(value) if descending else value)


@functools.total_ordering
class _Desc:
    __slots__ = ("v",)

    def __init__(self, v: Any):
        self.v = v

    def __lt__(self, other: "_Desc") -> bool:
        return other.v < self.v

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Desc) and other.v == self.v


def _row_key(values: Sequence[Any], desc: Sequence[bool], src: int, idx: int) -> tuple:
    return tuple(_key(v, d) for v, d in zip(values, desc)) + ((src, idx),)


def _upper_bound(local: pa.Table, by: list[str], desc: list[bool], rank: int, splitter: tuple) -> int:
    """First local position whose row sorts after ``splitter`` (binary search)."""
    values, src, idx = splitter
    target = _row_key(values, desc, src, idx)
    cols = [local.column(c) for c in by]
    lo, hi = 0, local.num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        row = _row_key([c[mid].as_py() for c in cols], desc, rank, mid)
        if row <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo
