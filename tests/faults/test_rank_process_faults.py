"""Faults around a rank's process: who may talk to the driver's control port, where a rank's
output goes (a full log disk, an over-long line, the stage it belongs to), and what a rank
leaves behind (processes its app started)."""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from test_gang import wait_dead

import phalanx as px
from phalanx.executors.control import ControlServer
from phalanx.executors.logs import MAX_LINE, RankOutput
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow
from phalanx.procs import pid_alive
from phalanx.runtime import netio

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks need not import this module


def app_rank(env):
    return env.rank


# ---- 13: a connection to the control port that says nothing ------------------------------------
@pytest.fixture
def silent_peer(monkeypatch):
    """Each control server made while the test runs gets, at once, a TCP connection that says
    nothing (another user's, before any rank connects); the list of those sockets."""
    silent: list[socket.socket] = []
    init = ControlServer.__init__

    def connect_first(self, *args, **kwargs):
        init(self, *args, **kwargs)
        host, _, port = self.address.rpartition(":")
        silent.append(socket.create_connection((host, int(port))))

    monkeypatch.setattr(ControlServer, "__init__", connect_first)
    yield silent
    for s in silent:
        s.close()


def test_a_silent_connection_to_the_control_port_does_not_hold_up_the_gangs_start(fault, monkeypatch, silent_peer):
    """Another user connects to the driver's control port and says nothing: every rank still
    registers (each handshake runs in a thread of its own, bounded by HANDSHAKE_S) and the gang
    starts while the silent connection is still open and unanswered."""
    fault.describe("a silent TCP connection to the driver's control port before the ranks connect")
    monkeypatch.setattr(netio, "HANDSHAKE_S", 120.0)  # the silent peer's slot outlasts the gang's start
    t0 = time.monotonic()
    with px.Gang(ranks=2, echo=False, start_timeout=60) as gang:
        took = time.monotonic() - t0
        assert gang.run(app_rank, timeout=60) == [0, 1]
        # the silent connection is still in its handshake: open, the challenge unanswered
        assert silent_peer[0].recv(1024, socket.MSG_DONTWAIT), "the driver closed the silent connection"
    assert took < 30, took
    fault.detected(0.0)
    fault.outcome(f"the gang started in {took:.1f} s while the silent connection stayed open")
    fault.data_lost("none")


def test_ranks_refused_while_every_handshake_slot_is_taken_connect_again(fault, monkeypatch, silent_peer):
    """Every handshake slot of the control port is taken (here: one slot, one silent peer):
    a rank whose connection is cut short tries again, and the gang starts once the slot
    is free (HANDSHAKE_S, 2 s here), instead of failing."""
    fault.describe("the control port's handshake slots are all held by silent connections")
    monkeypatch.setattr(netio, "HANDSHAKE_S", 2.0)
    monkeypatch.setattr(netio, "MAX_PENDING", 1)
    t0 = time.monotonic()
    with px.Gang(ranks=2, echo=False, start_timeout=60) as gang:
        took = time.monotonic() - t0
        assert gang.run(app_rank, timeout=60) == [0, 1]
    assert silent_peer, "no silent connection was made"
    fault.detected(0.0)
    fault.outcome(f"the ranks connected again and the gang started in {took:.1f} s")
    fault.data_lost("none")


# ---- 17: a full rank-log directory -------------------------------------------------------------
@pytest.fixture
def tiny_log_fs(tmp_path, monkeypatch):
    """A 1 MiB tmpfs as PHALANX_LOG_DIR (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    root = tmp_path / "logs"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(root)], capture_output=True, text=True
    )
    if mounted.returncode != 0:  # root without CAP_SYS_ADMIN (an unprivileged container)
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    monkeypatch.setenv("PHALANX_LOG_DIR", str(root))
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def fill(path: Path) -> None:
    """Write ``path`` until the file system is full."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def app_prints(env, lines: int, text: str):
    for i in range(lines):
        print(f"{text} {i} " + "." * 1000)
    return env.rank


def test_a_full_log_directory_does_not_hang_the_stage_and_says_what_was_lost(fault, tiny_log_fs, caplog):
    """The rank-log file system fills up: the driver goes on draining the ranks' output (no rank
    blocks on a full pipe), warns naming the log file and ENOSPC, and once the log can be
    written again it says how many lines are missing."""
    fault.describe("the rank-log directory's file system is full (1 MiB tmpfs)")
    with px.Gang(ranks=2, echo=False) as gang:
        fill(tiny_log_fs / "filler")
        t0 = time.monotonic()
        assert gang.run(app_prints, 2000, "lost", timeout=60) == [0, 1]  # 2 MB a rank, far over the pipe's 64 KiB
        took = time.monotonic() - t0
        log0 = gang.log_dir / "rank-0.log"
        assert f"cannot write rank 0's output to {log0}: [Errno 28] No space left on device (ENOSPC)" in caplog.text
        (tiny_log_fs / "filler").unlink()
        assert gang.run(app_prints, 1, "after", timeout=60) == [0, 1]
    text = log0.read_text()
    assert re.search(
        r"\[phalanx: \d+ line\(s\), \d+ bytes, of output were lost here: the log could not be written\]", text
    ), text[-2000:]
    assert "after 0 " in text
    fault.detected(took)
    fault.outcome("the stage finished; a warning named the full log and ENOSPC; the log counts the lines lost")
    fault.data_lost("rank output lines while the log's file system was full (counted in the log)")


# ---- 18: one over-long line of output ----------------------------------------------------------
def stage_log(db: RunDB, run_id: str, stage: str) -> bytes:
    """Rank 0's log of ``stage`` (b"": it wrote none)."""
    path = Path(db.attempts(run_id, stage)[-1]["log_dir"]) / "rank-0.log"
    return path.read_bytes() if path.exists() else b""


def test_an_over_long_line_is_cut_and_stays_in_the_log_of_the_stage_that_wrote_it(fault, tmp_path, monkeypatch):
    """A 20 MB line (over MAX_LINE): the driver's pump keeps its first MAX_LINE bytes and a note
    of how much was cut (what it holds is bounded), and the line — and what the stage printed
    after it — is in that stage's log, not in the log of the next stage, which reuses the gang."""
    fault.describe("a rank prints one 20 MB line, then the next stage runs on the same gang")
    write = RankOutput.write

    def slow_for_long_lines(self, rank, line):  # as a disk writing a 300 MB line is: the pump lags
        if line.startswith(b"xxx"):
            time.sleep(1.0)
        write(self, rank, line)

    monkeypatch.setattr(RankOutput, "write", slow_for_long_lines)
    db = RunDB(tmp_path / "state")
    size = 20 << 20
    wf = Workflow(
        name="long",
        stages={
            "a": Stage(app="fault_apps:print_long_line", ranks=2, params={"size": size}),
            "b": Stage(app="fault_apps:print_line", ranks=2, needs=["a"], params={"text": "stage b"}),
        },
    )
    result = run_workflow(wf, Site(name="t", cores=2), db=db)
    assert result.ok, result.failed
    said = [e["message"] for e in db.events(result.run_id) if e["stage"] == "b" and e["kind"] == "start"]
    assert said and "the gang of the previous stage" in said[0], said  # the gang was reused
    a_lines = stage_log(db, result.run_id, "a").splitlines()
    b_text = stage_log(db, result.run_id, "b")
    assert b"x" not in b_text and b_text.strip() == b"stage b", b_text[:200]  # nothing of stage a
    cut = size - MAX_LINE
    long = [line for line in a_lines if line.startswith(b"xxx")]
    assert len(long) == 1, [line[:80] for line in a_lines]
    assert (
        long[0]
        == b"x" * MAX_LINE + f" [phalanx: {cut} more bytes of this line not kept: a log line keeps {MAX_LINE}]".encode()
    )
    assert b"long line done" in a_lines
    fault.detected(0.0)
    fault.outcome(f"the line was cut to {MAX_LINE} bytes with a note, in the log of the stage that printed it")
    fault.data_lost(f"{cut} bytes of the over-long line (said in the log)")


# ---- 19: processes an app starts ---------------------------------------------------------------
def children_of(where: Path) -> list[int]:
    return [int(pid) for f in sorted(where.glob("*.children")) for pid in f.read_text().split()]


def assert_gone(where: Path, count: int) -> None:
    """The ``count`` processes whose pids the ranks wrote to ``where`` are gone (or going: 5 s
    for a SIGKILL already sent to land)."""
    pids = children_of(where)
    assert len(pids) == count, pids
    assert wait_dead(pids, within=5.0) == []


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "fails"])
@pytest.mark.parametrize("how", ["gang", "workflow"])
def test_nothing_a_rank_started_outlives_its_stage(fault, tmp_path, how, fails):
    """Each rank starts ``sleep 299`` twice, once in a session of its own (setsid): when the
    stage ends — succeeded, or failed with rank 1's exception while rank 0 waits in a barrier —
    none of them is left, under px.Gang and under a workflow on the local executor."""
    fault.describe(
        f"each rank starts two children (one setsid'd), the stage {'fails' if fails else 'succeeds'} ({how})"
    )
    params = {"dir": str(tmp_path), "fail": fails}
    if how == "gang":
        with px.Gang(ranks=2, echo=False) as gang:
            if fails:
                with pytest.raises(px.RankError, match="rank 1 fails on purpose"):
                    gang.run("fault_apps:start_children", params=params, timeout=60)
            else:
                gang.run("fault_apps:start_children", params=params, timeout=60)
                pids = children_of(tmp_path)
                assert len(pids) == 4, pids
                left = [p for p in pids if pid_alive(p)]
                assert left == [], left  # gone before the results reached the driver
    else:
        wf = Workflow(name="kids", stages={"s": Stage(app="fault_apps:start_children", ranks=2, params=params)})
        result = run_workflow(wf, Site(name="t", cores=2), db=RunDB(tmp_path / "state"))
        assert result.ok is not fails, result.failed
    assert_gone(tmp_path, 4)
    fault.detected(0.0)
    fault.outcome("every process the ranks started was gone when the stage ended")
    fault.data_lost("none")


def test_a_command_stages_background_job_does_not_outlive_it(fault, tmp_path):
    """A command that leaves a job running in the background (``sleep 299 &``) and exits 0: the
    job, in the command's process group, is gone when the stage ends."""
    fault.describe("a command stage leaves a background job and succeeds")
    script = f"sleep 299 & echo $! > {tmp_path}/cmd.$PHALANX_RANK.children"
    px.Gang(ranks=2, echo=False).run_command(["sh", "-c", script], timeout=60)
    assert_gone(tmp_path, 2)
    fault.detected(0.0)
    fault.outcome("the background jobs were killed with the command's process group")
    fault.data_lost("none")
