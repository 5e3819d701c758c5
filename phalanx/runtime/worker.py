"""The rank process: ``python -m phalanx.runtime.worker``.

Started by an executor (local processes, srun, mpirun, a Ray actor...) with the PHALANX_*
variables of ``protocol``.  It connects to the driver, rendezvouses with its peers, builds the
communicator once, then runs apps sent by the driver until told to shut down: the gang and its
communicator outlive one app (CylonFlow's stateful actors).

A rank never outlives its driver: ``DriverWatch`` reads the control connection in a thread
while the app computes, and ends the rank and everything it started when the connection ends
(the driver exited or was killed) or stays silent past the driver's heartbeat timeout (a
driver hung or cut off) — on every executor, whether or not a parent-death signal reaches the
rank (srun and Ray put processes between the driver and its ranks).

Nor does anything the rank's app starts outlive the app: the rank adopts its orphaned
descendants (a child subreaper, ``runtime.reaper``) and kills what is left of them when each app
ends, before it reports the app's result, and when it leaves.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from ..procs import descendants, die_with_parent
from . import reaper
from . import threads as threads_
from .envvars import ENV_PDEATHSIG, ENV_PRELOAD

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from .env import BSPEnv


def _die_with_parent() -> None:
    if os.environ.get(ENV_PDEATHSIG) == "1" and not die_with_parent(signal.SIGKILL):
        os._exit(1)  # the parent died before the kernel could be told


def main() -> int:
    t0 = time.perf_counter()
    _die_with_parent()
    reaper.become_subreaper()  # what the app starts stays below this process, orphans too
    threads = threads_.apply()  # again: a Ray actor imports phalanx before its rank env

    from . import protocol as P
    from .tasks import failure_from_exception

    rank, world_size = P.rank_from_environ()
    driver_timeout = float(os.environ.get(P.ENV_DRIVER_TIMEOUT) or P.DRIVER_TIMEOUT_S)
    conn = _connect(os.environ[P.ENV_CONTROL], bytes.fromhex(os.environ[P.ENV_AUTHKEY]), driver_timeout)
    P.send(conn, P.Hello(rank, os.getpid(), P.rank_host()))
    watch = DriverWatch(conn, rank, driver_timeout)
    watch.start()

    try:
        env = _build_env(rank, world_size, threads)
    except BaseException as exc:  # report why this rank could not join, then leave
        P.send(conn, P.Failed(None, failure_from_exception(rank, exc)))
        return 1
    P.send(conn, P.Ready(rank, time.perf_counter() - t0))
    try:
        return _serve(conn, watch, env, set(descendants(os.getpid())))
    finally:
        reaper.end_descendants()


def _connect(address: str, authkey: bytes, within_s: float) -> Connection:
    """The authenticated control connection to the driver at ``address`` (host:port).  A
    connection the driver cut short — its handshake slots were all taken (``netio.Handshakes``:
    others connected and said nothing) — is tried again, backing off, for ``within_s``; a wrong
    key is not."""
    from multiprocessing.connection import Client

    host, _, port = address.rpartition(":")
    deadline, pause = time.monotonic() + within_s, 0.05
    while True:
        try:
            return _no_delay(Client((host, int(port)), authkey=authkey))
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, EOFError):
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def _no_delay(conn: Connection) -> Connection:
    """Small messages sent back to back (a periodic resource sample, then a task's result)
    leave at once, not the second after the driver's delayed acknowledgement of the first
    (Nagle's algorithm: ~40 ms)."""
    import socket

    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the same socket; closing the duplicate keeps it
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # not TCP
        pass
    finally:
        sock.close()
    return conn


class DriverWatch(threading.Thread):
    """Reads everything the driver sends: apps and shutdown go to ``inbox`` for the main
    thread; heartbeats only prove the driver lives.  End of the connection, or silence for
    ``timeout_s``, means the driver is gone: the rank and its children end at once, even while
    the app computes, so nothing of theirs (a seal into the store) happens after the driver."""

    def __init__(self, conn: Connection, rank: int, timeout_s: float):
        super().__init__(name="phalanx-driver-watch", daemon=True)
        self.conn, self.rank, self.timeout_s = conn, rank, timeout_s
        self.inbox: queue.Queue[bytes] = queue.Queue()
        self.stopping = threading.Event()  # set by the main thread on Shutdown

    def run(self) -> None:
        from . import protocol as P

        heard = time.monotonic()
        while True:
            try:
                if not self.conn.poll(P.heartbeat_s(self.timeout_s)):
                    if time.monotonic() - heard > self.timeout_s:
                        self.driver_gone(f"no word from the driver for {self.timeout_s:g} s (hung, stopped or cut off)")
                    continue
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                # after Shutdown the driver closes the connection: that is no loss (the
                # main thread may not have taken the message from the inbox yet)
                if self.stopping.wait(1.0 if self.inbox.qsize() else 0.0):
                    return
                self.driver_gone("the driver closed the control connection (it exited or was killed)")
            heard = time.monotonic()
            if data != P.HEARTBEAT:
                self.inbox.put(data)

    def driver_gone(self, why: str) -> None:
        try:
            print(f"phalanx rank {self.rank}: {why}; ending this rank and what it started", file=sys.stderr, flush=True)
        except Exception:  # stderr may be a pipe the dead driver read
            pass
        end_process_tree()
        os._exit(1)


def end_process_tree() -> None:
    """SIGKILL this process's descendants, and its process group when it leads one (a rank
    started with its own session; not under srun or Ray, whose groups hold other processes)."""
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)


def _build_env(rank: int, world_size: int, threads: int) -> BSPEnv:
    from . import protocol as P
    from .comm import communicators
    from .env import BSPEnv

    timeout_s = float(os.environ.get(P.ENV_TIMEOUT, "1800"))
    comm_name = os.environ.get(P.ENV_COMM, "tcp")
    comm = communicators.load(comm_name).from_env(rank, world_size, os.environ.get(P.ENV_RDZV, ""), timeout_s)
    _limit_kernel_threads(threads)
    return BSPEnv(
        rank=rank, world_size=world_size, comm=comm, threads=threads, gang_id=os.environ.get(P.ENV_GANG_ID, "")
    )


def _limit_kernel_threads(threads: int) -> None:
    import pyarrow as pa

    pa.set_cpu_count(threads)
    pa.set_io_thread_count(max(threads, 2))
    # Only if already loaded (gloo): importing torch costs ~2 s a rank, and a later import
    # takes its thread count from OMP_NUM_THREADS, set above.
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)


def _serve(conn: Connection, watch: DriverWatch, env: BSPEnv, own: set[int]) -> int:
    """Run apps until Shutdown; ``own``: processes this rank had before its first app (not the
    app's: they stay)."""
    from . import protocol as P
    from .sampler import Sampler, interval_s
    from .tasks import failure_from_exception, resolve_app

    lock = threading.Lock()  # the sampler's thread sends on the connection too

    def send(msg: P.ToDriver) -> None:
        with lock:
            P.send(conn, msg)

    sampler = Sampler(send, env.rank, env.comm, interval_s(), P.rank_host())
    while True:
        msg: P.ToRank = P.loads(watch.inbox.get())  # the driver's end ends this process (DriverWatch)
        if isinstance(msg, P.Shutdown):
            watch.stopping.set()
            env.comm.close()
            return 0
        env.params = dict(msg.params or {})
        failure: BaseException | None = None
        with sampler.running(msg.task):  # its final sample goes with the result
            try:
                result = resolve_app(msg.app)(env, *msg.args, **msg.kwargs)
            except BaseException as exc:
                failure = exc
            _end_of_app(own)
        try:
            if failure is None:
                send(P.Result(msg.task, result, sampler.final))
        except BaseException as exc:  # a result that cannot be pickled
            failure = exc
        if failure is not None:
            send(P.Failed(msg.task, failure_from_exception(env.rank, failure), sampler.final))


def _end_of_app(own: set[int]) -> None:
    """Before the app's result goes to the driver: its output is in the pipe (the driver's log
    pump has it before the stage ends, so it is in this stage's log), and every process it
    started is gone."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    reaper.end_descendants(keep=own)


def warm_main() -> int:
    """A warm pool worker (``executors.pool``): import what ranks need, then wait on stdin for
    a rank environment (one JSON line) and run as a rank; end of stdin means "not needed"."""
    import importlib
    import json

    _die_with_parent()
    for module in filter(None, os.environ.get(ENV_PRELOAD, "").split(",")):
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
