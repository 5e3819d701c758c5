"""Apps for tests/test_samples.py (imported by the ranks as ``sample_apps:...``)."""

from __future__ import annotations

import time

import numpy as np

HELD_MB = 200  # what rank 1 allocates (and touches) in ``skewed``


def payload(src: int, dst: int) -> np.ndarray:
    """The bytes rank ``src`` sends rank ``dst``: sizes that differ per pair, so a swap shows."""
    return np.full(1000 * (src + 1) + 10 * dst, dst, dtype=np.uint8)


def skewed(env):
    """The ranks exchange ``payload``s; rank 0 sleeps ``sleep`` s before a barrier, which rank
    1 waits in; then rank 1 alone allocates (and touches) HELD_MB and holds it to a last barrier."""
    env.comm.exchange([payload(env.rank, d) for d in range(env.world_size)])
    if env.rank == 0:
        time.sleep(float(env.params["sleep"]))
    env.comm.barrier()
    held = np.ones(HELD_MB << 20, dtype=np.uint8) if env.rank == 1 else None
    env.comm.barrier()
    del held


def collectives(env):
    """Each public collective once (tables excepted): what the accounting should add up to."""
    me, world = env.rank, env.world_size
    sent, received = env.comm.bytes_sent, env.comm.bytes_received  # building the gang counted some
    env.comm.exchange([payload(me, d) for d in range(world)])
    env.comm.allreduce(np.arange(10, dtype=np.float64))
    env.comm.broadcast_bytes(np.zeros(300, dtype=np.uint8) if me == 0 else None, 0)
    env.comm.allgather_bytes(np.zeros(50 + me, dtype=np.uint8))
    env.comm.barrier()
    return env.comm.bytes_sent - sent, env.comm.bytes_received - received


def nothing(env):
    return env.rank


def hog(env):
    """Rank 0 allocates (and touches) HELD_MB, then frees it."""
    held = np.ones(HELD_MB << 20, dtype=np.uint8) if env.rank == 0 else None
    del held


def calm(env):
    """Allocates nothing much."""
    env.comm.barrier()
