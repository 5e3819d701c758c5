"""Runs that do not block: px.submit's RunHandle, `phalanx run --detach` and `phalanx wait`.

Real ranks and drivers; stages wait for a file the test creates (tests/submit_apps.py), so
"still running" is a fact the test controls, never a race it hopes to win."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

import phalanx as px
from phalanx.executors.base import pid_alive
from phalanx.orchestrator.models import Site
from phalanx.orchestrator.rundb import RunDB, wait_exit
from phalanx.orchestrator.yamlio import ConfigError
from phalanx.procs import descendants

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import apps  # noqa: E402
from apps import wf_generate_reference as generated  # noqa: E402
from test_gang import wait_dead  # noqa: E402

SITE = Site(name="t2", cores=2)
ROWS, SEED = 2000, 4


def until(condition, what: str, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {within:g}s"
        time.sleep(0.05)


def gated(d: Path) -> Path:
    """A workflow file: generate (2 ranks, waits for d/go) → totals (2 ranks), per-user sums."""
    spec = {
        "name": "gated",
        "stages": {
            "generate": {
                "app": "submit_apps:gated_generate",
                "ranks": 2,
                "outputs": ["tx"],
                "params": {"rows": ROWS, "seed": SEED, "dir": str(d)},
            },
            "totals": {
                "app": "apps:wf_totals",
                "ranks": 2,
                "inputs": {"tx": {"dataset": "tx", "by": ["user"]}},
                "outputs": ["totals"],
            },
        },
    }
    path = d / "wf.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def rank_pids(d: Path, ranks: int = 2) -> list[int]:
    """The pids the gated stage's ranks wrote once they run its app (waits for them)."""
    files = [d / f"pid.{r}" for r in range(ranks)]
    until(lambda: all(f.exists() and f.read_text() for f in files), "the stage's ranks never started")
    return [int(f.read_text()) for f in files]


def assert_totals_match_pandas(session: str) -> None:
    got = px.Store(session=session).read("totals").to_pandas().sort_values("user").reset_index(drop=True)
    expected = generated(ROWS, 2, seed=SEED).groupby("user", as_index=False)["amount"].sum()
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)


def children() -> set[int]:
    return {p for p in descendants(os.getpid()) if pid_alive(p)}


# ---- px.submit ---------------------------------------------------------------------------------
@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_submit_returns_at_once_and_the_handle_follows_the_run(tmp_path):
    h = px.submit(gated(tmp_path), site=SITE, state=tmp_path / "state")
    assert isinstance(h, px.RunHandle)
    assert not h.done()  # its first stage cannot end before the test creates tmp_path/go
    status = h.status()
    assert (status.run_id, status.state, status.session) == (h.run_id, "running", h.session)
    assert list(status.stages) == ["generate", "totals"]
    rank_pids(tmp_path)
    assert h.wait(timeout=0.5) is False and not h.done()
    status = h.status()
    assert (status.stages["generate"].state, status.stages["totals"].state) == ("running", "pending")
    assert RunDB(tmp_path / "state").run(h.run_id)["state"] == "running"  # what `phalanx status` reads

    (tmp_path / "go").touch()
    assert h.wait(timeout=240)
    result = h.result()
    assert result.ok, result.failed
    assert (result.run_id, result.session, result.state) == (h.run_id, h.session, "succeeded")
    status = h.status()
    assert status.finished and status.state == "succeeded"
    assert {n: s.state for n, s in status.stages.items()} == {"generate": "succeeded", "totals": "succeeded"}
    assert status.stages["generate"].rows == {"tx": ROWS}
    assert status.stages["totals"].rows == {"totals": 50}
    assert_totals_match_pandas(h.session)


def test_cancel_leaves_no_rank_process_and_marks_the_run_cancelled(tmp_path):
    before = children()
    h = px.submit(gated(tmp_path), site=SITE, state=tmp_path / "state")
    pids = rank_pids(tmp_path)
    assert h.cancel() is True
    assert [p for p in pids if pid_alive(p)] == []  # at once: cancel returned after they were gone
    assert children() <= before  # no warm rank, no kept gang either
    assert [a["state"] for a in RunDB(tmp_path / "state").attempts(h.run_id)] == ["cancelled"]
    assert h.done()
    status = h.status()
    assert status.state == "cancelled"
    assert {n: s.state for n, s in status.stages.items()} == {"generate": "cancelled", "totals": "skipped"}
    assert status.stages["totals"].error == "the run was cancelled"  # no upstream stage failed
    result = h.result()
    assert not result.ok and result.failed == {"generate": "cancelled"}
    assert result.state == "cancelled" and result.skipped == ["totals"]  # not alike a failed run


def test_a_failing_stage_gives_a_result_that_is_not_ok(tmp_path):
    wf = px.Workflow("boom", [px.stage(apps.wf_divide_by_zero, name="bad", ranks=2)])
    h = px.submit(wf, site=SITE, state=tmp_path / "state")
    assert h.wait(timeout=240)
    result = h.result()  # a failed run is a result, not an exception
    assert not result.ok and "ZeroDivisionError" in result.failed["bad"]
    assert result.state == "failed"
    assert h.status().state == "failed" and h.status().stages["bad"].state == "failed"
    too_big = px.Workflow("big", [px.stage(apps.wf_mark, name="huge", ranks=9)])
    with pytest.raises(ConfigError, match="9 ranks, but site 't2' can give at most 2"):
        px.submit(too_big, site=SITE, state=tmp_path / "state")
    assert [r["workflow"] for r in RunDB(tmp_path / "state").runs()] == ["boom"]  # nothing started


@pytest.fixture
def procs():
    """Processes a test starts (drivers): stopped by PID if the test ends before they do."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            if not wait_exit(pid, 30):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["ctrl-c in px.run", "exit with a run going"])
def test_ctrl_c_in_px_run_or_leaving_the_interpreter_cancels_the_run(tmp_path, procs, how):
    """px.run keeps its Ctrl-C (the run is cancelled, KeyboardInterrupt raised); a process that
    exits while a handle's run goes on cancels it (gangs stopped at once, not "lost")."""
    script = tmp_path / "pipeline.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(HERE)!r})
        import phalanx as px
        from phalanx.orchestrator.models import Site
        import submit_apps

        wf = px.Workflow("script", [px.stage(submit_apps.gated_generate, name="generate", ranks=2,
                                             params={{"dir": {str(tmp_path)!r}, "rows": 10}})])
        if sys.argv[1] == "exit":
            h = px.submit(wf, site=Site(name="t2", cores=2))
            while not all(os.path.exists(os.path.join({str(tmp_path)!r}, f"pid.{{r}}")) for r in (0, 1)):
                time.sleep(0.05)
            sys.exit(0)
        try:
            px.run(wf, site=Site(name="t2", cores=2), progress=False)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
    """)
    )
    env = {**os.environ, "PHALANX_STATE": str(tmp_path / "state")}
    proc = subprocess.Popen(
        [sys.executable, str(script), how.split()[0]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(proc.pid)
    pids = rank_pids(tmp_path)
    if how.startswith("ctrl-c"):
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)  # the app would wait 120 s for a go that never comes
    assert proc.returncode == (130 if how.startswith("ctrl-c") else 0), err
    assert "interrupted" in out or not how.startswith("ctrl-c")
    assert [p for p in pids if pid_alive(p)] == []
    db = RunDB(tmp_path / "state")
    run = db.runs()[0]
    assert run["state"] == "cancelled" and [s["state"] for s in db.stages(run["id"])] == ["cancelled"]


# ---- phalanx run --detach, phalanx wait -----------------------------------------------------------
@pytest.fixture
def phalanx(tmp_path, capsys, monkeypatch):
    """``phalanx ARGV...`` run in this process (the CLI's own code, without a new interpreter's
    start-up on a busy machine): (exit code, stdout, stderr)."""
    from phalanx.cli import main

    monkeypatch.setenv("PHALANX_STATE", str(tmp_path / "state"))

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def detach(tmp_path: Path, procs: list[int]) -> tuple[str, int]:
    """`phalanx run --detach`, a real command started in a terminal session of its own that then
    ends: the run id and the driver's pid."""
    env = {**os.environ, "PYTHONPATH": str(HERE), "PHALANX_STATE": str(tmp_path / "state")}
    terminal = subprocess.Popen(
        ["setsid", sys.executable, "-m", "phalanx.cli", "run", str(gated(tmp_path)), "--detach"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = terminal.communicate(timeout=300)
    assert terminal.returncode == 0, err
    run_id = out.strip()
    run = RunDB(tmp_path / "state").run(run_id)  # in the run DB before the id was printed
    assert run is not None and run["state"] == "running", (out, err)
    procs.append(run["pid"])
    assert f"log: {tmp_path / 'state' / 'drivers' / run_id}.log" in err
    with pytest.raises(ProcessLookupError):  # the terminal's session ended with nothing left in it
        os.killpg(terminal.pid, signal.SIGHUP)
    assert os.getsid(run["pid"]) == run["pid"]  # the driver leads a session of its own
    return run_id, run["pid"]


@pytest.mark.slow  # the core lane stays under 5 minutes; CI's slow lane runs it
def test_a_detached_run_outlives_its_terminal_and_wait_reports_it(tmp_path, procs, phalanx):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nstages:\n  a:\n    app: apps:wf_mark\n    ranks: 0\n")
    code, out, err = phalanx("run", str(bad), "--detach")  # reported here, before detaching
    assert code == 2 and "stages.a.ranks: must be ≥ 1" in err
    assert RunDB(tmp_path / "state").runs() == []

    run_id, driver = detach(tmp_path, procs)
    code, out, err = phalanx("status", run_id)
    assert code == 0 and f"run {run_id}: gated — running" in out
    rank_pids(tmp_path)
    code, out, err = phalanx("wait", run_id, "--timeout", "0.5")
    assert code == 124 and f"run {run_id} still running" in out

    (tmp_path / "go").touch()
    code, out, err = phalanx("wait", run_id, "--timeout", "240")
    assert code == 0 and f"run {run_id} succeeded" in out, out + err
    assert_totals_match_pandas(RunDB(tmp_path / "state").run(run_id)["session"])
    assert wait_exit(driver, 60)  # the driver ends with its run
    log = tmp_path / "state" / "drivers" / f"{run_id}.log"
    assert oct(log.stat().st_mode & 0o777) == oct(0o600) and oct(log.parent.stat().st_mode & 0o777) == oct(0o700)
    code, out, err = phalanx("logs", run_id, "--driver")
    assert code == 0 and f"run {run_id} succeeded" in out and "totals: 50 rows" in out


@pytest.mark.slow  # kept out of the core lane's 5 minutes: two detached drivers killed or cancelled mid-run
@pytest.mark.parametrize("how", ["kill -9", "phalanx cancel"])
def test_wait_on_a_detached_run_whose_driver_is_killed_or_cancelled(tmp_path, procs, phalanx, how):
    run_id, driver = detach(tmp_path, procs)
    pids = rank_pids(tmp_path)
    if how == "kill -9":
        os.kill(driver, signal.SIGKILL)
    else:
        code, out, err = phalanx("cancel", run_id)
        assert code == 0 and f"run {run_id} cancelled" in out, err
    code, out, err = phalanx("wait", run_id, "--timeout", "120")
    assert code == 1, out + err
    if how == "kill -9":
        assert f"run {run_id} lost" in out and f"driver process {driver} is gone" in err
    else:
        assert f"run {run_id} cancelled" in out
    assert f"--resume {run_id}" in err
    assert wait_dead(pids, within=30) == []  # the ranks left with their driver
