"""What the Airflow operators do with phalanx runs, without importing Airflow.

Detached drivers (``_driver``: as ``phalanx run --detach``'s, for a workflow already loaded and
checked in the worker, so one interpreter starts instead of two; started, waited for and
cancelled by ``phalanx.orchestrator.detached`` as the CLI's are), cancelling a run from another
process, the ranks' log lines of a run as they are written, the small manifest that goes to
XCom, and where a task keeps its run id between tries.  Everything here reads the run database
the way ``phalanx status`` does.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ...orchestrator import detached
from ...orchestrator.logfollow import READ_BYTES, LogCursor, LogLine
from ...orchestrator.rundb import FINAL, RunDB

RUN_ID_KEY = "phalanx_run_id"  # the task-state key (Airflow >= 3.3) that keeps a task's run id
_RANK_LINE = re.compile(r"^\[rank \d+\] ")


class SubmitError(RuntimeError):
    """The run did not start: a problem in the workflow, or its driver ended first (the message says)."""


# ---- starting a run whose driver outlives the task (deferrable mode) ------------------------------
def child_env() -> dict[str, str]:
    """The environment of a driver started from a worker: what the worker can import (DAG
    folder, plugins, its sys.path) the driver and its ranks can import too."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    old = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])), "PYTHONUNBUFFERED": "1"}


def pickle_functions_by_value(functions: Iterable[Any]) -> None:
    """Functions of modules another process cannot import by name (a DAG file, which Airflow
    loads as ``unusual_prefix_...``) travel by value, as functions of ``__main__`` do."""
    import cloudpickle

    for fn in functions:
        module = getattr(fn, "__module__", None)
        if not module or module == "__main__" or module not in sys.modules:
            continue
        top = module.partition(".")[0]
        if top in sys.builtin_module_names or importlib.machinery.PathFinder.find_spec(top) is not None:
            continue
        cloudpickle.register_pickle_by_value(sys.modules[module])


def submit_model(wf: Any, site: Any, db: RunDB, *, file: str = "<python>", resume: str | None = None) -> str:
    """Start a driver process for a checked workflow model (a ``px.Workflow``'s, functions by
    value) the way ``phalanx run --detach`` starts one for a file; returns the run id once the
    run is in the run database.  Its output goes to ``STATE/drivers/RUN.log``."""
    from ...private import create_private, private_dir
    from ...runtime import pickling  # functions keep their file and source: their tracebacks show them

    pickle_functions_by_value(wf.apps.values())
    specs = private_dir(
        db.state_dir / "airflow" / "specs",
        "workflows handed to detached drivers",
        "set PHALANX_STATE to a directory of your own",
    )
    spec = specs / f"{uuid.uuid4().hex}.pkl"
    create_private(spec).write_bytes(
        pickling.dumps({"workflow": wf, "site": site, "file": file, "resume": resume, "state": str(db.state_dir)})
    )
    argv = [sys.executable, "-m", "phalanx.integrations.airflow._driver", str(spec)]  # + the run id's pipe
    try:
        return detached.start_driver(argv, db, resume=resume, env=child_env(), tail_lines=30).run_id
    except detached.DriverStartError as exc:
        spec.unlink(missing_ok=True)
        raise SubmitError(str(exc)) from None


# ---- which try of a task owns a run ------------------------------------------------------------------
class RunOwner:
    """Which try of an Airflow task owns phalanx run ``run_id`` now, so that a kill of an older
    try never cancels a run a newer try took over.

    Clearing a deferred task starts try N+1 before the triggerer runs try N's ``on_kill``; try
    N+1 finds the run still going and re-attaches to it.  Each try ``claim``s the run before it
    starts, resumes or attaches to it; a kill ``cancel``s only a run its own try (or an older
    one) owns.  Both happen under an exclusive lock, so either the kill comes first (the claim
    then waits for the cancel to finish and the new try resumes the run) or the claim does (the
    kill then leaves the run to the new try).  The record is a small file of the phalanx state
    directory, ``STATE/airflow/owners/RUN.json`` (``{"try", "task", "cancelling"}``), which the
    trigger finds from the run id alone, whatever keeps the task's run id.
    """

    def __init__(self, state_dir: str | Path, run_id: str):
        self.folder = Path(state_dir) / "airflow" / "owners"
        self.run_id = run_id
        self.path = self.folder / f"{run_id}.json"

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        import fcntl

        from ...private import create_private, private_dir

        private_dir(
            self.folder, "which Airflow try owns each phalanx run", "set PHALANX_STATE to a directory of your own"
        )
        lock = self.folder / f"{self.run_id}.lock"
        create_private(lock)
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                record: dict[str, Any] = {}
                try:
                    record = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    pass
                yield record
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _write(self, record: dict[str, Any]) -> None:
        from ...private import create_private

        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        create_private(tmp, truncate=True).write_text(json.dumps(record))
        os.replace(tmp, self.path)

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def claim(self, try_number: int | None, task: Any = None, force: bool = False) -> bool:
        """Make try ``try_number`` the run's owner; False (nothing changed) while an older
        try's kill is cancelling the run: wait for the run to end, then resume it (``force``:
        claim it anyway, e.g. once the run ended, or a killer died mid-way)."""
        with self._locked() as record:
            if not force and record.get("cancelling") and _older(record.get("try"), try_number):
                return False
            self._write({"try": try_number, "task": task, "cancelling": False})
            return True

    def cancel(self, try_number: int | None, state: str | Path | None, wait: float = 30.0) -> tuple[str, int | None]:
        """Cancel the run for a kill of try ``try_number`` unless a newer try owns it:
        (the run's state after, None) or (its state, the newer owner's try) untouched."""
        with self._locked() as record:
            owner = record.get("try")
            if try_number is not None and owner is not None and _older(try_number, owner):
                run = RunDB(state).run(self.run_id)
                return (run["state"] if run else "unknown"), int(owner)
            self._write({**record, "try": try_number if owner is None else owner, "cancelling": True})
        try:
            return cancel_run(self.run_id, state, wait), None
        finally:
            with self._locked() as record:
                if record.get("cancelling"):
                    self._write({**record, "cancelling": False})


def _older(a: Any, b: Any) -> bool:
    """Try ``a`` came before try ``b`` (an unknown try is nobody's elder)."""
    return a is not None and b is not None and int(a) < int(b)


def wait_ended(db: RunDB, run_id: str, timeout: float, interval: float = 0.2) -> str:
    """The run's state once it has ended (a dead driver's reads "lost"), or as it is after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        run = db.run(run_id)
        if run is None or run["state"] in FINAL or time.monotonic() > deadline:
            return run["state"] if run else "unknown"
        time.sleep(interval)


# ---- stopping a run from another process ---------------------------------------------------------
def cancel_run(run_id: str, state: str | Path | None, wait: float = 30.0) -> str:
    """Stop a run driven by another process of this host (``phalanx cancel``: its driver stops
    every gang and waits until no rank process is left); returns the run's state after."""
    db = RunDB(state)
    run = db.run(run_id)  # a driver that died unannounced makes the run "lost" here
    if run is None or run["state"] in FINAL:
        return run["state"] if run else "unknown"
    if run["pid"] == os.getpid():
        raise RuntimeError(f"run {run_id} is driven by this process: cancel its handle instead")
    if detached.stop_run_driver(run, wait) is None:  # an older record: its pid may be another's now
        raise RuntimeError(
            f"run {run_id}: cannot tell whether pid {run['pid']} is still its driver (recorded by an older "
            "phalanx); nothing was signalled: check it with ps and stop it by hand"
        )
    return (db.run(run_id) or {}).get("state", "unknown")


# ---- the ranks' output ---------------------------------------------------------------------------
def rank_line(line: LogLine) -> str:
    """A rank's line as the task log shows it: ``[rank N] stage: text`` (``stage#2`` from the
    second attempt on; ``[launcher]``: the launcher's own)."""
    stage = line.stage if line.attempt == 1 else f"{line.stage}#{line.attempt}"
    prefix = f"[rank {line.rank}] " if line.rank is not None else "[launcher] "
    return f"{prefix}{stage}: {_RANK_LINE.sub('', line.text, count=1)}"


class RankLogs:
    """The lines ranks of a run write to their log files (``phalanx logs RUN``), as they come,
    as ``rank_line`` shows them: ``poll()`` returns every complete line written since the last,
    ``read()`` at most ``max_bytes`` of them (``orchestrator.logfollow.LogCursor``).  Attempts
    that started before ``since`` (an earlier try's) are left out."""

    def __init__(self, db: RunDB, run_id: str, since: float = 0.0, max_bytes: int = READ_BYTES):
        self._cursor = LogCursor(db, run_id, since=since, launcher=True, max_bytes=max_bytes)

    def read(self, final: bool = False) -> tuple[list[str], bool]:
        """New lines (at most ``max_bytes`` of the files), and whether more were left to read."""
        lines = [rank_line(line) for line in self._cursor.read(final)]
        return lines, self._cursor.behind

    def poll(self, final: bool = False) -> list[str]:
        out: list[str] = []
        while True:
            lines, more = self.read(final)
            out += lines
            if not more:
                return out


# ---- what a run produced -------------------------------------------------------------------------
def location(store: Any, exchange: str | None = None) -> dict[str, str]:
    """Where a store is, for a manifest: its root and metadata URLs and the site's exchange, with
    credentials masked (an S3 URL names its keys by reference, ``credentials=env:NAME``, and
    even that reference is masked here: the consumer's site supplies its own)."""
    from ...redact import redact

    where = {"root": redact(str(store.tier.root_url)), "metadata": redact(str(getattr(store.meta, "url", "")))}
    if exchange:
        where["exchange"] = redact(exchange)
    return where


def manifest(db: RunDB, run_id: str, store: Any, sites: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's small manifest for XCom: run id, state, store session and each output dataset
    with rows, bytes and partitioning (no data), the site that sealed it and where that site's
    store is (``location``: URLs with credentials masked), so that a task on another
    site can bring it over.  ``store``: a ``px.Store`` of the run's site; ``sites``: site name →
    site, of a run whose stages name their own."""
    from ...store import Store

    run = db.run(run_id) or {}
    session = run.get("session", "")
    home = run.get("site") or ""
    stores: dict[str, Any] = {}

    def store_of(site: str) -> Any:
        if site == home or site not in (sites or {}):
            return store
        if site not in stores:
            model = (sites or {})[site].store
            stores[site] = Store(model.root, metadata=model.metadata)
        return stores[site]

    outputs: dict[str, Any] = {}
    for s in db.stages(run_id):
        site = s.get("site") or home
        there = store_of(site)
        sess = there.for_session(session) if session else there
        exchange = (sites or {})[site].store.exchange if site in (sites or {}) else None
        for name in s["outputs"]:
            entry: dict[str, Any] = {
                "dataset": f"{session}/{name}",
                "stage": s["stage"],
                "site": site,
                "store": location(there, exchange),
            }
            try:
                info = sess.info(name)
                entry.update(
                    rows=info.num_rows,
                    bytes=info.nbytes,
                    partitions=info.num_partitions,
                    partitioning=json.loads(json.dumps(info.partitioning, default=str)),
                )
            except Exception as exc:  # deleted since (phalanx store rm): say so, do not fail the task
                rows, nbytes = s["outputs"][name]
                entry.update(rows=rows, bytes=nbytes, missing=f"{type(exc).__name__}: {exc}")
            outputs[name] = entry
    return {
        "run_id": run_id,
        "workflow": run.get("workflow"),
        "state": run.get("state"),
        "session": session,
        "store_root": str(store.root),
        "outputs": outputs,
        "status": f"phalanx status {run_id}",
    }


def failure_report(db: RunDB, run_id: str) -> tuple[str, str]:
    """(one line, the full text) of why a run did not succeed: each failed stage with its last
    attempt's error (the failing rank's traceback included) and its log directory."""
    run = db.run(run_id) or {"state": "unknown"}
    stages = db.stages(run_id)
    failed = [s for s in stages if s["state"] in ("failed", "lost", "cancelled")]
    if not failed:
        line = f"phalanx run {run_id} {run['state']}"
        events = [e["message"] for e in db.events(run_id) if e["kind"] in ("failed", "lost")]
        return line, line + (f": {events[-1]}" if events else "")
    parts, first = [], None
    for s in failed:
        attempts = db.attempts(run_id, s["stage"])
        last = attempts[-1] if attempts else {}
        summary = (s["error"] or s["state"]).splitlines()[0]
        first = first or f"stage {s['stage']!r} {s['state']}: {summary}"
        parts.append(
            f"stage {s['stage']!r} {s['state']} after {s['attempts']} attempt(s): {s['error'] or ''}\n"
            f"{last.get('error') or ''}\n    logs: {last.get('log_dir', '-')}"
        )
    skipped = [s["stage"] for s in stages if s["state"] == "skipped"]
    if skipped:
        parts.append(f"did not run (an upstream stage failed): {', '.join(skipped)}")
    line = f"phalanx run {run_id} {run['state']}: {first}"
    return line, "\n".join([line, *parts])


# ---- the run id a task keeps across its tries --------------------------------------------------------
class TaskRunId:
    """Where an Airflow task keeps the id of its phalanx run from one try to the next.

    Airflow >= 3.3: the task instance's own state store (``context["task_state_store"]``, kept
    across tries, scoped to dag run, task and map index).  Older 3.x have no such store (XCom is
    cleared when a try starts): a small file in phalanx's state directory named by a digest of
    (dag id, run id, task id, map index) keeps it instead.
    """

    def __init__(self, context: Any, db: RunDB):
        self.store = context.get("task_state_store") if hasattr(context, "get") else None
        ti = context["ti"]
        key = json.dumps([ti.dag_id, ti.run_id, ti.task_id, getattr(ti, "map_index", -1)])
        self.key = key
        self.path = db.state_dir / "airflow" / "runs" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")

    def get(self) -> str | None:
        if self.store is not None:
            value = self.store.get(RUN_ID_KEY)
            return str(value) if value else None
        try:
            return json.loads(self.path.read_text())["run_id"]
        except (OSError, ValueError, KeyError):
            return None

    def set(self, run_id: str) -> None:
        if self.store is not None:
            self.store.set(RUN_ID_KEY, run_id)
            return
        from ...private import create_private, private_dir

        private_dir(
            self.path.parent, "the phalanx runs of Airflow tasks", "set PHALANX_STATE to a directory of your own"
        )
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        create_private(tmp).write_text(json.dumps({"run_id": run_id, "task": json.loads(self.key)}))
        os.replace(tmp, self.path)


def wait_polling(db: RunDB, run_id: str, interval: float, on_poll: Callable[[], None]) -> str:
    """Poll the run DB until the run is finished (a dead driver's run reads "lost"); its state."""
    status = detached.wait_run(db, run_id, interval=interval, on_poll=on_poll)
    return status.state if status else "unknown"
