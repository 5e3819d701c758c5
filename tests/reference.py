"""Test data with the awkward cases, and comparison against an independent engine."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc


def make_part(rank: int, world: int, rows: int = 4000, seed: int = 0, hot: float = 0.3) -> pa.Table:
    """One rank's partition: skewed keys (a share ``hot`` of them is key 0), nulls in keys and values, strings,
    bools, timestamps; with 3+ ranks, rank 1 holds no rows at all."""
    if world >= 3 and rank == 1:
        rows = 0
    rng = np.random.default_rng(seed * 1000 + rank)
    key = rng.integers(0, rows // 4 + 5, rows)
    key[rng.random(rows) < hot] = 0
    key_mask = rng.random(rows) < 0.05
    v = rng.normal(size=rows)
    v_mask = rng.random(rows) < 0.1
    w = rng.integers(-50, 50, rows)
    cats = np.array(["alpha", "beta", "gamma", "delta", "ε-unicode", ""])
    s = cats[rng.integers(0, len(cats), rows)]
    s_mask = rng.random(rows) < 0.05
    ts = np.datetime64("2024-01-01T00:00:00") + rng.integers(0, 10**6, rows).astype("timedelta64[s]")
    return pa.table(
        {
            "key": pa.array(key, pa.int64(), mask=key_mask),
            "v": pa.array(v, pa.float64(), mask=v_mask),
            "w": pa.array(w, pa.int64()),
            "s": pa.array(s, pa.string(), mask=s_mask),
            "b": pa.array(rng.random(rows) < 0.5),
            "ts": pa.array(ts.astype("datetime64[us]"), pa.timestamp("us")),
        }
    )


def whole(world: int, rows: int = 4000, seed: int = 0, hot: float = 0.3) -> pa.Table:
    return pa.concat_tables([make_part(r, world, rows, seed, hot) for r in range(world)])


def _sortable(table: pa.Table) -> pa.Table:
    return table.take(pc.sort_indices(table, sort_keys=[(c, "ascending", "at_end") for c in table.column_names]))


def assert_same_rows(actual: pa.Table, expected: pa.Table, rel: float = 1e-9) -> None:
    """Equal as multisets of rows (order ignored); floats compared with a tolerance."""
    assert sorted(actual.column_names) == sorted(expected.column_names), (
        f"columns differ: {actual.column_names} vs {expected.column_names}"
    )
    actual = actual.select(expected.column_names)
    assert actual.num_rows == expected.num_rows, f"{actual.num_rows} rows, expected {expected.num_rows}"
    floats = [f.name for f in expected.schema if pa.types.is_floating(f.type)]
    # Sort on the exact columns first so float noise cannot reorder rows.
    exact = [c for c in expected.column_names if c not in floats] + floats
    a = _cast_like(actual, expected).select(exact)
    e = expected.select(exact)
    a, e = _sortable(a), _sortable(e)
    for name in exact:
        av, ev = a[name].to_pylist(), e[name].to_pylist()
        if name in floats:
            for i, (x, y) in enumerate(zip(av, ev)):
                if x is None or y is None or (isinstance(x, float) and math.isnan(x)):
                    assert (x is None) == (y is None), f"{name}[{i}]: {x} vs {y}"
                else:
                    assert math.isclose(x, y, rel_tol=rel, abs_tol=1e-9), f"{name}[{i}]: {x} vs {y}"
        else:
            assert av == ev, f"column {name} differs"


def _cast_like(table: pa.Table, like: pa.Table) -> pa.Table:
    fields = [pa.field(f.name, like.schema.field(f.name).type) for f in table.schema]
    return table.cast(pa.schema(fields))


def gid_table(t: pa.Table) -> pa.Table:
    """The whole frame with its global row position, for order-dependent references."""
    return t.append_column("gid", pa.array(np.arange(t.num_rows, dtype=np.int64)))


def expected_features(tx: pd.DataFrame, users: pd.DataFrame) -> pd.DataFrame:
    """The ETL example's features stage (phalanx.examples.synthetic), recomputed with pandas from
    the generated datasets."""
    tx = tx.assign(weekend=tx.ts.dt.day_of_week >= 5, online=tx.channel != "store")
    g = (
        tx.groupby("user_id")
        .agg(
            n_tx=("tx_id", "count"),
            total_amount=("amount", "sum"),
            avg_amount=("amount", "mean"),
            max_amount=("amount", "max"),
            n_weekend=("weekend", "sum"),
            n_online=("online", "sum"),
            n_refund=("is_refund", "sum"),
            first_ts=("ts", "min"),
            last_ts=("ts", "max"),
        )
        .reset_index()
    )
    df = g.merge(users, on="user_id", how="inner")
    days = lambda s: s.astype("datetime64[s]").astype("int64") / 86400  # noqa: E731
    signup = pd.to_datetime(df.signup_date).astype("datetime64[s]").astype("int64") / 86400
    df["n_tx_log"] = np.log1p(df.n_tx)
    df["total_log"] = np.log1p(df.total_amount)
    df["avg_log"] = np.log1p(df.avg_amount.fillna(0))
    df["max_log"] = np.log1p(df.max_amount.fillna(0))
    df["weekend_share"] = df.n_weekend / df.n_tx
    df["online_share"] = df.n_online / df.n_tx
    df["refund_share"] = df.n_refund / df.n_tx
    df["active_years"] = (days(df.last_ts) - days(df.first_ts)) / 365.25
    df["tenure_years"] = (days(df.last_ts) - signup) / 365.25
    df["age_scaled"] = df.age.fillna(40) / 100
    df["age_missing"] = df.age.isna().astype(float)
    df["label"] = df.churned.astype(float)
    return df.sort_values("user_id").reset_index(drop=True)
