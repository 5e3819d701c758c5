"""A sealed dataset crossing from one store to another (a site's store to another site's).

``cross(src, name, dst)`` makes, in ``dst`` (its session), the dataset ``name`` whose partition
files are byte for byte those of ``src``'s: same checksums, rows, schema and partitioning.  The
raw partition bytes are copied, never re-encoded, one partition at a time and each streamed
(``tiers.CHUNK``, 64 MiB, in memory at once however large the partition: read from the source's
mapping, object stream or holder's service, written as a file or a multipart upload), and sealed
with ``dst``'s ordinary seal (readers find all of it or nothing).  The new dataset records where
it came from (``DatasetInfo.origin``: the source store, session, name and version).

- **Verified** twice per partition: the bytes streamed from the source (mapped, downloaded, or
  fetched from the store service of the host that holds them: ``Store.partition_chunks``) against
  the source metadata's checksum as they pass, then what the destination tier holds, read back
  from it a chunk at a time, with the same checksum.  Reading back rather than hashing the bytes handed to the tier is what
  catches a tier that stores something else than it was given (an S3-compatible server that
  keeps the upload framing: docs/store.md) or a short write; on a file tier the read back is a
  memory map of the page cache, cheap.  A mismatch raises ``ChecksumError`` naming the dataset,
  the partition and both stores; nothing is sealed.
- **Once**: a destination that already holds ``name`` crossed from the same source version
  returns at once (``Crossing.already``), nothing moved — after checking that copy's
  partitions where they live (``Store.check``: a missing partition always, the checksum once
  per attempt of ``dst`` — a run's driver and its gangs — so a second reader or a retry stays
  O(1)).  A copy that fails the check is crossed again and replaces it (``Crossing.replaced``
  says why); on an object store under another name than the damaged one, which the seal then
  retires.
- **Resumable**: partitions are staged in a place of ``dst`` named after the source version
  (``cross-<key>``: on a file tier ``<root>/<session>/.staging/cross-<key>``, renamed to a fresh
  staging id just before the seal; on an object store written in place under
  ``<prefix>/<session>/<name>/cross-<key>``).  A crossing that was interrupted (killed, a lost
  connection, a bad partition) leaves what arrived there; the next crossing of the same source
  version keeps every staged partition whose size and checksum match and sends only the rest.
  ``phalanx store sessions`` lists such a staging area as an unsealed write and
  ``phalanx store rm --staging`` removes it.

Two crossings of one source version into one file-tier store at once are serialized (a lock
file ``<root>/<session>/.crossing/<key>.lock``, left in place: empty); on an object store
they are not coordinated (the scheduler crosses a dataset once per run).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..errors import ChecksumError, DatasetExistsError, StoreError
from ..private import FILE_MODE, makedirs
from ..redact import redact
from .metadata import DatasetInfo, PartitionInfo
from .store import Store
from .tiers import FileTier, Tier, part_file

__all__ = ["Crossing", "CrossingProgress", "SourceDamagedError", "cross", "describe", "origin_of"]


class SourceDamagedError(ChecksumError):
    """A source partition of a crossing fails its checksum: sending again from the same copy
    would fail the same way (a copy in transit is checked, and sent anew when damaged)."""


@dataclass
class CrossingProgress:
    """Where a crossing is, after partition ``index`` (sent, or found staged already)."""

    name: str
    index: int
    partitions: int
    moved: bool  # sent now (False: it had arrived in an earlier, interrupted crossing)
    bytes_done: int  # of the partitions handled so far, sent or found
    bytes_total: int
    bytes_moved: int
    seconds: float


@dataclass
class Crossing:
    """What ``cross`` did.  ``source``/``dest`` name the stores without credentials."""

    name: str
    source: str
    dest: str
    source_version: str
    version: str  # the dataset's version in the destination
    partitions: int
    bytes: int  # the dataset's size
    partitions_moved: int
    partitions_skipped: int  # found staged and verified (a resumed crossing), not sent again
    bytes_moved: int
    seconds: float
    already: bool  # the destination held it, crossed from the same source version: nothing done
    info: DatasetInfo = field(repr=False)
    replaced: str = ""  # why a dataset ``name`` the destination held was replaced ("" when none was)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_moved / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Plain values, for a run record or JSON."""
        return {
            "name": self.name,
            "source": self.source,
            "dest": self.dest,
            "source_version": self.source_version,
            "version": self.version,
            "partitions": self.partitions,
            "bytes": self.bytes,
            "partitions_moved": self.partitions_moved,
            "partitions_skipped": self.partitions_skipped,
            "bytes_moved": self.bytes_moved,
            "seconds": round(self.seconds, 3),
            "already": self.already,
            **({"replaced": self.replaced} if self.replaced else {}),
        }


def describe(store: Store) -> str:
    """``<root URL> session '<s>'``, credentials masked."""
    return f"{redact(store.tier.root_url)} session {store.session!r}"


def origin_of(src: Store, info: DatasetInfo) -> dict[str, str]:
    """What a crossed dataset records about its source: store (URL, masked), session, name,
    version; plus the root's identity on a file tier."""
    origin = {"store": redact(src.tier.root_url), "session": info.session, "name": info.name, "version": info.version}
    if isinstance(src.tier, FileTier):
        origin["root_id"] = src.tier.root_id()
    return origin


def _same_source(a: dict[str, str], b: dict[str, str]) -> bool:
    keys = ("session", "name", "version")
    if any(a.get(k) != b.get(k) for k in keys):
        return False
    if a.get("root_id") and b.get("root_id"):  # one directory reached by two paths is one store
        return a["root_id"] == b["root_id"]
    return a.get("store") == b.get("store")


def _key(origin: dict[str, str]) -> str:
    ident = {k: origin.get(k, "") for k in ("store", "root_id", "session", "name", "version")}
    if ident["root_id"]:
        ident["store"] = ""
    return xxhash.xxh3_64_hexdigest(json.dumps(ident, sort_keys=True).encode())


def cross(
    src: Store,
    name: str,
    dst: Store,
    *,
    run: str = "",
    replace: bool = False,
    verify: bool = True,
    on_progress: Callable[[CrossingProgress], None] | None = None,
) -> Crossing:
    """Copy the sealed dataset ``name`` of ``src`` into ``dst`` (its session), byte for byte,
    verified, resumable, once (module docstring).  ``run``: recorded as the new dataset's run
    (default the source's).  ``replace``: a dataset ``name`` in ``dst`` that did not cross from
    this source version is replaced (else ``DatasetExistsError``).  ``verify``: check a copy
    that crossed before (``Store.check``, once per attempt of ``dst``) and cross it again when
    it is damaged or incomplete; False trusts its metadata (a copy in transit, checked when it
    is read on: ``Store.partition_bytes``).  A source partition that fails its checksum raises
    ``SourceDamagedError``."""
    t0 = time.perf_counter()
    info = src.info(name)
    origin = origin_of(src, info)
    source, dest = describe(src), describe(dst)
    key = _key(origin)

    def result(sealed: DatasetInfo, moved: int, nbytes: int, already: bool, replaced: str = "") -> Crossing:
        return Crossing(
            name,
            source,
            dest,
            info.version,
            sealed.version,
            info.num_partitions,
            info.nbytes,
            moved,
            0 if already else info.num_partitions - moved,
            nbytes,
            time.perf_counter() - t0,
            already,
            sealed,
            replaced,
        )

    with _lock(dst, key):
        existing = dst.meta.get(dst.session, name)
        replaced = ""
        if existing is not None and _same_source(existing.origin, origin):
            damage = _damage(dst, existing) if verify else None
            if damage is None:
                return result(existing, 0, 0, already=True)
            replaced = f"its copy there (version {existing.version}) failed its check: {damage}"
        elif existing is not None:
            if not replace:
                raise DatasetExistsError(
                    f"{dest}: dataset {name!r} exists and did not cross from {source} version {info.version} "
                    f"(its origin: {existing.origin or 'put there'}); pass replace=True to replace it"
                )
            came = f"crossed from version {existing.origin.get('version')}" if existing.origin else "put there"
            replaced = f"it replaces version {existing.version} ({came})"
        tag = f"cross-{key}"
        tier = dst.tier
        if tier.atomic_rename:
            location = tier.scratch(dst.session, tag)
        else:
            if existing is not None and existing.version == tag:  # written in place: never over the copy it replaces
                tag = f"cross-{key}-again"
            location = tier.staging(dst.session, name, tag)
        place = dst.placement()
        parts: list[PartitionInfo] = []
        moved = nbytes = done = 0
        for i, p in enumerate(info.partitions):
            where = f"crossing dataset {name!r} partition {i} from {source} to {dest}"
            sent = not _arrived(tier, location, i, p)
            if sent:
                try:  # streamed: one chunk of the partition in memory, checked as it passes
                    tier.write_chunks(location, i, src.partition_chunks(info, i))
                except ChecksumError as exc:  # raised by the source's stream, after its last chunk
                    raise SourceDamagedError(f"{where}: the source's bytes are damaged: {exc}") from None
                except StoreError:  # the source unreadable: a holder's service gone, a partition lost
                    raise
                except OSError as exc:  # a full disk, an object store that failed the upload
                    raise StoreError(f"{where}: writing {location}/{part_file(i)} failed: {exc}") from exc
                there = _hash_there(tier, location, i)
                actual = there[1] if there is not None else "nothing"
                if actual != p.checksum:
                    raise ChecksumError(
                        f"{where}: the destination holds other bytes than were written "
                        f"({location}/{part_file(i)}: checksum {actual}, the source's metadata says {p.checksum})"
                    )
                moved += 1
                nbytes += p.bytes
            done += p.bytes
            parts.append(PartitionInfo(i, p.rows, p.bytes, p.checksum, **place))
            if on_progress is not None:
                on_progress(
                    CrossingProgress(
                        name, i, info.num_partitions, sent, done, info.nbytes, nbytes, time.perf_counter() - t0
                    )
                )
        if tier.atomic_rename:  # a fresh version: the staging area's name is reused by a resume
            staging_id = dst.new_staging_id(tag)
            tier.commit(location, tier.staging(dst.session, name, staging_id))
        else:
            staging_id = tag
        try:
            sealed = dst.seal(
                name,
                staging_id,
                parts,
                info.schema,
                info.partitioning,
                info.producer,
                run or info.run,
                existing is not None,  # what it replaces was decided above
                origin=origin,
            )
        except DatasetExistsError:
            # sealed meanwhile by another process (an object store is not locked): the same?
            again = dst.meta.get(dst.session, name)
            if again is None or not _same_source(again.origin, origin):
                raise
            return result(again, moved, nbytes, already=False)
        for i in range(sealed.num_partitions):  # each read back (or found staged) and checked just now
            dst._remember_verified(sealed, i, sealed.location)
        return result(sealed, moved, nbytes, already=False, replaced=replaced)


def _damage(dst: Store, info: DatasetInfo) -> str | None:
    """Why ``dst``'s copy ``info`` cannot be trusted (a partition missing, unreadable or failing
    its checksum, checked where it lives), or None.  ``Store.check`` hashes each partition once
    per attempt of ``dst``: a second crossing in the same run finds it checked."""
    try:
        for i in range(info.num_partitions):
            dst.check(info, i)
    except (StoreError, OSError) as exc:
        return str(exc)
    return None


def _hash_there(tier: Tier, location: str, index: int) -> tuple[int, str] | None:
    """(bytes, checksum) of partition ``index`` at ``location``, read back a chunk at a time;
    None when it is not there."""
    hasher, size = xxhash.xxh3_64(), 0
    try:
        for chunk in tier.read_chunks(location, index):
            hasher.update(memoryview(chunk))
            size += chunk.size
    except FileNotFoundError:
        return None
    return size, hasher.hexdigest()


def _arrived(tier: Tier, location: str, index: int, part: PartitionInfo) -> bool:
    """Whether partition ``index`` is staged at ``location`` already, whole and verified."""
    return _hash_there(tier, location, index) == (part.bytes, part.checksum)


@contextmanager
def _lock(dst: Store, key: str) -> Iterator[None]:
    """One crossing of a source version into a file-tier store at a time (an exclusive
    ``flock``); nothing on an object store."""
    root = dst.tier.local_root
    if root is None:
        yield
        return
    path = makedirs(root / dst.session / ".crossing") / f"{key}.lock"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
