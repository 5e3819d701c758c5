"""The rank process: ``python -m phalanx.runtime.worker``.

Started by an executor (local processes, srun, mpirun, a Ray actor...) with the PHALANX_*
variables of ``protocol``.  It connects to the driver, rendezvouses with its peers, builds the
communicator once, then runs apps sent by the driver until told to shut down: the gang and its
communicator outlive one app (CylonFlow's stateful actors).
"""

from __future__ import annotations

import os
import socket
import sys
import time


def _pin_and_limit_threads() -> int:
    """Apply CPU affinity and thread limits before numeric libraries start their pools."""
    cpus = os.environ.get("PHALANX_CPUS")
    by_rank = os.environ.get("PHALANX_CPUS_BY_RANK")  # protocol.ENV_CPUS_BY_RANK (mpirun: one env)
    if not cpus and by_rank:
        from .protocol import rank_from_environ

        sets = by_rank.split("|")
        rank = rank_from_environ()[0]
        cpus = sets[rank] if rank < len(sets) else ""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        except OSError:
            pass  # a container may forbid it; affinity is an optimisation only
    threads = int(os.environ.get("PHALANX_THREADS", "0") or 0) or (os.cpu_count() or 1)
    for var in ("POLARS_MAX_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    return threads


def _die_with_parent() -> None:
    if os.environ.get("PHALANX_PDEATHSIG") != "1" or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def main() -> int:
    t0 = time.perf_counter()
    _die_with_parent()
    threads = _pin_and_limit_threads()

    from multiprocessing.connection import Client

    from . import protocol as P
    from .tasks import failure_from_exception

    rank, world_size = P.rank_from_environ()
    host, _, port = os.environ[P.ENV_CONTROL].rpartition(":")
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[P.ENV_AUTHKEY]))
    P.send(conn, "hello", rank, os.getpid(), socket.gethostname())

    try:
        env = _build_env(rank, world_size, threads)
    except BaseException as exc:  # report why this rank could not join, then leave
        P.send(conn, "error", None, failure_from_exception(rank, exc))
        return 1
    P.send(conn, "ready", rank, time.perf_counter() - t0)
    return _serve(conn, env)


def _build_env(rank: int, world_size: int, threads: int):
    from . import protocol as P
    from .comm import communicators
    from .env import BSPEnv
    from .rendezvous import backend_for

    timeout_s = float(os.environ.get(P.ENV_TIMEOUT, "1800"))
    comm_name = os.environ.get(P.ENV_COMM, "gloo")
    comm_cls = communicators.load(comm_name)
    if comm_name == "mpi":
        comm = comm_cls(rank=rank, world_size=world_size)
    else:
        url = os.environ[P.ENV_RDZV]
        store = backend_for(url).connect(url, rank, world_size, timeout_s)
        comm = comm_cls(rank, world_size, store, timeout_s=timeout_s)
    _limit_kernel_threads(threads)
    return BSPEnv(rank=rank, world_size=world_size, comm=comm, threads=threads,
                  gang_id=os.environ.get(P.ENV_GANG_ID, ""))


def _limit_kernel_threads(threads: int) -> None:
    import pyarrow as pa

    pa.set_cpu_count(threads)
    pa.set_io_thread_count(max(threads, 2))
    # Only if already loaded (gloo): importing torch costs ~2 s a rank, and a later import
    # takes its thread count from OMP_NUM_THREADS, set above.
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def _serve(conn, env) -> int:
    from . import protocol as P
    from .tasks import failure_from_exception, resolve_app

    while True:
        try:
            msg = P.recv(conn)
        except (EOFError, OSError):
            return 0  # the driver went away: nothing left to do
        if msg[0] == "shutdown":
            env.comm.close()
            return 0
        _, task, app, args, kwargs, params = msg
        env.params = dict(params or {})
        try:
            result = resolve_app(app)(env, *args, **kwargs)
            P.send(conn, "result", task, result)
        except BaseException as exc:
            P.send(conn, "error", task, failure_from_exception(env.rank, exc))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def warm_main() -> int:
    """A warm pool worker (``executors.pool``): import what ranks need, then wait on stdin for
    a rank environment (one JSON line) and run as a rank; end of stdin means "not needed"."""
    import importlib
    import json

    _die_with_parent()
    for module in filter(None, os.environ.get("PHALANX_PRELOAD", "").split(",")):
        try:
            importlib.import_module(module)
        except ImportError:
            pass  # the rank reports it if it really needs it
    line = sys.stdin.readline()
    if not line:
        return 0
    env = json.loads(line)
    os.environ.update(env)
    # PYTHONPATH is read at interpreter start: apply the gang's (the driver's sys.path) now.
    for path in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if path and path not in sys.path:
            sys.path.insert(0, path)
    return main()


if __name__ == "__main__":
    sys.exit(warm_main() if "--warm" in sys.argv[1:] else main())
