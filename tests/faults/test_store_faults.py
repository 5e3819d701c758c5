"""Store faults: Redis metadata killed and restarted mid-stage (with and without persistence),
the store's tier full (a real 20 MB tmpfs), staging a killed driver left, `phalanx store` with
Redis unreachable, and a bit-flipped or truncated partition.  Real parts only: a redis-server
this module starts, stops and kills by PID; a tmpfs it mounts and unmounts."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from store_apps import get_verified
from test_resume_faults import damage
from test_scheduler import generated  # what apps:wf_generate writes, computed independently

import phalanx as px
from phalanx.errors import ChecksumError, StoreError
from phalanx.orchestrator.models import Site, Stage, Workflow
from phalanx.orchestrator.rundb import RunDB
from phalanx.orchestrator.scheduler import run_workflow

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'phalanx[redis]')")


def wait_until(predicate: Callable[[], Any], what: str, limit: float = 120.0) -> Any:
    """Poll ``predicate`` until it returns something true; fail after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} within {limit:.0f}s"
        time.sleep(0.02)
    return value


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "store", *args], env=env, capture_output=True, text=True, timeout=120
    )


def expected_totals(rows: int) -> pd.DataFrame:
    return generated(rows, 2, seed=3).groupby("user", as_index=False)["amount"].sum()


def totals_of(store: px.Store) -> pd.DataFrame:
    return store.read("totals").to_pandas().sort_values("user").reset_index(drop=True)


# ---- a redis-server the test can kill and start again on the same port --------------------------
class RedisServer:
    """redis-server on a fixed loopback port and directory: ``kill`` (SIGKILL, as a crash) and
    ``start`` again.  ``aof``: append-only file, fsync'd on every write, so a restart keeps
    every acknowledged write; without it a restart comes back empty (or from an explicit
    ``SAVE`` snapshot)."""

    def __init__(self, workdir: Path, aof: bool, password: str | None = None):
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        workdir.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:  # a free port, kept across restarts
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.argv = [
            exe,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if aof else "no",
            "--appendfsync",
            "always",
        ]
        if password:
            self.argv += ["--requirepass", password]
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 20
        while True:
            try:
                if client.ping():  # also false while it loads its append-only file
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"redis-server did not start: {' '.join(self.argv)}")
            time.sleep(0.02)
        client.close()
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path):
    """``redis_server(aof=..., password=...)`` starts one; all are stopped at the end."""
    servers: list[RedisServer] = []

    def start(aof: bool, password: str | None = None) -> RedisServer:
        servers.append(RedisServer(tmp_path / f"redis-{len(servers)}", aof, password))
        return servers[-1].start()

    yield start
    for s in servers:
        s.stop()


def failed_attempts(db: RunDB, run_id: str, stage: str) -> list[dict]:
    return [a for a in db.attempts(run_id, stage) if a["state"] == "failed"]


# ---- 1. Redis metadata killed and restarted while a stage runs ----------------------------------
@pytest.mark.redis
@pytest.mark.parametrize("aof", [True, False], ids=["persistent", "not-persistent"])
def test_redis_metadata_killed_and_restarted_mid_stage(redis_server, tmp_path, monkeypatch, fault, aof):
    fault.describe(
        f"Redis metadata killed (SIGKILL) mid-stage, restarted {'with (appendonly)' if aof else 'without'} persistence",
        backend="local",
    )
    server = redis_server(aof=aof)
    monkeypatch.setenv("PHALANX_STORE_METADATA", server.url)  # the site file cannot name metadata
    db, rows = RunDB(tmp_path / "state"), 4000
    wf = Workflow(
        name="redis-fault",
        stages={
            "generate": Stage(app="apps:wf_generate", ranks=2, params={"rows": rows, "seed": 3}, outputs=["tx"]),
            "totals": Stage(
                app="store_apps:totals_after_go",
                ranks=2,
                retries=1,
                outputs=["totals"],
                inputs={"tx": {"dataset": "tx", "by": ["user"]}},
                params={"dir": str(tmp_path)},
            ),
        },
    )
    site = Site(name="t", cores=4)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_workflow, wf, site, db=db)
        wait_until(
            lambda: running.done() or all((tmp_path / f"ready.{r}").exists() for r in (0, 1)),
            "stage totals read its input",
        )
        assert not running.done(), running.result()
        run = db.runs()[0]
        store = px.Store(session=run["session"])
        sealed = store.info("tx")

        server.kill()
        killed = time.monotonic()
        (tmp_path / "go").touch()  # the stage goes on to seal its output: Redis is gone
        first = wait_until(lambda: failed_attempts(db, run["id"], "totals"), "attempt 1 failed")[0]
        detect = time.monotonic() - killed
        assert f"store metadata {server.url} is unreachable" in first["error"], first["error"]
        server.start()  # same port and directory; attempt 2 starts after the retry backoff
        result = running.result(timeout=300)

    if aof:  # the retry completes; what was sealed before the crash is still there
        assert result.ok, result.failed
        assert [a["state"] for a in db.attempts(run["id"], "totals")] == ["failed", "succeeded"]
        assert store.info("tx").version == sealed.version and len(db.attempts(run["id"], "generate")) == 1
        outcome = "stage failed naming the Redis URL; the retry completed after the restart; tx kept"
    else:  # Redis came back empty: the retry refuses it, naming Redis; a resume recomputes
        assert not result.ok
        second = db.attempts(run["id"], "totals")[-1]
        assert f"store metadata {server.url}: the catalogue this store was opened with" in second["error"]
        assert "is gone: Redis came back empty" in second["error"]
        resumed = run_workflow(wf, site, db=db, resume=run["id"])
        assert resumed.ok, resumed.failed
        assert len(db.attempts(run["id"], "generate")) == 2  # tx's metadata was lost: recomputed
        outcome = (
            "retry refused the emptied Redis (error names its URL and the lost catalogue); --resume recomputed generate"
        )
    store = px.Store(session=run["session"])  # (the old one refuses an emptied Redis for good)
    pd.testing.assert_frame_equal(totals_of(store), expected_totals(rows), check_dtype=False)
    fault.detected(detect)
    fault.outcome(outcome + "; totals equal pandas")
    fault.data_lost("none")
    store.delete_session()


@pytest.mark.redis
def test_redis_restored_from_an_older_snapshot_is_refused(redis_server, tmp_path, fault):
    fault.describe("Redis metadata restarted from an older RDB snapshot (writes since lost)")
    server = redis_server(aof=False)
    store = px.Store(tmp_path / "root", session="snap", metadata=server.url)
    store.put("before", pa.table({"a": [1, 2]}))
    redis.Redis.from_url(server.url).save()
    store.put("after", pa.table({"a": [3]}))
    server.kill()
    server.start()  # loads the snapshot: 'after' is gone from the catalogue
    t0 = time.monotonic()
    with pytest.raises(
        StoreError,
        match=rf"store metadata {server.url}: the catalogue went back in time: "
        r"it has 1 writes, this process saw 2",
    ):
        store.read("after")
    fault.detected(time.monotonic() - t0)
    # A process that never saw the lost writes cannot tell: it sees the snapshot as it is.
    assert px.Store(tmp_path / "root", session="snap", metadata=server.url).list() == ["before"]
    fault.outcome(
        "the process that saw the lost writes refuses the catalogue (StoreError naming "
        "the URL); a new process sees the snapshot, without 'after' (recomputed on resume)"
    )
    fault.data_lost("none sealed in phalanx's view; the snapshot lacks later datasets (recomputed)")


# ---- 4. `phalanx store` with Redis metadata unreachable ---------------------------------------
@pytest.mark.redis
def test_store_cli_with_redis_unreachable_says_so_in_one_line(redis_server, tmp_path, fault):
    fault.describe("`phalanx store ls` with Redis metadata unreachable")
    server = redis_server(aof=False, password="s3cret-pass")
    root = str(tmp_path / "root")
    px.Store(root, session="s", metadata=server.url).put("d", pa.table({"a": [1]}))
    env = {**os.environ, "PHALANX_STORE_METADATA": server.url}
    ok = cli("--root", root, "--session", "s", "ls", env=env)
    assert ok.returncode == 0 and ok.stdout.startswith("d "), ok.stderr
    server.kill()
    for command in ("ls", "sessions"):
        t0 = time.monotonic()
        out = cli("--root", root, "--session", "s", command, env=env)
        took = time.monotonic() - t0
        assert out.returncode == 1 and out.stdout == ""
        assert out.stderr.splitlines() == [
            f"phalanx store: store metadata redis://:***@{server.url.split('@')[1]} is unreachable: "
            f"Error 111 connecting to 127.0.0.1:{server.url.split(':')[-1].split('/')[0]}. Connection refused."
        ]
    fault.detected(took)
    fault.outcome("one line naming the URL (password masked), exit code 1, no traceback")
    fault.data_lost("none")


# ---- 2. the store's tier full --------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    """A 20 MB tmpfs (mode 0700), mounted for the test and unmounted after."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir(mode=0o700)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=20m,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:  # lazily: this process may still map a file of it
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def low_water_mark(path: Path, done: threading.Event) -> tuple[int, float]:
    """The fewest free bytes seen on ``path``'s file system until ``done``, and when (sampled
    every 5 ms)."""
    low = (shutil.disk_usage(path).free, time.time())
    while not done.wait(0.005):
        low = min(low, (shutil.disk_usage(path).free, time.time()))
    return low


def table_of(nbytes: int, seed: int) -> pa.Table:
    return pa.table({"x": np.random.default_rng(seed).integers(0, 1 << 60, nbytes // 8)})


def test_tier_full_fails_the_put_cleanly_and_the_run_resumes_once_there_is_room(small_tmpfs, tmp_path, fault):
    fault.describe("the store's tier full (20 MB tmpfs) while a stage puts")
    root = small_tmpfs / "store"
    old = px.Store(root, session="old-run")
    old.put("filler", table_of(10_000_000, 1))
    kept = px.Store(root, session="kept")
    kept_table = table_of(1_000_000, 2)
    kept.put("k", [kept_table.slice(0, 60_000), kept_table.slice(60_000)])
    # 2 ranks × 375,000 rows × 16 bytes = 12 MB more than fits in what is left
    rows = 750_000
    wf = Workflow(
        name="tier-full",
        stages={
            "generate": Stage(app="apps:wf_generate", ranks=2, params={"rows": rows, "seed": 3}, outputs=["tx"]),
            "totals": Stage(
                app="apps:wf_totals", ranks=2, inputs={"tx": {"dataset": "tx", "by": ["user"]}}, outputs=["totals"]
            ),
        },
    )
    db, site = RunDB(tmp_path / "state"), Site(name="t", cores=4, store={"root": str(root)})
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:  # when was the tier fullest?
        fullest = pool.submit(low_water_mark, root, done)
        result = run_workflow(wf, site, db=db)
        done.set()
        _, full_at = fullest.result()

    # ENOSPC in the error (checked below) is the proof the tier filled; the 5 ms sampler may miss
    # the instant it was full (it did under CI load), so its low mark only dates the detection
    assert not result.ok and result.skipped == ["totals"], result.failed
    error = db.attempts(result.run_id, "generate")[0]["error"]
    for text in (
        "No space left on device",
        "put 'tx' partition ",
        "StoreError",
        f"store {root} ",
        f"{root}/{result.session}/.staging/",
    ):
        assert text in error, error
    assert "rank 0" in error.split("\n")[0] or "rank 1" in error.split("\n")[0]
    store = px.Store(root, session=result.session)
    assert not store.exists("tx") and store.unsealed() == []  # nothing half-sealed, staging gone
    assert kept.read("k").equals(kept_table)  # checksums verified by read
    fault.detected(db.attempts(result.run_id, "generate")[0]["ended"] - full_at)

    freed = cli("--root", str(root), "--session", "old-run", "rm", "--all")  # make room
    assert freed.returncode == 0 and "removed 1 datasets" in freed.stdout, freed.stderr
    resumed = run_workflow(wf, site, db=db, resume=result.run_id)
    assert resumed.ok, resumed.failed
    pd.testing.assert_frame_equal(totals_of(store), expected_totals(rows), check_dtype=False)
    assert store.read("tx").num_rows == rows and kept.read("k").equals(kept_table)
    fault.outcome(
        "StoreError naming ENOSPC, dataset, partition, rank and path; nothing sealed, staging "
        "removed, other datasets intact; --resume after `store rm` completed, equal to pandas"
    )
    fault.data_lost("none")


# ---- 3. staging a killed driver left ---------------------------------------------------------
def test_staging_left_by_a_killed_driver_is_listed_and_freed(tmp_path, fault):
    fault.describe("unsealed staging left by a killed driver, seen by `phalanx store sessions`")
    root = str(tmp_path / "root")
    lost, alone = px.Store(root, session="lost-run"), px.Store(root, session="only-staging")
    lost.put("kept", pa.table({"a": [1, 2, 3]}))
    for store in (lost, alone):  # as a killed driver's gang leaves it: staged, never sealed
        store.stage_partition(store.new_staging_id("20250101-000000-1-dead00"), 0, table_of(1_000_000, 3), name="half")
    t0 = time.monotonic()
    listing = cli("--root", root, "sessions")
    fault.detected(time.monotonic() - t0)
    lines = {line.split()[0]: line for line in listing.stdout.splitlines()}
    assert listing.returncode == 0 and sorted(lines) == ["lost-run", "only-staging"], listing
    assert lines["lost-run"].split()[1:3] == ["1", "datasets"] and lines["only-staging"].split()[1] == "0"
    for session, line in lines.items():
        assert "+ 1 unsealed writes 1.0 MB, last written" in line
        assert f"(free: phalanx store --session {session} rm --staging)" in line

    out = cli("--root", root, "--session", "lost-run", "rm", "--staging")
    assert out.stdout.strip() == "removed 1 unsealed writes (1.0 MB) of session 'lost-run'", out.stderr
    assert lost.unsealed("lost-run") == [] and lost.read("kept")["a"].to_pylist() == [1, 2, 3]
    out = cli("--root", root, "--session", "only-staging", "rm", "--all")
    assert out.returncode == 0 and "removed 1 unsealed writes" in out.stdout
    assert lost.unsealed() == [] and "unsealed" not in cli("--root", root, "sessions").stdout
    assert not (Path(root) / "only-staging").exists()
    fault.outcome("listed per session with bytes and age; rm --staging freed it, sealed data kept")
    fault.data_lost("none")


# ---- 5. a bit-flipped or truncated partition ---------------------------------------------------
@pytest.mark.parametrize("how", ["bit-flipped", "truncated"])
def test_a_damaged_partition_is_named_by_read_and_by_a_gang_get(how, fault):
    fault.describe(f"sealed partition {how}, read by Store.read and env.store.get(verify=True)")
    store = px.Store(session=f"damaged-{how}")
    store.put("d", [pa.table({"a": np.arange(5000)}), pa.table({"a": np.arange(5000, 9000)})])
    damage(store, "d", how)
    named = r"dataset 'd' partition 1 \(.*part-00001.arrow\): checksum mismatch"
    store = px.Store(session=store.session)  # a later reader: another attempt (the writer trusts its own)
    t0 = time.monotonic()
    with pytest.raises(ChecksumError, match=named):
        store.read("d")
    fault.detected(time.monotonic() - t0)
    if how == "truncated":  # unverified, it still cannot pass for data
        with pytest.raises(StoreError, match=r"dataset 'd' partition 1 \(.*\) is unreadable"):
            store.read("d", verify=False)
    with px.Gang(ranks=2, echo=False) as gang:
        with pytest.raises(px.RankError, match=named):
            gang.run(get_verified, store.session, "d")
    store.delete_session()
    fault.outcome(
        "ChecksumError naming dataset, partition and file, from Store.read and from every rank of a gang's get"
    )
    fault.data_lost("none (the damage is reported, never returned)")


# ---- 6. a group-shared root: a member must not make the owner delete outside it ----------------
MALLORY = "phalanxmallory"  # the second user of tests/faults/test_security.py


@pytest.fixture(scope="module")
def member() -> pwd.struct_passwd:
    """A second local user (created without a home if missing): a member of the store root's group."""
    if os.geteuid() != 0:
        pytest.skip("needs root: to create a second user and act as it")
    try:
        return pwd.getpwnam(MALLORY)
    except KeyError:
        pass
    made = subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", MALLORY], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot create a second user: useradd: {made.stderr.strip()}")
    return pwd.getpwnam(MALLORY)


@pytest.fixture
def shared(member):
    """A store root shared with ``member``'s group (2770, as a project directory on a cluster)
    and a victim directory of the owner's outside it; both removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="px-shared-", dir="/tmp"))
    os.chown(root, os.getuid(), member.pw_gid)
    os.chmod(root, 0o2770)
    victim = Path(tempfile.mkdtemp(prefix="px-victim-", dir="/tmp"))
    yield root, victim
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(victim, ignore_errors=True)


def as_member(member: pwd.struct_passwd, script: str, cwd: Path) -> None:
    """Run ``script`` (sh) as the group member, in ``cwd``."""
    done = subprocess.run(
        ["sh", "-euc", script], cwd=cwd, user=member.pw_uid, group=member.pw_gid, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_a_path_a_group_member_writes_under_retired_is_not_followed(shared, member, fault):
    fault.describe("a group member writes /victim into <shared root>/.retired; the owner runs `store rm`")
    root, victim = shared
    (victim / "precious.txt").write_text("keep me")
    store = px.Store(root, session="s")
    store.put("d", pa.table({"a": [1, 2, 3]}))
    # .retired is made by whoever retires first; the member gets there first
    as_member(member, f"mkdir -m 0777 .retired && printf %s {victim} > .retired/0-evil", root)
    t0 = time.monotonic()
    out = cli("--root", str(root), "--session", "s", "rm", "d")
    fault.detected(time.monotonic() - t0)
    assert (victim / "precious.txt").read_text() == "keep me"
    entry = root / ".retired" / "0-evil"
    assert out.returncode == 0 and out.stdout.strip() == "removed d", out
    assert f"refusing to act on {entry}, left in place" in out.stderr, out.stderr
    assert f"owned by {MALLORY} (uid {member.pw_uid})" in out.stderr and "check it, then remove it" in out.stderr
    assert entry.exists() and not store.exists("d")
    fault.outcome("the entry is refused (not the owner's), named on stderr and left; the victim directory survives")
    fault.data_lost("none")


def test_a_session_directory_a_group_member_swaps_for_a_symlink_is_not_followed(shared, member, fault):
    fault.describe("a group member replaces <shared root>/<session> by a symlink out; the owner runs `store rm --all`")
    root, victim = shared
    store = px.Store(root, session="s")
    info = store.put("d", pa.table({"a": [1, 2, 3]}))
    # the same layout outside the root, which the symlink makes the dataset's location name
    mirror = victim / Path(info.location).relative_to(root / "s")
    mirror.mkdir(parents=True)
    (mirror / "precious.txt").write_text("keep me")
    as_member(member, f"mv s s.moved && ln -s {victim} s", root)
    t0 = time.monotonic()
    out = cli("--root", str(root), "--session", "s", "rm", "--all")
    fault.detected(time.monotonic() - t0)
    assert (mirror / "precious.txt").read_text() == "keep me"
    assert out.returncode == 1, out
    assert f"refusing to remove {info.location}: {root / 's'} is a symbolic link (to {victim})" in out.stderr
    fault.outcome("`store rm --all` refused, naming the symlink and its target; the directory outside survives")
    fault.data_lost("none")
