"""Group-bys that scale: phalanx at 1 and 2 ranks against DuckDB with the same threads, over
the number of groups (100 to all-distinct), integer and string keys, one to six key columns.

    .venv/bin/python bench/groupby.py [--rows 10000000] [--reps 2] [--groups 100,100000,10000000]

Each configuration: ``groupby(keys).agg(sum of a float, mean of an int, count)`` on the same
rows (generated once per configuration, split between the ranks); phalanx's row count of the
answer checked against DuckDB's.  Printed: seconds (median), 2 ranks vs 1 rank, and phalanx at
2 ranks vs DuckDB with 2 threads (>1: phalanx slower).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers import loadavg

import phalanx as px


def make(rows: int, groups: int, kind: str, nkeys: int, seed: int = 3) -> pa.Table:
    """``groups`` distinct key tuples over ``nkeys`` columns (the first carries the cardinality,
    the others are functions of it, as a (region, city, store...) hierarchy is)."""
    rng = np.random.default_rng(seed)
    g = rng.integers(0, groups, rows) if groups < rows else rng.permutation(rows)
    cols: dict[str, pa.Array] = {}
    for i in range(nkeys):
        part = g // (7**i) if i else g
        if kind == "string":
            cols[f"k{i}"] = pa.array(np.char.add(f"key{i}-", part.astype(str)))
        else:
            cols[f"k{i}"] = pa.array(part)
    cols["v"] = pa.array(rng.random(rows))
    cols["w"] = pa.array(rng.integers(0, 1000, rows))
    return pa.table(cols)


def px_app(env, table: pa.Table, keys: list[str], reps: int):
    n, r, p = table.num_rows, env.rank, env.world_size
    df = px.DataFrame.from_arrow(table.slice(n * r // p, n * (r + 1) // p - n * r // p), env)
    times, rows = [], 0
    for i in range(reps + 1):
        env.comm.barrier()
        t0 = time.perf_counter()
        out = df.groupby(keys).agg(v=("v", "sum"), w=("w", "mean"), n=("w", "count"))
        rows = out.num_rows  # collective: the answer exists everywhere
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--groups", default="100,100000,10000000")
    ap.add_argument("--keys", default="1,3,6")
    ap.add_argument("--kinds", default="int,string")
    args = ap.parse_args()
    print(f"{args.rows:,} rows; load {loadavg()}")
    print(
        f"{'groups':>10} {'key':>6} {'ncols':>5} {'1 rank':>8} {'2 ranks':>8} {'duckdb2':>8} {'2r/1r':>6} {'2r/duck':>8}"
    )
    gangs = {n: px.Gang(n, echo=False) for n in (1, 2)}
    try:
        for groups in (int(g) for g in args.groups.split(",")):
            for kind in args.kinds.split(","):
                for nkeys in (int(k) for k in args.keys.split(",")):
                    table = make(args.rows, groups, kind, nkeys)
                    keys = [f"k{i}" for i in range(nkeys)]
                    con = duckdb.connect()
                    con.execute("SET threads=2")
                    con.register("t", table)
                    q = f"SELECT {', '.join(keys)}, sum(v), avg(w), count(w) FROM t GROUP BY ALL"
                    con.sql(q).to_arrow_table()
                    dt = []
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        ref = con.sql(q).to_arrow_table()
                        dt.append(time.perf_counter() - t0)
                    duck = statistics.median(dt)
                    t1, rows1 = gangs[1].run(px_app, table, keys, args.reps)[0]
                    t2, rows2 = gangs[2].run(px_app, table, keys, args.reps)[0]
                    ok = "" if rows1 == rows2 == ref.num_rows else f"  WRONG rows {rows1}/{rows2}/{ref.num_rows}"
                    print(
                        f"{groups:>10} {kind:>6} {nkeys:>5} {t1:>8.3f} {t2:>8.3f} {duck:>8.3f} "
                        f"{t2 / t1:>6.2f} {t2 / duck:>8.2f}{ok}",
                        flush=True,
                    )
    finally:
        for g in gangs.values():
            g.close()
    print(f"load {loadavg()}")


if __name__ == "__main__":
    main()
