#!/usr/bin/env python
"""Caching across runs: a 10-stage workflow run, then the same workflow again, fully cached (every
stage's outputs adopted from the first run: hard links, every partition's checksum verified, no
gang started, no site opened); and what sharing a dataset costs, linked vs copied.

    .venv/bin/python bench/cache.py [--stages 10] [--ranks 2] [--rows 1000000] [--adopt-mb 256]

Prints the two runs' wall times and their ratio, then for one dataset of ``--adopt-mb`` MB in
4 partitions on /dev/shm: hard links alone, a byte copy alone, the checksum of every partition
alone, and ``Store.adopt`` (links + the checksum of what was linked), each the best of 3.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import phalanx as px
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow
from phalanx.store.tiers import Tier, checksum_buffer


def seed(env):
    n = env.params["rows"] // env.world_size
    rng = np.random.default_rng(env.rank)
    env.output("d0", pa.table({"k": rng.integers(0, 1000, n), "v": rng.random(n)}))


def step(env):
    """Each stage: its input with one more derived column (a real pass over the rows)."""
    import pyarrow.compute as pc

    t = env.input("prev").to_arrow()
    out = t.append_column(f"c{env.params['i']}", pc.multiply(t.column("v"), env.params["i"]))
    env.output(f"d{env.params['i']}", out.select(["k", "v", f"c{env.params['i']}"]))


def workflow(stages: int, ranks: int, rows: int) -> Workflow:
    steps = {"s0": Stage(app="cache:seed", ranks=ranks, params={"rows": rows}, outputs=["d0"])}
    for i in range(1, stages):
        steps[f"s{i}"] = Stage(
            app="cache:step", ranks=ranks, params={"i": i}, inputs={"prev": f"d{i - 1}"}, outputs=[f"d{i}"]
        )
    return Workflow(name="cached-chain", cache=True, stages=steps)


def reruns(stages: int, ranks: int, rows: int, root: Path) -> None:
    site = Site(name="bench-cache", cores=max(2, ranks), store={"root": str(root)})
    with tempfile.TemporaryDirectory() as state:
        db = RunDB(state)
        times, results = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            result = run_workflow(workflow(stages, ranks, rows), site, db=db)
            times.append(time.perf_counter() - t0)
            assert result.ok, result.failed
            results.append(result)
        kinds = [e["kind"] for e in db.events(results[1].run_id)]
        assert kinds.count("cached") == stages and "start" not in kinds, kinds
        size = sum(d.nbytes for d in px.Store(root, results[0].session).meta.list(results[0].session))
    print(
        f"{stages} stages x {ranks} ranks, {rows:,} rows ({size / 1e6:.1f} MB sealed): first run {times[0]:.2f}s, "
        f"fully cached rerun {times[1]:.3f}s — {times[0] / times[1]:.1f}x faster"
    )


def best(fn, repeat: int = 3) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def sharing(mb: int, root: Path) -> None:
    src = px.Store(root, "src")
    rows = mb * 2**20 // 8 // 4
    src.put("big", [pa.table({"x": np.random.default_rng(p).random(rows)}) for p in range(4)])
    info = src.info("big")
    n = [0]

    def fresh() -> px.Store:
        n[0] += 1
        return src.for_session(f"dst{n[0]}")

    def link() -> None:
        dst = fresh()
        for i in range(info.num_partitions):
            dst.tier.share_partition(src.tier, info.location, i, f"{root}/{dst.session}/links")

    def copy() -> None:
        dst = fresh()
        for i in range(info.num_partitions):
            Tier.share_partition(dst.tier, src.tier, info.location, i, f"{root}/{dst.session}/copies")

    def verify() -> None:
        for i in range(info.num_partitions):
            checksum_buffer(src.tier.read_buffer(info.location, i))

    def adopt() -> None:
        how = fresh().adopt(src, "big").how
        assert how == "link", how

    times = {what: best(fn) for what, fn in (("link", link), ("copy", copy), ("verify", verify), ("adopt", adopt))}
    print(
        f"{info.nbytes / 1e6:.0f} MB in {info.num_partitions} partitions on {root}: hard links {times['link'] * 1e3:.2f} ms, "
        f"byte copy {times['copy'] * 1e3:.0f} ms ({info.nbytes / 1e9 / times['copy']:.1f} GB/s, and as many more "
        f"bytes of memory), checksums {times['verify'] * 1e3:.0f} ms; Store.adopt (links + checksums + seal) "
        f"{times['adopt'] * 1e3:.0f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--adopt-mb", type=int, default=256)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))  # the ranks import this module as "cache"
    root = Path(tempfile.mkdtemp(prefix="phalanx-bench-cache-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        reruns(args.stages, args.ranks, args.rows, root / "runs")
        sharing(args.adopt_mb, root / "sharing")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
