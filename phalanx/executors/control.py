"""The driver's end of the control plane: one authenticated connection per rank.

Reader threads turn every message (and every lost connection) into an event on one queue,
so the gang's driver loop waits in a single place and notices a dead rank at once; but a
rank's resource samples (``protocol.Sample``), which no driver loop waits for, go to
``samples`` (the latest per rank) and to the ``on_sample`` callback instead.  A
heartbeat thread tells every rank several times a timeout that the driver still lives: a rank
whose connection ends, or that hears nothing for ``PHALANX_DRIVER_TIMEOUT`` seconds, exits
(``runtime.worker.DriverWatch``) — also where no parent-death signal reaches it (srun, Ray).
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from ..runtime import protocol as P
from ..runtime.netio import Handshakes


class ControlServer:
    def __init__(
        self,
        world_size: int,
        host: str = "127.0.0.1",
        driver_timeout: float | None = None,
        on_sample: Callable[[P.Sample], None] | None = None,
    ):
        """``host``: the address ranks connect to (loopback unless ranks run on other
        machines; ``auto``: this host's address as its own name resolves).  ``driver_timeout``:
        seconds of silence after which ranks take the driver for gone (default
        ``PHALANX_DRIVER_TIMEOUT`` of the driver's environment, else 60).  ``on_sample``:
        called (in a reader thread) with every resource sample a rank sends."""
        if host == "auto":
            host = socket.gethostbyname(socket.getfqdn())
        self.world_size = world_size
        self.authkey = secrets.token_bytes(16)
        self.listener = socket.create_server((host, 0), backlog=128)
        # each rank (and anything else that connects) authenticates in a thread of its own,
        # for a few seconds at most: a connection that says nothing holds up no rank
        self._handshakes = Handshakes(self.listener, self._shake, self._refused, name="phalanx-control-handshake")
        self.events: queue.Queue[tuple[int, P.ToDriver]] = queue.Queue()
        self.conns: dict[int, Connection] = {}
        self.samples: dict[int, P.Sample] = {}  # the latest resource sample of each rank
        self.on_sample = on_sample
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
        host, port = self.listener.getsockname()[:2]
        return f"{host}:{port}"

    def rank_env(self) -> dict[str, str]:
        return {
            P.ENV_CONTROL: self.address,
            P.ENV_AUTHKEY: self.authkey.hex(),
            P.ENV_DRIVER_TIMEOUT: f"{self.driver_timeout:g}",
        }

    def _shake(self, sock: socket.socket, addr: tuple[Any, ...]) -> tuple[Connection, P.Hello]:
        """multiprocessing's mutual challenge (as ``Listener.accept`` does it), then the
        rank's Hello; on a duplicate of the socket's descriptor, so that ``Handshakes`` can
        cut it short by shutting the socket down."""
        conn = Connection(os.dup(sock.fileno()))
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            hello: P.Hello = P.recv(conn)
            if not isinstance(hello, P.Hello) or not 0 <= hello.rank < self.world_size:
                raise ValueError(f"not a rank of this gang: {hello!r:.80}")
        except BaseException:
            conn.close()
            raise
        sock.close()  # the connection holds its own descriptor
        return conn, hello

    @staticmethod
    def _refused(addr: tuple[Any, ...], why: str) -> str:
        return f"the driver refused a connection to its control port from {addr[0]}:{addr[1]}: {why}"

    def _accept(self) -> None:
        while not self._closed:
            got = self._handshakes.next()
            if got is None:  # closed
                return
            conn, hello = got
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
            if isinstance(msg, P.Sample):
                self._sampled(msg)
                continue
            final = getattr(msg, "sample", None)  # a task's final sample, with its Result or Failed
            if final is not None:
                self._sampled(final)
            self.events.put((rank, msg))

    def _sampled(self, sample: P.Sample) -> None:
        self.samples[sample.rank] = sample
        sink = self.on_sample
        if sink is None:
            return
        try:
            sink(sample)
        except Exception:  # a sink's failure must not end this rank's reader
            import logging

            logging.getLogger(__name__).warning("a resource sample's sink failed", exc_info=True)

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
        self._handshakes.close()
        for conn in self.conns.values():
            try:
                conn.close()
            except OSError:
                pass
        try:
            self.listener.close()
        except OSError:
            pass
