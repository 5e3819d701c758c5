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

import errno
import os
import pwd
import stat
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.ipc as ipc
import xxhash

from .._registry import Registry
from ..errors import UnsafePathError
from ..paths import default_spill_root  # noqa: F401  (re-exported: tests/faults/test_security.py imports it here)
from ..private import FILE_MODE, create_private, makedirs

CHECKSUM = "xxh3_64"
CHUNK = 64 << 20  # bytes of a partition in memory at once where one is streamed (a crossing)
ROOT_ID_FILE = ".root-id"  # FileTier.root_id


def checksum_buffer(buf: pa.Buffer | bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(buf))


def checksum_file(path: Path) -> str:
    with pa.memory_map(str(path)) as f:
        buf = f.read_buffer()
    return checksum_buffer(buf)


class HashingSink:
    """A write-only file for ``pa.PythonFile`` that writes to ``fd`` and computes the xxh3-64
    of everything written on the way (the same digest as ``checksum_buffer`` of the file).

    A large write (a column's buffer, handed over by the IPC writer without a copy) is hashed
    and written ``PIECE`` bytes at a time, so each piece is read from memory once and is still
    in cache when the kernel copies it into the file; small writes (IPC metadata, padding) are
    gathered and written together.  Errors (ENOSPC) propagate out of the IPC writer."""

    PIECE = 1 << 20  # hash a piece, then write it while it is in cache (chosen by measurement)
    SMALL = 64 << 10  # writes below this are gathered

    closed = False

    def __init__(self, fd: int):
        self.fd = fd
        self.size = 0
        self._hash = xxhash.xxh3_64()
        self._small = bytearray()

    def write(self, data: bytes | bytearray | memoryview | pa.Buffer) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = view.nbytes
        if n < self.SMALL:
            self._small += view
            if len(self._small) >= self.SMALL:
                self._flush_small()
        else:
            self._flush_small()
            self._out(view)
        self.size += n
        return n

    def _out(self, view: memoryview) -> None:
        fd, update, piece = self.fd, self._hash.update, self.PIECE
        for off in range(0, len(view), piece):
            chunk = view[off : off + piece]
            update(chunk)
            _write_all(fd, chunk)

    def _flush_small(self) -> None:
        if self._small:
            small, self._small = self._small, bytearray()
            self._out(memoryview(small))

    def flush(self) -> None:
        self._flush_small()

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        # The owner flushes and closes the descriptor (write_partition); a close from the
        # PythonFile wrapper later (garbage collection) must write nothing.
        self.closed = True

    def hexdigest(self) -> str:
        if self._small:
            raise RuntimeError("HashingSink: flush() before hexdigest()")
        return self._hash.hexdigest()


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


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
    name: str | None  # None where the tier's staging area does not record it (file tier)
    version: str  # the staging id (= the version it would have been sealed as)
    location: str


class Tier(ABC):
    """One place partitions can live.  Locations are strings: a path or an ``s3://`` prefix."""

    kind: str = ""  # "file" | "s3"
    url: str = ""  # the tier's root, as a string
    mmap: bool = False  # reads are memory-mapped (zero-copy) rather than downloaded
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

    @property
    def root_url(self) -> str:
        """The root as ``open_tier`` reopens it in another process (what a gang's ranks get
        through ``PHALANX_STORE``): ``url`` unless the tier's options travel in the URL too."""
        return self.url

    @property
    def local_root(self) -> Path | None:
        """The tier's root as a directory of this host, or None (an object store).  The store
        keeps what only a directory can hold beside it: the default SQLite metadata, retired
        versions awaiting removal, and the memory a budget limits."""
        return None

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

    def read_chunks(self, location: str, index: int, size: int = CHUNK) -> Iterator[pa.Buffer]:
        """The partition's bytes, ``size`` at a time (a stream: a crossing holds one chunk).
        This default slices ``read_buffer`` (zero-copy where it maps the file)."""
        buf = self.read_buffer(location, index)
        for at in range(0, buf.size, size):
            yield buf.slice(at, min(size, buf.size - at))

    def write_chunks(self, location: str, index: int, chunks: Iterable[pa.Buffer | memoryview]) -> None:
        """Write one partition's bytes as they come (a copy from another store, streamed); when
        ``chunks`` raises, nothing of the partition stays.  This default gathers them and calls
        ``write_buffer``."""
        self.write_buffer(location, index, pa.py_buffer(b"".join(bytes(c) for c in chunks)))

    def open_partition(self, buf: pa.Buffer) -> pa.Table:
        """A table over the partition's bytes without copying them."""
        return ipc.open_file(pa.BufferReader(buf)).read_all()

    def share_partition(self, src: Tier, src_location: str, index: int, location: str) -> str:
        """Make partition ``index`` of ``src_location`` (on tier ``src``) partition ``index`` of
        ``location`` on this tier, sharing its bytes where the tiers can (a hard link, a
        server-side copy), else copying them; returns how ("link", "server-side copy" or
        "copy").  The source is never written, and removing either leaves the other whole
        (``Store.adopt``: an earlier run's outputs reused)."""
        self.write_buffer(location, index, src.read_buffer(src_location, index))
        return "copy"

    @abstractmethod
    def commit(self, staging: str, final: str) -> None:
        """Make a staged location final (a rename, or nothing where staging is in place)."""

    @abstractmethod
    def remove(self, location: str) -> None:
        """Delete a location and everything in it; missing is fine.  The store passes only a
        location the tier ``owns``, but it may come from the metadata or from ``.retired``,
        which another user may be able to write: a tier that can reach outside its root (a
        directory: ``..``, symbolic links) must refuse such a location (``UnsafePathError``),
        as ``FileTier`` does with ``remove_under``."""

    def remove_partition(self, location: str, index: int) -> None:
        """Delete partition ``index`` of ``location``, leaving the others there (a partition
        that moved apart from its dataset's other partitions of the host: spill across hosts);
        missing is fine.  The same care as ``remove``."""
        raise NotImplementedError(f"{type(self).__name__} cannot remove one partition")

    @abstractmethod
    def remove_session(self, session: str) -> None: ...

    @abstractmethod
    def staged(self, owner: str) -> list[Staged]:
        """Writes whose staging id starts with ``<owner>-`` that may not be sealed."""

    @abstractmethod
    def usage(self, location: str) -> tuple[int, float]:
        """Bytes under ``location`` and when it was last written (seconds since the epoch)."""

    def close(self) -> None:
        pass


class FileTier(Tier):
    """A directory tree: ``<root>/<session>/<name>/v<version>/part-00000.arrow``."""

    kind = "file"
    mmap = True
    atomic_rename = True

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).absolute()
        self.url = str(self.root)
        self._root_id: str | None = None

    def __repr__(self) -> str:
        return f"FileTier({self.url})"

    def root_id(self) -> str:
        """This root's identity: a random id in ``<root>/.root-id``, made by its first user.
        Two processes see the same files exactly when they read the same id — ranks on one
        host, or on hosts that mount one shared file system — while the same path on hosts
        with their own ``/dev/shm`` gives different ids (the store then spans hosts)."""
        if self._root_id is None:
            path = makedirs(self.root) / ROOT_ID_FILE
            tmp = path.with_name(f".{ROOT_ID_FILE}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
            try:
                os.write(fd, uuid.uuid4().hex.encode())
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # publishes it whole, or finds the one another process made
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                check_mine(path, os.fstat(fd))
                self._root_id = os.read(fd, 64).decode().strip()
            finally:
                os.close(fd)
        return self._root_id

    @property
    def local_root(self) -> Path:
        return self.root

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
        # One pass over the rows: the IPC writer hands each buffer of the table (no copy) to a
        # HashingSink, which hashes it and writes it to the file a cache-sized piece at a time
        # (docs/store.md, "Put").  The file is never read back.
        fd = os.open(_new_partition(location, index), os.O_WRONLY)
        sink = HashingSink(fd)
        try:
            with ipc.new_file(pa.PythonFile(sink, mode="w"), table.schema) as writer:
                writer.write_table(table)
            sink.flush()
        finally:
            sink.fd = -1  # nothing can write through a descriptor number that is reused later
            os.close(fd)
        return sink.size, sink.hexdigest()

    def write_buffer(self, location: str, index: int, buf: pa.Buffer) -> None:
        self.write_chunks(location, index, [buf])

    def write_chunks(self, location: str, index: int, chunks: Iterable[pa.Buffer | memoryview]) -> None:
        path = _new_partition(location, index)
        fd = os.open(path, os.O_WRONLY)
        try:
            for chunk in chunks:
                _write_all(fd, memoryview(chunk))
        except BaseException:  # a source that failed midway (or its checksum): no partial file stays
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    def share_partition(self, src: Tier, src_location: str, index: int, location: str) -> str:
        """A hard link where both are directories of one file system (no byte copied; the
        inode lives until its last link goes), else a copy.  The link must be a regular file
        of this user's (a location read from metadata another user could write names nothing
        else)."""
        if not isinstance(src, FileTier):
            return super().share_partition(src, src_location, index, location)
        target = makedirs(location) / part_file(index)
        try:
            os.link(Path(src_location) / part_file(index), target, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP):
                raise  # FileNotFoundError: the source moved or went meanwhile
            return super().share_partition(src, src_location, index, location)  # another file system
        st = os.lstat(target)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            target.unlink()
            check_mine(target, st)
            raise UnsafePathError(f"{Path(src_location) / part_file(index)} is not a regular file")
        return "link"

    def read_buffer(self, location: str, index: int) -> pa.Buffer:
        # The buffer keeps the mapping alive; unlinking the file later does not invalidate it.
        with pa.memory_map(str(Path(location) / part_file(index))) as source:
            return source.read_buffer()

    def commit(self, staging: str, final: str) -> None:
        makedirs(Path(final).parent)
        os.rename(staging, final)  # atomic within one filesystem

    def remove(self, location: str) -> None:
        remove_under(self.root, location)

    def remove_partition(self, location: str, index: int) -> None:
        """The partition's file, then its directory if that was the last one in it."""
        remove_under(self.root, location, only=part_file(index))

    def remove_session(self, session: str) -> None:
        self.remove(str(self.root / session))

    def staged(self, owner: str) -> list[Staged]:
        return [Staged(p.parent.parent.name, None, p.name, str(p)) for p in self.root.glob(f"*/.staging/{owner}-*")]

    def usage(self, location: str) -> tuple[int, float]:
        nbytes, written = 0, 0.0
        for path in (Path(location), *Path(location).rglob("*")):
            try:
                st = path.stat()
            except FileNotFoundError:  # sealed or removed while we looked
                continue
            nbytes += st.st_size if stat.S_ISREG(st.st_mode) else 0
            written = max(written, st.st_mtime)
        return nbytes, written


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "an unknown user"


def check_mine(path: str | os.PathLike[str], st: os.stat_result) -> None:
    """Raise ``UnsafePathError`` unless ``st`` (of ``path``) is owned by this user."""
    me = os.getuid()
    if st.st_uid != me:
        raise UnsafePathError(
            f"{path} is owned by {_user(st.st_uid)} (uid {st.st_uid}), not by you ({_user(me)}, uid {me})"
        )


def remove_under(root: Path, location: str, only: str | None = None) -> None:
    """``rm -r location``, which must be a directory under ``root`` owned by this user, as is
    every directory between them; a missing one is nothing to do.  ``only``: remove just that
    file in it (not a link: unlinked as it is), then the directory if it is empty.

    Locations are read from places another user may be able to write — the metadata, a file
    under ``<root>/.retired`` — when the root is a group-shared directory, so one must not be
    able to name anything else: the path is checked inside ``root`` without following ``..``,
    then walked from ``root`` one directory at a time without following a symbolic link
    (``O_NOFOLLOW``), each directory checked to be this user's (so nobody else can swap a
    name in it before the removal, which itself follows no link and enters no directory of
    someone else's: ``_rmtree_at``).  Raises
    ``UnsafePathError`` naming the location and why."""
    where = Path(location)
    names = where.relative_to(root).parts if where.is_absolute() and where.is_relative_to(root) else ()
    if not names or ".." in names:
        raise UnsafePathError(f"refusing to remove {location}: it is not inside the store root {root}")
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # no root: nothing to remove
        return
    here = root
    try:
        for i, name in enumerate(names):
            here = here / name
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise UnsafePathError(f"{here} is a symbolic link (to {os.readlink(name, dir_fd=fd)})")
            if not stat.S_ISDIR(st.st_mode):
                raise UnsafePathError(f"{here} is not a directory")
            check_mine(here, st)
            if i == len(names) - 1:
                _rmtree_at(fd, name, here, only)
                return
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # became a link or a file meanwhile
                    raise UnsafePathError(f"{here} is no longer a directory") from None
                raise
            os.close(fd)
            fd = sub
            if not os.path.samestat(st, os.fstat(fd)):
                raise UnsafePathError(f"{here} was replaced while it was checked")
    except UnsafePathError as exc:
        raise UnsafePathError(f"refusing to remove {location}: {exc}") from None
    except OSError:  # e.g. removed by another process meanwhile: as rmtree(ignore_errors=True)
        return
    finally:
        os.close(fd)


def _rmtree_at(parent: int, name: str, path: Path, only: str | None = None) -> None:
    """``rm -r`` of ``name`` (``path``) in the directory open as ``parent``, following no link
    (as ``shutil.rmtree(name, dir_fd=parent)`` does from Python 3.11) and entering only
    directories of this user's (``UnsafePathError`` naming one that is not); an entry removed
    meanwhile is skipped.  ``only``: just that file in it, then the directory if that left it
    empty."""
    if only is not None and ("/" in only or only in ("", ".", "..")):
        raise UnsafePathError(f"{path}/{only} is not a file name")
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except FileNotFoundError:
        return
    try:
        check_mine(path, os.fstat(fd))
        if only is None:
            with os.scandir(fd) as entries:
                inside = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        else:
            inside = [(only, False)]  # unlinked as it is (a link is not followed)
        for sub, is_dir in inside:
            try:
                if is_dir:
                    _rmtree_at(fd, sub, path / sub)
                else:
                    os.unlink(sub, dir_fd=fd)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if only is None or exc.errno != errno.ENOTEMPTY:  # others of ``only``'s are still in it
            raise


def _new_partition(location: str, index: int) -> Path:
    """The partition's file, created empty and readable by this user only (dirs 0700)."""
    return create_private(makedirs(location) / part_file(index), truncate=True)


tiers = Registry("store tier", group="phalanx.tiers")
tiers.register("file", "phalanx.store.tiers:FileTier")
tiers.register("s3", "phalanx.store.objectstore:ObjectTier")


def open_tier(root: str | os.PathLike[str]) -> Tier:
    """``/a/dir`` or ``file:///a/dir`` → FileTier; ``s3://bucket/prefix?...`` → ObjectTier."""
    text = os.fspath(root)
    scheme = text.split("://", 1)[0] if "://" in text else "file"
    if scheme == "file" and text.startswith("file://"):
        text = text[len("file://") :]
    tier: Tier = tiers.load(scheme)(text)
    return tier
