"""Rank apps of the notebook tests (imported by the ranks of a kernel's gangs, by reference)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def wait_for(path: str, within: float = 120.0) -> bool:
    """On a rank: wait until the test creates ``path`` (a real condition, with a deadline)."""
    deadline = time.monotonic() + within
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def chatty(env, lines: int, gate: str) -> int:
    """Print ``lines`` lines and report progress, wait for the test's gate, print one more line."""
    from phalanx.integrations.jupyter import progress

    for i in range(lines):
        print(f"r{env.rank}-line-{i}", flush=True)
        progress(i + 1, lines + 1, "lines")
    assert wait_for(gate), "the test never opened the gate"
    print(f"r{env.rank}-after-gate", flush=True)
    progress(lines + 1, lines + 1, "done")
    return env.rank


def write_pid_and_block(env, directory: str) -> None:
    """Write this rank's pid, then wait (for an interrupt: the gate never opens)."""
    Path(directory, f"pid.{env.rank}").write_text(str(os.getpid()))
    wait_for(os.path.join(directory, "never"), within=600)


def fails_on(env, rank: int) -> int:
    """Raise on ``rank``; the others return their rank."""
    if env.rank == rank:
        raise RuntimeError(f"rank {rank} fails on purpose")
    return env.rank


def collect_limits(env) -> dict:
    """``DataFrame.collect(limit=...)`` on a frame of 2 + rank rows per rank."""
    import pyarrow as pa

    import phalanx as px

    n = 2 + env.rank
    df = px.DataFrame.from_arrow(pa.table({"r": [env.rank] * n, "i": list(range(n))}), env)
    out = {
        "all": df.collect().to_pydict(),
        "first3": df.collect(limit=3).to_pydict(),
        "zero": df.collect(limit=0).num_rows,
        "more": df.collect(limit=100).num_rows,
    }
    on_root = df.collect(root=1, limit=4)
    out["root"] = on_root.to_pydict() if on_root is not None else None
    try:
        df.collect(limit=-1)
    except ValueError as exc:
        out["bad"] = str(exc)
    return out
