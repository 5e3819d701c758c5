"""Apps of tests/test_cache.py: each notes on rank 0 that it ran (a line in params.log), so a
test can tell a stage that ran from one whose outputs were reused."""

from __future__ import annotations

from pathlib import Path


def _ran(env, what: str) -> None:
    if env.rank == 0:
        with open(env.params["log"], "a") as f:
            f.write(what + "\n")


def generate(env):
    """Rows of (user, amount) from params rows and seed, as tests/apps.py:wf_generate makes them
    (its wf_generate_reference is the independent reference); rows from a file when
    params.rows_file names one (data read outside the store: not in the fingerprint)."""
    import numpy as np
    import pyarrow as pa

    import phalanx as px

    _ran(env, "generate")
    rows = int(Path(env.params["rows_file"]).read_text()) if env.params.get("rows_file") else env.params["rows"]
    rng = np.random.default_rng([env.params.get("seed", 0), env.rank])
    n = rows // env.world_size
    part = pa.table({"user": rng.integers(0, 50, n), "amount": rng.integers(1, 100, n)})
    env.output("tx", px.DataFrame.from_arrow(part, env))


def totals(env):
    """Per-user sums of the input ``tx``."""
    _ran(env, "totals")
    return {"totals": env.input("tx").groupby("user").agg({"amount": "sum"})}
