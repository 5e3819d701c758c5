"""The ETL example (workflows/etl_to_training.yaml) on a SLURM pilot spanning the test bed's
three hosts, with no shared store root, seals byte-identical datasets to the same workflow
run on this one machine.

    .venv/bin/python -m pytest -m multihost tests/multihost/test_etl_multihost.py -q -n0 -s

Both runs use the same overrides (``SMALL``): the example's sizes shrunk as in
tests/test_examples.py (80,000 transactions, 4,000 users, 3 epochs of batch 64), ``generate``
and ``features`` on 3 ranks (so their partitions are in all three hosts' memory; the example
has 2), ``train`` (torch DDP) on its 2, ``report`` on its 1.  ``train`` is kept: torch is in
the venv (the test is marked ``torch`` and skips where torch cannot be imported).

1. **Local**: executor ``local`` on this machine, a store root of its own with the default
   settings (file tier, SQLite catalogue in the root, durability ``memory``).
2. **Across hosts**: the site of tests/multihost/test_slurm_gang_multihost.py — a SLURM pilot
   of 3 nodes (px-h1..px-h3, one task a node), ``driver_host`` the bridge address, a
   ``file://`` rendezvous on the shared /var/tmp, ``slurm.srun_via`` px-head — with the store
   root in /dev/shm, which every host has its own of (no shared store root), the catalogue
   (SQLite) on the shared /var/tmp and ``durability: memory``: each partition lives only in
   the memory of the host whose rank wrote it, served by that host's store service.

**How the multi-host datasets are read.**  With ``durability: memory`` the partitions exist
only in the hosts' /dev/shm, served by the pilot's store services, and the pilot (with its
services) ends when the run ends.  So the driver reads them *during* the run: the run is
started with ``px.submit`` and its last stage, ``report`` (a command stage that seals
nothing), is overridden to touch ``gate/sealed`` and wait for ``gate/go`` (at most 300 s)
before printing ``done`` as the example's does.  When ``sealed`` appears, every dataset is
sealed (``report`` needs ``train``, which needs the rest); the driver then reads each one
through ``px.Store`` — from the root namespace, whose /dev/shm holds none of them, so every
byte comes from the hosts' store services and is checked against the catalogue's checksum on
arrival — writes ``go``, and the run ends.  Nothing is written through to a shared directory:
the bytes compared are the ones in the hosts' memory.  (Write-through and reading the copies
after the run would compare the copies, not what the stages read from each other.)

Asserted: the same datasets, each with the same schema, partitioning, per-partition (rows,
bytes, checksum) — the rank counts are the same, so partitions must be byte-identical — and
equal tables (``pyarrow.Table.equals``: same rows in the same order), whole and partition by
partition; the partitions of the multi-host run on at least two of px-h1..3 (in fact all
three for generate's and features'); the run DB's stage inputs record bytes fetched from
other hosts (and read on the ranks' own), while the local run fetched nothing.  ``train``
reads its input with ``px.ml.loader``, which records it in the run DB too (rows, bytes, read
here vs fetched: every train rank holds every partition, so it fetches those of the hosts it
is not on); the test asserts ``features``' records (its inputs ``tx`` and ``users``) and that
some stage fetched bytes from another host, not the numbers of ``train``'s.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import phalanx as px
from phalanx.orchestrator.rundb import RunDB
from phalanx.store.service import write_token_file

from . import test_slurm_gang_multihost as pilot_tests
from .conftest import N_HOSTS
from .test_slurm_gang_multihost import HOSTS, pilot_site

driver_host = pilot_tests.driver_host  # the pilot tests' fixtures, used here too
host_root = pilot_tests.host_root

pytestmark = [pytest.mark.multihost, pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[2]
ETL = ROOT / "workflows" / "etl_to_training.yaml"
SMALL = {
    "stages.generate.ranks": 3,
    "stages.generate.params.rows": 80_000,
    "stages.generate.params.users": 4_000,
    "stages.features.ranks": 3,
    "stages.train.params.epochs": 3,
    "stages.train.params.batch_size": 64,
    "stages.train.params.lr": 0.01,
}
DATASETS = ["features", "train_metrics", "transactions", "users"]
STAGES = ["generate", "features", "train", "report"]

# report on the pilot: says every dataset is sealed, then waits for the driver to have read them
GATE = """
import pathlib, sys, time
gate = pathlib.Path(sys.argv[1])
(gate / "sealed").touch()
deadline = time.monotonic() + 300
while not (gate / "go").exists():
    if time.monotonic() > deadline:
        sys.exit("the driver never read the datasets (no " + str(gate / "go") + ")")
    time.sleep(0.1)
print("done")
"""


def run_all_local(tmp_path: Path, name: str) -> tuple[Any, float, px.Store]:
    """The ETL example at SMALL on this machine alone (3 local slots, store and state under
    ``tmp_path``, named ``name``): the run's result, its seconds, and its store, which holds
    every dataset of the example — the reference a run across hosts or sites must equal."""
    site = tmp_path / f"{name}.yaml"
    site.write_text(
        yaml.safe_dump({"name": name, "executor": "local", "cores": 3, "store": {"root": str(tmp_path / name)}})
    )
    t0 = time.monotonic()
    result = px.run(ETL, site, set=SMALL, state=tmp_path / f"{name}-state", progress=False)
    seconds = time.monotonic() - t0
    assert result.ok, (result.failed, result.skipped)
    store = px.Store(tmp_path / name, result.session)
    assert sorted(store.list()) == DATASETS
    return result, seconds, store


def snapshot(store: px.Store) -> dict:
    """Every dataset of the store's session: its info, the whole table, each partition's table."""
    out = {}
    for name in sorted(store.list()):
        info = store.info(name)
        out[name] = {
            "info": info,
            "table": store.read(name),
            "parts": [store.partition(info, i) for i in range(info.num_partitions)],
        }
    return out


def stage_inputs(db: RunDB, run_id: str) -> dict:
    return {s["stage"]: s.get("inputs") or {} for s in db.stages(run_id)}


def rank_hosts(db: RunDB, run_id: str, stage: str) -> list[str]:
    ranks = sorted(db.attempts(run_id, stage)[-1]["rank_info"], key=lambda r: r["rank"])
    return [r["host"] for r in ranks]


def test_the_etl_example_on_the_pilot_across_hosts_seals_the_same_bytes_as_on_one_host(
    multihost_slurm, shared_tmp, driver_host, host_root, tmp_path, monkeypatch
):
    pytest.importorskip("torch")  # the example's train stage
    assert N_HOSTS == 3
    monkeypatch.setenv("PHALANX_STORE_TOKEN_FILE", str(write_token_file(shared_tmp / "token", secrets.token_hex(32))))
    monkeypatch.setenv("PHALANX_LOG_DIR", str(shared_tmp / "logs" / "gangs"))

    # ---- 1. on this machine ------------------------------------------------------------------
    local, local_s, store = run_all_local(tmp_path, "test-local")
    local_db = RunDB(tmp_path / "test-local-state")
    here = snapshot(store)

    # ---- 2. on the pilot across px-h1..px-h3, the store in each host's own memory ------------
    root = host_root  # /dev/shm/...: each host's own
    metadata = f"sqlite://{shared_tmp}/meta.sqlite"  # the catalogue on the shared /var/tmp
    site = pilot_site(
        multihost_slurm, driver_host, shared_tmp, {"root": root, "metadata": metadata, "durability": "memory"}
    )
    (shared_tmp / "site.yaml").write_text(yaml.safe_dump(site))
    gate = shared_tmp / "gate"
    gate.mkdir()
    sets = {**SMALL, "stages.report.command": ["python", "-c", GATE, str(gate)]}
    t0 = time.monotonic()
    handle = px.submit(ETL, shared_tmp / "site.yaml", set=sets, state=shared_tmp / "state")
    try:
        while not (gate / "sealed").exists():
            if handle.wait(timeout=0.2):  # ended before report started: it failed
                result = handle.result()
                pytest.fail(f"the run on the pilot ended before its report stage: {result.failed} {result.skipped}")
            assert time.monotonic() - t0 < 300, "the run on the pilot did not reach its report stage in 300 s"
        sealed_s = time.monotonic() - t0
        # the run and its pilot are alive: the driver reads every dataset from the hosts' services
        t1 = time.monotonic()
        reader = px.Store(root, handle.session, metadata=metadata)
        there = snapshot(reader)
        read_s = time.monotonic() - t1
        fetched = reader.reads.as_dict()
    finally:
        (gate / "go").touch()
    result = handle.result()
    multi_s = time.monotonic() - t0
    assert result.ok, (result.failed, result.skipped)
    db = RunDB(shared_tmp / "state")
    assert {s["stage"]: s["state"] for s in db.stages(result.run_id)} == dict.fromkeys(STAGES, "succeeded")

    hosts = {s: rank_hosts(db, result.run_id, s) for s in ("generate", "features", "train")}
    print(
        f"\netl_to_training: local {local_s:.1f} s; pilot across hosts {multi_s:.1f} s "
        f"(all sealed at {sealed_s:.1f} s, the driver's read of {len(there)} datasets {read_s:.2f} s: {fetched}); "
        f"ranks on {hosts}"
    )

    # ---- the same datasets, byte for byte -------------------------------------------------------
    assert sorted(there) == sorted(here) == DATASETS
    for name in DATASETS:
        a, b = here[name]["info"], there[name]["info"]
        assert (b.schema, b.partitioning, b.num_rows) == (a.schema, a.partitioning, a.num_rows), name
        # the same rank counts: each partition the same bytes (the checksum of the file)
        assert [(p.rows, p.bytes, p.checksum) for p in b.partitions] == [
            (p.rows, p.bytes, p.checksum) for p in a.partitions
        ], name
        assert there[name]["table"].equals(here[name]["table"]), name  # same rows, same order
        assert len(there[name]["parts"]) == len(here[name]["parts"])
        for i, (pa_, pb) in enumerate(zip(here[name]["parts"], there[name]["parts"])):
            assert pb.equals(pa_), (name, i)

    # ---- where the data lived --------------------------------------------------------------------
    for name in DATASETS:
        placed = {p.host for p in there[name]["info"].partitions}
        assert placed <= set(HOSTS), (name, placed)
    for name in ("transactions", "users", "features"):  # 3 ranks: one partition in each host's memory
        assert sorted(p.host for p in there[name]["info"].partitions) == HOSTS, name
    assert len({p.host for n in DATASETS for p in there[n]["info"].partitions}) >= 2
    assert sorted(hosts["generate"]) == HOSTS and sorted(hosts["features"]) == HOSTS, hosts
    assert len(set(hosts["train"])) == 2 and set(hosts["train"]) <= set(HOSTS), hosts  # DDP across two hosts
    # the driver's /dev/shm held none of it: every byte came from the hosts' services, checked
    total = sum(p.bytes for n in DATASETS for p in there[n]["info"].partitions)
    assert fetched["local"] == 0 and fetched["fetched"] >= total, (fetched, total)

    # ---- bytes moved between hosts, as the run DB records them --------------------------------
    # (features' reads of transactions and users, and train's of the features through
    # px.ml.loader: train runs on two of the three hosts, so the third host's partition is fetched)
    inputs = stage_inputs(db, result.run_id)
    assert sorted(inputs["features"]) == ["tx", "users"], inputs
    assert inputs["train"]["data"]["fetched"] > 0 and inputs["train"]["data"]["read_here"] > 0, inputs
    for name, rec in inputs["features"].items():
        assert {"read_here", "fetched"} <= set(rec), (name, rec)
    across = {f"{s}.{n}": r["fetched"] for s, ins in inputs.items() for n, r in ins.items() if r.get("fetched")}
    assert across, inputs  # at least one stage read bytes held by another host
    print(f"stage inputs (bytes read on the rank's host / fetched from another): {inputs}")
    here_inputs = stage_inputs(local_db, local.run_id)
    assert not any(r.get("fetched") for ins in here_inputs.values() for r in ins.values()), here_inputs
    assert all(r.get("read_here", 0) > 0 for ins in here_inputs.values() for r in ins.values()), here_inputs
