"""The store's multi-host points (issue 23) on every multi-host site of the suite (``--site``;
skipped on single-host sites): a dataset put by a gang of N ranks, one per host, each
partition in its host's own /dev/shm, read by a gang of M != N ranks — balanced by rows, by
key and with ``shuffle="random"`` — each checked against pandas computed here independently;
the ranks on the hosts holding a partition map it, the others fetch it; a host whose store
service is lost fails the read on every rank within seconds, naming dataset, partition and
host; ranks placed by ``repartition.rank_hosts`` read everything where it lies.

Producer and readers share one run scope (one SLURM pilot; on Ray, one executor run): the
partitions live as long as the scope's store services.  The site is a ``sites.MultihostSite``
(``hosts``, ``run_on``, ``service_key``).

    .venv/bin/python -m pytest tests/conformance/test_contract_multihost.py -m multihost \
        --site slurm-multihost,ray-multihost -p no:randomly -q
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import phalanx as px
from phalanx.store.repartition import rank_hosts

COLS = ["src", "i", "key", "v"]


def _rows(rank: int, even: bool = False) -> int:
    # uneven partitions: balanced slices cross partition bounds; even ones: slice r = partition r
    return 4000 if even else 4000 + 1500 * rank


def part_of(rank: int, even: bool = False) -> pa.Table:
    """What producer rank ``rank`` puts (on the rank, and nothing else)."""
    rows = _rows(rank, even)
    rng = np.random.default_rng([23, rank])
    keys = rng.integers(0, 211, rows)
    return pa.table(
        {
            "src": pa.array(np.full(rows, rank, dtype=np.int64)),
            "i": pa.array(np.arange(rows, dtype=np.int64)),
            "key": pa.array([f"k{k}" for k in keys.tolist()], pa.string()),
            "v": pa.array(rng.integers(0, 10_000, rows), pa.int64()),
        }
    )


def expected(n: int, even: bool = False) -> pd.DataFrame:
    """The dataset, made here with numpy and pandas (not through the store or part_of)."""
    frames = []
    for rank in range(n):
        rows = _rows(rank, even)
        rng = np.random.default_rng([23, rank])
        keys = rng.integers(0, 211, rows)
        frames.append(
            pd.DataFrame(
                {
                    "src": np.full(rows, rank, dtype=np.int64),
                    "i": np.arange(rows, dtype=np.int64),
                    "key": ["k" + str(k) for k in keys],
                    "v": rng.integers(0, 10_000, rows),
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


# ---- on the ranks ------------------------------------------------------------------------------
def put_part(env, name: str, even: bool = False) -> str:
    env.store.put(name, part_of(env.rank, even), producer="contract-multihost")
    return socket.gethostname()


def read(env, name: str, how: str, verify: bool = True) -> dict:
    """This rank's share of ``name`` read ``how`` (balanced | by-key | random), with the bytes
    this read mapped here and fetched (the delta of env.store.reads)."""
    before = env.store.reads.as_dict()
    t0 = time.monotonic()
    if how == "by-key":
        df = env.store.get(name, by=["key"], verify=verify)
    elif how == "random":
        df = env.store.get(name, shuffle="random", seed=7, verify=verify)
    else:
        df = env.store.get(name, verify=verify)
    table = df.to_arrow()
    took = time.monotonic() - t0
    after = env.store.reads.as_dict()
    return {
        "host": socket.gethostname(),
        "table": table,
        "took": took,
        "plan": env.store.last_plan,
        "local": after["local"] - before["local"],
        "fetched": after["fetched"] - before["fetched"],
    }


def read_lazily(env, name: str, columns: list[str]) -> dict:
    """This rank's share of ``name`` read lazily and used only for ``columns``, then read
    whole (eagerly): the rows, and the bytes each read fetched from other hosts."""
    before = env.store.reads.fetched
    table = env.store.get(name, lazy=True).select(columns).to_arrow()
    lazy = env.store.reads.fetched - before
    before = env.store.reads.fetched
    whole = env.store.get(name).to_arrow()
    return {"table": table, "lazy": lazy, "eager": env.store.reads.fetched - before, "whole": whole.num_rows}


def read_until_it_fails(env, name: str, marker: str) -> None:
    """Read by key again and again (each read collective); after the first read every rank says
    so in ``marker``-<rank>; returns only if 60 s of reads all succeed."""
    deadline = time.monotonic() + 60
    first = True
    while time.monotonic() < deadline:
        env.store.get(name, by=["key"]).to_arrow()
        if first:
            Path(f"{marker}-{env.rank}").write_text(str(time.time()))
            first = False


# ---- the site's gangs ----------------------------------------------------------------------------
def multihost(site):
    if not getattr(site, "hosts", None) or len(site.hosts) < 2:
        pytest.skip(
            f"site {site.name!r} is one host: its ranks share one /dev/shm (the multi-host points need several)"
        )
    return site


class Scope:
    """One run scope (one pilot) on the site; gangs of any size on it, placed where asked."""

    def __init__(self, site):
        self.site, self.model = site, site.model()
        self.executor = self.model.create_executor()
        self.executor.open_run()
        self.gangs: list[px.Gang] = []

    def store(self) -> px.Store:
        return px.Store(self.model.store.root, metadata=self.model.store.metadata)

    def gang(self, n: int, hosts: list[str] | None = None) -> px.Gang:
        """A gang of ``n`` on the scope's pilot, rank r on ``hosts[r]`` (the first gang of a
        SLURM pilot, which starts the pilot, goes where SLURM puts it: a pilot not running has no
        nodes to ask for; Ray places every gang as asked, the first too)."""
        launcher = self.executor.launcher(n)
        if hosts is not None:
            placed = launcher.prefer_hosts(hosts)
            assert placed or not self.gangs, f"the launcher declined hosts {hosts}"
        g = px.Gang(n, site=self.model, executor=launcher, store=self.store(), echo=False)
        self.gangs.append(g)
        return g

    def close(self) -> None:
        for g in self.gangs:
            self.site.seen.add([g.gang_id])
            g.close()
        self.executor.close_run()


@pytest.fixture(scope="module")
def scope(site) -> Iterator[Scope]:
    s = Scope(multihost(site))
    yield s
    s.close()


@pytest.fixture(scope="module")
def spread(scope) -> dict:
    """'spread3': put by 3 ranks, one per host; 'spread2': by 2 ranks on the first two hosts;
    'even3': as spread3 with partitions of equal rows."""
    hosts = scope.site.hosts
    out = {}
    for name, n in (("spread3", 3), ("spread2", 2), ("even3", 3)):
        with scope.gang(n, hosts[:n]) as g:
            t0 = time.monotonic()
            out[name] = {"hosts": g.run(put_part, name, name == "even3"), "put_s": time.monotonic() - t0}
        info = scope.store().info(name)
        assert [p.host for p in info.partitions] == out[name]["hosts"], (info.partitions, out)
        assert sorted(out[name]["hosts"]) == hosts[:n], out  # one rank a host (the first gang: SLURM's order)
        assert len({p.root_id for p in info.partitions}) == n  # roots that share nothing
        out[name]["info"] = info
    return out


def _check_reads(results: list[dict], info, how: str) -> None:
    n = info.num_partitions
    want = expected(n, even=info.name == "even3")
    got = [r["table"].to_pandas() for r in results]
    union = pd.concat(got, ignore_index=True)
    key = ["src", "i"]
    pd.testing.assert_frame_equal(
        union.sort_values(key).reset_index(drop=True)[COLS], want.sort_values(key).reset_index(drop=True)[COLS]
    )
    sizes = [len(g) for g in got]
    if how == "balanced":  # rank r: the r-th slice of the rows in partition order
        assert max(sizes) - min(sizes) <= 1, sizes
        pd.testing.assert_frame_equal(union[COLS], want[COLS])
    elif how == "by-key":  # every key on one rank; the groupby of each rank = pandas'
        owners = [set(g["key"]) for g in got]
        assert sum(len(o) for o in owners) == len(set().union(*owners)) == want["key"].nunique()
        ours = pd.concat([g.groupby("key")["v"].sum() for g in got]).sort_index()
        pd.testing.assert_series_equal(ours, want.groupby("key")["v"].sum().sort_index())
    else:  # a permutation: balanced shares, not in stored order
        assert max(sizes) - min(sizes) <= 1, sizes
        assert not union[key].equals(want[key]), "shuffle='random' kept the stored order"


def _locality(results: list[dict], info) -> None:
    holders = {p.host for p in info.partitions}
    for r in results:
        if r["host"] in holders:
            assert r["local"] > 0, (r["host"], r["local"], r["fetched"])
        else:
            assert r["local"] == 0 and r["fetched"] > 0, (r["host"], r["local"], r["fetched"])


TIMES: dict = {}


@pytest.mark.parametrize("how", ["balanced", "by-key", "random"])
@pytest.mark.parametrize("n,m", [(3, 2), (2, 3)])
def test_a_dataset_put_on_n_hosts_is_read_right_by_m_ranks_elsewhere(site, scope, spread, n, m, how):
    """N→M, N != M: a gang of M ranks (one a host) reads the dataset put by N ranks; ranks on
    a host holding partitions map them, the others fetch (N=2: the third host holds nothing)."""
    info = spread[f"spread{n}"]["info"]
    with scope.gang(m, site.hosts[:m]) as g:
        t0 = time.monotonic()
        results = g.run(read, f"spread{n}", how)
        TIMES[(n, m, how)] = time.monotonic() - t0
    assert [r["host"] for r in results] == site.hosts[:m]
    _check_reads(results, info, how)
    _locality(results, info)
    assert sum(r["fetched"] for r in results) > 0, results  # some rank reads another host's partition
    if how == "by-key":
        assert all(r["plan"] == "hash: rows split at the hosts holding them" for r in results), results


@pytest.mark.parametrize("name,m", [("even3", 3), ("spread3", 3), ("spread3", 2)])
def test_readers_placed_by_rank_hosts_read_where_the_data_lies(site, scope, spread, name, m):
    """The scheduler's placement (``rank_hosts`` → ``prefer_hosts``): rank r runs on the host
    holding most of what it reads, and fetches less than a gang placed otherwise; when its
    balanced slice is a partition (M == N, partitions of equal rows) every byte is mapped,
    none fetched.  (Uneven partitions: a balanced slice crosses partition bounds, so even
    placed ranks fetch the rows past their partition's end.)"""
    info = spread[name]["info"]
    want = rank_hosts([info], m)
    assert want and set(want) <= set(site.hosts), want
    order = list(reversed(site.hosts))  # a gang started elsewhere first: placement must move it
    with scope.gang(m, order[:m]) as g:
        rotated = g.run(read, name, "balanced")
    with scope.gang(m, want) as g:
        placed = g.run(read, name, "balanced")
    assert [r["host"] for r in placed] == want
    _check_reads(placed, info, "balanced")
    _check_reads(rotated, info, "balanced")
    assert all(r["local"] > 0 for r in placed), placed
    if m == info.num_partitions and len({p.rows for p in info.partitions}) == 1:
        assert all(r["fetched"] == 0 and r["local"] > 0 for r in placed), placed
    assert sum(r["fetched"] for r in placed) < sum(r["fetched"] for r in rotated), (placed, rotated)
    TIMES[("placed", name, m)] = {
        what: {
            "s": max(r["took"] for r in rs),
            "local": [r["local"] for r in rs],
            "fetched": [r["fetched"] for r in rs],
        }
        for what, rs in (("placed", placed), ("rotated", rotated))
    }


def test_bytes_read_here_are_counted_once(site, scope, spread):
    """Ranks placed on their partitions (M == N, equal rows) count each mapped byte once in
    env.store.reads.local (what `phalanx status` and the report show as "here"), checked or
    not: the checksum check that precedes the read is no second read."""
    info = spread["even3"]["info"]
    total = sum(p.bytes for p in info.partitions)
    counted = {}
    for verify in (False, True):
        with scope.gang(3, rank_hosts([info], 3)) as g:
            results = g.run(read, "even3", "balanced", verify)
        assert all(r["fetched"] == 0 for r in results), results
        counted[verify] = [r["local"] for r in results]
    assert sum(counted[False]) == total, (counted, [p.bytes for p in info.partitions])
    assert sum(counted[True]) == total, (counted, [p.bytes for p in info.partitions])


def test_a_lazy_read_fetches_only_the_columns_its_plan_uses(site, scope, spread):
    """``env.store.get(lazy=True)`` (what ``env.input`` does) by readers placed away from the
    data: the frame's rows are right, and only the column the plan uses crosses the network
    (an int64 of the four columns: well under a third of an eager read's bytes)."""
    with scope.gang(3, list(reversed(site.hosts))[:3]) as g:
        results = g.run(read_lazily, "spread3", ["v"])
    want = expected(3)
    got = pd.concat([r["table"].to_pandas() for r in results], ignore_index=True)
    pd.testing.assert_frame_equal(got, want[["v"]])  # balanced shares, in partition order
    assert [r["table"].num_rows for r in results] == [r["whole"] for r in results]
    assert sum(r["eager"] for r in results) > 0, results  # the placement made them fetch
    assert all(r["lazy"] <= r["eager"] for r in results), results
    assert 0 < 3 * sum(r["lazy"] for r in results) < sum(r["eager"] for r in results), results


def _service_pid(site, host: str, root: str, key: str) -> int:
    r = site.run_on(host, ["cat", f"{root}/.services/{key}.json"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"{host}: no store service record {root}/.services/{key}.json: {r.stderr}"
    return int(json.loads(r.stdout)["pid"])


def test_a_host_lost_mid_read_fails_the_read_on_every_rank_naming_it(site, tmp_path):
    """Readers on the first two hosts read by key, again and again, a dataset with a partition
    on the third; that host's store service is killed (by the PID its record names): every
    rank fails within seconds with PartitionLostError naming dataset, partition and host.
    (A run scope of its own: the pilot has lost a service.)"""
    import os
    import signal

    scope = Scope(multihost(site))
    try:
        hosts = site.hosts
        with scope.gang(3, hosts[:3]) as g:
            g.run(put_part, "lost")
        info = scope.store().info("lost")
        victim = info.partitions[2].host
        readers = [h for h in hosts if h != victim][:2]
        key = site.service_key(scope.executor)  # the scope's services' (slurm-<pilot job>, ray-<id>)
        pid = _service_pid(site, victim, scope.model.store.root, key)
        marker = str(tmp_path / "read")
        with scope.gang(2, readers) as g:
            killed: list[float] = []

            def kill_after_first_read() -> None:
                deadline = time.monotonic() + 60
                while not all(Path(f"{marker}-{r}").exists() for r in range(2)) and time.monotonic() < deadline:
                    time.sleep(0.02)
                killed.append(time.monotonic())
                os.kill(pid, signal.SIGKILL)  # PIDs are global on the bed: its host's service

            threading.Thread(target=kill_after_first_read, daemon=True).start()
            with pytest.raises(px.RankError) as info_err:
                g.run(read_until_it_fails, "lost", marker, timeout=120)
            took = time.monotonic() - killed[0]
        err = info_err.value
        TIMES["lost"] = took
        assert took < 10, f"the read failed {took:.1f} s after {victim}'s service was killed"
        assert err.ranks == [0, 1], str(err)  # every rank's read failed, none hangs
        for f in err.failures:
            assert "PartitionLostError" in f.message or f.exc_type == "PartitionLostError", f.summary()
            assert re.search(rf"dataset 'lost' partition 2 is held in the memory of host {victim}", f.message), (
                f.summary()
            )
    finally:
        scope.close()


def test_timings(site, scope):
    """Not a check: prints the read times measured above (-s to see them)."""
    multihost(site)
    print("\nmulti-host read times (s):", json.dumps({str(k): v for k, v in TIMES.items()}, default=str))
