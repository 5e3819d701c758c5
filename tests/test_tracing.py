"""OpenTelemetry spans (phalanx/observe/tracing.py).

The driver's spans (run > stage > attempt) are captured in-process by the SDK's
InMemorySpanExporter.  The ranks' spans (rank > exchange) are separate processes': they trace
because their environment (inherited from the driver) says ``OTEL_TRACES_EXPORTER=otlp``, and
they send their spans over OTLP/HTTP to a receiver this test starts on loopback, which decodes
them with the OpenTelemetry protobuf definitions."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from phalanx.observe import tracing
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow

pytest.importorskip("opentelemetry.sdk")
# the ranks export over OTLP/HTTP (its exporter brings the protobufs the receiver decodes)
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode


def otel_vars() -> list[str]:
    """This process's OpenTelemetry settings (a test starts without them)."""
    return [v for v in os.environ if v.startswith("OTEL_") or v in ("TRACEPARENT", "TRACESTATE")]


class Receiver:
    """An OTLP/HTTP trace receiver on loopback: every span posted to /v1/traces, decoded."""

    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.add(self.path, ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def add(self, path: str, request) -> None:
        assert path == "/v1/traces"
        with self.lock:
            for rs in request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            {
                                "name": s.name,
                                "trace_id": s.trace_id.hex(),
                                "span_id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(),
                                "error": s.status.code == s.status.STATUS_CODE_ERROR,
                                "description": s.status.message,
                                "attributes": {a.key: _value(a.value) for a in s.attributes},
                                "service": resource.get("service.name"),
                            }
                        )

    def wait_for(self, pred, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [s for s in self.spans if pred(s)]
            if found:
                return found
            time.sleep(0.02)
        raise AssertionError(f"no such span within {timeout}s; got {[s['name'] for s in self.spans]}")

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


@pytest.fixture
def receiver(monkeypatch):
    """OTLP/HTTP export to a receiver of the test's (this process and the ranks it starts)."""
    for var in otel_vars():
        monkeypatch.delenv(var, raising=False)
    r = Receiver()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    yield r
    tracing.reset()
    r.close()


@pytest.fixture
def driver_spans(receiver):
    """The driver's spans in memory (the ranks still export to ``receiver``)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    yield exporter
    tracing.reset()


@pytest.mark.slow  # a real 3-stage run on 2 ranks: ~3 s
def test_spans_of_a_run_its_stages_attempts_ranks_and_exchanges(tmp_path, receiver, driver_spans):
    db = RunDB(tmp_path / "state")
    wf = Workflow(
        name="traced",
        stages={
            "gen": Stage(app="apps:wf_generate", ranks=2, params={"rows": 2000, "seed": 5}, outputs=["tx"]),
            "totals": Stage(app="apps:wf_totals", ranks=2, inputs={"tx": {"dataset": "tx"}}, outputs=["totals"]),
            "bad": Stage(app="apps:no_such_function_here", ranks=2, inputs={"t": "totals"}),
        },
    )
    result = run_workflow(wf, Site(name="tr", cores=2), db=db)
    assert result.state == "failed" and list(result.failed) == ["bad"]
    spans = driver_spans.get_finished_spans()
    (run,) = [s for s in spans if s.name == "run traced"]
    assert run.parent is None and run.status.status_code == StatusCode.ERROR
    assert run.attributes["phalanx.run_id"] == result.run_id and run.attributes["phalanx.state"] == "failed"
    trace_id = run.context.trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}  # one trace per run
    stages = {s.attributes["phalanx.stage"]: s for s in spans if s.name.startswith("stage ")}
    assert set(stages) == {"gen", "totals", "bad"}
    attempts = {s.attributes["phalanx.stage"]: s for s in spans if s.name.startswith("attempt ")}
    recorded = {a["stage"]: a for a in db.attempts(result.run_id)}  # the run DB, the independent record
    for name, stage in stages.items():
        assert stage.parent.span_id == run.context.span_id
        assert stage.attributes["phalanx.state"] == db_state(db, result.run_id, name)
        attempt = attempts[name]
        assert attempt.parent.span_id == stage.context.span_id and attempt.name == "attempt 1"
        assert attempt.attributes["phalanx.state"] == recorded[name]["state"]
        assert stage.start_time <= attempt.start_time <= attempt.end_time <= stage.end_time <= run.end_time
    assert stages["gen"].status.status_code == StatusCode.UNSET
    bad = attempts["bad"]
    assert bad.status.status_code == StatusCode.ERROR and "no_such_function_here" in bad.status.description
    assert bad.attributes["phalanx.cause"] == recorded["bad"]["cause"] == "AttributeError"
    assert stages["bad"].status.status_code == StatusCode.ERROR

    # the ranks: a span per rank under its attempt's, the exchanges under the rank's
    ranks = receiver.wait_for(lambda s: s["name"].startswith("rank ") and s["attributes"]["phalanx.stage"] == "bad")
    ranks = receiver.wait_for(lambda s: s["name"].startswith("rank "))
    hexid = lambda n: format(n, "016x")  # noqa: E731
    by_stage: dict[str, list[dict]] = {}
    for s in ranks:
        assert s["trace_id"] == format(trace_id, "032x") and s["service"] == "phalanx"
        assert s["parent"] == hexid(attempts[s["attributes"]["phalanx.stage"]].context.span_id)
        by_stage.setdefault(s["attributes"]["phalanx.stage"], []).append(s)
    assert {k: sorted(s["attributes"]["phalanx.rank"] for s in v) for k, v in by_stage.items()} == {
        "gen": [0, 1],
        "totals": [0, 1],
        "bad": [0, 1],
    }
    assert all(s["error"] for s in by_stage["bad"]) and not any(s["error"] for s in by_stage["totals"])
    rank_ids = {s["span_id"]: s["attributes"]["phalanx.rank"] for s in by_stage["totals"]}
    exchanges = receiver.wait_for(lambda s: s["name"] in ("exchange", "allgather") and s["parent"] in rank_ids)
    for s in exchanges:
        assert s["attributes"]["phalanx.rank"] == rank_ids[s["parent"]]
    moved = [s for s in exchanges if s["name"] == "exchange"]
    assert moved, [s["name"] for s in exchanges]
    sent = sum(s["attributes"]["phalanx.rows_sent"] for s in moved)
    assert sent == sum(s["attributes"]["phalanx.rows_received"] for s in moved) > 0  # every row sent arrived


def db_state(db: RunDB, run_id: str, stage: str) -> str:
    return {s["stage"]: s["state"] for s in db.stages(run_id)}[stage]


def test_the_environment_turns_tracing_on_and_spans_go_out_over_otlp(receiver):
    tracing.reset()
    assert tracing.on()
    spans = tracing.for_run("r1", "wf", "site")
    assert isinstance(spans, tracing.RunSpans)
    spans.start_run()
    spans.start_stage("a", ranks=2, site="site")
    spans.start_attempt("a", 1)
    carrier = spans.carrier("a")
    assert set(carrier) == {"TRACEPARENT"} and carrier["TRACEPARENT"].startswith("00-")
    app, first = spans.rank_app("a", "pkg.mod:fn")
    assert app == tracing.RANK_APP and first[0]["carrier"] == carrier and first[1] == "pkg.mod:fn"
    spans.end_attempt("a", "failed", "boom (password=hunter2)", cause="oom")
    spans.end_stage("a", "failed", "boom")
    spans.end_run("failed", "a: boom")
    tracing.reset()  # shuts the provider down: its spans are sent
    got = {s["name"]: s for s in receiver.wait_for(lambda s: s["name"] == "run wf")}
    got.update({s["name"]: s for s in receiver.spans})
    assert set(got) == {"run wf", "stage a", "attempt 1"}
    assert got["run wf"]["service"] == "phalanx" and got["run wf"]["parent"] == ""
    assert got["attempt 1"]["parent"] == got["stage a"]["span_id"]
    assert got["stage a"]["parent"] == got["run wf"]["span_id"]
    assert carrier["TRACEPARENT"].split("-")[1:3] == [got["attempt 1"]["trace_id"], got["attempt 1"]["span_id"]]
    assert got["attempt 1"]["attributes"]["phalanx.cause"] == "oom" and got["attempt 1"]["error"]
    assert got["attempt 1"]["description"] == "boom (password=***)"  # masked as the run DB masks errors


@pytest.mark.parametrize(
    "env, wanted",
    [
        ({}, []),
        ({"OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_TRACES_EXPORTER": "otlp, console"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, []),
    ],
)
def test_which_exporters_the_environment_asks_for(env, wanted):
    assert tracing.exporters_wanted(env) == wanted


def test_off_its_hooks_do_nothing(monkeypatch):
    for var in otel_vars():
        monkeypatch.delenv(var, raising=False)
    tracing.reset()
    try:
        assert not tracing.on()
        spans = tracing.for_run("r", "wf", "s")
        assert type(spans) is tracing.NoSpans
        assert spans.rank_app("a", "m:f") == ("m:f", ()) and spans.carrier("a") == {}
    finally:
        tracing.reset()


@pytest.mark.slow  # a fresh Python process importing the scheduler: 1-4 s
def test_off_it_imports_no_opentelemetry(tmp_path):
    """A fresh process without OTEL_* variables: the scheduler and the exchange operators load,
    a run's hooks are the do-nothing ones, and opentelemetry was never imported."""
    code = (
        "import sys, time\n"
        "import phalanx.operators.exchange, phalanx.orchestrator.scheduler\n"
        "from phalanx.observe import tracing\n"
        "assert not tracing.on()\n"
        "spans = tracing.for_run('r', 'wf', 's')\n"
        "assert type(spans) is tracing.NoSpans and spans.rank_app('a', 'm:f') == ('m:f', ())\n"
        "spans.start_run(); spans.start_stage('a'); spans.start_attempt('a', 1); spans.end_run('failed')\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "t = time.perf_counter()\n"
        "for _ in range(100_000): tracing.on()\n"
        "print((time.perf_counter() - t) * 1e4)\n"  # ns per call
    )
    env = {k: v for k, v in os.environ.items() if k not in otel_vars()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 5_000  # ns per exchange when off: a function call (~50 ns here)


def test_missing_exporter_is_said_and_tracing_stays_off(monkeypatch, caplog):
    for var in otel_vars():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "no_such_exporter")
    tracing.reset()
    try:
        assert not tracing.on()
    finally:
        tracing.reset()
    assert "'no_such_exporter' is not installed here" in caplog.text
