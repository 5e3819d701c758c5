#!/usr/bin/env python
"""Store benchmark: put bandwidth, get latency and N→M repartition throughput.

    .venv/bin/python bench/store.py            # 10 MB .. 1 GB partitions; N→M with 4M rows
    .venv/bin/python bench/store.py --quick    # up to 256 MB; 1M rows

Put: one partition of S bytes written by ``Store.put`` (Arrow IPC to the store's directory,
xxh3 checksum computed while writing, atomic seal), next to ``np.copyto`` of S bytes into
memory already touched (memcpy) and ``os.write`` of S bytes into a new file of the store's
directory (the kernel's cost of new tmpfs pages: what any put of new data pays at least).
Get: ``Store.info`` + ``Store.partition`` (metadata lookup + memory-map), and how many bytes
Arrow allocated while doing it (0 means zero-copy).  N→M: producer partitions written from the
driver, consumer gang of M ranks calling ``env.store.get`` in each mode; it prints which path
ran and rows/s over the gang.  Last, the ML loader against a plain PyTorch DataLoader over
pandas (bench/ml_loader.py, also runnable on its own).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import phalanx as px
from phalanx.operators import kernels
from phalanx.store.repartition import hash_partitioning


def table_of_bytes(nbytes: int, seed: int = 0) -> pa.Table:
    rows = nbytes // 16
    rng = np.random.default_rng(seed)
    return pa.table({"key": rng.integers(0, rows, rows), "value": rng.random(rows)})


def memcpy_gbs(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)  # pre-faulted
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(3))
    return nbytes / best / 1e9


def new_file_write_gbs(directory: Path, nbytes: int) -> float:
    """``os.write`` of ``nbytes`` into a new file in ``directory`` (min of 3)."""
    src = np.ones(nbytes, dtype=np.uint8)
    path = directory / f".bench-write-{time.time_ns()}"
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            view = memoryview(src)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        times.append(time.perf_counter() - t)
        path.unlink()
    return nbytes / min(times) / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_put_get(store: px.Store, sizes_mb: list[int], reps: int) -> None:
    print("\n## put bandwidth and get latency (one partition; memory tier: %s)" % store.root)
    print(
        f"{'size':>8} {'put s':>8} {'put GB/s':>9} {'memcpy GB/s':>12} {'put/memcpy':>11} "
        f"{'new-file write GB/s':>20} {'put/write':>10} "
        f"{'get ms (min/median)':>20} {'Arrow bytes allocated by get':>29}"
    )
    for mb in sizes_mb:
        table = table_of_bytes(mb << 20)
        nbytes = table.nbytes
        puts = []
        for r in range(reps):  # a session per rep, wiped at once (a replaced version would stay 300 s)
            if r:
                put_store.delete_session()
            put_store = store.for_session(f"{store.session}-put{r}")
            puts.append(_timed(lambda: put_store.put("bench", table)))
        put_s = min(puts)
        gets, allocated = [], 0
        for _ in range(max(reps, 5)):
            before = pa.total_allocated_bytes()
            t = time.perf_counter()
            info = put_store.info("bench")
            got = put_store.partition(info, 0)
            gets.append(time.perf_counter() - t)
            allocated = max(allocated, pa.total_allocated_bytes() - before)
            assert got.num_rows == table.num_rows
            del got
        mc = memcpy_gbs(nbytes)
        wr = new_file_write_gbs(Path(store.root), nbytes)
        put_gbs = nbytes / put_s / 1e9
        print(
            f"{mb:>6}MB {put_s:>8.3f} {put_gbs:>9.2f} {mc:>12.2f} {put_gbs / mc:>10.0%} "
            f"{wr:>20.2f} {put_gbs / wr:>9.0%} "
            f"{min(gets) * 1e3:>9.2f} / {statistics.median(gets) * 1e3:>7.2f} {allocated:>29,}"
        )
        put_store.delete_session()


def app_get(env, session: str, name: str, mode: str, verify: bool = True):
    rs = env.store.for_session(session)
    kwargs = {"balanced": {}, "by": {"by": "key"}, "random": {"shuffle": "random", "seed": 1}}[mode]
    kwargs["verify"] = verify
    rs.get(name, **kwargs)  # warm: page cache, imports
    env.comm.barrier()
    before = pa.total_allocated_bytes()
    t = time.perf_counter()
    df = rs.get(name, **kwargs)
    env.comm.barrier()
    elapsed = time.perf_counter() - t
    return elapsed, df.local_num_rows, rs.last_plan, pa.total_allocated_bytes() - before


def bench_repartition(store: px.Store, rows: int, producers: list[int], consumers: list[int]) -> None:
    print(f"\n## N→M get: {rows:,} rows (key int64, value float64), time = max over consumer ranks")
    print("(s: checksums verified, the default; unverified: verify=False; the ratio is what verifying costs)")
    print(
        f"{'N':>3} {'M':>3} {'mode':>9} {'s':>8} {'Mrows/s':>9} {'unverified s':>13} {'verified/unverified':>20} "
        f"{'allocated/rank':>15}  path"
    )
    for m in consumers:
        with px.Gang(ranks=m, echo=False, store=store.root, session=store.session) as gang:
            for n in producers:
                data = table_of_bytes(rows * 16, seed=n)
                store.put("plain", [data.slice(i * rows // n, rows // n) for i in range(n)], replace=True)
                parts = kernels.hash_partition(data, ["key"], n)
                store.put("hashed", parts, replace=True, partitioning=hash_partitioning(["key"], n))
                for mode, name in (("balanced", "plain"), ("by", "hashed"), ("random", "plain")):
                    res = gang.run(app_get, store.session, name, mode)
                    bare = max(r[0] for r in gang.run(app_get, store.session, name, mode, False))
                    s = max(r[0] for r in res)
                    alloc = max(r[3] for r in res)
                    print(
                        f"{n:>3} {m:>3} {mode:>9} {s:>8.3f} {rows / s / 1e6:>9.1f} {bare:>13.3f} "
                        f"{s / bare:>19.2f}x {alloc:>15,}  {res[0][2]}"
                    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-loader", action="store_true", help="skip the loader benchmark")
    args = ap.parse_args()
    sizes = [10, 100, 256] if args.quick else [10, 100, 256, 1024]
    rows = 1_000_000 if args.quick else 4_000_000
    print(f"# phalanx store benchmark  cpus 2  pyarrow {pa.__version__}")
    print("cpu pressure at start:", open("/proc/pressure/cpu").readline().strip())
    store = px.Store(session=f"bench-{int(time.time())}")
    try:
        bench_put_get(store, sizes, args.reps)
        bench_repartition(store, rows, producers=[1, 2, 4], consumers=[2, 3] if args.quick else [1, 2, 3, 4])
    finally:
        store.delete_session()
    if not args.no_loader:
        sys.path.insert(0, str(Path(__file__).parent))
        from ml_loader import bench_loader

        bench_loader(rows=1_000_000 if args.quick else 4_000_000, epochs=2 if args.quick else 3)
    print("cpu pressure at end:", open("/proc/pressure/cpu").readline().strip())


if __name__ == "__main__":
    main()
