#!/usr/bin/env python
"""Where an operator's time goes inside a rank: timed sections and cProfile, per rank.

    .venv/bin/python bench/profile_ops.py --rows 10000000 --ranks 2 --workloads join,sort
    .venv/bin/python bench/profile_ops.py --rows 10000000 --ranks 2 --cprofile 25

Same data and gang set-up as bench/operators.py (one kernel thread per rank, chunk c of A
from ``default_rng([c, 0])``, of B from ``default_rng([c, 1])``).  Sections: the operator
functions named in SECTIONS are wrapped with a timer on every rank (inclusive times: a
section that calls another counts both); "total" is the operator between two barriers.
Printed per workload: the best repetition's sections on the slowest rank.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from operators import gen_chunk

# (module, attribute): wrapped with a timer where present
SECTIONS = [
    ("phalanx.operators.kernels", "hash_partition"),
    ("phalanx.operators.kernels", "partition_ids"),
    ("phalanx.operators.kernels", "join"),
    ("phalanx.operators.kernels", "sort"),
    ("phalanx.operators.kernels", "run_sql"),
    ("phalanx.operators.shuffle", "shuffle_table"),
    ("phalanx.operators.shuffle", "exchange_tables"),
    ("phalanx.operators.shuffle", "concat"),
    ("phalanx.operators.shuffle", "shuffle_tables"),
    ("phalanx.operators.join", "shuffle_table"),
    ("phalanx.operators.join", "shuffle_tables"),
    ("phalanx.operators.groupby", "shuffle_table"),
    ("phalanx.operators.sort", "exchange_tables"),
    ("phalanx.operators.sort", "allgather_tables"),
    ("phalanx.operators.sort", "_splitters"),
    ("phalanx.operators.sort", "_range_partition"),
    ("phalanx.operators.exchange", "exchange_tables"),
]


def profile_app(env, n, chunks, key_frac, workloads, reps, top):
    import cProfile
    import functools
    import importlib
    import io
    import pstats

    import numpy as np
    import pyarrow as pa

    import phalanx as px

    acc: dict[str, float] = {}
    cpu_acc: dict[str, float] = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **k)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
                cpu_acc[name] = cpu_acc.get(name, 0.0) + time.process_time() - c

        wrapper.__px_timed__ = True
        return wrapper

    for mod, attr in SECTIONS:
        m = importlib.import_module(mod)
        fn = getattr(m, attr, None)
        if fn is not None and not getattr(fn, "__px_timed__", False):
            setattr(m, attr, timed(f"{mod.rsplit('.', 1)[1]}.{attr}", fn))

    r, R = env.rank, env.world_size
    lo, hi = r * chunks // R, (r + 1) * chunks // R
    parts = [gen_chunk(n, chunks, c, key_frac) for c in range(lo, hi)]
    ak, av, bk, bv = (np.concatenate([p[i] for p in parts]) for i in range(4))
    a = px.DataFrame.from_arrow(pa.table({"key": ak, "value": av}), env)
    b = px.DataFrame.from_arrow(pa.table({"key": bk, "value": bv}), env)

    def pipeline(a, b):
        j = a.merge(b, on="key", how="inner")
        g = j.groupby("key").agg({"value_x": "sum", "value_y": "sum"})
        return g.sort_values("key").add_scalar(1)

    ops = {
        "join": lambda a, b: a.merge(b, on="key", how="inner"),
        "groupby": lambda a, b: a.groupby("key").agg({"value": "sum"}),
        "sort": lambda a, b: a.sort_values("key"),
        "pipeline": pipeline,
    }
    out = {"threads": env.threads, "phalanx": px.__file__}
    for w in workloads:  # warm-up
        ops[w](a, b)
    for w in workloads:
        runs = []
        for _ in range(reps):
            acc.clear()
            cpu_acc.clear()
            env.comm.barrier()
            t, c = time.perf_counter(), time.process_time()
            res = ops[w](a, b)
            cpu = time.process_time() - c
            env.comm.barrier()
            total = time.perf_counter() - t
            runs.append({"total": total, "rows": res.local_num_rows, "cpu": cpu, **acc, "cpu_sections": dict(cpu_acc)})
            del res
        prof = None
        if top:
            pr = cProfile.Profile()
            env.comm.barrier()
            pr.enable()
            res = ops[w](a, b)
            env.comm.barrier()
            pr.disable()
            del res
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
            prof = s.getvalue()
        out[w] = {"runs": runs, "cprofile": prof}
    return out


def one_thread_launcher():
    from phalanx.executors.local import LocalLauncher

    class OneThreadPerRank(LocalLauncher):
        def placement(self, world_size):
            out = super().placement(world_size)
            for env in out:
                env["PHALANX_THREADS"] = "1"
                env.pop("PHALANX_CPUS", None)
            return out

    return OneThreadPerRank(echo=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--ranks", default="2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workloads", default="join,groupby,sort,pipeline")
    ap.add_argument("--key-frac", type=float, default=0.21)
    ap.add_argument("--cprofile", type=int, default=0, help="print the top N functions by tottime")
    args = ap.parse_args()
    import phalanx as px

    workloads = args.workloads.split(",")
    ranks = [int(x) for x in args.ranks.split(",")]
    chunks = 1
    for R in ranks:
        chunks = chunks * R // __import__("math").gcd(chunks, R)
    for R in ranks:
        print(
            f"## {R} rank(s), {args.rows} rows; loadavg {Path('/proc/loadavg').read_text().split()[:3]} "
            f"cpu pressure {Path('/proc/pressure/cpu').read_text().splitlines()[0]}",
            flush=True,
        )
        g = px.Gang(ranks=R, echo=False, executor=one_thread_launcher())
        g.start()
        try:
            per_rank = g.run(
                profile_app, args.rows, chunks, args.key_frac, workloads, args.reps, args.cprofile, timeout=3600
            )
        finally:
            g.close()
        print(f"phalanx {per_rank[0]['phalanx']}, {per_rank[0]['threads']} thread(s) per rank", flush=True)
        for w in workloads:
            totals = [max(p[w]["runs"][i]["total"] for p in per_rank) for i in range(args.reps)]
            i = int(np.argmin(totals))
            slow = max(range(R), key=lambda k: per_rank[k][w]["runs"][i]["cpu"])
            run = per_rank[slow][w]["runs"][i]
            secs = "  ".join(
                f"{k} {v:.3f}"
                for k, v in sorted(
                    ((k, v) for k, v in run.items() if k not in ("total", "rows", "cpu", "cpu_sections")),
                    key=lambda kv: -kv[1],
                )
            )
            cpus = "  ".join(f"{k} {v:.3f}" for k, v in sorted(run["cpu_sections"].items(), key=lambda kv: -kv[1]))
            print(
                f"{w:9} total {run['total']:.3f}s cpu {run['cpu']:.3f}s (reps {' '.join(f'{t:.3f}' for t in totals)}; "
                f"rank {slow}, {run['rows']} rows)\n    wall: {secs}\n    cpu:  {cpus}",
                flush=True,
            )
            if per_rank[0][w]["cprofile"]:
                print(per_rank[0][w]["cprofile"], flush=True)
        print(
            f"   after: loadavg {Path('/proc/loadavg').read_text().split()[:3]} cpu pressure "
            f"{Path('/proc/pressure/cpu').read_text().splitlines()[0]}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
