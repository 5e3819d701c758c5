"""Communicators: pick one by name (``gloo``, ``mpi``) through ``communicators``."""

from ..._registry import Registry
from .base import Communicator

communicators = Registry("communicator", group="phalanx.communicators")
communicators.register("gloo", "phalanx.runtime.comm.gloo:GlooCommunicator")
communicators.register("mpi", "phalanx.runtime.comm.mpi:MPICommunicator", extra="mpi")

__all__ = ["Communicator", "communicators"]
