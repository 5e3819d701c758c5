"""The executor contract for a gang (``px.Gang(N, site=...)``), on every site of the suite.

One gang of N ranks per site serves the module (started by the first test, restarted by
``Gang.run`` after the failure tests); gangs that must be their own (cannot be placed, closed)
are started by their tests.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pandas as pd
import pyarrow as pa
import pytest

import phalanx as px

from . import ranks as R
from .sites import N, pid_alive

FAIL_WITHIN_S = 10.0  # a rank that raises or is killed fails the gang within this


@pytest.fixture(scope="module")
def gang(site):
    g = px.Gang(N, site=site.model(), echo=False)
    yield g
    g.close()


def started(gang: px.Gang) -> list[dict]:
    """The gang's ranks' facts (starting it if it is not running)."""
    return gang.run(R.where)


# ---- a gang of N starts all or nothing and reports where each rank runs ---------------------
def test_a_gang_starts_whole_and_reports_where_each_rank_runs(site, gang):
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


def test_collectives(gang):
    got = gang.run(R.collectives)
    want_sum = [sum(r + 1 for r in range(N)), sum(10 * (r + 1) for r in range(N))]
    want_max = [max((3 * r) % 5 for r in range(N))]
    want_gathered = [bytes([65 + r]) * (5 * r) for r in range(N)]
    want_bcast = {"from": N - 1, "data": list(range(N - 1))}
    for rank, g in enumerate(got):
        assert g == {"sum": want_sum, "max": want_max, "gathered": want_gathered, "bcast": want_bcast}, rank


def test_alltoallv_of_arrow_tables_equals_pandas(gang):
    got = gang.run(R.alltoallv_tables)
    everything = pd.concat([R.rank_table(r).to_pandas() for r in range(N)], ignore_index=True)
    cols = ["src", "key", "value", "name"]
    for dest, table in enumerate(got):
        assert isinstance(table, pa.Table) and table.schema == R.rank_table(0).schema
        want = everything[everything["key"] % N == dest]
        pd.testing.assert_frame_equal(
            table.to_pandas().sort_values(cols).reset_index(drop=True), want.sort_values(cols).reset_index(drop=True)
        )
    assert sum(t.num_rows for t in got) == len(everything)


# ---- closing a gang leaves nothing: no process, job, step, actor or placement group ---------
def test_a_closed_gang_leaves_nothing_behind(site, gang):
    """A standalone gang is its own run: closing it frees everything it made — its ranks, its
    job or step, its actors and placement group, and an allocation it started (a pilot).
    (The module's gang: its site may have no room for another.)"""
    facts = started(gang)
    gang.close()
    assert not gang.running
    assert site.wait_nothing_left([gang.gang_id], facts) == []


# ---- a rank that raises, or is killed, fails the gang fast and is named ---------------------
def test_a_rank_that_raises_fails_the_gang_fast_and_is_named(site, gang):
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


def test_a_rank_killed_by_sigkill_fails_the_gang_fast_and_is_named(site, gang, tmp_path):
    before = started(gang)
    victim = 1
    killed: list[float] = []

    def kill_when_running():
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
def test_a_gang_that_cannot_be_placed_fails_in_time_with_the_resource_managers_reason(site, request_kind):
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


def test_a_gang_that_waits_for_busy_slots_fails_at_its_start_timeout(site, gang):
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


def _start_into(gang: px.Gang, outcome: dict) -> None:
    try:
        gang.start()
        outcome["started"] = time.monotonic()
    except Exception as exc:
        outcome.update(error=exc, failed=time.monotonic())
