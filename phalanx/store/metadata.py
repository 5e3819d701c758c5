"""Dataset metadata, kept apart from the payload: SQLite beside it by default.

A dataset row is inserted in the same transaction as its partitions when the dataset is
sealed, so a reader that finds the name finds all of it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa


@dataclass
class PartitionInfo:
    index: int
    rows: int
    bytes: int
    checksum: str


@dataclass
class DatasetInfo:
    session: str
    name: str
    version: str                 # unique id of the put that sealed it (also its directory)
    location: str                # directory of the partition files
    schema: pa.Schema
    partitions: list[PartitionInfo]
    partitioning: dict[str, Any] = field(default_factory=lambda: {"kind": "none"})
    producer: str = ""
    run: str = ""
    created: float = 0.0
    pinned: bool = False

    @property
    def num_rows(self) -> int:
        return sum(p.rows for p in self.partitions)

    @property
    def nbytes(self) -> int:
        return sum(p.bytes for p in self.partitions)

    @property
    def num_partitions(self) -> int:
        return len(self.partitions)

    def summary(self) -> dict[str, Any]:
        """Plain values for printing or JSON."""
        return {
            "name": self.name, "session": self.session, "version": self.version,
            "rows": self.num_rows, "bytes": self.nbytes, "partitions": self.num_partitions,
            "rows_per_partition": [p.rows for p in self.partitions],
            "checksums": [p.checksum for p in self.partitions],
            "partitioning": self.partitioning, "producer": self.producer, "run": self.run,
            "created": self.created, "schema": {f.name: str(f.type) for f in self.schema},
            "location": self.location, "pinned": self.pinned,
        }


class MetadataBackend(ABC):
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
    def sessions(self) -> list[str]: ...


_SCHEMA = """
CREATE TABLE IF NOT EXISTS datasets (
    session TEXT NOT NULL, name TEXT NOT NULL, version TEXT NOT NULL, location TEXT NOT NULL,
    schema BLOB NOT NULL, partitioning TEXT NOT NULL, producer TEXT, run TEXT,
    created REAL NOT NULL, pinned INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session, name));
CREATE TABLE IF NOT EXISTS partitions (
    session TEXT NOT NULL, name TEXT NOT NULL, idx INTEGER NOT NULL, rows INTEGER NOT NULL,
    bytes INTEGER NOT NULL, checksum TEXT NOT NULL, PRIMARY KEY (session, name, idx));
"""


class SQLiteMetadata(MetadataBackend):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as con:
            con.executescript(_SCHEMA)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # A connection per call: safe across the threads and processes of a gang.
        con = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            yield con
        finally:
            con.close()

    def _info(self, con: sqlite3.Connection, row: tuple) -> DatasetInfo:
        session, name, version, location, schema, partitioning, producer, run, created, pinned = row
        parts = [PartitionInfo(*p) for p in con.execute(
            "SELECT idx, rows, bytes, checksum FROM partitions WHERE session=? AND name=? ORDER BY idx",
            (session, name))]
        return DatasetInfo(session, name, version, location, pa.ipc.read_schema(pa.py_buffer(schema)),
                           parts, json.loads(partitioning), producer or "", run or "", created, bool(pinned))

    _COLS = "session, name, version, location, schema, partitioning, producer, run, created, pinned"

    def get(self, session: str, name: str) -> DatasetInfo | None:
        with self._connect() as con:
            row = con.execute(f"SELECT {self._COLS} FROM datasets WHERE session=? AND name=?",
                              (session, name)).fetchone()
            return self._info(con, row) if row else None

    def list(self, session: str) -> list[DatasetInfo]:
        with self._connect() as con:
            rows = con.execute(f"SELECT {self._COLS} FROM datasets WHERE session=? ORDER BY name",
                               (session,)).fetchall()
            return [self._info(con, r) for r in rows]

    def seal(self, info: DatasetInfo, replace: bool) -> DatasetInfo | None:
        with self._connect() as con:
            con.execute("BEGIN IMMEDIATE")  # one writer at a time: check and insert together
            try:
                row = con.execute(f"SELECT {self._COLS} FROM datasets WHERE session=? AND name=?",
                                  (info.session, info.name)).fetchone()
                old = self._info(con, row) if row else None
                if old is not None and not replace:
                    raise FileExistsError(info.name)
                if old is not None:
                    self._delete_rows(con, info.session, info.name)
                con.execute(
                    f"INSERT INTO datasets ({self._COLS}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                    (info.session, info.name, info.version, info.location,
                     info.schema.serialize().to_pybytes(), json.dumps(info.partitioning),
                     info.producer, info.run, info.created or time.time(), int(info.pinned)))
                con.executemany(
                    "INSERT INTO partitions VALUES (?,?,?,?,?,?)",
                    [(info.session, info.name, p.index, p.rows, p.bytes, p.checksum) for p in info.partitions])
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise
            return old

    @staticmethod
    def _delete_rows(con: sqlite3.Connection, session: str, name: str) -> None:
        con.execute("DELETE FROM datasets WHERE session=? AND name=?", (session, name))
        con.execute("DELETE FROM partitions WHERE session=? AND name=?", (session, name))

    def delete(self, session: str, name: str) -> DatasetInfo | None:
        with self._connect() as con:
            con.execute("BEGIN IMMEDIATE")
            row = con.execute(f"SELECT {self._COLS} FROM datasets WHERE session=? AND name=?",
                              (session, name)).fetchone()
            old = self._info(con, row) if row else None
            if old is not None:
                self._delete_rows(con, session, name)
            con.execute("COMMIT")
            return old

    def sessions(self) -> list[str]:
        with self._connect() as con:
            return [r[0] for r in con.execute("SELECT DISTINCT session FROM datasets ORDER BY session")]
