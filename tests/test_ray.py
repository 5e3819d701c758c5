"""Ray executor against a real multi-node Ray cluster on loopback (tests/infra/ray_cluster.py).

One session cluster: a head and two worker raylets, one CPU each, with the custom resources
node_head, node_a and node_b.  Gangs are placement groups with one actor per rank; the ranks
talk over Gloo, not through Ray.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import phalanx as px
from phalanx.executors.ray import RayExecutor, RayLauncher

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

SITE = "ray-test"


# ---- apps (run inside the rank actors; pickled by reference to this module) ---------------------
def app_where(env):
    import ray as _ray

    ctx = _ray.get_runtime_context()
    return {
        "rank": env.rank,
        "pid": os.getpid(),
        "node_id": ctx.get_node_id(),
        "env_node_id": os.environ.get("PHALANX_RAY_NODE_ID"),
        "actor_id": ctx.get_actor_id(),
        "threads": env.threads,
        "polars_threads": __import__("polars").thread_pool_size(),
    }


def app_allgather(env):
    mine = bytes([65 + env.rank]) * (10 * env.rank)  # rank 0 contributes nothing
    got = env.comm.allgather_bytes(np.frombuffer(mine, dtype=np.uint8))
    return [bytes(g) for g in got]


def app_alltoallv(env):
    n = env.world_size
    counts = [(env.rank + 1) * dest for dest in range(n)]  # uneven, zeros to rank 0
    send = np.concatenate([np.full(c, 16 * env.rank + dest, dtype=np.uint8) for dest, c in enumerate(counts)])
    recv, recv_counts = env.comm.alltoallv(send, counts)
    return [int(c) for c in recv_counts], recv.tobytes()


def app_print_and_sum(env, k):
    print(f"rank {env.rank} says hello {k}", flush=True)
    return int(env.comm.allreduce(np.array([env.rank + k]))[0])


def app_mark_then_sleep(env, marker_dir):
    Path(marker_dir, f"rank-{env.rank}").touch()
    while True:
        time.sleep(0.1)


def app_totals_killed_once(env):
    """apps.wf_totals, but the first attempt's rank 1 kills its own actor process mid-stage."""
    import signal

    import apps

    marker = Path(env.params["marker"])
    if env.rank == 1 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    env.comm.barrier()  # the other ranks would wait here forever without fail-fast
    return apps.wf_totals(env)


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def node_names(ray_cluster):
    """Ray node id → the node's custom resource (node_head, node_a, node_b)."""
    names = {}
    for node in ray.nodes():
        if node["Alive"]:
            names[node["NodeID"]] = next(k for k in node["Resources"] if k.startswith("node_"))
    assert sorted(names.values()) == ["node_a", "node_b", "node_head"]
    return names


def executor(cluster, **kw) -> RayExecutor:
    return RayExecutor({"address": cluster.address, **kw}, site=SITE)


def launcher(cluster, ranks: int, echo=False, **kw) -> RayLauncher:
    """What the scheduler does for a stage: the site's executor makes the gang's launcher."""
    return executor(cluster, **kw).launcher(ranks, echo=echo)


def live_groups(gang: px.Gang) -> list[str]:
    """States of the gang's placement groups (named phalanx-<gang id>) that Ray still keeps."""
    from ray.util.placement_group import placement_group_table

    return [
        t["state"]
        for t in placement_group_table().values()
        if t["name"] == f"phalanx-{gang.gang_id}" and t["state"] != "REMOVED"
    ]


def wait_until(cond, within=10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="class")
def spread_gang(ray_cluster):
    """Three ranks, STRICT_SPREAD over the three raylets, kept for the tests of one class (it
    holds every CPU of the cluster: it must be gone before other tests place gangs)."""
    lines: list[str] = []
    g = px.Gang(3, executor=launcher(ray_cluster, 3, strategy="STRICT_SPREAD", echo=lines.append), echo=False)
    g.echoed = lines
    g.start()
    yield g
    g.close()


# ---- tests ---------------------------------------------------------------------------------------
class TestPersistentSpreadGang:
    """One STRICT_SPREAD gang of 3 ranks (one per raylet) runs every app of this class."""

    def test_strict_spread_puts_every_rank_on_its_own_raylet(self, spread_gang, node_names):
        where = spread_gang.run(app_where)
        assert [w["rank"] for w in where] == [0, 1, 2]
        assert {w["node_id"] for w in where} == set(node_names)  # three distinct raylets
        assert all(w["env_node_id"] == w["node_id"] for w in where)
        assert [w["pid"] for w in where] == spread_gang.pids
        assert spread_gang.pids == [n["pid"] for n in spread_gang._launcher.nodes]
        assert all(w["threads"] == 1 for w in where)
        # the actor imported polars before serve(): the runtime_env sized its pool
        assert [w["polars_threads"] for w in where] == [1, 1, 1]

    def test_allgather_over_gloo(self, spread_gang):
        want = [b"", b"B" * 10, b"C" * 20]
        assert spread_gang.run(app_allgather) == [want] * 3

    def test_alltoallv_over_gloo(self, spread_gang):
        for dest, (counts, data) in enumerate(spread_gang.run(app_alltoallv)):
            assert counts == [(src + 1) * dest for src in range(3)]
            assert data == b"".join(bytes([16 * src + dest]) * ((src + 1) * dest) for src in range(3))

    def test_persistent_gang_reuses_the_same_actors(self, spread_gang):
        launcher_ = spread_gang._launcher
        pids, pg = list(spread_gang.pids), launcher_.pg
        actors = [w["actor_id"] for w in spread_gang.run(app_where)]
        for k in range(3):
            assert spread_gang.run(app_print_and_sum, k) == [3 + 3 * k] * 3
            again = spread_gang.run(app_where)
            assert [w["pid"] for w in again] == pids
            assert [w["actor_id"] for w in again] == actors
        assert launcher_.pg is pg and spread_gang.pids == pids
        # each rank's output went to its own log file, written by the actor
        log = (spread_gang.log_dir / "rank-2.log").read_text()
        assert "rank 2 says hello 0" in log and "rank 2 says hello 2" in log
        assert "rank 1 says" not in log
        # and, with echo, to the driver, prefixed by rank
        assert wait_until(lambda: "[rank 2] rank 2 says hello 2" in spread_gang.echoed, 5)

    def test_a_reused_gang_writes_to_the_next_stages_log_dir(self, spread_gang, tmp_path):
        old = spread_gang.log_dir
        assert spread_gang.redirect_logs(tmp_path / "next")
        assert spread_gang.run(app_print_and_sum, 7) == [24] * 3
        assert (tmp_path / "next" / "rank-0.log").read_text() == "rank 0 says hello 7\n"
        assert "hello 7" not in (old / "rank-0.log").read_text()
        assert wait_until(lambda: "[rank 1] rank 1 says hello 7" in spread_gang.echoed, 5)


@pytest.mark.parametrize(
    "ranks, kw, reasons",
    [
        (
            4,
            {"strategy": "STRICT_SPREAD"},
            [
                "4×{CPU: 1} STRICT_SPREAD",
                "Ray says INFEASIBLE",
                "cluster has 3 nodes",
                "STRICT_SPREAD needs 4 distinct nodes",
            ],
        ),
        (
            2,
            {"strategy": "PACK", "resources": {"node_a": 1}},
            ["2×{CPU: 1, node_a: 1} PACK", "1 of them can hold a bundle", "the gang needs {CPU: 2, node_a: 2}"],
        ),
    ],
    ids=["strict-spread-4-on-3-nodes", "two-ranks-need-node_a"],
)
def test_unplaceable_gang_fails_within_its_timeout_and_leaves_no_group(ray_cluster, ranks, kw, reasons):
    gang = px.Gang(ranks, executor=launcher(ray_cluster, ranks, ready_timeout_s=2, **kw), echo=False)
    t0 = time.monotonic()
    with pytest.raises(px.GangError) as info:
        gang.start()
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert elapsed < 2 + 8, msg
    assert f"site {SITE!r} (ray): placement group of" in msg and "not placeable within 2 s" in msg
    assert "Ray says " in msg
    for reason in reasons:
        assert reason in msg
    assert not gang.running and gang.gang_id
    assert wait_until(lambda: not live_groups(gang), 5), live_groups(gang)


def test_killed_actor_fails_the_gang_fast_and_the_next_run_starts_afresh(ray_cluster, node_names, tmp_path):
    # per-rank resources pin rank 0 to node_a and rank 1 to node_b
    lch = launcher(ray_cluster, 2, strategy="PACK", resources=[{"node_a": 1}, {"node_b": 1}])
    with px.Gang(2, executor=lch, echo=False) as gang:
        where = gang.run(app_where)
        assert [node_names[w["node_id"]] for w in where] == ["node_a", "node_b"]
        old_pids, old_pg, old_gang = list(gang.pids), lch.pg.id.hex(), gang.gang_id
        victim = lch.actors[1]
        killed_at = []

        def kill_rank1_when_busy():
            if wait_until(lambda: (tmp_path / "rank-1").exists(), 30):
                killed_at.append(time.monotonic())
                ray.kill(victim)

        killer = threading.Thread(target=kill_rank1_when_busy, daemon=True)
        killer.start()
        with pytest.raises(px.RankError) as info:
            gang.run(app_mark_then_sleep, str(tmp_path), timeout=60)
        failed_at = time.monotonic()
        killer.join()
        assert killed_at and failed_at - killed_at[0] < 5
        err = info.value
        assert err.ranks == [1] and err.stopped == [0]
        assert err.failures[0].exitcode == -9
        assert "killed by signal SIGKILL" in str(err)
        assert "Ray actor died" in str(err)  # the launcher's note in rank 1's log tail
        assert wait_until(lambda: not any(alive(p) for p in old_pids), 10)
        assert gang.gang_id == old_gang and wait_until(lambda: not live_groups(gang), 5)

        # the next run starts a fresh gang: a new placement group and new actors
        again = gang.run(app_where)
        assert [node_names[w["node_id"]] for w in again] == ["node_a", "node_b"]
        assert set(gang.pids).isdisjoint(old_pids) and lch.pg.id.hex() != old_pg
        assert gang.gang_id != old_gang and live_groups(gang) == ["CREATED"]
        new_pids = list(gang.pids)
    # closing the gang removes its placement group and ends its actors
    assert wait_until(lambda: not any(alive(p) for p in new_pids), 10)
    assert wait_until(lambda: not live_groups(gang), 5), live_groups(gang)


def test_a_command_runs_as_a_child_of_each_rank_actor(ray_cluster, tmp_path):
    """A command stage's program (not the phalanx worker): one per rank, exit codes per rank."""
    lch = launcher(ray_cluster, 2, strategy="SPREAD")
    code = "import os, sys; print('rank', os.environ['PHALANX_RANK'], os.getcwd()); sys.exit(3 * int(os.environ['PHALANX_RANK']))"
    env = [
        {"PHALANX_RANK": str(r), "PHALANX_WORLD_SIZE": "2", "PHALANX_GANG_ID": f"cmd-{os.getpid()}"} for r in range(2)
    ]
    try:
        lch.launch([sys.executable, "-c", code], env, tmp_path)
        assert wait_until(lambda: None not in lch.exitcodes(), 30), lch.status()
        assert lch.exitcodes() == [0, 3]
    finally:
        lch.kill(grace_s=1)
    assert (tmp_path / "rank-1.log").read_text() == f"rank 1 {os.getcwd()}\n"
    assert lch.pg is None and lch.actors == []


def test_a_workflow_stage_whose_actor_dies_is_retried_on_a_fresh_gang(ray_cluster, tmp_path):
    from phalanx.orchestrator.models import Site, Stage, Workflow
    from phalanx.orchestrator.rundb import RunDB
    from phalanx.orchestrator.scheduler import run_workflow

    site = Site(
        name="ray-wf",
        executor="ray",
        cores=3,
        ray={"address": ray_cluster.address, "strategy": "SPREAD", "ready_timeout_s": 30},
    )
    wf = Workflow(
        name="ray-tot",
        stages={
            "generate": Stage(app="apps:wf_generate", ranks=2, params={"rows": 3000, "seed": 5}, outputs=["tx"]),
            "totals": Stage(
                app="test_ray:app_totals_killed_once",
                ranks=3,
                retries=1,
                inputs={"tx": {"dataset": "tx", "by": ["user"]}},
                outputs=["totals"],
                params={"marker": str(tmp_path / "killed")},
            ),
        },
    )
    db = RunDB(tmp_path / "state")
    result = run_workflow(wf, site, db=db)
    assert result.ok, result.failed
    first, second = db.attempts(result.run_id, "totals")
    assert (first["state"], second["state"]) == ("failed", "succeeded")
    # rank 1's death; its peers may report their broken Gloo connections first
    assert re.search(r"\(ranks? [\d, ]*\b1\b", first["error"]), first["error"]
    assert first["gang_id"] != second["gang_id"]
    store = px.Store(session=result.session)
    got = store.read("totals").to_pandas().sort_values("user").reset_index(drop=True)
    want = store.read("tx").to_pandas().groupby("user", as_index=False)["amount"].sum()
    assert got["user"].tolist() == want["user"].tolist() and got["amount"].tolist() == want["amount"].tolist()
    store.delete_session()


class Hook(list):
    """An allocation hook that remembers what it was told."""

    def held(self, record: dict) -> None:
        self.append(("held", dict(record)))

    def released(self, record: dict) -> None:
        self.append(("released", dict(record)))


def test_a_gangs_placement_group_is_announced_and_released_from_another_process(ray_cluster):
    """What ``phalanx status`` does for a lost run: a fresh process connects to the cluster,
    kills the recorded gang's actors and removes its placement group."""
    ex = executor(ray_cluster)
    ex.open_run(hook=(hook := Hook()))
    lch = ex.launcher(2)  # tells the run's hook
    with px.Gang(2, executor=lch, echo=False) as gang:
        record = {
            "executor": "ray",
            "kind": "placement_group",
            "id": f"phalanx-{gang.gang_id}",
            "ranks": 2,
            "address": ray_cluster.address,
            "namespace": ray.get_runtime_context().namespace,
        }
        assert hook == [("held", record)]
        code = "import json, sys; from phalanx.executors import release; print(release(json.loads(sys.argv[1])))"
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(record)], capture_output=True, text=True, timeout=120
        )
        assert out.stdout.strip() == f"ray: removed placement group {record['id']} and killed 2 rank actor(s)", out
        assert wait_until(lambda: not any(alive(p) for p in gang.pids))
        assert wait_until(lambda: not live_groups(gang))
        from phalanx.executors import release

        assert release(record) == f"ray: placement group {record['id']} already gone"  # here: Ray's connection
    assert hook[-1] == ("released", record)
    ex.close_run()


def test_missing_ray_names_the_extra(monkeypatch):
    from phalanx.executors import ray as ray_executor

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(px.MissingDependencyError, match=r"pip install 'phalanx\[ray\]'"):
        ray_executor.import_ray()


def test_the_executor_builds_launchers_from_the_site_section_and_a_stages():
    """What a site's ``ray:`` section and a stage's own section over it give a gang."""
    ex = RayExecutor(
        {"address": "ray://head:10001", "strategy": "strict_spread", "cpus_per_rank": 2, "resources": {"GPU": 1}},
        site="gpu",
    )
    lch = ex.launcher(3)
    assert lch.site == "gpu" and lch.config.strategy == "STRICT_SPREAD" and lch.config.address == "ray://head:10001"
    assert lch.bundles(3) == [{"CPU": 2.0, "GPU": 1.0}] * 3
    assert lch.placement(3) == [{"PHALANX_THREADS": "2"}] * 3
    stage = ex.stage_config({"resources": [{"node_a": 1}, {"node_b": 1}]})
    assert ex.launcher(2, config=stage).bundles(2) == [{"CPU": 2.0, "node_a": 1.0}, {"CPU": 2.0, "node_b": 1.0}]
    with pytest.raises(px.PhalanxError, match=r"site 'gpu' \(ray\): resources lists 2 bundles for a gang of 3 ranks"):
        ex.launcher(3, config=stage)  # refused before anything connects
    with pytest.raises(px.PhalanxError, match=r"ray\.stratgy: unknown key \(did you mean 'strategy'\?\)"):
        RayLauncher(stratgy="PACK")
    with pytest.raises(px.PhalanxError, match=r"ray\.strategy: unknown strategy 'TIGHT'; known: STRICT_PACK"):
        RayLauncher(strategy="TIGHT")


@pytest.mark.parametrize("name", ["ray-local", "ray-example"])
def test_site_files_are_valid(name):
    from phalanx.executors import create
    from phalanx.orchestrator.loading import load_site

    site = load_site(str(Path(__file__).parents[1] / "site-configs" / f"{name}.yaml"))
    assert site.executor == "ray"
    ex = create(site.executor, site.ray, site=site.name, cores=site.cores)
    assert isinstance(ex, RayExecutor) and ex.capacity() == site.cores
    ex.check(2, ex.config)
    assert ex.launcher(2).site == site.name


def test_capacity_is_the_sites_cores_else_the_clusters_cpus(ray_cluster):
    assert executor(ray_cluster).capacity() == 3  # connected: head + 2 raylets, 1 CPU each
    assert executor(ray_cluster, cpus_per_rank=0.5).capacity() == 6
    assert executor(ray_cluster, cpus_per_rank=2).capacity() == 1
    assert RayExecutor({"address": ray_cluster.address}, cores=2).capacity() == 2


def test_closing_one_run_leaves_another_runs_gangs_alone(ray_cluster):
    """Two runs in one process, each with its executor: the first's close ends the gang it
    left open (its placement group), never the second's — nor the process's connection."""
    first, second = executor(ray_cluster), executor(ray_cluster)
    first.open_run()
    second.open_run()
    left_open = px.Gang(1, executor=first.launcher(1), echo=False).start()
    with px.Gang(1, executor=second.launcher(1), echo=False) as other:
        assert other.run(app_where)[0]["rank"] == 0
        first.close_run()
        assert wait_until(lambda: not live_groups(left_open), 10), live_groups(left_open)
        assert ray.is_initialized() and live_groups(other) == ["CREATED"]
        assert other.run(app_where)[0]["pid"] == other.pids[0]  # the same actor still serves
        second.close_run()
        assert wait_until(lambda: not live_groups(other), 10)
    left_open.close()


def test_a_gang_named_by_its_site_file_keeps_its_actors_across_runs(ray_cluster, monkeypatch):
    """px.Gang(ranks, site="ray-local"): the site's executor, communicator and rendezvous."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    site = Path(__file__).parents[1] / "site-configs" / "ray-local.yaml"
    with px.Gang(2, site=str(site), echo=False) as gang:
        assert type(gang._launcher).__name__ == "RayLauncher"
        first, second = gang.run(app_where), gang.run(app_where)
    assert [r["actor_id"] for r in first] == [r["actor_id"] for r in second]
    assert all(r["actor_id"] for r in first) and len({r["pid"] for r in first}) == 2
