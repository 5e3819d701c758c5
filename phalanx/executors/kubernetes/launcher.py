"""``KubernetesLauncher``: one gang as one Indexed Job (pod index = rank), followed by a watch.

What the pods say is turned into the ``Launcher`` contract: an exit code per rank (a container's
own, ``-9`` for a pod Kubernetes ended — OOMKilled, Evicted, DeadlineExceeded, deleted — or
one that can never start — ImagePullBackOff...), Kubernetes' reason appended to the rank's log
(``[phalanx kubernetes] rank 1: pod ...: OOMKilled ...``, which the gang's error shows) and a
``status()`` line with the scheduler's word while pods wait (Unschedulable: 0/3 nodes...).
The ranks' output reaches ``log_dir/rank-R.log`` through the API server's log stream.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...errors import GangError
from ...runtime import protocol as P
from ..base import Echo, Launcher, held, released, shared_env
from ..logs import RankOutput
from ..network import is_loopback
from . import manifests as M
from .client import Kube, api_error
from .config import KubernetesConfig

log = logging.getLogger("phalanx.executors.kubernetes")
_KILLED = -int(signal.SIGKILL)
# a container waiting for one of these never starts by itself: the rank fails at once
HOPELESS_WAITING = {"ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName", "CreateContainerConfigError"}
# ...except these passing states of them: the kubelet retries, the gang's start timeout bounds it
# (a loaded kubelet's "failed to sync secret cache: timed out waiting for the condition")
TRANSIENT_WAITING_MESSAGES = ("failed to sync secret cache", "failed to sync configmap cache")


def hopeless(waiting: Any) -> bool:
    """A waiting container that will never start by itself."""
    message = waiting.message or ""
    return waiting.reason in HOPELESS_WAITING and not any(m in message for m in TRANSIENT_WAITING_MESSAGES)


_LOG_WAIT_S = 3.0  # at most this long for a finished rank's log to arrive before its code is told
_MERGE = "application/strategic-merge-patch+json"  # said, not left to the client: $patch: delete needs it
_told: set[tuple[str, str]] = set()  # (site, what): said once a process (prefer_hosts declining)


def _say_once(site: str, what: str, message: str) -> None:
    if (site, what) not in _told:
        _told.add((site, what))
        log.warning("%s", message)


class KubernetesLauncher(Launcher):
    """Starts a gang as an Indexed Job with its Secret (and PodGroup, Service), follows its
    pods through a watch, streams their logs, and deletes everything on ``kill``."""

    name = "kubernetes"
    # kubelet → API server → watch takes 0.5–1.1 s (measured), then the rank's log is let in
    exit_latency = _LOG_WAIT_S + 3.0

    def __init__(
        self,
        connect: Callable[[], Kube],
        config: KubernetesConfig,
        *,
        site: str = "kubernetes",
        echo: Echo = False,
        gang_api: Callable[[Kube], str | None] = lambda kube: None,
        host_mounts: Callable[[dict[str, str]], list[tuple[str, bool]]] = lambda env: [],
        workdir: str | None = None,
        memory: str | None = None,
    ):
        """``connect``: the cluster's APIs (made on first launch); ``gang_api``: the PodGroup
        apiVersion to use on that cluster (None: no gang object); ``host_mounts``: the hostPath
        mounts for a gang's environment; ``memory``: the request when the section sets none."""
        self._connect = connect
        self.config = config
        self.site = site
        self.echo = echo
        self._gang_api = gang_api
        self._host_mounts = host_mounts
        self.workdir = workdir
        self.memory = memory
        self.kube: Kube | None = None
        self._lock = threading.RLock()
        self.placed: list[str] = []  # per rank: the node prefer_hosts chose for the next launch ("" none)
        self._reset(0)

    def _reset(self, ranks: int) -> None:
        self.ranks = ranks
        self.job: str | None = None
        self.job_obj: dict | None = None
        self._pods: dict[int, Any] = {}  # rank → its pod (V1Pod), latest seen
        self._final: dict[int, tuple[int, str]] = {}  # rank → (exit code, Kubernetes' note) once ended
        self._final_at: dict[int, float] = {}
        self._causes: dict[int, str] = {}  # rank → why Kubernetes ended its pod (end_cause), where it says
        self._codes: list[int | None] = [None] * ranks
        self._notes: dict[int, str] = {}
        self._log_threads: dict[int, threading.Thread] = {}
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._killing = False
        self._allocation: dict | None = None
        self._output: RankOutput | None = None
        self._control_host = ""
        self.preferred: list[str] = []  # per rank: the node this gang's pod prefers ("" none; []: not placed)
        self._lifted: set[str] = set()  # pods whose placement gate was lifted

    def _site(self) -> str:
        return f"site {self.site!r} (kubernetes)"

    # ---- launch -------------------------------------------------------------------------------
    def placement(self, world_size: int) -> list[dict[str, str]]:
        return [{P.ENV_THREADS: str(self.config.threads())} for _ in range(world_size)]

    def prefer_hosts(self, hosts: Sequence[str]) -> bool:
        """Rank r's pod prefers the node ``hosts[r]`` names — the node's name or its
        ``kubernetes.io/hostname`` label ("", or a host that is no schedulable node the site's
        ``node_selector`` admits: no preference) — with a preferred node affinity of weight 100
        (``manifests.node_affinity``: a full node delays no rank).  The Job's one pod template
        cannot differ by rank, so the next launch's pods start behind a scheduling gate that
        the launcher lifts pod by pod, giving each its rank's affinity.  For the next launch
        only; ``placed`` says what was chosen.  False when none of ``hosts`` is such a node,
        or the cluster's nodes cannot be listed or its pods not patched (RBAC: said once)."""
        self.placed = []
        if not any(hosts):
            return False
        try:
            kube = self._connect()
            nodes = kube.core.list_node().items
        except Exception as exc:
            _say_once(
                self.site,
                "nodes",
                f"{self._site()}: cannot list the cluster's nodes ({api_error(exc)}): ranks are not "
                "placed on the hosts holding their input (RBAC: allow list on nodes)",
            )
            return False
        wanted = self.config.node_selector
        usable = [
            n
            for n in nodes
            if not (n.spec and n.spec.unschedulable)
            and all((n.metadata.labels or {}).get(k) == v for k, v in wanted.items())
        ]
        node_of = {n.metadata.name: n.metadata.name for n in usable}
        for n in usable:  # a node's own name first, then the host name it is labelled with
            label = (n.metadata.labels or {}).get(M.HOSTNAME_LABEL)
            if label:
                node_of.setdefault(label, n.metadata.name)
        placed = [node_of.get(h, "") if h else "" for h in hosts]
        if not any(placed) or not self._may_patch_pods(kube):
            return False
        self.placed = placed
        return True

    def _may_patch_pods(self, kube: Kube) -> bool:
        """Whether this client may patch pods in the namespace (to lift the placement gate)."""
        from kubernetes import client

        ns = self.config.namespace
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"namespace": ns, "verb": "patch", "resource": "pods"}},
        }
        try:
            allowed = bool(client.AuthorizationV1Api(kube.api).create_self_subject_access_review(review).status.allowed)
            why = "RBAC: allow patch on pods"
        except Exception as exc:
            allowed, why = False, api_error(exc)
        if not allowed:
            _say_once(
                self.site,
                "patch",
                f"{self._site()}: may not patch pods in namespace {ns!r} ({why}): ranks are not placed "
                "on the hosts holding their input",
            )
        return allowed

    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        cfg = self.config
        if not cfg.image:
            raise GangError(f"{self._site()}: kubernetes.image is required (the image the ranks run in)")
        with self._lock:
            if self.job is not None:
                self.kill(grace_s=0)
            self._reset(len(rank_env))
            if len(self.placed) == self.ranks:
                self.preferred = self.placed
            self.placed = []  # this launch's
            self.kube = kube = self._connect()
            env = shared_env(rank_env, (P.ENV_RANK,), "kubernetes")
            authkey = env.pop(P.ENV_AUTHKEY, "") or secrets.token_hex(16)
            env.update(
                {
                    P.ENV_PDEATHSIG: "0",  # PID 1 of its container: the kubelet is its parent
                    "PYTHONUNBUFFERED": "1",
                    **cfg.env,
                }
            )
            self._control_host = env.get(P.ENV_CONTROL, "").rpartition(":")[0]
            gang_id = env.get(P.ENV_GANG_ID) or f"{os.getpid()}-{time.time_ns()}"
            name = M.job_name(cfg.job_name, gang_id)
            if cfg.network == "service" and env.get(P.ENV_RDZV, "").startswith("tcp://"):
                env[P.ENV_RDZV] = f"tcp://{M.rank_host(cfg, name, 0)}:{cfg.rendezvous_port}"
            if cfg.workload == "jobset":
                self._ask(kube, self._need_jobset_api)
            argv = list(argv)
            if cfg.python and argv and argv[0] == sys.executable:
                argv[0] = cfg.python
            spec = M.GangSpec(
                name=name,
                ranks=len(rank_env),
                argv=argv,
                env=env,
                authkey=authkey,
                gang_id=gang_id,
                gang_api=self._ask(kube, self._gang_api),
                host_mounts=self._host_mounts(env),
                workdir=self.workdir,
                memory=self.memory,
                placed=self.preferred,
            )
            self._output = RankOutput(Path(log_dir), self.echo)
            for r in range(self.ranks):  # a rank that never starts still has a log to show
                (Path(log_dir) / f"rank-{r}.log").touch(mode=0o600)
            self.job = name
            self._allocation = {
                "executor": "kubernetes",
                "id": name,
                "namespace": cfg.namespace,
                "kubeconfig": kube.kubeconfig,
                "context": kube.context,
                "ranks": self.ranks,
            }
            held(self.allocation_hook, self._allocation)  # before it exists: deleted by its label
            try:
                self._ask(kube, lambda k: self._create(k, spec))
            except BaseException:
                self.kill(grace_s=0)
                raise
            self._watcher = threading.Thread(
                target=self._watch, args=(kube, name), daemon=True, name=f"phalanx-k8s-watch-{name}"
            )
            self._watcher.start()

    def _ask(self, kube: Kube, call: Callable[[Kube], Any]) -> Any:
        """``call(kube)``; a server that cannot be reached is a ``GangError`` naming it."""
        try:
            return call(kube)
        except GangError:
            raise
        except Exception as exc:
            if type(exc).__name__ == "ApiException":
                raise GangError(f"{self._site()}: the API server refused: {api_error(exc)}") from None
            raise GangError(
                f"{self._site()}: cannot reach the API server {kube.api.configuration.host}: {root_cause(exc)}"
            ) from None

    def _create(self, kube: Kube, spec: M.GangSpec) -> None:
        """The Secret and gang objects first (pods need them to start), then the Job; then the
        Job owns them all, so deleting it (or its TTL) deletes everything."""
        cfg = self.config
        ns = cfg.namespace
        first: list[tuple[dict, Callable[[dict], Any]]] = [
            (M.secret(cfg, spec), lambda b: kube.core.create_namespaced_secret(ns, b))
        ]
        group = M.pod_group(cfg, spec)
        if group is not None:
            api_group, version = group["apiVersion"].split("/")
            first.append(
                (group, lambda b: kube.custom.create_namespaced_custom_object(api_group, version, ns, "podgroups", b))
            )
        if cfg.network == "service" and cfg.workload == "job":  # a JobSet makes its own
            first.append((M.service(cfg, spec), lambda b: kube.core.create_namespaced_service(ns, b)))
        what = "Secret"
        try:
            for body, create in first:
                what = body["kind"]
                create(body)
            made = M.workload(cfg, spec)
            what = made["kind"]
            if what == "JobSet":
                self.job_obj = kube.custom.create_namespaced_custom_object(
                    M.JOBSET_GROUP, M.JOBSET_VERSION, ns, M.JOBSET_PLURAL, made
                )
            else:
                self.job_obj = kube.api.sanitize_for_serialization(kube.batch.create_namespaced_job(ns, made))
        except Exception as exc:
            if type(exc).__name__ != "ApiException":
                raise
            raise GangError(
                f"{self._site()}: cannot create the gang's {what} in namespace {ns!r}: {api_error(exc)}"
            ) from None
        owner = {"metadata": {"ownerReferences": [M.owner_reference(self.job_obj)]}}
        for body, _ in first:
            try:
                self._patch(kube, body, owner)
            except Exception as exc:  # not fatal: kill() and release() delete them by label too
                log.warning(
                    "%s: could not make %s %s the %s's: %s",
                    self._site(),
                    body["kind"],
                    spec.name,
                    self.job_obj.get("kind", "Job"),
                    api_error(exc),
                )

    def _need_jobset_api(self, kube: Kube) -> None:
        if not kube.serves(M.JOBSET_GROUP, M.JOBSET_VERSION, M.JOBSET_PLURAL):
            raise GangError(
                f"{self._site()}: kubernetes.workload: jobset, but the API server serves no "
                f"{M.JOBSET_GROUP}/{M.JOBSET_VERSION} JobSet (is the JobSet controller installed? "
                "https://jobset.sigs.k8s.io); use workload: job"
            )

    def _patch(self, kube: Kube, body: dict, patch: dict) -> None:
        ns, name = self.config.namespace, body["metadata"]["name"]
        if body["kind"] == "Secret":
            kube.core.patch_namespaced_secret(name, ns, patch)
        elif body["kind"] == "Service":
            kube.core.patch_namespaced_service(name, ns, patch)
        else:
            group, version = body["apiVersion"].split("/")
            kube.custom.patch_namespaced_custom_object(group, version, ns, "podgroups", name, patch)

    # ---- following the pods --------------------------------------------------------------------
    def _watch(self, kube: Kube, name: str) -> None:
        """Keeps ``_pods`` current from a watch of the Job's pods (re-listing when the watch's
        resource version expired), until ``kill``."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        selector = f"{M.JOB_LABEL}={name}"
        ns = self.config.namespace
        version = None
        while not self._stop.is_set():
            try:
                if version is None:
                    listed = kube.core.list_namespaced_pod(ns, label_selector=selector)
                    for pod in listed.items:
                        self._seen(pod, deleted=False)
                    version = listed.metadata.resource_version
                stream = watch.Watch()
                for event in stream.stream(
                    kube.core.list_namespaced_pod,
                    ns,
                    label_selector=selector,
                    resource_version=version,
                    timeout_seconds=5,
                    allow_watch_bookmarks=True,
                ):
                    if self._stop.is_set():
                        stream.stop()
                        break
                    obj = event["object"]
                    if event["type"] == "ERROR":  # the version is too old: list again
                        version = None
                        break
                    version = obj.metadata.resource_version
                    if event["type"] != "BOOKMARK":
                        self._seen(obj, deleted=event["type"] == "DELETED")
            except ApiException as exc:
                if exc.status == 410:
                    version = None
                    continue
                log.debug("watch of %s: %s", name, api_error(exc))
                self._stop.wait(0.5)
            except Exception as exc:  # the server went away for a moment: watch again
                log.debug("watch of %s: %s: %s", name, type(exc).__name__, exc)
                self._stop.wait(0.5)

    def _seen(self, pod: Any, deleted: bool) -> None:
        annotations = pod.metadata.annotations or {}
        try:
            rank = int(annotations[M.INDEX_ANNOTATION])
        except (KeyError, ValueError):
            return
        with self._lock:
            if rank >= self.ranks or self._killing:
                return
            self._pods[rank] = pod
            if rank in self._final:
                return
            ended = self._ended(rank, pod, deleted)
            self._start_log(rank, pod)
            if ended is not None:
                self._final[rank] = ended
                self._final_at[rank] = time.monotonic()
                cause = pod_end_cause(pod)
                if cause:
                    self._causes[rank] = cause
            gated = (
                ended is None
                and not deleted
                and pod.metadata.name not in self._lifted
                and any(g.name == M.PLACEMENT_GATE for g in pod.spec.scheduling_gates or [])
            )
            if gated:
                self._lifted.add(pod.metadata.name)
        if gated:
            self._lift_gate(rank, pod.metadata.name)

    def _lift_gate(self, rank: int, pod_name: str) -> None:
        """Give a gated rank pod its node affinity and let the scheduler have it; where the
        server refuses the affinity, the gate alone (the rank runs anywhere); where it refuses
        that too, the rank fails (a gated pod would wait out the start timeout)."""
        kube, ns = self.kube, self.config.namespace
        if kube is None:
            return
        node = self.preferred[rank] if rank < len(self.preferred) else ""
        try:
            kube.core.patch_namespaced_pod(pod_name, ns, M.placement_patch(node), _content_type=_MERGE)
            return
        except Exception as exc:
            first = api_error(exc)
        try:
            kube.core.patch_namespaced_pod(pod_name, ns, M.placement_patch(""), _content_type=_MERGE)
            log.warning(
                "%s: pod %s: no node affinity for %s (%s): it runs where it fits", self._site(), pod_name, node, first
            )
        except Exception as exc:
            if self._stop.is_set() or getattr(exc, "status", None) == 404:
                return
            with self._lock:
                if rank not in self._final:
                    self._final[rank] = (
                        _KILLED,
                        f"pod {pod_name}: cannot lift its scheduling gate {M.PLACEMENT_GATE}: {api_error(exc)}",
                    )
                    self._final_at[rank] = time.monotonic()

    def _ended(self, rank: int, pod: Any, deleted: bool) -> tuple[int, str] | None:
        """(exit code, Kubernetes' note) of a rank whose pod ended or can never start; else None."""
        status = pod.status
        where = f"pod {pod.metadata.name}" + (f" on node {pod.spec.node_name}" if pod.spec.node_name else "")
        host_ip = status.host_ip if self.config.network == "host" else status.pod_ip
        if host_ip and not is_loopback(host_ip) and is_loopback(self._control_host):
            return _KILLED, (
                f"{where} ({host_ip}) cannot reach the driver, which listens on "
                f"{self._control_host} only: set the site's driver_host (auto, or an address the "
                "pods reach)"
            )
        container = next((c for c in status.container_statuses or [] if c.name == M.CONTAINER), None)
        state = container.state if container else None
        if state is not None and state.terminated is not None:
            t = state.terminated
            code = int(t.exit_code)
            if t.reason == "OOMKilled":
                limit = ((pod.spec.containers[0].resources.limits or {}) if pod.spec.containers else {}).get("memory")
                return _KILLED, f"{where}: OOMKilled: out of memory (over its memory limit {limit or '?'})"
            if 128 < code < 128 + 65:  # killed by a signal: the runtime reports 128+N
                return -(code - 128), f"{where}: container {t.reason or 'killed'}" + (
                    f": {t.message}" if t.message else ""
                )
            return code, ""
        if state is not None and state.waiting is not None and hopeless(state.waiting):
            w = state.waiting
            return _KILLED, f"{where}: {w.reason}: {w.message or ''} (the rank never started)".replace(":  (", " (")
        if status.phase == "Failed":  # Evicted, DeadlineExceeded, a node lost...
            return _KILLED, f"{where}: {status.reason or 'Failed'}: {status.message or 'the pod failed'}"
        if status.phase == "Succeeded":
            return 0, ""
        if deleted:
            return _KILLED, f"{where}: deleted before its rank ended (by another client, or its node went away)"
        return None

    def _start_log(self, rank: int, pod: Any) -> None:
        """Stream the rank container's output into ``rank-R.log`` once it has started."""
        if rank in self._log_threads or self._output is None:
            return
        container = next((c for c in pod.status.container_statuses or [] if c.name == M.CONTAINER), None)
        if (
            container is None
            or container.state is None
            or (container.state.running is None and container.state.terminated is None)
        ):
            return
        thread = threading.Thread(
            target=self._follow_log, args=(rank, pod.metadata.name), daemon=True, name=f"phalanx-k8s-log-{rank}"
        )
        self._log_threads[rank] = thread
        thread.start()

    def _follow_log(self, rank: int, pod_name: str) -> None:
        output, kube = self._output, self.kube
        if output is None or kube is None:
            return
        pending = b""
        try:
            resp = kube.core.read_namespaced_pod_log(
                pod_name, self.config.namespace, container=M.CONTAINER, follow=True, _preload_content=False
            )
            for chunk in resp.stream(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    output.write(rank, line + b"\n")
                if self._stop.is_set():
                    break
            resp.release_conn()
        except Exception as exc:
            if not self._stop.is_set():
                output.write(
                    rank, f"[phalanx kubernetes] could not read the log of pod {pod_name}: {api_error(exc)}\n".encode()
                )
        if pending:
            output.write(rank, pending + b"\n")

    # ---- Launcher --------------------------------------------------------------------------------
    def end_cause(self, rank: int) -> str | None:
        with self._lock:
            return self._causes.get(rank)

    def exitcodes(self) -> list[int | None]:
        with self._lock:
            now = time.monotonic()
            for rank, (code, note) in self._final.items():
                if self._codes[rank] is not None:
                    continue
                thread = self._log_threads.get(rank)
                if thread is not None and thread.is_alive() and now - self._final_at[rank] < _LOG_WAIT_S:
                    continue  # the gang shows a failed rank's log tail: let it arrive first
                if note:
                    self._notes[rank] = note
                    if self._output is not None:
                        self._output.write(rank, f"[phalanx kubernetes] rank {rank}: {note}\n".encode())
                self._codes[rank] = code
            return list(self._codes)

    def status(self) -> str | None:
        """Kubernetes' view of the gang: its Job, how many pods are in which phase, and why the
        first waiting one waits (the scheduler's message, an image pull...)."""
        if self.job is None:
            return None
        with self._lock:
            pods = dict(self._pods)
        phases: dict[str, int] = {}
        for rank in range(self.ranks):
            pod = pods.get(rank)
            phase = pod.status.phase if pod is not None else "not created"
            phases[phase] = phases.get(phase, 0) + 1
        why = _waiting_reason(list(pods.values()))
        counts = ", ".join(f"{n} {phase}" for phase, n in phases.items())
        gang = f"; gang scheduled as PodGroup {self.job}" if self._gang_api_used() else ""
        near = ", ".join(f"{r}: {n}" for r, n in enumerate(self.preferred) if n)
        near = f"; ranks prefer nodes {near}" if near else ""
        return (
            f"kubernetes: job {self.config.namespace}/{self.job}: pods {counts}"
            + (f" ({why})" if why else "")
            + gang
            + near
        )

    def _gang_api_used(self) -> bool:
        spec = M.pod_spec(self.job_obj or {})
        return "schedulingGroup" in spec or spec.get("schedulerName") == "volcano"

    def reason(self) -> str | None:
        return next((f"kubernetes: rank {r}: {n}" for r, n in sorted(self._notes.items())), None)

    def memory_note(self, rank: int) -> str:
        note = self._notes.get(rank) or (self._final.get(rank) or (0, ""))[1]
        return f" (kubernetes: {note})" if note else ""

    def redirect(self, log_dir: Path) -> bool:
        if self._output is None:
            return False
        self._output.move_to(Path(log_dir))
        return True

    def kill(self, grace_s: float = 2.0) -> None:
        """Delete the Job (its pods get ``grace_s`` to end), its Secret, PodGroup and Service, and
        wait until no pod of it is left running."""
        with self._lock:
            name, kube = self.job, self.kube
            if name is None or kube is None or self._killing:
                return
            self._killing = True
            live = [r for r in range(self.ranks) if r not in self._final]
        try:
            delete_gang(kube, self.config.namespace, name, grace_s=int(grace_s))
            if live:
                _wait_pods_gone(kube, self.config.namespace, name, timeout=grace_s + 30)
        except Exception as exc:  # the API server is gone: the run DB and the exit handler hold it
            log.warning("%s: could not delete job %s: %s", self._site(), name, api_error(exc))
            return
        finally:
            self._stop.set()
            for thread in list(self._log_threads.values()):
                thread.join(timeout=1.0)
            if self._output is not None:
                self._output.close()
        with self._lock:
            for rank in range(self.ranks):
                if self._codes[rank] is None:
                    self._codes[rank] = self._final.get(rank, (-int(signal.SIGTERM), ""))[0]
            record, self._allocation = self._allocation, None
        if record is not None:
            released(self.allocation_hook, record)


def root_cause(exc: BaseException) -> str:
    """The innermost reason of a connection error (urllib3 wraps it twice)."""
    reason = getattr(exc, "reason", None)
    while isinstance(reason, BaseException):
        inner = getattr(reason, "reason", None)
        if inner is None:
            break
        reason = inner
    return str(reason or exc)


# Why Kubernetes took a pod away, as retry policies name it: the reason of its DisruptionTarget
# condition (a deleted pod) or of its failed phase
_DISRUPTION_CAUSE = {
    "PreemptionByScheduler": "preempted",  # a higher-priority pod needed its node
    "EvictionByEvictionAPI": "preempted",  # drained (kubectl drain, a cluster autoscaler)
    "DeletionByTaintManager": "node_lost",  # its node became unreachable / NoExecute taint
    "DeletionByPodGC": "node_lost",  # its node is gone
    "TerminationByKubelet": "node_lost",  # node shutdown or pressure
}
_PHASE_CAUSE = {"Evicted": "preempted", "NodeLost": "node_lost", "Shutdown": "node_lost", "DeadlineExceeded": "timeout"}


def pod_end_cause(pod: Any) -> str | None:
    """Why Kubernetes ended a rank's pod, in the words of retry policies: "oom" (the container
    was OOMKilled), "preempted" (preempted or evicted), "node_lost" (its node went away),
    "timeout" (activeDeadlineSeconds); None where the rank simply exited."""
    status = pod.status
    for c in status.container_statuses or []:
        if c.name == M.CONTAINER and c.state is not None and c.state.terminated is not None:
            if c.state.terminated.reason == "OOMKilled":
                return "oom"
    for cond in status.conditions or []:
        if cond.type == "DisruptionTarget" and cond.status == "True" and cond.reason in _DISRUPTION_CAUSE:
            return _DISRUPTION_CAUSE[cond.reason]
    return _PHASE_CAUSE.get(status.reason or "") if status.phase == "Failed" else None


def _waiting_reason(pods: Sequence[Any]) -> str:
    """Why the gang's pods wait: the scheduler's own message where a pod has one (with gang
    scheduling the pods that would fit only say they wait for the group: the one that does
    not fit says why), else a container's waiting reason."""
    scheduled = [
        c for pod in pods for c in pod.status.conditions or [] if c.type == "PodScheduled" and c.status == "False"
    ]
    for cond in sorted(scheduled, key=lambda c: (c.message or "").startswith(_GROUP_WAIT)):
        return f"{cond.reason}: {cond.message}" if cond.message else str(cond.reason)
    for pod in pods:
        for c in pod.status.container_statuses or []:
            w = c.state.waiting if c.state is not None else None
            if w is not None and w.reason not in (None, "ContainerCreating"):
                return f"{w.reason}: {w.message}" if w.message else str(w.reason)
    return ""


_GROUP_WAIT = "pod group is unschedulable"  # native gang scheduling's word for "waiting for the others"


def delete_gang(kube: Kube, namespace: str, name: str, grace_s: int = 0) -> list[str]:
    """Delete a gang's JobSet, Job, pods, Secret, Service and PodGroup (whatever of them exists);
    the kinds deleted, e.g. ``["job", "2 pods", "secret"]``."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    done: list[str] = []
    selector = f"{M.GANG_LABEL}={name}"

    def gone(call: Callable[[], Any], what: str) -> None:
        try:
            call()
            done.append(what)
        except ApiException as exc:
            if exc.status != 404:
                raise

    gone(
        lambda: kube.custom.delete_namespaced_custom_object(  # workload: jobset (its Job goes with it)
            M.JOBSET_GROUP, M.JOBSET_VERSION, namespace, M.JOBSET_PLURAL, name, propagation_policy="Background"
        ),
        "jobset",
    )
    gone(
        lambda: kube.batch.delete_namespaced_job(
            name, namespace, body=client.V1DeleteOptions(propagation_policy="Background")
        ),
        "job",
    )
    pods = kube.core.list_namespaced_pod(namespace, label_selector=selector).items
    live = [p for p in pods if p.metadata.deletion_timestamp is None]
    if live:
        gone(
            lambda: kube.core.delete_collection_namespaced_pod(
                namespace, label_selector=selector, grace_period_seconds=grace_s
            ),
            f"{len(live)} pods",
        )
    gone(lambda: kube.core.delete_namespaced_secret(name, namespace), "secret")
    gone(lambda: kube.core.delete_namespaced_service(name, namespace), "service")
    for group, version in _pod_group_apis(kube):
        gone(
            functools.partial(
                kube.custom.delete_namespaced_custom_object, group, version, namespace, "podgroups", name
            ),
            "podgroup",
        )
    return done


def _pod_group_apis(kube: Kube) -> list[tuple[str, str]]:
    apis = filter(None, (kube.pod_group_api(g) for g in (M.NATIVE_GROUP, M.VOLCANO_GROUP)))
    return [(group, version) for group, _, version in (api.partition("/") for api in apis)]  # "group/version"


def _wait_pods_gone(kube: Kube, namespace: str, name: str, timeout: float) -> None:
    """Until no pod of the gang is left (a watch of their deletions), at most ``timeout`` s."""
    from kubernetes import watch

    selector = f"{M.GANG_LABEL}={name}"
    listed = kube.core.list_namespaced_pod(namespace, label_selector=selector)
    left = {p.metadata.name for p in listed.items}
    deadline = time.monotonic() + timeout
    version = listed.metadata.resource_version
    while left and time.monotonic() < deadline:
        stream = watch.Watch()
        for event in stream.stream(
            kube.core.list_namespaced_pod,
            namespace,
            label_selector=selector,
            resource_version=version,
            timeout_seconds=max(1, int(deadline - time.monotonic())),
        ):
            version = event["object"].metadata.resource_version
            if event["type"] == "DELETED":
                left.discard(event["object"].metadata.name)
            if not left:
                stream.stop()
                break
    if left:
        log.warning("pods of job %s still terminating after %.0f s: %s", name, timeout, ", ".join(sorted(left)))


__all__ = ["KubernetesLauncher", "delete_gang"]
