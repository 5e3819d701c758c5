"""The store service across hosts of the test bed (docs/multihost.md): a partition in px-h1's
/dev/shm, which px-h2 cannot see, fetched from px-h2 over the bridge byte-identical; a
service killed mid-fetch fails the reader fast, naming the endpoint.

    .venv/bin/python -m pytest -m multihost tests/multihost/test_store_service_multihost.py -q -p no:randomly
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from phalanx.store.service import ENV_TOKEN_FILE, write_token_file

pytestmark = pytest.mark.multihost

ROOT = "/dev/shm/phalanx-multihost-service/store"  # in each host's own /dev/shm

WRITE = """
import json, sys
import numpy as np, pyarrow as pa
from phalanx.store.tiers import FileTier, part_file
rows = int(sys.argv[2])
rng = np.random.default_rng(7)
table = pa.table({
    "key": pa.array(np.char.add("user-", (np.arange(rows) % 9973).astype(str))),
    "n": pa.array(np.arange(rows, dtype=np.int64)),
    "x": pa.array(rng.random(rows)),
})
tier = FileTier(sys.argv[1])
location = tier.final("s", "ds", "v0")
nbytes, checksum = tier.write_partition(location, 0, table)
print(json.dumps({"location": location, "nbytes": nbytes, "checksum": checksum}))
"""


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


@pytest.fixture
def service(multihost_bed, shared_tmp):
    """A store service on px-h1 serving ROOT there, with one partition of ``rows`` rows; yields
    (endpoint, partition, env for a reader, the server's Popen)."""
    bed = multihost_bed
    h1 = next(h for h in bed.hosts() if h["name"] == "px-h1")
    env = {**os.environ, ENV_TOKEN_FILE: str(write_token_file(shared_tmp / "token", secrets.token_urlsafe(32)))}
    started: list[subprocess.Popen] = []

    def start(rows: int) -> tuple[str, dict, dict, subprocess.Popen]:
        w = bed.run_on("px-h1", [*_py(WRITE), ROOT, str(rows)], env=env, capture_output=True, text=True, timeout=120)
        assert w.returncode == 0, w.stderr
        part = json.loads(w.stdout.splitlines()[-1])
        ep_file = shared_tmp / "endpoint"
        argv = [sys.executable, "-m", "phalanx.store.service", "--root", ROOT, "--host", h1["addr"]]
        proc = bed.popen_on("px-h1", [*argv, "--endpoint-file", str(ep_file)], env=env, stdout=subprocess.DEVNULL)
        started.append(proc)
        deadline = time.monotonic() + 30
        while not ep_file.exists():
            assert proc.poll() is None, "the store service exited"
            assert time.monotonic() < deadline, "the store service did not start in 30 s"
            time.sleep(0.05)
        return ep_file.read_text().strip(), part, env, proc

    yield start
    for proc in started:  # by the PID we started
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
    bed.run_on("px-h1", ["rm", "-rf", str(Path(ROOT).parent)], timeout=30)


READ = """
import json, os, sys
from phalanx.store.service import fetch, token_from_env
from phalanx.store.tiers import checksum_buffer
endpoint, location, out = sys.argv[1:4]
buf = fetch(endpoint, token_from_env(), location, 0, timeout=60)
open(out, "wb").write(buf)
print(json.dumps({"visible_here": os.path.exists(location), "checksum": checksum_buffer(buf), "size": buf.size}))
"""


def test_a_partition_in_one_hosts_memory_is_fetched_byte_identical_from_another(service, multihost_bed, shared_tmp):
    endpoint, part, env, _ = service(200_000)
    assert endpoint == "grpc+tcp://10.231.0.11:" + endpoint.rsplit(":", 1)[1]  # px-h1's bridge address
    expected = multihost_bed.run_on(
        "px-h1", ["cat", f"{part['location']}/part-00000.arrow"], capture_output=True, timeout=30
    ).stdout
    assert len(expected) == part["nbytes"]
    got = shared_tmp / "got.arrow"
    r = multihost_bed.run_on(
        "px-h2",
        [*_py(READ), endpoint, part["location"], str(got)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.splitlines()[-1])
    assert seen["visible_here"] is False  # px-h2's /dev/shm is its own
    assert not os.path.exists(part["location"])  # nor is it in the root namespace's
    assert seen == {"visible_here": False, "checksum": part["checksum"], "size": part["nbytes"]}
    assert got.read_bytes() == expected


READ_LOOP = """
import json, sys, time
from phalanx.store.service import RemoteStoreError, fetch, token_from_env
endpoint, location = sys.argv[1:3]
token = token_from_env()
n = 0
while True:
    try:
        fetch(endpoint, token, location, 0, timeout=60)
    except RemoteStoreError as e:
        exc, failed = e, time.time()
        break
    n += 1
    if n == 1:
        print("fetching", flush=True)
t0 = time.monotonic()
try:
    fetch(endpoint, token, location, 0, timeout=60)
    again = None
except RemoteStoreError as e:
    again = [type(e).__name__, str(e), time.monotonic() - t0]
print(json.dumps({"n": n, "error": [type(exc).__name__, str(exc)], "failed_at": failed, "again": again}), flush=True)
"""


def test_a_service_killed_mid_fetch_fails_the_reader_fast_naming_the_endpoint(service, multihost_bed):
    endpoint, part, env, server = service(3_000_000)  # ~70 MB: each fetch takes a while
    assert "phalanx.store.service" in Path(f"/proc/{server.pid}/cmdline").read_text()  # the PID we kill
    reader = multihost_bed.popen_on(
        "px-h2",
        [*_py(READ_LOOP), endpoint, part["location"]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout.readline().strip() == "fetching", reader.stderr.read()
        time.sleep(0.05)  # inside a later fetch
        killed = time.time()
        os.kill(server.pid, signal.SIGKILL)
        out, err = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, err
    r = json.loads(out.splitlines()[-1])
    print(r, f"failed {r['failed_at'] - killed:.3f} s after the kill")
    kind, message = r["error"]
    assert endpoint in message and part["location"] in message and "partition 0" in message, message
    assert kind == "ServiceUnreachableError", r
    assert r["failed_at"] - killed < 5, r  # fast: not the 60 s timeout
    kind2, message2, took = r["again"]
    assert kind2 == "ServiceUnreachableError" and endpoint in message2 and took < 5, r
