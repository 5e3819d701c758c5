"""One way to serve an ASGI app of phalanx's (the dashboard, ``/metrics``): uvicorn on a socket
bound here first — so the port is known (0: a free one) and a refused address is an error
naming it before anything starts — in the foreground until Ctrl-C, or in a thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from ..extras import require

LOOPBACK = ("127.0.0.1", "localhost", "::1")
GRACE_S = 2  # seconds open streams get to end when the server stops
WILDCARD = ("0.0.0.0", "::", "")  # never: a server of phalanx's listens where it is named


class AsgiServer:
    """Binds ``host:port`` at once; ``serve(app)`` or ``start(app)`` then serves ``app`` there.
    ``what``: the command, for its error messages (``phalanx ui``)."""

    def __init__(self, host: str, port: int, what: str):
        self._uvicorn = require("uvicorn", "ui", what)
        if host in WILDCARD:
            raise ValueError(
                f"{what}: --host {host or repr('')} would listen on every interface of this machine: name the "
                "address users reach it at (this host's address on the cluster network), or keep 127.0.0.1 "
                "and reach it through an SSH tunnel (ssh -L PORT:127.0.0.1:PORT HOST)"
            )
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(exc.errno, f"{what} cannot listen on {host}:{port}: {exc.strerror} (try --port 0)") from None
        self.sock.listen(128)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK

    def host_names(self) -> list[str]:
        """The Host header values that name this server (with and without its port)."""
        names = list(LOOPBACK) + ["[::1]"] if self.loopback else [self.host]
        return names + [f"{n}:{self.port}" for n in names]

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _server(self, app: Any) -> Any:
        config = self._uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            # Ctrl-C with a browser still following a run (a server-sent event stream never
            # ends by itself): those streams are cut after this long instead of awaited forever
            timeout_graceful_shutdown=GRACE_S,
        )
        self.server = self._uvicorn.Server(config)
        return self.server

    def serve_app(self, app: Any) -> None:
        """Serve ``app`` here until Ctrl-C (or ``stop`` from another thread)."""
        self._server(app).run(sockets=[self.sock])

    def start_app(self, app: Any, name: str) -> None:
        """Serve ``app`` in a daemon thread; returns once uvicorn accepts connections."""
        server = self._server(app)
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [self.sock]}, name=name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.sock.close()
