"""How long a run holds each of its sites: it probes each site's resource manager as it opens
it — a site whose SLURM controller or Kubernetes API server does not answer fails only its own
stages, named, before any work starts there, and the other sites' stages run — and it releases
a site's allocations once no stage there or reading from there remains.

The resource managers that are down here are real clients (``scontrol``, the Kubernetes Python
client) talking to an address where nothing listens: what a controller that is down looks like."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pandas as pd
import pytest
from apps import wf_generate_reference as generated

import phalanx as px
from phalanx.orchestrator.models import Site, Stage, StoreConfig, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow

pytestmark = pytest.mark.multisite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workflow() -> Workflow:
    """generate here; 'far' sums it on the site that is down; 'near' sums it here."""
    totals = {"app": "apps:wf_totals", "ranks": 1, "inputs": {"tx": "tx"}}
    return Workflow(
        name="probe",
        stages={
            "generate": Stage(app="apps:wf_generate", ranks=2, params={"rows": 2000, "seed": 3}, outputs=["tx"]),
            "far": Stage(**totals, outputs=["totals"]),
            "near": Stage(**totals, outputs=["totals_near"], params={"output": "totals_near"}),
        },
    )


def run_with_far_site(tmp_path: Path, far: Site):
    here = Site(name="here", cores=2, store=StoreConfig(root=str(tmp_path / "here-store")))
    db = RunDB(tmp_path / "state")
    result = run_workflow(workflow(), here, db=db, sites={"generate": here, "far": far, "near": here})
    assert not result.ok and set(result.failed) == {"far"}, result.failed
    states = {s["stage"]: s["state"] for s in db.stages(result.run_id)}
    assert states == {"generate": "succeeded", "far": "failed", "near": "succeeded"}
    assert [e["message"] for e in db.events(result.run_id) if e["kind"] == "site down"] == [
        result.failed["far"]
    ]  # said once, as the run opened the site
    assert db.attempts(result.run_id, "far") == []  # nothing was started there
    expected = generated(2000, 2, seed=3).groupby("user", as_index=False)["amount"].sum()
    table = px.Store(here.store.root, session=result.session).read("totals_near").to_pandas()
    pd.testing.assert_frame_equal(table.sort_values("user").reset_index(drop=True), expected, check_dtype=False)
    return result.failed["far"]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="SLURM's client commands are not installed")
def test_a_slurm_site_whose_controller_is_down_fails_only_its_stages(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=gone\n"
        f"SlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={free_port()}\n"
        "MessageTimeout=2\n"
        "NodeName=n1 NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN\n"
        "PartitionName=debug Nodes=ALL Default=YES State=UP\n"
    )
    far = Site(
        name="hpc",
        executor="slurm",
        cores=2,
        slurm={"conf": str(conf)},
        store=StoreConfig(root=str(tmp_path / "hpc-store")),
    )
    error = run_with_far_site(tmp_path, far)
    assert error.startswith("site 'hpc' cannot be reached: GangError: site 'hpc' (slurm): "), error
    assert f"SLURM_CONF={conf}" in error


def test_a_kubernetes_site_whose_api_server_is_down_fails_only_its_stages(tmp_path):
    pytest.importorskip("kubernetes")
    port = free_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: gone, cluster: {{server: 'https://127.0.0.1:{port}', insecure-skip-tls-verify: true}}}}]\n"
        "users: [{name: nobody, user: {}}]\n"
        "contexts: [{name: gone, context: {cluster: gone, user: nobody}}]\n"
        "current-context: gone\n"
    )
    far = Site(
        name="cloud",
        executor="kubernetes",
        kubernetes={"kubeconfig": str(kubeconfig), "image": "python:3.12-slim"},
        store=StoreConfig(root=str(tmp_path / "cloud-store")),
    )
    error = run_with_far_site(tmp_path, far)
    assert error.startswith(
        f"site 'cloud' cannot be reached: GangError: site 'cloud' (kubernetes): the API server https://127.0.0.1:{port} "
        "does not answer: "
    ), error


def test_a_site_is_released_once_no_stage_there_or_reading_from_there_remains(tmp_path):
    """generate on 'hpc'; totals here reads tx (it crosses as totals starts); after here reads
    totals.  Once totals ended nothing remains on hpc or reads from it: the run releases hpc's
    allocations then (an event), before 'after' starts — not at the run's end."""
    here = Site(name="here", cores=2, store=StoreConfig(root=str(tmp_path / "here-store")))
    hpc = Site(name="hpc", cores=2, store=StoreConfig(root=str(tmp_path / "hpc-store")))
    totals = {"app": "apps:wf_totals", "ranks": 1, "inputs": {"tx": "tx"}}
    wf = Workflow(
        name="release",
        stages={
            "generate": Stage(app="apps:wf_generate", ranks=2, params={"rows": 2000, "seed": 4}, outputs=["tx"]),
            "totals": Stage(**totals, outputs=["totals"]),
            "after": Stage(  # sums the totals again (the same table), reading nothing from hpc
                app="apps:wf_totals",
                ranks=1,
                inputs={"tx": "totals"},
                outputs=["totals_after"],
                params={"output": "totals_after"},
            ),
        },
    )
    db = RunDB(tmp_path / "state")
    result = run_workflow(wf, here, db=db, sites={"generate": hpc, "totals": here, "after": here})
    assert result.ok, result.failed
    released = [e for e in db.events(result.run_id) if e["kind"] == "site released"]
    assert [e["message"] for e in released] == ["site 'hpc': no stage there or reading from there remains"]
    totals_ended = db.attempts(result.run_id, "totals")[-1]["ended"]
    after_started = db.attempts(result.run_id, "after")[-1]["started"]
    assert totals_ended <= released[0]["ts"] <= after_started
    expected = generated(2000, 2, seed=4).groupby("user", as_index=False)["amount"].sum()
    for name in ("totals", "totals_after"):
        table = px.Store(here.store.root, session=result.session).read(name).to_pandas()
        pd.testing.assert_frame_equal(table.sort_values("user").reset_index(drop=True), expected, check_dtype=False)
