"""Gloo through torch.distributed on CPU tensors (the default: needs no launcher).

When every rank of the gang runs on one host, the bytes of ``alltoallv``, ``exchange`` and
``exchange_tables`` go through shared memory instead of Gloo's TCP pairs (``shm.ShmDataPath``;
Gloo then carries only the control message); ``PHALANX_SHM=0`` keeps them on Gloo.  Its
process group is torch's default one, which ``px.ml.ddp`` reuses.  ``tcp`` and ``shm`` are the
communicators without torch.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from .base import Communicator, ReduceOp
from .shm import ShmDataPath

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
# torch 2.15 renamed all_gather_into_tensor (now an alias kept for old code) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GlooCommunicator(ShmDataPath, Communicator):
    name = "gloo"

    def __init__(self, rank: int, world_size: int, store: dist.Store, timeout_s: float = 1800.0):
        super().__init__(rank, world_size)
        # One default process group per rank process: DDP in ml/ reuses it.
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.group = dist.group.WORLD
        self.start_shm()  # the shared-memory data path (shm.ShmEngine), where it applies

    def wire_alltoallv(self, send: np.ndarray, send_counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        counts = torch.tensor(list(send_counts), dtype=torch.int64)
        recv_counts = torch.empty(self.world_size, dtype=torch.int64)
        dist.all_to_all_single(recv_counts, counts)
        rc = recv_counts.numpy()
        # numpy's allocator gives large buffers huge pages: ~40% faster than torch.empty here
        recv = torch.from_numpy(np.empty(int(rc.sum()), dtype=np.uint8))
        # one flat tensor with split sizes: Gloo's list form of all_to_all rejects uneven sizes
        dist.all_to_all_single(
            recv,
            _as_tensor(send),
            output_split_sizes=rc.tolist(),
            input_split_sizes=list(map(int, send_counts)),
        )
        return recv.numpy(), rc

    def all_to_all_rows(self, rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows)
        out = np.empty_like(rows)
        dist.all_to_all_single(torch.from_numpy(out.reshape(-1)), torch.from_numpy(rows.reshape(-1)))
        return out

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
        return [flat[i * width : i * width + int(n)] for i, n in enumerate(sizes_np)]

    def broadcast_bytes(self, data: np.ndarray | None, root: int = 0) -> np.ndarray:
        send = None  # the root's buffer (the others' data is not used)
        if self.rank == root:
            assert data is not None, "broadcast_bytes: the root passes its buffer"
            send = data
        size = torch.tensor([send.nbytes if send is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=root)
        n = int(size.item())
        buf = _as_tensor(send) if send is not None else torch.empty(n, dtype=torch.uint8)
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
        self.close_shm()
        if dist.is_initialized():
            dist.destroy_process_group()


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a, dtype=np.uint8).reshape(-1)
    if not a.flags.writeable:  # torch wants writable memory; it never writes to send buffers
        a = a.copy()
    return torch.from_numpy(a)
