"""Hash shuffle: partition locally by key hash, exchange with alltoallv, concatenate."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from ..runtime.comm.base import Communicator
from . import kernels
from .exchange import concat, exchange_tables


def shuffle_table(comm: Communicator, table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Rows with equal ``keys`` end on the same rank; received pieces in source-rank order."""
    if comm.world_size == 1:
        return table
    parts = kernels.hash_partition(table, keys, comm.world_size)
    return concat(exchange_tables(comm, parts, table.schema), table.schema)


_KEEP = {"first": "first", "last": "last", False: "none"}


def drop_duplicates(
    comm: Communicator, table: pa.Table, subset: Sequence[str], keep: str | bool, colocated: bool = False
) -> pa.Table:
    if keep not in _KEEP:
        raise ValueError(f"drop_duplicates: keep must be 'first', 'last' or False, got {keep!r}")
    # Shuffled pieces arrive in source-rank order, each in its original order, so "first"
    # on the receiving rank is the first in the whole frame's order.
    shuffled = table if colocated else shuffle_table(comm, table, subset)
    out = kernels.to_polars(shuffled).unique(subset=list(subset), keep=_KEEP[keep], maintain_order=True)
    return kernels.from_polars(out, table.schema)
