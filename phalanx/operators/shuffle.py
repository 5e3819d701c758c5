"""Hash shuffle: partition locally by key hash, exchange with alltoallv, concatenate."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

from ..runtime.comm.base import Communicator
from . import kernels
from .exchange import concat, exchange_tables
from .plan import note, noting, rows


def shuffle_table(comm: Communicator, table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """Rows with equal ``keys`` end on the same rank; received pieces in source-rank order."""
    if comm.world_size == 1:
        return table
    if noting():
        note(f"Exchange hash by {list(keys)}: {rows(table)}")
    parts = kernels.hash_partition(table, keys, comm.world_size)
    return concat(exchange_tables(comm, parts, table.schema), table.schema)
