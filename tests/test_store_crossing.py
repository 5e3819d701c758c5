"""phalanx.store.crossing: a sealed dataset copied from one store to another, byte for byte,
verified, once, resumable — file→file, file→S3 and S3→file (moto), from partitions held by
another host's store service (loopback), and a crossing killed by PID then resumed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from test_store_backends import s3_endpoint, s3_root  # noqa: F401  (the moto fixture)

import phalanx as px
from phalanx.errors import ChecksumError, DatasetExistsError
from phalanx.store.crossing import Crossing, CrossingProgress, cross
from phalanx.store.metadata import open_metadata
from phalanx.store.tiers import FileTier, part_file

ROOT = Path(__file__).resolve().parent.parent


def parts_of(n: int, rows: int, seed: int = 0) -> list[pa.Table]:
    rng = np.random.default_rng(seed)
    return [
        pa.table(
            {
                "user": pa.array([f"u{j % 97:03d}" for j in range(rows)]),
                "amount": pa.array(rng.normal(size=rows)),
                "n": pa.array(np.arange(i * rows, (i + 1) * rows, dtype=np.int64)),
            }
        )
        for i in range(n)
    ]


def file_bytes(store: px.Store, name: str) -> list[bytes]:
    """Each partition file's bytes as the store's tier holds them."""
    info = store.info(name)
    return [store.tier.read_buffer(info.location, i).to_pybytes() for i in range(info.num_partitions)]


@pytest.fixture
def two(tmp_path):
    src = px.Store(tmp_path / "a", session="etl")
    dst = px.Store(tmp_path / "b", session="train")
    src.put("features", parts_of(5, 2000), partitioning={"kind": "hash", "keys": ["user"], "n": 5, "hash": "x"})
    return src, dst


def test_file_to_file_is_byte_identical_and_records_its_origin(two):
    src, dst = two
    seen: list[CrossingProgress] = []
    c = cross(src, "features", dst, run="run-7", on_progress=seen.append)
    s, d = src.info("features"), dst.info("features")
    assert file_bytes(src, "features") == file_bytes(dst, "features")
    assert [p.checksum for p in d.partitions] == [p.checksum for p in s.partitions]
    assert [p.rows for p in d.partitions] == [p.rows for p in s.partitions]
    assert d.schema.equals(s.schema) and d.partitioning == s.partitioning and d.run == "run-7"
    assert d.origin == {
        "store": str(src.root),
        "session": "etl",
        "name": "features",
        "version": s.version,
        "root_id": src.tier.root_id(),
    }
    assert d.location.startswith(str(dst.root)) and d.version != s.version
    assert (c.partitions_moved, c.partitions_skipped, c.bytes_moved, c.already) == (5, 0, s.nbytes, False)
    assert c.source == f"{src.root} session 'etl'" and c.dest == f"{dst.root} session 'train'"
    assert [p.index for p in seen] == list(range(5)) and seen[-1].bytes_done == s.nbytes and all(p.moved for p in seen)
    # the independent reference: pandas on both sides
    assert dst.read("features").to_pandas().equals(src.read("features").to_pandas())
    # nothing staged is left behind
    assert dst.unsealed() == [] and not any((Path(dst.root) / "train" / ".staging").iterdir())


def test_a_second_crossing_of_the_same_version_moves_nothing(two):
    src, dst = two
    first = cross(src, "features", dst)
    again = cross(src, "features", dst)
    assert again.already and again.bytes_moved == 0 and again.partitions_moved == 0
    assert again.version == first.version == dst.info("features").version
    # a new version at the source crosses again only when asked to replace
    src.put("features", parts_of(2, 100, seed=1), replace=True)
    with pytest.raises(DatasetExistsError, match="did not cross from"):
        cross(src, "features", dst)
    third = cross(src, "features", dst, replace=True)
    assert not third.already and third.partitions_moved == 2
    assert file_bytes(dst, "features") == file_bytes(src, "features")


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_copy_is_checked_once_per_attempt_and_crossed_again(two, monkeypatch):
    """The copy a crossing made is damaged afterwards (a bit flipped on the destination's
    disk).  A later attempt (a resume's driver: ``Store.new_attempt``) checks it before taking
    it for crossed, finds the damage, and crosses it again, replacing it; within one attempt
    the check is not repeated (what the crossing read back, it trusts: O(1) per reader)."""
    import phalanx.store.store as store_module

    src, dst = two
    first = cross(src, "features", dst)
    hashed: list[int] = []
    real = store_module.checksum_buffer

    def counting(buf):
        hashed.append(buf.size)
        return real(buf)

    monkeypatch.setattr(store_module, "checksum_buffer", counting)
    assert cross(src, "features", dst).already and hashed == []  # this attempt read it back: trusted
    flip_a_byte(Path(first.info.location) / part_file(2))
    dst.new_attempt()  # the next run attempt trusts nothing
    again = cross(src, "features", dst)
    assert not again.already and again.partitions_moved == 5 and again.bytes_moved == src.info("features").nbytes
    assert again.replaced.startswith(f"its copy there (version {first.version}) failed its check:")
    assert "partition 2" in again.replaced and "checksum mismatch" in again.replaced
    assert again.version != first.version == first.info.version and dst.info("features").version == again.version
    assert file_bytes(dst, "features") == file_bytes(src, "features")
    assert dst.read("features").to_pandas().equals(src.read("features").to_pandas())
    # the re-crossed copy is trusted by this attempt; a new attempt hashes each partition once
    hashed.clear()
    assert cross(src, "features", dst).already and hashed == []
    dst.new_attempt()
    assert cross(src, "features", dst).already and len(hashed) == 5
    assert cross(src, "features", dst).already and len(hashed) == 5
    # a partition removed is seen even by the attempt that checked it (no hashing needed)
    os.unlink(Path(dst.info("features").location) / part_file(0))
    assert "is missing" in cross(src, "features", dst).replaced
    assert file_bytes(dst, "features") == file_bytes(src, "features")


def test_a_crossing_replaces_a_copy_of_another_version_and_says_so(two):
    src, dst = two
    first = cross(src, "features", dst)
    src.put("features", parts_of(2, 100, seed=3), replace=True)
    again = cross(src, "features", dst, replace=True)
    assert again.replaced == f"it replaces version {first.version} (crossed from version {first.source_version})"
    assert again.summary()["replaced"] == again.replaced and "replaced" not in first.summary()
    assert file_bytes(dst, "features") == file_bytes(src, "features")


def test_a_damaged_copy_on_an_object_store_is_crossed_again_beside_it(s3_endpoint, tmp_path):  # noqa: F811
    """On an object store a crossing is written in place, under a name made from the source
    version: crossing the same version again after the copy was damaged writes beside it
    (``cross-<key>-again``), never over the copy the seal then retires."""
    src = px.Store(tmp_path / "a", session="etl")
    src.put("features", parts_of(3, 1000))
    meta, root = f"sqlite://{tmp_path / 'cloud.sqlite'}", s3_root(s3_endpoint)
    cloud = px.Store(root, session="train", metadata=meta)
    first = cross(src, "features", cloud)
    good = file_bytes(cloud, "features")
    cloud.tier.write_buffer(first.info.location, 1, pa.py_buffer(good[1][:-16]))  # cut short
    fresh = px.Store(root, session="train", metadata=meta)  # another attempt
    again = cross(src, "features", fresh)
    assert not again.already and again.version == f"{first.version}-again" and "partition 1" in again.replaced
    assert file_bytes(fresh, "features") == file_bytes(src, "features")
    assert fresh.unsealed() == []
    with pytest.raises(FileNotFoundError):  # the damaged copy was retired
        fresh.tier.read_buffer(first.info.location, 0)
    third = px.Store(root, session="train", metadata=meta)
    assert cross(src, "features", third).already


def test_a_damaged_source_partition_fails_naming_it_and_seals_nothing(two):
    src, dst = two
    info = src.info("features")
    path = Path(info.location) / part_file(3)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError) as err:
        cross(src, "features", dst)
    msg = str(err.value)
    assert "'features' partition 3" in msg and str(src.root) in msg and str(dst.root) in msg
    assert not dst.exists("features")
    # the three partitions before it stay staged for a resume, once the source is repaired; the
    # damaged one, streamed to its end before its checksum failed, does not
    (staged,) = dst.unsealed()
    assert staged.bytes == sum(p.bytes for p in info.partitions[:3])


def test_a_destination_that_stores_other_bytes_fails_naming_both_stores(two, monkeypatch):
    src, dst = two
    write = dst.tier.write_chunks

    def lossy(location, index, chunks):
        whole = pa.py_buffer(b"".join(c.to_pybytes() for c in chunks))
        write(location, index, [whole.slice(0, whole.size - 8)])  # a short write that says nothing

    monkeypatch.setattr(dst.tier, "write_chunks", lossy)
    with pytest.raises(ChecksumError, match=r"partition 0 from .* to .*: the destination holds other bytes"):
        cross(src, "features", dst)
    assert not dst.exists("features")


CHILD = """
import sys, time
import phalanx as px
from phalanx.store.crossing import cross

src = px.Store(sys.argv[1], session="etl")
dst = px.Store(sys.argv[2], session="train")
stop_after = int(sys.argv[3])

def progress(p):
    if p.index + 1 == stop_after:
        print("stopped", p.bytes_moved, flush=True)
        time.sleep(120)  # killed here by the test

cross(src, "big", dst, on_progress=progress)
"""


def test_a_crossing_killed_midway_resumes_with_only_the_rest(tmp_path):
    src = px.Store(tmp_path / "a", session="etl")
    dst = px.Store(tmp_path / "b", session="train")
    src.put("big", parts_of(40, 4000))
    info = src.info("big")
    k = 15
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(src.root), str(dst.root), str(k)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("stopped"), line
        assert int(line.split()[1]) == sum(p.bytes for p in info.partitions[:k])
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # by PID: the crossing this test started
        proc.wait(timeout=30)
    assert not dst.exists("big")
    # a partition cut short when the process died is not taken for arrived: the last one staged
    # is truncated as a kill in the middle of its write would leave it
    (staged,) = dst.unsealed()
    last = Path(staged.location) / part_file(k - 1)
    os.truncate(last, last.stat().st_size // 2)
    c = cross(src, "big", dst)
    assert (c.partitions_skipped, c.partitions_moved) == (k - 1, 40 - k + 1)
    assert c.bytes_moved == sum(p.bytes for p in info.partitions[k - 1 :])
    assert file_bytes(dst, "big") == file_bytes(src, "big")
    assert dst.unsealed() == []


def test_file_to_s3_and_back_to_file(s3_endpoint, tmp_path):  # noqa: F811
    src = px.Store(tmp_path / "a", session="etl")
    src.put("features", parts_of(4, 3000))
    cloud = px.Store(s3_root(s3_endpoint), session="train", metadata=f"sqlite://{tmp_path / 'cloud.sqlite'}")
    up = cross(src, "features", cloud)
    assert up.partitions_moved == 4 and up.bytes_moved == src.info("features").nbytes
    assert "?endpoint_override=" in up.dest and up.info.location.startswith("s3://")
    assert file_bytes(cloud, "features") == file_bytes(src, "features")
    assert [p.checksum for p in cloud.info("features").partitions] == [
        p.checksum for p in src.info("features").partitions
    ]
    assert cross(src, "features", cloud).already
    back_store = px.Store(tmp_path / "c", session="report")
    down = cross(cloud, "features", back_store)
    assert down.partitions_moved == 4 and back_store.info("features").origin["store"] == cloud.tier.root_url
    assert back_store.read("features").equals(src.read("features"))
    assert cloud.unsealed() == [] and back_store.unsealed() == []


def test_an_interrupted_crossing_to_s3_resumes_with_only_the_rest(s3_endpoint, tmp_path):  # noqa: F811
    src = px.Store(tmp_path / "a", session="etl")
    src.put("features", parts_of(6, 1000))
    cloud = px.Store(s3_root(s3_endpoint), session="train", metadata=f"sqlite://{tmp_path / 'cloud.sqlite'}")

    class Lost(Exception):
        pass

    def lose_after_two(p: CrossingProgress) -> None:
        if p.index == 1:
            raise Lost

    with pytest.raises(Lost):
        cross(src, "features", cloud, on_progress=lose_after_two)
    assert not cloud.exists("features") and len(cloud.unsealed()) == 1
    c = cross(src, "features", cloud)
    assert (c.partitions_skipped, c.partitions_moved) == (2, 4)
    assert file_bytes(cloud, "features") == file_bytes(src, "features") and cloud.unsealed() == []


def test_partitions_held_by_another_hosts_service_cross_through_it(tmp_path, monkeypatch):
    from phalanx.store.service import ENV_TOKEN, StoreService

    monkeypatch.setenv(ENV_TOKEN, "crossing-test-token")
    meta = f"sqlite://{tmp_path / 'meta.sqlite'}"
    holder = px.Store(tmp_path / "holder", session="etl", metadata=meta)
    holder.put("features", parts_of(3, 2000))
    with StoreService(holder.root, "127.0.0.1", token="crossing-test-token") as svc:
        info = holder.info("features")
        parts = [dataclasses.replace(p, host="h1", endpoint=svc.endpoint) for p in info.partitions]
        open_metadata(meta).seal(dataclasses.replace(info, partitions=parts), replace=True)
        # a reader whose root is another directory: every partition is another host's
        reader = px.Store(tmp_path / "elsewhere", session="etl", metadata=meta)
        assert not any(reader.is_here(p) for p in reader.info("features").partitions)
        dst = px.Store(tmp_path / "b", session="train")
        c = cross(reader, "features", dst)
    assert c.partitions_moved == 3
    assert file_bytes(dst, "features") == file_bytes(holder, "features")
    assert dst.info("features").partitions[0].root_id == FileTier(tmp_path / "b").root_id()


def test_store_show_prints_the_origin(two, capsys):
    from phalanx.cli import main

    src, dst = two
    cross(src, "features", dst)
    capsys.readouterr()
    assert main(["store", "--root", str(dst.root), "--session", "train", "show", "features"]) == 0
    assert json.loads(capsys.readouterr().out)["origin"]["version"] == src.info("features").version


def test_the_result_names_no_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value-123")
    src = px.Store(tmp_path / "a", session="etl")
    src.put("t", parts_of(1, 10))
    c = cross(src, "t", px.Store(tmp_path / "b"))
    assert isinstance(c, Crossing) and "very-secret" not in repr(c) + json.dumps(c.summary())
    assert c.seconds >= 0


def test_a_catalogue_of_the_previous_version_gains_the_origin_column(tmp_path):
    """A SQLite catalogue written before crossings (no ``origin`` column) opens, keeps its
    datasets (origin empty) and can record a crossed one."""
    import sqlite3

    src = px.Store(tmp_path / "a", session="etl")
    src.put("t", parts_of(2, 10))
    path = tmp_path / "b" / "meta.sqlite"
    old = px.Store(tmp_path / "b", session="train")
    old.put("before", parts_of(1, 10))
    with sqlite3.connect(path) as con:
        con.execute("ALTER TABLE datasets DROP COLUMN origin")  # as the previous version made it
    reopened = px.Store(tmp_path / "b", session="train")
    assert reopened.info("before").origin == {} and reopened.read("before").num_rows == 10
    cross(src, "t", reopened)
    assert reopened.info("t").origin["version"] == src.info("t").version


@pytest.mark.s3
def test_file_to_a_real_s3_server_and_back_is_byte_identical(seaweedfs_credentials, tmp_path):
    """Against SeaweedFS (tests/conftest.py's fixture, tests/infra/seaweedfs.py): every object
    the server stores holds the partition's exact bytes (a crossing reads each one back)."""
    server = seaweedfs_credentials
    src = px.Store(tmp_path / "a", session="etl")
    src.put("features", parts_of(4, 3000))
    cloud = px.Store(s3_root(server.endpoint), session="train", metadata=f"sqlite://{tmp_path / 'cloud.sqlite'}")
    up = cross(src, "features", cloud)
    assert up.partitions_moved == 4 and file_bytes(cloud, "features") == file_bytes(src, "features")
    info = cloud.info("features")
    key = info.location.split("/", 3)[3]  # s3://bucket/<key...>
    for p in info.partitions:
        assert server.object_size(info.location.split("/")[2], f"{key}/{part_file(p.index)}") == p.bytes
    back = px.Store(tmp_path / "c", session="report")
    assert cross(cloud, "features", back).partitions_moved == 4
    assert file_bytes(back, "features") == file_bytes(src, "features")
    assert cross(src, "features", cloud).already
