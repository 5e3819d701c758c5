"""What the communicator contract runs on the ranks, and the payloads it checks them with.

Payloads are generated deterministically from (source, destination), so every receiving rank
checks what it got byte for byte against what the source generated.  Ranks import this module
by reference: it imports neither pytest nor the contract.
"""

from __future__ import annotations

import os
import time

import numpy as np

BIG = 64 << 20  # one 64 MB message per exchange in the large test
ALLGATHER_KEY, BCAST_KEY = 10_000, 10_001  # payload "destinations" of the non-exchange tests


# ---- deterministic payloads ---------------------------------------------------------------
def payload(src: int, dst: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng([src, dst]).bytes(nbytes), dtype=np.uint8)


def small_size(src: int, dst: int) -> int:
    """Uneven sizes with plenty of zeros (every third pair, and rank 1 sends nothing at all)."""
    if src == 1 or (src + 2 * dst) % 3 == 0:
        return 0
    return 1 + (src * 7919 + dst * 104729) % 5000


def big_size(src: int, dst: int, world_size: int) -> int:
    """Rank 0 sends 64 MB to the last rank; the rest is small or empty."""
    return BIG if (src, dst) == (0, world_size - 1) else small_size(src, dst)


def _check_received(rank: int, views, expected_size) -> list[str]:
    """What differs between the bytes from each source and what that source generated."""
    problems = []
    for src, view in enumerate(views):
        got = np.frombuffer(view, dtype=np.uint8)
        want = payload(src, rank, expected_size(src, rank))
        if got.size != want.size:
            problems.append(f"rank {rank} from {src}: {got.size} bytes, expected {want.size}")
        elif not np.array_equal(got, want):
            first = int(np.flatnonzero(got != want)[0])
            problems.append(f"rank {rank} from {src}: bytes differ from offset {first}")
    return problems


# ---- apps (module level: the ranks import them by reference) ------------------------------
def app_identity(env):
    import polars as pl

    # every thread of the rank (polars' pool is made at import) on the rank's CPUs
    threads_cpus = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
    return (
        env.rank,
        env.world_size,
        env.comm.rank,
        env.comm.world_size,
        env.comm.name,
        sorted(os.sched_getaffinity(0)),
        os.environ.get("OMPI_COMM_WORLD_RANK"),
        (env.threads, pl.thread_pool_size()),
        threads_cpus,
    )


def app_exchange(env, sizes: str):
    n = env.world_size
    if sizes == "small":
        size = small_size
    elif sizes == "empty":

        def size(src, dst):
            return 0
    else:

        def size(src, dst):
            return big_size(src, dst, n)

    out = env.comm.exchange([payload(env.rank, d, size(env.rank, d)) for d in range(n)])
    return _check_received(env.rank, out, size)


def app_alltoallv_large(env):
    n = env.world_size
    counts = [big_size(env.rank, d, n) for d in range(n)]
    send = np.concatenate([payload(env.rank, d, c) for d, c in enumerate(counts)])
    recv, recv_counts = env.comm.alltoallv(send, counts)
    offsets = np.concatenate([[0], np.cumsum(recv_counts)])
    views = [recv[offsets[s] : offsets[s + 1]] for s in range(n)]
    return (
        recv.dtype.str,
        [int(c) for c in recv_counts],
        _check_received(env.rank, views, lambda s, d: big_size(s, d, n)),
    )


def app_exchange_results_kept(env, rounds: int):
    """Results of earlier exchanges stay intact while later ones run (a backend that reuses its
    buffers — the shared-memory segments — must not overwrite what a caller still holds)."""
    n = env.world_size
    kept = []
    for k in range(rounds):

        def size(src, dst, k=k):
            return 0 if src == dst else 1000 + 37 * k + 11 * src + dst

        got = env.comm.exchange([payload(env.rank, d + 100 * k, size(env.rank, d)) for d in range(n)])
        if k % 2 == 0:
            kept.append((k, got))  # held across the next exchanges; the odd rounds' go at once
    problems = []
    for k, got in kept:
        for src, view in enumerate(got):
            want = payload(src, env.rank + 100 * k, 0 if src == env.rank else 1000 + 37 * k + 11 * src + env.rank)
            if src != env.rank and not np.array_equal(np.frombuffer(view, dtype=np.uint8), want):
                problems.append(f"rank {env.rank}: round {k} from {src} changed")
    return problems


def app_alltoallv_slices_kept(env, rounds: int):
    """A slice of an alltoallv result, kept after the result itself was dropped, stays intact
    while later alltoallvs run (a backend may reuse its receive buffers, never one in use)."""
    n, me = env.world_size, env.rank
    kept = []
    for k in range(rounds):
        counts = [5000 + 13 * k + d for d in range(n)]
        send = np.concatenate([payload(me, d + 100 * k, c) for d, c in enumerate(counts)])
        recv, recv_counts = env.comm.alltoallv(send, counts)
        offs = np.concatenate([[0], np.cumsum(recv_counts)])
        src = (me + 1) % n
        kept.append((k, src, recv[offs[src] : offs[src + 1]]))  # only the slice survives
        del recv
    return [
        f"rank {me}: round {k} from {src} changed"
        for k, src, got in kept
        if not np.array_equal(got, payload(src, me + 100 * k, 5000 + 13 * k + me))
    ]


def app_exchange_wrong_length(env):
    try:
        env.comm.exchange([b""] * (env.world_size + 1))
    except ValueError as exc:
        return str(exc)
    return None


def app_allgather_bytes(env, empty: bool):
    mine = b"" if empty else bytes(payload(env.rank, ALLGATHER_KEY, 100 * env.rank))  # rank 0: empty
    got = env.comm.allgather_bytes(np.frombuffer(mine, dtype=np.uint8))
    return [bytes(g) for g in got]


def app_broadcast_bytes(env, root: int, nbytes: int):
    data = payload(root, BCAST_KEY, nbytes) if env.rank == root else None
    return bytes(env.comm.broadcast_bytes(data, root=root))


def rank_array(rank: int, dtype: str, op: str) -> np.ndarray:
    rng = np.random.default_rng([rank, 99])
    if dtype.startswith("float"):
        return rng.standard_normal((50, 20)).astype(dtype)
    info = np.iinfo(dtype)
    bound = 10**12 if dtype == "int64" else 10**8  # sums of 4 ranks fit the dtype
    a = rng.integers(-bound, bound, size=(50, 20), dtype=np.int64).astype(dtype)
    if op != "sum":  # extremes a float round trip (or a wider type) would not survive
        a[0, 0] = info.max - rank
        a[0, 1] = info.min + rank
    return a


def app_allreduce(env, dtype: str, op: str):
    return env.comm.allreduce(rank_array(env.rank, dtype, op), op)


def app_barrier(env):
    time.sleep(0.05 * env.rank)  # the last rank arrives last
    entered = time.time()
    env.comm.barrier()
    return entered, time.time()


def app_objects(env):
    c = env.comm
    gathered = c.allgather_obj({"rank": env.rank, "items": list(range(env.rank))} if env.rank % 2 == 0 else None)
    root = env.world_size - 1
    bcast = c.broadcast_obj({"from": root, "blob": b"x" * 100_000} if env.rank == root else None, root=root)
    return (
        gathered,
        bcast,
        c.allreduce_scalar(env.rank + 1),
        c.allreduce_scalar(0.5 * env.rank, "max"),
        c.allreduce_scalar(-env.rank, "min"),
    )


def app_every_collective_warnings_caught(env):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # deprecations too, and every repeat
        app_exchange(env, "small")
        app_allgather_bytes(env, False)
        app_broadcast_bytes(env, 0, 10)
        app_allreduce(env, "int64", "max")
        app_objects(env)
        env.comm.barrier()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def app_print(env, text: str):
    print(text)


def app_fail_on_rank_1(env):
    if env.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    env.comm.allreduce(np.ones(4))  # rank 0 waits here for a rank that never comes
    return "unreachable"
