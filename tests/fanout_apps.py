"""Apps of the fan-out and condition tests (tests/test_fanout.py): each writes what it was given,
so the tests can compare with an independent computation."""

from __future__ import annotations

import pyarrow as pa


def configs(env):
    """The sweep's configurations as rows (a fan-out over rows reads them)."""
    n = int(env.params.get("n", 3))
    table = pa.table({"scale": list(range(1, n + 1)), "label": [f"cfg{i}" for i in range(1, n + 1)]})
    env.output("configs", px_frame(env, table if env.rank == 0 else table.slice(0, 0)))


def numbers(env):
    """Rows x = 0..rows-1, spread over the ranks."""
    rows = int(env.params.get("rows", 100))
    mine = [x for x in range(rows) if x % env.world_size == env.rank]
    env.output("numbers", px_frame(env, pa.table({"x": pa.array(mine, pa.int64())})))


def scaled(env):
    """Each instance: x * scale + offset, with the instance's params as columns."""
    table = env.input("numbers").to_arrow()
    scale, offset = env.params.get("scale", 1), env.params.get("offset", 0)
    n = table.num_rows
    out = pa.table(
        {
            "x": table["x"],
            "y": pa.array([v * scale + offset for v in table["x"].to_pylist()], pa.int64()),
            "scale": pa.array([scale] * n, pa.int64()),
            "offset": pa.array([offset] * n, pa.int64()),
        }
    )
    env.output(env.outputs[0], px_frame(env, out))  # "scaled", or whatever the stage names it


def total(env):
    """Fan-in: the sum of y per (scale, offset), over one concatenated frame or a list."""
    got = env.input("parts")
    frames = got if isinstance(got, list) else [got]
    tables = [f.to_arrow() for f in frames]
    rows = {}
    for t in tables:
        for s, o, y in zip(t["scale"].to_pylist(), t["offset"].to_pylist(), t["y"].to_pylist()):
            rows[(s, o)] = rows.get((s, o), 0) + y
    keys = sorted(rows)
    out = pa.table(
        {
            "scale": pa.array([k[0] for k in keys], pa.int64()),
            "offset": pa.array([k[1] for k in keys], pa.int64()),
            "sum_y": pa.array([rows[k] for k in keys], pa.int64()),
            "frames": pa.array([len(frames)] * len(keys), pa.int64()),
        }
    )
    env.output(env.outputs[0], px_frame(env, out))


def fail_on(env):
    """An instance that fails when its scale is the param ``bad``."""
    if env.params.get("scale") == env.params.get("bad"):
        raise RuntimeError(f"instance with scale {env.params['scale']} fails on purpose")
    scaled(env)


def marker(env):
    """Writes one row saying it ran."""
    env.output("ran", px_frame(env, pa.table({"stage": [env.params.get("tag", "x")] if env.rank == 0 else []})))


def px_frame(env, table):
    from phalanx.operators.dataframe import DataFrame

    return DataFrame.from_arrow(table, env)
