"""The store's contracts, once: every metadata backend and every store tier passes the same
tests.  tests/test_store_backends.py runs them on SQLite and Redis, a directory and S3; a new
backend (a plug-in's too) subclasses the mix-in and says where its store or catalogue is::

    from phalanx.testing.store import MetadataContract, TierContract

    class TestMyTier(TierContract):
        @pytest.fixture
        def tier_root(self, tmp_path):
            return "mytier://bucket/prefix"  # a fresh, empty root: the mix-in opens px.Store on it

    class TestMyCatalogue(MetadataContract):
        @pytest.fixture
        def metadata_url(self, tmp_path):
            return "mydb://host/db"  # an empty catalogue: the mix-in opens it (open_metadata)

A store that needs more than a URL overrides ``tstore`` (a ``px.Store``, session "conf") or
``meta`` (an open, empty backend) instead.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import phalanx as px
from phalanx.errors import ChecksumError, DatasetExistsError, DatasetNotFoundError, StoreError, UnsafePathError
from phalanx.store.metadata import DatasetInfo, MetadataBackend, PartitionInfo, open_metadata
from phalanx.store.tiers import serialize
from phalanx.testing.tables import every_type_table, same_table


def dataset(session="s", name="d", version="v1", location="/x/v1", rows=(3, 4), created=None) -> DatasetInfo:
    schema = pa.schema([("a", pa.int64()), ("b", pa.string())])
    parts = [PartitionInfo(i, r, 100 * r, f"{i:016x}") for i, r in enumerate(rows)]
    return DatasetInfo(
        session,
        name,
        version,
        location,
        schema,
        parts,
        {"kind": "hash", "keys": ["a"], "n": 2, "hash": "x"},
        "prod",
        "run-1",
        created or time.time(),
    )


class MetadataContract:
    """A metadata backend's contract; a subclass provides the ``metadata_url`` fixture (an
    empty catalogue) or the ``meta`` fixture (an open backend, empty)."""

    @pytest.fixture
    def metadata_url(self) -> str:
        pytest.fail(f"{type(self).__name__}: override the 'metadata_url' fixture (or 'meta')")

    @pytest.fixture
    def meta(self, metadata_url: str) -> Iterator[MetadataBackend]:
        m = open_metadata(metadata_url)
        yield m
        m.close()

    def test_seal_then_get_gives_back_everything(self, meta):
        d = dataset()
        assert meta.get("s", "d") is None
        assert meta.seal(d, replace=False) is None
        got = meta.get("s", "d")
        assert got.schema.equals(d.schema) and got.partitions == d.partitions
        assert (got.version, got.location, got.partitioning, got.producer, got.run) == (
            d.version,
            d.location,
            d.partitioning,
            d.producer,
            d.run,
        )
        assert got.created == pytest.approx(d.created) and got.accessed == pytest.approx(d.created)
        assert not got.pinned and got.num_rows == 7 and got.nbytes == 700
        assert [x.name for x in meta.list("s")] == ["d"] and meta.sessions() == ["s"]

    def test_a_crossed_datasets_origin_is_kept(self, meta):
        """``DatasetInfo.origin`` (store.crossing): stored, moved along, absent when not given."""
        origin = {"store": "s3://bucket/p", "session": "etl", "name": "d", "version": "v0"}
        crossed = dataset()
        crossed.origin = dict(origin)
        meta.seal(crossed, replace=False)
        meta.seal(dataset(name="e"), replace=False)
        assert meta.get("s", "d").origin == origin and meta.get("s", "e").origin == {}
        assert meta.relocate("s", "d", "v1", "/x/v1", "/y/v1") and meta.get("s", "d").origin == origin
        assert meta.get("s", "d").summary()["origin"] == origin and "origin" not in meta.get("s", "e").summary()

    def test_a_name_exists_unless_replaced(self, meta):
        meta.seal(dataset(version="v1"), replace=False)
        with pytest.raises(FileExistsError):
            meta.seal(dataset(version="v2"), replace=False)
        assert meta.get("s", "d").version == "v1"
        old = meta.seal(dataset(version="v3", rows=(5,)), replace=True)
        assert old.version == "v1"
        assert meta.get("s", "d").version == "v3" and meta.get("s", "d").num_rows == 5

    def test_concurrent_seals_of_one_name_have_one_winner(self, meta):
        wins, losses = [], []

        def seal(i):
            try:
                meta.seal(dataset(version=f"v{i}"), replace=False)
                wins.append(i)
            except FileExistsError:
                losses.append(i)

        threads = [threading.Thread(target=seal, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1 and len(losses) == 7
        assert meta.get("s", "d").version == f"v{wins[0]}"

    def test_sessions_are_namespaces_and_delete_removes(self, meta):
        meta.seal(dataset(session="a", location="/a"), replace=False)
        meta.seal(dataset(session="b", location="/b"), replace=False)
        meta.seal(dataset(session="b", name="e"), replace=False)
        assert meta.get("a", "d").location == "/a" and meta.get("b", "d").location == "/b"
        assert meta.sessions() == ["a", "b"]
        assert sorted((x.session, x.name) for x in meta.all()) == [("a", "d"), ("b", "d"), ("b", "e")]
        assert meta.delete("a", "d").location == "/a"
        assert meta.delete("a", "d") is None
        assert meta.get("a", "d") is None and meta.sessions() == ["b"]
        assert [x.name for x in meta.list("b")] == ["d", "e"]

    def test_touch_pin_and_compare_and_set_relocate(self, meta):
        meta.seal(dataset(created=1000.0), replace=False)
        meta.touch("s", "d", 2000.5)
        meta.touch("s", "missing", 1.0)  # ignored
        assert meta.get("s", "d").accessed == 2000.5
        assert meta.set_pinned("s", "d", True) and meta.get("s", "d").pinned
        assert meta.set_pinned("s", "d", False) and not meta.get("s", "d").pinned
        assert not meta.set_pinned("s", "missing", True)
        assert not meta.relocate("s", "d", "v-other", "/x/v1", "/y")  # another version
        assert not meta.relocate("s", "d", "v1", "/elsewhere", "/y")  # moved meanwhile
        assert not meta.relocate("s", "missing", "v1", "/x/v1", "/y")
        assert meta.relocate("s", "d", "v1", "/x/v1", "/y/v1")
        got = meta.get("s", "d")
        assert got.location == "/y/v1" and got.version == "v1" and got.accessed == 2000.5
        assert meta.get("s", "missing") is None and meta.list("nobody") == []
        # a spill (unless_pinned) loses against a pin made while it copied; a reload does not
        meta.set_pinned("s", "d", True)
        assert not meta.relocate("s", "d", "v1", "/y/v1", "/spill/v1", unless_pinned=True)
        assert meta.get("s", "d").location == "/y/v1"
        assert meta.relocate("s", "d", "v1", "/y/v1", "/z/v1")

    def test_the_url_opens_the_same_catalogue(self, meta):
        meta.seal(dataset(), replace=False)
        other = open_metadata(meta.url)  # what a rank does with PHALANX_STORE_METADATA
        assert other.get("s", "d").version == "v1"
        other.close()


def exists_at(store: px.Store, location: str) -> bool:
    try:
        store.tier.read_buffer(location, 0)
        return True
    except FileNotFoundError:
        return False


class TierContract:
    """A store tier's contract; a subclass provides the ``tier_root`` fixture (the URL of a
    fresh root on the tier) or the ``tstore`` fixture (a ``px.Store`` on the tier, session
    "conf")."""

    @pytest.fixture
    def tier_root(self) -> str:
        pytest.fail(f"{type(self).__name__}: override the 'tier_root' fixture (or 'tstore')")

    @pytest.fixture
    def tstore(self, tier_root: str, tmp_path: Path) -> Iterator[px.Store]:
        """A store on the tier, with SQLite metadata in a temporary directory."""
        s = px.Store(tier_root, session="conf", metadata=f"sqlite://{tmp_path / 'meta.sqlite'}")
        yield s
        s.delete_session()

    def test_round_trip_of_every_type(self, tstore):
        t = every_type_table()
        info = tstore.put("types", [t.slice(0, 200), t.slice(200)], producer="unit")
        assert same_table(tstore.read("types"), t)
        got = tstore.info("types")
        assert [p.rows for p in got.partitions] == [200, 300] and got.location == info.location
        assert tstore.tier.owns(got.location)
        assert same_table(tstore.partition(got, 1, verify=True), t.slice(200))
        assert tstore.read("types", columns=["i64"]).column_names == ["i64"]

    def test_immutable_unless_replaced_and_old_payload_removed(self, tstore):
        tstore.put("x", pa.table({"a": [1]}))
        old = tstore.info("x").location
        with pytest.raises(DatasetExistsError, match="dataset 'x' exists"):
            tstore.put("x", pa.table({"a": [2]}))
        tstore.put("x", pa.table({"a": [3, 4]}), replace=True)
        assert tstore.read("x")["a"].to_pylist() == [3, 4]
        tstore.purge_retired(older_than=0)  # file tiers keep a replaced version for a grace period
        assert not exists_at(tstore, old)
        tstore.delete("x")
        with pytest.raises(DatasetNotFoundError):
            tstore.info("x")

    def test_sessions_are_separate_and_delete_session_removes_payload(self, tstore):
        other = tstore.for_session("conf-other")
        tstore.put("n", pa.table({"a": [1]}))
        info = other.put("n", pa.table({"a": [2]}))
        assert tstore.read("n")["a"].to_pylist() == [1] and other.read("n")["a"].to_pylist() == [2]
        assert other.delete_session() == 1
        assert not other.exists("n") and tstore.exists("n") and not exists_at(tstore, info.location)

    def test_corruption_is_caught_by_the_checksum(self, tstore):
        info = tstore.put("c", [pa.table({"a": np.arange(1000)})] * 2)
        data = bytearray(tstore.tier.read_buffer(info.location, 1).to_pybytes())
        data[len(data) // 2] ^= 0xFF
        tstore.tier.remove(info.location)
        tstore.tier.write_buffer(info.location, 0, serialize(pa.table({"a": np.arange(1000)})))
        tstore.tier.write_buffer(info.location, 1, pa.py_buffer(bytes(data)))
        assert len(tstore.read("c")) == 2000  # this attempt wrote it: trusted, not hashed again
        tstore.new_attempt()  # a later attempt (a resume) checks what it did not write
        with pytest.raises(ChecksumError, match=r"dataset 'c' partition 1 .*checksum mismatch"):
            tstore.read("c")

    def test_a_missing_partition_is_named(self, tstore):
        info = tstore.put("m", pa.table({"a": [1]}))
        tstore.tier.remove(info.location)
        with pytest.raises(StoreError, match=r"dataset 'm' partition 0 .*missing"):
            tstore.read("m")

    def test_a_failed_put_leaves_nothing(self, tstore, monkeypatch):
        real = tstore.tier.write_partition

        def write(location, index, table):
            if index == 1:
                raise OSError("disk full")
            return real(location, index, table)

        monkeypatch.setattr(tstore.tier, "write_partition", write)
        with pytest.raises(
            StoreError,
            match=r"session 'conf': put 'f' partition 1: writing .*/part-00001.arrow "
            r"failed: disk full",
        ):
            tstore.put("f", [pa.table({"a": [1]}), pa.table({"a": [2]})])
        monkeypatch.undo()
        assert not tstore.exists("f") and tstore.tier.staged("local") == [] and tstore.unsealed() == []

    def test_unsealed_writes_are_listed_with_size_and_age_and_removed(self, tstore):
        tstore.put("sealed", pa.table({"a": [1]}))
        other = tstore.for_session("conf-other")
        for store, name in ((tstore, "half"), (other, "half")):  # a killed driver's, never sealed
            store.stage_partition(store.new_staging_id("gang9"), 0, pa.table({"a": np.arange(1000)}), name=name)
        found = tstore.unsealed()
        assert [u.session for u in found] == ["conf", "conf-other"]
        size = serialize(pa.table({"a": np.arange(1000)})).size
        assert all(u.bytes == size and 0 <= u.idle_s < 60 and u.staging_id.startswith("gang9-") for u in found)
        assert [u.location for u in tstore.remove_unsealed()] == [found[0].location]
        assert [u.session for u in tstore.unsealed()] == ["conf-other"] and tstore.unsealed("conf") == []
        assert tstore.read("sealed")["a"].to_pylist() == [1]
        other.remove_unsealed()
        assert tstore.unsealed() == []

    def test_a_location_outside_the_tier_is_never_removed(self, tstore, tmp_path):
        """The catalogue (and ``.retired``) may be writable by others on a shared root: a
        dataset whose recorded location lies outside the tier — here beside it, in a store
        of its own — is not removed by a delete; the refusal names the location."""
        base, _, query = tstore.tier.root_url.partition("?")
        beside = px.Store(
            base.rstrip("/") + "-beside" + (f"?{query}" if query else ""),
            session="conf",
            metadata=f"sqlite://{tmp_path / 'beside.sqlite'}",
        )
        info = beside.put("theirs", pa.table({"a": [7]}))
        try:
            assert not tstore.tier.owns(info.location)
            tstore.meta.seal(info, False)
            with pytest.raises(UnsafePathError, match=f"refusing to remove {re.escape(info.location)}"):
                tstore.delete_session()
            assert beside.read("theirs")["a"].to_pylist() == [7]
        finally:
            beside.delete_session()

    def test_abort_staging_removes_unsealed_writes_of_its_owner_only(self, tstore):
        sealed_id = tstore.new_staging_id("gang7")
        part = tstore.stage_partition(sealed_id, 0, pa.table({"a": [1]}), name="kept")
        tstore.seal("kept", sealed_id, [part], pa.schema([("a", pa.int64())]), None, "", "", False)
        for owner, name in (("gang7", "lost"), ("gang7", "lost2"), ("gang8", "other")):
            tstore.stage_partition(tstore.new_staging_id(owner), 0, pa.table({"a": [2]}), name=name)
        assert tstore.abort_staging("gang7") == 2
        assert tstore.read("kept")["a"].to_pylist() == [1]  # sealed: kept
        assert [s.version.split("-")[0] for s in tstore.tier.staged("gang8")] == ["gang8"]
        # an object store lists the sealed prefix too (written in place); abort keeps it
        assert [st.name for st in tstore.tier.staged("gang7")] in ([], ["kept"])
        tstore.abort_staging("gang8")
