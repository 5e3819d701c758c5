"""The objects one gang is made of, as plain manifests (dicts): an Indexed Job whose pod index is
the rank (or, with ``workload: jobset``, a JobSet holding that Job), a Secret holding the control
connection's key, and — by the site's choices — a headless Service (``network: service``) and a
PodGroup (native or Volcano gang scheduling).

Pure functions of the config and the gang: no client, no cluster, so what phalanx creates can
be printed (``phalanx`` docs show one in full) and checked in unit tests.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import KubernetesConfig

MANAGED_BY = "app.kubernetes.io/managed-by"
GANG_LABEL = "phalanx.dev/gang"  # every object of one gang: what release() deletes by
JOB_LABEL = "phalanx.dev/job"  # the rank pods of one Job: what the launcher watches
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
CONTAINER = "rank"
SECRET_KEY = "authkey"
NATIVE_GROUP = "scheduling.k8s.io"
VOLCANO_GROUP = "scheduling.volcano.sh"
JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
REPLICATED_JOB = "r"  # short: a rank's hostname <jobset>-r-0-<index> stays within 63 characters
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# holds a gang's pods back from the scheduler until the launcher gave each its rank's node
# affinity (one pod template serves every index of a Job: no per-rank field in it)
PLACEMENT_GATE = "phalanx.dev/placement"
PLACEMENT_WEIGHT = 100  # the most a preferred term weighs (1-100): ahead of the scheduler's other scores


def job_name(prefix: str, gang_id: str) -> str:
    """A Job name (RFC 1123, ≤ 52 characters so pod hostnames ``<job>-<index>`` fit in 63) from
    the gang id, with a random tail: a retried gang never meets its predecessor's Job."""
    stem = re.sub(r"[^a-z0-9-]+", "-", f"{prefix}-{gang_id}".lower()).strip("-")
    return f"{stem[:46].rstrip('-')}-{secrets.token_hex(2)}"


@dataclass
class GangSpec:
    """What one gang's objects are made from, beyond the site's config."""

    name: str  # the Job's (and its Secret's, Service's, PodGroup's) name
    ranks: int
    argv: Sequence[str]
    env: Mapping[str, str]  # the same for every rank (base.shared_env), less the key
    authkey: str  # hex: goes into the Secret only, never into the Job
    gang_id: str = ""
    gang_api: str | None = None  # "scheduling.k8s.io/v1alpha2" etc.: the PodGroup's apiVersion
    host_mounts: Sequence[tuple[str, bool]] = ()  # (path, read_only): hostPath volumes at the same path
    workdir: str | None = None
    memory: str | None = None  # the request when the section sets none (site's memory_gb)
    labels: dict[str, str] = field(default_factory=dict)
    placed: Sequence[str] = ()  # per rank: the node it prefers ("" none; empty: no placement)


def labels(cfg: KubernetesConfig, spec: GangSpec) -> dict[str, str]:
    return {**cfg.labels, MANAGED_BY: "phalanx", GANG_LABEL: spec.name, **spec.labels}


def _meta(cfg: KubernetesConfig, spec: GangSpec, name: str | None = None) -> dict[str, Any]:
    return {"name": name or spec.name, "namespace": cfg.namespace, "labels": labels(cfg, spec)}


def secret(cfg: KubernetesConfig, spec: GangSpec) -> dict[str, Any]:
    """The control connection's key, read by the ranks through ``secretKeyRef``: the Job (and
    ``kubectl describe``) never shows it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(cfg, spec),
        "type": "Opaque",
        "stringData": {SECRET_KEY: spec.authkey},
    }


def service(cfg: KubernetesConfig, spec: GangSpec) -> dict[str, Any]:
    """A headless Service naming every rank pod ``<job>-<index>.<job>`` before it is ready (rank
    0's rendezvous must resolve while the others start)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cfg, spec),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: spec.name},
            "ports": [{"name": "rendezvous", "port": cfg.rendezvous_port}],
        },
    }


def pod_group(cfg: KubernetesConfig, spec: GangSpec) -> dict[str, Any] | None:
    """The PodGroup that makes the scheduler place all ranks or none (None: no gang object)."""
    if not spec.gang_api:
        return None
    group = spec.gang_api.split("/")[0]
    if group == NATIVE_GROUP:
        return {
            "apiVersion": spec.gang_api,
            "kind": "PodGroup",
            "metadata": _meta(cfg, spec),
            "spec": {"schedulingPolicy": {"gang": {"minCount": spec.ranks}}},
        }
    if group == VOLCANO_GROUP:
        body: dict[str, Any] = {"minMember": spec.ranks}
        if cfg.queue:
            body["queue"] = cfg.queue
        return {"apiVersion": spec.gang_api, "kind": "PodGroup", "metadata": _meta(cfg, spec), "spec": body}
    raise ValueError(f"no PodGroup for {spec.gang_api!r}")


def resources(cfg: KubernetesConfig, spec: GangSpec) -> dict[str, dict[str, str]]:
    """A rank container's requests and limits: the memory limit defaults to the request, so the
    kubelet enforces what the site promised."""
    requests: dict[str, str] = {"cpu": str(cfg.cpu)}
    limits: dict[str, str] = {}
    memory = cfg.memory if cfg.memory is not None else spec.memory
    if memory is not None:
        requests["memory"] = str(memory)
    limit = cfg.memory_limit if cfg.memory_limit is not None else memory
    if limit is not None:
        limits["memory"] = str(limit)
    if cfg.cpu_limit is not None:
        limits["cpu"] = str(cfg.cpu_limit)
    if cfg.gpus:
        limits[cfg.gpu_resource] = str(cfg.gpus)
    return {"requests": requests, **({"limits": limits} if limits else {})}


def _env(spec: GangSpec) -> list[dict[str, Any]]:
    from ...runtime import protocol as P
    from ...runtime.envvars import ENV_NODE, ENV_POD

    out: list[dict[str, Any]] = [
        # the pod's index is its rank (JOB_COMPLETION_INDEX too; PHALANX_RANK for command stages)
        {"name": P.ENV_RANK, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
        {"name": P.ENV_AUTHKEY, "valueFrom": {"secretKeyRef": {"name": spec.name, "key": SECRET_KEY}}},
        # where the rank runs for the driver's records: a container's hostname and pid say little
        {"name": ENV_NODE, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": ENV_POD, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": P.ENV_HOST, "value": f"$({ENV_NODE})/$({ENV_POD})"},
    ]
    out += [{"name": k, "value": v} for k, v in spec.env.items()]
    return out


def job(cfg: KubernetesConfig, spec: GangSpec) -> dict[str, Any]:
    """The gang's Indexed Job: ``completions = parallelism = ranks``, no retries of a pod (the
    stage retries on a fresh gang), and a failed or disrupted pod fails the whole Job."""
    meta = labels(cfg, spec)
    pod_labels = {**meta, JOB_LABEL: spec.name}
    volumes = [
        {"name": f"host-{i}", "hostPath": {"path": path, "type": "Directory"}}
        for i, (path, _) in enumerate(spec.host_mounts)
    ] + list(cfg.volumes)
    mounts = [
        {"name": f"host-{i}", "mountPath": path, "readOnly": ro} for i, (path, ro) in enumerate(spec.host_mounts)
    ] + list(cfg.volume_mounts)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": cfg.image,
        "imagePullPolicy": cfg.image_pull_policy,
        "command": list(spec.argv),
        "env": _env(spec),
        "resources": resources(cfg, spec),
    }
    if mounts:
        container["volumeMounts"] = mounts
    if spec.workdir:
        container["workingDir"] = spec.workdir
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": cfg.grace_s,
        "enableServiceLinks": False,
        "containers": [container],
    }
    if cfg.network == "host":
        pod.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    else:
        pod["subdomain"] = spec.name  # hostname <job>-<index>: the headless Service's names
    if cfg.service_account:
        pod["serviceAccountName"] = cfg.service_account
    else:  # ranks never talk to the API server
        pod["automountServiceAccountToken"] = False
    for key, value in (
        ("nodeSelector", cfg.node_selector),
        ("tolerations", cfg.tolerations),
        ("volumes", volumes),
        ("priorityClassName", cfg.priority_class),
    ):
        if value:
            pod[key] = value
    if any(spec.placed):  # the launcher lifts it per pod, with the rank's node affinity
        pod["schedulingGates"] = [{"name": PLACEMENT_GATE}]
    annotations = dict(cfg.annotations)
    if spec.gang_api and spec.gang_api.startswith(NATIVE_GROUP + "/"):
        pod["schedulingGroup"] = {"podGroupName": spec.name}
    elif spec.gang_api and spec.gang_api.startswith(VOLCANO_GROUP + "/"):
        pod["schedulerName"] = "volcano"
        annotations["scheduling.k8s.io/group-name"] = spec.name
    template: dict[str, Any] = {"metadata": {"labels": pod_labels}, "spec": pod}
    if annotations:
        template["metadata"]["annotations"] = annotations
    body: dict[str, Any] = {
        "completions": spec.ranks,
        "parallelism": spec.ranks,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "ttlSecondsAfterFinished": cfg.ttl_after_finished_s,
        "podFailurePolicy": {
            "rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]}},
                {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]},
            ]
        },
        "template": template,
    }
    if cfg.active_deadline_s:
        body["activeDeadlineSeconds"] = cfg.active_deadline_s
    job_meta = _meta(cfg, spec)
    if cfg.gang == "kueue":  # Kueue admits the whole Job's quota at once, then unsuspends it
        body["suspend"] = True
        if cfg.queue:
            job_meta["labels"]["kueue.x-k8s.io/queue-name"] = cfg.queue
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": job_meta, "spec": body}


def jobset(cfg: KubernetesConfig, spec: GangSpec) -> dict[str, Any]:
    """``workload: jobset``: the gang's Indexed Job (as :func:`job` makes it) as the one
    replicated Job of a JobSet that never restarts it (the stage retries on a fresh gang).
    With ``network: service`` the JobSet makes the headless Service itself (named as the gang)."""
    inner = job(cfg, spec)
    body = dict(inner["spec"])
    ttl = body.pop("ttlSecondsAfterFinished")
    suspend = body.pop("suspend", False)  # kueue: the JobSet is what Kueue admits
    js: dict[str, Any] = {
        "failurePolicy": {"maxRestarts": 0},
        "network": {
            "enableDNSHostnames": cfg.network == "service",
            **({"subdomain": spec.name} if cfg.network == "service" else {}),
        },
        "replicatedJobs": [
            {
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {"metadata": {"labels": labels(cfg, spec)}, "spec": body},
            }
        ],
        "ttlSecondsAfterFinished": ttl,
    }
    if suspend:
        js["suspend"] = True
    meta = inner["metadata"]
    if cfg.exclusive_topology:
        meta["annotations"] = {EXCLUSIVE_TOPOLOGY: cfg.exclusive_topology}
    return {"apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}", "kind": "JobSet", "metadata": meta, "spec": js}


def workload(cfg: KubernetesConfig, spec: GangSpec) -> dict[str, Any]:
    """The object that makes the gang's pods: the Job, or the JobSet holding it."""
    return jobset(cfg, spec) if cfg.workload == "jobset" else job(cfg, spec)


def pod_spec(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The rank pods' spec inside a Job or a JobSet manifest."""
    spec = obj.get("spec") or {}
    if obj.get("kind") == "JobSet":
        spec = (spec.get("replicatedJobs") or [{}])[0].get("template", {}).get("spec", {})
    return spec.get("template", {}).get("spec", {})


def node_affinity(node: str) -> dict[str, Any]:
    """A pod's preference for the node named ``node`` (its ``metadata.name``): preferred, not
    required, so a full, cordoned or tainted node delays no rank — it runs elsewhere and reads
    its input over the network (with a required term it would stay Pending, and with gang
    scheduling hold the whole gang, until the start timeout)."""
    return {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": PLACEMENT_WEIGHT,
                    "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]},
                }
            ]
        }
    }


def placement_patch(node: str) -> dict[str, Any]:
    """The strategic merge patch that gives a gated rank pod its node affinity (``node``; ""
    none) and lifts :data:`PLACEMENT_GATE` (other gates stay).  Kubernetes lets a pod's
    scheduling directives change while it is gated (KEP-3838; a preferred term freely)."""
    spec: dict[str, Any] = {"schedulingGates": [{"$patch": "delete", "name": PLACEMENT_GATE}]}
    if node:
        spec["affinity"] = node_affinity(node)
    return {"spec": spec}


def rank_host(cfg: KubernetesConfig, name: str, rank: int) -> str:
    """A rank pod's DNS name under ``network: service``: ``<job>-<index>.<service>``; a
    JobSet's pods are ``<jobset>-<replicated job>-<job index>-<index>``."""
    pod = f"{name}-{REPLICATED_JOB}-0-{rank}" if cfg.workload == "jobset" else f"{name}-{rank}"
    return f"{pod}.{name}.{cfg.namespace}.svc"


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """Makes an object the gang's Job's (or JobSet's): Kubernetes' garbage collector deletes it
    with its owner."""
    meta = owner["metadata"]
    return {
        "apiVersion": owner.get("apiVersion") or "batch/v1",
        "kind": owner.get("kind") or "Job",
        "name": meta["name"],
        "uid": meta["uid"],
        "blockOwnerDeletion": False,
        "controller": False,
    }


__all__ = [
    "CONTAINER",
    "GANG_LABEL",
    "GangSpec",
    "INDEX_ANNOTATION",
    "JOB_LABEL",
    "PLACEMENT_GATE",
    "job",
    "job_name",
    "jobset",
    "labels",
    "node_affinity",
    "owner_reference",
    "placement_patch",
    "pod_group",
    "pod_spec",
    "rank_host",
    "resources",
    "secret",
    "service",
    "workload",
]
