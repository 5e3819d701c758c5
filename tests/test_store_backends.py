"""Store backends: the same metadata tests on SQLite and a real redis-server, the same tier
tests on a directory, an S3 server (moto, started on loopback) and a real S3-compatible server
(SeaweedFS on loopback, marker ``s3``), the memory budget with spill / reload / pin, and gangs
whose ranks reach S3 and Redis through env.store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from reference import assert_same_rows, make_part, whole

import phalanx as px
from phalanx.runtime.rendezvous import free_port
from phalanx.store.metadata import open_metadata
from phalanx.store.store import parse_bytes
from phalanx.store.tiers import part_file, serialize
from phalanx.testing.store import MetadataContract, TierContract

BUCKET = "phalanx-test"  # moto's, and the SeaweedFS fixture's (tests/conftest.py: SEAWEEDFS_BUCKET)
ANON_BUCKET = "phalanx-anon"  # SeaweedFS: unsigned requests may use this one


# ---- servers --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on loopback (``pip install 'moto[server]'``), with one bucket."""
    pytest.importorskip("moto", reason="moto[server] is not installed (pip install 'phalanx[test]')")
    import pyarrow.fs as pafs

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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
        pafs.S3FileSystem(
            endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1", allow_bucket_creation=True
        ).create_dir(BUCKET)
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
    infos = tier.fs.get_file_info(
        pafs.FileSelector(f"{tier.base}/{under}".rstrip("/"), recursive=True, allow_not_found=True)
    )
    return [i.path for i in infos if i.type == pafs.FileType.File]


# ---- metadata conformance: SQLite and Redis ------------------------------------------------
class TestMetadataConformance(MetadataContract):
    """SQLite and a real redis-server (phalanx.testing.store: the mix-in opens each catalogue)."""

    @pytest.fixture(params=["sqlite", "redis"])
    def metadata_url(self, request, tmp_path):
        if request.param == "sqlite":
            return str(tmp_path / "meta.sqlite")
        pytest.importorskip("redis")
        url = request.getfixturevalue("redis_url")
        return f"{url}?prefix=t-{uuid.uuid4().hex[:8]}:"


# ---- tier conformance: a directory and S3 --------------------------------------------------
class TestTierConformance(TierContract):
    """A directory, an S3 server (moto on loopback) and a real S3-compatible server (SeaweedFS on
    loopback: marker s3, the s3 lane); the mix-in opens a store on each, with SQLite metadata in a
    temporary directory."""

    @pytest.fixture(params=["file", "s3", pytest.param("seaweedfs", marks=pytest.mark.s3)])
    def tier_root(self, request, tmp_path):
        if request.param == "file":
            return str(tmp_path / "root")
        if request.param == "seaweedfs":
            return s3_root(request.getfixturevalue("seaweedfs_credentials").endpoint)
        return s3_root(request.getfixturevalue("s3_endpoint"))


@pytest.mark.s3
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_objects_on_a_real_s3_server_hold_exactly_the_bytes_written(
    seaweedfs_credentials, signed, tmp_path, monkeypatch
):
    """pyarrow's AWS SDK uploads ``aws-chunked`` bodies with checksum trailers by default, and this
    SeaweedFS stores that framing as the object's bytes when the upload is unsigned (``anonymous``),
    silently (1,000 bytes were stored as 1,051; signed uploads are decoded).  phalanx's object tier turns it off itself
    (objectstore._AWS_CHECKSUM_ENV): with no such variable set by the user, every object the server
    keeps is exactly the partition the store wrote — by the server's own account (its filer's
    metadata), not the client's — and reads back verified."""
    for k in ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION"):
        monkeypatch.delenv(k, raising=False)  # a user who has never heard of them
    server = seaweedfs_credentials
    bucket = BUCKET if signed else ANON_BUCKET
    root = f"s3://{bucket}/framing-{uuid.uuid4().hex[:8]}?endpoint_override={server.endpoint}"
    store = px.Store(root + ("" if signed else "&anonymous=true"), session="frm", metadata=str(tmp_path / "m.sqlite"))
    rng = np.random.default_rng(7)
    parts = [
        pa.table({"k": np.arange(n, dtype=np.int64), "x": rng.random(n), "s": [f"row-{i}" for i in range(n)]})
        for n in (3, 1000, 70_000)
    ]
    info = store.put("framed", parts, producer="unit")
    assert len(info.partitions) == 3
    key_prefix = info.location[len(f"s3://{bucket}/") :]
    for i, (p, written) in enumerate(zip(info.partitions, parts)):
        assert p.bytes == serialize(written).size
        stored = server.object_size(bucket, f"{key_prefix}/{part_file(i)}")
        assert stored == p.bytes, f"partition {i}: {p.bytes} bytes written, the server stored {stored}"
    assert_same_rows(store.read("framed", verify=True), pa.concat_tables(parts))
    store.delete_session()


def test_s3_reads_download_and_objects_are_laid_out_by_session_name_version(s3_endpoint, tmp_path):
    store = px.Store(s3_root(s3_endpoint, "layout"), session="lay", metadata=str(tmp_path / "m.sqlite"))
    info = store.put("ds", [pa.table({"a": [1, 2]}), pa.table({"a": [3]})])
    assert info.location == f"s3://{BUCKET}/layout/lay/ds/{info.version}"
    assert sorted(s3_keys(store)) == [f"{BUCKET}/layout/lay/ds/{info.version}/part-0000{i}.arrow" for i in range(2)]
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
    s = px.Store(
        tmp_path / "shm",
        session="budget",
        metadata=str(tmp_path / "meta.sqlite"),
        memory_budget=int(2.5 * size),
        spill=tmp_path / "disk",
    )
    yield s
    s.delete_session()


def test_lru_dataset_spills_to_disk_and_comes_back_on_get(budget_store):
    s = budget_store
    tables = {n: table_of(80_000, i) for i, n in enumerate("abc")}
    s.put("a", tables["a"])
    s.put("b", tables["b"])
    assert s.memory_usage() == s.info("a").nbytes + s.info("b").nbytes <= s.memory_budget
    s.read("a")  # a is now more recently used than b
    s.put("c", tables["c"])  # over budget: b (least recently used) goes to disk
    assert [s.spilled(n) for n in "abc"] == [False, True, False]
    assert s.memory_usage() <= s.memory_budget
    spilled = s.info("b")
    assert s.spill_tier.owns(spilled.location) and Path(spilled.location).is_dir()
    assert s.read("b").equals(tables["b"])  # a get brings it back, and a (LRU now) spills
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
    s.put("c", tables["c"])  # a is the oldest but pinned: b spills
    assert [s.spilled(n) for n in "abc"] == [False, True, False]
    s.read("b")
    s.put("d", tables["d"])
    assert not s.spilled("a") and s.info("a").pinned
    s.unpin("a")
    s.read("b"), s.read("c"), s.read("d")
    assert s.spilled("a")  # unpinned and least recently used
    s.pin("a")  # pinning a spilled dataset brings it back
    assert not s.spilled("a") and s.read("a").equals(tables["a"])


def test_moving_keeps_readers_safe(budget_store):
    s = budget_store
    data = table_of(80_000, 1)
    s.put("a", data)
    held = s.read("a")  # buffers mapped from the memory tier
    stale = s.info("a")  # a location about to go away
    s.put("b", table_of(80_000, 2))
    s.read("b")
    s.put("c", table_of(80_000, 3))
    assert s.spilled("a") and not Path(stale.location).exists()
    assert held.equals(data)  # unlinked while mapped: the pages stay valid
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
    return (
        info.summary(),
        plan,
        back.collect(root=0),
        balanced.to_arrow().num_rows,
        st.tier.kind,
        st.meta.url,
        st.memory_budget,
    )


@pytest.mark.slow  # kept out of the core lane's 5 minutes
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
    store = px.Store(
        tmp_path / "shm", session="rgang", metadata=url, memory_budget=int(2.5 * per_dataset), spill=tmp_path / "disk"
    )
    with px.Gang(ranks=2, echo=False, store=store) as g:
        results = g.run(app_put_three_get_first, size)
    spilled_after, rows, meta_url, budget, spill = results[0]
    assert spilled_after == [False, False, True, False]  # c pushed a out; get a brought it back
    assert rows == size // 8 and meta_url == url
    assert budget == store.memory_budget and spill == str(tmp_path / "disk")
    assert [store.spilled(n) for n in "abc"] == [False, True, False]
    # the catalogue is in Redis: the same root with its default SQLite sees nothing
    assert store.list() == ["a", "b", "c"] and px.Store(tmp_path / "shm", session="rgang").list() == []
    assert store.read("a").num_rows == size // 4
    store.delete_session()
    assert store.meta.sessions() == [] or "rgang" not in store.meta.sessions()
