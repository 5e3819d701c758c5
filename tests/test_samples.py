"""Per-rank resource samples (issue 28): ranks sample themselves while a stage runs
(``runtime.sampler``), the driver writes the samples to the run database
(``orchestrator.samples``), ``phalanx status`` and the report show them and name the straggler."""

from __future__ import annotations

import logging
import re

import pytest
from sample_apps import HELD_MB, payload

import phalanx as px
from phalanx import cli
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.report import write_report
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.samples import SampleRecorder, straggler
from phalanx.orchestrator.scheduler import run_workflow
from phalanx.runtime import protocol as P
from phalanx.runtime.sampler import interval_s

RANKS, SLEEP_S, EVERY_S = 2, 0.5, 0.1


def expected_traffic(rank: int, world: int) -> tuple[int, int]:
    """The bytes ``sample_apps.skewed``'s exchange moves for ``rank``, from the payloads themselves."""
    sent = sum(payload(rank, d).nbytes for d in range(world) if d != rank)
    received = sum(payload(s, rank).nbytes for s in range(world) if s != rank)
    return sent, received


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """One stage of ``skewed`` on the local executor, sampled every EVERY_S seconds."""
    db = RunDB(tmp_path_factory.mktemp("samples") / "state")
    wf = Workflow(name="skew", stages={"skew": Stage(app="sample_apps:skewed", ranks=RANKS, params={"sleep": SLEEP_S})})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(P.ENV_SAMPLE, str(EVERY_S))
        result = run_workflow(wf, Site(name="samples", cores=RANKS), db=db)
    assert result.ok, result.failed
    return db, result.run_id


@pytest.mark.slow  # a stage run with a 0.5 s wait and a 200 MB allocation: ~3 s
def test_every_rank_leaves_samples_with_its_memory_traffic_and_waits(ran):
    db, run_id = ran
    latest = {r["rank"]: r for r in db.samples(run_id, "skew")}
    assert sorted(latest) == list(range(RANKS))
    everything = db.samples(run_id, latest=False)
    assert [r["ts"] for r in everything] == sorted(r["ts"] for r in everything)
    assert all(r["stage"] == "skew" and r["attempt"] == 1 for r in everything)
    for rank, row in latest.items():
        # sampled while it ran (every EVERY_S over SLEEP_S at least) and once as it ended
        assert sum(r["rank"] == rank for r in everything) >= 2
        # the newest row is the final one: the whole task, and exactly the exchange's payload
        assert row["elapsed"] >= SLEEP_S
        assert (row["sent"], row["received"]) == expected_traffic(rank, RANKS)
        assert 10 << 20 < row["rss"] <= row["peak_rss"] < 4 << 30
        assert 0 <= row["cpu"] <= 100 * 64
    assert latest[1]["peak_rss"] - latest[0]["peak_rss"] > 0.75 * (HELD_MB << 20)  # rank 1 alone held it
    assert latest[1]["comm_s"] >= SLEEP_S - 0.1  # rank 1 waited in the barrier while rank 0 slept


@pytest.mark.slow  # a stage run with a 0.5 s wait and a 200 MB allocation: ~3 s
def test_status_shows_a_line_per_rank(ran, capsys):
    db, run_id = ran
    assert cli.main(["status", run_id, "--state", str(db.state_dir)]) == 0
    out = capsys.readouterr().out
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"rank (\d+) +\S+ +cpu .*", out)}
    assert sorted(lines) == list(range(RANKS)), out
    peak = db.samples(run_id)[1]["peak_rss"]
    assert f"(peak {peak / 1e6:,.0f})" in lines[1]


def test_status_and_report_name_the_straggler(tmp_path, capsys):
    """Rows as the ranks of a 4-rank stage would send them: rank 2 computed 3 s, the others
    about 1 s and waited for it in collectives."""
    db = RunDB(tmp_path / "state")
    run_id, _ = db.new_run("wf", "wf.yaml", "site", None, {"join": 4})
    row = dict(host="node1", cpu=99.0, rss=300 << 20, peak_rss=400 << 20, sent=50 << 20, received=60 << 20)
    comm = {0: 2.0, 1: 2.1, 2: 0.1, 3: 1.9}  # of 3.1 s each: rank 2 computed 3.0 s, the others ~1
    db.add_samples(run_id, "join", 1, [dict(row, rank=r, ts=10.0, elapsed=1.0, comm_s=0.5) for r in range(4)])
    db.add_samples(run_id, "join", 1, [dict(row, rank=r, ts=12.0, elapsed=3.1, comm_s=c) for r, c in comm.items()])
    assert cli.main(["status", run_id, "--state", str(db.state_dir)]) == 0
    out = capsys.readouterr().out
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"rank (\d+) +node1 .*", out)}
    assert sorted(lines) == [0, 1, 2, 3], out
    assert [r for r, line in lines.items() if "straggler" in line] == [2]
    assert "comm 3% of 3.1s" in lines[2] and "comm 68% of 3.1s" in lines[1]
    assert "sent 52.4 MB  recv 62.9 MB" in lines[0]  # MB = 10^6 bytes
    assert "straggler: rank 2 computed 3.00s, the others 1.10s (median)" in out
    page = write_report(db, run_id, tmp_path / "r.html").read_text()
    rows = re.findall(r'<tr class="rank( straggler)?" data-rank="(\d)">', page)
    assert rows == [("", "0"), ("", "1"), (" straggler", "2"), ("", "3")]
    assert page.count('<polyline class="rss"') == 4  # two samples each: memory over time


def test_no_straggler_among_equals_or_alone():
    row = dict(elapsed=2.0, comm_s=1.0, rank=0)
    assert straggler([row]) is None
    assert straggler([dict(row, rank=r) for r in range(3)]) is None
    close = [dict(row, rank=0), dict(row, rank=1, comm_s=0.9)]  # 1.1 s against 1.0: noise
    assert straggler(close) is None


def test_a_bad_interval_is_refused_before_the_gang_starts(monkeypatch):
    monkeypatch.setenv(P.ENV_SAMPLE, "often")
    with pytest.raises(ValueError, match="PHALANX_SAMPLE_S must be seconds"):
        interval_s()
    with pytest.raises(px.GangError, match="PHALANX_SAMPLE_S"):
        px.Gang(1, echo=False).start()


def test_a_failing_database_loses_the_samples_not_the_stage(tmp_path, caplog):
    db = RunDB(tmp_path / "state")
    import sqlite3

    with sqlite3.connect(db.path) as con:
        con.execute("DROP TABLE samples")  # every write of samples now fails
    recorder = SampleRecorder(db, "run", "stage", 1, every_s=0.0)
    sample = P.Sample(
        task=1, rank=0, ts=1.0, host="h", cpu=1.0, rss=1, peak_rss=2, sent=3, received=4, comm_s=0.5, elapsed=1.0
    )
    recorder.add(sample)
    with caplog.at_level(logging.WARNING, logger="phalanx.samples"):
        recorder.close()  # no exception
    assert "could not record resource samples" in caplog.text


def test_samples_latest_and_series(tmp_path):
    db = RunDB(tmp_path / "state")
    row = dict(host="h", cpu=50.0, rss=10, peak_rss=20, sent=0, received=0, comm_s=0.0)
    db.add_samples("r", "a", 1, [dict(row, rank=0, ts=1.0, elapsed=1.0), dict(row, rank=0, ts=2.0, elapsed=2.0)])
    db.add_samples("r", "a", 2, [dict(row, rank=0, ts=3.0, elapsed=0.5)])
    db.add_samples("r", "b", 1, [dict(row, rank=1, ts=1.5, elapsed=1.5)])
    latest = [(r["stage"], r["attempt"], r["rank"], r["ts"]) for r in db.samples("r")]
    assert latest == [("a", 1, 0, 2.0), ("a", 2, 0, 3.0), ("b", 1, 1, 1.5)]
    assert [r["ts"] for r in db.samples("r", "a", latest=False)] == [1.0, 2.0, 3.0]
    assert db.samples("other") == []


@pytest.mark.parametrize(
    "communicator,env,every",
    [
        pytest.param("tcp", {"PHALANX_SHM": "0"}, "0.05", id="tcp-wire"),
        pytest.param("tcp", {}, "0", id="tcp-shm-off", marks=pytest.mark.slow),
        pytest.param("shm", {}, "0.05", id="shm", marks=pytest.mark.slow),
        pytest.param("gloo", {}, "0", id="gloo-off", marks=pytest.mark.slow),
    ],
)
def test_every_backend_counts_the_payload_of_each_collective(communicator, env, every):
    """The accounting of ``sample_apps.collectives`` against the payloads it moves; with
    sampling on, each rank's final sample (before its result) says the same; off: no sample."""
    if communicator == "gloo":
        pytest.importorskip("torch")
    sampled: list[P.Sample] = []
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**env, P.ENV_SAMPLE: every}.items():
            mp.setenv(k, v)
        with px.Gang(2, communicator=communicator, echo=False) as gang:
            gang.on_sample = sampled.append
            got = gang.run("sample_apps:collectives")
            latest = gang.samples
    for rank, (sent, received) in enumerate(got):
        other = 1 - rank
        ex_sent, ex_received = expected_traffic(rank, 2)
        ex_sent += 80 + (300 if rank == 0 else 0) + (50 + rank)  # allreduce, broadcast (root), allgather
        ex_received += 80 + (300 if rank != 0 else 0) + (50 + other)
        assert (sent, received) == (ex_sent, ex_received), rank
    if every == "0":  # off: not even a final sample (it would have come before the results)
        assert sampled == [] and latest == {}
        return
    for rank, (sent, received) in enumerate(got):
        mine = [s for s in sampled if s.rank == rank]
        assert [s.final for s in mine][-1:] == [True] and not any(s.final for s in mine[:-1])
        assert latest[rank] == mine[-1] and (mine[-1].sent, mine[-1].received) == (sent, received)
        assert mine[-1].task == 1 and mine[-1].comm_s <= mine[-1].elapsed


@pytest.mark.slow  # two stages on one kept gang
def test_a_tasks_peak_is_its_own_not_its_processs(tmp_path, monkeypatch):
    """The second stage runs on the processes the first used (a kept gang): rank 0's peak in it
    must not carry the first stage's HELD_MB."""
    monkeypatch.setenv(P.ENV_SAMPLE, "0.1")
    db = RunDB(tmp_path / "state")
    stages = {
        "hog": Stage(app="sample_apps:hog", ranks=RANKS),
        "calm": Stage(app="sample_apps:calm", ranks=RANKS, needs=["hog"]),
    }
    result = run_workflow(Workflow(name="peaks", stages=stages), Site(name="peaks", cores=RANKS), db=db)
    assert result.ok, result.failed
    gangs = {a["stage"]: a["gang_id"] for a in db.attempts(result.run_id)}
    assert gangs["hog"] == gangs["calm"]  # the same processes
    hog = {r["rank"]: r for r in db.samples(result.run_id, "hog")}
    calm = {r["rank"]: r for r in db.samples(result.run_id, "calm")}
    assert hog[0]["peak_rss"] - hog[1]["peak_rss"] > 0.75 * (HELD_MB << 20)
    assert hog[0]["peak_rss"] - calm[0]["peak_rss"] > 0.75 * (HELD_MB << 20)
