"""Store backends: the same metadata tests on SQLite and a real redis-server, the same tier
tests on a directory and an S3 server (moto, started on loopback), the memory budget with
spill / reload / pin, and gangs whose ranks reach S3 and Redis through env.store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import phalanx as px
from phalanx.errors import ChecksumError, DatasetExistsError, DatasetNotFoundError, StoreError
from phalanx.store.metadata import DatasetInfo, PartitionInfo, SQLiteMetadata, open_metadata
from phalanx.store.store import parse_bytes
from phalanx.runtime.rendezvous import free_port
from phalanx.store.tiers import serialize
from reference import assert_same_rows, make_part, whole
from test_store import every_type_table, same_table

BUCKET = "phalanx-test"


# ---- servers --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on loopback (``pip install 'moto[server]'``), with one bucket."""
    pytest.importorskip("moto", reason="moto[server] is not installed (pip install 'phalanx[test]')")
    import pyarrow.fs as pafs

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail(f"moto_server did not start on port {port}")
                time.sleep(0.05)
        # Credentials travel as the usual AWS variables: ranks inherit them from the driver.
        os.environ.update(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
        endpoint = f"http://127.0.0.1:{port}"
        pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                          allow_bucket_creation=True).create_dir(BUCKET)
        yield endpoint
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.terminate()  # by PID: the process this fixture started
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_root(endpoint: str, prefix: str | None = None) -> str:
    return f"s3://{BUCKET}/{prefix or 't-' + uuid.uuid4().hex[:8]}?endpoint_override={endpoint}"


def s3_keys(store: px.Store, under: str = "") -> list[str]:
    """Every object key below the store's prefix (directory markers included)."""
    import pyarrow.fs as pafs

    tier = store.tier
    infos = tier.fs.get_file_info(pafs.FileSelector(f"{tier.base}/{under}".rstrip("/"), recursive=True,
                                                    allow_not_found=True))
    return [i.path for i in infos if i.type == pafs.FileType.File]


# ---- metadata conformance: SQLite and Redis ------------------------------------------------
@pytest.fixture(params=["sqlite", "redis"])
def meta(request, tmp_path):
    if request.param == "sqlite":
        m = SQLiteMetadata(tmp_path / "meta.sqlite")
    else:
        pytest.importorskip("redis")
        url = request.getfixturevalue("redis_url")
        m = open_metadata(f"{url}?prefix=t-{uuid.uuid4().hex[:8]}:")
    yield m
    m.close()


def dataset(session="s", name="d", version="v1", location="/x/v1", rows=(3, 4), created=None) -> DatasetInfo:
    schema = pa.schema([("a", pa.int64()), ("b", pa.string())])
    parts = [PartitionInfo(i, r, 100 * r, f"{i:016x}") for i, r in enumerate(rows)]
    return DatasetInfo(session, name, version, location, schema, parts,
                       {"kind": "hash", "keys": ["a"], "n": 2, "hash": "x"}, "prod", "run-1",
                       created or time.time())


class TestMetadataConformance:
    def test_seal_then_get_gives_back_everything(self, meta):
        d = dataset()
        assert meta.get("s", "d") is None
        assert meta.seal(d, replace=False) is None
        got = meta.get("s", "d")
        assert got.schema.equals(d.schema) and got.partitions == d.partitions
        assert (got.version, got.location, got.partitioning, got.producer, got.run) == \
               (d.version, d.location, d.partitioning, d.producer, d.run)
        assert got.created == pytest.approx(d.created) and got.accessed == pytest.approx(d.created)
        assert not got.pinned and got.num_rows == 7 and got.nbytes == 700
        assert [x.name for x in meta.list("s")] == ["d"] and meta.sessions() == ["s"]

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
        assert not meta.relocate("s", "d", "v-other", "/x/v1", "/y")   # another version
        assert not meta.relocate("s", "d", "v1", "/elsewhere", "/y")    # moved meanwhile
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


# ---- tier conformance: a directory and S3 --------------------------------------------------
@pytest.fixture(params=["file", "s3"])
def tstore(request, tmp_path):
    """A store on each tier, with SQLite metadata in a temporary directory."""
    if request.param == "file":
        root = str(tmp_path / "root")
    else:
        root = s3_root(request.getfixturevalue("s3_endpoint"))
    s = px.Store(root, session="conf", metadata=f"sqlite://{tmp_path / 'meta.sqlite'}")
    yield s
    s.delete_session()


def exists_at(store: px.Store, location: str) -> bool:
    try:
        store.tier.read_buffer(location, 0)
        return True
    except FileNotFoundError:
        return False


class TestTierConformance:
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
        with pytest.raises(StoreError, match=r"session 'conf': put 'f' partition 1: writing .*/part-00001.arrow "
                                             r"failed: disk full"):
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

    def test_abort_staging_removes_unsealed_writes_of_its_owner_only(self, tstore):
        sealed_id = tstore.new_staging_id("gang7")
        part = tstore.stage_partition(sealed_id, 0, pa.table({"a": [1]}), name="kept")
        tstore.seal("kept", sealed_id, [part], pa.schema([("a", pa.int64())]), None, "", "", False)
        for owner, name in (("gang7", "lost"), ("gang7", "lost2"), ("gang8", "other")):
            tstore.stage_partition(tstore.new_staging_id(owner), 0, pa.table({"a": [2]}), name=name)
        assert tstore.abort_staging("gang7") == 2
        assert tstore.read("kept")["a"].to_pylist() == [1]        # sealed: kept
        assert [s.version.split("-")[0] for s in tstore.tier.staged("gang8")] == ["gang8"]
        # an object store lists the sealed prefix too (written in place); abort keeps it
        assert [st.name for st in tstore.tier.staged("gang7")] in ([], ["kept"])
        tstore.abort_staging("gang8")


def test_s3_reads_download_and_objects_are_laid_out_by_session_name_version(s3_endpoint, tmp_path):
    store = px.Store(s3_root(s3_endpoint, "layout"), session="lay", metadata=str(tmp_path / "m.sqlite"))
    info = store.put("ds", [pa.table({"a": [1, 2]}), pa.table({"a": [3]})])
    assert info.location == f"s3://{BUCKET}/layout/lay/ds/{info.version}"
    assert sorted(s3_keys(store)) == [f"{BUCKET}/layout/lay/ds/{info.version}/part-0000{i}.arrow"
                                      for i in range(2)]
    assert not store.tier.mmap and store.read("ds")["a"].to_pylist() == [1, 2, 3]
    assert store.rank_env()["PHALANX_STORE"] == s3_root(s3_endpoint, "layout")
    store.delete_session()
    # pyarrow leaves zero-byte directory markers (apache/arrow#36275); no data objects remain
    assert [k for k in s3_keys(store) if not k.endswith("/")] == []


def test_store_configuration_from_the_environment(s3_endpoint, tmp_path, monkeypatch, redis_url):
    root = s3_root(s3_endpoint, "envcfg")
    monkeypatch.setenv("PHALANX_STORE", root)
    monkeypatch.setenv("PHALANX_STORE_METADATA", redis_url)
    store = px.Store(session="envcfg")
    assert store.tier.kind == "s3" and store.meta.url == redis_url
    env = store.rank_env()
    assert env["PHALANX_STORE_BUDGET"] == ""
    # ranks get the catalogue's identity too: they refuse a Redis that lost it
    assert env["PHALANX_STORE_METADATA"].startswith(f"{redis_url}?catalogue=")
    assert open_metadata(env["PHALANX_STORE_METADATA"]).url == redis_url
    monkeypatch.delenv("PHALANX_STORE_METADATA")
    with pytest.raises(ValueError, match="memory budget needs a directory"):
        px.Store(root, memory_budget=10)
    with pytest.raises(ValueError, match="unknown option"):
        px.Store(f"s3://{BUCKET}/x?secret_key=oops")
    with pytest.raises(px.PhalanxError, match="unknown store tier 'gs'"):
        px.Store("gs://bucket/x")
    assert parse_bytes("4GiB") == 4 << 30 and parse_bytes("512MB") == 512_000_000 and parse_bytes("") is None


# ---- memory budget: spill, reload, pin -----------------------------------------------------
def table_of(nbytes: int, seed: int) -> pa.Table:
    return pa.table({"x": np.random.default_rng(seed).integers(0, 1 << 60, nbytes // 8)})


@pytest.fixture
def budget_store(tmp_path):
    size = serialize(table_of(80_000, 0)).size
    s = px.Store(tmp_path / "shm", session="budget", metadata=str(tmp_path / "meta.sqlite"),
                 memory_budget=int(2.5 * size), spill=tmp_path / "disk")
    yield s
    s.delete_session()


def test_lru_dataset_spills_to_disk_and_comes_back_on_get(budget_store):
    s = budget_store
    tables = {n: table_of(80_000, i) for i, n in enumerate("abc")}
    s.put("a", tables["a"])
    s.put("b", tables["b"])
    assert s.memory_usage() == s.info("a").nbytes + s.info("b").nbytes <= s.memory_budget
    s.read("a")                        # a is now more recently used than b
    s.put("c", tables["c"])            # over budget: b (least recently used) goes to disk
    assert [s.spilled(n) for n in "abc"] == [False, True, False]
    assert s.memory_usage() <= s.memory_budget
    spilled = s.info("b")
    assert s.spill_tier.owns(spilled.location) and Path(spilled.location).is_dir()
    assert s.read("b").equals(tables["b"])   # a get brings it back, and a (LRU now) spills
    assert [s.spilled(n) for n in "abc"] == [True, False, False]
    assert not Path(spilled.location).exists()
    for n in "abc":
        assert s.read(n).equals(tables[n])


def test_pinned_dataset_never_spills(budget_store):
    s = budget_store
    tables = {n: table_of(80_000, i) for i, n in enumerate("abcd")}
    s.put("a", tables["a"])
    s.pin("a")
    s.put("b", tables["b"])
    s.put("c", tables["c"])            # a is the oldest but pinned: b spills
    assert [s.spilled(n) for n in "abc"] == [False, True, False]
    s.read("b")
    s.put("d", tables["d"])
    assert not s.spilled("a") and s.info("a").pinned
    s.unpin("a")
    s.read("b"), s.read("c"), s.read("d")
    assert s.spilled("a")              # unpinned and least recently used
    s.pin("a")                         # pinning a spilled dataset brings it back
    assert not s.spilled("a") and s.read("a").equals(tables["a"])


def test_moving_keeps_readers_safe(budget_store):
    s = budget_store
    data = table_of(80_000, 1)
    s.put("a", data)
    held = s.read("a")                 # buffers mapped from the memory tier
    stale = s.info("a")                # a location about to go away
    s.put("b", table_of(80_000, 2))
    s.read("b")
    s.put("c", table_of(80_000, 3))
    assert s.spilled("a") and not Path(stale.location).exists()
    assert held.equals(data)           # unlinked while mapped: the pages stay valid
    assert s.partition(stale, 0).equals(data)  # a stale location follows the metadata


def test_a_dataset_larger_than_the_budget_goes_straight_to_disk(budget_store):
    s = budget_store
    s.put("small", table_of(80_000, 1))
    s.put("huge", table_of(400_000, 2))
    assert s.spilled("huge") and not s.spilled("small")
    assert s.read("huge").num_rows == 50_000 and s.spilled("huge")  # never fits: stays on disk


# ---- gangs: ranks reach S3 and Redis through env.store ---------------------------------------
def app_put_get(env, name):
    df = px.DataFrame.from_arrow(make_part(env.rank, env.world_size), env).shuffle("key")
    info = env.store.put(name, df)
    back = env.store.get(name, by="key")
    plan = env.store.last_plan
    balanced = env.store.get(name)
    st = env.store.store
    return (info.summary(), plan, back.collect(root=0), balanced.to_arrow().num_rows,
            st.tier.kind, st.meta.url, st.memory_budget)


def test_gang_put_and_get_with_the_store_on_s3(s3_endpoint, tmp_path):
    root = s3_root(s3_endpoint)
    store = px.Store(root, session="s3gang", metadata=str(tmp_path / "meta.sqlite"))
    with px.Gang(ranks=2, echo=False, store=store) as g:
        results = g.run(app_put_get, "feat")
    summary, plan, back, _, kind, meta_url, _ = results[0]
    assert {r[4] for r in results} == {"s3"} and {r[5] for r in results} == {store.meta.url}
    assert summary["partitions"] == 2 and summary["location"].startswith(f"s3://{BUCKET}/")
    assert plan == "hash: stored partition, zero-copy"
    assert sum(r[3] for r in results) == whole(2).num_rows
    assert_same_rows(back, whole(2))
    assert_same_rows(store.read("feat"), whole(2))
    keys = [k for k in s3_keys(store) if k.endswith(".arrow")]
    assert len(keys) == 2 and all(f"/s3gang/feat/{summary['version']}/" in k for k in keys)
    store.delete_session()


def app_put_fails_after_rank0_wrote(env, name):
    if env.rank == 1:
        def broken(*args, **kwargs):
            # let rank 0's partition reach S3 first, then fail this rank's write
            deadline = time.monotonic() + 20
            while not env.store.tier.staged(env.gang_id) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise OSError(f"upload failed (saw {len(env.store.tier.staged(env.gang_id))} staged)")

        env.store.store.stage_partition = broken
    env.store.put(name, pa.table({"a": np.arange(1000) + env.rank}))


def test_failed_gang_put_on_s3_leaves_no_objects(s3_endpoint, tmp_path):
    store = px.Store(s3_root(s3_endpoint), session="s3fail", metadata=str(tmp_path / "meta.sqlite"))
    with px.Gang(ranks=2, echo=False, store=store) as g:
        with pytest.raises(px.RankError, match=r"upload failed \(saw 1 staged\)"):
            g.run(app_put_fails_after_rank0_wrote, "half")
    assert not store.exists("half")
    assert [k for k in s3_keys(store) if not k.endswith("/")] == []


def app_put_three_get_first(env, size):
    out = []
    for i, name in enumerate("abc"):
        env.store.put(name, table_of(size, 10 * i + env.rank))
        out.append(env.store.store.spilled("a"))
    df = env.store.get("a")
    out.append(env.store.store.spilled("a"))
    st = env.store.store
    return out, df.to_arrow().num_rows, st.meta.url, st.memory_budget, st.spill_tier.url


def test_gang_with_redis_metadata_and_a_memory_budget(redis_url, tmp_path):
    url = f"{redis_url}?prefix=t-{uuid.uuid4().hex[:8]}:"
    size = 40_000
    per_dataset = 2 * serialize(table_of(size, 0)).size
    store = px.Store(tmp_path / "shm", session="rgang", metadata=url,
                     memory_budget=int(2.5 * per_dataset), spill=tmp_path / "disk")
    with px.Gang(ranks=2, echo=False, store=store) as g:
        results = g.run(app_put_three_get_first, size)
    spilled_after, rows, meta_url, budget, spill = results[0]
    assert spilled_after == [False, False, True, False]   # c pushed a out; get a brought it back
    assert rows == size // 8 and meta_url == url
    assert budget == store.memory_budget and spill == str(tmp_path / "disk")
    assert [store.spilled(n) for n in "abc"] == [False, True, False]
    # the catalogue is in Redis: the same root with its default SQLite sees nothing
    assert store.list() == ["a", "b", "c"] and px.Store(tmp_path / "shm", session="rgang").list() == []
    assert store.read("a").num_rows == size // 4
    store.delete_session()
    assert store.meta.sessions() == [] or "rgang" not in store.meta.sessions()
