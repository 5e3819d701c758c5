"""``px.Store``: the intermediate store seen from outside a gang (and the base of env.store).

Datasets are immutable once sealed, written as one partition file per producer rank, and
named within a *session* so two workflows never see each other's names.

A store is a payload tier (a directory — shared memory by default — or an ``s3://`` object
store), a metadata backend (SQLite or Redis) and, optionally, a memory budget with a disk
tier that least-recently-used datasets spill to.  ``rank_env()`` is how a gang hands the same
configuration to its ranks (``PHALANX_STORE*`` variables, read back by ``Store()``).
"""

from __future__ import annotations

import builtins
import copy
import errno
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace as _replace
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import xxhash

from ..errors import (
    ChecksumError,
    DatasetExistsError,
    DatasetNotFoundError,
    PartitionLostError,
    StoreError,
    UnsafePathError,
)
from ..paths import ENV_SPILL, ENV_STORE, default_spill_root, default_store_root
from ..private import FILE_MODE, makedirs
from ..runtime.envvars import (
    ENV_STORE_ATTEMPT,
    ENV_STORE_BUDGET,
    ENV_STORE_DURABLE,
    ENV_STORE_METADATA,
    ENV_STORE_SERVICE_KEY,
    ENV_STORE_SESSION,
    ENV_STORE_TOKEN_FILE,
)
from . import remote
from . import repartition as R
from .metadata import DatasetInfo, MetadataBackend, PartitionInfo, open_metadata
from .tiers import CHUNK, FileTier, Staged, Tier, check_mine, checksum_buffer, open_tier, part_file

log = logging.getLogger("phalanx.store")

DEFAULT_SESSION = "default"

# What a gang's ranks read back (Store.env): ENV_STORE_* (runtime.envvars); the two paths, ENV_STORE (PHALANX_STORE: a directory
# or s3://bucket/prefix?endpoint_override=…) and ENV_SPILL (PHALANX_STORE_SPILL: the disk
# directory datasets over the budget spill to), are defined with their defaults in phalanx.paths.


def parse_bytes(text: str | int | None) -> int | None:
    """``"4GiB"``, ``"512MB"``, ``"1e9"``, ``1000`` → bytes; ``None`` or ``""`` → None."""
    if text is None or text == "":
        return None
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(text))
    if not m:
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 4GiB, 512MB, 1000000)")
    number, unit, binary = m.groups()
    base = 1024 if binary or not unit else 1000
    return int(float(number) * base ** " KMGT".index(unit.upper() or " "))


def default_metadata_url(tier: Tier) -> str:
    """SQLite beside the payload of a file tier; for an object tier, a local SQLite file named
    after the bucket and prefix (one host only: name a Redis URL for more)."""
    if tier.local_root is not None:
        return f"sqlite://{tier.local_root / 'meta.sqlite'}"
    local = default_spill_root().parent / "metadata" / tier.kind
    safe = re.sub(r"[^A-Za-z0-9._/-]", "_", tier.url.split("://", 1)[1])
    return f"sqlite://{local / safe / 'meta.sqlite'}"


def _check_session(session: str) -> str:
    if not session or "/" in session or session.startswith(".") or "\0" in session:
        raise ValueError(f"bad session name {session!r}")
    return session


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or "\0" in name:
        raise ValueError(f"bad dataset name {name!r}: a non-empty string without '/' that does not start with '.'")
    return name


def _read_retired(entry: Path) -> str:
    """The location a file under ``.retired`` names, if this user wrote it: a regular file
    owned by this user, opened without following a link (``UnsafePathError`` otherwise)."""
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{entry} is a symbolic link (to {os.readlink(entry)})") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{entry} is not a regular file")
        check_mine(entry, st)
        return os.read(fd, 1 << 16).decode()
    finally:
        os.close(fd)


class Unsealed(NamedTuple):
    """A put's partitions that no seal published: a put in progress, or what the gang of a
    killed driver left behind."""

    session: str
    name: str | None  # None on a file tier (its staging area does not record it)
    staging_id: str
    location: str
    bytes: int
    idle_s: float  # seconds since it was last written


class Adopted(NamedTuple):
    """What ``Store.adopt`` sealed, and how its bytes came: "link", "server-side copy", "copy"
    (joined by "+" when partitions came differently)."""

    info: DatasetInfo
    how: str


class Store:
    """A store rooted at a directory (``/dev/shm/phalanx-$USER/store`` by default) or an object
    store (``s3://bucket/prefix?endpoint_override=http://host:port``).

    ``metadata``: a backend or URL (``sqlite:///path``, ``redis://host:port/db``); default
    ``PHALANX_STORE_METADATA``, else SQLite beside the payload.  ``memory_budget``: bytes the
    root (a file tier) may hold before least-recently-used datasets move to ``spill`` (a disk
    directory); default ``PHALANX_STORE_BUDGET`` / ``PHALANX_STORE_SPILL``.
    """

    def __init__(
        self,
        root: str | Path | None = None,
        session: str = DEFAULT_SESSION,
        metadata: MetadataBackend | str | None = None,
        *,
        memory_budget: int | str | None = None,
        spill: str | Path | None = None,
        attempt: str | None = None,
        durable: str | Path | None = None,
    ):
        """``durable``: write-through — every partition is also copied there as it is written
        (a directory every host mounts, or ``s3://...``), so it outlives the host that holds it
        in memory; default ``PHALANX_STORE_DURABLE``.  ``attempt``: who trusts what this store wrote or verified (docs/reliability.md,
        "when checksums are checked"): the run attempt of a driver and its gangs; default
        ``PHALANX_STORE_ATTEMPT``, else one of its own."""
        self.session = _check_session(session)
        self.attempt = attempt or os.environ.get(ENV_STORE_ATTEMPT) or uuid.uuid4().hex[:16]
        self.service_key = os.environ.get(ENV_STORE_SERVICE_KEY, "")  # this host's store service
        self.reads = remote.ReadCounts()  # bytes this process read here vs fetched from other hosts
        self._verified: set[tuple[str, int]] = set()  # (version, partition) checked by this process
        text = os.fspath(root) if root else (os.environ.get(ENV_STORE) or str(default_store_root()))
        self.tier: Tier = open_tier(text)
        local_root = self.tier.local_root
        self.root: Path | str = local_root if local_root is not None else self.tier.root_url
        budget = parse_bytes(memory_budget if memory_budget is not None else os.environ.get(ENV_STORE_BUDGET))
        if budget is not None and budget < 0:
            raise ValueError(f"memory_budget must be ≥ 0 bytes, got {budget}")
        if budget is not None and local_root is None:
            raise ValueError(f"a memory budget needs a directory root (shared memory), not {text!r}")
        self.memory_budget = budget
        if metadata is None:
            metadata = os.environ.get(ENV_STORE_METADATA) or default_metadata_url(self.tier)
        self.meta: MetadataBackend = open_metadata(metadata)
        durable_root = os.fspath(durable) if durable else os.environ.get(ENV_STORE_DURABLE) or None
        self.durable_tier: Tier | None = open_tier(durable_root) if durable_root else None
        spill_root = spill or os.environ.get(ENV_SPILL) or None
        self.spill_tier: FileTier | None = None
        if budget is not None or spill_root:
            self.spill_tier = FileTier(spill_root or default_spill_root())
            if self.spill_tier.root == local_root:
                raise ValueError(f"the spill directory must differ from the store root ({text})")

    def new_attempt(self, attempt: str | None = None) -> None:
        """Trust nothing this store wrote or checked so far: the next read of each partition
        checks its checksum again (a resume's driver is a new attempt)."""
        self.attempt = attempt or uuid.uuid4().hex[:16]
        self._verified = set()

    def for_session(self, session: str) -> Store:
        """The same store (tiers, metadata, budget), another session."""
        other = copy.copy(self)
        other.session = _check_session(session)
        return other

    @classmethod
    def from_env(cls) -> Store:
        """The store ``rank_env()`` describes: how a rank opens its gang's store."""
        return cls(session=os.environ.get(ENV_STORE_SESSION) or DEFAULT_SESSION)

    def rank_env(self) -> dict[str, str]:
        """The environment that makes ``Store()`` in another process (a rank) open this store."""
        return {
            ENV_STORE: str(self.root),
            ENV_STORE_SESSION: self.session,
            ENV_STORE_METADATA: self._rank_metadata_url(),
            ENV_STORE_BUDGET: "" if self.memory_budget is None else str(self.memory_budget),
            ENV_SPILL: self.spill_tier.url if self.spill_tier else "",
            ENV_STORE_ATTEMPT: self.attempt,
            ENV_STORE_DURABLE: self.durable_tier.root_url if self.durable_tier else "",
            # where the store services' token is (the path, never the secret): for ranks that
            # do not inherit the driver's environment (Ray actors, pods)
            **(
                {ENV_STORE_TOKEN_FILE: os.environ[ENV_STORE_TOKEN_FILE]} if os.environ.get(ENV_STORE_TOKEN_FILE) else {}
            ),
        }

    def _rank_metadata_url(self) -> str:
        # Redis names the catalogue's identity too, so ranks refuse a Redis that lost it.
        pinned = getattr(self.meta, "pinned_url", None)
        return pinned() if pinned is not None else self.meta.url

    def __repr__(self) -> str:
        budget = f" budget={self.memory_budget}" if self.memory_budget is not None else ""
        return f"<phalanx.Store {self.root} session={self.session!r} metadata={self.meta!r}{budget}>"

    def _where(self) -> str:
        return f"store {self.root} session {self.session!r}"

    # ---- inspection ---------------------------------------------------------------------
    def list(self) -> list[str]:
        return [d.name for d in self.meta.list(self.session)]

    def exists(self, name: str) -> bool:
        return self.meta.get(self.session, name) is not None

    def info(self, name: str) -> DatasetInfo:
        """The dataset's metadata (no side effects: ``use`` is the reading variant)."""
        info = self.meta.get(self.session, name)
        if info is None:
            known = ", ".join(self.list()) or "none"
            raise DatasetNotFoundError(f"{self._where()}: no dataset {name!r} (datasets: {known})")
        return info

    def sessions(self) -> builtins.list[str]:
        return self.meta.sessions()

    def spilled(self, name: str) -> bool:
        """Whether the dataset lives on the spill (disk) tier rather than the store root (for a
        dataset spread over hosts: whether this host spilled any of its partitions)."""
        return bool(self._spilled_here(self.info(name)))

    def memory_usage(self) -> int:
        """Bytes of sealed partitions (every session) in this host's memory tier, the store
        root: what the budget limits."""
        return sum(d.partitions[i].bytes for d in self.meta.all() for i in self._in_memory(d))

    # ---- reading --------------------------------------------------------------------------
    def use(self, name: str) -> DatasetInfo:
        """``info`` for a reader: records the access (LRU order) and, under a memory budget,
        brings a spilled dataset back into memory first (of a dataset spread over hosts: the
        partitions this host spilled)."""
        info = self.info(name)
        now = time.time()
        self.meta.touch(self.session, name, now)
        info.accessed = now
        back = self._spilled_here(info) if self.memory_budget is not None else []
        if back and self._fits(info):
            try:
                moved = self._move(info, self.tier) if back is True else self._move_parts(info, back, self.tier)
            except Exception as exc:  # e.g. shared memory full: the spilled copy still reads
                log.warning("%s: could not bring %r back into memory: %s", self._where(), name, exc)
                moved = None
            if moved is not None:
                info = moved
                self._enforce_budget()
        return info

    def partition(self, info: DatasetInfo, index: int, verify: bool = False, *, count: bool = True) -> pa.Table:
        """One partition: memory-mapped (zero-copy) from a file tier of this host, downloaded
        from an object store, fetched from the store service of the host that holds it.

        ``verify``: check its checksum where trust is crossed — unless this attempt wrote or
        checked it already here (then the read stays O(1)); a fetched partition is always
        checked.  See ``needs_verify``.  ``count``: add it to ``reads`` (not for a check alone)."""
        part = info.partitions[index]
        if not self.is_here(part):
            try:
                return self._fetched(info, index, count)
            except PartitionLostError:
                fresh = self._moved_since(info, index)  # spilled or brought back on its host meanwhile?
                if fresh is None:
                    raise
                return self.partition(fresh, index, verify, count=count)
        tier, buf, location, where = self._read_here(info, index)
        if verify and self.needs_verify(info, index, location):
            self._check(buf, part, where)
            self._remember_verified(info, index, location)
        table = self._open(tier, buf, part, where)
        if count:
            self.reads.local += part.bytes
        return table

    def _read_here(self, info: DatasetInfo, index: int) -> tuple[Tier, pa.Buffer, str, str]:
        """Partition ``index``'s bytes from a tier this process reads itself (following a move
        to another tier since ``info`` was read): (tier, bytes, location, where)."""
        location = info.location_of(index)
        where = _part_where(info, index, location)
        try:
            tier = self._tier_for(location)
            try:
                buf = tier.read_buffer(location, index)
            except FileNotFoundError:
                # Moved to another tier since ``info`` was read (spill/reload)? Follow it.
                fresh = self._moved_since(info, index)
                if fresh is None:
                    raise StoreError(f"{where} is missing") from None
                location = fresh.location_of(index)
                where = _part_where(fresh, index, location)
                tier = self._tier_for(location)
                buf = tier.read_buffer(location, index)
        except FileNotFoundError:
            raise StoreError(f"{where} is missing") from None
        except OSError as exc:
            raise StoreError(f"{where} is unreadable: {exc}") from None
        return tier, buf, location, where

    def _moved_since(self, info: DatasetInfo, index: int) -> DatasetInfo | None:
        """The dataset as the metadata has it now, if partition ``index`` moved (spill, reload)
        since ``info`` was read; else None."""
        fresh = self.meta.get(info.session, info.name)
        if fresh is None or fresh.version != info.version or fresh.location_of(index) == info.location_of(index):
            return None
        return fresh

    def partition_bytes(self, info: DatasetInfo, index: int) -> pa.Buffer:
        """Partition ``index``'s exact file bytes, always checked against the metadata's
        checksum (``ChecksumError`` naming it): mapped or downloaded here as ``partition`` reads
        them, or fetched from the store service of the host that holds it (or its
        written-through copy).  Counted in neither ``reads`` nor the verified set: what a copy
        of the dataset to another store (``store.crossing``) reads.  A fetched partition's bytes
        are hashed as they arrive (``service.fetch_hashed``), not in a second pass."""
        part = info.partitions[index]
        if self.is_here(part):
            _, buf, _, where = self._read_here(info, index)
            self._check(buf, part, f"{self._where()}: {where}")
            return buf
        buf, actual = remote.fetch_partition(self._where(), info, index, self._tier_for)
        if actual != part.checksum:
            raise ChecksumError(
                f"{self._where()}: dataset {info.name!r} partition {index} (fetched from {part.host or part.endpoint}): "
                f"checksum mismatch (stored {part.checksum}, file has {actual}); the file was changed or corrupted"
            )
        return buf

    def partition_chunks(self, info: DatasetInfo, index: int, size: int = CHUNK) -> Iterator[pa.Buffer]:
        """``partition_bytes``, ``size`` bytes at a time (a stream: a crossing holds one chunk of a
        partition, however large), checked against the metadata's checksum as they pass: a
        ``ChecksumError`` naming the partition after the last chunk, so a consumer that reached
        the end without one has the exact bytes."""
        part = info.partitions[index]
        if self.is_here(part):
            location = info.location_of(index)
            where = f"dataset {info.name!r} partition {index} ({location}/{part_file(index)})"
            chunks = self._tier_for(location).read_chunks(location, index, size)
        else:
            where = f"dataset {info.name!r} partition {index} (fetched from {part.host or part.endpoint})"
            chunks = remote.partition_chunks(self._where(), info, index, self._tier_for, size)
        hasher = xxhash.xxh3_64()
        try:
            for chunk in chunks:
                hasher.update(memoryview(chunk))
                yield chunk
        except StoreError:  # a holder's service gone midway, the partition lost with its host
            raise
        except FileNotFoundError:
            raise StoreError(f"{self._where()}: {where} is missing") from None
        except OSError as exc:
            raise StoreError(f"{self._where()}: {where} is unreadable: {exc}") from None
        if hasher.hexdigest() != part.checksum:
            raise ChecksumError(
                f"{self._where()}: {where}: checksum mismatch (stored {part.checksum}, the bytes have "
                f"{hasher.hexdigest()}); the file was changed or corrupted"
            )

    def check(self, info: DatasetInfo, index: int) -> None:
        """Raise unless partition ``index`` is there and passes its checksum: read here, or
        hashed by the store service of the host that holds it (no bytes move)."""
        part = info.partitions[index]
        if self.is_here(part):
            self.partition(info, index, verify=True, count=False)
            return
        try:
            actual = remote.checksum_there(self._where(), info, index, self._tier_for)
        except PartitionLostError:
            fresh = self._moved_since(info, index)  # spilled or brought back on its host meanwhile?
            if fresh is None:
                raise
            return self.check(fresh, index)
        if actual != part.checksum:
            raise ChecksumError(
                f"{self._where()}: dataset {info.name!r} partition {index} on host {part.host}: checksum mismatch "
                f"(stored {part.checksum}, the file there has {actual}); the file was changed or corrupted"
            )

    def _check(self, buf: pa.Buffer, part: PartitionInfo, where: str) -> None:
        actual = checksum_buffer(buf)
        if actual != part.checksum:
            raise ChecksumError(
                f"{where}: checksum mismatch (stored {part.checksum}, file has {actual}); the file was changed or corrupted"
            )

    @staticmethod
    def _open(tier: Tier, buf: pa.Buffer, part: PartitionInfo, where: str) -> pa.Table:
        try:
            table = tier.open_partition(buf)
        except (pa.ArrowException, OSError) as exc:  # e.g. a damaged schema: ArrowNotImplementedError
            raise StoreError(f"{where} is unreadable: {exc}") from None
        if table.num_rows != part.rows:
            raise StoreError(f"{where} has {table.num_rows} rows, the metadata says {part.rows}")
        return table

    # ---- where partitions live (the store across hosts) ----------------------------------------
    def placement(self) -> dict[str, str]:
        """What a partition written by this process records about where it lives: this host,
        its store root's identity and its store service (empty on an object store)."""
        if not isinstance(self.tier, FileTier):
            return {}
        endpoint = remote.local_endpoint(self.tier.root, self.service_key) if self.service_key else None
        return {"host": remote.hostname(), "root_id": self.tier.root_id(), "endpoint": endpoint or ""}

    def is_here(self, part: PartitionInfo) -> bool:
        """Whether this process reads ``part``'s files itself (same root: this host, or a file
        system the writer's host shares) rather than through its host's store service."""
        return not part.root_id or (isinstance(self.tier, FileTier) and part.root_id == self.tier.root_id())

    def needs_verify(self, info: DatasetInfo, index: int, location: str | None = None) -> bool:
        """Whether a read of partition ``index`` here must check its checksum: not when this
        attempt (a run attempt: the driver and its gangs) wrote it or checked it on this host,
        nor when this process checked it already; else yes — a resume of an earlier attempt,
        data read from disk (spill) or an object store, a partition from another host."""
        location = location or info.location_of(index)
        if not self.tier.owns(location):  # spill, a durable copy, another store: every read
            return True
        if (_place(location), index) in self._verified:
            return False
        marker = self._marker(info, index, location)
        return not (marker is not None and marker.exists())

    def _marker(self, info: DatasetInfo, index: int, location: str) -> Path | None:
        """This host's record that this attempt wrote or checked a partition where it is now
        (file tier only)."""
        root = self.tier.local_root
        if root is None or not self.is_here(info.partitions[index]):
            return None
        return root / info.session / ".verified" / self.attempt / f"{_place(location)}.{index}"

    def _remember_verified(self, info: DatasetInfo, index: int, location: str) -> None:
        if not self.tier.owns(location):
            return  # not kept: bytes off the memory tier are checked on every read
        self._verified.add((_place(location), index))
        self._mark(info.session, location, index, info.partitions[index])

    def _trust_sealed(self, version: str, index: int, part: PartitionInfo) -> None:
        """Trust partition ``index`` of ``version`` where its seal puts it (``tier.final``'s
        last component: ``v<version>``)."""
        place = self.tier.final(self.session, "_", version)
        self._verified.add((_place(place), index))
        self._mark(self.session, place, index, part)

    def _mark(self, session: str, location: str, index: int, part: PartitionInfo) -> None:
        root = self.tier.local_root
        if root is None or not self.is_here(part):
            return
        path = root / session / ".verified" / self.attempt / f"{_place(location)}.{index}"
        try:
            makedirs(path.parent)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE))
        except OSError as exc:  # only costs a second check later
            log.debug("%s: cannot record %s: %s", self._where(), path, exc)

    def spans_hosts(self, info: DatasetInfo, root_ids: Sequence[str] = ()) -> bool:
        """Whether ``info``'s partitions live on several hosts, or on hosts that are not those of
        ``root_ids`` (a gang's ranks): a by-key read then pulls each reader's rows from each
        holder (``rows_by_key``) instead of fetching whole partitions and shuffling."""
        roots = {p.root_id for p in info.partitions if p.root_id}
        if len(roots) > 1:
            return True
        here = set(root_ids) if root_ids else {self.tier.root_id()} if isinstance(self.tier, FileTier) else set()
        return bool(roots - here)

    def rows_by_key(
        self, info: DatasetInfo, index: int, keys: Sequence[str], nparts: int, part: int, columns: Sequence[str] | None
    ) -> pa.Table:
        """The rows of partition ``index`` whose ``keys`` hash to ``part`` of ``nparts`` (as a
        shuffle would send them), split by the service of the host that holds it — once for
        all ``nparts`` readers, checked there: only those rows move — else here."""
        from ..operators.kernels import hash_partition
        from .service import fetch_hash_part

        def ask(endpoint: str, token: str) -> pa.Table:
            p = info.partitions[index]
            location = info.location_of(index)
            return fetch_hash_part(endpoint, token, location, index, p.checksum, keys, nparts, part, columns)

        def here(whole: pa.Table) -> pa.Table:
            return hash_partition(whole.select(list(columns)) if columns is not None else whole, keys, nparts)[part]

        return self._rows_at_holder(info, index, ask, here)

    def rows(
        self, info: DatasetInfo, index: int, select: dict[str, Any], columns: Sequence[str] | None, verify: bool
    ) -> pa.Table:
        """The rows of partition ``index`` that ``repartition.select_rows(select)`` picks: a
        zero-copy slice (or a take) of the mapped partition here; from another host, only
        those rows, picked by its service after it checked the file."""
        if self.is_here(info.partitions[index]):
            table = self.partition(info, index, verify=verify)
            return R.select_rows(table.select(list(columns)) if columns is not None else table, select)
        from .service import fetch_rows

        def ask(endpoint: str, token: str) -> pa.Table:
            p = info.partitions[index]
            return fetch_rows(endpoint, token, info.location_of(index), index, p.checksum, select, columns)

        def here(whole: pa.Table) -> pa.Table:
            return R.select_rows(whole.select(list(columns)) if columns is not None else whole, select)

        return self._rows_at_holder(info, index, ask, here)

    def _rows_at_holder(
        self,
        info: DatasetInfo,
        index: int,
        ask: Callable[[str, str], pa.Table],
        here: Callable[[pa.Table], pa.Table],
    ) -> pa.Table:
        rows, fetched = remote.rows_at_holder(info, index, ask, here, lambda i: self.partition(info, i, verify=True))
        if fetched:
            self.reads.fetched += rows.nbytes
        elif info.partitions[index].endpoint and not self.is_here(info.partitions[index]):
            pass  # read whole by partition(): counted there
        elif info.partitions[index].endpoint:  # picked by this host's own service: read here
            self.reads.local += rows.nbytes
        return rows

    def _fetched(self, info: DatasetInfo, index: int, count: bool = True) -> pa.Table:
        """A partition held by another host: its exact bytes from that host's store service
        (or from its written-through copy when the host is gone), always checked."""
        part = info.partitions[index]
        where = f"dataset {info.name!r} partition {index}"
        buf = self.partition_bytes(info, index)
        if count:
            self.reads.fetched += part.bytes
        return self._open(self.tier, buf, part, where)

    def read(self, name: str, columns: Sequence[str] | None = None, verify: bool = True) -> pa.Table:
        """The whole dataset as one table (partitions in order), checksums verified."""
        info = self.use(name)
        tables = [self.partition(info, i, verify) for i in range(info.num_partitions)]
        table = pa.concat_tables(tables) if tables else info.schema.empty_table()
        return table.select(list(columns)) if columns is not None else table

    def _tier_for(self, location: str) -> Tier:
        for tier in (self.tier, self.spill_tier, self.durable_tier):
            if tier is not None and tier.owns(location):
                return tier
        if "://" in location:
            raise StoreError(
                f"{self._where()}: payload at {location} is on another store; open a Store with that root to read it"
            )
        return FileTier(Path(location).parent)  # any directory: a file tier reads absolute paths

    # ---- writing --------------------------------------------------------------------------
    def put(
        self,
        name: str,
        partitions: pa.Table | Sequence[pa.Table],
        replace: bool = False,
        producer: str = "",
        run: str = "",
        partitioning: dict[str, Any] | None = None,
    ) -> DatasetInfo:
        """Write from one process: each table becomes one partition (a gang uses env.store)."""
        _check_name(name)
        tables = [partitions] if isinstance(partitions, pa.Table) else list(partitions)
        if not tables:
            raise ValueError(f"put {name!r}: no partitions given")
        schema = tables[0].schema
        for i, t in enumerate(tables):
            if not t.schema.equals(schema):
                raise StoreError(f"put {name!r}: partition {i} has schema {t.schema}, partition 0 has {schema}")
        if not replace and self.exists(name):
            raise self._exists(name)
        staging_id = self.new_staging_id("local")
        try:
            parts = [self.stage_partition(staging_id, i, t, name=name) for i, t in enumerate(tables)]
        except BaseException:
            self.discard_staging(name, staging_id)
            raise
        return self.seal(name, staging_id, parts, schema, partitioning, producer, run, replace)

    def new_staging_id(self, owner: str) -> str:
        return f"{owner}-{uuid.uuid4().hex[:12]}"

    def stage_partition(self, staging_id: str, index: int, table: pa.Table, name: str | None = None) -> PartitionInfo:
        """Write one partition of a put that ``seal`` will publish (the object tier writes in
        place under the dataset's name, so it needs ``name``)."""
        if name is None and not self.tier.atomic_rename:
            raise ValueError(f"{self._where()}: stage_partition needs the dataset name")
        location = self.tier.staging(self.session, _check_name(name) if name else "", staging_id)
        try:
            nbytes, checksum = self.tier.write_partition(location, index, table)
        except OSError as exc:  # e.g. ENOSPC: the tier is full
            raise StoreError(
                f"{self._where()}: put {name!r} partition {index}: writing {location}/{part_file(index)} failed: {exc}"
            ) from exc
        through = self._write_through(location, index, name or "", staging_id) if self.durable_tier else ""
        part = PartitionInfo(index, table.num_rows, nbytes, checksum, copy=through, **self.placement())
        self._trust_sealed(staging_id, index, part)  # hashed while written: this attempt trusts it
        return part

    def _write_through(self, location: str, index: int, name: str, staging_id: str) -> str:
        """Copy the partition just written to the durable tier (its exact bytes); where."""
        assert self.durable_tier is not None
        through = self._durable_location(name, staging_id)
        try:
            self.durable_tier.write_buffer(through, index, self.tier.read_buffer(location, index))
        except OSError as exc:
            raise StoreError(
                f"{self._where()}: put {name!r} partition {index}: writing it through to {through} failed: {exc}"
            ) from exc
        return through

    def _durable_location(self, name: str, staging_id: str) -> str:
        assert self.durable_tier is not None
        return self.durable_tier.final(self.session, name, f"{staging_id}.copy")

    def discard_staging(self, name: str | None, staging_id: str) -> None:
        """Remove the partitions of a put that will not be sealed."""
        if name is not None and self.durable_tier is not None:
            self.durable_tier.remove(self._durable_location(name, staging_id))
        if name is None and not self.tier.atomic_rename:
            return
        self.tier.remove(self.tier.staging(self.session, name or "", staging_id))

    def seal(
        self,
        name: str,
        staging_id: str,
        parts: builtins.list[PartitionInfo],
        schema: pa.Schema,
        partitioning: dict[str, Any] | None,
        producer: str,
        run: str,
        replace: bool,
        committed: bool = False,
        *,
        origin: dict[str, str] | None = None,
    ) -> DatasetInfo:
        """Publish a staged dataset: move its files into place (file tier), then one atomic
        metadata step; only then can a reader find it.  ``committed``: each host moved its
        own partitions into place already (``commit_here``: a put whose ranks span hosts).
        ``origin``: where a crossed dataset came from (``store.crossing``)."""
        _check_name(name)
        final = self.tier.final(self.session, name, staging_id)
        if not committed:
            self.commit_here(name, staging_id, budget=False)  # the budget is kept once sealed
        now = time.time()
        info = DatasetInfo(
            self.session,
            name,
            staging_id,
            final,
            schema,
            parts,
            partitioning or {"kind": "none"},
            producer,
            run,
            now,
            accessed=now,
            origin=origin or {},
        )
        try:
            old = self.meta.seal(info, replace)
        except FileExistsError:
            self.tier.remove(final)
            raise self._exists(name) from None
        except BaseException as exc:
            # The seal may have committed before the error reached us (a lost reply, Ctrl-C):
            # remove the payload only if the metadata says it does not point at it — when the
            # metadata cannot say (unreachable), the payload stays (garbage at worst).
            try:
                current = self.meta.get(self.session, name)
            except Exception:
                log.warning(
                    "%s: sealing %r: the metadata did not say whether the seal landed; its payload stays at %s",
                    self._where(),
                    name,
                    final,
                )
                current = info
            if current is None or current.version != staging_id:
                self.tier.remove(final)
            if isinstance(exc, Exception) and not isinstance(exc, StoreError):  # e.g. a full disk
                raise StoreError(f"{self._where()}: sealing {name!r} failed: {exc}") from exc
            raise
        # Sealed: from here on, failures only leave garbage, never a wrong dataset.
        try:
            if old is not None:
                self._retire(old.location)
                self._remove_elsewhere(old)
            self._enforce_budget()
        except Exception as exc:
            log.warning("%s: after sealing %r: %s", self._where(), name, exc)
        return info

    def within_budget(self) -> None:
        """Bring this host's memory tier within the budget now (a no-op without one): after a
        put whose ranks span hosts, each host's first rank, for what had to be sealed before it
        could move (a put's own partitions over the budget).  Only costs memory if it fails."""
        if self.memory_budget is None or self.tier.local_root is None:
            return
        try:
            self._enforce_budget()
        except Exception as exc:
            log.warning("%s: keeping %s within the memory budget: %s", self._where(), remote.hostname(), exc)

    def commit_here(self, name: str, staging_id: str, *, budget: bool = True) -> None:
        """Move this host's staged partitions of a put into place (file tier: one rename).
        Under a memory budget (``budget``), this host's least-recently-used partitions spill
        first to make room for them (a put whose ranks span hosts: each host's first rank)."""
        staging = self.tier.staging(self.session, name, staging_id)
        if budget and self.memory_budget is not None and self.tier.local_root is not None:
            try:
                self._enforce_budget(incoming=self.tier.usage(staging)[0])
            except Exception as exc:  # only costs memory: the put goes on
                log.warning("%s: making room for %r on %s: %s", self._where(), name, remote.hostname(), exc)
        try:
            self.tier.commit(staging, self.tier.final(self.session, name, staging_id))
        except BaseException:
            self.tier.remove(staging)
            raise

    # ---- sharing a sealed dataset with another session (caching across runs) -----------------
    def adopt(self, src: Store, name: str, *, replace: bool = False, run: str = "") -> Adopted:
        """Make ``src``'s sealed dataset ``name`` (another session of this store: an earlier
        run's output) a dataset of this session under the same name, sharing its bytes where
        the tier can: each partition file hard-linked on a directory tier (no byte copied),
        a server-side copy on an object store, else copied (a partition held by another
        host's memory is fetched from it).  Every partition is checked against its checksum
        as this session now holds it (``ChecksumError`` naming the source: nothing sealed).

        Immutability and isolation hold: nothing of ``src`` is written (not even a verified
        marker), only its sealed files are read (never its staging area), and the two datasets
        have their own metadata and directory entries, so removing either session leaves the
        other whole (a linked file's bytes go with its last link).  ``run``: the run that
        adopts it (default: the source's)."""
        _check_name(name)
        info = src.info(name)
        if not replace and self.exists(name):
            raise self._exists(name)
        staging_id = self.new_staging_id("adopt")
        location = self.tier.staging(self.session, name, staging_id)
        how: set[str] = set()
        try:
            parts = [self._adopt_partition(src, info, i, location, staging_id, how) for i in range(info.num_partitions)]
        except BaseException:
            self.discard_staging(name, staging_id)
            raise
        origin = {
            "store": self.tier.url,
            "session": src.session,
            "name": name,
            "version": info.version,
            "adopted": "+".join(sorted(how)),
        }
        sealed = self.seal(
            name,
            staging_id,
            parts,
            info.schema,
            info.partitioning,
            info.producer,
            run or info.run,
            replace,
            origin=origin,
        )
        return Adopted(sealed, "+".join(sorted(how)) or "nothing (no partitions)")

    def _adopt_partition(
        self, src: Store, info: DatasetInfo, index: int, location: str, staging_id: str, how: set[str]
    ) -> PartitionInfo:
        """Partition ``index`` of ``src``'s ``info`` into this session's staged ``location``,
        checked as it is there now."""
        part = info.partitions[index]
        where = f"{src._where()}: dataset {info.name!r} partition {index}"
        try:
            if src.is_here(part):
                at = info.location_of(index)  # where it is now (spilled apart from the rest, too)
                how.add(self.tier.share_partition(src._tier_for(at), at, index, location))
            else:  # in another host's memory: its exact bytes, checked on the way
                self.tier.write_buffer(location, index, src.partition_bytes(info, index))
                how.add("copy")
            self._check(
                self.tier.read_buffer(location, index), part, f"{where} (adopted into session {self.session!r})"
            )
        except FileNotFoundError:
            raise StoreError(f"{where} is missing (removed or moved meanwhile)") from None
        through = ""
        if self.durable_tier is not None:  # its written-through copy shared too, where it has one
            if part.copy and self.durable_tier.owns(part.copy):
                through = self._durable_location(info.name, staging_id)
                self.durable_tier.share_partition(self.durable_tier, part.copy, index, through)
            else:
                through = self._write_through(location, index, info.name, staging_id)
        new = PartitionInfo(index, part.rows, part.bytes, part.checksum, copy=through, **self.placement())
        self._trust_sealed(staging_id, index, new)  # checked just now: this attempt trusts it
        return new

    def _exists(self, name: str) -> DatasetExistsError:
        return DatasetExistsError(
            f"{self._where()}: dataset {name!r} exists; datasets are immutable (pass replace=True to replace it)"
        )

    # ---- memory budget: spill to disk, reload on use, pin ------------------------------------
    # Per host: the budget covers the partitions in this host's memory tier (this store's root),
    # of every dataset.  A dataset that lives wholly on this host moves whole (its ``location``);
    # this host's partitions of a dataset spread over hosts move one by one, each into a
    # directory of its own (``PartitionInfo.location``, ``meta.relocate_partitions``), so hosts
    # that share a spill directory never collide.  Each host moves only its own partitions.
    def pin(self, name: str) -> DatasetInfo:
        """Keep the dataset in memory: never spilled (its partitions on this host brought back
        now if they were; those of other hosts at those hosts' next write)."""
        if not self.meta.set_pinned(self.session, name, True):
            raise DatasetNotFoundError(f"{self._where()}: no dataset {name!r}")
        info = self.info(name)
        back = self._spilled_here(info)
        if back is True:
            self._move(info, self.tier)
        elif back:
            self._move_parts(info, back, self.tier)
        self._enforce_budget()
        return self.info(name)

    def unpin(self, name: str) -> DatasetInfo:
        if not self.meta.set_pinned(self.session, name, False):
            raise DatasetNotFoundError(f"{self._where()}: no dataset {name!r}")
        self._enforce_budget()
        return self.info(name)

    def _whole(self, info: DatasetInfo) -> bool:
        """Whether ``info`` lives in one directory of this host: every partition here, none
        moved apart (the budget then moves it whole)."""
        return all(self.is_here(p) and not p.location for p in info.partitions)

    def _resident(self, info: DatasetInfo) -> bool:
        """Whether ``info`` lives whole on this store's root."""
        return self._whole(info) and self.tier.owns(info.location)

    def _in_memory(self, info: DatasetInfo) -> builtins.list[int]:
        """The partitions of ``info`` in this host's memory tier (this store's root)."""
        return [i for i, p in enumerate(info.partitions) if self.is_here(p) and self.tier.owns(info.location_of(i))]

    def _spilled_here(self, info: DatasetInfo) -> bool | builtins.list[int]:
        """What of ``info`` this host spilled: True (the whole dataset), or the partitions of a
        dataset spread over hosts that this host holds on its spill tier."""
        spill = self.spill_tier
        if spill is None:
            return []
        if self._whole(info):
            return spill.owns(info.location) and bool(info.partitions)
        return [i for i, p in enumerate(info.partitions) if self.is_here(p) and p.location and spill.owns(p.location)]

    def _bytes_here(self, info: DatasetInfo) -> int:
        """Bytes of the partitions of ``info`` this host holds (memory or spill)."""
        return sum(p.bytes for p in info.partitions if self.is_here(p))

    def _fits(self, info: DatasetInfo, incoming: int = 0) -> bool:
        """Could this host's partitions of ``info`` live in memory next to the pinned ones (and
        ``incoming`` bytes about to be sealed)?"""
        assert self.memory_budget is not None
        pinned = sum(
            d.partitions[i].bytes
            for d in self.meta.all()
            if d.pinned and (d.session, d.name) != (info.session, info.name)
            for i in self._in_memory(d)
        )
        return pinned + incoming + self._bytes_here(info) <= self.memory_budget

    def _enforce_budget(self, incoming: int = 0) -> None:
        """Keep this host's memory tier within the budget, counting ``incoming`` bytes about to
        be sealed (``commit_here``): pinned partitions this host spilled come back where they
        fit, then least-recently-used, unpinned datasets spill — whole where one lives only
        here, else this host's partitions of it, one at a time."""
        if self.memory_budget is None or self.spill_tier is None:
            return
        budget = self.memory_budget
        datasets = self.meta.all()
        pinned = sum(d.partitions[i].bytes for d in datasets if d.pinned for i in self._in_memory(d))
        for d in sorted((d for d in datasets if d.pinned), key=lambda d: -d.accessed):
            back = self._spilled_here(d)
            nbytes = d.nbytes if back is True else sum(d.partitions[i].bytes for i in back or [])
            if back and pinned + incoming + nbytes <= budget:
                moved = self._move(d, self.tier) if back is True else self._move_parts(d, back, self.tier)
                pinned += nbytes if moved is not None else 0
        datasets = self.meta.all()
        held = {(d.session, d.name): self._in_memory(d) for d in datasets}
        total = incoming + sum(d.partitions[i].bytes for d in datasets for i in held[(d.session, d.name)])
        if total <= budget:
            return
        here = {(d.session, d.name): sum(d.partitions[i].bytes for i in held[(d.session, d.name)]) for d in datasets}
        # one that could never fit goes first; then least recently used
        victims = sorted(
            (d for d in datasets if not d.pinned and held[(d.session, d.name)]),
            key=lambda d: (here[(d.session, d.name)] <= budget, d.accessed),
        )
        for d in victims:
            if total <= budget:
                break
            if self._resident(d):
                if self._move(d, self.spill_tier) is not None:
                    total -= d.nbytes
                    self._log_spill(d, d.nbytes, "")
                continue
            for i in held[(d.session, d.name)]:
                if total <= budget:
                    break
                if self._move_parts(d, [i], self.spill_tier) is not None:
                    total -= d.partitions[i].bytes
                    self._log_spill(d, d.partitions[i].bytes, f" partition {i}")

    def partition_places(self, info: DatasetInfo) -> builtins.list[dict[str, str]]:
        """Where each partition lives now: its host, "memory" (the store root's tier) or
        "spill" (a disk tier it was moved to under a memory budget), and its directory (on an
        object store: "s3" and its prefix)."""
        root = "memory" if isinstance(self.tier, FileTier) else self.tier.kind
        return [
            {
                "host": p.host or remote.hostname(),
                "tier": root if self.tier.owns(info.location_of(i)) else "spill",
                "location": info.location_of(i),
            }
            for i, p in enumerate(info.partitions)
        ]

    def _log_spill(self, info: DatasetInfo, nbytes: int, what: str) -> None:
        spill = self.spill_tier.url if self.spill_tier is not None else "?"
        log.info(
            "%s: spilled %s/%s%s (%d bytes) to %s on %s",
            self._where(),
            info.session,
            info.name,
            what,
            nbytes,
            spill,
            remote.hostname(),
        )

    def _move(self, info: DatasetInfo, dst: Tier) -> DatasetInfo | None:
        """Copy a sealed dataset to ``dst``, switch its location in one compare-and-set, then
        delete the old copy.  Readers that already mapped the old files keep valid pages (an
        unlinked file lives on while mapped); readers with a stale location follow the
        metadata (``partition``).  None when the dataset changed meanwhile (nothing moved)."""
        src = self._tier_for(info.location)
        tag = f"move-{uuid.uuid4().hex[:12]}"
        scratch = dst.scratch(info.session, tag)
        final = dst.final(info.session, info.name, f"{info.version}.{tag[5:]}")
        try:
            for i in range(info.num_partitions):
                dst.write_buffer(scratch, i, src.read_buffer(info.location, i))
            dst.commit(scratch, final)
        except FileNotFoundError:  # deleted, replaced or moved by another process meanwhile
            dst.remove(scratch)
            return None
        except BaseException:
            dst.remove(scratch)
            raise
        spilling = dst is self.spill_tier
        if not self.meta.relocate(info.session, info.name, info.version, info.location, final, unless_pinned=spilling):
            dst.remove(final)
            return None
        src.remove(info.location)
        return _replace(info, location=final)

    def _move_parts(self, info: DatasetInfo, indices: Sequence[int], dst: Tier) -> DatasetInfo | None:
        """``_move`` for partitions of this host that move apart from the rest of their dataset:
        each copied into a directory of its own on ``dst`` (this host's spill or memory tier),
        switched in one compare-and-set (``meta.relocate_partitions``), then its old file
        deleted (the others of this host stay in the dataset's directory).  The dataset as it
        is now, or None when nothing moved (it changed meanwhile)."""
        parts = list(info.partitions)
        for i in indices:
            old = info.location_of(i)
            src = self._tier_for(old)
            tag = f"move-{uuid.uuid4().hex[:12]}"
            scratch = dst.scratch(info.session, tag)
            final = dst.final(info.session, info.name, f"{info.version}.{tag[5:]}")
            try:
                dst.write_buffer(scratch, i, src.read_buffer(old, i))
                dst.commit(scratch, final)
            except FileNotFoundError:
                dst.remove(scratch)
                continue
            except BaseException:
                dst.remove(scratch)
                raise
            moves = {i: (old, final)}
            spilling = dst is self.spill_tier
            if not self.meta.relocate_partitions(info.session, info.name, info.version, moves, spilling):
                dst.remove(final)
                continue
            src.remove_partition(old, i)
            parts[i] = _replace(parts[i], location="" if final == info.location else final)
        if parts == info.partitions:
            return None
        return _replace(info, partitions=parts)

    # ---- removal ---------------------------------------------------------------------------
    def delete(self, name: str) -> None:
        old = self.meta.delete(self.session, name)
        if old is None:
            raise DatasetNotFoundError(f"{self._where()}: no dataset {name!r}")
        self._retire(old.location)
        self._remove_elsewhere(old)

    def _remove_moved(self, info: DatasetInfo) -> None:
        """Remove the partitions of a replaced or deleted version that moved apart from it
        (spilled, or brought back, on their host): this host's after the grace period, other
        hosts' through their store services."""
        there: dict[str, set[str]] = {}
        for p in info.partitions:
            if p.location and self.is_here(p):
                self._retire(p.location)
            elif p.location and p.endpoint:
                there.setdefault(p.location, set()).add(p.endpoint)
        for location, endpoints in there.items():
            remote.remove_there(self._where(), location, endpoints)

    def _remove_copies(self, info: DatasetInfo) -> None:
        for through in {p.copy for p in info.partitions if p.copy}:
            try:
                self._tier_for(through).remove(through)
            except (OSError, StoreError) as exc:
                log.warning("%s: the written-through copy %s stays: %s", self._where(), through, exc)

    def _elsewhere(self, info: DatasetInfo) -> set[str]:
        """The store services of the other hosts that hold partitions of ``info``."""
        return {p.endpoint for p in info.partitions if p.endpoint and not self.is_here(p)}

    def _remove_elsewhere(self, info: DatasetInfo, location: str | None = None) -> None:
        """Remove a replaced or deleted version (or ``location``) on the other hosts holding
        its partitions, and its written-through copy: at once — a reader there maps a
        partition before reading it, and a mapped file stays readable after removal; one that
        looks later follows the metadata."""
        self._remove_copies(info)
        if location is None:
            self._remove_moved(info)
        endpoints = self._elsewhere(info)
        if endpoints:
            remote.remove_there(self._where(), location or info.location, endpoints)

    # Readers look a dataset up, then open its files (rank 0 looks up for the whole gang), so
    # the files of a replaced or deleted version stay for a grace period before removal.
    RETIRE_GRACE_S = 300.0

    def _retire(self, location: str) -> None:
        trash = self.root_trash()
        if trash is None:  # object stores: remove at once (documented)
            self._remove_payload(location)
            return
        entry = trash / f"{time.time_ns()}-{uuid.uuid4().hex[:6]}"
        try:
            makedirs(trash)
            fd = os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
            try:
                os.write(fd, location.encode())
            finally:
                os.close(fd)
        except OSError as exc:  # e.g. someone else made .retired a file
            raise StoreError(
                f"{self._where()}: cannot record the replaced or deleted version at {location} "
                f"under {trash} ({exc}); its files stay until removed by hand"
            ) from None
        self.purge_retired()

    def root_trash(self) -> Path | None:
        local_root = self.tier.local_root
        return local_root / ".retired" if local_root is not None else None

    def purge_retired(self, older_than: float | None = None) -> int:
        """Remove retired versions older than ``older_than`` seconds (default: the grace)."""
        trash = self.root_trash()
        if trash is None or not trash.is_dir():
            return 0
        limit = time.time_ns() - int((self.RETIRE_GRACE_S if older_than is None else older_than) * 1e9)
        removed = 0
        for entry in trash.iterdir():
            try:
                if int(entry.name.split("-", 1)[0]) > limit:
                    continue
                self._remove_payload(_read_retired(entry))
                entry.unlink()
                removed += 1
            except UnsafePathError as exc:
                # On a root other users can write in, one of them may have put it there
                # (issue 22 item 14): it is left for the owner to look at, named each time.
                log.warning(
                    "%s: refusing to act on %s, left in place: %s. phalanx writes the files under %s "
                    "itself; if you did not, someone who can write in %s did: check it, then remove it",
                    self._where(),
                    entry,
                    exc,
                    trash,
                    trash.parent,
                )
            except (ValueError, OSError):  # another process purged it first
                continue
        return removed

    def _remove_payload(self, location: str) -> None:
        """Remove a dataset's files, read from the metadata or from ``.retired``: only on
        this store's own tiers (the root, the spill directory, the default spill directory,
        where a budgeted store spilled), each of which checks the location is inside it."""
        spill = self.spill_tier
        if spill is None and self.tier.local_root is not None and not self.tier.owns(location):
            try:
                spill = FileTier(default_spill_root())
            except UnsafePathError:  # someone else's: nothing of ours is there
                spill = None
        for tier in (self.tier, spill):
            if tier is not None and tier.owns(location):
                tier.remove(location)
                return
        raise UnsafePathError(
            f"refusing to remove {location}: it is not inside the store root {self.tier.url}"
            + (f" or the spill directory {spill.url}" if spill is not None else "")
        )

    def delete_session(self) -> int:
        """Remove every dataset of this session (metadata and payload); returns how many."""
        names = self.list()
        refused: builtins.list[str] = []
        elsewhere: dict[str, set[str]] = {}  # session directory on other hosts → their services
        for name in names:
            old = self.meta.delete(self.session, name)
            if old is not None:  # an explicit wipe: no grace period
                self._refusing(refused, self._remove_payload, old.location)
                self._remove_copies(old)
                self._remove_moved(old)
                if self._elsewhere(old):
                    elsewhere.setdefault(str(Path(old.location).parent.parent), set()).update(self._elsewhere(old))
        # The session's directory goes only when no dataset was sealed meanwhile.
        if not self.meta.list(self.session):
            for tier in (self.tier, self.spill_tier):
                if tier is not None:
                    self._refusing(refused, tier.remove_session, self.session)
            for session_dir, endpoints in elsewhere.items():
                remote.remove_there(self._where(), session_dir, endpoints)
        self._refused(refused)
        return len(names)

    @staticmethod
    def _refusing(refused: builtins.list[str], remove: Callable[[str], None], what: str) -> None:
        """``remove(what)``; a refusal (``UnsafePathError``) is added to ``refused``."""
        try:
            remove(what)
        except UnsafePathError as exc:
            refused.append(str(exc))

    def _refused(self, refused: builtins.list[str]) -> None:
        """Raise the refusals of a removal that went on with everything else."""
        if refused:
            raise UnsafePathError(
                f"{self._where()}: removed all else, but {'; '.join(refused)}. If you did not put "
                "it there, someone who can write in the store root did: check it before removing it by hand"
            )

    def abort_staging(self, owner: str) -> int:
        """Remove unsealed writes of ``owner`` (a gang id) in every session: a failed put.

        On an object store, writes are in place, so a prefix of ``owner`` that the metadata
        has sealed is kept."""
        removed = 0
        for tier, st in self._staged(owner):
            tier.remove(st.location)
            removed += 1
        return removed

    def unsealed(self, session: str | None = None) -> builtins.list[Unsealed]:
        """Writes no seal has published, in every session (or ``session``), with their size
        and idle time: puts in progress, or what the gangs of a killed driver left behind."""
        now = time.time()
        found = []
        for tier, st in self._staged("*"):
            if session is None or st.session == session:
                nbytes, written = tier.usage(st.location)
                found.append(Unsealed(st.session, st.name, st.version, st.location, nbytes, max(0.0, now - written)))
        return sorted(found, key=lambda u: (u.session, u.staging_id))

    def remove_unsealed(self) -> builtins.list[Unsealed]:
        """Remove this session's unsealed writes (see ``unsealed``) and return them; a put
        still in progress in the session then fails, so use it on sessions no run writes."""
        gone = self.unsealed(self.session)
        refused: builtins.list[str] = []
        for u in gone:
            self._refusing(refused, self._remove_payload, u.location)
        self._refused(refused)
        return gone

    def _staged(self, owner: str) -> Iterator[tuple[Tier, Staged]]:
        """Unsealed writes whose staging id matches ``<owner>-*`` (``owner`` may be ``*``), on
        the root and the spill tier; written-in-place prefixes the metadata sealed are skipped."""
        for tier in (self.tier, self.spill_tier):
            if tier is None:
                continue
            for st in tier.staged(owner):
                if st.name is not None:
                    cur = self.meta.get(st.session, st.name)
                    if cur is not None and cur.version == st.version and cur.location == st.location:
                        continue
                yield tier, st


def _part_where(info: DatasetInfo, index: int, location: str) -> str:
    """Names partition ``index`` of ``info`` at ``location`` in a message (and its host, where
    it moved apart from its dataset on a store spanning hosts: spilled there)."""
    part = info.partitions[index]
    host = f"on host {part.host}: " if part.host and part.location else ""
    return f"dataset {info.name!r} partition {index} ({host}{location}/{part_file(index)})"


def _place(location: str) -> str:
    """Where a dataset's bytes are, as trust is kept: the last component of its location
    (``v<version>`` as sealed, ``v<version>.<tag>`` after a move to or from spill)."""
    return location.rstrip("/").rsplit("/", 1)[-1]
