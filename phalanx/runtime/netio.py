"""Sockets between the ranks of a gang, without torch: authenticated connections and
length-prefixed frames (used by the torch-free rendezvous and the ``tcp`` communicator).

Every connection starts with a mutual handshake keyed with the gang's secret (derived from
``PHALANX_AUTHKEY``, which only the driver and its ranks hold):

1. both ends send a magic word, a fresh nonce and their rank;
2. the dialing end proves the key first: an HMAC-SHA256 over both nonces, both ranks, its role
   and the address it dialed (the listener's published ``host:port``);
3. only then does the listening end prove it, over the same transcript with its own role.

A listener never signs anything for an end that has not proved the key (no signing oracle),
and a proof is bound to one address, so a man in the middle who published its own address in
place of a rank's cannot relay one rank's proof to another.  A process that does not hold the
key — another user's, a stale rank of another gang on a reused port, a port scanner — is
refused with a warning; it cannot fail the gang, and each such connection holds a handshake
slot for at most ``HANDSHAKE_S``.  The frames after the handshake carry no MAC: the gang's
hosts and network are trusted not to alter TCP streams (as for Gloo and MPI).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..errors import PhalanxError
from .envvars import ENV_BIND_HOST, ENV_CONTROL

log = logging.getLogger(__name__)
T = TypeVar("T")

HANDSHAKE_S = 5.0  # the most an incoming connection may take to authenticate
MAX_PENDING = 64  # handshakes in progress at once on one listener
MAGIC = b"PHXMESH2"
_HELLO = struct.Struct("<8s16sq")  # magic, nonce, rank
_PROOF_LEN = 32
_LEN = struct.Struct("<Q")
_RETRY = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.EAGAIN,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ETIMEDOUT,
    errno.ECONNABORTED,
}


def mesh_key(authkey: bytes) -> bytes:
    """The key of rank-to-rank handshakes: derived, so the control plane's key is not used twice."""
    return hmac.new(authkey, b"phalanx mesh key v2", hashlib.sha256).digest()


def _proof(key: bytes, role: bytes, nonce_i: bytes, nonce_r: bytes, rank_i: int, rank_r: int, address: str) -> bytes:
    transcript = role + nonce_i + nonce_r + struct.pack("<qq", rank_i, rank_r) + address.encode()
    return hmac.new(key, transcript, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from a blocking socket (EOF before that is an error)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > limit:
        raise PhalanxError(f"a rendezvous frame of {n} bytes (at most {limit}): not a phalanx rank")
    return recv_exact(sock, n)


def _hello(sock: socket.socket, rank: int, what: str) -> tuple[bytes, bytes, int]:
    """Send our hello, read the peer's: (our nonce, its nonce, its rank)."""
    nonce = os.urandom(16)
    sock.sendall(_HELLO.pack(MAGIC, nonce, rank))
    magic, peer_nonce, peer = _HELLO.unpack(recv_exact(sock, _HELLO.size))
    if magic != MAGIC:
        raise PhalanxError(f"{what}: the other end is not a phalanx rank of this version")
    return nonce, peer_nonce, peer


def _initiate(sock: socket.socket, rank: int, peer: int, key: bytes, address: str, deadline: float, what: str) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        mine, theirs, got = _hello(sock, rank, what)
        if got != peer:
            raise PhalanxError(f"{what}: rank {rank} expected rank {peer} at {address}, found rank {got}")
        sock.sendall(_proof(key, b"I", mine, theirs, rank, peer, address))
        proof = recv_exact(sock, _PROOF_LEN)
    except (OSError, ConnectionError) as exc:
        raise PhalanxError(f"{what}: handshake with rank {peer} at {address} failed: {exc}") from exc
    if not hmac.compare_digest(proof, _proof(key, b"R", mine, theirs, rank, peer, address)):
        raise PhalanxError(
            f"{what}: the process at {address} claiming rank {peer} does not hold this "
            "gang's key (another gang, or another user's process, on that address)"
        )


def _respond(
    sock: socket.socket, rank: int, world_size: int, key: bytes, address: str, deadline: float, what: str
) -> int:
    """The listening end's handshake; returns the authenticated peer's rank."""
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        mine, theirs, peer = _hello(sock, rank, what)
        proof = recv_exact(sock, _PROOF_LEN)
        if not hmac.compare_digest(proof, _proof(key, b"I", theirs, mine, peer, rank, address)):
            raise PhalanxError(f"{what}: a connection claiming rank {peer} does not hold this gang's key")
        if not 0 <= peer < world_size or peer == rank:
            raise PhalanxError(f"{what}: a connection claiming rank {peer} in a gang of {world_size}")
        sock.sendall(_proof(key, b"R", theirs, mine, peer, rank, address))
    except (OSError, ConnectionError) as exc:
        raise PhalanxError(f"{what}: handshake failed: {exc}") from exc
    return peer


def connect_peer(
    address: tuple[str, int], rank: int, peer: int, authkey: bytes, deadline: float, what: str
) -> socket.socket:
    """A connected, authenticated socket to rank ``peer`` listening on ``address``; retried
    (backing off from 1 ms to 100 ms) while the name does not resolve yet or nothing listens
    there yet, until ``deadline``."""
    text = f"{address[0]}:{address[1]}"
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(address)
            break
        except OSError as exc:
            sock.close()
            retry = isinstance(exc, socket.gaierror) or exc.errno in _RETRY
            if not retry or time.monotonic() + pause > deadline:
                raise PhalanxError(f"{what}: rank {rank} cannot reach rank {peer} at {text}: {exc}") from exc
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
    try:
        _initiate(sock, rank, peer, mesh_key(authkey), text, deadline, what)
    except BaseException:
        sock.close()
        raise
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class Handshakes(Generic[T]):
    """Connections accepted on ``listener``, each authenticated by ``shake(sock, addr)`` in a
    thread of its own: up to ``MAX_PENDING`` side by side, each for at most ``HANDSHAKE_S``
    (then its socket is shut down, which ends any read or write of the handshake in progress).
    A connection whose handshake fails or runs out of time is refused with a warning
    (``refused(addr, why)``), so a peer that sends garbage, or connects and says nothing, can
    neither fail the listener's owner nor hold up the real peers.  The tcp communicator's mesh
    and the driver's control server both accept through this."""

    def __init__(
        self,
        listener: socket.socket,
        shake: Callable[[socket.socket, tuple[Any, ...]], T],
        refused: Callable[[tuple[Any, ...], str], str],
        name: str = "phalanx-handshake",
    ):
        self.listener, self.shake, self.refused, self.name = listener, shake, refused, name
        listener.settimeout(0)
        self._done: queue.Queue[T | str] = queue.Queue()  # an outcome: what shake returned, or a refusal
        self._wake_r, self._wake_w = socket.socketpair()
        self._pending: dict[socket.socket, float] = {}  # in handshake → when it must be over
        self._lock = threading.Lock()  # guards _pending: a handshake ends either done or expired
        self._closed = False
        self._waiting = False  # a thread is in next(): it closes the wake-up pair once closed

    def next(self, deadline: float | None = None) -> T | None:
        """The next authenticated connection (what ``shake`` returned); None once ``deadline``
        has passed or the listener was closed."""
        with self._lock:
            self._waiting = True
        try:
            return self._next(deadline)
        finally:
            with self._lock:
                self._waiting = False
                if self._closed:
                    self._close_wake()

    def _next(self, deadline: float | None) -> T | None:
        while not self._closed:
            try:
                outcome = self._done.get_nowait()
            except queue.Empty:
                pass
            else:
                if isinstance(outcome, str):
                    log.warning(outcome)
                    continue
                return outcome
            now = time.monotonic()
            self._expire(now)
            if deadline is not None and now >= deadline:
                return None
            with self._lock:
                wait = min(self._pending.values(), default=deadline if deadline is not None else now + 3600)
            if deadline is not None:
                wait = min(wait, deadline)
            # poll, not select: a driver may hold descriptors numbered over 1023
            poller = select.poll()
            try:
                poller.register(self.listener, select.POLLIN)
                poller.register(self._wake_r, select.POLLIN)
                ready = dict(poller.poll(max(wait - now, 0.0) * 1000))
            except (OSError, ValueError):  # the listener was closed under us
                return None
            if ready.get(self._wake_r.fileno()):
                self._wake_r.recv(4096)
            if ready.get(self.listener.fileno(), 0) & select.POLLNVAL:
                return None
            if ready.get(self.listener.fileno()):
                self._accept()
        return None

    def _accept(self) -> None:
        try:
            sock, addr = self.listener.accept()
        except (BlockingIOError, TimeoutError, ConnectionAbortedError):
            return
        except OSError:  # closed under us
            return
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                sock.close()
                log.warning(self.refused(addr, f"{len(self._pending)} handshakes in progress"))
                return
            self._pending[sock] = time.monotonic() + HANDSHAKE_S
        threading.Thread(target=self._shake, args=(sock, addr), daemon=True, name=self.name).start()

    def _shake(self, sock: socket.socket, addr: tuple[Any, ...]) -> None:
        try:
            outcome: T | str = self.shake(sock, addr)
            failed = False
        except Exception as exc:
            outcome, failed = self.refused(addr, str(exc)), True
        with self._lock:
            expired = self._pending.pop(sock, None) is None
        if expired and not failed:
            outcome = self.refused(addr, f"no handshake within {HANDSHAKE_S:g} s")
        # queued before the refused socket closes: the dialler sees the close only after its
        # refusal is in line, so a peer that connects next is never handled (and the wait
        # ended) before the intruder was refused and said so
        self._done.put(outcome)
        if expired or failed:
            sock.close()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _expire(self, now: float) -> None:
        """Shut down the sockets of handshakes past their time: their threads' reads end."""
        with self._lock:
            late = [s for s, until in self._pending.items() if until <= now or self._closed]
            for sock in late:
                del self._pending[sock]
        for sock in late:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """Stop accepting (the listener stays open: its owner closes it); handshakes in
        progress are cut short."""
        self._closed = True
        self._expire(time.monotonic())
        with self._lock:
            if not self._waiting:
                self._close_wake()
                return
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _close_wake(self) -> None:
        self._wake_r.close()
        self._wake_w.close()


def accept_peers(
    listener: socket.socket,
    address: str,
    count: int,
    rank: int,
    world_size: int,
    authkey: bytes,
    deadline: float,
    what: str,
) -> dict[int, socket.socket]:
    """``count`` authenticated connections on ``listener`` (published as ``address``), by the
    rank each comes from (``Handshakes``: side by side, each bounded by ``HANDSHAKE_S``; an
    intruder is refused with a warning and the wait goes on)."""
    key = mesh_key(authkey)

    def shake(sock: socket.socket, addr: tuple[Any, ...]) -> tuple[int, socket.socket]:
        peer = _respond(sock, rank, world_size, key, address, min(deadline, time.monotonic() + HANDSHAKE_S), what)
        return peer, sock

    def refused(addr: tuple[Any, ...], why: str) -> str:
        return f"rank {rank} refused a connection from {addr[0]}:{addr[1]}: {why}"

    got: dict[int, socket.socket] = {}
    handshakes = Handshakes(listener, shake, refused, name=f"phalanx-handshake-{rank}")
    try:
        while len(got) < count:
            outcome = handshakes.next(deadline)
            if outcome is None:
                raise PhalanxError(
                    f"{what}: rank {rank} waited in vain for rank(s) "
                    f"{sorted(set(range(world_size)) - set(got) - {rank})} to connect"
                )
            peer, sock = outcome
            if peer in got:
                sock.close()
                raise PhalanxError(f"{what}: rank {rank} got a second connection from rank {peer}")
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            got[peer] = sock
    except BaseException:
        for sock in got.values():
            sock.close()
        raise
    finally:
        handshakes.close()
    return got


def bind_host(rendezvous_url: str, deadline: float | None = None) -> str:
    """The address this rank listens on: ``PHALANX_BIND_HOST`` if set; else the address this
    host routes to the rendezvous host, or to the driver (``PHALANX_CONTROL``) when the
    rendezvous names no host (``file://``, MPI) — loopback when that host is loopback."""
    from urllib.parse import urlparse

    explicit = os.environ.get(ENV_BIND_HOST, "").strip()
    if explicit:
        return explicit
    target = urlparse(rendezvous_url).hostname if "://" in rendezvous_url else None
    if not target:
        target = os.environ.get(ENV_CONTROL, "").rpartition(":")[0] or "127.0.0.1"
    deadline = deadline if deadline is not None else time.monotonic() + 60
    pause = 0.01
    while True:  # a peer's name (a Kubernetes pod's) may resolve only once that pod runs
        try:
            addr = socket.gethostbyname(target)
            break
        except socket.gaierror as exc:
            if time.monotonic() + pause > deadline:
                raise PhalanxError(
                    f"cannot resolve {target!r} to choose the address to listen on: {exc} (set {ENV_BIND_HOST})"
                ) from exc
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
    if addr.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((addr, 9))  # no packet is sent: it only picks the route
        host: str = probe.getsockname()[0]  # (host, port) for AF_INET
        return host
