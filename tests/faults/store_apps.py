"""Apps of the store fault tests (tests/faults/test_store_faults.py), importable by ranks as
"store_apps:function"."""

from __future__ import annotations

import time
from pathlib import Path


def totals_after_go(env):
    """Per-user totals of ``tx``, held between reading and sealing: after reading, each rank
    writes params.dir/ready.<rank> and waits (bounded) for params.dir/go."""
    df = env.input("tx")
    directory = Path(env.params["dir"])
    (directory / f"ready.{env.rank}").touch()
    deadline = time.monotonic() + 120
    while not (directory / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{directory / 'go'} never appeared")
        time.sleep(0.02)
    return {"totals": df.groupby("user").agg({"amount": "sum"})}


def get_verified(env, session: str, name: str) -> int:
    """Rows of this rank's share of ``name``, read with checksums verified."""
    return env.store.for_session(session).get(name, verify=True).num_rows
