"""The kubernetes executor against a real cluster on this machine (tests/infra/k8s: a real control
plane with native gang scheduling, real nodes 127.0.0.1 and 127.0.0.2 whose pods run this host's
Python through hostPath mounts, and kwok for fake nodes).

Sites are site-configs/k8s-local.yaml pointed at the session's cluster, with pytest's temporary
directory shared with the pods (the ranks write their marker files there).  What exists on the
cluster is read through the API with the cluster's own client (tests/infra/k8s_cluster.py, no
``kubernetes`` package): Jobs, pods, Secrets, Services and PodGroups are found by the Job's name
(or the gang id in it), not by the labels the executor sets, so an object it forgot to label
still counts.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

import phalanx as px

pytestmark = pytest.mark.kubernetes

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
NS = "default"
PHALANX = [sys.executable, "-m", "phalanx.cli"]
GANG_WAIT = "pod group is unschedulable"  # the gang plugin's word for pods held back with their group


# ---- apps run on the ranks (imported by them as "test_kubernetes:...") ---------------------------
def hog_on_rank_1(env):
    """Rank 1 writes every page of ``params.mb`` MiB (past its memory limit); rank 0 waits for it."""
    env.comm.barrier()
    if env.rank == 1:
        block = bytearray(env.params["mb"] << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
    env.comm.barrier()
    return "survived"


def gang_facts(env):
    """Where the rank runs, and the control key it authenticated with."""
    return {"rank": env.rank, "pod": os.environ.get("PHALANX_POD"), "key": os.environ.get("PHALANX_AUTHKEY")}


def fail_rank_1_once(env):
    """Attempt 1: rank 1 exits 3 (its marker notes the gang).  Later attempts: rank 0 notes its
    gang, waits for ``go``, and every rank returns."""
    d = Path(env.params["dir"])
    marker = d / "rank-1-failed"
    if not marker.exists():
        env.comm.barrier()
        if env.rank == 1:
            marker.write_text(os.environ["PHALANX_GANG_ID"])
            os._exit(3)
        time.sleep(120)  # rank 0: stopped when rank 1's failure fails the gang
    if env.rank == 0:
        (d / "second-attempt").write_text(os.environ["PHALANX_GANG_ID"])
    deadline = time.monotonic() + 60
    while not (d / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    env.comm.barrier()


def where_and_sum(env):
    """Rank r's node and pod, and the gang's sum of (r+1)**2 (the ranks still talk as one)."""
    total = env.comm.allreduce_scalar((env.rank + 1) ** 2)
    return {
        "rank": env.rank,
        "node": os.environ.get("PHALANX_NODE"),
        "pod": os.environ.get("PHALANX_POD"),
        "sum": total,
    }


# ---- the site and the cluster -------------------------------------------------------------------
def wait_until(pred, within: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + within
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:g} s waiting for {what}")
        time.sleep(poll)


class K8s:
    """The session's cluster, and k8s-local sites on it."""

    def __init__(self, cluster, shared: Path):
        self.cluster, self.shared = cluster, shared
        data = yaml.safe_load((REPO / "site-configs" / "k8s-local.yaml").read_text())
        data["store"] = data.get("store") or {}
        data["kubernetes"] = {
            **data["kubernetes"],
            "kubeconfig": str(cluster.kubeconfig),
            "host_paths": [*data["kubernetes"]["host_paths"], str(shared)],
        }
        self.base = data
        # the version of scheduling.k8s.io that serves PodGroups (v1 holds only PriorityClasses)
        versions = [v["groupVersion"] for v in cluster.request("GET", "/apis/scheduling.k8s.io")["versions"]]
        api = next(
            v
            for v in versions
            if any(r["name"] == "podgroups" for r in cluster.request("GET", f"/apis/{v}")["resources"])
        )
        self.podgroups = f"/apis/{api}/namespaces/{NS}/podgroups"

    def data(self, **update) -> dict:
        """The site file's mapping with ``update`` over it (``kubernetes={...}`` merges)."""
        data = copy.deepcopy(self.base)
        for key, value in update.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return data

    def model(self, **update):
        from phalanx.orchestrator.models import Site
        from phalanx.orchestrator.yamlio import parse

        return parse(Site, self.data(**update), source="tests/test_kubernetes.py")

    def write_site(self, path: Path, **update) -> Path:
        path.write_text(yaml.safe_dump(self.data(**update)))
        return path

    # -- what exists ---------------------------------------------------------------------------
    def get(self, path: str):
        from infra.k8s_cluster import ClusterError

        try:
            return self.cluster.request("GET", path)
        except ClusterError as e:
            if getattr(e, "status", None) == 404:
                return None
            raise

    def pods(self, job: str) -> list[dict]:
        return [
            p
            for p in self.cluster.request("GET", f"/api/v1/namespaces/{NS}/pods")["items"]
            if p["metadata"]["name"].startswith(job + "-")
        ]

    def objects(self, part: str, deleted: bool = True) -> list[str]:
        """Jobs, pods, Secrets, Services and PodGroups whose name holds ``part`` (a Job's name,
        a gang id); ``deleted=False``: not those being deleted (a pod whose node has yet to confirm
        its end, a PodGroup whose protection finalizer waits for its pods: gone a moment later)."""
        part = part.lower()
        found = []
        for kind, path in (
            ("job", f"/apis/batch/v1/namespaces/{NS}/jobs"),
            ("pod", f"/api/v1/namespaces/{NS}/pods"),
            ("secret", f"/api/v1/namespaces/{NS}/secrets"),
            ("service", f"/api/v1/namespaces/{NS}/services"),
            ("podgroup", self.podgroups),
        ):
            found += [
                f"{kind} {o['metadata']['name']}"
                for o in self.cluster.request("GET", path)["items"]
                if part in o["metadata"]["name"] and (deleted or not o["metadata"].get("deletionTimestamp"))
            ]
        return found

    def jobs_of(self, gang_id: str) -> list[str]:
        return [o.split(" ", 1)[1] for o in self.objects(gang_id) if o.startswith("job ")]

    def wait_nothing_left(self, part: str, within: float = 10) -> None:
        """Everything of ``part`` is deleted now (none is left that is not being deleted), and is
        gone within ``within`` s (a pod once its node confirms its end, a PodGroup then)."""
        live = self.objects(part, deleted=False)
        assert live == [], f"not deleted: {live}"
        deadline = time.monotonic() + within
        while (left := self.objects(part)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], f"left behind after {within:g} s: {left}"

    def delete_job(self, name: str) -> None:
        """Cleanup after a failed test: the Job and everything it owns."""
        from infra.k8s_cluster import ClusterError

        for path in (
            f"/apis/batch/v1/namespaces/{NS}/jobs/{name}",
            f"/api/v1/namespaces/{NS}/secrets/{name}",
            f"{self.podgroups}/{name}",
        ):
            try:
                self.cluster.request("DELETE", path, {"propagationPolicy": "Background"} if "jobs" in path else None)
            except ClusterError:
                pass


@pytest.fixture(scope="module")
def k8s(k8s_cluster, tmp_path_factory):
    # every tmp_path of the session is under pytest's base temp: one host path shares them all
    return K8s(k8s_cluster, tmp_path_factory.getbasetemp())


def scheduled(pod: dict) -> dict | None:
    return next((c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"), None)


def rank_env(n: int, gang_id: str) -> list[dict[str, str]]:
    """What a gang gives its ranks (phalanx/gang.py ``_rank_env``), less what pods on fake nodes
    never read."""
    shared = {
        "PHALANX_WORLD_SIZE": str(n),
        "PHALANX_GANG_ID": gang_id,
        "PHALANX_CONTROL": "127.0.0.1:9",
        "PHALANX_AUTHKEY": secrets.token_hex(16),
        "PHALANX_RDZV": "tcp://127.0.0.1:10",
        "PHALANX_COMM": "gloo",
    }
    return [{**shared, "PHALANX_RANK": str(r)} for r in range(n)]


# ---- gang scheduling, on fake (kwok) nodes of 1 CPU ---------------------------------------------
@pytest.fixture
def fake_nodes(k8s):
    """``add(n)``: n more kwok nodes of 1 CPU in a pool of this test's own (a label it selects and
    a taint it tolerates: no other pod lands there, no pod of its lands elsewhere); ``section``:
    the kubernetes: keys that put a gang's pods, 1 CPU each, on the pool.  Deleted at the end."""
    pool = f"gang-{os.getpid()}-{secrets.token_hex(3)}"
    made: list[str] = []

    class Pool:
        section = {
            "cpu": 1,
            "node_selector": {"phalanx.test/pool": pool},
            "tolerations": [{"key": "phalanx.test/pool", "operator": "Equal", "value": pool, "effect": "NoSchedule"}],
        }

        @staticmethod
        def add(n: int) -> list[str]:
            names = k8s.cluster.add_kwok_nodes(
                n,
                cpu="1",
                memory="8Gi",
                prefix=f"{pool}-{len(made)}-",
                labels={"phalanx.test/pool": pool},
                taints=[{"key": "phalanx.test/pool", "value": pool, "effect": "NoSchedule"}],
            )
            made.extend(names)
            return names

    try:
        yield Pool
    finally:
        k8s.cluster.delete_nodes(made)


def test_a_gang_waits_whole_until_it_fits_then_is_bound_at_once_and_kill_deletes_it(k8s, fake_nodes, tmp_path):
    """4 ranks of 1 CPU, 3 nodes of 1 CPU: 3 pods would fit, none is bound (the PodGroup holds
    them), and status() says why in the scheduler's words.  A 4th node: all 4 are bound together.
    kill(): no Job, pod, Secret or PodGroup of it is left."""
    fake_nodes.add(3)
    executor = k8s.model().create_executor()
    launcher = executor.launcher(4, config=executor.stage_config(fake_nodes.section))
    gang_id = f"kwok-{secrets.token_hex(3)}"
    launcher.launch(["sleep", "600"], rank_env(4, gang_id), tmp_path)
    job = launcher.job
    try:
        # the scheduler has tried every pod: PodScheduled=False on all 4
        pods = wait_until(
            lambda: (
                len(p := k8s.pods(job)) == 4 and all((c := scheduled(x)) and c["status"] == "False" for x in p) and p
            ),
            30,
            "the scheduler to try all 4 pods",
        )
        assert [p["spec"].get("nodeName") for p in pods] == [None] * 4
        assert {scheduled(p)["reason"] for p in pods} == {"Unschedulable"}
        # and keeps none bound while it retries (its backoff is 1-2 s: 3 s see it retry)
        end = time.monotonic() + 3
        while time.monotonic() < end:
            bound = [p["metadata"]["name"] for p in k8s.pods(job) if p["spec"].get("nodeName")]
            assert bound == [], f"pods of a gang that does not fit were bound: {bound}"
            time.sleep(0.1)
        # what the scheduler says of the pod it could not place (the others only wait for their group)
        why = {scheduled(p)["message"] for p in k8s.pods(job)} - {None}
        reasons = {m for m in why if not m.startswith(GANG_WAIT)}
        assert any("Insufficient cpu" in m for m in reasons), why
        status = launcher.status()
        assert status.startswith(f"kubernetes: job {NS}/{job}: pods 4 Pending (Unschedulable: "), status
        assert f"gang scheduled as PodGroup {job}" in status, status
        assert launcher.exitcodes() == [None] * 4

        fake_nodes.add(1)  # room for the 4th rank

        def all_bound():
            pods = k8s.pods(job)
            return len(pods) == 4 and all(p["spec"].get("nodeName") for p in pods) and pods

        pods = wait_until(all_bound, 30, "all 4 pods to be bound")
        assert len({p["spec"]["nodeName"] for p in pods}) == 4  # one a node: each holds 1 CPU
        # together: bound in the same scheduling cycle of the group (timestamps have 1 s resolution)
        times = sorted(scheduled(p)["lastTransitionTime"] for p in pods)
        spread = (
            datetime.fromisoformat(times[-1].replace("Z", "+00:00"))
            - datetime.fromisoformat(times[0].replace("Z", "+00:00"))
        ).total_seconds()
        assert spread <= 1, times

        launcher.kill()
        k8s.wait_nothing_left(job)
        # checked last, so that a wrong word does not hide the rest: status() says why the gang
        # waits as the scheduler said it of the pod it could not place
        assert "Insufficient cpu" in status, (
            f"status() does not say why the gang waits: {status!r}; the scheduler said: {sorted(reasons)}"
        )
    finally:
        launcher.kill(grace_s=0)
        k8s.delete_job(job)


def failed_start(gang: px.Gang) -> tuple[float, str]:
    """(seconds, message) of a gang start that must fail with GangError; the gang is closed."""
    t0 = time.monotonic()
    try:
        with pytest.raises(px.GangError) as info:
            gang.start()
    finally:
        gang.close()
    return time.monotonic() - t0, str(info.value)


def test_a_gang_that_can_never_fit_fails_at_its_start_timeout_with_the_schedulers_reason(k8s, fake_nodes):
    fake_nodes.add(3)
    model = k8s.model(start_timeout=5, kubernetes=fake_nodes.section)
    gang = px.Gang(4, site=model, start_timeout=5, echo=False)
    took, msg = failed_start(gang)
    assert took < 5 + 5, f"failed after {took:.1f} s: {msg}"
    assert "did not manage to start within the start timeout (start_timeout=5s)" in msg, msg
    assert "pods 4 Pending (Unschedulable" in msg, msg
    k8s.wait_nothing_left(gang.gang_id)
    assert "Insufficient cpu" in msg, f"the error does not say why the gang never fit: {msg}"


# ---- a rank over its memory limit ------------------------------------------------------------------
def test_a_rank_over_its_memory_limit_is_reported_oomkilled(k8s):
    """A rank imports torch and pyarrow (~350-500 MB in its cgroup): 1Gi holds it; rank 1 then
    writes 2 GiB and the kernel kills it."""
    gang = px.Gang(2, site=k8s.model(kubernetes={"memory_limit": "1Gi"}), echo=False)
    try:
        gang.start()
        t0 = time.monotonic()
        with pytest.raises(px.RankError) as info:
            gang.run(hog_on_rank_1, params={"mb": 2048}, timeout=60)
        took = time.monotonic() - t0
        gang_id = gang.gang_id
    finally:
        gang.close()
    err = info.value
    assert err.first.rank == 1, str(err)
    assert err.first.exitcode == -signal.SIGKILL, str(err)
    first_line = str(err).splitlines()[0]
    assert "OOMKilled" in first_line and "out of memory" in first_line, str(err)
    assert "memory limit 1Gi" in first_line, str(err)
    assert err.first.cause == "oom", err.first  # what a retry policy's oom key matches
    assert took < 30, took
    k8s.wait_nothing_left(gang_id)


# ---- the ETL example: the same data on k8s-local as on this machine --------------------------------
def run_etl(site: dict, tmp: Path):
    """workflows/etl_to_training.yaml at tests/test_examples.py's small size on ``site``, with a
    run DB and store root of its own."""
    from test_examples import ETL, ETL_SMALL

    from phalanx.orchestrator.loading import load_workflow
    from phalanx.orchestrator.rundb import RunDB
    from phalanx.orchestrator.scheduler import run_workflow

    tmp.mkdir()
    site = {**site, "store": {"root": str(tmp / "store")}}
    (tmp / "site.yaml").write_text(yaml.safe_dump(site))
    wf, st = load_workflow(ETL, site=str(tmp / "site.yaml"), overrides=ETL_SMALL)
    db = RunDB(tmp / "state")
    t0 = time.monotonic()
    result = run_workflow(wf, st, file=str(ETL), db=db)
    took = time.monotonic() - t0
    assert result.ok, (result.failed, result.skipped)
    return db, result.run_id, px.Store(tmp / "store", result.session), took


def test_the_etl_example_gives_the_same_data_on_k8s_local_as_on_this_machine(k8s, tmp_path):
    import pandas as pd
    from test_examples import EPOCHS, sorted_frame

    local = run_etl(
        {"name": "test-local", "executor": "local", "cores": max(2, os.cpu_count() or 1)}, tmp_path / "local"
    )
    there = run_etl(k8s.data(), tmp_path / "k8s")
    print(f"etl_to_training: local {local[3]:.1f} s, k8s-local {there[3]:.1f} s")  # shown with -s
    (_, _, here, _), (db, run_id, store, _) = local, there
    for name, key in (("transactions", "tx_id"), ("users", "user_id"), ("features", "user_id")):
        pd.testing.assert_frame_equal(
            sorted_frame(store.read(name), key), sorted_frame(here.read(name), key), obj=f"{name} on k8s-local"
        )
    # training is not bit-identical from run to run, even on one site (two local runs ended at
    # losses 0.556 and 0.582, and an epoch's loss may rise a little): the same epochs over the
    # same rows, and a loss that falls over them as much as here, give or take that noise
    a, b = (s.read("train_metrics").to_pandas() for s in (here, store))
    assert a.epoch.tolist() == b.epoch.tolist() == list(range(EPOCHS))
    assert a.rows_seen.tolist() == b.rows_seen.tolist()
    assert b.loss.iloc[-1] < b.loss.iloc[0] - 0.02 and abs(b.loss.iloc[-1] - a.loss.iloc[-1]) < 0.1, (a, b)
    # the stages ran as Jobs of the cluster (stages share a gang where they can), none is left
    gangs = {a["gang_id"] for a in db.attempts(run_id)}
    assert len(db.attempts(run_id)) == 4 and None not in gangs and "" not in gangs
    placed = [e["message"] for e in db.events(run_id) if e["kind"] == "placed"]
    assert placed and all(m.startswith(f"kubernetes: job {NS}/") for m in placed), placed
    for g in gangs:
        k8s.wait_nothing_left(g)


# ---- a driver killed holding a gang: `phalanx status` deletes what it left -------------------------
STAGES = {
    # no control connection: its pods run on after the driver
    "command": "    kind: command\n    command: [sleep, '600']\n",
    # ranks end when their driver's connection drops (DriverWatch): the ended Job stays (TTL 600 s)
    "app": "    app: apps:sleep_forever\n",
}


@pytest.mark.parametrize("kind", list(STAGES))
def test_status_of_a_lost_run_deletes_the_job_its_killed_driver_left(k8s, tmp_path, kind):
    """The driver of a run whose stage holds a Job is SIGKILLed; ``phalanx status`` finds the Job
    in the run DB and deletes it with its pods, Secret and PodGroup: the Job object itself, not
    left to its TTL."""
    from phalanx.orchestrator.rundb import RunDB

    site = k8s.write_site(tmp_path / "site.yaml")
    wf = tmp_path / "wf.yaml"
    wf.write_text(f"name: k8s-leftover\nstages:\n  hold:\n{STAGES[kind]}    ranks: 2\n")
    state = tmp_path / "state"
    db = RunDB(state)
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(
        [*PHALANX, "run", str(wf), "--site", str(site), "--state", str(state), "--plain"],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
    )
    job = None
    try:
        run_id = wait_until(lambda: db.runs() and db.runs()[0]["id"], 60, "the run")
        job = wait_until(
            lambda: next((a["record"]["id"] for a in db.allocations(run_id)), None),
            60,
            "the Job's record in the run DB",
        )
        wait_until(
            lambda: len(p := k8s.pods(job)) == 2 and all(x["status"]["phase"] == "Running" for x in p),
            60,
            "the stage's 2 pods to run",
        )
        assert driver.poll() is None
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        # (never read the run with db.run()/db.runs() now: reading a lost run releases what it left)
        if kind == "app":
            wait_until(
                lambda: all(p["status"]["phase"] in ("Succeeded", "Failed") for p in k8s.pods(job)),
                30,
                "the ranks to end without their driver",
            )
        else:
            assert all(p["status"]["phase"] == "Running" for p in k8s.pods(job))
        # the driver's death deleted nothing: the Job, its pods, Secret, PodGroup are all there
        left = k8s.objects(job, deleted=False)
        kinds = sorted(o.split(" ")[0] for o in left)
        if kind == "app":
            # ranks that failed without their driver fail the Job (podFailurePolicy FailJob), and
            # the Job controller removes a pod whose end its kubelet has not reported yet (the
            # two nodes report 0.5-1 s apart): the controller's doing, not phalanx's
            assert [k for k in kinds if k != "pod"] == ["job", "podgroup", "secret"], left
            assert 1 <= kinds.count("pod") <= 2, left
        else:
            assert kinds == ["job", "pod", "pod", "podgroup", "secret"], left

        status = subprocess.run(
            [*PHALANX, "status", "--state", str(state), run_id], capture_output=True, text=True, timeout=120, cwd=REPO
        )
        assert status.returncode == 0, status.stderr
        # the Job is gone the moment status returns: status deleted it (its TTL is 600 s), and
        # with it everything else (deleted, if not all gone yet: wait_nothing_left)
        assert k8s.get(f"/apis/batch/v1/namespaces/{NS}/jobs/{job}") is None
        k8s.wait_nothing_left(job)
        assert f"run {run_id}: k8s-leftover — lost" in status.stdout, status.stdout
        # it says so (what else it names varies: the pods, Secret and PodGroup are the Job's, and
        # the garbage collector may delete them before status gets to them)
        released = [line.strip() for line in status.stdout.splitlines() if "released" in line]
        assert (
            len(released) == 1
            and released[0].startswith("released left by the driver: kubernetes: deleted job")
            and released[0].endswith(f" of job {NS}/{job}")
        ), status.stdout
        assert db.allocations(run_id) == []
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10)
        log.close()
        if job:
            k8s.delete_job(job)


# ---- a failed pod fails the gang; the stage retries on a fresh Job ---------------------------------
def test_a_failed_rank_fails_the_gang_and_the_retry_runs_on_a_fresh_job(k8s, tmp_path):
    from phalanx.orchestrator.models import Stage, Workflow
    from phalanx.orchestrator.rundb import RunDB
    from phalanx.orchestrator.scheduler import run_workflow

    site = k8s.model()
    wf = Workflow(
        name="k8s-retry",
        stages={"s": Stage(app="test_kubernetes:fail_rank_1_once", ranks=2, retries=1, params={"dir": str(tmp_path)})},
    )
    db = RunDB(tmp_path / "state")
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(r=run_workflow(wf, site, db=db)), daemon=True)
    runner.start()
    try:
        second = wait_until(
            lambda: (p := tmp_path / "second-attempt").exists() and p.read_text(), 120, "the second attempt's ranks"
        )
        first = (tmp_path / "rank-1-failed").read_text()
        assert first != second
        # while attempt 2 runs: attempt 1's Job is gone, attempt 2 has one Job of its own
        k8s.wait_nothing_left(first)
        assert len(k8s.jobs_of(second)) == 1
        (tmp_path / "go").touch()
        runner.join(timeout=120)
        assert not runner.is_alive(), "the workflow did not finish"
    finally:
        (tmp_path / "go").touch()
        runner.join(timeout=60)
    result = outcome["r"]
    assert result.ok, result.failed
    a1, a2 = db.attempts(result.run_id, "s")
    assert (a1["gang_id"], a2["gang_id"]) == (first, second)
    assert a1["state"] == "failed" and a2["state"] == "succeeded"
    assert "rank 1" in a1["error"] and "exited with code 3" in a1["error"], a1["error"]
    k8s.wait_nothing_left(second)


# ---- an image that can never start -------------------------------------------------------------
def test_a_rank_whose_image_never_starts_fails_the_gang_at_once(k8s):
    model = k8s.model(start_timeout=60, kubernetes={"image": "docker.io/local/nope:1", "image_pull_policy": "Never"})
    gang = px.Gang(2, site=model, echo=False)
    took, msg = failed_start(gang)
    assert took < 30, f"failed after {took:.1f} s (start_timeout 60): {msg}"
    assert "ErrImageNeverPull" in msg and "docker.io/local/nope:1" in msg, msg
    assert "never started" in msg, msg
    k8s.wait_nothing_left(gang.gang_id)


def test_workload_jobset_on_a_cluster_without_the_jobset_controller_fails_at_once_naming_it(k8s):
    """This cluster has no JobSet controller (none can be installed offline): the gang fails
    before anything is created, saying what is missing and what to use instead."""
    model = k8s.model(start_timeout=60, kubernetes={"workload": "jobset"})
    gang = px.Gang(2, site=model, echo=False)
    took, msg = failed_start(gang)
    assert took < 15, f"failed after {took:.1f} s (start_timeout 60): {msg}"
    assert "jobset.x-k8s.io/v1alpha2" in msg and "JobSet controller" in msg and "workload: job" in msg, msg
    k8s.wait_nothing_left(gang.gang_id)


# ---- the control key stays in its Secret -------------------------------------------------------
def test_the_control_key_is_in_the_secret_only_never_in_the_job_or_its_pods(k8s):
    gang = px.Gang(2, site=k8s.model(), echo=False)
    try:
        facts = gang.run(gang_facts)  # the ranks connected to the driver with this key
        (job,) = k8s.jobs_of(gang.gang_id)
        secret = k8s.get(f"/api/v1/namespaces/{NS}/secrets/{job}")
        key = base64.b64decode(secret["data"]["authkey"]).decode()
        assert re.fullmatch(r"[0-9a-f]{32,}", key), "the Secret holds no control key"
        assert [f["key"] for f in facts] == [key, key], "the ranks' key is not the Secret's"
        job_text = json.dumps(k8s.get(f"/apis/batch/v1/namespaces/{NS}/jobs/{job}"))
        pods = k8s.pods(job)
        assert sorted(p["metadata"]["name"] for p in pods) == sorted(f["pod"] for f in facts)
        assert key not in job_text
        for pod in pods:
            assert key not in json.dumps(pod)
        # it reaches the ranks by reference to the Secret
        env = {e["name"]: e for e in json.loads(job_text)["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["PHALANX_AUTHKEY"] == {
            "name": "PHALANX_AUTHKEY",
            "valueFrom": {"secretKeyRef": {"name": job, "key": "authkey"}},
        }
    finally:
        gang.close()
    k8s.wait_nothing_left(gang.gang_id)


# ---- a driver outside the source tree of an editable phalanx --------------------------------------
def test_a_driver_started_outside_the_source_tree_still_starts_its_ranks(k8s, tmp_path):
    """`phalanx run` from a project directory of the user's (not the phalanx checkout), with
    phalanx installed editable (pip install -e: a finder, not a path, on sys.path): host_paths
    ``auto`` must mount where phalanx is imported from, or the ranks cannot start its worker."""
    site = k8s.write_site(tmp_path / "site.yaml")
    (tmp_path / "wf.yaml").write_text("name: k8s-elsewhere\nstages:\n  one:\n    app: apps:rank_info\n    ranks: 1\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    out = subprocess.run(
        [*PHALANX, "run", "wf.yaml", "--site", str(site), "--state", str(tmp_path / "state"), "--plain"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# ---- ranks on the nodes holding their input (prefer_hosts) ----------------------------------------
def node_preference(pod: dict) -> list[str] | None:
    """The node names a pod's preferred node affinity asks for (None: it has no affinity)."""
    affinity = pod["spec"].get("affinity")
    if affinity is None:
        return None
    terms = affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    return [v for t in terms for f in t["preference"]["matchFields"] for v in f["values"]]


def rank_of(pod: dict) -> int:
    return int(pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"])


def test_prefer_hosts_gives_each_rank_pod_an_affinity_for_its_node_and_the_gang_runs(k8s):
    """Rank 0 asks for 127.0.0.2 by the node's kubernetes.io/hostname label... (here name and
    label agree), rank 1 for 127.0.0.1 (the reverse of nothing asked): each pod read back from
    the API server prefers its rank's node, lands there, and the gang computes as one."""
    real = k8s.cluster.real_nodes
    assert len(real) >= 2, real
    hosts = [real[1], real[0]]
    model = k8s.model()
    executor = model.create_executor()
    launcher = executor.launcher(2)
    assert launcher.prefer_hosts(hosts) is True
    assert launcher.placed == hosts
    gang = px.Gang(2, site=model, executor=launcher, echo=False)
    try:
        out = gang.run(where_and_sum)
        (job,) = k8s.jobs_of(gang.gang_id)
        pods = sorted(k8s.pods(job), key=rank_of)
        assert [node_preference(p) for p in pods] == [[hosts[0]], [hosts[1]]]
        term = pods[0]["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["weight"] == 100
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in pods[0]["spec"]["affinity"]["nodeAffinity"]
        assert [p["spec"].get("schedulingGates") for p in pods] == [None, None]  # lifted
        assert [p["spec"]["nodeName"] for p in pods] == hosts
        assert [(r["rank"], r["node"], r["sum"]) for r in out] == [(0, hosts[0], 5), (1, hosts[1], 5)]
        assert launcher.preferred == hosts and launcher.placed == []  # this launch's only
    finally:
        gang.close()
    k8s.wait_nothing_left(gang.gang_id)


def test_prefer_hosts_of_no_node_of_the_cluster_declines_and_the_pods_carry_no_affinity(k8s):
    model = k8s.model()
    executor = model.create_executor()
    launcher = executor.launcher(2)
    assert launcher.prefer_hosts(["no-such-host.example", ""]) is False
    assert launcher.prefer_hosts(["", ""]) is False
    assert launcher.placed == []
    gang = px.Gang(2, site=model, executor=launcher, echo=False)
    try:
        out = gang.run(where_and_sum)
        (job,) = k8s.jobs_of(gang.gang_id)
        pods = k8s.pods(job)
        assert len(pods) == 2
        for pod in pods:
            assert node_preference(pod) is None, pod["spec"].get("affinity")
            assert not pod["spec"].get("schedulingGates")
        template = k8s.get(f"/apis/batch/v1/namespaces/{NS}/jobs/{job}")["spec"]["template"]["spec"]
        assert "schedulingGates" not in template and "affinity" not in template
        assert [r["sum"] for r in out] == [5, 5]
    finally:
        gang.close()
    k8s.wait_nothing_left(gang.gang_id)


def test_the_manifests_of_a_placed_gang_gate_its_pods_and_the_patch_gives_a_preferred_affinity():
    """No cluster: the Job of a placed gang holds its pods at the placement gate; the per-pod
    patch is a preferred (never required) affinity for the node by name, and lifts only that
    gate.  An unplaced gang's Job has neither."""
    from phalanx.executors.kubernetes import manifests as M
    from phalanx.executors.kubernetes.config import KubernetesConfig

    cfg = KubernetesConfig(image="img:1")
    base = dict(name="phalanx-g-ab12", ranks=2, argv=["python3"], env={}, authkey="00" * 16)
    plain = M.pod_spec(M.job(cfg, M.GangSpec(**base)))
    assert "schedulingGates" not in plain and "affinity" not in plain
    assert M.job(cfg, M.GangSpec(**base, placed=["", ""])) == M.job(cfg, M.GangSpec(**base))
    placed = M.pod_spec(M.job(cfg, M.GangSpec(**base, placed=["node-a", ""])))
    assert placed["schedulingGates"] == [{"name": "phalanx.dev/placement"}]
    assert "affinity" not in placed  # one template for every rank: the affinity comes per pod
    assert {k: v for k, v in placed.items() if k != "schedulingGates"} == plain
    jobset = M.pod_spec(M.jobset(cfg, M.GangSpec(**base, placed=["node-a", ""])))
    assert jobset["schedulingGates"] == [{"name": "phalanx.dev/placement"}]

    assert M.node_affinity("node-a") == {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]},
                }
            ]
        }
    }
    assert M.placement_patch("node-a") == {
        "spec": {
            "schedulingGates": [{"$patch": "delete", "name": "phalanx.dev/placement"}],
            "affinity": M.node_affinity("node-a"),
        }
    }
    assert M.placement_patch("") == {
        "spec": {"schedulingGates": [{"$patch": "delete", "name": "phalanx.dev/placement"}]}
    }


def test_prefer_hosts_where_rbac_forbids_listing_nodes_declines_and_says_so_once(caplog):
    """No cluster: a client that may not list nodes (HTTP 403) declines, with one warning a
    process, and leaves the next launch unplaced."""
    from types import SimpleNamespace

    from kubernetes.client.exceptions import ApiException

    from phalanx.executors.kubernetes.config import KubernetesConfig
    from phalanx.executors.kubernetes.launcher import KubernetesLauncher

    def forbidden():
        raise ApiException(status=403, reason="Forbidden")

    kube = SimpleNamespace(core=SimpleNamespace(list_node=forbidden))
    site = f"rbac-{secrets.token_hex(3)}"
    launcher = KubernetesLauncher(lambda: kube, KubernetesConfig(image="img:1"), site=site)
    with caplog.at_level("WARNING", logger="phalanx.executors.kubernetes"):
        assert launcher.prefer_hosts(["node-a", "node-b"]) is False
        assert launcher.prefer_hosts(["node-a", "node-b"]) is False
    said = [r.getMessage() for r in caplog.records if site in r.getMessage()]
    assert len(said) == 1 and "cannot list the cluster's nodes" in said[0] and "403" in said[0], said
    assert launcher.placed == []
