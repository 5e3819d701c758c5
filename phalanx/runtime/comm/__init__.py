"""Communicators: pick one by name (``gloo``, ``tcp``, ``shm``, ``mpi``, ``ucx``) through ``communicators``."""

from ..._registry import Registry
from .base import Communicator

communicators = Registry("communicator", group="phalanx.communicators")
communicators.register("gloo", "phalanx.runtime.comm.gloo:GlooCommunicator", extra="torch")
communicators.register("tcp", "phalanx.runtime.comm.tcp:TCPCommunicator")
communicators.register("shm", "phalanx.runtime.comm.tcp_shm:ShmCommunicator")
communicators.register("mpi", "phalanx.runtime.comm.mpi:MPICommunicator", extra="mpi")
communicators.register("ucx", "phalanx.runtime.comm.ucx:UCXCommunicator", extra="ucx")

__all__ = ["Communicator", "communicators"]
