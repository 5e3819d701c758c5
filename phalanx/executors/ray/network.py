"""Can the ranks reach the driver and each other?  Ranks connect to the driver's control
address (the site's ``driver_host``) and rank 0 hosts the TCP rendezvous.

The default 127.0.0.1 is enough when every raylet runs on the driver's host
(``ray.cluster_utils``, the tests).  Ranks placed on another host while the driver listens on
loopback only are refused with a clear error; a loopback ``tcp://`` rendezvous is moved to a
free port of rank 0's node.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

from ...errors import GangError
from ...runtime import protocol as P
from ..network import is_loopback


def reachable_env(
    rank_env: list[dict[str, str]],
    nodes: Sequence[dict[str, Any]],
    *,
    free_port: Callable[[str], int],
    driver_ip: Callable[[], str],
    site: str = "ray",
    here: str | None = None,
) -> list[dict[str, str]]:
    """``rank_env`` for ranks placed on ``nodes`` (per rank: ``host``, ``node_ip``): a
    ``GangError`` when some are on another host than ``here`` (this one) but the driver listens
    on loopback; a loopback TCP rendezvous moved to ``tcp://<rank 0's node>:<free_port(ip)>``
    when rank 0 runs elsewhere.  ``driver_ip``: the driver's address as Ray sees it (for the
    error's hint)."""
    here = here or socket.gethostname()
    elsewhere = sorted({nd["node_ip"] for nd in nodes if nd["host"] != here})
    control_host = rank_env[0].get(P.ENV_CONTROL, "").rpartition(":")[0] if rank_env else ""
    if elsewhere and is_loopback(control_host):
        raise GangError(
            f"site {site!r} (ray): ranks were placed on other hosts ({', '.join(elsewhere)}) but the driver "
            f"listens on {control_host} only; set the site's driver_host (auto, or an address they reach, "
            f"e.g. this driver's Ray node IP {driver_ip()})"
        )
    url = urlparse(rank_env[0].get(P.ENV_RDZV, "")) if rank_env else None
    rank0 = nodes[0] if nodes else None
    if url and url.scheme == "tcp" and is_loopback(url.hostname) and rank0 and rank0["host"] != here:
        new = f"tcp://{rank0['node_ip']}:{free_port(rank0['node_ip'])}"
        rank_env = [{**env, P.ENV_RDZV: new} for env in rank_env]
    return rank_env
