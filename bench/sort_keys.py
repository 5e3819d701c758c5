#!/usr/bin/env python
"""Sorts by several keys and by strings: phalanx on 1 and R ranks against polars and DuckDB
with the same threads, one run, the same rows.

    .venv/bin/python bench/sort_keys.py --rows 10000000 --ranks 1,2 --reps 3

Workloads (stable, nulls last for phalanx; the peers' own ORDER BY):
    int2     by (a, b): a has 1000 values, b is almost unique (int64)
    str      by s: 100k distinct strings
    str_int  by (s descending, a)
Every engine's sorted key columns are compared with DuckDB's; a mismatch is printed.
Prints seconds (best of reps) and ratios; phalanx ranks run one kernel thread each, as the
peers get R threads.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from operators import RESULT_TAG  # noqa: E402  (bench/operators.py: the peers' result line)

WORKLOADS = {"int2": (["a", "b"], [False, False]), "str": (["s"], [False]), "str_int": (["s", "a"], [True, False])}


def gen(n: int, lo: int, hi: int):
    """Rows lo..hi-1 of the data set (the same rows whatever the rank count)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(11)
    a = rng.integers(0, 1000, n)[lo:hi]
    b = rng.integers(0, 1 << 62, n)[lo:hi]
    words = pa.array([f"w{i:06d}x" for i in range(100_000)], pa.string())
    s = words.take(pa.array(rng.integers(0, len(words), n)[lo:hi]))
    return pa.table({"a": a, "b": b, "s": s})


def key_digest(table, by) -> list:
    """Order-sensitive digest of the sorted key columns: first, middle and last rows, row count."""
    n = table.num_rows
    pick = [0, n // 2, n - 1] if n else []
    return [n] + [[table.column(c)[i].as_py() for c in by] for i in pick]


def px_app(env, n, workloads, reps):
    import time

    import phalanx as px

    lo, hi = env.rank * n // env.world_size, (env.rank + 1) * n // env.world_size
    df = px.DataFrame.from_arrow(gen(n, lo, hi), env)
    out = {}
    for w in workloads:
        by, desc = WORKLOADS[w]
        times = []
        for _ in range(reps):
            env.comm.barrier()
            t = time.perf_counter()
            res = df.sort_values(by, ascending=[not d for d in desc])
            env.comm.barrier()
            times.append(time.perf_counter() - t)
        whole = res.select(by).collect(root=0)
        out[w] = {"times": times, "digest": key_digest(whole, by) if whole is not None else None}
    return out


def peer_main(engine: str, n: int, threads: int, workloads: list[str], reps: int) -> None:
    import json

    table = gen(n, 0, n)
    out = {}
    if engine == "duckdb":
        import duckdb

        con = duckdb.connect()
        con.execute(f"SET threads = {threads}")
        con.register("t", table)

        def run(by, desc):
            order = ", ".join(f"{c} {'DESC' if d else 'ASC'} NULLS LAST" for c, d in zip(by, desc))
            return con.sql(f"SELECT * FROM t ORDER BY {order}").to_arrow_table()
    else:
        import polars as pl

        df = pl.from_arrow(table)

        def run(by, desc):
            return df.sort(by, descending=desc, nulls_last=True, maintain_order=True).to_arrow()

    for w in workloads:
        by, desc = WORKLOADS[w]
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            res = run(by, desc)
            times.append(time.perf_counter() - t)
        out[w] = {"times": times, "digest": key_digest(res, by)}
        del res
    print(RESULT_TAG + json.dumps(out, default=str))


def run_peer(engine: str, args, threads: int) -> dict:
    import json

    env = dict(os.environ, POLARS_MAX_THREADS=str(threads))
    cmd = [
        sys.executable,
        __file__,
        "--peer",
        engine,
        "--rows",
        str(args.rows),
        "--threads",
        str(threads),
        "--workloads",
        args.workloads,
        "--reps",
        str(args.reps),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    raise RuntimeError(f"{engine} failed:\n{p.stderr[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    if args.peer:
        peer_main(args.peer, args.rows, args.threads, workloads, args.reps)
        return 0

    import _peers
    from operators import one_thread_launcher

    import phalanx as px

    print(f"## sort by several keys: {args.rows} rows; loadavg {_peers.loadavg()}")
    results: dict[tuple[str, int], dict] = {}
    for R in [int(r) for r in args.ranks.split(",")]:
        with px.Gang(ranks=R, echo=False, executor=one_thread_launcher()) as g:
            results[("phalanx", R)] = g.run(px_app, args.rows, workloads, args.reps, timeout=3600)[0]
        for engine in ("polars", "duckdb"):
            results[(engine, R)] = run_peer(engine, args, R)
    best = {k: {w: min(v[w]["times"]) for w in workloads} for k, v in results.items()}
    ranks = sorted({R for _, R in results})
    head = f"{'engine':<10}{'R':>3}" + "".join(f"{w:>12}" for w in workloads)
    print(head)
    for (engine, R), times in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{engine:<10}{R:>3}" + "".join(f"{times[w]:>11.3f}s" for w in workloads))
    print("ratios (> 1: phalanx faster)")
    for R in ranks:
        for engine in ("polars", "duckdb"):
            print(
                f"  {engine} {R}t / phalanx {R}r"
                + "".join(f"{best[(engine, R)][w] / best[('phalanx', R)][w]:>11.2f}×" for w in workloads)
            )
    if len(ranks) > 1:
        lo, hi = ranks[0], ranks[-1]
        print(
            f"  phalanx {hi}r speed-up over {lo}r"
            + "".join(f"{best[('phalanx', lo)][w] / best[('phalanx', hi)][w]:>11.2f}×" for w in workloads)
        )
    wrong = [
        (k, w)
        for k, v in results.items()
        for w in workloads
        if v[w]["digest"] != results[("duckdb", ranks[0])][w]["digest"]
    ]
    for k, w in wrong:
        print(f"MISMATCH: {k[0]} {k[1]} on {w}: {results[k][w]['digest']}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
