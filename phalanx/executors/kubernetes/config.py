"""The ``kubernetes:`` section of a site file (and of a stage, over the site's), as a typed model.

Light on purpose: pydantic and ``executors.base`` only — never the ``kubernetes`` client — so
``phalanx validate`` and the published JSON Schemas read it where the extra is not installed.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator

from ..base import ExecutorConfig

GANG_MODES = ("auto", "native", "kueue", "volcano", "none")
Quantity = Union[int, float, str]  # "500m", 2, "4Gi": Kubernetes parses them
_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # an RFC 1123 label: namespaces, name prefixes


class KubernetesConfig(ExecutorConfig):
    """The ``kubernetes:`` section: which cluster and namespace, what each rank's pod holds and
    runs, and how the gang is scheduled.  A stage's own ``kubernetes:`` section overrides keys
    of the site's for its gangs."""

    kubeconfig: Optional[str] = Field(
        None,
        description="kubeconfig file (~ and $VARS expanded); default: KUBECONFIG, else ~/.kube/config, "
        "else the in-cluster service account",
    )
    context: Optional[str] = Field(None, description="kubeconfig context; default: its current one")
    namespace: str = Field("default", pattern=_NAME, max_length=63, description="namespace of the gangs' Jobs")
    image: Optional[str] = Field(
        None, description="container image of the ranks: it must hold the Python that runs phalanx (required)"
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Always | IfNotPresent | Never (local images)"
    )
    python: Optional[str] = Field(
        None,
        description="the interpreter in the image that runs ranks; default: the driver's own "
        "(sys.executable: right when host_paths shares it, else set e.g. python3)",
    )
    host_paths: Union[Literal["auto"], list[str]] = Field(
        default_factory=list,
        description="host directories mounted at the same path in every rank's pod "
        "(hostPath): 'auto' mounts the driver's Python environment, its sys.path and working directory "
        "read-only and the store's root read-write — nodes that share the driver's filesystem, as on an "
        "HPC cluster; a list names directories (read-write)",
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        description="further pod volumes (Kubernetes Volume objects: a PVC holding the store, a ConfigMap...)",
    )
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, description="their mounts in the rank container (VolumeMount objects)"
    )
    service_account: Optional[str] = Field(None, description="service account of the rank pods")
    node_selector: dict[str, str] = Field(default_factory=dict, description="node labels a rank's node must have")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="pod tolerations (Toleration objects)")
    cpu: Quantity = Field(1, description="CPU request of every rank (its thread count too, at least 1)")
    memory: Optional[Quantity] = Field(
        None,
        description="memory request of every rank (4Gi...); default: the site's memory_gb shared over its "
        "cores, else none",
    )
    cpu_limit: Optional[Quantity] = Field(None, description="CPU limit of every rank; default: none")
    memory_limit: Optional[Quantity] = Field(
        None,
        description="memory limit of every rank, enforced by the kubelet (a rank over it is OOMKilled and "
        "reported as out of memory); default: the memory request",
    )
    gpus: int = Field(0, ge=0, strict=True, description="GPUs of every rank (a limit of gpu_resource)")
    gpu_resource: str = Field("nvidia.com/gpu", description="the extended resource GPUs are counted in")
    network: Literal["host", "service"] = Field(
        "host",
        description="host: rank pods use their node's network (hostNetwork; the site's rendezvous "
        "and driver_host as given); service: pod network and a headless Service, rank 0's rendezvous at "
        "<job>-0.<service> (needs cluster DNS)",
    )
    rendezvous_port: int = Field(
        29400, ge=1, le=65535, strict=True, description="rank 0's rendezvous port with network: service"
    )
    gang: Literal["auto", "native", "kueue", "volcano", "none"] = Field(
        "auto",
        description="gang scheduling: auto (what the server offers: native PodGroup, else none) | "
        "native (scheduling.k8s.io Workload/PodGroup, minCount = ranks) | kueue (queue-name label) | volcano "
        "(Volcano PodGroup) | none",
    )
    queue: Optional[str] = Field(None, description="the Kueue LocalQueue (gang: kueue) or Volcano queue")
    workload: Literal["job", "jobset"] = Field(
        "job",
        description="job: each gang one Indexed Job | jobset: the same Indexed Job as the one replicated "
        "Job of a JobSet (jobset.x-k8s.io; its controller must be installed): for exclusive placement per "
        "topology domain and JobSet-aware tooling",
    )
    exclusive_topology: Optional[str] = Field(
        None,
        description="workload: jobset only: a node label (topology.kubernetes.io/zone, a rack label); each "
        "gang gets whole domains of it to itself (JobSet's exclusive placement)",
    )
    priority_class: Optional[str] = Field(None, description="priorityClassName of the rank pods")
    labels: dict[str, str] = Field(default_factory=dict, description="further labels of every object phalanx creates")
    annotations: dict[str, str] = Field(default_factory=dict, description="further annotations of the rank pods")
    env: dict[str, str] = Field(default_factory=dict, description="further environment of every rank")
    active_deadline_s: Optional[int] = Field(
        None, ge=1, strict=True, description="a gang's Job ends after this many seconds (DeadlineExceeded)"
    )
    ttl_after_finished_s: int = Field(
        600,
        ge=0,
        strict=True,
        description="Kubernetes deletes a finished Job after this long (phalanx deletes "
        "its own at once; this catches one a killed driver left)",
    )
    job_name: str = Field("phalanx", pattern=_NAME, max_length=20, description="prefix of the Jobs' names")
    grace_s: int = Field(5, ge=0, strict=True, description="terminationGracePeriodSeconds of the rank pods")

    @field_validator("cpu", "memory", "cpu_limit", "memory_limit")
    @classmethod
    def _quantity(cls, value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, bool) or (isinstance(value, (int, float)) and value <= 0):
            raise ValueError("must be a positive number or a Kubernetes quantity (500m, 4Gi)")
        if isinstance(value, str) and not value.strip():
            raise ValueError("must not be empty")
        return value

    def threads(self) -> int:
        """Each rank's thread count: its CPU request, at least one."""
        return max(1, int(cpu_cores(self.cpu)))


def cpu_cores(value: Quantity) -> float:
    """A CPU quantity in cores: ``"500m"`` → 0.5, ``2`` → 2.0."""
    text = str(value).strip()
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(text)


SITE_KEYS = tuple(KubernetesConfig.known_keys())

__all__ = ["GANG_MODES", "KubernetesConfig", "SITE_KEYS", "cpu_cores"]
