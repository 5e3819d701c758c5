"""What the planner of local work buys: one query over a Parquet table shaped like a user's
(string keys, several value columns, a wide text column), run by phalanx with its pipeline
planned (projections and filters in the scan, one fused pass), by phalanx eagerly (each
operator materialized before the next: ``compute()`` after every step, the behaviour before
the planner), and by DuckDB and Polars on the same file with the same threads.

    .venv/bin/python bench/plan.py [--rows 10000000] [--ranks 2] [--reps 3]

The query: read → filter on a date range → derive two columns → keep five → group by a string
key (sum, mean, count).  Every engine's answer is checked against DuckDB's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers import loadavg

import phalanx as px

DAY0 = np.datetime64("2020-01-01")
LO, HI = np.datetime64("2021-01-01"), np.datetime64("2021-04-01")


def make(path: Path, rows: int) -> None:
    rng = np.random.default_rng(7)
    days = DAY0 + np.sort(rng.integers(0, 1461, rows)).astype("timedelta64[D]")  # sorted: real logs are
    t = pa.table(
        {
            "day": pa.array(days, pa.date32()),
            "region": pa.array([f"region-{i}" for i in rng.integers(0, 50, rows)]),
            "customer": pa.array([f"cust-{i:06d}" for i in rng.integers(0, 100_000, rows)]),
            "price": rng.uniform(1, 500, rows),
            "qty": rng.integers(1, 20, rows),
            "discount": rng.uniform(0, 0.3, rows),
            "comment": pa.array([f"free text comment number {i} " * 3 for i in range(rows)]),
        }
    )
    pq.write_table(t, path, row_group_size=256 * 1024)


def query(df, eager: bool):
    def step(d):
        return d.compute() if eager else d

    q = step(
        step(df).filter(
            (pc.field("day") >= pa.scalar(LO.astype(object), pa.date32()))
            & (pc.field("day") < pa.scalar(HI.astype(object), pa.date32()))
        )
    )
    q = step(
        q.assign(
            revenue=pc.field("price") * pc.field("qty") * (pc.scalar(1.0) - pc.field("discount")),
            big=pc.field("qty") > 10,
        )
    )
    q = step(q.select(["region", "revenue", "qty", "big", "day"]))
    return q.groupby("region").agg(revenue=("revenue", "sum"), qty=("qty", "mean"), n=("qty", "count"))


def px_app(env, path: str, eager: bool, reps: int):
    times = []
    query(px.read_parquet(path, env), eager).collect(root=0)  # warm-up: imports, page cache
    for _ in range(reps):
        env.comm.barrier()
        t0 = time.perf_counter()
        out = query(px.read_parquet(path, env), eager)
        table = out.collect(root=0)
        times.append(time.perf_counter() - t0)
    return times, table


SQL = """
SELECT region, sum(price * qty * (1 - discount)) AS revenue, avg(qty) AS qty, count(qty) AS n
FROM read_parquet('{path}') WHERE day >= DATE '2021-01-01' AND day < DATE '2021-04-01' GROUP BY region
"""


def timed(fn, reps):
    times, out = [], fn()  # warm-up
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def same(a: pa.Table, b: pa.Table) -> bool:
    a, b = a.sort_by("region"), b.sort_by("region").select(a.column_names)
    return all(np.allclose(a[c].to_numpy(), b[c].to_numpy().astype(float)) for c in ("revenue", "qty", "n"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sales.parquet"
        make(path, args.rows)
        print(f"{args.rows:,} rows, {path.stat().st_size / 1e6:.0f} MB parquet; load {loadavg()}")
        con = duckdb.connect()
        con.execute(f"SET threads={args.ranks}")
        ref_t, ref = timed(lambda: con.sql(SQL.format(path=path)).to_arrow_table(), args.reps)

        import polars as pl

        pl_q = (
            pl.scan_parquet(path)
            .filter((pl.col("day") >= LO.astype(object)) & (pl.col("day") < HI.astype(object)))
            .with_columns(revenue=pl.col("price") * pl.col("qty") * (1 - pl.col("discount")))
            .group_by("region")
            .agg(pl.col("revenue").sum(), pl.col("qty").mean().alias("qty"), pl.col("qty").count().alias("n"))
        )
        pl_t, pl_out = timed(lambda: pl_q.collect().to_arrow(), args.reps)
        results = {"duckdb": (ref_t, ref), "polars": (pl_t, pl_out)}
        with px.Gang(args.ranks, echo=False) as gang:
            for name, eager in (("phalanx planned", False), ("phalanx eager", True)):
                times, table = gang.run(px_app, str(path), eager, args.reps)[0]
                results[name] = (times, table)
        print(f"{'engine':<18}{'median s':>10}{'vs planned':>12}  answer")
        base = statistics.median(results["phalanx planned"][0])
        for name, (times, table) in results.items():
            med = statistics.median(times)
            print(f"{name:<18}{med:>10.3f}{med / base:>11.2f}x  {'ok' if same(ref, table) else 'WRONG'}")
        print(f"threads/ranks: {args.ranks}; load {loadavg()}")


if __name__ == "__main__":
    main()
