"""Exceptions a user of phalanx can catch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .redact import redact


class PhalanxError(Exception):
    """Base class of every phalanx error.  Its message never carries a credential: a URL's
    password or a secret-named value in it is replaced by ``***`` (``phalanx.redact``)."""

    def __init__(self, *args: object, **kwargs: Any) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args), **kwargs)


class MissingDependencyError(PhalanxError, ImportError):
    """An optional backend was asked for but its package is not installed."""


class GangError(PhalanxError):
    """The gang could not be started, or is no longer usable."""


class StageTimeoutError(GangError):
    """The gang's ranks did not finish within the stage's ``timeout``."""


class UnsafePathError(PhalanxError, PermissionError):
    """A directory phalanx would keep its data in could be changed by another user."""


@dataclass
class RankFailure:
    """What one rank reported when it failed (or how it died)."""

    rank: int
    exc_type: str
    message: str
    traceback: str = ""
    exitcode: int | None = None
    after_peer: bool = False  # it went away only after a peer had failed (mpirun ending every rank)
    # why its process ended in the resource manager's words: oom, node_lost, preempted, timeout
    # ("" where it does not say: Launcher.end_cause)
    cause: str = ""

    def __post_init__(self) -> None:  # a rank's message travels to the terminal and the run DB
        self.message, self.traceback = redact(self.message), redact(self.traceback)

    def summary(self) -> str:
        if self.exc_type:
            return f"rank {self.rank}: {self.exc_type}: {self.message}"
        return f"rank {self.rank}: {self.message}"

    @property
    def collateral(self) -> bool:
        """This rank failed only because a peer went away (Gloo and MPI raise that as the
        surviving rank's own error): not the cause worth showing first."""
        return self.after_peer or (bool(self.exc_type) and any(s in self.message for s in _PEER_LOST))


# How communication libraries word "the other side is gone".
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "connection closed",
    "MPI_ERR_PROC_FAILED",
    "Connection reset by remote peer",  # UCX (ucxx's UCXXConnectionResetError)
    "lost its connection to rank",
)  # phalanx's tcp communicator


class RankError(PhalanxError):
    """One or more ranks of a gang failed; the other ranks were stopped.

    ``failures`` holds every rank that reported an error (sorted by rank);
    ``str(err)`` shows the first failing rank's traceback.
    """

    def __init__(self, failures: list[RankFailure], stopped: list[int] | None = None):
        self.failures = sorted(failures, key=lambda f: f.rank)
        self.stopped = stopped or []
        # the cause first: a rank that raised or died, before those that only lost a peer
        first = min(self.failures, key=lambda f: (f.collateral, f.rank))
        self.first = first
        ranks = ", ".join(str(f.rank) for f in self.failures)
        head = f"{len(self.failures)} rank(s) failed (ranks {ranks}); first: {first.summary()}"
        if self.stopped:
            head += f"\nstopped ranks {', '.join(map(str, self.stopped))} (fail-fast)"
        body = f"\n--- traceback of rank {first.rank} ---\n{first.traceback}" if first.traceback else ""
        super().__init__(head + body)

    @property
    def ranks(self) -> list[int]:
        return [f.rank for f in self.failures]


class StoreError(PhalanxError):
    """A store operation failed; the message names the dataset (and partition)."""


class DatasetNotFoundError(StoreError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DatasetExistsError(StoreError):
    pass


class ChecksumError(StoreError):
    pass


class RemoteStoreError(StoreError):
    """A fetch from a store service failed; the message names the endpoint, location and index."""


class ServiceUnreachableError(RemoteStoreError, ConnectionError):
    """The service did not answer (host down, service gone, network cut, timeout)."""


class RemotePartitionNotFoundError(RemoteStoreError, FileNotFoundError):
    """The service answered, but has no such partition."""


class AuthRefusedError(RemoteStoreError, PermissionError):
    """The service refused the token."""


class LocationRefusedError(RemoteStoreError, PermissionError):
    """The service refused to open the location (outside its roots, a link, someone else's)."""


class PartitionLostError(StoreError):
    """A partition held in the memory of another host cannot be read: that host, or its store
    service, is gone and no written-through copy exists.  The message names the dataset,
    partition and host; a resume recomputes the stage that wrote it."""
