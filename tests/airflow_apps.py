"""Stage apps of tests/test_airflow.py (imported by the ranks by name: tests/ is on their path)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa

import phalanx as px


def numbers(env):
    """params.n integers 0..n-1 split over the ranks, as output ``numbers``."""
    n = int(env.params.get("n", 100))
    lo, hi = n * env.rank // env.world_size, n * (env.rank + 1) // env.world_size
    env.log.info("numbers %d..%d here", lo, hi - 1)
    return {"numbers": px.DataFrame.from_arrow(pa.table({"x": pa.array(range(lo, hi), pa.int64())}), env)}


def fail_on_rank(env):
    """Rank params.rank raises (a traceback the test looks for); the others wait to be stopped."""
    if env.rank == int(env.params.get("rank", 1)):
        env.log.info("about to fail")
        raise ValueError(f"rank {env.rank} refuses on purpose: {env.params.get('word', 'kaboom')}")
    env.comm.barrier()  # never passes: the failing rank's peers are stopped by fail-fast


def sleeper(env):
    """Writes this rank's pid to params.dir/pid.<rank>, then sleeps (params.sleep_s, 300 s):
    only cancelling the run ends it."""
    d = Path(env.params["dir"])
    (d / f"pid.{env.rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + float(env.params.get("sleep_s", 300))
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise TimeoutError("nobody cancelled the sleeper")


def gated(env):
    """Writes params.dir/pid.<rank>, says so, and waits (≤ params.wait_s) until the test
    creates params.dir/go, then seals ``gated`` (one row per rank)."""
    d = Path(env.params["dir"])
    (d / f"pid.{env.rank}").write_text(str(os.getpid()))
    print(f"gated rank {env.rank}: waiting for {d / 'go'}", flush=True)  # what a deferred task's log shows
    deadline = time.monotonic() + float(env.params.get("wait_s", 120))
    while not (d / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{d / 'go'} never appeared")
        time.sleep(0.02)
    print(f"gated rank {env.rank}: go", flush=True)
    return {"gated": px.DataFrame.from_arrow(pa.table({"rank": [env.rank]}), env)}


def seal(env):
    """The first stage of the retry workflow: seals ``first`` and counts its runs in params.dir."""
    d = Path(env.params["dir"])
    with open(d / "seal.runs", "a") as f:
        f.write(f"{os.getpid()}\n")
    return {"first": px.DataFrame.from_arrow(pa.table({"v": [1, 2, 3]}), env)}


def flaky(env):
    """Fails the first time (no params.dir/flaky.marker yet: it creates it), then sums ``first``."""
    marker = Path(env.params["dir"]) / "flaky.marker"
    if not marker.exists():
        marker.write_text("failed once")
        raise RuntimeError("flaky fails on its first attempt")
    total = sum(env.input("first").to_arrow().column("v").to_pylist())
    return {"second": px.DataFrame.from_arrow(pa.table({"total": [total]}), env)}
