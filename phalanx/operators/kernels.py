"""Local (single-rank) kernels.  The one place that decides which engine runs what.

Measured on this machine (see docs/performance.md): polars is fastest for hash-partitioning
and sort and has rich group-by expressions; DuckDB joins 5M x 5M rows 1.6x faster than polars
on one thread (0.37 s vs 0.57 s) and its null-safe ``IS NOT DISTINCT FROM`` costs nothing.  Everything enters and leaves as Arrow; ``from_polars``
restores the caller's column types (polars hands strings back as large_string).
"""

from __future__ import annotations

import functools
import keyword
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

HASH_SEED = 0x5EED  # fixed: equal keys must land on the same rank on every rank and run
# Integer keys (every key column an integer type, nulls counted as 0) hash with a numpy
# multiplicative (Fibonacci) hash: deterministic across library versions and ~2x cheaper than
# polars' row hash on one thread.  Other keys use polars' row hash, stable only within one
# polars version.  The id names both, so a stored dataset is reused as hash-partitioned only
# by the same functions.
_FIB = np.uint64(0x9E3779B97F4A7C15)
HASH_ID = f"px-fib64-int-keys|polars-{pl.__version__}-hash_rows-seed{HASH_SEED}"


def to_polars(table: pa.Table) -> pl.DataFrame:
    return cast(
        pl.DataFrame, pl.from_arrow(table, rechunk=False)
    )  # a Table's is a DataFrame (typed DataFrame | Series)


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


def _int_key_arrays(table: pa.Table, keys: Sequence[str]) -> list[np.ndarray] | None:
    """The key columns as int64 numpy arrays (nulls as 0), or None unless all are integers."""
    out = []
    for k in keys:
        col = table.column(k)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        if not pa.types.is_integer(col.type):
            return None
        if col.null_count:
            col = pc.fill_null(col, 0)
        if col.type != pa.int64():
            col = col.cast(pa.int64())
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
        out.append(arr.to_numpy(zero_copy_only=False))
    return out


def _id_dtype(nparts: int) -> type:
    return np.uint8 if nparts <= 1 << 8 else np.uint16 if nparts <= 1 << 16 else np.uint32


_BLOCK = 1 << 16  # rows per block of the hash pass: its temporaries stay in cache


def partition_ids(table: pa.Table, keys: Sequence[str], nparts: int) -> np.ndarray:
    """The hash partition (0..nparts-1) of every row, from the key columns only (uint8 when
    nparts <= 256, uint16 / uint32 above)."""
    return partition_ids_counts(table, keys, nparts)[0]


def partition_ids_counts(table: pa.Table, keys: Sequence[str], nparts: int) -> tuple[np.ndarray, np.ndarray]:
    """``partition_ids`` and the number of rows per partition, in one pass."""
    ints = _int_key_arrays(table, keys)
    dtype = _id_dtype(nparts)
    if ints is None:
        hashed = to_polars(normalize_keys(table.select(list(keys)), keys)).hash_rows(seed=HASH_SEED)
        ids = (hashed % nparts).cast(pl.UInt32).to_numpy().astype(dtype, copy=False)
        return ids, np.bincount(ids, minlength=nparts)
    n = table.num_rows
    ids = np.empty(n, dtype=dtype)
    counts = np.zeros(nparts, dtype=np.int64)
    buf = np.empty(min(n, _BLOCK), dtype=np.uint64)
    views = [a.view(np.uint64) for a in ints]
    shift, scale = np.uint64(32), np.uint64(nparts)
    for start in range(0, n, _BLOCK):
        stop = min(n, start + _BLOCK)
        h = buf[: stop - start]
        np.multiply(views[0][start:stop], _FIB, out=h)
        for more in views[1:]:
            h ^= h >> np.uint64(29)
            h ^= more[start:stop]
            h *= _FIB
        # the top 32 bits of the product scaled to [0, nparts): no modulo bias, no division
        h >>= shift
        h *= scale
        h >>= shift
        out = ids[start:stop]
        out[...] = h
        counts += np.bincount(out, minlength=nparts)
    return ids, counts


def estimate_distinct(table: pa.Table, keys: Sequence[str], sample_rows: int = 100_000, seed: int = 0) -> float:
    """The number of distinct ``keys`` in ``table``, estimated from a sample of rows with
    Chao's estimator, d + f1²/(2·f2) (d distinct in the sample, f1 of them seen once, f2 twice),
    capped at the row count.  The share of distinct keys *in a sample* misleads: 100k keys over
    5M rows show 63% distinct in a 100k-row sample, though pre-aggregating shrinks the rows 50×."""
    n = table.num_rows
    if not n:
        return 0.0
    sample = _sampled(table.select(list(keys)), sample_rows, seed)
    d, f1, f2 = _key_frequencies(sample, keys)
    if n <= sample_rows:
        return float(d)
    extra = f1 * f1 / (2 * f2) if f2 else f1 * (f1 - 1) / 2
    return float(min(n, d + extra))


def _sampled(table: pa.Table, sample_rows: int, seed: int) -> pa.Table:
    """About ``sample_rows`` of the table's rows (all of them if it has no more): each row
    kept with probability sample/n (a Bernoulli sample: no row twice, which would count as a
    key seen twice), in order, from geometric gaps: O(sample), where choice(replace=False)
    permutes all n rows (20 ms at 2M) and np.unique of random draws sorts them (24 ms for
    100k).  Not a fixed stride: rows of a key often lie together (an order's lines after a
    join), and a stride steps over such runs — Q10's 3-row runs at a stride of 5.7 showed no
    key twice, so the estimate read "all distinct"."""
    n = table.num_rows
    if n <= sample_rows:
        return table
    gaps = np.random.default_rng(seed).geometric(sample_rows / n, int(sample_rows * 1.1) + 64)
    rows = np.cumsum(gaps) - 1
    return take_ascending(table, rows[: np.searchsorted(rows, n)])


def spreading_keys(table: pa.Table, keys: Sequence[str], sample_rows: int = 4_096, seed: int = 0) -> list[bool]:
    """For each key, whether its values alone tell apart at least ``SPREAD_SHARE`` of the
    groups the keys together tell apart in a sample of rows: a hash placement by it alone
    then spreads the groups about as evenly (a key with a value on many rows tells fewer
    apart), and hashes one column instead of all (4 string keys, 2M rows: 106 ms, 60 of
    them converting the strings for Polars' hash)."""
    sample = _sampled(table.select(list(keys)), sample_rows, seed)
    if sample.num_rows == 0:
        return [False] * len(keys)
    groups = _key_frequencies(sample, keys)[0]
    try:
        return [pc.count_distinct(sample.column(k), mode="all").as_py() >= SPREAD_SHARE * groups for k in keys]
    except pa.ArrowNotImplementedError:  # a key type Arrow does not hash: all the keys, as before
        return [False] * len(keys)


SPREAD_SHARE = 0.9


_ARROW_COUNTS_ROWS = 20_000  # up to this many sampled rows, Arrow counts the keys


def _key_frequencies(sample: pa.Table, keys: Sequence[str]) -> tuple[int, int, int]:
    """(distinct keys, keys seen once, keys seen twice) in the sample.  A small sample's in
    Arrow's group-by: 0.6 ms for 1000 rows where a DuckDB call costs 4 (its fixed cost;
    every group-by of more than 2000 rows a rank counts such a sample); a large one's in DuckDB,
    over the Arrow columns as they are (Polars first converted the strings: TPC-H Q10's 7
    keys, 41 ms per estimate; Arrow's group-by is 10% slower on several keys)."""
    if sample.num_rows <= _ARROW_COUNTS_ROWS:
        try:
            grouped = sample.group_by(list(keys), use_threads=False).aggregate([([], "count_all")])
        except pa.ArrowNotImplementedError:  # a key type Arrow does not hash
            pass
        else:
            counts = grouped.column("count_all").to_numpy()
            return len(counts), int((counts == 1).sum()), int((counts == 2).sum())
    cols = ", ".join(quote_ident(k) for k in keys)
    d, f1, f2 = (
        run_sql(
            "SELECT count(*), count(*) FILTER (WHERE c = 1), count(*) FILTER (WHERE c = 2) "
            f"FROM (SELECT count(*) AS c FROM __px_s GROUP BY {cols})",
            __px_s=sample,
        )
        .to_pylist()[0]
        .values()
    )
    return d, f1, f2


def take_ascending(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """The rows at the ascending indices ``rows``, batch by batch where a column has several
    chunks: Arrow's take over a chunked column joins its chunks first (90k of a rank's 3M
    lines in 24 chunks, 4 columns: 11.9 ms; batch by batch 2.3)."""
    if table.num_columns == 0 or all(c.num_chunks <= 1 for c in table.columns):
        return table.take(rows)
    parts, start = [], 0
    for batch in table.to_batches():
        lo, hi = np.searchsorted(rows, [start, start + batch.num_rows])
        if hi > lo:
            parts.append(batch.take(pa.array(rows[lo:hi] - start)))
        start += batch.num_rows
    return pa.Table.from_batches(parts, table.schema)


def split_by_ids(table: pa.Table, ids: np.ndarray, nparts: int, counts: np.ndarray | None = None) -> list[pa.Table]:
    """Rows with id i (``ids`` as from ``partition_ids``) into table i, row order kept.

    One counting pass (Arrow's stable sort of small integers is a counting sort), one gather
    of every column into a single destination table, zero-copy slices per partition.  When
    all rows share one id (a skewed key) nothing is copied.
    """
    if counts is None:
        counts = np.bincount(ids, minlength=nparts)
    empty = table.schema.empty_table()
    full = np.flatnonzero(counts)
    if len(full) <= 1:
        return [table if i in full else empty for i in range(nparts)]
    order = pc.array_sort_indices(pa.array(ids))
    taken = table.take(order)
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [taken.slice(int(starts[i]), int(counts[i])) if counts[i] else empty for i in range(nparts)]


def hash_partition(table: pa.Table, keys: Sequence[str], nparts: int) -> list[pa.Table]:
    """Split rows by hash of ``keys`` into ``nparts`` tables (row order kept within each)."""
    if nparts == 1:
        return [table]
    if table.num_rows == 0:
        return [table] * nparts
    ids, counts = partition_ids_counts(table, keys, nparts)
    return split_by_ids(table, ids, nparts, counts)


def sort(table: pa.Table, by: Sequence[str], descending: Sequence[bool]) -> pa.Table:
    """Stable sort, nulls last in every column (pandas' na_position='last'); floats as polars
    orders them (NaN above every number).

    One plain (non-string) column: polars sorts the frame.  Otherwise one stable arg-sort per
    column, last column first (an LSD sort: each pass keeps the order of the passes before
    it among its ties), strings ranked among their distinct values first, and one gather.
    Measured on one thread, 5M rows: polars' own sort by (int, int) takes 6.5 s and by one
    string column 2.1-5.8 s; the passes take 0.58 s and 0.2-3.4 s.
    """
    if table.num_rows <= 1:
        return table
    order = _arrow_order(table, by, descending)
    if order is not None:
        return table.take(order)
    if len(by) == 1 and not _is_string(table.schema.field(by[0]).type):
        return sort_runs(table, by, descending)
    order_keys = [_order_key(table.column(c)) for c in by]
    keys = [k for k in order_keys if k is not None]
    if len(keys) < len(order_keys):  # a nested type: polars' multi-column sort
        return sort_runs(table, by, descending)
    perm = None
    for key, desc in zip(reversed(keys), reversed(list(descending))):
        if perm is not None:
            key = key.gather(perm)
        step = (
            pl.DataFrame({"k": key})
            .select(pl.arg_sort_by("k", descending=desc, nulls_last=True, maintain_order=True))
            .to_series()
        )
        perm = step if perm is None else perm.gather(step)
    # polars' gather: 0.19 s for 5M rows with a string column, Arrow's take 1.0 s
    return from_polars(to_polars(table).gather(perm), table.schema)


# a frame up to this many rows is sorted by Arrow: Polars' conversions and plan cost ~1.5 ms
# whatever the rows (TPC-H's final ORDER BYs and Q2's top 100 of 300 rows: 1.47 -> 0.03 ms)
_ARROW_SORT_MAX_ROWS = 20_000


def _arrow_order(table: pa.Table, by: Sequence[str], descending: Sequence[bool]) -> pa.Array | None:
    """The stable order of a small table's rows as ``sort`` orders them, by Arrow's
    ``sort_indices``; None for a long table, a key type it might order otherwise, or a NaN in
    a descending float key (Arrow puts NaNs last, Polars first)."""
    if table.num_rows > _ARROW_SORT_MAX_ROWS:
        return None
    keys = []
    for name, desc in zip(by, descending):
        kind, column = table.schema.field(name).type, table.column(name)
        if pa.types.is_floating(kind):
            if desc and pc.any(pc.is_nan(column)).as_py():
                return None
        elif not (exact_hash_type(kind) or pa.types.is_timestamp(kind)):
            return None
        keys.append((name, "descending" if desc else "ascending", "at_end"))
    try:  # a null placement per key: pyarrow 25 and later
        return pc.sort_indices(table, options=pc.SortOptions(sort_keys=keys))
    except (TypeError, ValueError, pa.ArrowInvalid):
        return None


def sort_runs(table: pa.Table, by: Sequence[str], descending: Sequence[bool]) -> pa.Table:
    """Polars' stable sort of the frame: ``sort`` of one plain column, and of rows that are
    already a few sorted runs (what a sample sort receives), which its multi-column sort finds (5M rows in 2 runs of (float, string, int) keys:
    0.34 s, where the per-column passes take 2.1 s)."""
    if table.num_rows <= 1:
        return table
    df = to_polars(table).sort(list(by), descending=list(descending), nulls_last=True, maintain_order=True)
    return from_polars(df, table.schema)


def _is_string(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_string_view(t)
        or pa.types.is_binary_view(t)
    )


def _order_key(col: pa.ChunkedArray) -> pl.Series | None:
    """A polars column that sorts like ``col`` (nulls where it has them): the column itself,
    or for strings each value's rank among the distinct values in byte order; None for a
    nested type."""
    t = col.type
    if pa.types.is_nested(t):
        return None
    if pa.types.is_dictionary(t):
        col = col.cast(t.value_type)
    if not _is_string(col.type):
        return pl.Series("k", col)
    encoded = pc.dictionary_encode(col)
    if encoded.num_chunks > 1:
        encoded = encoded.unify_dictionaries()  # one dictionary, indices remapped to it
    dictionary = encoded.chunk(0).dictionary
    rank = np.empty(len(dictionary), dtype=np.uint32)
    rank[pc.array_sort_indices(dictionary).to_numpy()] = np.arange(len(dictionary), dtype=np.uint32)
    chunks = []
    for chunk in encoded.chunks:
        idx = chunk.indices
        ranks = rank[pc.fill_null(idx, 0).to_numpy()] if len(rank) else np.zeros(len(idx), np.uint32)
        chunks.append(pa.array(ranks, mask=idx.is_null().to_numpy(zero_copy_only=False) if idx.null_count else None))
    return pl.Series("k", pa.chunked_array(chunks, pa.uint32()))


def top_k(table: pa.Table, by: Sequence[str], descending: Sequence[bool], k: int) -> pa.Table:
    """The first ``k`` rows of ``sort(table, by, descending)``, ties in table order: polars
    plans a stable sort followed by a slice as a partial sort."""
    if table.num_rows <= k:
        return sort(table, by, descending)
    order = _arrow_order(table, by, descending)
    if order is not None:
        return table.take(order[:k])
    df = (
        to_polars(table)
        .lazy()
        .sort(list(by), descending=list(descending), nulls_last=True, maintain_order=True)
        .head(k)
        .collect()
    )
    return from_polars(df, table.schema)


# a right side up to this many rows joins by Arrow's hash lookup (``_index_join``); at 100k
# rows its hash table costs as much as Polars' join (TPC-H Q14's 75k lines x 100k parts)
_INDEX_JOIN_MAX_RIGHT = 50_000


def exact_hash_type(t: pa.DataType) -> bool:
    """Key types Arrow's hashing (group-by, lookup) tells apart exactly as pandas and SQL do:
    not floats (Arrow tells NaNs apart and -0.0 from 0.0)."""
    return (
        pa.types.is_integer(t)
        or pa.types.is_date(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
    )


def _index_join(
    left: pa.Table, right: pa.Table, left_on: Sequence[str], right_on: Sequence[str], how: str
) -> pa.Table | None:
    """``join`` by Arrow's hash lookup of each left key among the right's (``index_in``, a null
    matching a null): the left's rows in their order, the right's row of each taken.  For
    inner and left joins where one key's right column holds each value once (the other keys
    then compared on the row it finds), and semi and anti joins on one key, with a right side
    of at most ``_INDEX_JOIN_MAX_RIGHT`` rows; an inner join whose right side has no such key
    looks the right's rows up among the left's where the left has one and is that small.
    None otherwise.

    Why: the joins of a query's small tables cost Polars' fixed ~1.2 ms each (two conversions
    each way, two collects: TPC-H Q2 joins six times); by lookup 30-140 us for up to 5000
    rows, and 1M x 50k rows inner 11 ms vs 16 (docs/performance.md, "Joins by lookup")."""
    if how not in ("inner", "left", "semi", "anti"):
        return None
    pairs = list(zip(left_on, right_on))
    if not all(_lookup_pair(left.schema.field(a).type, right.schema.field(b).type) for a, b in pairs):
        return None
    if how in ("semi", "anti"):
        if len(pairs) != 1 or right.num_rows > _INDEX_JOIN_MAX_RIGHT:
            return None
        found = pc.is_in(left.column(left_on[0]), value_set=right.column(right_on[0]))
        return left.filter(found if how == "semi" else pc.invert(found))
    shared = {a for a, b in pairs if a == b}
    extra = right.select([n for n in right.column_names if n not in shared])
    schema = pa.schema([*left.schema, *extra.schema])
    at = _looked_up(left, right, pairs)
    if at is not None:
        _note_lookup(how, pairs, left, right)
        if how == "inner":
            found = pc.is_valid(at)
            left, at = left.filter(found), pc.drop_null(at)
        taken = extra.take(at)  # a null index (a left row without a match) takes nulls
        return pa.Table.from_arrays([*left.columns, *taken.columns], schema=schema)
    if how != "inner" or right.num_rows > _LOOKUP_MAX_PROBE:
        return None
    at = _looked_up(right, left, [(b, a) for a, b in pairs])  # each right row's left row
    if at is None:
        return None
    _note_lookup(how, pairs, left, right)
    found = pc.is_valid(at)
    taken, extra = left.take(pc.drop_null(at)), extra.filter(found)
    return pa.Table.from_arrays([*taken.columns, *extra.columns], schema=schema)


_LOOKUP_MAX_PROBE = 1_000_000  # rows looked up among a small side's (1M x 50k: 11 ms vs Polars' 16)


def _looked_up(probe: pa.Table, build: pa.Table, pairs: list[tuple[str, str]]) -> Any | None:
    """For each probe row, the index of the build row with the same keys (null: none), where
    one key's build column holds each value once and the build side has at most
    ``_INDEX_JOIN_MAX_RIGHT`` rows; None otherwise.  The other keys are compared on the row
    that key finds (null matching null)."""
    if build.num_rows > _INDEX_JOIN_MAX_RIGHT:
        return None
    # a null counts once; Polars counts the distinct values in a fifth of Arrow's time
    by = next((p for p in pairs if pl.Series(build.column(p[1])).n_unique() == build.num_rows), None)
    if by is None:
        return None  # a key on several rows: a row per match, the hash join's work
    at = pc.index_in(probe.column(by[0]), value_set=build.column(by[1]))
    for a, b in pairs:
        if (a, b) != by:
            mine, theirs = probe.column(a), build.column(b).take(at)
            same = pc.or_kleene(pc.equal(mine, theirs), pc.and_(pc.is_null(mine), pc.is_null(theirs)))
            at = pc.if_else(pc.fill_null(same, False), at, pa.scalar(None, at.type))
    return at


def _note_lookup(how: str, pairs: list[tuple[str, str]], left: pa.Table, right: pa.Table) -> None:
    from .plan import note, noting

    if noting():
        on = ", ".join(f"{a} = {b}" for a, b in pairs)
        note(f"per-rank join (Arrow lookup): {how} on {on}, {left.num_rows} x {right.num_rows} rows")


def _lookup_pair(left: pa.DataType, right: pa.DataType) -> bool:
    """Key types the lookup join compares exactly as the hash joins do."""
    return left == right and (exact_hash_type(left) or pa.types.is_timestamp(left))


# Polars' join table outgrows the caches where DuckDB's partitioned one does not: 10M x 10M
# rows (90% distinct keys) on one thread 2.53 s in Polars, 1.11 s in DuckDB
_POLARS_JOIN_MAX_RIGHT = 1_000_000


def _polars_join(
    left: pa.Table, right: pa.Table, left_on: Sequence[str], right_on: Sequence[str], how: str
) -> pa.Table | None:
    """``join`` in Polars, or None where a column's type would not come back unchanged.

    Why: on one thread Polars' hash join over Arrow tables takes 0.4-0.8x DuckDB's (DuckDB
    reads Arrow through its scan, then builds and probes): a 3M-row probe against 10k / 500k /
    3M keys, inner 16 / 74 / 312 ms vs 35 / 124 / 421, semi 13 / 45 / 169 vs 35 / 111 / 322,
    left 44 / 86 / 394 vs 189 / 230 / 626; strings on both sides (2M x 200k, inner) 232 vs
    406 ms, string keys 198 vs 297; 5M x 5M with repeated keys alike (1.68 vs 1.71 s)
    (docs/performance.md, "Joins in Polars").  Null keys match each other, NaN matches NaN
    and -0.0 matches 0.0, as DuckDB's ``IS NOT DISTINCT FROM``.  A right side of more than a
    million rows, a left join whose right side has more rows than its left, and right and
    outer joins stay in DuckDB (below)."""
    from .plan_polars import _simple

    if not all(_simple(f.type) for f in (*left.schema, *right.schema)):
        return None
    if right.num_rows > _POLARS_JOIN_MAX_RIGHT:
        return None
    if how in ("right", "outer") or (how == "left" and left.num_rows < right.num_rows):
        # Polars builds its table on the right side of an outer join whatever the sizes: 75k
        # customers left-joined with 730k orders (TPC-H Q13) 52 ms, DuckDB 34
        return None
    if len(set(left.schema.names)) != left.num_columns or len(set(right.schema.names)) != right.num_columns:
        return None
    # the right's columns under names of their own: no suffixes, no clash with the left's
    temp = {n: f"__px_r{i}" for i, n in enumerate(right.schema.names)}
    while set(temp.values()) & set(left.schema.names):
        temp = {n: "_" + t for n, t in temp.items()}
    from .plan import note, noting

    if noting():
        on = ", ".join(f"{a} = {b}" for a, b in zip(left_on, right_on))
        note(f"per-rank join (Polars): {how} on {on}, {left.num_rows} x {right.num_rows} rows")
    lf = to_polars(left)
    rf = to_polars(right.rename_columns([temp[n] for n in right.schema.names]))
    out = lf.join(
        rf,
        left_on=list(left_on),
        right_on=[temp[k] for k in right_on],
        how=how,  # type: ignore[arg-type]
        nulls_equal=True,
        coalesce=False,
        maintain_order="none",
    )
    if how in ("semi", "anti"):
        return restore_types(out.to_arrow(), left.schema)
    shared = {a for a, b in zip(left_on, right_on) if a == b}  # inner, left: the left's
    cols = [*left.schema.names, *(pl.col(temp[n]).alias(n) for n in right.schema.names if n not in shared)]
    like = pa.schema(list(left.schema) + [f for f in right.schema if f.name not in shared])
    return restore_types(out.select(cols).to_arrow(), like)


_JOIN_SQL = {
    "inner": "JOIN",
    "left": "LEFT JOIN",
    "right": "RIGHT JOIN",
    "outer": "FULL JOIN",
    "semi": "SEMI JOIN",
    "anti": "ANTI JOIN",
}
_duckdb = None


def rank_threads() -> int:
    """This rank's thread budget (``PHALANX_THREADS``; else every CPU)."""
    import os

    from ..runtime.envvars import ENV_THREADS

    return int(os.environ.get(ENV_THREADS, "0") or 0) or (os.cpu_count() or 1)


def duckdb_connection():
    """One DuckDB connection per process, with this rank's thread budget."""
    global _duckdb
    if _duckdb is None:
        import duckdb

        _duckdb = duckdb.connect()
        _duckdb.execute(f"SET threads={rank_threads()}")
        _duckdb.execute("SET preserve_insertion_order=false")  # joins need no output order
    return _duckdb


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def run_sql(query: str, **tables: Any) -> pa.Table:
    """Run ``query`` in this process's DuckDB over the given Arrow tables (by name).  A
    ``plan_sql.SqlInput`` in place of a table is a frame's pending pipeline: it becomes a
    ``WITH`` clause of the query, over its source table, fused into the query's scan."""
    from .plan import note, noting

    withs, registered = [], {}
    for name, table in tables.items():
        if isinstance(table, pa.Table):
            registered[name] = table
        else:
            clause, read = table.with_clause(name)
            withs.append(clause)
            registered.update(read)
    if withs:
        query = "WITH " + ", ".join(withs) + " " + query
    if noting():  # a hot path: the query's text is tidied only for explain
        note("per-rank query (DuckDB): " + " ".join(query.split()))
    con = duckdb_connection()
    if all(name.isidentifier() and not keyword.iskeyword(name) and not name.startswith("_px_") for name in registered):
        return _querying(tuple(registered))(con, query, **registered)
    for name, table in registered.items():
        con.register(name, table)
    try:
        return con.sql(query).to_arrow_table()
    finally:
        for name in registered:
            con.unregister(name)


@functools.lru_cache(maxsize=256)
def _querying(names: tuple[str, ...]) -> Callable[..., pa.Table]:
    """A function whose parameters are ``names``, that runs a query over them.  DuckDB finds a
    table the query names among the local variables of the Python frame that runs it (its
    replacement scan): the tables need no ``register``/``unregister`` around the query, which
    cost 1.3-1.6 ms of a 3 ms join of two small tables (DuckDB 2.0; every operator pays it once
    or twice).  The function's globals hold nothing else a query could pick up by mistake."""
    scope: dict[str, Any] = {}
    exec(
        f"def run(_px_con_, _px_query_, {', '.join(names)}):\n    return _px_con_.sql(_px_query_).to_arrow_table()\n",
        scope,
    )
    return scope["run"]


def join(left: pa.Table, right: pa.Table, left_on: Sequence[str], right_on: Sequence[str], how: str) -> pa.Table:
    """Equi-join where null keys match each other (pandas semantics): by Arrow's hash lookup
    where a side is small and has a key that holds each value once (``_index_join``), else in
    Polars where the right side is small (``_polars_join``), else in DuckDB.  ``semi`` and
    ``anti`` give the left's columns only.

    Column names must already be disjoint except for keys shared by name, which appear once
    (coalesced for right/outer joins, as pandas does for ``on=``).  Columns come out in
    pandas' order: the left's, then the right's.
    """
    joined = _index_join(left, right, left_on, right_on, how)
    if joined is None:
        joined = _polars_join(left, right, left_on, right_on, how)
    if joined is not None:
        return joined
    shared = {a for a, b in zip(left_on, right_on) if a == b}
    cond = " AND ".join(
        f"l.{quote_ident(a)} IS NOT DISTINCT FROM r.{quote_ident(b)}" for a, b in zip(left_on, right_on)
    )
    if how in ("semi", "anti"):  # the left's rows with (without) a match, each once
        out = run_sql(f"SELECT l.* FROM __px_l l {_JOIN_SQL[how]} __px_r r ON {cond}", __px_l=left, __px_r=right)
        return restore_types(out, left.schema)
    cols = []
    for name in left.schema.names:
        if name in shared and how in ("right", "outer"):
            cols.append(f"COALESCE(l.{quote_ident(name)}, r.{quote_ident(name)}) AS {quote_ident(name)}")
        else:
            cols.append(f"l.{quote_ident(name)}")
    cols += [f"r.{quote_ident(n)}" for n in right.column_names if n not in shared]
    out = run_sql(
        f"SELECT {', '.join(cols)} FROM __px_l l {_JOIN_SQL[how]} __px_r r ON {cond}", __px_l=left, __px_r=right
    )
    like = pa.schema(list(left.schema) + [f for f in right.schema if f.name not in shared])
    return restore_types(out, like)
