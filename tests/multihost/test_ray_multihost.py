"""A phalanx gang on a Ray cluster across the hosts of the test bed (docs/multihost.md): the
head in px-head (no CPUs), one raylet in each of px-h1..px-h3 (tests/infra/ray_multihost.py),
the driver (this pytest) in the root namespace connected through Ray Client
(``ray://10.231.0.10:10001``: a plain GCS address needs a raylet on the driver's host).

    .venv/bin/python -m pytest -m multihost tests/multihost/test_ray_multihost.py -q -p no:randomly

One rank actor per host (STRICT_SPREAD), each with its own /dev/shm; the store root in each
host's /dev/shm, the SQLite catalogue on the shared /var/tmp; the executor runs one store
service per Ray node for the run (phalanx/executors/ray/services.py); a put by 3 ranks and a
get by 2 ranks, placed by ``prefer_hosts`` on the hosts holding their rows, right against
pandas.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import phalanx as px
from phalanx.store.repartition import rank_hosts
from phalanx.store.service import ping, read_token_file, write_token_file

from .conftest import N_HOSTS, _keep

pytestmark = pytest.mark.multihost

HOSTS = [f"px-h{i}" for i in range(1, N_HOSTS + 1)]


def _client_ready(address: str, within: float = 120.0) -> None:
    """Until a Ray Client connection works (from a throwaway process, so this one's first
    connection is the tests'): the head's client port opens before the server behind it can
    start a session for a client — under load the first one failed ("Starting Ray client
    server failed") though the next succeeded."""
    probe = f"import ray; ray.init({address!r}, logging_level='ERROR'); ray.shutdown()"
    deadline = time.monotonic() + within
    while True:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=within)
        if r.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray Client at {address} does not take a session: {r.stderr[-2000:]}")
        time.sleep(2)


@pytest.fixture(scope="module")
def ray_bed(multihost_bed):
    pytest.importorskip("ray")
    from infra import ray_multihost

    was_up = ray_multihost.healthy()
    t0 = time.monotonic()
    state = ray_multihost.up()
    _client_ready(state["client"])
    state["fixture_up_s"] = round(time.monotonic() - t0, 1)
    yield state
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if not was_up and not _keep():
        r = ray_multihost.down()
        assert not r["left"], f"Ray processes left: {r['left']}"


@pytest.fixture(scope="module")
def driver_host(multihost_bed) -> str:
    return multihost_bed.load_state()["bridge_addr"]  # 10.231.0.1


@pytest.fixture
def host_root(multihost_bed, shared_tmp):
    root = f"/dev/shm/phalanx-mh-{shared_tmp.name}/store"
    yield root
    for h in multihost_bed.hosts():
        multihost_bed.run_on(h["name"], ["rm", "-rf", os.path.dirname(root)], timeout=30)
    shutil.rmtree(os.path.dirname(root), ignore_errors=True)


@pytest.fixture
def ray_run(ray_bed, shared_tmp, monkeypatch):
    from phalanx.executors.ray import RayExecutor

    monkeypatch.setenv("PHALANX_LOG_DIR", str(shared_tmp / "logs"))
    monkeypatch.setenv("PHALANX_STORE_TOKEN_FILE", str(write_token_file(shared_tmp / "token", secrets.token_hex(32))))
    ex = RayExecutor(
        {"address": ray_bed["client"], "strategy": "STRICT_SPREAD", "cpus_per_rank": 1, "ready_timeout_s": 120},
        site="ray-multihost",
    )
    ex.open_run()
    yield ex
    ex.close_run()


def _part(rank: int, rows: int = 500) -> pa.Table:
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
    return {
        "rank": env.rank,
        "host": socket.gethostname(),
        "shm": seen,
        "key": os.environ.get("PHALANX_STORE_SERVICE_KEY"),
        "node_ip": os.environ.get("PHALANX_RAY_NODE_IP"),
    }


def put(env, name):
    env.store.put(name, px.DataFrame.from_arrow(_part(env.rank), env), producer="mh")
    return socket.gethostname()


def get(env, name):
    back = env.store.get(name, by="key")
    return socket.gethostname(), back.to_arrow(), env.store.reads.as_dict()


def test_the_ray_cluster_spans_the_hosts_and_a_root_namespace_driver_reaches_it(ray_bed):
    import ray

    from phalanx.executors.ray import connect

    connect(ray_bed["client"])
    nodes = {nd["NodeManagerHostname"]: nd for nd in ray.nodes() if nd.get("Alive")}
    assert sorted(nodes) == sorted(["px-head", *HOSTS]), nodes.keys()
    for i, h in enumerate(HOSTS, start=1):
        assert nodes[h]["NodeManagerAddress"] == f"10.231.0.{10 + i}"
        assert nodes[h]["Resources"].get("CPU") == 1 and nodes[h]["Resources"].get(h) == 1
    assert not nodes["px-head"]["Resources"].get("CPU")  # the head runs no compute
    print(f"\nray across the bed up in {ray_bed.get('up_s')} s (head {ray_bed.get('head_s')} s)")


def test_a_ray_gang_puts_on_three_hosts_and_two_ranks_placed_by_locality_get_it(
    ray_run, ray_bed, multihost_bed, shared_tmp, driver_host, host_root
):
    bed, root = multihost_bed, host_root
    meta = f"sqlite://{shared_tmp}/meta.sqlite"
    common = {
        "executor": ray_run,
        "control_host": driver_host,
        "rendezvous": f"file://{shared_tmp}/rdzv",
        "store": px.Store(root, metadata=meta),
        "echo": False,
    }
    t0 = time.monotonic()
    with px.Gang(N_HOSTS, **common) as gang:
        t_start = time.monotonic() - t0
        info = gang.run(where)
        assert sorted(i["host"] for i in info) == HOSTS  # one rank on each host
        for i in info:  # each rank sees only its own marker: no /dev/shm in common
            assert i["shm"] == [f"phalanx-mh-rank-{i['rank']}"], info
        key = ray_run.services.key
        assert key.startswith("ray-") and all(i["key"] == key for i in info), info
        token = read_token_file(shared_tmp / "token")
        pids = {}
        for h in bed.hosts():  # each host's own service, on its own address, published in its root
            r = bed.run_on(
                h["name"], ["cat", f"{root}/.services/{key}.json"], capture_output=True, text=True, timeout=30
            )
            assert r.returncode == 0, f"{h['name']}: no endpoint record: {r.stderr}"
            record = json.loads(r.stdout)
            assert record["endpoint"].startswith(f"grpc+tcp://{h['addr']}:"), record
            assert ping(record["endpoint"], token) == h["name"]
            pids[h["name"]] = record["pid"]
        assert gang.run(put, "spread") is not None
    t_put = time.monotonic() - t0

    store = px.Store(root, metadata=meta)
    info3 = store.info("spread")
    assert sorted(p.host for p in info3.partitions) == HOSTS
    hosts = rank_hosts([info3], 2)
    assert hosts and all(h in HOSTS for h in hosts), hosts

    launcher = ray_run.launcher(2)
    assert launcher.prefer_hosts(hosts)
    assert launcher.prefer_hosts(["no-such-host", ""]) is False
    assert launcher.prefer_hosts(hosts)
    t1 = time.monotonic()
    with px.Gang(2, **{**common, "executor": launcher, "store": px.Store(root, metadata=meta)}) as gang:
        results = gang.run(get, "spread")
    t_get = time.monotonic() - t1
    assert [r[0] for r in results] == hosts  # rank r on the host holding most of its rows
    assert all(r[2]["local"] > 0 for r in results), [r[2] for r in results]
    assert sum(r[2]["fetched"] for r in results) > 0  # the third host's partition via its service
    got = pa.concat_tables([r[1] for r in results]).to_pandas()
    whole = pd.concat([_part(r).to_pandas() for r in range(N_HOSTS)])
    cols = ["src", "key", "v"]
    pd.testing.assert_frame_equal(
        got.sort_values(cols).reset_index(drop=True), whole.sort_values(cols).reset_index(drop=True)
    )
    keys = [set(r[1].column("key").to_pylist()) for r in results]
    assert not keys[0] & keys[1]  # by key: each key on one rank
    print(
        f"\ngang of 3 started in {t_start:.1f} s, put done at {t_put:.1f} s, "
        f"services {ray_run.services.timings}, gang of 2 + get {t_get:.1f} s"
    )

    ray_run.close_run()  # the services end with the run
    for h in bed.hosts():
        assert not bed.pid_alive(pids[h["name"]]), h
        r = bed.run_on(h["name"], ["ls", f"{root}/.services"], capture_output=True, text=True, timeout=30)
        assert r.stdout.split() == [], (h["name"], r.stdout)


def hostname(env):
    return socket.gethostname()


def test_prefer_hosts_puts_each_rank_on_the_node_asked_for(ray_run, driver_host, shared_tmp):
    gang_kw = dict(control_host=driver_host, rendezvous=f"file://{shared_tmp}/rdzv", store=shared_tmp / "store")
    launcher = ray_run.launcher(N_HOSTS)
    assert launcher.prefer_hosts(["elsewhere"] * N_HOSTS) is False  # no node of the cluster
    for want, got in [
        (["px-h3", "px-h1", "px-h2"], ["px-h3", "px-h1", "px-h2"]),
        (["10.231.0.12", "px-h3", "px-h1"], ["px-h2", "px-h3", "px-h1"]),  # by node IP too
    ]:
        launcher = ray_run.launcher(N_HOSTS)
        assert launcher.prefer_hosts(want)
        with px.Gang(N_HOSTS, executor=launcher, echo=False, **gang_kw) as gang:
            assert gang.run(hostname) == got
    launcher = ray_run.launcher(2)
    assert launcher.prefer_hosts(["px-h2", "px-h2"])  # one CPU a node: the second goes elsewhere
    assert launcher.placed[0] == "10.231.0.12" and launcher.placed[1] == ""
    with px.Gang(2, executor=launcher, echo=False, **gang_kw) as gang:
        where_ = gang.run(hostname)
        assert where_[0] == "px-h2" and where_[1] in HOSTS and where_[1] != "px-h2"


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


def test_a_two_stage_workflow_on_ray_across_the_hosts_places_the_reader_by_locality(
    ray_bed, shared_tmp, driver_host, host_root, monkeypatch
):
    """As the SLURM pilot's workflow test (test_slurm_gang_multihost.py), on the Ray cluster:
    generate's partitions in three hosts' memory, totals' two ranks on the hosts of
    generate's partitions 0 and 2 (prefer_hosts), the third read through its host's service."""
    import yaml

    root = host_root
    monkeypatch.setenv("PHALANX_STORE_TOKEN_FILE", str(write_token_file(shared_tmp / "token", secrets.token_hex(32))))
    site = {
        "name": "ray-multihost",
        "executor": "ray",
        "driver_host": driver_host,
        "rendezvous": f"file://{shared_tmp}/rdzv",
        "start_timeout": 120,
        "store": {
            "root": root,
            "metadata": f"sqlite://{shared_tmp}/meta.sqlite",
            "durability": "write-through",
            "durable": str(shared_tmp / "durable"),
        },
        "ray": {"address": ray_bed["client"], "strategy": "SPREAD", "ready_timeout_s": 120},
    }
    (shared_tmp / "site.yaml").write_text(yaml.safe_dump(site))
    (shared_tmp / "wf.yaml").write_text(WORKFLOW)
    t0 = time.monotonic()
    result = px.run(shared_tmp / "wf.yaml", shared_tmp / "site.yaml", state=shared_tmp / "state", progress=False)
    took = time.monotonic() - t0
    assert result.ok, result.failed
    from phalanx.orchestrator.rundb import RunDB

    db = RunDB(shared_tmp / "state")
    stages = {s["stage"]: s for s in db.stages(result.run_id)}
    read = stages["totals"]["inputs"]["tx"]
    assert read["fetched"] > 0 and read["read_here"] > 0, read
    hosts = {
        s: [r["host"] for r in sorted(db.attempts(result.run_id, s)[-1]["rank_info"], key=lambda r: r["rank"])]
        for s in ("generate", "totals")
    }
    assert sorted(hosts["generate"]) == HOSTS, hosts
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
    print(f"\nworkflow on ray across the hosts: {took:.1f} s")


def test_a_store_service_ends_with_its_actor(ray_run, multihost_bed, host_root):
    """The driver's Ray job ending (or an actor killed) takes the services with it: each is
    its actor's child with PR_SET_PDEATHSIG, not left running in the host."""
    import ray

    bed = multihost_bed
    services = ray_run.services
    key = services.ensure(ray, {"PHALANX_STORE": host_root})
    assert key and sorted(services.endpoints) == [h["addr"] for h in bed.hosts()], services.endpoints
    pids = [
        json.loads(bed.run_on(h["name"], ["cat", f"{host_root}/.services/{key}.json"], capture_output=True).stdout)[
            "pid"
        ]
        for h in bed.hosts()
    ]
    assert all(bed.pid_alive(p) for p in pids)
    for a in services.actors:
        ray.kill(a, no_restart=True)
    deadline = time.monotonic() + 20
    while any(bed.pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(bed.pid_alive(p) for p in pids), pids
