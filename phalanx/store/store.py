"""``px.Store``: the intermediate store seen from outside a gang (and the base of env.store).

Datasets are immutable once sealed, written as one partition file per producer rank, and
named within a *session* so two workflows never see each other's names.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa

from ..errors import ChecksumError, DatasetExistsError, DatasetNotFoundError, StoreError
from .metadata import DatasetInfo, MetadataBackend, PartitionInfo, SQLiteMetadata
from .tiers import FileTier, checksum_file, default_root

DEFAULT_SESSION = "default"


class Store:
    """A store rooted at a directory: ``/dev/shm/phalanx-$USER/store`` by default."""

    def __init__(self, root: str | Path | None = None, session: str = DEFAULT_SESSION,
                 metadata: MetadataBackend | None = None):
        if not session or "/" in session or session.startswith("."):
            raise ValueError(f"bad session name {session!r}")
        self.root = Path(root) if root else default_root()
        self.session = session
        self.tier = FileTier(self.root)
        self.meta = metadata or SQLiteMetadata(self.root / "meta.sqlite")

    def for_session(self, session: str) -> "Store":
        return Store(self.root, session, self.meta)

    def __repr__(self) -> str:
        return f"<phalanx.Store {self.root} session={self.session!r}>"

    # ---- inspection ---------------------------------------------------------------------
    def list(self) -> list[str]:
        return [d.name for d in self.meta.list(self.session)]

    def exists(self, name: str) -> bool:
        return self.meta.get(self.session, name) is not None

    def info(self, name: str) -> DatasetInfo:
        info = self.meta.get(self.session, name)
        if info is None:
            known = ", ".join(self.list()) or "none"
            raise DatasetNotFoundError(
                f"store {self.root} session {self.session!r}: no dataset {name!r} (datasets: {known})")
        return info

    def sessions(self) -> list[str]:
        return self.meta.sessions()

    # ---- reading --------------------------------------------------------------------------
    def partition(self, info: DatasetInfo, index: int, verify: bool = False) -> pa.Table:
        """One partition, memory-mapped (zero-copy); ``verify`` checks its checksum first."""
        part = info.partitions[index]
        path = Path(info.location) / self.tier.part_file(index)
        where = f"dataset {info.name!r} partition {index} ({path})"
        if not path.exists():
            raise StoreError(f"{where} is missing")
        if verify:
            actual = checksum_file(path)
            if actual != part.checksum:
                raise ChecksumError(f"{where}: checksum mismatch (stored {part.checksum}, "
                                    f"file has {actual}); the file was changed or corrupted")
        try:
            table = self.tier.open_partition(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise StoreError(f"{where} is unreadable: {exc}") from None
        if table.num_rows != part.rows:
            raise StoreError(f"{where} has {table.num_rows} rows, the metadata says {part.rows}")
        return table

    def read(self, name: str, columns: Sequence[str] | None = None, verify: bool = True) -> pa.Table:
        """The whole dataset as one table (partitions in order), checksums verified."""
        info = self.info(name)
        tables = [self.partition(info, i, verify) for i in range(info.num_partitions)]
        table = pa.concat_tables(tables) if tables else info.schema.empty_table()
        return table.select(list(columns)) if columns is not None else table

    # ---- writing --------------------------------------------------------------------------
    def put(self, name: str, partitions: pa.Table | Sequence[pa.Table], replace: bool = False,
            producer: str = "", run: str = "", partitioning: dict[str, Any] | None = None) -> DatasetInfo:
        """Write from one process: each table becomes one partition (a gang uses env.store)."""
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
            parts = [self.stage_partition(staging_id, i, t) for i, t in enumerate(tables)]
            return self.seal(name, staging_id, parts, schema, partitioning, producer, run, replace)
        finally:
            self.tier.remove(self.tier.staging_dir(self.session, staging_id))

    def new_staging_id(self, owner: str) -> str:
        return f"{owner}-{uuid.uuid4().hex[:12]}"

    def stage_partition(self, staging_id: str, index: int, table: pa.Table) -> PartitionInfo:
        nbytes, checksum = self.tier.write_partition(
            self.tier.staging_dir(self.session, staging_id), index, table)
        return PartitionInfo(index, table.num_rows, nbytes, checksum)

    def seal(self, name: str, staging_id: str, parts: list[PartitionInfo], schema: pa.Schema,
             partitioning: dict[str, Any] | None, producer: str, run: str, replace: bool) -> DatasetInfo:
        """Publish a staged dataset atomically: move its files into place, then one transaction."""
        staging = self.tier.staging_dir(self.session, staging_id)
        final = self.tier.final_dir(self.session, name, staging_id)
        self.tier.commit(staging, final)
        info = DatasetInfo(self.session, name, staging_id, str(final), schema, parts,
                           partitioning or {"kind": "none"}, producer, run, time.time())
        try:
            old = self.meta.seal(info, replace)
        except FileExistsError:
            self.tier.remove(final)
            raise self._exists(name) from None
        except BaseException:
            self.tier.remove(final)
            raise
        if old is not None:
            self.tier.remove(Path(old.location))
        return info

    def _exists(self, name: str) -> DatasetExistsError:
        return DatasetExistsError(f"store {self.root} session {self.session!r}: dataset {name!r} "
                                  "exists; datasets are immutable (pass replace=True to replace it)")

    # ---- removal ---------------------------------------------------------------------------
    def delete(self, name: str) -> None:
        old = self.meta.delete(self.session, name)
        if old is None:
            raise DatasetNotFoundError(f"store {self.root} session {self.session!r}: no dataset {name!r}")
        self.tier.remove(Path(old.location))

    def delete_session(self) -> int:
        """Remove every dataset of this session; returns how many."""
        names = self.list()
        for name in names:
            self.delete(name)
        self.tier.remove(self.root / self.session)
        return len(names)

    def abort_staging(self, owner: str) -> int:
        """Remove unsealed writes of ``owner`` (a gang id) in every session: a failed put."""
        removed = 0
        for staging in self.root.glob(f"*/.staging/{owner}-*"):
            self.tier.remove(staging)
            removed += 1
        return removed
