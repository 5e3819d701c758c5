"""What two ranks can gain on this machine at best: the same one-thread kernel in 1 process and
in P processes at once, on P-times smaller inputs per process.

    .venv/bin/python bench/concurrency.py                 # 5M rows per process, P = 2
    .venv/bin/python bench/concurrency.py --rows 2500000 --procs 4

A distributed operator on P ranks runs its local kernel on N/P rows in each of P processes at
the same time.  If those processes slow each other (shared caches, memory bandwidth, two vCPUs
that are hyperthreads of one core), no scheduling or exchange can win it back.  This prints,
per kernel, the slowdown of running P copies at once and the speed-up a P-rank operator could
reach with a free partition and exchange: P · t(1 process) / t(P processes), against one
process doing all N = P · rows rows (assuming cost linear in rows).  docs/scaling.md uses it as
the model's ``s``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def _kernels(rows: int, seed: int):
    import duckdb
    import numpy as np
    import polars as pl
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    key = rng.integers(0, int(2 * rows / 0.21), rows)  # the operator benchmark's keys
    value = rng.integers(0, 1000, rows)
    con = duckdb.connect()
    con.execute("SET threads = 1")
    con.register("a", pa.table({"key": key, "va": value}))
    con.register("b", pa.table({"key": rng.integers(0, int(2 * rows / 0.21), rows), "vb": value}))
    frame = pl.DataFrame({"key": key, "value": value})
    return {
        "polars sort": lambda: frame.sort("key", maintain_order=True),
        "duckdb join": lambda: con.sql("SELECT * FROM a JOIN b USING (key)").to_arrow_table(),
        "duckdb group-by": lambda: con.sql("SELECT key, sum(va) FROM a GROUP BY key").to_arrow_table(),
        "numpy hash pass": lambda: (key.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32),
        "memcpy 4x": lambda: np.concatenate([key, key, key, key]).copy(),
    }


def _worker(rows: int, reps: int, barrier, out) -> None:
    os.environ["POLARS_MAX_THREADS"] = "1"  # before polars is imported in this process
    kernels = _kernels(rows, os.getpid())
    best = {}
    for name, fn in kernels.items():
        fn()  # warm: first-touch page faults are not the kernel's cost
        barrier.wait()  # every process runs the same kernel at the same time
        t = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            t = min(t, time.perf_counter() - start)
        barrier.wait()
        best[name] = t
    out.put(best)


def run(procs: int, rows: int, reps: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(rows, reps, barrier, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    results = [out.get() for _ in workers]
    for w in workers:
        w.join()
    return {k: max(r[k] for r in results) for k in results[0]}  # the slowest process sets the pace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5_000_000, help="rows per process")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        print(
            f"# concurrency: {args.procs} processes x {args.rows:,} rows, best of {args.reps}; "
            f"cpus {os.cpu_count()}; loadavg {' '.join(f.read().split()[:3])}"
        )
    one = run(1, args.rows, args.reps)
    many = run(args.procs, args.rows, args.reps)
    print(f"{'kernel':18s} {'1 proc s':>9s} {f'{args.procs} at once s':>13s} {'slowdown':>9s} {'best speed-up':>14s}")
    for k in one:
        print(f"{k:18s} {one[k]:9.3f} {many[k]:13.3f} {many[k] / one[k]:8.2f}x {args.procs * one[k] / many[k]:13.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
