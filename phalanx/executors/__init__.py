"""Gang backends behind one interface (``base.Launcher``), picked by name."""

from .._registry import Registry
from .base import Launcher

executors = Registry("executor")
executors.register("local", "phalanx.executors.local:LocalLauncher")
executors.register("mpirun", "phalanx.executors.mpirun:MPIRunLauncher")

__all__ = ["Launcher", "executors"]
