"""A store service: the partitions under a file tier's root, served read-only over the network.

Each host of a run's allocation keeps the partitions its ranks wrote in its own memory tier
(``/dev/shm``).  A reader on another host fetches a partition's exact bytes from the service on
the holding host — the same bytes the metadata's checksum covers, so the reader verifies them
(``tiers.checksum_buffer``) and opens the IPC file zero-copy from the received buffer::

    svc = StoreService("/dev/shm/phalanx-alice/store", "10.0.0.11", token=secret)  # holder
    svc.endpoint                          # 'grpc+tcp://10.0.0.11:40123', for the metadata
    buf = fetch(endpoint, secret, location, 0)  # reader, any host: one pa.Buffer
    table = ipc.open_file(pa.BufferReader(buf)).read_all()
    svc.close()

Or in the foreground, as a pilot starts one per node (the secret from the environment or a
0600 file, never the command line)::

    PHALANX_STORE_TOKEN_FILE=~/.px/secret python -m phalanx.store.service \\
        --root /dev/shm/phalanx-alice/store --host 10.0.0.11 --endpoint-file /shared/ep.h1

Engine: Arrow Flight (gRPC, in pyarrow) for its calls and row-shaped answers, and plain HTTP/1.1
for whole files (``http_bytes``: gRPC's receive path costs a reader three times a socket's CPU);
why, with numbers: docs/store.md, "Across hosts".

- Read-only: a ticket names a (location, index) as the metadata records it; the service opens
  ``<location>/part-NNNNN.arrow`` only inside its root(s), walking from the root one directory at
  a time without following a symbolic link, each directory and the file this user's
  (``tiers.check_mine``); anything else is refused, naming it.
- Authenticated: a bearer token checked on every call by a server middleware
  (``hmac.compare_digest``); whoever holds it may read, hash and remove anything under the
  service's roots.  By default one per user (``token_file``: ``store.token`` in the state
  directory, made once); per allocation where the site sets ``PHALANX_STORE_TOKEN_FILE`` to a
  fresh file (docs/store.md, "Who can read what").  The token is never logged or put in an
  error message, but it travels in clear on every request (no TLS, on Flight and the bulk
  path alike): a service belongs on the cluster's private network only.
- Bound to the address asked for (loopback or the host's cluster address); a wildcard address
  (``0.0.0.0``, ``::``) is refused unless ``any_address=True``.
- A whole file's bytes: the holder's kernel ``sendfile``s them over HTTP, the reader receives
  them into one preallocated buffer.  With ``--flight-only`` (one port) they travel as record
  batches of one ``binary`` value each (slices of the mapped file), copied into one buffer.
"""

from __future__ import annotations

import argparse
import errno
import hmac
import json
import logging
import mmap
import os
import secrets
import signal
import socket
import stat
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl
import pyarrow.ipc as ipc

from ..errors import (
    AuthRefusedError,
    ChecksumError,
    LocationRefusedError,
    RemotePartitionNotFoundError,
    RemoteStoreError,
    ServiceUnreachableError,
    UnsafePathError,
)
from ..paths import ENV_SPILL, state_dir
from ..private import FILE_MODE, read_private_file
from ..runtime.envvars import ENV_STORE_TOKEN as ENV_TOKEN
from ..runtime.envvars import ENV_STORE_TOKEN_FILE as ENV_TOKEN_FILE
from . import http_bytes
from .http_bytes import BytesServer
from .remote import SERVICES_DIR, publish_endpoint
from .repartition import select_rows
from .tiers import FileTier, check_mine, checksum_buffer, part_file, remove_under

log = logging.getLogger("phalanx.store.service")

TOKEN_FILE_NAME = "store.token"  # the per-user default token, in the state directory
CHUNK = 4 << 20  # bytes per record batch of a raw fetch
DEFAULT_TIMEOUT = 60.0  # seconds for one fetch, connection included
WILDCARDS = ("", "0.0.0.0", "::", "[::]", "*")
# A holder that vanishes during a fetch without closing the connection (host down, network
# cut) is noticed by gRPC's keepalive within ~15 s, well before the fetch's own timeout.  Pings
# only while a call runs: the server's default policy refuses pings on an idle connection
# more often than every 5 minutes (and the Python Flight server cannot change it).
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_time_between_pings_ms", 10_000),
    # a host that does not answer a connection at all (down before the read began) fails the
    # call after ~5 s of connecting, not at the call's deadline
    ("grpc.min_reconnect_backoff_ms", 5_000),
]

_NOT_FOUND, _REFUSED, _CORRUPT = b"phalanx:not-found", b"phalanx:refused", b"phalanx:corrupt"


# ---- the secret -----------------------------------------------------------------------------
def read_token_file(path: str | os.PathLike[str]) -> str:
    """The secret in ``path``: a regular file of this user's that only this user can read."""
    token = read_private_file(path, "token file").strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def write_token_file(path: str | os.PathLike[str], token: str) -> Path:
    """Write ``token`` to a new 0600 file (for a pilot handing the secret to its nodes)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return Path(path)


def token_file() -> Path:
    """The token file this process uses: ``PHALANX_STORE_TOKEN_FILE``, else ``store.token`` in
    the state directory (``~/.local/state/phalanx``, on the home every node mounts), made with
    a new random secret (mode 0600) the first time.  One per user: every service and reader of
    this user's, on every host, holds it; nobody else can read it."""
    named = os.environ.get(ENV_TOKEN_FILE)
    if named:
        return Path(named)
    path = state_dir() / TOKEN_FILE_NAME
    try:
        write_token_file(path, secrets.token_hex(32))
    except FileExistsError:  # made before (or by a process racing us): use it
        pass
    return path


def token_from_env() -> str:
    """``PHALANX_STORE_TOKEN``, else the file ``token_file()`` names (made if missing)."""
    token = os.environ.get(ENV_TOKEN)
    if token:
        return token
    return read_token_file(token_file())


# ---- where this host's service is -------------------------------------------------------------
def resolve_host(host: str) -> str:
    """``auto``: the address this host's name resolves to (its cluster address, as SLURM and
    /etc/hosts know it); anything else as given."""
    if host != "auto":
        return host
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise ValueError(
            f"--host auto: this host's name {name!r} does not resolve ({exc}); give --host ADDRESS"
        ) from None


# ---- the server -----------------------------------------------------------------------------
class _BearerAuth(fl.ServerMiddlewareFactory):  # type: ignore[misc]
    def __init__(self, token: str):
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: Any, headers: dict[str, list[str | bytes]]) -> None:
        got = headers.get("authorization") or [""]
        value = got[0].encode() if isinstance(got[0], str) else got[0]
        if len(got) != 1 or not hmac.compare_digest(value, self._expected):
            raise fl.FlightUnauthenticatedError("store service: missing or wrong token")


def open_partition_fd(root: Path, location: str, index: int) -> int:
    """A read-only descriptor of ``<location>/part-NNNNN.arrow`` inside ``root``, reached from
    the root one directory at a time without following a symbolic link, every directory below
    the root and the file this user's.  ``UnsafePathError`` naming the location otherwise;
    ``FileNotFoundError`` when it is not there."""
    where = Path(location)
    if not FileTier(root).owns(location) or not where.is_absolute():
        raise UnsafePathError(f"{location} is not inside the store root {root}")
    names = where.relative_to(root).parts
    if ".." in names or "." in names:
        raise UnsafePathError(f"{location} is not inside the store root {root} (it names '..')")
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO must not hang us
    fd = os.open(root, flags | os.O_DIRECTORY)
    here = root
    try:  # the root itself may be a group's project directory (as for tiers.remove_under)
        steps = (*names, part_file(index))
        for i, name in enumerate(steps):
            here = here / name
            last = i == len(steps) - 1
            try:
                sub = os.open(name, flags | (0 if last else os.O_DIRECTORY), dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePathError(f"{here} is a symbolic link or not a directory") from None
                raise
            os.close(fd)
            fd = sub
            st = os.fstat(fd)
            check_mine(here, st)
            if last and not stat.S_ISREG(st.st_mode):
                raise UnsafePathError(f"{here} is not a regular file")
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def map_fd(fd: int) -> pa.Buffer:
    """The whole file open as ``fd``, memory-mapped read-only (the buffer keeps the map)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return pa.py_buffer(b"")
    return pa.py_buffer(mmap.mmap(fd, size, prot=mmap.PROT_READ))


def open_in_roots(roots: Sequence[Path], location: str, index: int) -> int:
    """``open_partition_fd`` in whichever of ``roots`` holds ``location``: ``FileNotFoundError``
    when it is not there, ``UnsafePathError`` (saying why, logged) when it may not be served."""
    refused: list[str] = []
    for root in roots:
        if not FileTier(root).owns(location):
            continue
        try:
            return open_partition_fd(root, location, index)
        except UnsafePathError as exc:
            refused.append(str(exc))
    why = "; ".join(refused) or f"it is not inside {' or '.join(map(str, roots))}"
    log.warning("store service: refused %s: %s", location, why)
    raise UnsafePathError(why)


class _Server(fl.FlightServerBase):  # type: ignore[misc]
    def __init__(self, roots: Sequence[Path], location: str, token: str, chunk: int, bytes_url: str = ""):
        super().__init__(location, middleware={"auth": _BearerAuth(token)})
        self.roots = list(roots)
        self.chunk = chunk
        self.splits = _Splits()
        self.bytes_url = bytes_url  # the HTTP bulk path of this service (http_bytes), "" if none

    def _open(self, location: str, index: int) -> pa.Buffer:
        try:
            fd = open_in_roots(self.roots, location, index)
        except FileNotFoundError:
            raise fl.FlightServerError(f"no partition {index} at {location}", _NOT_FOUND) from None
        except UnsafePathError as exc:
            raise fl.FlightServerError(f"refusing to serve {location}: {exc}", _REFUSED) from None
        try:
            return map_fd(fd)
        finally:
            os.close(fd)

    def do_action(self, context: Any, action: fl.Action) -> Iterator[bytes]:
        if action.type == "ping":  # is the service (and so its host's memory) still there?
            return iter([socket.gethostname().encode()])
        if action.type == "describe":  # where this service's bulk byte path listens
            return iter([json.dumps({"bytes": self.bytes_url}).encode()])
        try:
            want = json.loads(action.body.to_pybytes())
            location = str(want["location"])
        except (ValueError, KeyError, TypeError):
            raise fl.FlightServerError(f"bad {action.type} request: expected {{location, ...}}", _REFUSED) from None
        if action.type == "checksum":  # checked where it lives: no bytes cross the network
            return iter([checksum_buffer(self._open(location, int(want["index"]))).encode()])
        if action.type == "remove":  # a replaced or deleted version, or a session, of this user's
            self._remove(location)
            return iter([b"removed"])
        raise fl.FlightServerError(f"unknown action {action.type!r}", _REFUSED)

    def _remove(self, location: str) -> None:
        for root in self.roots:
            if FileTier(root).owns(location):
                try:
                    remove_under(root, location)
                except UnsafePathError as exc:
                    log.warning("store service: refused to remove %s: %s", location, exc)
                    raise fl.FlightServerError(str(exc), _REFUSED) from None
                return
        raise fl.FlightServerError(
            f"refusing to remove {location}: it is not inside {' or '.join(map(str, self.roots))}", _REFUSED
        )

    def do_get(self, context: Any, ticket: fl.Ticket) -> fl.FlightDataStream:
        try:
            want = json.loads(ticket.ticket)
            location, index, kind = str(want["location"]), int(want["index"]), want.get("as", "bytes")
        except (ValueError, KeyError, TypeError):
            raise fl.FlightServerError("bad ticket: expected {location, index, as}", _REFUSED) from None
        buf = self._open(location, index)
        if kind == "table":
            return fl.RecordBatchStream(ipc.open_file(pa.BufferReader(buf)).read_all())
        if kind == "rows":  # a slice, or a random share's rows: selected here, only they move
            try:
                checksum, select = str(want["checksum"]), dict(want["select"])
                columns = None if want.get("columns") is None else [str(c) for c in want["columns"]]
            except (KeyError, TypeError, ValueError):
                raise fl.FlightServerError("bad rows ticket: expected {select, checksum}", _REFUSED) from None
            self.splits.check(buf, location, index, checksum)
            table = ipc.open_file(pa.BufferReader(buf)).read_all()
            try:
                rows = select_rows(table.select(columns) if columns is not None else table, select)
            except (KeyError, TypeError, ValueError, pa.ArrowInvalid) as exc:
                raise fl.FlightServerError(f"bad rows ticket: {exc}", _REFUSED) from None
            return fl.RecordBatchStream(rows)
        if kind == "hash":  # one reader's rows by key: the split made here, once for all readers
            try:
                keys, nparts, part = [str(k) for k in want["by"]], int(want["nparts"]), int(want["part"])
                checksum = str(want["checksum"])
                columns = None if want.get("columns") is None else [str(c) for c in want["columns"]]
            except (KeyError, TypeError, ValueError):
                raise fl.FlightServerError("bad hash ticket: expected {by, nparts, part, checksum}", _REFUSED) from None
            return fl.RecordBatchStream(self.splits.part(buf, location, index, checksum, keys, nparts, part, columns))
        lo, hi = 0, buf.size
        if "part" in want:  # one of k streams of the same file: its j-th byte range
            j, k = (int(x) for x in want["part"])
            lo, hi = j * buf.size // k, (j + 1) * buf.size // k
        meta = {"size": str(buf.size), "offset": str(lo), "length": str(hi - lo)}
        schema = pa.schema([("chunk", pa.binary())], metadata=meta)
        return fl.GeneratorStream(schema, _chunks(buf.slice(lo, hi - lo), schema, self.chunk))


class _Splits:
    """Partitions split by key hash for M readers, made once and kept until each of the M
    parts was sent once (or until more than ``limit`` bytes of splits are held: the oldest
    go).  The file is checked against the reader's checksum before it is split: the reader
    gets rows, not the file, so the check happens here, where the bytes are."""

    def __init__(self, limit: int = 1 << 30):
        self.limit = limit
        self._lock = threading.Lock()
        self._splits: dict[tuple[Any, ...], tuple[list[pa.Table], set[int]]] = {}  # oldest first
        self._making: dict[tuple[Any, ...], threading.Lock] = {}
        self._checked: set[tuple[str, int, str]] = set()

    def part(
        self,
        buf: pa.Buffer,
        location: str,
        index: int,
        checksum: str,
        keys: list[str],
        nparts: int,
        part: int,
        columns: list[str] | None = None,
    ) -> pa.Table:
        key = (location, index, checksum, tuple(keys), nparts, None if columns is None else tuple(columns))
        with self._lock:
            making = self._making.setdefault(key, threading.Lock())
        with making:  # the first reader splits; the others wait for it instead of splitting too
            with self._lock:
                entry = self._splits.get(key)
            if entry is None:
                entry = (self._split(buf, location, index, checksum, keys, nparts, columns), set())
                with self._lock:
                    self._splits[key] = entry
                    self._trim(key)
        tables, sent = entry
        with self._lock:
            sent.add(part)
            if len(sent) == nparts:  # every reader has its rows: free the split
                self._splits.pop(key, None)
                self._making.pop(key, None)
        return tables[part]

    def check(self, buf: pa.Buffer, location: str, index: int, checksum: str) -> None:
        """The file against the reader's checksum, once per (file, checksum) in this service."""
        key = (location, index, checksum)
        with self._lock:
            if key in self._checked:
                return
        actual = checksum_buffer(buf)
        if actual != checksum:
            raise fl.FlightServerError(
                f"partition {index} at {location}: checksum mismatch (stored {checksum}, the file has {actual}); "
                "the file was changed or corrupted",
                _CORRUPT,
            )
        with self._lock:
            self._checked.add(key)

    def _split(
        self,
        buf: pa.Buffer,
        location: str,
        index: int,
        checksum: str,
        keys: list[str],
        nparts: int,
        columns: list[str] | None,
    ) -> list[pa.Table]:
        from ..operators.kernels import hash_partition

        self.check(buf, location, index, checksum)
        table = ipc.open_file(pa.BufferReader(buf)).read_all()
        try:
            return hash_partition(table.select(columns) if columns is not None else table, keys, nparts)
        except (KeyError, pa.ArrowException) as exc:
            raise fl.FlightServerError(f"partition {index} at {location}: {exc}", _REFUSED) from None

    def _trim(self, keep: tuple[Any, ...]) -> None:
        """Drop the oldest splits (a reader that never came: its gang failed) past ``limit``."""
        held = sum(t.nbytes for tables, _ in self._splits.values() for t in tables)
        for key in list(self._splits):
            if held <= self.limit:
                break
            if key != keep:
                tables, _ = self._splits.pop(key)
                held -= sum(t.nbytes for t in tables)


def _chunks(buf: pa.Buffer, schema: pa.Schema, chunk: int) -> Iterator[pa.RecordBatch]:
    for off in range(0, buf.size, chunk):
        piece = buf.slice(off, min(chunk, buf.size - off))
        offsets = pa.array([0, piece.size], pa.int32()).buffers()[1]
        yield pa.record_batch([pa.Array.from_buffers(pa.binary(), 1, [None, offsets, piece])], schema=schema)


def _check_host(host: str, any_address: bool) -> str:
    if host.strip("[]") in WILDCARDS and not any_address:
        raise ValueError(
            f"refusing to bind the store service to {host!r} (every interface): give the host's "
            "cluster address or 127.0.0.1 (any_address=True to override)"
        )
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class StoreService:
    """A Flight server of the partitions under ``root`` (and ``also``: e.g. the spill
    directory), on ``host:port`` (``port=0``: a free one), for holders of ``token`` (default:
    ``token_from_env()``).  ``endpoint`` is what readers pass to ``fetch``.  Whole files go over
    its HTTP bulk path on ``host:bytes_port`` (0: a free one; None: none, Flight carries them —
    for a firewall that opens one port)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        host: str,
        port: int = 0,
        token: str | None = None,
        *,
        also: Sequence[str | os.PathLike[str]] = (),
        chunk: int = CHUNK,
        any_address: bool = False,
        bytes_port: int | None = 0,
    ):
        self.roots = [Path(r).absolute() for r in (root, *also)]
        self.host = host
        bind = _check_host(host, any_address)
        token = token or token_from_env()
        roots = self.roots
        self._bytes: BytesServer | None = None
        if bytes_port is not None:
            self._bytes = BytesServer(
                bind, token, lambda location, index: open_in_roots(roots, location, index), bytes_port
            )
        try:
            self._server = _Server(
                self.roots, f"grpc+tcp://{bind}:{port}", token, chunk, self._bytes.url if self._bytes else ""
            )
        except BaseException:
            if self._bytes is not None:
                self._bytes.close()
            raise
        self.port: int = self._server.port
        self.endpoint = f"grpc+tcp://{bind}:{self.port}"
        self.bytes_url = self._bytes.url if self._bytes else ""  # the HTTP bulk path ("" none)
        self._closed = False

    def __repr__(self) -> str:  # never the token
        return f"<StoreService {self.endpoint} roots={[str(r) for r in self.roots]}>"

    def serve(self) -> None:
        """Serve in the foreground until ``close`` from another thread or a signal (SIGTERM,
        SIGINT): the signal's Python handler runs, then the service closes."""
        try:
            self._server.serve()
        finally:
            self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._server.shutdown()
            if self._bytes is not None:
                self._bytes.close()

    def __enter__(self) -> StoreService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the client -----------------------------------------------------------------------------
_clients: dict[tuple[int, str], fl.FlightClient] = {}
_clients_lock = threading.Lock()


def _client(endpoint: str) -> fl.FlightClient:
    key = (os.getpid(), endpoint)  # gRPC channels do not survive a fork
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = fl.connect(endpoint, generic_options=KEEPALIVE)
        return client


def _drop_client(endpoint: str) -> None:
    with _clients_lock:
        client = _clients.pop((os.getpid(), endpoint), None)
    if client is not None:
        client.close()


def _message(exc: BaseException) -> str:
    return str(exc).split(". Detail:", 1)[0].split(". gRPC client debug context", 1)[0]


def _call(
    endpoint: str, token: str, location: str, index: int, kind: str, timeout: float, extra: dict[str, Any] | None = None
) -> fl.FlightStreamReader:
    ticket = fl.Ticket(json.dumps({"location": location, "index": index, "as": kind, **(extra or {})}).encode())
    options = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())], timeout=timeout)
    return _client(endpoint).do_get(ticket, options)


def _fetch(
    endpoint: str,
    token: str,
    location: str,
    index: int,
    kind: str,
    timeout: float,
    read: Any,
    extra: dict[str, Any] | None = None,
) -> Any:
    what = f"partition {index} at {location} from the store service {endpoint}"
    try:
        return read(_call(endpoint, token, location, index, kind, timeout, extra))
    except fl.FlightUnauthenticatedError:
        raise AuthRefusedError(f"{what}: the service refused the token") from None
    except (fl.FlightUnavailableError, fl.FlightTimedOutError, fl.FlightCancelledError) as exc:
        _drop_client(endpoint)
        raise ServiceUnreachableError(f"{what}: the service is unreachable ({_message(exc)})") from None
    except fl.FlightServerError as exc:
        if exc.extra_info == _NOT_FOUND:
            raise RemotePartitionNotFoundError(f"{what}: no such partition there") from None
        if exc.extra_info == _REFUSED:
            raise LocationRefusedError(f"{what}: {_message(exc)}") from None
        if exc.extra_info == _CORRUPT:
            raise ChecksumError(f"{what}: {_message(exc)}") from None
        raise RemoteStoreError(f"{what}: {_message(exc)}") from None
    except (fl.FlightError, pa.ArrowException, OSError) as exc:
        if isinstance(exc, RemoteStoreError):
            raise
        _drop_client(endpoint)
        raise RemoteStoreError(f"{what}: {type(exc).__name__}: {_message(exc)}") from None


class _Ranges:
    """One file's bytes arriving over several streams into one buffer (made by the first)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.out: pa.Buffer | None = None

    def read(self, reader: fl.FlightStreamReader) -> None:
        meta = reader.schema.metadata
        size, at, end = int(meta[b"size"]), int(meta[b"offset"]), int(meta[b"offset"]) + int(meta[b"length"])
        with self.lock:
            if self.out is None:
                self.out = pa.allocate_buffer(size)
            out = self.out
        if out.size != size or end > size:
            raise RemoteStoreError(f"the streams disagree on the size ({out.size} vs {size} bytes)")
        view = memoryview(out)
        while True:
            try:
                piece = reader.read_chunk().data.column(0)[0].as_buffer()
            except StopIteration:
                break
            if at + piece.size > end:
                raise RemoteStoreError(f"the service sent more than the {end} bytes it announced")
            view[at : at + piece.size] = memoryview(piece)
            at += piece.size
        if at != end:
            raise RemoteStoreError(f"a stream ended at byte {at} of its range ending at {end}")


def _read_bytes(reader: fl.FlightStreamReader) -> pa.Buffer:
    size = int(reader.schema.metadata[b"size"])
    out: pa.Buffer | None = None
    at = 0
    while True:
        try:
            batch = reader.read_chunk().data
        except StopIteration:
            break
        piece = batch.column(0)[0].as_buffer()  # no copy: the value inside the received batch
        if at + piece.size > size:
            raise RemoteStoreError(f"the service sent more than the {size} bytes it announced")
        if out is None and piece.size == size:
            out = piece  # the whole file in one message: already one buffer, no copy
        else:
            if out is None:
                out = pa.allocate_buffer(size)
            memoryview(out)[at : at + piece.size] = memoryview(piece)
        at += piece.size
    if at != size:
        raise RemoteStoreError(f"the stream ended after {at} of {size} bytes")
    return out if out is not None else pa.py_buffer(b"")


def _action(endpoint: str, token: str | None, kind: str, request: dict[str, Any], timeout: float, what: str) -> str:
    options = fl.FlightCallOptions(
        headers=[(b"authorization", f"Bearer {token or token_from_env()}".encode())], timeout=timeout
    )
    try:
        results = list(_client(endpoint).do_action(fl.Action(kind, json.dumps(request).encode()), options))
    except fl.FlightUnauthenticatedError:
        raise AuthRefusedError(f"{what}: the service refused the token") from None
    except fl.FlightServerError as exc:
        if exc.extra_info == _NOT_FOUND:
            raise RemotePartitionNotFoundError(f"{what}: not there") from None
        if exc.extra_info == _REFUSED:
            raise LocationRefusedError(f"{what}: {_message(exc)}") from None
        raise RemoteStoreError(f"{what}: {_message(exc)}") from None
    except (fl.FlightError, OSError) as exc:
        _drop_client(endpoint)
        raise ServiceUnreachableError(f"{what}: the service is unreachable ({_message(exc)})") from None
    return results[0].body.to_pybytes().decode() if results else ""


def ping(endpoint: str, token: str | None = None, timeout: float = 5.0) -> str:
    """The serving host's name if the service at ``endpoint`` answers within ``timeout``;
    ``ServiceUnreachableError`` (or ``AuthRefusedError``) otherwise."""
    return _action(endpoint, token, "ping", {}, timeout, f"the store service {endpoint}")


def remote_checksum(
    endpoint: str, token: str | None, location: str, index: int, timeout: float = DEFAULT_TIMEOUT
) -> str:
    """The checksum of partition ``index`` at ``location``, computed by the service of the
    host that holds it (what a resume checks without moving the bytes)."""
    what = f"partition {index} at {location} on the store service {endpoint}"
    return _action(endpoint, token, "checksum", {"location": location, "index": index}, timeout, what)


def remote_remove(endpoint: str, token: str | None, location: str, timeout: float = 30.0) -> None:
    """Remove ``location`` (a dataset version or a session directory) on the service's host."""
    _action(endpoint, token, "remove", {"location": location}, timeout, f"removing {location} on {endpoint}")


def fetch(
    endpoint: str, token: str, location: str, index: int, timeout: float = DEFAULT_TIMEOUT, streams: int = 1
) -> pa.Buffer:
    """Partition ``index`` at ``location`` (as the metadata records it), exactly the bytes of
    its file on the service's host, as one buffer: check it with ``tiers.checksum_buffer``,
    open it with ``ipc.open_file(pa.BufferReader(buf))`` (zero-copy).  The bytes travel over
    the service's HTTP bulk path (``http_bytes``: at raw TCP's cost) where it has one, over
    Flight otherwise.  ``timeout``: seconds for the whole call; ``streams``: connections
    filling the buffer side by side.  Raises a ``RemoteStoreError`` naming the endpoint,
    location and index: ``ServiceUnreachableError``, ``RemotePartitionNotFoundError``,
    ``AuthRefusedError``, ``LocationRefusedError``."""
    return _fetch_bytes(endpoint, token, location, index, timeout, streams, hashed=False)[0]


def fetch_hashed(
    endpoint: str, token: str, location: str, index: int, timeout: float = DEFAULT_TIMEOUT, streams: int = 1
) -> tuple[pa.Buffer, str]:
    """``fetch``, and the bytes' checksum (``tiers.checksum_buffer``'s xxh3-64), computed as
    they arrive over the bulk path (``http_bytes.get_hashed``: each piece hashed while it is
    in cache) — what a reader compares with the metadata's instead of hashing the buffer again."""
    buf, digest = _fetch_bytes(endpoint, token, location, index, timeout, streams, hashed=True)
    return buf, digest if digest is not None else checksum_buffer(buf)


def _fetch_bytes(
    endpoint: str, token: str, location: str, index: int, timeout: float, streams: int, hashed: bool
) -> tuple[pa.Buffer, str | None]:
    what = f"partition {index} at {location} from the store service {endpoint}"

    def over(url: str) -> tuple[pa.Buffer, str | None]:
        if hashed:
            return http_bytes.get_hashed(url, token, location, index, timeout, streams, service=endpoint)
        return http_bytes.get(url, token, location, index, timeout, streams, service=endpoint), None

    known = (os.getpid(), endpoint) in _bytes_urls
    url = bytes_url(endpoint, token, timeout, what)
    if url:
        try:
            return over(url)
        except ServiceUnreachableError:
            if not known:
                raise
            # The endpoint (address:port) may now be a newer service's — a host's service
            # restarted on a port the last one had: the bulk path remembered was its
            # predecessor's.  Ask again once; a service that is gone fails the asking.
            _bytes_urls.pop((os.getpid(), endpoint), None)
            fresh = bytes_url(endpoint, token, timeout, what)
            if fresh == url:
                raise
            url = fresh
        if url:
            return over(url)
    return fetch_flight(endpoint, token, location, index, timeout, streams), None


def fetch_chunks(
    endpoint: str, token: str, location: str, index: int, chunk: int, timeout: float = DEFAULT_TIMEOUT
) -> Iterator[pa.Buffer]:
    """``fetch``, ``chunk`` bytes at a time (a crossing streams a partition through one chunk
    of memory): over the HTTP bulk path, ``timeout`` per chunk; a service without one sends
    the whole file over Flight as one chunk."""
    what = f"partition {index} at {location} from the store service {endpoint}"
    url = bytes_url(endpoint, token, timeout, what)
    if url:
        yield from http_bytes.stream(url, token, location, index, chunk, timeout, service=endpoint)
    else:
        yield fetch_flight(endpoint, token, location, index, timeout)


_bytes_urls: dict[tuple[int, str], str] = {}


def bytes_url(endpoint: str, token: str, timeout: float = DEFAULT_TIMEOUT, what: str = "") -> str:
    """The HTTP bulk path of the service at ``endpoint`` ("" for a service without one), asked
    once per process and endpoint.  Errors name ``what`` (the partition wanted) if given."""
    key = (os.getpid(), endpoint)
    url = _bytes_urls.get(key)
    if url is None:
        try:
            said = _action(endpoint, token, "describe", {}, timeout, what or f"the store service {endpoint}")
            url = str(json.loads(said)["bytes"])
        except LocationRefusedError:  # a service from before the bulk path: "unknown action"
            url = ""
        except (ValueError, KeyError, TypeError):
            raise RemoteStoreError(f"the store service {endpoint} described itself in an unreadable way") from None
        _bytes_urls[key] = url
    return url


def fetch_flight(
    endpoint: str, token: str, location: str, index: int, timeout: float = DEFAULT_TIMEOUT, streams: int = 1
) -> pa.Buffer:
    """``fetch`` over Flight only: the file's bytes as a stream of ``binary`` record batches
    (for services without the bulk path, and for bench/store_remote.py's comparison)."""
    if streams <= 1:
        buf: pa.Buffer = _fetch(endpoint, token, location, index, "bytes", timeout, _read_bytes)
        return buf
    ranges = _Ranges()
    with ThreadPoolExecutor(streams, thread_name_prefix="phalanx-fetch") as pool:
        done = [
            pool.submit(_fetch, endpoint, token, location, index, "bytes", timeout, ranges.read, {"part": [j, streams]})
            for j in range(streams)
        ]
        for d in done:
            d.result()
    assert ranges.out is not None
    return ranges.out


def fetch_hash_part(
    endpoint: str,
    token: str,
    location: str,
    index: int,
    checksum: str,
    keys: Sequence[str],
    nparts: int,
    part: int,
    columns: Sequence[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> pa.Table:
    """The rows of partition ``index`` whose ``keys`` hash to ``part`` of ``nparts`` (the same
    hash as a shuffle), split by the service that holds it — which checks the file against
    ``checksum`` first (``ChecksumError`` naming it otherwise).  Only those rows cross the
    network; the service splits once for all ``nparts`` readers."""
    extra = {
        "by": list(keys),
        "nparts": nparts,
        "part": part,
        "checksum": checksum,
        "columns": None if columns is None else list(columns),
    }
    table: pa.Table = _fetch(endpoint, token, location, index, "hash", timeout, lambda r: r.read_all(), extra)
    return table


def fetch_rows(
    endpoint: str,
    token: str,
    location: str,
    index: int,
    checksum: str,
    select: dict[str, Any],
    columns: Sequence[str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> pa.Table:
    """The rows of partition ``index`` that ``repartition.select_rows(select)`` picks (a
    slice, a random share's rows), selected by the service that holds it after it checked the
    file against ``checksum``: only those rows cross the network."""
    extra = {"select": select, "checksum": checksum, "columns": None if columns is None else list(columns)}
    table: pa.Table = _fetch(endpoint, token, location, index, "rows", timeout, lambda r: r.read_all(), extra)
    return table


def fetch_table(endpoint: str, token: str, location: str, index: int, timeout: float = DEFAULT_TIMEOUT) -> pa.Table:
    """The partition as a table, streamed as its record batches (no checksum: for a reader
    that trusts the service; ``fetch`` is the verifiable way)."""
    table: pa.Table = _fetch(endpoint, token, location, index, "table", timeout, lambda r: r.read_all())
    return table


# ---- python -m phalanx.store.service --------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m phalanx.store.service",
        description=f"Serve a store root's partitions over Arrow Flight until SIGTERM/SIGINT. The token comes from {ENV_TOKEN_FILE} (a 0600 file) or {ENV_TOKEN}, never the command line.",
    )
    p.add_argument("--root", required=True, help="the file tier's root (e.g. /dev/shm/phalanx-$USER/store)")
    p.add_argument("--also", action="append", default=[], help="another root to serve (the spill directory)")
    p.add_argument(
        "--host",
        required=True,
        help="the address to bind: the host's cluster address, 127.0.0.1, or auto (what this host's name resolves to)",
    )
    p.add_argument("--port", type=int, default=0, help="the Flight port (default: a free one)")
    p.add_argument(
        "--bytes-port", type=int, default=0, help="the port of the HTTP bulk path for whole files (default: a free one)"
    )
    p.add_argument(
        "--flight-only", action="store_true", help="no bulk path: whole files over Flight too (one port to open)"
    )
    p.add_argument("--endpoint-file", help="write the endpoint here (atomically) once serving")
    p.add_argument(
        "--key",
        help=f"publish the endpoint as ROOT/{SERVICES_DIR}/KEY.json for the ranks of this host "
        "(PHALANX_STORE_SERVICE_KEY=KEY); removed on exit",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    record: Path | None = None
    try:
        also = args.also or ([os.environ[ENV_SPILL]] if os.environ.get(ENV_SPILL) else [])
        bytes_port = None if args.flight_only else args.bytes_port
        svc = StoreService(args.root, resolve_host(args.host), args.port, also=also, bytes_port=bytes_port)
        if args.key:
            record = publish_endpoint(args.root, args.key, svc.endpoint)
    except (ValueError, OSError, fl.FlightError) as exc:
        print(f"phalanx store service: {exc}", file=sys.stderr)
        return 1

    stopping = threading.Event()

    def stop(signum: int, frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stopping.set()

    # The server answers from its own threads since it was made; this thread only waits for a
    # signal (not in serve(): a signal that came before serve() began would never end it).
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if args.endpoint_file:
        tmp = f"{args.endpoint_file}.{os.getpid()}.tmp"
        Path(tmp).write_text(svc.endpoint + "\n")
        os.replace(tmp, args.endpoint_file)
    bulk = f", whole files on {svc.bytes_url}" if svc.bytes_url else ""
    log.info("serving %s on %s%s (pid %d)", ", ".join(map(str, svc.roots)), svc.endpoint, bulk, os.getpid())
    print(svc.endpoint, flush=True)
    try:
        while not stopping.wait(1.0):
            pass
        svc.close()
    finally:
        if record is not None:
            record.unlink(missing_ok=True)
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
