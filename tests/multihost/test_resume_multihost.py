"""A run whose outputs lived in the memory of hosts that are gone, resumed (issue 23, faults).

A 2-stage workflow on the SLURM pilot across px-h1..3 keeps its datasets in the hosts' own
/dev/shm, served by the pilot's store services.  When the run ends, its pilot — and with it
every store service — ends: to a later driver the hosts holding the data are gone.

- ``durability: memory``: `--resume` finds every output lost (each partition's host no longer
  answers: checked where it lives, no bytes move), says so, and recomputes both stages from
  their lineage; the new result equals pandas.  Nothing reports success with missing rows.
- ``durability: write-through``: the copies hold; `--resume` reuses both stages.

    .venv/bin/python -m pytest -m multihost tests/multihost/test_resume_multihost.py -q -n0
"""

from __future__ import annotations

import secrets

import numpy as np
import pandas as pd
import pytest
import yaml

import phalanx as px
from phalanx.errors import PartitionLostError
from phalanx.orchestrator.rundb import RunDB
from phalanx.store.service import write_token_file

from . import test_slurm_gang_multihost as pilot_tests
from .test_slurm_gang_multihost import WORKFLOW, pilot_site

driver_host = pilot_tests.driver_host  # the fixtures of the pilot tests, used here too
host_root = pilot_tests.host_root

pytestmark = pytest.mark.multihost


def _expected() -> pd.DataFrame:
    parts = []
    for r in range(3):  # tests/apps.py: wf_generate with rows 6000, seed 5, on 3 ranks
        rng = np.random.default_rng([5, r])
        parts.append(pd.DataFrame({"user": rng.integers(0, 50, 2000), "amount": rng.integers(1, 100, 2000)}))
    return pd.concat(parts).groupby("user", as_index=False)["amount"].sum()


@pytest.mark.parametrize("durability", ["memory", "write-through"])
def test_resume_after_the_hosts_memory_is_gone(
    durability, multihost_slurm, shared_tmp, driver_host, host_root, monkeypatch
):
    root = host_root
    monkeypatch.setenv("PHALANX_STORE_TOKEN_FILE", str(write_token_file(shared_tmp / "token", secrets.token_hex(32))))
    monkeypatch.setenv("PHALANX_LOG_DIR", str(shared_tmp / "logs" / "gangs"))
    store_section = {"root": root, "metadata": f"sqlite://{shared_tmp}/meta.sqlite", "durability": durability}
    if durability == "write-through":
        store_section["durable"] = str(shared_tmp / "durable")
    site = pilot_site(multihost_slurm, driver_host, shared_tmp, store_section)
    (shared_tmp / "site.yaml").write_text(yaml.safe_dump(site))
    (shared_tmp / "wf.yaml").write_text(WORKFLOW)
    state = shared_tmp / "state"
    first = px.run(shared_tmp / "wf.yaml", shared_tmp / "site.yaml", state=state, progress=False)
    assert first.ok, first.failed
    # the pilot and its services are gone now: so is every partition held only in memory
    again = px.run(shared_tmp / "wf.yaml", shared_tmp / "site.yaml", state=state, progress=False, resume=first.run_id)
    assert again.ok, again.failed
    events = RunDB(state).events(first.run_id)
    reruns = {e["stage"]: e["message"] for e in events if e["kind"] == "rerun"}
    reused = {e["stage"] for e in events if e["kind"] == "reused"}
    if durability == "memory":
        assert set(reruns) == {"generate", "totals"}, events
        assert "is held in the memory of host px-h" in reruns["generate"], reruns
        assert not reused
    else:
        assert reused == {"generate", "totals"} and not reruns, events
    store = px.Store(
        root, first.session, metadata=f"sqlite://{shared_tmp}/meta.sqlite", durable=store_section.get("durable")
    )
    if durability == "write-through":
        got = store.read("totals").to_pandas()  # from the copies: the hosts' memory is gone
    else:  # recomputed by the resume, whose pilot is gone too: read what it sealed from the run DB
        stages = {s["stage"]: s for s in RunDB(state).stages(first.run_id)}
        assert stages["totals"]["outputs"]["totals"][0] == len(_expected())
        with pytest.raises(PartitionLostError, match="held in the memory of host px-h"):
            store.read("totals")  # and once that pilot ended, those are gone too
        return
    pd.testing.assert_frame_equal(got.sort_values("user").reset_index(drop=True), _expected(), check_dtype=False)
