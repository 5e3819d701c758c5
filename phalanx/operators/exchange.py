"""Moving Arrow tables between ranks: IPC streams over the communicator's alltoallv.

Every destination's piece is written as its own IPC stream into one growing buffer, so the
send side is a single contiguous buffer with no extra copy; the receive side reads each
source's stream straight out of the receive buffer (zero-copy).  The piece a rank keeps for
itself never leaves the process.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ..runtime.comm.base import Communicator


def serialize(table: pa.Table) -> np.ndarray:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return np.frombuffer(sink.getvalue(), dtype=np.uint8)


def deserialize(view) -> pa.Table:
    return ipc.open_stream(pa.BufferReader(pa.py_buffer(view))).read_all()


def exchange_tables(comm: Communicator, parts: list[pa.Table], schema: pa.Schema) -> list[pa.Table]:
    """alltoallv of tables: ``parts[i]`` goes to rank i; returns what each rank sent here."""
    me = comm.rank
    if comm.world_size == 1:
        return [parts[0]]
    sink = pa.BufferOutputStream()
    counts = []
    for dest, part in enumerate(parts):
        if dest == me or part.num_rows == 0:
            counts.append(0)
            continue
        start = sink.tell()
        with ipc.new_stream(sink, schema) as writer:
            writer.write_table(part)
        counts.append(sink.tell() - start)
    send = np.frombuffer(sink.getvalue(), dtype=np.uint8)
    views = comm.exchange_contiguous(send, counts)
    out = []
    for src, view in enumerate(views):
        if src == me:
            out.append(parts[me])
        elif view.nbytes == 0:
            out.append(schema.empty_table())
        else:
            out.append(deserialize(view))
    return out


def allgather_tables(comm: Communicator, table: pa.Table) -> list[pa.Table]:
    if comm.world_size == 1:
        return [table]
    return [deserialize(b) for b in comm.allgather_bytes(serialize(table))]


def concat(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return schema.empty_table()
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables)
