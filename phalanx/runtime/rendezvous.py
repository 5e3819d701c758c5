"""Rendezvous: how the ranks of a gang find each other before the communicator exists.

A rendezvous is named by a URL.  The driver *prepares* a concrete URL for one gang (a free
port, a fresh file, a key prefix) and passes it to every rank; each rank *connects* and gets
a ``torch.distributed.Store`` that Gloo uses to wire itself up — or, for communicators that do
not use torch (``tcp``, ``shm``), just ``share``s one small value per rank (its listening
address) with every other rank.

- ``tcp`` (default)            rank 0 hosts a TCPStore on a port the driver picked: no server.
- ``file`` / ``file:///dir``   a FileStore on a (shared) filesystem: no server, no ports.
- ``redis://host:port/db``     a Redis server the site runs (keys prefixed per gang).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast
from urllib.parse import parse_qs, urlencode, urlparse

from .._registry import Registry
from ..errors import PhalanxError
from ..private import makedirs
from ..redact import redact

if TYPE_CHECKING:
    from torch.distributed import Store


class Rendezvous(ABC):
    scheme: str

    @classmethod
    @abstractmethod
    def prepare(cls, spec: str, gang_id: str, workdir: Path) -> str:
        """Driver side: turn a site's spec into the concrete URL for one gang."""

    @classmethod
    @abstractmethod
    def connect(cls, url: str, rank: int, world_size: int, timeout_s: float) -> Store:
        """Rank side: the store every rank of the gang shares."""

    @classmethod
    @abstractmethod
    def share(cls, url: str, rank: int, world_size: int, value: bytes, timeout_s: float, authkey: bytes) -> list[bytes]:
        """Rank side, without torch: every rank gives one small value, every rank gets all of
        them in rank order (collective).  Values are public (addresses): whoever can read the
        rendezvous may see them, and what connects on them must authenticate (``authkey``)."""

    @classmethod
    def cleanup(cls, url: str) -> None:
        """Driver side, after the gang ended: remove what ``prepare`` left behind."""


def _timeout(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def reserve_port(host: str) -> socket.socket | None:
    """A socket bound (not listening) to a free port of ``host``, with SO_REUSEADDR: while it
    stays open the kernel gives that port to no other ``bind(0)`` nor outgoing connection (a
    concurrent gang's Gloo listeners took a port between ``free_port`` and rank 0's bind), yet
    rank 0 may still bind it with SO_REUSEADDR and listen.  None where ``host`` is not local."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
    except OSError:
        sock.close()
        return None
    return sock


def _tcp_address(url: str) -> tuple[str, int]:
    """The host and port of a ``tcp://host:port`` rendezvous URL (as ``prepare`` writes it)."""
    u = urlparse(url)
    if u.hostname is None or u.port is None:
        raise PhalanxError(f"rendezvous {url!r}: a tcp rendezvous is tcp://host:port")
    return u.hostname, u.port


class TCPRendezvous(Rendezvous):
    scheme = "tcp"
    _reserved: dict[str, socket.socket] = {}  # url -> the port's reservation, closed by cleanup

    @classmethod
    def prepare(cls, spec: str, gang_id: str, workdir: Path) -> str:
        u = urlparse(spec if "://" in spec else "tcp://")
        host = u.hostname or "127.0.0.1"
        if u.port:
            return f"tcp://{host}:{u.port}"
        sock = reserve_port(host)
        if sock is None:  # not an address of this machine: free_port says why
            return f"tcp://{host}:{free_port(host)}"
        url = f"tcp://{host}:{sock.getsockname()[1]}"
        cls._reserved[url] = sock
        return url

    @classmethod
    def cleanup(cls, url: str) -> None:
        sock = cls._reserved.pop(url, None)
        if sock is not None:
            sock.close()

    @classmethod
    def connect(cls, url: str, rank: int, world_size: int, timeout_s: float) -> Store:
        from torch.distributed import TCPStore

        host, port = _tcp_address(url)
        if rank != 0:
            return TCPStore(
                host, port, world_size, is_master=False, timeout=_timeout(timeout_s), wait_for_workers=False
            )
        # TCPStore alone listens on every interface: bind the socket to the URL's host
        # (loopback for a gang on one machine) and hand it over.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world_size))
        # detach: the store's server owns the descriptor from now on (Python must not close it)
        return TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=_timeout(timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.detach(),
            use_libuv=False,
        )

    @classmethod
    def share(cls, url: str, rank: int, world_size: int, value: bytes, timeout_s: float, authkey: bytes) -> list[bytes]:
        """Rank 0 listens on the URL's port; every other rank connects (authenticated both
        ways), sends its value and receives the table; then the port is closed."""
        from .netio import accept_peers, connect_peer, recv_frame, send_frame

        host, port = _tcp_address(url)
        deadline = time.monotonic() + timeout_s
        what = f"rendezvous {url}"
        if rank != 0:
            sock = connect_peer((host, port), rank, 0, authkey, deadline, what)
            with sock:
                send_frame(sock, value)
                return [recv_frame(sock) for _ in range(world_size)]
        received = {0: value}
        conns: dict[int, socket.socket] = {}
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
            listener.listen(max(128, world_size))
            conns = accept_peers(listener, f"{host}:{port}", world_size - 1, 0, world_size, authkey, deadline, what)
            for peer, sock in conns.items():
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                received[peer] = recv_frame(sock)
            # accept_peers returned world_size - 1 distinct ranks, each in 1..world_size-1: all of them
            values = [received[r] for r in range(world_size)]
            for sock in conns.values():
                for v in values:
                    send_frame(sock, v)
        finally:
            listener.close()
            for sock in conns.values():
                sock.close()
        return values


class FileRendezvous(Rendezvous):
    scheme = "file"

    @classmethod
    def prepare(cls, spec: str, gang_id: str, workdir: Path) -> str:
        path = urlparse(spec).path if "://" in spec else ""
        directory = makedirs(Path(path) if path else workdir)
        return f"file://{directory / f'rdzv-{gang_id}'}"

    @classmethod
    def connect(cls, url: str, rank: int, world_size: int, timeout_s: float) -> Store:
        from torch.distributed import FileStore

        store = FileStore(urlparse(url).path, world_size)
        store.set_timeout(_timeout(timeout_s))
        return store

    @classmethod
    def share(cls, url: str, rank: int, world_size: int, value: bytes, timeout_s: float, authkey: bytes) -> list[bytes]:
        """Each rank writes ``<file>.<rank>`` (0600, whole: written aside, then renamed) and
        reads the others' once they exist."""
        base = urlparse(url).path
        tmp = f"{base}.{rank}.{uuid.uuid4().hex[:8]}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, f"{base}.{rank}")

        def read(r: int) -> bytes | None:
            try:
                with open(f"{base}.{r}", "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return _poll_all(read, world_size, timeout_s, f"rendezvous {url}")

    @classmethod
    def cleanup(cls, url: str) -> None:
        path = Path(urlparse(url).path)
        path.unlink(missing_ok=True)
        for shared in path.parent.glob(path.name + ".*"):
            shared.unlink(missing_ok=True)


class RedisRendezvous(Rendezvous):
    scheme = "redis"

    @classmethod
    def prepare(cls, spec: str, gang_id: str, workdir: Path) -> str:
        u = urlparse(spec)
        query = parse_qs(u.query)
        query["prefix"] = [f"{query.get('prefix', ['phalanx'])[0]}:{gang_id}:"]
        return u._replace(query=urlencode(query, doseq=True)).geturl()

    @classmethod
    def connect(cls, url: str, rank: int, world_size: int, timeout_s: float) -> Store:
        from .redis_store import RedisStore

        return RedisStore(url, timeout_s=timeout_s)

    @classmethod
    def share(cls, url: str, rank: int, world_size: int, value: bytes, timeout_s: float, authkey: bytes) -> list[bytes]:
        from .redis_keys import client_and_prefix

        client, prefix = client_and_prefix(url)
        key = prefix + "share/{}"
        client.set(key.format(rank), value)
        return _poll_all(lambda r: client.get(key.format(r)), world_size, timeout_s, f"rendezvous {redact(url)}")

    @classmethod
    def cleanup(cls, url: str) -> None:
        from .redis_keys import delete_prefix

        delete_prefix(url)


def _poll_all(read: Callable[[int], bytes | None], world_size: int, timeout_s: float, what: str) -> list[bytes]:
    """``read(r)`` for every rank, retried (1 ms, backing off to 50 ms) until each gave a value."""
    deadline = time.monotonic() + timeout_s
    values: dict[int, bytes] = {}
    pause = 0.001
    while True:
        for r in range(world_size):
            if r not in values:
                value = read(r)
                if value is not None:
                    values[r] = value
        missing = [r for r in range(world_size) if r not in values]
        if not missing:
            return [values[r] for r in range(world_size)]
        if time.monotonic() > deadline:
            raise PhalanxError(f"{what}: rank(s) {missing} did not arrive within {timeout_s:.0f}s")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


rendezvous_backends = Registry("rendezvous", group="phalanx.rendezvous")
for _cls in (TCPRendezvous, FileRendezvous, RedisRendezvous):
    rendezvous_backends.register(
        _cls.scheme, f"{__name__}:{_cls.__name__}", extra="redis" if _cls is RedisRendezvous else None
    )


def backend_for(spec: str) -> type[Rendezvous]:
    scheme = spec.split("://", 1)[0] if "://" in spec else spec
    if scheme not in rendezvous_backends.names():
        raise PhalanxError(
            f"unknown rendezvous {spec!r}: use 'tcp', 'file', 'file:///shared/dir' or 'redis://host:port/db'"
        )
    # the registry holds any kind of target; this one's are Rendezvous classes
    return cast("type[Rendezvous]", rendezvous_backends.load(scheme))


def gang_authkey(what: str) -> bytes:
    """The gang's secret (set by the driver for every rank): it authenticates rank-to-rank sockets."""
    from . import protocol as P

    key = os.environ.get(P.ENV_AUTHKEY)
    if not key:
        raise PhalanxError(
            f"{what}: {P.ENV_AUTHKEY} is not set (ranks are started by a phalanx executor, which sets it)"
        )
    return bytes.fromhex(key)


def share(url: str, rank: int, world_size: int, value: bytes, timeout_s: float) -> list[bytes]:
    """Every rank's ``value`` to every rank, through the gang's rendezvous and without torch."""
    return backend_for(url).share(url, rank, world_size, value, timeout_s, gang_authkey("rendezvous"))


def new_gang_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
