"""pandas-style ``merge`` of two distributed frames.

Plan: agree on key types, then either broadcast the smaller side to every rank (when it is
small and the join type allows it) or co-partition both sides by key hash; then join locally.
Null keys match each other, as in pandas.  ``how="semi"``/``"anti"`` keep the left's rows
that have (have no) match — SQL's ``IN``/``NOT IN (subquery)`` — moving only the right's
distinct keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from . import kernels
from .common import as_list, check_columns
from .exchange import allgather_tables, concat
from .plan import Filter, Join, Pipeline, note, rows
from .shuffle import shuffle_table

if TYPE_CHECKING:
    from .dataframe import DataFrame

BROADCAST_BYTES = 64 << 20  # a side larger than this (whole frame) is never broadcast
BROADCAST_ALWAYS_BYTES = 1 << 20  # a side smaller than this always is (where the join allows it)
_HOWS = ("inner", "left", "right", "outer", "semi", "anti")


def _key_type(lt: pa.DataType, rt: pa.DataType, name: str) -> pa.DataType:
    """The common type both sides' key is cast to, or a TypeError naming the key."""
    if lt == rt:
        return lt
    kinds = [
        (pa.types.is_integer, "int"),
        (pa.types.is_floating, "float"),
        (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), "string"),
        (pa.types.is_timestamp, "timestamp"),
        (pa.types.is_boolean, "bool"),
        (pa.types.is_date, "date"),
    ]

    def kind(t):
        for test, k in kinds:
            if test(t):
                return "number" if k in ("int", "float") else k
        return str(t)

    if kind(lt) != kind(rt):
        raise TypeError(f"merge: key {name!r} is {lt} on the left but {rt} on the right; cast one side first")
    return (
        pa.unify_schemas([pa.schema([("k", lt)]), pa.schema([("k", rt)])], promote_options="permissive").field("k").type
    )


def _cast_keys(table: pa.Table, keys: Sequence[str], types: Sequence[pa.DataType]) -> pa.Table:
    for k, t in zip(keys, types):
        if table.schema.field(k).type != t:
            table = table.set_column(table.schema.get_field_index(k), k, table[k].cast(t))
    return table


def _suffix(table: pa.Table, overlap: set[str], suffix: str) -> pa.Table:
    return table.rename_columns([c + suffix if c in overlap else c for c in table.column_names])


Placement = tuple[str, ...]


def merge(
    left: DataFrame, right: DataFrame, *, on, how, left_on, right_on, suffixes, broadcast: bool | None
) -> tuple[pa.Table, Placement | None, tuple[Placement, ...]]:
    """The local partition of the result, the keys it is hash-partitioned by (if any), and
    other column tuples it is equally placed by (an inner join's right keys)."""
    lk, rk, types = _keys(left, right, on=on, how=how, left_on=left_on, right_on=right_on)
    rt = _cast_keys(right.to_arrow(), rk, types)
    lt = _cast_keys(left.to_arrow(), lk, types)
    # A side already hash-partitioned by its join keys, uncast, need not move; nor two sides
    # partitioned by the same positions of their keys (left by (a), right by (a'), joined on
    # (a, b) = (a', b'): matching rows share a and a', so a rank).
    l_placed = tuple(lk) in left._placements() and lt.schema.equals(left.schema)
    r_placed = tuple(rk) in right._placements() and rt.schema.equals(right.schema)
    sub = _common_subset(left.partitioned_by, right.partitioned_by, lk, rk)
    if sub and not (l_placed and r_placed) and lt.schema.equals(left.schema) and rt.schema.equals(right.schema):
        l_placed = r_placed = True
    if left.env.comm.world_size > 1 and l_placed and r_placed:
        note(f"no exchange: both sides already partitioned by {list(left.partitioned_by or ())}")
    if how in ("semi", "anti"):
        table, placed = _semi_join(left, lt, rt, lk, rk, how, l_placed, r_placed, broadcast)
        return table, placed, left._aliases if placed == left.partitioned_by else ()

    # pandas naming: keys shared by name appear once; other clashing columns get suffixes.
    shared = {a for a, b in zip(lk, rk) if a == b}
    overlap = (set(lt.column_names) & set(rt.column_names)) - shared
    if overlap and not all(suffixes):
        raise ValueError(f"merge: columns {sorted(overlap)} overlap and suffixes={suffixes}")
    lt, rt = _suffix(lt, overlap, suffixes[0]), _suffix(rt, overlap, suffixes[1])
    lk = [k + suffixes[0] if k in overlap else k for k in lk]
    rk = [k + suffixes[1] if k in overlap else k for k in rk]

    comm = left.env.comm
    partitioned_by = None
    aliases: tuple[Placement, ...] = ()
    side = None
    if comm.world_size > 1 and not (l_placed and r_placed):
        side = _broadcast_side(comm, lt, rt, how, broadcast)
    if side is not None:
        note(f"Exchange broadcast the {side} side (allgather): {rows(rt if side == 'right' else lt)}")
    if side is not None:  # the other side's rows stay where they are, and so its placements
        stay = left if side == "right" else right
        if side == "right":
            rt = concat(allgather_tables(comm, rt), rt.schema)
        else:
            lt = concat(allgather_tables(comm, lt), lt.schema)
        kept = [p for p in stay._placements() if not overlap & set(p)]
        partitioned_by, aliases = (kept[0], tuple(kept[1:])) if kept else (None, ())
    elif (ranged := _co_ranged(comm, lt, rt, lk, rk, l_placed or r_placed)) is not None:
        lt, rt = ranged  # placed by key ranges, not by hash: no placement to keep
    else:
        lt = lt if l_placed else shuffle_table(comm, lt, lk)
        rt = rt if r_placed else shuffle_table(comm, rt, rk)
        placed_by = [lk[i] for i in sub] if sub and l_placed and r_placed and left.partitioned_by != tuple(lk) else lk
        # Unmatched right rows have null left keys: only coalesced keys stay partitioned.
        if how in ("inner", "left") or set(placed_by) <= shared:
            partitioned_by = tuple(placed_by)
        if how == "inner":  # every row has equal left and right keys: placed by the right's too
            aliases = (tuple(rk[lk.index(k)] for k in placed_by),)
    return kernels.join(lt, rt, lk, rk, how), partitioned_by, aliases


def _keys(
    left: DataFrame, right: DataFrame, *, on, how, left_on, right_on
) -> tuple[list[str], list[str], list[pa.DataType]]:
    """The left's keys, the right's, and the type each pair is joined as; errors name the key."""
    if how not in _HOWS:
        raise ValueError(f"merge: how must be one of {_HOWS}, got {how!r}")
    if on is not None and (left_on is not None or right_on is not None):
        raise ValueError("merge: give either on= or left_on=/right_on=, not both")
    lk = as_list(on if on is not None else left_on)
    rk = as_list(on if on is not None else right_on)
    if not lk or len(lk) != len(rk):
        raise ValueError(f"merge: need the same number of left and right keys, got {lk} and {rk}")
    check_columns(left.schema, lk, "merge (left)")
    check_columns(right.schema, rk, "merge (right)")
    types = [_key_type(left.schema.field(a).type, right.schema.field(b).type, a) for a, b in zip(lk, rk)]
    return lk, rk, types


def pending_join(left: DataFrame, right: DataFrame, *, on, how, left_on, right_on, broadcast) -> Join | None:
    """The join as a pending step of the left's pipeline (``plan.Join``), where the left's
    rows stay on their ranks whatever its size: the right side (its distinct keys for a semi or
    anti join) is under ``BROADCAST_ALWAYS_BYTES`` in all (or ``broadcast=True``) and goes to
    every rank now.  The join then runs with the left's steps before and after it as one
    DuckDB query when the frame's rows are made, filters after it on the left's columns
    pushed below it (into a Parquet scan).  None where that does not hold (then ``merge``
    runs): right or outer joins, a key cast on the left, clashing column names, a right side
    too large.  Every rank decides alike (the schemas are the same; the size is allreduced)."""
    lk, rk, types = _keys(left, right, on=on, how=how, left_on=left_on, right_on=right_on)
    shared = {a for a, b in zip(lk, rk) if a == b}
    clash = (set(left.columns) & set(right.columns)) - shared
    if (
        broadcast is False
        or how not in ("inner", "left", "semi", "anti")
        or (clash and how not in ("semi", "anti"))
        or any(left.schema.field(k).type != t for k, t in zip(lk, types))
    ):
        return None
    comm = left.env.comm
    rt = _cast_keys(right.to_arrow(), rk, types)
    # semi/anti: the right's keys as they are bound their distinct ones (made only when small)
    side = rt.select(rk) if how in ("semi", "anti") else rt
    if not broadcast and int(comm.allreduce(np.array([side.nbytes], dtype=np.int64))[0]) >= BROADCAST_ALWAYS_BYTES:
        return None
    side = _distinct(side) if how in ("semi", "anti") else side
    what = "the right side's distinct keys" if how in ("semi", "anti") else "the right side"
    exchange = (
        f"Exchange broadcast {what} (allgather): {rows(side)}" if comm.world_size > 1 else "no exchange (one rank)"
    )
    side = concat(allgather_tables(comm, side), side.schema) if comm.world_size > 1 else side
    right_out = () if how in ("semi", "anti") else tuple(c for c in side.column_names if c not in shared)
    return Join(side, tuple(lk), tuple(rk), how, tuple(left.columns), right_out, exchange, right._node())


def right_by_left_key_sets(left: DataFrame, right: DataFrame, *, on, how, left_on, right_on, broadcast) -> DataFrame:
    """The right side with a semi join step for each key the left's rows were already filtered
    by — a join in the left's pending steps with a table on every rank, on the column the merge
    joins on (``Pipeline.key_set``): right rows outside that set can find no left row, and an
    inner, left, semi or anti merge drops them.  Nothing moves (the set is on every rank) and
    the right's filter keeps only rows that may match, before the merge sizes and exchanges
    its sides (TPC-H Q9: lineitem semi-joined with green parts meets partsupp on the part key;
    partsupp kept 1/18 of its rows is broadcast, lineitem stays in place)."""
    if how not in ("inner", "left", "semi", "anti") or not left._pipe.steps:
        return right
    lk, rk, _ = _keys(left, right, on=on, how=how, left_on=left_on, right_on=right_on)
    for lkey, rkey in zip(lk, rk):
        found = left._pipe.key_set(lkey)
        if found is None:
            continue
        join, column = found
        keys = join.table.select([column])
        if keys.schema.field(0).type != right.schema.field(rkey).type or _keeps_most(right, rkey, keys.column(0)):
            continue  # a cast key: left to the merge; or a test that would keep most rows
        exchange = f"no exchange: the keys the left's {lkey} was joined with"
        step = Join(keys, (rkey,), (column,), "semi", tuple(right.columns), (), exchange, join.made_by)
        right = right._then(step, right.schema)
    return right


def _to_right_ranges(comm, lt: pa.Table, lk: list[str], right: DataFrame, rk: list[str]) -> pa.Table | None:
    """The left's rows sent to the ranks whose right rows (before the right's pending steps,
    which only drop rows) can match them, where each rank's right keys lie in a range no other
    rank's touches (``ranges.to_owners_of``); None where they do not, or the join is on more
    than one key or one not an integer or date carried from the right's table (decided from
    the plan and the schemas, alike on every rank)."""
    from . import ranges

    carried = right._carried(rk[0]) if len(rk) == 1 else None
    source = right._pipe.source
    if comm.world_size == 1 or carried is None or not isinstance(source, pa.Table):
        return None
    if (
        not ranges.rangeable(lt.schema.field(lk[0]).type)
        or source.schema.field(carried).type != lt.schema.field(lk[0]).type
    ):
        return None
    return ranges.to_owners_of(comm, lt, lk[0], source.column(carried))


def _keeps_most(df: DataFrame, key: str, keys: pa.ChunkedArray) -> bool:
    """Whether "``key`` is one of ``keys``" keeps most of the frame's rows (over 70% of
    samples of its table's rows before its pending steps, every rank's share averaged: the
    ranks decide alike): a test that would be a pass for little."""
    from .plan import selectivity

    source, carried = df._pipe.source, df._carried(key)
    if not isinstance(source, pa.Table) or carried is None or not pa.types.is_integer(keys.type):
        return False  # decided from the plan and the schemas: alike on every rank
    share = selectivity(source.select([carried]), carried, keys)
    shares = df.env.comm.allreduce(np.array([share], dtype=np.float64))
    return float(shares[0]) > 0.7 * df.env.comm.world_size


def pending_join_into_right(
    left: DataFrame, right: DataFrame, *, on, how, left_on, right_on, broadcast
) -> tuple[Join, list[str]] | None:
    """An inner join as a pending step of the *right's* pipeline, the left's rows sent to every
    rank, and the merge's column order: where the right still has local steps to run over a
    table in memory (a filter over lineitem) and the left is small — under
    ``BROADCAST_ALWAYS_BYTES`` in all, or under ``BROADCAST_BYTES`` and at most 1/P of the
    columns the right's steps read (the cost rule of ``_broadcast_side``, the right's size
    taken before its filters: TPC-H Q16's 30k parts of 100k a rank stay the broadcast side).
    The right's filter then keeps only rows whose key the left holds, and its rows are copied
    out once, joined (TPC-H Q3: lineitem's date filter kept 1.6M rows of a rank's 3M for a
    join that kept 15k).  None where that does not hold (then the
    merge materializes both sides).  Every rank decides alike (schemas and pending steps are
    the same on every rank; the sizes are allreduced)."""
    pipe = right._pipe
    if how != "inner" or broadcast is False or not pipe.steps or not isinstance(pipe.source, pa.Table):
        return None
    lk, rk, types = _keys(left, right, on=on, how=how, left_on=left_on, right_on=right_on)
    shared = {a for a, b in zip(lk, rk) if a == b}
    if (set(left.columns) & set(right.columns)) - shared or any(
        right.schema.field(k).type != t for k, t in zip(rk, types)
    ):
        return None
    comm = left.env.comm
    # a left whose filters have not run yet is sized by the columns they read (an upper bound):
    # its steps may yet fuse with a small right side's join (``pending_join``: TPC-H Q7's
    # lineitem with 774 suppliers), so it is made only once it is chosen
    unmade = left._pipe.pending and not left._pipe.costly
    if unmade and not isinstance(left._pipe.source, pa.Table):
        return None
    lt = None if unmade else _cast_keys(left.to_arrow(), lk, types)
    left_bytes = _read_bytes(left._pipe) if lt is None else lt.nbytes
    sizes = comm.allreduce(np.array([left_bytes, _read_bytes(pipe)], dtype=np.int64))
    small = sizes[0] <= BROADCAST_ALWAYS_BYTES or (
        broadcast is None and sizes[0] <= BROADCAST_BYTES and sizes[0] * comm.world_size <= sizes[1]
    )
    if sizes[0] > sizes[1] or not (broadcast or small):  # a smaller right goes to every rank instead
        return None
    lt = _cast_keys(left.to_arrow(), lk, types) if lt is None else lt
    exchange = (
        f"Exchange broadcast the left side (allgather): {rows(lt)}" if comm.world_size > 1 else "no exchange (one rank)"
    )
    # where the left is large, to the right's key ranges (a pass over the right's keys to find
    # them costs less than every rank receiving the left: TPC-H Q7's 3.8 MB of lines, not Q3's
    # 0.2 MB of orders)
    side = _to_right_ranges(comm, lt, lk, right, rk) if sizes[0] > 2 * BROADCAST_ALWAYS_BYTES else None
    partial = side is not None
    if partial:  # each left row only where the right's rows of its key are
        exchange = f"Exchange the left side by the right's key ranges: {rows(lt)}"
    else:
        side = concat(allgather_tables(comm, lt), lt.schema) if comm.world_size > 1 else lt
    left_out = tuple(c for c in left.columns if c not in shared)
    step = Join(side, tuple(rk), tuple(lk), "inner", tuple(right.columns), left_out, exchange, left._node(), partial)
    return step, [*left.columns, *(c for c in right.columns if c not in shared)]


def semi_join_through_right(
    left: DataFrame, right: DataFrame, *, on, how, left_on, right_on, broadcast
) -> Callable[[], pa.Table] | None:
    """A semi or anti join as a semi-join reduction run *through the right's pipeline*: where
    the right still has a filter to run over a table in memory, and the left is made and its
    distinct keys, on every rank, weigh less than the right's key columns before the filter.
    Each rank's right steps then run with "the key is one of the left's" in their filter (a
    ``Join`` step: ``plan._apart``), and only the keys they keep move (TPC-H Q21: 40 thousand
    lines' orders against 730 thousand orders a rank, whose status filter would have been
    made, their distinct keys counted and both sides shuffled).  Returns the function that
    makes this rank's rows (the left's rows stay: placed as the left), or None (then
    ``pending_join`` or ``merge``).  Every rank decides alike (sizes allreduced)."""
    comm = left.env.comm
    pipe = right._pipe
    if how not in ("semi", "anti") or broadcast is not None or not isinstance(pipe.source, pa.Table):
        return None
    if not any(isinstance(s, Filter) for s in pipe.steps) or (left._pipe.pending and not left._pipe.costly):
        return None
    lk, rk, types = _keys(left, right, on=on, how=how, left_on=left_on, right_on=right_on)
    if any(right.schema.field(k).type != t for k, t in zip(rk, types)):
        return None
    lt = _cast_keys(left.to_arrow(), lk, types)
    left_keys = _distinct(lt.select(lk))
    carried = [right._carried(k) for k in rk]  # the source columns the keys are (None: computed)
    right_keys = sum(pipe.source.column(c).nbytes for c in carried if c)
    sizes = comm.allreduce(np.array([left_keys.nbytes, right_keys], dtype=np.int64))
    total = int(sizes[0]) * comm.world_size  # what every rank receiving the left's keys costs
    if not (total <= BROADCAST_BYTES and total <= int(sizes[1])):
        return None

    def run() -> pa.Table:
        keys = left_keys
        if comm.world_size > 1:
            note(f"Exchange allgather the left side's distinct keys (semi-join reduction): {rows(left_keys)}")
            keys = _distinct(concat(allgather_tables(comm, left_keys), left_keys.schema))
        step = Join(keys, tuple(rk), tuple(lk), "semi", tuple(rk), (), "the left's distinct keys")
        mine = right.select(list(rk))
        matched = _distinct(mine._then(step, step.output_schema(mine.schema)).to_arrow())
        note(f"per-rank filter of the right side's pending steps by those keys: {matched.num_rows} keys kept")
        if comm.world_size > 1:
            note(f"Exchange allgather the left's keys the right has: {rows(matched)}")
            matched = concat(allgather_tables(comm, matched), matched.schema)
        return kernels.join(lt, matched, lk, rk, how)

    return run


def _read_bytes(pipe: Pipeline) -> int:
    """The bytes of the source columns a pending pipeline over a table reads."""
    source = pipe.source
    assert isinstance(source, pa.Table)
    return sum(source.column(c).nbytes for c in pipe.optimized()[0])


def _common_subset(
    lp: Sequence[str] | None, rp: Sequence[str] | None, lk: Sequence[str], rk: Sequence[str]
) -> list[int] | None:
    """The positions i of the join keys such that the left is partitioned by (lk[i]...) and the
    right by (rk[i]...) in the same order; None when there are none."""
    if not lp or not rp or len(lp) != len(rp):
        return None
    try:
        pos = [list(lk).index(c) for c in lp]
    except ValueError:
        return None
    return pos if [rk[i] for i in pos] == list(rp) else None


def _semi_join(
    left: DataFrame,
    lt: pa.Table,
    rt: pa.Table,
    lk: list[str],
    rk: list[str],
    how: str,
    l_placed: bool,
    r_placed: bool,
    broadcast: bool | None,
) -> tuple[pa.Table, tuple[str, ...] | None]:
    """The left's rows with (``semi``) or without (``anti``) a matching key on the right, each
    once, the left's columns only.  The left's rows move only where both sides are shuffled,
    or at the edges of key ranges apart on every rank (``_co_ranged``); of the right, only keys
    move:
    - its distinct keys broadcast when its keys are small (or ``broadcast=True``);
    - where the left's keys are few beside what a shuffle would move, a semi-join reduction
      (``_matched_keys``): no distinct of the right's keys is made (TPC-H Q22: 20 thousand
      customers against 1.5 million orders' customer keys, 54 ms a rank for their distinct);
    - else its distinct keys broadcast when small beside the left (``_broadcast_side``), or
      both sides co-partitioned by key."""
    comm = left.env.comm
    rt = rt.select(rk)
    partitioned_by = left.partitioned_by
    if comm.world_size == 1 or (l_placed and r_placed):
        return kernels.join(lt, rt, lk, rk, how), partitioned_by  # duplicate keys cost the join nothing
    if not broadcast and (ranged := _co_ranged(comm, lt, rt, lk, rk, l_placed or r_placed)) is not None:
        return kernels.join(ranged[0], ranged[1], lk, rk, how), None  # edge rows moved: no placement kept
    left_keys = lt.select(lk)
    sizes = comm.allreduce(np.array([lt.nbytes, left_keys.nbytes, rt.nbytes], dtype=np.int64))
    if broadcast is None and sizes[2] > BROADCAST_ALWAYS_BYTES and _reduces(comm.world_size, sizes, l_placed, r_placed):
        return kernels.join(lt, _matched_keys(comm, left_keys, rt, lk, rk), lk, rk, how), partitioned_by
    rt = _distinct(rt)
    if _broadcast_side(comm, lt, rt, how, broadcast) == "right":
        note(f"Exchange broadcast the right side's distinct keys (allgather): {rows(rt)}")
        rt = concat(allgather_tables(comm, rt), rt.schema)
    else:
        lt = lt if l_placed else shuffle_table(comm, lt, lk)
        rt = rt if r_placed else shuffle_table(comm, rt, rk)
        partitioned_by = tuple(lk)
    return kernels.join(lt, rt, lk, rk, how), partitioned_by


def _co_ranged(
    comm, lt: pa.Table, rt: pa.Table, lk: list[str], rk: list[str], placed: bool
) -> tuple[pa.Table, pa.Table] | None:
    """Both sides met by key ranges (``ranges.co_ranged``) where a hash shuffle would move
    them: one integer or date key of one type, neither side already hash-placed (decided from
    the schemas, alike on every rank, before the ranks compare their ranges)."""
    from . import ranges

    kind = lt.schema.field(lk[0]).type
    if placed or comm.world_size == 1 or len(lk) != 1 or not ranges.rangeable(kind):
        return None
    if rt.schema.field(rk[0]).type != kind:
        return None
    return ranges.co_ranged(comm, lt, rt, lk[0], rk[0])


def _reduces(world_size: int, sizes, l_placed: bool, r_placed: bool) -> bool:
    """Whether a semi-join reduction costs less than making the right's distinct keys and
    moving them.  The reduction's cost: every rank receives the left's distinct keys, probes
    its right keys with them (one pass, ~5x cheaper a row than a distinct), and receives the
    matched ones: it pays where the right's keys outnumber all the left's many times over
    (TPC-H Q22: 1.5 million orders' customer keys against 38 thousand customers', 143 → 109
    ms at 2 ranks; not Q4's 300 thousand lines against 76 thousand orders, whose distinct keys
    are broadcast: 113 ms, 138 reduced).  ``sizes``: the left's bytes, its keys' bytes, the
    right keys' bytes, all ranks together."""
    left_keys, right_keys = int(sizes[1]), int(sizes[2])
    if l_placed or r_placed:  # one side placed: the other moves alone; keep it simple
        return False
    return right_keys >= 8 * world_size * left_keys and world_size * left_keys <= BROADCAST_BYTES


def _matched_keys(comm, left_keys: pa.Table, right_keys: pa.Table, lk: list[str], rk: list[str]) -> pa.Table:
    """The left's distinct keys that some rank's right keys hold, on every rank (a semi-join
    reduction): the left's distinct keys go to every rank, each rank keeps those its right
    keys match (one hash pass over them), and those go to every rank.  Joined with them, each
    rank's left rows find their match (or, for an anti join, that they have none) where they
    are.  Null keys match as the join's do (the same kernel)."""
    lkeys = _distinct(left_keys)
    note(f"Exchange allgather the left side's distinct keys (semi-join reduction): {rows(lkeys)}")
    lkeys = concat(allgather_tables(comm, lkeys), lkeys.schema)
    lkeys = _distinct(lkeys)
    matched = kernels.join(lkeys, right_keys, lk, rk, "semi").rename_columns(rk)  # named as the right's
    note(f"Exchange allgather the left's keys the right has: {rows(matched)}")
    return concat(allgather_tables(comm, matched), matched.schema)


def _distinct(table: pa.Table) -> pa.Table:
    return kernels.from_polars(kernels.to_polars(table).unique(maintain_order=False), table.schema)


def _broadcast_side(comm, lt: pa.Table, rt: pa.Table, how: str, broadcast: bool | None) -> str | None:
    """Which side to replicate: only one whose unmatched rows are never output."""
    if broadcast is False:
        return None
    sizes = comm.allreduce(np.array([lt.nbytes, rt.nbytes], dtype=np.int64))
    allowed = {
        "inner": ("left", "right"),
        "left": ("right",),
        "right": ("left",),
        "outer": (),
        "semi": ("right",),
        "anti": ("right",),
    }[how]
    limit = np.inf if broadcast else BROADCAST_BYTES
    candidates = [(sizes[0 if s == "left" else 1], sizes[1 if s == "left" else 0], s) for s in allowed]
    candidates = [(n, other, s) for n, other, s in candidates if n <= limit]
    if broadcast is None:
        # Chosen by cost: every rank receives the whole broadcast side (P·b moved, each rank
        # builds on all of b) where a shuffle moves about (a + b)·(P-1)/P and leaves the rows
        # placed by key for what follows (TPC-H Q13: 24 MB of orders sent to every rank to meet
        # 1.2 MB of customers, then the group-by shuffled again).  Below a small size a
        # broadcast is one round where a shuffle is two: always taken.
        P = comm.world_size
        candidates = [c for c in candidates if c[0] <= BROADCAST_ALWAYS_BYTES or c[0] * P <= c[1]]
    return min(candidates)[2] if candidates else None
