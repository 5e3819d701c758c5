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
from typing import Any

from ..errors import PhalanxError
from .envvars import ENV_BIND_HOST, ENV_CONTROL

log = logging.getLogger(__name__)

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
    rank each comes from.  Handshakes run side by side (up to ``MAX_PENDING``), each bounded by
    ``HANDSHAKE_S``: a connection that fails one is closed with a warning and the wait goes on,
    so an intruder can neither fail the gang nor hold up the real peers."""
    key = mesh_key(authkey)
    # a handshake's outcome: the peer's rank and its socket, or why it was refused
    done: queue.Queue[tuple[int, socket.socket] | str] = queue.Queue()
    wake_r, wake_w = socket.socketpair()
    got: dict[int, socket.socket] = {}
    pending = 0

    def shake(sock: socket.socket, addr: tuple[Any, ...]) -> None:
        try:
            peer = _respond(sock, rank, world_size, key, address, min(deadline, time.monotonic() + HANDSHAKE_S), what)
            done.put((peer, sock))
        except Exception as exc:
            sock.close()
            done.put(f"rank {rank} refused a connection from {addr[0]}:{addr[1]}: {exc}")
        try:
            wake_w.send(b"x")
        except OSError:
            pass

    try:
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PhalanxError(
                    f"{what}: rank {rank} waited in vain for rank(s) "
                    f"{sorted(set(range(world_size)) - set(got) - {rank})} to connect"
                )
            ready, _, _ = select.select([listener, wake_r], [], [], left)
            if wake_r in ready:
                wake_r.recv(4096)
            while True:
                try:
                    outcome = done.get_nowait()
                except queue.Empty:
                    break
                pending -= 1
                if isinstance(outcome, str):
                    log.warning(outcome)
                    continue
                peer, sock = outcome
                if peer in got:
                    sock.close()
                    raise PhalanxError(f"{what}: rank {rank} got a second connection from rank {peer}")
                else:
                    sock.settimeout(None)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    got[peer] = sock
            if listener in ready and len(got) < count:
                listener.settimeout(0)
                try:
                    sock, addr = listener.accept()
                except (TimeoutError, BlockingIOError):
                    continue
                if pending >= MAX_PENDING:
                    sock.close()
                    log.warning(
                        "rank %d refused a connection from %s:%s: %d handshakes in progress",
                        rank,
                        addr[0],
                        addr[1],
                        pending,
                    )
                    continue
                pending += 1
                threading.Thread(target=shake, args=(sock, addr), daemon=True, name=f"phalanx-handshake-{rank}").start()
    except BaseException:
        for sock in got.values():
            sock.close()
        raise
    finally:
        wake_r.close()
        wake_w.close()
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
