"""Sockets between the ranks of a gang, without torch: authenticated connections and
length-prefixed frames (used by the torch-free rendezvous and the ``tcp`` communicator).

Every connection starts with a mutual handshake: both ends send a magic word, a fresh nonce and
their rank, then an HMAC-SHA256 (keyed with the gang's authkey, which only the driver and its
ranks hold) of the other end's nonce and their own rank.  A process that does not hold the key
— another user's, or a stale rank of another gang on a reused port — is refused by name, and a
rank never sends data to, or takes data from, a socket it has not authenticated.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import socket
import struct
import time

from ..errors import PhalanxError

MAGIC = b"PHXMESH1"
_HELLO = struct.Struct("<8s16sq")   # magic, nonce, rank
_PROOF_LEN = 32
_LEN = struct.Struct("<Q")


def _proof(authkey: bytes, nonce: bytes, rank: int) -> bytes:
    return hmac.new(authkey, b"phalanx-mesh" + nonce + struct.pack("<q", rank), hashlib.sha256).digest()


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


def handshake(sock: socket.socket, rank: int, authkey: bytes, deadline: float, what: str) -> int:
    """Authenticate both ends of a connected socket; returns the peer's rank."""
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    nonce = os.urandom(16)
    try:
        sock.sendall(_HELLO.pack(MAGIC, nonce, rank))
        magic, peer_nonce, peer = _HELLO.unpack(recv_exact(sock, _HELLO.size))
        if magic != MAGIC:
            raise PhalanxError(f"{what}: the other end is not a phalanx rank")
        sock.sendall(_proof(authkey, peer_nonce, rank))
        proof = recv_exact(sock, _PROOF_LEN)
    except (OSError, ConnectionError) as exc:
        raise PhalanxError(f"{what}: handshake failed: {exc}") from exc
    if not hmac.compare_digest(proof, _proof(authkey, nonce, peer)):
        raise PhalanxError(f"{what}: the peer claiming rank {peer} does not hold this gang's key "
                           "(another gang, or another user's process, on that address)")
    return peer


def connect_peer(address: tuple[str, int], rank: int, peer: int, authkey: bytes, deadline: float,
                 what: str) -> socket.socket:
    """A connected, authenticated socket to rank ``peer`` listening on ``address``; retried
    (backing off from 1 ms to 100 ms) while nothing listens there yet, until ``deadline``."""
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(address)
            break
        except OSError as exc:
            sock.close()
            if exc.errno not in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EAGAIN) \
                    or time.monotonic() + pause > deadline:
                raise PhalanxError(f"{what}: rank {rank} cannot reach rank {peer} at "
                                   f"{address[0]}:{address[1]}: {exc}") from exc
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
    try:
        got = handshake(sock, rank, authkey, deadline, what)
        if got != peer:
            raise PhalanxError(f"{what}: rank {rank} expected rank {peer} at {address[0]}:{address[1]}, "
                               f"found rank {got}")
    except BaseException:
        sock.close()
        raise
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def accept_peer(listener: socket.socket, rank: int, world_size: int, authkey: bytes, deadline: float,
                what: str) -> tuple[int, socket.socket]:
    """The next authenticated connection on ``listener`` and the rank it comes from."""
    listener.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        sock, _ = listener.accept()
    except socket.timeout:
        raise PhalanxError(f"{what}: rank {rank} waited in vain for its peers to connect") from None
    try:
        peer = handshake(sock, rank, authkey, deadline, what)
        if not 0 <= peer < world_size or peer == rank:
            raise PhalanxError(f"{what}: a connection claiming rank {peer} in a gang of {world_size}")
    except BaseException:
        sock.close()
        raise
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return peer, sock


def bind_host(rendezvous_url: str) -> str:
    """The address this rank listens on: ``PHALANX_BIND_HOST`` if set; loopback when the
    rendezvous is on loopback (a gang on one machine); else the address this host routes to
    the rendezvous host (``file://`` rendezvous: this host name's address)."""
    from urllib.parse import urlparse

    explicit = os.environ.get("PHALANX_BIND_HOST", "").strip()
    if explicit:
        return explicit
    target = urlparse(rendezvous_url).hostname if "://" in rendezvous_url else None
    if not target:
        if os.environ.get("PHALANX_HOST", "127.0.0.1") in ("127.0.0.1", "localhost"):
            return "127.0.0.1"
        return socket.gethostbyname(socket.gethostname())
    addr = socket.gethostbyname(target)
    if addr.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((addr, 9))  # no packet is sent: it only picks the route
        return probe.getsockname()[0]
