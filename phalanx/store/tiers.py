"""Where partition payloads live: a directory on shared memory, a local disk or a shared FS.

Each partition is one uncompressed Arrow IPC file, so a reader memory-maps it and gets the
table without copying (Vineyard's model).  A put writes into a staging directory that is
renamed into place when the dataset is sealed: readers never see half a dataset.
"""

from __future__ import annotations

import getpass
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import xxhash

CHECKSUM = "xxh3_64"


def default_root() -> Path:
    """Shared memory when the machine has it (the fast tier on one host), else the temp dir."""
    env = os.environ.get("PHALANX_STORE")
    if env:
        return Path(env)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"phalanx-{getpass.getuser()}" / "store"


def checksum_file(path: Path) -> str:
    with pa.memory_map(str(path)) as f:
        buf = f.read_buffer()
    return xxhash.xxh3_64_hexdigest(memoryview(buf))


class FileTier:
    """A directory tree: ``<root>/<session>/<name>/v<version>/part-00000.arrow``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def staging_dir(self, session: str, staging_id: str) -> Path:
        return self.root / session / ".staging" / staging_id

    def final_dir(self, session: str, name: str, version: int) -> Path:
        return self.root / session / name / f"v{version}"

    @staticmethod
    def part_file(index: int) -> str:
        return f"part-{index:05d}.arrow"

    def write_partition(self, directory: Path, index: int, table: pa.Table) -> tuple[int, str]:
        """Write one partition; returns (bytes, checksum)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / self.part_file(index)
        with pa.OSFile(str(path), "wb") as sink:
            with ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
        return path.stat().st_size, checksum_file(path)

    def open_partition(self, path: Path) -> pa.Table:
        """Memory-mapped and zero-copy: the table's buffers point into the file."""
        with pa.memory_map(str(path)) as source:
            return ipc.open_file(source).read_all()

    def commit(self, staging: Path, final: Path) -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, final)  # atomic within one filesystem

    def remove(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)
