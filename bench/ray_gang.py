#!/usr/bin/env python
"""Gang start time, per-app and per-stage overhead on Ray (placement group + one actor per rank)
next to the local executor (rank processes), with the Ray cluster already up.

    .venv/bin/python bench/ray_gang.py [--ranks 2] [--repeats 5] [--apps 20] [--stages 5]
                                       [--address HOST:PORT] [--strategy PACK]

Per stage: bench/orchestrator.py's chain of trivial stages through the scheduler, on a local
site with cold gangs (no warm pool, no reuse: what a Ray site does) and on a Ray site.

Without --address it starts the loopback test cluster (tests/infra/ray_cluster.py: a head and
two worker raylets) first; that start is reported but not part of the gang start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import phalanx as px
from phalanx.executors.ray import RayLauncher

HERE = Path(__file__).resolve().parent


def noop(env):
    return env.rank


def gang_once(ranks: int, executor, apps: int) -> dict[str, float]:
    t0 = time.perf_counter()
    gang = px.Gang(ranks, executor=executor, echo=False)
    gang.start()
    start = time.perf_counter() - t0
    gang.run(noop)  # the first app pays for unpickling/importing this module on the ranks
    per_app = []
    for _ in range(apps):
        t = time.perf_counter()
        gang.run(noop)
        per_app.append(time.perf_counter() - t)
    t = time.perf_counter()
    gang.close()
    out = {"start_s": start, "app_ms": 1e3 * statistics.median(per_app), "close_s": time.perf_counter() - t}
    if isinstance(executor, RayLauncher):
        out.update(executor.timings)
    return out


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--apps", type=int, default=20, help="trivial apps timed per gang")
    ap.add_argument("--address", help="an existing Ray cluster (default: start the loopback one)")
    ap.add_argument("--strategy", default="PACK")
    ap.add_argument("--stages", type=int, default=5, help="trivial stages in the chain (0: skip)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    cluster = None
    if args.address is None:
        sys.path.insert(0, str(HERE.parent / "tests"))
        from infra.ray_cluster import LocalRayCluster

        t = time.perf_counter()
        cluster = LocalRayCluster(workers=2).start()
        address = cluster.address
        print(f"loopback Ray cluster (head + 2 raylets) up in {time.perf_counter() - t:.1f} s")
    else:
        address = args.address
    try:
        launcher = RayLauncher(address=address, strategy=args.strategy)
        t = time.perf_counter()
        launcher.connect()
        print(f"ray.init (driver connects) {time.perf_counter() - t:.2f} s")
        local, ray_runs = [], []
        for i in range(args.repeats):  # interleaved: both see the same background load
            local.append(gang_once(args.ranks, "local", args.apps))
            ray_runs.append(gang_once(args.ranks, launcher, args.apps))
            print(
                f"  run {i + 1}: local start {local[-1]['start_s']:.2f} s, "
                f"ray start {ray_runs[-1]['start_s']:.2f} s "
                f"(placement {ray_runs[-1]['placement_s']:.3f} s, actors {ray_runs[-1]['actors_s']:.2f} s)"
            )
        stages = {}
        if args.stages:
            sys.path.insert(0, str(HERE))
            from orchestrator import chain  # bench/orchestrator.py

            from phalanx.orchestrator.models import Site

            sites = {
                "local": Site(name="local-cold", cores=max(args.ranks, 2), warm_ranks=0, reuse_gangs=False),
                "ray": Site(
                    name="ray-bench", executor="ray", cores=3, ray={"address": address, "strategy": args.strategy}
                ),
            }
            for label, site in sites.items():
                total, per = chain(args.stages, args.ranks, site)
                stages[label] = {
                    "total_s": total,
                    "per_stage_s": total / args.stages,
                    "median_stage_s": statistics.median(per),
                }
    finally:
        if cluster is not None:
            cluster.stop()

    lo, ra = summary(local), summary(ray_runs)
    print(f"\n{args.ranks} ranks, median of {args.repeats} gangs ({args.apps} trivial apps each):")
    print(f"{'':22}{'local':>10}{'ray':>10}{'ray/local':>11}")
    for key, label, unit in (
        ("start_s", "gang start", "s"),
        ("app_ms", "trivial app", "ms"),
        ("close_s", "gang close", "s"),
    ):
        print(f"{label + ' (' + unit + ')':22}{lo[key]:10.3f}{ra[key]:10.3f}{ra[key] / lo[key]:10.2f}×")
    print(
        f"ray start = placement group {ra['placement_s']:.3f} s + actors {ra['actors_s']:.2f} s "
        f"+ rank start-up and rendezvous {ra['start_s'] - ra['placement_s'] - ra['actors_s']:.2f} s"
    )
    if stages:
        lo_s, ra_s = stages["local"]["per_stage_s"], stages["ray"]["per_stage_s"]
        print(
            f"{'stage (chain of ' + str(args.stages) + ')':22}{lo_s:10.3f}{ra_s:10.3f}{ra_s / lo_s:10.2f}×"
            "   s per trivial stage through the scheduler (local: cold gangs)"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"ranks": args.ranks, "local": local, "ray": ray_runs, "stages": stages}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
