"""One dataset whose partitions live in the memory of three hosts (docs/store.md, "Across
hosts"): each host of the test bed writes one partition into its own /dev/shm and runs a store
service; a reader anywhere (another host, the driver's namespace) reads the whole dataset, the
partitions of its own host mapped and the others fetched and checked; a host whose service is
gone fails the read naming dataset, partition and host.

    .venv/bin/python -m pytest -m multihost tests/multihost/test_store_multihost.py -q
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest

from phalanx.runtime.envvars import ENV_STORE_DURABLE, ENV_STORE_SERVICE_KEY, ENV_STORE_TOKEN_FILE

pytestmark = pytest.mark.multihost

HOSTS = ("px-h1", "px-h2", "px-h3")

WRITE = """
import dataclasses, json, sys
import numpy as np, pyarrow as pa
from phalanx.store import Store
root, meta, staging_id, index = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rows = 30_000 + 1_000 * index
rng = np.random.default_rng(index)
table = pa.table({
    "user": pa.array(np.char.add("user-", (rng.integers(0, 5000, rows)).astype(str))),
    "n": pa.array(np.arange(rows, dtype=np.int64) + 1_000_000 * index),
    "x": pa.array(rng.random(rows)),
})
store = Store(root, session="s", metadata=meta)
part = store.stage_partition(staging_id, index, table, "ds")
store.commit_here("ds", staging_id)
print(json.dumps(dataclasses.asdict(part)))
"""

READ = """
import json, sys
from phalanx.store import Store
store = Store(sys.argv[1], session="s", metadata=sys.argv[2])
table = store.read("ds")
table.to_pandas().to_parquet(sys.argv[3])
print(json.dumps(store.reads.as_dict()))
"""


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _reference() -> pd.DataFrame:
    """The same rows, made here independently of the store (numpy + pandas)."""
    import numpy as np

    frames = []
    for index in range(len(HOSTS)):
        rows = 30_000 + 1_000 * index
        rng = np.random.default_rng(index)
        frames.append(
            pd.DataFrame(
                {
                    "user": np.char.add("user-", (rng.integers(0, 5000, rows)).astype(str)),
                    "n": np.arange(rows, dtype=np.int64) + 1_000_000 * index,
                    "x": rng.random(rows),
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


@pytest.fixture
def spread(request, multihost_bed, shared_tmp):
    """Services on px-h1..3 (each serving its own /dev/shm root) and dataset 's/ds' with
    partition i written on HOSTS[i]; yields (root, metadata URL, env, {host: service Popen})."""
    bed = multihost_bed
    root = f"/dev/shm/phalanx-mh-{uuid.uuid4().hex[:8]}/store"
    meta = f"sqlite://{shared_tmp}/meta.sqlite"
    token = shared_tmp / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    key = f"test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, ENV_STORE_TOKEN_FILE: str(token), ENV_STORE_SERVICE_KEY: key}
    if getattr(request, "param", None) == "write-through":  # store.durability: write-through
        env[ENV_STORE_DURABLE] = str(shared_tmp / "durable")
    services: dict[str, subprocess.Popen] = {}
    try:
        for host in HOSTS:
            argv = [sys.executable, "-m", "phalanx.store.service", "--root", root, "--host", "auto", "--key", key]
            services[host] = bed.popen_on(host, argv, env=env, stdout=subprocess.PIPE, text=True)
        for host, proc in services.items():
            assert proc.stdout.readline().strip().startswith("grpc+tcp://10.231.0."), f"{host}'s service did not start"
        staging_id = f"t-{uuid.uuid4().hex[:12]}"
        parts = []
        for index, host in enumerate(HOSTS):
            w = bed.run_on(
                host,
                [*_py(WRITE), root, meta, staging_id, str(index)],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert w.returncode == 0, w.stderr
            parts.append(json.loads(w.stdout.splitlines()[-1]))
        import pyarrow as pa

        from phalanx.store import Store
        from phalanx.store.metadata import PartitionInfo

        schema = pa.schema([("user", pa.string()), ("n", pa.int64()), ("x", pa.float64())])
        driver = Store(root, session="s", metadata=meta)
        driver.seal(
            "ds", staging_id, [PartitionInfo(**p) for p in parts], schema, None, "writer", "", False, committed=True
        )
        yield root, meta, env, services
    finally:
        for proc in services.values():  # by the PIDs we started
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=15)
        for host in HOSTS:
            bed.run_on(host, ["rm", "-rf", root.rsplit("/", 1)[0]], timeout=30)
        shutil.rmtree(root.rsplit("/", 1)[0], ignore_errors=True)  # the driver's Store made one here too


def test_partitions_record_the_host_that_holds_them(spread):
    root, meta, env, _ = spread
    from phalanx.store import Store

    info = Store(root, session="s", metadata=meta).info("ds")
    assert [p.host for p in info.partitions] == list(HOSTS)
    assert len({p.root_id for p in info.partitions}) == 3  # three roots that share nothing
    assert [p.endpoint.split(":")[1] for p in info.partitions] == ["//10.231.0.11", "//10.231.0.12", "//10.231.0.13"]
    assert info.summary()["hosts"] == list(HOSTS)
    # what a user sees: where each dataset lives
    ls = subprocess.run(
        [str(Path(sys.executable).parent / "phalanx"), "store", "--root", root, "--session", "s", "ls"],
        env={**env, "PHALANX_STORE_METADATA": meta},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ls.returncode == 0, ls.stderr
    assert "on px-h1,px-h2,px-h3" in ls.stdout


def test_a_reader_on_any_host_reads_the_whole_dataset_right(spread, multihost_bed, shared_tmp):
    root, meta, env, _ = spread
    want = _reference()
    # on px-h2: its own partition mapped, the two others fetched and checked
    out = shared_tmp / "h2.parquet"
    r = multihost_bed.run_on(
        "px-h2", [*_py(READ), root, meta, str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    counts = json.loads(r.stdout.splitlines()[-1])
    pd.testing.assert_frame_equal(pd.read_parquet(out), want)
    from phalanx.store import Store

    sizes = [p.bytes for p in Store(root, session="s", metadata=meta).info("ds").partitions]
    assert counts == {"local": sizes[1], "fetched": sizes[0] + sizes[2]}
    # from the driver's namespace (px.Store outside a gang): every partition fetched
    with _with_env(env):
        store = Store(root, session="s", metadata=meta)
        pd.testing.assert_frame_equal(store.read("ds").to_pandas(), want)
        assert store.reads.local == 0 and store.reads.fetched == sum(sizes)


def test_a_lost_host_fails_the_read_naming_dataset_partition_and_host(spread, multihost_bed, shared_tmp):
    root, meta, env, services = spread
    services["px-h2"].send_signal(signal.SIGKILL)  # its host's memory is gone with it
    services["px-h2"].wait(timeout=15)
    out = shared_tmp / "h3.parquet"
    t0 = time.monotonic()
    r = multihost_bed.run_on(
        "px-h3", [*_py(READ), root, meta, str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0 and not out.exists()
    assert "PartitionLostError" in r.stderr
    assert "dataset 'ds' partition 1 is held in the memory of host px-h2" in r.stderr
    assert "phalanx run --resume" in r.stderr and "stage 'writer'" in r.stderr
    assert time.monotonic() - t0 < 60


def _with_env(env: dict):
    """The store variables of ``env`` in this (driver) process, for a px.Store made here."""
    import contextlib

    @contextlib.contextmanager
    def scope():
        old = {k: os.environ.get(k) for k in env if k.startswith("PHALANX_STORE")}
        os.environ.update({k: env[k] for k in old})
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return scope()


FLIP = """
import sys
path = sys.argv[1] + "/part-00000.arrow"
data = bytearray(open(path, "rb").read())
data[len(data) // 2] ^= 0xFF
open(path, "wb").write(bytes(data))
"""


def test_checksums_are_checked_where_the_partitions_live(spread, multihost_bed):
    """What a resume does before it reuses an output: each host's service hashes its own
    partition; a corrupted one is named with its host, no bytes move."""
    from phalanx.errors import ChecksumError
    from phalanx.store import Store

    root, meta, env, _ = spread
    with _with_env(env):
        store = Store(root, session="s", metadata=meta)
        info = store.info("ds")
        for i in range(3):
            store.check(info, i)
        assert store.reads.fetched == 0
        r = multihost_bed.run_on("px-h1", [*_py(FLIP), info.location], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        with pytest.raises(ChecksumError, match="dataset 'ds' partition 0 on host px-h1: checksum mismatch"):
            store.check(info, 0)


def test_deleting_a_dataset_frees_the_memory_of_every_host_holding_it(spread, multihost_bed):
    from phalanx.store import Store

    root, meta, env, _ = spread
    with _with_env(env):
        store = Store(root, session="s", metadata=meta)
        location = store.info("ds").location

        def present() -> list[bool]:
            return [multihost_bed.run_on(h, ["test", "-e", location]).returncode == 0 for h in HOSTS]

        assert present() == [True, True, True]
        store.delete("ds")
        assert present() == [False, False, False]


@pytest.mark.parametrize("spread", ["write-through"], indirect=True)
def test_written_through_partitions_outlive_their_host(spread, multihost_bed, shared_tmp):
    """store.durability: write-through — each partition is also copied to a shared directory
    as it is written; a reader whose partition's host is gone reads the copy (checked)."""
    root, meta, env, services = spread
    services["px-h2"].send_signal(signal.SIGKILL)
    services["px-h2"].wait(timeout=15)
    out = shared_tmp / "h3.parquet"
    r = multihost_bed.run_on("px-h3", [*_py(READ), root, meta, str(out)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pd.testing.assert_frame_equal(pd.read_parquet(out), _reference())
    from phalanx.store import Store

    with _with_env(env):
        store = Store(root, session="s", metadata=meta)
        info = store.info("ds")
        assert all(p.copy.startswith(str(shared_tmp / "durable")) for p in info.partitions)
        store.check(info, 1)  # a resume finds the output whole: from the copy
        store.delete("ds")
        assert not any((shared_tmp / "durable").rglob("*.arrow"))


def _fetching_from(bed, host: str, port: int) -> bool:
    """Whether a connection to ``host``'s service port is established (a fetch under way)."""
    ss = bed.run_on(
        host, ["ss", "-Htn", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True
    )
    return bool(ss.stdout.strip())


@pytest.mark.parametrize("when", ["mid-fetch", "before the read"])
def test_a_host_cut_off_fails_the_reader_within_seconds(when, spread, multihost_bed, shared_tmp):
    """px-h1 stops answering (its link goes down: no RST, no FIN — a host that vanished) while
    px-h3 fetches its partition, or before px-h3 starts reading: gRPC keepalive, or the connect
    timeout, notices, and the read fails naming the dataset, partition and host instead of
    hanging until the fetch's deadline (60 s)."""
    root, meta, env, _ = spread
    from phalanx.store import Store

    endpoint = Store(root, session="s", metadata=meta).info("ds").partitions[0].endpoint
    port = int(endpoint.rsplit(":", 1)[1])
    veth = next(h["veth"] for h in multihost_bed.hosts() if h["name"] == "px-h1")
    shape = ["ip", "netns", "exec", "px-h1", "tc", "qdisc"]
    rate = ["root", "tbf", "rate", "1mbit", "burst", "32kb", "latency", "1s"]  # ~1 MB: ~8 s
    subprocess.run([*shape, "add", "dev", "eth0", *rate], check=True)
    out = shared_tmp / "h3.parquet"
    try:
        if when == "before the read":
            subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        reader = multihost_bed.popen_on(
            "px-h3",
            [*_py(READ), root, meta, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if when == "mid-fetch":
            deadline = time.monotonic() + 60
            while not _fetching_from(multihost_bed, "px-h1", port):
                assert reader.poll() is None, reader.communicate()
                assert time.monotonic() < deadline, "the reader never connected to px-h1"
                time.sleep(0.1)
            subprocess.run(["ip", "link", "set", veth, "down"], check=True)
        t0 = time.monotonic()
        _, err = reader.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        subprocess.run(["ip", "link", "set", veth, "up"], check=True)
        subprocess.run([*shape, "del", "dev", "eth0", "root"], check=False)
    assert reader.returncode != 0 and not out.exists()
    assert "dataset 'ds' partition 0 is held in the memory of host px-h1" in err, err
    assert took < 30, f"the reader took {took:.1f} s to notice"
