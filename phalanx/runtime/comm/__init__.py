"""Communicators: pick one by name (``gloo``, ``shm``, ``mpi``, ``ucx``) through ``communicators``."""

from ..._registry import Registry
from .base import Communicator

communicators = Registry("communicator", group="phalanx.communicators")
communicators.register("gloo", "phalanx.runtime.comm.gloo:GlooCommunicator")
communicators.register("shm", "phalanx.runtime.comm.shm:ShmCommunicator")
communicators.register("mpi", "phalanx.runtime.comm.mpi:MPICommunicator", extra="mpi")
communicators.register("ucx", "phalanx.runtime.comm.ucx:UCXCommunicator", extra="ucx")

__all__ = ["Communicator", "communicators"]
