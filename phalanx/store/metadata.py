"""Dataset metadata, kept apart from the payload, behind one interface.

- ``SQLiteMetadata`` (``sqlite:///path/meta.sqlite`` or a plain path): the default, beside the
  payload of a file-tier store.  Every process that opens the store must see the same file
  (one host, or a shared file system that supports SQLite's locking).
- ``RedisMetadata`` (``redis://host:port/db?prefix=...``, in ``redis_metadata.py``): for gangs
  that span hosts or a payload on an object store.

A dataset becomes visible in one atomic step (``seal``): its row and all its partitions
together, so a reader that finds the name finds all of it.  Besides the immutable description
the metadata keeps three mutable things: the payload's *location* (it moves between the memory
and the disk tier under a memory budget), the *last access* time (least-recently-used spill
order) and the *pinned* flag (never spilled).
"""

from __future__ import annotations

import builtins
import json
import sqlite3
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from .._registry import Registry
from ..errors import StoreError
from ..private import create_private, makedirs
from ..sqlite_wal import set_wal


@dataclass
class PartitionInfo:
    index: int
    rows: int
    bytes: int
    checksum: str
    # Where it lives when the store spans hosts (all empty on one host or a shared root):
    host: str = ""  # the host whose memory holds it
    root_id: str = ""  # identity of that host's store root (FileTier.root_id): same id, same files
    endpoint: str = ""  # that host's store service (grpc+tcp://addr:port), "" if none
    copy: str = ""  # a written-through copy's directory on a durable tier, "" if none
    # The directory that holds it when it moved on its host apart from the rest of the dataset
    # (under a memory budget: to that host's spill tier, or back into its memory tier); "" when
    # it is in the dataset's ``location``.  ``DatasetInfo.location_of`` reads it.
    location: str = ""

    @property
    def place(self) -> dict[str, str]:
        """The non-empty placement fields, as stored."""
        return {k: v for k in PLACE_FIELDS if (v := getattr(self, k))}

    @classmethod
    def of(
        cls, index: int, rows: int, nbytes: int, checksum: str, place: str | dict[str, str] | None = None
    ) -> PartitionInfo:
        """From stored fields; ``place``: the JSON (or dict) ``place`` gave."""
        fields = json.loads(place) if isinstance(place, str) and place else (place or {})
        return cls(index, rows, nbytes, checksum, **{k: str(v) for k, v in fields.items() if k in PLACE_FIELDS})


PLACE_FIELDS = ("host", "root_id", "endpoint", "copy", "location")


@dataclass
class DatasetInfo:
    session: str
    name: str
    version: str  # unique id of the put that sealed it (also its directory)
    location: str  # directory of the partition files
    schema: pa.Schema
    partitions: list[PartitionInfo]
    partitioning: dict[str, Any] = field(default_factory=lambda: {"kind": "none"})
    producer: str = ""
    run: str = ""
    created: float = 0.0
    pinned: bool = False
    accessed: float = 0.0  # last get/read (or the seal), for least-recently-used spill
    # Where a dataset that crossed from another store came from (store.crossing): that store,
    # session, name and version; empty for a dataset put here.
    origin: dict[str, str] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return sum(p.rows for p in self.partitions)

    def location_of(self, index: int) -> str:
        """The directory that holds partition ``index`` now (on the host ``host`` names)."""
        return self.partitions[index].location or self.location

    @property
    def nbytes(self) -> int:
        return sum(p.bytes for p in self.partitions)

    @property
    def num_partitions(self) -> int:
        return len(self.partitions)

    def summary(self) -> dict[str, Any]:
        """Plain values for printing or JSON."""
        return {
            "name": self.name,
            "session": self.session,
            "version": self.version,
            "rows": self.num_rows,
            "bytes": self.nbytes,
            "partitions": self.num_partitions,
            "rows_per_partition": [p.rows for p in self.partitions],
            "checksums": [p.checksum for p in self.partitions],
            "partitioning": self.partitioning,
            "producer": self.producer,
            "run": self.run,
            "created": self.created,
            "schema": {f.name: str(f.type) for f in self.schema},
            "location": self.location,
            "hosts": [p.host for p in self.partitions] if any(p.host for p in self.partitions) else [],
            "places": [p.place for p in self.partitions] if any(p.place for p in self.partitions) else [],
            "pinned": self.pinned,
            "accessed": self.accessed,
            **({"origin": self.origin} if self.origin else {}),
        }


class MetadataBackend(ABC):
    """The catalogue of sealed datasets, by (session, name)."""

    url: str = ""  # how another process (a rank) opens the same catalogue

    @abstractmethod
    def get(self, session: str, name: str) -> DatasetInfo | None: ...

    @abstractmethod
    def list(self, session: str) -> list[DatasetInfo]: ...

    @abstractmethod
    def seal(self, info: DatasetInfo, replace: bool) -> DatasetInfo | None:
        """Publish ``info`` atomically; returns the dataset it replaced, if any.

        Raises FileExistsError when the name exists and ``replace`` is False."""

    @abstractmethod
    def delete(self, session: str, name: str) -> DatasetInfo | None: ...

    @abstractmethod
    def sessions(self) -> builtins.list[str]: ...

    @abstractmethod
    def touch(self, session: str, name: str, when: float | None = None) -> None:
        """Record an access (get/read) now or at ``when``; a missing dataset is ignored."""

    @abstractmethod
    def set_pinned(self, session: str, name: str, pinned: bool) -> bool:
        """Set the pinned flag; False when there is no such dataset."""

    @abstractmethod
    def relocate(
        self, session: str, name: str, version: str, old_location: str, new_location: str, unless_pinned: bool = False
    ) -> bool:
        """Point the dataset at a new location, atomically, only if it is still ``version``
        at ``old_location`` (compare-and-set) — and, with ``unless_pinned``, not pinned (a
        spill must not win against a pin made while it copied); False otherwise."""

    def relocate_partitions(
        self, session: str, name: str, version: str, moves: dict[int, tuple[str, str]], unless_pinned: bool = False
    ) -> bool:
        """Point partitions at new directories, all of ``moves`` (index → (old, new)) in one
        atomic step, only if the dataset is still ``version`` and each partition still at its
        old directory (``DatasetInfo.location_of``) — and, with ``unless_pinned``, not pinned;
        False otherwise.  How one host spills its partitions of a dataset spread over hosts.
        A backend without it moves nothing (such datasets then stay in memory)."""
        return False

    def all(self) -> builtins.list[DatasetInfo]:
        """Every dataset of every session."""
        return [d for s in self.sessions() for d in self.list(s)]

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS datasets (
    session TEXT NOT NULL, name TEXT NOT NULL, version TEXT NOT NULL, location TEXT NOT NULL,
    schema BLOB NOT NULL, partitioning TEXT NOT NULL, producer TEXT, run TEXT,
    created REAL NOT NULL, pinned INTEGER NOT NULL DEFAULT 0, accessed REAL NOT NULL DEFAULT 0,
    origin TEXT NOT NULL DEFAULT '', PRIMARY KEY (session, name));
CREATE TABLE IF NOT EXISTS partitions (
    session TEXT NOT NULL, name TEXT NOT NULL, idx INTEGER NOT NULL, rows INTEGER NOT NULL,
    bytes INTEGER NOT NULL, checksum TEXT NOT NULL, place TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (session, name, idx));
"""


class SQLiteMetadata(MetadataBackend):
    """One SQLite file (WAL mode); a connection per call, so threads and processes share it."""

    def __init__(self, path: str | Path):
        text = str(path)
        if text.startswith("sqlite://"):
            text = text[len("sqlite://") :]
        self.path = Path(text).absolute()
        self.url = f"sqlite://{self.path}"
        create_private(makedirs(self.path.parent) / self.path.name)  # 0600, and so its -wal, -shm
        with self._connect() as con:
            if not self._current(con):
                self._migrate(con)

    @staticmethod
    def _current(con: sqlite3.Connection) -> bool:
        """Whether both tables exist with today's columns (then opening writes nothing)."""
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        cols = {r[1] for r in con.execute("PRAGMA table_info(datasets)")}
        part_cols = {r[1] for r in con.execute("PRAGMA table_info(partitions)")}
        return {"datasets", "partitions"} <= tables and {"accessed", "origin"} <= cols and "place" in part_cols

    @classmethod
    def _migrate(cls, con: sqlite3.Connection) -> None:
        """Create the tables, or add the columns a catalogue of an older version of the store
        lacks, under the write lock from the first statement (BEGIN IMMEDIATE): processes that
        open a new or old catalogue at once look and change one after another, so no two add
        the column ("duplicate column name")."""
        con.execute("BEGIN IMMEDIATE")
        try:
            if not cls._current(con):
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        con.execute(statement)
                cols = {r[1] for r in con.execute("PRAGMA table_info(datasets)")}
                if "accessed" not in cols:
                    con.execute("ALTER TABLE datasets ADD COLUMN accessed REAL NOT NULL DEFAULT 0")
                if "origin" not in cols:
                    con.execute("ALTER TABLE datasets ADD COLUMN origin TEXT NOT NULL DEFAULT ''")
                if "place" not in {r[1] for r in con.execute("PRAGMA table_info(partitions)")}:
                    con.execute("ALTER TABLE partitions ADD COLUMN place TEXT NOT NULL DEFAULT ''")
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise

    def __repr__(self) -> str:
        return f"SQLiteMetadata({self.path})"

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            con = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"store metadata {self.path}: {exc}") from None
        try:
            set_wal(con)
            yield con
        except sqlite3.Error as exc:  # a full disk ("disk I/O error"), a corrupted file...
            raise StoreError(f"store metadata {self.path}: {exc}") from exc
        finally:
            con.close()

    _COLS = "session, name, version, location, schema, partitioning, producer, run, created, pinned, accessed, origin"

    def _info(self, con: sqlite3.Connection, row: tuple[Any, ...]) -> DatasetInfo:
        session, name, version, location, schema, partitioning, producer, run, created, pinned, accessed, origin = row
        parts = [
            PartitionInfo.of(*p)
            for p in con.execute(
                "SELECT idx, rows, bytes, checksum, place FROM partitions WHERE session=? AND name=? ORDER BY idx",
                (session, name),
            )
        ]
        return DatasetInfo(
            session,
            name,
            version,
            location,
            pa.ipc.read_schema(pa.py_buffer(schema)),
            parts,
            json.loads(partitioning),
            producer or "",
            run or "",
            created,
            bool(pinned),
            accessed or created,
            json.loads(origin) if origin else {},
        )

    def _row(self, con: sqlite3.Connection, session: str, name: str) -> DatasetInfo | None:
        row = con.execute(f"SELECT {self._COLS} FROM datasets WHERE session=? AND name=?", (session, name)).fetchone()
        return self._info(con, row) if row else None

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One snapshot for the dataset row and its partitions: a replace that commits in
        between must not mix two versions."""
        with self._connect() as con:
            con.execute("BEGIN")
            try:
                yield con
            finally:
                con.execute("COMMIT")

    def get(self, session: str, name: str) -> DatasetInfo | None:
        with self._read() as con:
            return self._row(con, session, name)

    def list(self, session: str) -> list[DatasetInfo]:
        with self._read() as con:
            rows = con.execute(
                f"SELECT {self._COLS} FROM datasets WHERE session=? ORDER BY name", (session,)
            ).fetchall()
            return [self._info(con, r) for r in rows]

    def all(self) -> builtins.list[DatasetInfo]:
        with self._read() as con:
            rows = con.execute(f"SELECT {self._COLS} FROM datasets ORDER BY session, name").fetchall()
            return [self._info(con, r) for r in rows]

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as con:
            con.execute("BEGIN IMMEDIATE")  # one writer at a time: check and change together
            try:
                yield con
                con.execute("COMMIT")
            except BaseException:
                if con.in_transaction:  # a failed COMMIT (disk full) may have ended it already
                    con.execute("ROLLBACK")
                raise

    def seal(self, info: DatasetInfo, replace: bool) -> DatasetInfo | None:
        with self._write() as con:
            old = self._row(con, info.session, info.name)
            if old is not None and not replace:
                raise FileExistsError(info.name)
            if old is not None:
                self._delete_rows(con, info.session, info.name)
            created = info.created or time.time()
            con.execute(
                f"INSERT INTO datasets ({self._COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    info.session,
                    info.name,
                    info.version,
                    info.location,
                    info.schema.serialize().to_pybytes(),
                    json.dumps(info.partitioning),
                    info.producer,
                    info.run,
                    created,
                    int(info.pinned),
                    info.accessed or created,
                    json.dumps(info.origin) if info.origin else "",
                ),
            )
            con.executemany(
                "INSERT INTO partitions VALUES (?,?,?,?,?,?,?)",
                [
                    (
                        info.session,
                        info.name,
                        p.index,
                        p.rows,
                        p.bytes,
                        p.checksum,
                        json.dumps(p.place) if p.place else "",
                    )
                    for p in info.partitions
                ],
            )
        return old

    @staticmethod
    def _delete_rows(con: sqlite3.Connection, session: str, name: str) -> None:
        con.execute("DELETE FROM datasets WHERE session=? AND name=?", (session, name))
        con.execute("DELETE FROM partitions WHERE session=? AND name=?", (session, name))

    def delete(self, session: str, name: str) -> DatasetInfo | None:
        with self._write() as con:
            old = self._row(con, session, name)
            if old is not None:
                self._delete_rows(con, session, name)
        return old

    def sessions(self) -> builtins.list[str]:
        with self._connect() as con:
            return [r[0] for r in con.execute("SELECT DISTINCT session FROM datasets ORDER BY session")]

    def touch(self, session: str, name: str, when: float | None = None) -> None:
        with self._connect() as con:
            con.execute(
                "UPDATE datasets SET accessed=? WHERE session=? AND name=?",
                (time.time() if when is None else when, session, name),
            )

    def set_pinned(self, session: str, name: str, pinned: bool) -> bool:
        with self._connect() as con:
            cur = con.execute("UPDATE datasets SET pinned=? WHERE session=? AND name=?", (int(pinned), session, name))
            return cur.rowcount == 1

    def relocate(
        self, session: str, name: str, version: str, old_location: str, new_location: str, unless_pinned: bool = False
    ) -> bool:
        with self._connect() as con:
            cur = con.execute(
                "UPDATE datasets SET location=? WHERE session=? AND name=? AND version=? AND location=?"
                + (" AND pinned=0" if unless_pinned else ""),
                (new_location, session, name, version, old_location),
            )
            return cur.rowcount == 1

    def relocate_partitions(
        self, session: str, name: str, version: str, moves: dict[int, tuple[str, str]], unless_pinned: bool = False
    ) -> bool:
        with self._write() as con:
            info = self._row(con, session, name)
            if info is None or info.version != version or (unless_pinned and info.pinned):
                return False
            places = moved_places(info, moves)
            if places is None:
                return False
            con.executemany(
                "UPDATE partitions SET place=? WHERE session=? AND name=? AND idx=?",
                [(json.dumps(place) if place else "", session, name, i) for i, place in places.items()],
            )
            return True


def moved_places(info: DatasetInfo, moves: dict[int, tuple[str, str]]) -> dict[int, dict[str, str]] | None:
    """The partitions' new ``place`` fields after ``moves`` (index → (old, new) directory), or
    None when one is no longer at its old directory (a compare-and-set lost)."""
    places = {}
    for i, (old, new) in moves.items():
        if not 0 <= i < info.num_partitions or info.location_of(i) != old:
            return None
        place = info.partitions[i].place
        place.pop("location", None)
        if new != info.location:
            place["location"] = new
        places[i] = place
    return places


def open_metadata(url: str | Path | MetadataBackend) -> MetadataBackend:
    """``sqlite:///path`` or a plain path → SQLite; ``redis://host:port/db`` → Redis."""
    if isinstance(url, MetadataBackend):
        return url
    text = str(url)
    scheme = text.split("://", 1)[0] if "://" in text else "sqlite"
    backend: MetadataBackend = metadata_backends.load(scheme)(text)
    return backend


metadata_backends = Registry("store metadata backend", group="phalanx.metadata")
metadata_backends.register("sqlite", "phalanx.store.metadata:SQLiteMetadata")
metadata_backends.register("redis", "phalanx.store.redis_metadata:RedisMetadata", extra="redis")
metadata_backends.register("rediss", "phalanx.store.redis_metadata:RedisMetadata", extra="redis")
