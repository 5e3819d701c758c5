"""Warm rank processes: a gang on warm workers behaves as one on fresh processes."""

from __future__ import annotations

import os

import pytest

import phalanx as px
from phalanx.errors import RankError
from phalanx.executors.local import LocalLauncher
from phalanx.executors.pool import WarmPool


def pid_and_sum(env):
    import apps  # importable only through the gang's PYTHONPATH (the tests directory)

    total = env.comm.allreduce(env.rank + 1)
    return os.getpid(), total, apps.__name__, os.environ.get("PHALANX_THREADS")


def fail_on_rank_1(env):
    if env.rank == 1:
        raise ValueError("rank 1 says no")
    env.comm.barrier()


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_a_gang_runs_on_warm_workers_and_a_second_gang_on_their_replacements():
    pool = WarmPool(2)
    try:
        first = [p.pid for p in pool._idle]
        with px.Gang(2, executor=LocalLauncher(echo=False, pool=pool)) as gang:
            out = gang.run(pid_and_sum)
        assert [o[0] for o in out] == first  # the warm processes became the ranks
        assert [o[1] for o in out] == [3, 3] and {o[2] for o in out} == {"apps"}
        assert all(o[3] for o in out)  # the rank environment reached the warm process
        replacements = [p.pid for p in pool._idle]
        assert len(replacements) == 2 and not set(replacements) & set(first)
        with px.Gang(2, executor=LocalLauncher(echo=False, pool=pool)) as gang:
            assert [o[0] for o in gang.run(pid_and_sum)] == replacements
    finally:
        pool.close()
    assert pool._idle == []


@pytest.mark.slow  # kept out of the core lane's 5 minutes
def test_failures_on_warm_workers_name_the_rank():
    pool = WarmPool(2, demand=lambda: 2)
    try:
        with px.Gang(2, executor=LocalLauncher(echo=False, pool=pool)) as gang:
            with pytest.raises(RankError, match="rank 1 says no"):
                gang.run(fail_on_rank_1)
    finally:
        pool.close()


def test_the_pool_warms_no_more_than_the_demand():
    left = {"n": 1}
    pool = WarmPool(4, demand=lambda: left["n"])
    try:
        assert len(pool._idle) == 1
        left["n"] = 0
        taken = pool.take(1)
        assert len(taken) == 1
        pool._fill()
        assert pool._idle == []
        taken[0].stdin.close()  # not needed after all: it exits
        assert taken[0].wait(timeout=60) == 0
    finally:
        pool.close()
