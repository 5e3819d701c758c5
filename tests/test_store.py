"""The intermediate store: round trips, N→M repartitioning, atomic seal, checksums, sessions."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from reference import assert_same_rows, make_part, whole

import phalanx as px
from phalanx.errors import ChecksumError, DatasetExistsError, DatasetNotFoundError, StoreError, UnsafePathError
from phalanx.operators import kernels
from phalanx.store.repartition import hash_partitioning
from phalanx.testing.tables import every_type_table, same_table

SIZES = (1, 2, 3, 4)


@pytest.fixture
def store(request):
    s = px.Store(session=f"t-{request.node.name}"[:60].replace("/", "_"))
    yield s
    s.delete_session()


def test_round_trip_of_every_type_with_info(store):
    t = every_type_table()
    info = store.put("types", [t.slice(0, 200), t.slice(200)], producer="unit-test")
    assert same_table(store.read("types"), t)
    assert store.list() == ["types"] and store.exists("types")
    got = store.info("types")
    assert got.schema.equals(t.schema)
    assert [p.rows for p in got.partitions] == [200, 300]
    assert got.producer == "unit-test" and got.partitioning == {"kind": "none"}
    assert got.nbytes == sum(os.path.getsize(p) for p in Path(info.location).glob("*.arrow"))
    summary = got.summary()
    assert summary["rows"] == 500 and len(summary["checksums"]) == 2


def test_put_checksum_is_the_files_own_xxh3_and_the_file_is_arrows_ipc(store):
    """The checksum a put computes while writing equals xxh3-64 of the file's bytes read back
    independently, and the file is what Arrow's own IPC writer makes: many small buffers
    (gathered writes), a column larger than one hashed piece, strings, dictionaries, nulls,
    several record batches, an empty partition."""
    import xxhash

    from phalanx.store.tiers import HashingSink

    big = pa.array(np.arange(3 * HashingSink.PIECE // 8 + 123, dtype=np.int64))  # > PIECE bytes
    wide = pa.table({f"c{i}": pa.array([i, None, i + 1], pa.int32()) for i in range(200)})
    batches = pa.concat_tables([every_type_table(300), every_type_table(200)])  # two batches
    tables = [pa.table({"big": big}), wide, batches, every_type_table(0), every_type_table()]
    for k, t in enumerate(tables):
        info = store.put(f"p{k}", t)
        part = info.partitions[0]
        data = (Path(info.location) / "part-00000.arrow").read_bytes()
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, t.schema) as w:
            w.write_table(t)
        assert data == sink.getvalue().to_pybytes(), k  # Arrow's bytes, exactly
        assert part.checksum == xxhash.xxh3_64_hexdigest(data) and part.bytes == len(data), k
        back = store.read(f"p{k}")  # its checksum verified on read
        assert back.schema == t.schema and back.num_rows == t.num_rows, k


def test_a_put_failing_inside_the_ipc_writer_leaves_nothing(store, monkeypatch):
    """ENOSPC from a write in the middle of a partition (after some bytes were written and
    hashed) fails the put with the OS error, and nothing is sealed or staged."""
    import errno

    from phalanx.errors import StoreError
    from phalanx.store import tiers

    real = tiers._write_all
    written = []

    def full(fd, view):
        if sum(written) > 100_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(len(view))
        real(fd, view)

    monkeypatch.setattr(tiers, "_write_all", full)
    with pytest.raises(
        StoreError,
        match=r"put 'f' partition 0: writing .*part-00000.arrow failed: "
        r"\[Errno 28\] No space left on device",
    ):
        store.put("f", pa.table({"a": np.arange(1_000_000)}))
    assert written and not store.exists("f")
    assert [u for u in store.unsealed() if u.session == store.session] == []


def test_datasets_are_immutable_unless_replaced(store):
    store.put("x", pa.table({"a": [1]}))
    old_location = store.info("x").location
    with pytest.raises(DatasetExistsError, match="dataset 'x' exists"):
        store.put("x", pa.table({"a": [2]}))
    old_info = store.info("x")
    store.put("x", pa.table({"a": [3, 4]}), replace=True)
    assert store.read("x")["a"].to_pylist() == [3, 4]
    # a reader that looked the old version up before the replace can still open it ...
    assert store.partition(old_info, 0)["a"].to_pylist() == [1]
    # ... until the grace period for retired versions is over
    store.purge_retired(older_than=0)
    assert not Path(old_location).exists()
    store.delete("x")
    with pytest.raises(DatasetNotFoundError, match="no dataset 'x'"):
        store.info("x")


def test_sessions_do_not_see_each_other(store):
    other = store.for_session(store.session + "-other")
    store.put("shared-name", pa.table({"a": [1]}))
    other.put("shared-name", pa.table({"a": [2]}))
    assert store.read("shared-name")["a"].to_pylist() == [1]
    assert other.read("shared-name")["a"].to_pylist() == [2]
    assert other.delete_session() == 1
    assert not other.exists("shared-name") and store.exists("shared-name")
    assert not (store.root / other.session).exists()


def test_corrupted_partition_names_dataset_and_partition(store):
    info = store.put("c", [pa.table({"a": np.arange(1000)}), pa.table({"a": np.arange(1000)})])
    path = Path(info.location) / "part-00001.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    later = px.Store(store.root, session=store.session)  # e.g. the driver of a resume
    with pytest.raises(ChecksumError, match=r"dataset 'c' partition 1 .*checksum mismatch"):
        later.read("c")


def test_any_arrow_error_reading_an_unverified_partition_names_it(tmp_path):
    """A damaged schema makes pyarrow raise ArrowNotImplementedError ("Integers with more than
    64 bits not implemented"), not ArrowInvalid: a read without verification names the
    dataset, partition and file for every pyarrow error (issue 22 item 21)."""
    import pyarrow.ipc as ipc

    store = px.Store(tmp_path / "root", session="s")
    info = store.put("c", pa.table({"a": np.arange(1000)}))
    path = Path(info.location) / "part-00000.arrow"
    good = path.read_bytes()

    def error_of(data: bytes) -> type | None:
        try:
            ipc.open_file(pa.BufferReader(data)).read_all()
        except Exception as exc:
            return type(exc)
        return None

    damaged = next(  # one byte of the footer's schema, found rather than hard-coded
        (
            d
            for i in range(len(good) - 64, len(good))
            for v in (0x00, 0x7F, 0xFF)
            if error_of(d := good[:i] + bytes([v]) + good[i + 1 :]) is pa.ArrowNotImplementedError
        ),
        None,
    )
    assert damaged is not None
    path.write_bytes(damaged)
    with pytest.raises(StoreError, match=r"dataset 'c' partition 0 \(.*part-00000.arrow\) is unreadable: "):
        store.read("c", verify=False)


# ---- N producer partitions → M consumer ranks ---------------------------------------------
def put_from_driver(store: px.Store, name: str, n: int, by=None) -> pa.Table:
    """A dataset of n partitions; with ``by``, hash-partitioned the way a gang would."""
    data = whole(n, rows=1500, seed=n)
    if by:
        parts = kernels.hash_partition(data, by, n)
        store.put(name, parts, partitioning=hash_partitioning(by, n))
        return pa.concat_tables(parts)
    store.put(name, [make_part(r, n, 1500, n) for r in range(n)])
    return data


def app_get(env, session, name, mode):
    rs = env.store.for_session(session)
    if mode == "balanced":
        df = rs.get(name)
    elif mode == "by":
        df = rs.get(name, by=["key"])
    else:
        df = rs.get(name, shuffle="random", seed=int(mode.split(":")[1]))
    local = df.to_arrow()
    return df.collect(root=0), local.num_rows, local.column("key").to_pylist(), rs.last_plan, df.partitioned_by


@pytest.mark.parametrize("n", SIZES)
def test_get_balanced_n_to_m_keeps_order_with_zero_copy(gang, store, n):
    data = put_from_driver(store, "d", n)
    results = gang.run(app_get, store.session, "d", "balanced")
    assert results[0][0].equals(data)  # rank order = dataset order: nothing lost, duplicated or moved
    sizes = [r[1] for r in results]
    assert max(sizes) - min(sizes) <= 1
    assert {r[3] for r in results} == {"balanced, zero-copy"}


@pytest.mark.parametrize("n", SIZES)
def test_get_by_keys_n_to_m(gang, store, n):
    data = put_from_driver(store, "d", n, by=["key"])
    results = gang.run(app_get, store.session, "d", "by")
    assert_same_rows(results[0][0], data)
    owner = {}
    for rank, r in enumerate(results):
        for k in r[2]:
            assert owner.setdefault(k, rank) == rank, f"key {k} on ranks {owner[k]} and {rank}"
        assert r[4] == ("key",)
    expected_plan = "hash: stored partition, zero-copy" if n == gang.world_size else "hash: balanced read + shuffle"
    assert {r[3] for r in results} == {expected_plan}


@pytest.mark.parametrize("n", SIZES)
def test_get_random_is_a_seeded_permutation(gang, store, n):
    data = put_from_driver(store, "d", n)
    first = gang.run(app_get, store.session, "d", "random:7")
    again = gang.run(app_get, store.session, "d", "random:7")
    other = gang.run(app_get, store.session, "d", "random:8")
    assert_same_rows(first[0][0], data)
    assert first[0][0].equals(again[0][0])
    assert not first[0][0].equals(other[0][0])
    assert not first[0][0].equals(data)


# ---- put from a gang ----------------------------------------------------------------------
def app_put_then_get(env, name):
    df = px.DataFrame.from_arrow(make_part(env.rank, env.world_size), env).shuffle("key")
    info = env.store.put(name, df, producer="features")
    back = env.store.get(name, by="key")
    return info.summary(), env.store.last_plan, back.collect(root=0)


def test_gang_put_records_partitioning_and_reads_back_zero_copy(gang):
    name = f"gang-put-{gang.world_size}"
    results = gang.run(app_put_then_get, name)
    summary, plan, back = results[0]
    assert summary["partitioning"]["keys"] == ["key"] and summary["partitioning"]["n"] == gang.world_size
    assert summary["producer"] == "features" and summary["partitions"] == gang.world_size
    assert plan == "hash: stored partition, zero-copy"
    assert_same_rows(back, whole(gang.world_size))
    assert_same_rows(px.Store().read(name), whole(gang.world_size))
    px.Store().delete(name)


def app_put_existing(env, name):
    env.store.put(name, pa.table({"a": [env.rank]}))


def test_put_of_an_existing_name_fails_on_every_rank(gang):
    name = f"exists-{gang.world_size}"
    px.Store().put(name, pa.table({"a": [0]}))
    with pytest.raises(px.RankError) as info:
        gang.run(app_put_existing, name)
    assert info.value.ranks == list(range(gang.world_size))
    assert "DatasetExistsError" in {f.exc_type for f in info.value.failures}
    px.Store().delete(name)


def app_put_fails_on_rank_1(env, name):
    if env.rank == 1:
        raise RuntimeError("producer rank 1 failed")
    env.store.put(name, pa.table({"a": np.arange(1000) + env.rank}))


def test_failed_producer_leaves_nothing_visible_or_staged():
    store = px.Store()
    with px.Gang(ranks=3, echo=False) as g:
        with pytest.raises(px.RankError, match="producer rank 1 failed"):
            g.run(app_put_fails_on_rank_1, "half-written")
        assert not store.exists("half-written")
        assert list(store.root.glob(f"*/.staging/{g.gang_id}-*")) == []


def app_concurrent_reads(env, name, times):
    store = px.Store()
    return [store.read(name).num_rows for _ in range(times)]


def test_concurrent_readers_see_the_whole_dataset(gang, store):
    data = whole(4, rows=20_000)
    px.Store().put("conc", [data.slice(0, 40_000), data.slice(40_000)])
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(px.Store().read("conc").num_rows)) for _ in range(4)]
    for t in threads:
        t.start()
    results = gang.run(app_concurrent_reads, "conc", 5)
    for t in threads:
        t.join()
    assert {n for r in results for n in r} | set(seen) == {data.num_rows}
    px.Store().delete("conc")


def app_get_verified(env, name):
    return env.store.get(name, verify=True).num_rows


def test_get_with_verify_reports_the_corrupt_partition(gang2_store):
    g, store = gang2_store
    info = store.put("corrupt", [pa.table({"a": np.arange(5000)})] * 2)
    path = Path(info.location) / "part-00000.arrow"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(px.RankError, match=r"dataset 'corrupt' partition 0 .*checksum mismatch"):
        g.run(app_get_verified, "corrupt")


@pytest.fixture
def gang2_store():
    store = px.Store(session="verify")
    with px.Gang(ranks=2, echo=False, session="verify") as g:
        yield g, store
    store.delete_session()


def app_write_fails_on_rank_1_but_is_caught(env, name):
    if env.rank == 1:

        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")

        env.store.store.stage_partition = broken
    try:
        env.store.put(name, pa.table({"a": [env.rank]}))
    except Exception as exc:  # an app may catch store errors: no rank may be left waiting
        return f"{type(exc).__name__}: {exc}"
    return "sealed"


def test_a_write_failing_on_one_rank_fails_the_put_on_every_rank():
    with px.Gang(ranks=3, echo=False) as g:
        outcomes = g.run(app_write_fails_on_rank_1_but_is_caught, "one-rank-fails", timeout=60)
        assert outcomes[1] == "OSError: [Errno 28] No space left on device"
        for r in (0, 2):
            assert outcomes[r].startswith(
                "PhalanxError: put 'one-rank-fails': writing partitions failed on rank(s) [1]"
            )
        assert not px.Store().exists("one-rank-fails")
        # this gang's session only: another worker's test may be staging a put right now
        session = g.run(app_store_session)[0]
        assert list(px.Store().root.glob(f"{session}/.staging/*")) == []


def app_store_session(env):
    return env.store.store.session


def app_get_columns(env, session, name):
    rs = env.store.for_session(session)
    return [
        rs.get(name, columns=["v", "w"]).collect(root=0),
        rs.get(name, by="key", columns=["w"]).collect(root=0),
        rs.get(name, shuffle="random", seed=3, columns=["s"]).collect(root=0),
    ]


def test_get_reads_only_the_columns_asked_for(gang, store):
    data = put_from_driver(store, "d", 2)
    balanced, by_key, shuffled = gang.run(app_get_columns, store.session, "d")[0]
    assert balanced.equals(data.select(["v", "w"]))
    assert by_key.column_names == ["w"]
    assert sorted(by_key["w"].to_pylist()) == sorted(data["w"].to_pylist())
    assert shuffled.column_names == ["s"]
    assert sorted(shuffled["s"].to_pylist(), key=str) == sorted(data["s"].to_pylist(), key=str)


def app_delete_and_pin(env, name):
    env.store.put(name, pa.table({"a": [env.rank]}))
    pinned = env.store.pin(name).pinned
    env.store.delete(name)
    try:
        env.store.delete(name)
    except Exception as exc:
        return pinned, env.store.exists(name), type(exc).__name__
    return pinned, env.store.exists(name), None


def test_store_changes_from_a_gang_are_made_once(gang):
    results = gang.run(app_delete_and_pin, f"collective-{gang.world_size}")
    assert results == [(True, False, "DatasetNotFoundError")] * gang.world_size


@pytest.mark.slow  # the core lane stays under 5 minutes; CI's slow lane runs it
def test_cli_store_sessions_ls_rm_and_rm_all(tmp_path):
    import subprocess
    import sys

    root = tmp_path / "root"
    for session, names in (("run-a", ["x", "y"]), ("run-b", ["z"])):
        s = px.Store(root, session)
        for n in names:
            s.put(n, pa.table({"v": list(range(10))}))

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "phalanx.cli", "store", "--root", str(root), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    out = cli("sessions")
    assert out.returncode == 0 and [l.split()[:2] for l in out.stdout.splitlines()] == [["run-a", "2"], ["run-b", "1"]]
    assert cli("--session", "run-a", "rm").returncode == 2  # neither names nor --all
    assert cli("--session", "run-a", "rm", "x").stdout.strip() == "removed x"
    assert "removed 1 datasets of session 'run-a'" in cli("--session", "run-a", "rm", "--all").stdout
    assert px.Store(root, "run-a").list() == [] and px.Store(root, "run-b").list() == ["z"]
    bad = cli("--session", "run-b", "rm", "nope")
    assert bad.returncode == 1 and "no dataset 'nope'" in bad.stderr


# ---- issue 22: what the store removes, the modes of what it creates, concurrent first opens ----
def test_purge_of_retired_follows_no_path_out_of_the_root_or_of_another_user(tmp_path, caplog):
    """A file under .retired names a location to remove; on a root other users can write in,
    none may make the owner remove a directory outside the root (named directly, through
    ``..`` or through a symbolic link inside the root), one owned by someone else, or follow
    an entry that is a link or is not the owner's (issue 22 item 14; the hostile-user versions
    with a real second user are in tests/faults/test_store_faults.py)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    store = px.Store(root, session="s")
    old = store.put("d", pa.table({"a": [1]}))
    store.put("d", pa.table({"a": [2]}), replace=True)  # the old version is retired: one entry
    trash = root / ".retired"
    assert len(os.listdir(trash)) == 1
    for name in ("direct", "dotdot", "via-link", "theirs"):
        (outside / name).mkdir(parents=True)
        (outside / name / "keep").write_text("keep")
    (root / "s" / "link").symlink_to(outside)
    theirs = root / "s" / "theirs"
    theirs.mkdir()
    (theirs / "keep").write_text("keep")
    entries = {
        "0-direct": str(outside / "direct"),
        "0-dotdot": f"{root}/s/../../outside/dotdot",
        "0-vialink": str(root / "s" / "link" / "via-link"),
        "0-theirs": str(theirs),
    }
    for name, location in entries.items():
        (trash / name).write_text(location)
    (trash / "0-islink").symlink_to(trash / "0-direct")
    if os.geteuid() == 0:  # a directory and an entry of another user (root can make them)
        os.chown(theirs, 4242, 4242)
        (trash / "0-notmine").write_text(str(outside / "direct"))
        os.chown(trash / "0-notmine", 4242, 4242)

    with caplog.at_level("WARNING", logger="phalanx.store"):
        assert store.purge_retired(older_than=0) == 1  # the store's own entry
    assert not Path(old.location).exists() and store.read("d")["a"].to_pylist() == [2]
    for name in ("direct", "dotdot", "via-link", "theirs"):
        assert (outside / name / "keep").read_text() == "keep"
    assert (theirs / "keep").read_text() == "keep"
    said = {r.getMessage().split(" refusing to act on ")[1].split(",")[0]: r.getMessage() for r in caplog.records}
    assert sorted(said) == sorted(str(trash / n) for n in os.listdir(trash)), caplog.text
    assert f"{outside / 'direct'}: it is not inside the store root {root}" in said[str(trash / "0-direct")]
    assert "not inside the store root" in said[str(trash / "0-dotdot")]
    assert f"{root / 's' / 'link'} is a symbolic link (to {outside})" in said[str(trash / "0-vialink")]
    assert f"{trash / '0-islink'} is a symbolic link" in said[str(trash / "0-islink")]
    if os.geteuid() == 0:
        assert f"{theirs} is owned by an unknown user (uid 4242), not by you" in said[str(trash / "0-theirs")]
        assert f"{trash / '0-notmine'} is owned by an unknown user (uid 4242)" in said[str(trash / "0-notmine")]
    # a location in the metadata is no more trusted: store rm --all removes the rest, then
    # refuses naming it (and the session directory, which holds someone else's)
    current = store.info("d").location
    store.meta.seal(replace(store.info("d"), name="e", location=str(outside / "direct")), False)
    with pytest.raises(UnsafePathError, match=f"refusing to remove {outside / 'direct'}: it is not inside") as info:
        store.delete_session()
    assert f"refusing to remove {root / 's'}: {theirs} is owned by" in str(info.value) or os.geteuid() != 0
    assert (outside / "direct" / "keep").exists() and (theirs / "keep").exists()
    assert store.list() == [] and not Path(current).exists()


def test_a_retired_directory_that_is_not_one_fails_delete_naming_it(tmp_path):
    store = px.Store(tmp_path / "root", session="s")
    info = store.put("d", pa.table({"a": [1]}))
    (tmp_path / "root" / ".retired").write_text("not a directory")
    with pytest.raises(StoreError, match=f"cannot record the replaced or deleted version at {info.location} under"):
        store.delete("d")
    assert not store.exists("d") and Path(info.location).is_dir()  # gone from the catalogue, files kept


def test_everything_the_store_creates_is_private_to_its_user(tmp_path):
    """Files 0600 and directories 0700 under the root and the spill directory, whatever the
    umask — partitions, the catalogue, and the files under .retired
    (issue 22 item 21: those were 0644)."""
    umask = os.umask(0o022)
    try:
        root, spill = tmp_path / "root", tmp_path / "spill"
        store = px.Store(root, session="s", memory_budget=1 << 20, spill=spill)
        big = pa.table({"x": np.arange(200_000)})  # 1.6 MB: over the budget, spilled
        store.put("d", pa.table({"a": [1]}))
        store.put("d", pa.table({"a": [2]}), replace=True)  # retires the first version
        store.put("e", big)
        store.put("e", big, replace=True)
        store.delete("d")
        assert store.spilled("e") and len(os.listdir(root / ".retired")) == 3
    finally:
        os.umask(umask)
    modes = {str(p): oct(p.lstat().st_mode & 0o777) for top in (root, spill) for p in (top, *top.rglob("*"))}
    wrong = {p: m for p, m in modes.items() if m != (oct(0o700) if Path(p).is_dir() else oct(0o600))}
    assert not wrong, wrong
    assert any(".retired/" in p for p in modes) and str(root / "meta.sqlite") in modes


_FIRST_VERSION_SCHEMA = """CREATE TABLE datasets (
    session TEXT NOT NULL, name TEXT NOT NULL, version TEXT NOT NULL, location TEXT NOT NULL,
    schema BLOB NOT NULL, partitioning TEXT NOT NULL, producer TEXT, run TEXT,
    created REAL NOT NULL, pinned INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (session, name))"""


def _open_catalogue(path, go, results):
    from phalanx.store.metadata import SQLiteMetadata

    go.wait()
    try:
        SQLiteMetadata(path)
        results.put(None)
    except Exception as exc:  # what the test reports
        results.put(repr(exc))


@pytest.mark.parametrize("catalogue", ["new", "first-version"])
def test_processes_opening_a_catalogue_at_once_all_succeed(tmp_path, catalogue):
    """8 processes open the same new catalogue, or one of the first version of the store
    (no ``accessed`` column), at the same moment, 4 times: every one opens it (the column was
    added by two at once: "duplicate column name", 1–3 of 8 died)."""
    import multiprocessing
    import sqlite3

    ctx = multiprocessing.get_context("fork")  # started at once, without importing again
    failures = []
    for round_ in range(4):
        path = tmp_path / f"{round_}" / "meta.sqlite"
        if catalogue == "first-version":
            path.parent.mkdir()
            with sqlite3.connect(path) as con:
                con.execute(_FIRST_VERSION_SCHEMA)
        go, results = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_open_catalogue, args=(path, go, results)) for _ in range(8)]
        for p in procs:
            p.start()
        go.set()
        failures += [r for r in (results.get(timeout=60) for _ in procs) if r]
        for p in procs:
            p.join(30)
    assert failures == []
    with sqlite3.connect(path) as con:
        assert "accessed" in {r[1] for r in con.execute("PRAGMA table_info(datasets)")}


def test_rank_hosts_puts_each_reader_where_most_of_its_rows_are():
    """Placement by locality (store spread over hosts): reader rank r runs where most of the
    bytes of its balanced share live; no host recorded → no preference."""
    from phalanx.store.metadata import DatasetInfo, PartitionInfo
    from phalanx.store.repartition import rank_hosts

    def info(parts):
        return DatasetInfo("s", "d", "v", "/x", pa.schema([("a", pa.int64())]), parts)

    spread = info([PartitionInfo(i, 100, 800, "c", host=h) for i, h in enumerate(["h1", "h2", "h3"])])
    assert rank_hosts([spread], 3) == ["h1", "h2", "h3"]  # N = M: partition r's host
    assert rank_hosts([spread], 1) == ["h1"]  # a tie: the first host by name
    # 2 readers of 3 partitions: rows [0,150) mostly on h1, [150,300) mostly on h3
    assert rank_hosts([spread], 2) == ["h1", "h3"]
    skewed = info([PartitionInfo(0, 10, 80, "c", host="h1"), PartitionInfo(1, 290, 2320, "c", host="h2")])
    assert rank_hosts([skewed], 2) == ["h2", "h2"]
    assert rank_hosts([info([PartitionInfo(0, 100, 800, "c")])], 2) is None  # one host / shared root
