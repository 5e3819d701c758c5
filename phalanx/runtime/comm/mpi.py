"""MPI through mpi4py, for ranks started by mpirun/srun (shared-memory transport on one host)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from .base import Communicator, ReduceOp

_OPS = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}


class MPICommunicator(Communicator):
    name = "mpi"

    @classmethod
    def from_env(cls, rank: int, world_size: int, rendezvous_url: str, timeout_s: float) -> MPICommunicator:
        return cls(rank=rank, world_size=world_size)  # mpirun/srun wired the ranks already

    def __init__(
        self, rank: int | None = None, world_size: int | None = None, comm: MPI.Comm | None = None, **_: object
    ):
        self.mpi = comm if comm is not None else MPI.COMM_WORLD
        super().__init__(self.mpi.Get_rank(), self.mpi.Get_size())
        if rank is not None and rank != self.rank:
            raise RuntimeError(f"MPI says this is rank {self.rank}, the launcher said {rank}")
        if world_size is not None and world_size != self.world_size:
            raise RuntimeError(f"MPI world has {self.world_size} ranks, the gang expected {world_size}")

    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        sc = np.asarray(send_counts, dtype=np.int64)
        rc = np.empty(self.world_size, dtype=np.int64)
        self.mpi.Alltoall(sc, rc)
        recv = np.empty(int(rc.sum()), dtype=np.uint8)
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        self.mpi.Alltoallv([np.ascontiguousarray(send, dtype=np.uint8), (sc, sd), MPI.BYTE], [recv, (rc, rd), MPI.BYTE])
        return recv, rc

    def allgather_bytes(self, data: np.ndarray) -> list[np.ndarray]:
        sizes = np.empty(self.world_size, dtype=np.int64)
        self.mpi.Allgather(np.array([data.nbytes], dtype=np.int64), sizes)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        self.mpi.Allgatherv(np.ascontiguousarray(data, dtype=np.uint8), [out, (sizes, displs), MPI.BYTE])
        return [out[int(d) : int(d + n)] for d, n in zip(displs, sizes)]

    def broadcast_bytes(self, data: np.ndarray | None, root: int = 0) -> np.ndarray:
        send = None  # the root's buffer (the others' data is not used)
        if self.rank == root:
            assert data is not None, "broadcast_bytes: the root passes its buffer"
            send = data
        size = np.array([send.nbytes if send is not None else 0], dtype=np.int64)
        self.mpi.Bcast(size, root=root)
        buf = np.ascontiguousarray(send, dtype=np.uint8) if send is not None else np.empty(int(size[0]), np.uint8)
        if size[0]:
            self.mpi.Bcast(buf, root=root)
        return buf

    def allreduce(self, array: np.ndarray, op: ReduceOp = "sum") -> np.ndarray:
        src = np.ascontiguousarray(array)
        out = np.empty_like(src)
        self.mpi.Allreduce(src, out, op=_OPS[op])
        return out

    def barrier(self) -> None:
        self.mpi.Barrier()
