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
from pathlib import Path

from test_driver_death import wait_for

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
