"""Messages between the driver and the rank processes of a gang (over one TCP connection each).

Every message is a tuple whose first item names it; payloads are cloudpickled once.

rank → driver: ("hello", rank, pid, host) · ("ready", rank, seconds) · ("result", task, value)
               ("error", task | None, RankFailure)
driver → rank: ("run", task, app, args, kwargs, params) · ("shutdown",)
               and, every ``heartbeat_s(timeout)``, an empty message (``HEARTBEAT``, never a
               pickle): a rank that hears nothing for ``PHALANX_DRIVER_TIMEOUT`` seconds, or sees
               the connection end, takes its driver for gone and exits (``worker.DriverWatch``)
"""

from __future__ import annotations

import os
import pickle
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

ENV_CONTROL = "PHALANX_CONTROL"  # host:port of the driver's control listener
ENV_AUTHKEY = "PHALANX_AUTHKEY"  # hex; authenticates the control connection
ENV_RANK = "PHALANX_RANK"
ENV_WORLD_SIZE = "PHALANX_WORLD_SIZE"
ENV_RDZV = "PHALANX_RDZV"  # rendezvous URL prepared by the driver
ENV_COMM = "PHALANX_COMM"  # communicator name
ENV_GANG_ID = "PHALANX_GANG_ID"
ENV_CPUS = "PHALANX_CPUS"  # "0,1": CPU affinity for this rank
ENV_CPUS_BY_RANK = "PHALANX_CPUS_BY_RANK"  # "0|1|2,3": per rank, when all ranks share one env
ENV_THREADS = "PHALANX_THREADS"  # threads for this rank's local kernels
ENV_TIMEOUT = "PHALANX_TIMEOUT"  # seconds for rendezvous and collectives
ENV_PDEATHSIG = "PHALANX_PDEATHSIG"  # "1": die with the launching process
ENV_DRIVER_TIMEOUT = "PHALANX_DRIVER_TIMEOUT"  # seconds of silence after which the driver is gone
ENV_HOST = "PHALANX_HOST"  # where the rank runs, as its executor names it (node/pod)

HEARTBEAT = b""  # the driver's "still here"
HEARTBEAT_S = 1.0  # how often the driver sends it, at most
DRIVER_TIMEOUT_S = 60.0  # default silence a rank tolerates (a driver stopped, hung or cut off)


def heartbeat_s(driver_timeout_s: float) -> float:
    """Seconds between heartbeats: a rank's timeout spans at least four."""
    return min(HEARTBEAT_S, driver_timeout_s / 4)


# Where other launchers put the rank, in the order they are checked.
_RANK_VARS = (ENV_RANK, "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
_SIZE_VARS = (ENV_WORLD_SIZE, "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _first(names: tuple[str, ...]) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    raise RuntimeError(f"not started as a phalanx rank: none of {', '.join(names)} is set")


def rank_host() -> str:
    """Where this rank runs, for the driver's records: its executor's name for the place
    (``node/pod`` on Kubernetes, where the hostname and pid are a container's), else the host."""
    import socket

    return os.environ.get(ENV_HOST) or socket.gethostname()


def rank_from_environ() -> tuple[int, int]:
    return _first(_RANK_VARS), _first(_SIZE_VARS)


def send(conn: Connection, *msg: Any) -> None:
    conn.send_bytes(cloudpickle.dumps(msg, protocol=5))


def recv(conn: Connection) -> tuple:
    return loads(conn.recv_bytes())


def loads(data: bytes) -> tuple:
    return pickle.loads(data)
