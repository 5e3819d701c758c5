"""Where partition payloads live: tiers behind one interface, picked by the store's root URL.

- ``FileTier``: a directory — shared memory (``/dev/shm``, the default), a local disk, or a
  shared file system.  Partitions are memory-mapped when read (zero-copy, Vineyard's model).
  A put writes into ``<root>/<session>/.staging/<id>/`` which is renamed into place when the
  dataset is sealed.
- ``ObjectTier`` (``s3://bucket/prefix``, in ``objectstore.py``): an S3-compatible object store
  through ``pyarrow.fs``.  Object stores cannot rename, so a put writes straight under the
  final key prefix and the metadata seal alone publishes it.

Every partition is one uncompressed Arrow IPC file named ``part-00000.arrow`` inside a
*location* (a directory path or an ``s3://`` prefix) recorded in the dataset's metadata.
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.ipc as ipc
import xxhash

from .._registry import Registry
from ..paths import default_spill_root  # noqa: F401  (re-exported: tests/faults/test_security.py imports it here)
from ..private import create_private, makedirs

CHECKSUM = "xxh3_64"


def checksum_buffer(buf: pa.Buffer | bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(buf))


def checksum_file(path: Path) -> str:
    with pa.memory_map(str(path)) as f:
        buf = f.read_buffer()
    return checksum_buffer(buf)


def part_file(index: int) -> str:
    return f"part-{index:05d}.arrow"


def serialize(table: pa.Table) -> pa.Buffer:
    """One partition as an uncompressed Arrow IPC file, in memory."""
    sink = pa.BufferOutputStream()
    with ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


class Staged(NamedTuple):
    """An unsealed write found by ``Tier.staged``."""

    session: str
    name: str | None     # None where the tier's staging area does not record it (file tier)
    version: str         # the staging id (= the version it would have been sealed as)
    location: str


class Tier(ABC):
    """One place partitions can live.  Locations are strings: a path or an ``s3://`` prefix."""

    kind: str = ""           # "file" | "s3"
    url: str = ""            # the tier's root, as a string
    mmap: bool = False       # reads are memory-mapped (zero-copy) rather than downloaded
    atomic_rename: bool = False  # staging is renamed into place; else written in place

    # ---- layout ----------------------------------------------------------------------------
    @abstractmethod
    def staging(self, session: str, name: str, staging_id: str) -> str:
        """Where a put writes its partitions before the seal."""

    @abstractmethod
    def final(self, session: str, name: str, version: str) -> str:
        """Where a sealed dataset's partitions live."""

    @abstractmethod
    def scratch(self, session: str, tag: str) -> str:
        """A private location to copy into before ``commit`` (moves between tiers)."""

    def owns(self, location: str) -> bool:
        return location.startswith(self.url.rstrip("/") + "/")

    # ---- payload ---------------------------------------------------------------------------
    @abstractmethod
    def write_partition(self, location: str, index: int, table: pa.Table) -> tuple[int, str]:
        """Write one partition; returns (bytes, checksum)."""

    @abstractmethod
    def write_buffer(self, location: str, index: int, buf: pa.Buffer) -> None:
        """Write one partition's bytes as they are (a copy from another tier)."""

    @abstractmethod
    def read_buffer(self, location: str, index: int) -> pa.Buffer:
        """The partition's bytes: memory-mapped on a file tier, downloaded on an object tier.

        Raises FileNotFoundError when it is not there."""

    def open_partition(self, buf: pa.Buffer) -> pa.Table:
        """A table over the partition's bytes without copying them."""
        return ipc.open_file(pa.BufferReader(buf)).read_all()

    @abstractmethod
    def commit(self, staging: str, final: str) -> None:
        """Make a staged location final (a rename, or nothing where staging is in place)."""

    @abstractmethod
    def remove(self, location: str) -> None:
        """Delete a location and everything in it; missing is fine."""

    @abstractmethod
    def remove_session(self, session: str) -> None: ...

    @abstractmethod
    def staged(self, owner: str) -> list[Staged]:
        """Writes whose staging id starts with ``<owner>-`` that may not be sealed."""

    def close(self) -> None:
        pass


class FileTier(Tier):
    """A directory tree: ``<root>/<session>/<name>/v<version>/part-00000.arrow``."""

    kind = "file"
    mmap = True
    atomic_rename = True

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).absolute()
        self.url = str(self.root)

    def __repr__(self) -> str:
        return f"FileTier({self.url})"

    # kept for callers of the first version of the store
    def staging_dir(self, session: str, staging_id: str) -> Path:
        return self.root / session / ".staging" / staging_id

    def final_dir(self, session: str, name: str, version: str) -> Path:
        return self.root / session / name / f"v{version}"

    part_file = staticmethod(part_file)

    def staging(self, session: str, name: str, staging_id: str) -> str:
        return str(self.staging_dir(session, staging_id))

    def final(self, session: str, name: str, version: str) -> str:
        return str(self.final_dir(session, name, version))

    def scratch(self, session: str, tag: str) -> str:
        return str(self.root / session / ".staging" / tag)

    def write_partition(self, location: str, index: int, table: pa.Table) -> tuple[int, str]:
        path = _new_partition(location, index)
        with pa.OSFile(str(path), "wb") as sink:
            with ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
        return path.stat().st_size, checksum_file(path)

    def write_buffer(self, location: str, index: int, buf: pa.Buffer) -> None:
        with pa.OSFile(str(_new_partition(location, index)), "wb") as sink:
            sink.write(buf)

    def read_buffer(self, location: str, index: int) -> pa.Buffer:
        # The buffer keeps the mapping alive; unlinking the file later does not invalidate it.
        with pa.memory_map(str(Path(location) / part_file(index))) as source:
            return source.read_buffer()

    def commit(self, staging: str, final: str) -> None:
        makedirs(Path(final).parent)
        os.rename(staging, final)  # atomic within one filesystem

    def remove(self, location: str) -> None:
        shutil.rmtree(location, ignore_errors=True)

    def remove_session(self, session: str) -> None:
        self.remove(str(self.root / session))

    def staged(self, owner: str) -> list[Staged]:
        return [Staged(p.parent.parent.name, None, p.name, str(p))
                for p in self.root.glob(f"*/.staging/{owner}-*")]


def _new_partition(location: str, index: int) -> Path:
    """The partition's file, created empty and readable by this user only (dirs 0700)."""
    return create_private(makedirs(location) / part_file(index), truncate=True)


tiers = Registry("store tier", group="phalanx.tiers")
tiers.register("file", "phalanx.store.tiers:FileTier")
tiers.register("s3", "phalanx.store.objectstore:ObjectTier")


def open_tier(root: str | os.PathLike) -> Tier:
    """``/a/dir`` or ``file:///a/dir`` → FileTier; ``s3://bucket/prefix?...`` → ObjectTier."""
    text = os.fspath(root)
    scheme = text.split("://", 1)[0] if "://" in text else "file"
    if scheme == "file" and text.startswith("file://"):
        text = text[len("file://"):]
    return tiers.load(scheme)(text)
