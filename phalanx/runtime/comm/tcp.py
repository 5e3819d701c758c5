"""TCP sockets between every pair of ranks, in plain Python: a communicator without torch.

A rank that imports torch for Gloo carries ~300 MiB of private memory and ~2–3 s of import
before it holds any data; a dataframe gang does not need either.  ``communicator: tcp`` wires
the gang as a full mesh of authenticated TCP connections (``runtime.netio``: every rank listens
on an ephemeral port, the rendezvous ``share``s the addresses, each rank connects to the ranks
below it and accepts the ones above) and runs every collective as one all-pairs transfer that
moves every send and every receive at once on non-blocking sockets (``poll``), so no pair waits
for another and a large exchange is full duplex.  Collectives are matched by order: every rank
calls them in the same order, a TCP stream keeps it, and a receiver never reads past the bytes
the current collective owes it.

When ranks share a host, the bytes of ``alltoallv``/``exchange``/``exchange_tables`` go through
shared memory (``shm.ShmDataPath``) and the sockets carry only the control rows, as for Gloo;
``communicator: shm`` is this communicator with the shared-memory path required (``tcp_shm``).

Control collectives are all-pairs (O(ranks) messages per rank): meant for gangs of up to a few
hundred ranks; larger gangs use ``mpi``.  A peer that dies is noticed at once (its connection
closes) and named; a silent one after the gang's timeout.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Sequence

import numpy as np

from ...errors import PhalanxError
from ..netio import accept_peers, bind_host, connect_peer
from .base import NUMPY_REDUCE, Communicator, ReduceOp
from .shm import ShmDataPath

_POLLIN, _POLLOUT = select.POLLIN, select.POLLOUT
_POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL
_Pending = dict[int, tuple[memoryview, int]]  # peer → (its buffer, bytes moved so far)


class TCPCommunicator(ShmDataPath, Communicator):
    name = "tcp"

    @classmethod
    def from_env(cls, rank: int, world_size: int, rendezvous_url: str, timeout_s: float) -> TCPCommunicator:
        from ..rendezvous import gang_authkey

        return cls(rank, world_size, rendezvous_url, gang_authkey(f"communicator {cls.name}"), timeout_s=timeout_s)

    def __init__(self, rank: int, world_size: int, rendezvous_url: str, authkey: bytes, timeout_s: float = 1800.0):
        super().__init__(rank, world_size)
        self.timeout_s = timeout_s
        self.peers: dict[int, socket.socket] = {}
        self._fds: dict[int, int] = {}
        self.shm = None
        self._broken: str | None = None  # set when a collective failed midway: the streams are out of step
        if world_size > 1:
            self._connect(rendezvous_url, authkey)
        try:
            self.start_shm()
        except BaseException:
            self._close_sockets()
            raise

    # ---- wiring ---------------------------------------------------------------------------
    def _connect(self, url: str, authkey: bytes) -> None:
        from ..rendezvous import backend_for

        deadline = time.monotonic() + self.timeout_s
        what = f"communicator {self.name}"
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((bind_host(url, deadline), 0))
            listener.listen(max(128, self.world_size))
            host, port = listener.getsockname()[:2]
            mine = f"{host}:{port}"
            addresses = backend_for(url).share(
                url, self.rank, self.world_size, mine.encode(), max(deadline - time.monotonic(), 0.001), authkey
            )
            for peer in range(self.rank):
                h, p = addresses[peer].decode().rsplit(":", 1)
                self.peers[peer] = connect_peer((h, int(p)), self.rank, peer, authkey, deadline, what)
            above = accept_peers(
                listener, mine, self.world_size - 1 - self.rank, self.rank, self.world_size, authkey, deadline, what
            )
            if any(p < self.rank for p in above):
                for sock in above.values():
                    sock.close()
                raise PhalanxError(f"{what}: rank {self.rank} was dialled by a lower rank")
            self.peers.update(above)
        except BaseException:
            self._close_sockets()
            raise
        finally:
            listener.close()
        for sock in self.peers.values():
            sock.setblocking(False)
        self._fds = {p: s.fileno() for p, s in self.peers.items()}

    # ---- the one transfer every collective is made of ---------------------------------------
    def _transfer(self, sends: dict[int, memoryview], recvs: dict[int, memoryview]) -> None:
        """Send ``sends[p]`` to and receive exactly ``len(recvs[p])`` bytes from each peer p,
        all at once.  A failure midway leaves the streams out of step: every later collective
        of this communicator raises instead of reading misaligned bytes."""
        if self._broken:
            raise PhalanxError(
                f"communicator {self.name}: rank {self.rank} cannot run another collective "
                f"after an earlier one failed ({self._broken})"
            )
        try:
            self._transfer_all(sends, recvs)
        except BaseException as exc:
            self._broken = str(exc) or type(exc).__name__
            raise

    def _transfer_all(self, sends: dict[int, memoryview], recvs: dict[int, memoryview]) -> None:
        out: _Pending = {p: (v, 0) for p, v in sends.items() if v.nbytes}
        inb: _Pending = {p: (v, 0) for p, v in recvs.items() if v.nbytes}
        for p in list(out):  # small messages leave without a poll
            self._send_some(p, out)
        if not out and not inb:
            return
        deadline = time.monotonic() + self.timeout_s
        by_fd = {self._fds[p]: p for p in set(out) | set(inb)}
        poller = select.poll()
        registered: dict[int, int] = {}
        while out or inb:
            for fd, p in by_fd.items():
                want = (_POLLOUT if p in out else 0) | (_POLLIN if p in inb else 0)
                if want != registered.get(fd):
                    if want:
                        (poller.modify if fd in registered else poller.register)(fd, want)
                        registered[fd] = want
                    elif fd in registered:
                        poller.unregister(fd)
                        del registered[fd]
            left = deadline - time.monotonic()
            events = poller.poll(min(max(int(left * 1000), 0), 60_000)) if left > 0 else []
            if not events and time.monotonic() < deadline:
                continue
            if not events:
                waiting = sorted(set(out) | set(inb))
                raise PhalanxError(
                    f"communicator {self.name}: rank {self.rank} waited {self.timeout_s:.0f}s for rank(s) {waiting}"
                )
            for fd, ev in events:
                p = by_fd[fd]
                if p in inb and ev & (_POLLIN | _POLLERR):
                    self._recv_some(p, inb)
                if p in out and ev & (_POLLOUT | _POLLERR):
                    self._send_some(p, out)

    def _send_some(self, p: int, out: _Pending) -> None:
        view, pos = out[p]
        try:
            pos += self.peers[p].send(view[pos:])
        except BlockingIOError:
            return
        except OSError as exc:
            raise self._lost(p, exc) from exc
        if pos == view.nbytes:
            del out[p]
        else:
            out[p] = (view, pos)

    def _recv_some(self, p: int, inb: _Pending) -> None:
        view, pos = inb[p]
        try:
            k = self.peers[p].recv_into(view[pos:])
        except BlockingIOError:
            return
        except OSError as exc:
            raise self._lost(p, exc) from exc
        if k == 0:
            raise self._lost(p, None)
        pos += k
        if pos == view.nbytes:
            del inb[p]
        else:
            inb[p] = (view, pos)

    def _lost(self, p: int, exc: OSError | None) -> PhalanxError:
        why = f": {exc}" if exc else ""
        return PhalanxError(
            f"communicator {self.name}: rank {self.rank} lost its connection to rank {p} "
            f"(that rank ended or failed){why}"
        )

    def _counts_all_to_all(self, counts: Sequence[int]) -> np.ndarray:
        """counts[p] to rank p; returns what each rank sent here (one int64 per rank)."""
        return self.all_to_all_rows(np.asarray(counts, dtype=np.int64).reshape(-1, 1)).reshape(-1)

    # ---- primitives ---------------------------------------------------------------------------
    def wire_alltoallv(self, send: np.ndarray, send_counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        counts = [int(c) for c in send_counts]
        if len(counts) != self.world_size:
            raise ValueError(f"alltoallv needs {self.world_size} counts, got {len(counts)}")
        flat = np.ascontiguousarray(send, dtype=np.uint8).reshape(-1)
        if sum(counts) != flat.size or min(counts) < 0:
            raise ValueError(f"alltoallv: counts {counts} do not add up to the {flat.size} bytes sent")
        recv_counts = self._counts_all_to_all(counts)
        soff = np.concatenate([[0], np.cumsum(counts)]).tolist()
        roff = np.concatenate([[0], np.cumsum(recv_counts)]).tolist()
        recv = np.empty(int(roff[-1]), dtype=np.uint8)
        me = self.rank
        recv[roff[me] : roff[me + 1]] = flat[soff[me] : soff[me + 1]]
        src, dst = flat.data, recv.data
        self._transfer(
            {p: src[soff[p] : soff[p + 1]] for p in self.peers}, {p: dst[roff[p] : roff[p + 1]] for p in self.peers}
        )
        return recv, recv_counts

    def all_to_all_rows(self, rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows)
        got = np.empty_like(rows)
        got[self.rank] = rows[self.rank]
        src, dst = rows.reshape(-1).data.cast("B"), got.reshape(-1).data.cast("B")
        width = rows[0].nbytes
        self._transfer(
            {p: src[p * width : (p + 1) * width] for p in self.peers},
            {p: dst[p * width : (p + 1) * width] for p in self.peers},
        )
        return got

    def allgather_bytes(self, data: np.ndarray) -> list[np.ndarray]:
        flat = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
        sizes = self._counts_all_to_all([flat.nbytes] * self.world_size)
        out = [flat if p == self.rank else np.empty(int(sizes[p]), dtype=np.uint8) for p in range(self.world_size)]
        src = flat.data
        self._transfer({p: src for p in self.peers}, {p: out[p].data for p in self.peers})
        return out

    def broadcast_bytes(self, data: np.ndarray | None, root: int = 0) -> np.ndarray:
        if self.rank == root:
            flat = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
            size = np.array([flat.nbytes], dtype=np.int64)
            sends = {p: size.data.cast("B") for p in self.peers}
            self._transfer(sends, {})
            self._transfer({p: flat.data for p in self.peers}, {})
            return flat
        size = np.zeros(1, dtype=np.int64)
        self._transfer({}, {root: size.data.cast("B")})
        buf = np.empty(int(size[0]), dtype=np.uint8)
        self._transfer({}, {root: buf.data})
        return buf

    def allreduce(self, array: np.ndarray, op: ReduceOp = "sum") -> np.ndarray:
        """Every rank gets every rank's array and reduces them in rank order: the same bits on
        every rank, floats included."""
        if op not in NUMPY_REDUCE:
            raise ValueError(f"allreduce: op must be one of {sorted(NUMPY_REDUCE)}, got {op!r}")
        src = np.ascontiguousarray(array)
        if self.world_size == 1:
            alone: np.ndarray = src.copy()  # (numpy's stubs give copy() as Any before Python 3.12)
            return alone
        parts = np.empty((self.world_size,) + src.shape, dtype=src.dtype)
        parts[self.rank] = src
        width = src.nbytes
        flat_in = parts.reshape(-1).data.cast("B")
        flat_out = src.reshape(-1).data.cast("B")
        self._transfer({p: flat_out for p in self.peers}, {p: flat_in[p * width : (p + 1) * width] for p in self.peers})
        return np.asarray(NUMPY_REDUCE[op](parts, axis=0, dtype=src.dtype))

    def barrier(self) -> None:
        one = np.zeros(1, dtype=np.uint8)
        got = np.zeros(self.world_size, dtype=np.uint8)
        mv = got.data
        self._transfer({p: one.data for p in self.peers}, {p: mv[p : p + 1] for p in self.peers})

    def close(self) -> None:
        self.close_shm()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self.peers.values():
            try:
                sock.close()
            except OSError:
                pass
        self.peers.clear()
