"""The lookup-table membership test of a join's filter (``membership.lookup_mask``), against
numpy's ``isin``: ids from 0 and offset ranges (negative values), nulls on both sides, values
outside the column's range, chunks, and the columns it leaves to a hash lookup."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from phalanx.operators import membership
from phalanx.operators.plan_polars import members

N = membership.MIN_ROWS + 4_321


def _column(values: np.ndarray, nulls: np.ndarray, kind: pa.DataType) -> pa.ChunkedArray:
    array = pa.array(values, mask=nulls).cast(kind)
    cut = len(values) // 3
    return pa.chunked_array([array.slice(0, cut), array.slice(cut, 7), array.slice(cut + 7)])


@pytest.mark.parametrize(
    "low, kind, values_kind",
    [(0, pa.int64(), pa.int64()), (-50_000, pa.int64(), pa.int64()), (10**12, pa.int64(), pa.int32()),
     (3, pa.int32(), pa.int64()), (0, pa.uint32(), pa.int64()), (-100, pa.int16(), pa.int16())],
    ids=["ids from 0", "negative", "large offset", "int32 rows, int64 values", "uint32", "int16"],
)  # fmt: skip
def test_rows_whose_value_is_wanted_are_marked_as_numpy_isin_marks_them(low, kind, values_kind):
    rng = np.random.default_rng(4)
    span = 20_000
    rows = low + rng.integers(0, span, N)
    nulls = rng.random(N) < 0.03
    column = _column(rows, nulls, kind)
    wanted = low + rng.integers(-span // 4, span + span // 4, 2_000)  # some outside the range
    if values_kind == pa.int32():
        wanted = wanted - low  # int32 values against a column far from them: none match
    values = pa.chunked_array([pa.array(wanted[:1_000]).cast(values_kind), pa.array([None], values_kind)])
    values = pa.chunked_array([*values.chunks, pa.array(wanted[1_000:]).cast(values_kind)])
    if pa.types.is_unsigned_integer(kind):
        values = pa.chunked_array([c.filter(np.asarray(c.fill_null(0)) >= 0) for c in values.chunks], values_kind)
        wanted = wanted[wanted >= 0]
    mask = membership.lookup_mask(column, values)
    assert mask is not None
    got = np.asarray(mask.to_numpy(zero_copy_only=False))
    expected = np.isin(rows, wanted)
    assert (np.asarray(mask.is_null()) == nulls).all()  # a null row: null (no match)
    assert (got[~nulls] == expected[~nulls]).all()
    table = pa.table({"k": column, "i": np.arange(N)})
    assert members(table, "k", values).column("i").to_pylist() == np.flatnonzero(expected & ~nulls).tolist()


def test_a_narrow_column_whose_range_outgrows_its_type_is_looked_up_right():
    rng = np.random.default_rng(12)
    rows = rng.integers(-30_000, 30_000, N).astype(np.int16)  # the range, 60000, is past int16's max
    values = np.array([-29_999, -5, 7, 29_990, 29_999], np.int16)
    mask = membership.lookup_mask(pa.chunked_array([pa.array(rows)]), pa.chunked_array([pa.array(values)]))
    assert mask is not None and (np.asarray(mask) == np.isin(rows, values)).all()


def test_columns_it_cannot_serve_go_to_a_hash_lookup():
    rng = np.random.default_rng(5)
    rows = rng.integers(0, 1_000, N)
    values = pa.chunked_array([pa.array([1, 2, 3])])
    assert membership.lookup_mask(pa.chunked_array([pa.array(rows[:100])]), values) is None  # short
    wide = rows.copy()
    wide[0], wide[1] = membership.MAX_RANGE + 5, -7
    negative = pa.chunked_array([pa.array([-1, 2, 3])])
    assert membership.lookup_mask(pa.chunked_array([pa.array(wide)]), negative) is None  # too wide a range
    # values from 1 up: a table over theirs, the column's far and negative values clipped off
    mask = membership.lookup_mask(pa.chunked_array([pa.array(wide)]), values)
    assert mask is not None and (np.asarray(mask) == np.isin(wide, [1, 2, 3])).all()
    with_zero = pa.chunked_array([pa.array([0, 2])])  # 0 wanted: a negative row must not clip onto it
    assert membership.lookup_mask(pa.chunked_array([pa.array(wide)]), with_zero) is None  # and too wide
    small = np.concatenate([[-3], rows[1:]])  # 0 wanted, a row below it, a range that fits: shifted
    mask = membership.lookup_mask(pa.chunked_array([pa.array(small)]), with_zero)
    assert mask is not None and (np.asarray(mask) == np.isin(small, [0, 2])).all()
    unsigned = pa.chunked_array([pa.array(rows, pa.uint64())])
    assert membership.lookup_mask(unsigned, values) is None
    assert membership.lookup_mask(pa.chunked_array([pa.array(rows)]), values.cast(pa.uint64())) is None
    assert membership.lookup_mask(pa.chunked_array([pa.array([None] * N, pa.int64())]), values) is None
    # and the hash lookup then answers the same
    table = pa.table({"k": unsigned, "i": np.arange(N)})
    kept = members(table, "k", values.cast(pa.uint64()))
    assert kept.column("i").to_pylist() == np.flatnonzero(np.isin(rows, [1, 2, 3])).tolist()


def test_a_short_column_is_looked_up_by_arrow_with_the_same_rows_as_numpy_isin():
    rng = np.random.default_rng(6)
    n = 5_000
    rows = rng.integers(-100, 100, n)
    nulls = rng.random(n) < 0.05
    column = _column(rows, nulls, pa.int32())
    values = pa.chunked_array([pa.array([3, -7, None, 50, 1_000], pa.int32())])  # a null matches no row
    mask = membership.member_mask(column, values)
    assert mask is not None and mask.null_count == 0
    expected = np.isin(rows, [3, -7, 50]) & ~nulls
    assert (np.asarray(mask) == expected).all()
    table = pa.table({"k": column, "i": np.arange(n)})
    assert members(table, "k", values).column("i").to_pylist() == np.flatnonzero(expected).tolist()
    # values of another type: Polars' lookup (it casts them), with the same rows
    assert membership.member_mask(column, values.cast(pa.int64())) is None
    assert members(table, "k", values.cast(pa.int64())).column("i").to_pylist() == np.flatnonzero(expected).tolist()


# ---- a column sorted chunk by chunk: the wanted values' runs found by binary search ----
def _sorted_column(rng: np.random.Generator, kind: pa.DataType, start: int = 0) -> tuple[np.ndarray, pa.ChunkedArray]:
    """Runs of 1 to 7 equal ids (lineitem's orders), ascending, in chunks of uneven size (one
    empty, one cut inside a run); the last chunk starts below the one before it (each chunk
    is sorted, not the column)."""
    ids = start + np.repeat(np.arange(0, 3 * N // 4 * 2, 2), rng.integers(1, 8, 3 * N // 4))[:N]
    tail = np.sort(rng.integers(start, start + 1_000, 3_000))
    rows = np.concatenate([ids, tail])
    cut = len(ids) // 3 + 1
    parts = [rows[:cut], rows[cut:cut], rows[cut : len(ids)], tail]
    return rows, pa.chunked_array([pa.array(p).cast(kind) for p in parts], kind)


@pytest.mark.parametrize("kind", [pa.int64(), pa.int32(), pa.uint32()])
def test_rows_of_a_sorted_column_are_found_as_numpy_isin_finds_them(kind):
    rng = np.random.default_rng(7)
    rows, column = _sorted_column(rng, kind)
    wanted = rng.integers(-100, rows.max() + 100, len(rows) // 40)
    wanted = wanted[wanted >= 0] if pa.types.is_unsigned_integer(kind) else wanted
    values = pa.chunked_array([pa.array(wanted[:50]), pa.array([None], pa.int64()), pa.array(wanted[50:])])
    got = membership.sorted_rows(column, values)  # values repeat and fall outside the range
    assert got is not None
    assert got.tolist() == np.flatnonzero(np.isin(rows, wanted)).tolist()
    table = pa.table({"k": column, "i": np.arange(len(rows))})
    assert members(table, "k", values).column("i").to_pylist() == got.tolist()


def test_an_inner_join_s_pairs_of_a_sorted_column_match_a_merge_of_numpy():
    rng = np.random.default_rng(8)
    rows, column = _sorted_column(rng, pa.int64(), start=-5_000)
    keys = rng.permutation(np.arange(-6_000, rows.max() + 50, 3))[: len(rows) // 20]  # distinct, unsorted
    pairs = membership.sorted_pairs(column, pa.chunked_array([pa.array(keys)]))
    assert pairs is not None
    got_rows, got_keys = pairs
    expected = np.flatnonzero(np.isin(rows, keys))
    assert got_rows.tolist() == expected.tolist()
    assert (keys[got_keys] == rows[got_rows]).all()


def test_a_column_or_keys_it_cannot_search_are_left_to_the_hash_joins():
    rng = np.random.default_rng(9)
    rows, column = _sorted_column(rng, pa.int64())
    keys = pa.chunked_array([pa.array(np.arange(0, 200, 2))])
    assert membership.sorted_pairs(column, keys) is not None
    late = rows.copy()
    late[membership.PROBE_ROWS + 10] = -1  # sorted in its first rows only
    assert membership.sorted_rows(pa.chunked_array([pa.array(late)]), keys) is None
    assert membership.sorted_pairs(pa.chunked_array([pa.array(late)]), keys) is None
    twice = pa.chunked_array([pa.array([4, 8, 4])])  # a key on two rows: a row per match
    assert membership.sorted_pairs(column, twice) is None
    assert membership.sorted_pairs(column, pa.chunked_array([pa.array([4, None])])) is None
    assert membership.sorted_pairs(column, keys.cast(pa.int32())) is None  # types differ
    assert membership.sorted_rows(column, keys.cast(pa.int32())) is not None  # a filter: the values compared
    many = pa.chunked_array([pa.array(np.arange(len(rows) // 8))])  # more values than binary searches pay for
    assert membership.sorted_rows(column, many) is None
    with_null = pa.chunked_array([pa.array([1, None, 2] + list(range(3, N)))])
    assert membership.sorted_rows(with_null, keys) is None


def test_an_inner_join_s_pairs_of_an_increasing_column_match_numpy():
    rng = np.random.default_rng(10)
    ids = np.cumsum(rng.integers(1, 5, 9_000)) - 300  # strictly increasing, negative ones too
    column = pa.chunked_array([pa.array(ids[:4_000]), pa.array(ids[4_000:])])  # in two chunks
    keys = rng.integers(-400, ids.max() + 50, 30_000)  # repeating, unsorted, some matching nothing
    pairs = membership.increasing_pairs(column, pa.chunked_array([pa.array(keys)]))
    assert pairs is not None
    rows, at = pairs
    expected = np.flatnonzero(np.isin(keys, ids))
    assert at.tolist() == expected.tolist()  # the keys' rows that match, ascending
    assert (ids[rows] == keys[at]).all()


def test_a_column_that_does_not_strictly_increase_is_left_to_the_hash_joins():
    keys = pa.chunked_array([pa.array([3, 3, 8])])
    ids = np.arange(0, 20_000, 2)
    assert membership.increasing_pairs(pa.chunked_array([pa.array(ids)]), keys) is not None
    twice = ids.copy()
    twice[membership.PROBE_ROWS + 7] = twice[membership.PROBE_ROWS + 6]  # equal past the first rows
    assert membership.increasing_pairs(pa.chunked_array([pa.array(twice)]), keys) is None
    falling = ids.copy()
    falling[-1] = 0
    assert membership.increasing_pairs(pa.chunked_array([pa.array(falling)]), keys) is None
    assert membership.increasing_pairs(pa.chunked_array([pa.array(ids)]), keys.cast(pa.int32())) is None
    assert membership.increasing_pairs(pa.chunked_array([pa.array([1, None, 5])]), keys) is None
    assert (
        membership.increasing_pairs(pa.chunked_array([pa.array(ids)]), pa.chunked_array([pa.array([1, None])])) is None
    )
    assert membership.increasing_pairs(pa.chunked_array([pa.array([], pa.int64())]), keys) is None
