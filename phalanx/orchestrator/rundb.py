"""The run database: runs, stages, attempts and events in SQLite under a state directory."""

from __future__ import annotations

import json
import os
import re
import socket
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import PhalanxError
from ..private import create_private
from ..procs import boot_id, pid_alive, same_process, start_time
from ..redact import redact_opt
from ..sqlite_wal import set_wal

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, workflow TEXT NOT NULL, file TEXT, site TEXT, session TEXT NOT NULL,
    state TEXT NOT NULL, started REAL, ended REAL);
CREATE TABLE IF NOT EXISTS stages (
    run_id TEXT NOT NULL, stage TEXT NOT NULL, state TEXT NOT NULL, ranks INTEGER,
    attempts INTEGER NOT NULL DEFAULT 0, started REAL, ended REAL, error TEXT, outputs TEXT,
    PRIMARY KEY (run_id, stage));
CREATE TABLE IF NOT EXISTS attempts (
    run_id TEXT NOT NULL, stage TEXT NOT NULL, attempt INTEGER NOT NULL, state TEXT NOT NULL,
    started REAL, ended REAL, gang_id TEXT, log_dir TEXT, error TEXT,
    PRIMARY KEY (run_id, stage, attempt));
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL, ts REAL NOT NULL, stage TEXT, kind TEXT NOT NULL, message TEXT);
CREATE TABLE IF NOT EXISTS allocations (
    run_id TEXT NOT NULL, stage TEXT, executor TEXT NOT NULL, ident TEXT NOT NULL,
    record TEXT NOT NULL, created REAL NOT NULL, released REAL,
    PRIMARY KEY (run_id, executor, ident));
CREATE TABLE IF NOT EXISTS samples (
    run_id TEXT, stage TEXT, attempt INTEGER, rank INTEGER, ts REAL, host TEXT, cpu REAL, rss INTEGER,
    peak_rss INTEGER, sent INTEGER, received INTEGER, comm_s REAL, elapsed REAL);
"""
# Columns added since the first version of the schema: (table, column, type); added to older databases on open.
_ADDED = [
    ("runs", "pid", "INTEGER"),
    ("runs", "host", "TEXT"),
    ("stages", "inputs", "TEXT"),
    ("attempts", "rank_info", "TEXT"),
    ("stages", "fingerprint", "TEXT"),
    ("runs", "pid_started", "INTEGER"),  # the driver's start time and boot: with pid, one process for good
    ("runs", "boot_id", "TEXT"),
    ("stages", "site", "TEXT"),  # the site a stage runs on (a workflow on several sites)
    ("attempts", "cause", "TEXT"),  # why an attempt failed: oom, timeout, exit:3... (orchestrator/retry.py)
    ("stages", "fp_hash", "TEXT"),  # its fingerprint's hash: what caching across runs looks up
    ("stages", "deps", "TEXT"),  # the stages it waits for (JSON list): the DAG the dashboard draws
]
# Made with the columns they index (IF NOT EXISTS: every migration runs them)
_INDEXES = [
    "CREATE INDEX IF NOT EXISTS stages_by_fp_hash ON stages (fp_hash, state)",
    "CREATE INDEX IF NOT EXISTS samples_by_rank ON samples (run_id, stage, attempt, rank, ts)",
]
_SAMPLE_COLUMNS = ("rank", "ts", "host", "cpu", "rss", "peak_rss", "sent", "received", "comm_s", "elapsed")
_TABLES = re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", _SCHEMA)
_JSON = {"outputs", "inputs", "rank_info", "record", "fingerprint", "deps"}
FINAL = ("succeeded", "failed", "cancelled", "lost")
RETRY_RELEASE_S = 60.0  # a leftover allocation this process failed to free is tried again after this
_FAILED_RELEASES: dict[tuple[str, str, str, str], float] = {}  # (db, run, executor, id) → when it failed


class RunDB:
    def __init__(self, state_dir: str | Path | None = None):
        self.state_dir = paths.state_dir(state_dir)  # PHALANX_STATE, else under XDG_STATE_HOME; private
        self.path = create_private(self.state_dir / "runs.sqlite")  # 0600, and so its -wal, -shm
        if self._missing(None):  # a new database, or an older one: made current under a write lock
            with self._con() as con:
                con.execute("BEGIN IMMEDIATE")  # so that processes opening it at once do it once
                try:
                    for statement in _SCHEMA.split(";"):
                        if statement.strip():
                            con.execute(statement)
                    for table, column, kind in self._missing(con):  # tables are there now
                        con.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
                    for statement in _INDEXES:
                        con.execute(statement)
                    con.execute(  # stages recorded before fp_hash existed can be cache hits too
                        "UPDATE stages SET fp_hash=json_extract(fingerprint, '$.hash') "
                        "WHERE fp_hash IS NULL AND fingerprint IS NOT NULL AND json_valid(fingerprint)"
                    )
                    con.execute("COMMIT")
                except BaseException:
                    if con.in_transaction:
                        con.execute("ROLLBACK")
                    raise

    def _missing(self, con: sqlite3.Connection | None) -> list[tuple[str, str, str]]:
        """The tables and columns this database lacks, as (table, column, type); a missing
        table as (table, "", "").  Only reads: a current database is opened without a write
        (``phalanx status`` works on a full disk)."""

        def columns(table: str) -> set[str]:
            q = f"PRAGMA table_info({table})"
            return {r["name"] for r in (con.execute(q) if con is not None else self._rows(q))}

        missing = []
        for table in _TABLES:
            if not columns(table):
                missing.append((table, "", ""))
        for table, column, kind in _ADDED:
            have = columns(table)
            if have and column not in have:
                missing.append((table, column, kind))
        return missing

    @contextmanager
    def _con(self) -> Iterator[sqlite3.Connection]:
        """A connection for one read or write; SQLite's errors as ``RunDBError`` naming the file
        (and, when its file system is full, saying so)."""
        try:
            con = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        except sqlite3.Error as exc:
            raise RunDBError(self.path, exc) from exc
        con.row_factory = sqlite3.Row
        try:
            if con.execute("PRAGMA journal_mode").fetchone()[0] != "wal":  # a new database: once
                set_wal(con)
            yield con
        except sqlite3.OperationalError as exc:
            if isinstance(exc, RunDBError):
                raise
            raise RunDBError(self.path, exc) from exc
        finally:
            con.close()

    def _rows(self, query: str, params: tuple = ()) -> list[dict]:
        """A read, as dicts.  When the file system is full a reader may be unable to open the
        database as writers do (WAL mode: it must create the -shm file): it then reads it
        read-only, else as an immutable file (what the last checkpoint holds), so ``phalanx
        status`` and ``logs`` work on a full disk."""
        try:
            with self._con() as con:
                return [dict(r) for r in con.execute(query, params)]
        except RunDBError as exc:
            first = exc
        from urllib.parse import quote

        for how in ("mode=ro", "immutable=1"):
            try:
                con = sqlite3.connect(f"file:{quote(str(self.path))}?{how}", uri=True, timeout=60)
            except sqlite3.Error:
                continue
            try:
                con.row_factory = sqlite3.Row
                return [dict(r) for r in con.execute(query, params)]
            except sqlite3.Error:
                continue
            finally:
                con.close()
        raise first

    def log_dir(self, run_id: str, stage: str, attempt: int) -> Path:
        return self.state_dir / "logs" / run_id / stage / f"attempt-{attempt}"

    # ---- writes -------------------------------------------------------------------------
    def new_run(
        self, workflow: str, file: str, site: str, session: str | None, stages: dict[str, int]
    ) -> tuple[str, str]:
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        session = session or f"{workflow}-{run_id}"
        with self._con() as con:
            con.execute(
                "INSERT INTO runs (id, workflow, file, site, session, state, started, pid, host, pid_started, "
                "boot_id) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (run_id, workflow, file, site, session, "running", time.time(), *_me()),
            )
            con.executemany(
                "INSERT INTO stages (run_id, stage, state, ranks) VALUES (?,?,?,?)",
                [(run_id, s, "pending", r) for s, r in stages.items()],
            )
        return run_id, session

    def add_stages(self, run_id: str, stages: dict[str, int]) -> None:
        """Rows for stages a resumed run's workflow has and the run did not (an edited file)."""
        with self._con() as con:
            con.executemany(
                "INSERT OR IGNORE INTO stages (run_id, stage, state, ranks) VALUES (?,?,?,?)",
                [(run_id, s, "pending", r) for s, r in stages.items()],
            )

    def remove_stage(self, run_id: str, stage: str) -> None:
        """A stage replaced by its instances (a fan-out expanded while the run goes on)."""
        with self._con() as con:
            con.execute("DELETE FROM stages WHERE run_id=? AND stage=?", (run_id, stage))

    def set_stage_sites(self, run_id: str, sites: dict[str, str]) -> None:
        """The site each stage runs on (stage → site name)."""
        with self._con() as con:
            con.executemany(
                "UPDATE stages SET site=? WHERE run_id=? AND stage=?", [(v, run_id, k) for k, v in sites.items()]
            )

    def set_stage_deps(self, run_id: str, deps: dict[str, set[str]]) -> None:
        """The stages each stage waits for (``validate.dependencies``): the run's DAG."""
        with self._con() as con:
            con.executemany(
                "UPDATE stages SET deps=? WHERE run_id=? AND stage=?",
                [(json.dumps(sorted(v)), run_id, k) for k, v in deps.items()],
            )

    def set_run(self, run_id: str, state: str) -> None:
        ended = time.time() if state in FINAL else None
        with self._con() as con:
            if state == "running":  # (re)started by this process: cancel and liveness find it here
                con.execute(
                    "UPDATE runs SET state=?, ended=NULL, pid=?, host=?, pid_started=?, boot_id=? WHERE id=?",
                    (state, *_me(), run_id),
                )
            else:
                con.execute("UPDATE runs SET state=?, ended=? WHERE id=?", (state, ended, run_id))

    def set_stage(self, run_id: str, stage: str, state: str, **fields: Any) -> None:
        cols = {"state": state, **fields}
        if "fingerprint" in cols:  # its hash in a column of its own, indexed (cache_candidates)
            cols["fp_hash"] = (cols["fingerprint"] or {}).get("hash")
        for key in _JSON & set(cols):
            cols[key] = json.dumps(cols[key])
        if "error" in cols:
            cols["error"] = redact_opt(cols["error"])
        sets = ", ".join(f"{k}=?" for k in cols)
        with self._con() as con:
            con.execute(f"UPDATE stages SET {sets} WHERE run_id=? AND stage=?", (*cols.values(), run_id, stage))

    def start_attempt(self, run_id: str, stage: str, attempt: int, gang_id: str, log_dir: str) -> None:
        with self._con() as con:
            con.execute(
                "INSERT OR REPLACE INTO attempts (run_id, stage, attempt, state, started, ended, gang_id, "
                "log_dir, error) VALUES (?,?,?,?,?,?,?,?,?)",
                (run_id, stage, attempt, "running", time.time(), None, gang_id, log_dir, None),
            )
            con.execute("UPDATE stages SET attempts=? WHERE run_id=? AND stage=?", (attempt, run_id, stage))

    def set_attempt_gang(self, run_id: str, stage: str, attempt: int, gang_id: str) -> None:
        with self._con() as con:
            con.execute(
                "UPDATE attempts SET gang_id=? WHERE run_id=? AND stage=? AND attempt=?",
                (gang_id, run_id, stage, attempt),
            )

    def end_attempt(
        self,
        run_id: str,
        stage: str,
        attempt: int,
        state: str,
        error: str | None = None,
        ranks: list[dict] | None = None,
        cause: str | None = None,
    ) -> None:
        """``ranks``: per rank {rank, pid, host, started, ended} (what the report draws);
        ``cause``: why it failed (``orchestrator.retry.classify``)."""
        with self._con() as con:
            con.execute(
                "UPDATE attempts SET state=?, ended=?, error=?, rank_info=COALESCE(?, rank_info), cause=? "
                "WHERE run_id=? AND stage=? AND attempt=?",
                (
                    state,
                    time.time(),
                    redact_opt(error),
                    json.dumps(ranks) if ranks is not None else None,
                    cause,
                    run_id,
                    stage,
                    attempt,
                ),
            )

    # ---- allocations: what a driver holds on a resource manager (jobs, steps, pilots, groups) --
    def add_allocation(self, run_id: str, stage: str | None, record: dict) -> None:
        """Record a resource-manager allocation the moment it exists (``record``: executor,
        id and whatever ``phalanx.executors.release`` needs to free it), so a driver killed
        without a word leaves the next ``status``/``cancel``/``--resume`` enough to free it."""
        with self._con() as con:
            con.execute(
                "INSERT OR REPLACE INTO allocations VALUES (?,?,?,?,?,?,NULL)",
                (run_id, stage, record["executor"], str(record["id"]), json.dumps(record), time.time()),
            )

    def mark_released(self, run_id: str, record: dict) -> None:
        """Record that an allocation is gone (its launcher freed it, or ``release_leftovers`` did)."""
        with self._con() as con:
            con.execute(
                "UPDATE allocations SET released=? WHERE run_id=? AND executor=? AND ident=?",
                (time.time(), run_id, record["executor"], str(record["id"])),
            )

    def allocations(self, run_id: str, live: bool = True) -> list[dict]:
        """Per allocation: its record plus stage, created, released; ``live``: unreleased only."""
        q = "SELECT * FROM allocations WHERE run_id=?" + (" AND released IS NULL" if live else "") + " ORDER BY created"
        return [_decoded(r) for r in self._rows(q, (run_id,))]

    def event(self, run_id: str, kind: str, message: str, stage: str | None = None) -> None:
        with self._con() as con:
            con.execute(
                "INSERT INTO events VALUES (?,?,?,?,?)", (run_id, time.time(), stage, kind, redact_opt(message))
            )

    # ---- reads --------------------------------------------------------------------------
    def add_samples(self, run_id: str, stage: str, attempt: int, rows: list[dict]) -> None:
        """Per-rank resource samples of a running stage (``runtime.sampler``), in one transaction;
        each row has the keys of ``_SAMPLE_COLUMNS`` (a missing one is NULL)."""
        if not rows:
            return
        values = [(run_id, stage, attempt, *(row.get(k) for k in _SAMPLE_COLUMNS)) for row in rows]
        marks = ",".join("?" * (3 + len(_SAMPLE_COLUMNS)))
        with self._con() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                con.executemany(
                    f"INSERT INTO samples (run_id, stage, attempt, {', '.join(_SAMPLE_COLUMNS)}) VALUES ({marks})",
                    values,
                )
                con.execute("COMMIT")
            except BaseException:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                raise

    def samples(self, run_id: str, stage: str | None = None, latest: bool = True) -> list[dict]:
        """A run's resource samples (of one stage); ``latest``: only the newest of each (stage,
        attempt, rank), ordered by stage, attempt and rank; else every one, ordered by time."""
        where, params = ("run_id=?", (run_id,)) if stage is None else ("run_id=? AND stage=?", (run_id, stage))
        if not latest:
            return self._rows(f"SELECT * FROM samples WHERE {where} ORDER BY ts, stage, attempt, rank", params)
        return self._rows(
            f"SELECT run_id, stage, attempt, {', '.join(_SAMPLE_COLUMNS)} FROM (SELECT *, ROW_NUMBER() "
            f"OVER (PARTITION BY stage, attempt, rank "
            f"ORDER BY ts DESC, rowid DESC) AS nth FROM samples WHERE {where}) WHERE nth=1 "
            "ORDER BY stage, attempt, rank",
            params,
        )

    def run(self, run_id: str) -> dict | None:
        rows = self._rows("SELECT * FROM runs WHERE id=?", (run_id,))
        return self._reconciled(rows[0]) if rows else None

    def runs(self, limit: int = 20, state: str | None = None) -> list[dict]:
        """The newest runs (in ``state`` only: as recorded, before a dead driver's run is found lost)."""
        where, params = ("WHERE state=? ", (state,)) if state else ("", ())
        rows = self._rows(f"SELECT * FROM runs {where}ORDER BY started DESC LIMIT ?", (*params, limit))
        return [self._reconciled(r) for r in rows]

    def run_counts(self) -> dict[str, int]:
        """How many runs are in each state (as recorded: reading a dead driver's run marks it lost)."""
        return {r["state"]: r["n"] for r in self._rows("SELECT state, COUNT(*) AS n FROM runs GROUP BY state")}

    def _reconciled(self, run: dict) -> dict:
        """A run whose driver died without a word (SIGKILL, a crashed node) is "lost", not
        "running" forever: what it still held on a resource manager (jobs, pilots, placement
        groups) is released, and it can be resumed."""
        driver = driver_alive(run)
        if run["state"] == "running" and driver is False:
            gone = f"driver process {run['pid']} is gone"
            if pid_alive(run["pid"]):  # its pid was given to another process since
                gone += f" (pid {run['pid']} now belongs to a process that is not the run's driver)"
            try:
                with self._con() as con:  # one process marks it lost (and reports it), not every reader
                    marked = con.execute(
                        "UPDATE runs SET state='lost', ended=? WHERE id=? AND state='running' AND pid=?",
                        (time.time(), run["id"], run["pid"]),
                    ).rowcount
                if marked:
                    self.event(run["id"], "lost", gone)
                    for s in self.stages(run["id"]):
                        if s["state"] == "running":
                            self.set_stage(run["id"], s["stage"], "lost", ended=time.time())
            except RunDBError:  # a full disk: shown lost here, recorded by a reader once there is room
                pass
            run = {**run, "state": "lost"}
        if run["state"] in ("lost", "cancelled", "failed"):
            try:
                self.release_leftovers(run["id"])
            except RunDBError:  # what was freed could not be recorded: freed again (a no-op) next time
                pass
        return run

    def release_leftovers(self, run_id: str) -> list[str]:
        """Free the allocations a driver that is gone left behind; one event per allocation.
        One this process could not free is tried again after ``RETRY_RELEASE_S`` (a reader
        that polls — the dashboard, a ``watch phalanx status`` — neither hammers an unreachable
        resource manager nor fills the run's events)."""
        lines = []
        for alloc in self.allocations(run_id):
            key = (str(self.path), run_id, alloc["executor"], alloc["ident"])
            if time.monotonic() - _FAILED_RELEASES.get(key, -RETRY_RELEASE_S) < RETRY_RELEASE_S:
                continue
            try:
                from ..executors import release

                line = release(alloc["record"])
            except Exception as exc:  # the resource manager unreachable: try again later
                _FAILED_RELEASES[key] = time.monotonic()
                self.event(
                    run_id, "release", f"could not release {alloc['executor']} {alloc['ident']}: {exc}", alloc["stage"]
                )
                continue
            _FAILED_RELEASES.pop(key, None)
            self.mark_released(run_id, alloc["record"])
            self.event(run_id, "release", f"left by the driver: {line}", alloc["stage"])
            lines.append(line)
        return lines

    # ---- one driver per run ----------------------------------------------------------------
    def acquire(self, run_id: str) -> dict:
        """Make this process the run's driver (``--resume``): refused while another live
        driver holds it; a dead driver's hold is taken over (its leftovers freed first)."""
        run = self.run(run_id)  # reconciles: a dead driver's run becomes "lost"
        if run is None:
            raise KeyError(run_id)
        pid, host, started, boot = _me()
        me = (pid, host)
        with self._con() as con:
            con.execute("BEGIN IMMEDIATE")  # no second driver between our read and our write
            row = dict(con.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone())
            holder = (row["pid"], row["host"])
            if row["state"] == "running" and holder != me:
                con.execute("ROLLBACK")
                raise RunLockedError(run_id, *holder)
            con.execute(
                "UPDATE runs SET state='running', ended=NULL, pid=?, host=?, pid_started=?, boot_id=? WHERE id=?",
                (pid, host, started, boot, run_id),
            )
            con.execute("COMMIT")
        return {**row, "state": "running", "pid": pid, "host": host, "pid_started": started, "boot_id": boot}

    def events(self, run_id: str) -> list[dict]:
        return self._rows("SELECT * FROM events WHERE run_id=? ORDER BY ts", (run_id,))

    def stages(self, run_id: str) -> list[dict]:
        return [_decoded(r) for r in self._rows("SELECT * FROM stages WHERE run_id=? ORDER BY rowid", (run_id,))]

    def cache_candidates(self, fp_hash: str, exclude_run: str, limit: int = 20) -> list[dict]:
        """Succeeded stages of other runs whose fingerprint has this hash, newest first: per
        stage its run id, stage name, outputs and fingerprint, and its run's workflow and
        session (what caching across runs reuses)."""
        q = (
            "SELECT s.run_id, s.stage, s.outputs, s.fingerprint, s.ended, r.workflow, r.session FROM stages s "
            "JOIN runs r ON r.id = s.run_id WHERE s.fp_hash=? AND s.state='succeeded' AND s.run_id != ? "
            "ORDER BY s.ended DESC LIMIT ?"
        )
        return [_decoded(r) for r in self._rows(q, (fp_hash, exclude_run, limit))]

    def last_fingerprint(self, workflow: str, stage: str, exclude_run: str) -> dict | None:
        """The newest other run of ``workflow`` whose stage ``stage`` recorded a fingerprint:
        {run_id, fingerprint}, or None (what a cacheable stage that runs compares itself with)."""
        q = (
            "SELECT s.run_id, s.fingerprint FROM stages s JOIN runs r ON r.id = s.run_id "
            "WHERE r.workflow=? AND s.stage=? AND s.run_id != ? AND s.fingerprint IS NOT NULL "
            "ORDER BY s.ended DESC LIMIT 1"
        )
        rows = [_decoded(r) for r in self._rows(q, (workflow, stage, exclude_run))]
        return rows[0] if rows else None

    def attempts(self, run_id: str, stage: str | None = None) -> list[dict]:
        q = "SELECT * FROM attempts WHERE run_id=?" + (" AND stage=?" if stage else "") + " ORDER BY started"
        return [_decoded(r) for r in self._rows(q, (run_id, stage) if stage else (run_id,))]


class RunDBError(PhalanxError, sqlite3.OperationalError):
    """The run database could not be read or written: a full file system, a broken file.  Its
    message names the file (and says when the file system holding it is full); still an
    ``sqlite3.OperationalError`` for code that catches that."""

    def __init__(self, path: Path, exc: BaseException):
        import shutil

        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = None
        full = free is not None and free < 1 << 20
        hint = (
            f": the file system holding it is full ({free:,} bytes free) — free space there, or set "
            f"{paths.ENV_STATE} to a state directory on another one"
            if full
            else ""
        )
        super().__init__(f"the run database {path}: {exc}{hint}")
        self.path, self.full = path, full


class RunLockedError(PhalanxError):
    """Another live driver holds the run."""

    def __init__(self, run_id: str, pid: int, host: str):
        here = host == socket.gethostname()
        hint = (
            f"wait for it, or stop it with: phalanx cancel {run_id}"
            if here
            else f"it runs on another host: stop it there (phalanx cancel {run_id})"
        )
        super().__init__(f"run {run_id} is being driven by process {pid} on host {host!r}; one driver per run — {hint}")
        self.run_id, self.pid, self.host = run_id, pid, host


def _decoded(row: dict) -> dict:
    for key in _JSON & set(row):
        row[key] = json.loads(row[key]) if row[key] else ([] if key in ("rank_info", "deps") else {})
    return row


def _me() -> tuple[int, str, int | None, str | None]:
    """This process as a run records its driver: pid, host, start time, boot id."""
    return os.getpid(), socket.gethostname(), start_time(os.getpid()), boot_id()


def driver_alive(run: dict) -> bool | None:
    """Whether the run's recorded driver process still runs (``procs.same_process``): True it
    does; False it is gone — its pid free, or owned by a process started since (a reused pid),
    or the host rebooted; None when that cannot be told: another host's driver, or a record
    of an older phalanx (pid without start time) whose pid runs."""
    if not run.get("pid") or run.get("host") != socket.gethostname():
        return None
    return same_process(run["pid"], run.get("pid_started"), run.get("boot_id"))


def wait_exit(pid: int, timeout_s: float, started: int | None = None, boot: str | None = None) -> bool:
    """Wait up to ``timeout_s`` for process ``pid`` to end; True if it did.  With ``started``
    and ``boot`` (``procs.start_time``, ``procs.boot_id``): for that process to end — another
    process given its pid since does not count."""

    def gone() -> bool:
        return not pid_alive(pid) if started is None else same_process(pid, started, boot) is False

    deadline = time.monotonic() + timeout_s
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    return gone()
