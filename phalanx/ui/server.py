"""Serving the dashboard: a socket bound where asked (loopback by default), its URL with the
token, and uvicorn until Ctrl-C or ``stop``."""

from __future__ import annotations

import secrets
import socket
import threading
from typing import Any

from ..extras import require
from ..orchestrator.rundb import RunDB
from .app import make_app


def new_token() -> str:
    return secrets.token_urlsafe(24)


class Dashboard:
    """The dashboard on ``host:port`` (port 0: a free one).  ``url`` has the token;
    ``serve()`` runs until stopped; ``start()`` serves in a thread (tests, notebooks)."""

    def __init__(
        self,
        db: RunDB,
        host: str = "127.0.0.1",
        port: int = 8765,
        token: str | None = None,
        store: Any = None,
        poll_s: float | None = None,
    ):
        uvicorn = require("uvicorn", "ui", "phalanx ui")
        self.token = token or new_token()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(
                exc.errno, f"phalanx ui cannot listen on {host}:{port}: {exc.strerror} (try --port 0)"
            ) from None
        self.sock.listen(128)
        self.host, self.port = host, self.sock.getsockname()[1]
        names = [host] if host not in ("127.0.0.1", "localhost", "::1") else ["127.0.0.1", "localhost", "::1"]
        extra = {"poll_s": poll_s} if poll_s else {}
        app = make_app(db, self.token, store=store, hosts=names + [f"{n}:{self.port}" for n in names], **extra)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The address to open: the token included (it becomes a cookie on the first visit)."""
        return f"{self.base}/?token={self.token}"

    def serve(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self) -> Dashboard:
        self._thread = threading.Thread(target=self.serve, name="phalanx-ui", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.sock.close()
