"""The executor contract: what every executor does for a gang (``GangContract``) and for
workflow runs (``RunContract``), checked through the public API only (``px.Gang``,
``run_workflow``, ``px.submit``, the run DB) and each resource manager's own tools.

A subclass runs it on a site; the tests take a ``site`` fixture (a ``ContractSite``) that the
caller provides, module- or session-scoped, in the test module or a conftest::

    import pytest
    from phalanx.testing.executor import GangContract, RunContract
    from phalanx.testing.site import ContractSite

    @pytest.fixture(scope="module")
    def site():
        with ContractSite("mine", {"name": "mine", "executor": "mine", "cores": 4}) as s:
            yield s

    class TestMyGangs(GangContract): ...
    class TestMyRuns(RunContract): ...

Keep the two in separate classes (or modules): ``GangContract`` holds one gang of ``N`` ranks
for its class, which ``RunContract``'s runs would otherwise have to share the site with.  What
a site's resource manager refuses or queues is described by ``ContractSite.impossible`` and
``.waiting``; a test whose point the site cannot have (no queue, no gang reuse) is skipped
saying why.  ``mark_known_failures`` turns a table of (test, site) → reason into strict xfails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

import phalanx as px
from phalanx.orchestrator.models import Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow
from phalanx.testing import ranks as R
from phalanx.testing.site import ContractSite, N, pid_alive

FAIL_WITHIN_S = 10.0  # a rank that raises, is killed or exits non-zero fails its gang within this
WHERE = "phalanx.testing.ranks:stage_where"
WAIT = "phalanx.testing.ranks:stage_where_then_wait"

KnownFailures = Mapping[tuple[str, "str | None"], "str | tuple[str, bool]"]


def mark_known_failures(items: list[pytest.Item], known: KnownFailures) -> None:
    """Contract points an executor breaks today, as ``{(test name, site): reason}``: each
    becomes a strict xfail there, so the fix flips it (``(reason, False)``: non-strict, where
    the failure is a race).  ``site`` is the ``site`` fixture's parameter, None where it is not
    parametrised.  Call it from ``pytest_collection_modifyitems``."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        site = callspec.params.get("site") if callspec else None
        entry = known.get((getattr(item, "originalname", item.name), site))
        if entry:
            reason, strict = (entry, True) if isinstance(entry, str) else entry
            item.add_marker(pytest.mark.xfail(strict=strict, reason=reason))


def started(gang: px.Gang) -> list[dict]:
    """The gang's ranks' facts (starting it if it is not running)."""
    return gang.run(R.where)


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


def _start_into(gang: px.Gang, outcome: dict) -> None:
    try:
        gang.start()
        outcome["started"] = time.monotonic()
    except Exception as exc:
        outcome.update(error=exc, failed=time.monotonic())


class GangContract:
    """The executor contract for a gang (``px.Gang(N, site=...)``).

    One gang of N ranks serves the class (started by the first test, restarted by ``Gang.run``
    after the failure tests); gangs that must be their own (cannot be placed, closed) are
    started by their tests.  Needs a ``site`` fixture (a ``ContractSite``)."""

    @pytest.fixture(scope="class")
    @classmethod
    def gang(cls, site) -> Iterator[px.Gang]:
        g = px.Gang(N, site=site.model(), echo=False)
        yield g
        g.close()

    # ---- a gang of N starts all or nothing and reports where each rank runs ---------------------
    def test_a_gang_starts_whole_and_reports_where_each_rank_runs(self, site, gang):
        t0 = time.monotonic()
        gang.start()
        assert gang.running and time.monotonic() - t0 < site.model().start_timeout
        facts = started(gang)
        # every rank is up, is the rank it says, in this gang, and is where the gang says it is
        assert [f["rank"] for f in facts] == list(range(N))
        assert {f["PHALANX_GANG_ID"] for f in facts} == {gang.gang_id}
        assert gang.pids == [f["pid"] for f in facts], (gang.pids, facts)
        assert gang.hosts == [f["host"] for f in facts], (gang.hosts, facts)
        assert len(set(zip(gang.hosts, gang.pids))) == N, "two ranks share a process"
        here = os.uname().nodename
        assert all(pid_alive(f["pid"]) for f in facts if f["host"] == here), "a rank's process is not alive"
        # the resource manager's rank is the gang's rank (srun's SLURM_PROCID, mpirun's world rank)
        for f in facts:
            for var in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
                assert f[var] is None or int(f[var]) == f["rank"], (var, f)
        # all ranks in one allocation: one SLURM job (a job of its own, or the pilot's); Ray: one
        # actor each
        assert len({f["SLURM_JOB_ID"] for f in facts}) == 1, facts
        actors = [f.get("ray_actor") for f in facts if f.get("ray_actor")]
        assert len(set(actors)) == len(actors)
        assert gang.health() is None

    def test_a_site_that_is_up_answers_its_probe(self, site):
        site.model().create_executor().probe()  # raises, naming the server, when it does not answer

    def test_collectives(self, gang):
        got = gang.run(R.collectives)
        want_sum = [sum(r + 1 for r in range(N)), sum(10 * (r + 1) for r in range(N))]
        want_max = [max((3 * r) % 5 for r in range(N))]
        want_gathered = [bytes([65 + r]) * (5 * r) for r in range(N)]
        want_bcast = {"from": N - 1, "data": list(range(N - 1))}
        for rank, g in enumerate(got):
            assert g == {"sum": want_sum, "max": want_max, "gathered": want_gathered, "bcast": want_bcast}, rank

    def test_alltoallv_of_arrow_tables_equals_pandas(self, gang):
        got = gang.run(R.alltoallv_tables)
        everything = pd.concat([R.rank_table(r).to_pandas() for r in range(N)], ignore_index=True)
        cols = ["src", "key", "value", "name"]
        for dest, table in enumerate(got):
            assert isinstance(table, pa.Table) and table.schema == R.rank_table(0).schema
            want = everything[everything["key"] % N == dest]
            pd.testing.assert_frame_equal(
                table.to_pandas().sort_values(cols).reset_index(drop=True),
                want.sort_values(cols).reset_index(drop=True),
            )
        assert sum(t.num_rows for t in got) == len(everything)

    # ---- closing a gang leaves nothing: no process, job, step, actor or placement group ---------
    def test_a_closed_gang_leaves_nothing_behind(self, site, gang):
        """A standalone gang is its own run: closing it frees everything it made — its ranks, its
        job or step, its actors and placement group, and an allocation it started (a pilot).
        (The module's gang: its site may have no room for another.)"""
        facts = started(gang)
        gang.close()
        assert not gang.running
        assert site.wait_nothing_left([gang.gang_id], facts) == []

    # ---- a rank that raises, or is killed, fails the gang fast and is named ---------------------
    def test_a_rank_that_raises_fails_the_gang_fast_and_is_named(self, site, gang):
        before = started(gang)
        t0 = time.monotonic()
        with pytest.raises(px.RankError) as info:
            gang.run(R.rank_raises, 1, timeout=120)
        took = time.monotonic() - t0
        err = info.value
        assert took < FAIL_WITHIN_S, f"the gang failed {took:.1f} s after rank 1 raised"
        assert err.first.rank == 1 and err.ranks == [1], str(err)
        assert "contract: rank 1 raises on purpose" in str(err) and "rank_raises" in str(err)  # its traceback
        assert sorted(err.stopped) == [0, 2], str(err)
        # the others were stopped: no rank process, step or actor is left (the run's pilot may stay)
        assert site.wait_nothing_left([gang.gang_id], before, within=10, allocations=False) == []

    def test_a_rank_killed_by_sigkill_fails_the_gang_fast_and_is_named(
        self, site: ContractSite, gang: px.Gang, tmp_path: Path
    ) -> None:
        before = started(gang)
        victim = 1
        killed: list[float] = []

        def kill_when_running() -> None:
            deadline = time.monotonic() + 60
            while len(list(tmp_path.glob("rank-*.json"))) < N and time.monotonic() < deadline:
                time.sleep(0.02)
            killed.append(time.monotonic())
            # as the OOM killer or an operator would (a container's rank: found by its gang and rank)
            os.kill(site.host_pid(gang.gang_id, victim, gang.pids[victim]), signal.SIGKILL)

        threading.Thread(target=kill_when_running, daemon=True).start()
        with pytest.raises(px.RankError) as info:
            gang.run(R.mark_then_wait, str(tmp_path), timeout=120)
        took = time.monotonic() - killed[0]
        err = info.value
        assert took < FAIL_WITHIN_S, f"the gang failed {took:.1f} s after rank {victim} was killed"
        assert err.first.rank == victim, str(err)  # the killed rank is the cause, named first
        assert re.search(r"SIGKILL|signal 9|code -9|code 137", str(err)), str(err)
        assert site.wait_nothing_left([gang.gang_id], before, within=10, allocations=False) == []

    # ---- a gang that cannot be placed fails within its start timeout, with the reason -------------
    @pytest.mark.parametrize("request_kind", ["more-ranks-than-it-has", "an-impossible-request"])
    def test_a_gang_that_cannot_be_placed_fails_in_time_with_the_resource_managers_reason(self, site, request_kind):
        ask = site.impossible.get(request_kind)
        if ask is None:
            pytest.skip(
                f"site {site.name!r} (executor {site.executor!r}) has no resource manager that refuses "
                f"a gang: its ranks are processes of this host, oversubscribed when they outnumber its cores"
            )
        model = site.model(start_timeout=20, **ask.get("site", {}))
        gang = px.Gang(ask["ranks"], site=model, echo=False)
        t0 = time.monotonic()
        try:
            with pytest.raises(px.GangError) as info:
                gang.start()
        finally:
            gang.close()
        took = time.monotonic() - t0
        msg = str(info.value)
        assert took < model.start_timeout + 5, f"failed after {took:.1f} s: {msg}"
        assert re.search(ask["reason"], msg, re.S), msg
        assert not gang.running
        assert site.wait_nothing_left([gang.gang_id]) == []

    def test_a_gang_that_waits_for_busy_slots_fails_at_its_start_timeout(
        self, site: ContractSite, gang: px.Gang
    ) -> None:
        """Every slot is taken (by a job or placement group of the test's): a gang's wait in the
        queue counts in its start timeout, and the error says what the resource manager says."""
        if site.waiting is None:
            pytest.skip(
                f"site {site.name!r} (executor {site.executor!r}) has no resource manager to queue on: "
                "its gangs never wait for slots"
            )
        gang.close()  # the module's gang and what it held (a pilot) give their slots back first
        model = site.model(start_timeout=3)
        waiting = px.Gang(1, site=model, echo=False)
        outcome: dict = {}
        with site.occupied():
            t0 = time.monotonic()
            starter = threading.Thread(target=_start_into, args=(waiting, outcome), daemon=True)
            starter.start()
            starter.join(model.start_timeout + 5)
            took = time.monotonic() - t0
        starter.join(120)  # the slots are free again: a gang still waiting starts now, and is closed
        waiting.close()
        assert "error" in outcome or "started" in outcome, f"still starting {took:.0f} s after the slots were freed"
        assert "error" in outcome, (
            f"the gang was still waiting {took:.0f} s into a start_timeout of "
            f"{model.start_timeout:g} s (it started once the slots were freed)"
        )
        msg = str(outcome["error"])
        assert isinstance(outcome["error"], px.GangError), msg
        assert outcome["failed"] - t0 < model.start_timeout + 5, f"failed after {outcome['failed'] - t0:.1f} s: {msg}"
        assert re.search(site.waiting, msg), msg
        assert site.wait_nothing_left([waiting.gang_id]) == []


class RunContract:
    """The executor contract for workflow runs (``run_workflow`` and the run DB).

    Command stages behave like BSP stages; a reused gang keeps its processes; a stage the site
    can never place fails; cancelling a run leaves nothing; two runs in one process never end
    each other's allocations.  Needs a ``site`` fixture (a ``ContractSite``)."""

    # ---- command stages behave like BSP stages -------------------------------------------------
    def test_command_stages_report_exit_codes_fail_fast_and_log_to_the_attempt(self, site, tmp_path):
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
    def test_a_reused_gang_keeps_its_processes_across_stages(self, site, tmp_path):
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
    def test_a_stage_bigger_than_the_site_fails_in_time_with_the_reason(self, site, tmp_path):
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
    def test_cancelling_a_run_leaves_nothing_behind(self, site, tmp_path):
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

    def test_cancelling_a_run_whose_gang_waits_for_busy_slots_ends_it_at_once(
        self, site: ContractSite, tmp_path: Path
    ) -> None:
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
        run = db.run(handle.run_id)
        assert run is not None and run["state"] == "cancelled", run
        assert db.allocations(handle.run_id) == []
        assert site.wait_nothing_left(gang_ids(db, handle.run_id)) == []

    # ---- two runs in one process never close each other's allocations -------------------------------
    def test_two_runs_in_one_process_never_close_each_others_allocations(self, site, tmp_path):
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
        a = workflow(
            "contract-run-a", s={"app": WAIT, "ranks": 1, "params": {"dir": str(tmp_path / "a"), "go": str(go)}}
        )
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
