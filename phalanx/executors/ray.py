"""Ray executor: a gang is one Ray placement group with one actor per rank.

CylonFlow-on-Ray's stateful actors: the placement group reserves every rank's bundle at once
(all or nothing: wait for it with a timeout, else remove it and fail with Ray's reason), then
one actor per rank is scheduled on its bundle and runs the phalanx rank worker
(``phalanx.runtime.worker.main``) *inside the actor process*.  So

- killing the actor kills the rank: the rank's control connection drops, and the gang fails
  fast exactly as when a local rank process dies;
- the communicator (Gloo) is built once per gang and kept across apps (a persistent
  ``px.Gang`` reuses the same actors, same PIDs);
- ranks talk to each other over Gloo directly (TCP), out of band: Ray's object store carries
  nothing but the actors' tiny start-up calls.

Differences from the local executor, by design:

- ``argv`` is not executed when it is the phalanx worker (``python -m phalanx.runtime.worker``):
  the actor calls the worker's ``main()`` in-process.  Any other ``argv`` (a command stage's
  program) runs as a child process of the actor that dies with it; the driver's Python path
  in ``argv[0]`` becomes the node's own, and the driver's working directory is used where it
  exists on the node.
- The actor is a process the raylet started, so the worker's parent-death signal does not
  apply (``PHALANX_PDEATHSIG=0``): Ray itself kills a job's actors and placement groups when
  the driver exits.  CPU pinning (``PHALANX_CPUS``) is dropped too: Ray reserves CPUs as
  counts, not core ids; ``PHALANX_THREADS`` is the bundle's CPU count.
- Rank output goes to ``log_dir/rank-R.log`` written by the actor itself (its stdout and
  stderr file descriptors are redirected there).  On a multi-host cluster ``log_dir`` must be
  on a shared filesystem for the driver to show a failed rank's last lines (and for ``echo``).
- Each rank gets ``PHALANX_RAY_NODE_ID``, ``PHALANX_RAY_NODE_IP`` and ``PHALANX_RAY_ACTOR_ID``.
- The actor has two threads (``max_concurrency=2``): ``serve()`` runs the rank for its whole
  life, so ``redirect()`` (a gang reused by the next stage writes to that stage's log
  directory) can still reach it.
- A dead actor's rank reports exit code -9 (SIGKILL), and Ray's reason is appended to its log
  (``[phalanx ray] the rank's Ray actor died: ...``), which the gang's error shows.

When the driver dies: the rank actors are named (``phalanx-<gang>-rankR``, namespace
``phalanx``) but not detached, so they and the placement group belong to the driver's Ray
job.  Measured on Ray 2.60 with the driver SIGKILLed: the raylet sees the driver's socket
close, the GCS marks the job finished, kills its actors and removes its placement groups
within 0.3 s.  The ranks also end by themselves (their control connection ends:
``runtime.worker.DriverWatch``).  Where Ray would keep them longer (a Ray Client driver keeps
its job for a reconnect grace period; a partitioned driver), the placement group is in the run
DB from before its creation (``base.held``) and ``release`` removes it and kills its actors.

Site section (all optional)::

    ray:
      address: auto            # auto (RAY_ADDRESS, else the latest cluster on this host) |
                               # host:port of the GCS | ray://host:10001 (Ray Client) | local
      namespace: phalanx
      strategy: PACK           # STRICT_PACK | PACK | SPREAD | STRICT_SPREAD
      cpus_per_rank: 1         # the CPU count of every rank's bundle
      resources: {}            # extra resources of every bundle ({GPU: 1}, {node_a: 1}...),
                               # or a list with one dict per rank
      ready_timeout_s: 60      # how long to wait for the whole placement group
      runtime_env: {}          # Ray runtime_env of the rank actors (pip, env_vars, ...)
      init: {}                 # extra keyword arguments of ray.init()

Reachability: ranks connect to the driver's control address (the site's ``driver_host``) and
rank 0 hosts the TCP rendezvous.  The default 127.0.0.1 is enough when every raylet runs on
the driver's host (``ray.cluster_utils``, the tests); ``launch`` refuses, with a clear error,
ranks placed on another host while the driver listens on loopback only.  A loopback ``tcp://``
rendezvous is moved to rank 0's node (a free port there) automatically.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

from ..errors import GangError, MissingDependencyError, PhalanxError
from ..runtime import protocol as P
from .base import Launcher, held, released

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
SITE_KEYS = ("address", "namespace", "strategy", "cpus_per_rank", "resources",
             "ready_timeout_s", "runtime_env", "init")
ENV_NODE_ID = "PHALANX_RAY_NODE_ID"
ENV_NODE_IP = "PHALANX_RAY_NODE_IP"
ENV_ACTOR_ID = "PHALANX_RAY_ACTOR_ID"
_KILLED = -int(signal.SIGKILL)  # how a dead actor's rank is reported by exitcodes()


def import_ray():
    """``import ray``, or an error naming the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(
            f"executor 'ray' needs the ray package, which is not installed ({exc.name or exc}); "
            "install it with: pip install 'phalanx[ray]'") from exc
    return ray


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _keep_ray_on_loopback() -> None:
    """Connecting to a cluster on loopback (started with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as
    the tests do): without this Ray rewrites 127.0.0.1 in the address to this host's routable
    IP, where nothing listens, and ``ray.init`` hangs.  Ray reads the variable once, at import,
    into a constant that only ``services.get_node_ip_address`` uses: set both."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    consts = sys.modules.get("ray._private.ray_constants")
    if consts is not None and hasattr(consts, "ENABLE_RAY_CLUSTER"):
        consts.ENABLE_RAY_CLUSTER = False


def _fmt_bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


class RayLauncher(Launcher):
    name = "ray"

    def __init__(self, echo: bool | Callable[[str], None] = False, *, address: str = "auto",
                 namespace: str | None = "phalanx", strategy: str = "PACK",
                 cpus_per_rank: float = 1, resources: dict | Sequence[dict] | None = None,
                 ready_timeout_s: float = 60.0, runtime_env: dict | None = None,
                 init: dict | None = None, site: str = "ray"):
        strategy = str(strategy).upper()
        if strategy not in STRATEGIES:
            raise PhalanxError(f"site {site!r} (ray): unknown strategy {strategy!r}; "
                               f"use one of {', '.join(STRATEGIES)}")
        if not cpus_per_rank or float(cpus_per_rank) <= 0:
            raise PhalanxError(f"site {site!r} (ray): cpus_per_rank must be > 0, got {cpus_per_rank!r}")
        self.echo = echo
        self.address = address
        self.namespace = namespace
        self.strategy = strategy
        self.cpus_per_rank = float(cpus_per_rank)
        self.resources = resources or {}
        self.ready_timeout_s = float(ready_timeout_s)
        self.runtime_env = runtime_env
        self.init_kwargs = dict(init or {})
        self.site = site
        # one gang at a time; launch() resets these (a Gang restarts on the same launcher)
        self.pg = None
        self.actors: list[Any] = []
        self.nodes: list[dict[str, Any]] = []    # per rank: pid, node_id, node_ip, host
        self._done: list[Any] = []                # per rank: ObjectRef of the actor's serve()
        self._codes: list[int | None] = []
        self._follower: _LogFollower | None = None
        self._log_paths: list[Path] = []
        self._allocation: dict | None = None   # the gang's placement group (base.held)
        self.timings: dict[str, float] = {}

    @classmethod
    def from_site(cls, ray_section: dict | None, ranks: int | None = None, *, site: str = "ray",
                  echo: bool | Callable[[str], None] = False) -> "RayLauncher":
        """The launcher a site's ``ray:`` section describes (``ranks``: the gang size, to
        check a per-rank ``resources`` list)."""
        section = dict(ray_section or {})
        unknown = sorted(set(section) - set(SITE_KEYS))
        if unknown:
            raise PhalanxError(f"site {site!r}: unknown key(s) in ray: {', '.join(unknown)}; "
                               f"known: {', '.join(SITE_KEYS)}")
        launcher = cls(echo=echo, site=site, **section)
        res = launcher.resources
        if ranks is not None and not isinstance(res, dict) and len(res) != ranks:
            raise PhalanxError(f"site {site!r} (ray): resources lists {len(res)} bundles "
                               f"for a gang of {ranks} ranks")
        return launcher

    def __repr__(self) -> str:
        return (f"<RayLauncher site={self.site!r} address={self.address!r} {self.strategy} "
                f"cpus_per_rank={self.cpus_per_rank:g}>")

    # ---- connection -------------------------------------------------------------------------
    def connect(self):
        """The ray module, connected: ``ray.init(address=...)`` unless already initialised."""
        ray = import_ray()
        if ray.is_initialized():
            return ray
        kwargs: dict[str, Any] = {"address": self.address, "log_to_driver": False,
                                  "logging_level": logging.WARNING, **self.init_kwargs}
        if self.namespace:
            kwargs.setdefault("namespace", self.namespace)
        target = os.environ.get("RAY_ADDRESS") if self.address in (None, "auto") else self.address
        target = target or ""
        if not target.startswith("ray://") and _is_loopback(target.rpartition(":")[0]):
            _keep_ray_on_loopback()
        try:
            ray.init(**kwargs)
        except Exception as exc:
            raise GangError(f"site {self.site!r} (ray): cannot connect to Ray at "
                            f"{self.address!r}: {exc}") from exc
        return ray

    @property
    def control_host(self) -> str:
        """The address ranks should reach the driver at: the driver's Ray node IP."""
        ray = self.connect()
        return ray.util.get_node_ip_address()

    # ---- Launcher -----------------------------------------------------------------------------
    def placement(self, world_size: int) -> list[dict[str, str]]:
        threads = str(max(1, int(self.cpus_per_rank)))
        return [{P.ENV_THREADS: threads} for _ in range(world_size)]

    def bundles(self, world_size: int) -> list[dict[str, float]]:
        per_rank = self.resources if not isinstance(self.resources, dict) else [self.resources] * world_size
        if len(per_rank) != world_size:
            raise GangError(f"site {self.site!r} (ray): resources lists {len(per_rank)} bundles "
                            f"for a gang of {world_size} ranks")
        return [{"CPU": self.cpus_per_rank, **{k: float(v) for k, v in (res or {}).items()}}
                for res in per_rank]

    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.connect()
        self._reset()
        n = len(rank_env)
        self._codes = [None] * n
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        bundles = self.bundles(n)
        gang_id = rank_env[0].get(P.ENV_GANG_ID) or uuid.uuid4().hex[:12]

        t0 = time.perf_counter()
        self._allocation = {"executor": "ray", "kind": "placement_group", "id": f"phalanx-{gang_id}",
                            "ranks": n, "address": ray.get_runtime_context().gcs_address,
                            "namespace": ray.get_runtime_context().namespace}
        held(self.allocation_hook, self._allocation)  # before it exists: found by name
        self.pg = placement_group(bundles, strategy=self.strategy, name=self._allocation["id"])
        ready, _ = ray.wait([self.pg.ready()], timeout=self.ready_timeout_s)
        if not ready:
            why = self._why_unplaceable(ray, bundles)
            self._remove_pg()
            raise GangError(f"site {self.site!r} (ray): placement group of {self._describe(bundles)} "
                            f"not placeable within {self.ready_timeout_s:g} s: {why}")
        self.timings["placement_s"] = time.perf_counter() - t0

        actor_cls = ray.remote(_RankActor)
        for r, bundle in enumerate(bundles):
            opts: dict[str, Any] = {
                "num_cpus": bundle["CPU"], "max_restarts": 0, "max_task_retries": 0,
                # serve() occupies one thread for the rank's life; redirect() needs another
                "max_concurrency": 2,
                "name": f"phalanx-{gang_id}-rank{r}",
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=r),
            }
            if bundle.get("GPU"):
                opts["num_gpus"] = bundle["GPU"]
            if bundle.get("memory"):
                opts["memory"] = bundle["memory"]
            custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
            if custom:
                opts["resources"] = custom
            if self.runtime_env:
                opts["runtime_env"] = self.runtime_env
            self.actors.append(actor_cls.options(**opts).remote())
        try:
            self.nodes = ray.get([a.info.remote() for a in self.actors],
                                 timeout=max(self.ready_timeout_s, 30.0))
        except Exception as exc:
            self.kill(grace_s=0)
            raise GangError(f"site {self.site!r} (ray): the rank actors did not start: "
                            f"{type(exc).__name__}: {exc}") from exc
        self.timings["actors_s"] = time.perf_counter() - t0 - self.timings["placement_s"]

        rank_env = self._reachable(rank_env)
        self._log_paths = [log_dir / f"rank-{r}.log" for r in range(n)]
        command = None if _is_worker(argv) else list(argv)  # else a command stage's program
        self._done = [a.serve.remote(env, str(path), command, os.getcwd(), sys.executable)
                      for a, env, path in zip(self.actors, rank_env, self._log_paths)]
        if self.echo:
            self._follower = _LogFollower(self._log_paths, self.echo)
            self._follower.start()

    def exitcodes(self) -> list[int | None]:
        pending = [r for r, c in enumerate(self._codes) if c is None and r < len(self._done)]
        if pending:
            ray = sys.modules.get("ray")
            refs = [self._done[r] for r in pending]
            try:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            except Exception:  # Ray is gone (shutdown): the ranks with it
                ready = refs
            ready_ids = {ref.hex() for ref in ready}
            for r, ref in zip(pending, refs):
                if ref.hex() in ready_ids:
                    self._codes[r] = self._exitcode_of(r, ref)
        return list(self._codes)

    def redirect(self, log_dir: Path) -> None:
        """Ranks' output to ``log_dir`` from now on (a gang reused by the next stage)."""
        ray = sys.modules.get("ray")
        if ray is None or not self.actors:
            return
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        paths = [log_dir / f"rank-{r}.log" for r in range(len(self.actors))]
        ray.get([a.redirect.remote(str(p)) for a, p in zip(self.actors, paths)], timeout=30)
        self._log_paths = paths
        if self._follower is not None:
            self._follower.move_to(paths)

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
                for r, nd in enumerate(self.nodes))
        elif self.actors:
            text += f"; {len(self.actors)} rank actors starting"
        return text

    def kill(self, grace_s: float = 2.0) -> None:
        """Kill the rank actors (Ray kills at once: there is no gentler way into an actor busy
        in its serve loop), then remove the placement group."""
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
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
        if self.pg is not None or self.actors or self._allocation is not None:
            self.kill(grace_s=0)
        self.pg, self.actors, self.nodes, self._done, self._codes = None, [], [], [], []
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

    def _describe(self, bundles: list[dict[str, float]]) -> str:
        kinds: dict[str, int] = {}
        for b in bundles:
            kinds[_fmt_bundle(b)] = kinds.get(_fmt_bundle(b), 0) + 1
        return " + ".join(f"{count}×{b}" for b, count in kinds.items()) + f" {self.strategy}"

    def _why_unplaceable(self, ray, bundles: list[dict[str, float]]) -> str:
        """Ray's scheduling state, and what the cluster has, in one line."""
        from ray.util.placement_group import placement_group_table

        try:
            table = placement_group_table(self.pg)
            state = table.get("stats", {}).get("scheduling_state") or table.get("state", "?")
            nodes = [nd for nd in ray.nodes() if nd.get("Alive")]
        except Exception as exc:
            return f"(could not ask Ray why: {exc})"
        fits = [nd for nd in nodes if any(_fits(b, nd["Resources"]) for b in bundles)]
        need = sorted({k for b in bundles for k in b})
        totals = {k: sum(nd["Resources"].get(k, 0.0) for nd in nodes) for k in need}
        parts = [f"Ray says {state}", f"cluster has {len(nodes)} node{'s' * (len(nodes) != 1)}"]
        if len(fits) < len(nodes):
            parts.append(f"{len(fits)} of them can hold a bundle")
        parts.append("total " + _fmt_bundle(totals))
        if self.strategy == "STRICT_SPREAD" and len(bundles) > len(fits):
            parts.append(f"STRICT_SPREAD needs {len(bundles)} distinct nodes")
        elif self.strategy == "STRICT_PACK" and not any(_fits(_sum(bundles), nd["Resources"]) for nd in nodes):
            parts.append(f"STRICT_PACK needs one node with {_fmt_bundle(_sum(bundles))}")
        elif any(totals[k] < sum(b.get(k, 0.0) for b in bundles) for k in need):
            parts.append(f"the gang needs {_fmt_bundle(_sum(bundles))}")
        else:
            parts.append("the resources are busy (other placement groups, actors or tasks)")
        return "; ".join(parts)

    def _reachable(self, rank_env: list[dict[str, str]]) -> list[dict[str, str]]:
        """Check ranks can reach the driver; move a loopback TCP rendezvous to rank 0's node."""
        here = socket.gethostname()
        elsewhere = sorted({nd["node_ip"] for nd in self.nodes if nd["host"] != here})
        control_host = rank_env[0].get(P.ENV_CONTROL, "").rpartition(":")[0]
        if elsewhere and _is_loopback(control_host):
            self.kill(grace_s=0)
            raise GangError(
                f"site {self.site!r} (ray): ranks were placed on other hosts ({', '.join(elsewhere)}) "
                f"but the driver listens on {control_host} only; set the site's driver_host "
                f"(auto, or an address they reach, e.g. this driver's Ray node IP "
                f"{sys.modules['ray'].util.get_node_ip_address()})")
        url = urlparse(rank_env[0].get(P.ENV_RDZV, ""))
        rank0 = self.nodes[0] if self.nodes else None
        if url.scheme == "tcp" and _is_loopback(url.hostname) and rank0 and rank0["host"] != here:
            port = sys.modules["ray"].get(self.actors[0].free_port.remote(rank0["node_ip"]), timeout=30)
            new = f"tcp://{rank0['node_ip']}:{port}"
            rank_env = [{**env, P.ENV_RDZV: new} for env in rank_env]
        return rank_env

    def _exitcode_of(self, rank: int, ref) -> int:
        ray = sys.modules["ray"]
        try:
            return int(ray.get(ref, timeout=5))
        except ray.exceptions.RayActorError as exc:
            self._note(rank, f"the rank's Ray actor died: {_first_line(exc)}")
            return _KILLED
        except ray.exceptions.RayTaskError as exc:
            self._note(rank, f"the rank's Ray actor failed: {_first_line(exc)}")
            return 1
        except Exception as exc:
            self._note(rank, f"the rank's Ray actor is lost: {type(exc).__name__}: {_first_line(exc)}")
            return _KILLED

    def _note(self, rank: int, text: str) -> None:
        """Append the launcher's reason to the rank's log, which the gang shows on failure."""
        try:
            with open(self._log_paths[rank], "a") as f:
                f.write(f"[phalanx ray] {text}\n")
        except (OSError, IndexError):
            pass


def release(record: dict) -> str:
    """Kill the rank actors and remove the placement group of a gang recorded by
    ``RayLauncher.launch`` (from any process; connects to the record's cluster if need be)."""
    ray = import_ray()
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    ours = not ray.is_initialized()
    if ours:
        RayLauncher(address=record["address"], namespace=record.get("namespace"), site="release").connect()
    elif ray.get_runtime_context().gcs_address != record["address"]:
        raise GangError(f"ray: this process is connected to the Ray cluster at "
                        f"{ray.get_runtime_context().gcs_address}, not {record['address']}")
    try:
        actors = 0
        for r in range(int(record.get("ranks", 0))):
            try:
                ray.kill(ray.get_actor(f"{record['id']}-rank{r}", namespace=record.get("namespace")),
                         no_restart=True)
                actors += 1
            except ValueError:  # no such live actor
                pass
        groups = [pg_id for pg_id, t in placement_group_table().items()
                  if t.get("name") == record["id"] and t.get("state") != "REMOVED"]
        for pg_id in groups:
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
    finally:
        if ours:
            ray.shutdown()
    if not (actors or groups):
        return f"ray: placement group {record['id']} already gone"
    return f"ray: removed placement group {record['id']} and killed {actors} rank actor(s)"


def _fits(bundle: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) >= v for k, v in bundle.items())


def _sum(bundles: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---- inside the actor ---------------------------------------------------------------------------
class _RankActor:
    """One rank.  ``serve`` runs the rank worker's main loop until the gang shuts it down."""

    def info(self) -> dict[str, Any]:
        import ray

        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), "host": socket.gethostname()}

    def redirect(self, log_path: str) -> None:
        """Send this rank's output to ``log_path`` from now on (while serve() runs)."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def free_port(self, host: str) -> int:
        from ..runtime.rendezvous import free_port

        return free_port(host)

    def serve(self, env: dict[str, str], log_path: str, command: list[str] | None = None,
              cwd: str | None = None, driver_python: str | None = None) -> int:
        """Run the rank; its exit code.  ``command`` None: the phalanx worker, in this process;
        else that program as a child process (a command stage), which dies with the actor."""
        import ray

        ctx = ray.get_runtime_context()
        env = dict(env)
        env.pop(P.ENV_CPUS, None)            # core ids mean nothing to Ray's CPU counts
        env.pop(P.ENV_CPUS_BY_RANK, None)
        env[P.ENV_PDEATHSIG] = "0"           # our parent is the raylet; Ray ends us with the job
        env[ENV_NODE_ID] = ctx.get_node_id()
        env[ENV_NODE_IP] = ray.util.get_node_ip_address()
        env[ENV_ACTOR_ID] = ctx.get_actor_id() or ""
        os.environ.update(env)
        if cwd and os.path.isdir(cwd):  # as for local ranks: the driver's directory, if here too
            os.chdir(cwd)
        # apps are pickled by reference: import what the driver imports (where it exists here)
        for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
            if entry and entry not in sys.path and os.path.isdir(entry):
                sys.path.insert(0, entry)

        self.redirect(log_path)
        if command is not None:
            return _run_command(command, driver_python)

        from ..runtime import worker

        try:
            code = worker.main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
        return int(code or 0)


def _is_worker(argv: Sequence[str]) -> bool:
    """Is ``argv`` the phalanx rank worker (``python -m phalanx.runtime.worker``)?"""
    return list(argv[-2:]) == ["-m", "phalanx.runtime.worker"]


def _run_command(command: list[str], driver_python: str | None) -> int:
    """A command stage's program on this rank, output to our (redirected) stdout/stderr."""
    import subprocess

    if driver_python and command and command[0] == driver_python:
        command = [sys.executable, *command[1:]]  # this node's Python, not the driver's path

    def die_with_actor() -> None:
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=die_with_actor)
    except OSError as exc:
        print(f"phalanx: cannot start {command[0]!r}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return 127
    return proc.wait()


# ---- driver side: echo rank logs ----------------------------------------------------------------
class _LogFollower(threading.Thread):
    """Follows the ranks' log files and echoes whole lines, prefixed ``[rank R]``."""

    def __init__(self, paths: list[Path], echo: bool | Callable[[str], None]):
        super().__init__(name="phalanx-ray-logs", daemon=True)
        self.paths = paths
        self.echo = echo
        self._stop_evt = threading.Event()
        self._files: dict[int, Any] = {}
        self._partial: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self._stop_evt.wait(0.2):
            self._poll()
        self._poll()
        for f in self._files.values():
            f.close()

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(timeout=2.0)

    def move_to(self, paths: list[Path]) -> None:
        with self._lock:
            self._poll_locked()
            for f in self._files.values():
                f.close()
            self._files.clear()
            self.paths = paths

    def _poll(self) -> None:
        with self._lock:
            self._poll_locked()

    def _poll_locked(self) -> None:
        for rank, path in enumerate(self.paths):
            f = self._files.get(rank)
            if f is None:
                try:
                    f = self._files[rank] = open(path, "rb")
                except OSError:
                    continue
            data = self._partial.get(rank, b"") + f.read()
            *lines, self._partial[rank] = data.split(b"\n")
            for line in lines:
                self._emit(rank, line.decode(errors="replace"))

    def _emit(self, rank: int, text: str) -> None:
        prefix = f"[rank {rank}] "
        if not text.startswith(prefix):
            text = prefix + text
        if callable(self.echo):
            self.echo(text)
        else:
            print(text, file=sys.stderr, flush=True)
