"""Prometheus metrics of runs, stages and ranks, read from the run DB when scraped.

Nothing is counted while a run goes on: a scrape reads the run DB (SQLite in WAL mode, whose
readers never hold up the driver writing it) and turns what it holds into metric families —
the runs by state, each recent run's stages, attempts, rows and bytes, and each rank's newest
resource sample.  So any process that can read the run DB serves the same numbers: the
dashboard (``phalanx ui``, at ``/metrics``), or ``phalanx metrics`` beside a headless driver.

Cardinality is bounded: per-run series exist only for the ``runs`` newest runs (20 by default)
and the runs still running (at most ``MAX_RUNNING``); the per-rank ones only for each stage's
latest attempt.  A run that leaves the window stops being exported; ``phalanx_runs`` still
counts it.  The metric names are in docs/observe.md.

Needs ``prometheus_client`` (the ``ui`` extra), imported when a registry is made.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator
from typing import Any

from ..extras import require
from ..orchestrator.rundb import RunDB
from .serving import LOOPBACK, AsgiServer

RUNS = 20  # the newest runs exported (and every running one)
MAX_RUNNING = 200  # running runs exported at most (the newest), whatever ``runs`` is
DEFAULT_PORT = 9465
# Per-rank resource samples (run DB table ``samples``): column → (metric, help, type, scale)
SAMPLE_METRICS = {
    "cpu": (
        "phalanx_rank_cpu_ratio",
        "CPU the rank's process used at its newest sample (1.0: one core busy)",
        "gauge",
        0.01,
    ),
    "rss": ("phalanx_rank_rss_bytes", "Resident memory of the rank's process", "gauge", 1),
    "peak_rss": ("phalanx_rank_peak_rss_bytes", "Peak resident memory of the rank's process", "gauge", 1),
    "sent": ("phalanx_rank_sent_bytes", "Bytes the rank sent to other ranks", "counter", 1),
    "received": ("phalanx_rank_received_bytes", "Bytes the rank received from other ranks", "counter", 1),
    "comm_s": ("phalanx_rank_comm_seconds", "Seconds the rank spent in collectives (exchanges)", "counter", 1),
    "elapsed": ("phalanx_rank_elapsed_seconds", "Seconds since the rank's app started", "gauge", 1),
    "ts": ("phalanx_rank_sample_timestamp_seconds", "When the rank's newest sample was taken (Unix time)", "gauge", 1),
}
RUN = ["run", "workflow"]
STAGE = [*RUN, "stage"]


def _client() -> Any:
    return require("prometheus_client", "ui", "Prometheus metrics")


def make_registry(db: RunDB, runs: int = RUNS) -> Any:
    """A ``prometheus_client.CollectorRegistry`` whose only collector reads ``db`` at each
    scrape (no process or GC metrics of the serving process: they say nothing of runs)."""
    prom = _client()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(RunDBCollector(db, runs))
    return registry


def metrics_app(db: RunDB, runs: int = RUNS) -> Any:
    """An ASGI application answering scrapes with ``db``'s metrics (the dashboard mounts it
    at ``/metrics`` behind its own token)."""
    return _client().make_asgi_app(make_registry(db, runs))


class RunDBCollector:
    """A custom collector: every ``collect()`` (one per scrape) reads the run DB afresh."""

    def __init__(self, db: RunDB, runs: int = RUNS):
        if runs < 0:
            raise ValueError(f"runs must be 0 or more, got {runs}")
        self.db, self.runs = db, runs

    def collect(self) -> Iterator[Any]:
        core = require("prometheus_client.core", "ui", "Prometheus metrics")
        begun = time.perf_counter()
        running = self.db.runs(MAX_RUNNING, state="running")  # read first: a dead driver's run turns lost
        counts = self.db.run_counts()
        window = {r["id"]: r for r in self.db.runs(self.runs)}
        window.update((r["id"], r) for r in running)
        families = _Families(core)
        families.gauge("phalanx_runs", "Runs in the run DB by state (all of them)", ["state"])
        for state, n in sorted(counts.items()):
            families.add("phalanx_runs", [state], n)
        now = time.time()
        for run in window.values():
            _run_metrics(families, self.db, run, now)
        families.gauge("phalanx_scrape_duration_seconds", "Seconds this scrape took to read the run DB", [])
        families.add("phalanx_scrape_duration_seconds", [], time.perf_counter() - begun)
        yield from families.all()


class _Families:
    """Metric families by name, created on first use, in the order they were declared."""

    def __init__(self, core: Any):
        self.core = core
        self.by_name: dict[str, Any] = {}

    def gauge(self, name: str, doc: str, labels: list[str]) -> None:
        if name not in self.by_name:
            self.by_name[name] = self.core.GaugeMetricFamily(name, doc, labels=labels)

    def counter(self, name: str, doc: str, labels: list[str]) -> None:
        if name not in self.by_name:
            self.by_name[name] = self.core.CounterMetricFamily(name, doc, labels=labels)

    def add(self, name: str, labels: list[str], value: float) -> None:
        self.by_name[name].add_metric([str(v) for v in labels], value)

    def all(self) -> Iterator[Any]:
        yield from self.by_name.values()


def _run_metrics(f: _Families, db: RunDB, run: dict, now: float) -> None:
    """One run's series: the run itself, its stages and their ranks."""
    labels = [run["id"], run["workflow"]]
    f.gauge("phalanx_run_info", "1 per exported run; its site and state as labels", [*RUN, "site", "state"])
    f.add("phalanx_run_info", [*labels, run["site"] or "", run["state"]], 1)
    if run["started"]:
        f.gauge("phalanx_run_start_time_seconds", "When the run started (Unix time)", RUN)
        f.add("phalanx_run_start_time_seconds", labels, run["started"])
        f.gauge("phalanx_run_duration_seconds", "Seconds the run has taken (so far, while it runs)", RUN)
        f.add("phalanx_run_duration_seconds", labels, (run["ended"] or now) - run["started"])
    stages = db.stages(run["id"])
    by_state: dict[str, int] = {}
    for s in stages:
        by_state[s["state"]] = by_state.get(s["state"], 0) + 1
    f.gauge("phalanx_stages", "Stages of the run by state", [*RUN, "state"])
    for state, n in sorted(by_state.items()):
        f.add("phalanx_stages", [*labels, state], n)
    attempts: dict[str, list[dict]] = {}
    for a in db.attempts(run["id"]):
        attempts.setdefault(a["stage"], []).append(a)
    for s in stages:
        _stage_metrics(f, [*labels, s["stage"]], s, attempts.get(s["stage"], []), now)
    samples = getattr(db, "samples", None)  # a run DB of an older phalanx has none
    if samples is not None:
        _rank_metrics(f, labels, samples(run["id"], latest=True))


def _stage_metrics(f: _Families, labels: list[str], s: dict, attempts: list[dict], now: float) -> None:
    f.gauge("phalanx_stage_info", "1 per stage; its state and site as labels", [*STAGE, "state", "site"])
    f.add("phalanx_stage_info", [*labels, s["state"], s.get("site") or ""], 1)
    f.gauge("phalanx_stage_ranks", "Ranks of the stage's gang", STAGE)
    f.add("phalanx_stage_ranks", labels, s["ranks"] or 0)
    if s["started"]:
        f.gauge("phalanx_stage_duration_seconds", "Seconds the stage took, all attempts (so far, while it runs)", STAGE)
        f.add("phalanx_stage_duration_seconds", labels, (s["ended"] or now) - s["started"])
    f.counter("phalanx_stage_attempts", "Attempts the stage made", STAGE)
    f.add("phalanx_stage_attempts", labels, len(attempts))
    causes: dict[str, int] = {}
    for a in attempts:
        if a["state"] == "failed":
            causes[a.get("cause") or "unknown"] = causes.get(a.get("cause") or "unknown", 0) + 1
    f.counter(
        "phalanx_stage_failed_attempts",
        "Failed attempts of the stage by cause (oom, timeout, exit:N...)",
        [*STAGE, "cause"],
    )
    for cause, n in sorted(causes.items()):
        f.add("phalanx_stage_failed_attempts", [*labels, cause], n)
    for kind, key in (("output", "outputs"), ("input", "inputs")):
        f.gauge(f"phalanx_stage_{kind}_rows", f"Rows of each {kind} dataset of the stage (all ranks)", [*STAGE, kind])
        f.gauge(f"phalanx_stage_{kind}_bytes", f"Bytes of each {kind} dataset of the stage (all ranks)", [*STAGE, kind])
        for name, value in sorted((s.get(key) or {}).items()):
            rows, nbytes = (value["rows"], value["bytes"]) if isinstance(value, dict) else value
            f.add(f"phalanx_stage_{kind}_rows", [*labels, name], rows)
            f.add(f"phalanx_stage_{kind}_bytes", [*labels, name], nbytes)


def _rank_metrics(f: _Families, labels: list[str], samples: list[dict]) -> None:
    """Each rank's newest sample, of each stage's latest attempt that has samples."""
    latest: dict[str, int] = {}
    for s in samples:
        latest[s["stage"]] = max(latest.get(s["stage"], 0), s["attempt"])
    rank_labels = [*STAGE, "rank", "host"]
    for column, (name, doc, kind, scale) in SAMPLE_METRICS.items():
        (f.counter if kind == "counter" else f.gauge)(name, doc, rank_labels)
        for s in samples:
            if s["attempt"] == latest[s["stage"]] and s.get(column) is not None:
                f.add(name, [*labels, s["stage"], s["rank"], s.get("host") or ""], s[column] * scale)


# ---- serving /metrics on its own (``phalanx metrics``) ---------------------------------------
class MetricsServer(AsgiServer):
    """``/metrics`` of ``db`` on ``host:port`` (port 0: a free one), served by uvicorn.

    ``token``: the bearer token a scrape must present (``Authorization: Bearer``; Prometheus'
    ``authorization: {credentials_file: ...}``), compared in constant time.  Without one the
    server listens on loopback only.  The Host header must name this server where it listens
    on loopback (a web page's DNS rebinding reads nothing).  ``serve()`` runs until Ctrl-C;
    ``start()``/``stop()`` serve in a thread."""

    def __init__(
        self, db: RunDB, host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: str | None = None, runs: int = RUNS
    ):
        require("uvicorn", "ui", "phalanx metrics")
        if not token and host not in LOOPBACK:
            raise ValueError(
                f"phalanx metrics on {host} (not loopback) needs a bearer token: --token-file FILE "
                "(Prometheus then scrapes with authorization: {credentials_file: FILE})"
            )
        super().__init__(host, port, "phalanx metrics")
        self.app = ScrapeGate(metrics_app(db, runs), token, self.host_names() if self.loopback else None)

    @property
    def url(self) -> str:
        return f"{self.base}/metrics"

    def serve(self) -> None:
        self.serve_app(self.app)

    def start(self) -> MetricsServer:
        self.start_app(self.app, "phalanx-metrics")
        return self


class ScrapeGate:
    """ASGI middleware in front of the metrics app: ``/metrics`` only, the Host header among
    ``hosts`` (None: any), and the bearer token when there is one (401 otherwise)."""

    def __init__(self, app: Any, token: str | None, hosts: list[str] | None):
        self.app, self.token, self.hosts = app, token, hosts

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.hosts is not None and headers.get("host", "") not in self.hosts:
            await _answer(send, 400, b"unknown Host header\n")
        elif scope["path"] != "/metrics":
            await _answer(send, 404, b"phalanx metrics: scrape /metrics\n")
        elif self.token and not _bearer_ok(headers.get("authorization", ""), self.token):
            await _answer(send, 401, b"phalanx metrics: this endpoint needs its bearer token\n", bearer=True)
        else:
            await self.app(scope, receive, send)


def _bearer_ok(header: str, token: str) -> bool:
    kind, _, given = header.partition(" ")
    return kind.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def _answer(send: Any, status: int, body: bytes, bearer: bool = False) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8")] + ([(b"www-authenticate", b"Bearer")] if bearer else [])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
