#!/usr/bin/env python
"""A dataset crossing between two sites' stores, by each path phalanx takes, next to copying the
same bytes with the S3 server's own client — one run, the same data, interleaved repetitions.

    .venv/bin/python bench/store_crossing.py                  # 192 MB in 8 partitions, 3 reps
    .venv/bin/python bench/store_crossing.py --mb 1024 --parts 8 --reps 3   # docs/crossing.md

Data: user-shaped transactions (the ETL example's: string keys and categories, ints, floats,
timestamps, bools; bench/store_remote.py's ``user_table``), sealed by a put in the producer
site's store (a file tier under /dev/shm).  The consumer site's store is another root.  Paths:

  direct              cross(producer, "tx", consumer): each partition read where it lives,
                      checked, written, read back and checked (phalanx.store.crossing)
  direct from service the producer's partitions held by another host (a second root whose store
                      service on loopback serves them, the catalogue shared): fetched in
                      64 MiB chunks over the service, then as direct
  via object store    the same through an exchange both sites name: up to a real S3-compatible
                      server (SeaweedFS on loopback, tests/infra/seaweedfs.py), then down
    up / down         the two legs of it
  weed client up      SeaweedFS's own client copying the same partition files into the same
                      server (``weed filer.copy``, into /buckets/<bucket>/...)
  weed client down    and reading them back out of its filer (HTTP GET, the filer's own API)
  copyfile            shutil.copyfile of the same files between the two roots (no checks)

Prints median MB/s, seconds per GB and each path's ratio to its reference (direct vs copyfile;
object store up/down vs the weed client up/down), the load average before and after, and the
peak RSS of a separate process doing one direct crossing and one crossing up (streamed in
64 MiB chunks, so it stays far below the dataset's size).  Needs the built ``weed`` binary
(tests/infra/seaweedfs-build.sh) for the object-store rows.  Results: docs/crossing.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests"), str(HERE)]

from store_remote import user_table  # noqa: E402

import phalanx as px  # noqa: E402
from phalanx.store.crossing import cross  # noqa: E402
from phalanx.store.tiers import part_file  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=192, help="dataset size in MB")
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--volume-mb", type=int, default=1024, help="SeaweedFS volume size limit (16 volumes)")
    ap.add_argument("--no-s3", action="store_true", help="only the direct path and copyfile")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="px-cross-", dir="/dev/shm"))
    times: dict[str, list[float]] = {}
    server = None
    stack = contextlib.ExitStack()

    def timed(case: str, fn) -> object:
        t = time.perf_counter()
        out = fn()
        times.setdefault(case, []).append(time.perf_counter() - t)
        return out

    try:
        producer = px.Store(base / "hpc", session="etl")
        part = args.mb * 1_000_000 // args.parts
        producer.put("tx", [user_table(part, seed=i) for i in range(args.parts)])
        info = producer.info("tx")
        files = [Path(info.location) / part_file(i) for i in range(info.num_partitions)]
        mb = info.nbytes / 1e6
        print(
            f"# dataset: {mb:.0f} MB in {info.num_partitions} partitions of user-shaped rows ({info.num_rows:,} rows)"
        )
        print(f"# load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
        exchange = weed = filer = None
        if not args.no_s3:
            from infra import seaweedfs

            weed = seaweedfs.find_binary()
            if weed is None:
                print(f"# no SeaweedFS: {seaweedfs.why_missing()}")
            else:
                server = seaweedfs.start(weed, volume_mb=args.volume_mb)
                server.create_bucket("bench")
                os.environ.update(server.env())
                exchange = f"s3://bench/{{}}?endpoint_override={server.endpoint}"
                filer = f"127.0.0.1:{server.ports['filer']}.{server.ports['filer_grpc']}"
                # a new bucket's first writes grow its volumes (seconds): warmed, not measured
                warm = px.Store(exchange.format("warm"), metadata=f"sqlite://{base / 'warm.sqlite'}")
                warm.tier.write_buffer(f"{warm.tier.url}/w", 0, producer.tier.read_buffer(info.location, 0))
                warm.tier.remove(warm.tier.url)
        service, remote_src = _served_copy(stack, base, producer)
        for rep in range(args.reps):
            consumer = px.Store(base / f"cloud{rep}", session="train")
            timed("direct", lambda: cross(producer, "tx", consumer))
            shutil.rmtree(base / f"cloud{rep}")
            consumer = px.Store(base / f"cloud{rep}", session="train")
            timed("direct from service", lambda: cross(remote_src, "tx", consumer))
            out = base / f"copy{rep}"
            out.mkdir()
            timed("copyfile", lambda: [shutil.copyfile(f, out / f.name) for f in files])
            if exchange is not None:
                middle = px.Store(
                    exchange.format(uuid.uuid4().hex[:8]), session="x", metadata=f"sqlite://{base / f'x{rep}.sqlite'}"
                )
                landed = px.Store(base / f"cloud-x{rep}", session="train")
                timed("object store up", lambda: cross(producer, "tx", middle))
                timed("object store down", lambda: cross(middle, "tx", landed))
                times.setdefault("via object store", []).append(
                    times["object store up"][-1] + times["object store down"][-1]
                )
                folder = f"/buckets/bench/weed-{rep}/"
                timed("weed client up", lambda: _weed_copy(weed, files, f"http://{filer}{folder}"))
                back = base / f"weed-back{rep}"
                back.mkdir()
                timed("weed client down", lambda: _filer_get(server, folder, files, back))
                for f in files:  # the server's client moved the same bytes
                    assert (back / f.name).stat().st_size == f.stat().st_size
                middle.tier.remove(middle.tier.url)
                shutil.rmtree(back)
                shutil.rmtree(base / f"cloud-x{rep}")
            shutil.rmtree(out)
            shutil.rmtree(base / f"cloud{rep}")
        print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"# peak RSS of a process crossing {mb:.0f} MB: {_peak_rss(base, exchange)}")
        refs = {
            "direct": "copyfile",
            "direct from service": "copyfile",
            "object store up": "weed client up",
            "object store down": "weed client down",
            "via object store": None,
        }
        print(f"{'path':20} {'median MB/s':>12} {'best MB/s':>10} {'s per GB':>9}  vs")
        for case, spent in times.items():
            med = statistics.median(spent)
            ref = refs.get(case)
            vs = f"{statistics.median(times[ref]) / med:5.2f}x {ref}" if ref and ref in times else ""
            print(f"{case:20} {mb / med:12.0f} {mb / min(spent):10.0f} {med / mb * 1000:9.2f}  {vs}")
        if "via object store" in times:
            both = statistics.median(times["weed client up"]) + statistics.median(times["weed client down"])
            print(
                f"via object store vs weed client up + down: {both / statistics.median(times['via object store']):.2f}x"
            )
    finally:
        stack.close()
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _served_copy(stack: contextlib.ExitStack, base: Path, producer: px.Store) -> tuple[object, px.Store]:
    """The producer's dataset held by another host: a second root (the same partition files) whose
    store service on loopback serves them, the catalogue shared; returns the service and a store
    on a third root that reads the dataset from it (tests/test_verify_once.py's set-up)."""
    from phalanx.runtime.envvars import ENV_STORE_SERVICE_KEY
    from phalanx.store.remote import publish_endpoint
    from phalanx.store.service import ENV_TOKEN, StoreService

    os.environ.setdefault(ENV_TOKEN, uuid.uuid4().hex)
    catalogue = f"sqlite:///{base / 'served.sqlite'}"
    holder_root = base / "holder"
    holder_root.mkdir()
    svc = stack.enter_context(StoreService(holder_root, "127.0.0.1"))
    publish_endpoint(holder_root, "bench-holder", svc.endpoint)
    old = os.environ.get(ENV_STORE_SERVICE_KEY)
    os.environ[ENV_STORE_SERVICE_KEY] = "bench-holder"
    try:
        holder = px.Store(holder_root, session="etl", metadata=catalogue)
        info = producer.info("tx")
        holder.put("tx", [producer.partition(info, i) for i in range(info.num_partitions)])
        assert all(p.endpoint == svc.endpoint for p in holder.info("tx").partitions)
    finally:
        if old is None:
            os.environ.pop(ENV_STORE_SERVICE_KEY)
        else:
            os.environ[ENV_STORE_SERVICE_KEY] = old
    return svc, px.Store(base / "elsewhere", session="etl", metadata=catalogue)


_RSS_CHILD = """
import json, resource, sys, time
sys.path[:0] = json.loads(sys.argv[1])
import phalanx as px
from phalanx.store.crossing import cross
base, exchange = sys.argv[2], sys.argv[3]
src = px.Store(base + "/hpc", session="etl")
t = time.perf_counter()
cross(src, "tx", px.Store(base + "/rss-direct", session="train"))
out = {"direct_s": time.perf_counter() - t, "direct_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
if exchange:
    t = time.perf_counter()
    cross(src, "tx", px.Store(exchange.format("rss"), session="x", metadata="sqlite://" + base + "/rss.sqlite"))
    out["up_s"] = time.perf_counter() - t
    out["after_up_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def _peak_rss(base: Path, exchange: str | None) -> str:
    """Peak RSS of a fresh process doing one direct crossing, then one up to the object store."""
    done = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, json.dumps(sys.path[:3]), str(base), exchange or ""],
        check=True,
        capture_output=True,
        text=True,
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(base / "rss-direct", ignore_errors=True)
    text = f"{out['direct_rss_mb']:.0f} MB after a direct crossing ({out['direct_s']:.2f} s)"
    if "up_s" in out:
        text += f", {out['after_up_rss_mb']:.0f} MB after also one up ({out['up_s']:.1f} s)"
    return text


def _weed_copy(weed: Path | None, files: list[Path], target: str) -> None:
    subprocess.run([str(weed), "filer.copy", *map(str, files), target], check=True, capture_output=True)


def _filer_get(server, folder: str, files: list[Path], into: Path) -> None:
    for f in files:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.ports['filer']}{folder}{f.name}") as resp:
            with open(into / f.name, "wb") as out:
                shutil.copyfileobj(resp, out, 1 << 22)


if __name__ == "__main__":
    sys.exit(main())
