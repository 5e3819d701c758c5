#!/usr/bin/env python
"""Gang start and per-stage overhead on every site, next to the local site, in one run.

Brings up what it needs on loopback — the private SLURM cluster (tests/infra/slurm-up.sh), a
3-raylet Ray cluster (tests/infra/ray_cluster.py) and the Kubernetes test cluster with two real
nodes (tests/infra/k8s/up.sh; its binaries: tests/infra/k8s/build.sh) — unless they are already
up, measures, and stops what it started; radical-local needs only radical.pilot (each run
submits its own pilot to RP's local.localhost).  Per site (2 ranks):

  gang start   px.Gang(2, site=...).start(), median of --repeat (ranks launched, connected,
               rendezvoused, communicator built); the SLURM pilot's own allocation is made
               before the first measurement, and so is the RADICAL-Pilot pilot (its time from
               submission to active is printed apart: once per run)
  per stage    a chain of --stages trivial stages through the scheduler (each reads the previous
               output from the store and seals its own), with the site's defaults (gang reuse
               where the executor allows it); "stage 2..n" leaves out the first stage, which
               carries a run's own allocation (the RP pilot's start)

    .venv/bin/python bench/sites.py [--repeat 3] [--stages 5] [--sites local,slurm-local,...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]

from orchestrator import chain  # noqa: E402  (bench/orchestrator.py)

import phalanx as px  # noqa: E402
from phalanx.orchestrator.validate import load_site  # noqa: E402

SITES = ["local", "slurm-local", "slurm-pilot-local", "ray-local", "k8s-local", "radical-local"]


def gang_start(site, repeat: int, executor=None) -> float:
    """Median seconds of px.Gang(2).start(); ``executor``: one whose run scope the caller holds
    (a RADICAL-Pilot pilot already active), else each gang is a run of its own."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        gang = px.Gang(2, site=site, executor=executor, echo=False).start()
        times.append(time.perf_counter() - t0)
        assert gang.run(lambda env: env.comm.allreduce(1)) == [2, 2]
        gang.close()
    return statistics.median(times)


class Clusters:
    """The SLURM and Ray clusters the chosen sites need; stops only what it started."""

    def __init__(self, sites: list[str]):
        self.slurm_started = False
        self.ray = None
        self.k8s = None
        if any(s.startswith("slurm") for s in sites):
            if shutil.which("slurmctld") is None:
                raise SystemExit("slurm sites need Slurm: bash scripts/setup-slurm.sh")
            up = subprocess.run(
                ["scontrol", "ping"],
                capture_output=True,
                text=True,
                env={**os.environ, "SLURM_CONF": "/tmp/phalanx-slurm/slurm.conf"},
            )
            self.slurm_started = "is UP" not in up.stdout
            subprocess.run([str(REPO / "tests" / "infra" / "slurm-up.sh")], check=True, capture_output=True)
        if "ray-local" in sites:
            import ray
            from infra.ray_cluster import LocalRayCluster

            self.ray = LocalRayCluster(workers=2, cpus_per_node=1).start()
            os.environ["RAY_ADDRESS"] = self.ray.address
            ray.init(address=self.ray.address, namespace="phalanx-bench", log_to_driver=False)
        if "k8s-local" in sites:
            from infra import k8s_cluster

            reason = k8s_cluster.available()
            if reason:
                raise SystemExit(f"k8s-local needs the Kubernetes test cluster: {reason}")
            self.k8s = k8s_cluster
            k8s_cluster.ensure_cluster(real_nodes=2)

    def stop(self) -> None:  # a run's pilot ends with its run (close_run)
        if self.ray is not None:
            import ray

            ray.shutdown()
            self.ray.stop()
        if self.k8s is not None:
            self.k8s.teardown()  # only if this process brought it up (PHALANX_K8S_KEEP=1 keeps it)
        if self.slurm_started:
            subprocess.run([str(REPO / "tests" / "infra" / "slurm-down.sh")], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stages", type=int, default=5)
    ap.add_argument("--sites", default=",".join(SITES))
    args = ap.parse_args()
    names = args.sites.split(",")
    clusters = Clusters(names)
    rows = []
    pilots: list[str] = []
    try:
        for name in names:
            site = load_site(name)
            if site.executor == "slurm" and site.slurm.allocation == "pilot":
                px.Gang(1, site=site, echo=False).start().close()  # the pilot: held from here on
            executor = None
            if site.executor == "radical":  # a run's pilot: made once, gangs start on it
                executor = site.create_executor()
                t0 = time.perf_counter()
                executor.open_run()
                executor.pilot().wait_active(600)
                pilots.append(
                    f"{name}: pilot submitted -> active {time.perf_counter() - t0:.2f}s "
                    "(RP session included; once per run)"
                )
            try:
                start = gang_start(site, args.repeat, executor)
            finally:
                if executor is not None:
                    executor.close_run()
            total, per = chain(args.stages, 2, site)
            rows.append((name, site.executor, start, total / args.stages, statistics.mean(per[1:] or per)))
            print(f"  measured {name}", file=sys.stderr)
    finally:
        clusters.stop()
    base_start, base_stage, base_steady = rows[0][2], rows[0][3], rows[0][4]
    print(
        f"{'site':20} {'executor':9} {'gang start':>11} {'vs first':>9} {'per stage':>10} {'vs first':>9} "
        f"{'stage 2..n':>11} {'vs first':>9}"
    )
    for name, executor, start, stage, steady in rows:
        print(
            f"{name:20} {executor:9} {start:10.2f}s {start / base_start:8.2f}x {stage:9.2f}s "
            f"{stage / base_stage:8.2f}x {steady:10.2f}s {steady / base_steady:8.2f}x"
        )
    print(
        f"(2 ranks; gang start median of {args.repeat} (radical: on an active pilot); per stage = chain of "
        f"{args.stages} trivial stages / stages (a run's pilot start included); stage 2..n = mean time of "
        "stages 2..n from start to sealed output; each site's defaults: reuse on local, ray, kubernetes, radical)"
    )
    for line in pilots:
        print(line)
    print("cpu pressure:", open("/proc/pressure/cpu").readline().strip())


if __name__ == "__main__":
    main()
