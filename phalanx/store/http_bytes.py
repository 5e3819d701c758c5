"""The store service's bulk path: a partition file's exact bytes over plain HTTP/1.1.

Arrow Flight carries the store service's control plane and every row-shaped answer (a slice,
one reader's rows by key); a whole file's bytes go over HTTP/1.1 on a second port of the same
service.  Why: gRPC's receive path (HTTP/2 frames into its own slice buffers, reassembled, then
copied into one buffer) costs a reader ~0.8 s of CPU per GB against ~0.27 s for a socket read,
which held a Flight fetch to 55-60% of raw TCP between two test-bed hosts whatever the message
size or number of streams (bench/store_remote.py; docs/store.md, "Across hosts").  Here the
holder's kernel sends the file (``os.sendfile``: nothing in Python touches the bytes) and
the reader receives it straight into one preallocated buffer (``recv_into``: the one copy any
socket read makes) — what raw TCP does, inside a standard protocol.

Same rules as the Flight calls: the same bearer token on every request (compared with
``hmac.compare_digest``, never logged), the same bind address, files opened only through the
service's own ``open_fd`` (inside its roots, no symbolic link, this user's).  Byte ranges use
the standard ``Range`` header (RFC 9110) so several streams can fill one buffer.
"""

from __future__ import annotations

import errno
import hmac
import http.client
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, urlsplit

import pyarrow as pa
import xxhash

from ..errors import (
    AuthRefusedError,
    LocationRefusedError,
    RemotePartitionNotFoundError,
    RemoteStoreError,
    ServiceUnreachableError,
    UnsafePathError,
)

log = logging.getLogger("phalanx.store.service")

CONNECT_TIMEOUT = 5.0  # a host that does not answer a connection: fail fast, as the Flight calls do
STALL_TIMEOUT = 15.0  # no byte for this long mid-transfer: the holder is gone (host down, cut)
SERVE_TIMEOUT = 60.0  # the holder frees a request's thread whose reader stopped reading

OpenFd = Callable[[str, int], int]  # (location, index) -> a read-only fd; FileNotFoundError, UnsafePathError


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection serves a reader's requests
    # The headers and the file go out in two sends: with Nagle's algorithm a small file (or the
    # tail of one) waits for the reader's delayed ACK of the headers, ~40 ms on a kept connection.
    disable_nagle_algorithm = True
    server_version = "phalanx-store"
    timeout = SERVE_TIMEOUT
    server: _HTTPServer

    def log_message(self, format: str, *args: object) -> None:
        log.debug("bytes %s: " + format, self.client_address[0], *args)

    def _refuse(self, status: int, why: str) -> None:
        body = why.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        got = self.headers.get_all("Authorization") or []
        if len(got) != 1 or not hmac.compare_digest(got[0].encode(), self.server.expected):
            return self._refuse(401, "store service: missing or wrong token")
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        try:
            if url.path != "/part":
                raise ValueError(url.path)
            location, index = query["location"][0], int(query["index"][0])
        except (KeyError, IndexError, ValueError):
            return self._refuse(400, "bad request: expected GET /part?location=...&index=N")
        try:
            fd = self.server.open_fd(location, index)
        except FileNotFoundError:
            return self._refuse(404, f"no partition {index} at {location}")
        except UnsafePathError as exc:
            log.warning("store service: refused %s: %s", location, exc)
            return self._refuse(403, f"refusing to serve {location}: {exc}")
        with os.fdopen(fd, "rb") as file:
            size = os.fstat(fd).st_size
            wanted = _byte_range(self.headers.get("Range"), size)
            if wanted is None:
                return self._refuse(416, f"bad or unsatisfiable Range {self.headers.get('Range')!r} for {size} bytes")
            lo, hi = wanted
            self.send_response(206 if self.headers.get("Range") else 200)
            self.send_header("Content-Length", str(hi - lo))
            self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{size}" if hi > lo else f"bytes */{size}")
            self.end_headers()
            if hi > lo:
                try:
                    _send_file(self.connection, file.fileno(), lo, hi - lo)
                except OSError as exc:  # the reader went away or stopped reading: its own error says so
                    log.debug("bytes %s: %s after part of %s", self.client_address[0], exc, location)
                    self.close_connection = True


def _send_file(conn: socket.socket, fd: int, at: int, count: int) -> None:
    """``count`` bytes of the file ``fd`` from offset ``at`` down ``conn``, by the kernel
    (``sendfile``: nothing in Python touches them), the call blocking until they are sent as
    a raw sender's does — bounded by ``SO_SNDTIMEO``: a reader that stops reading for
    ``SERVE_TIMEOUT`` fails it (``TimeoutError``) and frees this thread."""
    conn.settimeout(None)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(SERVE_TIMEOUT))
    try:
        while count:
            try:
                sent = os.sendfile(conn.fileno(), fd, at, count)
            except BlockingIOError:  # SO_SNDTIMEO ran out with nothing sent
                raise TimeoutError(f"the reader took nothing for {SERVE_TIMEOUT:.0f} s") from None
            if not sent:
                raise OSError(errno.EIO, "the file ended early (shrunk while being sent?)")
            at, count = at + sent, count - sent
    finally:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(0))
        conn.settimeout(SERVE_TIMEOUT)


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``[lo, hi)`` of a ``Range: bytes=a-b`` header (one range; the whole file without one)."""
    if header is None:
        return 0, size
    if size == 0:
        return 0, 0  # an empty file: any range of it is empty
    unit, _, spec = header.partition("=")
    first, dash, last = spec.partition("-")
    if unit.strip() != "bytes" or not dash or not first.strip().isdigit():
        return None
    if last.strip() and not last.strip().isdigit():
        return None
    lo = int(first)
    hi = min(size, int(last) + 1) if last.strip() else size
    return (lo, hi) if lo < hi else None


class _HTTPServer(ThreadingHTTPServer):
    """Keeps the connections it serves, so that closing the server ends them too: a reader
    keeps its connections open between requests (HTTP/1.1 keep-alive), and one must not be
    served by a closed service's thread."""

    daemon_threads = True
    expected: bytes
    open_fd: OpenFd

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.live: set[socket.socket] = set()
        self.live_lock = threading.Lock()

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        with self.live_lock:
            self.live.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        with self.live_lock:
            self.live.discard(request)
        super().shutdown_request(request)

    def end_connections(self) -> None:
        with self.live_lock:
            live, self.live = self.live, set()
        for conn in live:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # its thread reads end-of-file and ends; the reader sees it closed
            except OSError:
                pass


class BytesServer:
    """An HTTP/1.1 server of partition files on ``host:port`` (0: a free one), for holders of ``token``;
    ``url`` is what ``get`` takes.  Serves from its own thread until ``close``."""

    def __init__(self, host: str, token: str, open_fd: OpenFd, port: int = 0):
        bind = host.strip("[]")
        server_class = (
            type("_Server6", (_HTTPServer,), {"address_family": socket.AF_INET6}) if ":" in bind else _HTTPServer
        )
        self._httpd = server_class((bind, port), _Handler)
        self._httpd.expected = f"Bearer {token}".encode()
        self._httpd.open_fd = open_fd
        self.port: int = self._httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="phalanx-store-bytes", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._httpd.end_connections()


# ---- the client -----------------------------------------------------------------------------
PIECE = 1 << 20  # bytes per receive when hashing: hashed right after, while the kernel's copy is in cache
KEEP = 4  # idle connections kept per service (per process): a reused one has its TCP window grown
_kept: dict[tuple[int, str], list[_Connection]] = {}
_kept_lock = threading.Lock()


def get(
    url: str, token: str, location: str, index: int, timeout: float, streams: int = 1, service: str = ""
) -> pa.Buffer:
    """Partition ``index`` at ``location`` from the bytes server at ``url``: exactly its file's
    bytes in one buffer, over ``streams`` connections (byte ranges) filling it side by side.
    ``timeout``: seconds for the whole fetch.  Errors name the service (``service``: as the
    metadata records it, e.g. its Flight endpoint), location and index."""
    return _get(url, token, location, index, timeout, streams, service, hashed=False)[0]


def get_hashed(
    url: str, token: str, location: str, index: int, timeout: float, streams: int = 1, service: str = ""
) -> tuple[pa.Buffer, str]:
    """``get``, and the xxh3-64 of the bytes (``tiers.checksum_buffer``'s digest), computed as
    they arrive: each piece is hashed right after the socket read that wrote it, while it is
    still in the CPU's cache, so the check costs a fraction of a second pass over the buffer
    (over several streams, whose ranges a digest cannot join, it is that second pass)."""
    buf, digest = _get(url, token, location, index, timeout, streams, service, hashed=True)
    return buf, digest if digest is not None else xxhash.xxh3_64_hexdigest(memoryview(buf))


def _get(
    url: str, token: str, location: str, index: int, timeout: float, streams: int, service: str, hashed: bool
) -> tuple[pa.Buffer, str | None]:
    what = f"partition {index} at {location} from the store service {service or url}"
    deadline = time.monotonic() + timeout
    if streams <= 1:
        with _request(url, token, what, deadline, location, index, None) as (conn, length):
            out = pa.allocate_buffer(length)
            hasher = xxhash.xxh3_64() if hashed else None
            conn.fill(memoryview(out), 0, length, hasher)
            return out, hasher.hexdigest() if hasher is not None else None
    with _request(url, token, what, deadline, location, index, (0, 0)) as (conn, length):
        head = pa.allocate_buffer(length)  # its first byte, to learn the file's size
        conn.fill(memoryview(head), 0, length)
        size = conn.size
    if size <= 1:
        return head, None
    out = pa.allocate_buffer(size)
    bounds = [(j * size // streams, (j + 1) * size // streams) for j in range(streams)]

    def fill(lo: int, hi: int) -> None:
        with _request(url, token, what, deadline, location, index, (lo, hi - 1)) as (conn, length):
            conn.fill(memoryview(out)[lo : lo + length], 0, length)

    with ThreadPoolExecutor(streams, thread_name_prefix="phalanx-fetch") as pool:
        for done in [pool.submit(fill, lo, hi) for lo, hi in bounds if hi > lo]:
            done.result()
    return out, None


def stream(
    url: str, token: str, location: str, index: int, chunk: int, timeout: float, service: str = ""
) -> Iterator[pa.Buffer]:
    """Partition ``index`` at ``location`` from the bytes server at ``url``, ``chunk`` bytes at
    a time off one response (each a new buffer: a consumer may keep it while it uploads).
    ``timeout``: seconds for each chunk, so a long stream to a slow consumer never times out
    while data flows."""
    what = f"partition {index} at {location} from the store service {service or url}"
    with _request(url, token, what, time.monotonic() + timeout, location, index, None) as (conn, length):
        got = 0
        while got < length:
            conn.deadline = time.monotonic() + timeout
            out = pa.allocate_buffer(min(chunk, length - got))
            conn.fill(memoryview(out), got, length)
            got += out.size
            yield out


@contextmanager
def _request(
    url: str, token: str, what: str, deadline: float, location: str, index: int, span: tuple[int, int] | None
) -> Iterator[tuple[_Connection, int]]:
    """A connection to ``url`` with the reply to a GET of the file (``span``: an inclusive byte
    range) begun: (connection, bytes in the reply).  A connection this process kept from an
    earlier fetch is used first; one its service closed meanwhile (idle, restarted) is
    replaced by a new one once.  A connection whose reply was read to its end is kept for the
    next fetch, any other closed."""
    key = (os.getpid(), url)
    with _kept_lock:
        conn = _kept.get(key, []).pop() if _kept.get(key) else None
    length = -1
    if conn is not None:
        conn.reset(token, what, deadline)
        try:
            length = conn.start(location, index, span)
        except _Stale:
            conn.close()
            conn = None
        except BaseException:
            conn.close()
            raise
    if conn is None:
        conn = _Connection(url, token, what, deadline)
        try:
            conn.connect()
            length = conn.start(location, index, span)
        except BaseException:
            conn.close()
            raise
    try:
        yield conn, length
    except BaseException:
        conn.close()
        raise
    if not conn.done():
        conn.close()
        return
    with _kept_lock:
        idle = _kept.setdefault(key, [])
        if len(idle) < KEEP:
            idle.append(conn)
            return
    conn.close()


class _Stale(ServiceUnreachableError):
    """A kept connection its service closed before answering (idle too long, or restarted)."""


class _Connection:
    def __init__(self, url: str, token: str, what: str, deadline: float):
        split = urlsplit(url)
        if split.scheme != "http" or not split.hostname or not split.port:
            raise RemoteStoreError(f"{what}: not an http://HOST:PORT address")
        self.what, self.deadline, self.size, self.left = what, deadline, -1, 0
        self.reused = False
        self.resp: http.client.HTTPResponse | None = None
        self.headers = {"Authorization": f"Bearer {token}"}
        self.conn = http.client.HTTPConnection(split.hostname, split.port, timeout=self._left(CONNECT_TIMEOUT))

    def _left(self, most: float) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ServiceUnreachableError(f"{self.what}: timed out")
        return min(most, left)

    def connect(self) -> None:
        try:
            self.conn.connect()
        except OSError as exc:
            raise ServiceUnreachableError(f"{self.what}: the service is unreachable ({exc})") from None
        assert self.conn.sock is not None
        self.sock: socket.socket = self.conn.sock

    def reset(self, token: str, what: str, deadline: float) -> None:
        """Ready a kept connection for another request."""
        self.what, self.deadline, self.size, self.reused = what, deadline, -1, True
        self.headers = {"Authorization": f"Bearer {token}"}

    def close(self) -> None:
        if self.resp is not None:
            self.resp.close()
        self.conn.close()

    def done(self) -> bool:
        """The reply was read to its end on a connection that stays open: it can serve another."""
        return self.left == 0 and self.resp is not None and self.resp.isclosed() and self.conn.sock is not None

    def start(self, location: str, index: int, span: tuple[int, int] | None = None) -> int:
        """Ask for the file's bytes (``span``: inclusive byte range); how many the reply has."""
        headers = dict(self.headers)
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[1]}"
        with self._errors(stale=self.reused):
            self.sock.settimeout(self._left(STALL_TIMEOUT))
            self.conn.request("GET", f"/part?location={quote(location, safe='')}&index={index}", headers=headers)
            self.resp = resp = self.conn.getresponse()
        with self._errors():
            if resp.status not in (200, 206):
                raise _refusal(resp.status, resp.read(4096).decode(errors="replace"), self.what)
            length = int(resp.getheader("Content-Length") or -1)
            self.size, at = _total(resp.getheader("Content-Range"), length), 0 if span is None else span[0]
            if length < 0 or self.size < 0 or at + length > self.size:
                raise RemoteStoreError(f"{self.what}: a reply without a usable length")
            self.left = length
            if length == 0:
                resp.close()
            return length

    def fill(self, view: memoryview, done: int, length: int, hasher: xxhash.xxh3_64 | None = None) -> None:
        """The reply's next ``len(view)`` bytes into ``view`` (``done`` of ``length`` read before),
        fed to ``hasher`` as they land.  What the HTTP client read ahead with the headers is
        copied first; the rest goes from the socket straight into ``view`` (``PIECE`` bytes at
        most per read when hashing; without, as much as has arrived: fewer reads and wake-ups),
        the socket blocking in the kernel (as a raw socket's reader does) for at most the stall
        timeout (``SO_RCVTIMEO``) or what is left of the fetch's."""
        view = view.cast("B")
        got = 0
        with self._errors():
            assert self.resp is not None
            if view and self.resp.fp is not None:
                ahead = len(self.resp.fp.peek())  # bytes read with the headers (one read when none)
                if ahead:
                    got = self.resp.readinto(view[: min(ahead, len(view))])
                    if hasher is not None:
                        hasher.update(view[:got])
            sock, timeo, most = self.sock, -1.0, PIECE if hasher is not None else len(view)
            sock.settimeout(None)
            try:
                while got < len(view):
                    wait = self._left(STALL_TIMEOUT)
                    if wait != timeo:  # the stall timeout, or less near the fetch's deadline
                        timeo = wait
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(wait))
                    n = sock.recv_into(view[got : got + most])
                    if not n:
                        # the holder closed the connection: its service (or its host) went away
                        raise ServiceUnreachableError(
                            f"{self.what}: the service closed the connection after {done + got} of {length} bytes"
                        )
                    if hasher is not None:
                        hasher.update(view[got : got + n])
                    got += n
            finally:
                self.left -= got
                if self.left == 0 and self.resp.fp is not None:
                    self.resp.close()  # its file object only: the connection stays open for the next request
                if timeo >= 0:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0))

    @contextmanager
    def _errors(self, stale: bool = False) -> Iterator[None]:
        """A failed call as a ``ServiceUnreachableError`` naming what was asked for (``stale``: a
        closed connection is a ``_Stale`` one, to be replaced)."""
        try:
            yield
        except RemoteStoreError:
            raise
        except (TimeoutError, BlockingIOError) as exc:  # BlockingIOError: SO_RCVTIMEO ran out
            raise ServiceUnreachableError(f"{self.what}: no data for {STALL_TIMEOUT:.0f} s ({exc})") from None
        except (http.client.HTTPException, ConnectionError) as exc:
            kind = _Stale if stale else ServiceUnreachableError
            raise kind(f"{self.what}: the connection failed ({type(exc).__name__}: {exc})") from None
        except OSError as exc:
            raise ServiceUnreachableError(f"{self.what}: {type(exc).__name__}: {exc}") from None


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def _total(content_range: str | None, length: int) -> int:
    if content_range is None:
        return length
    try:
        return int(content_range.rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return -1


def _refusal(status: int, why: str, what: str) -> RemoteStoreError:
    if status == 401:
        return AuthRefusedError(f"{what}: the service refused the token")
    if status == 404:
        return RemotePartitionNotFoundError(f"{what}: no such partition there")
    if status == 403:
        return LocationRefusedError(f"{what}: {why}")
    return RemoteStoreError(f"{what}: HTTP {status}: {why}")
