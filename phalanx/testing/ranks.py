"""What the executor contract runs on the ranks: BSP apps, workflow stage apps and command-stage
programs.

Ranks import them by reference (``phalanx.testing.ranks:where``), so this module lives in the
package and imports neither pytest nor the contract.  Whatever a rank learns about where it runs
(its pid, host, SLURM job and step, Ray actor) is a "fact": the contract compares facts with
what the gang reports and later checks that nothing they name is left.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

# environment a rank may have from its resource manager
RM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURMD_NODENAME",
    "OMPI_COMM_WORLD_RANK",
    "PHALANX_GANG_ID",
    "PHALANX_RANK",
)


def facts(rank: int | None = None) -> dict:
    """Where this process runs, as the OS and its resource manager see it."""
    # a rank's host as the driver records it (PHALANX_HOST: node/pod in a container)
    out = {
        "rank": rank,
        "pid": os.getpid(),
        "host": os.environ.get("PHALANX_HOST") or socket.gethostname(),
        "time": time.time(),
        **{k: os.environ.get(k) for k in RM_VARS},
    }
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            ctx = ray.get_runtime_context()
            out.update(
                ray_actor=ctx.get_actor_id(),
                ray_node=ctx.get_node_id(),
                ray_actor_name=getattr(ctx, "get_actor_name", lambda: None)(),
                ray_namespace=ctx.namespace,
            )
        except Exception:  # not inside an actor
            pass
    return out


# ---- BSP apps ---------------------------------------------------------------------------------
def where(env) -> dict:
    return facts(env.rank)


def collectives(env) -> dict:
    """allreduce (sum, max), allgather of uneven bytes (rank 0 sends none), broadcast from the
    last rank, barrier; the driver checks every rank's view against the formulas."""
    r, n = env.rank, env.world_size
    total = env.comm.allreduce(np.array([r + 1, 10 * (r + 1)], dtype=np.int64))
    top = env.comm.allreduce(np.array([(3 * r) % 5], dtype=np.int64), op="max")
    gathered = env.comm.allgather_bytes(np.frombuffer(bytes([65 + r]) * (5 * r), dtype=np.uint8))
    value = env.comm.broadcast_obj({"from": r, "data": list(range(r))} if r == n - 1 else None, root=n - 1)
    env.comm.barrier()
    return {"sum": total.tolist(), "max": top.tolist(), "gathered": [bytes(g) for g in gathered], "bcast": value}


def rank_table(rank: int) -> pa.Table:
    """Rank ``rank``'s table: uneven sizes (rank 1 has no rows), a string column with nulls."""
    rows = (40, 0, 300, 7)[rank % 4]
    rng = np.random.default_rng([11, rank])
    keys = rng.integers(0, 1000, rows)
    names = [None if k % 7 == 0 else f"k{k}" for k in keys.tolist()]
    return pa.table(
        {
            "key": pa.array(keys, pa.int64()),
            "value": pa.array(rng.normal(size=rows)),
            "name": pa.array(names, pa.string()),
            "src": pa.array(np.full(rows, rank), pa.int64()),
        }
    )


def alltoallv_tables(env) -> pa.Table:
    """Rows go to rank ``key % world_size``: each rank sends one Arrow IPC stream per
    destination (none to itself... it keeps its own, and none where it has no rows) through
    the communicator's alltoallv, and returns what it received, concatenated."""
    import pyarrow.ipc as ipc

    n, me = env.world_size, env.rank
    table = rank_table(me)
    dest = table.column("key").to_numpy() % n
    parts = [table.filter(pa.array(dest == d)) for d in range(n)]
    chunks, counts = [], []
    for d, part in enumerate(parts):
        if d == me or part.num_rows == 0:
            counts.append(0)
            continue
        sink = pa.BufferOutputStream()
        with ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(part)
        buf = sink.getvalue()
        chunks.append(np.frombuffer(buf, dtype=np.uint8))
        counts.append(buf.size)
    send = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.uint8)
    recv, recv_counts = env.comm.alltoallv(send, counts)
    got, offset = [parts[me]], 0
    for src, count in enumerate(int(c) for c in recv_counts):
        if count and src != me:
            view = recv[offset : offset + count]
            got.append(ipc.open_stream(pa.BufferReader(pa.py_buffer(view.tobytes()))).read_all())
        offset += count
    return pa.concat_tables(got)


def rank_raises(env, bad: int) -> int:
    """Rank ``bad`` raises; the others wait for it in a barrier (they would wait forever)."""
    if env.rank == bad:
        raise ValueError(f"contract: rank {bad} raises on purpose")
    env.comm.barrier()
    return env.rank


def _write_atomically(path: Path, text: str) -> None:
    """Write then rename: a test polling for the file never reads it half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def mark_then_wait(env, marker_dir: str) -> None:
    """Say "running" with a file, then sleep — in no collective: a dead peer can only be seen
    by the executor and the control plane, not by a communication error."""
    _write_atomically(Path(marker_dir, f"rank-{env.rank}.json"), json.dumps(facts(env.rank)))
    while True:
        time.sleep(0.1)


# ---- workflow stage apps (params: dir, and what each says) ------------------------------------
def stage_where(env) -> None:
    """Record facts as <dir>/<stage>-rank-<r>.json and print a line to the rank's log."""
    print(f"contract stage {env.stage} rank {env.rank} of {env.world_size} says hello", flush=True)
    _write_atomically(Path(env.params["dir"], f"{env.stage}-rank-{env.rank}.json"), json.dumps(facts(env.rank)))
    env.comm.barrier()


def stage_where_then_wait(env) -> None:
    """stage_where, then wait until the file params.go exists (forever if nobody makes it)."""
    stage_where(env)
    go = Path(env.params["go"])
    while not go.exists():
        time.sleep(0.05)
    env.comm.barrier()


# ---- command-stage programs (python -c; params arrive as PHALANX_PARAM_*) ---------------------
COMMAND = r"""
import json, os, socket, sys, time
rank, size = int(os.environ["PHALANX_RANK"]), int(os.environ["PHALANX_WORLD_SIZE"])
d, stage = os.environ["PHALANX_PARAM_DIR"], os.environ["PHALANX_PARAM_STAGE"]
fail = int(os.environ.get("PHALANX_PARAM_FAIL_RANK", "-1"))
print(f"contract stage {stage} rank {rank} of {size} says hello", flush=True)
keys = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURMD_NODENAME", "OMPI_COMM_WORLD_RANK",
        "PHALANX_GANG_ID", "PHALANX_RANK")
facts = {"rank": rank, "pid": os.getpid(), "host": os.environ.get("PHALANX_HOST") or socket.gethostname(),
         "time": time.time(),
         **{k: os.environ.get(k) for k in keys}}
with open(os.path.join(d, f"{stage}-rank-{rank}.json.tmp"), "w") as f:
    json.dump(facts, f)
os.rename(os.path.join(d, f"{stage}-rank-{rank}.json.tmp"), os.path.join(d, f"{stage}-rank-{rank}.json"))
if rank == fail:  # once every other rank runs (fail-fast must have something to stop)
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(d) if n.startswith(f"{stage}-rank-") and n.endswith(".json")]) < size:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    print(f"rank {rank} exits with code 3", flush=True)
    sys.exit(3)
if fail >= 0:
    time.sleep(120)  # a peer fails: fail-fast must stop this rank long before
"""
