"""Global sort by sample sort with weighted, tie-broken splitters.

One numeric sort column (ints, floats, dates, timestamps, durations; the common case) takes
the range-partition-first plan: every rank samples its unsorted rows, all ranks agree on
splitters, each row's destination comes from a vectorised binary search of an order-
preserving uint64 code of its key, rows move in one counting pass + exchange, and every rank
sorts only what it received, once.  Ties are broken by the global row position (rank, index),
exactly the order a stable sort keeps, so a heavily repeated key still spreads over ranks.

Other sorts (several columns, strings):
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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import kernels
from .common import check_columns
from .exchange import allgather_tables, concat, exchange_tables, gather_tables

if TYPE_CHECKING:
    from .dataframe import DataFrame

OVERSAMPLE = 32  # samples per destination rank from every rank
_SRC, _IDX, _W = "__px_src", "__px_idx", "__px_weight"


def _descending(df: DataFrame, by: list[str], ascending: bool | Sequence[bool]) -> list[bool]:
    if not by:
        raise ValueError("sort_values: give at least one column")
    check_columns(df.schema, by, "sort_values")
    asc = [ascending] * len(by) if isinstance(ascending, bool) else list(ascending)
    if len(asc) != len(by):
        raise ValueError(f"sort_values: {len(by)} columns but {len(asc)} ascending flags")
    return [not a for a in asc]


def top_k(df: DataFrame, by: list[str], ascending: bool | Sequence[bool], k: int) -> pa.Table:
    """The first ``k`` rows of the sorted frame, on rank 0 (see ``DataFrame.sort_values``).
    Each rank's best k (a stable top-k) go to rank 0 in rank order, so a stable sort there
    breaks ties by (rank, position): the frame's order, as sort-then-head gives."""
    desc = _descending(df, by, ascending)
    comm = df.env.comm
    table = df.to_arrow()
    local = kernels.top_k(table, by, desc, k)
    if comm.world_size == 1:
        return local
    best = gather_tables(comm, local, root=0)
    return kernels.top_k(best, by, desc, k) if best is not None else local.slice(0, 0)


def sort_values(df: DataFrame, by: list[str], ascending: bool | Sequence[bool]) -> pa.Table:
    desc = _descending(df, by, ascending)
    comm = df.env.comm
    table = df.to_arrow()
    if comm.world_size == 1:
        return kernels.sort(table, by, desc)
    totals = comm.allreduce(np.array([table.num_rows, table.nbytes], dtype=np.int64))
    if int(totals[0]) <= SMALL_ROWS and int(totals[1]) <= SMALL_BYTES:
        return _sort_whole(comm, table, by, desc)
    if len(by) == 1 and _codable(table.schema.field(by[0]).type):
        return _range_sort(comm, table, by[0], desc[0])
    if comm.world_size - 1 <= FEW_SPLITTERS and all(_rangeable(table.schema.field(c).type) for c in by):
        return _range_sort_keys(comm, table, by, desc)
    local = kernels.sort(table, by, desc)
    splitters = _splitters(comm, local, by, desc)
    if not splitters:  # no rank has a row
        return local
    cuts = [0] + [_upper_bound(local, by, desc, comm.rank, s) for s in splitters] + [local.num_rows]
    parts = [local.slice(cuts[i], cuts[i + 1] - cuts[i]) for i in range(comm.world_size)]
    received = concat(exchange_tables(comm, parts, local.schema), local.schema)
    # sorted runs, one per source rank, in rank order: stable, ties keep that order
    return kernels.sort_runs(received, by, desc)


# ---- a small frame: every rank sorts all of it ---------------------------------------------
# up to these totals a sort gathers every row on every rank: one allgather and one local sort,
# where the sample sort's rounds (samples, splitters, the exchange) cost 4.8 ms for 100 rows of
# strings at 2 ranks (TPC-H sorts its few result rows last: Q4, Q12, Q13, Q22 ...)
SMALL_ROWS = 20_000
SMALL_BYTES = 4 << 20


def _sort_whole(comm, table: pa.Table, by: list[str], desc: list[bool]) -> pa.Table:
    """Every rank's rows to every rank, sorted (stable: rank order, then row order, as the
    sample sort keeps ties), each rank keeping an even share in order."""
    from .plan import note, rows

    note(f"small frame: allgathered and sorted on every rank, each keeps its share: {rows(table)}")
    whole = kernels.sort(concat(allgather_tables(comm, table), table.schema), by, desc)
    n, p, r = whole.num_rows, comm.world_size, comm.rank
    start, stop = n * r // p, n * (r + 1) // p
    return whole.slice(start, stop - start)


# ---- one numeric column: range-partition first, sort once --------------------------------------
_SIGN = np.uint64(1 << 63)
_NAN_CODE = np.uint64(0xFFF8000000000000)  # above +inf's code: NaN sorts after numbers
MIN_SAMPLE = 1024  # samples per rank at least: balanced ranks even for unsorted input
FEW_SPLITTERS = 8  # up to this many splitters, compare passes place rows; more: binary search
_TAG_SHIFT = 40  # rank << 40 | row index: a global position that orders rows like the frame


def _codable(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_temporal(t) or pa.types.is_float32(t) or pa.types.is_float64(t)


def _sort_codes(arr: pa.Array, descending: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """uint64 codes whose unsigned order is the sort order of the non-null values (ties equal;
    NaN after numbers ascending, first descending, as polars), and the null mask (or None)."""
    t = arr.type
    nulls = None
    if arr.null_count:
        nulls = arr.is_null().to_numpy(zero_copy_only=False)
        arr = pc.fill_null(arr, pa.scalar(0.0 if pa.types.is_floating(t) else 0, t))
    if pa.types.is_floating(t):
        f = arr.cast(pa.float64()).to_numpy() + 0.0  # -0.0 + 0.0 == +0.0: equal values, equal codes
        bits = f.view(np.uint64)
        code = np.where(bits & _SIGN, ~bits, bits | _SIGN)
        nan = np.isnan(f)
        if nan.any():
            code[nan] = _NAN_CODE
    elif pa.types.is_unsigned_integer(t):
        code = arr.cast(pa.uint64()).to_numpy().copy()
    else:  # signed ints; temporal types are integers underneath
        if not pa.types.is_integer(t):
            arr = arr.view(pa.int32() if t.bit_width == 32 else pa.int64())
        code = arr.cast(pa.int64()).to_numpy().view(np.uint64) ^ _SIGN
    if descending:
        np.invert(code, out=code)
    return code, nulls


def _range_sort(comm, table: pa.Table, column: str, descending: bool) -> pa.Table:
    col = table.column(column)
    code, nulls = _sort_codes(col.chunk(0) if col.num_chunks == 1 else col.combine_chunks(), descending)
    n = len(code)
    rank = comm.rank
    # a sample of this rank's rows: (null?, code, global position), each standing for n/k rows
    idx = _random_sample(n, rank, comm.world_size)
    sample = pa.table(
        {
            "null": pa.array(nulls[idx] if nulls is not None else np.zeros(len(idx), dtype=bool)),
            "code": pa.array(code[idx]),
            "tag": pa.array((np.int64(rank) << _TAG_SHIFT) + idx.astype(np.int64)),
            "w": pa.array(np.full(len(idx), n / len(idx) if len(idx) else 0.0)),
        }
    )
    every = concat(allgather_tables(comm, sample), sample.schema)
    if every.num_rows == 0:  # no rank has a row
        return table
    s_null = every["null"].to_numpy(zero_copy_only=False)
    s_code = every["code"].to_numpy()
    s_tag = every["tag"].to_numpy()
    order = np.lexsort((s_tag, s_code, s_null))
    picks = order[_quantiles(every["w"].to_numpy()[order], comm.world_size)]
    ids = _range_ids(code, nulls, rank, s_null[picks], s_code[picks], s_tag[picks], comm.world_size)
    parts = kernels.split_by_ids(table, ids, comm.world_size)
    received = concat(exchange_tables(comm, parts, table.schema), table.schema)
    # pieces arrive in source-rank order, each in its original order: a stable sort of what
    # arrived is the global stable order
    return kernels.sort(received, [column], [descending])


def _random_sample(n: int, rank: int, world_size: int) -> np.ndarray:
    """Sorted distinct row indices of an unsorted partition of ``n`` rows to sample."""
    k = min(n, max(OVERSAMPLE * world_size, MIN_SAMPLE))
    if not k:
        return np.zeros(0, np.int64)
    return np.unique(np.random.default_rng([rank, n]).integers(0, n, k)).astype(np.int64)


def _tagged_sample(table: pa.Table, by: list[str], idx: np.ndarray, rank: int) -> pa.Table:
    """The sort columns of rows ``idx``, tagged with (rank, index) and the rows each stands for."""
    k, n = len(idx), table.num_rows
    return (
        table.select(by)
        .take(pa.array(idx))
        .append_column(_SRC, pa.array(np.full(k, rank, dtype=np.int64)))
        .append_column(_IDX, pa.array(idx))
        .append_column(_W, pa.array(np.full(k, n / k if k else 0.0)))
    )


def _quantiles(weights: np.ndarray, nparts: int) -> np.ndarray:
    """Positions of the ``nparts - 1`` splitters among sorted samples of these weights: the
    samples at the weighted quantiles 1/nparts, 2/nparts, ..."""
    cum = np.cumsum(weights)
    targets = cum[-1] * np.arange(1, nparts) / nparts
    return np.minimum(np.searchsorted(cum, targets), len(cum) - 1).astype(np.int64)


def _range_ids(
    code: np.ndarray,
    nulls: np.ndarray | None,
    rank: int,
    sp_null: np.ndarray,
    sp_code: np.ndarray,
    sp_tag: np.ndarray,
    nparts: int,
) -> np.ndarray:
    """Destination of every row: the number of splitters that sort before it, comparing
    (null?, code, global position) lexicographically.  Splitters are sorted that way."""
    dtype = kernels._id_dtype(nparts)
    nn = int((~sp_null).sum())  # non-null splitters come first
    nn_code, nn_tag = sp_code[:nn], sp_tag[:nn]
    if nn <= FEW_SPLITTERS:
        # one compare pass per splitter beats two binary searches per row (5M rows, 1
        # splitter: 10 ms against 70 ms)
        ids: np.ndarray = np.zeros(len(code), dtype=dtype)
        for c in nn_code:
            ids += np.greater(code, c)
        ties = [(np.flatnonzero(code == c), i) for i, c in enumerate(nn_code) if i == 0 or nn_code[i - 1] != c]
        # rows whose key equals a splitter's: order by position among the equal splitters
        for tie, start in ties:
            if len(tie):
                stop = int(np.searchsorted(nn_code, nn_code[start], side="right"))
                pos = (np.int64(rank) << _TAG_SHIFT) + tie.astype(np.int64)
                ids[tie] += np.searchsorted(nn_tag[start:stop], pos, side="left").astype(dtype)
    else:
        lo = np.searchsorted(nn_code, code, side="left")
        hi = np.searchsorted(nn_code, code, side="right")
        ids = lo.astype(dtype)
        tie = np.flatnonzero(hi > lo)
        if len(tie):
            pos = (np.int64(rank) << _TAG_SHIFT) + tie.astype(np.int64)
            tlo, thi = lo[tie], hi[tie]
            for start in np.unique(tlo):
                m = tlo == start
                stop = int(thi[m][0])
                ids[tie[m]] += np.searchsorted(nn_tag[start:stop], pos[m], side="left").astype(dtype)
    if nulls is not None and nulls.any():
        rows = np.flatnonzero(nulls)
        pos = (np.int64(rank) << _TAG_SHIFT) + rows.astype(np.int64)
        ids[rows] = (nn + np.searchsorted(sp_tag[nn:], pos, side="left")).astype(dtype)
    return ids


# ---- several columns (numbers, strings), a few ranks: range-partition first too ------------------
def _rangeable(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return _codable(t) or kernels._is_string(t)


def _range_sort_keys(comm, table: pa.Table, by: list[str], desc: list[bool]) -> pa.Table:
    """Sort once: sample unsorted rows, agree on splitter rows, place every row with one
    vectorised compare pass per splitter, exchange, sort what arrived.  Sorting first and
    again after the exchange (the general plan) cost 2 ranks 1.77 s on 10M rows by (int, int)
    where 1 rank took 1.92 s."""
    n, rank = table.num_rows, comm.rank
    sample = _tagged_sample(table, by, _random_sample(n, rank, comm.world_size), rank)
    every = concat(allgather_tables(comm, sample), sample.schema)
    if every.num_rows == 0:  # no rank has a row
        return table
    every = kernels.sort(every, by + [_SRC, _IDX], desc + [False, False])
    splitters = every.take(pa.array(_quantiles(every[_W].to_numpy(), comm.world_size))).to_pylist()
    keys = [_CompareKey(table.column(c), d) for c, d in zip(by, desc)]
    pos = (np.int64(rank) << _TAG_SHIFT) + np.arange(n, dtype=np.int64)
    ids = np.zeros(n, dtype=kernels._id_dtype(comm.world_size))
    for sp in splitters:
        after, equal = np.zeros(n, dtype=bool), np.ones(n, dtype=bool)
        for key, c in zip(keys, by):
            gt, eq = key.compare(sp[c])
            after |= equal & gt
            equal &= eq
        after |= equal & (pos > (np.int64(sp[_SRC]) << _TAG_SHIFT) + np.int64(sp[_IDX]))
        ids += after
    parts = kernels.split_by_ids(table, ids, comm.world_size)
    received = concat(exchange_tables(comm, parts, table.schema), table.schema)
    return kernels.sort(received, by, desc)  # stable: pieces arrive in source-rank order


class _CompareKey:
    """One sort column of this rank's rows, compared with a splitter's value in sort order
    (nulls last, NaN above numbers, descending reversed): (sorts after, equal) per row."""

    def __init__(self, col: pa.ChunkedArray, descending: bool):
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
        self.arr, self.descending = arr, descending
        self.nulls = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
        self.code = _sort_codes(arr, descending)[0] if _codable(arr.type) else None

    def compare(self, value: Any) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.arr)
        null = self.nulls if self.nulls is not None else np.zeros(n, dtype=bool)
        if value is None:  # every non-null row sorts before a null splitter
            return np.zeros(n, dtype=bool), null.copy()
        if self.code is not None:
            v = _sort_codes(pa.array([value], self.arr.type), self.descending)[0][0]
            return (self.code > v) | null, (self.code == v) & ~null
        op = pc.less if self.descending else pc.greater
        gt = pc.fill_null(op(self.arr, pa.scalar(value, self.arr.type)), True)  # null rows: last
        eq = pc.fill_null(pc.equal(self.arr, pa.scalar(value, self.arr.type)), False)
        return gt.to_numpy(zero_copy_only=False), eq.to_numpy(zero_copy_only=False)


def _splitters(comm, local: pa.Table, by: list[str], desc: list[bool]) -> list[tuple]:
    n = local.num_rows
    k = min(n, OVERSAMPLE * comm.world_size)
    idx = (np.arange(k, dtype=np.int64) * n) // k if k else np.zeros(0, dtype=np.int64)
    sample = _tagged_sample(local, by, idx, comm.rank)
    every = concat(allgather_tables(comm, sample), sample.schema)
    if every.num_rows == 0:
        return []
    every = kernels.sort(every, by + [_SRC, _IDX], desc + [False, False])
    rows = every.take(pa.array(_quantiles(every[_W].to_numpy(), comm.world_size))).to_pylist()
    return [(tuple(r[c] for c in by), r[_SRC], r[_IDX]) for r in rows]


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

    def __lt__(self, other: _Desc) -> bool:
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
