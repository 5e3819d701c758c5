"""Prometheus metrics (phalanx/observe/metrics.py): scraped over HTTP from a real server on
loopback, parsed with the official parser, and checked against the run DB read with sqlite3.

(The real Prometheus server is not run here: it is a Go binary that cannot be built or
fetched on this machine; its text format is parsed with prometheus_client's own parser.)"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from phalanx.observe.metrics import MetricsServer
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow

parser = pytest.importorskip("prometheus_client.parser")
HERE = Path(__file__).parent


def scrape(url: str, token: str | None = None, host: str | None = None) -> dict[tuple, float]:
    """Every sample of the endpoint: (name, sorted labels) → value."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    if host:
        request.add_header("Host", host)
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def status_of(url: str, token: str | None = None, host: str | None = None) -> int:
    try:
        scrape(url, token, host)
    except urllib.error.HTTPError as exc:
        return exc.code
    return 200


def of(samples: dict[tuple, float], name: str, **labels: str) -> dict[tuple, float]:
    """The samples of ``name`` whose labels include ``labels``."""
    want = {(k, str(v)) for k, v in labels.items()}
    return {k: v for k, v in samples.items() if k[0] == name and want <= set(k[1])}


def one(samples: dict[tuple, float], name: str, **labels: str) -> float:
    found = of(samples, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return next(iter(found.values()))


def rows(db: RunDB, query: str, *params) -> list[sqlite3.Row]:
    """The run DB read directly (the independent side of every comparison)."""
    con = sqlite3.connect(db.path)
    con.row_factory = sqlite3.Row
    try:
        return con.execute(query, params).fetchall()
    finally:
        con.close()


@pytest.mark.slow  # a real run: a gang starts (~2 s on a quiet machine, more on a busy one)
def test_a_runs_metrics_scraped_over_http_match_the_run_db(tmp_path):
    db = RunDB(tmp_path / "state")
    wf = Workflow(
        name="metered",
        stages={
            "gen": Stage(app="apps:wf_generate", ranks=1, params={"rows": 300, "seed": 1}, outputs=["tx"]),
            "bad": Stage(app="apps:no_such_function_here", ranks=1, inputs={"tx": "tx"}),
        },
    )
    result = run_workflow(wf, Site(name="m", cores=2), db=db)
    assert not result.ok and "bad" in result.failed
    server = MetricsServer(db, port=0).start()
    try:
        got = scrape(server.url)
    finally:
        server.stop()
    run = result.run_id
    for state, n in rows(db, "SELECT state, COUNT(*) FROM runs GROUP BY state"):
        assert one(got, "phalanx_runs", state=state) == n
    (rec,) = rows(db, "SELECT * FROM runs WHERE id=?", run)
    assert one(got, "phalanx_run_info", run=run, workflow="metered", site="m", state="failed") == 1
    assert one(got, "phalanx_run_duration_seconds", run=run) == pytest.approx(rec["ended"] - rec["started"])
    for state, n in rows(db, "SELECT state, COUNT(*) FROM stages WHERE run_id=? GROUP BY state", run):
        assert one(got, "phalanx_stages", run=run, state=state) == n
    for st in rows(db, "SELECT * FROM stages WHERE run_id=?", run):
        stage = st["stage"]
        assert one(got, "phalanx_stage_info", run=run, stage=stage, state=st["state"]) == 1
        took = one(got, "phalanx_stage_duration_seconds", run=run, stage=stage)
        assert took == pytest.approx(st["ended"] - st["started"])
        (n,) = rows(db, "SELECT COUNT(*) FROM attempts WHERE run_id=? AND stage=?", run, stage)[0]
        assert one(got, "phalanx_stage_attempts_total", run=run, stage=stage) == n >= 1
        failed = rows(
            db,
            "SELECT cause, COUNT(*) FROM attempts WHERE run_id=? AND stage=? AND state='failed' GROUP BY cause",
            run,
            stage,
        )
        exported = of(got, "phalanx_stage_failed_attempts_total", run=run, stage=stage)
        assert {dict(k[1])["cause"]: v for k, v in exported.items()} == {c: n for c, n in failed}
        for name, (nrows, nbytes) in json.loads(st["outputs"] or "{}").items():
            assert one(got, "phalanx_stage_output_rows", run=run, stage=stage, output=name) == nrows
            assert one(got, "phalanx_stage_output_bytes", run=run, stage=stage, output=name) == nbytes
    assert one(got, "phalanx_stage_output_rows", run=run, stage="gen", output="tx") == 300
    assert dict(next(iter(of(got, "phalanx_stage_failed_attempts_total", run=run, stage="bad")))[1])["cause"]
    # per rank: the newest sample of each rank of the stage's latest attempt, as the samples table has it
    sampled = rows(
        db,
        "SELECT * FROM samples s WHERE run_id=? AND attempt=(SELECT MAX(attempt) FROM samples WHERE run_id=s.run_id "
        "AND stage=s.stage) AND ts=(SELECT MAX(ts) FROM samples WHERE run_id=s.run_id AND stage=s.stage AND "
        "attempt=s.attempt AND rank=s.rank)",
        run,
    )
    assert {r["stage"] for r in sampled} == {"gen", "bad"}, "the sampler recorded no sample of a stage"
    for r in sampled:
        at = {"run": run, "stage": r["stage"], "rank": str(r["rank"]), "host": r["host"]}
        assert one(got, "phalanx_rank_rss_bytes", **at) == r["rss"] > 0
        assert one(got, "phalanx_rank_peak_rss_bytes", **at) == r["peak_rss"]
        assert one(got, "phalanx_rank_cpu_ratio", **at) == pytest.approx(r["cpu"] / 100)
        assert one(got, "phalanx_rank_sent_bytes_total", **at) == r["sent"]
        assert one(got, "phalanx_rank_comm_seconds_total", **at) == pytest.approx(r["comm_s"])
        assert one(got, "phalanx_rank_sample_timestamp_seconds", **at) == pytest.approx(r["ts"])


def test_only_the_newest_and_running_runs_are_exported_and_a_token_guards_them(tmp_path):
    db = RunDB(tmp_path / "state")
    running, _ = db.new_run("old", "f.yaml", "s", None, {"a": 1})  # its driver (this process) lives: running
    ended = []
    for i in range(4):
        run_id, _ = db.new_run(f"wf{i}", "f.yaml", "s", None, {"a": 2, "b": 1})
        db.set_stage(run_id, "a", "succeeded", started=time.time() - 2, ended=time.time())
        db.set_run(run_id, "succeeded")
        ended.append(run_id)
    server = MetricsServer(db, port=0, token="s3cret", runs=2).start()
    try:
        assert status_of(server.url) == 401
        assert status_of(server.url, token="wrong") == 401
        assert status_of(server.url.replace("/metrics", "/other"), token="s3cret") == 404
        assert status_of(server.url, token="s3cret", host="evil.example:80") == 400  # DNS rebinding
        got = scrape(server.url, token="s3cret")
    finally:
        server.stop()
    exported = {dict(k[1])["run"] for k in of(got, "phalanx_run_info")}
    assert exported == {running, *ended[-2:]}  # the 2 newest, and the running one however old
    assert {dict(k[1])["state"]: v for k, v in of(got, "phalanx_runs").items()} == {"running": 1, "succeeded": 4}
    assert one(got, "phalanx_stages", run=ended[-1], state="pending") == 1
    assert one(got, "phalanx_stage_ranks", run=ended[-1], stage="a") == 2
    assert not of(got, "phalanx_stage_duration_seconds", run=running)  # never started: no duration
    assert one(got, "phalanx_scrape_duration_seconds") < 5


def test_a_server_off_loopback_needs_a_token_and_never_listens_on_every_interface(tmp_path):
    with pytest.raises(ValueError, match="needs a bearer token: --token-file"):
        MetricsServer(RunDB(tmp_path / "state"), host="0.0.0.0", port=0)
    for wildcard in ("0.0.0.0", "::"):
        with pytest.raises(ValueError, match="every interface"):
            MetricsServer(RunDB(tmp_path / "state"), host=wildcard, port=0, token="t")


@pytest.mark.slow  # a Python process of its own: ~2 s
def test_cli_metrics_serves_until_interrupted_and_refuses_a_readable_token_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    token.chmod(0o644)
    cmd = [sys.executable, "-m", "phalanx.cli", "metrics", "--port", "0", "--state", str(tmp_path / "state")]
    refused = subprocess.run([*cmd, "--token-file", str(token)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "chmod 600" in refused.stderr and "t0ken" not in refused.stderr
    off = subprocess.run([*cmd, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert off.returncode == 1 and "needs a bearer token" in off.stderr
    token.chmod(0o600)
    proc = subprocess.Popen([*cmd, "--token-file", str(token)], stdout=subprocess.PIPE, text=True, cwd=HERE)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert "bearer token" in lines[0] and "t0ken" not in "".join(lines)
        url = re.fullmatch(r"scrape (http://127\.0\.0\.1:\d+/metrics)\n", lines[1]).group(1)
        assert status_of(url) == 401
        assert {k[0] for k in scrape(url, token="t0ken")} == {"phalanx_scrape_duration_seconds"}  # no runs yet
    finally:
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0
