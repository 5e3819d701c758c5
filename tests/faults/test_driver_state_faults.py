"""The driver and its state directory under faults: a reused driver pid, many processes opening a
new state directory at once, a full state directory, signals to ``phalanx run`` and to
``--detach``, and what ``ps`` shows of a detached driver.

Each test runs the real CLI (``python -m phalanx.cli``) in processes of its own; this module
stops and kills only processes it started, by PID, and unmounts the tmpfs it mounts.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_driver_death import wait_for

from phalanx.orchestrator.rundb import RunDB

TESTS = Path(__file__).resolve().parents[1]
PHALANX = [sys.executable, "-m", "phalanx.cli"]


def env_for(state: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(TESTS), str(TESTS / "faults"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        ),
        "PHALANX_STATE": str(state),
        **extra,
    }


def cli(state: Path, *args: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PHALANX, *args], env=env_for(state, **extra), capture_output=True, text=True, timeout=timeout
    )


# ---- 16. many processes open a new state directory at once ---------------------------------
OPEN_AT_ONCE = """
import sys, time
from pathlib import Path

import pytest
from phalanx.orchestrator.rundb import RunDB
state, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ready.touch()
while not go.exists():  # released together: every process opens the new database at once
    time.sleep(0.001)
RunDB(state)
"""


def test_processes_opening_a_new_state_directory_at_once_all_succeed(tmp_path, fault):
    """8 processes, imports done, released by one file: each opens the same new ``PHALANX_STATE``
    (3 rounds, a new directory each).  Before: 1-3 of 8 died with "duplicate column name: pid"
    (the schema's ALTER TABLE raced) or "database is locked" (setting WAL mode raced)."""
    fault.describe("8 processes open a new state directory at once (x3)")
    script = tmp_path / "open.py"
    script.write_text(OPEN_AT_ONCE)
    failures = []
    for round_ in range(3):
        state, go = tmp_path / f"state-{round_}", tmp_path / f"go-{round_}"
        ready = [tmp_path / f"ready-{round_}-{i}" for i in range(8)]
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(state), str(r), str(go)],
                env=env_for(state),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in ready
        ]
        try:
            wait_for("every process ready", lambda: all(r.exists() for r in ready), 120)  # noqa: B023
            go.touch()
            for p in procs:
                out, _ = p.communicate(timeout=120)
                if p.returncode:
                    failures.append(f"round {round_}, pid {p.pid}: exit {p.returncode}: {out.strip()[-300:]}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        con = sqlite3.connect(state / "runs.sqlite")
        cols = {r[1] for r in con.execute("PRAGMA table_info(runs)")}
        con.close()
        assert {"pid", "host"} <= cols, cols
    assert failures == []
    fault.outcome("24 of 24 processes opened the new run DB; the schema is whole")
    fault.data_lost("none")


# ---- 15. a dead driver's pid given to another process ----------------------------------------
RECORD_AND_WAIT = """
import sys, time
from phalanx.orchestrator.rundb import RunDB
run_id, _ = RunDB(sys.argv[1]).new_run("reused", "wf.yaml", "local", None, {"a": 1})
print(run_id, flush=True)
time.sleep(600)
"""


def spawn_with_pid(pid: int, argv: list[str]) -> subprocess.Popen:
    """``argv`` started as process ``pid`` (free again): the kernel's next pid set through
    /proc/sys/kernel/ns_last_pid (root), tried until no other fork of this host came between."""
    try:
        for _ in range(200):
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
            proc = subprocess.Popen(argv, start_new_session=True)
            if proc.pid == pid:
                return proc
            proc.kill()
            proc.wait()
    except OSError as exc:
        pytest.skip(f"cannot choose the next pid (/proc/sys/kernel/ns_last_pid needs root): {exc}")
    pytest.skip(f"pid {pid} could not be had in 200 tries (other processes forking)")


@pytest.mark.parametrize("record", ["current", "older"])
def test_cancel_never_signals_the_process_a_dead_drivers_pid_was_given_to(tmp_path, fault, record):
    """A driver records its run and is SIGKILLed; the kernel gives its pid to a new process
    (``sleep``, through ns_last_pid).  ``phalanx status`` must not show the run "running" and
    ``phalanx cancel`` must not signal the sleeper.  ``older``: the record has no start time or
    boot id (an older phalanx wrote it): status says it cannot tell, cancel refuses (exit 1).
    Before: status said "running" and cancel SIGTERMed the sleeper."""
    fault.describe(f"a dead driver's pid reused, {record} run record")
    state = tmp_path / "state"
    RunDB(state)
    driver = subprocess.Popen(
        [sys.executable, "-c", RECORD_AND_WAIT, str(state)], env=env_for(state), stdout=subprocess.PIPE, text=True
    )
    run_id = driver.stdout.readline().strip()
    driver.kill()
    driver.wait()
    assert run_id, "the driver recorded no run"
    con = sqlite3.connect(state / "runs.sqlite")
    if record == "older" and "pid_started" in {r[1] for r in con.execute("PRAGMA table_info(runs)")}:
        con.execute("UPDATE runs SET pid_started=NULL, boot_id=NULL WHERE id=?", (run_id,))
        con.commit()
    con.close()
    other = spawn_with_pid(driver.pid, ["sleep", "300"])
    try:
        status = cli(state, "status", run_id)
        cancel = cli(state, "cancel", run_id, "--wait", "5")
        time.sleep(0.2)
        alive = other.poll() is None
        assert alive, f"phalanx cancel signalled process {other.pid}, not the run's driver: {cancel}"
        if record == "current":
            assert f"run {run_id}: reused — lost" in status.stdout, status
            assert cancel.returncode == 0 and f"run {run_id} is already lost" in cancel.stdout, cancel
            gone = [e["message"] for e in RunDB(state).events(run_id) if e["kind"] == "lost"]
            assert gone == [
                f"driver process {driver.pid} is gone (pid {driver.pid} now belongs to a process that is not "
                "the run's driver)"
            ]
        else:
            assert f"run {run_id}: reused — running? (unknown" in status.stdout, status
            assert "may be the driver or another process given the pid since" in status.stdout, status
            assert cancel.returncode == 1 and "it was not signalled" in cancel.stderr, cancel
    finally:
        other.kill()
        other.wait()
    fault.detected(0.0)
    fault.outcome(
        "run lost, the pid's new owner untouched"
        if record == "current"
        else "status: cannot tell; cancel refused (exit 1), the pid's owner untouched"
    )
    fault.data_lost("none")
