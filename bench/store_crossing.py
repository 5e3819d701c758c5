#!/usr/bin/env python
"""A dataset crossing between stores (phalanx.store.crossing.cross) next to copying the same
bytes without phalanx, in the same repetition.

    .venv/bin/python bench/store_crossing.py --mb 256 --parts 8 --reps 3

Cases: file→file (two store roots under /dev/shm) against ``shutil.copyfile`` of each partition
file; file→S3 and S3→file against a real SeaweedFS server on loopback (tests/infra/seaweedfs.py:
needs the built ``weed`` binary) against writing / reading each partition's bytes with
pyarrow's S3 filesystem directly (no checksum, no read back).  A crossing reads each partition
once, hashes it, writes it, and reads it back from the destination to hash it again.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa

import phalanx as px
from phalanx.store.crossing import cross
from phalanx.store.tiers import part_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def table_of_bytes(nbytes: int, seed: int) -> pa.Table:
    rows = nbytes // 16
    rng = np.random.default_rng(seed)
    return pa.table({"key": rng.integers(0, rows, rows), "value": rng.random(rows)})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256, help="dataset size")
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="px-cross-", dir="/dev/shm"))
    rows: list[tuple[str, float, float]] = []
    server = None
    try:
        src = px.Store(base / "a", session="etl")
        part = args.mb * 1_000_000 // args.parts
        src.put("d", [table_of_bytes(part, i) for i in range(args.parts)])
        info = src.info("d")
        mb = info.nbytes / 1e6
        print(f"dataset: {mb:.0f} MB in {info.num_partitions} partitions")
        cloud_url = None
        if not args.no_s3:
            from infra import seaweedfs

            weed = seaweedfs.find_binary()
            if weed is None:
                print(f"no SeaweedFS: {seaweedfs.why_missing()}")
            else:
                import os

                server = seaweedfs.start(weed)
                server.create_bucket("bench")
                os.environ.update(server.env())
                cloud_url = f"s3://bench/{{}}?endpoint_override={server.endpoint}"
                # the server's first writes to a bucket grow its volumes (seconds): not measured
                warm = px.Store(cloud_url.format("warm"), metadata=f"sqlite://{base / 'warm.sqlite'}")
                warm.tier.write_buffer(f"{warm.tier.url}/w", 0, src.tier.read_buffer(info.location, 0))
                warm.tier.remove(warm.tier.url)
        for rep in range(args.reps):
            dst = px.Store(base / f"b{rep}", session="train")
            t = time.perf_counter()
            c = cross(src, "d", dst)
            rows.append(("file→file cross", mb / (time.perf_counter() - t), c.seconds))
            out = base / f"cp{rep}"
            out.mkdir()
            t = time.perf_counter()
            for i in range(info.num_partitions):
                shutil.copyfile(Path(info.location) / part_file(i), out / part_file(i))
            rows.append(("file→file copyfile", mb / (time.perf_counter() - t), 0))
            shutil.rmtree(out)
            if cloud_url is not None:
                cloud = px.Store(
                    cloud_url.format(uuid.uuid4().hex[:8]),
                    session="train",
                    metadata=f"sqlite://{base / f'cloud{rep}.sqlite'}",
                )
                t = time.perf_counter()
                cross(src, "d", cloud)
                rows.append(("file→S3 cross", mb / (time.perf_counter() - t), 0))
                raw = f"{cloud.tier.url}/raw"
                t = time.perf_counter()
                for i in range(info.num_partitions):
                    cloud.tier.write_buffer(raw, i, src.tier.read_buffer(info.location, i))
                rows.append(("file→S3 pyarrow write", mb / (time.perf_counter() - t), 0))
                back = px.Store(base / f"c{rep}", session="report")
                t = time.perf_counter()
                cross(cloud, "d", back)
                rows.append(("S3→file cross", mb / (time.perf_counter() - t), 0))
                t = time.perf_counter()
                for i in range(info.num_partitions):
                    buf = cloud.tier.read_buffer(raw, i)
                    (base / "one.arrow").write_bytes(memoryview(buf))
                    del buf
                rows.append(("S3→file pyarrow read", mb / (time.perf_counter() - t), 0))
                cloud.tier.remove(cloud.tier.url)
                shutil.rmtree(base / f"c{rep}")
            shutil.rmtree(base / f"b{rep}")
        print(f"{'case':24} {'median MB/s':>12} {'best MB/s':>10}")
        for case in dict.fromkeys(r[0] for r in rows):
            speeds = [r[1] for r in rows if r[0] == case]
            print(f"{case:24} {statistics.median(speeds):12.0f} {max(speeds):10.0f}")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
