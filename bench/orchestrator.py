#!/usr/bin/env python
"""Orchestration overhead per stage: a chain of trivial 2-rank stages, each reading the previous
stage's output from the store and sealing its own (gang start + rendezvous + hand-off + seal +
bookkeeping).

    .venv/bin/python bench/orchestrator.py [--stages 10] [--ranks 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

import phalanx as px
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow


def seed(env):
    env.output("d0", pa.table({"x": [env.rank]}))


def step(env):
    df = env.input("prev")
    env.output(env.outputs[0], df)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    stages = {"s0": Stage(app="orchestrator:seed", ranks=args.ranks, outputs=["d0"])}
    for i in range(1, args.stages):
        stages[f"s{i}"] = Stage(app="orchestrator:step", ranks=args.ranks, inputs={"prev": f"d{i - 1}"},
                                outputs=[f"d{i}"])
    wf = Workflow(name="chain", stages=stages)
    with tempfile.TemporaryDirectory() as state:
        db = RunDB(state)
        t0 = time.perf_counter()
        result = run_workflow(wf, Site(name="local"), db=db)
        total = time.perf_counter() - t0
        assert result.ok, result.failed
        per = [s["ended"] - s["started"] for s in db.stages(result.run_id)]
        px.Store(session=result.session).delete_session()
    print(f"chain of {args.stages} trivial {args.ranks}-rank stages: {total:.2f} s in all, "
          f"{total / args.stages:.2f} s per stage")
    print(f"per stage (gang start → sealed output): median {statistics.median(per):.2f} s, "
          f"min {min(per):.2f} s, max {max(per):.2f} s   (target < 1.5 s)")
    print("cpu pressure:", open("/proc/pressure/cpu").readline().strip())


if __name__ == "__main__":
    main()
