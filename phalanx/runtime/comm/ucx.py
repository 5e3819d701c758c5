"""UCX through ucxx (extra ``phalanx[ucx]``): for clusters whose network UCX drives natively
(InfiniBand/RoCE verbs, shared memory between processes of a node, CUDA IPC).

Bootstrap goes through phalanx's rendezvous, without torch: every rank ``share``s its UCX
*worker address* and makes one endpoint to every peer from those addresses — no listener
socket is opened.  Messages are tag-matched on the receiving worker; a tag is
(collective sequence number, source rank), so collectives never mix even when a fast rank is
one collective ahead.  The collectives are built from point-to-point sends: alltoallv sends
its counts first, then every non-empty piece, all at once.

On this loopback machine UCX runs over tcp/lo and measured slower than Gloo (bench/exchange.py):
it is here for RDMA networks, not for one host.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ...extras import require
from ..envvars import ENV_HOST
from .base import NUMPY_REDUCE, Communicator, ReduceOp

R = TypeVar("R")  # what an awaited coroutine returns


def _import_ucxx() -> Any:
    # A worker on loopback-only sites must not offer its address on other interfaces.
    if os.environ.get(ENV_HOST, "127.0.0.1") in ("127.0.0.1", "localhost"):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_TLS", "tcp,self")  # sm,self is unreachable here (COMMS.md)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets UCX_MEMTYPE_CACHE, unused on CPU
    return require("ucxx", "ucx", "communicator 'ucx'")


class UCXCommunicator(Communicator):
    name = "ucx"

    @classmethod
    def from_env(cls, rank: int, world_size: int, rendezvous_url: str, timeout_s: float) -> UCXCommunicator:
        from ..rendezvous import share

        return cls(
            rank, world_size, lambda mine: share(rendezvous_url, rank, world_size, mine, timeout_s), timeout_s=timeout_s
        )

    def __init__(self, rank: int, world_size: int, share: Callable[[bytes], list[bytes]], timeout_s: float = 1800.0):
        """``share(my worker address)`` returns every rank's (the rendezvous' ``share``)."""
        super().__init__(rank, world_size)
        self._ucxx = ucxx = _import_ucxx()
        self._timeout = timeout_s
        self._loop = asyncio.new_event_loop()
        self._seq = 0
        shared = share(bytes(ucxx.get_worker_address()))
        addresses = {r: shared[r] for r in range(world_size) if r != rank}
        self._eps = {
            r: self._run(ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(a)))
            for r, a in addresses.items()
        }
        self.barrier()  # every endpoint is up before anyone sends data

    # ---- plumbing --------------------------------------------------------------------------
    def _run(self, coro: Awaitable[R]) -> R:
        return self._loop.run_until_complete(asyncio.wait_for(coro, self._timeout))

    def _tag(self, src: int, step: int = 0) -> int:
        return (self._seq << 24) | (step << 16) | src

    async def _send(self, dst: int, buf: np.ndarray, step: int = 0) -> None:
        await self._eps[dst].send(buf, tag=self._tag(self.rank, step), force_tag=True)

    async def _recv(self, src: int, buf: np.ndarray, step: int = 0) -> None:
        await self._ucxx.recv(buf, tag=self._tag(src, step))

    def _collective(self, coro: Awaitable[R]) -> R:
        try:
            return self._run(coro)
        finally:
            self._seq += 1

    async def _sizes(self, mine: Sequence[int]) -> np.ndarray:
        """Step 0 of a collective: ``mine[d]`` to every peer d; returns what each sent here."""
        got = np.zeros(self.world_size, dtype=np.int64)
        got[self.rank] = mine[self.rank]
        box = {r: np.empty(1, dtype=np.int64) for r in self._eps}
        await asyncio.gather(
            *[self._send(r, np.array([mine[r]], dtype=np.int64)) for r in self._eps],
            *[self._recv(r, box[r]) for r in self._eps],
        )
        for r, b in box.items():
            got[r] = b[0]
        return got

    # ---- primitives ------------------------------------------------------------------------
    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        send = np.ascontiguousarray(send, dtype=np.uint8).reshape(-1)
        counts = [int(c) for c in send_counts]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

        async def run() -> tuple[np.ndarray, np.ndarray]:
            recv_counts = await self._sizes(counts)
            at = np.concatenate([[0], np.cumsum(recv_counts)]).astype(np.int64)
            recv = np.empty(int(at[-1]), dtype=np.uint8)
            me = self.rank
            recv[at[me] : at[me + 1]] = send[offsets[me] : offsets[me + 1]]
            await asyncio.gather(
                *[self._send(r, send[offsets[r] : offsets[r + 1]], 1) for r in self._eps if counts[r]],
                *[self._recv(r, recv[at[r] : at[r + 1]], 1) for r in self._eps if recv_counts[r]],
            )
            return recv, recv_counts

        return self._collective(run())

    def allgather_bytes(self, data: np.ndarray) -> list[np.ndarray]:
        data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)

        async def run() -> list[np.ndarray]:
            sizes = await self._sizes([data.nbytes] * self.world_size)
            out = {r: np.empty(int(sizes[r]), dtype=np.uint8) for r in self._eps}
            await asyncio.gather(
                *[self._send(r, data, 1) for r in self._eps if data.nbytes],
                *[self._recv(r, out[r], 1) for r in self._eps if sizes[r]],
            )
            return [data.copy() if r == self.rank else out[r] for r in range(self.world_size)]

        return self._collective(run())

    def broadcast_bytes(self, data: np.ndarray | None, root: int = 0) -> np.ndarray:
        async def run() -> np.ndarray:
            if self.rank == root:
                buf = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
                size = np.array([buf.nbytes], dtype=np.int64)
                await asyncio.gather(*[self._send(r, size) for r in self._eps])
                if buf.nbytes:
                    await asyncio.gather(*[self._send(r, buf, 1) for r in self._eps])
                return buf
            size = np.empty(1, dtype=np.int64)
            await self._recv(root, size)
            buf = np.empty(int(size[0]), dtype=np.uint8)
            if buf.nbytes:
                await self._recv(root, buf, 1)
            return buf

        return self._collective(run())

    def allreduce(self, array: np.ndarray, op: ReduceOp = "sum") -> np.ndarray:
        array = np.ascontiguousarray(array)
        parts = self.allgather_bytes(array.view(np.uint8).reshape(-1))
        stacked = np.stack([p.view(array.dtype).reshape(array.shape) for p in parts])
        return np.asarray(NUMPY_REDUCE[op](stacked, axis=0, dtype=array.dtype))

    def barrier(self) -> None:
        self.allgather_bytes(np.zeros(1, dtype=np.uint8))

    def close(self) -> None:
        for ep in self._eps.values():
            try:
                self._loop.run_until_complete(asyncio.wait_for(ep.close(), 5.0))
            except Exception:  # a peer already gone: nothing left to flush
                pass
        self._eps.clear()
        self._loop.close()
