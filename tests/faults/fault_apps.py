"""Stage apps of the resume/driver fault tests, importable as "fault_apps:function"."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """Writes ``text`` so a reader polling ``path`` never sees it empty or half-written (a rename
    is atomic; ``write_text`` creates the file empty first)."""
    part = path.with_name(f".{path.name}.part")
    part.write_text(text)
    os.replace(part, path)


def wait_for_file(env):
    """Blocks (bounded) until params.file exists: a stage that runs as long as the test wants."""
    path, deadline = Path(env.params["file"]), time.monotonic() + env.params.get("limit", 120)
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)
    env.comm.barrier()


def write_pid(env):
    """Each rank writes its pid to params.dir/<stage>.<rank>.pid."""
    write_whole(Path(env.params["dir"], f"{env.stage}.{env.rank}.pid"), str(os.getpid()))
    env.comm.barrier()


def kill_idle_rank(env):
    """Waits until stage params.victim has succeeded (its gang now idle, kept for reuse), then
    SIGKILLs that stage's rank 1 and waits until it is dead."""
    from phalanx.orchestrator.rundb import RunDB, pid_alive

    db, victim = RunDB(env.params["state"]), env.params["victim"]
    deadline = time.monotonic() + 120
    while True:
        run = db.runs()[0]
        if {s["stage"]: s["state"] for s in db.stages(run["id"])}.get(victim) == "succeeded":
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"stage {victim!r} never succeeded")
        time.sleep(0.05)
    pid = int(Path(env.params["dir"], f"{victim}.1.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    while pid_alive(pid):
        time.sleep(0.01)


def count_rows(env):
    """The input ``tx`` as ``counted``: rows and the sum of ``amount``, one row."""
    import pyarrow as pa

    import phalanx as px

    df = env.input("tx")
    total = env.comm.allreduce_scalar(int(pa.compute.sum(df.to_arrow()["amount"]).as_py() or 0))
    part = (
        pa.table({"rows": [df.num_rows], "amount": [total]})
        if env.rank == 0
        else pa.table({"rows": pa.array([], pa.int64()), "amount": pa.array([], pa.int64())})
    )
    return {"counted": px.DataFrame.from_arrow(part, env)}


def eat_memory(env):
    """Rank 1 allocates 64 MiB at a time (touched) up to params.gib GiB; the others wait."""
    import numpy as np

    if env.rank == 1:
        held = []
        for _ in range(int(env.params["gib"] * 16)):
            held.append(np.ones(8 << 20))  # 64 MiB of float64
    env.comm.barrier()


def start_children(env):
    """Each rank starts two ``sleep 299`` — a plain child and one in a session of its own
    (setsid) — and writes their pids to params.dir/<stage>.<rank>.children; with params.fail,
    rank 1 then raises while the others wait in a barrier (until the driver stops them)."""
    import subprocess

    kids = [subprocess.Popen(["sleep", "299"]), subprocess.Popen(["sleep", "299"], start_new_session=True)]
    write_whole(Path(env.params["dir"], f"{env.stage}.{env.rank}.children"), " ".join(str(k.pid) for k in kids))
    if env.params.get("fail"):
        if env.rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
    env.comm.barrier()


def print_long_line(env):
    """Rank 0 prints one line of params.size bytes ("x"...) and the line "long line done"."""
    if env.rank == 0:
        print("x" * env.params["size"])
        print("long line done")
    env.comm.barrier()


def print_line(env):
    """Every rank prints params.text."""
    print(env.params["text"])
