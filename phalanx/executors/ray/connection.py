"""This process's connection to a Ray cluster (Ray allows one per process).

Made by the first gang (or ``RayExecutor.open_run``) that needs it and kept until the process
exits: a run's close never ends it, since another run or ``px.Gang`` of the process may use
it.  The rank actors and placement groups are what a run owns, and it frees them itself.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ...errors import GangError
from ...extras import require
from .network import is_loopback

# two gangs starting at once must not both call ray.init; a temporary connection (release)
# must not be shut down under a gang that found it open
_connect_lock = threading.RLock()


def import_ray():
    """``import ray``, or an error naming the extra to install."""
    return require("ray", "ray", "executor 'ray'")


def connected():
    """The ray module when this process is connected to a cluster, else None (Ray not
    imported, or not initialised: nothing is started to find out)."""
    ray = sys.modules.get("ray")
    try:
        return ray if ray is not None and ray.is_initialized() else None
    except Exception:  # a half-imported or shut-down Ray
        return None


def connect(
    address: str = "auto", namespace: str | None = "phalanx", init: Mapping[str, Any] | None = None, site: str = "ray"
):
    """The ray module, connected: ``ray.init(address=...)`` unless this process already is
    (then that connection serves, whatever ``address`` says: Ray has one per process)."""
    ray = import_ray()
    with _connect_lock:
        if ray.is_initialized():
            return ray
        kwargs: dict[str, Any] = {
            "address": address,
            "log_to_driver": False,
            "logging_level": logging.WARNING,
            **(init or {}),
        }
        if namespace:
            kwargs.setdefault("namespace", namespace)
        target = (os.environ.get("RAY_ADDRESS") if address in (None, "auto") else address) or ""
        if not target.startswith("ray://") and is_loopback(target.rpartition(":")[0]):
            keep_ray_on_loopback()
        for attempt in range(1, CLIENT_ATTEMPTS + 1):
            try:
                ray.init(**kwargs)
                break
            except Exception as exc:
                if attempt < CLIENT_ATTEMPTS and client_server_failed(exc):
                    logging.getLogger("phalanx").warning(
                        "site %r (ray): the Ray client server at %s failed to start this client's "
                        "server (attempt %d of %d); trying again",
                        site, address, attempt, CLIENT_ATTEMPTS,
                    )  # fmt: skip
                    time.sleep(attempt)
                    continue
                raise GangError(f"site {site!r} (ray): cannot connect to Ray at {address!r}: {exc}") from exc
    return ray


# A ray:// connection makes the head start a server process for this client; under load that
# start can fail once ("Starting Ray client server failed", seen in CI's multihost lane) where
# the next succeeds: the connection is tried again, a failure of any other kind is not.
CLIENT_ATTEMPTS = 3


def client_server_failed(exc: BaseException) -> bool:
    """Whether ``ray.init`` failed because the head's client server could not start a server
    for this client (a transient failure: worth another attempt)."""
    return isinstance(exc, ConnectionAbortedError) and "Starting Ray client server failed" in str(exc)


@contextmanager
def connection_to(address: str, namespace: str | None, site: str = "ray") -> Iterator[Any]:
    """The ray module connected to ``address`` for the block: this process's connection when
    it has one (``GangError`` if to another cluster), else one made for the block and shut
    down after it; other threads wanting a connection wait meanwhile."""
    ray = import_ray()
    with _connect_lock:
        ours = not ray.is_initialized()
        if ours:
            connect(address, namespace, site=site)
        elif ray.get_runtime_context().gcs_address != address:
            raise GangError(
                f"ray: this process is connected to the Ray cluster at "
                f"{ray.get_runtime_context().gcs_address}, not {address}"
            )
        try:
            yield ray
        finally:
            if ours:
                ray.shutdown()


def keep_ray_on_loopback() -> None:
    """Connecting to a cluster on loopback (started with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as
    the tests do): without this Ray rewrites 127.0.0.1 in the address to this host's routable
    IP, where nothing listens, and ``ray.init`` hangs.  Ray reads the variable once, at import,
    into a constant that only ``services.get_node_ip_address`` uses: set both."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    consts = sys.modules.get("ray._private.ray_constants")
    if consts is not None and hasattr(consts, "ENABLE_RAY_CLUSTER"):
        consts.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]  # a deliberate patch of Ray's constant (a module as ModuleType)
