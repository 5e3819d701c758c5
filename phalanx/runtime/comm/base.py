"""The communicator interface: the few collectives a BSP dataframe needs.

Implementations (one file each) provide the five primitives on contiguous uint8 numpy
buffers; everything else (object collectives, lists of buffers) is built here once, so a new
backend (UCX, a shared-memory one) is one small file plus a registry line.
"""

from __future__ import annotations

import functools
import pickle
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

ReduceOp = str  # "sum" | "min" | "max"
T = TypeVar("T")  # what a function run on one rank returns
# for backends that gather the arrays and reduce them in rank order (the same bits on every rank)
NUMPY_REDUCE = {"sum": np.add.reduce, "min": np.minimum.reduce, "max": np.maximum.reduce}


class Communicator(ABC):
    """Collectives among the ``world_size`` ranks of one gang.

    Every public collective is accounted (``_ACCOUNTED``, wrapped once here for every backend):
    ``comm_seconds`` spent inside collectives (the outermost call: a wait for a late peer
    included), and the payload ``bytes_sent`` to and ``bytes_received`` from other ranks, as
    the outermost call that measures sees it (an ``exchange`` its buffers, an
    ``exchange_tables`` its tables' Arrow bytes; an object collective lets the bytes collective
    inside count its pickle); a rank's own part, a backend's framing and control rounds are not
    counted.  ``runtime.sampler`` reports them.
    """

    name: str = "abstract"
    # the accounting: class defaults, so a backend's __init__ need not call the base's
    bytes_sent: int = 0
    bytes_received: int = 0
    comm_seconds: float = 0.0
    _depth: int = 0  # accounted calls in progress (a collective built on another)
    _claimed: bool = False  # a call in progress measures the bytes (those inside it do not)
    _since: float = 0.0  # perf_counter() at which the collective in progress began (0: none)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr, measure in _ACCOUNTED.items():
            fn = cls.__dict__.get(attr)
            if fn is not None and not getattr(fn, "_accounted", False):
                setattr(cls, attr, _accounted(fn, measure))

    def comm_time(self) -> float:
        """Seconds spent in collectives so far, the one in progress included (a sampler thread
        reads it while the rank waits for a late peer)."""
        since = self._since
        return self.comm_seconds + (time.perf_counter() - since if since else 0.0)

    @classmethod
    def from_env(cls, rank: int, world_size: int, rendezvous_url: str, timeout_s: float) -> Communicator:
        """How a rank builds its communicator (collective).  This default connects the gang's
        rendezvous store (``torch.distributed.Store``) and hands it to the constructor."""
        from ..rendezvous import backend_for

        store = backend_for(rendezvous_url).connect(rendezvous_url, rank, world_size, timeout_s)
        # a subclass that keeps this default takes (rank, world_size, store, timeout_s=), as gloo does
        return cls(rank, world_size, store, timeout_s=timeout_s)  # type: ignore[call-arg]  # not the base's signature

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size

    # ---- primitives every backend implements -------------------------------------------
    @abstractmethod
    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Send ``send[off_i:off_i+send_counts[i]]`` to rank i (uneven sizes, zeros allowed).

        Returns ``(recv, recv_counts)``: one contiguous uint8 buffer holding what every rank
        sent to this one, in rank order, and how many bytes came from each rank.
        """

    @abstractmethod
    def allgather_bytes(self, data: np.ndarray) -> list[np.ndarray]:
        """Every rank contributes one uint8 buffer (sizes may differ); all receive all."""

    @abstractmethod
    def broadcast_bytes(self, data: np.ndarray | None, root: int = 0) -> np.ndarray:
        """``root``'s buffer to every rank (others pass None)."""

    @abstractmethod
    def allreduce(self, array: np.ndarray, op: ReduceOp = "sum") -> np.ndarray:
        """Element-wise reduction of a numeric numpy array over all ranks."""

    @abstractmethod
    def barrier(self) -> None: ...

    def close(self) -> None:
        """Free the backend's resources; the communicator is unusable afterwards."""

    # ---- built on the primitives --------------------------------------------------------
    def exchange(self, buffers: Sequence[Any]) -> list[memoryview]:
        """alltoallv of one buffer per destination rank; returns one view per source rank."""
        if len(buffers) != self.world_size:
            raise ValueError(f"exchange needs {self.world_size} buffers, got {len(buffers)}")
        views = [memoryview(b).cast("B") for b in buffers]
        counts = [v.nbytes for v in views]
        send = np.empty(sum(counts), dtype=np.uint8)
        pos = 0
        for v, n in zip(views, counts):
            send[pos : pos + n] = np.frombuffer(v, dtype=np.uint8)
            pos += n
        return self.exchange_contiguous(send, counts)

    def exchange_contiguous(self, send: np.ndarray, send_counts: Sequence[int]) -> list[memoryview]:
        recv, recv_counts = self.alltoallv(send, send_counts)
        offsets = np.concatenate([[0], np.cumsum(recv_counts)])
        mv = recv.data
        return [mv[int(offsets[i]) : int(offsets[i + 1])] for i in range(self.world_size)]

    def exchange_tables(self, parts: list[pa.Table], schema: pa.Schema) -> list[pa.Table]:
        """alltoallv of Arrow tables: ``parts[i]`` goes to rank i; returns what each rank sent
        here, in rank order (``parts[rank]`` itself for this rank: it never leaves the process).

        This default writes every destination's piece as its own IPC stream into one send
        buffer, moves it with ``exchange_contiguous`` and opens each received stream in place
        (zero-copy); a backend with a faster table path (shared memory) overrides it."""
        import pyarrow as pa
        import pyarrow.ipc as ipc

        if len(parts) != self.world_size:
            raise ValueError(f"exchange_tables needs {self.world_size} tables, got {len(parts)}")
        me = self.rank
        if self.world_size == 1:
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
        views = self.exchange_contiguous(send, counts)
        return [
            parts[me] if src == me else (read_ipc_stream(view) if view.nbytes else schema.empty_table())
            for src, view in enumerate(views)
        ]

    def allgather_obj(self, obj: Any) -> list[Any]:
        payload = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
        return [pickle.loads(b.data) for b in self.allgather_bytes(payload)]

    def broadcast_obj(self, obj: Any = None, root: int = 0) -> Any:
        payload = None
        if self.rank == root:
            payload = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
        return pickle.loads(self.broadcast_bytes(payload, root).data)

    def on_root(self, fn: Callable[..., T], *args: Any, root: int = 0) -> T:
        """``root`` calls ``fn(*args)``; every rank returns its result or raises its error.

        For decisions one rank makes (planning a read, sealing a dataset): a failure there
        becomes the same exception on every rank instead of a rank left waiting.
        """
        outcome: tuple[str, Any] | None = None  # ("ok", result) or ("error", exception)
        if self.rank == root:
            try:
                outcome = ("ok", fn(*args))
            except Exception as exc:
                outcome = ("error", exc)
        status, value = self.broadcast_obj(outcome, root)
        if status == "error":
            raise value
        result: T = value  # what fn returned on root
        return result

    def on_every_rank(self, what: str, fn: Any, *args: Any) -> Any:
        """Run a local step on every rank; if it fails anywhere, it fails everywhere.

        Call this before a collective whose peers must not wait for a rank whose local step
        (writing a file, opening a partition) raised: the failing rank re-raises its own error,
        the others raise one that names the failed ranks and the first error.
        """
        try:
            result, error = fn(*args), None
        except Exception as exc:
            result, error = None, exc
        errors = self.allgather_obj(None if error is None else f"{type(error).__name__}: {error}")
        failed = [r for r, e in enumerate(errors) if e is not None]
        if not failed:
            return result
        if error is not None:
            raise error
        from ...errors import PhalanxError

        raise PhalanxError(f"{what} failed on rank(s) {failed}: {errors[failed[0]]}")

    def allreduce_scalar(self, value: int | float, op: ReduceOp = "sum") -> int | float:
        dtype = np.int64 if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else np.float64
        out = self.allreduce(np.array([value], dtype=dtype), op)
        result: int | float = out[0].item()  # a Python int (int64) or float (float64)
        return result

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank={self.rank} world_size={self.world_size}>"


# ---- accounting (Communicator's docstring) --------------------------------------------------------
Args = tuple[Any, ...]
Kwargs = dict[str, Any]
# (self, args, kwargs, result) -> (sent, received); None: the collective inside measures (an object's pickle)
Measure = Callable[[Communicator, Args, Kwargs, Any], tuple[int, int]] | None


def _accounted(fn: Callable[..., Any], measure: Measure) -> Callable[..., Any]:
    @functools.wraps(fn)
    def collective(self: Communicator, *args: Any, **kwargs: Any) -> Any:
        outermost = self._depth == 0
        claim = measure is not None and not self._claimed  # the outermost call that measures
        self._depth += 1
        if claim:
            self._claimed = True
        t0 = time.perf_counter()
        if outermost:
            self._since = t0
        try:
            result = fn(self, *args, **kwargs)
        finally:
            self._depth -= 1
            if claim:
                self._claimed = False
            if outermost:
                self.comm_seconds += time.perf_counter() - t0
                self._since = 0.0
        if claim:
            try:
                sent, received = measure(self, args, kwargs, result)  # type: ignore[misc]  # claim: not None
            except Exception:  # an argument of an unexpected type: uncounted, never a failure
                sent = received = 0
            self.bytes_sent += sent
            self.bytes_received += received
        return result

    collective._accounted = True  # type: ignore[attr-defined]  # marks it wrapped
    return collective


def _others(sizes: Sequence[Any], me: int) -> int:
    """The bytes of every rank's entry but ``me``'s."""
    return int(sum(int(n) for n in sizes)) - (int(sizes[me]) if me < len(sizes) else 0)


def _nbytes(buffers: Sequence[Any]) -> list[int]:
    return [memoryview(b).nbytes for b in buffers]


def _arg(args: Args, kwargs: Kwargs, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _alltoallv(c: Communicator, args: Args, kwargs: Kwargs, result: Any) -> tuple[int, int]:
    return _others(_arg(args, kwargs, 1, "send_counts"), c.rank), _others(result[1], c.rank)


def _exchange(c: Communicator, args: Args, kwargs: Kwargs, result: Any) -> tuple[int, int]:
    return _others(_nbytes(_arg(args, kwargs, 0, "buffers")), c.rank), _others(_nbytes(result), c.rank)


def _exchange_contiguous(c: Communicator, args: Args, kwargs: Kwargs, result: Any) -> tuple[int, int]:
    return _others(_arg(args, kwargs, 1, "send_counts"), c.rank), _others(_nbytes(result), c.rank)


def _exchange_tables(c: Communicator, args: Args, kwargs: Kwargs, result: Any) -> tuple[int, int]:
    parts = _arg(args, kwargs, 0, "parts")
    return _others([t.nbytes for t in parts], c.rank), _others([t.nbytes for t in result], c.rank)


def _allgather(c: Communicator, args: Args, kwargs: Kwargs, result: Any) -> tuple[int, int]:
    return _arg(args, kwargs, 0, "data").nbytes * (c.world_size - 1), _others([b.nbytes for b in result], c.rank)


def _broadcast(c: Communicator, args: Args, kwargs: Kwargs, result: Any) -> tuple[int, int]:
    if c.rank == _arg(args, kwargs, 1, "root", 0):
        return result.nbytes * (c.world_size - 1), 0
    return 0, result.nbytes


def _allreduce(c: Communicator, args: Args, kwargs: Kwargs, result: Any) -> tuple[int, int]:
    n = _arg(args, kwargs, 0, "array").nbytes * (c.world_size - 1)
    return n, n


def _nothing(c: Communicator, args: Args, kwargs: Kwargs, result: Any) -> tuple[int, int]:
    return 0, 0


# The public collectives and how each measures its payload.  Not on_root / on_every_rank: they
# run local steps (timed as compute) around the object collectives that are accounted.
_ACCOUNTED: dict[str, Measure] = {
    "alltoallv": _alltoallv,
    "allgather_bytes": _allgather,
    "broadcast_bytes": _broadcast,
    "allreduce": _allreduce,
    "barrier": _nothing,
    "exchange": _exchange,
    "exchange_contiguous": _exchange_contiguous,
    "exchange_tables": _exchange_tables,
    "allgather_obj": None,  # its pickles' bytes: allgather_bytes counts them
    "broadcast_obj": None,
    "allreduce_scalar": None,
}
for _name, _measure in _ACCOUNTED.items():  # the base class's own (its subclasses': __init_subclass__)
    setattr(Communicator, _name, _accounted(getattr(Communicator, _name), _measure))


# ---- Arrow IPC streams in caller-provided memory (used by exchange_tables) --------------------
def ipc_stream_size(table: pa.Table, schema: pa.Schema) -> int:
    """The bytes ``write_ipc_stream`` will write for ``table``: metadata only, no data copied."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    sink = pa.MockOutputStream()
    with ipc.new_stream(sink, schema) as writer:
        writer.write_table(table)
    size: int = sink.size()  # pyarrow is untyped here
    return size


def write_ipc_stream(table: pa.Table, schema: pa.Schema, out: np.ndarray) -> None:
    """``table`` as one IPC stream into the uint8 array ``out`` (exactly ``ipc_stream_size`` long)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    sink = pa.FixedSizeBufferWriter(pa.py_buffer(out))
    with ipc.new_stream(sink, schema) as writer:
        writer.write_table(table)
    if sink.tell() != out.size:
        raise RuntimeError(f"IPC stream of {sink.tell()} bytes, {out.size} were planned")


def read_ipc_stream(view: Any) -> pa.Table:
    """The table in one IPC stream, read in place: its buffers point into ``view`` (and keep it alive)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    return ipc.open_stream(pa.BufferReader(pa.py_buffer(view))).read_all()
