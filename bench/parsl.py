#!/usr/bin/env python
"""Parsl apps on a warm gang vs a fresh gang per app (``bsp_app(persistent=True)``).

A chain of small 2-rank BSP apps, each reading the previous app's output from the store (a
``DatasetRef`` passed through Parsl) and sealing its own, on a HighThroughputExecutor whose worker
drives gangs of phalanx's local executor (``config_from_site("local")``).  Fresh: every app starts
its gang (processes, rendezvous, Gloo) and stops it; persistent: the worker's warm gang runs them
all.  ``--mpi`` adds the same chain on an MPIExecutor (ranks through ``$PARSL_MPI_PREFIX``: a gang
per task by construction).

    .venv/bin/python bench/parsl.py [--apps 5] [--ranks 2] [--mpi] [--site site-configs/slurm-local.yaml]

``--site``: the phalanx site whose executor places the gangs (default ``local``; a SLURM site: a
per-stage job per fresh gang, one job held by the persistent gang; start the test cluster first
with tests/infra/slurm-up.sh).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

# this file is bench/parsl.py: its directory must not shadow the parsl package
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import pyarrow as pa  # noqa: E402


def seed(env, rows):
    return pa.table({"k": list(range(env.rank, rows, env.world_size))})


def step(env, prev):
    return prev  # read on every rank, sealed again as this app's output


def chain(apps: int, ranks: int, **options) -> tuple[list[float], list[float]]:
    """Per app: seconds from submission to result (sequential), and the worker's own seconds."""
    from phalanx.integrations.parsl import bsp_app

    first = bsp_app(ranks=ranks, outputs=["d"], **options)(seed)
    nxt = bsp_app(ranks=ranks, outputs=["d"], **options)(step)
    wall, worker = [], []
    ref = None
    for _ in range(apps):
        t0 = time.perf_counter()
        result = (first(1000) if ref is None else nxt(ref)).result()
        wall.append(time.perf_counter() - t0)
        worker.append(result.seconds)
        if ref is not None:
            ref.store().delete_session()  # the previous app's session has done its job
        ref = result.outputs["d"]
    ref.store().delete_session()
    return wall, worker


def run(mode: str, site: str, apps: int, ranks: int, runs_root: str) -> dict[str, tuple[list[float], list[float]]]:
    import parsl

    from phalanx.integrations.parsl import config_from_site

    out = {}
    from phalanx.orchestrator.validate import load_site

    slurm = load_site(site).executor == "slurm"
    extra = {"nodes_per_block": ranks} if mode == "mpi" and slurm else {}  # a rank on each node
    dfk = parsl.load(config_from_site(site, mode=mode, run_dir=f"{runs_root}/{mode}", **extra))
    try:
        if mode == "site":
            chain(1, ranks, site=site)  # the block's worker is up before anything is timed
            out["fresh gang per app"] = chain(apps, ranks, site=site, persistent=False)
            out["persistent gang"] = chain(apps, ranks, site=site, persistent=True)
        else:
            chain(1, ranks, communicator="gloo")
            out["MPIExecutor, gang per task"] = chain(apps, ranks, communicator="gloo")
    finally:
        dfk.cleanup()
        parsl.clear()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--apps", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mpi", action="store_true", help="also the chain on an MPIExecutor")
    ap.add_argument("--site", default="local", help="phalanx site (name or file); default local")
    args = ap.parse_args()
    results: dict[str, tuple[list[float], list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-parsl-") as runs:
        results.update(run("site", args.site, args.apps, args.ranks, runs))
        if args.mpi:
            results.update(run("mpi", args.site, args.apps, args.ranks, runs))
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(
        f"{args.apps} chained {args.ranks}-rank apps on site {args.site} (load average {load}); seconds "
        "per app, submit → result (worker's share)"
    )
    print(f"{'placement':30} {'median':>8} {'mean':>8} {'first':>8} {'worker median':>14}")
    for name, (wall, worker) in results.items():
        print(
            f"{name:30} {statistics.median(wall):8.3f} {statistics.mean(wall):8.3f} {wall[0]:8.3f} "
            f"{statistics.median(worker):14.3f}"
        )
    fresh = statistics.median(results["fresh gang per app"][0])
    warm = statistics.median(results["persistent gang"][0])
    print(f"persistent gang: {fresh / warm:.1f}x faster per app than a fresh gang ({fresh:.3f} s → {warm:.3f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
