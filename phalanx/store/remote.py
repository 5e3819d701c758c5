"""Partitions held by other hosts: where this host's store service is, and reading a
partition from the service of the host that holds it (or its written-through copy).

Kept apart from ``service.py`` so that ``import phalanx`` does not load Arrow Flight: a store
whose partitions are all on this host never imports it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from ..errors import PartitionLostError, RemoteStoreError, ServiceUnreachableError, UnsafePathError
from ..private import FILE_MODE, makedirs
from ..procs import boot_id, same_process, start_time
from .tiers import check_mine, checksum_buffer

if TYPE_CHECKING:
    from .metadata import DatasetInfo
    from .tiers import Tier

log = logging.getLogger("phalanx.store")

NO_SERVICE = (
    "no store service served it (the allocation that wrote it started none: a SLURM pilot runs one per "
    "node; elsewhere give the site a store root every host mounts, or store.durability: write-through)"
)
SERVICES_DIR = ".services"  # <root>/.services/<key>.json: the endpoint of this host's service


@dataclass
class ReadCounts:
    """Bytes of partitions a process read: mapped or read on its own host vs fetched."""

    local: int = 0
    fetched: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"local": self.local, "fetched": self.fetched}


@cache
def hostname() -> str:
    return socket.gethostname()


# ---- this host's service ------------------------------------------------------------------------
def endpoint_record(root: str | os.PathLike[str], key: str) -> Path:
    if not key or "/" in key or key.startswith("."):
        raise ValueError(f"bad store service key {key!r}")
    return Path(root) / SERVICES_DIR / f"{key}.json"


def publish_endpoint(root: str | os.PathLike[str], key: str, endpoint: str) -> Path:
    """Record ``endpoint`` as this host's store service for ``key`` (atomically, 0600)."""
    path = endpoint_record(root, key)
    makedirs(path.parent)
    pid = os.getpid()
    record = {"endpoint": endpoint, "host": hostname(), "pid": pid, "start": start_time(pid), "boot": boot_id()}
    tmp = path.with_name(f".{path.name}.{pid}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return path


def local_endpoint(root: str | os.PathLike[str], key: str) -> str | None:
    """The endpoint of the live store service ``key`` of this host (its record in the host's
    own store root), or None: no record, or its process is gone."""
    path = endpoint_record(root, key)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        check_mine(path, os.fstat(fd))
        record = json.loads(os.read(fd, 1 << 16))
        pid, started, boot = int(record["pid"]), record.get("start"), record.get("boot")
        endpoint = str(record["endpoint"])
    except (UnsafePathError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)
    return None if same_process(pid, started, boot) is False else endpoint


# ---- reading another host's partition ---------------------------------------------------------
def fetch_partition(
    where: str, info: DatasetInfo, index: int, tier_for: Callable[[str], Tier]
) -> tuple[pa.Buffer, str]:
    """Partition ``index`` of ``info``, held by another host: its exact bytes from that host's
    store service, else from its written-through copy; ``PartitionLostError`` naming dataset,
    partition and host when neither can be read.  Returns the bytes and their checksum
    (``tiers.checksum_buffer``'s digest: from the service, hashed as they arrived), which the
    caller compares with the metadata's."""
    from .service import fetch_hashed, token_from_env

    part = info.partitions[index]
    why = NO_SERVICE
    if part.endpoint:
        try:
            return fetch_hashed(part.endpoint, token_from_env(), info.location_of(index), index)
        except ServiceUnreachableError as exc:
            why = f"the host or its store service is gone ({exc})"
        except FileNotFoundError as exc:  # the host is back, its memory is not
            why = f"the host no longer has it ({exc})"
        except RemoteStoreError:
            raise
    if part.copy:
        try:
            buf = tier_for(part.copy).read_buffer(part.copy, index)
        except OSError as exc:
            why += f"; its written-through copy at {part.copy} is unreadable too ({exc})"
        else:
            return buf, checksum_buffer(buf)
    raise _lost(where, info, index, why)


def partition_chunks(
    where: str, info: DatasetInfo, index: int, tier_for: Callable[[str], Tier], chunk: int
) -> Iterator[pa.Buffer]:
    """``fetch_partition``, ``chunk`` bytes at a time (a stream).  A service that fails before
    its first chunk gives way to the written-through copy; one that fails midway fails the
    stream (``ServiceUnreachableError``: the caller starts the partition again).  The caller
    checks the checksum."""
    from .service import fetch_chunks, token_from_env

    part = info.partitions[index]
    why = NO_SERVICE
    if part.endpoint:
        stream = fetch_chunks(part.endpoint, token_from_env(), info.location_of(index), index, chunk)
        try:
            first = next(stream, None)
        except ServiceUnreachableError as exc:
            why = f"the host or its store service is gone ({exc})"
        except FileNotFoundError as exc:
            why = f"the host no longer has it ({exc})"
        else:
            if first is not None:
                yield first
            yield from stream
            return
    if part.copy:
        try:
            yield from tier_for(part.copy).read_chunks(part.copy, index, chunk)
            return
        except OSError as exc:
            why += f"; its written-through copy at {part.copy} is unreadable too ({exc})"
    raise _lost(where, info, index, why)


def _lost(where: str, info: DatasetInfo, index: int, why: str) -> PartitionLostError:
    part = info.partitions[index]
    return PartitionLostError(
        f"{where}: dataset {info.name!r} partition {index} is held in the memory of host {part.host or '?'}"
        f" and cannot be read: {why}. The data is lost with that host: `phalanx run --resume RUN` "
        f"recomputes {('stage ' + repr(info.producer)) if info.producer else 'the stage that wrote it'}"
    )


def checksum_there(where: str, info: DatasetInfo, index: int, tier_for: Callable[[str], Tier]) -> str:
    """The checksum of another host's partition, computed by that host's store service (no
    bytes move); ``PartitionLostError`` when the service is gone or lost the partition."""
    from .service import remote_checksum

    part = info.partitions[index]
    why = NO_SERVICE
    if part.endpoint:
        try:
            return remote_checksum(part.endpoint, None, info.location_of(index), index)
        except ServiceUnreachableError as exc:
            why = f"the host or its store service is gone ({exc})"
        except FileNotFoundError as exc:
            why = f"the host no longer has it ({exc})"
        except RemoteStoreError:
            raise
    if part.copy:  # the host is gone, its written-through copy is what a reader gets
        try:
            return checksum_buffer(tier_for(part.copy).read_buffer(part.copy, index))
        except OSError as exc:
            why += f"; its written-through copy at {part.copy} is unreadable too ({exc})"
    raise PartitionLostError(
        f"{where}: dataset {info.name!r} partition {index} is held in the memory of host {part.host or '?'}"
        f" and cannot be checked: {why}"
    )


def remove_there(where: str, location: str, endpoints: set[str]) -> None:
    """Remove ``location`` on the hosts of ``endpoints`` (their store services); a host that
    does not answer keeps it (logged: its memory is freed when its allocation's node is)."""
    from .service import remote_remove

    for endpoint in sorted(endpoints):
        try:
            remote_remove(endpoint, None, location)
        except RemoteStoreError as exc:
            log.warning("%s: %s stays on the host of %s: %s", where, location, endpoint, exc)


def rows_at_holder(
    info: DatasetInfo,
    index: int,
    ask: Callable[[str, str], pa.Table],
    here: Callable[[pa.Table], pa.Table],
    read_whole: Callable[[int], pa.Table],
) -> tuple[pa.Table, bool]:
    """Some rows of partition ``index``, picked by the store service of the host that holds it
    (``ask(endpoint, token)``: it checks the file first, and only those rows move), else picked
    here (``here``) from the whole partition (``read_whole``: no service, or a service gone —
    which then reads a partition of this host, or the written-through copy, or says what is
    lost).  Returns the rows and whether they came from another host."""
    from .service import token_from_env

    p = info.partitions[index]
    if p.endpoint:
        try:
            return ask(p.endpoint, token_from_env()), p.host != hostname()
        except (ServiceUnreachableError, FileNotFoundError):
            pass  # read_whole says what is lost, or reads the copy
        except RemoteStoreError:
            raise
    return here(read_whole(index)), False
