"""The driver and its state directory under faults: a reused driver pid, many processes opening a
new state directory at once, a full state directory, signals to ``phalanx run`` and to
``--detach``, and what ``ps`` shows of a detached driver.

Each test runs the real CLI (``python -m phalanx.cli``) in processes of its own; this module
stops and kills only processes it started, by PID, and unmounts the tmpfs it mounts.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import test_store_faults
from test_driver_death import wait_for

from phalanx.orchestrator.rundb import RunDB

small_tmpfs = test_store_faults.small_tmpfs  # a fixture: a 20 MB tmpfs, mounted for a test, unmounted after

TESTS = Path(__file__).resolve().parents[1]
PHALANX = [sys.executable, "-m", "phalanx.cli"]


def first_stage_state(db: RunDB) -> str | None:
    """The first stage's state of the first run, or None until the driver has recorded both (it
    writes the run's row before its stages' rows)."""
    runs = db.runs()
    stages = db.stages(runs[0]["id"]) if runs else []
    return stages[0]["state"] if stages else None


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
            assert "running?" in cli(state, "status").stdout
            assert cancel.returncode == 1 and "it was not signalled" in cancel.stderr, cancel
            from phalanx.integrations.airflow._runs import cancel_run  # the Airflow provider's kill

            with pytest.raises(RuntimeError, match="nothing was signalled"):
                cancel_run(run_id, state, wait=5)
        if record == "current":
            from phalanx.integrations.airflow._runs import cancel_run

            assert cancel_run(run_id, state, wait=5) == "lost"
        assert other.poll() is None, f"a cancel signalled process {other.pid}, not the run's driver"
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


# ---- 20. signals: a second SIGTERM during a cancel; Ctrl-C on `run --detach` -----------------
def hold_workflow(tmp: Path, file: Path) -> Path:
    """One stage of 2 ranks that runs until ``file`` exists (at most 120 s)."""
    wf = tmp / "wf.yaml"
    wf.write_text(
        textwrap.dedent(f"""\
        name: signals
        stages:
          hold:
            app: fault_apps:wait_for_file
            ranks: 2
            params: {{file: {file}, limit: 120}}
        """)
    )
    return wf


def test_a_second_sigterm_during_a_cancel_exits_130_with_one_message(tmp_path, fault):
    """``phalanx run`` gets SIGTERM (``phalanx cancel``'s) while its stage runs, then two more
    while it stops the gangs.  Before: two chained KeyboardInterrupt tracebacks, exit -2."""
    fault.describe("SIGTERM x3 to `phalanx run` while it cancels")
    state = tmp_path / "state"
    wf = hold_workflow(tmp_path, tmp_path / "never")
    out = open(tmp_path / "run.out", "w+")
    proc = subprocess.Popen([*PHALANX, "run", str(wf), "--plain"], env=env_for(state), stdout=out, stderr=out)
    try:
        db = RunDB(state)
        wait_for("the stage running", lambda: first_stage_state(db) == "running", 120)
        time.sleep(0.5)  # its ranks started
        t0 = time.monotonic()
        for _ in range(3):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.seek(0)
    text = out.read()
    assert code == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert text.count("cancelled: every gang was stopped") == 1, text
    assert db.runs()[0]["state"] == "cancelled"
    fault.detected(time.monotonic() - t0)
    fault.outcome("exit 130, one message, the run cancelled")
    fault.data_lost("none")


def test_ctrl_c_on_run_detach_stops_its_driver_and_leaves_no_starting_log(tmp_path, fault):
    """Ctrl-C (SIGINT) on ``phalanx run --detach`` once its driver process exists, before the run
    id came: the driver is stopped (nothing runs that the user has no id for), one message, exit
    130, no ``drivers/.starting-*.log``.  Before: a traceback, no run id, the run went on."""
    from phalanx.procs import descendants, pid_alive

    fault.describe("Ctrl-C on `phalanx run --detach` while its driver starts")
    state = tmp_path / "state"
    wf = hold_workflow(tmp_path, tmp_path / "never")
    starter = subprocess.Popen(
        [*PHALANX, "run", str(wf), "--detach"], env=env_for(state), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    drivers: list[int] = []
    try:
        drivers = wait_for("the driver process", lambda: descendants(starter.pid), 120, poll=0.005)
        t0 = time.monotonic()
        starter.send_signal(signal.SIGINT)
        out, err = starter.communicate(timeout=120)
        wait_for("the driver to end", lambda: not any(pid_alive(p) for p in drivers), 30)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        for pid in drivers:  # a driver the test started (through the starter), by PID
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    err_text = err.decode()
    assert starter.returncode == 130, (out, err_text)
    assert "Traceback" not in err_text and "interrupted: the detached driver was stopped" in err_text, err_text
    assert [p.name for p in (state / "drivers").glob(".*")] == []  # no .starting- log, no .overrides-
    assert [r["state"] for r in RunDB(state).runs() if r["state"] == "running"] == []
    fault.detected(time.monotonic() - t0)
    fault.outcome("driver stopped, exit 130, one message, no .starting- log")
    fault.data_lost("none")


# ---- 21 (part). a detached driver's command line -----------------------------------------
def test_a_detached_drivers_command_line_shows_no_set_value(tmp_path, fault):
    """``--set`` values reach a detached driver, but not through its command line (``ps``
    shows that to every user for the whole run).  The override names the file the stage waits
    for: the run ends only if the driver got it.  Before: ``--set=...`` in its argv."""
    fault.describe("`run --detach --set`: what ps shows of the driver")
    state = tmp_path / "state"
    go = tmp_path / "go-SECRET-4711"
    wf = hold_workflow(tmp_path, tmp_path / "never")
    started = cli(state, "run", str(wf), "--detach", "--set", f"stages.hold.params.file={go}", timeout=300)
    assert started.returncode == 0, started
    run_id = started.stdout.strip()
    db = RunDB(state)
    pid = db.run(run_id)["pid"]
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            argv = f.read().split("\0")
        assert not any("SECRET" in a or a.startswith("--set") for a in argv), argv
        assert [p.name for p in (state / "drivers").glob(".*")] == []  # the overrides file: read, removed
        go.touch()
        waited = cli(state, "wait", run_id, "--timeout", "120", timeout=200)
        assert waited.returncode == 0, waited
    finally:
        if db.run(run_id)["state"] == "running":
            cli(state, "cancel", run_id)
    fault.outcome("the override applied; the driver's argv names only a removed 0600 file")
    fault.data_lost("none")


# ---- 17 (first half). the state directory's file system full ------------------------------
def fill(directory: Path) -> Path:
    """A file in ``directory`` grown until its file system has no byte left."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    return filler


def test_a_full_state_directory_fails_the_run_naming_it_and_status_and_logs_still_work(small_tmpfs, tmp_path, fault):
    """The state directory on a 20 MB tmpfs, filled while a stage runs; the stage then ends and
    the driver's next run DB write fails.  The driver says which file and that its file system
    is full (no traceback), stops its gangs and exits 1; ``phalanx status`` (list and run) and
    ``phalanx logs`` work while the disk is still full and show the run lost; once there is
    room a status records it.  Before: raw "disk I/O error" tracebacks naming no path, and
    status and logs crashed with them while the disk was full."""
    from phalanx.procs import descendants, pid_alive

    fault.describe("the state directory's file system full while a stage runs (20 MB tmpfs)")
    state = small_tmpfs / "state"
    go = tmp_path / "go"
    wf = hold_workflow(tmp_path, go)
    out = open(tmp_path / "run.out", "w+")
    proc = subprocess.Popen([*PHALANX, "run", str(wf), "--plain"], env=env_for(state), stdout=out, stderr=out)
    ranks: list[int] = []
    try:
        db = RunDB(state)
        wait_for("the stage running", lambda: first_stage_state(db) == "running", 120)
        run_id = db.runs()[0]["id"]
        ranks = wait_for("its ranks", lambda: len(descendants(proc.pid)) >= 2 and descendants(proc.pid), 60)
        filler = fill(small_tmpfs)
        t0 = time.monotonic()
        go.touch()  # the stage ends: the driver records it (and cannot)
        code = proc.wait(timeout=120)
        wait_for("no rank process left", lambda: not any(pid_alive(p) for p in ranks), 30)
        out.seek(0)
        text = out.read()
        assert code == 1, text
        assert "Traceback" not in text, text
        assert f"phalanx run: the run database {state / 'runs.sqlite'}: " in text, text
        assert "the file system holding it is full" in text and f"--resume {run_id}" in text, text
        assert shutil.disk_usage(small_tmpfs).free < 65536, "the tmpfs is no longer full: the test proves nothing"
        for args in (["status"], ["status", run_id], ["logs", run_id]):
            r = cli(state, *args)
            assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r)
        listed = cli(state, "status").stdout
        assert run_id in listed and ("lost" in listed or "failed" in listed), listed
        filler.unlink()
        assert cli(state, "status", run_id).returncode == 0
        con = sqlite3.connect(state / "runs.sqlite")
        recorded = con.execute("SELECT state FROM runs WHERE id=?", (run_id,)).fetchone()[0]
        con.close()
        assert recorded in ("lost", "failed"), recorded
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in ranks:  # ranks the test's driver started, by PID
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    fault.detected(time.monotonic() - t0)
    fault.outcome(
        "driver: one line naming the file and the full file system, exit 1, no rank left; "
        "status and logs worked while full; the run recorded lost once there was room"
    )
    fault.data_lost("none (the run resumes)")
