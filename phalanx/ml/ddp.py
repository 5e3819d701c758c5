"""``px.ml.ddp``: DistributedDataParallel over a Gloo process group of the gang's ranks.

A ``gloo`` gang has one already (its communicator is torch's default group).  Any other gang
(``tcp``, ``shm``, ``mpi``, ``ucx``: no torch until now) gets one on first use: rank 0 reserves a
port on the address its communicator listens on, the gang's communicator tells every rank, and
each joins torch's default group through a TCPStore there (one collective, ~1–3 s, mostly
importing torch — paid by training stages only, not by every dataframe rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from ..runtime.env import BSPEnv


def ddp(env: BSPEnv, model: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """Wrap ``model`` in ``DistributedDataParallel`` on the gang's Gloo group (collective).

    Every rank calls it with the same architecture; DDP copies rank 0's parameters and buffers
    to the others, and ``backward()`` averages the gradients over the ranks.  ``kwargs`` go to
    ``DistributedDataParallel`` (``device_ids`` defaults to None: CPU, or one device per rank
    chosen by where the model lives; ``process_group`` to the gang's group).
    """
    if not all(hasattr(env, a) for a in ("rank", "world_size", "comm")):
        raise RuntimeError(
            f"px.ml.ddp needs the env of a gang rank (the first argument of an app run by "
            f"gang.run), got {type(env).__name__}: DDP runs inside a px.Gang, not in the driver"
        )
    if isinstance(model, DistributedDataParallel):
        raise TypeError("px.ml.ddp: the model is already wrapped in DistributedDataParallel")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"px.ml.ddp wraps a torch.nn.Module, got {type(model).__name__}")
    _gloo_group(env)
    kwargs.setdefault("device_ids", None)
    kwargs.setdefault("process_group", getattr(env.comm, "group", None) or dist.group.WORLD)
    return DistributedDataParallel(model, **kwargs)


def _gloo_group(env: BSPEnv) -> None:
    """Make sure torch's default process group is a Gloo group of exactly the gang's ranks."""
    if not dist.is_available():
        raise RuntimeError("px.ml.ddp: this torch build has no torch.distributed")
    if not dist.is_initialized():
        if getattr(env.comm, "name", None) == "gloo":
            raise RuntimeError(
                "px.ml.ddp: torch.distributed's default process group is not initialised "
                "in this process, yet the gang's communicator is gloo"
            )
        _join_group(env)
    backend = dist.get_backend()
    if backend != "gloo":
        raise RuntimeError(f"px.ml.ddp: the default process group uses {backend!r}, expected 'gloo'")
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise RuntimeError(
            f"px.ml.ddp: torch.distributed is rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"the gang says rank {env.rank} of {env.world_size}"
        )


def _join_group(env: BSPEnv) -> None:
    import datetime
    import os

    from ..runtime import protocol as P
    from ..runtime.netio import bind_host
    from ..runtime.rendezvous import TCPRendezvous, reserve_port

    timeout_s = float(os.environ.get(P.ENV_TIMEOUT, "1800"))
    reservation: list = []

    def reserve() -> str:  # on rank 0; a failure there is the same error on every rank
        host = bind_host(os.environ.get(P.ENV_RDZV, ""))
        sock = reserve_port(host)
        if sock is None:
            raise RuntimeError(f"px.ml.ddp: rank 0 cannot bind a port on {host} for torch's process group")
        reservation.append(sock)
        return f"tcp://{host}:{sock.getsockname()[1]}"

    try:
        url = env.comm.on_root(reserve)
        store = TCPRendezvous.connect(url, env.rank, env.world_size, timeout_s)
    finally:
        for sock in reservation:
            sock.close()
    dist.init_process_group(
        "gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
