"""Key ranges: where each rank's values of an integer or date key lie in a range no other rank's
overlaps — tables split by row groups of a sorted key, as lineitem and orders are by their
order key — rows with equal keys meet by moving the few at the ranges' edges, not by a hash
shuffle that moves (P-1)/P of every side.

Each rank says its key's span (min, max, rows, nulls) in one allgather; every rank then decides
alike.  The left's spans, in key order, give each rank an interval it owns; a row goes to the
owner of its key's interval, so the left's rows stay (but a key its range shares with the next
rank's start), and the right's stay where its spans line up with the left's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..runtime.comm.base import Communicator
from . import kernels
from .arrow_agg import _numbers, integer_or_date  # _numbers: integers, dates as day counts
from .exchange import concat, exchange_tables
from .plan import note

MOVED_AT_MOST = 0.25  # of the right's rows, as estimated from the spans: else a hash shuffle
LOAD_AT_MOST = 1.25  # a rank's rows after, against the most any rank holds before


@dataclass(frozen=True)
class Span:
    lo: int | None  # None: no non-null key on this rank
    hi: int | None
    rows: int
    nulls: int


rangeable = integer_or_date  # the keys whose ranks' ranges are compared


def span(column: pa.ChunkedArray) -> Span:
    """The column's (min, max) as integers (a date as its day or millisecond count), rows and
    nulls; one pass over the values where they lie (no copy of a column of many chunks)."""
    nulls = column.null_count
    if len(column) == nulls:
        return Span(None, None, len(column), nulls)
    bounds = pc.min_max(column)
    lo, hi = bounds["min"], bounds["max"]
    if pa.types.is_date(column.type):
        as_int = pa.int32() if pa.types.is_date32(column.type) else pa.int64()
        lo, hi = lo.cast(as_int), hi.cast(as_int)
    return Span(int(lo.as_py()), int(hi.as_py()), len(column), nulls)


def ownership(spans: list[Span], strict: bool = False) -> tuple[list[int], list[int]] | None:
    """(the rank owning each interval in key order, the keys where intervals 1.. start) from
    the spans of every rank, or None where two ranks' spans overlap (touching at one key is
    apart unless ``strict``: that key goes to the later interval)."""
    held = sorted((s.lo, s.hi, r) for r, s in enumerate(spans) if s.lo is not None and s.hi is not None)
    if not held or not all(p[1] < q[0] if strict else p[1] <= q[0] for p, q in zip(held, held[1:])):
        return None
    return [r for *_, r in held], [lo for lo, *_ in held[1:]]


def _interval(owners: list[int], starts: list[int], rank: int) -> tuple[float, float] | None:
    """The keys rank owns, [start, end) (None: it holds no key of the left)."""
    if rank not in owners:
        return None
    i = owners.index(rank)
    return (starts[i - 1] if i else -np.inf), (starts[i] if i < len(starts) else np.inf)


def _share(s: Span, lo: float, end: float) -> float:
    """The part of a span's rows with keys in [lo, end), its keys taken as spread evenly."""
    assert s.lo is not None and s.hi is not None
    inside = min(float(s.hi) + 1, end) - max(float(s.lo), lo)
    return max(0.0, inside) / (s.hi - s.lo + 1)


def _worth_it(right: list[Span], owners: list[int], starts: list[int]) -> bool:
    """Whether the right's rows mostly stay where they are, and no rank ends with many more rows
    than the most any holds now, estimated from the spans (keys spread evenly in each)."""
    total = sum(s.rows for s in right)
    received = dict.fromkeys(owners, 0.0)
    stays = 0.0
    for r, s in enumerate(right):
        if s.lo is None:
            continue
        for o in owners:  # the intervals cover every key
            part = s.rows * _share(s, *_interval(owners, starts, o))  # type: ignore[misc]
            received[o] += part
            stays += part if o == r else 0.0
    moved = total - stays
    most = max(s.rows for s in right)
    return moved <= MOVED_AT_MOST * total and max(received.values(), default=0.0) <= LOAD_AT_MOST * most + 1


def _moved(comm: Communicator, table: pa.Table, key: str, owners: list[int], starts: list[int]) -> pa.Table:
    """This rank's rows whose keys it owns, with those other ranks sent it (a collective)."""
    values = _numbers(table.column(key))
    mine = _interval(owners, starts, comm.rank)
    empty = table.schema.empty_table()
    parts = [empty] * comm.world_size
    if table.num_rows and (mine is None or values.min() < mine[0] or values.max() >= mine[1]):
        bounds = np.asarray(starts, dtype=values.dtype)
        if len(values) < 2 or bool(np.all(values[1:] >= values[:-1])):  # sorted: slices, no copy
            cuts = [0, *np.searchsorted(values, bounds, side="left").tolist(), len(values)]
            for i, o in enumerate(owners):
                parts[o] = table.slice(cuts[i], cuts[i + 1] - cuts[i])
        else:
            ids: np.ndarray = np.asarray(owners, dtype=kernels._id_dtype(comm.world_size))[
                np.searchsorted(bounds, values, "right")
            ]
            parts = kernels.split_by_ids(table, ids, comm.world_size)
        kept = parts[comm.rank]
        parts[comm.rank] = empty
    else:
        kept = table
    received = exchange_tables(comm, parts, table.schema)
    received[comm.rank] = kept
    return concat(received, table.schema)


def co_ranged(
    comm: Communicator, left: pa.Table, right: pa.Table, left_key: str, right_key: str
) -> tuple[pa.Table, pa.Table] | None:
    """Both sides with rows of equal keys on one rank, moved by the left's key ranges, where
    every rank's left keys lie apart from the other ranks' (and so do the right's) and the
    right's ranges line up with the left's well enough that few rows move (``_worth_it``);
    None otherwise (then a hash shuffle).  No null key on any rank (a null matches a null
    anywhere).  The keys are of one integer or date type on both sides."""
    seen = comm.allgather_obj((span(left.column(left_key)), span(right.column(right_key))))
    lefts, rights = [s[0] for s in seen], [s[1] for s in seen]
    if any(s.nulls for s in lefts + rights):
        return None
    owned = ownership(lefts)
    if owned is None or ownership(rights) is None or not _worth_it(rights, *owned):
        return None
    note("no hash exchange: each rank's key range is apart from the others' (rows at the edges moved)")
    return _moved(comm, left, left_key, *owned), _moved(comm, right, right_key, *owned)


def to_owners_of(comm: Communicator, table: pa.Table, key: str, owner_keys: pa.ChunkedArray) -> pa.Table | None:
    """Each of ``table``'s rows sent to the one rank whose ``owner_keys`` (a side that stays
    where it is) can hold its key, where every rank's owner keys lie in a range strictly apart
    from the others' (no key on two ranks); None otherwise, or where a key is null on any rank.
    In place of sending the table to every rank: each row moves at most once, and rows already
    on their owner not at all (lines and orders split by row groups of the order key)."""
    seen = comm.allgather_obj((span(table.column(key)), span(owner_keys)))
    if any(mine.nulls or theirs.nulls for mine, theirs in seen):
        return None
    owned = ownership([theirs for _, theirs in seen], strict=True)
    return None if owned is None else _moved(comm, table, key, *owned)
