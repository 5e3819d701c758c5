"""Tables the store contract writes and compares: every Arrow type the store keeps, and an
equality where NaN equals NaN."""

from __future__ import annotations

import datetime
import decimal

import numpy as np
import pyarrow as pa


def every_type_table(n: int = 500) -> pa.Table:
    rng = np.random.default_rng(1)
    mask = rng.random(n) < 0.2
    return pa.table(
        {
            "i8": pa.array(rng.integers(-100, 100, n), pa.int8(), mask=mask),
            "i64": pa.array(rng.integers(-(2**62), 2**62, n), pa.int64(), mask=mask),
            "u32": pa.array(rng.integers(0, 2**32 - 1, n), pa.uint32()),
            "f32": pa.array(rng.random(n), pa.float32(), mask=mask),
            "f64": pa.array(np.where(rng.random(n) < 0.1, np.nan, rng.normal(size=n))),
            "bool": pa.array(rng.random(n) < 0.5, mask=mask),
            "str": pa.array([None if m else f"s{i}-ü" * (i % 4) for i, m in enumerate(mask)]),
            "large_str": pa.array([f"L{i}" for i in range(n)], pa.large_string()),
            "ts": pa.array(
                [datetime.datetime(2024, 1, 1) + datetime.timedelta(seconds=int(i)) for i in range(n)],
                pa.timestamp("us", tz="UTC"),
            ),
            "date": pa.array([datetime.date(2020, 1, 1) + datetime.timedelta(days=i) for i in range(n)]),
            "dec": pa.array([decimal.Decimal(i) / 100 for i in range(n)], pa.decimal128(10, 2)),
            "list": pa.array([[i, i + 1] if i % 3 else None for i in range(n)], pa.list_(pa.int64())),
            "dict": pa.array(["a", "b", None, "c"] * (n // 4)).dictionary_encode(),
        }
    )


def same_table(a: pa.Table, b: pa.Table) -> bool:
    """Table equality where NaN equals NaN (Arrow's equals says NaN != NaN)."""
    if not a.schema.equals(b.schema):
        return False
    for name in a.column_names:
        x, y = a[name], b[name]
        if pa.types.is_floating(x.type):
            if not (
                np.array_equal(x.is_null().to_numpy(zero_copy_only=False), y.is_null().to_numpy(zero_copy_only=False))
                and np.array_equal(x.fill_null(0).to_numpy(), y.fill_null(0).to_numpy(), equal_nan=True)
            ):
                return False
        elif not x.equals(y):
            return False
    return True
