"""Running a workflow: ready stages start as soon as their site can place their whole gang.

Placement is all-or-nothing over a site's rank slots (no partial holds); independent stages
run side by side on disjoint slots (disjoint CPUs when the slots fit the machine's cores); a
failed stage is retried on a fresh gang with backoff; a stage whose outputs are sealed by an
earlier attempt of the same run is not run again (--resume).

A run spans every site its stages name (``site:`` on a stage; the workflow's by default): each
site keeps its own store, executor, run-scoped allocations and slots (``SiteRun``), stages on
different sites run side by side, and an input sealed on another site's store crosses into the
consumer's store before the consumer starts (``store.crossing``; once per run, verified,
resumable).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from ..errors import GangError, RankError
from ..gang import Gang
from ..observe import tracing
from ..redact import redact
from ..runtime.envvars import ENV_PARAM_PREFIX
from ..store import Store
from ..store.repartition import rank_hosts
from .cache import RunCache
from .driver_service import DriverStoreService, needs_driver_service
from .fingerprint import changes, fingerprints
from .models import Site, Workflow
from .retry import RetryState, classify, label, policy_of
from .rundb import RunDB
from .samples import SampleRecorder
from .validate import dependencies, gpu_shortfall

STAGE_APP = "phalanx.orchestrator.stage:run_stage"
BACKOFF_S = (1.0, 4.0, 15.0)  # between attempts of a failed stage
# Slots of a site whose executor cannot say (SLURM per-stage jobs): gangs up to this many ranks
# in all are submitted at once and the resource manager queues them
UNBOUNDED_SLOTS = 4096
MAX_INSTANCES = 10_000  # threads a run may add for fan-out instances (started as stages start)


@dataclass
class RunResult:
    run_id: str
    session: str
    ok: bool
    failed: dict[str, str] = field(default_factory=dict)  # stage → error summary
    skipped: list[str] = field(default_factory=list)  # never ran: an upstream stage failed, or a cancel
    # the run's state in the run DB: succeeded, failed or cancelled (a cancelled run is not ok either)
    state: str = ""
    # stages not run because their when: was false (or an upstream's): no failure
    skipped_when: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.state:
            self.state = "succeeded" if self.ok else "failed"


class SiteRun:
    """One site of a run: its store (the run's session on the site's root), its executor and
    its rank slots, and the gangs kept there for the next stage of the same size."""

    def __init__(self, site: Site, session: str):
        self.site = site
        durable = site.store.durable if site.store.durability == "write-through" else None
        self.store = Store(site.store.root, session, metadata=site.store.metadata, durable=durable)
        self.executor = site.create_executor()
        self.caps = self.executor.capabilities
        self.capacity = self.executor.capacity() or UNBOUNDED_SLOTS
        self.free = list(range(self.capacity))
        # GPU slots, handed out like rank slots where the executor counts them (None: the
        # resource manager does, from the stage's gpus_per_rank in its request)
        self.gpu_capacity = self.executor.gpu_capacity()
        self.free_gpus = list(range(self.gpu_capacity or 0))
        # Gangs of succeeded stages, kept for the next stage of the same size (slots → gang):
        # CylonFlow's stateful actors — no process start, no rendezvous, communicator reused.
        self.idle: dict[tuple[int, ...], Gang] = {}
        self.opened = False
        self.down = ""  # why the site could not be opened for this run ("" when it was)
        self.driver_service: DriverStoreService | None = None  # what the driver wrote here, served

    def open_driver_service(self, run_id: str) -> str | None:
        """Serve what the driver writes into this site's store to the site's ranks on other
        hosts, where its store is each host's own memory (``driver_service``); the endpoint."""
        if self.driver_service is not None or not needs_driver_service(self.site, self.executor):
            return None
        service = DriverStoreService(self.store, self.site.driver_host, run_id)
        endpoint = service.open()
        self.driver_service = service
        return endpoint

    def close(self) -> None:
        """The run no longer holds this site: its allocations and the driver's service end."""
        self.opened = False
        try:
            self.executor.close_run()
        finally:
            if self.driver_service is not None:
                self.driver_service.close()
                self.driver_service = None

    @property
    def name(self) -> str:
        return self.site.name

    def gpus_of(self, stage) -> int:
        """GPU slots a gang of ``stage`` takes here (0 where the resource manager counts them)."""
        return stage.ranks * (stage.gpus_on(self.site) or 0) if self.gpu_capacity is not None else 0

    def fits(self, stage) -> bool:
        """Whether the free slots hold the stage's whole gang: rank slots and GPU slots."""
        return stage.ranks <= len(self.free) and self.gpus_of(stage) <= len(self.free_gpus)

    def same_store(self, other: SiteRun) -> bool:
        """Both sites read and write one store (same root and metadata): nothing crosses."""
        return (str(self.store.root), repr(self.store.meta)) == (str(other.store.root), repr(other.store.meta))


class Scheduler:
    def __init__(
        self,
        wf: Workflow,
        site: Site,
        db: RunDB,
        run_id: str,
        session: str,
        on_event: Callable[[str, str, str], None] | None = None,
        sites: dict[str, Site] | None = None,
    ):
        self.wf, self.site, self.db, self.run_id = wf, site, db, run_id
        self.on_event = on_event or (lambda stage, kind, msg: None)
        # stage → its site's name; each site opened once (its store, executor, slots)
        self.sites: dict[str, SiteRun] = {site.name: SiteRun(site, session)}
        self.where: dict[str, str] = {}
        for stage in wf.stages:
            model = (sites or {}).get(stage, site)
            if model.name not in self.sites:
                self.sites[model.name] = SiteRun(model, session)
            self.where[stage] = model.name
        self.home = self.sites[site.name]
        self.store, self.executor = self.home.store, self.home.executor  # the workflow's site
        self._gangs: dict[str, Gang] = {}  # stage → its running gang (BSP or command)
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._pending: list[str] = []  # stages not started yet
        self._nested: set[str] = set()  # stages run again inside another's retry (lost inputs)
        self._exchanges: set[str] = set()  # object stores this run's crossings went through
        self._crossing = threading.Lock()  # one crossing at a time per run: a dataset crosses once
        self._gpu_slots: dict[str, list[int]] = {}  # stage → the GPU slots its gang holds
        self._memory: dict[str, int] = {}  # stage → bytes per rank of its next attempt (retry.memory)
        self._skipped_when: dict[str, str] = {}  # stage → why it did not run (its when: or an upstream's)
        self._conditions: dict[str, bool] = {}  # stage → its when: held (evaluated once, when it was ready)
        self.cache = RunCache(self)  # caching across runs (cache.py)
        self.trace = tracing.for_run(run_id, wf.name, site.name)  # OpenTelemetry spans; hooks that do nothing when off

    def at(self, stage: str) -> SiteRun:
        """The site ``stage`` runs on."""
        return self.sites[self.where[stage]]

    def _event(self, stage: str | None, kind: str, message: str) -> None:
        self.db.event(self.run_id, kind, message, stage)
        self.on_event(stage or "", kind, message)

    def run(self) -> RunResult:
        self.trace.start_run()
        try:
            result = self._drive()
        except BaseException as exc:
            self.trace.end_run("cancelled" if isinstance(exc, KeyboardInterrupt) else "failed", error_summary(exc))
            raise
        self.trace.end_run(result.state, "; ".join(f"{s}: {e}" for s, e in result.failed.items()) or None)
        return result

    def _drive(self) -> RunResult:
        self.on_event("", "run", self.run_id)
        deps = dependencies(self.wf)
        prior = {s["stage"]: s for s in self.db.stages(self.run_id)}
        # A resumed run's earlier gangs are all gone (the run was ours to resume): what they
        # staged and never sealed — a driver killed mid-put leaves it — is removed now.
        for a in self.db.attempts(self.run_id):
            if a["gang_id"]:
                self.at(a["stage"]).store.abort_staging(a["gang_id"]) if a["stage"] in self.where else None
            if a["state"] == "running":  # its driver died with it (a lost run): it never ends now
                self.db.end_attempt(
                    self.run_id, a["stage"], a["attempt"], "lost", "its driver was gone before it ended (run resumed)"
                )
        self.fingerprints = fingerprints(self.wf, deps, self.store)
        done = {
            s for s in self.wf.stages if prior.get(s, {}).get("state") == "succeeded" and self._reusable(s, prior[s])
        }
        done |= self.cache.static_hits(done, deps)  # earlier runs' outputs, adopted before any site opens
        pending = [s for s in self.wf.stages if s not in done]
        self.db.set_run(self.run_id, "running")
        self.db.set_stage_sites(self.run_id, self.where)
        self.db.set_stage_deps(self.run_id, deps)
        self._pending = pending
        if len(self.sites) > 1:
            plan = ", ".join(f"{name} on {self.where[name]}" for name in self.wf.stages)
            self._event(None, "sites", f"{len(self.sites)} sites: {plan}")
        try:
            for here in self.sites.values():
                try:
                    self._open_site(here, pending)
                except Exception as exc:  # one site's resource manager unreachable...
                    if len(self.sites) == 1:
                        raise  # ...on one site, the run's own failure, as always
                    here.down = f"site {here.name!r} cannot be reached: {type(exc).__name__}: {exc}"
                    self._event(None, "site down", here.down)  # ...on several: only its stages fail
            return self._run(pending, done, deps)
        finally:
            for here in self.sites.values():
                for closing in self._close_idle(here, list(here.idle)):
                    closing.join(timeout=30)  # the run ends with its gangs gone (a Job deleted...)
                if here.opened:
                    here.close()

    def _open_site(self, here: SiteRun, pending: list[str]) -> None:
        """What lives as long as the run on this site (a pilot allocation, warm processes)."""
        mine = [s for s in pending if self.where[s] == here.name]
        if not mine and (here is not self.home or not pending):
            return  # every stage there was reused (or cached): nothing to hold
        if len(self.sites) > 1:
            here.executor.probe()  # a site that is down: only its stages fail, named, before any work
        warm = here.capacity if here.site.warm_ranks is None else here.site.warm_ranks
        if not any(self.wf.stages[s].kind != "command" for s in mine):
            warm = 0
        here.executor.open_run(
            hook=RunAllocations(self.db, self.run_id, None),
            demand=lambda: self._warm_demand(here),
            warm=warm if here.caps.warm_pool else 0,
        )
        here.opened = True
        endpoint = here.open_driver_service(self.run_id)
        if endpoint:
            self._event(
                None, "store service", f"site {here.name!r}: what the driver writes here is served at {endpoint}"
            )
        known = here.executor.capacity()  # some executors know only once connected (a Ray cluster's CPUs)
        if known and known != here.capacity:
            here.capacity, here.free = known, list(range(known))

    def _reusable(self, stage: str, prior: dict) -> bool:
        """A stage that succeeded in an earlier attempt of this run is not run again only when
        what would produce its outputs is unchanged (fingerprint) and every output is still
        sealed and passes its checksums; otherwise it runs again, and says why."""
        changed = changes(prior.get("fingerprint") or {}, self.fingerprints[stage])
        problem = (
            ("changed since it ran: " + "; ".join(changed))
            if changed
            else unverified(self.at(stage).store, self.wf.stages[stage].outputs)
        )
        if problem:
            self._event(stage, "rerun", f"{problem}: runs again")
            return False
        self._event(
            stage, "reused", "outputs sealed by an earlier attempt, fingerprint and checksums match: not run again"
        )
        return True

    def _warm_demand(self, here: SiteRun) -> int:
        """Rank processes the site's warm pool should have ready: the ranks of its stages not
        started yet that no live gang of their size can serve (those reuse it)."""
        with self._lock:
            live = {len(k) for k in here.idle} | {
                g.world_size for s, g in self._gangs.items() if self.where.get(s) == here.name
            }
        wf = self.wf  # a fan-out over rows may replace it meanwhile
        stages = [wf.stages[s] for s in list(self._pending) if s in wf.stages and self.where.get(s) == here.name]
        return sum(st.ranks for st in stages if st.kind != "command" and st.ranks not in live)

    def _place(self, stage: str, ranks: int, reuse: bool) -> tuple[list[int], Gang | None]:
        """Slots for a gang of ``ranks`` on the stage's site: an idle gang's when one fits in
        the free slots; its GPU slots too (``_gpu_slots``)."""
        here = self.at(stage)
        gang, dead = None, []
        with self._lock:
            gpus = here.gpus_of(self.wf.stages[stage])
            self._gpu_slots[stage], here.free_gpus = here.free_gpus[:gpus], here.free_gpus[gpus:]
            if reuse:
                for key in list(here.idle):
                    if len(key) == ranks and set(key) <= set(here.free):
                        candidate = here.idle.pop(key)
                        problem = candidate.health()  # a rank may have died while it sat idle
                        if problem is None:
                            gang, slots = candidate, list(key)
                            break
                        dead.append((candidate, problem))
            if gang is None:  # slots no kept gang holds first: keep those gangs for later stages
                held = {s for k in here.idle for s in k}
                slots = sorted(here.free, key=lambda s: s in held)[:ranks]
            here.free = [s for s in here.free if s not in slots]
            stale = [k for k in here.idle if set(k) & set(slots)]  # their CPUs go to a new gang
        for g, problem in dead:
            self._event(stage, "gang", f"kept gang {g.gang_id} not reused: {problem}; a fresh gang starts")
            threading.Thread(target=g.close, name="phalanx-close-gang", daemon=True).start()
        self._close_idle(here, stale)
        return slots, gang

    def _close_idle(self, here: SiteRun, keys: list[tuple[int, ...]]) -> list[threading.Thread]:
        """Close these idle gangs of a site, each in a thread of its own (the threads)."""
        with self._lock:
            gangs = [here.idle.pop(k) for k in keys if k in here.idle]
        threads = [threading.Thread(target=g.close, name="phalanx-close-gang", daemon=True) for g in gangs]
        for t in threads:
            t.start()
        return threads

    def _run(self, pending: list[str], done: set[str], deps: dict[str, set[str]]) -> RunResult:
        failed: dict[str, str] = {}
        why: dict[str, str] = {}  # skipped stage → why it never ran
        running: dict[Future, tuple[str, list[int]]] = {}
        for name in list(pending):  # a gang the site can never place fails now, not never
            ranks, here = self.wf.stages[name].ranks, self.at(name)
            gpus = here.gpus_of(self.wf.stages[name])
            if here.down or ranks > here.capacity or gpus > len(here.free_gpus):
                pending.remove(name)
                failed[name] = here.down or (
                    f"{ranks} ranks, but site {here.name!r} ({here.site.executor}) can give at "
                    f"most {here.capacity} at once"
                    if ranks > here.capacity
                    else gpu_shortfall(ranks, gpus // ranks, here.name, len(here.free_gpus))
                )
                self.db.set_stage(self.run_id, name, "failed", ended=time.time(), error=failed[name])
                self._event(name, "failed", failed[name])
        # Threads start as stages do (a fan-out over rows adds stages while the run goes on)
        with ThreadPoolExecutor(max_workers=len(pending) + MAX_INSTANCES) as pool:
            try:
                while pending or running:
                    before = list(pending)
                    for name in list(pending):
                        if deps[name] & set(failed):
                            pending.remove(name)
                            failed.setdefault(name, "")  # skipped: marked below
                            why[name] = (
                                "the run was cancelled" if self._cancelled.is_set() else "an upstream stage failed"
                            )
                            continue
                        blocked = self._blocked_by_skips(deps[name])
                        if blocked:  # an upstream stage did not run (its when: was false)
                            pending.remove(name)
                            self._skip(name, blocked)
                            continue
                        if not deps[name] <= done | set(self._skipped_when):
                            continue
                        problem = self._ready(name, pending, deps, done)
                        if problem is not None:  # a fan-out expanded, a condition false or failing
                            if problem:
                                failed[name] = problem
                                self.db.set_stage(self.run_id, name, "failed", ended=time.time(), error=problem)
                                self._event(name, "failed", problem)
                            continue
                        ranks, here = self.wf.stages[name].ranks, self.at(name)
                        if here.fits(self.wf.stages[name]):
                            reuse = (
                                here.site.reuse_gangs
                                and here.caps.reuse_gangs
                                and self.wf.stages[name].kind != "command"
                                and not here.gpus_of(self.wf.stages[name])  # a kept gang's ranks have no GPU
                            )
                            slots, gang = self._place(name, ranks, reuse)
                            pending.remove(name)
                            running[pool.submit(self._run_stage, name, slots, gang)] = (name, slots)
                    if not running:
                        if pending != before:
                            continue  # the pass expanded a fan-out or skipped a stage: look again
                        break
                    # A timeout, so the main thread runs Python often enough to see Ctrl-C
                    # (the signal may be taken by another thread while this one sleeps).
                    finished, _ = wait(list(running), timeout=0.2, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        name, slots = running.pop(fut)
                        here = self.at(name)
                        here.free = sorted(here.free + slots)
                        here.free_gpus = sorted(here.free_gpus + self._gpu_slots.pop(name, []))
                        error = fut.result()
                        if error is None:
                            done.add(name)
                        else:
                            failed[name] = error
                    if finished:
                        self._release_sites(pending, [n for n, _ in running.values()], deps)
            except BaseException:  # Ctrl-C: stop every gang, leave the store consistent
                self.cancel()
                self.db.set_run(self.run_id, "cancelled")
                raise
        for name in pending:  # nothing runs and none of these can start: never a silent success
            failed[name] = "it never became ready (its upstream stages did not all end)"
            self.db.set_stage(self.run_id, name, "failed", ended=time.time(), error=failed[name])
            self._event(name, "failed", failed[name])
        skipped = [s for s, e in failed.items() if e == ""]
        for s in skipped:  # what the run DB records is what `phalanx status`, the report, the CLI say
            self.db.set_stage(self.run_id, s, "skipped", error=why[s])
            self._event(s, "skipped", why[s])
        real = {s: e for s, e in failed.items() if e}
        ok = not real and not skipped  # stages whose when: was false (and theirs downstream) are no failure
        # a cancel (Scheduler.cancel, a run handle's) ends the run "cancelled", as a Ctrl-C does
        state = "succeeded" if ok else "cancelled" if self._cancelled.is_set() else "failed"
        if ok:
            self._clear_exchanges()
        self.db.set_run(self.run_id, state)
        return RunResult(self.run_id, self.store.session, ok, real, skipped, state, dict(self._skipped_when))

    def _release_sites(self, pending: list[str], running: list[str], deps: dict[str, set[str]]) -> None:
        """Close a site's run scope (its pilot, its kept gangs, its connection) once no stage
        is still to run there and no stage still to start reads what was sealed there (its
        input crosses as it starts): a SLURM pilot is not held while training runs on the
        cloud.  The workflow's own site stays open to the end (the driver's)."""
        if len(self.sites) == 1:
            return
        for here in self.sites.values():
            if here is self.home or not here.opened:
                continue
            if any(self.where.get(s) == here.name for s in (*pending, *running)):
                continue
            if any(self.where.get(u) == here.name for s in pending for u in deps.get(s, ())):
                continue
            for closing in self._close_idle(here, list(here.idle)):
                closing.join(timeout=30)
            try:
                here.close()
            except Exception as exc:  # the run goes on; the leftover is released by its record
                self._event(None, "site released", f"site {here.name!r}: closing its allocations failed: {exc}")
                continue
            self._event(None, "site released", f"site {here.name!r}: no stage there or reading from there remains")

    def _ready(self, name: str, pending: list[str], deps: dict[str, set[str]], done: set[str]) -> str | None:
        """A stage whose upstream is done, before it is placed: a fan-out over rows is expanded
        into its instances (they take its place in ``pending``); a ``when:`` is evaluated once.
        None: place it; "": it is handled (expanded, or skipped); else why it failed."""
        from .conditions import evaluate

        st = self.wf.stages[name]
        if st.foreach is not None:
            pending.remove(name)
            try:
                self._fan_out(name, pending, deps, done)
            except Exception as exc:  # too many rows, the dataset lost...
                return f"foreach: {type(exc).__name__}: {exc}"
            return ""
        if st.when and name not in self._conditions:
            try:
                self._conditions[name] = evaluate(st.when, st.params, lambda d: self._read_small(d, name))
            except Exception as exc:
                pending.remove(name)
                return f"when: {st.when!r} could not be evaluated: {type(exc).__name__}: {exc}"
            if not self._conditions[name]:
                pending.remove(name)
                self._skip(name, f"when: {st.when!r} is false")
                return ""
            self._event(name, "condition", f"when: {st.when!r} holds")
        return None

    def _fan_out(self, name: str, pending: list[str], deps: dict[str, set[str]], done: set[str]) -> None:
        """Expand a fan-out over the rows of a dataset sealed upstream into its instances: they
        join the run (run DB, pending, dependencies, fingerprints); an instance that an earlier
        attempt of this run already ran (a resume) is reused as any stage is."""
        from .fanout import expand, instance_name, row_items
        from .fingerprint import fingerprints
        from .validate import dependencies

        st = self.wf.stages[name]
        assert st.foreach is not None and st.foreach.rows
        items = row_items(self._read_small(st.foreach.rows, name, MAX_INSTANCES), st.foreach, name)
        self.wf = expand(self.wf, name, items)
        made = [instance_name(name, i) for i in range(len(items))]
        for inst in made:
            self.where[inst] = self.where[name]
        deps.clear()
        deps.update(dependencies(self.wf))
        self.fingerprints = fingerprints(self.wf, deps, self.store)
        self.db.add_stages(self.run_id, {n: self.wf.stages[n].ranks for n in made})
        self.db.set_stage_sites(self.run_id, {n: self.where[n] for n in made})
        self.db.set_stage_deps(self.run_id, deps)  # the instances, and the fan-in now waiting for them
        self.db.remove_stage(self.run_id, name)
        prior = {s["stage"]: s for s in self.db.stages(self.run_id)}
        for inst in made:
            if prior.get(inst, {}).get("state") == "succeeded" and self._reusable(inst, prior[inst]):
                done.add(inst)
            else:
                pending.append(inst)
        self._event(
            name, "fan-out", f"{len(made)} instance{'' if len(made) == 1 else 's'} over the rows of {st.foreach.rows!r}"
        )

    def _read_small(self, dataset: str, stage: str, limit: int | None = None):
        """A small dataset as an Arrow table, read by the driver (a ``when:``, a fan-out over
        rows): from the store it was sealed in; a fan-out's output: its instances' rows."""
        import pyarrow as pa

        from .conditions import MAX_ROWS

        limit = limit or MAX_ROWS
        parts = self.wf._fanned.get(dataset)
        if parts is not None:
            made = self._made_datasets()  # once, not per part: a fan-out may have thousands
            tables = [self._read_small(p, stage, limit) for p in parts if p in made]
            return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})
        producers = {out: s for s, spec in self.wf.stages.items() for out in spec.outputs}
        session, _, short = dataset.rpartition("/")
        store = self.at(producers.get(dataset, stage)).store
        store = store.for_session(session) if session else store
        rows = store.info(short).num_rows
        if rows > limit:
            raise ValueError(f"dataset {dataset!r} has {rows:,} rows; at most {limit:,} are read here")
        return store.read(short)

    def _made_datasets(self) -> set[str]:
        """Outputs of the stages that ran (not those skipped by a condition)."""
        return {out for s, spec in self.wf.stages.items() if s not in self._skipped_when for out in spec.outputs}

    def _blocked_by_skips(self, upstream: set[str]) -> str:
        """Why a stage cannot run because stages it needs were skipped ("" when it can): a
        skipped stage blocks what needs it, but instances of a fan-out block only when every
        instance was skipped (a fan-in reads the instances that ran)."""
        for dep in sorted(upstream & set(self._skipped_when)):
            template = self.wf.template_of(dep)
            if template == dep:
                return f"upstream stage {dep!r} was skipped"
            siblings = [d for d in upstream if self.wf.template_of(d) == template]
            if all(d in self._skipped_when for d in siblings):
                return f"every instance of {template!r} was skipped"
        return ""

    def _skip(self, name: str, why: str) -> None:
        self._skipped_when[name] = why
        self.db.set_stage(self.run_id, name, "skipped", ended=time.time(), error=why)
        self._event(name, "skipped", why)

    def _clear_exchanges(self) -> None:
        """A succeeded run leaves nothing in the object stores it crossed through: its copies
        there were in transit.  A failed run keeps them, so a resume does not send them again."""
        from .crossings import clear_exchange

        for exchange in sorted(self._exchanges):
            try:
                removed = clear_exchange(exchange, self.store.session)
            except Exception as exc:  # the run's data is where it belongs; say what stayed behind
                self._event(None, "exchange", f"could not remove this run's copies from {redact(exchange)}: {exc}")
            else:
                self._event(
                    None, "exchange", f"removed this run's {removed} dataset(s) in transit from {redact(exchange)}"
                )

    def cancel(self) -> None:
        self._cancelled.set()
        with self._lock:
            gangs = list(self._gangs.values())
        for here in self.sites.values():
            self._close_idle(here, list(here.idle))
        for g in gangs:
            g._teardown(graceful=False)

    def _rank_memory(self, stage: str) -> int | None:
        """Bytes per rank the stage's gangs get (the site's share, or its executor section's
        own: SLURM mem_per_cpu), what a retry after out of memory multiplies; None: unknown."""
        here = self.at(stage)
        try:
            return here.executor.rank_memory_for(
                here.executor.stage_config(self.wf.stages[stage].executor_section(here.site.executor))
            )
        except Exception:  # a bad section: the attempt itself will say so
            return here.executor.rank_memory

    def _gang(self, stage: str, slots: list[int], log_dir) -> Gang:
        """A gang for one attempt of ``stage`` on ``slots``: the site's executor with the stage's
        own section over the site's."""
        st, here = self.wf.stages[stage], self.at(stage)
        config = here.executor.stage_config(st.executor_section(here.site.executor))
        config = here.executor.with_gpus(config, st.gpus_on(here.site))  # SLURM --gpus-per-task...
        here.executor.check(st.ranks, config)
        executor = here.executor.sized(self._memory[stage]) if stage in self._memory else here.executor
        launcher = executor.launcher(len(slots), slots=slots, config=config)
        gpus, per = self._gpu_slots.get(stage, []), st.gpus_on(here.site) or 0
        launcher.assign_gpus([gpus[r * per : (r + 1) * per] for r in range(len(slots))])  # local: CUDA_VISIBLE_DEVICES
        # Every job, step, pilot or placement group is in the run DB the moment it exists: a
        # driver killed without a word leaves enough for the next status/cancel/resume to free it.
        launcher.allocation_hook = RunAllocations(self.db, self.run_id, stage)
        self._place_by_locality(stage, launcher)
        return Gang(
            st.ranks,
            executor=launcher,
            communicator=here.site.communicator,
            rendezvous=here.site.rendezvous,
            log_dir=log_dir,
            echo=False,
            store=here.store,
            start_timeout=here.site.start_timeout,
            control_host=here.site.driver_host,
        )

    def _place_by_locality(self, stage: str, launcher) -> None:
        """Ask the launcher to put each rank on the host that holds most of its input (a store
        spread over hosts); said in an event when it did."""
        st, home = self.wf.stages[stage], self.at(stage).store
        infos = []
        for spec in st.inputs.values():
            session, _, short = spec.dataset.rpartition("/")
            store = home.for_session(session) if session else home
            if store.exists(short):
                infos.append(store.info(short))
        hosts = rank_hosts(infos, st.ranks) if infos else None
        if hosts and launcher.prefer_hosts(hosts):
            self._event(stage, "placed", f"ranks on the hosts holding their input: {', '.join(hosts)}")

    def _cross_inputs(self, stage: str) -> dict[str, dict]:
        """Inputs of ``stage`` that a stage on another site sealed in that site's store, brought
        into this site's store before the gang starts (local name → the crossing's record)."""
        here = self.at(stage)
        producers = {out: s for s, spec in self.wf.stages.items() for out in spec.outputs}
        crossed = {}
        for local, spec in self.wf.stages[stage].inputs.items():
            producer = producers.get(spec.dataset)
            if producer is None:
                continue
            there = self.at(producer)
            if there is not here and not there.same_store(here):
                crossed[local] = self._cross(spec.dataset, there, here, stage)
        return crossed

    def _cross(self, dataset: str, there: SiteRun, here: SiteRun, stage: str) -> dict:
        """One dataset from ``there``'s store into ``here``'s (``crossings.cross_dataset``: through
        the object store both sites name as their ``exchange`` when they do, else directly),
        once per run — a second reader on this site (or a retry) finds it crossed (``already``)
        and nothing moves.  A failed try is tried again (``CROSSING_TRIES``, each said as an
        event 'crossing retry'; a cancel ends the pause) before it fails this attempt."""
        from .crossings import cross_dataset, crossing_message, shared_exchange

        exchange = shared_exchange(there.site.store.exchange, here.site.store.exchange)
        if exchange:
            self._exchanges.add(exchange)
        with self._crossing:
            record = cross_dataset(
                dataset,
                there.store,
                here.store,
                exchange,
                src_site=there.name,
                dst_site=here.name,
                run=self.run_id,
                wait=self._cancelled.wait,
                on_retry=lambda message: self._event(stage, "crossing retry", message),
            )
        self._event(stage, "crossed", crossing_message(dataset, record))
        return record

    def _recompute_lost_inputs(self, name: str, slots: list[int]) -> bool:
        """Before a retry: inputs of ``name`` that stages of this workflow sealed but that are
        now lost or damaged (their host is gone, a partition deleted or corrupted) are made
        again from their lineage — the producing stage runs again, on this stage's slots —
        else the retry would fail the same way.  True when something was recomputed."""
        producers = {out: stage for stage, spec in self.wf.stages.items() for out in spec.outputs}
        redo: dict[str, str] = {}
        for spec in self.wf.stages[name].inputs.values():
            dataset = spec.dataset
            if "/" not in dataset and dataset in producers:
                if self.where[producers[dataset]] != self.where[name]:
                    # made on another site: not run again here; the next attempt's crossing checks
                    # the copy on this site (Store.check: a missing partition always, its checksum once
                    # per run) and sends it again when it fails
                    continue
                why = unverified(self.at(name).store, [dataset])
                if why:
                    redo.setdefault(producers[dataset], why)
        for producer, why in redo.items():
            need = self.at(name).gpus_of(self.wf.stages[producer])
            if self.wf.stages[producer].ranks > len(slots) or need > len(self._gpu_slots.get(name, [])):
                self._event(name, "lost input", f"{why}; stage {producer!r} needs more slots than this stage holds")
                return False
            self._event(name, "lost input", f"{why}: stage {producer!r} runs again first")
            self._nested.add(producer)
            self._gpu_slots[producer] = self._gpu_slots.get(name, [])[:need]
            try:
                if self._run_stage(producer, slots[: self.wf.stages[producer].ranks]) is not None:
                    return False
            finally:
                self._nested.discard(producer)
                self._gpu_slots.pop(producer, None)
        return bool(redo)

    def _run_stage(self, name: str, slots: list[int], reused: Gang | None = None) -> str | None:
        """All attempts of one stage; returns None on success, else the last error summary."""
        self.trace.start_stage(name, self.wf.stages[name].ranks, self.where.get(name))
        error: str | None = "failed"
        try:
            error = self._attempts(name, slots, reused)
        finally:
            state = "succeeded" if error is None else "cancelled" if error == "cancelled" else "failed"
            self.trace.end_stage(name, state, error)
        return error

    def _attempts(self, name: str, slots: list[int], reused: Gang | None) -> str | None:
        if self.cache.reuse(name, slots, reused):  # an earlier run's outputs, adopted (cache.py)
            return None
        st = self.wf.stages[name]
        self.db.set_stage(self.run_id, name, "running", started=time.time(), ended=None, error=None)
        error = ""
        # A resumed run numbers on: earlier attempts keep their records and logs.
        first = 1 + max((a["attempt"] for a in self.db.attempts(self.run_id, name)), default=0)
        here = self.at(name)
        retry = RetryState(policy_of(st, here.site), self._rank_memory(name), pauses=BACKOFF_S)
        attempt = first - 1
        while True:
            attempt += 1
            if self._cancelled.is_set():
                self.db.set_stage(self.run_id, name, "cancelled", ended=time.time(), error="cancelled")
                return "cancelled"
            log_dir = self.db.log_dir(self.run_id, name, attempt)
            self.trace.start_attempt(name, attempt)
            try:
                if st.kind == "command":
                    failure = self._run_command(name, attempt, slots, log_dir)
                else:
                    failure = self._gang_attempt(name, attempt, slots, log_dir, reused)
                    reused = None  # a kept gang serves only the first attempt
                if failure is None:
                    self.trace.end_attempt(name, "succeeded")
                    return None
                error, detail, ranks, cause = failure
            except Exception as exc:  # a bad executor section, an unknown rendezvous...: this stage's
                import traceback  # failure, never the run's (siblings keep running)

                error, ranks, cause = f"{type(exc).__name__}: {exc}", None, classify(exc)
                detail = f"{error}\n{traceback.format_exc()}"
            if self._cancelled.is_set():
                self.db.end_attempt(self.run_id, name, attempt, "cancelled", detail, ranks=ranks, cause=cause)
                self.trace.end_attempt(name, "cancelled", error, cause)
                self.db.set_stage(self.run_id, name, "cancelled", ended=time.time(), error="cancelled")
                return "cancelled"
            self.db.end_attempt(self.run_id, name, attempt, "failed", detail, ranks=ranks, cause=cause)
            self.trace.end_attempt(name, "failed", error, cause)
            self._event(name, "failed", f"attempt {attempt}: {error}")
            decision = retry.after(cause)  # by the stage's retry policy (orchestrator/retry.py)
            if decision.retry or retry.policy.causes:
                self._event(name, "retry", f"attempt {attempt}: {label(cause)} — {decision.describe()}")
            if not decision.retry or self._cancelled.is_set():
                break
            if decision.memory:
                self._memory[name] = decision.memory  # _gang gives the next gang's ranks this much
            try:
                recomputed = self._recompute_lost_inputs(name, slots)
            except Exception as exc:  # e.g. the metadata unreachable: the retry will say so
                self._event(name, "lost input", f"could not check the inputs before the retry: {exc}")
                recomputed = False
            if not recomputed:  # the backoff; a cancel ends it at once (the loop then stops)
                self._cancelled.wait(decision.wait_s)
        self._memory.pop(name, None)
        self.db.set_stage(self.run_id, name, "failed", ended=time.time(), error=error)
        return error or "failed"

    def _succeeded(
        self, name: str, attempt: int, message: str, results: list[dict] | None = None, crossed: dict | None = None
    ) -> None:
        outputs = results[0]["outputs"] if results else {}
        totals = input_totals(results) if results else {}
        for local, crossing in (crossed or {}).items():  # the run record says how the input got here
            totals.setdefault(local, {}).update(crossed=crossing)
        self.db.end_attempt(self.run_id, name, attempt, "succeeded", ranks=rank_records(results) if results else None)
        self.db.set_stage(
            self.run_id,
            name,
            "succeeded",
            ended=time.time(),
            outputs=outputs,
            error=None,
            fingerprint=self.fingerprints[name],
            **({"inputs": totals} if totals else {}),
        )
        self._event(name, "succeeded", message)

    def _gang_attempt(
        self, name: str, attempt: int, slots: list[int], log_dir, reused: Gang | None
    ) -> tuple[str, str, list[dict], str] | None:
        """One attempt of a bsp/torch stage on a gang (the previous stage's, when it was kept for
        this one); None on success, else (summary, full error, per-rank records, cause)."""
        from .fanout import gathered_inputs

        st, here = self.wf.stages[name], self.at(name)
        inputs = gathered_inputs(self.wf, name, set(self._skipped_when))
        outputs = self.wf._aliases.get(name) or st.outputs  # a fan-out instance writes OUT as OUT.i
        self.db.start_attempt(self.run_id, name, attempt, "", str(log_dir))  # gang start included
        try:
            crossed = self._cross_inputs(name)
        except Exception as exc:  # the source site unreachable, a checksum mismatch: this attempt's failure
            return error_summary(exc), str(exc), [], classify(exc)
        gang = reused if reused is not None and reused.redirect_logs(log_dir) else None
        how = f"the gang of the previous stage ({gang.gang_id})" if gang else "a new gang"
        if gang is None:
            gang = self._gang(name, slots, log_dir)
        self._event(name, "start", f"attempt {attempt}: {counted(st.ranks, 'rank')} on slots {slots}, {how}")
        keep = False
        samples = SampleRecorder(self.db, self.run_id, name, attempt)  # the ranks' resources, while they run
        try:
            with self._lock:
                self._gangs[name] = gang
            gang.start()
            self.db.set_attempt_gang(self.run_id, name, attempt, gang.gang_id)
            where = gang.status()  # the resource manager's view
            if where:
                self._event(name, "placed", where)
            gang.on_sample = samples.add
            app, first = self.trace.rank_app(name, STAGE_APP)  # traced: the attempt's context goes first
            results = gang.run(
                app, *first, name, self.wf.app_of(name), inputs, outputs, params=st.params, timeout=st.timeout
            )
        except (RankError, GangError) as exc:
            return error_summary(exc), str(exc), failed_ranks(gang, exc), classify(exc)
        else:  # a gang that just succeeded may serve the next stage of its size
            keep = (
                here.site.reuse_gangs
                and here.caps.reuse_gangs
                and gang.running
                and not self._cancelled.is_set()
                and name not in self._nested  # it ran on another stage's slots
                and not self._gpu_slots.get(name)  # its ranks' GPUs go back to the site
            )
        finally:
            gang.on_sample = None
            samples.close()  # the ranks' final samples came with their results
            with self._lock:
                self._gangs.pop(name, None)
                if keep:
                    here.idle[tuple(slots)] = gang
            if not keep:
                gang.close()
        rows = ", ".join(f"{k}: {r:,} rows" for k, (r, _) in results[0]["outputs"].items())
        self._succeeded(name, attempt, rows, results, crossed)
        return None

    def _run_command(
        self, name: str, attempt: int, slots: list[int], log_dir
    ) -> tuple[str, str, list[dict] | None, str] | None:
        """An external program on every rank (an existing MPI or native code as a stage), on a
        gang like any stage's (``Gang.run_command``): params as PHALANX_PARAM_*.  None on
        success, else (summary, full error, per-rank records) as for BSP stages."""
        st, here = self.wf.stages[name], self.at(name)
        self.db.start_attempt(self.run_id, name, attempt, "", str(log_dir))
        if not here.caps.runs_commands:
            error = f"executor {here.site.executor!r} cannot start programs: command stages cannot run on it"
            return error, error, None, "GangError"
        command = st.command
        if not command:  # the stage model's validator requires one for a command stage
            error = f"stage {name!r} is a command stage without a command"
            return error, error, None, "GangError"
        try:  # its inputs sealed on another site cross first, as a bsp stage's do
            crossed = self._cross_inputs(name)
        except Exception as exc:
            return error_summary(exc), str(exc), None, classify(exc)
        gang = self._gang(name, slots, log_dir)
        env = {f"{ENV_PARAM_PREFIX}{k.upper()}": str(v) for k, v in st.params.items()}
        env.update(self.trace.carrier(name))  # TRACEPARENT: the program may continue the trace
        self._event(name, "start", f"attempt {attempt}: {counted(st.ranks, 'rank')} of {command[0]!r} on slots {slots}")
        with self._lock:
            self._gangs[name] = gang
        try:
            gang.run_command(command_argv(command), env, timeout=st.timeout)
        except OSError as exc:  # the program does not exist or is not executable
            error = f"cannot start {command[0]!r}: {exc.strerror or exc}"
            return error, error, None, type(exc).__name__
        except (RankError, GangError) as exc:  # a rank failed; the resource manager refused (bad partition...)
            return error_summary(exc), str(exc), failed_ranks(gang, exc), classify(exc)
        finally:
            self.db.set_attempt_gang(self.run_id, name, attempt, gang.gang_id)
            with self._lock:
                self._gangs.pop(name, None)
        self._succeeded(name, attempt, f"{counted(st.ranks, 'rank')} exited 0", crossed=crossed)
        return None


def counted(n: int, noun: str) -> str:
    """``n`` and the noun in the number it needs: "1 rank", "2 ranks", "0 ranks"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def error_summary(exc: BaseException) -> str:
    """A failure's one-line summary: its first line, with the line after it when the first only
    introduces it ("gang of 2 could not start (...):" says nothing without its reason)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


class RunAllocations:
    """A launcher's allocation hook: resource-manager allocations recorded in the run DB."""

    def __init__(self, db: RunDB, run_id: str, stage: str | None):
        self.db, self.run_id, self.stage = db, run_id, stage

    def held(self, record: dict) -> None:
        self.db.add_allocation(self.run_id, self.stage, record)

    def released(self, record: dict) -> None:
        self.db.mark_released(self.run_id, record)


def unverified(store: Store, outputs: list[str]) -> str | None:
    """Why sealed outputs cannot be trusted (missing, a partition corrupted, truncated or lost
    with its host), or None when every partition of every output passes its checksum (checked
    where it lives: here, or by the store service of the host that holds it)."""
    from ..errors import StoreError

    for name in outputs:
        if not store.exists(name):
            return f"output {name!r} is not in the store"
        info = store.info(name)
        try:
            for i in range(info.num_partitions):
                store.check(info, i)
        except StoreError as exc:
            return f"output {name!r} failed verification ({exc})"
    return None


def command_argv(command: list[str]) -> list[str]:
    """``python``/``python3`` in a command stage is the Python that runs phalanx (its venv),
    not whatever PATH finds first — or nothing, on systems with only ``python3``."""
    import sys

    return [sys.executable, *command[1:]] if command[0] in ("python", "python3") else list(command)


def rank_records(results: list[dict]) -> list[dict]:
    """Per rank: pid, host and when its app ran (the report's timeline), and its device and peak
    GPU memory where it used CUDA."""
    return [
        {
            "rank": r,
            **{k: res[k] for k in ("pid", "host", "started", "ended")},
            **({"gpu": res["gpu"]} if res.get("gpu") else {}),
        }
        for r, res in enumerate(results)
    ]


def failed_ranks(gang: Gang, exc: Exception) -> list[dict]:
    """Per rank of a failed attempt: pid and host, and how it ended — failed (its error and exit code,
    None while it still reported), or stopped by fail-fast."""
    failures = {f.rank: f for f in getattr(exc, "failures", [])}
    stopped = set(getattr(exc, "stopped", []))
    out = []
    for r in range(gang.world_size):
        rec: dict = {
            "rank": r,
            "pid": gang.pids[r] if r < len(gang.pids) else None,
            "host": gang.hosts[r] if r < len(gang.hosts) else None,
        }  # whose pid it is
        if r in failures:
            rec.update(outcome="failed", error=failures[r].summary(), exit=failures[r].exitcode)
        elif r in stopped:
            rec["outcome"] = "stopped"
        out.append(rec)
    return out


def input_totals(results: list[dict]) -> dict[str, dict]:
    """Per input: rows and bytes read over all ranks, the repartition path taken, and the bytes
    of stored partitions read on the ranks' own hosts vs fetched from other hosts."""
    totals: dict[str, dict] = {}
    for res in results:
        for local, st in res["inputs"].items():
            t = totals.setdefault(
                local,
                {"dataset": st["dataset"], "rows": 0, "bytes": 0, "plan": st["plan"], "read_here": 0, "fetched": 0},
            )
            for key in ("rows", "bytes", "read_here", "fetched"):
                t[key] += st.get(key, 0)
    return totals


def run_workflow(
    wf: Workflow,
    site: Site,
    *,
    file: str = "<python>",
    db: RunDB | None = None,
    resume: str | None = None,
    on_event=None,
    sites: dict[str, Site] | None = None,
) -> RunResult:
    """Run (or resume) a workflow; returns which stages failed.  ``site``: the workflow's;
    ``sites``: stage → the site it names (default: loaded from the stages' ``site:``)."""
    return prepare_run(wf, site, file=file, db=db, resume=resume, on_event=on_event, sites=sites).run()


def prepare_run(
    wf: Workflow,
    site: Site,
    *,
    file: str = "<python>",
    db: RunDB | None = None,
    resume: str | None = None,
    on_event=None,
    sites: dict[str, Site] | None = None,
) -> Scheduler:
    """The run's record (new, or the resumed run's, locked to this driver) and its scheduler,
    not started yet: ``.run()`` runs it, ``.cancel()`` from another thread stops it, and
    ``.run_id`` is known at once (what a run handle needs)."""
    if sites is None and any(st.site for st in wf.stages.values()):
        from pathlib import Path

        from .loading import stage_sites

        near = Path(file).resolve().parent if file and not file.startswith("<") else None
        sites = stage_sites(wf, site, near)
    from .fanout import expand_static

    wf = expand_static(wf)  # static fan-outs: their instances are stages from the start
    if sites is not None:
        sites = {name: sites[wf.template_of(name)] for name in wf.stages if wf.template_of(name) in sites}
    db = db or RunDB()
    if resume:
        try:
            run = db.acquire(resume)  # one driver per run: RunLockedError while another holds it
        except KeyError:
            raise GangError(f"no run {resume!r} in {db.path}") from None
        run_id, session = run["id"], run["session"]
        db.add_stages(run_id, {n: s.ranks for n, s in wf.stages.items()})  # stages added since
    else:
        run_id, session = db.new_run(
            wf.name, file, site.name, site.store.session, {n: s.ranks for n, s in wf.stages.items()}
        )
    try:
        return Scheduler(wf, site, db, run_id, session, on_event, sites)
    except BaseException as exc:  # the store refused (another user's root, Redis down): the run ends here
        db.event(run_id, "failed", f"{type(exc).__name__}: {exc}")
        db.set_run(run_id, "failed")
        raise
