"""Which rows of an integer column hold one of a set of values, by a lookup table.

A join's membership filter on its own (``plan_polars.members``: the rows before a semi join,
or an inner join that keeps few) asks it of every row before the join copies them out: a
rank's 3M lines against 1337 parts (TPC-H Q8) or 45k orders (Q5).  Where the column's values
lie in a range of at most ``MAX_RANGE`` (ids mostly do), a byte per value of the range marks
the wanted ones and each row's byte is fetched (Arrow's ``take``): 3.5-4.6 ms over 3M rows on
one thread alone, where Polars' hash lookup took 11.6-15 ms (774 to 146k values); with both
ranks at work on the 2 cores (memory shared), 11-12 ms against 14.5-15.  A membership term
joined to a filter's other terms stays in that filter's one Polars pass
(``plan_polars._with_membership``): apart, it cost more than it saved (TPC-H Q3, Q7).
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


def lookup_mask(column: pa.ChunkedArray, values: pa.ChunkedArray) -> Any | None:
    """True where the integer column's value is one of ``values`` (null where it is null);
    None where the column is short, not an integer one or its values span more than
    ``MAX_RANGE`` (then a hash lookup)."""
    if len(column) < MIN_ROWS or not (_fits_int64(column.type) and _fits_int64(values.type)):
        return None
    if column.null_count == len(column):
        return None
    bounds = pc.min_max(column)
    lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
    if hi - lo >= MAX_RANGE:
        return None
    wanted = pc.drop_null(values).to_numpy().astype(np.int64)  # a null matches no row
    wanted = wanted[(wanted >= lo) & (wanted <= hi)]
    base = 0 if lo >= 0 and hi < MAX_RANGE else lo  # ids from 0 up index the table as they are
    table = np.zeros(hi - base + 1, dtype=np.uint8)
    table[wanted - base] = 1
    at = column if base == 0 else pc.subtract(column, pa.scalar(base, column.type))
    return pc.cast(pc.take(pa.array(table), at), pa.bool_())


def _fits_int64(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) and t != pa.uint64()
