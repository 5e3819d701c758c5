"""One store service per Ray node for a run: what the SLURM pilot does per node, on Ray.

A gang whose store is a directory (``PHALANX_STORE`` in its ranks' environment, not
``s3://``) on a cluster of several nodes needs, on every node that holds partitions, a
``phalanx.store.service`` serving that node's root (each node's ``/dev/shm`` is its own), so
that a rank reads another node's partitions from it.  ``StoreServices.ensure`` starts, once
per (executor run, root), one ``ServiceActor`` per host (node address) with CPUs — pinned there by
``NodeAffinitySchedulingStrategy`` (hard), no CPUs — which runs ``python -m
phalanx.store.service --root R --host <node IP> --key ray-<id>`` as its child (dying with it:
``PR_SET_PDEATHSIG``) and returns its endpoint.  Each service publishes itself in its own
node's ``R/.services/ray-<id>.json``; the ranks get ``PHALANX_STORE_SERVICE_KEY=ray-<id>``.
``close`` (the executor's ``close_run``) stops them: SIGTERM to the service (which removes its
record), then the actor is killed.  The actors are not detached: they end with the driver's
Ray job should the driver die first.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from ...paths import ENV_SPILL, ENV_STORE
from ...runtime.envvars import ENV_STORE_TOKEN_FILE

log = logging.getLogger("phalanx.executors.ray")

STORE_ENV = (ENV_STORE, ENV_SPILL, ENV_STORE_TOKEN_FILE)  # what a service takes from a gang's env
SERVICE_WAIT_S = 60.0


class ServiceActor:
    """Runs one store service on its node (wrapped by ``ray.remote`` on the driver)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self, root: str, key: str, env: Mapping[str, str], python: str, timeout: float) -> dict[str, Any]:
        import socket

        import ray

        from ...procs import die_with_parent

        host = ray.util.get_node_ip_address()
        os.makedirs(root, exist_ok=True)
        full = {**os.environ, **env}
        self.proc = proc = subprocess.Popen(
            [python if os.path.exists(python) else sys.executable, "-m", "phalanx.store.service"]
            + ["--root", root, "--host", host, "--key", key],
            env=full,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
        )
        assert proc.stdout is not None and proc.stderr is not None  # both PIPE
        stdout, stderr = proc.stdout, proc.stderr
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(stdout.readline().strip()), daemon=True)
        reader.start()
        reader.join(timeout)
        endpoint = out[0] if out else ""
        if not endpoint:
            err = ""
            if proc.poll() is not None:
                lines = (stderr.read() or "").strip().splitlines()
                err = lines[-1] if lines else ""
            self.stop()
            return {
                "host": socket.gethostname(),
                "node_ip": host,
                "endpoint": "",
                "error": err or "no endpoint in time",
            }
        threading.Thread(target=stderr.read, daemon=True).start()  # never blocks on a full pipe
        return {"host": socket.gethostname(), "node_ip": host, "endpoint": endpoint, "pid": proc.pid}

    def stop(self, grace: float = 5.0) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


class StoreServices:
    """The store services of one executor run (per store root), started on first need."""

    def __init__(self, site: str = "ray"):
        self.site = site
        self._lock = threading.Lock()
        self.key = ""
        self.root: str | None = None
        self.actors: list[Any] = []
        self.endpoints: dict[str, str] = {}  # node IP → endpoint
        self.timings: dict[str, float] = {}

    def ensure(self, ray, env: Mapping[str, str]) -> str | None:
        """The services' key for a gang with environment ``env`` (starting them on every alive
        node the first time), or None where the gang's store is not a directory root."""
        root = env.get(ENV_STORE, "")
        if not root or "://" in root:
            return None
        with self._lock:
            if self.root == root and self.actors:
                return self.key
            if self.actors:  # another root: one set of services at a time
                self._close(ray)
            return self._start(ray, root, {k: env[k] for k in STORE_ENV if env.get(k)})

    def _start(self, ray, root: str, env: dict[str, str]) -> str | None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        t0 = time.perf_counter()
        # one node a host (address) that ranks can run on: a head started with no CPUs holds no
        # partition, and raylets sharing a host (ray.cluster_utils) share its /dev/shm
        nodes: dict[str, dict] = {}
        for nd in ray.nodes():
            if nd.get("Alive") and nd.get("Resources", {}).get("CPU", 0) > 0:
                nodes.setdefault(nd.get("NodeManagerAddress", ""), nd)
        if len(nodes) < 2:  # one host: the ranks read its root directly
            return None
        self.key = f"ray-{uuid.uuid4().hex[:12]}"
        cls = ray.remote(ServiceActor)
        self.actors = [
            cls.options(
                num_cpus=0,
                max_restarts=0,
                name=f"phalanx-store-{self.key}-{i}",
                scheduling_strategy=NodeAffinitySchedulingStrategy(nd["NodeID"], soft=False),
            ).remote()
            for i, nd in enumerate(nodes.values())
        ]
        self.root = root
        refs = [a.start.remote(root, self.key, env, sys.executable, SERVICE_WAIT_S) for a in self.actors]
        try:
            found = ray.get(refs, timeout=SERVICE_WAIT_S + 30)
        except Exception as exc:
            log.warning("ray: store services did not start (site %r): %s", self.site, exc)
            found = []
        self.endpoints = {f["node_ip"]: f["endpoint"] for f in found if f.get("endpoint")}
        for f in found:
            if not f.get("endpoint"):
                log.warning("ray: no store service on %s (site %r): %s", f["node_ip"], self.site, f.get("error"))
        self.timings["services_s"] = time.perf_counter() - t0
        return self.key

    def close(self) -> None:
        from .connection import connected

        ray = connected()
        with self._lock:
            self._close(ray)

    def _close(self, ray) -> None:
        actors, self.actors = self.actors, []
        self.root, self.endpoints = None, {}
        if ray is None or not actors:
            return
        try:
            ray.get([a.stop.remote() for a in actors], timeout=30)
        except Exception as exc:
            log.warning("ray: stopping the store services: %s", exc)
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
