"""``merge_asof``: each left row joined with the right row nearest in ``on`` (pandas semantics).

Plan (collective):

- **With ``by``**: rows that may match share their ``by`` keys, so both sides are hash-shuffled
  by ``by`` (skipped when both are already partitioned by the same ``by`` columns), or, when the
  right side is small (``join.BROADCAST_BYTES`` over all ranks), the right side is broadcast and
  the left stays where it is.  Then one local as-of join.
- **Without ``by``**: the left stays where it is.  Every rank announces the range of its left
  ``on`` values (one allgather of two values); every rank sends each other rank the right rows
  inside that range plus its nearest right rows just outside it (all rows tied at the last value
  before the range and at the first after it), so every candidate a left row could pick reaches
  it.  A left frame sorted by ``on`` (``sort_values``) receives only its own range; an unsorted
  one, whose ranges overlap, receives up to the whole right side (a broadcast's volume).  A small
  right side is broadcast outright.

The local join is polars' ``join_asof`` on the key columns only (1M x 1M rows with a 1,000-value
``by``, one thread: 0.43-0.49 s, DuckDB's ``ASOF LEFT JOIN`` 2.1-2.2 s), followed by one gather
of the right's other columns.  ``nearest`` is a backward and a forward join, the closer one kept.

Semantics, as pandas: every left row is kept once; ``backward`` picks the right row with the
largest ``on`` <= the left's, ``forward`` the smallest >=, ``nearest`` the closer (a tie goes
backward); among right rows tied on ``on``, backward picks the last in frame order and forward the
first.  ``allow_exact_matches=False`` makes those < and > (a right row with the left's very ``on``
is never picked, in any direction).  ``left_by``/``right_by`` pair key columns of different names
(position by position); the right's keys whose names differ from the left's stay in the output,
as pandas keeps them.  ``tolerance`` (a number, or a ``datetime.timedelta`` for temporal ``on``) drops matches
farther than it.  Null ``by`` keys match each other (as in ``merge``).  Unlike pandas (which
raises), a null left ``on`` matches nothing and right rows with a null ``on`` are never picked.
Unmatched rows get nulls.  Columns: the left's, then the right's without ``on`` and ``by``;
other names on both sides get ``suffixes``.

Order: each rank's output rows keep the left frame's order.  When the left does not move (no
``by``, or a broadcast right side) the whole output is in the left frame's order, as in pandas;
after a shuffle by ``by`` each rank holds its keys' rows in frame order, and the frame is
partitioned by ``by``.
"""

from __future__ import annotations

import datetime as dt
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from . import kernels
from .common import as_list, check_columns
from .exchange import allgather_tables, concat, exchange_tables
from .join import BROADCAST_BYTES, _cast_keys, _key_type
from .plan import note, rows
from .shuffle import shuffle_table

if TYPE_CHECKING:
    from .dataframe import DataFrame

DIRECTIONS = ("backward", "forward", "nearest")
_L, _R, _RON = "__px_lpos", "__px_rpos", "__px_ron"


def merge_asof(
    left: DataFrame,
    right: DataFrame,
    on: str,
    by: str | Sequence[str] | None = None,
    tolerance: Any = None,
    direction: str = "backward",
    suffixes: tuple[str, str] = ("_x", "_y"),
    broadcast: bool | None = None,
    left_by: str | Sequence[str] | None = None,
    right_by: str | Sequence[str] | None = None,
    allow_exact_matches: bool = True,
) -> DataFrame:
    """The as-of join of ``left`` and ``right`` (collective); see the module's docstring.
    ``broadcast``: True always replicates the right side, False never, None when it is small."""
    lby, rby = _by_pairs(by, left_by, right_by)
    _check(left, right, on, lby, rby, tolerance, direction, suffixes)
    if not isinstance(allow_exact_matches, bool):
        raise TypeError(f"merge_asof: allow_exact_matches must be True or False, got {allow_exact_matches!r}")
    if left.env is not right.env:
        raise ValueError("merge_asof: the frames belong to different gangs (envs); join frames of one gang")
    what = f"MergeAsof {direction} on {on!r}" + (f" by {lby}" if lby == rby and lby else "")
    what += f" by {lby} = {rby}" if lby != rby else ""
    what += "" if allow_exact_matches else " (no exact matches)"
    (table, placed), op = left._run(
        what,
        lambda: _merge_asof(left, right, on, lby, rby, tolerance, direction, suffixes, broadcast, allow_exact_matches),
        right,
    )
    return left._new(table, placed, op, right)


def _by_pairs(by: Any, left_by: Any, right_by: Any) -> tuple[list[str], list[str]]:
    """The left's and the right's key columns, pair by pair."""
    if by is not None and (left_by is not None or right_by is not None):
        raise ValueError("merge_asof: give by, or left_by and right_by, not both")
    if (left_by is None) != (right_by is None):
        raise ValueError("merge_asof: left_by and right_by go together (one column each side per key)")
    if by is not None:
        return as_list(by), as_list(by)
    lby, rby = as_list(left_by), as_list(right_by)
    if len(lby) != len(rby):
        raise ValueError(f"merge_asof: left_by {lby} and right_by {rby} must name as many columns each")
    return lby, rby


def _right_out(right_columns: Sequence[str], on: str, lby: list[str], rby: list[str]) -> list[str]:
    """The right's columns in the output: all but ``on`` and the keys named as on the left."""
    shared = {on} | {r for lk, r in zip(lby, rby) if lk == r}
    return [c for c in right_columns if c not in shared]


def _check(
    left: DataFrame,
    right: DataFrame,
    on: str,
    by: list[str],
    rby: list[str],
    tolerance: Any,
    direction: str,
    suffixes: tuple,
) -> None:
    """The same error on every rank (schemas are agreed), before any communication."""
    if direction not in DIRECTIONS:
        raise ValueError(f"merge_asof: direction must be one of {DIRECTIONS}, got {direction!r}")
    if not isinstance(on, str):
        raise TypeError(f"merge_asof: on must be one column name, got {on!r}")
    if on in by or on in rby:
        raise ValueError(f"merge_asof: {on!r} is both the on column and a by column")
    check_columns(left.schema, [on, *by], "merge_asof (left)")
    check_columns(right.schema, [on, *rby], "merge_asof (right)")
    t = _key_type(left.schema.field(on).type, right.schema.field(on).type, on)
    temporal = pa.types.is_temporal(t)
    if not (temporal or pa.types.is_integer(t) or pa.types.is_floating(t)):
        raise TypeError(f"merge_asof: on={on!r} must be numeric or temporal (timestamps, dates), it is {t}")
    for k, r in zip(by, rby):
        _key_type(left.schema.field(k).type, right.schema.field(r).type, k if k == r else f"{k}/{r}")
    if tolerance is not None:
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float, dt.timedelta, np.number)):
            raise TypeError(f"merge_asof: tolerance must be a number or a datetime.timedelta, got {tolerance!r}")
        if isinstance(tolerance, dt.timedelta) != temporal:
            need = "a datetime.timedelta" if temporal else "a number"
            raise TypeError(f"merge_asof: on={on!r} is {t}, so tolerance must be {need}, got {tolerance!r}")
        if (tolerance < dt.timedelta(0)) if isinstance(tolerance, dt.timedelta) else tolerance < 0:
            raise ValueError(f"merge_asof: tolerance must be >= 0, got {tolerance!r}")
    overlap = set(left.columns) & set(_right_out(right.columns, on, by, rby))
    if overlap and not (isinstance(suffixes, (tuple, list)) and len(suffixes) == 2 and all(suffixes)):
        raise ValueError(f"merge_asof: columns {sorted(overlap)} are on both sides and suffixes={suffixes!r}")


def _merge_asof(
    left: DataFrame,
    right: DataFrame,
    on: str,
    by: list[str],
    rby: list[str],
    tolerance: Any,
    direction: str,
    suffixes: tuple,
    broadcast: bool | None,
    exact: bool,
) -> tuple[pa.Table, tuple[str, ...] | None]:
    keys, rkeys = [on, *by], [on, *rby]
    types = [_key_type(left.schema.field(k).type, right.schema.field(r).type, k) for k, r in zip(keys, rkeys)]
    lt = _cast_keys(left.to_arrow(), keys, types)
    rt = _cast_keys(right.to_arrow(), rkeys, types)
    comm = left.env.comm
    placed = left.partitioned_by
    if comm.world_size > 1:
        sizes = comm.allreduce(np.array([rt.nbytes], dtype=np.int64))
        uncast = lt.schema.equals(left.schema) and rt.schema.equals(right.schema)
        keys_placed = bool(left.partitioned_by) and set(left.partitioned_by or ()) <= set(by)
        pair = dict(zip(by, rby))  # the right's partitioning, as the left's keys would place it
        right_placed = tuple(pair[k] for k in left.partitioned_by or ()) if keys_placed else None
        if keys_placed and right_placed == right.partitioned_by and uncast:
            note(f"no exchange: both sides already partitioned by {list(left.partitioned_by or ())}")
        elif broadcast or (broadcast is None and int(sizes[0]) <= BROADCAST_BYTES):
            note(f"Exchange broadcast the right side (allgather): {rows(rt)}")
            rt = concat(allgather_tables(comm, rt), rt.schema)
        elif by:
            lt, rt = shuffle_table(comm, lt, by), shuffle_table(comm, rt, rby)
            placed = tuple(by)
        else:
            rt = _send_ranges(comm, lt, rt, on)
    overlap = set(lt.column_names) & set(_right_out(rt.column_names, on, by, rby))
    if placed and overlap & set(placed):
        placed = None
    return _join_local(lt, rt, on, by, rby, tolerance, direction, overlap, suffixes, exact), placed


def _send_ranges(comm, lt: pa.Table, rt: pa.Table, on: str) -> pa.Table:
    """The right rows every rank's left ``on`` range needs: those inside it and those tied at
    the nearest value before and after it (an exchange; the left does not move)."""
    bounds = pa.table(
        {"lo": [pc.min(lt[on])], "hi": [pc.max(lt[on])]}, schema=pa.schema([("lo", lt[on].type), ("hi", lt[on].type)])
    )
    every = concat(allgather_tables(comm, bounds), bounds.schema)
    col = rt[on]
    parts = []
    for lo, hi in zip(every["lo"], every["hi"]):
        if not lo.is_valid:  # that rank has no left row with an on value
            parts.append(rt.slice(0, 0))
            continue
        before = pc.max(col.filter(pc.less(col, lo)))
        after = pc.min(col.filter(pc.greater(col, hi)))
        start = before if before.is_valid else lo
        stop = after if after.is_valid else hi
        mask = pc.and_(pc.greater_equal(col, start), pc.less_equal(col, stop))
        parts.append(rt.filter(pc.fill_null(mask, False)))
    note(f"Exchange the right rows of every rank's left range of {on!r}: {rows(rt)}")
    return concat(exchange_tables(comm, parts, rt.schema), rt.schema)


def _by_codes(frame: pl.DataFrame, by: list[str]) -> tuple[pl.DataFrame, list[str]]:
    """``by`` as columns on which polars matches null with null: each key filled with a fixed
    value of its type plus a flag of where it was null (polars never matches null keys)."""
    if not by:
        return frame, []
    exprs, names = [], []
    for i, k in enumerate(by):
        dtype = frame.schema[k]
        fill = "" if dtype == pl.String else False if dtype == pl.Boolean else pl.lit(0).cast(dtype)
        exprs += [pl.col(k).fill_null(fill).alias(f"__px_by{i}"), pl.col(k).is_null().alias(f"__px_byn{i}")]
        names += [f"__px_by{i}", f"__px_byn{i}"]
    return frame.with_columns(exprs), names


def _picks(
    lt: pa.Table, rt: pa.Table, on: str, by: list[str], rby: list[str], tolerance: Any, direction: str, exact: bool
) -> pa.Array:
    """For every left row (in its order), the position of its right row, or null."""
    lk, codes = _by_codes(kernels.to_polars(lt.select([on, *by])).with_row_index(_L), by)
    rk, _ = _by_codes(kernels.to_polars(rt.select([on, *rby])).with_row_index(_R), rby)
    lk = lk.select([_L, on, *codes]).sort(on, maintain_order=True)
    rk = rk.select([_R, pl.col(on).alias(_RON), *codes]).drop_nulls(_RON).sort(_RON, maintain_order=True)

    def one(strategy: Literal["backward", "forward"]) -> pl.DataFrame:
        with warnings.catch_warnings():  # polars cannot check sortedness within by groups; we sorted
            warnings.simplefilter("ignore")
            out = lk.join_asof(
                rk, left_on=on, right_on=_RON, by=codes or None, strategy=strategy, allow_exact_matches=exact
            )
        dist = (pl.col(on) - pl.col(_RON)) if strategy == "backward" else (pl.col(_RON) - pl.col(on))
        return out.select(_L, pl.col(_R), dist.alias("d"))

    if direction == "nearest":
        b, f = one("backward"), one("forward")
        both = b.join(f, on=_L, suffix="_f")
        take_b = pl.col("d").is_not_null() & (pl.col("d_f").is_null() | (pl.col("d") <= pl.col("d_f")))
        out = both.select(
            _L,
            pl.when(take_b).then(pl.col(_R)).otherwise(pl.col(f"{_R}_f")).alias(_R),
            pl.when(take_b).then(pl.col("d")).otherwise(pl.col("d_f")).alias("d"),
        )
    else:
        out = one("backward" if direction == "backward" else "forward")
    if tolerance is not None:
        out = out.with_columns(pl.when(pl.col("d") <= tolerance).then(pl.col(_R)).alias(_R))
    return out.sort(_L)[_R].to_arrow()


def _join_local(
    lt: pa.Table,
    rt: pa.Table,
    on: str,
    by: list[str],
    rby: list[str],
    tolerance: Any,
    direction: str,
    overlap: set,
    suffixes,
    exact: bool = True,
) -> pa.Table:
    picks = _picks(lt, rt, on, by, rby, tolerance, direction, exact)
    kept = _right_out(rt.column_names, on, by, rby)
    payload = rt.select(kept).take(picks) if kept else None
    out = lt.rename_columns([c + suffixes[0] if c in overlap else c for c in lt.column_names])
    for name, column in zip(payload.column_names if payload else [], payload.columns if payload else []):
        out = out.append_column(pa.field(name + suffixes[1] if name in overlap else name, column.type), column)
    return out
