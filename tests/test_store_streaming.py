"""A partition streamed a chunk at a time (what a crossing between sites does): the exact bytes,
checked against the metadata's checksum as they pass, with one chunk in memory however large
the partition — from a file tier, from another host's store service over its bulk path, and
into and out of an object store."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest
from test_store_backends import s3_endpoint, s3_root  # noqa: F401  (moto's server fixture)

import phalanx as px
from phalanx.errors import ChecksumError
from phalanx.store.service import StoreService, fetch_chunks, write_token_file
from phalanx.store.tiers import FileTier, checksum_buffer, part_file

MB = 1 << 20


def table(rows: int) -> pa.Table:
    return pa.table({"k": pa.array([f"key-{i % 1013:06d}" for i in range(rows)]), "v": pa.array(range(rows))})


def test_a_partition_streams_in_chunks_with_the_exact_bytes(tmp_path):
    store = px.Store(tmp_path / "store", "s")
    store.put("ds", [table(300_000)])
    info = store.info("ds")
    on_disk = (Path(info.location) / part_file(0)).read_bytes()
    chunks = list(store.partition_chunks(info, 0, size=MB))
    assert len(on_disk) > 3 * MB and [c.size for c in chunks[:-1]] == [MB] * (len(chunks) - 1)
    assert b"".join(c.to_pybytes() for c in chunks) == on_disk
    FileTier(tmp_path / "copy").write_chunks(str(tmp_path / "copy" / "d"), 0, store.partition_chunks(info, 0, MB))
    assert (tmp_path / "copy" / "d" / part_file(0)).read_bytes() == on_disk


def test_a_damaged_partition_fails_its_stream_after_the_last_chunk(tmp_path):
    store = px.Store(tmp_path / "store", "s")
    store.put("ds", [table(200_000)])
    info = store.info("ds")
    path = Path(info.location) / part_file(0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one bit flipped in the middle
    path.write_bytes(bytes(data))
    got = []
    with pytest.raises(ChecksumError, match=r"dataset 'ds' partition 0 .*checksum mismatch \(stored "):
        for chunk in store.partition_chunks(info, 0, size=MB):
            got.append(chunk.size)
    assert sum(got) == len(data)  # every chunk passed; the stream failed at its end, before anyone sealed it


STREAM = textwrap.dedent(
    """
    import sys, pyarrow as pa
    from phalanx.store.service import fetch, fetch_chunks, token_from_env
    endpoint, location, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pool = pa.default_memory_pool()
    n = sum(c.size for c in fetch_chunks(endpoint, token_from_env(), location, 0, chunk))
    streamed = pool.max_memory()
    whole = fetch(endpoint, token_from_env(), location, 0).size
    print(n, whole, streamed, pool.max_memory())
    """
)


@pytest.mark.slow  # a 48 MB partition over the loopback, in a process of its own
def test_a_partition_from_another_hosts_service_streams_through_one_chunk_of_memory(tmp_path):
    """The holder's service sends the file over its bulk path; the reader's Arrow memory peaks
    at about one chunk while it streams, and at the whole partition when it fetches it whole."""
    root = tmp_path / "root"
    tier = FileTier(root)
    location = tier.final("s", "big", "v0")
    payload = os.urandom(48 * MB)
    tier.write_buffer(location, 0, pa.py_buffer(payload))
    token = "stream-test-token"
    env = {**os.environ, "PHALANX_STORE_TOKEN_FILE": str(write_token_file(tmp_path / "token", token))}
    env.pop("PHALANX_STORE_TOKEN", None)
    with StoreService(root, "127.0.0.1", token=token, bytes_port=0) as svc:
        chunks = list(fetch_chunks(svc.endpoint, token, location, 0, 8 * MB))
        assert [c.size for c in chunks] == [8 * MB] * 6
        assert checksum_buffer(pa.py_buffer(b"".join(c.to_pybytes() for c in chunks))) == checksum_buffer(payload)
        out = subprocess.run(
            [sys.executable, "-c", STREAM, svc.endpoint, location, str(4 * MB)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    n, whole, streamed_peak, whole_peak = map(int, out.stdout.split())
    assert n == whole == 48 * MB
    assert streamed_peak <= 3 * 4 * MB, streamed_peak  # a chunk or two, never the partition
    assert whole_peak >= 48 * MB  # the same partition fetched whole: all of it at once


@pytest.mark.slow  # a moto S3 server of its own
def test_an_object_store_takes_and_gives_a_partition_in_chunks(tmp_path, s3_endpoint):  # noqa: F811
    store = px.Store(tmp_path / "store", "s")
    store.put("ds", [table(300_000)])
    info = store.info("ds")
    on_disk = (Path(info.location) / part_file(0)).read_bytes()
    s3 = px.Store(s3_root(s3_endpoint), "s").tier
    location = s3.staging("s", "up", "v0")
    s3.write_chunks(location, 0, store.partition_chunks(info, 0, size=MB))
    back = list(s3.read_chunks(location, 0, MB))
    assert [c.size for c in back[:-1]] == [MB] * (len(back) - 1)
    assert b"".join(c.to_pybytes() for c in back) == on_disk
