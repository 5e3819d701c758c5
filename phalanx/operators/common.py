"""Checks and schema agreement shared by the distributed operators."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa

from ..runtime.comm.base import Communicator
from .exchange import deserialize, serialize

ROWID = "__px_rowid"
_RANK_SHIFT = 40  # rank << 40 | local index: a global row id that orders rows like the frame


def as_list(cols: str | Iterable[str] | None) -> list[str]:
    if cols is None:
        return []
    if isinstance(cols, str):
        return [cols]
    return list(cols)


def check_columns(schema: pa.Schema, cols: Sequence[str], op: str) -> None:
    """Raise the same KeyError on every rank (the schema is agreed) before any collective."""
    missing = [c for c in cols if c not in schema.names]
    if missing:
        raise KeyError(f"{op}: unknown column(s) {', '.join(map(repr, missing))}; columns are {schema.names}")


def colocated(partitioned_by: Sequence[str] | None, keys: Sequence[str]) -> bool:
    """Rows with equal ``keys`` are already on one rank: the frame is hash-partitioned by the
    keys or by some of them (equal keys → equal values of that subset → one rank)."""
    return bool(partitioned_by) and set(partitioned_by or ()) <= set(keys)


def agree_schema(comm: Communicator, table: pa.Table, what: str) -> pa.Table:
    """Make every rank's partition share one schema (promoting types, filling null columns).

    Ranks with no rows often infer weaker types (pandas object → null); a column missing on
    some rank or typed incompatibly is an error that names the column and ranks.
    """
    if comm.world_size == 1:
        return table
    schemas = [deserialize(b).schema for b in comm.allgather_bytes(serialize(table.schema.empty_table()))]
    if all(s.equals(schemas[0]) for s in schemas):
        return table
    names = schemas[0].names
    for r, s in enumerate(schemas):
        if s.names != names:
            raise ValueError(f"{what}: rank {r} has columns {s.names} but rank 0 has {names}")
    try:
        unified = pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid) as exc:
        detail = "; ".join(f"rank {r}: {s.types}" for r, s in enumerate(schemas))
        raise TypeError(f"{what}: ranks disagree on column types ({detail}): {exc}") from None
    return table.cast(unified) if not table.schema.equals(unified) else table


def with_rowid(table: pa.Table, rank: int) -> pa.Table:
    ids = (np.int64(rank) << _RANK_SHIFT) + np.arange(table.num_rows, dtype=np.int64)
    return table.append_column(ROWID, pa.array(ids))


def balanced_bounds(total: int, nparts: int) -> np.ndarray:
    """Global row offsets splitting ``total`` rows into ``nparts`` near-equal ranges."""
    return np.array([total * i // nparts for i in range(nparts + 1)], dtype=np.int64)
