"""A 2-stage pipeline across hosts: consumer ranks on the hosts holding their input vs not.

The multi-host test bed (docs/multihost.md: px-h1..px-h3 with their own /dev/shm) and its
SLURM cluster, one pilot over the three hosts (one rank per host).  A producer gang writes a
user-shaped dataset (the ETL example's transactions plus a string key; one partition per
host, each in its own host's memory).  Then consumer gangs read it, in one run, interleaved:

  balanced, on the data's hosts   rank r on the host of partition r (what the scheduler asks
                                  for: store.repartition.rank_hosts) — every byte mapped
  balanced, rotated               rank r on the host of partition r+1 — every byte fetched
  by key, pulled                  get(by="user_key"): each rank pulls its rows from each holder,
                                  which splits its partition once (each row moves once)
  by key, fetch + shuffle         the same rows the way the store did before it sliced at the
                                  source: whole partitions fetched, then a hash shuffle
  sum(amount), rotated, eager     a stage that uses one column of the eight: get() reads every
                                  column (every byte fetched), then sums
  sum(amount), rotated, lazy      the same with get(lazy=True), what env.input does: only the
                                  column the plan uses is fetched

    .venv/bin/python bench/store_locality.py                 # brings the bed and SLURM up
    .venv/bin/python bench/store_locality.py --mb 64 --reps 5

Prints per case the slowest rank's get time (median, best) and the bytes read on the ranks'
own hosts vs fetched; ratios against "balanced, on the data's hosts".  Needs root (the bed).
Results: docs/store.md, "Across hosts".
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
HOSTS = ["px-h1", "px-h2", "px-h3"]
SLURM_DIR = "/var/tmp/phalanx-slurm-multihost"


def produce(env, name: str, nbytes: int):
    import socket

    from store_remote import user_table  # bench/store_remote.py: the same user-shaped rows

    table = user_table(nbytes, seed=env.rank)
    env.store.put(name, table, replace=True)
    return socket.gethostname()


def consume(env, name: str, how: str):
    import socket

    from phalanx.operators.shuffle import shuffle_table
    from phalanx.store import repartition as R

    store = env.store
    env.comm.barrier()
    before = (store.reads.local, store.reads.fetched)
    t0 = time.perf_counter()
    if how == "fetch+shuffle":  # the single-host path: whole partitions, then a shuffle
        info = store.info(name)
        whole = lambda i, sel: R.select_rows(store.partition(info, i, verify=True), sel)  # noqa: E731
        local = R.balanced_rows(info, whole, env.rank, env.world_size)
        rows = shuffle_table(env.comm, local, ["user_key"]).num_rows
    elif how in ("sum-eager", "sum-lazy"):  # one column of the eight used
        frame = store.get(name, lazy=how == "sum-lazy")
        rows = frame.agg(total=("amount", "sum")).collect(root=0)
        rows = 0 if rows is None else rows.num_rows
    else:
        rows = store.get(name, by="user_key" if how == "pull" else None).to_arrow().num_rows
    took = time.perf_counter() - t0
    return {
        "host": socket.gethostname(),
        "s": took,
        "rows": rows,
        "here": store.reads.local - before[0],
        "fetched": store.reads.fetched - before[1],
        "plan": store.last_plan,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=64, help="MB per partition (one per host)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: the multi-host test bed")
    from infra import multihost

    multihost.up(3)
    up = subprocess.run([str(REPO / "tests/infra/slurm-multihost-up.sh")], capture_output=True, text=True)
    if up.returncode:
        sys.exit(f"slurm-multihost-up.sh failed:\n{up.stderr}")

    import phalanx as px
    from phalanx.executors.slurm import SlurmExecutor
    from phalanx.store.service import write_token_file

    shared = Path(tempfile.mkdtemp(prefix="phalanx-bench-locality-", dir="/var/tmp"))
    os.chmod(shared, 0o755)
    root = f"/dev/shm/phalanx-bench-locality-{shared.name}/store"
    os.environ["PHALANX_LOG_DIR"] = str(shared / "logs")
    os.environ["PHALANX_STORE_TOKEN_FILE"] = str(write_token_file(shared / "token", secrets.token_hex(32)))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "bench"), os.environ.get("PYTHONPATH", "")])
    section = {
        "allocation": "pilot",
        "conf": f"{SLURM_DIR}/slurm.conf",
        "srun_via": [str(REPO / "tests/infra/multihost-exec"), "px-head"],
        "ranks_per_node": 1,
        "poll_interval": 0.25,
        "pilot": {"nodes": 3, "ntasks": 3, "time": "00:30:00"},
    }
    ex = SlurmExecutor(section, site="bench-multihost")
    ex.open_run()
    store = px.Store(root, metadata=f"sqlite://{shared}/meta.sqlite")
    gang_kw = dict(
        control_host=multihost.load_state()["bridge_addr"],
        rendezvous=f"file://{shared}/rdzv",
        store=store,
        echo=False,
    )
    load0 = os.getloadavg()[0]
    results: dict[str, list[dict]] = {}
    try:

        def gang(hosts: list[str] | None) -> px.Gang:
            launcher = ex.launcher(3)
            if hosts is not None:
                assert launcher.prefer_hosts(hosts), "the pilot could not place the ranks"
            return px.Gang(3, executor=launcher, **gang_kw)

        with gang(None) as g:  # its first gang starts the pilot, with a store service per node
            where = g.run(produce, "tx", args.mb * 1_000_000)
        assert sorted(where) == HOSTS, where
        HOSTS[:] = where  # partition r is on the host of producer rank r
        cases = [
            ("balanced, on the data's hosts", HOSTS, "balanced"),
            ("balanced, rotated", HOSTS[1:] + HOSTS[:1], "balanced"),
            ("by key, pulled", HOSTS, "pull"),
            ("by key, fetch + shuffle", HOSTS, "fetch+shuffle"),
            ("sum(amount), rotated, eager", HOSTS[1:] + HOSTS[:1], "sum-eager"),
            ("sum(amount), rotated, lazy", HOSTS[1:] + HOSTS[:1], "sum-lazy"),
        ]
        # one gang at a time (the pilot holds one rank slot per host), the cases interleaved;
        # each gang reads twice and the second read is timed (the first pays imports, connections)
        for _ in range(args.reps):
            for label, hosts, how in cases:
                with gang(hosts) as g:
                    g.run(consume, "tx", how)
                    out = g.run(consume, "tx", how)
                assert [o["host"] for o in out] == hosts, out
                results.setdefault(label, []).append(
                    {
                        "s": max(o["s"] for o in out),
                        "here": sum(o["here"] for o in out),
                        "fetched": sum(o["fetched"] for o in out),
                        "plan": out[0]["plan"],
                    }
                )
    finally:
        ex.close_run()
        for h in HOSTS:
            multihost.run_on(h, ["rm", "-rf", os.path.dirname(root)], timeout=30)
        shutil.rmtree(os.path.dirname(root), ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)
    load1 = os.getloadavg()[0]
    base = statistics.median(r["s"] for r in results[cases[0][0]])
    print(f"3 hosts x {args.mb} MB partitions, {args.reps} reps; load average {load0:.1f} -> {load1:.1f}")
    print(f"{'case':32} {'median s':>9} {'best s':>8} {'vs local':>9} {'MB here':>9} {'MB fetched':>11}  plan")
    for label, _, _ in cases:
        rs = results[label]
        med = statistics.median(r["s"] for r in rs)
        print(
            f"{label:32} {med:9.3f} {min(r['s'] for r in rs):8.3f} {med / base:8.2f}x "
            f"{rs[0]['here'] / 1e6:9.1f} {rs[0]['fetched'] / 1e6:11.1f}  {rs[0]['plan']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
