"""The memory budget per host for a dataset spread over hosts (issue 23, docs/store.md "Spill
across hosts").

Two hosts on this machine, as tests/test_verify_once.py fakes them: two store roots (each its
own root id, so neither reads the other's files), each with a store service on loopback that
serves its root and the spill directory, one catalogue.  Both hosts spill into the *same*
directory, as on the test bed (one /var/tmp for all hosts): their spilled partitions must not
collide.  A put spread over them is what a gang spanning hosts does (``RankStore.put``): each
host stages its ranks' partitions, moves them into place (``commit_here``), one seals.  Rows are
compared with pandas; across real hosts: tests/multihost/test_store_spill_multihost.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import phalanx as px
from phalanx.errors import ChecksumError
from phalanx.store.metadata import DatasetInfo, PartitionInfo, open_metadata
from phalanx.store.tiers import part_file

REPO = Path(__file__).resolve().parent.parent
ROWS = 100_000  # 800 kB a partition
BUDGET = 2_000_000  # two partitions of a host, not three


def base(name: str) -> int:
    return sum(map(ord, name)) * 10**8  # each dataset its own values


def part_table(name: str, i: int, rows: int = ROWS) -> pa.Table:
    return pa.table({"v": np.arange(rows, dtype=np.int64) + base(name) + 1_000_000 * i})


def reference(name: str, n: int) -> pd.DataFrame:
    """What a dataset of ``n`` partitions holds, built by pandas alone."""
    values = [pd.Series(range(ROWS), dtype="int64") + base(name) + 1_000_000 * i for i in range(n)]
    return pd.DataFrame({"v": pd.concat(values, ignore_index=True)})


def spread_put(hosts: list[Any], name: str, n: int = 4, rows: int = ROWS) -> DatasetInfo:
    """Partition i written on host i mod len(hosts), as a gang spanning hosts puts it."""
    first = hosts[0]
    staging_id = first.new_staging_id("t")
    parts = [hosts[i % len(hosts)].stage_partition(staging_id, i, part_table(name, i, rows), name) for i in range(n)]
    for host in hosts[: min(n, len(hosts))]:
        host.commit_here(name, staging_id)
    schema = part_table(name, 0).schema
    return first.seal(name, staging_id, parts, schema, None, "", "", False, committed=True)


class OtherHost:
    """Host b: its ``px.Store`` in the helper process (tests/spill_hosts_helper.py), called by
    method name: ``b.put(...)``, ``b.call("root_id")``."""

    def __init__(self, proc: subprocess.Popen[bytes]):
        self.proc = proc
        self.endpoint = self.reply()

    def reply(self) -> Any:
        from spill_hosts_helper import receive

        assert self.proc.stdout is not None
        status, value = receive(self.proc.stdout)
        if status == "err":
            raise value
        return value

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from spill_hosts_helper import send

        assert self.proc.stdin is not None
        send(self.proc.stdin, (method, args, kwargs))
        return self.reply()

    def __getattr__(self, method: str) -> Any:
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)


@pytest.fixture
def two_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[px.Store, Any, Path]]:
    """Host a: a store in this process; host b: one in a process that sees its own directory
    at host a's root path (a mount namespace, as each host of the bed has its own /dev/shm)."""
    from phalanx.runtime.envvars import ENV_STORE_SERVICE_KEY
    from phalanx.store.remote import publish_endpoint
    from phalanx.store.service import ENV_TOKEN, StoreService

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("faking a second host's memory at the same path needs root and unshare (a mount namespace)")
    monkeypatch.setenv(ENV_TOKEN, "spill-hosts-test-token")
    monkeypatch.setenv(ENV_STORE_SERVICE_KEY, "sh-test")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests")]))
    catalogue = f"sqlite:///{tmp_path / 'catalogue.db'}"
    spill = tmp_path / "spill"  # shared by both hosts, as /var/tmp on the bed
    root, b_own = tmp_path / "store", tmp_path / "host-b-memory"
    root.mkdir()
    b_own.mkdir()
    script = 'mount --bind "$1" "$2" && exec "$3" "$4" "$2" "$5" "$6" "$7"'
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(b_own), str(root)]
    argv += [sys.executable, str(REPO / "tests" / "spill_hosts_helper.py"), str(spill), catalogue, str(BUDGET)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
    try:
        with StoreService(root, "127.0.0.1", also=[spill]) as svc:
            publish_endpoint(root, "sh-test", svc.endpoint)
            b = OtherHost(proc)
            a = px.Store(root, session="s", metadata=catalogue, memory_budget=BUDGET, spill=spill)
            assert a.tier.root_id() != b.call("root_id")
            yield a, b, spill
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def in_spill(info: DatasetInfo, index: int, spill: Path) -> bool:
    return Path(info.location_of(index)).is_relative_to(spill)


def old_spilled(a: px.Store, b: Any, spill: Path) -> DatasetInfo:
    """Put 'old' then 'new' (1.6 MB a host each): 'old' spills on both hosts; its info."""
    spread_put([a, b], "old")
    spread_put([a, b], "new")
    old = a.info("old")
    assert all(in_spill(old, i, spill) for i in range(4)), [old.location_of(i) for i in range(4)]
    return old


@pytest.mark.slow  # a second host process: ~2 s
def test_each_host_spills_its_own_least_recently_used_partitions(two_hosts):
    a, b, spill = two_hosts
    spread_put([a, b], "old")  # 2 partitions (1.6 MB) on each host: within budget
    assert a.memory_usage() == b.memory_usage() == 2 * a.info("old").partitions[0].bytes
    spread_put([a, b], "new")  # another 1.6 MB a host: 'old' (least recently used) spills there
    old = a.info("old")
    assert all(in_spill(old, i, spill) for i in range(4)), [old.location_of(i) for i in range(4)]
    # each partition in a directory of its own: the hosts share the spill directory, never a file
    assert len({old.location_of(i) for i in range(4)}) == 4
    for i, p in enumerate(old.partitions):  # recorded where it is, on the host that holds it
        assert (Path(old.location_of(i)) / part_file(i)).is_file()
        assert not (Path(old.location) / part_file(i)).exists()
        assert p.host and p.root_id == (a.tier.root_id() if i % 2 == 0 else b.call("root_id"))
    for host in (a, b):
        assert host.memory_usage() <= BUDGET
        assert not any(in_spill(host.info("new"), i, spill) for i in range(4))
    # placement as `phalanx store show` prints it
    assert [pl["tier"] for pl in a.partition_places(old)] == ["spill"] * 4
    assert [pl["tier"] for pl in a.partition_places(a.info("new"))] == ["memory"] * 4


@pytest.mark.slow  # a second host process: ~2 s
def test_readers_on_either_host_get_every_row_of_a_spilled_dataset(two_hosts):
    a, b, spill = two_hosts
    old = old_spilled(a, b, spill)
    for reader in (a, b):  # each reads its own spilled partitions there and fetches the others'
        table = pa.concat_tables([reader.partition(old, i, verify=True) for i in range(4)])
        pd.testing.assert_frame_equal(table.to_pandas(), reference("old", 4))
    assert a.reads.fetched == b.call("attr", "reads").fetched == 2 * old.partitions[0].bytes
    # a read through use() brings this host's partitions back (they fit once the others spill)
    pd.testing.assert_frame_equal(b.read("old").to_pandas(), reference("old", 4))
    now = b.info("old")
    assert [in_spill(now, i, spill) for i in range(4)] == [True, False, True, False]
    assert b.memory_usage() <= BUDGET


@pytest.mark.slow  # a second host process: ~2 s
def test_a_reader_with_a_stale_location_follows_the_metadata(two_hosts):
    a, b, spill = two_hosts
    spread_put([a, b], "old")
    stale = a.info("old")  # read before the move
    mapped = a.partition(stale, 0)  # mapped before the move: stays valid after the unlink
    spread_put([a, b], "new")
    assert all(in_spill(a.info("old"), i, spill) for i in range(4))
    for reader in (a, b):
        table = pa.concat_tables([reader.partition(stale, i, verify=True) for i in range(4)])
        pd.testing.assert_frame_equal(table.to_pandas(), reference("old", 4))
        reader.check(stale, 1 if reader is a else 0)  # hashed by the holder, at its new place
    assert not (Path(stale.location) / part_file(0)).exists()
    pd.testing.assert_frame_equal(mapped.to_pandas(), reference("old", 4).iloc[:ROWS])


@pytest.mark.slow  # a second host process: ~2 s
def test_a_pin_brings_partitions_back_on_each_host_at_its_next_write(two_hosts):
    a, b, spill = two_hosts
    old_spilled(a, b, spill)
    a.pin("old")  # host a's partitions back now, host b's at b's next write
    old = a.info("old")
    assert [in_spill(old, i, spill) for i in range(4)] == [False, True, False, True]
    spread_put([a, b], "small", 2, rows=1000)  # a put on both hosts: b brings the pinned back
    old, new = a.info("old"), a.info("new")
    assert not any(in_spill(old, i, spill) for i in range(4))
    assert all(in_spill(new, i, spill) for i in range(4))  # to make room for them
    spread_put([a, b], "third")  # pinned: never spilled; the others make room
    assert not any(in_spill(a.info("old"), i, spill) for i in range(4))
    assert a.memory_usage() <= BUDGET  # the sealing host keeps the budget at once
    # a host that does not seal makes room before its partitions come, not after: pinned and
    # incoming together are over budget there until its next write spills what it can
    third_here = sum(p.bytes for i, p in enumerate(a.info("third").partitions) if i % 2)
    assert b.memory_usage() <= BUDGET + third_here
    spread_put([a, b], "small2", 2, rows=1000)
    assert not any(in_spill(a.info("old"), i, spill) for i in range(4))
    for host in (a, b):
        assert host.memory_usage() <= BUDGET
    pd.testing.assert_frame_equal(a.read("old").to_pandas(), reference("old", 4))


@pytest.mark.slow  # a second host process: ~2 s
def test_a_damaged_spilled_partition_fails_naming_dataset_partition_and_host(two_hosts):
    a, b, spill = two_hosts
    old = old_spilled(a, b, spill)
    path = Path(old.location_of(1)) / part_file(1)  # held by host b, spilled there
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    host = old.partitions[1].host
    with pytest.raises(ChecksumError, match=rf"dataset 'old' partition 1 \(on host {host}: .*checksum mismatch"):
        b.partition(old, 1, verify=True)  # on its host: bytes off the memory tier are checked
    with pytest.raises(ChecksumError, match=rf"dataset 'old' partition 1 .*{host}.*checksum mismatch"):
        a.partition(old, 1, verify=False)  # fetched from host b: checked on arrival
    with pytest.raises(ChecksumError, match=r"dataset 'old' partition 1 on host .*checksum mismatch"):
        a.check(old, 1)


@pytest.mark.slow  # a second host process: ~2 s
def test_another_session_adopts_a_spilled_spread_dataset(two_hosts):
    a, b, spill = two_hosts
    old_spilled(a, b, spill)
    adopted = a.for_session("t").adopt(a, "old")  # host a's spilled file linked, b's fetched
    assert adopted.info.num_rows == 4 * ROWS
    pd.testing.assert_frame_equal(a.for_session("t").read("old").to_pandas(), reference("old", 4))


@pytest.mark.slow  # a second host process: ~2 s
def test_deleting_a_spilled_spread_dataset_removes_its_spilled_partitions(two_hosts):
    a, b, spill = two_hosts
    old = old_spilled(a, b, spill)
    places = [Path(old.location_of(i)) for i in range(4)]
    assert all(p.is_dir() for p in places)
    a.delete("old")
    a.purge_retired(older_than=0)  # this host's after the grace period; b's at once by its service
    assert not any(p.exists() for p in places), [p for p in places if p.exists()]


@pytest.mark.slow  # a second host process: ~2 s
def test_store_show_names_each_partitions_host_and_tier(two_hosts, capsys, monkeypatch):
    from phalanx.cli import main

    a, b, spill = two_hosts
    old_spilled(a, b, spill)
    monkeypatch.setenv("PHALANX_STORE_METADATA", a.meta.url)
    assert main(["store", "--root", str(a.root), "--session", "s", "show", "old"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [p["tier"] for p in shown["at"]] == ["spill"] * 4
    assert [p["location"] for p in shown["at"]] == [a.info("old").location_of(i) for i in range(4)]
    assert all(p["host"] for p in shown["at"])


# ---- the metadata step, on both backends -------------------------------------------------------
@pytest.fixture(params=["sqlite", "redis"])
def meta(request, tmp_path):
    if request.param == "sqlite":
        return open_metadata(f"sqlite:///{tmp_path / 'm.db'}")
    pytest.importorskip("redis")
    import uuid

    return open_metadata(f"{request.getfixturevalue('redis_url')}?prefix=t-{uuid.uuid4().hex[:8]}:")


def test_relocate_partitions_is_one_compare_and_set(meta):
    parts = [PartitionInfo(i, 1, 8, f"c{i}", host=f"h{i}", root_id=f"r{i}") for i in range(3)]
    schema = pa.schema([("v", pa.int64())])
    meta.seal(DatasetInfo("s", "d", "v1", "/mem/v1", schema, parts), replace=False)
    assert meta.relocate_partitions("s", "d", "v1", {0: ("/mem/v1", "/spill/a"), 2: ("/mem/v1", "/spill/b")})
    got = meta.get("s", "d")
    assert [got.location_of(i) for i in range(3)] == ["/spill/a", "/mem/v1", "/spill/b"]
    assert [p.host for p in got.partitions] == ["h0", "h1", "h2"]  # the other place fields kept
    # one stale old location: nothing moves
    assert not meta.relocate_partitions("s", "d", "v1", {1: ("/mem/v1", "/x"), 2: ("/mem/v1", "/y")})
    assert not meta.relocate_partitions("s", "d", "v2", {1: ("/mem/v1", "/x")})  # another version
    meta.set_pinned("s", "d", True)
    assert not meta.relocate_partitions("s", "d", "v1", {1: ("/mem/v1", "/x")}, unless_pinned=True)
    # back to the dataset's directory: the partition's own location is cleared
    assert meta.relocate_partitions("s", "d", "v1", {0: ("/spill/a", "/mem/v1")})
    got = meta.get("s", "d")
    assert got.partitions[0].location == "" and got.location_of(2) == "/spill/b"
    assert [got.location_of(i) for i in range(3)] == ["/mem/v1", "/mem/v1", "/spill/b"]
