"""Caching across runs (``cache: true``) and ``phalanx store gc``.

A stage is cacheable where its ``cache:`` says so, else its workflow's, else its site's (default
false).  Before a cacheable stage runs, the run DB is asked for succeeded stages of earlier runs
— of any workflow — whose fingerprint (``fingerprint.py``: definition, params, app code, the
upstream stages' fingerprints, the versions of external inputs) has the same hash, newest first
(one indexed query).  The first of them that passes every check is a hit:

- its outputs are sealed in the store of this stage's site (same root and metadata: the earlier
  run's session there);
- the inputs it read that stages of the workflow make hold the same data as this run's (their
  partitions' checksums): a fingerprint says what *would* be made, the checksums what was —
  an upstream stage that ran again and made other data (it reads a database, it is not
  cacheable) is not covered up by a stale cached result downstream;
- every partition passes its checksum as this run now holds it (``Store.adopt`` checks each).

On a hit the outputs are adopted into this run's session under their names (hard links on a
directory store: no byte copied; a server-side copy on an object store), the stage is recorded
succeeded with its fingerprint, and an event ``cached`` names the run (and stage) that made
them.  Otherwise the stage runs, and an event ``not cached`` says why: what changed since the
newest earlier run of the stage (``fingerprint.changes``), "no earlier run", or why each
matching run's outputs were not reused (a partition failed its checksum, an output is gone...).

A cached stage keeps the store's rules: the earlier session is only read (never written, its
staging area never looked at), and each session has its own metadata and directory entries, so
``phalanx store gc`` or ``store rm`` of either leaves the other whole.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..store import Store
from .fingerprint import changes

if TYPE_CHECKING:
    from ..gang import Gang
    from .rundb import RunDB
    from .scheduler import Scheduler

MAX_CANDIDATES = 5  # earlier runs looked at per stage (newest first), each with its reason if not reused


def cacheable(wf: Any, name: str, site: Any) -> bool:
    """Stage over workflow over site: the first that says."""
    for setting in (getattr(wf.stages[name], "cache", None), getattr(wf, "cache", None)):
        if setting is not None:
            return bool(setting)
    return bool(getattr(site, "cache", False))


class RunCache:
    """The cache of one run: the scheduler asks ``static_hits`` before any site opens and
    ``reuse`` at the start of every stage it runs (fan-out instances included)."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self._missed: set[str] = set()  # looked at before the run started, not cached: not again

    def static_hits(self, done: set[str], deps: dict[str, set[str]]) -> set[str]:
        """Cacheable stages whose upstream is done (reused or cached itself) and that are cache
        hits, adopted now: a fully cached rerun starts no gang and opens no site.  Stages with a
        ``when:`` or a ``foreach:`` are left to the run (decided there, once ready)."""
        hits: set[str] = set()
        wf = self.sched.wf
        progress = True
        while progress:
            progress = False
            for name, st in wf.stages.items():
                if name in done or name in hits or name in self._missed or not deps[name] <= done | hits:
                    continue
                if getattr(st, "when", None) or getattr(st, "foreach", None) is not None:
                    continue
                if not cacheable(wf, name, self.sched.at(name).site):
                    continue
                if self._lookup(name):
                    hits.add(name)
                    progress = True
                else:
                    self._missed.add(name)
        return hits

    def reuse(self, name: str, slots: list[int] | None = None, gang: Gang | None = None) -> bool:
        """True when ``name`` was a cache hit (recorded succeeded: the caller returns); a gang
        kept for it goes back to its site's kept gangs for the next stage."""
        if name in self._missed:  # decided before the run started (a lost input's rerun asks again)
            self._missed.discard(name)
            return False
        if not cacheable(self.sched.wf, name, self.sched.at(name).site) or not self._lookup(name):
            return False
        if gang is not None and slots is not None:
            here = self.sched.at(name)
            with self.sched._lock:
                here.idle[tuple(slots)] = gang
        return True

    # ---- one stage ----------------------------------------------------------------------
    def _lookup(self, name: str) -> bool:
        sched = self.sched
        fp = sched.fingerprints.get(name)
        if not fp:
            return False
        reasons = []
        for cand in sched.db.cache_candidates(fp["hash"], sched.run_id, MAX_CANDIDATES):
            problem = self._try(name, cand)
            if problem is None:
                return True
            who = _who(cand, sched.wf.name)
            reasons.append(f"{who}: {problem}")
            sched._event(name, "not cached", f"outputs of {who} not reused: {problem}")
        sched._event(name, "not cached", "runs: " + self._why(name, fp, bool(reasons)))
        return False

    def _why(self, name: str, fp: dict, matched: bool) -> str:
        if matched:
            return "no earlier run with the same fingerprint has outputs that can be reused (above)"
        last = self.sched.db.last_fingerprint(self.sched.wf.name, name, self.sched.run_id)
        if last is None:
            return "no earlier run of this stage with a recorded fingerprint"
        said = changes(last["fingerprint"], fp)
        return f"changed since run {last['run_id']}: " + ("; ".join(said) or "its definition changed")

    def _try(self, name: str, cand: dict) -> str | None:
        """Adopt ``cand``'s outputs into this run's session; None when done, else why not."""
        sched = self.sched
        st, here = sched.wf.stages[name], sched.at(name)
        if cand["session"] == here.store.session:
            return (
                "it wrote to this run's own store session (a site's store.session), whose datasets later runs replace"
            )
        src = here.store.for_session(cand["session"])
        sealed = {out: src.meta.get(src.session, out) for out in st.outputs}
        missing = [out for out, info in sealed.items() if info is None]
        if missing:
            return (
                f"output {missing[0]!r} is no longer in the store {here.store.root} (removed, or made on another site)"
            )
        differs = self._inputs_differ(name, src)
        if differs:
            return differs
        first = sealed[st.outputs[0]] if st.outputs else None
        origin = first.origin if first is not None else {}
        by = f" (which had them from session {origin['session']!r})" if origin.get("adopted") else ""
        adopted = []
        try:
            for out in st.outputs:
                adopted.append(here.store.adopt(src, out, replace=True, run=sched.run_id))
        except (StoreError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        now = time.time()
        sched.db.set_stage(
            sched.run_id,
            name,
            "succeeded",
            started=now,
            ended=now,
            error=None,
            outputs={a.info.name: (a.info.num_rows, a.info.nbytes) for a in adopted},
            fingerprint=sched.fingerprints[name],
        )
        parts = sum(a.info.num_partitions for a in adopted)
        how = ", ".join(sorted({a.how for a in adopted})) or "no outputs"
        sched._event(
            name,
            "cached",
            f"outputs of {_who(cand, sched.wf.name)}{by} reused: fingerprint matches; "
            f"{parts} partition{'' if parts == 1 else 's'} verified, {how}",
        )
        return None

    def _inputs_differ(self, name: str, src: Store) -> str:
        """Why the data this stage would read is not what ``src``'s run read ("" when it is):
        each input a stage of this workflow makes, by its partitions' checksums."""
        sched = self.sched
        producers = {out: s for s, spec in sched.wf.stages.items() for out in spec.outputs}
        for local, spec in sched.wf.stages[name].inputs.items():
            producer = producers.get(spec.dataset)
            if producer is None or "/" in spec.dataset:
                continue  # another run's dataset: its version is in the fingerprint
            now = _checksums(sched.at(producer).store, spec.dataset)
            then = _checksums(src, spec.dataset)
            if then is None:  # read across sites in that run: the producer's site has its own copy
                then = _checksums(sched.at(producer).store.for_session(src.session), spec.dataset)
            if now != then:
                return f"input {local!r} ({spec.dataset}) is not the data it read then" + (
                    f" (stage {producer!r} ran again and made other data)" if now and then else ""
                )
        return ""


def _checksums(store: Store, dataset: str) -> list[str] | None:
    try:
        info = store.meta.get(store.session, dataset)
    except StoreError:
        return None
    return [p.checksum for p in info.partitions] if info is not None else None


def _who(cand: dict, workflow: str) -> str:
    stage = f"stage {cand['stage']!r}" + (f" of workflow {cand['workflow']!r}" if cand["workflow"] != workflow else "")
    return f"run {cand['run_id']} ({stage})"


# ---- phalanx store gc -------------------------------------------------------------------------
# A run's session is "<workflow>-<run id>" (RunDB.new_run); only such sessions are ever removed
RUN_SESSION = re.compile(r".+-(\d{8}-\d{6}-[0-9a-f]{6})")
MIN_AGE_S = 3600.0


@dataclass
class Collected:
    """One session ``gc`` removes (or would), and why."""

    session: str
    datasets: int
    bytes: int  # of its datasets and unsealed writes (shared with other sessions or not)
    why: str


@dataclass
class GcReport:
    removed: list[Collected] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (session, why it stays)
    staging: list[Collected] = field(default_factory=list)  # unsealed writes of finished runs' sessions
    freed: int = 0  # bytes the removal frees (files whose every link goes), or would
    dry_run: bool = False


def collect(
    store: Store,
    db: RunDB,
    *,
    dry_run: bool = False,
    keep_last: int | None = None,
    min_age: float = MIN_AGE_S,
) -> GcReport:
    """Remove from ``store`` the sessions no run in ``db`` still references (``phalanx store gc``).

    A session is referenced while a run of ``db`` has it as its session — all of them by
    default; with ``keep_last`` N only the N newest runs of each workflow (and every run still
    running) — or while such a run read it by ``SESSION/NAME``.  Removed are only sessions a run
    made (``<workflow>-<run id>``): those of runs ``keep_last`` drops, and those of runs that are
    not in ``db`` (deleted, or a wiped state directory) — where the store can tell they are this
    user's (a directory tier: the session's directory is theirs; on an object store only sessions
    of runs in ``db``).  A session used (written, read) in the last ``min_age`` seconds stays (a
    run another state directory drives).  Unsealed writes left in the sessions of finished runs
    go too.  A hard-linked partition (a cached stage's) frees its bytes with its last link."""
    report = GcReport(dry_run=dry_run)
    runs = db.runs(limit=-1)  # reconciled: a run whose driver is gone is "lost", not "running"
    owners: dict[str, list[dict]] = {}
    for run in runs:
        owners.setdefault(run["session"], []).append(run)
    kept_runs = _kept_runs(runs, keep_last)
    referenced = {r["session"]: f"run {r['id']} ({r['state']})" for r in kept_runs}
    for run in kept_runs:  # what they read of other runs (SESSION/NAME inputs)
        for st in db.stages(run["id"]):
            for spec in (st.get("inputs") or {}).values():
                session = str(spec.get("dataset", "")).rpartition("/")[0]
                if session:
                    referenced.setdefault(session, f"read by run {run['id']}")
    unsealed: dict[str, list] = {}
    for u in store.unsealed():
        unsealed.setdefault(u.session, []).append(u)
    now, doomed = time.time(), []
    root = store.tier.local_root
    dirs = (
        {d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")}
        if root and root.is_dir()
        else set()
    )
    for session in sorted(set(store.sessions()) | set(unsealed) | dirs):  # a directory left with nothing sealed too
        infos = store.meta.list(session)
        if session in referenced:
            left = unsealed.get(session, [])  # by runs that ended: a killed driver's, an interrupted crossing's
            if left and all(u.idle_s >= min_age for u in left):
                if not any(r["state"] == "running" for r in owners.get(session, [])):
                    report.staging.append(Collected(session, 0, sum(u.bytes for u in left), "unsealed writes"))
                    if not dry_run:
                        store.for_session(session).remove_unsealed()
            report.kept.append((session, referenced[session]))
            continue
        why = _removable(store, session, owners, now, min_age, infos, unsealed.get(session, []))
        if why.startswith("keep: "):
            report.kept.append((session, why[len("keep: ") :]))
            continue
        size = sum(d.nbytes for d in infos) + sum(u.bytes for u in unsealed.get(session, []))
        report.removed.append(Collected(session, len(infos), size, why))
        doomed.append(session)
    report.freed = _freed(store, doomed, report) + sum(c.bytes for c in report.staging)
    if not dry_run:
        for session in doomed:
            store.for_session(session).delete_session()
    return report


def _kept_runs(runs: list[dict], keep_last: int | None) -> list[dict]:
    """The runs whose sessions stay: all, or the newest ``keep_last`` per workflow and every
    run still running."""
    if keep_last is None:
        return list(runs)
    kept: list[dict] = []
    seen: dict[str, int] = {}
    for run in sorted(runs, key=lambda r: r["started"] or 0, reverse=True):
        seen[run["workflow"]] = seen.get(run["workflow"], 0) + 1
        if run["state"] == "running" or seen[run["workflow"]] <= keep_last:
            kept.append(run)
    return kept


def _removable(
    store: Store, session: str, owners: dict[str, list[dict]], now: float, min_age: float, infos: list, unsealed: list
) -> str:
    """Why an unreferenced session goes, or "keep: " and why it stays."""
    if session in owners:
        why = f"run {owners[session][0]['id']} is older than the runs kept"
    else:
        found = RUN_SESSION.fullmatch(session)
        if not found:
            return "keep: not a run's session (<workflow>-<run id>)"
        if store.tier.local_root is None:
            return "keep: its run is not in this run database, and whose it is cannot be told on an object store"
        why = f"its run {found[1]} is not in the run database"
    if store.tier.local_root is not None:
        try:
            st = os.lstat(store.tier.local_root / session)
        except FileNotFoundError:
            st = None
        if st is not None and (st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode)):
            return "keep: its directory is another user's"
        touched = [st.st_mtime] if st is not None else []
    else:
        touched = []
    used = max(
        [d.accessed for d in infos] + [d.created for d in infos] + [now - u.idle_s for u in unsealed] + touched or [0]
    )
    if now - used < min_age:
        return f"keep: used {now - used:.0f}s ago (less than --min-age {min_age:.0f}s)"
    return why


def _freed(store: Store, sessions: list[str], report: GcReport) -> int:
    """Bytes removing ``sessions`` frees: on a directory tier, files whose every hard link is
    under them (a cached stage's link elsewhere keeps the bytes); elsewhere their sizes."""
    root = store.tier.local_root
    if root is None:
        return sum(c.bytes for c in report.removed)
    links: dict[tuple[int, int], list[int]] = {}  # inode → [size, links, links seen under the sessions]
    for session in sessions:
        for path in _files([root / session] + ([store.spill_tier.root / session] if store.spill_tier else [])):
            st = os.lstat(path)
            entry = links.setdefault((st.st_dev, st.st_ino), [st.st_size, st.st_nlink, 0])
            entry[2] += 1
    return sum(size for size, nlink, seen in links.values() if seen >= nlink)


def _files(tops: list[Path]) -> Iterator[Path]:
    for top in tops:
        for dirpath, _, files in os.walk(top):  # follows no link to a directory
            for f in files:
                path = Path(dirpath) / f
                if stat.S_ISREG(os.lstat(path).st_mode):
                    yield path
