"""Gloo through torch.distributed on CPU tensors (the default: needs no launcher).

When every rank of the gang runs on one host, the bytes of ``alltoallv``, ``exchange`` and
``exchange_tables`` go through shared memory instead of Gloo's TCP pairs (``shm.ShmEngine``;
Gloo then carries only the control message); ``PHALANX_SHM=0`` keeps them on Gloo.
``communicator: shm`` (``shm.ShmCommunicator``) always uses it, for the co-located ranks of a
gang that spans hosts too.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .base import Communicator, ReduceOp

if TYPE_CHECKING:
    import pyarrow as pa

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
# torch 2.15 renamed all_gather_into_tensor (now an alias kept for old code) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GlooCommunicator(Communicator):
    name = "gloo"
    shm_required = False  # ShmCommunicator: the shared-memory path always, for same-host peers

    def __init__(self, rank: int, world_size: int, store: "dist.Store", timeout_s: float = 1800.0):
        super().__init__(rank, world_size)
        # One default process group per rank process: DDP in ml/ reuses it.
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.group = dist.group.WORLD
        self.shm = None  # the shared-memory data path (shm.ShmEngine), where it applies
        if world_size > 1 and (self.shm_required or _shm_wanted()):
            from .shm import ShmEngine

            self.shm = ShmEngine.start(self, required=self.shm_required)

    # ---- data: shared memory between co-located ranks when there is an engine ----------------
    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        if self.shm is None:
            return self.gloo_alltoallv(send, send_counts)
        counts = [int(c) for c in send_counts]
        if len(counts) != self.world_size:
            raise ValueError(f"alltoallv needs {self.world_size} counts, got {len(counts)}")
        offs = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        flat = np.ascontiguousarray(send, dtype=np.uint8).reshape(-1)
        views = self.shm.exchange_pieces(counts, lambda d, out: np.copyto(out, flat[offs[d]:offs[d + 1]]))
        me = self.rank
        mine = flat[offs[me]:offs[me + 1]]
        pieces = [mine if v is None else v for v in views]
        recv_counts = np.array([p.size for p in pieces], dtype=np.int64)
        recv = self.shm.recv_buffer(int(recv_counts.sum()))
        pos = 0
        for p in pieces:
            recv[pos:pos + p.size] = p
            pos += p.size
        return recv, recv_counts

    def exchange(self, buffers: Sequence[Any]) -> list[memoryview]:
        if self.shm is None:
            return super().exchange(buffers)
        if len(buffers) != self.world_size:
            raise ValueError(f"exchange needs {self.world_size} buffers, got {len(buffers)}")
        arrays = [np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8) for b in buffers]
        views = self.shm.exchange_pieces([a.size for a in arrays], lambda d, out: np.copyto(out, arrays[d]))
        return [memoryview(arrays[self.rank] if v is None else v) for v in views]

    def exchange_contiguous(self, send: np.ndarray, send_counts: Sequence[int]) -> list[memoryview]:
        if self.shm is None:
            return super().exchange_contiguous(send, send_counts)
        counts = [int(c) for c in send_counts]
        offs = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        flat = np.ascontiguousarray(send, dtype=np.uint8).reshape(-1)
        return self.exchange([flat[offs[d]:offs[d + 1]] for d in range(self.world_size)])

    def exchange_tables(self, parts: "list[pa.Table]", schema: "pa.Schema") -> "list[pa.Table]":
        if self.shm is None:
            return super().exchange_tables(parts, schema)
        from .base import ipc_stream_size, read_ipc_stream, write_ipc_stream

        me = self.rank
        sizes = [0 if d == me or part.num_rows == 0 else ipc_stream_size(part, schema)
                 for d, part in enumerate(parts)]
        views = self.shm.exchange_pieces(sizes, lambda d, out: write_ipc_stream(parts[d], schema, out))
        return [parts[me] if src == me else (read_ipc_stream(v) if v.size else schema.empty_table())
                for src, v in enumerate(views)]

    def gloo_alltoallv(self, send: np.ndarray, send_counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        counts = torch.tensor(list(send_counts), dtype=torch.int64)
        recv_counts = torch.empty(self.world_size, dtype=torch.int64)
        dist.all_to_all_single(recv_counts, counts)
        rc = recv_counts.numpy()
        # numpy's allocator gives large buffers huge pages: ~40% faster than torch.empty here
        recv = torch.from_numpy(np.empty(int(rc.sum()), dtype=np.uint8))
        dist.all_to_all_single(
            recv, _as_tensor(send),
            output_split_sizes=rc.tolist(), input_split_sizes=list(map(int, send_counts)),
        )
        return recv.numpy(), rc

    def allgather_bytes(self, data: np.ndarray) -> list[np.ndarray]:
        size = torch.tensor([data.nbytes], dtype=torch.int64)
        sizes = torch.empty(self.world_size, dtype=torch.int64)
        _all_gather_single(sizes, size)
        sizes_np = sizes.numpy()
        width = max(int(sizes_np.max()), 1)
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: data.nbytes] = _as_tensor(data)
        out = torch.from_numpy(np.empty(width * self.world_size, dtype=np.uint8))
        _all_gather_single(out, padded)
        flat = out.numpy()
        return [flat[i * width: i * width + int(n)] for i, n in enumerate(sizes_np)]

    def broadcast_bytes(self, data: np.ndarray | None, root: int = 0) -> np.ndarray:
        size = torch.tensor([data.nbytes if self.rank == root else 0], dtype=torch.int64)
        dist.broadcast(size, src=root)
        n = int(size.item())
        buf = _as_tensor(data) if self.rank == root else torch.empty(n, dtype=torch.uint8)
        if n:
            dist.broadcast(buf, src=root)
        return buf.numpy()

    def allreduce(self, array: np.ndarray, op: ReduceOp = "sum") -> np.ndarray:
        t = torch.from_numpy(np.array(array, copy=True))
        dist.all_reduce(t, op=_OPS[op])
        return t.numpy()

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _shm_wanted() -> bool:
    return os.environ.get("PHALANX_SHM", "1").strip().lower() not in ("0", "false", "no", "off")


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a, dtype=np.uint8).reshape(-1)
    if not a.flags.writeable:  # torch wants writable memory; it never writes to send buffers
        a = a.copy()
    return torch.from_numpy(a)
