"""Faults in one rank of a local gang: it hangs, it eats memory, it is killed mid-shuffle."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from test_gang import wait_dead

import phalanx as px
from phalanx.executors.local import LocalLauncher

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks need not import this module

GIB = 1 << 30


def wait_for(what: str, check, within: float) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {within}s")
        time.sleep(0.02)


# ---- a rank that hangs --------------------------------------------------------------------
def app_rank1_hangs(env):
    while env.rank == 1:
        time.sleep(0.1)
    return env.rank


def test_hung_rank_is_named_when_the_stage_times_out(fault):
    fault.describe("a rank hangs (stage timeout 3 s)")
    with px.Gang(ranks=3, echo=False) as gang:
        pids = list(gang.pids)
        t0 = time.monotonic()
        with pytest.raises(px.GangError) as info:
            gang.run(app_rank1_hangs, timeout=3)
        took = time.monotonic() - t0
    msg = str(info.value)
    assert ("rank 1 did not manage to finish within the stage timeout (timeout=3s); ranks 0, 2 finished") in msg, msg
    assert f"logs in {gang.log_dir}" in msg
    assert 3 <= took < 5, took
    assert wait_dead(pids) == []
    fault.detected(took)
    fault.outcome("GangError names the hung rank and the stage timeout; every rank stopped")
    fault.data_lost("none (the stage fails; nothing was sealed)")


# ---- a rank that eats memory --------------------------------------------------------------
def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def app_rank1_eats_memory(env, limit: int, under_log: str):
    """Rank 1 allocates 64 MiB at a time up to 3x its limit (the machine stays safe even with
    no enforcement), logging when it was last under the limit; rank 0 waits for it in a
    barrier, as a BSP peer would."""
    hoard = []
    with open(under_log, "a", buffering=1) as log:
        while env.rank == 1 and len(hoard) * (64 << 20) < 3 * limit:
            if rss_anon() <= limit:
                log.write(f"{time.time()}\n")
            hoard.append(np.ones(8 << 20))  # 64 MiB, touched
    env.comm.barrier()
    return "survived"


def test_rank_over_its_memory_limit_is_killed_and_named(fault, tmp_path):
    fault.describe("one rank allocates until killed (per-rank limit 1 GiB)")
    limit = 1 * GIB
    under_log = tmp_path / "under-limit"
    launcher = LocalLauncher(echo=False, mem_limit_bytes=limit)
    with px.Gang(ranks=2, executor=launcher) as gang:
        pids = list(gang.pids)
        with pytest.raises(px.RankError) as info:
            gang.run(app_rank1_eats_memory, limit, str(under_log))
        failed_at = time.time()
    err = info.value
    assert err.first.rank == 1, str(err)
    assert err.first.message.startswith("rank process killed by signal SIGKILL — over its memory limit of 1 GiB"), (
        err.first.message
    )
    last_under = float(under_log.read_text().split("\n")[-2])  # the last whole line
    took = failed_at - last_under  # from the last moment under the limit: ≥ time to detect
    assert took < 3, took
    assert wait_dead(pids) == []
    fault.detected(took)
    fault.outcome(f"RankError: {err.first.summary()}")
    fault.data_lost("none (the stage fails; nothing was sealed)")


# ---- a rank killed mid-shuffle of a real merge ---------------------------------------------
def tables(rank: int, rows: int = 20_000) -> tuple[pa.Table, pa.Table]:
    rng = np.random.default_rng(rank)
    left = pa.table({"key": rng.integers(0, rows, rows), "a": rng.random(rows)})
    right = pa.table({"key": rng.integers(0, rows, rows // 2), "b": rng.integers(0, 100, rows // 2)})
    return left, right


def app_merge(env, hold_file: str | None = None):
    """A shuffle merge; with ``hold_file``, rank 1 stops inside its first exchange (the others
    are in the collective, waiting for it), creates ``hold_file`` and waits to be killed."""
    if hold_file and env.rank == 1:
        exchange = env.comm.exchange_tables  # what a shuffle calls (Gloo's own path or shared memory)

        def held(*args, **kwargs):
            Path(hold_file).touch()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                time.sleep(0.05)
            return exchange(*args, **kwargs)

        env.comm.exchange_tables = held
    left, right = (px.DataFrame.from_arrow(t, env) for t in tables(env.rank))
    return left.merge(right, on="key", broadcast=False).collect(root=0)


SITES = [
    pytest.param(None, id="local"),
    pytest.param("slurm-local", id="slurm", marks=pytest.mark.slurm),
    pytest.param("ray-local", id="ray", marks=pytest.mark.ray),
]


@pytest.fixture
def site(request, monkeypatch):
    """The site a gang runs on (its cluster started by the session's fixture)."""
    name = request.param
    if name == "slurm-local":
        request.getfixturevalue("slurm_cluster")
    elif name == "ray-local":
        monkeypatch.setenv("RAY_ADDRESS", request.getfixturevalue("ray_cluster").address)
    return name


@pytest.mark.parametrize("site", SITES, indirect=True)
def test_rank_killed_mid_shuffle_fails_fast_and_a_rerun_is_right(fault, tmp_path, site):
    fault.describe("SIGKILL one rank mid-shuffle of a merge", backend=site.split("-")[0] if site else "local")
    hold = tmp_path / "held"
    killed_at: list[float] = []

    def kill_when_held(pid: int) -> None:  # from outside the gang, as an operator or the kernel would
        wait_for("rank 1 inside its exchange", hold.exists, 60)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    with px.Gang(ranks=3, echo=False, site=site) as gang:
        pids = list(gang.pids)
        threading.Thread(target=kill_when_held, args=(pids[1],), daemon=True).start()
        with pytest.raises(px.RankError) as info:
            gang.run(app_merge, str(hold))
        took = time.monotonic() - killed_at[0]
    err = info.value
    assert err.first.rank == 1, str(err)
    if site is None:  # the local launcher watches its ranks' memory: it says why a rank died
        assert "killed by signal SIGKILL" in err.first.message, str(err)
        assert "not out of memory: the kernel recorded no OOM kill" in err.first.message
    assert took < 2, took
    assert wait_dead(pids) == []

    with px.Gang(ranks=3, echo=False, site=site) as fresh:
        out = fresh.run(app_merge)[0].to_pandas()
    parts = [tables(r) for r in range(3)]
    left = pd.concat([p[0].to_pandas() for p in parts])
    right = pd.concat([p[1].to_pandas() for p in parts])
    expected = left.merge(right, on="key")
    cols = ["key", "a", "b"]
    pd.testing.assert_frame_equal(
        out[cols].sort_values(cols).reset_index(drop=True), expected[cols].sort_values(cols).reset_index(drop=True)
    )
    fault.detected(took)
    fault.outcome("RankError names the killed rank first; a fresh gang's rerun equals pandas")
    fault.data_lost("none")
