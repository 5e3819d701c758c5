"""Quickstart: a 4-rank gang runs a join → groupby → sort app twice on one communicator.

    .venv/bin/python workflows/quickstart.py [--ranks 4] [--rows 1000000]

Each rank makes its own slice of the left table; the right table is Parquet files that the
ranks split between them.  The result is checked against DuckDB on the same data.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import duckdb
import numpy as np
import pyarrow as pa

import phalanx as px


def make_part(rank: int, rows: int, world: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng([seed, rank])
    n = rows // world
    return pa.table({"key": rng.integers(0, rows // 2, n), "v": rng.random(n), "w": rng.integers(0, 100, n)})


def write_right(env, rows: int, directory: str) -> str:
    """Write the right-hand table as one Parquet file per rank."""
    right = make_part(env.rank, rows // 4, env.world_size, seed=1).rename_columns(["key", "x", "y"])
    return px.DataFrame.from_arrow(right, env).write_parquet(directory)


def app(env, rows: int, right_dir: str):
    left = px.DataFrame.from_arrow(make_part(env.rank, rows, env.world_size), env)
    right = px.read_parquet(f"{right_dir}/*.parquet", env)
    out = left.merge(right, on="key", how="inner").groupby("key").agg({"v": "sum", "w": "mean"}).sort_values("key")
    env.log.info("holds %d of the sorted rows", out.local_num_rows)
    return out.num_rows, out.head(3).collect(root=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args()
    right_dir = tempfile.mkdtemp(prefix="phalanx-quickstart-")

    with px.Gang(ranks=args.ranks) as gang:
        print(f"gang of {args.ranks} ready in {gang.ready_seconds:.2f}s (logs: {gang.log_dir})")
        gang.run(write_right, args.rows, right_dir)
        for rows in (args.rows, 2 * args.rows):
            t0 = time.perf_counter()
            results = gang.run(app, rows, right_dir)
            took = time.perf_counter() - t0
            num_rows, head = results[0]
            print(f"{rows:>10,} rows: {num_rows:,} groups in {took:.2f}s on the same gang")

            # independent check with DuckDB on the same data
            L = pa.concat_tables([make_part(r, rows, args.ranks) for r in range(args.ranks)])  # noqa: F841 (DuckDB reads L and R by name)
            R = duckdb.read_parquet(f"{right_dir}/*.parquet").to_arrow_table()  # noqa: F841
            ref = duckdb.sql(
                "SELECT key, SUM(v) AS v, AVG(w) AS w FROM L JOIN R USING (key) GROUP BY key ORDER BY key LIMIT 3"
            ).to_arrow_table()
            expected = duckdb.sql("SELECT COUNT(DISTINCT key) FROM L JOIN R USING (key)").fetchall()[0][0]
            assert num_rows == expected, (num_rows, expected)
            assert head["key"].equals(ref["key"]) and np.allclose(head["v"], ref["v"])
            print(f"{'':>10}  matches DuckDB; first rows: {head.to_pylist()}")


if __name__ == "__main__":
    main()
