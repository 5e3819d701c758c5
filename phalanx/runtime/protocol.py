"""Messages between the driver and the rank processes of a gang (over one TCP connection each).

Every message is one of the small frozen dataclasses below, cloudpickled once (payloads
included); driver and ranks always run the same phalanx, so they share these classes.  Code sent
by value (an app defined in a script or a notebook cell) keeps its file name and brings its lines
of source (``pickling.dumps``): a rank's traceback names the user's file and line and shows it.

rank → driver: ``Hello`` (first, on connecting) · ``Ready`` · ``Result`` · ``Failed``
               · ``Sample`` (every ``PHALANX_SAMPLE_S`` while a task runs, and the final one
               inside the task's ``Result`` or ``Failed``: ``runtime.sampler``; the driver's
               reader hands samples to a sink, not to the event queue)
driver → rank: ``Run`` · ``Shutdown``
               and, every ``heartbeat_s(timeout)``, an empty message (``HEARTBEAT``, never a
               pickle): a rank that hears nothing for ``PHALANX_DRIVER_TIMEOUT`` seconds, or sees
               the connection end, takes its driver for gone and exits (``worker.DriverWatch``)
driver only:   ``Disconnected``, which the driver's reader of a connection queues when it ends
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

# The rank protocol's variables (defined in envvars; launchers use them as ``P.ENV_*``).
from .envvars import ENV_AUTHKEY as ENV_AUTHKEY
from .envvars import ENV_COMM as ENV_COMM
from .envvars import ENV_CONTROL as ENV_CONTROL
from .envvars import ENV_CPUS as ENV_CPUS
from .envvars import ENV_CPUS_BY_RANK as ENV_CPUS_BY_RANK
from .envvars import ENV_DRIVER_TIMEOUT as ENV_DRIVER_TIMEOUT
from .envvars import ENV_GANG_ID as ENV_GANG_ID
from .envvars import ENV_HOST as ENV_HOST
from .envvars import ENV_PDEATHSIG as ENV_PDEATHSIG
from .envvars import ENV_RANK as ENV_RANK
from .envvars import ENV_RDZV as ENV_RDZV
from .envvars import ENV_SAMPLE as ENV_SAMPLE
from .envvars import ENV_THREADS as ENV_THREADS
from .envvars import ENV_TIMEOUT as ENV_TIMEOUT
from .envvars import ENV_WORLD_SIZE as ENV_WORLD_SIZE
from .pickling import dumps

if TYPE_CHECKING:
    from ..errors import RankFailure

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


# ---- the messages ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """A rank has connected (the first message on its connection)."""

    rank: int
    pid: int
    host: str  # where it runs, as its executor names it (``rank_host``)


@dataclass(frozen=True)
class Ready:
    """A rank has built its communicator and waits for apps."""

    rank: int
    seconds: float  # from the process's start


@dataclass(frozen=True)
class Result:
    """What a rank's app returned for task ``task``; ``sample``: the rank's final resource
    sample of the task (sampling on), in the same message: no extra one per task."""

    task: int
    value: Any
    sample: Sample | None = None


@dataclass(frozen=True)
class Failed:
    """A rank failed: its app raised (``task``), or it could not join the gang (``task`` None)."""

    task: int | None
    failure: RankFailure
    sample: Sample | None = None  # as Result's


@dataclass(frozen=True)
class Sample:
    """A rank's resources while task ``task`` runs (``runtime.sampler``): cumulative since the
    task started, but ``cpu`` (percent of one core over the last interval, children included)
    and the memory (bytes: ``rss`` the rank's own, ``peak_rss`` the high-water mark)."""

    task: int
    rank: int
    ts: float  # time.time() of the reading
    host: str
    cpu: float
    rss: int
    peak_rss: int
    sent: int  # payload bytes the rank's collectives sent to other ranks
    received: int
    comm_s: float  # seconds inside collectives
    elapsed: float  # seconds since the task started (compute: elapsed - comm_s)
    final: bool = False  # the one taken as the task ended (it comes with its Result or Failed)


@dataclass(frozen=True)
class Disconnected:
    """A rank's connection ended (queued by the driver's reader; never sent)."""


@dataclass(frozen=True)
class Run:
    """Run ``app(env, *args, **kwargs)`` as task ``task``, with ``env.params`` = ``params``."""

    task: int
    app: Any
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] | None = None


@dataclass(frozen=True)
class Shutdown:
    """Leave: close the communicator and exit."""


ToDriver = Hello | Ready | Result | Failed | Sample | Disconnected
ToRank = Run | Shutdown


def send(conn: Connection, msg: ToDriver | ToRank) -> None:
    conn.send_bytes(dumps(msg, protocol=5))


def recv(conn: Connection) -> Any:
    return loads(conn.recv_bytes())


def loads(data: bytes) -> Any:
    return pickle.loads(data)
