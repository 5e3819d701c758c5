"""A dataset crossing *into* a site whose store is each host's own memory (issue 23: the
driver's host serves what it holds, like every host of the run).

``generate`` runs here (the local executor, its own store); ``totals`` runs on the SLURM pilot
across the three bed hosts, whose store root is each host's /dev/shm with ``durability:
memory``; ``back`` runs here again.  ``tx`` crosses into the pilot site's store before totals
starts: the driver writes it, so its partitions lie in the driver's host memory (the root
namespace's /dev/shm), which no bed host shares.  The pilot's ranks read it through the store
service the driver runs for the site (at the site's ``driver_host``, the bridge address) — by
key, 2 partitions to 3 ranks — and ``totals`` crosses back for ``back``.  Right against pandas.

A resume whose first run failed after the crossing (the driver's service gone with it) finds
the crossed copy already there, points it at the new run's service, and reads it from there.

    .venv/bin/python -m pytest -m multisite tests/multisite/test_into_host_memory.py -q -n0
"""

from __future__ import annotations

import secrets

import pandas as pd
import pytest
import yaml
from apps import wf_generate_reference as generated
from multihost import test_slurm_gang_multihost as pilot_tests

import phalanx as px
from phalanx.orchestrator.rundb import RunDB
from phalanx.store.remote import hostname

pytestmark = [pytest.mark.multisite, pytest.mark.multihost]

driver_host = pilot_tests.driver_host
host_root = pilot_tests.host_root

BACK = """
import phalanx as px
print("totals", px.Store.from_env().read("totals").num_rows)
"""


def workflow(hpc_file, fail_marker: str = "") -> dict:
    totals = {
        "app": "apps:wf_totals",
        "ranks": 3,
        "site": str(hpc_file),
        "needs": ["generate"],
        "inputs": {"tx": {"dataset": "tx", "by": ["user"]}},
        "outputs": ["totals"],
    }
    if fail_marker:
        totals["params"] = {"fail_marker": fail_marker, "fail_times": 1}
    return {
        "name": "into-memory",
        "stages": {
            "generate": {"app": "apps:wf_generate", "ranks": 2, "params": {"rows": 6000, "seed": 9}, "outputs": ["tx"]},
            "totals": totals,
            "back": {
                "kind": "command",
                "command": ["python", "-c", BACK],
                "needs": ["totals"],
                "inputs": {"totals": "totals"},
            },
        },
    }


def sites(multihost_slurm, driver_host, shared_tmp, host_root, tmp_path):
    token = shared_tmp / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    hpc = pilot_tests.pilot_site(
        multihost_slurm,
        driver_host,
        shared_tmp,
        {"root": host_root, "metadata": f"sqlite://{shared_tmp}/meta.sqlite", "durability": "memory"},
    )
    hpc["name"] = "hpc"
    here = {"name": "here", "executor": "local", "cores": 2, "store": {"root": str(tmp_path / "here")}}
    files = {}
    for site in (hpc, here):
        files[site["name"]] = shared_tmp / f"{site['name']}.yaml"
        files[site["name"]].write_text(yaml.safe_dump(site))
    return files, token


def expected() -> pd.DataFrame:
    tx = generated(6000, 2, seed=9)
    return tx.groupby("user", as_index=False)["amount"].sum().sort_values("user").reset_index(drop=True)


def totals_here(tmp_path, session: str) -> pd.DataFrame:
    got = px.Store(tmp_path / "here", session).read("totals").to_pandas()
    return got.sort_values("user").reset_index(drop=True)


def served(db: RunDB, run_id: str) -> list[str]:
    return [e["message"] for e in db.events(run_id) if e["kind"] == "store service"]


def test_a_dataset_crossed_into_the_hosts_memory_is_read_by_the_pilots_ranks_from_the_drivers_host(
    multihost_slurm, driver_host, shared_tmp, host_root, tmp_path, monkeypatch
):
    files, token = sites(multihost_slurm, driver_host, shared_tmp, host_root, tmp_path)
    monkeypatch.setenv("PHALANX_STORE_TOKEN_FILE", str(token))
    monkeypatch.setenv("PHALANX_LOG_DIR", str(shared_tmp / "logs" / "gangs"))
    (shared_tmp / "wf.yaml").write_text(yaml.safe_dump(workflow(files["hpc"])))
    state = shared_tmp / "state"
    result = px.run(shared_tmp / "wf.yaml", files["here"], state=state, progress=False)
    assert result.ok, result.failed
    pd.testing.assert_frame_equal(totals_here(tmp_path, result.session), expected(), check_dtype=False)

    db = RunDB(state)
    (message,) = served(db, result.run_id)
    assert message.startswith("site 'hpc': what the driver writes here is served at grpc+tcp://" + driver_host), message
    read = {s["stage"]: s for s in db.stages(result.run_id)}["totals"]["inputs"]["tx"]
    assert read["fetched"] > 0 and read["read_here"] == 0, read  # every byte from the driver's host
    hpc_store = px.Store(host_root, result.session, metadata=f"sqlite://{shared_tmp}/meta.sqlite")
    hosts = {p.host for p in hpc_store.info("tx").partitions}
    assert hosts == {hostname()}, hosts  # the crossed copy: in the driver's memory


def test_a_resume_points_the_crossed_copy_at_its_own_drivers_service(
    multihost_slurm, driver_host, shared_tmp, host_root, tmp_path, monkeypatch
):
    files, token = sites(multihost_slurm, driver_host, shared_tmp, host_root, tmp_path)
    monkeypatch.setenv("PHALANX_STORE_TOKEN_FILE", str(token))
    monkeypatch.setenv("PHALANX_LOG_DIR", str(shared_tmp / "logs" / "gangs"))
    marker = shared_tmp / "fail-once"
    (shared_tmp / "wf.yaml").write_text(yaml.safe_dump(workflow(files["hpc"], fail_marker=str(marker))))
    state = shared_tmp / "state"
    first = px.run(shared_tmp / "wf.yaml", files["here"], state=state, progress=False)
    assert not first.ok and "totals" in first.failed, first
    hpc_store = px.Store(host_root, first.session, metadata=f"sqlite://{shared_tmp}/meta.sqlite")
    before = {p.endpoint for p in hpc_store.info("tx").partitions}

    again = px.run(shared_tmp / "wf.yaml", files["here"], state=state, progress=False, resume=first.run_id)
    assert again.ok, again.failed
    pd.testing.assert_frame_equal(totals_here(tmp_path, again.session), expected(), check_dtype=False)
    db = RunDB(state)
    crossed = [e["message"] for e in db.events(again.run_id) if e["kind"] == "crossed" and "tx:" in e["message"]]
    assert len(crossed) == 2 and "already" in crossed[1], crossed  # the resume sent nothing: the copy was there
    after = {p.endpoint for p in hpc_store.info("tx").partitions}
    assert len(after) == 1 and after != before, (before, after)  # the resume's own service
    first_served, resumed_served = served(db, again.run_id)  # the run's events: both drivers'
    assert first_served.endswith(next(iter(before))) and resumed_served.endswith(next(iter(after)))
