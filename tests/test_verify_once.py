"""Reads stay O(1): a partition is hashed where trust is crossed, once per partition per attempt
(docs/reliability.md, "Inputs are verified where trust is crossed, once per attempt").

Every partition check goes through one digest, ``xxhash.xxh3_64_hexdigest`` (called by
``store.tiers.checksum_buffer``, which every reader, the store service and a crossing use), or,
for a partition fetched from another host's store service, a streaming ``xxh3_64`` fed as the
bytes arrive (a write hashes through one too: the tests wrap both around reads only).  The
tests replace both in the process that reads — the test process, or a rank while its app runs
— with wrappers that record the size of each buffer hashed.  The partitions have distinct byte
sizes, so the recorded sizes say which partitions were hashed, compared with the sizes the
metadata records.
Real gangs on the local site, as the other store tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import phalanx as px
from phalanx.errors import ChecksumError

RANKS = 2


def hashed_sizes(fn: Callable[[], Any]) -> tuple[Any, list[int]]:
    """``fn()`` with every ``xxh3_64_hexdigest`` of this process recorded, and every digest of a
    streaming ``xxh3_64`` (a fetched partition is hashed piece by piece as it arrives: its
    size is what was fed in): (result, sizes hashed)."""
    import xxhash

    sizes: list[int] = []
    real, real_stream = xxhash.xxh3_64_hexdigest, xxhash.xxh3_64

    def counting(data: Any, *args: Any, **kwargs: Any) -> str:
        sizes.append(memoryview(data).nbytes)
        return real(data, *args, **kwargs)

    class Counting:
        def __init__(self, *args: Any) -> None:
            self.hasher, self.fed = real_stream(*args), 0

        def update(self, data: Any) -> None:
            self.fed += memoryview(data).nbytes
            self.hasher.update(data)

        def hexdigest(self) -> str:
            sizes.append(self.fed)
            return self.hasher.hexdigest()

    xxhash.xxh3_64_hexdigest, xxhash.xxh3_64 = counting, Counting
    try:
        return fn(), sizes
    finally:
        xxhash.xxh3_64_hexdigest, xxhash.xxh3_64 = real, real_stream


def rank_table(rank: int) -> pa.Table:
    """Rank ``rank``'s rows: a size of its own, so its partition's file size differs."""
    n = 20_000 + 7_000 * rank
    return pa.table({"k": np.arange(n, dtype=np.int64) % 97, "v": np.arange(n, dtype=np.float64) + rank})


def expected() -> pa.Table:
    return pa.concat_tables([rank_table(r) for r in range(RANKS)])


def app_put(env, name):
    env.store.put(name, rank_table(env.rank))


def app_get(env, name, times, by=None):
    """``times`` verifying gets (every rank); per get: (rows this rank got, sizes it hashed)."""
    return [hashed_sizes(lambda: env.store.get(name, by=by, verify=True).to_arrow().num_rows) for _ in range(times)]


def app_put_then_get(env, name, times):
    env.store.put(name, rank_table(env.rank))
    return app_get(env, name, times)


def part_sizes(store: px.Store, name: str) -> list[int]:
    return sorted(p.bytes for p in store.info(name).partitions)


def hashed_by_gang(results: list[list[tuple[int, list[int]]]], get: int) -> list[int]:
    """The sizes all ranks hashed during get number ``get``."""
    return sorted(s for per_rank in results for s in per_rank[get][1])


def rows_by_gang(results: list[list[tuple[int, list[int]]]], get: int) -> int:
    return sum(per_rank[get][0] for per_rank in results)


def flip_a_byte(store: px.Store, name: str, index: int) -> None:
    """Damage partition ``index``'s file in place: one byte of its column data flipped (the
    file still opens as Arrow; only the checksum can tell)."""
    path = Path(store.info(name).location) / f"part-{index:05d}.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def session(request):
    name = f"vo-{request.node.name}"[:60].replace("[", "-").replace("]", "")
    yield name
    px.Store(session=name).delete_session()


def writer_gang(session: str) -> px.Gang:
    """A gang of its own attempt (its Store's): the run attempt that writes."""
    return px.Gang(ranks=RANKS, echo=False, session=session, store=px.Store(session=session))


@pytest.mark.slow
def test_a_gang_reads_back_what_it_put_without_hashing(session):
    with writer_gang(session) as g:
        results = g.run(app_put_then_get, "d", 2)
        writer = g.store  # the driver of the same attempt
        sizes = part_sizes(writer, "d")
        assert len(sizes) == RANKS and len(set(sizes)) == RANKS  # distinct: a hashed size names its partition
        for get in (0, 1):  # the get after the put, and a second get: no partition hashed
            assert rows_by_gang(results, get) == expected().num_rows
            assert hashed_by_gang(results, get) == []
        # a later stage of the same attempt (another app on the kept gang), by rows and by key
        for by in (None, "k"):
            later = g.run(app_get, "d", 1, by)
            assert rows_by_gang(later, 0) == expected().num_rows and hashed_by_gang(later, 0) == []
        # the driver of the attempt reads it too, without hashing (the ranks' markers on this host)
        table, hashed = hashed_sizes(lambda: writer.read("d", verify=True))
        assert hashed == []
        assert table.sort_by("v").equals(expected().sort_by("v"))


@pytest.mark.slow
def test_a_new_attempt_hashes_each_partition_exactly_once(session):
    with writer_gang(session) as g:
        g.run(app_put, "d")
    writer = px.Store(session=session)
    sizes = part_sizes(writer, "d")
    # A resume (another run attempt, another gang): its first get hashes every partition once,
    # split over its ranks; its second get and a later stage's get by key hash nothing.
    with writer_gang(session) as resumed:
        results = resumed.run(app_get, "d", 2)
        assert rows_by_gang(results, 0) == rows_by_gang(results, 1) == expected().num_rows
        assert hashed_by_gang(results, 0) == sizes
        assert all(len(per_rank[0][1]) <= 1 for per_rank in results)  # each rank one of the two
        assert hashed_by_gang(results, 1) == []
        later = resumed.run(app_get, "d", 1, "k")
        assert hashed_by_gang(later, 0) == []
        # the driver of that attempt trusts what its ranks checked on this host
        same_attempt = px.Store(session=session, attempt=resumed.store.attempt)
        table, hashed = hashed_sizes(lambda: same_attempt.read("d"))
        assert hashed == [] and table.num_rows == expected().num_rows
    # px.Store() in another process (here: a new Store) is another attempt: once per partition
    reader = px.Store(session=session)
    table, first = hashed_sizes(lambda: reader.read("d"))
    _, second = hashed_sizes(lambda: reader.read("d"))
    assert sorted(first) == sizes and second == []
    assert table.sort_by("v").equals(expected().sort_by("v"))
    reader.new_attempt()  # forgets what it trusted
    _, again = hashed_sizes(lambda: reader.read("d"))
    assert sorted(again) == sizes


@pytest.mark.slow
def test_a_damaged_partition_fails_every_new_attempt_and_is_not_remembered_as_checked(session):
    with writer_gang(session) as g:
        g.run(app_put, "d")
        writer = g.store
        flip_a_byte(writer, "d", 1)
        # What the rule gives up: the attempt that wrote the partition trusts it (O(1) reads),
        # so damage done behind its back on its own host reads as data (a different table).
        table, hashed = hashed_sizes(lambda: writer.read("d", verify=True))
        assert hashed == [] and not table.sort_by("v").equals(expected().sort_by("v"))
    # Every later attempt checks: a resume's gang fails on every rank naming the partition ...
    with writer_gang(session) as resumed:
        for _ in range(2):  # and a failed check is not remembered as checked: the retry fails too
            with pytest.raises(px.RankError, match=r"dataset 'd' partition 1 .*checksum mismatch") as err:
                resumed.run(app_get, "d", 1)
            assert "(ranks 0, 1)" in str(err.value)  # every rank, not only the one that hashed it
    # ... and so does a reader in another process, each time it reads.
    reader = px.Store(session=session)
    for _ in range(2):
        with pytest.raises(ChecksumError, match=r"dataset 'd' partition 1 .*checksum mismatch"):
            reader.read("d")
    # the undamaged partition was checked once and stays trusted
    _, hashed = hashed_sizes(lambda: reader.partition(reader.info("d"), 0, verify=True))
    assert hashed == []


def test_a_partition_fetched_from_another_host_is_checked_on_every_arrival(tmp_path, monkeypatch):
    """Another host on this machine: a second store root (its own root id) whose partitions a
    store service on loopback serves, the catalogue shared.  A fetched partition is checked on
    arrival every time (docs/reliability.md: "a partition fetched from another host (always,
    on arrival)"), by the attempt that wrote it too, with ``verify=False`` too; a damaged one
    fails the read naming it.  Across real hosts: tests/multihost/."""
    from phalanx.runtime.envvars import ENV_STORE_SERVICE_KEY
    from phalanx.store.remote import publish_endpoint
    from phalanx.store.service import ENV_TOKEN, StoreService

    monkeypatch.setenv(ENV_TOKEN, "verify-once-test-token")
    catalogue = f"sqlite:///{tmp_path / 'catalogue.db'}"
    holder_root = tmp_path / "holder"
    holder_root.mkdir()
    with StoreService(holder_root, "127.0.0.1") as svc:
        publish_endpoint(holder_root, "vo-test", svc.endpoint)
        monkeypatch.setenv(ENV_STORE_SERVICE_KEY, "vo-test")
        writer = px.Store(holder_root, session="x", metadata=catalogue)
        writer.put("d", [rank_table(0), rank_table(1)])
        parts = writer.info("d").partitions
        assert [p.endpoint for p in parts] == [svc.endpoint] * 2
        # the writer's attempt, on the other host: trust does not travel with the bytes
        reader = px.Store(tmp_path / "reader", session="x", metadata=catalogue, attempt=writer.attempt)
        assert not reader.is_here(parts[0])
        for verify in (True, True, False):
            table, hashed = hashed_sizes(lambda v=verify: reader.read("d", verify=v))
            assert sorted(hashed) == sorted(p.bytes for p in parts), verify
            assert table.equals(expected())
        assert reader.reads.as_dict() == {"local": 0, "fetched": 3 * sum(p.bytes for p in parts)}
        flip_a_byte(writer, "d", 1)
        for _ in range(2):
            with pytest.raises(ChecksumError, match=r"dataset 'd' partition 1 .*checksum mismatch"):
                reader.read("d")


def spilling_store(tmp_path: Path, **kwargs: Any) -> px.Store:
    """A store whose memory budget holds one of the tables ``spill_two`` puts."""
    return px.Store(tmp_path / "root", session="spill", memory_budget=2_000_000, spill=tmp_path / "spill", **kwargs)


SPILLED = pa.table({"v": np.arange(200_000, dtype=np.int64)})  # 1.6 MB: one fits the budget


def spill_two(store: px.Store, tmp_path: Path) -> None:
    """Put 'a' and 'b': over the budget, 'a' (least recently used) goes to the spill directory."""
    store.put("a", SPILLED)
    store.put("b", SPILLED)
    assert store.spilled("a") and Path(store.info("a").location).is_relative_to(tmp_path / "spill")


def test_another_attempt_checks_a_partition_damaged_on_the_spill_directory(tmp_path):
    writer = spilling_store(tmp_path)
    try:
        spill_two(writer, tmp_path)
        flip_a_byte(writer, "a", 0)
        reader = spilling_store(tmp_path)  # another attempt (another process's px.Store)
        with pytest.raises(ChecksumError, match=r"dataset 'a' partition 0 .*checksum mismatch"):
            reader.read("a")  # brought back into memory first (the budget makes room), then checked
        _, hashed = hashed_sizes(lambda: reader.read("b"))  # the undamaged one: hashed once
        assert hashed == [writer.info("b").partitions[0].bytes]
        assert reader.read("b").equals(SPILLED)
    finally:
        writer.delete_session()


def test_the_writing_attempt_checks_a_partition_read_from_spill(tmp_path):
    """Spill crosses trust (docs/reliability.md: "read from a disk tier (spill)"; issue 23:
    "brought back from spill"): even the attempt that wrote a dataset checks it when its bytes
    come from the spill directory, so a file damaged there is caught."""
    store = spilling_store(tmp_path)
    try:
        spill_two(store, tmp_path)
        flip_a_byte(store, "a", 0)
        with pytest.raises(ChecksumError, match=r"dataset 'a' partition 0 .*checksum mismatch"):
            store.partition(store.info("a"), 0, verify=True)  # read on the spill directory
        with pytest.raises(ChecksumError, match=r"dataset 'a' partition 0 .*checksum mismatch"):
            store.read("a")  # brought back into memory first, then read
    finally:
        store.delete_session()
