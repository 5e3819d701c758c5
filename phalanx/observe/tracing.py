"""OpenTelemetry spans of runs, stages, attempts, ranks and exchanges.

A run is one trace: ``run WORKFLOW`` > ``stage NAME`` > ``attempt N`` on the driver (opened
and closed by the scheduler as it records them in the run DB), then on every rank of that
attempt ``rank R`` > ``exchange``/``allgather`` (each with the rows and bytes it moved).  The
attempt's context reaches its ranks with the task that starts the stage's app there (W3C
``traceparent``); during the app it is also in the rank's environment as ``TRACEPARENT`` (and
``TRACESTATE``), and a command stage's program gets it there: code of the user's own can
continue the trace.

Off unless asked for, and then free: tracing is on in a process whose environment names a
span exporter — ``OTEL_TRACES_EXPORTER=otlp`` (its endpoint, headers and protocol from the
standard ``OTEL_EXPORTER_OTLP_*`` variables; ``http/protobuf`` unless the protocol says
``grpc``), ``console``, or any exporter installed under the SDK's entry points — and
``OTEL_SDK_DISABLED`` is not ``true``; or after ``enable(provider)`` (a program that made its
own ``TracerProvider``, tests with an in-memory exporter).  Ranks decide for themselves from
their own environment (inherited from the driver on this machine, SLURM and mpirun; a site
passes it to pods and actors).  When off, nothing imports ``opentelemetry``: an exchange
costs one function call that reads a module global.  The SDK comes with the ``otel`` extra;
where it is missing a process that asks for tracing says so once and runs without it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any

from ..extras import install_hint, installed
from ..redact import redact
from ..runtime.tasks import resolve_app

ENV_EXPORTER = "OTEL_TRACES_EXPORTER"
ENV_DISABLED = "OTEL_SDK_DISABLED"
CARRIED = {"traceparent": "TRACEPARENT", "tracestate": "TRACESTATE"}  # W3C field → environment variable
RANK_APP = "phalanx.observe.tracing:traced_app"  # what a traced attempt runs on its ranks
FLUSH_S = 5.0  # a rank waits at most this long for its spans to be exported when its app ends
BAD_STATES = ("failed", "cancelled", "lost")

log = logging.getLogger(__name__)
_decided = False
_tracer: Any = None  # the process's tracer while tracing is on, else None
_provider: Any = None
_owned = False  # _provider was made here, from the environment


def on() -> bool:
    """Whether this process traces (decided at the first call, from its environment)."""
    if not _decided:
        _decide()
    return _tracer is not None


def enable(provider: Any) -> None:
    """Trace with ``provider`` (an ``opentelemetry.sdk.trace.TracerProvider`` of the caller's,
    whatever the environment says) from now on."""
    global _decided, _tracer, _provider
    reset()
    _decided, _provider, _tracer = True, provider, provider.get_tracer("phalanx")


def reset() -> None:
    """Forget what ``enable``/``disable`` or the environment decided: the next ``on()`` looks
    at the environment again (a provider made from the environment is shut down: its spans sent)."""
    global _decided, _tracer, _provider, _owned
    if _owned and _provider is not None:
        _provider.shutdown()
    _decided, _tracer, _provider, _owned = False, None, None, False


def disable() -> None:
    """No spans from now on, whatever the environment says (until ``enable``)."""
    global _decided
    reset()
    _decided = True


def exporters_wanted(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The span exporters the environment names (empty: tracing off)."""
    if environ.get(ENV_DISABLED, "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in environ.get(ENV_EXPORTER, "").split(",") if n.strip()]
    return [n for n in names if n != "none"]


def _decide() -> None:
    global _decided, _tracer, _provider, _owned
    _decided = True
    names = exporters_wanted()
    if not names:
        return
    asked = f"{ENV_EXPORTER}={','.join(names)} asks for traces"
    if not installed("opentelemetry.sdk"):
        log.warning("%s, but opentelemetry-sdk is not installed here: %s; running without", asked, install_hint("otel"))
        return
    try:
        provider = _provider_from_env(names)
    except Exception as exc:  # a bad OTEL_* value: the run goes on untraced, and says why
        log.warning(
            "%s, but the exporters could not be set up (%s: %s); running without", asked, type(exc).__name__, exc
        )
        return
    if provider is not None:
        _provider, _tracer, _owned = provider, provider.get_tracer("phalanx"), True


def _provider_from_env(names: list[str]) -> Any:
    """A TracerProvider exporting to each named exporter through a batch processor (service
    name ``phalanx`` unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES give one)."""
    from importlib.metadata import entry_points

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "phalanx"}))
    found = {ep.name: ep for ep in entry_points(group="opentelemetry_traces_exporter")}
    added = 0
    for name in names:
        if name == "otlp":
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            name = "otlp_proto_grpc" if protocol.strip() == "grpc" else "otlp_proto_http"
        if name not in found:
            package = "opentelemetry-exporter-" + name.replace("_", "-") if name.startswith("otlp") else name
            log.warning(
                "span exporter %r is not installed here (pip install %s): its spans are not sent", name, package
            )
            continue
        try:
            exporter = found[name].load()()
        except ImportError as exc:  # the exporter's own dependency missing (grpcio...)
            log.warning("span exporter %r cannot be loaded (%s): its spans are not sent", name, exc)
            continue
        provider.add_span_processor(BatchSpanProcessor(exporter))
        added += 1
    return provider if added else None


def _ambient() -> Any:
    """The context a run's span continues: the span current in this thread (a traced program
    running the workflow), else this process's ``TRACEPARENT`` (a traced CI job), else none."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if trace.get_current_span().get_span_context().is_valid:
        return None  # the current context: start_span's default
    carrier = {field: os.environ[var] for field, var in CARRIED.items() if os.environ.get(var)}
    return TraceContextTextMapPropagator().extract(carrier) if carrier else None


# ---- the driver: run > stage > attempt ---------------------------------------------------------
class NoSpans:
    """A run's spans while tracing is off: every hook does nothing."""

    def start_run(self) -> None:
        pass

    def end_run(self, state: str, error: str | None = None) -> None:
        pass

    def start_stage(self, stage: str, ranks: int | None = None, site: str | None = None) -> None:
        pass

    def end_stage(self, stage: str, state: str, error: str | None = None) -> None:
        pass

    def start_attempt(self, stage: str, attempt: int) -> None:
        pass

    def end_attempt(self, stage: str, state: str, error: str | None = None, cause: str | None = None) -> None:
        pass

    def carrier(self, stage: str) -> dict[str, str]:
        """The attempt's context as environment variables for its ranks (none when off)."""
        return {}

    def rank_app(self, stage: str, app: str) -> tuple[str, tuple]:
        """What the ranks run for ``app`` and the arguments that go first: ``app`` itself when off."""
        return app, ()


class RunSpans(NoSpans):
    """The spans of one run while tracing is on; stage and attempt spans are keyed by stage
    (each stage runs one attempt at a time), opened and closed from the scheduler's threads."""

    def __init__(self, tracer: Any, run_id: str, workflow: str, site: str):
        self.tracer, self.run_id, self.workflow, self.site = tracer, run_id, workflow, site
        self._spans: dict[tuple[str, str], Any] = {}
        self._attempts: dict[str, int] = {}
        self._lock = threading.Lock()

    def _open(self, key: tuple[str, str], name: str, parent: Any, attributes: dict[str, Any]) -> None:
        span = self.tracer.start_span(name, context=parent, attributes={"phalanx.run_id": self.run_id, **attributes})
        with self._lock:
            self._spans[key] = span

    def _close(self, key: tuple[str, str], state: str, error: str | None = None, **attributes: Any) -> None:
        from opentelemetry.trace import Status, StatusCode

        with self._lock:
            span = self._spans.pop(key, None)
        if span is None:
            return
        span.set_attributes({"phalanx.state": state, **{k: v for k, v in attributes.items() if v is not None}})
        if state in BAD_STATES:
            span.set_status(Status(StatusCode.ERROR, redact(error or state)))
        span.end()

    def _context(self, *keys: tuple[str, str]) -> Any:
        """The context of the first of these spans that is open (a child's parent)."""
        from opentelemetry import trace

        with self._lock:
            span = next((self._spans[k] for k in keys if k in self._spans), None)
        return trace.set_span_in_context(span) if span is not None else None

    def start_run(self) -> None:
        attributes = {"phalanx.workflow": self.workflow, "phalanx.site": self.site}
        self._open(("run", ""), f"run {self.workflow}", _ambient(), attributes)

    def end_run(self, state: str, error: str | None = None) -> None:
        with self._lock:
            left = [k for k in self._spans if k[0] != "run"]
        for key in left:  # a stage a Ctrl-C left open
            self._close(key, state, error)
        self._close(("run", ""), state, error)

    def start_stage(self, stage: str, ranks: int | None = None, site: str | None = None) -> None:
        attributes = {"phalanx.stage": stage, "phalanx.ranks": ranks, "phalanx.site": site}
        self._open(("stage", stage), f"stage {stage}", self._context(("run", "")), _set(attributes))

    def end_stage(self, stage: str, state: str, error: str | None = None) -> None:
        self._close(("attempt", stage), state, error)  # one an exception left open
        self._close(("stage", stage), state, error, **{"phalanx.attempts": self._attempts.get(stage)})

    def start_attempt(self, stage: str, attempt: int) -> None:
        self._attempts[stage] = attempt
        parent = self._context(("stage", stage), ("run", ""))
        self._open(
            ("attempt", stage), f"attempt {attempt}", parent, {"phalanx.stage": stage, "phalanx.attempt": attempt}
        )

    def end_attempt(self, stage: str, state: str, error: str | None = None, cause: str | None = None) -> None:
        self._close(("attempt", stage), state, error, **{"phalanx.cause": cause})

    def carrier(self, stage: str) -> dict[str, str]:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        context = self._context(("attempt", stage), ("stage", stage))
        fields: dict[str, str] = {}
        if context is not None:
            TraceContextTextMapPropagator().inject(fields, context)
        return {CARRIED[k]: v for k, v in fields.items() if k in CARRIED}

    def rank_app(self, stage: str, app: str) -> tuple[str, tuple]:
        carrier = self.carrier(stage)
        if not carrier:
            return app, ()
        attributes = {
            "phalanx.run_id": self.run_id,
            "phalanx.stage": stage,
            "phalanx.attempt": self._attempts.get(stage),
        }
        return RANK_APP, ({"carrier": carrier, "attributes": _set(attributes)}, app)


def for_run(run_id: str, workflow: str, site: str) -> NoSpans:
    """The spans of a run: ``RunSpans`` while this process traces, else hooks that do nothing."""
    return RunSpans(_tracer, run_id, workflow, site) if on() else NoSpans()


def _set(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}


# ---- the ranks: rank > exchange -----------------------------------------------------------------
def traced_app(env: Any, trace: dict, app: Any, *args: Any, **kwargs: Any) -> Any:
    """``app(env, *args, **kwargs)`` on a rank of a traced attempt: ``TRACEPARENT`` set while it
    runs and, where this rank traces, inside a span ``rank R`` that continues the attempt's
    (exported before the rank reports back: a rank may be stopped right after)."""
    carrier: dict[str, str] = trace["carrier"]
    with _environment(carrier):
        if not on():
            return resolve_app(app)(env, *args, **kwargs)
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from ..runtime.protocol import rank_host

        parent = TraceContextTextMapPropagator().extract({k: carrier[v] for k, v in CARRIED.items() if v in carrier})
        attributes = {
            **trace.get("attributes", {}),
            "phalanx.rank": env.rank,
            "phalanx.world_size": env.world_size,
            "host.name": rank_host(),
            "process.pid": os.getpid(),
        }
        try:
            with _tracer.start_as_current_span(f"rank {env.rank}", context=parent, attributes=attributes):
                return resolve_app(app)(env, *args, **kwargs)
        finally:
            if _provider is not None:
                _provider.force_flush(int(FLUSH_S * 1000))


@contextmanager
def _environment(values: dict[str, str]):
    """``values`` in os.environ for the block, the earlier values back after it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def exchange_span(kind: str, comm: Any, parts: list, move: Callable[[], list]) -> list:
    """``move()`` (a collective that sends ``parts[i]`` to rank i and returns what each rank
    sent here) inside a span ``kind`` with the rows and Arrow bytes sent to and received from
    the other ranks.  Call it only when ``on()``."""
    me = comm.rank
    sent = [p for dest, p in enumerate(parts) if dest != me]
    attributes = {
        "phalanx.rank": me,
        "phalanx.world_size": comm.world_size,
        "phalanx.rows_sent": sum(p.num_rows for p in sent),
        "phalanx.bytes_sent": sum(p.nbytes for p in sent),
    }
    with _tracer.start_as_current_span(kind, attributes=attributes) as span:
        got = move()
        received = [t for src, t in enumerate(got) if src != me]
        span.set_attributes(
            {
                "phalanx.rows_received": sum(t.num_rows for t in received),
                "phalanx.bytes_received": sum(t.nbytes for t in received),
            }
        )
    return got
