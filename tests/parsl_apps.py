"""BSP functions for tests/test_parsl.py, in an importable module: Parsl pickles apps by reference.

Each app is decorated in the test (``bsp_app(...)(parsl_apps.merge_groupby)``) so one function
serves every placement.  Inputs are made deterministically from a seed, so the test can build the
same tables for DuckDB.
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

import phalanx as px


def make_tables(rows: int, seed: int) -> tuple[pa.Table, pa.Table]:
    """Transactions (user, amount) and users (user, region): the whole input, for the check."""
    rng = np.random.default_rng(seed)
    users = 50
    tx = pa.table(
        {
            "user": rng.integers(0, users + 10, rows),  # some users have no row in `users`
            "amount": rng.integers(1, 1000, rows).astype("float64"),
        }
    )
    us = pa.table({"user": np.arange(users, dtype="int64"), "region": np.arange(users, dtype="int64") % 7})
    return tx, us


def generate(env, rows, seed):
    """Rank r's share of both tables, sealed as outputs tx and users."""
    tx, us = make_tables(rows, seed)

    def share(t: pa.Table) -> pa.Table:
        per = -(-t.num_rows // env.world_size)
        return t.slice(env.rank * per, per)

    return {
        "tx": px.DataFrame.from_arrow(share(tx), env),
        "users": px.DataFrame.from_arrow(share(us), env),
        "rank": env.rank,
        "pid": os.getpid(),
        "node": os.environ.get("SLURMD_NODENAME"),
    }


def merge_groupby(env, tx, users):
    """Join transactions with users and total the amount per region (distributed merge+groupby)."""
    joined = tx.merge(users, on="user", how="inner")
    out = joined.groupby("region").agg({"amount": "sum", "user": "count"})
    return {"by_region": out, "local_rows": out.local_num_rows, "pid": os.getpid()}


def top_regions(env, by_region, n):
    """A second app on the first's output: the n regions with the largest totals."""
    out = by_region.sort_values("amount", ascending=False).head(n)
    return out


def fail_on_rank(env, rank, pid_dir):
    """Every rank notes its pid; rank ``rank`` raises, the others wait in a collective."""
    with open(os.path.join(pid_dir, f"rank-{env.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if env.rank == rank:
        raise ValueError(f"boom on rank {env.rank}")
    env.barrier()  # the failing rank never arrives: fail-fast must stop us
    return env.rank


def failing_stage(env):
    raise RuntimeError("stage boom")


def trivial(env):
    return env.rank


def totals_stage(env):
    """A workflow stage reading a Parsl app's output (bound as its input tx): amount per user."""
    return {"totals": env.input("tx").groupby("user").agg({"amount": "sum"})}
