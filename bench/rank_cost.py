#!/usr/bin/env python
"""What a rank costs before it moves any data, per communicator: start, memory, small collectives.

    .venv/bin/python bench/rank_cost.py                       # tcp, shm, gloo; 2 ranks
    .venv/bin/python bench/rank_cost.py --ranks 4 --comms tcp,gloo,mpi --reps 2000

For each communicator, in one run on the same machine:

- ``start``: ``px.Gang.start()`` to the first app's return (process start, imports, rendezvous,
  communicator wiring), best of ``--starts`` fresh gangs;
- memory of one idle rank after a small shuffle: RSS, and the private anonymous memory
  (``Private_Dirty`` of ``/proc/self/smaps_rollup``: what each further rank on the host adds,
  shared library text excluded); ``torch`` says whether the rank imported it;
- the latency of small collectives (mean of ``--reps`` after a warm-up, the slowest rank):
  ``barrier``, ``allreduce_scalar``, ``allgather_obj`` of a small tuple, ``broadcast_obj`` and
  an ``alltoallv`` of 64 bytes per peer.  A distributed query of many small operators pays
  these on every step (TPC-H at SF 1: tens per query).

The last columns divide the reference (the first of ``--comms``) by each communicator: > 1
means faster or lighter than the reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import phalanx as px


def app_probe(env, reps: int) -> dict:
    import pyarrow as pa

    comm = env.comm
    df = px.DataFrame.from_arrow(pa.table({"k": np.arange(env.rank, 100_000, env.world_size)}), env)
    assert len(df.shuffle("k").to_arrow()) > 0
    out: dict = {}
    small = np.zeros(64 * env.world_size, dtype=np.uint8)
    ops = {
        "barrier": lambda: comm.barrier(),
        "allreduce_scalar": lambda: comm.allreduce_scalar(1.5),
        "allgather_obj": lambda: comm.allgather_obj((env.rank, "x")),
        "broadcast_obj": lambda: comm.broadcast_obj({"plan": 1} if env.rank == 0 else None),
        "alltoallv_64B": lambda: comm.alltoallv(small, [64] * env.world_size),
    }
    for name, fn in ops.items():
        for _ in range(max(reps // 10, 10)):
            fn()
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = (time.perf_counter() - t0) / reps
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) << 10
    with open("/proc/self/smaps_rollup") as f:
        private = next(int(line.split()[1]) for line in f if line.startswith("Private_Dirty")) << 10
    out["rss"], out["private"], out["torch"] = rss, private, "torch" in sys.modules
    return out


def app_nothing(env) -> int:
    return env.rank


def measure(comm: str, ranks: int, reps: int, starts: int) -> dict:
    executor = "mpirun" if comm == "mpi" else None
    best_start = float("inf")
    for _ in range(starts):
        t0 = time.perf_counter()
        with px.Gang(ranks=ranks, communicator=comm, executor=executor, echo=False) as g:
            g.run(app_nothing)
            best_start = min(best_start, time.perf_counter() - t0)
    with px.Gang(ranks=ranks, communicator=comm, executor=executor, echo=False) as g:
        per_rank = g.run(app_probe, reps)
    merged = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k != "torch"}
    merged["torch"] = any(r["torch"] for r in per_rank)
    merged["start"] = best_start
    return merged


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--comms", default="gloo,tcp,shm", help="the first is the reference")
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--starts", type=int, default=3)
    args = ap.parse_args()
    comms = args.comms.split(",")
    load = open("/proc/loadavg").read().split()[:3]
    print(
        f"# rank cost: {args.ranks} ranks, {args.reps} reps per collective, best of {args.starts} starts; "
        f"loadavg {' '.join(load)}; {os.cpu_count()} CPUs"
    )
    results = {c: measure(c, args.ranks, args.reps, args.starts) for c in comms}
    ref = results[comms[0]]
    ops = ["barrier", "allreduce_scalar", "allgather_obj", "broadcast_obj", "alltoallv_64B"]
    head = f"{'communicator':<12} {'start s':>8} {'RSS MiB':>8} {'private MiB':>12} {'torch':>6} " + " ".join(
        f"{o + ' µs':>20}" for o in ops
    )
    print(head)
    for c, r in results.items():
        print(
            f"{c:<12} {r['start']:>8.2f} {r['rss'] / 2**20:>8.0f} {r['private'] / 2**20:>12.0f} "
            f"{str(r['torch']):>6} " + " ".join(f"{r[o] * 1e6:>20.1f}" for o in ops)
        )
    for c in comms[1:]:
        r = results[c]
        print(
            f"{comms[0]} ÷ {c}: start {ref['start'] / r['start']:.1f}×, RSS {ref['rss'] / r['rss']:.1f}×, "
            f"private {ref['private'] / r['private']:.1f}×, " + ", ".join(f"{o} {ref[o] / r[o]:.1f}×" for o in ops)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
