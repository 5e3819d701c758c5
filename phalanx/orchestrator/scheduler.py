"""Running a workflow: ready stages start as soon as the site can place their whole gang.

Placement is all-or-nothing over the site's rank slots (no partial holds); independent stages
run side by side on disjoint slots (disjoint CPUs when the slots fit the machine's cores); a
failed stage is retried on a fresh gang with backoff; a stage whose outputs are sealed by an
earlier attempt of the same run is not run again (--resume).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

from ..errors import GangError, RankError
from ..executors.local import LocalLauncher, usable_cpus
from ..gang import Gang
from ..store import Store
from .fingerprint import changes, fingerprints
from .models import Site, Stage, Workflow
from .rundb import RunDB
from .validate import dependencies

STAGE_APP = "phalanx.orchestrator.stage:run_stage"
BACKOFF_S = (1.0, 4.0, 15.0)  # between attempts of a failed stage


@dataclass
class RunResult:
    run_id: str
    session: str
    ok: bool
    failed: dict[str, str] = field(default_factory=dict)  # stage → error summary
    skipped: list[str] = field(default_factory=list)      # never ran: an upstream stage failed


class Scheduler:
    def __init__(self, wf: Workflow, site: Site, db: RunDB, run_id: str, session: str,
                 on_event: Callable[[str, str, str], None] | None = None):
        self.wf, self.site, self.db, self.run_id = wf, site, db, run_id
        self.store = Store(site.store.root, session, metadata=site.store.metadata)
        self.on_event = on_event or (lambda stage, kind, msg: None)
        self.capacity = site.capacity()
        self._free = list(range(self.capacity))
        self._gangs: dict[str, Gang] = {}
        self._commands: dict[str, object] = {}  # stage → launcher of a running command stage
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._pool = None  # warm rank processes (local executor), made by run()
        self._pending: list[str] = []  # stages not started yet
        # Gangs of succeeded stages, kept for the next stage of the same size (slots → gang):
        # CylonFlow's stateful actors — no process start, no rendezvous, communicator reused.
        self._idle: dict[tuple[int, ...], Gang] = {}

    def _event(self, stage: str | None, kind: str, message: str) -> None:
        self.db.event(self.run_id, kind, message, stage)
        self.on_event(stage or "", kind, message)

    def run(self) -> RunResult:
        self.on_event("", "run", self.run_id)
        deps = dependencies(self.wf)
        prior = {s["stage"]: s for s in self.db.stages(self.run_id)}
        # A resumed run's earlier gangs are all gone (the run was ours to resume): what they
        # staged and never sealed — a driver killed mid-put leaves it — is removed now.
        for a in self.db.attempts(self.run_id):
            if a["gang_id"]:
                self.store.abort_staging(a["gang_id"])
        self.fingerprints = fingerprints(self.wf, deps, self.store)
        done = {s for s in self.wf.stages if prior.get(s, {}).get("state") == "succeeded"
                and self._reusable(s, prior[s])}
        pending = [s for s in self.wf.stages if s not in done]
        self.db.set_run(self.run_id, "running")
        warm = self.capacity if self.site.warm_ranks is None else self.site.warm_ranks
        if self.site.executor == "local" and warm and any(self.wf.stages[s].kind != "command" for s in pending):
            from ..executors.pool import WarmPool

            self._pending = pending
            self._pool = WarmPool(warm, demand=self._warm_demand)
        try:
            return self._run(pending, done, deps)
        finally:
            self._close_idle(list(self._idle))
            if self._pool is not None:
                self._pool.close()
            if self.site.executor == "slurm":  # the run's pilot allocation, if it held one
                from ..executors.slurm import SlurmPilot

                SlurmPilot.close_shared()

    def _reusable(self, stage: str, prior: dict) -> bool:
        """A stage that succeeded in an earlier attempt of this run is not run again only when
        what would produce its outputs is unchanged (fingerprint) and every output is still
        sealed and passes its checksums; otherwise it runs again, and says why."""
        changed = changes(prior.get("fingerprint") or {}, self.fingerprints[stage])
        problem = ("changed since it ran: " + "; ".join(changed)) if changed else \
            unverified(self.store, self.wf.stages[stage].outputs)
        if problem:
            self._event(stage, "rerun", f"{problem}: runs again")
            return False
        self._event(stage, "reused", "outputs sealed by an earlier attempt, fingerprint and checksums "
                                     "match: not run again")
        return True

    def _warm_demand(self) -> int:
        """Rank processes the warm pool should have ready: the ranks of stages not started yet
        that no live gang of their size can serve (those reuse it)."""
        with self._lock:
            live = {len(k) for k in self._idle} | {g.world_size for g in self._gangs.values()}
        stages = [self.wf.stages[s] for s in list(self._pending)]
        return sum(st.ranks for st in stages if st.kind != "command" and st.ranks not in live)

    def _place(self, stage: str, ranks: int, reuse: bool) -> tuple[list[int], Gang | None]:
        """Slots for a gang of ``ranks``: an idle gang's when one fits in the free slots."""
        gang, dead = None, []
        with self._lock:
            if reuse:
                for key in list(self._idle):
                    if len(key) == ranks and set(key) <= set(self._free):
                        candidate = self._idle.pop(key)
                        problem = candidate.health()  # a rank may have died while it sat idle
                        if problem is None:
                            gang, slots = candidate, list(key)
                            break
                        dead.append((candidate, problem))
            if gang is None:  # slots no kept gang holds first: keep those gangs for later stages
                held = {s for k in self._idle for s in k}
                slots = sorted(self._free, key=lambda s: s in held)[:ranks]
            self._free = [s for s in self._free if s not in slots]
            stale = [k for k in self._idle if set(k) & set(slots)]  # their CPUs go to a new gang
        for g, problem in dead:
            self._event(stage, "gang", f"kept gang {g.gang_id} not reused: {problem}; a fresh gang starts")
            threading.Thread(target=g.close, name="phalanx-close-gang", daemon=True).start()
        self._close_idle(stale)
        return slots, gang

    def _close_idle(self, keys: list[tuple[int, ...]]) -> None:
        with self._lock:
            gangs = [self._idle.pop(k) for k in keys if k in self._idle]
        for g in gangs:
            threading.Thread(target=g.close, name="phalanx-close-gang", daemon=True).start()

    def _run(self, pending: list[str], done: set[str], deps: dict[str, set[str]]) -> RunResult:
        failed: dict[str, str] = {}
        running: dict[Future, tuple[str, list[int]]] = {}
        with ThreadPoolExecutor(max_workers=max(1, len(pending))) as pool:
            try:
                while pending or running:
                    for name in list(pending):
                        if deps[name] & set(failed):
                            pending.remove(name)
                            failed.setdefault(name, "")  # skipped: marked below
                            continue
                        ranks = self.wf.stages[name].ranks
                        if deps[name] <= done and ranks <= len(self._free):
                            reuse = self.site.reuse_gangs and self.wf.stages[name].kind != "command"
                            slots, gang = self._place(name, ranks, reuse)
                            pending.remove(name)
                            running[pool.submit(self._run_stage, name, slots, gang)] = (name, slots)
                    if not running:
                        break
                    # A timeout, so the main thread runs Python often enough to see Ctrl-C
                    # (the signal may be taken by another thread while this one sleeps).
                    finished, _ = wait(list(running), timeout=0.2, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        name, slots = running.pop(fut)
                        self._free = sorted(self._free + slots)
                        error = fut.result()
                        if error is None:
                            done.add(name)
                        else:
                            failed[name] = error
            except BaseException:  # Ctrl-C: stop every gang, leave the store consistent
                self.cancel()
                self.db.set_run(self.run_id, "cancelled")
                raise
        skipped = [s for s, e in failed.items() if e == ""]
        for s in skipped:
            self.db.set_stage(self.run_id, s, "skipped", error="an upstream stage failed")
            self._event(s, "skipped", "an upstream stage failed")
        real = {s: e for s, e in failed.items() if e}
        ok = not real and not skipped
        self.db.set_run(self.run_id, "succeeded" if ok else "failed")
        return RunResult(self.run_id, self.store.session, ok, real, skipped)

    def cancel(self) -> None:
        self._cancelled.set()
        with self._lock:
            gangs = list(self._gangs.values())
            commands = list(self._commands.values())
        self._close_idle(list(self._idle))
        for g in gangs:
            g._teardown(graceful=False)
        for launcher in commands:
            launcher.kill(grace_s=0.5)

    def _launcher(self, slots: list[int], stage: str | None = None):
        if self.site.executor in ("slurm", "ray"):
            launcher = site_launcher(self.site, len(slots), self.wf.stages[stage] if stage else None)
        elif self.site.executor != "local":
            return self.site.executor
        else:
            cpus = usable_cpus()
            fits = self.capacity <= len(cpus)  # more slots than cores: oversubscribed, no pinning
            launcher = LocalLauncher(echo=False, pin=fits, cpus=[cpus[s] for s in slots] if fits else None,
                                     pool=self._pool, mem_limit_bytes=rank_memory(self.site))
        # Every job, step, pilot or placement group is in the run DB the moment it exists: a
        # driver killed without a word leaves enough for the next status/cancel/resume to free it.
        launcher.allocation_hook = RunAllocations(self.db, self.run_id, stage)
        return launcher

    def _run_stage(self, name: str, slots: list[int], reused: Gang | None = None) -> str | None:
        """All attempts of one stage; returns None on success, else the last error summary."""
        st = self.wf.stages[name]
        self.db.set_stage(self.run_id, name, "running", started=time.time(), ended=None, error=None)
        error = ""
        # A resumed run numbers on: earlier attempts keep their records and logs.
        first = 1 + max((a["attempt"] for a in self.db.attempts(self.run_id, name)), default=0)
        for attempt in range(first, first + st.retries + 1):
            if self._cancelled.is_set():
                self.db.set_stage(self.run_id, name, "cancelled", ended=time.time(), error="cancelled")
                return "cancelled"
            log_dir = self.db.log_dir(self.run_id, name, attempt)
            try:
                if st.kind == "command":
                    error = self._run_command(name, attempt, slots, log_dir)
                    if error is None:
                        self._succeeded(name, attempt, f"{st.ranks} rank{'s' if st.ranks > 1 else ''} exited 0")
                        return None
                    detail, ranks = error, None
                else:
                    failure = self._gang_attempt(name, attempt, slots, log_dir, reused)
                    reused = None  # a kept gang serves only the first attempt
                    if failure is None:
                        return None
                    error, detail, ranks = failure
            except Exception as exc:  # a bad executor section, an unknown rendezvous...: this stage's
                import traceback       # failure, never the run's (siblings keep running)

                error, ranks = f"{type(exc).__name__}: {exc}", None
                detail = f"{error}\n{traceback.format_exc()}"
            if self._cancelled.is_set():
                self.db.end_attempt(self.run_id, name, attempt, "cancelled", detail, ranks=ranks)
                self.db.set_stage(self.run_id, name, "cancelled", ended=time.time(), error="cancelled")
                return "cancelled"
            self.db.end_attempt(self.run_id, name, attempt, "failed", detail, ranks=ranks)
            self._event(name, "failed", f"attempt {attempt}: {error}")
            if attempt < first + st.retries and not self._cancelled.is_set():
                time.sleep(BACKOFF_S[min(attempt - first, len(BACKOFF_S) - 1)])
        self.db.set_stage(self.run_id, name, "failed", ended=time.time(), error=error)
        return error or "failed"

    def _succeeded(self, name: str, attempt: int, message: str, results: list[dict] | None = None) -> None:
        outputs = results[0]["outputs"] if results else {}
        self.db.end_attempt(self.run_id, name, attempt, "succeeded",
                            ranks=rank_records(results) if results else None)
        self.db.set_stage(self.run_id, name, "succeeded", ended=time.time(), outputs=outputs, error=None,
                          fingerprint=self.fingerprints[name],
                          **({"inputs": input_totals(results)} if results else {}))
        self._event(name, "succeeded", message)

    def _gang_attempt(self, name: str, attempt: int, slots: list[int], log_dir,
                      reused: Gang | None) -> tuple[str, str, list[dict]] | None:
        """One attempt of a bsp/torch stage on a gang (the previous stage's, when it was kept for
        this one); None on success, else (summary, full error, per-rank records)."""
        st = self.wf.stages[name]
        inputs = {k: v.model_dump(exclude_none=True) for k, v in st.inputs.items()}
        self.db.start_attempt(self.run_id, name, attempt, "", str(log_dir))  # gang start included
        gang = reused if reused is not None and reused.redirect_logs(log_dir) else None
        how = f"the gang of the previous stage ({gang.gang_id})" if gang else "a new gang"
        if gang is None:
            gang = Gang(st.ranks, executor=self._launcher(slots, name), communicator=self.site.communicator,
                        rendezvous=self.site.rendezvous, log_dir=log_dir, echo=False, store=self.store,
                        start_timeout=self.site.start_timeout, control_host=self.site.driver_host)
        self._event(name, "start", f"attempt {attempt}: {st.ranks} ranks on slots {slots}, {how}")
        keep = False
        try:
            with self._lock:
                self._gangs[name] = gang
            gang.start()
            self.db.set_attempt_gang(self.run_id, name, attempt, gang.gang_id)
            where = getattr(gang._launcher, "status", None)  # the resource manager's view
            if callable(where):
                self._event(name, "placed", where())
            results = gang.run(STAGE_APP, name, self.wf.app_of(name), inputs, st.outputs,
                               params=st.params, timeout=st.timeout)
        except (RankError, GangError) as exc:
            return str(exc).splitlines()[0], str(exc), failed_ranks(gang, exc)
        else:  # a gang that just succeeded may serve the next stage of its size
            keep = (self.site.reuse_gangs and self.site.executor in ("local", "ray") and gang.running
                    and not self._cancelled.is_set())
        finally:
            with self._lock:
                self._gangs.pop(name, None)
                if keep:
                    self._idle[tuple(slots)] = gang
            if not keep:
                gang.close()
        rows = ", ".join(f"{k}: {r:,} rows" for k, (r, _) in results[0]["outputs"].items())
        self._succeeded(name, attempt, rows, results)
        return None

    def _run_command(self, name: str, attempt: int, slots: list[int], log_dir) -> str | None:
        """An external program on every rank (an existing MPI or native code as a stage): it
        gets PHALANX_RANK, PHALANX_WORLD_SIZE, a rendezvous URL and the store's settings; the
        stage fails fast when any rank exits non-zero."""
        from ..executors.base import Launcher
        from ..runtime import protocol as P
        from ..runtime.rendezvous import backend_for, new_gang_id

        st = self.wf.stages[name]
        self.db.start_attempt(self.run_id, name, attempt, "", str(log_dir))
        launcher = self._launcher(slots, name)
        if not isinstance(launcher, Launcher):
            return f"command stages need the local executor, not {launcher!r}"
        gang_id = new_gang_id()
        url = backend_for(self.site.rendezvous).prepare(self.site.rendezvous, gang_id, log_dir)
        base = {P.ENV_WORLD_SIZE: str(st.ranks), P.ENV_RDZV: url, P.ENV_GANG_ID: gang_id,
                P.ENV_PDEATHSIG: "1", **self.store.rank_env(),
                **{f"PHALANX_PARAM_{k.upper()}": str(v) for k, v in st.params.items()}}
        placement = launcher.placement(st.ranks)
        rank_env = [{**base, P.ENV_RANK: str(r), **placement[r]} for r in range(st.ranks)]
        self.db.set_attempt_gang(self.run_id, name, attempt, gang_id)
        self._event(name, "start", f"attempt {attempt}: {st.ranks} ranks of {st.command[0]!r} on slots {slots}")
        with self._lock:
            self._commands[name] = launcher
        deadline = time.monotonic() + st.timeout if st.timeout else None
        try:
            launcher.launch(command_argv(st.command), rank_env, log_dir)
            while True:
                codes = launcher.exitcodes()
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    return "; ".join(f"rank {r} exited with code {c}" for r, c in bad)
                if all(c == 0 for c in codes):
                    return None
                if self._cancelled.is_set():
                    return "cancelled"
                if deadline is not None and time.monotonic() > deadline:
                    late = [r for r, c in enumerate(codes) if c is None]
                    return (f"rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not finish "
                            f"within the stage timeout of {st.timeout:g}s")
                time.sleep(0.05)
        except OSError as exc:  # the program does not exist or is not executable
            return f"cannot start {st.command[0]!r}: {exc.strerror or exc}"
        except GangError as exc:  # the resource manager will never run it (bad partition...)
            return str(exc).splitlines()[0]
        finally:
            launcher.kill(grace_s=1.0)
            with self._lock:
                self._commands.pop(name, None)


class RunAllocations:
    """A launcher's allocation hook: resource-manager allocations recorded in the run DB."""

    def __init__(self, db: RunDB, run_id: str, stage: str | None):
        self.db, self.run_id, self.stage = db, run_id, stage

    def held(self, record: dict) -> None:
        self.db.add_allocation(self.run_id, self.stage, record)

    def released(self, record: dict) -> None:
        self.db.release_allocation(self.run_id, record)


def site_launcher(site: Site, ranks: int, stage: Stage | None = None):
    """The launcher of one gang on a batch or cloud site: the site's section of the site file,
    with the stage's own section of the same name over it."""
    if site.executor == "slurm":
        from ..executors.slurm import SlurmLauncher

        section = {**(site.slurm or {}), **((stage.slurm if stage else None) or {})}
        share = rank_memory(site)
        if share and not {"mem", "mem-per-cpu", "mem_per_cpu"} & set(section):  # SLURM enforces it
            cpus = int(section.get("cpus-per-task", section.get("cpus_per_task", 1)))
            section["mem-per-cpu"] = f"{max(1, share // cpus >> 20)}M"
        return SlurmLauncher.from_site(section, ranks, site=site.name)
    from ..executors.ray import RayLauncher

    section = {**(site.ray or {}), **((stage.ray if stage else None) or {})}
    return RayLauncher.from_site(section, ranks, site=site.name)


def unverified(store: Store, outputs: list[str]) -> str | None:
    """Why sealed outputs cannot be trusted (missing, a partition corrupted or truncated), or
    None when every partition of every output passes its checksum."""
    from ..errors import StoreError

    for name in outputs:
        if not store.exists(name):
            return f"output {name!r} is not in the store"
        info = store.info(name)
        try:
            for i in range(info.num_partitions):
                store.partition(info, i, verify=True)
        except StoreError as exc:
            return f"output {name!r} failed verification ({exc})"
    return None


def rank_memory(site: Site) -> int | None:
    """Bytes each rank may hold: the site's ``memory_gb`` shared over its slots, like its cores,
    so stages running side by side stay within it together."""
    return int(site.memory_gb * 2**30 / site.capacity()) if site.memory_gb else None


def command_argv(command: list[str]) -> list[str]:
    """``python``/``python3`` in a command stage is the Python that runs phalanx (its venv),
    not whatever PATH finds first — or nothing, on systems with only ``python3``."""
    import sys

    return [sys.executable, *command[1:]] if command[0] in ("python", "python3") else list(command)


def rank_records(results: list[dict]) -> list[dict]:
    """Per rank: pid, host and when its app ran (the report's timeline)."""
    return [{"rank": r, **{k: res[k] for k in ("pid", "host", "started", "ended")}}
            for r, res in enumerate(results)]


def failed_ranks(gang: Gang, exc: Exception) -> list[dict]:
    """Per rank of a failed attempt: pid, and how it ended — failed (its error and exit code,
    None while it still reported), or stopped by fail-fast."""
    failures = {f.rank: f for f in getattr(exc, "failures", [])}
    stopped = set(getattr(exc, "stopped", []))
    out = []
    for r in range(gang.world_size):
        rec: dict = {"rank": r, "pid": gang.pids[r] if r < len(gang.pids) else None}
        if r in failures:
            rec.update(outcome="failed", error=failures[r].summary(), exit=failures[r].exitcode)
        elif r in stopped:
            rec["outcome"] = "stopped"
        out.append(rec)
    return out


def input_totals(results: list[dict]) -> dict[str, dict]:
    """Per input: rows and bytes read over all ranks and the repartition path taken."""
    totals: dict[str, dict] = {}
    for res in results:
        for local, st in res["inputs"].items():
            t = totals.setdefault(local, {"dataset": st["dataset"], "rows": 0, "bytes": 0, "plan": st["plan"]})
            t["rows"] += st["rows"]
            t["bytes"] += st["bytes"]
    return totals


def run_workflow(wf: Workflow, site: Site, *, file: str = "<python>", db: RunDB | None = None,
                 resume: str | None = None, on_event=None) -> RunResult:
    """Run (or resume) a workflow; returns which stages failed."""
    return prepare_run(wf, site, file=file, db=db, resume=resume, on_event=on_event).run()


def prepare_run(wf: Workflow, site: Site, *, file: str = "<python>", db: RunDB | None = None,
                resume: str | None = None, on_event=None) -> Scheduler:
    """The run's record (new, or the resumed run's, locked to this driver) and its scheduler,
    not started yet: ``.run()`` runs it, ``.cancel()`` from another thread stops it, and
    ``.run_id`` is known at once (what a run handle needs)."""
    db = db or RunDB()
    if resume:
        try:
            run = db.acquire(resume)  # one driver per run: RunLockedError while another holds it
        except KeyError:
            raise GangError(f"no run {resume!r} in {db.path}") from None
        run_id, session = run["id"], run["session"]
        db.add_stages(run_id, {n: s.ranks for n, s in wf.stages.items()})  # stages added since
    else:
        run_id, session = db.new_run(wf.name, file, site.name, site.store.session,
                                     {n: s.ranks for n, s in wf.stages.items()})
    try:
        return Scheduler(wf, site, db, run_id, session, on_event)
    except BaseException as exc:  # the store refused (another user's root, Redis down): the run ends here
        db.event(run_id, "failed", f"{type(exc).__name__}: {exc}")
        db.set_run(run_id, "failed")
        raise
