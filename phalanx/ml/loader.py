"""``px.ml.loader``: mini-batches of a sealed store dataset as torch tensors, one share per rank.

Which rows a rank sees in an epoch is the same as ``torch.utils.data.DistributedSampler``
(``shuffle="global"``: a permutation seeded by ``seed + epoch``, padded by wrapping around so
every rank gets ``ceil(N / world)`` rows, rank r taking positions r, r + world, ...).  How they
are read is not: no per-row Python and no collate.  Every rank memory-maps the dataset's
partitions (the store is shared memory or a shared file system), and a background thread builds
one row-major numpy matrix per chunk of the rank's share: sort the chunk's row numbers, gather
each feature column with ``np.take`` on the zero-copy Arrow views (nearly sequential reads),
transpose a cache-sized block at a time and scatter whole rows into their place in the
permutation.  Batches are ``torch.from_numpy`` views of that matrix.  With ``device=`` a CUDA
device, the matrix is pinned (in the background thread) and each batch is copied to the device
asynchronously on a dedicated stream while the previous one is used (:func:`prefetch`).
See docs/ml.md.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pyarrow as pa
import torch

if TYPE_CHECKING:
    from ..runtime.env import BSPEnv
    from ..store.metadata import DatasetInfo
    from ..store.store import Store

SHUFFLES = ("global", "local", None)
CHUNK_BYTES = 256 << 20  # a rank's share is built in chunks of at most this many bytes
_BLOCK_BYTES = 1 << 21  # rows transposed per step: a block that stays in cache

_NUMPY_DTYPE = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def loader(
    env: BSPEnv,
    dataset: str,
    features: str | Sequence[str],
    label: str | None = None,
    *,
    batch_size: int = 1024,
    shuffle: str | None = "global",
    seed: int = 0,
    drop_last: bool = False,
    dtype: torch.dtype = torch.float32,
    label_dtype: torch.dtype | None = None,
    prefetch: int = 2,
    session: str | None = None,
    verify: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
    device: str | torch.device | None = None,
) -> Loader:
    """Batches ``(x, y)`` (or ``x`` without a label) of stored dataset ``dataset`` for this rank.

    Collective: every rank of the gang calls it with the same arguments.  ``x`` has shape
    ``[B, len(features)]`` and dtype ``dtype``; ``y`` has shape ``[B]`` and dtype
    ``label_dtype`` (default: int64 for an integer label column, else ``dtype``).

    shuffle: ``"global"`` a fresh permutation of all rows each epoch (``set_epoch``), the same
    on every rank, each rank a disjoint strided share (DistributedSampler's rows exactly);
    ``"local"`` rank r always reads the contiguous block ``[r*S, (r+1)*S)`` and permutes it
    each epoch; ``None`` that block in order.  Every rank yields the same number of batches:
    with ``drop_last=False`` each rank gets ``S = ceil(N / world)`` rows, the missing
    ``S*world - N`` taken again from the start of the order (a few rows twice per epoch), and
    the last batch may be short (the same length on every rank); with ``drop_last=True``
    ``S = N // world`` and only full batches (``S // batch_size`` of them) are yielded.

    prefetch: chunks built ahead by a background thread (the next epoch's too, assuming
    ``set_epoch(epoch + 1)``); 0 builds in the consuming thread.  session: a store session
    other than the gang's.  verify: check every partition's checksum first (each partition by
    one rank; a corrupted one fails the loader on every rank, naming it).  ``dataset`` may be
    ``SESSION/NAME`` (another run's output), as a stage's inputs may.

    device: where batches are yielded.  None or ``"cpu"``: CPU tensors, views of the chunk
    matrix.  A CUDA device (``"cuda"``, ``"cuda:0"``, ``px.ml.rank_device()``): the chunk is
    pinned in the background thread and each batch copied to the device with a non-blocking copy
    on a dedicated CUDA stream, the next batch's copy issued before the current batch is yielded
    so it overlaps the training step; the rows and their order are the same.
    """
    if session is None and "/" in dataset:
        session, _, dataset = dataset.rpartition("/")
    return Loader(
        env,
        dataset,
        features,
        label,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        dtype=dtype,
        label_dtype=label_dtype,
        prefetch=prefetch,
        session=session,
        verify=verify,
        chunk_bytes=chunk_bytes,
        device=device,
    )


def _record_input(
    env: Any, session: str | None, dataset: str, info: DatasetInfo, shuffle: str | None, here: int, fetched: int
) -> None:
    """Inside a workflow stage, what the loader read of one of the stage's inputs, for the run
    record (as ``env.input`` records it): rows, bytes, how, and bytes read here vs fetched."""
    scope = getattr(env, "_stage", None)
    stats = getattr(scope, "input_stats", None)
    if scope is None or stats is None:
        return
    full = f"{session}/{dataset}" if session else dataset
    for local, spec in scope.inputs.items():
        if spec.get("dataset") in (dataset, full):
            stats[local] = {
                "dataset": spec["dataset"],
                "rows": info.num_rows,
                "bytes": info.nbytes,
                "plan": f"px.ml.loader, shuffle={shuffle}: every partition on every rank",
                "read_here": here,
                "fetched": fetched,
            }


# ---- which rows ---------------------------------------------------------------------------
def samples_per_rank(num_rows: int, world_size: int, drop_last: bool) -> int:
    return num_rows // world_size if drop_last else -(-num_rows // world_size)


def rank_rows(
    num_rows: int, world_size: int, rank: int, shuffle: str | None, seed: int, epoch: int, drop_last: bool
) -> np.ndarray:
    """This rank's global row numbers for one epoch, in the order they are yielded."""
    per = samples_per_rank(num_rows, world_size, drop_last)
    total = per * world_size
    if shuffle == "global":  # torch.utils.data.DistributedSampler(shuffle=True), exactly
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        perm = torch.randperm(num_rows, generator=g).numpy()
        if total > num_rows:
            perm = np.resize(perm, total)  # pads by wrapping around, as DistributedSampler does
        return np.ascontiguousarray(perm[rank:total:world_size])
    rows = np.arange(rank * per, (rank + 1) * per, dtype=np.int64)
    if total > num_rows:
        rows %= num_rows  # the last rank's block wraps around to the first rows
    if shuffle == "local":
        rows = rows[np.random.default_rng([seed, epoch, rank]).permutation(per)]
    return rows


# ---- the columns, as numpy views --------------------------------------------------------------
class _Columns:
    """The dataset's feature (and label) columns: one segment per record batch of each partition."""

    def __init__(self, store: Store, info: DatasetInfo, names: Sequence[str]):
        starts = [0]
        self.segments: list[list[np.ndarray]] = []
        for i, part in enumerate(info.partitions):
            if part.rows == 0:
                continue
            table = store.partition(info, i).select(list(names))
            for batch in table.to_batches():
                if batch.num_rows == 0:
                    continue
                self.segments.append([_numpy_view(batch.column(j), name, info.name, i) for j, name in enumerate(names)])
                starts.append(starts[-1] + batch.num_rows)
        self.starts = np.array(starts, dtype=np.int64)

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])


def _numpy_view(arr: pa.Array, name: str, dataset: str, partition: int) -> np.ndarray:
    if arr.null_count:
        raise ValueError(
            f"px.ml.loader: dataset {dataset!r} column {name!r} has {arr.null_count} null(s) "
            f"(partition {partition}); fill or drop them before training (fill_null, filter)"
        )
    if pa.types.is_boolean(arr.type):
        return arr.to_numpy(zero_copy_only=False)  # bit-packed in Arrow: one byte a row here
    return arr.to_numpy(zero_copy_only=True)


def _check_column_type(schema: pa.Schema, name: str, dataset: str, role: str) -> pa.DataType:
    if schema.get_field_index(name) < 0:
        raise ValueError(
            f"px.ml.loader: dataset {dataset!r} has no {role} column {name!r} (columns: {', '.join(schema.names)})"
        )
    t = schema.field(name).type
    if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        raise TypeError(
            f"px.ml.loader: {role} column {name!r} of dataset {dataset!r} has type {t}; "
            "the loader takes numeric or bool columns (encode others before putting them)"
        )
    return t


# ---- building a chunk --------------------------------------------------------------------------
def _sort_rows(rows: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(sorted rows, where each came from)``: one packed-key sort, no argsort."""
    n = len(rows)
    k = max(1, int(n - 1).bit_length())
    if int(num_rows).bit_length() + k > 62:
        order = np.argsort(rows, kind="stable")
        return rows[order], order
    key = (rows.astype(np.int64, copy=False) << k) | np.arange(n, dtype=np.int64)
    key.sort()
    return key >> k, key & ((1 << k) - 1)


def _take(col: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    if col.dtype == out.dtype:
        np.take(col, idx, out=out, mode="clip")  # indices are valid; "clip" avoids a buffer
    else:
        out[...] = np.take(col, idx, mode="clip")


def build_chunk(
    cols: _Columns, rows: np.ndarray, nfeatures: int, xdtype: np.dtype, ydtype: np.dtype | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """``X[i] = features of row rows[i]`` (row-major ``[n, F]``) and ``y[i]`` its label."""
    n, F = len(rows), nfeatures
    src, order = _sort_rows(rows, cols.num_rows)
    identity = bool(n < 2 or np.all(order[1:] > order[:-1]))
    bounds = np.searchsorted(src, cols.starts)  # sorted positions where each segment starts
    X = np.empty((n, F), xdtype)
    y = np.empty(n, ydtype) if ydtype is not None else None
    rowbytes = F * X.itemsize
    row_void = np.dtype((np.void, rowbytes))
    Xv = X.view(row_void).reshape(-1)
    blk = int(min(max(_BLOCK_BYTES // max(rowbytes, 1), 1024), 1 << 16))
    tmp = np.empty((F, blk), xdtype)
    rows_blk = np.empty((blk, F), xdtype)
    rows_blk_v = rows_blk.view(row_void).reshape(-1)
    ys = np.empty(n, ydtype) if y is not None and not identity else y
    seg = 0
    for a in range(0, n, blk):
        b = min(a + blk, n)
        # the segments this block of sorted rows falls in
        while bounds[seg + 1] <= a:
            seg += 1
        s = seg
        while s < len(cols.segments) and bounds[s] < b:
            lo, hi = max(a, int(bounds[s])), min(b, int(bounds[s + 1]))
            if lo < hi:
                local = src[lo:hi] - cols.starts[s]
                columns = cols.segments[s]
                for j in range(F):
                    _take(columns[j], local, tmp[j, lo - a : hi - a])
                if ys is not None:  # (it is when y is)
                    _take(columns[F], local, ys[lo:hi])
            s += 1
        m = b - a
        if identity:
            X[a:b] = tmp[:, :m].T
        else:
            rows_blk[:m] = tmp[:, :m].T
            Xv[order[a:b]] = rows_blk_v[:m]  # whole rows to their place in the order
    if y is not None and not identity:
        y[order] = ys
    return X, y


# ---- background building ---------------------------------------------------------------------
@dataclass
class _Chunk:
    epoch: int
    index: int
    count: int  # chunks in this epoch
    x: torch.Tensor
    y: torch.Tensor | None
    build_s: float


class _Source:
    """Plans an epoch's chunks and builds them (what the prefetch thread holds)."""

    def __init__(
        self,
        columns: _Columns,
        rows_args: tuple,
        chunk_rows: int,
        nfeatures: int,
        xdtype: np.dtype,
        ydtype: np.dtype | None,
        x_to: torch.dtype | None,
        y_to: torch.dtype | None,
        pin: bool = False,
    ):
        self.columns, self.rows_args, self.chunk_rows = columns, rows_args, chunk_rows
        self.nfeatures, self.xdtype, self.ydtype, self.x_to, self.y_to = nfeatures, xdtype, ydtype, x_to, y_to
        self.pin = pin  # page-locked chunks, for asynchronous copies to a CUDA device

    def rows(self, epoch: int) -> np.ndarray:
        num_rows, world_size, rank, shuffle, seed, drop_last, per_epoch = self.rows_args
        return rank_rows(num_rows, world_size, rank, shuffle, seed, epoch, drop_last)[:per_epoch]

    def plan(self, epoch: int) -> list[np.ndarray]:
        rows = self.rows(epoch)
        return [rows[i : i + self.chunk_rows] for i in range(0, len(rows), self.chunk_rows)]

    def build(self, epoch: int, index: int, count: int, rows: np.ndarray) -> _Chunk:
        t0 = time.perf_counter()
        X, y = build_chunk(self.columns, rows, self.nfeatures, self.xdtype, self.ydtype)
        x = torch.from_numpy(X)
        if self.x_to is not None:
            x = x.to(self.x_to)
        yt = None
        if y is not None:
            yt = torch.from_numpy(y)
            if self.y_to is not None:
                yt = yt.to(self.y_to)
        if self.pin:  # (only with a CUDA device: the loader checked it exists)
            x = x.pin_memory()
            yt = yt.pin_memory() if yt is not None else None
        return _Chunk(epoch, index, count, x, yt, time.perf_counter() - t0)


class _Pipeline:
    """A thread building chunks of epochs start, start+1, ... at most ``prefetch`` ahead."""

    def __init__(self, source: _Source, start_epoch: int, prefetch: int):
        self._source = source
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._permits = threading.Semaphore(prefetch)
        self._stop = threading.Event()
        self.next = (start_epoch, 0)  # the chunk the consumer gets next
        self.closed = False
        self._thread = threading.Thread(target=self._run, args=(start_epoch,), daemon=True, name="phalanx-ml-loader")
        self._thread.start()

    def _run(self, epoch: int) -> None:
        try:
            while True:
                chunks = self._source.plan(epoch)
                if not chunks:
                    return
                for i, rows in enumerate(chunks):
                    while not self._permits.acquire(timeout=0.1):
                        if self._stop.is_set():
                            return
                    if self._stop.is_set():
                        return
                    self._queue.put(self._source.build(epoch, i, len(chunks), rows))
                epoch += 1
        except BaseException as exc:  # handed to the consumer, raised there
            self._queue.put(exc)

    def get(self) -> tuple[_Chunk, float]:
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("px.ml.loader: the prefetch thread stopped") from None
        waited = time.perf_counter() - t0
        self._permits.release()
        if isinstance(item, BaseException):
            self.closed = True
            raise item
        self.next = (item.epoch, item.index + 1) if item.index + 1 < item.count else (item.epoch + 1, 0)
        return item, waited

    def close(self) -> None:
        self.closed = True
        self._stop.set()
        self._permits.release()
        if threading.current_thread() is not self._thread:  # (a loader collected by that thread)
            self._thread.join()


# ---- the loader ------------------------------------------------------------------------------
class Loader:
    """Iterable over this rank's batches of the current epoch; see :func:`loader`."""

    def __init__(
        self,
        env: BSPEnv,
        dataset: str,
        features: str | Sequence[str],
        label: str | None = None,
        *,
        batch_size: int = 1024,
        shuffle: str | None = "global",
        seed: int = 0,
        drop_last: bool = False,
        dtype: torch.dtype = torch.float32,
        label_dtype: torch.dtype | None = None,
        prefetch: int = 2,
        session: str | None = None,
        verify: bool = True,
        chunk_bytes: int = CHUNK_BYTES,
        device: str | torch.device | None = None,
    ):
        for attr in ("rank", "world_size", "comm", "store"):
            if not hasattr(env, attr):
                raise TypeError(
                    f"px.ml.loader needs the env of a gang rank (the first argument of an "
                    f"app run by gang.run), got {type(env).__name__}"
                )
        features = [features] if isinstance(features, str) else list(features)
        if not features:
            raise ValueError("px.ml.loader: give at least one feature column")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"px.ml.loader: batch_size must be an integer ≥ 1, got {batch_size!r}")
        if shuffle not in SHUFFLES:
            raise ValueError(f"px.ml.loader: shuffle must be 'global', 'local' or None, got {shuffle!r}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"px.ml.loader: prefetch must be an integer ≥ 0, got {prefetch!r}")
        self.env, self.dataset, self.features, self.label = env, dataset, features, label
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, int(seed), bool(drop_last)
        self.prefetch = prefetch
        self.device = _resolve_device(device)
        self.rank, self.world_size = env.rank, env.world_size
        self.epoch = 0

        rank_store = env.store if session is None else env.store.for_session(session)
        store = rank_store.store
        # One rank looks the name up, so every rank reads the same version even if it is being
        # replaced; ``use`` (where the store has it) records the read and reloads a spilled dataset.
        info = env.comm.on_root(getattr(store, "use", store.info), dataset)
        mine = (dataset, info.version, features, label, batch_size, shuffle, self.seed, self.drop_last)
        everyone = env.comm.allgather_obj(mine)
        for r, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                raise ValueError(
                    f"px.ml.loader is collective: rank {r} called it with "
                    f"(dataset, version, features, label, batch_size, shuffle, seed, "
                    f"drop_last) = {theirs}, rank 0 with {everyone[0]}"
                )
        self.info = info
        for f in features:
            _check_column_type(info.schema, f, dataset, "feature")
        label_type = _check_column_type(info.schema, label, dataset, "label") if label is not None else None
        self.dtype, self._xdtype, self._xconvert = _resolve_dtype(dtype, "dtype")
        self.label_dtype: torch.dtype | None
        self._ydtype: np.dtype | None
        if label is not None:
            if label_dtype is None:
                label_dtype = torch.int64 if pa.types.is_integer(label_type) else dtype
            self.label_dtype, self._ydtype, self._yconvert = _resolve_dtype(label_dtype, "label_dtype")
        else:
            self.label_dtype, self._ydtype, self._yconvert = None, None, False
        if info.num_rows == 0:
            raise ValueError(f"px.ml.loader: dataset {dataset!r} has no rows")
        if verify:
            from ..store.rank import verify_share

            env.comm.on_every_rank(
                f"px.ml.loader {dataset!r}: verifying checksums", verify_share, env, store, info, rank_store.root_ids()
            )
        reads = store.reads
        here, fetched = reads.local, reads.fetched
        columns = _Columns(store, info, features + ([label] if label is not None else []))
        _record_input(env, session, dataset, info, shuffle, reads.local - here, reads.fetched - fetched)

        self.num_rows = info.num_rows
        self.num_samples = samples_per_rank(self.num_rows, self.world_size, self.drop_last)
        self._rows_per_epoch = self.num_samples // batch_size * batch_size if self.drop_last else self.num_samples
        row_bytes = len(features) * self._xdtype.itemsize + (
            self._ydtype.itemsize if label and self._ydtype is not None else 0
        )
        self.chunk_rows = max(batch_size, chunk_bytes // row_bytes // batch_size * batch_size)
        # what the prefetch thread needs, without a reference to the loader (so that dropping
        # the loader stops the thread)
        self._source = _Source(
            columns,
            self._rows_args(),
            self.chunk_rows,
            len(features),
            self._xdtype,
            self._ydtype,
            self.dtype if self._xconvert else None,
            self.label_dtype if self._yconvert else None,
            pin=self.device is not None,
        )
        self._pipeline: _Pipeline | None = None
        self._completed: int | None = None  # the last epoch iterated to its end
        self._warned = False
        self.stats: dict[str, Any] = {}

    # ---- the public surface ---------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` from the next iteration on (call it every epoch)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Batches per epoch: the same on every rank."""
        return math.ceil(self._rows_per_epoch / self.batch_size)

    def rows(self, epoch: int | None = None) -> np.ndarray:
        """The global row numbers this rank yields in ``epoch`` (default: the current one), in order."""
        return self._source.rows(self.epoch if epoch is None else epoch)

    def _rows_args(self) -> tuple:
        return (
            self.num_rows,
            self.world_size,
            self.rank,
            self.shuffle,
            self.seed,
            self.drop_last,
            self._rows_per_epoch,
        )

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        if self._completed == epoch and self.shuffle is not None and not self._warned:
            warnings.warn(
                f"px.ml.loader: epoch {epoch} iterated again with the same order; call "
                "loader.set_epoch(epoch) before each epoch for a new permutation",
                stacklevel=2,
            )
            self._warned = True
        if self._rows_per_epoch == 0:  # drop_last with fewer rows per rank than one batch
            self.stats = {
                "epoch": epoch,
                "rows": 0,
                "batches": 0,
                "chunks": 0,
                "build_s": 0.0,
                "wait_s": 0.0,
                "seconds": 0.0,
            }
            self._completed = epoch
            return iter(())
        if self.prefetch == 0:
            self.close()
            batches = self._batches(None, epoch)
        else:
            if self._pipeline is None or self._pipeline.closed or self._pipeline.next != (epoch, 0):
                self.close()  # a different epoch, or the last one was left half-way: start afresh
                self._pipeline = _Pipeline(self._source, epoch, self.prefetch)
            batches = self._batches(self._pipeline, epoch)
        if self.device is None:
            return batches
        copier = _CudaCopier(self.device)
        return prefetch(batches, copier.start, copier.ready)

    def close(self) -> None:
        """Stop the prefetch thread (iterating again restarts it)."""
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"<px.ml.Loader {self.dataset!r} rank {self.rank}/{self.world_size} rows={self.num_rows} "
            f"per_rank={self.num_samples} batch_size={self.batch_size} shuffle={self.shuffle!r} "
            f"epoch={self.epoch}{f' device={self.device}' if self.device is not None else ''}>"
        )

    def _batches(self, pipeline: _Pipeline | None, epoch: int) -> Iterator[Any]:
        B = self.batch_size
        stats = {"epoch": epoch, "rows": 0, "batches": 0, "chunks": 0, "build_s": 0.0, "wait_s": 0.0}
        t_start = time.perf_counter()
        source = self._source
        plan = source.plan(epoch) if pipeline is None else []  # (the pipeline plans its own)
        index, count = 0, None
        while count is None or index < count:
            if pipeline is None:
                t0 = time.perf_counter()
                chunk = source.build(epoch, index, len(plan), plan[index])
                waited = time.perf_counter() - t0
            else:
                if pipeline.closed or pipeline is not self._pipeline:
                    raise RuntimeError(
                        "px.ml.loader: this iterator was superseded by a newer iteration of the same loader"
                    )
                chunk, waited = pipeline.get()
                assert (chunk.epoch, chunk.index) == (epoch, index), (chunk.epoch, chunk.index, epoch, index)
            count = chunk.count
            stats["chunks"] += 1
            stats["build_s"] += chunk.build_s
            stats["wait_s"] += waited
            n = len(chunk.x)
            for a in range(0, n, B):
                b = min(a + B, n)
                stats["rows"] += b - a
                stats["batches"] += 1
                # y is built when the loader has a label
                yield (chunk.x[a:b], chunk.y[a:b]) if chunk.y is not None else chunk.x[a:b]
            del chunk
            index += 1
        stats["seconds"] = time.perf_counter() - t_start
        self.stats = stats
        self._completed = epoch


def _resolve_dtype(dtype: Any, what: str) -> tuple[torch.dtype, np.dtype, bool]:
    """``(torch dtype, numpy dtype the matrix is built in, whether to convert it after)``."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"px.ml.loader: {what} must be a torch dtype (torch.float32...), got {dtype!r}")
    if dtype in _NUMPY_DTYPE:
        return dtype, np.dtype(_NUMPY_DTYPE[dtype]), False
    if dtype.is_floating_point:  # bfloat16, float8...: built as float32, converted per chunk
        return dtype, np.dtype(np.float32), True
    raise TypeError(f"px.ml.loader: {what} {dtype} is not supported (use a float, integer or bool dtype)")


# ---- batches on a device ------------------------------------------------------------------------
T = TypeVar("T")
H = TypeVar("H")


def prefetch(batches: Iterable[T], start: Callable[[T], H], ready: Callable[[H], Any]) -> Iterator[Any]:
    """``ready(start(b))`` for each batch ``b``, one batch ahead: ``start`` (issue the copy of
    the next batch) is called before the current batch is yielded, ``ready`` (make the
    consumer's stream wait for that copy) just before it is.  Generic so that it is tested on
    the CPU with a fake copy; :class:`_CudaCopier` is the real one."""
    it = iter(batches)
    try:
        pending = start(next(it))
    except StopIteration:
        return
    for batch in it:
        following = start(batch)  # its copy overlaps the consumer's work on ``pending``
        yield ready(pending)
        pending = following
    yield ready(pending)


class _CudaCopier:
    """Host→device copies on a dedicated stream: ``start`` issues non-blocking copies of a
    (pinned) batch and records an event; ``ready`` makes the current stream wait for it and
    tells the caching allocator the tensors are used there."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def start(self, batch: Any) -> tuple[Any, Any]:
        tensors = batch if isinstance(batch, tuple) else (batch,)
        # (no wait on the consumer's stream: the copy reads a pinned chunk the consumer never
        # writes, and waiting would serialise it behind the step it is meant to overlap)
        with torch.cuda.stream(self.stream):
            moved = tuple(t.to(self.device, non_blocking=True) for t in tensors)
            done = torch.cuda.Event()
            done.record(self.stream)
        return (moved if isinstance(batch, tuple) else moved[0]), done

    def ready(self, handle: tuple[Any, Any]) -> Any:
        batch, done = handle
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for t in batch if isinstance(batch, tuple) else (batch,):
            t.record_stream(current)  # allocated on the copy stream, used on this one
        return batch


def _resolve_device(device: str | torch.device | None) -> torch.device | None:
    """None for the CPU (today's batches, unchanged), else a CUDA device that exists."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(
            f"px.ml.loader: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}"
        ) from exc
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"px.ml.loader: device {dev} is not supported (the CPU or a CUDA device)")
    if not torch.cuda.is_available():
        raise RuntimeError(f"px.ml.loader: device {dev} asked for, but CUDA is not available on this rank")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"px.ml.loader: device {dev} asked for, this rank sees {torch.cuda.device_count()} GPU(s) "
            "(its CUDA_VISIBLE_DEVICES)"
        )
    return dev
