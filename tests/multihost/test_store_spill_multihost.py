"""The memory budget per host on the test bed (docs/store.md, "Spill across hosts"): datasets
spread over px-h1..3, each host's partitions in its own /dev/shm under a budget of two
partitions, all three spilling into one /var/tmp directory (shared by the bed's hosts, as a
cluster's is not: the hosts must not collide there).  Each host runs a store service over its
root and the spill directory; each put writes one partition per host (the host makes room
first: ``commit_here``), the driver seals.  Last, the same through a gang on the SLURM pilot
across the hosts (``env.store.put`` / ``get``; the pilot's services serve the spill directory).

    .venv/bin/python -m pytest -m multihost tests/multihost/test_store_spill_multihost.py -q \\
        --basetemp=/var/tmp/$USER-bt
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
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from phalanx.runtime.envvars import ENV_STORE_SERVICE_KEY, ENV_STORE_TOKEN_FILE

from .test_slurm_gang_multihost import driver_host, host_root, slurm_section  # noqa: F401 - fixtures too

pytestmark = pytest.mark.multihost

HOSTS = ("px-h1", "px-h2", "px-h3")
ROWS = 50_000  # 800 kB a partition
BUDGET = 2_000_000  # two partitions of a host, not three

PUT = """
import dataclasses, json, sys
import numpy as np, pyarrow as pa
from phalanx.store import Store
root, meta, spill, budget, staging_id, name, index, rows, base = sys.argv[1:10]
index, rows, base = int(index), int(rows), int(base)
n = np.arange(rows, dtype=np.int64) + base + 1_000_000 * index
table = pa.table({"n": n, "x": n * 0.5})
store = Store(root, session="s", metadata=meta, memory_budget=int(budget), spill=spill)
part = store.stage_partition(staging_id, index, table, name)
store.commit_here(name, staging_id)  # makes room on this host first
print(json.dumps(dataclasses.asdict(part)))
"""

READ = """
import json, sys
import pyarrow as pa
from phalanx.store import Store
root, meta, name, out = sys.argv[1:5]
store = Store(root, session="s", metadata=meta)
info = store.info(name)
table = pa.concat_tables([store.partition(info, i, verify=True) for i in range(info.num_partitions)])
table.to_pandas().to_parquet(out)
print(json.dumps({**store.reads.as_dict(), "memory": store.memory_usage()}))
"""


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def _base(name: str) -> int:
    return sum(map(ord, name)) * 10**8


def _reference(name: str, rows: int = ROWS) -> pd.DataFrame:
    """The dataset's rows, made here by numpy and pandas alone."""
    n = np.concatenate([np.arange(rows, dtype=np.int64) + _base(name) + 1_000_000 * i for i in range(len(HOSTS))])
    return pd.DataFrame({"n": n, "x": n * 0.5})


class Bed:
    """Store services on px-h1..3 and a driver here; ``put`` writes a dataset spread over them."""

    def __init__(self, bed, root: str, meta: str, spill: Path, env: dict):
        self.bed, self.root, self.meta, self.spill, self.env = bed, root, meta, spill, env

    def put(self, name: str, rows: int = ROWS) -> None:
        import pyarrow as pa

        from phalanx.store.metadata import PartitionInfo

        staging_id = f"t-{uuid.uuid4().hex[:12]}"
        parts = []
        for index, host in enumerate(HOSTS):
            argv = [self.root, self.meta, str(self.spill), str(BUDGET), staging_id, name, str(index), str(rows)]
            w = self.bed.run_on(
                host, [*_py(PUT), *argv, str(_base(name))], env=self.env, capture_output=True, text=True, timeout=120
            )
            assert w.returncode == 0, w.stderr
            parts.append(PartitionInfo(**json.loads(w.stdout.splitlines()[-1])))
        schema = pa.schema([("n", pa.int64()), ("x", pa.float64())])
        self.driver().seal(name, staging_id, parts, schema, None, "writer", "", False, committed=True)

    def driver(self):
        from phalanx.store import Store

        return Store(self.root, session="s", metadata=self.meta)

    def read_on(self, host: str, name: str, out: Path) -> subprocess.CompletedProcess:
        return self.bed.run_on(
            host, [*_py(READ), self.root, self.meta, name, str(out)], env=self.env, capture_output=True, text=True
        )

    def spilled(self, name: str) -> list[bool]:
        info = self.driver().info(name)
        return [Path(info.location_of(i)).is_relative_to(self.spill) for i in range(info.num_partitions)]


@pytest.fixture
def spread(multihost_bed, shared_tmp, monkeypatch):
    bed = multihost_bed
    root = f"/dev/shm/phalanx-mh-{uuid.uuid4().hex[:8]}/store"
    meta = f"sqlite://{shared_tmp}/meta.sqlite"
    spill = shared_tmp / "spill"  # one /var/tmp for the bed's hosts
    token = shared_tmp / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    key = f"test-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, ENV_STORE_TOKEN_FILE: str(token), ENV_STORE_SERVICE_KEY: key}
    monkeypatch.setenv(ENV_STORE_TOKEN_FILE, str(token))  # the driver here fetches too
    services: dict[str, subprocess.Popen] = {}
    try:
        for host in HOSTS:
            argv = [sys.executable, "-m", "phalanx.store.service", "--root", root, "--also", str(spill)]
            argv += ["--host", "auto", "--key", key]
            services[host] = bed.popen_on(host, argv, env=env, stdout=subprocess.PIPE, text=True)
        for host, proc in services.items():
            assert proc.stdout.readline().strip().startswith("grpc+tcp://10.231.0."), f"{host}'s service did not start"
        yield Bed(bed, root, meta, spill, env)
    finally:
        top = root.rsplit("/", 1)[0]
        for host in HOSTS:  # each host's service (by the PID we started), then its memory
            proc = services.get(host)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=15)
            bed.run_on(host, ["rm", "-rf", top], timeout=30)
        shutil.rmtree(top, ignore_errors=True)  # the driver's Store made one here too


def test_each_host_spills_its_own_partitions_and_every_reader_gets_every_row(spread, shared_tmp):
    spread.put("d1")
    spread.put("d2")  # two partitions a host: within budget
    assert spread.spilled("d1") == [False] * 3
    spread.put("d3")  # each host makes room: its least recently used partition (of d1) spills
    assert spread.spilled("d1") == [True] * 3
    assert spread.spilled("d2") == spread.spilled("d3") == [False] * 3
    d1 = spread.driver().info("d1")
    assert [p.host for p in d1.partitions] == list(HOSTS)
    assert len({d1.location_of(i) for i in range(3)}) == 3  # one spill directory, no collision

    # what a user sees: each partition's host and tier
    show = subprocess.run(
        [str(Path(sys.executable).parent / "phalanx"), "store", "--root", spread.root, "--session", "s", "show", "d1"],
        env={**spread.env, "PHALANX_STORE_METADATA": spread.meta},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert show.returncode == 0, show.stderr
    at = json.loads(show.stdout)["at"]
    assert [(p["host"], p["tier"]) for p in at] == [(h, "spill") for h in HOSTS]
    assert [p["location"] for p in at] == [d1.location_of(i) for i in range(3)]

    # px-h2 reads its own spilled file and fetches the others' from their hosts' services
    sizes = [p.bytes for p in d1.partitions]
    out = shared_tmp / "d1-h2.parquet"
    r = spread.read_on("px-h2", "d1", out)
    assert r.returncode == 0, r.stderr
    pd.testing.assert_frame_equal(pd.read_parquet(out), _reference("d1"))
    counts = json.loads(r.stdout.splitlines()[-1])
    assert (counts["local"], counts["fetched"]) == (sizes[1], sizes[0] + sizes[2])
    assert counts["memory"] <= BUDGET  # px-h2's memory tier
    # the driver's namespace holds none: every partition fetched
    driver = spread.driver()
    pd.testing.assert_frame_equal(driver.read("d1").to_pandas(), _reference("d1"))
    assert driver.reads.local == 0 and driver.reads.fetched == sum(sizes)

    # a pin made here reaches each host at its next write: d1 comes back, d2 makes room
    driver.pin("d1")
    spread.put("d4", rows=1000)
    assert spread.spilled("d1") == [False] * 3
    assert spread.spilled("d2") == [True] * 3
    out = shared_tmp / "d1-h3.parquet"
    r = spread.read_on("px-h3", "d1", out)
    assert r.returncode == 0, r.stderr
    pd.testing.assert_frame_equal(pd.read_parquet(out), _reference("d1"))
    assert json.loads(r.stdout.splitlines()[-1])["memory"] <= BUDGET
    spread.put("d5", rows=1000)  # pinned: stays
    assert spread.spilled("d1") == [False] * 3


def test_a_damaged_spilled_partition_fails_naming_dataset_partition_and_host(spread, shared_tmp):
    for name in ("d1", "d2", "d3"):
        spread.put(name)
    d1 = spread.driver().info("d1")
    assert spread.spilled("d1") == [True] * 3
    path = Path(d1.location_of(2)) / "part-00002.arrow"  # px-h3's, in the shared /var/tmp
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    r = spread.read_on("px-h3", "d1", shared_tmp / "h3.parquet")  # read on its host, from spill
    assert r.returncode != 0 and "ChecksumError" in r.stderr
    assert "dataset 'd1' partition 2 (on host px-h3: " in r.stderr and "checksum mismatch" in r.stderr
    r = spread.read_on("px-h1", "d1", shared_tmp / "h1.parquet")  # fetched from px-h3's service
    assert r.returncode != 0 and "ChecksumError" in r.stderr
    assert "dataset 'd1' partition 2 (fetched from px-h3)" in r.stderr and "checksum mismatch" in r.stderr


# ---- the same through a gang on the SLURM pilot (its services serve the spill directory) ----------
def put_three_then_get(env):
    """Each rank (one per host) puts one partition of d1, d2, d3; then d1 is read back."""
    import socket

    import pyarrow as pa

    for name in ("d1", "d2", "d3"):
        n = np.arange(ROWS, dtype=np.int64) + _base(name) + 1_000_000 * env.rank
        env.store.put(name, pa.table({"n": n, "x": n * 0.5}))
    info = env.store.info("d1")
    before = [Path(info.location_of(i)).is_relative_to(env.store.store.spill_tier.root) for i in range(3)]
    n = np.arange(3 * ROWS, dtype=np.int64)  # one host's share alone is over the budget
    env.store.put("big", pa.table({"n": n, "x": n * 0.5}))
    after_big = env.store.store.memory_usage()  # each host's first rank spilled it after the seal
    share = env.store.get("d1").to_arrow()  # rank 0's use() brings its host's partition back
    env.comm.barrier()
    return socket.gethostname(), before, share, env.store.store.memory_usage(), after_big


def test_a_gang_on_the_slurm_pilot_spills_on_each_host_and_reads_back_right(
    multihost_slurm,
    shared_tmp,
    driver_host,  # noqa: F811 - the fixtures imported above
    host_root,  # noqa: F811
    monkeypatch,
):
    import phalanx as px
    from phalanx.executors.slurm import SlurmExecutor
    from phalanx.store.service import write_token_file

    monkeypatch.setenv("PHALANX_LOG_DIR", str(shared_tmp / "logs" / "gangs"))
    monkeypatch.setenv(ENV_STORE_TOKEN_FILE, str(write_token_file(shared_tmp / "token", secrets.token_hex(32))))
    meta = f"sqlite://{shared_tmp}/meta.sqlite"
    spill = shared_tmp / "spill"
    ex = SlurmExecutor(slurm_section(multihost_slurm), site="slurm-multihost")
    ex.open_run()
    try:
        store = px.Store(host_root, metadata=meta, memory_budget=BUDGET, spill=spill)
        with px.Gang(
            len(HOSTS), executor=ex, control_host=driver_host, rendezvous=f"file://{shared_tmp}/rdzv", store=store
        ) as gang:
            results = gang.run(put_three_then_get)
    finally:
        ex.close_run()
    assert sorted(r[0] for r in results) == sorted(HOSTS)
    assert all(r[1] == [True] * 3 for r in results), [r[1] for r in results]  # d1 spilled on every host
    got = pd.concat([r[2].to_pandas() for r in results], ignore_index=True)
    pd.testing.assert_frame_equal(got, _reference("d1"))
    assert all(r[3] <= BUDGET for r in results), [r[3] for r in results]  # each host's memory tier
    assert all(r[4] <= BUDGET for r in results), [r[4] for r in results]  # also right after a put over it
    info = px.Store(host_root, metadata=meta).info("d1")
    assert sorted(p.host for p in info.partitions) == sorted(HOSTS)
    # rank 0's host brought its partition back (use); the others' stay on their spill
    assert sum(Path(info.location_of(i)).is_relative_to(spill) for i in range(3)) == 2
