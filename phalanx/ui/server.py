"""Serving the dashboard: where it listens (loopback by default), its URL with the token, and
its web application (``app.make_app``) served until Ctrl-C or ``stop``."""

from __future__ import annotations

import secrets
from typing import Any

from ..observe.serving import AsgiServer
from ..orchestrator.rundb import RunDB
from .app import make_app


def new_token() -> str:
    return secrets.token_urlsafe(24)


class Dashboard(AsgiServer):
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
        super().__init__(host, port, "phalanx ui")
        self.token = token or new_token()
        extra = {"poll_s": poll_s} if poll_s else {}
        self.app = make_app(db, self.token, store=store, hosts=self.host_names(), **extra)

    @property
    def url(self) -> str:
        """The address to open: the token included (it becomes a cookie on the first visit)."""
        return f"{self.base}/?token={self.token}"

    def serve(self) -> None:
        self.serve_app(self.app)

    def start(self) -> Dashboard:
        self.start_app(self.app, "phalanx-ui")
        return self
