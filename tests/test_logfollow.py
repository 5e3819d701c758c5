"""Following a run's rank logs while it runs: ``LogCursor`` over files being appended, and
``phalanx logs RUN --follow`` from another process against a run in progress."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from phalanx.executors.logs import MAX_LINE
from phalanx.orchestrator.logfollow import FileTail, LogCursor, LogLine, follow, follow_file
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import prepare_run


@pytest.fixture
def db(tmp_path):
    return RunDB(tmp_path / "state")


def append(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        f.write(data)


def texts(lines: list[LogLine]) -> list[tuple[str, int, int | None, str]]:
    return [(x.stage, x.attempt, x.rank, x.text) for x in lines]


def test_cursor_partial_lines_missing_files_new_attempts_and_stages(db, tmp_path):
    run_id, _ = db.new_run("wf", "<python>", "local", None, {"a": 2, "b": 1})
    a1 = db.log_dir(run_id, "a", 1)
    cursor = LogCursor(db, run_id)
    assert cursor.read() == []  # no attempt yet
    db.start_attempt(run_id, "a", 1, "", str(a1))
    assert cursor.read() == [] and not cursor.behind  # its directory does not exist yet
    append(a1 / "rank-0.log", b"one\ntwo\npart")
    assert texts(cursor.read()) == [("a", 1, 0, "one"), ("a", 1, 0, "two")]  # "part" waits for its newline
    assert cursor.read() == []
    append(a1 / "rank-0.log", b"ial\n")
    append(a1 / "rank-1.log", b"r1 \xff bytes\n")  # rank 1's file appears later; not UTF-8
    append(a1 / "launcher.log", b"mpirun says\n")  # not a rank's: only with launcher=True
    assert texts(cursor.read()) == [("a", 1, 0, "partial"), ("a", 1, 1, "r1 \ufffd bytes")]

    # attempt 1 fails with a last line that never gets its newline: whole once the attempt ended
    append(a1 / "rank-1.log", b"Traceback: no newline")
    assert cursor.read() == []
    db.end_attempt(run_id, "a", 1, "failed", "boom")
    assert texts(cursor.read()) == [("a", 1, 1, "Traceback: no newline")]
    a2, b1 = db.log_dir(run_id, "a", 2), db.log_dir(run_id, "b", 1)
    db.start_attempt(run_id, "a", 2, "", str(a2))
    append(a2 / "rank-1.log", b"second try\n")
    assert texts(cursor.read()) == [("a", 2, 1, "second try")]
    db.end_attempt(run_id, "a", 2, "succeeded")
    db.start_attempt(run_id, "b", 1, "", str(b1))
    append(b1 / "rank-0.log", b"stage b\nunfinished")
    assert texts(cursor.read()) == [("b", 1, 0, "stage b")]
    assert texts(cursor.read(final=True)) == [("b", 1, 0, "unfinished")]  # the run ended: the rest
    assert cursor.read(final=True) == []

    # a fresh cursor reads it all in attempt order; the filters; the launcher's lines
    every = [
        ("a", 1, 0, "one"),
        ("a", 1, 0, "two"),
        ("a", 1, 0, "partial"),
        ("a", 1, 1, "r1 \ufffd bytes"),
        ("a", 1, 1, "Traceback: no newline"),
        ("a", 2, 1, "second try"),
        ("b", 1, 0, "stage b"),
        ("b", 1, 0, "unfinished"),
    ]
    assert texts(LogCursor(db, run_id).read(final=True)) == every
    assert texts(LogCursor(db, run_id, rank=1).read(final=True)) == [x for x in every if x[2] == 1]
    assert texts(LogCursor(db, run_id, "a", attempt=2).read()) == [("a", 2, 1, "second try")]
    assert ("a", 1, None, "mpirun says") in texts(LogCursor(db, run_id, launcher=True).read())
    db.set_run(run_id, "succeeded")
    assert texts(follow(db, run_id, poll_s=0.01)) == every  # a finished run: everything, then it ends
    with pytest.raises(KeyError):
        list(follow(db, "no-such-run"))


def test_cursor_reads_a_large_log_in_bounded_pieces(db, tmp_path):
    run_id, _ = db.new_run("wf", "<python>", "local", None, {"a": 2})
    d = db.log_dir(run_id, "a", 1)
    db.start_attempt(run_id, "a", 1, "", str(d))
    want = {r: [f"rank {r} line {i} " + "x" * (i % 50) for i in range(3000)] for r in (0, 1)}
    for r, lines in want.items():
        append(d / f"rank-{r}.log", ("\n".join(lines) + "\n").encode())
    long = b"y" * (MAX_LINE + 5000)
    append(d / "rank-0.log", long + b"\nafter\n")
    size = sum(p.stat().st_size for p in d.iterdir())
    cursor = LogCursor(db, run_id, max_bytes=16_384)
    got: dict[int | None, list[str]] = {0: [], 1: []}
    reads = 0
    while True:
        lines = cursor.read()
        reads += 1
        # a read takes at most max_bytes of the files: what it returns is at most that (and a
        # line carried over from the previous read)
        carried = max((len(x.text) for x in lines if x.text.startswith("y")), default=0)
        assert sum(len(x.text) + 1 for x in lines) - carried <= 16_384 + 200, reads
        for x in lines:
            got[x.rank].append(x.text)
        if not cursor.behind:
            break
    assert reads >= size // 16_384
    assert got[1] == want[1]
    assert got[0][:-2] == want[0] and got[0][-1] == "after"
    cut = got[0][-2]  # the line over MAX_LINE: kept up to it, with a note of what was dropped
    assert cut.startswith("y" * MAX_LINE) and cut.endswith(
        f"[phalanx: 5000 more bytes of this line not shown: a line keeps {MAX_LINE}]"
    )


def test_file_tail_waits_for_a_missing_file_and_rereads_a_truncated_one(tmp_path):
    path = tmp_path / "driver.log"
    tail = FileTail(path)
    assert tail.read() == ([], False)
    path.write_bytes(b"a\nb")
    assert tail.read() == (["a"], False)
    assert tail.read(final=True) == (["b"], False)
    path.write_bytes(b"n\n")  # shorter than what was read: truncated, read from its start
    assert tail.read() == (["n"], False)
    (tmp_path / "next.log").write_bytes(b"new file\n")
    os.replace(tmp_path / "next.log", path)  # another file under that name: read from its start
    assert tail.read() == (["new file"], False)
    ended = iter([False, False, True])
    path.write_bytes(b"1\n2\n")
    assert list(follow_file(path, lambda: next(ended), poll_s=0.001)) == ["1", "2"]


# ---- `phalanx logs RUN --follow` against a run in progress -------------------------------------------
RANK = r"""
import os, sys, time
r, d = os.environ["PHALANX_RANK"], sys.argv[1]
for i in range(3):
    print(f"rank {r} before {i}", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(d, "go")) and time.monotonic() < deadline:
    time.sleep(0.01)
for i in range(3):
    print(f"rank {r} after {i}", flush=True)
sys.stdout.write(f"rank {r} last, no newline")
"""


def test_cli_logs_follow_streams_a_running_run_until_it_ends(db, tmp_path):
    """The run's ranks print three lines, wait for the test, print four more; ``phalanx logs
    --follow`` in another process shows the first lines while the ranks wait (the run still
    running), then the rest, and ends with the run, saying how it ended."""
    wf = Workflow(
        name="follow",
        stages={"say": Stage(kind="command", command=[sys.executable, "-c", RANK, str(tmp_path)], ranks=2)},
    )
    sched = prepare_run(wf, Site(name="test2", cores=2), db=db)
    driver = threading.Thread(target=sched.run, daemon=True)
    driver.start()
    follower = subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli", "logs", sched.run_id, "--follow", "--state", str(db.state_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x.rstrip("\n")) for x in follower.stdout], daemon=True)
    reader.start()
    try:
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while sum("before 2" in x for x in seen) < 2:  # both ranks' first lines, while they wait
            assert time.monotonic() < deadline and follower.poll() is None, (seen, follower.poll())
            try:
                seen.append(lines.get(timeout=0.05))
            except queue.Empty:
                pass
        assert db.run(sched.run_id)["state"] == "running"
        (tmp_path / "go").touch()
        assert follower.wait(timeout=60) == 0
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait()
        (tmp_path / "go").touch()
        driver.join(60)
    reader.join(10)
    while not lines.empty():
        seen.append(lines.get())
    assert db.run(sched.run_id)["state"] == "succeeded"
    assert follower.stderr.read().strip() == f"phalanx logs: run {sched.run_id} succeeded"
    for r in (0, 1):
        mine = [x for x in seen if x.startswith(f"[say attempt 1 rank {r}] ")]
        # every line of the rank, in order, the last (no newline) included: the rank's own file
        on_disk = (db.log_dir(sched.run_id, "say", 1) / f"rank-{r}.log").read_text().split("\n")
        assert [x.split("] ", 1)[1] for x in mine] == on_disk
        assert on_disk == [*(f"rank {r} before {i}" for i in range(3)), *(f"rank {r} after {i}" for i in range(3))] + [
            f"rank {r} last, no newline"
        ]
    assert len(seen) == 14
    assert os.environ.get("PHALANX_STATE") != str(db.state_dir)  # the test's own state, named by --state


@pytest.mark.slow  # a second phalanx process: kept out of the core lane's 5 minutes
def test_cli_logs_driver_follow_and_ctrl_c_ends_the_following_not_the_run(db, tmp_path):
    """``--driver --follow`` on a run still going shows its driver's log as it grows; Ctrl-C ends
    the following quietly (130, no traceback) and leaves the run running; once the run has
    ended, the rest of the log and the run's state."""
    run_id, _ = db.new_run("follow", "<python>", "local", None, {"say": 1})  # driven by this test
    log = db.state_dir / "drivers" / f"{run_id}.log"
    log.parent.mkdir()
    log.write_text("driver line 1\n")
    argv = [sys.executable, "-m", "phalanx.cli", "logs", run_id, "--driver", "-f", "--state", str(db.state_dir)]
    follower = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follower.stdout.readline() == "driver line 1\n"
        append(log, b"driver line 2\n")
        assert follower.stdout.readline() == "driver line 2\n"  # written after the follower started
        follower.send_signal(signal.SIGINT)
        assert follower.wait(timeout=30) == 130
        assert follower.stderr.read() == "" and follower.stdout.read() == ""
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait()
    assert db.run(run_id)["state"] == "running"
    append(log, b"driver line 3, no newline")
    db.set_run(run_id, "failed")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1  # as `phalanx wait`: the run did not succeed
    assert done.stdout.splitlines() == ["driver line 1", "driver line 2", "driver line 3, no newline"]
    assert done.stderr.strip() == f"phalanx logs: run {run_id} failed"
