"""This process's connection to a Kubernetes API server (the official ``kubernetes`` client), and
what the server offers for gang scheduling."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from ...errors import GangError
from ...extras import require

_cache: dict[tuple[str | None, str | None], Kube] = {}
_lock = threading.Lock()


def _module():
    return require("kubernetes", "kubernetes", "executor 'kubernetes'")


@dataclass
class Kube:
    """The APIs of one cluster (kubeconfig + context)."""

    api: Any  # kubernetes.client.ApiClient
    core: Any  # CoreV1Api
    batch: Any  # BatchV1Api
    custom: Any  # CustomObjectsApi
    kubeconfig: str | None
    context: str | None
    _apis: dict[str, str | None] = field(default_factory=dict)  # group → its PodGroup API (discovered once)

    def pod_group_versions(self) -> dict[str, list[str]]:
        """API group → versions the server serves, preferred first (one discovery call)."""
        from kubernetes import client

        out: dict[str, list[str]] = {}
        for group in client.ApisApi(self.api).get_api_versions().groups:
            preferred = group.preferred_version.version if group.preferred_version else None
            out[group.name] = sorted((v.version for v in group.versions), key=lambda v: v != preferred)
        return out

    def serves(self, group: str, version: str, plural: str) -> bool:
        try:
            found = self.custom.get_api_resources(group, version)
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return False
            raise
        return any(r.name == plural for r in (found.resources or []))

    def pod_group_api(self, group: str) -> str | None:
        """``group/version`` of the preferred PodGroup API of ``group`` the server serves (asked
        once per client)."""
        if group not in self._apis:
            self._apis[group] = next(
                (
                    f"{group}/{v}"
                    for v in self.pod_group_versions().get(group, [])
                    if self.serves(group, v, "podgroups")
                ),
                None,
            )
        return self._apis[group]


def expand(path: str | None) -> str | None:
    return os.path.expandvars(os.path.expanduser(path)) if path else None


def connect(kubeconfig: str | None = None, context: str | None = None, site: str = "kubernetes") -> Kube:
    """The APIs of the cluster a kubeconfig (default: KUBECONFIG, ~/.kube/config, else the
    in-cluster service account) and context name; one client per (file, context) per process."""
    kubeconfig = expand(kubeconfig)
    key = (kubeconfig, context)
    with _lock:
        if key in _cache:
            return _cache[key]
        k8s = _module()
        from kubernetes import client, config

        try:
            if (
                kubeconfig
                or os.environ.get("KUBECONFIG")
                or os.path.exists(os.path.expanduser("~/.kube/config"))
                or context
            ):
                api = config.new_client_from_config(config_file=kubeconfig, context=context)
            else:
                config.load_incluster_config()
                api = client.ApiClient()
        except Exception as exc:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config or in-cluster"
            raise GangError(
                f"site {site!r} (kubernetes): cannot load the cluster's credentials from {where}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        del k8s
        kube = Kube(
            api=api,
            core=client.CoreV1Api(api),
            batch=client.BatchV1Api(api),
            custom=client.CustomObjectsApi(api),
            kubeconfig=kubeconfig,
            context=context,
        )
        _cache[key] = kube
        return kube


def api_error(exc: BaseException) -> str:
    """A client error in the server's words (its Status message), not the whole HTTP dump."""
    body = getattr(exc, "body", None)
    if body:
        try:
            import json

            status = json.loads(body)
            return f"{status.get('reason') or getattr(exc, 'reason', '')}: {status.get('message', body)}"
        except (ValueError, AttributeError):
            pass
    status = getattr(exc, "status", None)
    return f"HTTP {status} {getattr(exc, 'reason', '')}".strip() if status else f"{type(exc).__name__}: {exc}"


__all__ = ["Kube", "api_error", "connect", "expand"]
