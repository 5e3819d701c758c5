"""The fan-in of the sweep example (workflows/sweep.yaml): the best of the trained configurations."""

from __future__ import annotations

import pyarrow as pa

import phalanx as px


def pick_best(env):
    """Reads every training instance's metrics (``gather: list``: one frame per instance, and
    ``env.inputs["metrics"]["items"]`` the config each was trained with) and seals ``best``: one
    row a config, ranked by the last epoch's accuracy (then loss), the best first."""
    spec = env.inputs["metrics"]
    rows = []
    for item, frame in zip(spec["items"], env.input("metrics")):
        whole = frame.collect()  # every rank gets the instance's few rows
        assert whole is not None
        history = whole.to_pylist()
        last = max(history, key=lambda r: r["epoch"])
        rows.append({**{k: float(v) for k, v in item.items()}, "accuracy": last["accuracy"], "loss": last["loss"]})
    rows.sort(key=lambda r: (-r["accuracy"], r["loss"]))
    for rank, row in enumerate(rows, 1):
        env.log.info("#%d %s", rank, ", ".join(f"{k}={v:.4g}" for k, v in row.items()))
    table = pa.Table.from_pylist(rows) if env.rank == 0 else pa.Table.from_pylist(rows).slice(0, 0)
    env.output("best", px.DataFrame.from_arrow(table, env))
