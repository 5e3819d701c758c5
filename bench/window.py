"""Window functions: a running sum and a lag per key, ordered by time, by phalanx at 1 and 2
ranks and by DuckDB with as many threads as phalanx has ranks, on the same rows.

    .venv/bin/python bench/window.py [--rows 1000000] [--keys 10000] [--reps 3]

phalanx times ``df.window(...)`` until every rank holds its result (the shuffle by key and one
local DuckDB query; the same without ``partition_by``: global sort, carries, halo exchange);
DuckDB runs the same window SQL over the whole Arrow table.  Answers are checked against
DuckDB's (sums of the output columns).  The machine is shared: timings are noisy.
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

SQL = {
    "partitioned by k": (
        "SELECT *, sum(v) OVER (PARTITION BY k ORDER BY t, gid ROWS UNBOUNDED PRECEDING) AS c, "
        "lag(v, 1) OVER (PARTITION BY k ORDER BY t, gid) AS p FROM T"
    ),
    "partitioned by k, with rank (DuckDB plan)": (
        "SELECT *, sum(v) OVER (PARTITION BY k ORDER BY t, gid ROWS UNBOUNDED PRECEDING) AS c, "
        "lag(v, 1) OVER (PARTITION BY k ORDER BY t, gid) AS p, rank() OVER (PARTITION BY k ORDER BY t) AS r FROM T"
    ),
    "over the whole frame": (
        "SELECT *, sum(v) OVER (ORDER BY t, gid ROWS UNBOUNDED PRECEDING) AS c, lag(v, 1) OVER (ORDER BY t, gid) AS p FROM T"
    ),
}


def part(rank: int, world: int, rows: int, keys: int) -> pa.Table:
    lo, hi = rows * rank // world, rows * (rank + 1) // world
    rng = np.random.default_rng(rank + 100 * world)
    n = hi - lo
    t = np.datetime64("2024-01-01") + rng.integers(0, 10**7, n).astype("timedelta64[s]")
    return pa.table(
        {
            "k": rng.integers(0, keys, n),
            "t": pa.array(t.astype("datetime64[us]")),
            "v": rng.normal(size=n),
            "gid": np.arange(lo, hi, dtype=np.int64),
        }
    )


def px_app(env, rows: int, keys: int, case: str, reps: int):
    df = px.DataFrame.from_arrow(part(env.rank, env.world_size, rows, keys), env).compute()
    by = "k" if case.startswith("partitioned") else None
    extra = {"r": ("rank",)} if "rank" in case else {}
    times = []
    for _ in range(reps + 1):  # the first: warm-up
        env.comm.barrier()
        t0 = time.perf_counter()
        out = df.window(order_by="t", partition_by=by, c=("v", "cumsum"), p=("v", "lag", 1), **extra).compute()
        env.comm.barrier()
        times.append(time.perf_counter() - t0)
    sums = [env.comm.allreduce_scalar(float(np.nansum(out.to_arrow()[c].to_numpy(zero_copy_only=False)))) for c in "cp"]
    return times[1:], sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print(f"{args.rows:,} rows, {args.keys:,} keys; load {loadavg()}")
    for case, query in SQL.items():
        print(f"\ncumsum + lag {case}, ordered by t")
        print(f"{'engine':<22}{'median s':>10}  answer")
        for ranks in (1, 2):
            T = pa.concat_tables([part(r, ranks, args.rows, args.keys) for r in range(ranks)])
            con = duckdb.connect()
            con.execute(f"SET threads={ranks}")
            con.register("T", T)
            times = []
            for _ in range(args.reps + 1):
                t0 = time.perf_counter()
                ref = con.sql(query).to_arrow_table()
                times.append(time.perf_counter() - t0)
            want = [float(np.nansum(ref[c].to_numpy(zero_copy_only=False))) for c in "cp"]
            print(f"{f'duckdb {ranks} threads':<22}{statistics.median(times[1:]):>10.3f}")
            with px.Gang(ranks, echo=False) as gang:
                px_times, sums = gang.run(px_app, args.rows, args.keys, case, args.reps)[0]
            ok = all(np.isclose(a, b, rtol=1e-6) for a, b in zip(sums, want))
            print(f"{f'phalanx {ranks} rank(s)':<22}{statistics.median(px_times):>10.3f}  {'ok' if ok else 'WRONG'}")
    print(f"\nload {loadavg()}")


if __name__ == "__main__":
    main()
