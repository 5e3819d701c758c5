"""``px.ml.ddp``: DistributedDataParallel over the gang's ranks: NCCL when every rank has a GPU, else Gloo.

A ``gloo`` gang has one already (its communicator is torch's default group).  Any other gang
(``tcp``, ``shm``, ``mpi``, ``ucx``: no torch until now) gets one on first use: rank 0 reserves a
port on the address its communicator listens on, the gang's communicator tells every rank, and
each joins torch's default group through a TCPStore there (one collective, ~1–3 s, mostly
importing torch — paid by training stages only, not by every dataframe rank).

The gradient all-reduce uses NCCL when every rank has a GPU (``cuda:0`` of its
``CUDA_VISIBLE_DEVICES``), each a different one: the ranks allgather their device over the
gang's communicator first, so all take the same decision (:func:`choose_backend`), and the NCCL
group is made with ``dist.new_group`` on the same rendezvous store as the Gloo one.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

if TYPE_CHECKING:
    from ..runtime.env import BSPEnv


@dataclass(frozen=True)
class RankDevice:
    """Where one rank trains: ``device`` is ``"cuda:0"`` or ``"cpu"``; ``gpu`` identifies the
    physical GPU (its UUID, else CUDA_VISIBLE_DEVICES) so that two ranks on one GPU are seen."""

    rank: int
    host: str
    device: str
    gpu: str = ""


def choose_backend(devices: Sequence[RankDevice]) -> tuple[str, str]:
    """``(backend, why)`` for the gradient all-reduce, from every rank's device (pure: the
    same list on every rank gives the same answer).  NCCL only when every rank has a GPU and
    no two ranks of one host share one (NCCL refuses that); Gloo otherwise."""
    if not devices:
        return "gloo", "no ranks"
    cpu = [d.rank for d in devices if not d.device.startswith("cuda")]
    if cpu:
        return "gloo", f"rank(s) {', '.join(map(str, cpu))} have no GPU"
    seen: dict[tuple[str, str], int] = {}
    for d in devices:
        key = (d.host, d.gpu)
        if d.gpu and key in seen:
            return "gloo", f"ranks {seen[key]} and {d.rank} share GPU {d.gpu} on {d.host}"
        seen.setdefault(key, d.rank)
    return "nccl", f"every rank has a GPU ({len(devices)})"


def rank_device() -> torch.device:
    """This rank's device: ``cuda:0`` (the first of its CUDA_VISIBLE_DEVICES) when CUDA is
    available, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _describe(env: BSPEnv, device: torch.device) -> RankDevice:
    from ..runtime.protocol import rank_host

    gpu = ""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = str(getattr(props, "uuid", "") or os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0])
    return RankDevice(env.rank, rank_host(), str(device), gpu)


def timeout_s() -> float:
    """The timeout of the process groups (Gloo and NCCL): the gang's, PHALANX_TIMEOUT, 1800 s."""
    from ..runtime import protocol as P

    return float(os.environ.get(P.ENV_TIMEOUT, "1800"))


_NCCL: dict[tuple[int, int], Any] = {}  # (rank, world) → this process's NCCL group, made once


def ddp(env: BSPEnv, model: torch.nn.Module, **kwargs: Any) -> DistributedDataParallel:
    """Wrap ``model`` in ``DistributedDataParallel`` over the gang's ranks (collective).

    The model is moved to the rank's device (:func:`rank_device`); the all-reduce uses NCCL
    when every rank has its own GPU, the gang's Gloo group otherwise (:func:`choose_backend`;
    the choice is in ``model.px_backend``).  Every rank calls it with the same architecture;
    DDP copies rank 0's parameters and buffers to the others, and ``backward()`` averages the
    gradients over the ranks.  ``kwargs`` go to ``DistributedDataParallel`` (``device_ids``
    defaults to ``[0]`` on a GPU, None on the CPU; ``process_group`` to the chosen group).
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
    device = rank_device()
    devices = env.comm.allgather_obj(_describe(env, device))
    backend, why = choose_backend(devices)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        model = model.to(device)
    if backend == "nccl":
        key = (env.rank, env.world_size)
        if key not in _NCCL:  # every rank makes it in the same call: new_group is collective
            _NCCL[key] = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=timeout_s()))
        group = _NCCL[key]
    else:
        group = getattr(env.comm, "group", None) or dist.group.WORLD
    kwargs.setdefault("device_ids", [device.index] if device.type == "cuda" else None)
    kwargs.setdefault("process_group", group)
    wrapped = DistributedDataParallel(model, **kwargs)
    # (object.__setattr__: plain attributes, not registered as submodules or parameters)
    object.__setattr__(wrapped, "px_backend", backend)
    object.__setattr__(wrapped, "px_backend_reason", why)
    object.__setattr__(wrapped, "px_device", device)
    return wrapped


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
    from ..runtime import protocol as P
    from ..runtime.netio import bind_host
    from ..runtime.rendezvous import TCPRendezvous, reserve_port

    timeout = timeout_s()
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
        store = TCPRendezvous.connect(url, env.rank, env.world_size, timeout)
    finally:
        for sock in reservation:
            sock.close()
    dist.init_process_group(
        "gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=datetime.timedelta(seconds=timeout)
    )
