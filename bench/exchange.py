#!/usr/bin/env python
"""Exchange benchmark: alltoallv and table exchange between co-located ranks, against memcpy.

    .venv/bin/python bench/exchange.py                    # 64 and 256 MB per rank, 2 ranks
    .venv/bin/python bench/exchange.py --sizes 64 --reps 5 --ranks 2 --comms gloo-tcp,tcp-noshm,shm

Every rank sends S bytes in all to the other ranks (S / (ranks - 1) to each; nothing to
itself) and receives as much.  Bandwidth is S divided by the time of the collective (the
slowest rank of a repetition; the best repetition of ``--reps`` after one warm-up, whose time
is printed too as "first": it includes creating the shared-memory segments).  Measured per
communicator, in the same rank processes:

- ``memcpy``: ``np.copyto`` of S bytes into a pre-faulted buffer, on every rank at once (the
  ceiling a one-copy exchange can reach); ``memcpy+alloc``: ``a.copy()`` (fresh memory each time);
- ``alltoallv``: ``comm.alltoallv`` (one contiguous receive buffer: the shared-memory path makes
  two copies, into the segment and out of it);
- ``exchange``: ``comm.exchange_contiguous`` (views of what arrived: one copy on shm);
- ``tables``: ``exchange_tables`` of int64 tables of S bytes (IPC written once, read in place).

Communicators: ``gloo-tcp`` (Gloo's TCP pairs: PHALANX_SHM=0), ``tcp-noshm`` (phalanx's own
TCP sockets, without torch: PHALANX_SHM=0; any ``<name>-noshm`` works), ``shm`` (the
shared-memory path; ``tcp`` and ``gloo`` on one host use the same), ``mpi`` where mpirun and mpi4py are installed, ``ucx``
where ucxx is (tcp/lo on this machine: for RDMA clusters, not one host).
Machine load (/proc/loadavg, /proc/pressure/cpu) is printed before and after: on a shared
machine the numbers move with it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time

import numpy as np

import phalanx as px


def app_bench(env, sizes_mb: list[int], reps: int) -> dict:
    import pyarrow as pa

    from phalanx.operators.exchange import exchange_tables

    comm, n, me = env.comm, env.world_size, env.rank
    out: dict = {}

    def timed(fn) -> list[float]:
        times = []
        for _ in range(reps + 1):  # the first one warms up (segments, page faults)
            comm.barrier()
            t0 = time.perf_counter()
            result = fn()
            dt = time.perf_counter() - t0
            del result
            times.append(dt)
        return times

    for mb in sizes_mb:
        total = mb << 20
        each = total // (n - 1)
        counts = [0 if d == me else each for d in range(n)]
        send = np.frombuffer(np.random.default_rng(me).bytes(each * (n - 1)), dtype=np.uint8).copy()
        dst = np.ones(total, dtype=np.uint8)
        src = np.ones(total, dtype=np.uint8)
        rows = each // 8
        parts = [
            pa.table({"v": np.arange(rows, dtype=np.int64) + me})
            if d != me
            else pa.table({"v": np.arange(0, dtype=np.int64)})
            for d in range(n)
        ]
        res = {
            "memcpy": timed(lambda: np.copyto(dst, src)),
            "memcpy+alloc": timed(lambda: src.copy()),
            "alltoallv": timed(lambda: comm.alltoallv(send, counts)),
            "exchange": timed(lambda: comm.exchange_contiguous(send, counts)),
            "tables": timed(lambda: exchange_tables(comm, parts, parts[0].schema)),
        }
        out[mb] = {"bytes": each * (n - 1), "times": res}
        del send, dst, src, parts
    shm = getattr(comm, "shm", None)
    out["engine"] = None if shm is None else dict(shm.stats)
    return out


def load() -> str:
    with open("/proc/loadavg") as f:
        avg = " ".join(f.read().split()[:3])
    try:
        with open("/proc/pressure/cpu") as f:
            some = f.readline().split()[1]
    except OSError:
        some = "n/a"
    return f"loadavg {avg}; cpu pressure {some}"


def run(comm: str, ranks: int, sizes: list[int], reps: int) -> dict:
    env = dict(os.environ)
    name = comm
    if comm == "gloo-tcp" or comm.endswith("-noshm"):  # the communicator's own wire only
        os.environ["PHALANX_SHM"] = "0"
        name = "gloo" if comm == "gloo-tcp" else comm[: -len("-noshm")]
    try:
        executor = "mpirun" if comm == "mpi" else "local"
        with px.Gang(ranks=ranks, communicator=name, executor=executor, echo=False) as g:
            results = g.run(app_bench, sizes, reps)
    finally:
        os.environ.clear()
        os.environ.update(env)
    merged: dict = {"engine": [r["engine"] for r in results]}
    for mb in sizes:
        nbytes = results[0][mb]["bytes"]
        merged[mb] = {}
        for what in results[0][mb]["times"]:
            per_rep = np.max([r[mb]["times"][what] for r in results], axis=0)  # slowest rank
            merged[mb][what] = {
                "first_s": float(per_rep[0]),
                "best_s": float(per_rep[1:].min()),
                "gbs": nbytes / float(per_rep[1:].min()) / 1e9,
                "first_gbs": nbytes / float(per_rep[0]) / 1e9,
            }
    return merged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,256", help="MB each rank sends in all (comma-separated)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    default = "gloo-tcp,tcp-noshm,shm" + (
        ",mpi" if shutil.which("mpirun") and importlib.util.find_spec("mpi4py") else ""
    )
    default += ",ucx" if importlib.util.find_spec("ucxx") else ""
    ap.add_argument("--comms", default=default)
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    comms = args.comms.split(",")
    print(f"# exchange bench: {args.ranks} ranks, {sizes} MB per rank, best of {args.reps} (+1 warm-up)")
    print(f"# before: {load()}")
    all_results = {}
    for comm in comms:
        t0 = time.perf_counter()
        all_results[comm] = run(comm, args.ranks, sizes, args.reps)
        print(f"# {comm}: {time.perf_counter() - t0:.1f} s; engine stats per rank: {all_results[comm]['engine']}")
    print(f"# after: {load()}")
    ref = comms[0]
    for mb in sizes:
        print(
            f"\n## {mb} MB per rank ({args.ranks} ranks); GB/s per rank (first repetition in brackets); "
            f"ratio to memcpy (pre-faulted, measured in the same gang)"
        )
        print(
            f"{'communicator':<12} {'operation':<10} {'GB/s':>7} {'(first)':>9} {'best ms':>9} "
            f"{'÷ memcpy':>9} {'÷ memcpy+alloc':>15}"
        )
        for comm in comms:
            r = all_results[comm][mb]
            mem, alloc = r["memcpy"]["gbs"], r["memcpy+alloc"]["gbs"]
            print(f"{comm:<12} {'memcpy':<10} {mem:>7.2f} {'':>9} {r['memcpy']['best_s'] * 1e3:>9.1f}")
            print(f"{comm:<12} {'memcpy+alloc':<10} {alloc:>7.2f} {'':>9} {r['memcpy+alloc']['best_s'] * 1e3:>9.1f}")
            for what in ("alltoallv", "exchange", "tables"):
                x = r[what]
                print(
                    f"{comm:<12} {what:<10} {x['gbs']:>7.2f} {'(' + format(x['first_gbs'], '.2f') + ')':>9} "
                    f"{x['best_s'] * 1e3:>9.1f} {x['gbs'] / mem:>9.2f} {x['gbs'] / alloc:>15.2f}"
                )
        if len(comms) > 1:
            for comm in comms[1:]:
                ratios = ", ".join(
                    f"{what} {all_results[comm][mb][what]['gbs'] / all_results[ref][mb][what]['gbs']:.1f}×"
                    for what in ("alltoallv", "exchange", "tables")
                )
                print(f"{comm} ÷ {ref}: {ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "reps": args.reps, "results": all_results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
