"""Issue 24's HPC-to-cloud ETL (tests/multisite/test_hpc_to_cloud.py: ``generate``/``features``
on the test SLURM cluster's pilot across the multi-host bed, store in the hosts' /dev/shm with
``durability: memory``; ``train`` on the test Kubernetes cluster; ``report`` here; the features
crossing through the SeaweedFS exchange) from the entry points other than ``phalanx run``:

- **Parsl**: the workflow (its model with test_hpc_to_cloud's ``set``) as one app,
  ``workflow_app``, in a thread pool of Parsl's.
- **Airflow**: a DAG (written by the test into the session Airflow's DAGs folder) whose
  ``PhalanxWorkflowOperator`` task runs the workflow file with that ``set``, its stages naming
  the hpc, cloud and here sites, through ``dag.test()`` (in the main thread: Airflow's task
  runner sets signal handlers).

In both, test_hpc_to_cloud's ``hold`` stage on hpc keeps the pilot (and with it the hpc
datasets in the bed hosts' memory) while a driver-side reader takes every dataset of every site;
each equals the all-local run's byte for byte — transactions, users and features on hpc, features
in the exchange and as crossed to cloud, train_metrics on cloud and as crossed here — and the run
record says features crossed hpc → cloud through the object store (bytes up and down).

Not a task per stage (``PhalanxStageOperator``): each such task is a run of its own, and a SLURM
pilot belongs to its run's executor and ends with it (phalanx/executors/slurm/pilot.py), so with
``durability: memory`` the hpc datasets of ``generate``'s task are gone before ``features``'
task starts; a per-stage DAG on this hpc site would need ``durability: write-through`` to a
``durable`` every host mounts.

    PHALANX_REQUIRE_SEAWEEDFS=1 .venv/bin/python -m pytest -m multisite \\
        tests/multisite/test_hpc_to_cloud_entry_points.py -q -n0
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from multihost import test_etl_multihost as etl_tests
from multihost import test_slurm_gang_multihost as pilot_tests

import phalanx as px
from multisite.test_hpc_to_cloud import DATASETS, ETL, pilot_env, same_copies, snapshot, three_sites
from phalanx.orchestrator.rundb import RunDB

if importlib.util.find_spec("airflow") is not None:  # its session Airflow (imports no airflow itself)
    from test_airflow import TESTS, af  # noqa: F401  (af: a fixture, found by its name here)

pytestmark = [pytest.mark.multisite, pytest.mark.multihost]

driver_host = pilot_tests.driver_host  # the pilot tests' fixtures, used here too
host_root = pilot_tests.host_root


@pytest.fixture
def bed(multihost_slurm, shared_tmp, driver_host, host_root, k8s_cluster, seaweedfs_credentials, tmp_path, monkeypatch):
    """The all-local reference (each dataset's bytes) and test_hpc_to_cloud's three sites."""
    pytest.importorskip("torch")  # the example's train stage
    pilot_env(monkeypatch, shared_tmp)
    _, _, alone = etl_tests.run_all_local(tmp_path, "all-local")
    reference = snapshot(alone)
    assert sorted(reference) == DATASETS
    sites = three_sites(
        multihost_slurm, shared_tmp, driver_host, host_root, k8s_cluster, seaweedfs_credentials, tmp_path
    )
    sites.root = tmp_path  # the cloud and here store roots are in it
    return reference, sites


def same_as_all_local(reference: dict, stages: dict, sites, session: str, there: dict, on_exchange: dict) -> None:
    """Every dataset of every site equals the all-local run's byte for byte (``there``: the hpc
    ones, read while hold waited; ``on_exchange``: the features in transit), and the run record
    says how the features and the metrics crossed."""
    features = stages["train"]["inputs"]["data"]["crossed"]
    nbytes = sum(p.bytes for p in reference["features"]["info"].partitions)
    assert (features["from"], features["to"], features["path"]) == ("hpc", "cloud", "object store"), features
    assert features["bytes"] == 2 * nbytes and not features["already"], features  # up, then down, once
    assert stages["report"]["inputs"]["metrics"]["crossed"]["path"] == "direct"
    on_cloud = snapshot(px.Store(sites.root / "cloud", session))
    at_home = snapshot(px.Store(sites.root / "here", session))
    assert sorted(on_cloud) == ["features", "train_metrics"] and sorted(at_home) == ["train_metrics"]
    assert px.Store(sites.exchange, session).list() == []  # the succeeded run removed its copies in transit
    same_copies(reference, there, on_exchange, on_cloud, at_home)


def test_parsl_app_hpc_to_cloud_same_bytes_as_all_local(bed, shared_tmp, host_root, tmp_path):
    parsl = pytest.importorskip("parsl", reason="parsl is not installed (pip install 'phalanx[parsl]')")
    from parsl.config import Config
    from parsl.executors.threads import ThreadPoolExecutor

    from phalanx.integrations.parsl import WorkflowResult, workflow_app
    from phalanx.orchestrator.loading import load_workflow

    reference, sites = bed
    wf, here = load_workflow(ETL, site=str(sites.files["here"]), overrides=sites.sets)
    session = f"parsl-{secrets.token_hex(4)}"  # known before the run: the driver reads hpc meanwhile
    here = here.model_copy(update={"store": here.store.model_copy(update={"session": session})})
    state = shared_tmp / "state"  # the pilot writes its log there
    dfk = parsl.load(Config(executors=[ThreadPoolExecutor(max_threads=1)], run_dir=str(tmp_path / "runinfo")))
    t0 = time.monotonic()
    try:
        future = workflow_app(wf, here, state=state)()
        try:
            while not (sites.gate / "sealed").exists():
                if future.done():  # ended before hold: it failed
                    pytest.fail(f"the run ended before its hold stage: {future.exception()!r}")
                assert time.monotonic() - t0 < 300, "the run did not reach its hold stage in 300 s"
                time.sleep(0.2)
            on_hpc = px.Store(host_root, session, metadata=sites.metadata)
            there = snapshot(on_hpc, ["transactions", "users", "features"])  # from the bed hosts' memory
            fetched = on_hpc.reads.as_dict()
            on_exchange = snapshot(px.Store(sites.exchange, session))
        finally:
            (sites.gate / "go").touch()
        result = future.result(timeout=300)
    finally:
        dfk.cleanup()
        parsl.clear()
    assert isinstance(result, WorkflowResult) and result.session == session
    stages = {s["stage"]: s for s in RunDB(state).stages(result.run_id)}
    assert {s: stages[s]["site"] for s in ("generate", "features", "train", "report", "hold")} == {
        "generate": "hpc",
        "features": "hpc",
        "train": "cloud",
        "report": "here",
        "hold": "hpc",
    }
    assert fetched["local"] == 0 and fetched["fetched"] > 0, fetched  # none in the driver's /dev/shm
    same_as_all_local(reference, stages, sites, session, there, on_exchange)
    assert str(result.outputs["train_metrics"].root) == str(tmp_path / "cloud")  # where its stage sealed it


DAG = '''"""Written by tests/multisite/test_hpc_to_cloud_entry_points.py: the HPC-to-cloud ETL as an
Airflow task whose stages name the hpc, cloud and here sites."""
import datetime

from airflow.sdk import DAG

from phalanx.integrations.airflow import PhalanxWorkflowOperator

with DAG("px_hpc_to_cloud", schedule=None, start_date=datetime.datetime(2025, 1, 1), catchup=False) as dag:
    PhalanxWorkflowOperator(task_id="etl", workflow={etl!r}, site={here!r}, set={sets!r}, state={state!r},
                            deferrable=False)
'''


def dags_test(module: Path, dag_id: str) -> str:
    """``airflow dags test DAG_ID`` in a process of its own, as a user runs it (it parses the DAGs
    folder afresh: a DAG file written after this process's first ``dag.test()`` is not in the
    DagBag that call cached); its output."""
    assert module.exists()
    r = subprocess.run(
        [sys.executable, "-m", "airflow", "dags", "test", dag_id],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))},
    )
    out = r.stdout + r.stderr
    sys.stdout.write(out[-20000:])  # shown by pytest when the test fails
    assert r.returncode == 0, out[-5000:]
    return out


def test_airflow_dag_hpc_to_cloud_same_bytes_as_all_local(request, bed, shared_tmp, host_root, capfd):
    if importlib.util.find_spec("airflow") is None:  # never imported before af sets AIRFLOW_HOME
        pytest.skip("apache-airflow 3 is not installed (pip install 'phalanx[airflow]')")
    af = request.getfixturevalue("af")
    reference, sites = bed
    # The operator reads each value as `--set K=V` reads its text (str(v), as YAML): a list or a
    # mapping given as JSON (str() of a list writes Python's repr, whose '\n' escapes YAML's single
    # quotes keep as they are)
    sets = {k: v if isinstance(v, str) else json.dumps(v) for k, v in sites.sets.items()}
    state = shared_tmp / f"state-{secrets.token_hex(4)}"  # the pilot writes its log there; this run's only
    module = af.dags / f"px_hpc_to_cloud_{secrets.token_hex(4)}.py"
    module.write_text(DAG.format(etl=str(ETL), here=str(sites.files["here"]), sets=sets, state=str(state)))
    # dag.test drives the run here (Airflow's task runner sets signal handlers: the main thread
    # only); a thread reads the hpc datasets while hold waits, then lets the run end
    read: dict = {}

    def while_held() -> None:
        t0 = time.monotonic()
        try:
            while not (sites.gate / "sealed").exists():
                if time.monotonic() - t0 > 300:
                    raise TimeoutError("the run did not reach its hold stage in 300 s")
                time.sleep(0.2)
            read["session"] = session = RunDB(state).runs(limit=1)[0]["session"]
            on_hpc = px.Store(host_root, session, metadata=sites.metadata)
            read["there"] = snapshot(on_hpc, ["transactions", "users", "features"])  # the bed hosts' memory
            read["fetched"] = on_hpc.reads.as_dict()
            read["exchange"] = snapshot(px.Store(sites.exchange, session))
        except BaseException as e:  # said below
            read["error"] = e
        finally:
            (sites.gate / "go").touch()

    reader = threading.Thread(target=while_held, daemon=True)
    reader.start()
    try:
        log = dags_test(module, "px_hpc_to_cloud")
    finally:
        (sites.gate / "go").touch()  # the run failed before hold: the reader ends too
        (sites.gate / "sealed").touch()
        reader.join(timeout=60)
    assert "DagRun Finished: dag_id=px_hpc_to_cloud" in log and "state=success" in log, log[-3000:]
    assert "error" not in read, read["error"]
    session, there, on_exchange = read["session"], read["there"], read["exchange"]
    assert read["fetched"]["local"] == 0 and read["fetched"]["fetched"] > 0, read["fetched"]
    (run,) = RunDB(state).runs()  # the task's run, in the state directory its operator was given
    assert run["session"] == session and run["state"] == "succeeded"
    stages = {s["stage"]: s for s in RunDB(state).stages(run["id"])}
    where = {"generate": "hpc", "features": "hpc", "train": "cloud", "report": "here", "hold": "hpc"}
    assert {name: st["site"] for name, st in stages.items()} == where  # each stage on the site it names
    same_as_all_local(reference, stages, sites, session, there, on_exchange)
    assert "features: hpc → cloud (object store)" in log, log[-3000:]
