"""One workflow on two sites from the entry points other than ``phalanx run``: Airflow (a task
per stage, each naming its site; the whole workflow as one task, from a file and from a
``px.Workflow``) and Parsl (``px.Workflow.as_parsl_app``).

The sites are this machine with two store roots ("hpc", "cloud": tests/test_multisite.py's
``site_files``), so an input sealed on one crosses into the other's store: the crossed dataset
has the source's partition checksums, the results equal pandas', and the task's manifest (XCom)
and run record say how it crossed.  Airflow runs through ``dag.test()`` on tests/test_airflow.py's
session Airflow (``af``)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pandas as pd
import pytest
from apps import wf_generate_reference as generated
from test_multisite import site_files

import phalanx as px

if importlib.util.find_spec("airflow") is not None:  # its session Airflow (imports no airflow itself)
    from test_airflow import af, run_dag  # noqa: F401  (af: a fixture, found by its name here)

pytestmark = pytest.mark.multisite
TESTS = Path(__file__).resolve().parents[1]
DAGS = TESTS / "airflow_dags" / "phalanx_multisite_dags.py"


@pytest.fixture
def sites(tmp_path, monkeypatch):
    """site-configs/hpc.yaml and cloud.yaml (and wf.yaml beside them), found by name; the ranks
    import tests/apps.py."""
    wf = site_files(tmp_path)
    monkeypatch.setenv("PHALANX_SITE_PATH", str(tmp_path / "site-configs"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    return tmp_path, wf


def totals_of(rows: int, seed: int) -> pd.DataFrame:
    return generated(rows, 2, seed=seed).groupby("user", as_index=False)["amount"].sum()


def same_table(got: pd.DataFrame, expected: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(got.sort_values("user").reset_index(drop=True), expected, check_dtype=False)


def same_checksums(a: px.Store, b: px.Store, name: str) -> int:
    """``name`` in ``b`` has ``a``'s partitions (rows, bytes, checksums); its size."""
    src, dst = a.info(name), b.info(name)
    assert [(p.rows, p.bytes, p.checksum) for p in src.partitions] == [
        (p.rows, p.bytes, p.checksum) for p in dst.partitions
    ]
    assert dst.origin["store"] == str(a.root) and dst.origin["version"] == src.version
    return src.nbytes


# ---- Airflow -------------------------------------------------------------------------------------
@pytest.fixture
def dags(request, sites):
    """tests/test_airflow.py's session Airflow (``af``), its DAGs folder holding this file's DAGs."""
    if importlib.util.find_spec("airflow") is None:  # never imported before af sets AIRFLOW_HOME
        pytest.skip("apache-airflow 3 is not installed (pip install 'phalanx[airflow]')")
    af = request.getfixturevalue("af")
    link = af.dags / DAGS.name
    if not link.exists():
        link.symlink_to(DAGS)
    return af


def test_airflow_a_task_per_stage_on_two_sites_crosses_the_input_once(dags, sites, capfd):
    from phalanx.orchestrator.rundb import RunDB

    af, (root, _) = dags, sites
    states, xcoms, log = run_dag(af, capfd, DAGS, "px_multisite_tasks")
    assert states == dict.fromkeys(("generate", "totals", "again"), "success"), states
    made = xcoms["generate"]["return_value"]
    session = made["session"]
    entry = made["outputs"]["tx"]  # the manifest says where tx is: the site and its store (no secret)
    assert entry["site"] == "hpc" and entry["store"]["root"] == str(root / "hpc-store")
    assert entry["store"]["metadata"].startswith("sqlite://") and xcoms["generate"]["tx"] == entry
    hpc, cloud = px.Store(root / "hpc-store", session=session), px.Store(root / "cloud-store", session=session)
    nbytes = same_checksums(hpc, cloud, "tx")
    # both readers ran on cloud; tx crossed once, for the first
    first, second = xcoms["totals"]["return_value"], xcoms["again"]["return_value"]
    assert first["session"] == second["session"] == session
    assert first["outputs"]["totals"]["site"] == "cloud"
    assert first["crossed"]["tx"] == {
        **first["crossed"]["tx"],
        "dataset": f"{session}/tx",
        "from": "hpc",
        "to": "cloud",
        "bytes": nbytes,
        "path": "direct",
        "already": False,
    }
    assert second["crossed"]["tx"]["already"] is True and second["crossed"]["tx"]["bytes"] == 0
    expected = totals_of(4000, 5)
    same_table(cloud.read("totals").to_pandas(), expected)
    same_table(cloud.read("totals_again").to_pandas(), expected)
    assert not hpc.exists("totals") and not cloud.exists("generate")
    # the task log and the run record say it
    assert f"{session}/tx: hpc → cloud (direct), {nbytes / 1e6:,.1f} MB in" in log
    events = RunDB().events(first["run_id"])
    assert [e["stage"] for e in events if e["kind"] == "crossed"] == ["totals"]
    assert len(json.dumps(first)) < 4000


def test_airflow_a_whole_workflow_on_two_sites_file_and_python(dags, sites, capfd):
    from phalanx.orchestrator.rundb import RunDB

    af, (root, wf) = dags, sites
    states, xcoms, _ = run_dag(af, capfd, DAGS, "px_multisite_workflow", {"workflow": str(wf)})
    assert states == {"file": "success", "object": "success"}, states
    for task, (rows, seed) in (("file", (3000, 9)), ("object", (4000, 5))):
        result = xcoms[task]["return_value"]
        outputs = result["outputs"]
        assert (outputs["tx"]["site"], outputs["totals"]["site"]) == ("hpc", "cloud"), outputs
        assert outputs["totals"]["store"]["root"] == str(root / "cloud-store") and outputs["totals"]["rows"] == 50
        hpc = px.Store(root / "hpc-store", session=result["session"])
        cloud = px.Store(root / "cloud-store", session=result["session"])
        same_table(cloud.read("totals").to_pandas(), totals_of(rows, seed))
        nbytes = same_checksums(hpc, cloud, "tx")
        stages = {s["stage"]: s for s in RunDB().stages(result["run_id"])}
        crossed = stages["totals"]["inputs"]["tx"]["crossed"]
        assert (crossed["from"], crossed["to"], crossed["bytes"], crossed["path"]) == ("hpc", "cloud", nbytes, "direct")
        assert stages["generate"]["site"] == "hpc"


def test_airflow_manifest_names_a_store_without_its_credentials(dags):
    from types import SimpleNamespace

    from phalanx.integrations.airflow._runs import location
    from phalanx.integrations.airflow.operators import same_location

    store = SimpleNamespace(
        tier=SimpleNamespace(root_url="s3://lake/px?endpoint_override=http://h:1&secret_key=abc123"),
        meta=SimpleNamespace(url="redis://:hunter2@h:6379/0"),
    )
    where = location(store, "s3://x/ex?endpoint_override=http://h:2&credentials=env:SITE_B")
    text = json.dumps(where)
    assert "abc123" not in text and "hunter2" not in text and "SITE_B" not in text
    assert where["exchange"].startswith("s3://x/ex?endpoint_override=http://h:2")
    assert same_location(where, dict(where)) and not same_location(where, {**where, "root": "/elsewhere"})


# ---- Parsl ---------------------------------------------------------------------------------------
def test_parsl_workflow_app_on_two_sites(sites):
    parsl = pytest.importorskip("parsl", reason="parsl is not installed (pip install 'phalanx[parsl]')")
    import apps
    from parsl.config import Config
    from parsl.executors.threads import ThreadPoolExecutor

    from phalanx.integrations.parsl import WorkflowResult, workflow_app
    from phalanx.orchestrator.rundb import RunDB

    root, wf_file = sites
    generate = px.stage(apps.wf_generate, name="generate", ranks=2, params={"rows": 2000, "seed": 3}, outputs=["tx"])
    by_user = {"tx": {"dataset": "tx", "by": ["user"]}}
    totals = px.stage(apps.wf_totals, name="totals", ranks=2, site="cloud", inputs=by_user, outputs=["totals"])
    wf = px.Workflow("parsl-across", [generate, totals], site="hpc")
    dfk = parsl.load(Config(executors=[ThreadPoolExecutor(max_threads=2)], run_dir=str(root / "runinfo")))
    try:
        # a px.Workflow and a workflow file (its stages' sites beside it), each a Parsl app
        futures = [
            wf.as_parsl_app(state=root / "state")(),
            workflow_app(str(wf_file), state=root / "state")(),
        ]
        results = [f.result(timeout=240) for f in futures]
    finally:
        dfk.cleanup()
        parsl.clear()
    for result, (rows, seed) in zip(results, ((2000, 3), (3000, 9))):
        assert isinstance(result, WorkflowResult)
        assert Path(result.outputs["totals"].root) == root / "cloud-store"  # where its stage sealed it
        assert Path(result.outputs["tx"].root) == root / "hpc-store"
        same_table(result.outputs["totals"].read().to_pandas(), totals_of(rows, seed))
        hpc = px.Store(root / "hpc-store", session=result.session)
        cloud = px.Store(root / "cloud-store", session=result.session)
        nbytes = same_checksums(hpc, cloud, "tx")
        stages = {s["stage"]: s for s in RunDB(root / "state").stages(result.run_id)}
        assert stages["totals"]["inputs"]["tx"]["crossed"]["bytes"] == nbytes
