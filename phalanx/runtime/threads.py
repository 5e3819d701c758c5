"""A rank's CPU affinity and thread limits, applied before any numeric library loads.

Polars sizes its thread pool when it is imported (setting POLARS_MAX_THREADS later changes
nothing), and a pool's threads keep the affinity they were created with.  ``import phalanx``
imports polars, so a rank must be pinned and limited before that import: ``phalanx/__init__``
calls :func:`apply` first thing, and the worker calls it again (idempotent) for its count.
Measured before this ran first: every rank of a "1 thread per rank" gang sorted with 2 polars
threads — a 1-rank gang used both cores, and 2 ranks oversubscribed theirs.
Stdlib only: it runs before the package's other imports.
"""

from __future__ import annotations

import os

from .envvars import ENV_CPUS, ENV_CPUS_BY_RANK, ENV_THREADS

# thread-pool sizes read at import by polars, OpenMP (torch, numpy's BLAS), MKL, OpenBLAS
POOL_VARS = ("POLARS_MAX_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def is_rank() -> bool:
    """Was this process started as a rank (an executor set its thread share)?"""
    return any(v in os.environ for v in (ENV_THREADS, ENV_CPUS, ENV_CPUS_BY_RANK))


def apply() -> int:
    """Pin this process to its CPUs (``PHALANX_CPUS``, or its rank's set in
    ``PHALANX_CPUS_BY_RANK``) and size every pool to ``PHALANX_THREADS``; the thread count.
    The rank's share overrides pool sizes inherited from the driver's environment."""
    cpus = os.environ.get(ENV_CPUS)
    by_rank = os.environ.get(ENV_CPUS_BY_RANK)  # mpirun: one environment for every rank
    if not cpus and by_rank:
        from .protocol import rank_from_environ

        sets = by_rank.split("|")
        rank = rank_from_environ()[0]
        cpus = sets[rank] if rank < len(sets) else ""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        except (OSError, ValueError):
            pass  # a container may forbid it; affinity is an optimisation only
    given = int(os.environ.get(ENV_THREADS, "0") or 0)
    threads = given or (os.cpu_count() or 1)
    for var in POOL_VARS:
        if given:
            os.environ[var] = str(threads)
        else:
            os.environ.setdefault(var, str(threads))
    return threads
