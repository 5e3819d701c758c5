"""A multi-node Ray cluster on this machine's loopback: a head and worker raylets.

Every node is a real raylet with its own CPUs and a node-specific custom resource
(``node_head``, ``node_a``, ``node_b``, ...), so placement strategies (STRICT_SPREAD puts
ranks on distinct raylets) and resource constraints behave as on a real cluster.

From tests (in-process; stops exactly what it started)::

    from infra.ray_cluster import LocalRayCluster
    with LocalRayCluster(workers=2) as cluster:
        ray.init(address=cluster.address)   # or RayExecutor({"address": cluster.address})

By hand (a detached holder process keeps the cluster up until ``down``)::

    eval "$(.venv/bin/python tests/infra/ray_cluster.py up)"   # exports RAY_ADDRESS
    .venv/bin/phalanx run workflows/etl_to_training.yaml --site site-configs/ray-local.yaml
    .venv/bin/python tests/infra/ray_cluster.py status
    .venv/bin/python tests/infra/ray_cluster.py down

Pitfalls on this machine (../shared/infra/ENGINES.md):
- On Linux Ray replaces a loopback node IP by the host's routable one and its daemons listen
  on every interface.  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set here before Ray reads it,
  keeps the node IP at 127.0.0.1 and every listener on loopback.
- Never ``ray stop``: it kills every Ray process on the host, other people's too.  ``down``
  signals only the holder process recorded in the state file, which shuts its own cluster down
  (and Ray's reaper process kills the nodes should the holder die).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from phalanx.executors.ray.connection import keep_ray_on_loopback  # imports no Ray
from phalanx.orchestrator.rundb import pid_alive as _alive
from phalanx.orchestrator.rundb import wait_exit

keep_ray_on_loopback()  # before Ray's constants module reads it (or, if it did, over its constant)


def state_file() -> Path:
    return Path(tempfile.gettempdir()) / f"phalanx-{getpass.getuser()}" / "ray-cluster.json"


class LocalRayCluster:
    """``ray.cluster_utils.Cluster``: a head plus ``workers`` raylets, all on 127.0.0.1."""

    def __init__(self, workers: int = 2, cpus_per_node: int = 1, object_store_mb: int = 80):
        self.workers = workers
        self.cpus_per_node = cpus_per_node
        self.object_store_mb = object_store_mb
        self.cluster = None
        self.temp_dir: str | None = None  # Ray's session files (logs, sockets); removed by stop()
        # node name → its custom resource, e.g. {"head": "node_head", "a": "node_a"}
        self.resources = {
            "head": "node_head",
            **{chr(ord("a") + i): f"node_{chr(ord('a') + i)}" for i in range(workers)},
        }

    @property
    def address(self) -> str:
        return self.cluster.address

    def start(self) -> LocalRayCluster:
        keep_ray_on_loopback()
        from ray.cluster_utils import Cluster

        # short: Ray's unix socket paths live under it
        self.temp_dir = tempfile.mkdtemp(prefix="pxray-", dir="/tmp" if os.path.isdir("/tmp") else None)
        os.makedirs("/tmp/ray", exist_ok=True)  # ray.init writes the current cluster's address there
        common = {
            "num_cpus": self.cpus_per_node,
            "object_store_memory": self.object_store_mb << 20,
            "temp_dir": self.temp_dir,
        }
        self.cluster = Cluster(
            initialize_head=True, head_node_args={**common, "include_dashboard": False, "resources": {"node_head": 1}}
        )
        try:
            for name, resource in self.resources.items():
                if name != "head":
                    self.cluster.add_node(**common, resources={resource: 1})
            self.cluster.wait_for_nodes()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.cluster is not None:
            import ray

            if ray.is_initialized():
                ray.shutdown()  # a driver connected to this cluster would outlive it otherwise
            self.cluster.shutdown()
            self.cluster = None
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- command line ---------------------------------------------------------------------------
def _read_state() -> dict | None:
    try:
        return json.loads(state_file().read_text())
    except (OSError, ValueError):
        return None


def _serve(args) -> int:
    """The holder: starts the cluster, records it, keeps it until SIGTERM/SIGINT."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    cluster = LocalRayCluster(workers=args.workers, cpus_per_node=args.cpus)
    cluster.start()
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"pid": os.getpid(), "address": cluster.address, "resources": list(cluster.resources.values())})
    )
    try:
        while not stop:
            time.sleep(0.2)
    finally:
        cluster.stop()
        if (_read_state() or {}).get("pid") == os.getpid():
            path.unlink(missing_ok=True)
    return 0


def _up(args) -> int:
    state = _read_state()
    if state and _alive(state["pid"]):
        print(f"export RAY_ADDRESS={state['address']}")
        print(f"# already up (holder pid {state['pid']})", file=sys.stderr)
        return 0
    state_file().unlink(missing_ok=True)
    log = state_file().with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        holder = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "serve",
                "--workers",
                str(args.workers),
                "--cpus",
                str(args.cpus),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        state = _read_state()
        if state and state.get("pid") == holder.pid:
            print(f"export RAY_ADDRESS={state['address']}")
            print(
                f"# Ray cluster up: head + {args.workers} raylets on 127.0.0.1, resources "
                f"{', '.join(state['resources'])}; holder pid {holder.pid}, log {log}",
                file=sys.stderr,
            )
            return 0
        if holder.poll() is not None:
            print(f"the cluster did not start (exit {holder.returncode}); see {log}", file=sys.stderr)
            return 1
        time.sleep(0.2)
    holder.terminate()
    print(f"the cluster did not start within {args.timeout:g} s; see {log}", file=sys.stderr)
    return 1


def _down(args) -> int:
    state = _read_state()
    if not state or not _alive(state["pid"]):
        state_file().unlink(missing_ok=True)
        print("no cluster of ours is running", file=sys.stderr)
        return 0
    pid = state["pid"]
    os.kill(pid, signal.SIGTERM)
    if not wait_exit(pid, args.timeout):
        print(f"holder {pid} did not stop within {args.timeout:g} s", file=sys.stderr)
        return 1
    print(f"Ray cluster at {state['address']} stopped", file=sys.stderr)
    return 0


def _status(args) -> int:
    state = _read_state()
    if not state or not _alive(state["pid"]):
        print("down")
        return 1
    print(f"up: RAY_ADDRESS={state['address']} (holder pid {state['pid']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("up", "serve"):
        p = sub.add_parser(
            name,
            help="start the cluster, detached" if name == "up" else "hold the cluster in the foreground (what up runs)",
        )
        p.add_argument("--workers", type=int, default=2, help="worker raylets besides the head")
        p.add_argument("--cpus", type=int, default=1, help="CPUs of each node")
        p.add_argument("--timeout", type=float, default=120)
    sub.add_parser("down", help="stop the cluster `up` started").add_argument("--timeout", type=float, default=30)
    sub.add_parser("status")
    args = parser.parse_args(argv)
    return {"up": _up, "serve": _serve, "down": _down, "status": _status}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
