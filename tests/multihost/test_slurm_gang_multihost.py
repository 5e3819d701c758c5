"""A phalanx gang on the SLURM pilot across the hosts of the test bed (docs/multihost.md), the
driver (this pytest) in the root namespace: one rank per host, each with its own /dev/shm; a
shuffle and an allreduce among them right against pandas; the store (SQLite catalogue and
file tier) on the shared /var/tmp, written by one host's rank and read by another's.

    .venv/bin/python -m pytest -m multihost tests/multihost/test_slurm_gang_multihost.py -q -p no:randomly

The site (``SITE``): ``slurm.srun_via`` runs the driver's ``srun --jobid`` inside px-head (srun
listens for its tasks on the address its host's name resolves to: 127.0.0.1 in the root
namespace, which no host reaches); ``driver_host`` is the root namespace's bridge address
(``auto`` resolves this machine's name, to 127.0.0.1 here); the rendezvous, store and logs
are under ``shared_tmp``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import phalanx as px
from phalanx.executors.slurm import SlurmExecutor
from phalanx.store.service import ping, read_token_file, write_token_file

from .conftest import INFRA, N_HOSTS

pytestmark = pytest.mark.multihost

HOSTS = [f"px-h{i}" for i in range(1, N_HOSTS + 1)]


def slurm_section(conf: str) -> dict:
    return {
        "allocation": "pilot",
        "conf": conf,
        "srun_via": [str(INFRA / "multihost-exec"), "px-head"],
        "ranks_per_node": 1,
        "poll_interval": 0.25,
        "pilot": {"nodes": N_HOSTS, "ntasks": N_HOSTS, "time": "00:30:00"},
    }


def pilot_site(conf: str, driver_host: str, shared: Path, store: dict) -> dict:
    """A site file's content: the pilot across the hosts, the driver at the bridge address,
    the rendezvous on the shared directory, the given ``store:`` section."""
    return {
        "name": "slurm-multihost",
        "executor": "slurm",
        "driver_host": driver_host,
        "rendezvous": f"file://{shared}/rdzv",
        "start_timeout": 120,
        "store": store,
        "slurm": slurm_section(conf),
    }


@pytest.fixture(scope="module")
def driver_host(multihost_bed) -> str:
    return multihost_bed.load_state()["bridge_addr"]  # 10.231.0.1: what every host reaches


@pytest.fixture
def host_root(multihost_bed, shared_tmp):
    """A store root in /dev/shm: each host's own (and the driver's, which a driver's Store
    makes); removed everywhere at the end."""
    root = f"/dev/shm/phalanx-mh-{shared_tmp.name}/store"
    yield root
    for h in multihost_bed.hosts():
        multihost_bed.run_on(h["name"], ["rm", "-rf", os.path.dirname(root)], timeout=30)
    shutil.rmtree(os.path.dirname(root), ignore_errors=True)


@pytest.fixture
def pilot_run(multihost_slurm, shared_tmp, monkeypatch):
    """A run scope on the multihost cluster's pilot (closed at the end: the pilot is cancelled);
    gang logs and the pilot's log under shared_tmp."""
    monkeypatch.setenv("PHALANX_LOG_DIR", str(shared_tmp / "logs" / "gangs"))
    ex = SlurmExecutor(slurm_section(multihost_slurm), site="slurm-multihost")
    ex.open_run()
    yield ex
    ex.close_run()


def _part(rank: int, rows: int = 3000) -> pa.Table:
    rng = np.random.default_rng(rank)
    return pa.table(
        {
            "key": pa.array([f"k{int(k)}" for k in rng.integers(0, 97, rows)]),
            "v": pa.array(rng.integers(0, 1000, rows), type=pa.int64()),
            "src": pa.array(np.full(rows, rank, dtype=np.int64)),
        }
    )


def where(env):
    marker = f"/dev/shm/phalanx-mh-rank-{env.rank}"
    open(marker, "w").close()
    try:
        seen = sorted(n for n in os.listdir("/dev/shm") if n.startswith("phalanx-mh-rank-"))
    finally:
        os.unlink(marker)
    return {"rank": env.rank, "host": socket.gethostname(), "shm": seen, "node": os.environ.get("SLURMD_NODENAME")}


def compute(env):
    """allreduce of a vector, and a shuffle + groupby of each rank's part."""
    total = env.comm.allreduce(np.arange(4, dtype=np.int64) * (env.rank + 1))
    df = px.DataFrame.from_arrow(_part(env.rank), env)
    by_key = df.groupby("key").agg({"v": "sum"}).collect(root=0)
    shuffled = df.shuffle("key").to_arrow()
    keys = set(shuffled.column("key").to_pylist())
    return total.tolist(), by_key, keys, sorted(set(shuffled.column("src").to_pylist()))


def put_then_get(env, name):
    df = px.DataFrame.from_arrow(_part(env.rank, 500), env)
    env.store.put(name, df, producer="mh")
    back = env.store.get(name, by="key")
    mine = back.to_arrow()
    return socket.gethostname(), back.collect(root=0), mine.num_rows


def test_a_pilot_gang_runs_one_rank_per_host_and_its_collectives_are_right(pilot_run, driver_host, shared_tmp):
    with px.Gang(
        N_HOSTS,
        executor=pilot_run,
        control_host=driver_host,
        rendezvous=f"file://{shared_tmp}/rdzv",
        store=shared_tmp / "store",
        echo=False,
    ) as gang:
        info = gang.run(where)
        assert [i["host"] for i in info] == [i["node"] for i in info]
        assert sorted(i["host"] for i in info) == HOSTS  # one rank on each host
        for i in info:  # each rank sees its own marker only: no /dev/shm in common
            assert i["shm"] == [f"phalanx-mh-rank-{i['rank']}"], info
        assert gang.hosts == [i["host"] for i in info]

        results = gang.run(compute)
        n = N_HOSTS
        assert all(r[0] == (np.arange(4) * sum(range(1, n + 1))).tolist() for r in results)
        ref = pd.concat([_part(r).to_pandas() for r in range(n)]).groupby("key")["v"].sum().sort_index()
        got = results[0][1].to_pandas().set_index("key")["v"].sort_index()
        pd.testing.assert_series_equal(got, ref, check_names=False)
        keys = [r[2] for r in results]  # the shuffle: each key on exactly one rank
        assert set().union(*keys) == set(ref.index) and sum(len(k) for k in keys) == len(ref)

        name = "mh-put"
        results = gang.run(put_then_get, name)
        whole = pd.concat([_part(r, 500).to_pandas() for r in range(n)])
        back = results[0][1].to_pandas()
        assert sorted(r[0] for r in results) == HOSTS
        assert sum(r[2] for r in results) == len(whole)
        pd.testing.assert_frame_equal(
            back.sort_values(["src", "key", "v"]).reset_index(drop=True),
            whole.sort_values(["src", "key", "v"]).reset_index(drop=True),
        )
    # the catalogue and the partitions are on the shared /var/tmp: the driver reads them too
    store = px.Store(shared_tmp / "store")
    assert store.read(name).num_rows == len(whole)
    assert (shared_tmp / "store" / "meta.sqlite").is_file()


def test_a_driver_listening_on_loopback_is_refused_naming_an_address_the_nodes_reach(pilot_run, shared_tmp):
    """``auto`` is what this machine's name resolves to: 127.0.0.1 in the bed's root namespace
    (/etc/hosts: "127.0.0.1 vm"), which the ranks on px-h1.. cannot reach."""
    assert socket.gethostbyname(socket.getfqdn()) == "127.0.0.1"  # what ControlServer makes of auto here
    t0 = time.monotonic()
    with pytest.raises(px.GangError) as info:
        px.Gang(
            N_HOSTS,
            executor=pilot_run,
            control_host="auto",
            rendezvous=f"file://{shared_tmp}/rdzv",
            store=shared_tmp / "store",  # not the test session's in /dev/shm: the hosts would get it
            echo=False,
        ).start()
    message = str(info.value)
    assert "the driver listens on 127.0.0.1 only" in message and "px-h1, px-h2, px-h3" in message, message
    assert "leaves from 10.231.0.1" in message, message
    assert time.monotonic() - t0 < 30


def test_a_loopback_tcp_rendezvous_is_refused_with_the_pilot_on_other_hosts(pilot_run, driver_host, shared_tmp):
    """``rendezvous: tcp`` (the default) is tcp://127.0.0.1:PORT: rank 0 would host it on its
    own host's loopback, and the other ranks would wait out the start timeout."""
    t0 = time.monotonic()
    with pytest.raises(px.GangError) as info:
        px.Gang(
            N_HOSTS,
            executor=pilot_run,
            control_host=driver_host,
            rendezvous="tcp",
            store=shared_tmp / "store",
            echo=False,
        ).start()
    message = str(info.value)
    assert "but the rendezvous is tcp on 127.0.0.1" in message and "file:///" in message, message
    assert time.monotonic() - t0 < 30


# ---- the pilot's store services: one per node, for the life of the allocation ----------------
def service_env(env):
    return {k: os.environ.get(k) for k in ("PHALANX_STORE", "PHALANX_STORE_SERVICE_KEY")} | {
        "host": socket.gethostname()
    }


def put_then_get_counted(env, name):
    host, back, mine = put_then_get(env, name)
    return host, back, mine, env.store.reads.as_dict()


def test_the_pilot_runs_a_store_service_on_each_host_until_it_closes(
    multihost_bed, multihost_slurm, shared_tmp, driver_host, host_root, monkeypatch
):
    bed = multihost_bed
    root = host_root  # each host's own
    monkeypatch.setenv("PHALANX_LOG_DIR", str(shared_tmp / "logs" / "gangs"))
    monkeypatch.setenv("PHALANX_STORE_TOKEN_FILE", str(write_token_file(shared_tmp / "token", secrets.token_hex(32))))
    ex = SlurmExecutor(slurm_section(multihost_slurm), site="slurm-multihost")
    ex.open_run()
    try:
        with px.Gang(
            N_HOSTS,
            executor=ex,
            control_host=driver_host,
            rendezvous=f"file://{shared_tmp}/rdzv",
            store=px.Store(root, metadata=f"sqlite://{shared_tmp}/meta.sqlite"),  # the catalogue shared
            echo=False,
        ) as gang:
            pilot = ex.pilot()
            key = f"slurm-{pilot.job_id}"
            seen = gang.run(service_env)
            assert sorted(s["host"] for s in seen) == HOSTS
            assert all(s["PHALANX_STORE"] == root and s["PHALANX_STORE_SERVICE_KEY"] == key for s in seen), seen
            assert sorted(pilot.store_services) == HOSTS  # start() waited for every node's
            token = read_token_file(shared_tmp / "token")
            for h in bed.hosts():
                r = bed.run_on(
                    h["name"],
                    ["cat", f"{root}/.services/{key}.json"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                assert r.returncode == 0, f"{h['name']}: no endpoint record: {r.stderr}"
                record = json.loads(r.stdout)
                assert record["host"] == h["name"], record
                assert record["endpoint"].startswith(f"grpc+tcp://{h['addr']}:"), record  # its own address
                assert pilot.store_services[h["name"]] == record["endpoint"]
                assert bed.pid_alive(record["pid"])
                mode = bed.run_on(h["name"], ["stat", "-c", "%a", f"{root}/.services/{key}.json"], capture_output=True)
                assert mode.stdout.decode().strip() == "600"
                assert ping(record["endpoint"], token) == h["name"]  # served, over the bridge from the root namespace
            # partitions written in three hosts' memory, read back by key across them: through
            # the services of the pilot
            results = gang.run(put_then_get_counted, "spread")
            whole = pd.concat([_part(r, 500).to_pandas() for r in range(N_HOSTS)])
            cols = ["src", "key", "v"]
            pd.testing.assert_frame_equal(
                results[0][1].to_pandas().sort_values(cols).reset_index(drop=True),
                whole.sort_values(cols).reset_index(drop=True),
            )
            assert all(r[3]["local"] > 0 for r in results), [r[3] for r in results]  # each its own host's
            # the driver (no partition in its /dev/shm) reads all three through the hosts' services
            reader = px.Store(root, metadata=f"sqlite://{shared_tmp}/meta.sqlite")
            table = reader.read("spread")
            pd.testing.assert_frame_equal(
                table.to_pandas().sort_values(cols).reset_index(drop=True),
                whole.sort_values(cols).reset_index(drop=True),
            )
            info = reader.info("spread")
            assert sorted(p.host for p in info.partitions) == HOSTS  # one partition in each host's memory
            assert reader.reads.local == 0 and reader.reads.fetched == sum(p.bytes for p in info.partitions)
            pids = {
                h["name"]: json.loads(
                    bed.run_on(h["name"], ["cat", f"{root}/.services/{key}.json"], capture_output=True).stdout
                )["pid"]
                for h in bed.hosts()
            }
    finally:
        ex.close_run()
    assert not list((shared_tmp / "logs").rglob("*.endpoint"))
    for h in bed.hosts():  # the allocation ended: so did every service, its record with it
        assert not bed.pid_alive(pids[h["name"]]), h
        r = bed.run_on(h["name"], ["ls", f"{root}/.services"], capture_output=True, text=True, timeout=30)
        assert r.stdout.split() == [], (h["name"], r.stdout)


# ---- a workflow run on that site -------------------------------------------------------------
WORKFLOW = """
name: mh
stages:
  generate:
    app: apps:wf_generate
    ranks: 3
    params: {rows: 6000, seed: 5}
    outputs: [tx]
  totals:
    app: apps:wf_totals
    ranks: 2
    needs: [generate]
    inputs: {tx: {dataset: tx, by: [user]}}
    outputs: [totals]
"""


def test_a_two_stage_workflow_runs_on_the_pilot_with_the_store_in_the_hosts_memory(
    multihost_slurm, shared_tmp, driver_host, host_root, monkeypatch
):
    """generate (3 ranks: one per host, each partition in its host's /dev/shm) → totals (2
    ranks, reading by user: the third host's partition through its store service); outputs
    written through to a shared directory, read after the run (the pilot and its services
    are gone by then)."""
    import yaml

    root = host_root
    monkeypatch.setenv("PHALANX_STORE_TOKEN_FILE", str(write_token_file(shared_tmp / "token", secrets.token_hex(32))))
    site = pilot_site(
        multihost_slurm,
        driver_host,
        shared_tmp,
        {
            "root": root,
            "metadata": f"sqlite://{shared_tmp}/meta.sqlite",
            "durability": "write-through",
            "durable": str(shared_tmp / "durable"),
        },
    )
    (shared_tmp / "site.yaml").write_text(yaml.safe_dump(site))
    (shared_tmp / "wf.yaml").write_text(WORKFLOW)
    result = px.run(shared_tmp / "wf.yaml", shared_tmp / "site.yaml", state=shared_tmp / "state", progress=False)
    assert result.ok, result.failed
    from phalanx.orchestrator.rundb import RunDB

    db = RunDB(shared_tmp / "state")
    stages = {s["stage"]: s for s in db.stages(result.run_id)}
    read = stages["totals"]["inputs"]["tx"]
    assert read["fetched"] > 0 and read["read_here"] > 0, read  # 2 ranks, partitions on 3 hosts
    # totals' rank r reads rows [3000r, 3000r+3000): most of them in generate's rank 2r partition,
    # and it ran on that partition's host
    hosts = {
        s: [r["host"] for r in sorted(db.attempts(result.run_id, s)[-1]["rank_info"], key=lambda r: r["rank"])]
        for s in ("generate", "totals")
    }
    assert hosts["totals"] == [hosts["generate"][0], hosts["generate"][2]], hosts
    placed = [e["message"] for e in db.events(result.run_id) if e["message"].startswith("ranks on the hosts")]
    assert placed == [f"ranks on the hosts holding their input: {', '.join(hosts['totals'])}"], placed
    store = px.Store(root, result.session, metadata=f"sqlite://{shared_tmp}/meta.sqlite")
    got = store.read("totals").to_pandas().sort_values("user").reset_index(drop=True)
    parts = []
    for r in range(3):
        rng = np.random.default_rng([5, r])
        parts.append(pd.DataFrame({"user": rng.integers(0, 50, 2000), "amount": rng.integers(1, 100, 2000)}))
    expected = pd.concat(parts).groupby("user", as_index=False)["amount"].sum()
    pd.testing.assert_frame_equal(got, expected, check_dtype=False)


def test_a_pilot_whose_log_dir_the_nodes_lack_fails_at_once_with_slurms_reason(multihost_slurm, shared_tmp):
    """A log dir in the driver's /tmp, which no host has: SLURM cannot open the batch script's
    output, the job fails (JobLaunchFailure) right after it started, and the pilot's start
    says so at once instead of waiting for its store services."""
    from phalanx.executors.slurm import SlurmPilot

    private = Path(tempfile.mkdtemp(prefix="phalanx-mh-pilot-"))  # /tmp: the root namespace's own
    pilot = SlurmPilot({"nodes": N_HOSTS, "ntasks": N_HOSTS}, conf=multihost_slurm)
    t0 = time.monotonic()
    try:
        with pytest.raises(px.GangError, match=r"slurm: pilot job \d+ FAILED \(JobLaunchFailure\)"):
            pilot.start(60, store={"PHALANX_STORE": str(shared_tmp / "store")}, log_dir=private)
        assert time.monotonic() - t0 < 15
    finally:
        pilot.close()
        shutil.rmtree(private, ignore_errors=True)


# ---- placing ranks on the hosts that hold their input ------------------------------------------
def hostname(env):
    return socket.gethostname()


def test_a_pilot_step_puts_each_rank_on_the_node_asked_for(pilot_run, driver_host, shared_tmp):
    pilot = pilot_run.pilot()
    launcher = pilot_run.launcher(N_HOSTS)
    assert launcher.prefer_hosts(["px-h1"] * N_HOSTS) is False  # the pilot is not running yet
    pilot.start(60)
    gang_kw = dict(control_host=driver_host, rendezvous=f"file://{shared_tmp}/rdzv", store=shared_tmp / "store")
    assert launcher.prefer_hosts(["elsewhere"] * N_HOSTS) is False  # none of the pilot's nodes
    for want, got in [
        (["px-h3", "px-h1", "px-h2"], ["px-h3", "px-h1", "px-h2"]),
        (["px-h2", "px-h2", ""], ["px-h2", "px-h1", "px-h3"]),  # one rank a node (ranks_per_node)
    ]:
        launcher = pilot_run.launcher(N_HOSTS)
        assert launcher.prefer_hosts(want)
        with px.Gang(N_HOSTS, executor=launcher, echo=False, **gang_kw) as gang:
            assert gang.run(hostname) == got
    launcher = pilot_run.launcher(2)
    assert launcher.prefer_hosts(["px-h3", "px-h2"])
    with px.Gang(2, executor=launcher, echo=False, **gang_kw) as gang:
        assert gang.run(hostname) == ["px-h3", "px-h2"]
