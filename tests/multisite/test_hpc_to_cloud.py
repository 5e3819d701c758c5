"""HPC to cloud in one workflow, one run (issue 24's proof): the ETL example
(workflows/etl_to_training.yaml) with ``generate`` and ``features`` on the test SLURM cluster's
pilot across the multi-host test bed, the features sealed there, ``train`` on the test
Kubernetes cluster, ``report`` on this machine — and the same datasets, byte for byte, as the
all-local run of the same workflow.

    .venv/bin/python -m pytest -m multisite tests/multisite/test_hpc_to_cloud.py -q -n0 -s

The sizes are tests/multihost/test_etl_multihost.py's (``SMALL``: 80,000 transactions, 4,000
users, ``generate``/``features`` on 3 ranks — one a host — ``train`` on 2, 3 epochs).

The three sites and their stores:

- **hpc** (the pilot of tests/multihost/test_slurm_gang_multihost.py ``pilot_site``): store
  root in /dev/shm — each bed host its own — with ``durability: memory``: a partition lives only
  in the memory of the host whose rank wrote it, served by that host's store service; the
  catalogue (SQLite) on the shared /var/tmp.
- **cloud** (site-configs/k8s-local.yaml on the session's cluster): store root a directory of
  this host, which the rank pods mount read-write (``host_paths: auto`` mounts the store root
  the gang's environment names); the pods reach nothing else of the other sites.
- **here** (the workflow's own site, executor ``local``): a store root of its own.

Two crossings, each done by the driver before the consuming stage starts:

1. ``features`` hpc → cloud **through the object store** both site files name as
   ``store.exchange`` (a real SeaweedFS on 127.0.0.1): up from the bed hosts' store services to
   S3, then down into the cluster's store directory — the HPC center and the cloud pool share
   an object store, not a network.
2. ``train_metrics`` cloud → here **directly** (this site names no exchange): ``report`` is a
   command stage given ``inputs: {metrics: train_metrics}``; it reads the crossed copy from its
   own store (``px.Store.from_env()``).

The hpc datasets live in the bed's memory only while the pilot (with the store services)
lasts, and the run releases a site's allocations as soon as no stage there or reading from there
remains — the pilot would end as ``train`` starts.  So a command stage ``hold`` on hpc, after
``train``, touches ``gate/sealed`` and waits for ``gate/go``, as in test_etl_multihost.py: the
driver reads every dataset of every site meanwhile — the hpc ones through the hosts' services,
checked against their checksums — then lets the run end.  ``cloud`` is released once ``report``
has started (its input crossed) and nothing else needs it.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from multihost import test_etl_multihost as etl_tests
from multihost import test_slurm_gang_multihost as pilot_tests
from multihost.conftest import N_HOSTS

import phalanx as px
from phalanx.orchestrator.rundb import RunDB
from phalanx.store.service import write_token_file
from phalanx.store.tiers import part_file

pytestmark = [pytest.mark.multisite, pytest.mark.multihost]

driver_host = pilot_tests.driver_host  # the pilot tests' fixtures, used here too
host_root = pilot_tests.host_root
ETL, SMALL, DATASETS, STAGES = etl_tests.ETL, etl_tests.SMALL, etl_tests.DATASETS, etl_tests.STAGES  # its sizes

WHERE = {"generate": "hpc", "features": "hpc", "train": "cloud", "report": "here", "hold": "hpc"}

# report, on this machine: reads the metrics that crossed into its store
REPORT = """
import phalanx as px
metrics = px.Store.from_env().read("train_metrics")
print("epochs", metrics.num_rows, "final loss", metrics.column("loss")[-1].as_py())
"""


def snapshot(store: px.Store, names=None) -> dict:
    """Datasets of the store's session: info, each partition's exact bytes (checked against the
    checksum wherever they live: mapped here or fetched from a host's service), whole table."""
    out = {}
    for name in sorted(names or store.list()):
        info = store.info(name)
        out[name] = {
            "info": info,
            "raw": [store.partition_bytes(info, i).to_pybytes() for i in range(info.num_partitions)],
            "table": store.read(name),
        }
    return out


def same_bytes(a: dict, b: dict, what: str) -> None:
    ia, ib = a["info"], b["info"]
    assert (ib.schema, ib.partitioning, ib.num_rows) == (ia.schema, ia.partitioning, ia.num_rows), what
    assert [(p.rows, p.bytes, p.checksum) for p in ib.partitions] == [
        (p.rows, p.bytes, p.checksum) for p in ia.partitions
    ], what
    assert b["raw"] == a["raw"], what  # the partition files themselves
    assert b["table"].equals(a["table"]), what


def pilot_env(monkeypatch, shared_tmp: Path) -> None:
    """The store services' token and the pilot ranks' log directory, on the shared /var/tmp."""
    monkeypatch.setenv("PHALANX_STORE_TOKEN_FILE", str(write_token_file(shared_tmp / "token", secrets.token_hex(32))))
    monkeypatch.setenv("PHALANX_LOG_DIR", str(shared_tmp / "logs" / "gangs"))  # the pilot's ranks write there


def three_sites(multihost_slurm, shared_tmp, driver_host, host_root, k8s_cluster, seaweedfs_credentials, tmp_path):
    """The hpc, cloud and here site files (in ``shared_tmp``), the exchange both hpc and cloud
    name, the hpc catalogue, the gate directory of the ``hold`` stage, and the workflow's ``set``
    (``SMALL``, each stage's site, report reading the crossed metrics, hold on hpc)."""
    from test_kubernetes import K8s

    exchange = f"s3://phalanx-test/exchange-{secrets.token_hex(4)}?endpoint_override={seaweedfs_credentials.endpoint}"
    metadata = f"sqlite://{shared_tmp}/meta.sqlite"  # the hpc catalogue, on the shared /var/tmp
    hpc = pilot_tests.pilot_site(
        multihost_slurm,
        driver_host,
        shared_tmp,
        {"root": host_root, "metadata": metadata, "durability": "memory", "exchange": exchange},
    )
    hpc["name"] = "hpc"
    kube = K8s(k8s_cluster, tmp_path)
    cloud = kube.data(name="cloud", store={"root": str(tmp_path / "cloud"), "exchange": exchange})
    here = {"name": "here", "executor": "local", "cores": 3, "store": {"root": str(tmp_path / "here")}}
    files = {}
    for site in (hpc, cloud, here):
        files[site["name"]] = shared_tmp / f"{site['name']}.yaml"
        files[site["name"]].write_text(yaml.safe_dump(site))
    gate = shared_tmp / f"gate-{secrets.token_hex(4)}"  # hold runs on a bed host: /tmp is its own
    gate.mkdir()
    sets = {
        **SMALL,
        "stages.generate.site": str(files["hpc"]),
        "stages.features.site": str(files["hpc"]),
        "stages.train.site": str(files["cloud"]),
        "stages.report.inputs": {"metrics": "train_metrics"},
        "stages.report.command": ["python", "-c", REPORT],
        # test_etl_multihost's gate, on hpc: says every dataset is sealed and waits for the driver
        # to have read them (the pilot and its store services live while a stage there runs)
        "stages.hold": {
            "kind": "command",
            "command": ["python", "-c", etl_tests.GATE, str(gate)],
            "needs": ["train"],
            "site": str(files["hpc"]),
        },
    }
    return SimpleNamespace(exchange=exchange, metadata=metadata, kube=kube, files=files, gate=gate, sets=sets)


def same_copies(reference: dict, there: dict, on_exchange: dict, on_cloud: dict, at_home: dict) -> None:
    """Every copy of every dataset of the HPC-to-cloud run equals the all-local run's."""
    for name in ("transactions", "users", "features"):
        same_bytes(reference[name], there[name], f"{name} on hpc")
    same_bytes(reference["features"], on_exchange["features"], "features in the exchange")
    same_bytes(reference["features"], on_cloud["features"], "features crossed to cloud")
    same_bytes(reference["train_metrics"], on_cloud["train_metrics"], "train_metrics on cloud")
    same_bytes(reference["train_metrics"], at_home["train_metrics"], "train_metrics crossed here")


def test_etl_on_the_slurm_pilot_training_on_kubernetes_report_here_one_run_same_bytes_as_all_local(
    multihost_slurm,
    shared_tmp,
    driver_host,
    host_root,
    k8s_cluster,
    seaweedfs_credentials,
    tmp_path,
    monkeypatch,
):
    pytest.importorskip("torch")  # the example's train stage
    assert N_HOSTS == 3
    pilot_env(monkeypatch, shared_tmp)

    # ---- 1. the all-local run -------------------------------------------------------------------
    _, local_s, alone = etl_tests.run_all_local(tmp_path, "all-local")
    reference = snapshot(alone)
    assert sorted(reference) == DATASETS

    # ---- 2. the sites ---------------------------------------------------------------------------
    bed = three_sites(multihost_slurm, shared_tmp, driver_host, host_root, k8s_cluster, seaweedfs_credentials, tmp_path)
    exchange, metadata, kube, files, gate, sets = bed.exchange, bed.metadata, bed.kube, bed.files, bed.gate, bed.sets

    # ---- 3. one run on three sites -------------------------------------------------------------
    t0 = time.monotonic()
    handle = px.submit(ETL, files["here"], set=sets, state=shared_tmp / "state")  # the pilot writes its log there
    try:
        while not (gate / "sealed").exists():
            if handle.wait(timeout=0.2):  # ended before report started: it failed
                result = handle.result()
                pytest.fail(f"the run ended before its hold stage: {result.failed} {result.skipped}")
            assert time.monotonic() - t0 < 240, "the run did not reach its hold stage in 240 s"
        sealed_s = time.monotonic() - t0
        t1 = time.monotonic()
        on_hpc = px.Store(host_root, handle.session, metadata=metadata)
        there = snapshot(on_hpc, ["transactions", "users", "features"])  # from the bed hosts' memory
        fetched = on_hpc.reads.as_dict()
        on_exchange = snapshot(px.Store(exchange, handle.session))  # in transit: gone once the run succeeds
        read_s = time.monotonic() - t1
    finally:
        (gate / "go").touch()
    result = handle.result()
    multi_s = time.monotonic() - t0
    assert result.ok, (result.failed, result.skipped)
    db = RunDB(shared_tmp / "state")
    stages = {s["stage"]: s for s in db.stages(result.run_id)}
    assert {s: stages[s]["state"] for s in STAGES} == dict.fromkeys(STAGES, "succeeded")
    assert stages["hold"]["state"] == "succeeded"
    on_cloud = snapshot(px.Store(tmp_path / "cloud", result.session))
    assert px.Store(exchange, result.session).list() == []  # the succeeded run removed its copies in transit
    at_home = snapshot(px.Store(tmp_path / "here", result.session))

    # ---- where each stage ran ------------------------------------------------------------------
    events = db.events(result.run_id)
    plan = next(e["message"] for e in events if e["kind"] == "sites")
    assert plan == "3 sites: " + ", ".join(f"{s} on {w}" for s, w in WHERE.items()), plan
    # each other site released as soon as nothing there or reading from there remained: cloud
    # once report had started (train_metrics crossed), hpc once hold ended; here at the run's end
    released = {e["message"].split("'")[1]: e["ts"] for e in events if e["kind"] == "site released"}
    assert sorted(released) == ["cloud", "hpc"], released
    report_started = db.attempts(result.run_id, "report")[-1]["started"]
    assert report_started <= released["cloud"] and db.attempts(result.run_id, "hold")[-1]["ended"] <= released["hpc"]
    ranks = {s: [r["host"] for r in db.attempts(result.run_id, s)[-1]["rank_info"]] for s in STAGES[:3]}
    assert sorted(ranks["generate"]) == sorted(ranks["features"]) == pilot_tests.HOSTS, ranks
    placed = [e["message"] for e in events if e["kind"] == "placed" and e["stage"] == "train"]
    assert placed and all(m.startswith("kubernetes: job ") for m in placed), placed
    kube.wait_nothing_left(db.attempts(result.run_id, "train")[-1]["gang_id"])  # its Job, pods... deleted
    for name in ("transactions", "users", "features"):  # one partition in each bed host's memory
        assert sorted(p.host for p in there[name]["info"].partitions) == pilot_tests.HOSTS, name
    assert fetched["local"] == 0 and fetched["fetched"] > 0, fetched  # none in the driver's /dev/shm
    assert sorted(on_cloud) == ["features", "train_metrics"]  # train sealed its metrics there
    assert sorted(at_home) == ["train_metrics"] and sorted(on_exchange) == ["features"]

    # ---- the crossings, as the run record says them --------------------------------------------
    features_crossed = stages["train"]["inputs"]["data"]["crossed"]
    metrics_crossed = stages["report"]["inputs"]["metrics"]["crossed"]
    nbytes = {name: sum(p.bytes for p in reference[name]["info"].partitions) for name in DATASETS}
    assert features_crossed["from"] == "hpc" and features_crossed["to"] == "cloud"
    assert features_crossed["path"] == "object store" and not features_crossed["already"]
    assert features_crossed["bytes"] == 2 * nbytes["features"]  # up to the exchange, then down
    assert metrics_crossed["from"] == "cloud" and metrics_crossed["to"] == "here"
    assert metrics_crossed["path"] == "direct" and not metrics_crossed["already"]
    assert metrics_crossed["bytes"] == nbytes["train_metrics"]
    said = [e["message"] for e in events if e["kind"] == "crossed"]
    assert len(said) == 2 and "features: hpc → cloud (object store)" in said[0], said
    assert "train_metrics: cloud → here (direct)" in said[1], said
    report_log = Path(db.attempts(result.run_id, "report")[-1]["log_dir"], "rank-0.log").read_text()
    assert "epochs 3 final loss" in report_log, report_log  # it read the crossed metrics

    # ---- the same datasets as the all-local run, byte for byte ---------------------------------
    same_copies(reference, there, on_exchange, on_cloud, at_home)
    for store in (on_cloud, at_home):
        for name, got in store.items():  # a crossed copy on a file root: the very file bytes
            info = got["info"]
            files_there = [(Path(info.location) / part_file(i)).read_bytes() for i in range(info.num_partitions)]
            assert files_there == reference[name]["raw"], name

    print(
        f"\nhpc→cloud: all-local {local_s:.1f} s; one run on 3 sites {multi_s:.1f} s (report reached at "
        f"{sealed_s:.1f} s; the driver's read of the hpc datasets {read_s:.2f} s: {fetched}); ranks {ranks}\n"
        f"crossed: train.data {features_crossed}; report.metrics {metrics_crossed}\n"
        f"events: {said}\nreport's log: {report_log.strip()[-300:]}"
    )
