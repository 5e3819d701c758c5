"""Which rows of an integer column hold one of a set of values: by binary search where the
column is sorted, else by a lookup table.

Where the column never decreases down each chunk's rows (TPC-H's lineitem by l_orderkey, a
time series by time) and the values wanted are few against its rows, each value's run of
rows is found by two binary searches (``sorted_rows``; ``sorted_pairs`` for an inner join,
which then takes the right's rows by the pairs with no hash table): beyond the check that the
column is sorted, most rows are never read.  A rank's 3M lines joined to 45k orders (TPC-H
Q5) 19 -> 12 ms with the join's gathers, inside the query with both ranks at work.

A join's membership test (``plan_polars.members``: the rows before a semi join, or an inner
join that keeps few; a filter's term, ``plan_polars._with_membership``) asks it of every row
before the join copies them out: a rank's 3M lines against 1337 parts (TPC-H Q8) or 774
suppliers (Q7).  Where the wanted values lie from 0 to ``MAX_RANGE`` (ids mostly do), a byte
per value up to the largest marks them and each row's byte is fetched, the row's value
clipped into the table (numpy's ``take``): 3M lines against 774 suppliers 4.0 ms on one
thread alone, where Polars' hash lookup took 11-13; other values by a table over the column's
range.  As a filter's stage of its own after the filter's fixed-width terms (no longer inside
Polars' one pass), Q7's lines 20 -> 14.5 ms a rank inside the query.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MAX_RANGE = 1 << 24  # a table of 16 MB at most
MIN_ROWS = 65_536  # below it the lookup's fixed costs are not worth it


def member_mask(column: pa.ChunkedArray, values: pa.ChunkedArray) -> Any | None:
    """True where the integer column's value is one of ``values`` (a null row: false or null,
    never true): a short column by Arrow's hash lookup (Polars' call costs ~0.5 ms whatever
    the rows: TPC-H Q2 asks three times of 12 to 5000 rows), a long one by a lookup table
    (``lookup_mask``); None where neither serves (then Polars' hash lookup)."""
    if len(column) < MIN_ROWS:
        return pc.is_in(column, value_set=values, skip_nulls=True) if column.type == values.type else None
    return lookup_mask(column, values)


def sorted_rows(column: pa.ChunkedArray, values: pa.ChunkedArray) -> np.ndarray | None:
    """The indices of the rows whose value is one of ``values``, ascending, where the integer
    column is sorted chunk by chunk (``_runs``); None otherwise."""
    if not (_searchable(column, values) and _head_sorted(column)):
        return None
    found = _runs(column, _distinct_ascending(pc.drop_null(values).to_numpy().astype(np.int64, copy=False)))
    return None if found is None else found[0]


def sorted_pairs(column: pa.ChunkedArray, keys: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """An inner join's row pairs by the sorted column's runs (``_runs``): the indices of the
    rows whose value is one of ``keys``, ascending, and for each the index of that key; None
    where the column is not sorted chunk by chunk, a key is null or on several rows, or the
    types differ (then a hash join)."""
    if not _searchable(column, keys) or keys.null_count or column.type != keys.type or not _head_sorted(column):
        return None  # (the column's first rows probed before the keys are sorted)
    values = keys.to_numpy().astype(np.int64, copy=False)
    order = None if never_decreasing(values) else np.argsort(values, kind="stable")
    ascending = values if order is None else values[order]
    if len(ascending) > 1 and bool((ascending[1:] == ascending[:-1]).any()):
        return None  # a key on several rows: a row per match, the hash join's work
    found = _runs(column, ascending)
    if found is None:
        return None
    rows, which = found
    return rows, which if order is None else order[which]


def increasing_pairs(column: pa.ChunkedArray, keys: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """An inner join's row pairs where the integer column strictly increases down its rows
    (each value once, in order: orders by their key) and the keys repeat (their lines): each
    key binary-searched among the column's values — no hash table built, no membership pass
    first.  (The column's matching rows, in the keys' order; those keys' rows, ascending.)
    None for a column that does not strictly increase or is longer than 131,072 rows, keys of
    another type or more than 1M, or a null in either (then the hash joins)."""
    if not (len(column) and _fits_int64(column.type)) or column.type != keys.type:
        return None
    if column.null_count or keys.null_count or len(column) > _INCREASING_MAX_ROWS or len(keys) > _INCREASING_MAX_KEYS:
        return None
    if not _head_sorted(column, strict=True):
        return None
    values = column.to_numpy()
    if not never_decreasing(values, strict=True):
        return None
    wanted = keys.to_numpy()
    at = np.minimum(np.searchsorted(values, wanted), len(values) - 1)
    found = np.flatnonzero(values[at] == wanted)
    return at[found], found


# the searched column stays in cache (1 MB of int64): 70k keys among 60k rows 1.5 ms a rank;
# over a column of 750k, 1M keys' searches (~50 ms) would cost more than a hash join
_INCREASING_MAX_ROWS = 131_072
_INCREASING_MAX_KEYS = 1_000_000


# a wanted value costs two binary searches of ~17 steps where a row costs one hash probe:
# worth it while the values wanted number at most this share of the rows
_SEARCHES_PER_ROW = 1 / 16


def _searchable(column: pa.ChunkedArray, values: pa.ChunkedArray) -> bool:
    return (
        len(column) >= MIN_ROWS
        and not column.null_count
        and _fits_int64(column.type)
        and _fits_int64(values.type)
        and len(values) <= _SEARCHES_PER_ROW * len(column)
    )


def _runs(column: pa.ChunkedArray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Where each chunk of the column (no null) never decreases down the rows (TPC-H's
    lineitem by l_orderkey, a time series by time): the indices of the rows holding one of
    the ``wanted`` values (distinct, ascending), ascending, and for each the index of its
    value in ``wanted``; None where a chunk's values decrease somewhere.  Each wanted value
    inside a chunk's range is found by two binary searches, so beyond the sortedness check
    the work grows with the values, not the rows: a rank's 3M lines against 23k orders."""
    rows, which, offset = [], [], 0
    for chunk in column.chunks:
        a = chunk.to_numpy()
        if len(a) and not never_decreasing(a):
            return None
        if len(a):
            first = int(np.searchsorted(wanted, a[0], "left"))
            # in the chunk's range, so of its type (numpy would cast the chunk to the values')
            inside = wanted[first : np.searchsorted(wanted, a[-1], "right")].astype(a.dtype, copy=False)
            lo = np.searchsorted(a, inside, "left")
            counts = np.searchsorted(a, inside, "right") - lo
            hit = np.flatnonzero(counts)
            lo, counts = lo[hit], counts[hit]
            starts = np.cumsum(counts) - counts  # where each value's rows begin in the output
            rows.append(np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(lo + offset - starts, counts))
            which.append(np.repeat(hit + first, counts))
        offset += len(a)
    if not rows:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return np.concatenate(rows), np.concatenate(which)


PROBE_ROWS = 4096


def _distinct_ascending(values: np.ndarray) -> np.ndarray:
    """The values once each, ascending (numpy's ``unique`` hashes: 6 ms for 45k values)."""
    if not never_decreasing(values):
        values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if len(values) else values


def never_decreasing(a: np.ndarray, strict: bool = False) -> bool:
    """Whether the values never decrease (``strict``: always increase) down the array: its
    first ``PROBE_ROWS`` first (an unsorted column is found out without a pass over all of
    them).  Compared, not subtracted: unsigned differences wrap."""
    for part in (a[:PROBE_ROWS], a):
        later, earlier = part[1:], part[:-1]
        if bool((later <= earlier).any() if strict else (later < earlier).any()):
            return False
    return True


def _head_sorted(column: pa.ChunkedArray, strict: bool = False) -> bool:
    """Whether the column's first rows are in order: asked before any work that needs all
    of them to be (most columns are not, and fail here)."""
    return never_decreasing(column.slice(0, PROBE_ROWS).to_numpy(), strict)


def lookup_mask(column: pa.ChunkedArray, values: pa.ChunkedArray) -> Any | None:
    """True where the integer column's value is one of ``values`` (null where it is null);
    None where the column is short, not an integer one, or neither the values nor the
    column's values lie in a range of at most ``MAX_RANGE`` (then a hash lookup)."""
    if len(column) < MIN_ROWS or not (_fits_int64(column.type) and _fits_int64(values.type)):
        return None
    if column.null_count == len(column):
        return None
    wanted = pc.drop_null(values).to_numpy().astype(np.int64)  # a null matches no row
    if len(wanted) and 0 <= wanted.min() and wanted.max() < MAX_RANGE:
        if wanted.min() > 0 or pa.types.is_unsigned_integer(column.type) or pc.min(column).as_py() >= 0:
            return _clipped_lookup(column, wanted)
    bounds = pc.min_max(column)
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    if hi - lo >= MAX_RANGE:
        return None
    wanted = wanted[(wanted >= lo) & (wanted <= hi)]
    table = np.zeros(hi - lo + 1, dtype=np.uint8)
    table[wanted - lo] = 1
    at = pc.subtract(column.cast(pa.int64()), pa.scalar(lo, pa.int64()))  # in int64: int16's -30000..30000 spans 60000
    return pc.cast(pc.take(pa.array(table), at), pa.bool_())


def _clipped_lookup(column: pa.ChunkedArray, wanted: np.ndarray) -> pa.ChunkedArray:
    """``lookup_mask`` for wanted values from 0 up, where 0 is wanted only if no row is below
    it: a table over the values' range, with a last entry for every value above them, each
    row's index clipped into it (numpy's ``take``: the column's range never computed, no
    shifted copy) — 3M lines against 774 suppliers 2.7 ms on one thread, Arrow's ``take``
    from a table over the column's range 7.4, Polars' hash lookup 12."""
    table = np.zeros(int(wanted.max()) + 2, dtype=bool)
    table[wanted] = True
    chunks = []
    for chunk in column.chunks:
        rows = (chunk.fill_null(0) if chunk.null_count else chunk).to_numpy()
        found = pa.array(np.take(table, rows, mode="clip"))
        chunks.append(pc.if_else(chunk.is_valid(), found, None) if chunk.null_count else found)
    return pa.chunked_array(chunks, pa.bool_())


def _fits_int64(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) and t != pa.uint64()
