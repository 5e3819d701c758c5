"""``phalanx ui``: the dashboard's web application (Starlette, served by uvicorn).

Read-only over the run DB and the store: a run is never blocked by its viewers (the run DB is
SQLite in WAL mode, where readers never hold up the writer; every read runs in a worker thread,
so a slow one holds up no other request).  Live parts are server-sent events: a run's view is
pushed again whenever it changes, a rank's log line by line as it is written.

Security: bound to loopback unless told otherwise; every request needs the server's token —
given once in the URL ``phalanx ui`` prints (then kept in an HttpOnly, SameSite=Strict cookie
and dropped from the address bar) or as ``Authorization: Bearer`` (a Prometheus scrape of
``/metrics``); the Host header must name this server (no DNS rebinding); the page loads nothing
from elsewhere and runs no inline script (a strict Content-Security-Policy).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

from ..extras import require
from ..orchestrator.rundb import FINAL, RunDB
from . import data

STATIC = Path(__file__).parent / "static"
COOKIE = "phalanx_ui"
POLL_S = 1.0  # how often a live view looks at the run DB for changes
LOG_POLL_S = 0.5  # how often a streamed log looks for new lines
PING_S = 15.0  # a comment on an idle stream, so proxies and browsers keep it open
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def make_app(db: RunDB, token: str, store: Any = None, hosts: list[str] | None = None, poll_s: float = POLL_S):
    """The dashboard as an ASGI application.  ``token``: what every request must present;
    ``store``: a ``phalanx.store.Store`` whose datasets the store page lists (None: no store
    page); ``hosts``: the Host header values accepted (default: loopback names)."""
    require("starlette", "ui", "phalanx ui")
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def api_runs(request: Request) -> Response:
        return JSONResponse(await in_thread(data.runs, db))

    async def api_run(request: Request) -> Response:
        try:
            return JSONResponse(await in_thread(data.run, db, request.path_params["run_id"]))
        except data.UnknownRun as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)

    async def api_timeline(request: Request) -> Response:
        try:
            svg = await in_thread(data.timeline, db, request.path_params["run_id"])
        except data.UnknownRun as exc:
            return JSONResponse({"error": str(exc)}, status_code=404)
        return Response(svg, media_type="image/svg+xml")

    async def api_run_stream(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if await in_thread(db.run, run_id) is None:
            return JSONResponse({"error": f"no run {run_id!r} in {db.path}"}, status_code=404)

        async def views() -> AsyncIterator[str]:
            last, idle = None, 0.0
            while not await request.is_disconnected():
                view = await in_thread(data.run, db, run_id)
                text = json.dumps(view, default=str)
                if text != last:
                    last, idle = text, 0.0
                    yield f"event: run\ndata: {text}\n\n"
                    if view["run"]["final"]:
                        yield "event: end\ndata: {}\n\n"
                        return
                else:
                    idle += poll_s
                    if idle >= PING_S:
                        idle = 0.0
                        yield ": ping\n\n"
                await asyncio.sleep(poll_s)

        return _events(views())

    async def api_logs(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if await in_thread(db.run, run_id) is None:
            return JSONResponse({"error": f"no run {run_id!r} in {db.path}"}, status_code=404)
        q = request.query_params
        try:
            rank = int(q["rank"]) if q.get("rank") else None
            attempt = int(q["attempt"]) if q.get("attempt") else None
        except ValueError:
            return JSONResponse({"error": "rank and attempt are whole numbers"}, status_code=400)
        from ..orchestrator.logfollow import LogCursor

        cursor = LogCursor(db, run_id, stage=q.get("stage") or None, rank=rank, attempt=attempt)

        async def lines() -> AsyncIterator[str]:
            idle = 0.0
            while not await request.is_disconnected():
                batch = await in_thread(cursor.read)
                if batch:
                    idle = 0.0
                    yield _lines_event(batch)
                    continue  # more may be waiting: read again at once
                run = await in_thread(db.run, run_id)
                if run is None or run["state"] in FINAL:
                    while True:  # what the last writes left, last lines without their newline too
                        rest = await in_thread(cursor.read, True)
                        if rest:
                            yield _lines_event(rest)
                        if not cursor.behind:
                            break
                    yield "event: end\ndata: {}\n\n"
                    return
                idle += LOG_POLL_S
                if idle >= PING_S:
                    idle = 0.0
                    yield ": ping\n\n"
                await asyncio.sleep(LOG_POLL_S)

        return _events(lines())

    async def api_store(request: Request) -> Response:
        if store is None:
            return JSONResponse({"error": "this dashboard was started without a store"}, status_code=404)
        session = request.query_params.get("session") or None
        try:
            return JSONResponse(await in_thread(data.store_view, store, session))
        except Exception as exc:  # the metadata unreachable (Redis down): say so, the rest works
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=503)

    def _events(body: AsyncIterator[str]) -> Response:
        return StreamingResponse(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )

    routes = [
        Route("/", index),
        Route("/favicon.ico", lambda request: FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")),
        Route("/api/runs", api_runs),
        Route("/api/runs/{run_id}", api_run),
        Route("/api/runs/{run_id}/timeline.svg", api_timeline),
        Route("/api/runs/{run_id}/stream", api_run_stream),
        Route("/api/runs/{run_id}/logs", api_logs),
        Route("/api/store", api_store),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    metrics = _metrics_app(db)
    if metrics is not None:  # (an object: Starlette serves a function as a request handler)
        routes.append(Route("/metrics", _Asgi(metrics)))
    allowed = hosts or ["127.0.0.1", "localhost", "::1"]

    async def unreadable(request: Request, exc: Exception) -> Response:
        # the run DB busy, on a full disk, damaged: the page says so and tries again later
        return JSONResponse({"error": str(exc)}, status_code=503)

    app = Starlette(
        routes=routes,
        middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=allowed)],
        exception_handlers={sqlite3.Error: unreadable},  # RunDBError is one
    )
    return TokenGate(app, token)


def _lines_event(lines: list[Any]) -> str:
    """Log lines (``logfollow.LogLine``) as one server-sent event."""
    payload = [{"stage": x.stage, "attempt": x.attempt, "rank": x.rank, "text": x.text} for x in lines]
    return f"event: lines\ndata: {json.dumps(payload)}\n\n"


def _metrics_app(db: RunDB) -> Any:
    """``/metrics`` (Prometheus' text format) when the metrics module and its client are here."""
    try:
        from ..observe.metrics import metrics_app
    except ImportError:
        return None
    try:
        return metrics_app(db)
    except ImportError:
        return None


class _Asgi:
    """An ASGI application as an object."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


class TokenGate:
    """ASGI middleware: every request presents the token — ``?token=`` once (answered with a
    cookie and a redirect to the same address without it), then the cookie; or a bearer token.
    Compared in constant time; never logged."""

    def __init__(self, app: Any, token: str):
        if not token:
            raise ValueError("the dashboard needs a token")
        self.app, self.token = app, token

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        given = dict(query).get("token")
        if given is not None and self._ok(given):
            rest = urlencode([(k, v) for k, v in query if k != "token"])
            location = scope.get("root_path", "") + scope["path"] + (f"?{rest}" if rest else "")
            await _send(
                send,
                303,
                b"",
                [
                    (b"location", location.encode("latin-1")),
                    (b"set-cookie", f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/".encode("latin-1")),
                ],
            )
            return
        if self._ok(_cookie(scope, COOKIE)) or self._ok(_bearer(scope)):
            await self.app(scope, receive, _secured(send))
            return
        await _send(
            send,
            401,
            b"phalanx ui: this page needs the token in the address `phalanx ui` printed (http://HOST:PORT/?token=...)\n",
            [(b"content-type", b"text/plain; charset=utf-8"), (b"www-authenticate", b"Bearer")],
        )

    def _ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())


def _secured(send: Any) -> Any:
    """``send`` adding the security headers to every response."""

    async def wrapped(message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            headers += [
                (b"content-security-policy", _CSP.encode()),
                (b"x-content-type-options", b"nosniff"),
                (b"referrer-policy", b"no-referrer"),
            ]
            message = {**message, "headers": headers}
        await send(message)

    return wrapped


async def _send(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _cookie(scope: dict, name: str) -> str | None:
    for key, value in scope.get("headers", []):
        if key == b"cookie":
            for part in value.decode("latin-1").split(";"):
                k, _, v = part.strip().partition("=")
                if k == name:
                    return v
    return None


def _bearer(scope: dict) -> str | None:
    for key, value in scope.get("headers", []):
        if key == b"authorization":
            kind, _, cred = value.decode("latin-1").partition(" ")
            if kind.lower() == "bearer":
                return cred.strip()
    return None
