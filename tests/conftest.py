"""Shared fixtures: gangs kept alive per world size, and a real redis-server on loopback."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

import phalanx as px

WORLD_SIZES = (1, 2, 3, 4)

# Every store the tests open (driver and ranks) lives in one throwaway directory.  Rank
# processes import this module too (apps pickled from test modules that import it): they
# inherit the directory instead of making their own.
# A rank must keep the store its gang gave it (an S3 root, say): only the owner sets it.
_OWNER = "PHALANX_TEST_STORE" not in os.environ
if _OWNER:
    os.environ["PHALANX_TEST_STORE"] = tempfile.mkdtemp(
        prefix="phalanx-test-store-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    os.environ["PHALANX_STORE"] = os.environ["PHALANX_TEST_STORE"]
_STORE_ROOT = os.environ["PHALANX_TEST_STORE"]
# Each xdist worker its own store below it (its ranks inherit it): with `--dist load` the cases
# of one test run on several workers at once, and may put datasets of the same name.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and "PHALANX_TEST_STORE_WORKER" not in os.environ:
    os.environ["PHALANX_TEST_STORE_WORKER"] = os.path.join(_STORE_ROOT, _WORKER)
    os.makedirs(os.environ["PHALANX_TEST_STORE_WORKER"], mode=0o700, exist_ok=True)
    os.environ["PHALANX_STORE"] = os.environ["PHALANX_TEST_STORE_WORKER"]


def pytest_addoption(parser):
    # the conformance suite (tests/conformance): the executor contract on these sites
    parser.addoption(
        "--site",
        action="append",
        default=[],
        metavar="NAME",
        help="conformance suite: run the executor contract on these sites only (repeatable or "
        "comma-separated: local, mpirun, slurm, slurm-pilot, ray, k8s-local, radical-local; default: all of them)",
    )


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): the core lane — pyproject's own selection — the slow
    lane (core tests kept out of its 5 minutes; no cluster) and the radical lane (each run its
    own pilot: no cluster to share; 5:31 instead of 7:48 here, RP's agents mostly wait) run on
    two worker processes, a file each at a time (core: 4:39 instead of 5:46 here, a lone pytest
    keeps 2 cores 1.3 busy); any other selection runs in one process, since a lane's session
    fixtures start one cluster each (a Slurm, a Ray cluster, a control plane, the multi-host bed)."""
    addopts = config.getini("addopts")
    core = next((value for flag, value in zip(addopts, addopts[1:]) if flag == "-m"), None)
    lane = config.option.markexpr
    two = lane == core or any(lane == name or lane.startswith(f"{name} and not (") for name in ("slow", "radical"))
    return 2 if two and not config.option.collectonly else 0


def pytest_sessionfinish(session, exitstatus):
    if _OWNER:
        shutil.rmtree(_STORE_ROOT, ignore_errors=True)


@pytest.fixture(scope="session", params=WORLD_SIZES, ids=lambda n: f"ranks{n}")
def gang(request):
    """One gang per world size for the whole session: starting ranks costs ~2 s."""
    g = px.Gang(ranks=request.param, echo=False)
    g.start()
    yield g
    g.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url():
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="phalanx-redis-")
    proc = subprocess.Popen(
        [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"redis-server did not start on port {port}")
        time.sleep(0.02)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)
    shutil.rmtree(workdir, ignore_errors=True)


# ---- a private SLURM cluster on loopback (tests marked slurm) ------------------------------
_INFRA = Path(__file__).resolve().parent / "infra"
SLURM_CONF = f"{os.environ.get('PHALANX_SLURM_DIR', '/tmp/phalanx-slurm')}/slurm.conf"


def _cluster_up() -> bool:
    if not Path(SLURM_CONF).exists():
        return False
    r = subprocess.run(
        ["scontrol", "ping"], env={**os.environ, "SLURM_CONF": SLURM_CONF}, capture_output=True, text=True, timeout=30
    )
    return "is UP" in r.stdout


@pytest.fixture(scope="session")
def slurm_cluster():
    if shutil.which("slurmctld") is None:
        pytest.skip("slurmctld is not installed (scripts/setup-slurm.sh installs Debian's slurm-wlm and munge)")
    was_up = _cluster_up()
    r = subprocess.run([str(_INFRA / "slurm-up.sh")], capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.fail(f"tests/infra/slurm-up.sh failed ({r.returncode}):\n{r.stderr}\n{r.stdout}")
    yield SLURM_CONF
    from phalanx.executors.base import _release_all

    _release_all()  # what a test left held (a pilot, a job) is freed while the cluster is up
    # a cluster a developer started by hand stays up; PHALANX_SLURM_KEEP=1 keeps ours
    if not was_up and not os.environ.get("PHALANX_SLURM_KEEP"):
        subprocess.run([str(_INFRA / "slurm-down.sh")], capture_output=True, timeout=120)


# ---- a real Kubernetes cluster on loopback (tests marked kubernetes) -------------------------
@pytest.fixture(scope="session")
def k8s_cluster():
    """A real control plane and two real nodes (127.0.0.1, 127.0.0.2) whose pods run this host's
    Python (tests/infra/k8s/up.sh); stopped at the end unless it was up before or
    PHALANX_K8S_KEEP=1.  Skips where it cannot run (no binaries: tests/infra/k8s/build.sh)."""
    pytest.importorskip(
        "kubernetes", reason="the kubernetes client is not installed (pip install 'phalanx[kubernetes]')"
    )
    from infra import k8s_cluster as k8s

    reason = k8s.available()
    if reason:
        pytest.skip(f"no Kubernetes test cluster: {reason}")
    try:
        cluster = k8s.ensure_cluster(real_nodes=2)
    except k8s.ClusterError as exc:
        pytest.fail(str(exc))
    yield cluster
    from phalanx.executors.base import _release_all

    _release_all()  # what a test left held (a Job) is deleted while the API server is up
    k8s.teardown()


# ---- a multi-node Ray cluster on loopback (tests marked ray) ---------------------------------
@pytest.fixture(scope="session")
def ray_cluster():
    """A head and two worker raylets (1 CPU each; resources node_head/node_a/node_b); this
    process is connected to it.  Stops only what it started (never `ray stop`)."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'phalanx[ray]')")
    from infra.ray_cluster import LocalRayCluster

    cluster = LocalRayCluster(workers=2, cpus_per_node=1)
    cluster.start()
    try:
        ray.init(address=cluster.address, namespace="phalanx-test", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()


# ---- the fault suite (tests/faults, marker faults) ------------------------------------------
# The fault suite (marker ``faults``): each test injects one fault and states what phalanx did.
#
# A test asks for the ``fault`` fixture and fills in what the reliability table shows::
#
#     def test_kill_rank(fault):
#         fault.describe("kill a rank mid-shuffle", backend="local")
#         ...                                  # inject, measure
#         fault.detected(seconds)              # time from the fault to phalanx noticing it
#         fault.outcome("gang stopped, retry gave the right answer")
#         fault.data_lost("none")              # what the user lost (the suite requires none)
#
# Rows are appended (one JSON line per test, with whether it passed) to the file named by
# ``PHALANX_FAULT_RESULTS`` when it is set; ``scripts/reliability_table.py`` runs the suite with
# it and regenerates the table in docs/reliability.md.


def pytest_collection_modifyitems(config, items):
    here = os.path.join(os.path.dirname(__file__), "faults")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.faults)


@dataclass
class FaultRecord:
    test: str
    fault: str = ""
    backend: str = "local"
    result: str = ""
    detect_s: float | None = None
    lost: str = ""
    passed: bool = False
    started: float = field(default_factory=time.time)

    def describe(self, fault: str, backend: str = "local") -> None:
        self.fault, self.backend = fault, backend

    def detected(self, seconds: float) -> None:
        self.detect_s = round(seconds, 2)

    def outcome(self, text: str) -> None:
        self.result = text

    def data_lost(self, text: str) -> None:
        self.lost = text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.fault_call_passed = report.passed


@pytest.fixture
def fault(request):
    record = FaultRecord(request.node.nodeid)
    yield record
    record.passed = bool(getattr(request.node, "fault_call_passed", False))
    path = os.environ.get("PHALANX_FAULT_RESULTS")
    if path and record.fault:
        with open(path, "a") as f:
            f.write(json.dumps(asdict(record)) + "\n")


# ---- a real S3-compatible server (the s3 and multisite lanes) ------------------------------------
SEAWEEDFS_BUCKET = "phalanx-test"
SEAWEEDFS_ANON_BUCKET = "phalanx-anon"  # unsigned requests may use this one


@pytest.fixture(scope="session")
def seaweedfs_endpoint():
    """A real S3-compatible server: one SeaweedFS ``weed server`` on free ports of 127.0.0.1
    (tests/infra/seaweedfs.py), with the bucket ``SEAWEEDFS_BUCKET`` for random credentials (``.env()``)
    and ``SEAWEEDFS_ANON_BUCKET`` for unsigned requests as well.
    Skipped when the pinned binary is not built (tests/infra/seaweedfs-build.sh); the s3 lane of
    .ci/run builds it and sets PHALANX_REQUIRE_SEAWEEDFS=1, which turns that skip into a failure."""
    from infra import seaweedfs

    weed = seaweedfs.find_binary()
    if weed is None:
        if os.environ.get("PHALANX_REQUIRE_SEAWEEDFS") == "1":
            pytest.fail(seaweedfs.why_missing())
        pytest.skip(seaweedfs.why_missing())
    server = seaweedfs.start(weed, anonymous_buckets=(SEAWEEDFS_ANON_BUCKET,))
    try:
        server.create_bucket(SEAWEEDFS_BUCKET)
        server.create_bucket(SEAWEEDFS_ANON_BUCKET)
        yield server
    finally:
        server.stop()  # by PID; its data directory is removed


@pytest.fixture
def seaweedfs_credentials(seaweedfs_endpoint):
    """The SeaweedFS server's credentials in the AWS variables for one test (moto's fixture holds
    other ones for its module); a MonkeyPatch of its own, since a test may undo its ``monkeypatch``
    halfway (pyarrow's client reads the variables at each request)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in seaweedfs_endpoint.env().items():
            mp.setenv(k, v)
        yield seaweedfs_endpoint
