"""Shared-memory exchange for ranks on one host (``communicator: shm``; also the intra-host data
path of ``tcp`` and ``gloo`` when every rank of the gang shares a host).

Each rank writes what it sends to its co-located peers **once**, into a shared-memory segment
(a file under tmpfs, mapped ``MAP_SHARED``); the peers map that file and read their pieces in
place — Arrow IPC streams they open zero-copy, so a received table *is* the sender's bytes.
The communicator's own wire (TCP sockets for ``tcp``/``shm``, Gloo for ``gloo``) carries only
the control message: one fixed-width all-to-all per exchange saying where each piece lies.
Peers on other hosts (hierarchical gangs) get their pieces through the wire's alltoallv in the
same exchange.  ``ShmDataPath`` is the communicator base that uses it.

Segments
    A rank owns a small pool of segments (up to 62 slots) that it reuses: writing into pages
    that are already allocated and mapped runs at memcpy speed, while a fresh tmpfs file costs
    a page fault and a zeroed page per 4 KiB (5–10× slower on this VM).  A segment may be
    rewritten only when no peer still holds a view of it: with every control message, each rank
    tells each peer which of that peer's slots it still has live views of (a bit mask; received
    tables, memoryviews and arrays keep their mapping — and the slot — alive).  Since that
    report is written before the peer maps the current exchange, a slot used in exchange *k* is
    reusable from exchange *k + 2* on.  A segment larger than ``PHALANX_SHM_POOL_MAX`` (1 GiB)
    is used once: its memory goes when the last view of it goes.

Names and cleanup
    Files are created 0600 with ``O_EXCL`` as ``<dir>/<rank>-<slot>-<generation>`` in a per-gang
    directory: under the store's staging area (``<store root>/<session>/.staging/<gang id>-shm-
    <nonce>``) when the store root is on tmpfs — so the driver's ``abort_staging`` of a failed
    gang removes what a killed rank left — else ``/dev/shm/phalanx-<user>/exchange/<gang id>-…``
    (or ``PHALANX_SHM_DIR``).  A new file is unlinked as soon as every peer has mapped it (one
    barrier, only in exchanges that created a segment), and the last rank to leave removes the
    directory: in steady state nothing of the exchange is visible in the file system, and the
    memory of a killed gang is freed by the kernel when its processes are gone.

Full shared memory
    A segment is allocated with ``posix_fallocate`` (ENOSPC now, not SIGBUS on a later write).
    When it does not fit (the file system's free space, or ``PHALANX_SHM_LIMIT`` bytes per rank),
    that exchange goes through the wire instead, on every rank, with a warning naming the size
    and the directory; ``PHALANX_SHM_FALLBACK=0`` makes it an error instead.

``PHALANX_SHM=0`` turns the shared-memory path off for ``tcp`` and ``gloo``.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import uuid
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ...errors import PhalanxError
from ...paths import default_shm_root, default_store_root
from ..envvars import (
    ENV_GANG_ID,
    ENV_SHM,
    ENV_SHM_DIR,
    ENV_SHM_FALLBACK,
    ENV_SHM_HOSTS,
    ENV_SHM_LIMIT,
    ENV_SHM_POOL_MAX,
    ENV_STORE_SESSION,
)
from .base import Communicator

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)


ALIGN = 64  # pieces start 64-byte aligned (Arrow buffers stay aligned)
POOL_SLOTS = 62  # slots 0..61 are reusable; the held mask is one int64
ONE_SHOT = 63  # the slot number of a segment used once
MiB = 1 << 20
# control words, per (source, destination)
W = 8
F_FLAG, F_SLOT, F_GEN, F_SIZE, F_OFF, F_LEN, F_HELD, F_NEW = range(W)
FLAG_OK, FLAG_NO_SPACE = 0, 1


class ShmSpaceError(PhalanxError, OSError):
    """A segment did not fit in shared memory (and the fallback to the communicator's wire is off)."""


class _NoSpace(Exception):
    pass


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


D = TypeVar("D", int, None)  # an environment variable's default


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def _env_bytes(name: str, default: D) -> int | D:
    text = os.environ.get(name, "").strip()
    return int(float(text)) if text else default


def _on_tmpfs(path: Path) -> bool:
    """Whether ``path`` (or its nearest existing ancestor) lies on a tmpfs mount."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best, fstype = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, fields[2]
    except OSError:
        return False
    return fstype == "tmpfs"


def host_id() -> str:
    """Ranks with the same id share a host's shared memory: hostname and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"


def segment_dir(tag: str) -> Path:
    """The per-gang directory segments are created in (see the module's docstring)."""
    explicit = os.environ.get(ENV_SHM_DIR)
    if explicit:
        return Path(explicit) / tag
    store = str(default_store_root())
    if "://" not in store and _on_tmpfs(Path(store)):
        session = os.environ.get(ENV_STORE_SESSION) or "default"
        return Path(store) / session / ".staging" / tag
    root = default_shm_root()
    if root is None:
        raise PhalanxError(
            f"no shared memory for the exchange: {store} is not on tmpfs and this "
            f"machine has no /dev/shm; set {ENV_SHM_DIR} to a tmpfs directory"
        )
    return root / "exchange" / tag


def _makedirs(path: Path) -> None:
    """``mkdir -p`` with new directories 0700."""
    todo = []
    p = path
    while not p.exists() and p != p.parent:
        todo.append(p)
        p = p.parent
    for d in reversed(todo):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass


class _Segment:
    """One of this rank's segments (writable mapping)."""

    __slots__ = ("slot", "gen", "size", "path", "mm", "buf", "last_used", "held", "linked")

    def __init__(self, slot: int, gen: int, size: int, path: Path, mm: mmap.mmap):
        self.slot, self.gen, self.size, self.path, self.mm = slot, gen, size, path, mm
        self.buf: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8)  # None once unmapped
        self.last_used = -10
        self.held = 0  # bit mask of peers that still hold views of it
        self.linked = True  # its name is still in the directory

    def unmap(self) -> None:
        """Drop this rank's writable mapping of the segment (a view still held keeps it alive)."""
        self.buf = None
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # a caller still holds a view: the mapping goes with it


class _Mapped:
    """A peer's segment as mapped here (read-only), and the views handed out of it."""

    __slots__ = ("gen", "mm", "views")

    def __init__(self, gen: int, mm: mmap.mmap):
        self.gen, self.mm = gen, mm
        self.views: list[weakref.ref[Any]] = []

    def held(self) -> bool:
        self.views = [w for w in self.views if w() is not None]
        return bool(self.views)


class ShmEngine:
    """The shared-memory data path of a communicator (``comm``, a ``ShmDataPath``)."""

    def __init__(self, comm: ShmDataPath, hosts: list[str], tag: str, hierarchical: bool):
        self.comm = comm
        self.rank, self.n = comm.rank, comm.world_size
        self.local = [h == hosts[self.rank] for h in hosts]
        self.multi_host = len(set(hosts)) > 1
        self.hierarchical = hierarchical
        self.dir = segment_dir(tag)
        self.limit = _env_bytes(ENV_SHM_LIMIT, None)
        self.pool_max = _env_bytes(ENV_SHM_POOL_MAX, 1 << 30)
        self.fallback = os.environ.get(ENV_SHM_FALLBACK, "1").strip().lower() not in ("0", "false", "no", "off")
        self.seq = 0
        self.gen = 0
        self.pool: dict[int, _Segment] = {}
        self.one_shot: list[_Segment] = []  # created this exchange, until unlinked
        self.maps: list[dict[int, _Mapped]] = [{} for _ in range(self.n)]
        self.recv_bufs: list[tuple[np.ndarray, weakref.ref[Any] | None]] = []  # alltoallv's, reused
        self.stats = {"exchanges": 0, "segments_created": 0, "bytes_created": 0, "fallbacks": 0}

    # ---- construction (collective) ------------------------------------------------------
    @classmethod
    def start(cls, comm: ShmDataPath, required: bool) -> ShmEngine | None:
        """Compare host ids (one allgather); None where no two ranks share a host (or, unless
        ``required``, where the gang spans hosts or shared memory is unusable here)."""
        labels = os.environ.get(ENV_SHM_HOSTS)
        mine = labels.split(",")[comm.rank] if labels else host_id()
        gang = os.environ.get(ENV_GANG_ID) or "comm"
        nonce = uuid.uuid4().hex[:8] if comm.rank == 0 else None
        problem = None
        try:
            segment_dir("probe")
        except PhalanxError as exc:
            problem = str(exc)
        infos = comm.allgather_obj((mine, nonce, problem))
        hosts = [i[0] for i in infos]
        problems = [f"rank {r}: {i[2]}" for r, i in enumerate(infos) if i[2]]
        if problems:
            if required:
                raise PhalanxError("communicator shm: " + "; ".join(problems))
            return None
        if len(set(hosts)) == len(hosts) or (not required and len(set(hosts)) > 1):
            return None
        tag = f"{gang}-shm-{infos[0][1]}"
        unseen = _probe(comm, hosts, segment_dir(tag), infos[0][1])
        if unseen:  # one kernel, but not one shared memory (containers: a /dev/shm of their own)
            if required:
                raise PhalanxError(
                    f"communicator shm: ranks on one host do not share {segment_dir(tag)}: "
                    + "; ".join(unseen)
                    + f" (set {ENV_SHM_DIR} to a tmpfs directory they share)"
                )
            return None
        return cls(comm, hosts, tag, hierarchical=required)

    # ---- the exchange ------------------------------------------------------------------
    def exchange_pieces(self, sizes: Sequence[int], fill: Callable[[int, np.ndarray], None]) -> list[np.ndarray | None]:
        """Every rank sends ``sizes[d]`` bytes to rank d (``sizes[rank]`` is not sent), which
        ``fill(d, out)`` writes into the uint8 array ``out``.  Returns, per source rank, a
        read-only uint8 array of what it sent here — a view into its shared-memory segment for
        a co-located source — and None for this rank itself."""
        n, me = self.n, self.rank
        self.seq += 1
        k = self.seq
        self.stats["exchanges"] += 1
        sizes = [int(s) for s in sizes]
        local = [d for d in range(n) if d != me and self.local[d] and sizes[d] > 0]
        offsets: dict[int, int] = {}
        total = 0
        for d in local:
            offsets[d] = total
            total = _align(total + sizes[d])
        seg, new, no_space = None, False, None
        if total:
            try:
                seg, new = self._segment_for(total, k)
            except _NoSpace as exc:
                no_space = str(exc)
        if seg is not None:
            assert seg.buf is not None  # _segment_for hands out mapped segments only
            for d in local:
                fill(d, seg.buf[offsets[d] : offsets[d] + sizes[d]])
            seg.last_used = k
        held = self._held_masks()
        ctrl = np.zeros((n, W), dtype=np.int64)
        ctrl[:, F_FLAG] = FLAG_NO_SPACE if no_space else FLAG_OK
        ctrl[:, F_SLOT] = -1
        for d in range(n):
            ctrl[d, F_HELD] = held[d]
            if seg is not None:
                ctrl[d, F_SLOT], ctrl[d, F_GEN], ctrl[d, F_SIZE], ctrl[d, F_NEW] = seg.slot, seg.gen, seg.size, int(new)
            if d in offsets:
                ctrl[d, F_OFF], ctrl[d, F_LEN] = offsets[d], sizes[d]
        got = self._all_to_all(ctrl)
        for p in range(n):
            if p != me:
                self._note_held(p, int(got[p, F_HELD]))
        short = [p for p in range(n) if got[p, F_FLAG] == FLAG_NO_SPACE]
        if short:
            reasons = self.comm.allgather_obj(no_space)
            why = "; ".join(f"rank {p}: {reasons[p]}" for p in short)
            if not self.fallback:
                self._after_new(got)
                raise ShmSpaceError(
                    errno.ENOSPC,
                    f"shared-memory exchange: {why} ({ENV_SHM_FALLBACK}=0, so no fallback to {self.comm.name}'s wire)",
                )
            if me == short[0]:
                log.warning("shared-memory exchange: %s; this exchange goes through %s's wire", why, self.comm.name)
            self.stats["fallbacks"] += 1
        out: list[np.ndarray | None] = [None] * n
        for p in range(n):
            if p == me or not self.local[p]:
                continue
            r = got[p]
            slot, length = int(r[F_SLOT]), int(r[F_LEN])
            if slot < 0 or (slot == ONE_SHOT and (not length or short)):
                out[p] = _EMPTY
                continue
            mapped = self._mapping(p, slot, int(r[F_GEN]), int(r[F_SIZE]))
            if not length or short:
                out[p] = _EMPTY
                continue
            view = np.frombuffer(mapped.mm, dtype=np.uint8, count=length, offset=int(r[F_OFF]))
            if slot != ONE_SHOT:
                mapped.views.append(weakref.ref(view))
            out[p] = view
        self._after_new(got)
        if self.multi_host or short:
            via_wire = [d for d in range(n) if d != me and (short or not self.local[d])]
            for p, view in self._wire_pieces(sizes, fill, via_wire).items():
                out[p] = view
        return out

    def _after_new(self, got: np.ndarray) -> None:
        """A new segment's name goes once every peer has mapped it (one barrier)."""
        if not got[:, F_NEW].any():
            return
        self.comm.barrier()
        for seg in list(self.pool.values()) + self.one_shot:
            if seg.linked:
                _unlink(seg.path)
                seg.linked = False
        for seg in self.one_shot:  # the peers' mappings hold its memory from now on
            seg.unmap()
        self.one_shot.clear()
        _rmdir(self.dir)  # the last rank to leave an empty directory removes it

    def _wire_pieces(
        self, sizes: list[int], fill: Callable[[int, np.ndarray], None], dests: list[int]
    ) -> dict[int, np.ndarray]:
        """Pieces for ``dests`` through the wire's alltoallv (every rank calls it)."""
        counts = [sizes[d] if d in dests else 0 for d in range(self.n)]
        send = np.empty(sum(counts), dtype=np.uint8)
        pos = 0
        for d, c in enumerate(counts):
            if c:
                fill(d, send[pos : pos + c])
                pos += c
        recv, recv_counts = self.comm.wire_alltoallv(send, counts)
        recv.flags.writeable = False
        offs = np.concatenate([[0], np.cumsum(recv_counts)])
        return {
            p: recv[int(offs[p]) : int(offs[p + 1])]
            for p in range(self.n)
            if p != self.rank and (p in dests or not self.local[p])
        }

    def _all_to_all(self, ctrl: np.ndarray) -> np.ndarray:
        return self.comm.all_to_all_rows(ctrl)

    # ---- receive side --------------------------------------------------------------------
    def recv_buffer(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` for alltoallv's result: a view of one of two kept
        buffers once the caller dropped the previous view of it (no page faults: fresh memory
        costs as much as the copy), else fresh memory.  Buffers over the pool's limit are not kept."""
        for i, (base, ref) in enumerate(self.recv_bufs):
            if base.size >= nbytes and (ref is None or ref() is None):
                view = _view(base, nbytes)
                self.recv_bufs[i] = (base, weakref.ref(view))
                return view
        if nbytes > self.pool_max or nbytes == 0:
            return np.empty(nbytes, dtype=np.uint8)
        base = np.empty(nbytes, dtype=np.uint8)
        view = _view(base, nbytes)
        free = [i for i, (_, ref) in enumerate(self.recv_bufs) if ref is None or ref() is None]
        if free:
            self.recv_bufs[free[0]] = (base, weakref.ref(view))
        elif len(self.recv_bufs) < 2:
            self.recv_bufs.append((base, weakref.ref(view)))
        return view

    def _mapping(self, p: int, slot: int, gen: int, size: int) -> _Mapped:
        cached = self.maps[p].get(slot)
        if cached is not None and cached.gen == gen:
            return cached
        path = self.dir / f"{p}-{slot}-{gen}"
        fd = os.open(path, os.O_RDONLY)
        try:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if slot != ONE_SHOT else 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        mapped = _Mapped(gen, mm)
        if slot != ONE_SHOT:
            self.maps[p][slot] = mapped  # a replaced generation lives on in its views only
        return mapped

    def _held_masks(self) -> list[int]:
        """Per peer: the bit mask of its slots this rank still holds views of."""
        masks = [0] * self.n
        for p, slots in enumerate(self.maps):
            for slot, mapped in slots.items():
                if mapped.held():
                    masks[p] |= 1 << slot
        return masks

    # ---- send side -----------------------------------------------------------------------
    def _note_held(self, p: int, mask: int) -> None:
        bit = 1 << p
        for slot, seg in self.pool.items():
            seg.held = (seg.held | bit) if (mask >> slot) & 1 else (seg.held & ~bit)

    def _segment_for(self, total: int, k: int) -> tuple[_Segment, bool]:
        """A segment of at least ``total`` bytes nobody reads any more; new when none fits."""
        free = [s for s in self.pool.values() if s.last_used < k - 1 and not s.held]
        fits = [s for s in free if s.size >= total]
        if fits:
            return min(fits, key=lambda s: s.size), False
        size = -(-(total + total // 8) // MiB) * MiB  # headroom for the next, slightly larger one
        if size > self.pool_max:
            return self._create(ONE_SHOT, _align(total)), True
        if free:
            victim = max(free, key=lambda s: s.size)
            del self.pool[victim.slot]
            victim.unmap()
            slot = victim.slot
        elif len(self.pool) < POOL_SLOTS:
            slot = min(set(range(POOL_SLOTS)) - set(self.pool))
        else:
            return self._create(ONE_SHOT, _align(total)), True
        seg = self._create(slot, size)
        self.pool[slot] = seg
        return seg, True

    def _create(self, slot: int, size: int) -> _Segment:
        held_now = sum(s.size for s in self.pool.values())
        if self.limit is not None and held_now + size > self.limit:
            raise _NoSpace(
                f"a {_human(size)} segment in {self.dir} would bring this rank's shared "
                f"memory to {_human(held_now + size)}, over {ENV_SHM_LIMIT}={self.limit}"
            )
        self.gen += 1
        path = self.dir / f"{self.rank}-{slot}-{self.gen}"
        for attempt in range(3):  # another rank may remove the empty directory meanwhile
            _makedirs(self.dir)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        try:
            try:
                st = os.statvfs(self.dir)
                free = st.f_bavail * st.f_frsize
                if size > free:
                    raise OSError(errno.ENOSPC, "not enough free space")
                os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on a write
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            except OSError as exc:
                _unlink(path)
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    st = os.statvfs(self.dir)
                    raise _NoSpace(
                        f"no room for a {_human(size)} segment at {path} ({_human(st.f_bavail * st.f_frsize)} "
                        f"free of {_human(st.f_blocks * st.f_frsize)}): {exc.strerror}"
                    ) from None
                raise
        finally:
            os.close(fd)
        self.stats["segments_created"] += 1
        self.stats["bytes_created"] += size
        seg = _Segment(slot, self.gen, size, path, mm)
        if slot == ONE_SHOT:
            self.one_shot.append(seg)
        return seg

    def close(self) -> None:
        for seg in list(self.pool.values()) + self.one_shot:
            if seg.linked:
                _unlink(seg.path)
            seg.unmap()
        self.pool.clear()
        self.one_shot.clear()
        self.maps = [{} for _ in range(self.n)]
        self.recv_bufs = []
        _rmdir(self.dir)


_EMPTY = np.empty(0, dtype=np.uint8)
_EMPTY.flags.writeable = False


def _view(base: np.ndarray, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of ``base`` as an array every later view (slice, Arrow buffer) of it
    refers to — a plain slice would refer to ``base`` itself — so a weak reference to it says
    whether anything still uses those bytes."""
    return np.frombuffer(base.data[:nbytes], dtype=np.uint8)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _probe(comm: ShmDataPath, hosts: list[str], directory: Path, nonce: str) -> list[str]:
    """Does every rank see the files its same-host peers write in ``directory``?  Each writes a
    probe file, every rank reads its peers' (collective: two small collectives); returns what
    some rank could not see, the same list on every rank."""
    me = comm.rank
    mine = directory / f"probe-{me}"
    try:
        _makedirs(directory)
        fd = os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, f"{nonce}-{me}".encode())
        os.close(fd)
        wrote = None
    except OSError as exc:
        wrote = f"rank {me} cannot write {mine}: {exc.strerror or exc}"
    comm.barrier()
    unseen = [wrote] if wrote else []
    for peer, host in enumerate(hosts):
        if peer != me and host == hosts[me]:
            try:
                seen = (directory / f"probe-{peer}").read_text()
            except OSError:
                seen = None
            if seen != f"{nonce}-{peer}":
                unseen.append(f"rank {me} does not see rank {peer}'s files")
    found = [u for per_rank in comm.allgather_obj(unseen) for u in per_rank]
    try:
        os.unlink(mine)
    except OSError:
        pass
    comm.barrier()  # then the directory is empty: gone until an exchange needs a segment
    _rmdir(directory)
    return found


def _rmdir(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty (a peer's file is still there) or already gone


def shm_wanted() -> bool:
    return os.environ.get(ENV_SHM, "1").strip().lower() not in ("0", "false", "no", "off")


class ShmDataPath(Communicator):
    """The base of a communicator (listed before ``Communicator``, whose methods it falls back
    to) that implements ``wire_alltoallv`` (its own alltoallv of bytes) and ``all_to_all_rows``
    (one fixed-width row of int64 to each rank): ``alltoallv``, ``exchange`` and
    ``exchange_tables`` then move the bytes between co-located ranks through shared memory, and
    the rest through the wire."""

    shm_required = False  # True: the shared-memory path always, for same-host peers
    shm: ShmEngine | None = None

    def wire_alltoallv(self, send: np.ndarray, send_counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def all_to_all_rows(self, rows: np.ndarray) -> np.ndarray:
        """Row d of the (ranks, k) array ``rows`` to rank d; returns the rows received, by source."""
        raise NotImplementedError

    def start_shm(self) -> None:
        """Collective: set up the shared-memory path where it applies (after the wire is up)."""
        self.shm = None
        if self.world_size > 1 and (self.shm_required or shm_wanted()):
            self.shm = ShmEngine.start(self, required=self.shm_required)

    def close_shm(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        if self.shm is None:
            return self.wire_alltoallv(send, send_counts)
        counts = [int(c) for c in send_counts]
        if len(counts) != self.world_size:
            raise ValueError(f"alltoallv needs {self.world_size} counts, got {len(counts)}")
        offs = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        flat = np.ascontiguousarray(send, dtype=np.uint8).reshape(-1)
        views = self.shm.exchange_pieces(counts, lambda d, out: np.copyto(out, flat[offs[d] : offs[d + 1]]))
        me = self.rank
        mine = flat[offs[me] : offs[me + 1]]
        pieces = [mine if v is None else v for v in views]
        recv_counts = np.array([p.size for p in pieces], dtype=np.int64)
        recv = self.shm.recv_buffer(int(recv_counts.sum()))
        pos = 0
        for p in pieces:
            recv[pos : pos + p.size] = p
            pos += p.size
        return recv, recv_counts

    def exchange(self, buffers: Sequence[Any]) -> list[memoryview]:
        if self.shm is None:
            return super().exchange(buffers)
        if len(buffers) != self.world_size:
            raise ValueError(f"exchange needs {self.world_size} buffers, got {len(buffers)}")
        arrays = [np.frombuffer(memoryview(b).cast("B"), dtype=np.uint8) for b in buffers]
        views = self.shm.exchange_pieces([a.size for a in arrays], lambda d, out: np.copyto(out, arrays[d]))
        return [(arrays[self.rank] if v is None else v).data for v in views]

    def exchange_contiguous(self, send: np.ndarray, send_counts: Sequence[int]) -> list[memoryview]:
        if self.shm is None:
            return super().exchange_contiguous(send, send_counts)
        counts = [int(c) for c in send_counts]
        offs = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        flat = np.ascontiguousarray(send, dtype=np.uint8).reshape(-1)
        return self.exchange([flat[offs[d] : offs[d + 1]] for d in range(self.world_size)])

    def exchange_tables(self, parts: list[pa.Table], schema: pa.Schema) -> list[pa.Table]:
        if self.shm is None:
            return super().exchange_tables(parts, schema)
        from .base import ipc_stream_size, read_ipc_stream, write_ipc_stream

        me = self.rank
        sizes = [0 if d == me or part.num_rows == 0 else ipc_stream_size(part, schema) for d, part in enumerate(parts)]
        views = self.shm.exchange_pieces(sizes, lambda d, out: write_ipc_stream(parts[d], schema, out))
        return [
            parts[me] if v is None else (read_ipc_stream(v) if v.size else schema.empty_table())
            for v in views  # None: this rank's own part (exchange_pieces)
        ]
