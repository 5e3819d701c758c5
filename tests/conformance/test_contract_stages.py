"""The executor contract for workflow runs (``run_workflow`` and the run DB), on every site.

Command stages behave like BSP stages; a reused gang keeps its processes; a stage the site can
never place fails; cancelling a run leaves nothing; two runs in one process never end each
other's allocations.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

import phalanx as px
from phalanx.orchestrator.models import Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow

from . import ranks as R
from .sites import N

FAIL_WITHIN_S = 10.0
WHERE = "conformance.ranks:stage_where"
WAIT = "conformance.ranks:stage_where_then_wait"


def workflow(name: str, **stages: dict) -> Workflow:
    return Workflow(name=name, stages={k: Stage(**v) for k, v in stages.items()})


def command(stage: str, ranks: int, d: Path, **params) -> dict:
    return {
        "kind": "command",
        "command": ["python", "-c", R.COMMAND],
        "ranks": ranks,
        "params": {"dir": str(d), "stage": stage, **params},
    }


def facts_of(d: Path, stage: str, ranks: int) -> list[dict]:
    return [json.loads((d / f"{stage}-rank-{r}.json").read_text()) for r in range(ranks)]


def wait_for_files(d: Path, stage: str, ranks: int, within: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + within
    while len(list(d.glob(f"{stage}-rank-*.json"))) < ranks:
        assert time.monotonic() < deadline and alive(), f"the ranks of {stage!r} did not start within {within:g} s"
        time.sleep(0.05)


def gang_ids(db: RunDB, run_id: str) -> list[str]:
    return [a["gang_id"] for a in db.attempts(run_id) if a["gang_id"]]


# ---- command stages behave like BSP stages -------------------------------------------------
def test_command_stages_report_exit_codes_fail_fast_and_log_to_the_attempt(site, tmp_path):
    """Side by side: "ok" (1 rank, exits 0) and "bad" (2 ranks: rank 1 exits 3 at once, rank 0
    would sleep 120 s): "ok" succeeds, "bad" fails within 10 s naming rank 1 and its code, rank 0
    is stopped, every rank's output is in its attempt's log directory."""
    db = RunDB(tmp_path / "state")
    wf = workflow("contract-command", ok=command("ok", 1, tmp_path), bad=command("bad", 2, tmp_path, fail_rank=1))
    result = run_workflow(wf, site.model(), db=db)
    stages = {s["stage"]: s for s in db.stages(result.run_id)}
    assert stages["ok"]["state"] == "succeeded", (stages["ok"], result.failed)
    assert not result.ok and list(result.failed) == ["bad"], result.failed
    error = result.failed["bad"]
    assert re.search(r"\brank 1\b", error) and re.search(r"\bcode 3\b", error), error
    [attempt] = db.attempts(result.run_id, "bad")
    bad = facts_of(tmp_path, "bad", 2)
    exited = (tmp_path / "bad-rank-1.json").stat().st_mtime  # rank 1 exits right after all ranks wrote theirs
    exited = max(exited, (tmp_path / "bad-rank-0.json").stat().st_mtime)
    assert attempt["state"] == "failed" and attempt["ended"] - exited < FAIL_WITHIN_S, (
        f"the stage failed {attempt['ended'] - exited:.1f} s after rank 1 exited"
    )
    ids = gang_ids(db, result.run_id)
    assert site.wait_nothing_left(ids, facts_of(tmp_path, "ok", 1) + bad, within=10) == []
    for stage, ranks in (("ok", 1), ("bad", 2)):
        [attempt] = db.attempts(result.run_id, stage)
        log_dir = Path(attempt["log_dir"])
        for r in range(ranks):
            log = log_dir / f"rank-{r}.log"
            assert log.exists(), (
                f"{stage}: no {log.name} in the attempt's log dir {log_dir}: "
                f"{sorted(p.name for p in log_dir.iterdir()) if log_dir.exists() else 'missing'}"
            )
            assert f"contract stage {stage} rank {r} of {ranks} says hello" in log.read_text(), log.read_text()


# ---- a reused gang keeps its processes --------------------------------------------------------
def test_a_reused_gang_keeps_its_processes_across_stages(site, tmp_path):
    if not site.can("reuse_gangs"):
        pytest.skip(
            f"site {site.name!r}: executor {site.executor!r} does not declare reuse_gangs "
            "(every stage gets a gang of its own)"
        )
    db = RunDB(tmp_path / "state")
    params = {"dir": str(tmp_path)}
    wf = workflow(
        "contract-reuse",
        first={"app": WHERE, "ranks": 2, "params": params},
        second={"app": WHERE, "ranks": 2, "params": params, "needs": ["first"]},
    )
    result = run_workflow(wf, site.model(reuse_gangs=True), db=db)
    assert result.ok, result.failed
    first, second = facts_of(tmp_path, "first", 2), facts_of(tmp_path, "second", 2)
    assert [f["pid"] for f in second] == [f["pid"] for f in first]  # the same processes
    assert len(set(gang_ids(db, result.run_id))) == 1  # one gang served both stages
    # each stage's output went to its own attempt's log directory
    for stage, other in (("first", "second"), ("second", "first")):
        [attempt] = db.attempts(result.run_id, stage)
        log = (Path(attempt["log_dir"]) / "rank-1.log").read_text()
        assert f"contract stage {stage} rank 1 of 2 says hello" in log and f"stage {other} " not in log, log
    assert site.wait_nothing_left(gang_ids(db, result.run_id), first) == []  # freed when the run ended


# ---- a stage the site can never place fails in time, with the reason --------------------------
def test_a_stage_bigger_than_the_site_fails_in_time_with_the_reason(site, tmp_path):
    capacity = site.capacity()
    model = site.model(start_timeout=20)
    db = RunDB(tmp_path / "state")
    wf = workflow("contract-too-big", big=command("big", capacity + 1, tmp_path))
    t0 = time.monotonic()
    result = run_workflow(wf, model, db=db)
    took = time.monotonic() - t0
    [row] = db.stages(result.run_id)
    assert row["state"] == "failed" and not result.ok and "big" in result.failed, (row, result)
    assert took < model.start_timeout + 5
    assert str(capacity + 1) in result.failed["big"], result.failed["big"]  # names what could not be given


# ---- cancel leaves no process, job, step, actor or placement group -----------------------------
def test_cancelling_a_run_leaves_nothing_behind(site, tmp_path):
    """``px.submit(...).cancel()`` while the stage's ranks run: the run ends "cancelled" and
    nothing of it is left — rank process, job, step, pilot, actor, placement group, or a live
    allocation in the run DB."""
    db = RunDB(tmp_path / "state")
    wf = workflow(
        "contract-cancel",
        wait={"app": WAIT, "ranks": N, "params": {"dir": str(tmp_path), "go": str(tmp_path / "never")}},
    )
    handle = px.submit(wf, site=site.model(), state=tmp_path / "state")
    try:
        # the run's own allocation (a SLURM pilot, a RADICAL-Pilot pilot) starts within its gang's start timeout
        wait_for_files(tmp_path, "wait", N, within=site.model().start_timeout, alive=lambda: not handle.done())
    finally:
        t0 = time.monotonic()
        stopped = handle.cancel(timeout=30)
    took = time.monotonic() - t0
    assert stopped and handle.done(), f"the run had not ended {took:.0f} s after cancel()"
    assert db.run(handle.run_id)["state"] == "cancelled"
    [row] = db.stages(handle.run_id)
    assert row["state"] == "cancelled", row
    assert db.allocations(handle.run_id) == []  # the run DB holds no live allocation
    assert site.wait_nothing_left(gang_ids(db, handle.run_id), facts_of(tmp_path, "wait", N)) == []
    assert took < FAIL_WITHIN_S + 10, f"cancel() took {took:.1f} s"


def test_cancelling_a_run_whose_gang_waits_for_busy_slots_ends_it_at_once(site, tmp_path):
    """Every slot is taken: the run's gang waits in the resource manager's queue; cancel() must
    end that wait (and the run) at once, not when the queue moves."""
    if site.waiting is None:
        pytest.skip(
            f"site {site.name!r} (executor {site.executor!r}) has no resource manager to queue on: "
            "its gangs never wait for slots"
        )
    db = RunDB(tmp_path / "state")
    wf = workflow("contract-cancel-queued", s={"app": WHERE, "ranks": 1, "params": {"dir": str(tmp_path)}})
    outcome: dict = {}
    with site.occupied():
        handle = px.submit(wf, site=site.model(), state=tmp_path / "state")
        deadline = time.monotonic() + 30  # until its gang is in the queue
        while not db.attempts(handle.run_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
        t0 = time.monotonic()
        canceller = threading.Thread(
            target=lambda: outcome.update(stopped=handle.cancel(timeout=8), took=time.monotonic() - t0), daemon=True
        )
        canceller.start()
        canceller.join(12)  # cancel(timeout=8) itself must return by then
    canceller.join(120)  # the slots are free: a wait that cancel() did not end ends now
    handle.wait(120)
    assert outcome.get("stopped") and outcome["took"] < 8, (
        f"cancel(timeout=8) returned {outcome.get('stopped')} after {outcome.get('took', 0):.0f} s: its gang was still queued"
    )
    assert db.run(handle.run_id)["state"] == "cancelled"
    assert db.allocations(handle.run_id) == []
    assert site.wait_nothing_left(gang_ids(db, handle.run_id)) == []


# ---- two runs in one process never close each other's allocations -------------------------------
def test_two_runs_in_one_process_never_close_each_others_allocations(site, tmp_path):
    """Three runs of one process on one site, side by side: G, a standalone px.Gang (its own
    run); A and B, workflow runs (px.submit: a Scheduler each, in threads of their own).  A's
    stage waits; B's ends once A's runs.  When B ends it frees what it held — and nothing of G's
    or A's: G keeps its processes, A's stage finishes in its first attempt; A's end leaves G
    alone.  (All three start at once: B's stage waits for A's.)"""
    model = site.model(**site.side_by_side)
    db = RunDB(tmp_path / "state")
    go = tmp_path / "go"
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    a = workflow("contract-run-a", s={"app": WAIT, "ranks": 1, "params": {"dir": str(tmp_path / "a"), "go": str(go)}})
    b = workflow(
        "contract-run-b",
        s={
            "app": WAIT,
            "ranks": 1,
            "params": {"dir": str(tmp_path / "b"), "go": str(tmp_path / "a" / "s-rank-0.json")},
        },
    )
    run_a = px.submit(a, site=model, state=tmp_path / "state")
    run_b = px.submit(b, site=model, state=tmp_path / "state")
    try:
        with px.Gang(1, site=model, echo=False) as gang:  # starts while A's and B's stages do
            before = [f["pid"] for f in gang.run(R.where)]
            result_b = run_b.result(timeout=model.start_timeout + 60)
            assert result_b.ok, result_b.failed
            assert (tmp_path / "a" / "s-rank-0.json").exists() and not run_a.done(), (
                f"run A is not running while run B ends: {run_a.status()}"
            )
            assert gang.health() is None, f"run B's end broke the gang: {gang.health()}"
            assert [f["pid"] for f in gang.run(R.where)] == before
            assert not run_a.done(), f"run A ended with run B: {run_a.status()}"
            go.touch()
            result_a = run_a.result(timeout=60)
            assert result_a.ok, f"run A failed after run B ended: {result_a.failed}"
            assert [x["state"] for x in db.attempts(result_a.run_id, "s")] == ["succeeded"]
            assert gang.health() is None, f"run A's end broke the gang: {gang.health()}"
            assert [f["pid"] for f in gang.run(R.where)] == before
    finally:
        go.touch()
        for run in (run_a, run_b):
            if not run.wait(30):
                run.cancel(timeout=30)
