"""The driver's end of the control plane: one authenticated connection per rank.

Reader threads turn every message (and every lost connection) into an event on one queue,
so the gang's driver loop waits in a single place and notices a dead rank at once.
"""

from __future__ import annotations

import queue
import secrets
import threading
from multiprocessing.connection import Connection, Listener
from typing import Any

from ..runtime import protocol as P


class ControlServer:
    def __init__(self, world_size: int, host: str = "127.0.0.1"):
        """``host``: the address ranks connect to (loopback unless ranks run on other
        machines; ``auto``: this host's address as its own name resolves)."""
        if host == "auto":
            import socket

            host = socket.gethostbyname(socket.getfqdn())
        self.world_size = world_size
        self.authkey = secrets.token_bytes(16)
        self.listener = Listener((host, 0), authkey=self.authkey)
        self.events: "queue.Queue[tuple[int, tuple]]" = queue.Queue()
        self.conns: dict[int, Connection] = {}
        self._closed = False
        self._accepter = threading.Thread(target=self._accept, name="phalanx-control", daemon=True)
        self._accepter.start()

    @property
    def address(self) -> str:
        host, port = self.listener.address
        return f"{host}:{port}"

    def rank_env(self) -> dict[str, str]:
        return {P.ENV_CONTROL: self.address, P.ENV_AUTHKEY: self.authkey.hex()}

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
                hello = P.recv(conn)
            except Exception:  # listener closed, or a peer failed the handshake
                if self._closed:
                    return
                continue
            rank = hello[1]
            self.conns[rank] = conn
            self.events.put((rank, hello))
            threading.Thread(target=self._read, args=(rank, conn), daemon=True,
                             name=f"phalanx-control-rank{rank}").start()

    def _read(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                msg = P.recv(conn)
            except (EOFError, OSError):
                self.events.put((rank, ("eof",)))
                return
            except Exception as exc:  # a result that cannot be unpickled on the driver
                from ..errors import RankFailure

                self.events.put((rank, ("error", None, RankFailure(
                    rank, type(exc).__name__, f"could not read the rank's message: {exc}"))))
                continue
            self.events.put((rank, msg))

    def send(self, rank: int, *msg: Any) -> None:
        P.send(self.conns[rank], *msg)

    def close(self) -> None:
        self._closed = True
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass
        try:
            self.listener.close()
        except OSError:
            pass
