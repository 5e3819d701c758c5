"""Moving Arrow tables between ranks: IPC streams, through the communicator.

Every destination's piece is written as its own IPC stream — into one send buffer for the
communicator's alltoallv (the default, ``Communicator.exchange_tables``), or straight into a
shared-memory segment the receivers map (``gloo`` on one host, ``shm``) — and the receive side
reads each source's stream in place (zero-copy).  The piece a rank keeps for itself never
leaves the process.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ..observe import tracing
from ..runtime.comm.base import Communicator, read_ipc_stream


def serialize(table: pa.Table) -> np.ndarray:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return np.frombuffer(sink.getvalue(), dtype=np.uint8)


def deserialize(view) -> pa.Table:
    return read_ipc_stream(view)


def exchange_tables(comm: Communicator, parts: list[pa.Table], schema: pa.Schema) -> list[pa.Table]:
    """alltoallv of tables: ``parts[i]`` goes to rank i; returns what each rank sent here.

    The communicator moves them (``Communicator.exchange_tables``): IPC streams over its
    alltoallv by default; through shared memory, written once and mapped by the receivers,
    between co-located ranks of ``gloo`` and ``shm`` (``runtime/comm/shm.py``)."""
    if comm.world_size == 1:
        return [parts[0]]
    if tracing.on():  # a span with the rows and bytes moved (observe/tracing.py; off: this check only)
        return tracing.exchange_span("exchange", comm, parts, lambda: comm.exchange_tables(parts, schema))
    return comm.exchange_tables(parts, schema)


def allgather_tables(comm: Communicator, table: pa.Table) -> list[pa.Table]:
    if comm.world_size == 1:
        return [table]
    if tracing.on():
        parts = [table] * comm.world_size
        return tracing.exchange_span("allgather", comm, parts, lambda: _allgather(comm, table))
    return _allgather(comm, table)


def _allgather(comm: Communicator, table: pa.Table) -> list[pa.Table]:
    return [deserialize(b) for b in comm.allgather_bytes(serialize(table))]


def gather_tables(comm: Communicator, table: pa.Table, root: int) -> pa.Table | None:
    """Every rank's ``table`` on ``root``, in rank order (None on the other ranks)."""
    parts = [table.schema.empty_table()] * comm.world_size
    parts[root] = table
    got = exchange_tables(comm, parts, table.schema)
    return concat(got, table.schema) if comm.rank == root else None


def concat(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return schema.empty_table()
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables)
