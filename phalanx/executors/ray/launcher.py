"""``RayLauncher``: one gang as one placement group with one rank actor per bundle."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import GangError
from ...runtime import protocol as P
from ...runtime import threads as threads_
from ...runtime.envvars import ENV_STORE_SERVICE_KEY, ENV_STORE_TOKEN_FILE, ENV_THREADS
from ..base import Echo, Launcher, held, released
from ..logs import FileFollower
from .actor import RankActor, is_worker
from .config import RayConfig, ray_config
from .connection import connect, connected
from .network import reachable_env
from .placement import describe, why_unplaceable
from .services import StoreServices

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

_KILLED = -int(signal.SIGKILL)
NODE_SHARE = 0.001  # of a node's node:<ip> resource (1.0 a node) that pins a bundle there  # how a dead actor's rank is reported by exitcodes()


class RayLauncher(Launcher):
    """Starts a gang on a Ray cluster: its placement group (all bundles or none, within
    ``ready_timeout_s``), then one ``RankActor`` per bundle running the rank.

    ``config``: a ``RayConfig`` or the keys of a ``ray:`` section (also as keyword arguments:
    ``RayLauncher(address=..., strategy="SPREAD")``); ``site`` names the site in errors.
    """

    name = "ray"

    def __init__(
        self,
        config: RayConfig | Mapping[str, Any] | None = None,
        *,
        echo: Echo = False,
        site: str = "ray",
        **keys: Any,
    ):
        if keys:  # over the section's own
            base = config.model_dump(exclude_unset=True) if isinstance(config, RayConfig) else dict(config or {})
            config = {**base, **keys}
        self.config = ray_config(config, site)
        self.echo = echo
        self.site = site
        # one gang at a time; launch() resets these (a Gang restarts on the same launcher)
        self.pg: PlacementGroup | None = None
        self.actors: list[Any] = []
        self.nodes: list[dict[str, Any]] = []  # per rank: pid, node_id, node_ip, host
        self._done: list[Any] = []  # per rank: ObjectRef of the actor's serve()
        self._codes: list[int | None] = []
        self._notes: list[str] = []  # Ray's word on ranks that died (reason())
        self._causes: dict[int, str] = {}  # rank → why Ray ended its actor (end_cause), where it says
        self._follower: FileFollower | None = None
        self._log_paths: list[Path] = []
        self._allocation: dict | None = None  # the gang's placement group (base.held)
        self.timings: dict[str, float] = {}
        self.services: StoreServices | None = None  # the run's store services (the executor's)
        self.placed: list[str] = []  # per rank: the Ray node IP prefer_hosts chose ("" none)

    def __repr__(self) -> str:
        c = self.config
        return f"<RayLauncher site={self.site!r} address={c.address!r} {c.strategy} cpus_per_rank={c.cpus_per_rank:g}>"

    def connect(self):
        """The ray module, connected to the section's cluster (or the one this process is)."""
        c = self.config
        return connect(c.address, c.namespace, c.init, site=self.site)

    @property
    def holds(self) -> bool:
        """Whether the launcher holds a placement group or actors now."""
        return self.pg is not None or bool(self.actors) or self._allocation is not None

    # ---- Launcher -----------------------------------------------------------------------------
    def placement(self, world_size: int) -> list[dict[str, str]]:
        return [{P.ENV_THREADS: str(self.config.threads())} for _ in range(world_size)]

    def bundles(self, world_size: int) -> list[dict[str, float]]:
        try:
            bundles = self.config.bundles(world_size)
        except ValueError as exc:
            raise GangError(f"site {self.site!r} (ray): {exc}") from None
        if len(self.placed) == world_size:  # rank r on node placed[r]: Ray's node:<ip> resource
            bundles = [{**b, f"node:{ip}": NODE_SHARE} if ip else b for b, ip in zip(bundles, self.placed)]
        return bundles

    def prefer_hosts(self, hosts: Sequence[str]) -> bool:
        """Rank r on the Ray node whose host name or node IP is ``hosts[r]`` (its bundle asks
        for a share of that node's ``node:<ip>`` resource), at most as many ranks a node as its
        CPUs hold bundles; a rank whose host is "" or no node, or whose node is full, goes
        where the placement group's strategy puts it (STRICT_SPREAD: one rank a node).  For the
        next launch only.  False when none of ``hosts`` is a node of the cluster, the cluster
        is on one host (one node address), or the strategy is STRICT_PACK (one node, Ray's choice)."""
        if self.config.strategy == "STRICT_PACK":
            return False
        try:
            ray = self.connect()
            nodes = [nd for nd in ray.nodes() if nd.get("Alive")]
        except Exception:
            return False
        ip_of: dict[str, str] = {}
        room: dict[str, int] = {}
        per_rank = self.config.cpus_per_rank
        for nd in nodes:
            ip = nd.get("NodeManagerAddress", "")
            ip_of[ip] = ip
            ip_of.setdefault(nd.get("NodeManagerHostname", ""), ip)
            room[ip] = room.get(ip, 0) + int(nd.get("Resources", {}).get("CPU", 0) // per_rank)
        if self.config.strategy == "STRICT_SPREAD":  # one rank an address (raylets may share one)
            room = {ip: min(n, 1) for ip, n in room.items()}
        if sum(1 for n in room.values() if n) < 2 or not any(h in ip_of for h in hosts if h):
            return False  # one host with CPUs: nothing to choose
        placed = []
        for h in hosts:
            ip = ip_of.get(h, "") if h else ""
            if ip and room.get(ip, 0) > 0:
                room[ip] -= 1
                placed.append(ip)
            else:
                placed.append("")
        if not any(placed):
            return False
        self.placed = placed
        return True

    def placement_wait(self) -> float:
        """How long the placement group may wait: ``ready_timeout_s``, bounded by the gang's
        start timeout (a wait for busy CPUs counts in it, as a wait in SLURM's queue would)."""
        wait_s = self.config.ready_timeout_s
        if self.start_timeout:
            wait_s = min(wait_s, self.start_timeout)
        return wait_s

    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        bundles = self.bundles(len(rank_env))
        self.placed = []  # this launch's
        ray = self.connect()
        self._reset()
        try:
            self._launch(ray, bundles, argv, rank_env, Path(log_dir))
        except BaseException:
            self.kill(grace_s=0)
            raise

    def _launch(
        self, ray, bundles: list[dict[str, float]], argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path
    ) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c = self.config
        n = len(rank_env)
        self._codes = [None] * n
        log_dir.mkdir(parents=True, exist_ok=True)
        gang_id = rank_env[0].get(P.ENV_GANG_ID) or uuid.uuid4().hex[:12]

        t0 = time.perf_counter()
        context = ray.get_runtime_context()
        self._allocation = {
            "executor": "ray",
            "kind": "placement_group",
            "id": f"phalanx-{gang_id}",
            "ranks": n,
            "address": context.gcs_address,
            "namespace": context.namespace,
        }
        held(self.allocation_hook, self._allocation)  # before it exists: found by name
        self.pg = pg = placement_group(bundles, strategy=c.strategy, name=self._allocation["id"])
        wait_s = self.placement_wait()
        # in slices: a kill() from another thread (cancel) removes the group and sets self.pg to
        # None; the launch ends then, not when Ray resolves the removed group's ready() (under
        # load that took longer than cancel's 8 s in the contract test)
        ready_ref, deadline = pg.ready(), time.monotonic() + wait_s
        ready: list[Any] = []
        while not ready and self.pg is pg and (left := deadline - time.monotonic()) > 0:
            ready, _ = ray.wait([ready_ref], timeout=min(0.5, left))
        if self.pg is not pg:
            raise GangError(f"site {self.site!r} (ray): the gang was stopped while it waited for its placement group")
        if not ready:
            why = why_unplaceable(ray, pg, bundles, c.strategy)
            raise GangError(
                f"site {self.site!r} (ray): placement group of {describe(bundles, c.strategy)} "
                f"not placeable within {wait_s:g} s: {why}"
            )
        self.timings["placement_s"] = time.perf_counter() - t0

        actor_cls = ray.remote(RankActor)
        for r, bundle in enumerate(bundles):
            opts: dict[str, Any] = {
                "num_cpus": bundle["CPU"],
                "max_restarts": 0,
                "max_task_retries": 0,
                # serve() occupies one thread for the rank's life; redirect() needs another
                "max_concurrency": 2,
                "name": f"phalanx-{gang_id}-rank{r}",
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=r
                ),
            }
            if bundle.get("GPU"):
                opts["num_gpus"] = bundle["GPU"]
            if bundle.get("memory"):
                opts["memory"] = bundle["memory"]
            custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
            if custom:
                opts["resources"] = custom
            runtime_env = rank_runtime_env(c.runtime_env, rank_env[r])
            if runtime_env:
                opts["runtime_env"] = runtime_env
            self.actors.append(actor_cls.options(**opts).remote())
        try:
            self.nodes = ray.get([a.info.remote() for a in self.actors], timeout=max(c.ready_timeout_s, 30.0))
        except Exception as exc:
            raise GangError(
                f"site {self.site!r} (ray): the rank actors did not start: {type(exc).__name__}: {exc}"
            ) from exc
        self.timings["actors_s"] = time.perf_counter() - t0 - self.timings["placement_s"]

        rank_env = reachable_env(
            rank_env,
            self.nodes,
            site=self.site,
            driver_ip=ray.util.get_node_ip_address,
            free_port=lambda ip: ray.get(self.actors[0].free_port.remote(ip), timeout=30),
        )
        # the actors have the raylet's environment, not ours: the store services' token file
        # (a path on the shared filesystem; never the token itself, which Ray would keep)
        forward = {k: os.environ[k] for k in (ENV_STORE_TOKEN_FILE,) if os.environ.get(k)}
        if forward:
            rank_env = [{**forward, **env} for env in rank_env]
        if self.services is not None:  # one store service per node (services.py)
            key = self.services.ensure(ray, rank_env[0])
            if key:
                rank_env = [{**env, ENV_STORE_SERVICE_KEY: key} for env in rank_env]
        self._log_paths = [log_dir / f"rank-{r}.log" for r in range(n)]
        command = None if is_worker(argv) else list(argv)  # else a command stage's program
        self._done = [
            a.serve.remote(env, str(path), command, os.getcwd(), sys.executable)
            for a, env, path in zip(self.actors, rank_env, self._log_paths)
        ]
        if self.echo:
            self._follower = FileFollower(self._log_paths, self.echo, name="phalanx-ray-logs")

    def exitcodes(self) -> list[int | None]:
        pending = [r for r, c in enumerate(self._codes) if c is None and r < len(self._done)]
        if pending:
            ray = sys.modules.get("ray")
            refs = [self._done[r] for r in pending]
            if ray is None:  # Ray is gone (not in sys.modules): the ranks with it
                ready = refs
            else:
                try:
                    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
                except Exception:  # Ray is gone (shutdown): the ranks with it
                    ready = refs
            ready_ids = {ref.hex() for ref in ready}
            for r, ref in zip(pending, refs):
                if ref.hex() in ready_ids:
                    self._codes[r] = self._exitcode_of(r, ref)
        return list(self._codes)

    def redirect(self, log_dir: Path) -> bool:
        """Ranks' output to ``log_dir`` from now on (a gang reused by the next stage)."""
        ray = connected()
        if ray is None or not self.actors:
            return False
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        paths = [log_dir / f"rank-{r}.log" for r in range(len(self.actors))]
        ray.get([a.redirect.remote(str(p)) for a, p in zip(self.actors, paths)], timeout=30)
        self._log_paths = paths
        if self._follower is not None:
            self._follower.move_to(paths)
        return True

    def status(self) -> str:
        """Ray's view of this gang (the gang names it when ranks do not start in time)."""
        if self.pg is None:
            return "ray: no placement group"
        try:
            from ray.util.placement_group import placement_group_table

            table = placement_group_table(self.pg)
            state = table.get("state", "?")
            sched = table.get("stats", {}).get("scheduling_state")
        except Exception as exc:
            return f"ray: cannot ask Ray: {exc}"
        text = f"ray: placement group {table.get('name', '')} {state}" + (f" ({sched})" if sched else "")
        codes = self.exitcodes()
        if self.nodes:
            text += "; ranks " + ", ".join(
                f"{r} pid {nd['pid']} on {nd['node_ip']}" + ("" if codes[r] is None else f" exited {codes[r]}")
                for r, nd in enumerate(self.nodes)
            )
        elif self.actors:
            text += f"; {len(self.actors)} rank actors starting"
        return text

    def reason(self) -> str | None:
        """Ray's word on the first rank whose actor died or failed, if one did."""
        return self._notes[0] if self._notes else None

    def kill(self, grace_s: float = 2.0) -> None:
        """Kill the rank actors (Ray kills at once: there is no gentler way into an actor busy
        in its serve loop), then remove the placement group."""
        ray = connected()
        if ray is not None:
            for actor in self.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass
            live = [ref for ref, c in zip(self._done, self._codes) if c is None]
            if live:
                try:
                    ray.wait(live, num_returns=len(live), timeout=max(grace_s, 0.5), fetch_local=False)
                except Exception:
                    pass
            self.exitcodes()
        self._remove_pg()
        self.actors = []
        if self._follower is not None:
            self._follower.stop()
            self._follower = None

    # ---- helpers ------------------------------------------------------------------------------
    def _reset(self) -> None:
        if self.holds:
            self.kill(grace_s=0)
        self.pg, self.actors, self.nodes, self._done, self._codes, self._notes = None, [], [], [], [], []
        self.timings = {}

    def _remove_pg(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            except Exception:  # Ray is gone (shutdown): it removed the job's groups itself
                pass
        record, self._allocation = self._allocation, None
        if record is not None:
            released(self.allocation_hook, record)

    def _exitcode_of(self, rank: int, ref) -> int:
        ray = sys.modules["ray"]
        try:
            return int(ray.get(ref, timeout=5))
        except ray.exceptions.RayActorError as exc:
            self._note(rank, f"the rank's Ray actor died: {_first_line(exc)}")
            cause = actor_death_cause(exc)
            if cause:
                self._causes[rank] = cause
            return _KILLED
        except ray.exceptions.RayTaskError as exc:
            self._note(rank, f"the rank's Ray actor failed: {_first_line(exc)}")
            return 1
        except Exception as exc:
            self._note(rank, f"the rank's Ray actor is lost: {type(exc).__name__}: {_first_line(exc)}")
            return _KILLED

    def end_cause(self, rank: int) -> str | None:
        return self._causes.get(rank)

    def _note(self, rank: int, text: str) -> None:
        """Remember Ray's reason for ``reason()`` and append it to the rank's log, which the
        gang shows on failure."""
        self._notes.append(f"ray: rank {rank}: {text}")
        try:
            with open(self._log_paths[rank], "a") as f:
                f.write(f"[phalanx ray] {text}\n")
        except (OSError, IndexError):
            pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def rank_runtime_env(user: Mapping[str, Any] | None, env: Mapping[str, str]) -> dict[str, Any]:
    """The actor's runtime_env: the site's, plus the rank's thread share as environment
    variables.  The actor process imports phalanx (and so polars, which sizes its thread pool
    at import) when it unpickles the actor class, before ``serve`` sets the rank's
    environment: only variables Ray sets at process start size that pool.  Measured: without
    them a 1-thread rank on a 2-CPU node had 2 polars threads."""
    out = dict(user or {})
    variables = dict(out.get("env_vars") or {})
    threads = env.get(ENV_THREADS)
    if threads:
        variables[ENV_THREADS] = threads
        variables.update({var: threads for var in threads_.POOL_VARS})
    if variables:
        out["env_vars"] = variables
    return out


# How Ray words an actor's death by its node's (the raylet gone) or by its memory monitor
_NODE_DIED = ("node has died", "node died", "node was terminated", "raylet died")
_OUT_OF_MEMORY = ("running low on memory", "OutOfMemoryError", "memory monitor")


def actor_death_cause(exc: BaseException) -> str | None:
    """Why Ray ended a rank's actor, as retry policies name it: "preempted" (its node drained
    for preemption: Ray's own flag), "node_lost" (its node died), "oom" (Ray's memory monitor
    killed it); None otherwise."""
    if getattr(exc, "preempted", False):
        return "preempted"
    text = str(exc)
    if any(m in text for m in _NODE_DIED):
        return "node_lost"
    if any(m in text for m in _OUT_OF_MEMORY):
        return "oom"
    return None
