"""The driver's end of the control plane: one authenticated connection per rank.

Reader threads turn every message (and every lost connection) into an event on one queue,
so the gang's driver loop waits in a single place and notices a dead rank at once.  A
heartbeat thread tells every rank several times a timeout that the driver still lives: a rank
whose connection ends, or that hears nothing for ``PHALANX_DRIVER_TIMEOUT`` seconds, exits
(``runtime.worker.DriverWatch``) — also where no parent-death signal reaches it (srun, Ray).
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import threading
from multiprocessing.connection import Connection, Listener

from ..runtime import protocol as P


class ControlServer:
    def __init__(self, world_size: int, host: str = "127.0.0.1", driver_timeout: float | None = None):
        """``host``: the address ranks connect to (loopback unless ranks run on other
        machines; ``auto``: this host's address as its own name resolves).  ``driver_timeout``:
        seconds of silence after which ranks take the driver for gone (default
        ``PHALANX_DRIVER_TIMEOUT`` of the driver's environment, else 60)."""
        if host == "auto":
            import socket

            host = socket.gethostbyname(socket.getfqdn())
        self.world_size = world_size
        self.authkey = secrets.token_bytes(16)
        self.listener = Listener((host, 0), authkey=self.authkey)
        self.events: queue.Queue[tuple[int, P.ToDriver]] = queue.Queue()
        self.conns: dict[int, Connection] = {}
        self.driver_timeout = float(driver_timeout or os.environ.get(P.ENV_DRIVER_TIMEOUT) or P.DRIVER_TIMEOUT_S)
        # one writer at a time per connection: the gang's sends and the heartbeat thread's
        self._send_locks: dict[int, threading.Lock] = {}
        self._closed = False
        self._stop = threading.Event()
        self._accepter = threading.Thread(target=self._accept, name="phalanx-control", daemon=True)
        self._accepter.start()
        threading.Thread(target=self._heartbeat, name="phalanx-heartbeat", daemon=True).start()

    @property
    def address(self) -> str:
        host, port = self.listener.address
        return f"{host}:{port}"

    def rank_env(self) -> dict[str, str]:
        return {
            P.ENV_CONTROL: self.address,
            P.ENV_AUTHKEY: self.authkey.hex(),
            P.ENV_DRIVER_TIMEOUT: f"{self.driver_timeout:g}",
        }

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self.listener.accept()
                hello: P.Hello = P.recv(conn)
            except Exception:  # listener closed, or a peer failed the handshake
                if self._closed:
                    return
                continue
            rank = hello.rank
            self._send_locks[rank] = threading.Lock()
            self.conns[rank] = conn
            self.events.put((rank, hello))
            threading.Thread(
                target=self._read, args=(rank, conn), daemon=True, name=f"phalanx-control-rank{rank}"
            ).start()

    def _read(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                msg = P.recv(conn)
            except (EOFError, OSError):
                self.events.put((rank, P.Disconnected()))
                return
            except Exception as exc:  # a result that cannot be unpickled on the driver
                from ..errors import RankFailure

                failure = RankFailure(rank, type(exc).__name__, f"could not read the rank's message: {exc}")
                self.events.put((rank, P.Failed(None, failure)))
                continue
            self.events.put((rank, msg))

    def send(self, rank: int, msg: P.ToRank) -> None:
        with self._send_locks[rank]:
            P.send(self.conns[rank], msg)

    def _heartbeat(self) -> None:
        if hasattr(signal, "pthread_sigmask"):  # a rank that just left must not kill a driver
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})  # whose SIGPIPE is SIG_DFL
        while not self._stop.wait(P.heartbeat_s(self.driver_timeout)):
            for rank, conn in list(self.conns.items()):
                try:
                    with self._send_locks[rank]:
                        conn.send_bytes(P.HEARTBEAT)
                except (OSError, ValueError):  # the rank is gone: its reader reports it
                    pass

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass
        try:
            self.listener.close()
        except OSError:
            pass
