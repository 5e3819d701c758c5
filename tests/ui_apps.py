"""Stage apps of the dashboard's tests (importable as "ui_apps:NAME")."""

import os
import time


def gated(env):
    """Prints a line, waits for the file ``params.gate`` (the test opens it), then writes ``out``."""
    import pyarrow as pa

    print(f"rank {env.rank} waits for the gate", flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(env.params["gate"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"rank {env.rank} passed the gate", flush=True)
    env.output("out", pa.table({"rank": [env.rank] * (10 * (env.rank + 1))}))


def fails_on_rank_1(env):
    """Rank 1 prints a line and raises; the others wait at a barrier (and are stopped)."""
    if env.rank == 1:
        print("rank 1 is about to fail: the disk is made of cheese", flush=True)
        raise RuntimeError("planned failure on rank 1")
    env.comm.barrier()


def uneven(env):
    """Rank 1 computes for a second before the barrier: rank 0 waits for it there (a straggler)."""
    if env.rank == 1:
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            pass
    env.comm.barrier()
