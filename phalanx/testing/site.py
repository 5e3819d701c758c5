"""A site of the executor contract (``ContractSite``) and how the contract looks for what a gang
leaves behind: rank processes, processes carrying a gang's id, SLURM jobs and steps, Ray actors
and placement groups, Kubernetes objects, RADICAL-Pilot sandboxes' processes.

A plug-in's site is usually ``ContractSite(name, data)``: ``data`` is a site file's mapping
(``executor: mine``, its ``mine:`` section, ``cores``...) and ``backend="local"`` (the default)
probes this host's processes.  An executor whose ranks live elsewhere subclasses it and extends
``leftovers`` and ``free_everything_seen``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.orchestrator.models import Site

N = 3  # ranks of the contract's gangs: uneven exchanges, a victim in the middle, spread over 3 nodes


# ---- probes: is anything of these gangs left? ------------------------------------------------
def pid_alive(pid: int) -> bool:
    """A process that exists and is no zombie (an unreaped rank is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def processes_of(gang_ids: set[str]) -> list[str]:
    """Processes of this host whose environment names one of ``gang_ids`` (ranks, srun,
    mpirun, a command's children...), other than this one."""
    if not gang_ids:
        return []
    wanted = [f"PHALANX_GANG_ID={g}\0".encode() for g in gang_ids]
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read() + b"\0"
            if any(w in env for w in wanted) and pid_alive(int(entry.name)):
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                out.append(f"process {entry.name} ({cmd[:80]})")
        except OSError:
            continue
    return out


@dataclass
class Seen:
    """What the contract learned about one site's gangs: ids, rank facts."""

    gang_ids: set[str] = field(default_factory=set)
    facts: list[dict] = field(default_factory=list)

    def add(self, gang_ids=(), facts=()) -> None:
        self.gang_ids |= {g for g in gang_ids if g}
        self.facts += [f for f in facts if f]


@dataclass
class ContractSite:
    """One site the executor contract runs on: ``data`` is its site file's mapping (tests get
    fresh ``Site`` models of it), the rest says what the site's resource manager does.

    ``impossible`` maps "more-ranks-than-it-has" and "an-impossible-request" to
    ``{"ranks": R, "site": {model keys over data}, "reason": regex of the gang's error}``;
    ``waiting`` is a regex of what the resource manager says of a gang queued for busy slots
    (``occupied()`` must then fill them).  Left empty, those tests skip.  As a context manager
    it frees, on exit, whatever the contract's gangs left."""

    name: str
    data: dict  # the site file's mapping, with the suite's settings
    backend: str = "local"  # local | slurm | ray | kubernetes | radical: which probes apply
    slurm_conf: str | None = None
    impossible: dict[str, dict] = field(default_factory=dict)  # what its resource manager refuses: id → request
    side_by_side: dict = field(default_factory=dict)  # model keys under which 3 runs of 1 rank fit at once
    waiting: str | None = None  # what the resource manager says of a gang waiting for busy slots (a regex)
    seen: Seen = field(default_factory=Seen)  # everything the suite's gangs ever were: freed at teardown

    def __enter__(self) -> ContractSite:
        return self

    def __exit__(self, *exc: object) -> None:
        # what the contract's gangs left is freed: a broken executor must not starve what follows
        self.free_everything_seen()

    def model(self, **update: Any) -> Site:
        """A fresh ``Site`` model of this site, ``update`` over its keys (``slurm={...}``
        merges into the section)."""
        from phalanx.orchestrator.models import Site
        from phalanx.orchestrator.yamlio import parse

        data = copy.deepcopy(self.data)
        for key, value in update.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return parse(Site, data, source=f"conformance site {self.name!r}")

    @property
    def executor(self) -> str:
        return self.data["executor"]

    def capacity(self) -> int:
        """Rank slots the site can ever give at once (the site model's answer)."""
        slots = self.model().capacity()
        assert slots is not None, f"site {self.name!r}: its model declares no capacity (the contract needs one)"
        return slots

    def can(self, capability: str) -> bool:
        """What the site's executor declares (``phalanx.executors.capabilities``)."""
        from phalanx.executors import capabilities

        return bool(getattr(capabilities(self.executor), capability))

    # -- leftovers ---------------------------------------------------------------------------
    def leftovers(self, gang_ids=(), facts=(), allocations: bool = True) -> list[str]:
        """What of these gangs (their ids, their ranks' facts) still exists: rank processes,
        processes carrying a gang's id, SLURM jobs and steps, Ray actors and placement groups.
        ``allocations=False``: not what outlives a gang by design while its run goes on (the
        SLURM pilot job its ranks ran in) — after a rank failure, say."""
        gang_ids = {g for g in gang_ids if g} | {f.get("PHALANX_GANG_ID") for f in facts if f.get("PHALANX_GANG_ID")}
        self.seen.add(gang_ids, facts)
        here = os.uname().nodename
        left = [
            f"rank {f['rank']}'s process {f['pid']}"
            for f in facts
            if f.get("host") in (here, None) and pid_alive(f["pid"])
        ]
        left += processes_of(gang_ids)
        if self.backend == "slurm":
            left += self._slurm_left(gang_ids, facts, allocations)
        if self.backend == "ray":
            left += self._ray_left(gang_ids, facts)
        if self.backend == "kubernetes":
            left += [f"kubernetes {what}" for what in self._k8s_objects(gang_ids)]
        if self.backend == "radical":
            left += self._radical_left(gang_ids, allocations)
        return left

    def wait_nothing_left(self, gang_ids=(), facts=(), within: float = 15.0, allocations: bool = True) -> list[str]:
        """``leftovers`` once it is empty, or what is still there after ``within`` seconds."""
        deadline = time.monotonic() + within
        while True:
            left = self.leftovers(gang_ids, facts, allocations)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    @contextlib.contextmanager
    def occupied(self):
        """Every slot of the site's resource manager held by something else (a SLURM job of all
        6 CPUs, a Ray placement group of every CPU) while the block runs; None where there is no
        resource manager to queue on."""
        if self.backend == "slurm":
            job = (
                self.slurm(
                    "sbatch",
                    "--parsable",
                    "--job-name=contract-blocker",
                    "-N3",
                    "-n6",
                    "-o",
                    "/dev/null",
                    "--wrap",
                    "sleep 600",
                )
                .strip()
                .split(";")[0]
            )
            try:
                deadline = time.monotonic() + 60
                while "RUNNING" not in self.slurm("squeue", "-h", "-j", job, "-o", "%T"):
                    assert time.monotonic() < deadline, f"the blocker job {job} did not start within 60 s"
                    time.sleep(0.1)
                yield f"slurm job {job}"
            finally:
                self.slurm("scancel", job)
        elif self.backend == "ray":
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group

            cpus = int(ray.cluster_resources().get("CPU", 0))
            pg = placement_group([{"CPU": 1}] * cpus, strategy="SPREAD", name=f"contract-blocker-{os.getpid()}")
            try:
                assert pg.wait(60), "the blocker placement group was not placed within 60 s"
                yield f"ray placement group of {cpus} CPUs"
            finally:
                remove_placement_group(pg)
        elif self.backend == "kubernetes":
            with self._k8s_blockers() as what:
                yield what
        else:
            yield None

    def host_pid(self, gang_id: str, rank: int, pid: int) -> int:
        """The pid of a gang's rank as this host sees it: a rank in a container (Kubernetes)
        reports its container's pid; its process is found by the gang id and rank in its
        environment."""
        if self.backend != "kubernetes":
            return pid
        want = [f"PHALANX_GANG_ID={gang_id}\0".encode(), f"PHALANX_RANK={rank}\0".encode()]
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    env = f.read() + b"\0"
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if all(w in env for w in want) and b"phalanx.runtime.worker" in cmd:
                return int(entry.name)
        raise AssertionError(f"no process of rank {rank} of gang {gang_id} on this host")

    # -- kubernetes --------------------------------------------------------------------------
    def _kube(self):
        from phalanx.executors.kubernetes.client import connect

        return connect(self.data["kubernetes"]["kubeconfig"])

    def _k8s_objects(self, gang_ids: set[str]) -> list[str]:
        """Jobs, pods, Secrets, Services and PodGroups phalanx made for one of these gangs."""
        if not gang_ids:
            return []
        kube, ns = self._kube(), self.data["kubernetes"].get("namespace", "default")
        selector = "app.kubernetes.io/managed-by=phalanx"
        found = [("job", j.metadata.name) for j in kube.batch.list_namespaced_job(ns, label_selector=selector).items]
        found += [("pod", p.metadata.name) for p in kube.core.list_namespaced_pod(ns, label_selector=selector).items]
        found += [
            ("secret", x.metadata.name) for x in kube.core.list_namespaced_secret(ns, label_selector=selector).items
        ]
        found += [
            ("service", x.metadata.name) for x in kube.core.list_namespaced_service(ns, label_selector=selector).items
        ]
        api = kube.pod_group_api("scheduling.k8s.io")
        if api:
            group, version = api.split("/")
            found += [
                ("podgroup", x["metadata"]["name"])
                for x in kube.custom.list_namespaced_custom_object(
                    group, version, ns, "podgroups", label_selector=selector
                )["items"]
            ]
        return [f"{kind} {name}" for kind, name in found if any(g.lower() in name for g in gang_ids)]

    @contextlib.contextmanager
    def _k8s_blockers(self):
        """A pod on every real node requesting all of its CPUs, running (sleep) until the block ends."""
        from kubernetes import client

        kube, ns = self._kube(), self.data["kubernetes"].get("namespace", "default")
        nodes = kube.core.list_node(label_selector="phalanx.dev/node=real").items
        names = []
        try:
            for node in nodes:
                name = f"contract-blocker-{os.getpid()}-{node.metadata.name.replace('.', '-')}"
                kube.core.create_namespaced_pod(
                    ns,
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": name},
                        "spec": {
                            "restartPolicy": "Never",
                            "terminationGracePeriodSeconds": 0,
                            "automountServiceAccountToken": False,
                            "nodeSelector": {"kubernetes.io/hostname": node.metadata.name},
                            "containers": [
                                {
                                    "name": "sleep",
                                    "image": self.data["kubernetes"]["image"],
                                    "imagePullPolicy": "Never",
                                    "command": ["/usr/bin/busybox", "sleep", "600"],
                                    "resources": {"requests": {"cpu": node.status.allocatable["cpu"]}},
                                }
                            ],
                        },
                    },
                )
                names.append(name)
            deadline = time.monotonic() + 60
            while any(kube.core.read_namespaced_pod(n, ns).status.phase != "Running" for n in names):
                assert time.monotonic() < deadline, "the blocker pods did not start within 60 s"
                time.sleep(0.2)
            yield f"kubernetes pods {', '.join(names)} holding every real node's CPUs"
        finally:
            for name in names:
                try:
                    kube.core.delete_namespaced_pod(name, ns, body=client.V1DeleteOptions(grace_period_seconds=0))
                except Exception:
                    pass

    # -- radical ----------------------------------------------------------------------------
    def _radical_sandboxes(self, gang_ids: set[str]) -> list[tuple[Path, Path]]:
        """(task sandbox, pilot sandbox) of these gangs' RP tasks: RP names a task's directory
        after its uid (phalanx-<gang id>), in its pilot's under the site's radical.sandbox."""
        root = Path(self.data["radical"]["sandbox"]) / "radical.pilot.sandbox"
        found = []
        for gang in gang_ids:
            for task in root.glob(f"*/*/*{gang}*"):
                if task.is_dir():
                    found.append((task, task.parent))
        return found

    def _radical_left(self, gang_ids: set[str], allocations: bool = True) -> list[str]:
        """Processes working in these gangs' task sandboxes (mpiexec, the ranks' wrappers) and,
        with ``allocations``, in their pilots' (RP's agent and its components)."""
        from phalanx.executors.radical.pilot import processes_in

        left = []
        for task, pilot in self._radical_sandboxes(gang_ids):
            for where, kind in ((task, "task"), (pilot, "pilot")) if allocations else ((task, "task"),):
                for pid in processes_in(where):
                    if pid_alive(pid):
                        try:
                            with open(f"/proc/{pid}/cmdline", "rb") as f:
                                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                        except OSError:
                            cmd = "?"
                        left.append(f"radical {kind} {where.name}: process {pid} ({cmd[:60]})")
        return list(dict.fromkeys(left))

    def slurm(self, *args: str) -> str:
        r = subprocess.run(
            list(args),
            env={**os.environ, "SLURM_CONF": self.slurm_conf or ""},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode:
            raise RuntimeError(f"{' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def _slurm_left(self, gang_ids: set[str], facts, allocations: bool = True) -> list[str]:
        """Jobs and steps squeue still lists that a rank ran in, or named after a gang."""
        jobs = {f["SLURM_JOB_ID"] for f in facts if f.get("SLURM_JOB_ID")} if allocations else set()
        steps = {
            f"{f['SLURM_JOB_ID']}.{f['SLURM_STEP_ID']}"
            for f in facts
            if f.get("SLURM_JOB_ID") and f.get("SLURM_STEP_ID")
        }
        left = []
        for what, flags, ids in (("job", [], jobs), ("step", ["-s"], steps)):
            for line in self.slurm("squeue", "-h", *flags, "-o", "%i %j").splitlines():
                ident, _, name = line.strip().partition(" ")
                if ident in ids or any(g in name for g in gang_ids):
                    left.append(f"slurm {what} {ident} ({name})")
        return left

    def _ray_left(self, gang_ids: set[str], facts) -> list[str]:
        import ray
        from ray.util.placement_group import placement_group_table

        left = [
            f"ray placement group {t['name']} {t['state']}"
            for t in placement_group_table().values()
            if any(g in (t.get("name") or "") for g in gang_ids) and t["state"] != "REMOVED"
        ]
        names = {f.get("ray_actor_name") for f in facts if f.get("ray_actor_name")}
        left += [
            f"ray actor {a['name']} (namespace {a['namespace']})"
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"] in names or any(g in a["name"] for g in gang_ids)
        ]
        return left

    def free_everything_seen(self) -> list[str]:
        """At the end of the site's tests: free whatever the suite's gangs left (a broken
        executor's leftovers must not starve the tests that follow); what was freed."""
        left = self.leftovers(self.seen.gang_ids, self.seen.facts)
        for f in self.seen.facts:
            if f.get("host") in (os.uname().nodename, None) and pid_alive(f["pid"]):
                try:
                    os.kill(f["pid"], signal.SIGKILL)
                except OSError:
                    pass
        if self.backend == "slurm":
            jobs = {f["SLURM_JOB_ID"] for f in self.seen.facts if f.get("SLURM_JOB_ID")}
            for line in self.slurm("squeue", "-h", "-o", "%i %j").splitlines():
                ident, _, name = line.strip().partition(" ")
                if ident in jobs or any(g in name for g in self.seen.gang_ids):
                    subprocess.run(
                        ["scancel", ident],
                        env={**os.environ, "SLURM_CONF": self.slurm_conf or ""},
                        capture_output=True,
                        timeout=60,
                    )
        if self.backend == "kubernetes":
            from phalanx.executors.kubernetes.launcher import delete_gang

            for what in self._k8s_objects(self.seen.gang_ids):
                kind, name = what.split(" ", 1)
                if kind == "job":
                    delete_gang(self._kube(), self.data["kubernetes"].get("namespace", "default"), name)
        if self.backend == "radical":
            from phalanx.executors.radical.pilot import sweep

            for _task, pilot in self._radical_sandboxes(self.seen.gang_ids):
                sweep(pilot, grace_s=1.0)
        if self.backend == "ray":
            import ray
            from ray.util.placement_group import PlacementGroup, placement_group_table

            for a in ray.util.list_named_actors(all_namespaces=True):
                if any(g in a["name"] for g in self.seen.gang_ids):
                    try:
                        ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]))
                    except Exception:
                        pass
            for pg_id, t in placement_group_table().items():
                if any(g in (t.get("name") or "") for g in self.seen.gang_ids) and t["state"] != "REMOVED":
                    try:
                        ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
                    except Exception:
                        pass
        return left
