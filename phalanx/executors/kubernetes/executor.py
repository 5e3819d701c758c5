"""``KubernetesExecutor``: the ``kubernetes`` executor — every gang an Indexed Job, scheduled
all-or-nothing where the cluster can (see the package docstring)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ...errors import GangError
from ...runtime import protocol as P
from ...runtime.envvars import ENV_SPILL, ENV_STORE, ENV_STORE_METADATA
from ..base import PROBE_S, Capabilities, Echo, Executor, gpu_key
from . import manifests as M
from .client import Kube, api_error, connect
from .config import KubernetesConfig
from .launcher import KubernetesLauncher, delete_gang, root_cause


class KubernetesExecutor(Executor[KubernetesConfig]):
    """Gangs as Indexed Jobs on a Kubernetes cluster.  The API server decides where and when
    pods run (``capacity()`` is None unless the site caps its cores): a gang waits in the
    scheduler's queue, all of it or none with gang scheduling, within the site's start timeout."""

    name = "kubernetes"
    config_model = KubernetesConfig
    capabilities = Capabilities(
        reuse_gangs=True, pins_cpus=False, warm_pool=False, runs_commands=True, mpi_world=False, remote_ranks=True
    )

    @staticmethod
    def release(record: dict) -> str:
        """Delete a gang's Job, pods, Secret, Service and PodGroup from any process."""
        kube = connect(record.get("kubeconfig"), record.get("context"), site="release")
        done = delete_gang(kube, record["namespace"], record["id"])
        where = f"{record['namespace']}/{record['id']}"
        return (
            f"kubernetes: deleted {', '.join(done)} of job {where}" if done else f"kubernetes: job {where} already gone"
        )

    def with_gpus(self, config: KubernetesConfig, gpus_per_rank: int | None) -> KubernetesConfig:
        """Every rank pod's limit of ``gpu_resource`` (nvidia.com/gpu)."""
        return gpu_key(config, "gpus", gpus_per_rank, "kubernetes.gpus")

    def check(self, ranks: int, config: KubernetesConfig | None = None) -> None:
        cfg = self.effective_config(config)
        if not cfg.image:
            raise ValueError("kubernetes.image: required — the container image the ranks run in")
        if cfg.gang == "kueue" and not cfg.queue:
            raise ValueError("kubernetes.queue: gang: kueue needs the LocalQueue to submit to")
        if cfg.exclusive_topology and cfg.workload != "jobset":
            raise ValueError("kubernetes.exclusive_topology: exclusive placement is JobSet's; set workload: jobset")
        if len(cfg.volume_mounts) and not (cfg.volumes or cfg.host_paths):
            raise ValueError("kubernetes.volume_mounts: mounts name volumes, but kubernetes.volumes lists none")
        _host_paths(cfg.host_paths)  # raises on a bad entry

    def probe(self) -> None:
        """The API server's ``/version`` answers, else a GangError naming the server."""
        cfg = self.config
        kube = connect(cfg.kubeconfig, cfg.context, site=self.site)
        from kubernetes import client

        try:
            client.VersionApi(kube.api).get_code(_request_timeout=PROBE_S)
        except Exception as exc:
            why = api_error(exc) if type(exc).__name__ == "ApiException" else root_cause(exc)
            raise GangError(
                f"site {self.site!r} (kubernetes): the API server {kube.api.configuration.host} does not answer: {why}"
            ) from None

    def launcher(
        self, ranks: int, *, slots: Sequence[int] = (), config: KubernetesConfig | None = None, echo: Echo = False
    ) -> KubernetesLauncher:
        """A launcher for one gang; ``slots`` are not used (the scheduler places pods)."""
        cfg = self.effective_config(config)
        self.check(ranks, cfg)
        paths = _host_paths(cfg.host_paths)
        memory = f"{max(1, self.rank_memory >> 20)}Mi" if self.rank_memory else None
        launcher = KubernetesLauncher(
            lambda: connect(cfg.kubeconfig, cfg.context, site=self.site),
            cfg,
            site=self.site,
            echo=echo,
            gang_api=lambda kube: gang_api(kube, cfg, self.site),
            host_mounts=lambda env: host_mounts(paths, env),
            workdir=os.getcwd() if any(p == "auto" for p, _ in paths) else None,
            memory=memory,
        )
        launcher.allocation_hook = self.hook
        return launcher


def gang_api(kube: Kube, cfg: KubernetesConfig, site: str) -> str | None:
    """The PodGroup apiVersion a gang is created with under ``cfg.gang`` (None: no PodGroup)."""
    if cfg.gang in ("none", "kueue"):
        return None  # kueue: the Job's queue-name label, no PodGroup
    if cfg.gang == "volcano":
        api = kube.pod_group_api(M.VOLCANO_GROUP)
        if api is None:
            raise GangError(
                f"site {site!r} (kubernetes): gang: volcano, but the cluster serves no "
                f"{M.VOLCANO_GROUP} PodGroup API (is Volcano installed?)"
            )
        return api
    api = kube.pod_group_api(M.NATIVE_GROUP)
    if api is None and cfg.gang == "native":
        raise GangError(
            f"site {site!r} (kubernetes): gang: native, but the API server serves no "
            f"{M.NATIVE_GROUP} PodGroup (Kubernetes ≥ 1.36 with the GenericWorkload and GangScheduling "
            "feature gates); use gang: auto to run without one"
        )
    return api


def _host_paths(entries: Any) -> list[tuple[str, bool]]:
    """The section's ``host_paths`` as (path or "auto", read_only): ``/usr:ro``, ``/data``."""
    if entries == "auto":
        entries = ["auto"]
    out = []
    for entry in entries:
        path, _, mode = str(entry).partition(":")
        if mode not in ("", "ro", "rw"):
            raise ValueError(f"kubernetes.host_paths: {entry!r}: the mode after ':' is ro or rw")
        if path != "auto" and not os.path.isabs(path):
            raise ValueError(f"kubernetes.host_paths: {entry!r} is not an absolute path (or 'auto')")
        out.append((path, mode == "ro"))
    return out


def host_mounts(paths: list[tuple[str, bool]], env: Mapping[str, str]) -> list[tuple[str, bool]]:
    """hostPath mounts of a gang: the listed ones, and for ``auto`` the driver's Python (its
    prefixes, sys.path, working directory: read-only) and what the gang writes (the store's
    root, spill and metadata directories, a file rendezvous: read-write).  Nested paths of the
    same mode are mounted once, under their outermost directory."""
    mounts: dict[str, bool] = {}
    for path, ro in paths:
        if path != "auto":
            mounts[os.path.realpath(path)] = ro
            continue
        # the interpreter, where phalanx itself is imported from (an editable install's source
        # tree is on no sys.path entry), the driver's sys.path and working directory
        source = str(Path(__file__).resolve().parents[3])
        for p in (sys.prefix, sys.base_prefix, source, os.getcwd(), *sys.path):
            if p and os.path.isdir(p):
                mounts.setdefault(os.path.realpath(p), True)
        for written in _written_dirs(env):
            mounts[written] = False
    out: list[tuple[str, bool]] = []
    for path in sorted(mounts, key=len):
        ro = mounts[path]
        if any(path.startswith(kept.rstrip("/") + "/") and (kept_ro == ro or not kept_ro) for kept, kept_ro in out):
            continue
        out.append((path, ro))
    return out


def _written_dirs(env: Mapping[str, str]) -> list[str]:
    """Directories of this host the ranks write to, from the gang's environment."""
    found = []
    for key in (ENV_STORE, ENV_SPILL):
        value = env.get(key, "")
        if value and "://" not in value:
            found.append(value)
    for key in (ENV_STORE_METADATA, P.ENV_RDZV):
        url = urlparse(env.get(key, ""))
        if url.scheme in ("sqlite", "file") and url.path:
            found.append(str(Path(url.path).parent))
    return [os.path.realpath(p) for p in found if os.path.isdir(p)]


__all__ = ["KubernetesExecutor", "gang_api", "host_mounts"]
