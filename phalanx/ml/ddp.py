"""``px.ml.ddp``: DistributedDataParallel over the gang's Gloo process group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from ..runtime.env import BSPEnv


def ddp(env: "BSPEnv", model: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """Wrap ``model`` in ``DistributedDataParallel`` on the gang's Gloo group (collective).

    Every rank calls it with the same architecture; DDP copies rank 0's parameters and buffers
    to the others, and ``backward()`` averages the gradients over the ranks.  ``kwargs`` go to
    ``DistributedDataParallel`` (``device_ids`` defaults to None: CPU, or one device per rank
    chosen by where the model lives; ``process_group`` to the gang's group).
    """
    if not all(hasattr(env, a) for a in ("rank", "world_size", "comm")):
        raise RuntimeError(
            f"px.ml.ddp needs the env of a gang rank (the first argument of an app run by "
            f"gang.run), got {type(env).__name__}: DDP runs inside a px.Gang, not in the driver")
    comm_name = getattr(env.comm, "name", type(env.comm).__name__)
    if comm_name not in ("gloo", "shm"):  # shm's control plane is Gloo's process group
        raise RuntimeError(
            f"px.ml.ddp needs a gang with the gloo communicator (it reuses its torch.distributed "
            f"process group); this gang uses {comm_name!r}: start it with "
            f"px.Gang(..., communicator='gloo')")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("px.ml.ddp: torch.distributed's default process group is not initialised "
                           "in this process; call it inside an app run by a gloo gang")
    backend = dist.get_backend()
    if backend != "gloo":
        raise RuntimeError(f"px.ml.ddp: the default process group uses {backend!r}, expected 'gloo'")
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise RuntimeError(
            f"px.ml.ddp: torch.distributed is rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"the gang says rank {env.rank} of {env.world_size}")
    if isinstance(model, DistributedDataParallel):
        raise TypeError("px.ml.ddp: the model is already wrapped in DistributedDataParallel")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"px.ml.ddp wraps a torch.nn.Module, got {type(model).__name__}")
    kwargs.setdefault("device_ids", None)
    kwargs.setdefault("process_group", getattr(env.comm, "group", None) or dist.group.WORLD)
    return DistributedDataParallel(model, **kwargs)
